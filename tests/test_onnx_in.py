"""ONNX originals (issue 23): ``fuse`` / ``inspect`` of an ``.onnx`` file someone already exported.

The digits fixture is exported here at run time with ``torch.onnx.export`` (TorchScript exporter at opset 17 and
18, the dynamo exporter at 18), folded, and held to the norm-free export of the same model: the same op histogram,
outputs within the verification policy, question 1 exact in float64. Small models show the refusals: a norm before
a zero-padded conv, a residual reading the norm, a shared weight keep the norm with the reason, and the output
still matches; a blocked norm whose input comes from a Linear folds backward.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from slabconv import api, onnx_in
from slabconv.cli import app
from slabconv.engine import onnx_apply, onnx_fold, reasons
from slabconv.errors import InputError, UsageError
from slabconv.load.model import load_model
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.render import summary_lines
from slabconv.verify import onnx_original
from slabconv.zoo.norms import RepBN
from tests import errordoc
from tests import onnxcases as oc
from tests.conftest import FIXTURE, ROOT, op_histogram, randomize_norms


def _export(model: nn.Module, x: torch.Tensor, path: Path, opset: int, dynamo: bool = False) -> Path:
    """``model`` to ONNX, input ``x`` / output ``y``, a dynamic batch for the TorchScript exporter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs: dict = {"dynamo": dynamo, "opset_version": opset, "input_names": ["x"], "output_names": ["y"]}
        if not dynamo:
            kwargs["dynamic_axes"] = {"x": {0: "batch"}, "y": {0: "batch"}}
        torch.onnx.export(model.eval(), (x,), str(path), **kwargs)
    return path


def _norm_free(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every RepBN replaced by identity (the norm-free bound)."""
    free = copy.deepcopy(model)
    for parent in list(free.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RepBN):
                setattr(parent, name, nn.Identity())
    return free


def _prepared_histogram(path: Path) -> collections.Counter[str]:
    """The op histogram of ``path`` as slabconv prepares any ONNX original before folding (onnxscript's constant
    folding: no-op Casts go, Shapes of static sizes become constants): what a complete fold of its twin reaches."""
    import onnx_ir as ir

    from slabconv.engine.onnx_lower import prepare

    model = ir.load(str(path))
    prepare(model, str(path))
    ir.save(model, str(path.with_suffix(".prepared.onnx")))
    counts = op_histogram(path.with_suffix(".prepared.onnx"))
    del counts["Identity"]  # what the exporter writes for the nn.Identity that stands in for a norm
    return counts


def _bn_conv(
    rng: np.random.Generator, channels: int = 4, out: int = 5
) -> tuple[list[onnx.TensorProto], Callable[..., list[onnx.NodeProto]]]:
    """A hand-built ``x -> BatchNormalization (g, b, m, v) -> y -> Conv 1x1 (k) -> z``: the float32 initializers,
    drawn from ``rng`` (scale in [0.5, 1.5], shift and mean in [-1, 1], var in [0.5, 2], ``k`` ``(out, channels, 1,
    1)``), and ``nodes(bn_outputs)``, the two nodes with the BatchNormalization writing ``bn_outputs``."""
    from onnx import helper, numpy_helper

    arrays = {"g": rng.uniform(0.5, 1.5, channels), "b": rng.uniform(-1, 1, channels),
              "m": rng.uniform(-1, 1, channels), "v": rng.uniform(0.5, 2, channels),
              "k": rng.standard_normal((out, channels, 1, 1))}  # fmt: skip

    def nodes(bn_outputs: tuple[str, ...] = ("y",)) -> list[onnx.NodeProto]:
        return [helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], list(bn_outputs), name="bn"),
                helper.make_node("Conv", ["y", "k"], ["z"], name="conv")]  # fmt: skip

    return [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()], nodes


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.fixture(scope="module")
def digits() -> tuple[nn.Module, torch.Tensor]:
    loaded = load_model(FIXTURE / "checkpoint.pth")
    return loaded.model, loaded.example(2, 0)


EXPORTS = [pytest.param(17, False, id="torchscript-opset17"), pytest.param(18, False, id="torchscript-opset18")]
EXPORTS += [pytest.param(18, True, id="dynamo-opset18", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("opset", "dynamo"), EXPORTS)
def test_digits_export_folds_to_the_norm_free_graph(digits, tmp_path, opset, dynamo):
    model, x = digits
    original = _export(model, x, tmp_path / "model.onnx", opset, dynamo)
    free = _export(_norm_free(model), x, tmp_path / "free.onnx", opset, dynamo)
    report = api.fuse(original, tmp_path / "out", verify=VerifyOptions(samples=16))
    fused = tmp_path / "out" / "model.onnx"
    assert [d.action for d in report.folds] == ["folded-forward"] * 9
    assert report.verification is not None and report.verification.passed
    assert report.verification.exact and all(c.passed for c in report.verification.exact)
    got, want = op_histogram(fused), _prepared_histogram(free)
    assert got["BatchNormalization"] == 0
    assert got == want, {k: (got[k], want[k]) for k in got | want if got[k] != want[k]}
    before, after = onnx.load(str(original)), onnx.load(str(fused))
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert after.graph.input[0].type == before.graph.input[0].type  # dynamic axes kept
    assert [(o.domain, o.version) for o in after.opset_import] == [(o.domain, o.version) for o in before.opset_import]
    kept = {n.name for n in after.graph.node}
    assert kept <= {n.name for n in before.graph.node}  # no node renamed, none added (every consumer had a bias)
    xs = np.random.default_rng(1).standard_normal((2, 1, 8, 8)).astype(np.float32)
    y0, y1 = _run(original, xs), _run(fused, xs)
    assert np.abs(y1 - y0).max() / np.abs(y0).max() < 1e-5


_STATIC_ADVICE = {
    "dynamo": "torch.onnx.export(..., dynamo=True, dynamic_shapes=({0: torch.export.Dim('batch')},))",
    "torchscript": "torch.onnx.export(..., dynamo=False, input_names=['x'], dynamic_axes={'x': {0: 'batch'}})",
    None: "a dynamic batch axis (torch.onnx.export: dynamic_shapes with dynamo=True, dynamic_axes with dynamo=False)",
    "tf2onnx": "tf2onnx.convert.from_keras(..., input_signature=(tf.TensorSpec((None, ...), tf.float32, name='x'),))",
    "jax2onnx": "jax2onnx.to_onnx(..., [('B', ...)]) (a named batch axis)",
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo", None, "tf2onnx", "jax2onnx"])
def test_a_static_batch_is_warned_about_in_the_spelling_of_the_exporter_that_wrote_the_file(tmp_path, exporter):
    """An ONNX file with a static batch of 2: the warning says how to export a dynamic batch with the exporter
    that wrote the file (``dynamic_axes`` for ``torch.onnx.export(..., dynamo=False)``, ``dynamic_shapes`` for
    ``dynamo=True``), told by its ``producer_version`` and node marks; tf2onnx's ``input_signature`` and jax2onnx's
    named axis for their files (their ``producer_name``: a Keras user was told torch's spellings); a file made by
    another producer (by hand here) gets torch's two spellings."""
    path = tmp_path / "static.onnx"
    if exporter in (None, "tf2onnx", "jax2onnx"):
        model = oc.base_model()
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
        model.producer_name, model.producer_version = exporter or "hand", "1.17.0 None"
        onnx.save(model, str(path))
    else:
        torch.manual_seed(0)
        module = randomize_norms(nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 3)), seed=3).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.randn(2, 8),), str(path), dynamo=exporter == "dynamo", input_names=["x"])
    report = api.inspect(path)
    assert report.source is not None and report.source.batch == 2
    assert report.to_dict()["source"]["exporter"] == (exporter if exporter in ("dynamo", "torchscript") else None)
    line = next(iter(summary_lines(report)))
    assert line == (
        f"warning: {path} was exported with a static batch of 2, so the fused files run on batches of exactly 2; "
        f"export it with {_STATIC_ADVICE[exporter]} for any batch (docs/onnx.md)"
    )
    assert _STATIC_ADVICE[exporter] in (errordoc.documented(line) or ""), line  # docs/errors.md lists it


def test_inspect_reports_an_onnx_source(digits, tmp_path):
    model, x = digits
    path = _export(model, x, tmp_path / "model.onnx", 17)
    report = api.inspect(path)
    data = report.to_dict()
    assert data["source"]["format"] == "onnx" and data["source"]["opset"] == 17
    assert data["source"]["producer"].startswith("pytorch")
    assert data["summary"] == {"norms": 9, "folded": 9, "kept": 0}
    assert data["folds"][0]["norm"] == "blocks.0.norm1" and data["folds"][0]["kind"] == "RepBN"  # as the checkpoint
    # the weight ranges, measured on the initializers as on the checkpoint's tensors (engine.ranges)
    want = api.inspect(FIXTURE / "checkpoint.pth").to_dict()["ranges"]
    got = data["ranges"]
    assert [(r["layer"], r["folds"]) for r in got] == [(r["layer"], r["folds"]) for r in want] and len(got) == 9
    for g, w in zip(got, want, strict=True):
        for block in ("per_tensor", "per_channel"):
            g[block].pop("worst_channel", None), w[block].pop("worst_channel", None)  # rows that tie to 1e-12
            assert g[block] == pytest.approx(w[block], rel=1e-9), (g["layer"], block)


class _Model(nn.Module):
    """A ``(B, N, C)`` model around one RepBN, wired as ``kind`` says."""

    def __init__(self, kind: str, c: int = 8):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(c, c)
        self.norm = RepBN(c)
        self.fc = nn.Linear(c, c)
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        if kind == "backward-nobias":  # the producer has no bias: the fold creates one
            self.lin = nn.Linear(c, c, bias=False)
        if kind == "shared":
            self.fc2 = nn.Linear(c, c)
            self.fc2.weight = self.fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "padded-conv":  # the norm feeds a conv that pads with zeros
            return self.conv(self.norm(x).transpose(1, 2))
        if self.kind == "residual":  # the normalized tensor is also added back
            z = self.norm(x)
            return self.fc(z) + z
        if self.kind in ("backward", "backward-nobias"):  # a residual reads the norm, a Linear produces its input
            z = self.norm(self.lin(x))
            return self.fc(z) + z
        if self.kind == "backward-roll":  # ... through a roll of the tokens (TorchScript: two Slices and a Concat)
            z = self.norm(self.lin(x).roll(2, 1))
            return self.fc(z) + z
        if self.kind == "input-reused":  # blocked forward, and a backward fold would change y for the residual
            y = self.lin(x)
            z = self.norm(y)
            return self.fc(z) + z + y
        if self.kind == "shared":
            z = self.norm(x)
            return self.fc(z) + self.fc2(z[:, :1])
        return self.fc(self.norm(x))


CASES = [
    ("padded-conv", "kept-affine", reasons.PADDED_CONV_CONSUMER),
    ("residual", "kept-affine", reasons.RESIDUAL_READS_NORM),
    ("shared", "folded-forward", None),  # the shared initializer is copied for the layer the fold changes
    ("backward", "folded-backward", None),
    ("backward-nobias", "folded-backward", None),
    ("backward-roll", "folded-backward", None),
    ("input-reused", "kept-affine", reasons.RESIDUAL_READS_NORM),
    ("plain", "folded-forward", None),
]


@pytest.mark.parametrize(("kind", "action", "reason"), CASES, ids=[c[0] for c in CASES])
def test_small_models_fold_or_keep_with_the_reason(tmp_path, kind, action, reason):
    torch.manual_seed(0)
    model = randomize_norms(_Model(kind).eval(), seed=3)
    path = _export(model, torch.randn(2, 5, 8), tmp_path / "model.onnx", 17)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    (decision,) = report.folds
    assert (decision.action, decision.reason) == (action, reason)
    assert report.verification is not None and report.verification.passed
    fused = op_histogram(tmp_path / "out" / "model.onnx")
    # a kept norm stays on its blocked paths only: one BatchNormalization on the conv's (B, C, N) input (channels at
    # axis 1), else one Mul and one Add on the tokens (B, N, C)
    on_axis_1 = kind == "padded-conv"
    assert fused["BatchNormalization"] == on_axis_1
    assert fused["Mul"] == op_histogram(path)["Mul"] - 1 + (action == "kept-affine" and not on_axis_1)  # alpha * x


def test_a_naive_fold_of_a_refused_norm_would_be_wrong(tmp_path):
    """The refusal is needed: folding the residual case forward anyway (into fc) changes the output."""
    torch.manual_seed(0)
    model = randomize_norms(_Model("residual").eval(), seed=3)
    path = _export(model, torch.randn(2, 5, 8), tmp_path / "model.onnx", 17)
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    y0, y1 = _run(path, x), _run(_naive_onnx(path, tmp_path / "naive.onnx"), x)
    assert np.abs(y1 - y0).max() / np.abs(y0).max() > 1e-3


def test_batchnorm2d_before_an_unpadded_conv_folds_into_it(tmp_path):
    model = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 2, stride=2, padding=0))
    randomize_norms(model.eval(), seed=1)
    path = _export(model, torch.randn(2, 4, 8, 8), tmp_path / "model.onnx", 18)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert [(d.kind, d.action) for d in report.folds] == [("BatchNorm", "folded-forward")]
    assert report.verification is not None and report.verification.passed
    assert op_histogram(tmp_path / "out" / "model.onnx") == collections.Counter({"Conv": 1})


def test_external_data_stays_external(digits, tmp_path):
    model, x = digits
    path = _export(model, x, tmp_path / "src" / "model.onnx", 17) if (tmp_path / "src").mkdir() is None else None
    assert path is not None
    proto = onnx.load(str(path))
    onnx.save(proto, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert report.outputs is not None and report.outputs.files == ["model.onnx", "model.onnx.data"]
    assert report.to_dict()["source"]["external_data"] is True
    assert (tmp_path / "out" / "model.onnx").stat().st_size < 100_000


def test_external_data_outside_the_folder_is_refused(digits, tmp_path):
    model, x = digits
    (tmp_path / "a").mkdir()
    path = _export(model, x, tmp_path / "a" / "model.onnx", 17)
    proto = onnx.load(str(path))
    onnx.save(proto, str(path), save_as_external_data=True, location="w.bin", size_threshold=0)
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../w.bin"
    onnx.save(proto, str(path))
    (tmp_path / "a" / "w.bin").rename(tmp_path / "w.bin")
    with pytest.raises(InputError, match="'../w.bin', which is not a file inside the model's folder"):
        api.inspect(path)


def test_cli_fuse_of_an_onnx_file_and_its_refusals(digits, tmp_path):
    model, x = digits
    path = _export(model, x, tmp_path / "model.onnx", 17)
    runner = CliRunner()
    result = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--samples", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verification"]["passed"] and data["source"]["format"] == "onnx"
    assert data["outputs"]["onnx"] == "model.onnx"
    shown = runner.invoke(app, ["inspect", str(path)])
    assert shown.exit_code == 0 and "folds (onnx, opset 17, pytorch" in shown.stdout
    bad = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "o2"), "--arch", "deit_prepbn"])
    assert bad.exit_code == 2 and "--arch does not apply to an ONNX original" in bad.output
    exported = runner.invoke(app, ["export", str(path), "--onnx", str(tmp_path / "again.onnx")])
    assert exported.exit_code == 2 and "an ONNX file is already an export" in exported.output
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x07garbage")
    broken = runner.invoke(app, ["inspect", str(tmp_path / "broken.onnx")])
    assert broken.exit_code == 2 and "not a readable ONNX model" in broken.output
    assert not (tmp_path / "o2").exists()


def test_check_options_refuses_what_an_onnx_original_cannot_honour(tmp_path):
    with pytest.raises(UsageError, match="--stream"):
        from slabconv import onnx_in

        onnx_in.check_options(tmp_path / "m.onnx", LoadOptions(), WriteOptions(stream=True))


@pytest.mark.parametrize(
    "flags",
    [["--dtype", "float16"], ["--opset", "21"], ["--input-shape", "8"], ["--generate", "4"]],
    ids=lambda flags: flags[0],
)
def test_an_option_an_onnx_original_cannot_honour_is_refused_not_claimed(flags, tmp_path):
    """``fuse m.onnx --dtype float16`` wrote a float32 model.onnx and printed "(float16): verification PASSED"; each
    such option is refused before anything is read, in one line, and nothing is written."""
    runner = CliRunner()
    path = oc.save(oc.base_model(), tmp_path / "m")
    result = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), *flags])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert lines == [f"error: {path}: {flags[0]} does not apply to an ONNX original" + lines[0].split("original", 1)[1]]
    assert "; drop it" in lines[0] and result.stdout == ""
    assert not (tmp_path / "out").exists()
    kept = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--generate", "0", "--quiet"])
    assert kept.exit_code == 0, kept.output  # --generate 0 asks for no generation check: honoured


