"""docs/report.schema.json is the report's contract: the fixtures' reports match it, and it rejects what it must.

(Every report the tests make is also checked against it as it is made: ``conftest.every_report_matches_the_schema``.)
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from jsonschema import Draft202012Validator

from tests.conftest import FIXTURE, REPORT_SCHEMA, ROOT, VALIDATED

VALIDATOR = Draft202012Validator(REPORT_SCHEMA)


@pytest.fixture(scope="module")
def fused_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("schema") / "out"
    command = [sys.executable, "-m", "slabconv", "fuse", str(FIXTURE / "checkpoint.pth"), "--out", str(out), "-q"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=600)
    return json.loads((out / "report.json").read_text())


def test_the_schema_is_a_valid_json_schema() -> None:
    Draft202012Validator.check_schema(REPORT_SCHEMA)


def test_a_report_json_written_by_the_console_script_matches(fused_report: dict) -> None:
    assert not list(VALIDATOR.iter_errors(fused_report))


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r.pop("source"),
        lambda r: r.update(undocumented=1),
        lambda r: r["folds"][0].update(action="folded-sideways"),
        lambda r: r["verification"]["checks"][0].update(tolerance_from="guess"),
        lambda r: r["verification"].pop("question_1_exact"),
        lambda r: r["outputs"]["sha256"].update({"model.onnx": "not a digest"}),
    ],
    ids=["no source", "extra field", "unknown action", "unknown bound", "no question 1", "bad digest"],
)
def test_the_schema_rejects_a_damaged_report(fused_report: dict, damage) -> None:
    report = copy.deepcopy(fused_report)
    damage(report)
    assert list(VALIDATOR.iter_errors(report))


def test_the_session_hook_checks_every_report_made(fixture_ckpt) -> None:
    """The session hook (conftest) is installed: a report that does not match the schema fails the test that made
    it, and one that does is counted. Every test that makes a report (in memory and streamed fuse, verify, inspect,
    export) goes through it, in whichever worker runs it."""
    from slabconv import api

    report = api.inspect(fixture_ckpt)
    before = len(VALIDATED)
    report.to_dict()
    assert len(VALIDATED) == before + 1 and VALIDATED[-1] == "inspect"
    bad = copy.deepcopy(report)
    bad.command = "no-such-command"
    with pytest.raises(AssertionError, match="does not match docs/report.schema.json"):
        bad.to_dict()
