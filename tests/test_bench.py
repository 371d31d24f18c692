"""`slabconv bench` runtimes: which run on this machine, the half-precision variants the GPU rows time, and the
device move they rely on (checked on the meta device: any tensor left on the CPU makes an op fail there)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from slabconv import api, bench
from slabconv.cli import app
from slabconv.errors import UsageError
from tests import llm_helpers
from tests.conftest import ROOT, small_vit
from tests.test_llama import tiny_model, tokens

CKPT = ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth"
CUDA = torch.cuda.is_available()
TEXT = llm_helpers.TEXT
text_fused_plain = llm_helpers.text_fused_plain


def _models():
    return [("vit", small_vit(), torch.randn(2, 1, 8, 8)), ("llama", tiny_model(), tokens(2, 8))]


@pytest.mark.parametrize("name, model, x", _models(), ids=["vit", "llama"])
def test_to_device_leaves_nothing_on_the_cpu(name, model, x):
    """Every variant runs on another device after ``to_device``. The LLaMA graph records ``device=cpu`` in its
    mask and rope constants, so a plain ``.to(device)`` is not enough there."""
    variants = bench.build_variants(model, x, torch.float32)
    assert set(variants) == {"original", "fused", "norm-free", "layernorm"}
    for gm in variants.values():
        with torch.no_grad():
            want = gm(x)
            got = bench.to_device(gm, "meta")(x.to("meta"))
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype
    if name == "llama":
        with pytest.raises(RuntimeError, match="device"):
            copy.deepcopy(variants["fused"]).to("meta")(x.to("meta"))


@pytest.mark.parametrize("name, model, x", _models(), ids=["vit", "llama"])
def test_half_variants_are_folded_and_as_accurate_as_the_half_original(name, model, x):
    """The fp16 rows time a model traced and folded in float16; against float64 it is as accurate as the float16
    original (docs/verification.md: the gap between the two is the original's own rounding)."""
    variants = bench.build_variants(model, x, torch.float16)
    xh = x.half() if x.is_floating_point() else x
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double() if x.is_floating_point() else x)
        original, fused = variants["original"](xh), variants["fused"](xh)
    assert fused.dtype == torch.float16
    assert not [n for n in variants["fused"].graph.nodes if "batch_norm" in str(n.target)]

    def err(out: torch.Tensor) -> float:
        return ((out.double() - exact).abs().max() / exact.abs().max()).item()

    assert err(fused) <= max(1e-3, 1.5 * err(original)), (err(fused), err(original))


def test_runtime_choice_follows_the_machine(monkeypatch):
    import onnxruntime as ort

    if not CUDA:
        assert bench.default_runtimes() == ["pytorch", "onnxruntime"]
        with pytest.raises(UsageError, match="no CUDA device"):
            bench.check_runtimes(["pytorch", "pytorch-cuda-fp16"])
    with pytest.raises(UsageError, match="choose from"):
        bench.check_runtimes(["tensorrt"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "onnxruntime-cuda" not in bench.default_runtimes() and "pytorch-cuda-graphs-fp16" in bench.default_runtimes()
    with pytest.raises(UsageError, match="onnxruntime-gpu"):
        bench.check_runtimes(["onnxruntime-cuda"])
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert bench.default_runtimes() == [n for n, spec in bench.RUNTIMES.items() if not spec.opt_in]  # int8: if named


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cli_refuses_a_cuda_runtime_without_cuda_before_loading():
    result = CliRunner().invoke(app, ["bench", str(CKPT), "--runtime", "pytorch-cuda"])
    assert result.exit_code == 2 and "no CUDA device" in result.output


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_runtimes_time_every_variant():
    result = CliRunner().invoke(
        app, ["bench", str(CKPT), "--batch", "1,4", "--repeats", "3", "--warmup", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    import json

    runtimes = {t["runtime"] for t in json.loads(result.stdout)["timings"]}
    assert {"pytorch-cuda", "pytorch-cuda-fp16", "pytorch-cuda-graphs-fp16"} <= runtimes


@pytest.mark.slow
def test_a_language_model_bench_times_greedy_generation_like_for_like(text_fused_plain):
    """bench of the text fixture times greedy generation of the original and the fused model in the same runtime
    (transformers, KV cache): the original's transformers twin computes the zoo original's logits, and all three
    runs generate the same tokens."""
    import numpy as np

    from slabconv.load.model import load_model
    from slabconv.verify.generate import original_twin
    from slabconv.write.hf_llama import load_fused_llama

    loaded = load_model(TEXT)
    twin = original_twin(loaded.model, load_fused_llama(text_fused_plain).config, loaded.dtype)
    ids = torch.from_numpy(np.load(TEXT / "holdout.npz")["x"][:4, :40]).long()
    with torch.no_grad():
        want = loaded.model(ids)
        got = twin(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    report = api.bench(TEXT, batches=(1,), runtimes=("pytorch",), warmup=1, repeats=2)
    generation = report.bench["generation"]
    assert generation["same_tokens"] is True and generation["steps"] == 32 and generation["prompts"] == 8
    assert generation["original_tokens_per_second"] > 0 and generation["fused_tokens_per_second"] > 0
    ratio = generation["fused_tokens_per_second"] / generation["original_tokens_per_second"]
    assert generation["fused_over_original"] == pytest.approx(ratio)


def test_bench_reports_the_four_variants_and_the_headline_ratio():
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(CKPT),
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
    result = CliRunner().invoke(app, ["bench", str(CKPT), "--batch", "x"])
    assert result.exit_code == 2 and "--batch" in result.output