class _Logits(nn.Module):
    """A language model's logits alone (what an ONNX export of it returns)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids)
        return out.logits if hasattr(out, "logits") else out


LLAMA_EXPORTS = [pytest.param(18, False, id="torchscript-opset18"), pytest.param(18, True, id="dynamo-opset18")]


@pytest.mark.slow
@pytest.mark.parametrize(("opset", "dynamo"), LLAMA_EXPORTS)
def test_llama_prepbn_export_folds_to_the_norm_free_graph_plus_the_biases_it_needs(tmp_path, opset, dynamo):
    loaded = load_model(ROOT / "fixtures" / "text-prepbn")
    model, ids = _Logits(loaded.model).eval(), loaded.example(2, 0)
    original = _export(model, ids, tmp_path / "model.onnx", opset, dynamo)
    free = _export(_norm_free(model), ids, tmp_path / "free.onnx", opset, dynamo)
    report = api.fuse(original, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [d.action for d in report.folds] == ["folded-forward"] * 7
    assert report.verification is not None and report.verification.passed
    assert report.verification.inputs.startswith("random(")  # token ids drawn below the embedding's row count
    got, want = op_histogram(tmp_path / "out" / "model.onnx"), _prepared_histogram(free)
    created = sum(len(d.into) for d in report.folds)  # q/k/v, gate/up and lm_head have no bias: each gets one
    assert got - collections.Counter({"Add": created}) == want
    assert got["Add"] == want["Add"] + created


def test_a_float16_export_folds_and_is_judged_in_float16(digits, tmp_path):
    model, x = digits
    path = _export(copy.deepcopy(model).half(), x.half(), tmp_path / "model.onnx", 17)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=16))
    assert report.source is not None and report.source.dtype == "float16"
    assert report.verification is not None and report.verification.passed
    assert {c.dtype for c in report.verification.checks} == {"float16"}
    assert report.verification.exact[1].error == 0.0  # every float16 weight is the float64 fold rounded once
    assert op_histogram(tmp_path / "out" / "model.onnx")["BatchNormalization"] == 0


class _Flat(nn.Module):
    """``(B, C)``: a Gemm produces the BatchNorm's input, which a residual also reads."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.lin, self.bn, self.fc = nn.Linear(c, c), nn.BatchNorm1d(c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = self.bn(y)
        return self.fc(z) + z + y


def test_no_backward_fold_when_another_node_reads_the_norms_input(tmp_path):
    model = randomize_norms(_Flat().eval(), seed=2)
    path = _export(model, torch.randn(4, 8), tmp_path / "model.onnx", 17)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    (decision,) = report.folds
    assert (decision.action, decision.reason) == ("kept-affine", reasons.RESIDUAL_READS_NORM)
    assert report.verification is not None and report.verification.passed


class _AffineIntoBatchNorm(nn.Module):
    """PP-LCNetV3's rep layer: a learned scalar affine read by an identity-branch BatchNorm and by a 1x1 conv,
    the BatchNorm's output added to the conv's (so both norms keep an affine, the BatchNorm's read by the add)."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.stem, self.bn, self.conv = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.Conv2d(c, c, 1)
        self.scale, self.shift = nn.Parameter(torch.tensor([1.7])), nn.Parameter(torch.tensor([0.4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.scale * torch.relu(self.stem(x)) + self.shift
        return torch.relu(self.bn(a) + self.conv(a))


def test_a_norm_kept_before_a_kept_batchnorm_is_what_that_batchnorm_reads(tmp_path):
    """The BatchNorm's kept affine is applied to the scalar affine's kept output, not to the relu under it."""
    model = randomize_norms(_AffineIntoBatchNorm().eval(), seed=3)
    x = torch.randn(2, 3, 6, 6)
    path = _export(model, x, tmp_path / "model.onnx", 18)
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert sorted(d.action for d in report.folds) == ["kept-affine", "kept-affine"]
    fused = _run(tmp_path / "out" / "model.onnx", x.numpy())
    np.testing.assert_allclose(fused, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


class _TwoInputs(nn.Module):
    """``input_ids`` through an embedding and a RepBN into a Linear, ``attention_mask`` zeroing padded tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.fc = nn.Embedding(11, 8), RepBN(8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        z = self.fc(self.norm(self.emb(ids)) + 0 * other)  # the norm's output is read by a residual Add
        return z * attention_mask.unsqueeze(-1).to(z.dtype)


def test_a_model_with_several_inputs_is_fed_each_from_its_type_and_shape(tmp_path):
    model = randomize_norms(_TwoInputs().eval(), seed=1)
    ids, mask, other = torch.randint(0, 11, (2, 5)), torch.ones(2, 5, dtype=torch.int64), torch.randn(2, 5, 8)
    path = tmp_path / "three.onnx"
    torch.onnx.export(
        model, (ids, mask, other), str(path), dynamo=False, input_names=["input_ids", "attention_mask", "other"],
        dynamic_axes={n: {0: "batch"} for n in ("input_ids", "attention_mask", "other")},
    )  # fmt: skip
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=6))
    (decision,) = report.folds  # blocked by the residual, folded backward into the embedding table
    assert decision.action == "folded-backward"
    assert report.verification is not None and report.verification.passed
    assert report.verification.inputs == "random(seed=0, samples=6)"
    info = onnx_in_read(path)
    drawn, _, _ = onnx_original.choose_onnx_inputs(info, VerifyOptions(samples=64))
    assert isinstance(drawn, dict) and list(drawn) == ["input_ids", "attention_mask", "other"]
    assert drawn["input_ids"].min() >= 0 and drawn["input_ids"].max() == 10  # bounded by the embedding's 11 rows
    assert (drawn["attention_mask"] == 1).all() and drawn["other"].dtype == np.float32
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 11, (3, 5)), "attention_mask": np.array([[1, 1, 1, 0, 0]] * 3),
             "other": rng.standard_normal((3, 5, 8)).astype(np.float32)}  # fmt: skip
    np.savez(tmp_path / "in.npz", **feeds)
    report = api.fuse(path, tmp_path / "out2", verify=VerifyOptions(inputs=tmp_path / "in.npz"))
    assert report.verification is not None and report.verification.passed
    fused = ort.InferenceSession(str(tmp_path / "out2" / "model.onnx"), providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y0, y1 = original.run(None, feeds)[0], fused.run(None, feeds)[0]
    assert np.abs(y1 - y0).max() / np.abs(y0).max() < 1e-5 and (y1[:, 3:] == 0).all()
    np.savez(tmp_path / "bad.npz", input_ids=feeds["input_ids"], other=feeds["other"])
    with pytest.raises(InputError, match=r"expected an array named 'attention_mask', one per model input"):
        api.fuse(path, tmp_path / "out3", verify=VerifyOptions(inputs=tmp_path / "bad.npz"))
    # a uint64 id above int64's range is named as stored (a cast to int64 before the check made it -1)
    huge = feeds["input_ids"].astype(np.uint64)
    huge[1, 2] = 2**64 - 1
    np.savez(tmp_path / "huge.npz", **{**feeds, "input_ids": huge})
    with pytest.raises(InputError, match=rf"token id {2**64 - 1} is outside the model's vocabulary \(0\.\.10\)"):
        onnx_original.choose_onnx_inputs(info, VerifyOptions(inputs=tmp_path / "huge.npz"))


def onnx_in_read(path: Path):  # noqa: ANN201 - the OnnxFile of path
    from slabconv.load.onnx_file import read_onnx

    return read_onnx(path)


def test_files_slabconv_cannot_fold_or_feed_are_refused_with_one_line(tmp_path):
    model = randomize_norms(_Model("plain").eval(), seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.randn(2, 5, 8),), str(tmp_path / "dyn.onnx"), dynamo=False, input_names=["x"],
            dynamic_axes={"x": {0: "batch", 1: "tokens"}},
        )  # fmt: skip
    with pytest.raises(
        UsageError, match=r"the input 'x' has dynamic axes besides the batch; pass VerifyOptions\(inputs=\.\.\.\)"
    ):
        api.fuse(tmp_path / "dyn.onnx", tmp_path / "out", verify=VerifyOptions(samples=2))
    assert not (tmp_path / "out").exists()
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).standard_normal((3, 7, 8)).astype(np.float32))
    report = api.fuse(tmp_path / "dyn.onnx", tmp_path / "out", verify=VerifyOptions(inputs=tmp_path / "x.npz"))
    assert report.verification is not None and report.verification.passed
    proto = onnx.load(str(tmp_path / "dyn.onnx"))
    onnx.save(proto, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="ext.bin", size_threshold=0)
    (tmp_path / "ext.bin").unlink()
    with pytest.raises(InputError, match=r"its external data file 'ext.bin' is missing; copy it beside the .onnx"):
        api.inspect(tmp_path / "ext.onnx")
    proto = onnx.load(str(tmp_path / "dyn.onnx"))
    bn = next(n for n in proto.graph.node if n.op_type == "BatchNormalization")  # export_params=False: no values
    mean = next(t for t in proto.graph.initializer if t.name == bn.input[3])
    proto.graph.input.append(onnx.helper.make_tensor_value_info(mean.name, mean.data_type, list(mean.dims)))
    proto.graph.initializer.remove(mean)
    onnx.save(proto, str(tmp_path / "noparams.onnx"))
    with pytest.raises(InputError, match=rf"input '{mean.name}' is a parameter of BatchNormalization .*export_params"):
        api.inspect(tmp_path / "noparams.onnx")


def test_verify_an_onnx_original_against_its_fused_folder_answers_both_questions(digits, tmp_path):
    model, x = digits
    path = _export(model, x, tmp_path / "model.onnx", 17)
    api.fuse(path, tmp_path / "out", verify=None)
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(path), str(tmp_path / "out"), "--samples", "8", "--json"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)
    # the reference is described as fuse and inspect describe the same original (one OnnxFile.source)
    assert {**api.inspect(path).to_dict()["source"], "runtime": None} == verdict["reference"]
    assert verdict["reference"]["opset"] == 17
    v = verdict["verification"]
    assert v["question_1_exact"] is True and len(v["exact"]) == 2
    assert v["reference"].startswith("the reference ONNX graph in float64")
    assert all(c["reference"] == "float64" for c in v["checks"])
    # A fold off by 0.1% in one weight: question 1 names it, exit 1.
    import onnx_ir as ir

    fused = ir.load(str(tmp_path / "out" / "model.onnx"))
    name = next(n for n, v in fused.graph.initializers.items() if v.const_value is not None and v.const_value.size > 64)
    value = fused.graph.initializers[name]
    value.const_value = ir.tensor(value.const_value.numpy() * np.float32(1.001), name=name)
    ir.save(fused, str(tmp_path / "bad.onnx"))
    bad = runner.invoke(app, ["verify", str(path), str(tmp_path / "bad.onnx"), "--samples", "8", "--json"])
    assert bad.exit_code == 1
    exact = json.loads(bad.stdout)["verification"]["exact"]
    assert [c["passed"] for c in exact] == [True, False] and exact[1][
        "worst"
    ] == name  # the fold is right, the file not


class _Decomposed(nn.Module):
    """A BatchNorm written out as arithmetic, as some exporters emit it, before a Linear."""

    def __init__(self, c: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        for name in ("mean", "gamma", "beta"):
            self.register_buffer(name, torch.randn(c, generator=g))
        self.register_buffer("var", torch.rand(c, generator=g) + 0.5)
        self.fc = nn.Linear(c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((x - self.mean) / torch.sqrt(self.var + 1e-5) * self.gamma + self.beta)


class _LayerScale(nn.Module):
    """ViT's LayerScale: ``x + gamma * fc2(gelu(fc1(x)))`` (a residual reads it: it folds backward into fc2)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.gamma = nn.Parameter(torch.randn(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("opset", [17, 18])
def test_decomposed_batchnorm_and_layerscale_fold_away(tmp_path, opset):
    path = _export(_Decomposed().eval(), torch.randn(2, 5, 8), tmp_path / "bn.onnx", opset)
    report = api.fuse(path, tmp_path / "bn", verify=VerifyOptions(samples=8))
    assert [(d.kind, d.action) for d in report.folds] == [("Affine", "folded-forward")]
    assert report.verification is not None and report.verification.passed
    assert set(op_histogram(tmp_path / "bn" / "model.onnx")) <= {"MatMul", "Add", "Gemm"}
    path = _export(_LayerScale().eval(), torch.randn(2, 5, 8), tmp_path / "ls.onnx", opset)
    before = op_histogram(path)
    report = api.fuse(path, tmp_path / "ls", verify=VerifyOptions(samples=8))
    assert [(d.kind, d.action, d.reason) for d in report.folds] == [("LayerScale", "folded-backward", None)]
    assert report.verification is not None and report.verification.passed
    before.pop("Constant", None)  # a Constant node's tensor is written as an initializer
    assert op_histogram(tmp_path / "ls" / "model.onnx") == before - collections.Counter({"Mul": 1})


@pytest.mark.slow
def test_a_third_party_batchnorm_transformer_export_loses_every_batchnorm(tmp_path):
    """transformers' PatchTST with ``norm_type="batchnorm"`` (BatchNorm before q/k/v and the feed-forward),
    exported by the dynamo exporter: every BatchNorm folds, the outputs match."""
    patchtst = pytest.importorskip("transformers.models.patchtst")
    config = patchtst.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=2, ffn_dim=32, norm_type="batchnorm", scaling=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = randomize_norms(patchtst.PatchTSTForPrediction(config).eval(), seed=4)

    class Prediction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(past_values=x).prediction_outputs

    path = _export(Prediction(), torch.randn(2, 32, 3), tmp_path / "patchtst.onnx", 18, dynamo=True)
    assert op_histogram(path)["BatchNormalization"] == 4
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert [(d.kind, d.action) for d in report.folds] == [("BatchNorm", "folded-forward")] * 4
    assert report.verification is not None and report.verification.passed
    assert op_histogram(tmp_path / "out" / "model.onnx")["BatchNormalization"] == 0


def test_a_norm_on_the_graph_output_folds_backward_and_the_output_keeps_its_name(tmp_path):
    """``Linear(bias=False) -> BatchNorm1d`` on ``(B, C)``: the layer gets a created bias, the graph output is
    still ``y``."""
    model = randomize_norms(nn.Sequential(nn.Linear(8, 6, bias=False), nn.BatchNorm1d(6)).eval(), seed=7)
    path = _export(model, torch.randn(4, 8), tmp_path / "model.onnx", 17)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert [(d.action, d.reason) for d in report.folds] == [("folded-backward", None)]
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [o.name for o in fused.graph.output] == ["y"]
    assert "BatchNormalization" not in {n.op_type for n in fused.graph.node}
    assert report.verification is not None and report.verification.passed


@pytest.mark.slow
def test_levit_batchnorms_after_linears_fold_backward(tmp_path):
    """transformers' LeViT puts a BatchNorm after every Linear (``MLPLayerWithBN``): each folds into its Linear."""
    levit = pytest.importorskip("transformers.models.levit")
    config = levit.LevitConfig(
        image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
        key_dim=[8, 8, 8], patch_size=16, attention_ratio=[2, 2, 2], mlp_ratio=[2, 2, 2],
    )  # fmt: skip
    torch.manual_seed(0)
    model = randomize_norms(levit.LevitForImageClassification(config).eval(), seed=1)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=x).logits

    path = _export(Logits(), torch.randn(2, 3, 64, 64), tmp_path / "levit.onnx", 18)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    actions = collections.Counter(d.action for d in report.folds)
    assert actions == collections.Counter({"folded-backward": 22, "folded-forward": 1}), actions
    assert report.verification is not None and report.verification.passed
    assert op_histogram(tmp_path / "out" / "model.onnx")["BatchNormalization"] == 0


class _Joined(nn.Module):
    """A RepBN whose output goes through ``Concat``, ``Cast`` or a split (the TorchScript exporter's
    ``SplitToSequence`` of ``tensor_split``) before the Linear that absorbs it."""

    def __init__(self, kind: str, c: int = 8):
        super().__init__()
        self.kind = kind
        self.norm = RepBN(c)
        self.fc = nn.Linear({"channel-cat": 2 * c, "channel-split": c // 2, "crossed-roll": c // 2}.get(kind, c), c)
        self.cls_token = nn.Parameter(torch.randn(1, 1, c))
        if kind == "widen":
            self.fc = self.fc.double()
        if kind == "narrow":
            self.fc = self.fc.half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x)
        if self.kind == "token-cat":  # tokens split and put back together in another order
            return self.fc(torch.cat([z[:, 2:], z[:, :2]], dim=1))
        if self.kind == "cls-cat":  # a class token the norm did not produce
            return self.fc(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), z], dim=1))
        if self.kind == "channel-cat":
            return self.fc(torch.cat([z, z], dim=-1))
        if self.kind == "channel-roll":  # the channels rotated by slices put back together
            return self.fc(torch.cat([z[..., 3:], z[..., :3]], dim=-1))
        if self.kind == "crossed-roll":  # channel halves put one after the other on the token axis
            return self.fc(torch.cat([z[..., 4:], z[..., :4]], dim=1))
        if self.kind == "channel-split":
            return self.fc(z.tensor_split(2, -1)[1])
        if self.kind == "widen":
            return self.fc(z.double())
        return self.fc(z.half()).float()  # narrow


