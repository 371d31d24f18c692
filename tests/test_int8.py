"""Issue 40, item 1: the int8 check (``slabconv.verify.int8``): both sides quantized alike with onnxruntime's
tools, their top-1 against the float original, and the one-sided paired test that decides.

The models are tiny and their ONNX files come from the TorchScript exporter (a fraction of a second each); what
``verify --runtime onnxruntime-int8`` adds is the runtime entry around the same functions.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from benchmarks.int8_agreement import Bottleneck, Tabular
from slabconv.engine import capture, fold_program, fused_state_dict, planner
from slabconv.verify.int8 import ALPHA, check_int8, compare_int8, quantize_int8, sign_test
from slabconv.verify.results import int8_failure

ROOT = Path(__file__).resolve().parent.parent
C = 32  # the benchmark's models (benchmarks.int8_agreement) at a smaller width


def test_the_sign_test_is_the_exact_binomial_tail() -> None:
    stats = pytest.importorskip("scipy.stats")
    for worse, better in [(0, 0), (1, 0), (3, 1), (10, 2), (50, 40), (40, 50), (291, 1), (700, 841)]:
        expected = stats.binomtest(worse, worse + better, 0.5, alternative="greater").pvalue if worse + better else 1
        assert sign_test(worse, better) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_paired_counts_for_samples_and_for_sequences() -> None:
    """A classifier: a sample counts against the fused side when only the original keeps its top-1. A language
    model: a sequence counts against it when fewer of its positions keep the top-1 than in the original."""
    ref = np.eye(4)[[0, 1, 2, 3, 0, 1]] * 5.0  # six samples, classes 0 1 2 3 0 1
    original = ref.copy()
    original[0] = np.eye(4)[1]  # the int8 original loses sample 0
    fused = ref.copy()
    fused[[2, 3]] = np.eye(4)[[0, 0]]  # the int8 fused loses samples 2 and 3
    check = compare_int8("int8 @ test", [original], [fused], [ref], None, calibration="x")
    assert (check.units, check.count, check.worse, check.better) == ("samples", 6, 2, 1)
    assert check.original.agreement == pytest.approx(5 / 6) and check.fused.agreement == pytest.approx(4 / 6)
    assert check.p_value == pytest.approx(sign_test(2, 1)) and check.passed
    tokens = np.stack([ref[:3], ref[3:]])  # two sequences of three positions
    lost_two = tokens.copy()
    lost_two[0, :2] = np.eye(4)[[3, 3]]
    lost_one = tokens.copy()
    lost_one[0, 2] = np.eye(4)[0]
    check = compare_int8("int8 @ test", [lost_one], [lost_two], [tokens], None, calibration="x")
    assert (check.units, check.count, check.positions, check.worse, check.better) == ("sequences", 2, 3, 1, 0)


def test_many_paired_losses_fail_and_noise_does_not() -> None:
    gen = np.random.default_rng(0)
    ref = gen.normal(size=(400, 10))
    noisy = ref + gen.normal(scale=0.3, size=ref.shape)
    also_noisy = ref + gen.normal(scale=0.3, size=ref.shape)
    assert compare_int8("n", [noisy], [also_noisy], [ref], None, calibration="x").passed
    worse = ref + gen.normal(scale=1.5, size=ref.shape)
    check = compare_int8("n", [noisy], [worse], [ref], None, calibration="x")
    assert not check.passed and check.p_value < ALPHA
    assert "the fold costs int8 accuracy" in int8_failure(check.to_dict())  # the line the report prints


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    """360 samples of 64 features: the digits fixture's holdout images as features have constant pixels, whose
    BatchNorm scale ``1 / sqrt(eps)`` alone makes a forward fold lose int8 agreement (flagged, measured: 96% ->
    58%); these features have standard deviations within a factor 4 of one another."""
    gen = np.random.default_rng(0)
    x = gen.normal(size=(360, 64)) * gen.uniform(0.5, 2, size=64) + gen.normal(size=64)
    return x.astype(np.float32)


def _calibrated(model: nn.Module, x: np.ndarray) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        model.bn.momentum = None
        model.train()
        model(torch.from_numpy(x))
    return model.eval()


def _int8(model: nn.Module, x: np.ndarray, folder: Path) -> tuple[list, object]:
    """Fold ``model``, write both sides as ONNX (the fused side: the model without its norm, the fused weights
    loaded), and run the int8 check on ``x``: each decision with the program's ranges, and the check."""
    example = torch.from_numpy(x[:2])
    gm = capture(model, example)
    decisions, program = fold_program(gm)
    fused = copy.deepcopy(model)
    fused.bn = nn.Identity()
    fused.load_state_dict(fused_state_dict(gm))
    paths = []
    for tag, module in (("original", model), ("fused", fused)):
        path = folder / f"{tag}.onnx"
        torch.onnx.export(
            module, (example,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "b"}},
        )  # fmt: skip
        paths.append(path)
    with torch.no_grad():
        float_original = [model(torch.from_numpy(x)).double().numpy()]
        assert torch.allclose(fused(torch.from_numpy(x)), model(torch.from_numpy(x)), rtol=1e-3, atol=1e-3)
    check = check_int8("int8 @ test", paths[0], paths[1], x, float_original, None)
    return [(d, program.ranges) for d in decisions], check


