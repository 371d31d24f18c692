"""Machine-readable renderings of a report: JUnit XML for CI systems.

One ``<testcase>`` per numeric check (each output under each runtime setting, e.g. ``output @
onnxruntime[all-optimizations]``) and per integrity check (``onnx.checker[full_check] model.onnx``,
``safetensors reload model.safetensors``). A failing check is a ``<failure>`` whose message says what was
measured and the tolerance it would have needed. The layout is the common subset that GitHub Actions test
reporters, GitLab, Jenkins and Azure Pipelines read: ``testsuites > testsuite > testcase > failure``.
"""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from slabconv.errors import UsageError
from slabconv.report.data import Report
from slabconv.write.staging import check_output_file


def check_report_path(path: Path, inputs: Iterable[Path]) -> None:
    """Check before the work that ``--junit PATH`` may be written: not an input, not a folder or a link, a name
    ending in ``.xml``, and if it exists, a JUnit report slabconv wrote (a rerun replaces its own report, never
    another file).

    Raises:
        UsageError: naming the path and what is there.
    """
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"--junit {path} is a folder; give a file path such as {path / 'equivalence.xml'}")
    try:
        check_output_file(path, force=True, inputs=list(inputs), owned=written_by_slabconv)
    except UsageError as err:
        raise UsageError(f"--junit {err}") from None
    if path.suffix.lower() != ".xml":
        raise UsageError(
            f"--junit {path}: a JUnit report is XML; give a file name ending in .xml, e.g. equivalence.xml"
        )


def written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is a JUnit XML file that slabconv wrote (its root is ``<testsuites name="slabconv">``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'<testsuites name="slabconv"' in head


def junit_tree(report: Report) -> ET.ElementTree:
    """The JUnit XML tree of a verification report: one ``<testcase>`` per check of question 1, per file check
    and per check of question 2; ``time`` is how long the run took, shared out per case."""
    v = report.verification
    assert v is not None
    candidate = (report.candidate.path if report.candidate else None) or report.out_dir or "candidate"
    classname = "slabconv.verify." + Path(str(candidate)).name.replace(".", "_")
    cases: list[tuple[str, bool, str, str]] = []  # name, passed, measured, failure message
    for e in v.exact:
        measured = f"method={e.method} error={e.error:.6g} bound={e.bound:g} worst={e.worst}"
        cases.append((f"question 1: {e.name}", e.passed, measured, e.failure()))
    for i in v.integrity:
        cases.append((f"file: {i.name}", i.passed, i.detail, i.failure()))
    for c in v.checks:
        top1 = "n/a" if c.top1_agreement is None else f"{c.top1_agreement:.2%}"
        measured = (
            f"e_fused={c.e_fused:.6g} e_orig={c.e_orig if c.e_orig is None else format(c.e_orig, '.6g')} "
            f"e_pair={c.e_pair:.6g} tolerance={c.tolerance:.6g} ({c.tolerance_from}) max_abs_err={c.max_abs_err:.6g} "
            f"top1_decisive={top1} decisive={c.decisive} near_ties={c.near_ties} samples={c.samples} "
            f"worst_sample={c.worst_sample} dtype={c.dtype} reference={c.reference}"
        )
        cases.append((f"question 2: {c.name}", c.passed, measured, c.failure()))
    failures = sum(not passed for _, passed, _, _ in cases)
    seconds = f"{v.seconds / max(len(cases), 1):.3f}"
    root = ET.Element("testsuites", name="slabconv", tests=str(len(cases)), failures=str(failures))
    suite = ET.SubElement(
        root,
        "testsuite",
        name="slabconv.verify",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped="0",
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
    for name, passed, measured, message in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=seconds)
        ET.SubElement(case, "system-out").text = measured
        if not passed:
            ET.SubElement(case, "failure", type="NotEquivalent", message=message).text = measured
    return ET.ElementTree(root)


def write_junit(report: Report, path: Path) -> None:
    """Write the JUnit XML of ``report`` to ``path`` atomically (a temporary file beside it, then a rename).

    Raises:
        UsageError: the folder of ``path`` cannot be written.
    """
    path = Path(path)
    tree = junit_tree(report)
    ET.indent(tree)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    except OSError as err:
        raise UsageError(f"cannot write the JUnit report {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            tree.write(f, encoding="utf-8", xml_declaration=True)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