JOINED = [
    ("token-cat", "folded-forward", None),
    ("cls-cat", "kept-affine", reasons.CONCAT_WITH_UNNORMALIZED),
    ("channel-cat", "folded-forward", None),  # each piece holds whole channel blocks: the affine tiles
    ("channel-split", "folded-forward", None),  # the second half of the channels: their affine, not the first's
    ("channel-roll", "folded-forward", None),  # the affine of the channels each index holds, rotated
    ("crossed-roll", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.cat"),  # two channel sets on one axis
    ("widen", "folded-forward", None),
    ("narrow", "kept-affine", reasons.NARROWING_CAST),
]


def _naive_onnx(path: Path, out: Path) -> Path:
    """The careless fold: the norm's affine into every layer its walk reached, blocked paths ignored (the plan with
    its kept affines dropped)."""
    import onnx_ir as ir

    model = ir.load(str(path))
    lowered, plans = onnx_fold.plan_file(model, str(path))
    for p in plans:
        p.kept, p.remove = [], True
    onnx_apply.apply_plans(model, lowered, plans)
    ir.save(model, str(out))
    return out


def _same_conv(path: Path, kernel: int, kernel_attr: bool, shift: bool = True) -> Path:
    """``x -> BatchNormalization -> Conv(auto_pad=SAME_UPPER)``, a conv as jax2onnx writes it; ``kernel_shape`` is
    optional in ONNX (the weight's shape says it), so a file may leave it out. Without ``shift`` the norm's bias
    and mean are 0 (a scale of mixed signs alone)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {
        "conv.weight": rng.standard_normal((4, 4, kernel, kernel)),
        "bn.weight": rng.uniform(0.5, 2, 4),
        "bn.bias": 3 * rng.standard_normal(4),
        "bn.running_mean": rng.standard_normal(4),
        "bn.running_var": rng.uniform(0.5, 2, 4),
    }
    if not shift:
        arrays["bn.weight"] *= [1, -1, 1, -1]
        arrays["bn.bias"], arrays["bn.running_mean"] = np.zeros(4), np.zeros(4)
    inits = [numpy_helper.from_array(a.astype(np.float32), name) for name, a in arrays.items()]
    attrs = {"kernel_shape": [kernel, kernel]} if kernel_attr else {}
    nodes = [
        helper.make_node("BatchNormalization", ["x", *list(arrays)[1:]], ["n"], name="bn"),
        helper.make_node("Conv", ["n", "conv.weight"], ["y"], name="conv", auto_pad="SAME_UPPER", **attrs),
    ]
    x, y = (helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, [2, 4, 8, 8]) for v in ("x", "y"))
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("kernel_attr", [True, False], ids=["kernel_shape", "no-kernel_shape"])
@pytest.mark.parametrize(
    ("kernel", "action", "reason"), [(1, "folded-forward", None), (3, "kept-affine", reasons.PADDED_CONV_CONSUMER)]
)
def test_a_same_padded_conv_pads_by_its_kernel_whether_or_not_kernel_shape_is_written(
    tmp_path, kernel, kernel_attr, action, reason
):
    """``auto_pad=SAME_UPPER`` pads nothing around a 1x1 stride-1 kernel (the fold is exact) and pads a 3x3 one (the
    norm's shift would reach the zeros the conv reads at the border): the kernel is the attribute's, else the
    weight's."""
    import onnx_ir as ir

    path = _same_conv(tmp_path / "model.onnx", kernel, kernel_attr)
    model, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.reason) for d in decisions] == [(action, reason)]
    ir.save(model, str(tmp_path / "fused.onnx"))
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    y0 = _run(path, x)
    assert np.abs(_run(tmp_path / "fused.onnx", x) - y0).max() <= 1e-5 * np.abs(y0).max()
    if action == "kept-affine":  # the refusal is needed: the naive fold is far off
        y1 = _run(_naive_onnx(path, tmp_path / "naive.onnx"), x)
        assert np.abs(y1 - y0).max() / np.abs(y0).max() > 1e-3


def test_a_norm_without_shift_folds_into_a_padded_conv(tmp_path):
    """A norm whose every shift is 0 (bias and mean 0: Keras' ``Normalization`` layer before it is adapted, a
    LayerScale) scales the conv's padded zeros to zeros: it folds into the 3x3 ``SAME_UPPER`` conv, and the fused
    file computes the original's outputs (the same file with a shift keeps the affine, the test above)."""
    import onnx_ir as ir

    path = _same_conv(tmp_path / "model.onnx", 3, True, shift=False)
    model, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.into, d.reason) for d in decisions] == [("folded-forward", ["conv"], None)]
    ir.save(model, str(tmp_path / "fused.onnx"))
    assert "BatchNormalization" not in op_histogram(tmp_path / "fused.onnx")
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    y0 = _run(path, x)
    assert np.abs(_run(tmp_path / "fused.onnx", x) - y0).max() <= 1e-5 * np.abs(y0).max()
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert report.verification is not None and report.verification.passed


def _bn_initializers(rng: np.random.Generator, weights: dict[str, tuple[int, ...]], bias: float = 1.0) -> list:
    """Float32 initializers of a 4-channel ``BatchNormalization`` named ``bn`` (its weight, bias times ``bias``,
    running mean and variance, drawn from ``rng`` in that order: the node's inputs after ``x``, ``BN_INPUTS``), then
    of each of ``weights`` (name -> shape, standard normal, drawn after them)."""
    from onnx import numpy_helper

    arrays = {
        "bn.weight": rng.uniform(0.5, 2, 4),
        "bn.bias": bias * rng.standard_normal(4),
        "bn.running_mean": rng.standard_normal(4),
        "bn.running_var": rng.uniform(0.5, 2, 4),
    }
    arrays |= {name: rng.standard_normal(shape) for name, shape in weights.items()}
    return [numpy_helper.from_array(a.astype(np.float32), name) for name, a in arrays.items()]


BN_INPUTS = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]


def _gather_nd(path: Path, indices: list[list[int]], channels_first: bool) -> Path:
    """``x (6, 4) -> BatchNormalization -> GatherND(indices) -> MatMul``, as the dynamo exporter writes ``y[:, idx]``
    (``channels_first``: the ``GatherND`` between two ``Transpose``s, picking along the channels)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    index = np.array(indices, dtype=np.int64)
    k = len(indices) if index.shape[1] > 1 or channels_first else 4
    inits = _bn_initializers(rng, {"fc.weight": (k, 5)}, bias=3)
    inits.append(numpy_helper.from_array(index, "idx"))
    picked = ["t"] if channels_first else ["n"]
    nodes = [helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["n"], name="bn")]
    nodes += [helper.make_node("Transpose", ["n"], ["t"], perm=[1, 0])] if channels_first else []
    nodes += [helper.make_node("GatherND", [*picked, "idx"], ["g"], name="gather")]
    nodes += [helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 0])] if channels_first else []
    nodes += [helper.make_node("MatMul", ["gt" if channels_first else "g", "fc.weight"], ["y"], name="fc")]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [6, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


GATHER_ND = [
    # rows (tokens) picked: the channels pass whole
    ("tokens", [[4], [0], [2]], False, "folded-forward", None),
    # channels picked, in their order (a repeat too): the affine of the channels picked
    ("channels", [[3], [1], [3]], True, "folded-forward", None),
    # (token, channel) pairs: each output element from its own channel, mixed along one axis
    ("mixed", [[4, 1], [0, 3], [2, 2], [1, 0]], False, "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.index"),
]


@pytest.mark.parametrize(("indices", "channels_first", "action", "reason"), [c[1:] for c in GATHER_ND],
                         ids=[c[0] for c in GATHER_ND])  # fmt: skip
def test_a_gather_nd_folds_what_it_picks_and_keeps_what_it_mixes(tmp_path, indices, channels_first, action, reason):
    """A ``GatherND`` is ``aten.index`` over its first axes: picked tokens or channels fold; indices that pair
    tokens with channels put elements of different channels on one axis, and the norm is kept (the naive fold,
    which takes the gathered axis for channels, is far off)."""
    import onnx_ir as ir

    path = _gather_nd(tmp_path / "model.onnx", indices, channels_first)
    model, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.reason, d.into) for d in decisions] == [(action, reason, ["fc"] if reason is None else [])]
    ir.save(model, str(tmp_path / "fused.onnx"))
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32) * 2 + 1
    y0 = _run(path, x)
    assert np.abs(_run(tmp_path / "fused.onnx", x) - y0).max() <= 1e-5 * np.abs(y0).max()
    if action == "kept-affine":
        y1 = _run(_naive_onnx(path, tmp_path / "naive.onnx"), x)
        assert np.abs(y1 - y0).max() / np.abs(y0).max() > 1e-3


@pytest.mark.parametrize(("kind", "action", "reason"), JOINED, ids=[c[0] for c in JOINED])
def test_concat_and_cast_pass_where_they_commute_and_block_where_not(tmp_path, kind, action, reason):
    torch.manual_seed(0)
    model = randomize_norms(_Joined(kind).eval(), seed=3)
    x = torch.randn(2, 5, 8)
    if kind == "narrow":  # float32 inputs beyond float16's range, a norm that brings them back into it
        with torch.no_grad():
            model.norm.bn.running_var.fill_(1e6)
            model.norm.alpha.fill_(1e-4)
        x = x * 3e4
    path = _export(model, x, tmp_path / "model.onnx", 17)
    assert op_histogram(path)[
        {"widen": "Cast", "narrow": "Cast", "channel-split": "SplitToSequence"}.get(kind, "Concat")
    ]
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=np.concatenate([x.numpy(), x.numpy() * 0.5]))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(inputs=inputs))
    (decision,) = report.folds
    assert (decision.action, decision.reason) == (action, reason)
    assert report.verification is not None and report.verification.passed
    if action == "kept-affine":  # the refusal is needed: the naive fold is far off (or inf)
        y0 = _run(path, x.numpy())
        y1 = _run(_naive_onnx(path, tmp_path / "naive.onnx"), x.numpy())
        assert not np.isfinite(y1).all() or np.abs(y1 - y0).max() / np.abs(y0).max() > 1e-3


def test_a_bfloat16_original_is_refused_with_its_dtype_named_and_folds_unverified(tmp_path):
    """onnxruntime's CPU provider has no bfloat16 BatchNormalization: question 2 cannot run, so ``fuse`` refuses
    with one line naming the dtype (nothing written); without verification the fold is the float64 fold rounded
    once to bfloat16 (question 1's tensors, checked here by hand)."""
    model = randomize_norms(_Model("plain").eval(), seed=1).to(torch.bfloat16)
    path = _export(model, torch.randn(2, 5, 8, dtype=torch.bfloat16), tmp_path / "model.onnx", 18)
    with pytest.raises(InputError, match=r"onnxruntime cannot run this bfloat16 model \(.*verify=None"):
        api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert not (tmp_path / "out").exists()
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert [d.action for d in report.folds] == ["folded-forward"]
    fused64, _ = onnx_in.fold_onnx(path, as_float64=True)
    written = onnx_original.float_tensors(tmp_path / "out" / "model.onnx")
    want = onnx_original.stored_tensors(fused64, float64=True)
    assert written and all(t.dtype == torch.bfloat16 for t in written.values())
    for name, tensor in written.items():
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name


def test_a_graph_exported_in_training_mode_is_refused_before_verification_blames_the_fold(tmp_path):
    """The dynamo exporter keeps a module's training mode: a dropout then draws random numbers on every run, the
    original disagrees with itself and question 1 would call a correct fold wrong."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 8),), str(path), dynamo=True, opset_version=18)
    assert {"RandomUniformLike", "Bernoulli", "Dropout"} & set(op_histogram(path))
    with pytest.raises(InputError, match=r"the graph draws random numbers \(.*export the model after model.eval\(\)"):
        api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert api.fuse(_export(model.eval(), torch.randn(2, 8), tmp_path / "e.onnx", 18, dynamo=True), tmp_path / "ok",
                    verify=VerifyOptions(samples=2)).verification.passed  # fmt: skip


def test_a_wrong_fold_of_an_onnx_original_writes_nothing_and_its_report_names_no_file(tmp_path, monkeypatch):
    """The ONNX driver finishes like every fuse (``pipeline.finish``): a failed check is an exit-1 error, nothing is
    written, and the report it carries names no output file."""
    import onnx_ir as ir

    from slabconv import onnx_in
    from slabconv.errors import VerificationError

    model = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 2, stride=2, padding=0))
    randomize_norms(model.eval(), seed=1)
    path = _export(model, torch.randn(2, 4, 8, 8), tmp_path / "model.onnx", 18)
    real = onnx_in.fold_onnx

    def off_by_one_weight(*args, **kwargs):
        folded, decisions = real(*args, **kwargs)
        value = next(v for v in folded.graph.initializers.values() if v.const_value is not None and v.shape.rank() == 4)
        array = value.const_value.numpy().copy()
        array.flat[0] += 0.5
        value.const_value = ir.tensor(array)
        return folded, decisions

    monkeypatch.setattr(onnx_in, "fold_onnx", off_by_one_weight)
    with pytest.raises(VerificationError, match="not equivalent") as caught:
        api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert caught.value.report.outputs is None
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_simplify_writes_a_smaller_graph_verified_like_any_other(digits, tmp_path):
    """``--simplify`` runs onnxscript's optimizer on the fused graph: fewer nodes, the mark in its metadata, and both
    questions answered on it (question 1's float64 fold simplified the same way), in ``fuse`` and in ``verify``."""
    model, x = digits
    path = _export(model, x, tmp_path / "model.onnx", 17)
    plain = api.fuse(path, tmp_path / "plain", verify=None)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8), write=WriteOptions(simplify=True))
    assert report.verification is not None and report.verification.passed
    assert report.verification.exact and all(c.passed for c in report.verification.exact)
    info = report.outputs.onnx_info["simplified"]
    before, after = sum(op_histogram(tmp_path / "plain" / "model.onnx").values()), info["nodes_after"]
    assert info["nodes_before"] == before and after < before
    assert sum(op_histogram(tmp_path / "out" / "model.onnx").values()) == after
    assert [d.action for d in plain.folds] == [d.action for d in report.folds]
    result = CliRunner().invoke(app, ["verify", str(path), str(tmp_path / "out"), "--samples", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verification"]["question_1_exact"] is True
    with pytest.raises(UsageError, match="--simplify simplifies model.onnx"):
        api.fuse(path, tmp_path / "no", write=WriteOptions(simplify=True, onnx=False))


def test_simplify_is_no_larger_than_onnxslim_on_the_original(tmp_path):
    """transformers' PVTv2 (a tiny config, TorchScript export with a static batch): onnxslim's ``FusionGemm`` turns
    each ``MatMul`` on 3-D tokens and its bias ``Add`` into ``Reshape`` -> ``Gemm`` -> ``Reshape``; on the fused
    graph, whose shapes slabconv's preparation resolved, it did so where it does not on the export, and
    ``--simplify`` was larger than onnxslim's output on the original (94 nodes against 89 at 64 x 64). onnxslim
    without that pattern is tried too, and the smaller graph kept, named in the mark; question 1 repeats it."""
    import onnxslim
    import transformers

    config = transformers.PvtV2Config(
        depths=[1, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], sr_ratios=[2, 1], patch_sizes=[7, 3],
        strides=[4, 2], num_encoder_blocks=2, mlp_ratios=[2, 2], num_labels=5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.PvtV2ForImageClassification(config).eval()
    model.config.return_dict = False
    path = tmp_path / "pvt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 3, 32, 32),), str(path), dynamo=False, opset_version=17)  # batch 2
        theirs = len(onnxslim.slim(onnx.load(str(path))).graph.node)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4), write=WriteOptions(simplify=True))
    assert report.verification is not None and report.verification.passed
    assert report.verification.exact and all(c.passed for c in report.verification.exact)
    ours = sum(op_histogram(tmp_path / "out" / "model.onnx").values())
    assert ours <= theirs, (ours, theirs)
    assert report.outputs.onnx_info["simplified"]["simplifiers"][-1].endswith(" without FusionGemm"), (ours, theirs)


class _RepVGG(nn.Module):
    """A RepVGG block (PP-LCNetV3's): ``relu(bn1(conv3x3(x)) + bn2(conv1x1(x)) + bn3(x))``, whose identity-branch
    ``bn3`` reads ``x`` that both convs read too (the exporter folds ``bn1`` and ``bn2`` into their convs), then a
    BatchNorm read by a 1x1 conv and by the residual around it (``pw(z) + z``)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.c3, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c1, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.bn3, self.bn, self.pw = nn.BatchNorm2d(c), nn.BatchNorm2d(c), nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        z = self.bn(torch.relu(self.bn1(self.c3(x)) + self.bn2(self.c1(x)) + self.bn3(x)))
        return self.pw(z) + z


def test_a_kept_batchnorm_on_nchw_stays_one_node_no_larger_than_onnxslim(tmp_path):
    """A kept affine on the channel axis 1 of an NCHW tensor is one ``BatchNormalization`` (scale ``s``, bias ``t``,
    mean 0, variance 1, epsilon 0: exactly ``x * s + t``), not a ``Mul`` and an ``Add``: the RepVGG block's
    identity-branch BatchNorm (kept whole, ``residual-reads-norm``) and the BatchNorm the residual reads beside the
    conv it folds into were each two nodes where the export and onnxslim have one, and ``fuse --simplify`` of
    PP-LCNetV3 was larger than onnxslim's output of the export by one node per such BatchNorm."""
    import onnxslim

    torch.manual_seed(0)
    model = randomize_norms(_RepVGG().eval(), seed=5)
    path = _export(model, torch.randn(2, 3, 8, 8), tmp_path / "repvgg.onnx", 17)
    original = op_histogram(path)
    assert original["BatchNormalization"] == 2 and original["Mul"] == 0  # bn1, bn2 are in their convs already
    theirs = len(onnxslim.slim(onnx.load(str(path))).graph.node)
    for simplify in (False, True):
        out = tmp_path / f"out-{simplify}"
        report = api.fuse(path, out, verify=VerifyOptions(samples=4), write=WriteOptions(simplify=simplify))
        assert report.verification is not None and report.verification.passed
        assert report.verification.exact and all(c.passed for c in report.verification.exact)
        actions = {d.norm.rsplit(".", 1)[-1]: (d.action, d.reason) for d in report.folds}
        assert actions == {"bn3": ("kept-affine", reasons.RESIDUAL_READS_NORM),
                           "bn": ("kept-affine", reasons.RESIDUAL_READS_NORM)}, actions  # fmt: skip
        fused = op_histogram(out / "model.onnx")
        assert fused == original, (simplify, fused, original)  # bn's affine is in pw now, each kept one a node
        assert sum(fused.values()) <= theirs
        bn = [n for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "BatchNormalization"]
        assert [a.f for n in bn for a in n.attribute if a.name == "epsilon"] == [0.0, 0.0]
        x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(_run(out / "model.onnx", x), _run(path, x), rtol=1e-5, atol=1e-5)


class _AIFI(nn.Module):
    """RT-DETR's AIFI encoder layer with RepBN norms, as the RT-DETR / YOLO repositories copy it from the SLAB code
    (``src.permute(0, 2, 1).view([-1, c, h, w])`` back to the feature map), then the neck's 1x1 conv."""

    def __init__(self, c: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.ma = nn.MultiheadAttention(c, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(c, hidden), nn.Linear(hidden, c)
        self.norm1, self.norm2 = RepBN(c), RepBN(c)
        self.conv = nn.Conv2d(c, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = x.shape[1:]
        src = x.flatten(2).permute(0, 2, 1)
        src = self.norm1(src + self.ma(src, src, value=src)[0])
        src = self.norm2(src + self.fc2(torch.nn.functional.gelu(self.fc1(src))))
        return self.conv(src.permute(0, 2, 1).view([-1, c, h, w]))


def test_rt_detr_aifi_exported_with_a_dynamic_batch_folds_its_output_norm_into_the_neck(tmp_path):
    """``yolo export dynamic=True`` writes the TorchScript export with a dynamic batch: ``view(-1, c, h, w)`` becomes
    a Reshape whose target ONNX's own shape inference cannot resolve; the channels stay whole, and the norm folds
    into the 1x1 conv as it does in the program (shapes inferred again once the shape arithmetic is folded)."""
    from slabconv import engine

    model = randomize_norms(_AIFI().eval(), seed=2)
    x = torch.randn(2, 16, 4, 4)
    path = _export(model, x, tmp_path / "aifi.onnx", 17)
    program = [(d.norm, d.action, d.reason, d.into) for d in engine.fold_all(engine.capture(model, x))]
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.norm, d.action, d.reason, d.into) for d in report.folds] == program
    assert program[1] == ("norm2", "folded-forward", None, ["conv"])
    assert report.verification is not None and report.verification.passed


@pytest.mark.parametrize(("c_in", "c_out", "group"), [(8, 4, 2), (4, 4, 4)])
def test_the_float64_reference_runs_a_grouped_conv_transpose_as_torch_does(tmp_path, c_in, c_out, group):
    """onnxruntime has no float64 ``ConvTranspose``, so the float64 reference falls to onnx's reference evaluator,
    whose grouped branch raises (8 -> 4 channels, 2 groups) or returns a wrong tensor (depthwise, 4 groups): each
    group goes through its ``group = 1`` path, and the reference equals torch's ``conv_transpose2d`` in float64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((c_in, c_out // group, 3, 3)), rng.standard_normal(c_out)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=group, strides=[2, 2], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, c_in, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, c_out, 9, 9])],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")],
    )
    path = tmp_path / "convt.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = rng.standard_normal((2, c_in, 5, 5)).astype(np.float32)
    (got,), which = onnx_original.float64_reference(path, x, "float32", None)
    assert which.startswith("onnx.reference")
    want = torch.nn.functional.conv_transpose2d(
        torch.tensor(x, dtype=torch.float64),
        torch.tensor(w.astype(np.float32), dtype=torch.float64),
        torch.tensor(b.astype(np.float32), dtype=torch.float64),
        stride=2,
        padding=1,
        groups=group,
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "attrs"),
    [
        ((2, 4, 5, 5), {"strides": [2, 2], "pads": [1, 0, 2, 1], "output_padding": [1, 0]}),
        ((2, 4, 5, 6), {"strides": [2, 3], "dilations": [2, 1], "pads": [0, 1, 0, 1]}),
        ((2, 4, 7), {"strides": [2], "pads": [1, 1], "output_padding": [1]}),
        ((1, 4, 3, 3, 3), {"strides": [2, 2, 2], "pads": [1, 1, 1, 0, 0, 0]}),
    ],
)
def test_the_float64_reference_runs_a_conv_transpose_by_torch_as_onnx_defines_it(tmp_path, monkeypatch, shape, attrs):
    """The float64 reference's ``ConvTranspose`` (onnxruntime has no float64 kernel) is torch's
    ``conv_transpose1d/2d/3d``, not onnx's reference, which scatters in Python (minutes for a fold of ViTPose's small
    deconvolution head); with asymmetric pads, output padding and dilation it equals onnx's own ``group = 1``
    reference, the spec's definition, in float64."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(0)
    spatial = len(shape) - 2
    w, b = rng.standard_normal((4, 3, *[3] * spatial)), rng.standard_normal(3)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    get = {"strides": [1] * spatial, "dilations": [1] * spatial, "output_padding": [0] * spatial, **attrs}.__getitem__
    sizes = [  # the spec's output size: s (n - 1) + output_padding + d (k - 1) + 1 - pads at both ends
        s * (n - 1) + o + d * 2 + 1 - p - e
        for n, s, o, d, p, e in zip(
            shape[2:], get("strides"), get("output_padding"), get("dilations"), get("pads")[:spatial],
            get("pads")[spatial:], strict=True,
        )
    ]  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, *shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3, *sizes])],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "convt.onnx"))
    x = rng.standard_normal(shape).astype(np.float32)
    name = f"conv_transpose{spatial}d"
    calls, plain = [], getattr(torch.nn.functional, name)
    monkeypatch.setattr(torch.nn.functional, name, lambda *a, **k: calls.append(1) or plain(*a, **k))
    (got,), which = onnx_original.float64_reference(tmp_path / "convt.onnx", x, "float32", None)
    assert which.startswith("onnx.reference") and calls
    for t in graph.initializer:  # the spec's own reference in float64: onnx's evaluator, group 1
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    graph.input[0].type.tensor_type.elem_type = graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    (want,) = ReferenceEvaluator(model).run(None, {"x": x.astype(np.float64)})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


