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
from typing import Any

from slabconv.errors import UsageError
from slabconv.write.staging import check_output_file


def check_report_path(path: Path, inputs: Iterable[Path]) -> None:
    """Check before the work that ``--junit PATH`` may be written: not an input, not a folder or a link, and if it
    exists, a JUnit report slabconv wrote (a rerun replaces its own report, never another file).

    Raises:
        UsageError: naming the path and what is there.
    """
    try:
        check_output_file(path, force=True, inputs=list(inputs), owned=written_by_slabconv)
    except UsageError as err:
        raise UsageError(f"--junit {err}") from None


def written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is a JUnit XML file that slabconv wrote (its root is ``<testsuites name="slabconv">``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'<testsuites name="slabconv"' in head


def junit_tree(report: dict[str, Any]) -> ET.ElementTree:
    """The JUnit XML tree of a verification report (``{"candidate", "verification", ...}``)."""
    v = report["verification"]
    checks, integrity = v["checks"], v.get("integrity", [])
    candidate = report.get("candidate", {}).get("path") or report.get("out_dir") or "candidate"
    classname = "slabconv.verify." + Path(str(candidate)).name.replace(".", "_")
    failures = sum(not c["passed"] for c in checks) + sum(not i["passed"] for i in integrity)
    root = ET.Element("testsuites", name="slabconv", tests=str(len(checks) + len(integrity)), failures=str(failures))
    suite = ET.SubElement(
        root,
        "testsuite",
        name="slabconv.verify",
        tests=str(len(checks) + len(integrity)),
        failures=str(failures),
        errors="0",
        skipped="0",
    )
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("slabconv_version", report.get("slabconv_version", "")),
        ("reference", report.get("reference", {}).get("path", "")),
        ("candidate", str(candidate)),
        ("inputs", v.get("inputs", "")),
        ("runtime", v.get("runtime", "")),
    ):
        ET.SubElement(props, "property", name=key, value=str(value))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=classname, name=c["name"], time="0")
        top1 = "n/a" if c["top1_agreement"] is None else f"{c['top1_agreement']:.2%}"
        measured = (
            f"max_abs_err={c['max_abs_err']:.6g} max_rel_err={c['max_rel_err']:.6g} "
            f"mean_abs_err={c['mean_abs_err']:.6g} top1_agreement={top1} worst_sample={c['worst_sample']} "
            f"samples={c['samples']} rtol={c['tolerance']:g} atol={c['atol']:g}"
        )
        ET.SubElement(case, "system-out").text = measured
        if not c["passed"]:
            failure = ET.SubElement(
                case,
                "failure",
                type="NotEquivalent",
                message=(
                    f"max rel err {c['max_rel_err']:.3g} > tolerance {c['tolerance']:g} or top-1 agreement {top1} "
                    f"< 100%; it would have needed rtol >= {c['max_rel_err']:.3g} (worst sample {c['worst_sample']})"
                ),
            )
            failure.text = measured
    for i in integrity:
        case = ET.SubElement(suite, "testcase", classname=classname, name=i["name"], time="0")
        ET.SubElement(case, "system-out").text = i["detail"]
        if not i["passed"]:
            ET.SubElement(case, "failure", type="IntegrityCheckFailed", message=i["detail"]).text = i["detail"]
    return ET.ElementTree(root)


def write_junit(report: dict[str, Any], path: Path) -> None:
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
