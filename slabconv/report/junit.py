"""Machine-readable renderings of a report: JUnit XML for CI systems.

One ``<testcase>`` per numeric check (each output under each runtime setting, e.g. ``output @
onnxruntime[all-optimizations]``), per integrity check (``onnx.checker[full_check] model.onnx``), per written
file no runtime could run (a ``<skipped>`` case naming why), and for ``fuse`` one per norm (``fold: NORM``). A
failing check is a ``<failure>`` whose message says what was measured, the tolerance it would have needed and the
first diverging fold (the localisation). The layout is the common subset that GitHub Actions test reporters, GitLab,
Jenkins and Azure Pipelines read: ``testsuites > testsuite > testcase > failure``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from slabconv.errors import UsageError
from slabconv.report.data import Report
from slabconv.text import shown
from slabconv.verify.results import Case
from slabconv.write.output_checks import holds_mark
from slabconv.write.staging import check_output_file, staging_file


def check_report_path(path: Path, inputs: Iterable[Path]) -> None:
    """Check before the work that ``--junit PATH`` may be written: not an input, not a folder or a link, a name
    ending in ``.xml``, and if it exists, a JUnit report slabconv wrote (a rerun replaces its own report, never
    another file).

    Raises:
        UsageError: naming the path and what is there.
    """
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"--junit {path} is a folder; give a file path such as {path / 'equivalence.xml'}")
    try:  # a FIFO, socket or device is refused there at once, as for --plot and --onnx
        check_output_file(path, force=True, inputs=list(inputs), owned=junit_written_by_slabconv)
    except UsageError as err:
        raise UsageError(f"--junit {err}") from None
    if path.suffix.lower() != ".xml":
        raise UsageError(
            f"--junit {path}: a JUnit report is XML; give a file name ending in .xml, e.g. equivalence.xml"
        )


def junit_written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is a regular JUnit XML file that slabconv wrote (its root is
    ``<testsuites name="slabconv">``, in its first 4 KiB)."""
    return holds_mark(path, b'<testsuites name="slabconv"', 4096)


def fold_cases(report: Report, require_folded: bool = False) -> list[Case]:
    """One case per norm of a ``fuse`` report: ``fold: NORM``, passed when it folded away; a kept norm (held as a
    per-channel affine, equivalent) passes too, unless ``require_folded`` (``--require-folded``) asks for a
    norm-free model."""
    cases = []
    for d in report.folds or []:
        folded = d.action.startswith("folded")
        if folded:
            measured = f"{d.kind} {d.action} into {', '.join(d.into)}"
        else:
            before = f" (before {', '.join(d.kept_on)})" if d.kept_on else ""
            measured = f"{d.kind} {d.action}: {d.reason}{before}"
        ok = folded or not require_folded
        message = "" if ok else f"{d.norm} is kept ({d.reason}); --require-folded needs every norm folded away"
        cases.append(Case(f"fold: {d.norm}", ok, measured, message))
    return cases


def junit_tree(report: Report, require_folded: bool = False) -> ET.ElementTree:
    """The JUnit XML tree of a report. ``fuse`` (with ``--junit``): a ``slabconv.folds`` suite, one ``<testcase>``
    per norm (``fold_cases``). ``fuse`` and ``verify``: a ``slabconv.verify`` suite, one ``<testcase>`` per check
    that ran (``Verification.cases``: question 1, the file checks, question 2, greedy generation and the task
    metrics per runtime, the int8 checks), so the failure count is zero exactly when the report passed; ``time`` is
    how long the run took, shared out per case."""
    v = report.verification
    candidate = (report.candidate.path if report.candidate else None) or report.out_dir or "candidate"
    suites: list[tuple[str, list[Case], float]] = []
    if report.command == "fuse":
        suites.append(("slabconv.folds", fold_cases(report, require_folded), 0.0))
    if v is not None:
        suites.append(("slabconv.verify", v.cases(), v.seconds))  # the same verdicts as v.passed
    tests = sum(len(cases) for _, cases, _ in suites)
    failures = sum(not case.passed for _, cases, _ in suites for case in cases)
    root = ET.Element("testsuites", name="slabconv", tests=str(tests), failures=str(failures))
    for name, cases, seconds in suites:
        classname = name + "." + Path(str(candidate)).name.replace(".", "_")
        suite = ET.SubElement(
            root,
            "testsuite",
            name=name,
            tests=str(len(cases)),
            failures=str(sum(not case.passed for case in cases)),
            errors="0",
            skipped=str(sum(case.skipped for case in cases)),
            time=f"{seconds:.3f}",
        )
        props = ET.SubElement(suite, "properties")
        facts: list[tuple[str, object]] = [("slabconv_version", report.slabconv_version), ("candidate", candidate)]
        if name == "slabconv.folds":
            facts += [("source", report.source.path if report.source else ""), ("require_folded", require_folded)]
        elif v is not None:
            facts += [
                ("reference", report.reference.path if report.reference else ""),
                ("inputs", v.inputs),
                ("runtime", v.runtime),
                *(("note", note) for note in v.notes),
            ]
            if v.localization is not None:
                facts.append(("localization", v.localization.detail))
        for key, value in facts:
            ET.SubElement(props, "property", name=key, value=str(value))
        each = f"{seconds / max(len(cases), 1):.3f}"
        kind = "NotFolded" if name == "slabconv.folds" else "NotEquivalent"
        for case in cases:
            element = ET.SubElement(suite, "testcase", classname=classname, name=case.name, time=each)
            ET.SubElement(element, "system-out").text = case.measured
            if not case.passed:
                ET.SubElement(element, "failure", type=kind, message=case.message).text = case.measured
            elif case.skipped:
                ET.SubElement(element, "skipped", message=case.message)
    return ET.ElementTree(root)


def write_junit(report: Report, path: Path, require_folded: bool = False) -> None:
    """Write the JUnit XML of ``report`` (``junit_tree``) to ``path`` atomically: into a marked staging folder beside
    it (``slabconv.write.staging.staging_file``), then one rename.

    Raises:
        UsageError: the folder of ``path`` cannot be written.
    """
    path = Path(path)
    tree = junit_tree(report, require_folded)
    ET.indent(tree)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write the JUnit report {shown(path)}: {err.strerror or err}") from None
    with staging_file(path, force=True, owned=junit_written_by_slabconv) as tmp:
        with open(tmp / path.name, "wb") as f:
            tree.write(f, encoding="utf-8", xml_declaration=True)