class _TopKQueries(nn.Module):
    """RT-DETR's query selection in small: a conv and its BatchNorm, then ``torch.gather`` of the top-k of the 100
    flattened positions (a ``GatherElements`` on an axis of 100 entries, behind a conv), along ``dim``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.head(self.bn(self.conv(x))).flatten(2)  # (N, 4, 100)
        index = tokens[:, :1].topk(5, dim=-1).indices.expand(-1, 4, -1)
        return torch.gather(tokens, self.dim, index)


def _preserved_export(model: torch.nn.Module, x: torch.Tensor, path: Path) -> Path:
    """``model`` exported by the TorchScript exporter at opset 17 with ``training=PRESERVE``: each BatchNorm stays a
    node, not folded into the conv before it in float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preserve = torch.onnx.TrainingMode.PRESERVE
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, training=preserve)
    return path


def _assert_onnx_reference_is_torchs(path: Path, model: torch.nn.Module, x: torch.Tensor) -> None:
    """The float64 reference of the ONNX file at ``path``, run by onnx's reference evaluator (onnxruntime has no
    float64 ``Conv``), equals ``model`` run by torch in float64 on ``x``."""
    (got,), which = onnx_original.float64_reference(path, x.numpy(), "float32", None)
    assert which.startswith("onnx.reference")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [2, -1])
def test_a_gather_over_more_than_64_entries_behind_a_conv_is_verified(tmp_path, dim):
    """onnxruntime has no float64 ``Conv``, so the float64 reference falls to onnx's reference evaluator, whose
    ``GatherElements`` raised on an axis of more than 64 entries (``np.choose``: ``fuse`` of RT-DETR ended in an
    internal error) and on a negative axis (its shape check slices ``shape[dim + 1:]``). The reference equals
    torch's ``gather`` in float64, and the norm folds and is verified."""
    model = randomize_norms(_TopKQueries(dim).eval(), seed=3)
    x = torch.randn(2, 3, 10, 10)
    path = _preserved_export(model, x, tmp_path / "topk.onnx")
    _assert_onnx_reference_is_torchs(path, model, x)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.norm, d.action) for d in report.folds] == [("bn", "folded-forward")]
    assert report.verification is not None and report.verification.passed


@pytest.mark.parametrize(("opset", "mode"), [(16, "bilinear"), (16, "bicubic"), (20, "linear"), (20, "cubic")])
def test_the_float64_reference_runs_a_grid_sample_of_either_opsets_mode_names(tmp_path, opset, mode):
    """A ``Conv`` sends the float64 reference to onnx's reference evaluator, whose ``GridSample`` raised on opset
    16's mode names (``bilinear``, ``bicubic``: the TorchScript exporter's below opset 20, RT-DETR's deformable
    attention), an internal error of ``fuse``, and computed the grid's coordinates in float32 at opset 20. The
    reference equals torch's conv and ``grid_sample`` in float64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w, grid = rng.standard_normal((4, 3, 1, 1)), rng.uniform(-1.2, 1.2, (2, 3, 4, 2))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"]),
        helper.make_node("GridSample", ["h", "grid"], ["y"], mode=mode, padding_mode="zeros", align_corners=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3, 4])],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(grid.astype(np.float32), "grid")],
    )
    path = tmp_path / "grid.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    (got,), which = onnx_original.float64_reference(path, x, "float32", None)
    assert which.startswith("onnx.reference")
    as64 = [torch.tensor(a.astype(np.float32), dtype=torch.float64) for a in (x, w, grid)]
    torch_mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    want = torch.nn.functional.grid_sample(
        torch.nn.functional.conv2d(as64[0], as64[1]), as64[2], mode=torch_mode, align_corners=False
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_initializers_and_modules_named_as_python_keywords_fold(tmp_path):
    """fx writes each stored tensor's target into Python code (``self.in.weight``): a norm statistic named ``is``
    and a conv in a module scope named ``in`` (``nn.ModuleDict({"in": ...})``, the TorchScript exporter's
    ``/in/Conv``) were an internal error (a ``SyntaxError``) before anything was planned. Such a part of a layer's
    name gets a ``_`` after it."""
    from onnx import helper

    rng = np.random.default_rng(0)
    inits = _bn_initializers(rng, {"onnx::Conv_9": (3, 4, 1, 1)})
    inits[0].name = "is"
    nodes = [
        helper.make_node("BatchNormalization", ["x", "is", *BN_INPUTS[1:]], ["n"], name="/lambda/BatchNormalization"),
        helper.make_node("Conv", ["n", "onnx::Conv_9"], ["y"], name="/in/Conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 5, 5])],
        inits,
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.norm, d.action, d.into) for d in report.folds] == [("lambda", "folded-forward", ["in_"])]
    assert report.verification is not None and report.verification.passed


@pytest.mark.parametrize("name", ["onnx::Mul_12", "onnx__Mul_12"])
def test_a_layerscale_of_an_exporters_constant_is_named_by_its_module(tmp_path, name):
    """The TorchScript exporter stores a LayerScale's ``gamma.view(1, -1, 1, 1)`` as a constant of its own
    (``onnx::Mul_12``; ``onnx__Mul_12`` once a tool has made the names identifiers) read by ``/ls/Mul``: the norm is
    ``ls``, as the checkpoint names it, under either spelling (the second was taken for a parameter's path and
    named the norm)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {"c1.weight": rng.standard_normal((4, 3, 1, 1)), name: rng.uniform(0.5, 1.5, (1, 4, 1, 1))}
    arrays["c2.weight"] = rng.standard_normal((2, 4, 1, 1))
    nodes = [
        helper.make_node("Conv", ["x", "c1.weight"], ["a"], name="/c1/Conv"),
        helper.make_node("Mul", ["a", name], ["b"], name="/ls/Mul"),
        helper.make_node("Relu", ["b"], ["r"], name="/Relu"),
        helper.make_node("Conv", ["r", "c2.weight"], ["y"], name="/c2/Conv"),
    ]
    info = [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, [2, c, 5, 5]) for k, c in (("x", 3), ("y", 2))]
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    path = tmp_path / "model.onnx"
    graph = helper.make_graph(nodes, "g", info[:1], info[1:], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.inspect(path)
    assert [(d.norm, d.kind, d.action, d.into) for d in report.folds] == [
        ("ls", "LayerScale", "folded-backward", ["c1"])
    ]


@pytest.mark.parametrize(
    ("opset", "padding", "action", "reason"),
    [
        (16, "border", "folded-forward", None),
        (20, "reflection", "folded-forward", None),
        (16, "zeros", "kept-affine", reasons.ZERO_PADDING_AFTER_NORM),
    ],
)
def test_a_grid_sample_passes_a_shift_unless_it_samples_zeros_outside(tmp_path, opset, padding, action, reason):
    """``x -> BatchNormalization -> GridSample -> 1x1 Conv``, a grid reaching outside the input: border and
    reflection padding sample input elements there, so the norm's affine commutes and folds into the conv; zeros
    padding samples zeros, which the folded shift would move (the naive fold is far off). The ``padding_mode``
    attribute was not read (every ``GridSample`` kept as zeros)."""
    import onnx_ir as ir
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = _bn_initializers(rng, {"conv.weight": (3, 4, 1, 1)})
    grid = rng.uniform(-1.4, 1.4, (2, 5, 6, 2)).astype(np.float32)
    mode = "linear" if opset >= 20 else "bilinear"
    nodes = [
        helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["n"], name="bn"),
        helper.make_node("GridSample", ["n", "grid"], ["g"], mode=mode, padding_mode=padding, align_corners=0),
        helper.make_node("Conv", ["g", "conv.weight"], ["y"], name="conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 4, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 5, 6])],
        [*inits, numpy_helper.from_array(grid, "grid")],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    model, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.reason) for d in decisions] == [(action, reason)]
    x = np.random.default_rng(1).standard_normal((2, 4, 4, 4)).astype(np.float32)
    y0 = _run(path, x)
    naive = np.abs(_run(_naive_onnx(path, tmp_path / "naive.onnx"), x) - y0).max() / np.abs(y0).max()
    assert naive > 1e-3 if action == "kept-affine" else naive < 1e-5
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.action, d.reason) for d in report.folds] == [(action, reason)]
    assert report.verification is not None and report.verification.passed


