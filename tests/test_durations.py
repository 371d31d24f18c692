"""The suite's file order: tests/durations.json, measured by scripts/test_durations.py, costliest file first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("test_durations_script", ROOT / "scripts" / "test_durations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_junit_report_sums_to_seconds_per_file(tmp_path: Path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_b" name="test_one" time="1.25"/>'
        '<testcase classname="tests.test_a.TestGroup" name="test_two" time="0.5"/>'
        '<testcase classname="tests.test_b" name="test_three" time="2.0"/>'
        '<testcase classname="tests.test_a" name="test_four" time="0.04"/>'
        "</testsuite></testsuites>"
    )
    costs = _script().file_costs(junit)
    assert costs == {"tests/test_b.py": 3.2, "tests/test_a.py": 0.5}  # 3.25 and 0.54, to 0.1 s
    assert list(costs) == ["tests/test_b.py", "tests/test_a.py"]


def test_this_session_collected_the_files_costliest_first(request: pytest.FixtureRequest):
    costs = json.loads((ROOT / "tests" / "durations.json").read_text())
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    new = [f for f in files if f not in costs]
    assert files[: len(new)] == new  # files the table does not know yet go first
    known = [costs[f] for f in files[len(new) :]]
    assert known == sorted(known, reverse=True)


def test_the_table_names_test_files_that_exist():
    costs = json.loads((ROOT / "tests" / "durations.json").read_text())
    missing = [name for name in costs if not (ROOT / name).is_file()]
    assert not missing, f"tests/durations.json names files that are gone: {missing}; run scripts/test_durations.py"
