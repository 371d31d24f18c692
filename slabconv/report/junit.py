"""Machine-readable renderings of a report: JUnit XML for CI systems.

One ``<testcase>`` per numeric check (each output under each runtime setting, e.g. ``output @
onnxruntime[all-optimizations]``), per integrity check (``onnx.checker[full_check] model.onnx``) and per written
file no runtime could run (a ``<skipped>`` case naming why). A failing check is a ``<failure>`` whose message
says what was measured, the tolerance it would have needed and the first diverging fold (the localisation). The
layout is the common subset that GitHub Actions test reporters, GitLab, Jenkins and Azure Pipelines read:
``testsuites > testsuite > testcase > failure``.
"""

from __future__ import annotations

import os
import stat
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from slabconv.errors import UsageError
from slabconv.report.data import Report
from slabconv.text import shown
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
        check_output_file(path, force=True, inputs=list(inputs), owned=written_by_slabconv)
    except UsageError as err:
        raise UsageError(f"--junit {err}") from None
    if path.suffix.lower() != ".xml":
        raise UsageError(
            f"--junit {path}: a JUnit report is XML; give a file name ending in .xml, e.g. equivalence.xml"
        )


def written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is a regular JUnit XML file that slabconv wrote (its root is
    ``<testsuites name="slabconv">``); a FIFO or device is never opened (opening a FIFO waits for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = f.read(4096)
    return b'<testsuites name="slabconv"' in head


def junit_tree(report: Report) -> ET.ElementTree:
    """The JUnit XML tree of a verification report: one ``<testcase>`` per check that ran
    (``Verification.cases``: question 1, the file checks, question 2, greedy generation per runtime), so the
    failure count is zero exactly when the report passed; ``time`` is how long the run took, shared out per case."""
    v = report.verification
    assert v is not None
    candidate = (report.candidate.path if report.candidate else None) or report.out_dir or "candidate"
    classname = "slabconv.verify." + Path(str(candidate)).name.replace(".", "_")
    cases = v.cases()  # the same verdicts as v.passed: the failure count and the exit code agree
    failures = sum(not case.passed for case in cases)
    skipped = sum(case.skipped for case in cases)
    seconds = f"{v.seconds / max(len(cases), 1):.3f}"
    root = ET.Element("testsuites", name="slabconv", tests=str(len(cases)), failures=str(failures))
    suite = ET.SubElement(
        root,
        "testsuite",
        name="slabconv.verify",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{v.seconds:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("slabconv_version", report.slabconv_version),
        ("reference", report.reference.path if report.reference else ""),
        ("candidate", str(candidate)),
        ("inputs", v.inputs),
        ("runtime", v.runtime),
    ):
        ET.SubElement(props, "property", name=key, value=str(value))
    for note in v.notes:
        ET.SubElement(props, "property", name="note", value=note)
    if v.localization is not None:
        ET.SubElement(props, "property", name="localization", value=v.localization.detail)
    for case in cases:
        element = ET.SubElement(suite, "testcase", classname=classname, name=case.name, time=seconds)
        ET.SubElement(element, "system-out").text = case.measured
        if not case.passed:
            ET.SubElement(element, "failure", type="NotEquivalent", message=case.message).text = case.measured
        elif case.skipped:
            ET.SubElement(element, "skipped", message=case.message)
    return ET.ElementTree(root)


def write_junit(report: Report, path: Path) -> None:
    """Write the JUnit XML of ``report`` to ``path`` atomically: into a marked staging folder beside it
    (``slabconv.write.staging.staging_file``), then one rename.

    Raises:
        UsageError: the folder of ``path`` cannot be written.
    """
    path = Path(path)
    tree = junit_tree(report)
    ET.indent(tree)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write the JUnit report {shown(path)}: {err.strerror or err}") from None
    with staging_file(path, force=True, owned=written_by_slabconv) as tmp:
        with open(tmp / path.name, "wb") as f:
            tree.write(f, encoding="utf-8", xml_declaration=True)