@pytest.mark.parametrize("opset", [13, 15])
def test_the_float64_reference_runs_an_inference_batchnorm_with_its_stored_statistics(tmp_path, opset):
    """A ``Conv`` (no float64 kernel in onnxruntime) sends the float64 reference to onnx's reference evaluator,
    whose ``BatchNormalization`` 9 (opsets 9 to 13, as tf2onnx and older TorchScript exports write it) used the
    batch's statistics: question 1 then failed a right fold. The reference equals torch's conv and inference
    batch norm in float64 at every opset."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 1, 1)).astype(np.float32)
    stats = [rng.uniform(0.5, 1.5, 4), rng.uniform(-1, 1, 4), rng.uniform(-1, 1, 4), rng.uniform(0.5, 2, 4)]
    names = ["gamma", "beta", "mean", "var"]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("BatchNormalization", ["c", *names], ["y"], epsilon=1e-3),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 5, 5])],
        [numpy_helper.from_array(w, "w")]
        + [numpy_helper.from_array(a.astype(np.float32), n) for a, n in zip(stats, names, strict=True)],
    )
    path = tmp_path / "bn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    (got,), which = onnx_original.float64_reference(path, x, "float32", None)
    assert which.startswith("onnx.reference")
    gamma, beta, mean, var = (torch.tensor(a.astype(np.float32), dtype=torch.float64) for a in stats)
    conv = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
    eps = float(np.float32(1e-3))  # the attribute is a float32
    want = torch.nn.functional.batch_norm(conv, mean, var, gamma, beta, training=False, eps=eps)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_a_norm_an_if_branch_reads_keeps_its_affine_inside_the_branch(tmp_path):
    """A BatchNorm that a Conv and both branches of an ``If`` read (an outer-scope read, no input of the ``If``):
    the Conv takes the fold, the ``If`` blocks (``unsupported-op:onnx.If``) and its branches read the kept affine.
    Redirecting the branches to the norm's input (the fold without the affine) changed the output by 17% with
    ``--no-verify``; here the fused file computes the original's outputs down both branches."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    out4 = helper.make_tensor_value_info
    branches = {
        key: helper.make_graph(
            [helper.make_node("Conv", ["n", w], [o])], key, [], [out4(o, TensorProto.FLOAT, [2, 4, 3, 3])]
        )
        for key, w, o in (("then_branch", "k1", "o1"), ("else_branch", "k2", "o2"))
    }
    nodes = [
        helper.make_node("Conv", ["x", "k0"], ["c0"], name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu"),
        helper.make_node("BatchNormalization", ["r0", "g", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Conv", ["n", "k1"], ["c1"], name="conv1"),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["branch"], name="if", **branches),
        helper.make_node("Add", ["c1", "branch"], ["y"]),
    ]
    arrays = {
        "k0": rng.standard_normal((6, 3, 1, 1)),
        "g": rng.uniform(0.5, 1.5, 6),
        "b": rng.uniform(-1, 1, 6),
        "m": rng.uniform(-1, 1, 6),
        "v": rng.uniform(0.5, 2, 6),
        "k1": rng.standard_normal((4, 6, 1, 1)),
        "k2": rng.standard_normal((4, 6, 1, 1)),
        "zero": np.array(0.0),
    }
    graph = helper.make_graph(
        nodes,
        "g",
        [out4("x", TensorProto.FLOAT, [2, 3, 3, 3])],
        [out4("y", TensorProto.FLOAT, [2, 4, 3, 3])],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()],
    )
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert [(d.action, d.reason) for d in report.folds] == [("kept-affine", "unsupported-op:onnx.If")]
    (kept,) = [
        n for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node if n.op_type == "BatchNormalization"
    ]
    assert kept.name == "bn/kept_affine"  # the norm's own node went, the kept affine reads its input
    x = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    for sample in (x, -x):  # one input down each branch
        want, got = _run(path, sample), _run(tmp_path / "out" / "model.onnx", sample)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_quantized_graph_is_refused_in_one_line_and_its_dequantized_weights_are_no_constants(tmp_path):
    """onnxruntime's ``quantize_static`` writes a norm's weight as ``DequantizeLinear`` of an int8 initializer
    and rounds every activation (``QuantizeLinear``): no fold into it is exact, so ``inspect`` / ``fuse`` refuse
    the file in one line. The engine never runs an opaque ONNX node, so a value computed through one is no
    constant (evaluating it was an internal error)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from slabconv.errors import UnsupportedModelError

    rng = np.random.default_rng(0)
    f32 = {
        "k0": rng.standard_normal((4, 3, 1, 1)),
        "beta": rng.uniform(-1, 1, 4),
        "mean": rng.uniform(-1, 1, 4),
        "var": rng.uniform(0.5, 2, 4),
        "k1": rng.standard_normal((2, 4, 1, 1)),
        "scale": np.array(0.01),
    }
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in f32.items()]
    inits.append(numpy_helper.from_array(rng.integers(50, 127, 4).astype(np.int8), "gamma_q"))
    nodes = [
        helper.make_node("Conv", ["x", "k0"], ["c0"]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("DequantizeLinear", ["gamma_q", "scale"], ["gamma"]),
        helper.make_node("BatchNormalization", ["r0", "gamma", "beta", "mean", "var"], ["n"], name="bn"),
        helper.make_node("Conv", ["n", "k1"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, str(tmp_path / "qdq.onnx"))
    with pytest.raises(InputError, match=r"a quantized graph \(1 DequantizeLinear, as .*fold the float"):
        api.inspect(tmp_path / "qdq.onnx")
    with pytest.raises(UnsupportedModelError, match=r"BatchNorm node .*computed, not stored"):
        onnx_fold.plan_file(ir.from_proto(proto))


def test_an_original_no_float64_evaluator_runs_is_named_not_an_internal_error(tmp_path):
    """onnxruntime's optimizer writes its own ops (``com.microsoft`` ``BiasGelu``): onnxruntime has no float64
    kernel for them and onnx's reference evaluator does not know them, so question 1 cannot run; one line says
    so and what to do."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    node = helper.make_node("BiasGelu", ["x", "b"], ["y"], domain="com.microsoft", name="c0")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
        [numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(tmp_path / "ort.onnx"))
    x = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    with pytest.raises(InputError, match=r"runs neither in onnxruntime .*BiasGelu.*or pass --no-verify") as err:
        onnx_original.float64_reference(tmp_path / "ort.onnx", x, "float32", None)
    assert "(onnxruntime's basic level, ORT_ENABLE_BASIC, writes none)" in str(err.value)
    assert errordoc.documented(f"error: {err.value}") is not None


def test_pads_computed_from_a_static_size_under_a_dynamic_batch_fold_as_the_zeros_they_are(tmp_path):
    """Swin's window padding as the TorchScript exporter writes it under a dynamic batch: the ``Pad`` amounts are
    computed from ``x.size(2)`` (``Gather`` of a scalar index from ``Shape``), static where the batch is not.
    onnxscript's folder gathers only 1-D indices from a shape, so the pads stayed computed and the norm before
    the ``Pad`` was kept (``unsupported-op:onnx.Pad``); the size is now a constant, the pads fold to zeros and the
    norm folds into the conv after the ``Pad``, verified."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {
        "k0": rng.standard_normal((4, 3, 1, 1)),
        "g": rng.uniform(0.5, 1.5, 4),
        "b": rng.uniform(-1, 1, 4),
        "m": rng.uniform(-1, 1, 4),
        "v": rng.uniform(0.5, 2, 4),
        "k1": rng.standard_normal((2, 4, 1, 1)),
    }
    ints = {"two": np.array(2), "window": np.array(4), "zeros": np.zeros(6), "axis0": np.array([0])}
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    inits += [numpy_helper.from_array(a.astype(np.int64), k) for k, a in ints.items()]
    nodes = [
        helper.make_node("Conv", ["x", "k0"], ["c0"]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("BatchNormalization", ["r0", "g", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Shape", ["n"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["h"]),
        helper.make_node("Mod", ["h", "window"], ["rest"]),
        helper.make_node("Unsqueeze", ["rest", "axis0"], ["rest1"]),
        helper.make_node("Concat", ["zeros", "rest1", "rest1"], ["pads"], axis=0),
        helper.make_node("Pad", ["n", "pads"], ["p"]),
        helper.make_node("Conv", ["p", "k1"], ["y"], name="conv1"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 4, 4])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "pad.onnx"))
    report = api.fuse(tmp_path / "pad.onnx", tmp_path / "out", verify=VerifyOptions(samples=2))
    assert [(d.action, d.reason, d.into) for d in report.folds] == [("folded-forward", None, ["k1"])]  # by its weight
    assert report.verification is not None and report.verification.passed


@pytest.mark.parametrize(("size", "kernel", "pads"), [(7, 5, 0), (1, 64, 0), (6, 3, 1)])
def test_the_float64_reference_averages_a_ceil_mode_pool_over_what_each_window_covers(tmp_path, size, kernel, pads):
    """onnx's reference ``AveragePool`` pads the input out to whole windows under ``ceil_mode``: a 5x5 window of
    stride 5 on a 7x7 map got a wrong mean, a 64-wide window on a 1x1 map (transformers' EfficientNet pooler,
    ``AvgPool2d(1280, ceil_mode=True)``) NaN. Behind a ``Conv`` (no float64 kernel in onnxruntime) the reference is
    torch's ``avg_pool2d`` in float64, as onnxruntime computes it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 1, 1)).astype(np.float32)
    out = -(-(size + 2 * pads - kernel) // kernel) + 1  # ceil_mode
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node(
            "AveragePool", ["c"], ["y"], kernel_shape=[kernel] * 2, strides=[kernel] * 2, pads=[pads] * 4, ceil_mode=1
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2, out, out])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "pool.onnx"))
    x = rng.standard_normal((2, 3, size, size)).astype(np.float32)
    (got,), which = onnx_original.float64_reference(tmp_path / "pool.onnx", x, "float32", None)
    assert which.startswith("onnx.reference")
    conv = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
    want = torch.nn.functional.avg_pool2d(conv, kernel, kernel, pads, ceil_mode=True, count_include_pad=False)
    session = ort.InferenceSession(str(tmp_path / "pool.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want.numpy(), rtol=1e-5, atol=1e-6)  # as onnxruntime
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


class _WeightNormConv(nn.Module):
    """A ``weight_norm`` conv (its weight ``g * v / ||v||``, computed on every call when the exporter does not fold
    constants), then a BatchNorm read by a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1))
        self.bn, self.fc = nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(nn.functional.gelu(self.conv(x))).transpose(1, 2))


def test_a_weight_the_exporter_computes_is_folded_at_the_files_precision_and_question_1_judges_the_fold(tmp_path):
    """TorchScript without constant folding writes the conv's weight as its ``weight_norm`` arithmetic. The engine
    folds it into a constant in float32, as the file's runtime computes it; question 1 holds the fold to that graph
    in float64 (held to the file's arithmetic in float64, the fold failed by 2e-8, "the fold is wrong", exit 1)."""
    model = randomize_norms(_WeightNormConv().eval(), seed=2)
    path = tmp_path / "wn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 4, 10),), str(path), dynamo=False, do_constant_folding=False,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    assert op_histogram(path)["ReduceL2"] == 1  # the weight as the file computes it
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    (decision,) = report.folds
    assert decision.action == "folded-forward" and decision.into == ["fc"]
    assert report.verification is not None and report.verification.passed
    exact = [c for c in report.verification.exact if c.method == "graph"]
    assert exact and exact[0].error < 1e-12


def test_a_norm_after_a_transposed_conv_folds_through_every_door(tmp_path):
    """The BatchNorm before a grouped ``ConvTranspose`` stays an affine (``transposed-conv-consumer``), the RepBN
    after it folds into its columns and a created bias, through the ``.pt2`` door and the ONNX door
    (TorchScript export: a ``ConvTranspose`` of ``group = 2`` without bias), with the same decisions; both folds
    pass verification (question 1 on the ONNX door runs the float64 ``ConvTranspose`` group by group), and the
    fused ``model.onnx`` computes the original file's outputs in onnxruntime, the fused ``model.pt2`` the module's."""
    from tests.test_doors import ConvTransposeBetweenNorms

    model = randomize_norms(ConvTransposeBetweenNorms().eval(), seed=3)
    decisions = [
        ("norm", "kept-affine", reasons.TRANSPOSED_CONV_CONSUMER, []),
        ("norm2", "folded-backward", None, ["fc"]),
    ]
    fused, xs = _through_both_doors(model, torch.randn(2, 8, 5, 5), tmp_path, decisions)
    assert op_histogram(fused) == collections.Counter({"BatchNormalization": 1, "ConvTranspose": 1, "Relu": 1})
    (convt,) = [n for n in onnx.load(str(fused)).graph.node if n.op_type == "ConvTranspose"]
    assert len(convt.input) == 3  # the created bias
    program = torch.export.load(tmp_path / "pt2" / "model.pt2").module()
    want = model(torch.from_numpy(xs))
    assert (program(torch.from_numpy(xs)) - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_norm_before_a_pointwise_transposed_conv_folds_through_every_door(tmp_path):
    """A BatchNorm before a 1x1, stride-1 ``ConvTranspose`` (group 2, with bias) folds forward into its rows and
    bias, the RepBN after it backward into its columns, through the ``.pt2`` door and the ONNX door alike; both
    pass verification (question 1 exact), and the fused ``model.onnx`` has no norm left and computes the original's
    outputs in onnxruntime."""
    from tests.test_exact_folds import PointwiseUp

    model = randomize_norms(PointwiseUp(2, 2, 0, 1, True).eval(), seed=4)
    decisions = [("norm", "folded-forward", None, ["fc"]), ("norm2", "folded-backward", None, ["fc"])]
    fused, _ = _through_both_doors(model, torch.randn(2, 8, 5, 5), tmp_path, decisions)
    assert op_histogram(fused) == collections.Counter({"ConvTranspose": 1, "Relu": 1})


def _through_both_doors(model, x, tmp_path, decisions):
    """``model`` fused as a ``.pt2`` program and as its TorchScript ONNX export (opset 18): both get ``decisions``
    (``(norm, action, reason, into)`` each) and pass verification, question 1 exact on the ONNX door, and the fused
    ``model.onnx`` computes the original file's outputs in onnxruntime on 3 other samples. Returns that file and
    those samples."""
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "model.pt2")
    original = _export(model, x, tmp_path / "model.onnx", 18)
    by_program = api.fuse(tmp_path / "model.pt2", tmp_path / "pt2", verify=VerifyOptions(samples=4),
                          write=WriteOptions(onnx=False))  # fmt: skip
    by_onnx = api.fuse(original, tmp_path / "onnx", verify=VerifyOptions(samples=4))
    for report in (by_program, by_onnx):
        assert [(d.norm, d.action, d.reason, d.into) for d in report.folds] == decisions
        assert report.verification is not None and report.verification.passed
    assert by_onnx.verification.exact and all(c.passed for c in by_onnx.verification.exact)
    fused = tmp_path / "onnx" / "model.onnx"
    xs = np.random.default_rng(1).standard_normal((3, *x.shape[1:])).astype(np.float32)
    y0, y1 = _run(original, xs), _run(fused, xs)
    assert np.abs(y1 - y0).max() <= 1e-5 * np.abs(y0).max()
    return fused, xs


def test_an_opset_9_batchnorm_listing_its_batch_statistics_is_kept_in_training_mode(tmp_path):
    """Opsets 9 to 13 have no ``training_mode``: a ``BatchNormalization`` that lists its mean, var, saved mean and
    saved var outputs (TorchScript's export in training mode) normalises with the batch's statistics in
    onnxruntime, read or not. Folding its stored statistics into the next conv wrote a file 50% off under
    ``--no-verify``; it is kept (``train-mode``) and the fused file computes the original's outputs."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits, bn_conv = _bn_conv(rng)
    info = helper.make_tensor_value_info

    def save(outputs: tuple[str, ...], name: str) -> Path:
        graph = helper.make_graph(
            bn_conv(outputs), "g", [info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
            [info("z", TensorProto.FLOAT, [2, 5, 3, 3])], inits,
        )  # fmt: skip
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)]), str(tmp_path / name))
        return tmp_path / name

    path = save(("y", "rm", "rv", "sm", "sv"), "train.onnx")
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32) * 3 + 1
    want = _run(path, x)
    naive = _run(save(("y",), "inference.onnx"), x)  # the stored statistics: what a fold of them computes
    assert np.abs(naive - want).max() > 0.1 * np.abs(want).max()
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert [(d.action, d.reason) for d in report.folds] == [("kept", "train-mode")]
    np.testing.assert_allclose(_run(tmp_path / "out" / "model.onnx", x), want, rtol=1e-5, atol=1e-6)


def test_simplify_leaves_a_training_mode_batchnorm_to_the_simplifiers_that_keep_it(tmp_path):
    """A ``BatchNormalization`` with ``training_mode=1`` after a Conv normalises by the batch's statistics:
    onnxscript's optimizer folds its running statistics into the Conv (its rewrite rule does not read the mode),
    which changes the outputs. ``fuse --simplify`` does not run it on such a graph (the report says why), so the
    simplified file computes the original's outputs and verification passes."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper
    from onnxscript.optimizer import optimize

    rng = np.random.default_rng(0)
    arrays = {
        "k": rng.standard_normal((4, 3, 1, 1)), "g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4),
        "m": rng.uniform(-1, 1, 4), "v": rng.uniform(0.5, 2, 4), "k2": rng.standard_normal((5, 4, 1, 1)),
    }  # fmt: skip
    info = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Conv", ["x", "k"], ["c"], name="conv"),
        helper.make_node(
            "BatchNormalization", ["c", "g", "b", "m", "v"], ["y", "rm", "rv"], name="bn", training_mode=1
        ),
        helper.make_node("Conv", ["y", "k2"], ["z"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
        [info("z", TensorProto.FLOAT, [2, 5, 4, 4])],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()],
    )
    path = tmp_path / "train.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), str(path))
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32) * 3 + 1
    want = _run(path, x)
    naive = ir.load(path)
    optimize(naive)  # what onnxscript's optimizer alone makes of it
    ir.save(naive, tmp_path / "naive.onnx")
    assert np.abs(_run(tmp_path / "naive.onnx", x) - want).max() > 0.1 * np.abs(want).max()
    report = api.fuse(path, tmp_path / "out", write=WriteOptions(simplify=True), verify=VerifyOptions(samples=2))
    assert report.verification.passed and [(d.action, d.reason) for d in report.folds] == [("kept", "train-mode")]
    simplified = report.outputs.onnx_info["simplified"]
    assert "onnxscript 0.7" not in " ".join(simplified["simplifiers"])
    assert simplified["onnxscript"].startswith("onnxscript's optimizer not run: bn is a BatchNormalization in training")
    np.testing.assert_allclose(_run(tmp_path / "out" / "model.onnx", x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", [[1, 4, 1, 1], []], ids=["scale-of-batch-1", "scalar"])
def test_an_input_without_the_batch_axis_is_refused_in_one_line_and_folds_unverified(tmp_path, side):
    """A scale fed at run time ``(1, C, 1, 1)`` beside a batch of 2, or a scalar: verification feeds every input N
    samples along axis 0, which such an input cannot take (onnxruntime refused the call: an internal error after
    the reference's work). Refused before any work, naming the input; ``--no-verify`` folds the BatchNorm."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {"g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "k": rng.standard_normal((5, 4, 1, 1))}  # fmt: skip
    info = helper.make_tensor_value_info
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"], name="scale"),
             helper.make_node("BatchNormalization", ["xs", "g", "b", "m", "v"], ["y"], name="bn"),
             helper.make_node("Conv", ["y", "k"], ["z"], name="conv")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [info("x", TensorProto.FLOAT, [2, 4, 3, 3]), info("s", TensorProto.FLOAT, side)],
        [info("z", TensorProto.FLOAT, [2, 5, 3, 3])],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()],
    )  # fmt: skip
    path = tmp_path / "side.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    shown = re.escape(f"{side}".replace(" ", "").replace(",", ", "))
    with pytest.raises(InputError, match=rf"the input 's' \(shape {shown}\) has no batch axis like the first input "
                       r"'x' \(axis 0 of size 2\).*verify=None"):  # fmt: skip
        api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert not (tmp_path / "out").exists()
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert [d.action for d in report.folds] == ["folded-forward"]
    feeds = {"x": rng.standard_normal((2, 4, 3, 3)).astype(np.float32),
             "s": rng.uniform(0.5, 2, side).astype(np.float32)}  # fmt: skip
    want, got = (ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (path, tmp_path / "out" / "model.onnx"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_bias_created_in_an_ir_3_graph_is_listed_as_a_graph_input(tmp_path):
    """IR version 3 (the TorchScript exporter at opset 7 and 8) requires every initializer to be a graph input: the
    bias a fold creates for a conv without one was an initializer only, so the fused file failed ``onnx.checker``
    (exit 2, 'not a valid ONNX model' naming slabconv's own output). The folded norm's statistics, inputs with
    their stored defaults, stayed listed as inputs nothing read: a value fed to them was silently ignored."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits, bn_conv = _bn_conv(rng)
    nodes = bn_conv()
    info = helper.make_tensor_value_info
    listed = [info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [2, 4, 3, 3]), *listed],
                              [info("z", TensorProto.FLOAT, [2, 5, 3, 3])], inits)  # fmt: skip
    path = tmp_path / "ir3.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)], ir_version=3), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    conv = next(n for n in fused.graph.node if n.op_type == "Conv")
    assert fused.ir_version == 3 and len(conv.input) == 3 and conv.input[2] in {i.name for i in fused.graph.input}
    onnx.checker.check_model(fused)
    # the statistics were inputs with defaults: the fused file no longer lists them (a value fed would be ignored)
    assert {i.name for i in fused.graph.input} == {"x", "k", conv.input[2]}
    assert {t.name for t in fused.graph.initializer} == {"k", conv.input[2]}


@pytest.mark.parametrize(("listed", "action"), [("m", "kept"), ("g", "kept"), ("k", "kept-affine")])
def test_a_tensor_the_caller_may_feed_is_not_folded_and_stays_an_input(tmp_path, listed, action):
    """From IR version 4 on an initializer listed as a graph input (``keep_initializers_as_inputs=True``) is a
    default the caller may replace (onnxruntime lets it): a BatchNorm statistic or scale (``m``, ``g``) or the
    consumer's weight (``k``) listed so was folded with its default and the input dropped, so the fused file ignored
    (or refused) a value the original reads. It is not a constant: the norm stays (``overridable-initializer``),
    every input of the original stays, and fed, the fused file computes what the original does. A fold with the
    default (what the fused file computed) is wrong once the input is fed."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits, bn_conv = _bn_conv(rng)
    info = helper.make_tensor_value_info
    default = next(onnx.numpy_helper.to_array(t) for t in inits if t.name == listed)
    inputs = [info("x", TensorProto.FLOAT, [2, 4, 3, 3]), info(listed, TensorProto.FLOAT, list(default.shape))]
    graph = helper.make_graph(bn_conv(), "g", inputs, [info("z", TensorProto.FLOAT, [2, 5, 3, 3])], inits)
    path = tmp_path / "listed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [(d.action, d.reason) for d in report.folds] == [(action, reasons.OVERRIDABLE)]
    fused = tmp_path / "out" / "model.onnx"
    assert [i.name for i in onnx.load(str(fused)).graph.input] == ["x", listed]
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    feeds = {"x": x, listed: (default + rng.uniform(0.5, 1, default.shape)).astype(np.float32)}
    want, got = (ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (path, fused))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    naive = _run(path, x)  # the original at the default: what a fold with the default computes, whatever is fed
    assert np.abs(naive - want).max() > 1e-2 * np.abs(want).max()


def test_a_size_computed_from_a_value_the_caller_may_feed_stays_computed(tmp_path):
    """``Reshape(z, [Shape(z)[i], -1])`` with ``i`` an initializer listed as a graph input (IR 4 on: its value a
    default the caller may replace). The preparation's constant folding (onnxscript's ``Gather`` of a ``Shape``)
    read the default 0 and wrote the shape ``(2, -1)`` as a constant: fed ``i = 1``, the original gives ``(5, 18)``
    and the fused file gave ``(2, 45)``. The size stays computed from the input."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits, bn_conv = _bn_conv(rng)
    inits += [onnx.numpy_helper.from_array(np.array(a, np.int64), k) for k, a in (("i", 0), ("rest", [-1]),
                                                                                 ("zero", [0]))]  # fmt: skip
    nodes = [*bn_conv(), helper.make_node("Shape", ["z"], ["s"]), helper.make_node("Gather", ["s", "i"], ["d"]),
             helper.make_node("Unsqueeze", ["d", "zero"], ["d1"]),
             helper.make_node("Concat", ["d1", "rest"], ["shape"], axis=0),
             helper.make_node("Reshape", ["z", "shape"], ["out"])]  # fmt: skip
    info = helper.make_tensor_value_info
    inputs = [info("x", TensorProto.FLOAT, [2, 4, 3, 3]), info("i", TensorProto.INT64, [])]
    graph = helper.make_graph(nodes, "g", inputs, [info("out", TensorProto.FLOAT, ["a", "b"])], inits)
    path = tmp_path / "size.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-forward"]
    feeds = {"x": rng.standard_normal((2, 4, 3, 3)).astype(np.float32), "i": np.array(1, np.int64)}
    want, got = (ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (path, tmp_path / "out" / "model.onnx"))
    assert want.shape == got.shape == (5, 18)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_reshape_to_sizes_the_caller_may_feed_blocks_the_fold(tmp_path):
    """``BatchNormalization -> Reshape(shape) -> Transpose -> MatMul`` with ``shape`` an initializer listed as a graph
    input (IR 4 on): its default ``(1, 4, 4)`` keeps the channel axis whole, so a fold into the MatMul is exact for the
    default only. Shape inference read the default, the norm was folded and the fused file declared the default's
    sizes: fed ``shape = (2, 4, 2)`` (which mixes channels into the rows the MatMul contracts), the original gives
    ``(2, 2, 3)`` and the fused file gave ``(1, 4, 3)``. Sizes the caller may feed are unknown: the norm stays
    (``overridable-initializer``, before the reshape) and fed, the fused file computes what the original does. The
    fold with the default is wrong once fed."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    arrays = {"g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "W": rng.standard_normal((4, 3))}  # fmt: skip
    inits = [onnx.numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    inits.append(onnx.numpy_helper.from_array(np.array([1, 4, 4], np.int64), "shape"))
    nodes = [helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], name="bn"),
             helper.make_node("Reshape", ["y", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1], name="transpose"),
             helper.make_node("MatMul", ["t", "W"], ["out"], name="matmul")]  # fmt: skip
    info = helper.make_tensor_value_info
    inputs = [info("x", TensorProto.FLOAT, [1, 4, 4]), info("shape", TensorProto.INT64, [3])]
    graph = helper.make_graph(nodes, "g", inputs, [info("out", TensorProto.FLOAT, ["a", "b", 3])], inits)
    path = tmp_path / "fed_shape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [(d.action, d.reason, d.kept_on) for d in report.folds] == [
        ("kept-affine", reasons.OVERRIDABLE, ["<model>:onnx.Reshape"])
    ]
    x = rng.standard_normal((1, 4, 4)).astype(np.float32)
    feeds = {"x": x, "shape": np.array([2, 4, 2], np.int64)}
    want, got = (ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (path, tmp_path / "out" / "model.onnx"))
    assert want.shape == got.shape == (2, 2, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    declared = onnx.load(str(tmp_path / "out" / "model.onnx")).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value if d.HasField("dim_value") else None for d in declared] == [None, None, 3]  # not the default's
    scale = arrays["g"] / np.sqrt(arrays["v"] + 1e-5)  # the fold with the default: W's rows scaled per channel
    shift = arrays["b"] - arrays["m"] * scale
    naive = x.reshape(2, 4, 2).transpose(0, 2, 1) @ (scale[:, None] * arrays["W"]) + shift @ arrays["W"]
    assert np.abs(naive - want).max() > 1e-2 * np.abs(want).max()


class _ReluBnConv(nn.Module):
    """``conv1 -> ReLU -> BatchNorm -> conv2 (no bias; padded with ``pad``) -> ReLU -> mean -> fc``: onnxruntime's
    extended optimizer writes each conv and its ReLU as one ``com.microsoft`` ``FusedConv``."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)
        self.conv2, self.fc = nn.Conv2d(6, 8, 3, padding=pad, bias=False), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv2(self.bn(torch.relu(self.conv1(x)))))
        return self.fc(y.mean((2, 3)))


