"""Measure what each test file costs and write tests/durations.json, the table `make test` orders files by.

`make test` runs `pytest -n auto --dist loadfile --no-loadscope-reorder`: each test file is one unit of work, handed
to the next idle worker in the order collected, and tests/conftest.py collects the files costliest first (longest
processing time first), so that the run does not end with one worker on a long file while the other waits. A file
missing from the table (a new one) is collected first, as if it cost the most.

    python scripts/test_durations.py                 # runs the suite once (as make test does) and writes the table
    python scripts/test_durations.py --junit FILE    # the table from a run you made with --junitxml=FILE

A file's cost is the sum of its tests' times in the JUnit report (setup, call and teardown: a module-scoped
fixture's setup counts towards the file's first test), rounded to 0.1 s. Run it again when files are added or a
file's cost changes much; a stale table only changes the order, never what runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"


def file_costs(junit: Path) -> dict[str, float]:
    """Seconds per test file (``tests/test_x.py``) from a pytest JUnit XML report, costliest first.

    pytest names a test case's class ``tests.test_x`` or ``tests.test_x.TestClass``; the file is the dotted path up
    to its ``test_`` module."""
    costs: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if module is None:
            continue
        costs["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    return {name: round(seconds, 1) for name, seconds in costs.most_common()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="a pytest --junitxml report to read instead of running the suite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        junit = args.junit
        if junit is None:
            junit = Path(scratch) / "junit.xml"
            command = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile"]
            subprocess.run([*command, "-p", "no:cacheprovider", f"--junitxml={junit}"], cwd=ROOT, check=False)
        costs = file_costs(junit)
    if not costs:
        print(f"no test cases in {junit}", file=sys.stderr)
        return 1
    TABLE.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {len(costs)} files, {sum(costs.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