def test_quantized_weights_have_one_scale_per_output_channel(tmp_path: Path, digits: np.ndarray) -> None:
    model = _calibrated(Tabular(C), digits)
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.from_numpy(digits[:2]),), str(path), dynamo=False, input_names=["x"])
    out = quantize_int8(path, tmp_path / "q.onnx", digits[:64])
    graph = onnx.load(str(out)).graph
    init = {t.name: t for t in graph.initializer}
    weights = [n for n in graph.node if n.op_type == "DequantizeLinear" and init.get(n.input[0]) is not None]
    weights = [n for n in weights if len(init[n.input[0]].dims) == 2]
    assert len(weights) == 2  # fc1 and fc2, stored (out, in) for a Gemm
    for node in weights:
        w, scale = init[node.input[0]], init[node.input[1]]
        assert w.data_type == onnx.TensorProto.INT8
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        assert list(scale.dims) == [w.dims[axis]] and w.dims[axis] in (C, 10)
    assert {n.op_type for n in graph.node} >= {"QuantizeLinear", "DequantizeLinear", "Gemm"}


class Residual(nn.Module):
    """``fc2(h + relu(fc1(h)))``, ``h = fc0(x)``: ``h`` is read by a Linear and by a residual addition."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, C), nn.Linear(C, C), nn.Linear(C, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc0(x)
        return self.fc2(h + torch.relu(self.fc1(h)))


def test_only_the_layers_inputs_are_quantized(tmp_path: Path, digits: np.ndarray) -> None:
    """onnxruntime's quantizer would let the residual addition read the dequantized copy of ``h`` (one pair per
    tensor); the float ops read the float tensor, so a side is not charged for where the quantizer put a pair."""
    path = tmp_path / "m.onnx"
    torch.onnx.export(Residual().eval(), (torch.from_numpy(digits[:2]),), str(path), dynamo=False)
    graph = onnx.load(str(quantize_int8(path, tmp_path / "q.onnx", digits[:64]))).graph
    made_by = {o: n for n in graph.node for o in n.output}
    weights = {t.name for t in graph.initializer}
    readers = [
        n.op_type
        for n in graph.node
        for i in n.input
        if (p := made_by.get(i)) is not None and p.op_type == "DequantizeLinear" and p.input[0] not in weights
    ]
    assert readers and set(readers) <= {"Gemm", "MatMul", "Conv"}  # h's copy goes to fc1 only, not to the Add


def test_one_tiny_channel_scale_is_flagged_and_costs_int8_agreement(tmp_path: Path, digits: np.ndarray) -> None:
    """Acceptance (issue 40): one input feature in units 1000 times larger (a norm with one tiny channel scale)
    folded forward: the fold is flagged and the fused model loses int8 agreement; the same model with ordinary
    features is not flagged and keeps it."""
    (ordinary_tmp := tmp_path / "ordinary").mkdir()
    folds, check = _int8(_calibrated(Tabular(C), digits), digits, ordinary_tmp)
    ((decision, ranges),) = folds
    assert decision.action == "folded-forward" and not any(r.flagged for r in ranges.values())
    assert check.passed and check.fused.agreement > 0.9
    wide = digits.copy()
    wide[:, 36] *= 1e3
    (outlier_tmp := tmp_path / "outlier").mkdir()
    folds, check = _int8(_calibrated(Tabular(C), wide), wide, outlier_tmp)
    ((decision, ranges),) = folds
    assert decision.action == "folded-forward" and ranges["fc1.weight"].flagged
    assert any(w.startswith("int8:") and "fc1" in w for w in decision.warnings)
    assert check.original.agreement > 0.9 and check.fused.agreement < check.original.agreement - 0.3
    assert not check.passed and check.p_value < 1e-10


def test_the_backward_choice_keeps_int8_agreement_where_forward_loses_it(
    tmp_path: Path, digits: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A norm that can fold either way, with one tiny channel scale: slabconv folds it backward and the int8
    check passes; forcing the forward fold (the limit raised) is flagged and fails it. The reason the planner
    prefers the backward fold there (docs/math.md, "Which direction")."""
    model = _calibrated(Bottleneck(C), digits)
    with torch.no_grad():  # the same function, channel 0 of the norm's input 1000 times larger
        model.fc1.weight[0] *= 1e3
        model.fc1.bias[0] *= 1e3
        model.bn.running_mean[0] *= 1e3
        model.bn.running_var[0] *= 1e6
    (chosen := tmp_path / "chosen").mkdir()
    folds, check = _int8(model, digits, chosen)
    ((decision, ranges),) = folds
    assert decision.action == "folded-backward" and not any(r.flagged for r in ranges.values())
    assert check.passed
    monkeypatch.setattr(planner, "STEP_GROWTH_LIMIT", math.inf)
    (forced := tmp_path / "forced").mkdir()
    folds, forced_check = _int8(model, digits, forced)
    ((decision, ranges),) = folds
    assert decision.action == "folded-forward" and ranges["fc2.weight"].flagged
    assert not forced_check.passed and forced_check.fused.agreement < check.fused.agreement - 0.3