@pytest.mark.parametrize("pad", [0, 1])
def test_a_batchnorm_between_onnxruntimes_fused_convs_folds_into_the_next_one(tmp_path, pad):
    """onnxruntime's extended optimizer (``ORT_ENABLE_EXTENDED``, saved with ``optimized_model_filepath``) writes
    ``Conv -> Relu`` as one ``FusedConv``: the BatchNorm between two of them was kept
    (``unsupported-op:com.microsoft.FusedConv``) and, had it folded, the file could not be verified (no float64
    ``FusedConv`` in onnxruntime or onnx's reference evaluator). It folds into the next conv's weight, its created
    bias becomes that ``FusedConv``'s ``B`` (the ReLU reads the biased sum), and question 1 runs the ``FusedConv``s
    as the ``Conv`` and ReLU they are. Before a padded conv the norm stays: folded forward it would add its shift to
    the padding's zeros, and folded backward through the ReLU (``relu(z) s + t`` into ``relu(z s + t)``) it is wrong."""
    torch.manual_seed(0)
    model = randomize_norms(_ReluBnConv(pad)).eval()
    x = torch.randn(2, 3, 9, 9)
    exported = tmp_path / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(exported), dynamo=False, opset_version=17, input_names=["x"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ortext.onnx")
    ort.InferenceSession(str(exported), options, providers=["CPUExecutionProvider"])
    path = tmp_path / "ortext.onnx"
    assert op_histogram(path)["FusedConv"] == 2
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert report.verification is not None and report.verification.passed
    [decision] = report.folds
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    want, got = _run(path, x.numpy()), _run(tmp_path / "out" / "model.onnx", x.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if pad == 0:
        assert decision.action == "folded-forward"
        assert "BatchNormalization" not in op_histogram(tmp_path / "out" / "model.onnx")
        second = [n for n in fused.graph.node if n.op_type == "FusedConv"][1]
        assert len(second.input) == 3 and second.input[2]  # the created bias is its B input
        return
    assert decision.action in ("kept", "kept-affine")
    s = model.bn.weight / torch.sqrt(model.bn.running_var + model.bn.eps)
    t = model.bn.bias - model.bn.running_mean * s
    with torch.no_grad():  # the backward fold a naive tool would make: the ReLU between them ignored
        naive = copy.deepcopy(model)
        naive.conv1.weight.mul_(s[:, None, None, None])
        naive.conv1.bias.mul_(s).add_(t)
        naive.bn = nn.Identity()
        assert (naive(x) - model(x)).abs().max() > 1e-2 * model(x).abs().max()


def test_float16_weights_behind_float32_inputs_fold_and_are_judged_as_float16(tmp_path):
    """onnxruntime's ``convert_float_to_float16(model, keep_io_types=True)`` (onnxconverter-common's converter)
    keeps float32 inputs and outputs, stores float16 weights, and appends the inputs' ``Cast`` after the nodes
    that read them. ``onnx.checker`` refused the node order (onnxruntime runs it: the nodes are sorted now), and
    question 2 judged the fold, rounded to float16, at float32's tolerance (exit 1 on a right fold)."""
    from onnx import TensorProto, helper
    from onnxruntime.transformers.float16 import convert_float_to_float16

    rng = np.random.default_rng(0)
    inits, bn_conv = _bn_conv(rng, channels=8, out=16)
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        bn_conv(), "g", [info("x", TensorProto.FLOAT, [2, 8, 4, 4])], [info("z", TensorProto.FLOAT, [2, 16, 4, 4])],
        inits,
    )  # fmt: skip
    half = convert_float_to_float16(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                    keep_io_types=True)  # fmt: skip
    cast = next(i for i, n in enumerate(half.graph.node) if n.input[0] == "x")
    assert cast > 0 and half.graph.node[0].input[0] == half.graph.node[cast].output[0]  # read before it is made
    path = tmp_path / "half.onnx"
    onnx.save(half, str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=16))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-forward"]
    assert {c.dtype for c in report.verification.checks} == {"float16"}
    assert onnx.load(str(tmp_path / "out" / "model.onnx")).graph.initializer[0].data_type == TensorProto.FLOAT16
    x = rng.standard_normal((2, 8, 4, 4)).astype(np.float32)
    want, got = _run(path, x), _run(tmp_path / "out" / "model.onnx", x)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("between", [None, "Relu"])
def test_a_batchnorm_whose_input_no_inference_types_is_reported_kept(tmp_path, between):
    """A ``BatchNormalization`` behind an op no shape inference types (the ``com.microsoft`` ops onnxruntime's
    optimizer writes, here one of another domain) has an input of unknown rank: the lowering reads it as one opaque
    node, the planner never sees it, and the report counted no norm (the BN of SLAB's block after onnxruntime's
    ``ORT_ENABLE_EXTENDED``, in front of its head, went unmentioned). It is one ``kept`` decision, whose reason
    names the op that hides the input's shape (it named the norm itself, ``unsupported-op:onnx.BatchNormalization``),
    and ``--require-folded`` refuses the file. ``between``: an ONNX op between them, opaque only because its own
    input is untyped (a ``ReduceMean`` after onnxruntime's ``FusedConv``), is passed for the op that hides it (the
    reason named it, ``unsupported-op:onnx.Relu``)."""
    from onnx import TensorProto, helper, numpy_helper

    from slabconv.errors import KeptNormsError

    rng = np.random.default_rng(0)
    arrays = {"gb": rng.standard_normal(4), "s": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4),
              "m": rng.uniform(-1, 1, 4), "v": rng.uniform(0.5, 2, 4), "W": rng.standard_normal((3, 4))}  # fmt: skip
    nodes = [helper.make_node("Mystery", ["x", "gb"], ["g"], domain="org.example"),
             *([helper.make_node(between, ["g"], ["r"])] if between else []),
             helper.make_node("BatchNormalization", ["r" if between else "g", "s", "b", "m", "v"], ["n"],
                              name="/norm/BatchNormalization"),
             helper.make_node("Gemm", ["n", "W"], ["y"], transB=1)]  # fmt: skip
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, ["batch", 4])],
                              [info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()],
                              )  # fmt: skip
    path = tmp_path / "opaque.onnx"
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("org.example", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    report = api.inspect(path)
    want = [("/norm/BatchNormalization", "kept", "unsupported-op:org.example.Mystery")]
    assert [(d.norm, d.action, d.reason) for d in report.folds] == want
    assert report.summary is not None and (report.summary.norms, report.summary.kept) == (1, 1)
    with pytest.raises(KeptNormsError, match="BatchNormalization"):
        api.fuse(path, tmp_path / "out", verify=None, write=WriteOptions(require_folded=True))
    assert not (tmp_path / "out").exists()


def test_a_batchnorm_inside_a_loop_body_is_reported_kept_by_the_loop(tmp_path):
    """A ``Loop`` is one opaque node to the engine, so the BatchNorm in its body was never seen: the fuse said
    'nothing to fold: ... has no norms (already fused?)' of a model with a norm. It is now one ``kept`` decision,
    named by the op that holds it, and the file runs as the original."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {"g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "k": rng.standard_normal((4, 4, 1, 1))}  # fmt: skip
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("BatchNormalization", ["v_in", "g", "b", "m", "v"], ["n"], name="body_bn"),
         helper.make_node("Conv", ["n", "k"], ["v_out"], name="body_conv"),
         helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                 info("v_in", TensorProto.FLOAT, [2, 4, 3, 3])],
        [info("c_out", TensorProto.BOOL, []), info("v_out", TensorProto.FLOAT, [2, 4, 3, 3])],
    )  # fmt: skip
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    inits.append(numpy_helper.from_array(np.array(2, np.int64), "trip"))
    graph = helper.make_graph([helper.make_node("Loop", ["trip", "", "x"], ["y"], name="loop", body=body)], "g",
                              [info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
                              [info("y", TensorProto.FLOAT, [2, 4, 3, 3])], inits)  # fmt: skip
    path = tmp_path / "loop.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert [(d.norm, d.action, d.reason) for d in report.folds] == [("body_bn", "kept", "unsupported-op:onnx.Loop")]
    assert report.summary is not None and (report.summary.norms, report.summary.kept) == (1, 1)
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(_run(tmp_path / "out" / "model.onnx", x), _run(path, x))


@pytest.mark.parametrize("omitted", ["cond", "trip_count"])
def test_a_batchnorm_after_a_loop_that_omits_an_optional_input_folds(tmp_path, omitted):
    """A ``Loop`` may omit its trip count or its initial condition (the input name is ""). onnxruntime's symbolic
    shape inference raised ``KeyError: ''`` on it and ONNX's own gives a loop-carried output no shape, so the
    BatchNormalization after the loop had an input of unknown rank and was kept as
    ``unsupported-op:onnx.BatchNormalization``, a reason naming the norm, where the fold is exact: the body passes the
    tensor through. Shape inference now reads the omitted input as a typed scalar; the norm folds into the conv after
    it and the file runs as the original."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {"g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "k": rng.standard_normal((3, 4, 1, 1))}  # fmt: skip
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    inits += [numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array(True), "yes")]
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Identity", ["v_in"], ["v_out"]), helper.make_node("Less", ["i", "two"], ["c_out"])],
        "body", [info("i", TensorProto.INT64, []), info("c_in", TensorProto.BOOL, []),
                 info("v_in", TensorProto.FLOAT, [2, 4, 3, 3])],
        [info("c_out", TensorProto.BOOL, []), info("v_out", TensorProto.FLOAT, [2, 4, 3, 3])],
    )  # fmt: skip
    loop_in = ["two", "", "x"] if omitted == "cond" else ["", "yes", "x"]
    nodes = [helper.make_node("Loop", loop_in, ["carried"], name="loop", body=body),
             helper.make_node("BatchNormalization", ["carried", "g", "b", "m", "v"], ["n"], name="bn"),
             helper.make_node("Conv", ["n", "k"], ["y"], name="conv")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
                              [info("y", TensorProto.FLOAT, [2, 3, 3, 3])], inits)  # fmt: skip
    path = tmp_path / "loop.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert [(d.norm, d.action, d.into) for d in report.folds] == [("bn", "folded-forward", ["k"])]
    assert report.verification is not None and report.verification.passed
    out = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert "BatchNormalization" not in op_histogram(tmp_path / "out" / "model.onnx")
    assert [n.input[:2] for n in out.graph.node if n.op_type == "Loop"] == [loop_in[:2]]
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    want, got = _run(path, x), _run(tmp_path / "out" / "model.onnx", x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("mean_fed", [True, False])
def test_an_unnamed_norm_is_named_by_its_output_in_errors_inspect_and_the_report(tmp_path, mean_fed):
    """A hand-built graph (onnx.helper leaves nodes unnamed): its BatchNormalization is named by the tensor it
    writes, as onnxruntime and Netron show it, not as node '' or a name onnx-ir made up: in the refusal of a mean
    fed as a graph input, and in ``inspect`` and the report of the fused file (kept in front of a ``Relu``)."""
    h, c = onnx.helper, 4
    values = {k: np.full(c, v, np.float32) for k, v in (("scale", 1.5), ("shift", 0.2), ("var", 2.0), ("mean", 0.1))}
    values["W"] = np.random.default_rng(0).standard_normal((3, c, 1, 1)).astype(np.float32)
    fed = [("x", [1, c, 3, 3])] + ([("mean", [c])] if mean_fed else [])
    graph = h.make_graph(
        [h.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"], ["normed"]),
         h.make_node("Relu", ["normed"], ["act"]), h.make_node("Conv", ["normed", "W"], ["y"])],
        "g",
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in fed],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 3, 3]),
         h.make_tensor_value_info("act", onnx.TensorProto.FLOAT, [1, c, 3, 3])],
        [onnx.numpy_helper.from_array(v, k) for k, v in values.items() if not (mean_fed and k == "mean")],
    )  # fmt: skip
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(tmp_path / "bn.onnx"))
    if mean_fed:
        with pytest.raises(InputError, match=r"input 'mean' is a parameter of BatchNormalization node 'normed' "):
            api.inspect(tmp_path / "bn.onnx")
        return
    assert [(d.norm, d.action) for d in api.inspect(tmp_path / "bn.onnx").folds] == [("normed", "kept-affine")]
    report = api.fuse(tmp_path / "bn.onnx", tmp_path / "out", verify=VerifyOptions(samples=2))
    assert [d.norm for d in report.folds] == ["normed"] and report.verification is not None
    assert report.verification.passed


