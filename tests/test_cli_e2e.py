"""The console script end to end on the real digits fixture (issue: the main job).

One real subprocess run of the Makefile's `make demo` command, stdout and stderr piped as in a CI log
(module-scoped, reused by the checks below), then: exit code, the files, the report's numbers, what it printed
(README's example, full names, one progress line per stage), zero BatchNormalization nodes, the norm-free op
histogram, the safetensors metadata, holdout accuracy of the fused ONNX; and a deliberately wrong fold (alpha
dropped) caught by `slabconv verify` with exit 1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from scripts import readme_example
from slabconv.cli import app
from slabconv.load.formats import load_checkpoint
from slabconv.util import sha256_file
from slabconv.write.onnx import export_onnx
from slabconv.zoo import get_arch
from tests.conftest import FIXTURE, op_histogram

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("captures_shared")]  # one trace a model: conftest.py


def _slabconv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slabconv", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("fuse") / "digits-fused"
    _, proc = readme_example.run_demo(out)
    report = json.loads((out / "report.json").read_text()) if proc.returncode == 0 else {}
    return out, report, proc


def test_fuse_exits_0_and_writes_the_files(fused):
    out, report, proc = fused
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt2", "model.safetensors", "report.json"]
    s = report["summary"]
    assert f"{s['norms']} norms: {s['folded']} folded away, {s['kept']} kept" in proc.stdout.splitlines()


def test_readme_example_is_what_make_demo_prints(fused):
    """README's block, written by scripts/readme_example.py, equals this run's output but for the seconds,
    library versions, measured errors' digits and the output folder."""
    out, _, proc = fused
    fresh = readme_example.block(readme_example.demo_command(), proc)
    assert readme_example.normalise(fresh, out) == readme_example.normalise(readme_example.readme_block()), (
        "README's example differs from what `make demo` prints: run scripts/readme_example.py"
    )


def test_piped_output_has_full_names_and_one_progress_line_per_stage(fused):
    out, report, proc = fused
    assert "…" not in proc.stdout + proc.stderr and "\x1b[" not in proc.stdout + proc.stderr  # no cut, no colour
    rows = [line.split() for line in proc.stdout.splitlines()]
    for fold in report["folds"]:  # each norm's row names it and every layer it folded into, whole
        into = [f"{x}," for x in fold["into"][:-1]] + fold["into"][-1:]
        row = [fold["norm"], fold["kind"], fold["action"], *into]
        assert any(r[: len(row)] == row for r in rows), row  # then the int8 step column
    stages = proc.stderr.splitlines()
    assert all(re.fullmatch(r"\[ *\d+\.\ds\] \S.*", line) for line in stages), stages
    names = [line.split("] ", 1)[1] for line in stages]
    assert len(names) == len(set(names)) >= 8  # one line per stage, never a line per step
    assert names[0] == f"loading {readme_example.demo_command().split()[2]}" and names[-1].startswith("verifying")
    seconds = [float(line[1:].split("s]")[0]) for line in stages]
    assert seconds == sorted(seconds)
    assert all(line.rstrip() == line for line in proc.stdout.splitlines())  # no padding to a terminal width


def test_report_numbers_meet_the_tolerance_on_the_whole_holdout(fused, fixture_ckpt):
    _, report, _ = fused
    holdout = np.load(FIXTURE / "holdout.npz")
    v = report["verification"]
    assert v["passed"] is True
    assert v["samples"] == len(holdout["y"]) and v["inputs"].endswith("holdout.npz")
    assert v["max_rel_err"] <= 1e-5 and v["top1_agreement"] == 1.0
    assert v["question_1_exact"] is True and v["exact"][0]["error"] <= 1e-9 and v["exact"][1]["error"] <= 0.5
    assert {c["name"] for c in v["checks"]} == {
        "output @ onnxruntime[no-optimizations]",
        "output @ onnxruntime[all-optimizations]",
        f"output @ pytorch {torch.__version__} float32 (model.pt2)",
    }
    assert all(c["e_fused"] <= c["tolerance"] == max(1e-5, 2 * c["e_orig"]) for c in v["checks"])
    assert report["source"]["sha256"] == sha256_file(fixture_ckpt)
    assert report["source"]["arch"] == "deit_prepbn" and report["source"]["format"] == "training-checkpoint"
    assert len(report["folds"]) == 9 and all(f["action"] == "folded-forward" for f in report["folds"])