def test_bench_opens_each_variant_quantized_alike(tmp_path: Path, digits: np.ndarray) -> None:
    """``bench --runtime onnxruntime-int8``: the one table entry opens each variant's export quantized, calibrated
    on the inputs bench draws, and times it (the exports made here with the fast TorchScript exporter)."""
    from slabconv import bench
    from slabconv.verify.backends import BACKENDS

    model = _calibrated(Tabular(C), digits)
    path = tmp_path / "original.onnx"
    torch.onnx.export(
        model, (torch.from_numpy(digits[:2]),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "b"}},
    )  # fmt: skip
    exported = {torch.float32: {"original": path}}
    spec = BACKENDS["onnxruntime-int8"]
    calibration = torch.from_numpy(digits[: bench.CALIBRATION_SAMPLES])
    opened = bench._open_variants(spec, {}, calibration[:2], exported, tmp_path, lambda *a: None, calibration)
    runtime = opened["original"]
    assert runtime.kind == "onnxruntime-int8" and runtime.label.startswith("onnxruntime-int8[")
    (out,) = runtime.run(digits[:8])
    with torch.no_grad():
        exact = model(torch.from_numpy(digits[:8])).double().numpy()
    assert 0 < np.abs(out - exact).max() < 0.1 * np.abs(exact).max()  # int8: close, not bit-equal
    runtime.timed(np.ascontiguousarray(digits[:4]))()


def test_verify_runtime_int8_judges_both_sides_in_the_report_and_junit(tmp_path: Path, digits: np.ndarray) -> None:
    """``verify ORIGINAL FUSED --runtime onnxruntime-int8`` (an ONNX original and the folder ``fuse`` wrote):
    question 2 in the usual runtimes, then both sides quantized alike; the check is in report.json, the terminal and
    JUnit. Ordinary features pass (calibrated on ``--calibration``); one feature in units 1000 times larger (a norm
    with one tiny channel scale, folded forward) fails it, exit 1, the fold flagged in ``fuse``'s report."""
    import json
    import xml.etree.ElementTree as ET

    from typer.testing import CliRunner

    from slabconv import api
    from slabconv.cli import app

    wide = digits.copy()
    wide[:, 36] *= 1e3
    results = {}
    for tag, x in (("ordinary", digits), ("outlier", wide)):
        (folder := tmp_path / tag).mkdir()
        model = _calibrated(Tabular(C), x)
        if tag == "ordinary":  # a .pt2 original: the reference is exported to ONNX for the int8 check
            original = folder / "original.pt2"
            batch = torch.export.Dim("batch", min=2)
            program = torch.export.export(model, (torch.from_numpy(x[:2]),), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(original))
        else:  # an ONNX original
            original = folder / "original.onnx"
            torch.onnx.export(
                model, (torch.from_numpy(x[:2]),), str(original), dynamo=False, input_names=["x"],
                output_names=["y"], dynamic_axes={"x": {0: "b"}},
            )  # fmt: skip
        np.savez(folder / "x.npz", x=x)
        np.savez(folder / "calibration.npz", x=x[:64])
        fused = api.fuse(original, folder / "out")
        assert [r.flagged for r in fused.ranges or []] == [tag == "outlier"]
        args = ["verify", str(original), str(folder / "out"), "--runtime", "onnxruntime-int8", "--inputs"]
        args += [str(folder / "x.npz"), "--junit", str(folder / "j.xml"), "--json"]
        args += ["--calibration", str(folder / "calibration.npz")] if tag == "ordinary" else []
        result = CliRunner().invoke(app, args)
        v = json.loads(result.stdout)["verification"]
        assert v["checks"] and all("onnxruntime[" in c["name"] or "pytorch" in c["name"] for c in v["checks"])
        (check,) = v["int8"]
        cases = {c.get("name"): c for c in ET.parse(folder / "j.xml").getroot().iter("testcase")}
        results[tag] = (result.exit_code, check, cases["int8 @ onnxruntime-int8"].find("failure") is None)
    code, check, junit_ok = results["ordinary"]
    assert code == 0 and check["passed"] and junit_ok and check["calibration"].endswith("calibration.npz")
    assert check["fused"]["agreement"] > 0.9 and check["original"]["agreement"] > 0.9
    code, check, junit_ok = results["outlier"]
    assert code == 1 and not check["passed"] and not junit_ok and check["p_value"] < ALPHA
    assert check["fused"]["agreement"] < check["original"]["agreement"] - 0.3