@pytest.mark.parametrize("opset", [18, 21])
def test_opset_18s_group_normalization_is_refused_by_name_as_onnx_checker_refuses_it(tmp_path, opset):
    """ONNX deprecates GroupNormalization-18 (scale and bias one per group, not per channel as opset 21's and
    PyTorch's): onnx.checker refuses the file, and slabconv says which node and what to do, one line; the same
    graph at opset 21 is read."""
    h, c = onnx.helper, 4
    size = 2 if opset < 21 else c
    values = {"gs": np.full(size, 1.5, np.float32), "gb": np.full(size, 0.2, np.float32)}
    graph = h.make_graph(
        [h.make_node("GroupNormalization", ["x", "gs", "gb"], ["y"], num_groups=2)],
        "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, c, 3, 3])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, c, 3, 3])],
        [onnx.numpy_helper.from_array(v, k) for k, v in values.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    onnx.save(model, str(tmp_path / "gn.onnx"))
    if opset == 21:
        onnx.checker.check_model(model)
        assert api.inspect(tmp_path / "gn.onnx").folds == []  # no affine to fold without --fold-norm-affine
        return
    with pytest.raises(onnx.checker.ValidationError, match="deprecated"):
        onnx.checker.check_model(model)
    with pytest.raises(InputError, match=r"GroupNormalization node 'y' is opset 18's, .* at opset 21 or later$"):
        api.inspect(tmp_path / "gn.onnx")


class _BatchOfOne(nn.Module):
    """Conv -> ReLU -> BatchNorm -> Conv, then a reshape to ``(1, 50)``: exported with a dynamic batch axis, the
    graph still fixes the batch at 1 (the ``Reshape`` target is a constant)."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.bn(torch.relu(self.c1(x)))).reshape(1, 50)


def test_an_original_whose_graph_fixes_a_declared_dynamic_batch_is_named_not_an_internal_error(tmp_path):
    """onnxruntime runs the original on one sample and fails on several: one line naming the file and what to do
    (exit 2), not an internal error; with ``--samples 1`` it folds and verifies."""
    torch.manual_seed(0)
    path = _export(randomize_norms(_BatchOfOne()).eval(), torch.randn(1, 3, 5, 5), tmp_path / "one.onnx", 17)
    runner = CliRunner()
    result = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--samples", "4"])
    assert result.exit_code == 2, result.output
    assert "onnxruntime runs the original on one sample but not on 4 at once" in result.output
    assert "internal error" not in result.output and not (tmp_path / "out").exists()
    one = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--samples", "1"])
    assert one.exit_code == 0, one.output


class _LosesItsOwnDtype(nn.Module):
    """Conv -> ReLU -> BatchNorm -> Conv -> ``h = 0.9 tanh``, then ``((h + 2**24) - 2**24) + h / 2``: float32's
    spacing at 2**24 is 2, so the bracket is 0 there for every ``|h| < 1`` and the output ``h / 2``, while in float64
    it is ``1.5 h``: the original is 2/3 of its output's scale away from its float64 self on every input."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 0.9 * torch.tanh(self.c2(self.bn(torch.relu(self.c1(x)))))
        return ((h + 2.0**24) - 2.0**24) + h / 2


def test_a_bound_that_admits_an_all_zero_output_is_named_not_taken_for_a_check(tmp_path):
    """An original 2/3 away from its float64 self gives question 2 a bound of 4/3, which an all-zero output (error
    1) meets: the verdict says so (a fold, where question 1 still holds every tensor; and a candidate judged by
    question 2 alone, which such a candidate passes). The same network without the cancellation gets no such
    note."""
    torch.manual_seed(0)
    model = randomize_norms(_LosesItsOwnDtype()).eval()
    path = _export(model, torch.randn(2, 3, 5, 5), tmp_path / "loses.onnx", 17)
    runner = CliRunner()
    fused = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--samples", "4", "--json"])
    assert fused.exit_code == 0, fused.output
    verification = json.loads(fused.stdout)["verification"]
    assert [c["tolerance_from"] for c in verification["checks"]] == ["2*e_orig"] * 2
    notes = verification["notes"]
    assert any("admits an all-zero output" in n and "question 1, which holds every stored tensor" in n for n in notes)
    zeros = onnx.load(str(path))  # a candidate that computes nothing: y = 0 * y
    zeros.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero"))
    zeros.graph.node[-1].output[0] = "y_before"
    zeros.graph.node.append(onnx.helper.make_node("Mul", ["y_before", "zero"], ["y"]))
    onnx.save(zeros, str(tmp_path / "zeros.onnx"))
    alone = runner.invoke(app, ["verify", str(path), str(tmp_path / "zeros.onnx"), "--samples", "4", "--json"])
    assert alone.exit_code == 0, alone.output
    notes = json.loads(alone.stdout)["verification"]["notes"]
    assert any("admits an all-zero output" in n and "says nothing about the candidate's values" in n for n in notes)
    model.forward = lambda x: 0.9 * torch.tanh(model.c2(model.bn(torch.relu(model.c1(x)))))  # type: ignore[method-assign]
    plain = _export(model, torch.randn(2, 3, 5, 5), tmp_path / "plain.onnx", 17)
    result = runner.invoke(app, ["verify", str(plain), str(plain), "--samples", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert not any("admits an all-zero" in n for n in json.loads(result.stdout)["verification"]["notes"])


class _Saturated(nn.Module):
    """Conv -> BatchNorm -> Conv, then ``relu(y - 1e4) + 1``: every output is 1 whatever the input."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c2(self.bn(self.c1(x))) - 1e4) + 1


def test_outputs_the_same_on_every_sample_are_named_not_taken_for_a_check(digits, tmp_path):
    """Question 2 on a model whose outputs do not depend on its inputs compares constants: the verdict says so
    (a fold, where question 1 still holds every tensor; and a candidate judged by question 2 alone). The digits
    model's varying outputs get no such note."""
    torch.manual_seed(0)
    model = randomize_norms(_Saturated()).eval()
    path = _export(model, torch.randn(2, 3, 5, 5), tmp_path / "flat.onnx", 17)
    runner = CliRunner()
    fused = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out"), "--samples", "4", "--json"])
    assert fused.exit_code == 0, fused.output
    notes = json.loads(fused.stdout)["verification"]["notes"]
    assert any("the same on all 4 samples" in n and "question 1, which holds every stored tensor" in n for n in notes)
    alone = runner.invoke(app, ["verify", str(path), str(path), "--samples", "4", "--json"])
    assert alone.exit_code == 0, alone.output
    notes = json.loads(alone.stdout)["verification"]["notes"]
    assert any("the same on all 4 samples" in n and "says nothing about the candidate" in n for n in notes)
    varying, x = digits
    digits_path = _export(varying, x, tmp_path / "digits.onnx", 17)
    result = runner.invoke(app, ["verify", str(digits_path), str(digits_path), "--samples", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert not any("the same on all" in n for n in json.loads(result.stdout)["verification"]["notes"])


def _keras_layer_norm(path: Path) -> Path:
    """``x (batch, 4) -> BatchNormalization -> MatMul -> LayerNorm -> MatMul`` with the LayerNorm as tf2onnx writes
    Keras' ``LayerNormalization``: a ``Reshape`` to ``(1, batch, 4, 1)``, then a ``BatchNormalization`` over the
    batch axis whose mean and variance the graph computes from its input, and whose scale and bias are ones and
    zeros ``Expand``-ed to the batch size read from ``Shape(x)`` (a symbol under a dynamic batch)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = _bn_initializers(rng, {"fc1.weight": (4, 4), "fc2.weight": (4, 3)})
    inits += [
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array([1, -1, 4, 1], np.int64), "as_4d"),
        numpy_helper.from_array(np.array([0], np.int64), "start"),
        numpy_helper.from_array(np.array([1], np.int64), "stop"),
    ]
    nodes = [
        helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["n"], name="bn"),
        helper.make_node("MatMul", ["n", "fc1.weight"], ["h"], name="fc1"),
        helper.make_node("Shape", ["h"], ["shape"], name="ln/Shape"),
        helper.make_node("Slice", ["shape", "start", "stop"], ["rows"], name="ln/Slice"),
        helper.make_node("Expand", ["one", "rows"], ["ones"], name="ln/ones"),
        helper.make_node("Expand", ["zero", "rows"], ["zeros"], name="ln/zeros"),
        helper.make_node("Reshape", ["h", "as_4d"], ["r"], name="ln/Reshape"),
        helper.make_node("ReduceMean", ["r"], ["mean"], name="ln/mean", axes=[0, 2, 3], keepdims=0),
        helper.make_node("ReduceMean", ["r"], ["mean4"], name="ln/mean4", axes=[2, 3], keepdims=1),
        helper.make_node("Sub", ["r", "mean4"], ["d"], name="ln/Sub"),
        helper.make_node("Mul", ["d", "d"], ["d2"], name="ln/Square"),
        helper.make_node("ReduceMean", ["d2"], ["var"], name="ln/var", axes=[0, 2, 3], keepdims=0),
        helper.make_node("BatchNormalization", ["r", "ones", "zeros", "mean", "var"], ["ln"], name="ln/BN"),
        helper.make_node("Reshape", ["ln", "shape"], ["l"], name="ln/Reshape_1"),
        helper.make_node("MatMul", ["l", "fc2.weight"], ["y"], name="fc2"),
    ]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], producer_name="tf2onnx"), path)
    return path


def test_a_keras_layer_norm_as_tf2onnx_writes_it_stays_and_the_norm_before_it_folds(tmp_path):
    """tf2onnx's Keras ``LayerNormalization`` is a ``BatchNormalization`` over a dynamic axis whose statistics are
    computed per call and whose ones / zeros are sized by a symbol: it is kept (``batch-stats-in-eval``, no fixed
    affine), and the BatchNorm before the Dense still folds, verified. (Sizing those ones by the symbol, or the
    norm's channels, was an internal error.)"""
    path = _keras_layer_norm(tmp_path / "model.onnx")
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.norm, d.action, d.reason) for d in report.folds or []] == [
        ("bn", "folded-forward", None),
        ("ln", "kept", reasons.BATCH_STATS_IN_EVAL),
    ]
    assert report.verification is not None and report.verification.passed
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    y0 = _run(path, x)
    assert np.abs(_run(tmp_path / "out" / "model.onnx", x) - y0).max() <= 1e-5 * np.abs(y0).max()


class _GlobalMax(nn.Module):
    """A conv and its BatchNorm, a global max pool and a Linear, over 1 or 3 spatial axes (a 3-D or 5-D tensor);
    the exporter writes the pool as a `MaxPool`, which the test rewrites as the `GlobalMaxPool` it is."""

    def __init__(self, spatial: int) -> None:
        super().__init__()
        kinds = {
            1: (nn.Conv1d, nn.BatchNorm1d, nn.AdaptiveMaxPool1d),
            3: (nn.Conv3d, nn.BatchNorm3d, nn.AdaptiveMaxPool3d),
        }
        conv, bn, pool = kinds[spatial]
        self.conv, self.bn, self.pool, self.fc = conv(3, 4, 1), bn(4), pool(1), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("spatial", [1, 3])
def test_the_float64_reference_pools_a_global_max_over_every_spatial_axis(tmp_path, spatial):
    """onnx's reference ``GlobalMaxPool`` (reached behind a conv: onnxruntime has no float64 ``Conv``) took the
    maximum over the last two axes: over the channels of a 3-D input (tf2onnx's Keras ``GlobalMaxPooling1D``:
    ``fuse`` ended in an internal error), over two of the three spatial axes of a 5-D one. The reference equals
    torch's in float64, and the norm folds and is verified."""
    model = randomize_norms(_GlobalMax(spatial).eval(), seed=3)
    x = torch.randn(2, 3, *(5,) * spatial)
    path = _preserved_export(model, x, tmp_path / "gmp.onnx")
    proto = onnx.load(str(path))
    (pool,) = (n for n in proto.graph.node if n.op_type == "MaxPool")  # the exporter's MaxPool over the whole input
    pool.op_type = "GlobalMaxPool"
    del pool.attribute[:]
    onnx.save(proto, str(path))
    _assert_onnx_reference_is_torchs(path, model, x)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [d.action for d in report.folds or []] == ["folded-backward"]
    assert report.verification is not None and report.verification.passed


def test_simplify_writes_no_reshape_attribute_an_opset_11_file_cannot_hold(tmp_path):
    """``x (batch, 4, 1, 1) -> BatchNormalization -> Reshape(Concat(Shape(x)[0], 4)) -> MatMul`` at opset 11, as
    paddle2onnx writes a ResNet's flatten: onnxscript's optimizer makes the computed shape a constant and writes
    ``allowzero=1``, an attribute of opset 14 on, which ``onnx.checker`` refused (``fuse --simplify`` failed). The
    shape holds no 0, so the attribute goes; the file is checked and verified."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = _bn_initializers(rng, {"fc.weight": (4, 3)})
    inits += [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array([4]), "four")]
    nodes = [
        helper.make_node("BatchNormalization", ["x", *BN_INPUTS], ["n"], name="bn"),
        helper.make_node("Shape", ["n"], ["shape"], name="Shape"),
        helper.make_node("Gather", ["shape", "zero"], ["rows"], name="Gather", axis=0),
        helper.make_node("Unsqueeze", ["rows"], ["rows1"], name="Unsqueeze", axes=[0]),
        helper.make_node("Concat", ["rows1", "four"], ["flat"], name="Concat", axis=0),
        helper.make_node("Reshape", ["n", "flat"], ["f"], name="Reshape"),
        helper.make_node("MatMul", ["f", "fc.weight"], ["y"], name="fc"),
    ]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4, 1, 1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), path)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4), write=WriteOptions(simplify=True))
    assert [(d.norm, d.action) for d in report.folds or []] == [("bn", "folded-forward")]
    assert report.verification is not None and report.verification.passed
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    onnx.checker.check_model(fused, full_check=True)
    assert not [a for n in fused.graph.node if n.op_type == "Reshape" for a in n.attribute if a.name == "allowzero"]


def test_a_model_as_a_program_and_as_onnx_is_verified_on_the_same_random_inputs(tmp_path):
    """``random(seed=0, samples=16)`` was drawn by torch for a checkpoint or ``.pt2`` and by numpy for an ONNX file:
    the same model through two doors got two verdicts (timm's SHViT-S1, random weights: question 2 failed the
    ``.pt2``'s fused files and passed the ONNX export's, both fused files as far from float64 on the same inputs)."""
    from slabconv.verify.inputs import choose_inputs

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).eval()
    x = torch.randn(2, 3, 6, 6)
    program, onnx_path = tmp_path / "m.pt2", tmp_path / "m.onnx"
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)), program)
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "b"}})
    drawn, label, _ = choose_inputs(load_model(program), None, 8, 3)
    from_onnx, onnx_label, _ = onnx_original.choose_onnx_inputs(
        onnx_in_read(onnx_path), VerifyOptions(samples=8, seed=3)
    )
    assert label == onnx_label == "random(seed=3, samples=8)"
    assert isinstance(from_onnx, np.ndarray) and from_onnx.dtype == drawn.dtype == np.float32
    np.testing.assert_array_equal(from_onnx, drawn)


def test_samples_takes_the_first_n_of_an_inputs_file_through_the_onnx_door_as_through_a_checkpoint(tmp_path):
    """``--samples N`` with ``--inputs`` takes the file's first N samples (its help says so): an ONNX original
    with one input and one with two took every sample of the file."""
    from slabconv.verify.inputs import choose_inputs

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).eval()
    x = torch.randn(2, 3, 6, 6)
    program, onnx_path = tmp_path / "m.pt2", tmp_path / "m.onnx"
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)), program)
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "b"}})
    data = np.random.default_rng(0).standard_normal((5, 3, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=data)
    opts = VerifyOptions(inputs=tmp_path / "in.npz", samples=2)
    drawn, label, digest = choose_inputs(load_model(program), opts.inputs, 16, 0, limit=opts.samples)
    from_onnx, onnx_label, onnx_digest = onnx_original.choose_onnx_inputs(onnx_in_read(onnx_path), opts)
    assert onnx_label == label and "its first 2 of 5 samples" in label and onnx_digest == digest
    np.testing.assert_array_equal(from_onnx, data[:2])
    np.testing.assert_array_equal(drawn, data[:2])

    two = tmp_path / "two.onnx"  # a graph of two inputs: x + y
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 3]) for n in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "g", inputs,
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 3])])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), two)
    np.savez(tmp_path / "xy.npz", x=data.reshape(5, -1)[:, :3], y=data.reshape(5, -1)[:, 3:6])
    several, several_label, _ = onnx_original.choose_onnx_inputs(
        onnx_in_read(two), VerifyOptions(inputs=tmp_path / "xy.npz", samples=3)
    )
    assert isinstance(several, dict) and {k: len(v) for k, v in several.items()} == {"x": 3, "y": 3}
    assert "its first 3 of 5 samples" in several_label


def _gemm_file(path: Path, norm: str, op: str = "Gemm", c: tuple[int, ...] | None = None, **attrs: float) -> Path:
    """``x (6, 4)`` -> ``norm`` -> ``op`` -> ``y (6, 3)``, or the op first and the norm on the graph output
    (``norm`` "before" / "after"), the op a ``Gemm`` with ``attrs`` and a C of shape ``c`` (``transA``: a
    ``Transpose`` gives it ``A`` as ``(4, 6)``), or a ``MatMul`` by a ``(1, 4, 3)`` weight on ``x (2, 6, 4)``. The
    norm is a ``BatchNormalization`` over ``x``'s axis 1, or a ``Mul`` and ``Add`` on the last axis for the
    ``MatMul``. "rows": the BatchNorm reads ``x (4, 4)`` and ``transA`` makes its channels the rows of ``A``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    channels = {"before": 4, "after": 3, "rows": 4}[norm]
    arrays = {"s": rng.uniform(0.5, 1.5, channels), "b": rng.uniform(-1, 1, channels),
              "m": rng.uniform(-1, 1, channels), "v": rng.uniform(0.5, 2, channels)}  # fmt: skip
    arrays["W"] = rng.standard_normal((1, 4, 3) if op == "MatMul" else (3, 4) if attrs.get("transB") else (4, 3))
    flip = bool(attrs.get("transA"))
    shape = (
        [2, 6, 4] if op == "MatMul" else [4, 4] if norm == "rows" else [4, 6] if flip and norm == "after" else [6, 4]
    )
    reads = ["a", "W"]
    if c is not None:
        arrays["C"] = rng.standard_normal(c)
        reads.append("C")
    if op == "MatMul":
        norm_nodes = [helper.make_node("Mul", ["n_in", "s"], ["n_mid"]), helper.make_node("Add", ["n_mid", "b"], ["n"])]
    else:
        norm_nodes = [helper.make_node("BatchNormalization", ["n_in", "s", "b", "m", "v"], ["n"], name="bn")]
    layer = [helper.make_node(op, reads, ["z"], name="layer", **attrs)]
    if norm == "after":
        nodes = [helper.make_node("Identity", ["x"], ["a"]), *layer, helper.make_node("Identity", ["z"], ["n_in"]),
                 *norm_nodes, helper.make_node("Identity", ["n"], ["y"])]  # fmt: skip
    else:
        into = helper.make_node("Transpose", ["n"], ["a"], perm=[1, 0]) if flip and norm != "rows" else None
        nodes = [helper.make_node("Identity", ["x"], ["n_in"]), *norm_nodes,
                 into or helper.make_node("Identity", ["n"], ["a"]), *layer,
                 helper.make_node("Identity", ["z"], ["y"])]  # fmt: skip
    info = helper.make_tensor_value_info
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    rows = 4 if norm == "rows" else 6
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, shape)],
                              [info("y", TensorProto.FLOAT, [*shape[:-2], rows, 3])], inits)  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _input_shape(path: Path) -> list[int]:
    return [d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]


@pytest.mark.parametrize(
    ("norm", "op", "c", "attrs"),
    [("before", "Gemm", (3,), {"alpha": 0.3}), ("after", "Gemm", (3,), {"alpha": 0.3}),
     ("before", "Gemm", (1, 3), {"beta": 0.7}), ("after", "Gemm", (1, 3), {"beta": 0.7}),
     ("before", "Gemm", None, {"alpha": 0.3, "beta": 0.7}), ("after", "Gemm", None, {"alpha": 0.3, "beta": 0.7}),
     ("before", "Gemm", (3,), {"transA": 1}), ("after", "Gemm", (3,), {"transA": 1, "transB": 1, "alpha": 2.5}),
     ("before", "Gemm", (6, 3), {"beta": 0.7}), ("before", "Gemm", (6, 1), {}),
     ("after", "Gemm", (6, 3), {"beta": 0.7}), ("after", "Gemm", (6, 1), {}), ("after", "Gemm", (), {}),
     ("after", "Gemm", (1,), {"beta": 0.7}), ("before", "MatMul", None, {}), ("after", "MatMul", None, {})],
)  # fmt: skip
def test_every_gemm_and_batched_matmul_form_folds_exactly(tmp_path, norm, op, c, attrs):
    """A ``Gemm`` with ``alpha`` or ``beta`` not 1, with ``transA``, or with a C per row (``(M, N)``, ``(M, 1)``)
    or one number, and a ``MatMul`` by a ``(1, K, N)`` weight, were opaque, which kept the norm beside them though
    the fold is exact: the engine folds into ``alpha B`` and ``beta C`` (written so, ``alpha`` / ``beta`` then 1),
    into ``B`` behind ``A``'s transpose, a forward fold's bias added to a C per row, a backward fold's ``(s, t)``
    into ``B`` and a C per row as ``s beta C + t`` (``(M, N)``). The norm goes and onnxruntime runs the folded file
    as the original."""
    path = _gemm_file(tmp_path / "gemm.onnx", norm, op, c, **attrs)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-forward" if norm == "before" else "folded-backward"]
    out = tmp_path / "out" / "model.onnx"
    assert not {"BatchNormalization", "Mul"} & set(op_histogram(out))
    x = np.random.default_rng(1).standard_normal(_input_shape(path)).astype(np.float32)
    want, got = _run(path, x), _run(out, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("case", ["layerscale", "layerscale-column", "both", "shared"])
def test_a_gemms_c_per_row_takes_every_backward_fold_of_it(tmp_path, case):
    """A ``Gemm`` whose C is per row, ``(6, 3)`` (``(6, 1)`` in "layerscale-column", whose add is on the rows' axis
    yet the LayerScale after it is on the Gemm's channels), folds backward whatever else its folds are: a LayerScale
    after it (no shift, no bias created: C becomes ``s C``), a BatchNorm before it (forward) and one after it
    (backward: C becomes ``s2 (beta C + W t1) + t2``), a C another Gemm reads too (copied for the folded one).
    onnxruntime runs the fused file as the original, and leaving C as it was would change the output."""
    h, rng = onnx.helper, np.random.default_rng(0)
    c_shape = (6, 1) if case == "layerscale-column" else (6, 3)
    arrays = {"W": rng.standard_normal((4, 3)), "C": rng.standard_normal(c_shape), "W2": rng.standard_normal((4, 3))}
    arrays |= {k: rng.uniform(0.5, 1.5, n) for k, n in (("ls", 3), ("s1", 4), ("s2", 3), ("v1", 4), ("v2", 3))}
    arrays |= {k: rng.uniform(-1, 1, n) for k, n in (("b1", 4), ("b2", 3), ("m1", 4), ("m2", 3))}
    bn2 = h.make_node("BatchNormalization", ["z", "s2", "b2", "m2", "v2"], ["n2"], name="bn2")
    nodes = {
        "layerscale": [
            h.make_node("Gemm", ["x", "W", "C"], ["z"], name="gemm"),
            h.make_node("Mul", ["z", "ls"], ["n2"], name="ls"),
        ],
        "layerscale-column": [
            h.make_node("Gemm", ["x", "W", "C"], ["z"], name="gemm"),
            h.make_node("Mul", ["z", "ls"], ["n2"], name="ls"),
        ],
        "both": [
            h.make_node("BatchNormalization", ["x", "s1", "b1", "m1", "v1"], ["n1"], name="bn1"),
            h.make_node("Gemm", ["n1", "W", "C"], ["z"], name="gemm", beta=0.5),
            bn2,
        ],
        "shared": [
            h.make_node("Gemm", ["x", "W", "C"], ["z"], name="gemm"),
            bn2,
            h.make_node("Gemm", ["x", "W2", "C"], ["z2"], name="gemm2"),
        ],
    }[case]
    nodes.append(h.make_node("Relu", ["n2"], ["y"]) if case != "shared" else h.make_node("Add", ["n2", "z2"], ["y"]))
    read = {i for n in nodes for i in n.input}
    info = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [6, k]) for n, k in (("x", 4), ("y", 3))]
    inits = [onnx.numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items() if k in read]
    path = tmp_path / "gemm.onnx"
    onnx.save(h.make_model(h.make_graph(nodes, "g", info[:1], info[1:], inits), opset_imports=[h.make_opsetid("", 17)]),
              str(path))  # fmt: skip
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert report.verification is not None and report.verification.passed
    assert {d.norm: d.action for d in report.folds if d.norm != "bn1"} == {
        "ls" if case.startswith("layerscale") else "bn2": "folded-backward"
    }
    out = tmp_path / "out" / "model.onnx"
    assert set(op_histogram(out)) == {"Gemm", "Add" if case == "shared" else "Relu"}
    x = rng.standard_normal((6, 4)).astype(np.float32)
    want, got = _run(path, x), _run(out, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    fused = onnx.load(str(out))
    for init in fused.graph.initializer:  # C as it was, beside the folded weight: not the original
        if init.name == next(n.input[2] for n in fused.graph.node if n.name == "gemm"):
            init.CopyFrom(
                onnx.numpy_helper.from_array(
                    (arrays["C"] * (0.5 if case == "both" else 1)).astype(np.float32), init.name
                )
            )
    onnx.save(fused, str(tmp_path / "naive.onnx"))
    naive = _run(tmp_path / "naive.onnx", x)
    assert np.abs(naive - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize(
    ("equation", "w_shape", "bias"),
    [("btc,cd->btd", (4, 3), True), ("...c,dc->...d", (3, 4), False), ("btc,cd->bdt", (4, 3), False)],
)
def test_a_norm_before_an_einsum_linear_layer_folds_into_its_weight(tmp_path, equation, w_shape, bias):
    """Keras' ``EinsumDense`` (tf2onnx) writes a Linear as ``Einsum`` of the tensor and a 2-D weight contracting the
    last axis: a ``Mul`` / ``Add`` by per-channel ``Constant`` nodes before it folds into the weight (and the bias
    ``Add`` after it), with the weight stored ``(K, N)`` or ``(N, K)``; onnxruntime runs the fused file as the
    original. An equation that moves the axes (``->bdt``) is no Linear: no norm is found there."""
    h, rng = onnx.helper, np.random.default_rng(0)
    const = {"s": rng.uniform(0.5, 1.5, 4), "t": rng.uniform(-1, 1, 4)}
    nodes = [h.make_node("Constant", [], [k], value=onnx.numpy_helper.from_array(v.astype(np.float32)))
             for k, v in const.items()]  # fmt: skip
    nodes += [h.make_node("Mul", ["x", "s"], ["xs"]), h.make_node("Add", ["xs", "t"], ["xa"]),
              h.make_node("Einsum", ["xa", "W"], ["z" if bias else "y"], name="dense", equation=equation)]  # fmt: skip
    inits = {"W": rng.standard_normal(w_shape), "b": rng.standard_normal(3)}
    if bias:
        nodes.append(h.make_node("Add", ["z", "b"], ["y"], name="dense/bias"))
    out = [2, 3, 5] if equation.endswith("bdt") else [2, 5, 3]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5, 4])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out)],
        [onnx.numpy_helper.from_array(a.astype(np.float32), k) for k, a in inits.items() if k == "W" or bias],
    )  # fmt: skip
    path = tmp_path / "einsum.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=8))
    assert report.verification is not None and report.verification.passed
    fused = tmp_path / "out" / "model.onnx"
    if equation.endswith("bdt"):
        assert report.folds == [] and {"Mul", "Einsum"} <= set(op_histogram(fused))
        return
    assert [(d.action, d.into) for d in report.folds] == [("folded-forward", ["W"])]
    assert "Mul" not in op_histogram(fused) and op_histogram(fused)["Add"] == 1  # the bias (kept or created)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    want, got = _run(path, x), _run(fused, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_gemm_keeps_a_norm_on_its_rows_and_dropping_it_would_be_wrong(tmp_path):
    """Kept, with the true reason: a BatchNorm whose channels ``transA`` makes the rows of ``A`` (the Gemm
    contracts the other axis). The fold that drops the kept affine changes the output; the kept affine is laid out
    on ``A`` as the file holds it, before the transpose ``transA`` makes inside the Gemm (it was laid out after it,
    on ``A``'s other axis: question 1 failed, 1.36 relative)."""
    path = _gemm_file(tmp_path / "gemm.onnx", "rows", "Gemm", (3,), transA=1)
    (decision,) = api.inspect(path).folds
    assert (decision.action, decision.reason) == ("kept-affine", "consumer-not-on-channel-axis")
    x = np.random.default_rng(1).standard_normal(_input_shape(path)).astype(np.float32)
    want, got = _run(path, x), _run(_naive_onnx(path, tmp_path / "naive.onnx"), x)
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()
    v = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4)).verification
    assert v is not None and v.passed and v.exact and all(e.passed for e in v.exact)
    fused = _run(tmp_path / "out" / "model.onnx", x)
    assert np.abs(fused - want).max() <= 1e-5 * np.abs(want).max()