def test_fused_onnx_has_no_norm_left_and_matches_the_norm_free_bound(fused, fixture_ckpt, tmp_path):
    out, _, _ = fused
    ckpt = load_checkpoint(fixture_ckpt)
    spec = get_arch("deit_prepbn")
    bound = spec.build(ckpt.state_dict, ckpt.config, "identity").eval()
    export_onnx(bound, torch.randn(2, 1, 8, 8), tmp_path / "bound.onnx")
    fused_ops = op_histogram(out / "model.onnx")
    assert fused_ops["BatchNormalization"] == 0
    assert fused_ops == op_histogram(tmp_path / "bound.onnx")


def test_fused_onnx_has_a_dynamic_batch_and_keeps_the_holdout_accuracy(fused, fixture_ckpt):
    out, report, _ = fused
    holdout = np.load(FIXTURE / "holdout.npz")
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a named, dynamic batch axis
    logits = session.run(None, {session.get_inputs()[0].name: holdout["x"]})[0]
    accuracy = float((logits.argmax(1) == holdout["y"]).mean())
    assert accuracy >= 0.95
    saved = torch.load(fixture_ckpt, weights_only=True)
    assert abs(accuracy * 100 - saved["max_accuracy"]) < 1e-6


def test_safetensors_carry_provenance_metadata_and_load_into_the_norm_free_model(fused, fixture_ckpt):
    out, _, _ = fused
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["arch"] == "deit_prepbn" and meta["source_sha256"] == sha256_file(fixture_ckpt)
    assert meta["slabconv_version"] and meta["complete"] == "true"
    assert not [k for k in keys if ".norm" in k or k.startswith("norm.")]


