"""Machine-readable renderings of a report: JUnit XML for CI systems (one test case per check)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def write_junit(report: dict[str, Any], path: Path) -> None:
    """Write ``report['verification']['checks']`` as a JUnit XML test suite named ``slabconv.verify``.

    A failing check becomes a ``<failure>`` whose message gives the error and the tolerance it would have
    needed. Readable by GitHub Actions test reporters, GitLab, Jenkins.
    """
    checks = report["verification"]["checks"]
    failures = sum(not c["passed"] for c in checks)
    suite = ET.Element("testsuite", name="slabconv.verify", tests=str(len(checks)), failures=str(failures))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="slabconv.verify", name=c["name"])
        ET.SubElement(case, "system-out").text = (
            f"max_abs_err={c['max_abs_err']:.6g} max_rel_err={c['max_rel_err']:.6g} "
            f"top1_agreement={c['top1_agreement']} samples={c['samples']} tolerance={c['tolerance']:g}"
        )
        if not c["passed"]:
            ET.SubElement(case, "failure", message=(
                f"max rel err {c['max_rel_err']:.3g} > tolerance {c['tolerance']:g} or top-1 agreement "
                f"{c['top1_agreement']}; worst sample {c['worst_sample']}"
            ))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