def test_a_kept_affine_on_the_transposed_right_operand_of_a_fused_matmul_is_laid_out_on_its_channels(tmp_path):
    """A BatchNorm over axis 1 of ``n (2, 4, 3)`` read as the right operand of a ``com.microsoft`` ``FusedMatMul``
    with ``transB=1`` (``a @ n^T``): the lowering adds the transpose (``aten.transpose``), after which the channels
    are the last axis. The affine kept before the product goes on ``n`` as the file holds it, on axis 1 (laid out on
    the transpose's axis, it would scale the wrong axis). ``Gemm`` / ``MatMul`` weights seen transposed are views of
    a constant: no affine is ever kept on them."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    arrays = {"s": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4)}  # fmt: skip
    nodes = [helper.make_node("BatchNormalization", ["bx", "s", "b", "m", "v"], ["n"], name="bn"),
             helper.make_node("FusedMatMul", ["a", "n"], ["y"], name="fmm", domain="com.microsoft", transB=1,
                              alpha=0.5)]  # fmt: skip
    info = helper.make_tensor_value_info
    inputs = [info("a", TensorProto.FLOAT, [2, 5, 3]), info("bx", TensorProto.FLOAT, [2, 4, 3])]
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    graph = helper.make_graph(nodes, "g", inputs, [info("y", TensorProto.FLOAT, [2, 5, 4])], inits)
    path = tmp_path / "fmm.onnx"
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    report = api.fuse(path, tmp_path / "out", verify=None)
    assert [(d.action, d.reason) for d in report.folds] == [("kept-affine", "unsupported-op:aten.matmul")]
    feeds = {"a": rng.standard_normal((2, 5, 3)).astype(np.float32),
             "bx": rng.standard_normal((2, 4, 3)).astype(np.float32)}  # fmt: skip
    want, got = (ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (path, tmp_path / "out" / "model.onnx"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _ort_extended(tmp_path: Path) -> Path:
    """A BatchNorm over ``x (B, C, T)``, then a Linear on its transpose scaled by 0.5, a ReLU and a Linear, exported
    by the TorchScript exporter and saved by onnxruntime's extended-level optimizer: the ``Transpose``, ``MatMul``
    and ``Mul`` become one ``com.microsoft`` ``FusedMatMul`` (``transA=1``, ``alpha=0.5``)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.fc, self.out = nn.BatchNorm1d(8), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.fc(self.bn(x).transpose(1, 2)) * 0.5))

    torch.manual_seed(0)
    model = randomize_norms(Block(), seed=3).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 8, 6),), str(tmp_path / "plain.onnx"), dynamo=False,
                          input_names=["x"], dynamic_axes={"x": {0: "b"}})  # fmt: skip
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "extended.onnx")
    ort.InferenceSession(str(tmp_path / "plain.onnx"), options, providers=["CPUExecutionProvider"])
    return tmp_path / "extended.onnx"


def test_an_onnxruntime_extended_level_file_folds_into_its_fused_matmul(tmp_path):
    """onnxruntime's ``FusedMatMul`` (a ``MatMul`` with ``transA`` / ``transB`` and ``alpha``) is a layer as
    ``Gemm`` is: the BatchNorm before it folds into its weight (``alpha`` then 1), as in the file the exporter
    wrote; onnxruntime runs the file in float64, so both questions are answered. It was an opaque op: the norm was
    kept, and ONNX's inference left every value after it untyped."""
    path = _ort_extended(tmp_path)
    (fused_matmul,) = [n for n in onnx.load(str(path)).graph.node if n.op_type == "FusedMatMul"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused_matmul.attribute}
    assert fused_matmul.domain == "com.microsoft" and attrs["transA"] == 1 and attrs["alpha"] == 0.5
    plain = api.inspect(tmp_path / "plain.onnx").folds
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert (
        [(d.action, d.kind) for d in report.folds]
        == [(d.action, d.kind) for d in plain]
        == [("folded-forward", "BatchNorm")]
    )
    v = report.verification
    assert v is not None and v.passed and v.exact and all(e.passed for e in v.exact)
    assert "BatchNormalization" not in op_histogram(tmp_path / "out" / "model.onnx")
    x = np.random.default_rng(1).standard_normal((3, 8, 6)).astype(np.float32)
    want, got = _run(path, x), _run(tmp_path / "out" / "model.onnx", x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