def test_calibration_without_an_int8_runtime_is_refused(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from slabconv.cli import app

    result = CliRunner().invoke(app, ["verify", "a.pth", "b", "--calibration", str(tmp_path / "c.npz")])
    assert result.exit_code == 2 and "--runtime onnxruntime-int8" in result.output


def test_calibration_without_an_int8_runtime_is_refused_by_the_api_before_any_work(tmp_path: Path) -> None:
    """``fuse`` and ``verify`` through the API take ``--calibration`` on the terms of the CLI, before the fold (a
    calibration no runtime uses would be silently ignored) and before reading a model."""
    from slabconv import api
    from slabconv.errors import UsageError
    from slabconv.options import VerifyOptions
    from tests.conftest import FIXTURE

    opts = VerifyOptions(runtimes=("onnxruntime",), calibration=tmp_path / "c.npz")
    message = r"^--calibration calibrates an int8 runtime; add VerifyOptions\(runtimes=\('onnxruntime-int8',\)\)$"
    with pytest.raises(UsageError, match=message):
        api.fuse(tmp_path / "missing.pth", tmp_path / "out", verify=opts)
    with pytest.raises(UsageError, match=message):
        api.verify(FIXTURE / "checkpoint.pth", FIXTURE / "checkpoint.pth", verify=opts)
    assert not (tmp_path / "out").exists()


class _BatchRelative(nn.Module):
    """A BatchNorm between Linears, and each class score taken relative to its mean over the batch: a sample's
    top-1 depends on the other samples of its batch, so a file run on batches of another size decides otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.bn, self.fc1 = nn.Linear(64, C), nn.BatchNorm1d(C), nn.Linear(C, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.bn(self.fc0(x)))
        return h - h.mean(dim=0, keepdim=True)


def test_the_int8_check_runs_a_static_batch_original_and_its_fold_in_the_originals_batches(
    tmp_path: Path, digits: np.ndarray
) -> None:
    """A ``.pt2`` exported with a static batch of 2 whose fused files take any batch: the int8 check runs both
    quantized sides on the original's batches of 2, as question 2 runs every file, so its top-1 is the original's
    (on batches of 16 the fused side decides for other batches and fails the check)."""
    from typer.testing import CliRunner

    from slabconv import api
    from slabconv.cli import app
    from slabconv.options import VerifyOptions

    torch.manual_seed(0)
    model = _calibrated(_BatchRelative(), digits)
    torch.export.save(torch.export.export(model, (torch.from_numpy(digits[:2]),)), str(tmp_path / "static.pt2"))
    np.savez(tmp_path / "x.npz", x=digits[:128])
    api.fuse(tmp_path / "static.pt2", tmp_path / "out", verify=VerifyOptions(inputs=tmp_path / "x.npz"))
    args = ["verify", str(tmp_path / "static.pt2"), str(tmp_path / "out"), "--runtime", "onnxruntime-int8"]
    result = CliRunner().invoke(app, [*args, "--inputs", str(tmp_path / "x.npz"), "--json"])
    (check,) = json.loads(result.stdout)["verification"]["int8"]
    assert result.exit_code == 0 and check["passed"], result.output
    assert check["fused"]["agreement"] > 0.9 and check["original"]["agreement"] > 0.9  # 0.55 on batches of 16
