"""The console script on the real text fixture (a Hugging Face style LLaMA-PRepBN folder), and `bench`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from slabconv.cli import app
from tests.conftest import ROOT

TEXT = ROOT / "fixtures" / "text-prepbn"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fused_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("text") / "fused"
    result = CliRunner().invoke(app, ["fuse", str(TEXT), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_fuse_reads_the_folder_and_folds_every_norm(fused_text):
    _, report = fused_text
    assert report["source"]["arch"] == "llama_prepbn" and report["source"]["format"].startswith("hf-")
    assert [f["action"] for f in report["folds"]] == ["folded-forward"] * 7
    assert report["folds"][0]["into"] == [
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert report["folds"][-1]["into"] == ["lm_head"]


def test_verification_used_the_token_holdout_and_every_position(fused_text):
    _, report = fused_text
    holdout = np.load(TEXT / "holdout.npz")
    v = report["verification"]
    assert v["passed"] and v["inputs"].endswith("holdout.npz")
    assert v["samples"] == len(holdout["x"])
    assert v["top1_agreement"] == 1.0 and v["max_rel_err"] <= 1e-5


def test_task_metrics_for_the_original_and_every_runtime_that_generates(fused_text):
    """Issue 40, item 4: teacher-forced perplexity and next-token KL of the original (float64 reference, its own
    dtype) and of the fused model in transformers, in onnxruntime (decoder.onnx) and in onnxruntime-genai."""
    from slabconv.verify.task_metrics import TASK_SEQUENCES

    _, report = fused_text
    t = report["verification"]["task_metrics"]
    assert t["passed"] and t["sequences"] == TASK_SEQUENCES and t["positions"] == TASK_SEQUENCES * 63
    names = [r["name"] for r in t["runs"]]
    assert names[0].startswith("original float32") and not t["runs"][0]["decides"]
    assert any("transformers" in n for n in names) and any("decoder.onnx" in n for n in names)
    from slabconv.verify.generate import genai_available

    if genai_available():
        assert any("onnxruntime-genai" in n for n in names)
    else:
        assert any("onnxruntime-genai is not installed" in n for n in t["notes"])
    ppl = t["reference"]["perplexity"]
    assert 3 < ppl < 8  # the fixture's held-out text (the unigram perplexity is 25.7)
    for run in t["runs"]:
        assert abs(run["perplexity"] / ppl - 1) < 1e-4 and 0 <= run["kl_mean"] <= run["kl_max"] < 1e-6


def test_verify_the_folder_against_its_fused_onnx(fused_text, tmp_path):
    """``verify FOLDER model.onnx`` on the first 64 holdout sequences (4096 positions): the door under test is the
    folder against an ONNX file; fuse's own verification above already held this model.onnx to every holdout
    position (test_verification_used_the_token_holdout_and_every_position), and the whole holdout would only
    repeat that float64 reference."""
    out, _ = fused_text
    result = CliRunner().invoke(app, ["verify", str(TEXT), str(out / "model.onnx"), "--samples", "64", "--json"])
    assert result.exit_code == 0, result.output
    v = json.loads(result.stdout)["verification"]
    assert v["top1_agreement"] == 1.0 and v["samples"] == 64 and "holdout.npz (its first 64 of" in v["inputs"]


def test_bench_reports_the_four_variants_and_the_headline_ratio():
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth"),
            "--batch",
            "1,4",
            "--repeats",
            "3",
            "--warmup",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    variants = {(t["variant"], t["runtime"], t["batch"]) for t in report["timings"]}
    for variant in ("original", "fused", "norm-free", "layernorm"):
        for runtime in ("pytorch", "onnxruntime"):
            assert {(variant, runtime, 1), (variant, runtime, 4)} <= variants
    ratios = report["fused_over_norm_free"]
    assert len(ratios) == 4 and all(r["ratio"] > 0 for r in ratios)


def test_bench_refuses_a_bad_batch_list():
    result = CliRunner().invoke(
        app, ["bench", str(ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth"), "--batch", "x"]
    )
    assert result.exit_code == 2 and "--batch" in result.output