@pytest.fixture(scope="module")
def verified(fused, fixture_ckpt, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """One ``verify`` of the fused ONNX against the fixture at the default tolerance, with ``--junit``: its result
    and the JUnit file (read only by the tests below)."""
    out, _, _ = fused
    junit = tmp_path_factory.mktemp("verified") / "j.xml"
    result = CliRunner().invoke(
        app, ["verify", str(fixture_ckpt), str(out / "model.onnx"), "--junit", str(junit), "--json"]
    )
    return result, junit


def test_verify_passes_on_the_fused_onnx_and_writes_junit(verified):
    result, junit = verified
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verification"]["passed"] is True
    assert 'failures="0"' in junit.read_text()


def test_a_fold_that_drops_alpha_is_caught_by_verify_with_exit_1(fixture_ckpt, tmp_path):
    """Make the wrong fold a naive tool would: treat every RepBN as a plain BatchNorm (alpha dropped)."""
    saved = torch.load(fixture_ckpt, weights_only=True)
    saved["model"] = {k: torch.zeros_like(v) if k.endswith(".alpha") else v for k, v in saved["model"].items()}
    wrong = tmp_path / "alpha-dropped" / "checkpoint.pth"
    wrong.parent.mkdir()
    torch.save(saved, wrong)
    wrote = CliRunner().invoke(  # the naive fold's files, in process; the verdict below from the console script
        app, ["fuse", str(wrong), "--out", str(tmp_path / "wrong"), "--no-verify", "--no-pt2"]
    )
    assert wrote.exit_code == 0, wrote.output
    verdict = _slabconv("verify", str(fixture_ckpt), str(tmp_path / "wrong" / "model.onnx"), "--json")
    assert verdict.returncode == 1, verdict.stderr
    v = json.loads(verdict.stdout)["verification"]
    assert v["passed"] is False and v["max_rel_err"] > 1e-2


def test_inspect_prints_the_plan_and_writes_nothing(fixture_ckpt, tmp_path):
    before = sorted(p.name for p in fixture_ckpt.parent.iterdir())
    result = CliRunner().invoke(app, ["inspect", str(fixture_ckpt), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [f["into"] for f in report["folds"]][-1] == ["head"]
    assert "outputs" not in report and "verification" not in report
    assert sorted(p.name for p in fixture_ckpt.parent.iterdir()) == before


def test_export_writes_fused_and_unfused_onnx(fixture_ckpt, tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["export", str(fixture_ckpt), "--onnx", str(tmp_path / "f.onnx")]).exit_code == 0
    assert (
        runner.invoke(app, ["export", str(fixture_ckpt), "--onnx", str(tmp_path / "u.onnx"), "--no-fuse"]).exit_code
        == 0
    )
    assert op_histogram(tmp_path / "f.onnx")["BatchNormalization"] == 0
    assert op_histogram(tmp_path / "u.onnx")["BatchNormalization"] == 9
    result = runner.invoke(
        app,
        [
            "verify",
            str(tmp_path / "u.onnx"),
            str(tmp_path / "f.onnx"),
            "--inputs",
            str(FIXTURE / "holdout.npz"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output


def test_list_names_the_fixture_architecture():
    result = CliRunner().invoke(app, ["list", "--json"])
    assert result.exit_code == 0
    assert "deit_prepbn" in {row["name"] for row in json.loads(result.stdout)}


def test_a_failed_fuse_names_no_written_file(fixture_ckpt, tmp_path):
    """``--rtol 1e-9`` is tighter than float32 rounding: the fuse fails (exit 1), writes nothing, and neither the
    text output nor ``--json`` names a file it did not write. In process (the console script's start-up is
    checked by the module's ``make demo`` run): the same app, the same stdout and stderr."""
    out = tmp_path / "x"
    runner = CliRunner()
    text = runner.invoke(app, ["fuse", str(fixture_ckpt), "--out", str(out), "--rtol", "1e-9", "--samples", "8"])
    assert text.exit_code == 1, text.output
    assert "wrote" not in text.stdout + text.stderr and "nothing was written" in text.stderr
    as_json = runner.invoke(  # the report of the same failure; the ONNX file's fate is the text run's
        app,
        ["fuse", str(fixture_ckpt), "--out", str(out), "--rtol", "1e-9", "--json", "--samples", "8", "--no-onnx"],
    )
    assert as_json.exit_code == 1, as_json.output
    report = json.loads(as_json.stdout)
    assert report["outputs"] is None and report["verification"]["passed"] is False
    assert not out.exists()


def test_the_junit_failure_count_agrees_with_the_exit_code(fused, verified, fixture_ckpt, tmp_path):
    """The same command passing and failing: exit 0 with failures="0" (the module's run at the default tolerance;
    an --rtol that makes a run pass: tests/test_verify_cli.py::test_tolerance_overrides_decide_the_verdict), exit 1
    with as many failures as the report has failed checks (every case the JUnit file holds is a check that ran)."""
    out, _, _ = fused
    for rtol, code in ((None, 0), ("1e-12", 1)):
        junit = tmp_path / f"{code}.xml"
        if rtol is None:
            result, junit = verified
        else:
            args = ["verify", str(fixture_ckpt), str(out / "model.onnx"), "--rtol", rtol, "--junit", str(junit)]
            result = CliRunner().invoke(app, [*args, "--json"])
        assert result.exit_code == code, result.output
        v = json.loads(result.stdout)["verification"]
        failed = [c for c in v["exact"] + v["integrity"] + v["checks"] if not c["passed"]]
        text = junit.read_text()
        assert f'failures="{len(failed)}"' in text and (len(failed) > 0) == (code == 1)
        assert text.count("<testcase ") == len(v["exact"]) + len(v["integrity"]) + len(v["checks"])
