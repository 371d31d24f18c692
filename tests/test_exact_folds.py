"""Exact folds through the ops and patterns models put between a norm and its layers (issue 36): interpolation and
pooling, convs that pad nothing, a layer's separate bias add, a channel concat (the norm folds into the layer's
slice of input channels), a norm after a sum of layers (a chain of affines, MobileBERT), and the blocker a refusal
names when a layer's weight is computed.

Each family has cases that fold (the fused graph matches the original) and cases where the naive fold would be
wrong and slabconv keeps the affine (or the norm) with the reason. ``test_every_resampling_rule_has_cases`` fails
when a pooling or resampling rule is added to the table without its cases here.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv import engine, fold
from slabconv.engine import FOLD_BLOCK, fused_state_dict, onnx_fold, reasons
from slabconv.engine.capture import stored
from slabconv.engine.rewriter import fold_program
from slabconv.engine.rules import RULE_OF, RULES
from slabconv.report.data import Report
from slabconv.report.render import summary_lines
from slabconv.zoo.norms import RepBN
from tests.foldcheck import (
    NAIVE_MIN_ERR,
    TOL,
    affine_of,
    assert_affine_only,
    aten_ops,
    bn_nodes,
    fuse,
    kept_affines,
    naive_fold,
    norm_free,
    randomize,
    rel_err,
)

C, B = 8, 2
Op = Callable[[torch.Tensor], torch.Tensor]


def grid(dims: int, size: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, C, *([size] * dims), generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


SAMPLE_GRID = torch.rand(B, 4, 4, 2, generator=torch.Generator().manual_seed(1)) * 2.6 - 1.3
"""Sampling positions for ``F.grid_sample`` of a 2-D input, a quarter of them outside ``[-1, 1]``: made here, not
in the traced forward (torch.export before 2.9 cannot trace the making of a ``torch.Generator``)."""


# --------------------------------------------------------------------------------------------- resampling, pooling


class Resampled(nn.Module):
    """``fc(op(norm(x)))`` on ``(B, C, *spatial)``: a BatchNorm, the op, a 1x1 conv (or a Linear on the channels
    when the op leaves ``(B, C)``)."""

    def __init__(self, op: Op, dims: int, linear: bool = False) -> None:
        super().__init__()
        self.op = op
        self.norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](C)
        self.fc = nn.Linear(C, 5) if linear else [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](C, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.op(self.norm(x)))


@dataclass(frozen=True)
class Case:
    op: Op
    aten: str  # the ATen op (packet) the exported graph must hold
    dims: int = 2
    linear: bool = False
    positive: bool | None = None  # force every scale > 0 / some < 0
    reason: str | None = None  # a refusal: the reason, and the naive fold must be wrong


def _up(mode: str, **kw: object) -> Op:
    return lambda y: F.interpolate(y, **kw, mode=mode)  # type: ignore[arg-type]


# rule -> (cases that fold, a case that must not)
RESAMPLING: dict[str, tuple[list[Case], Case | None]] = {
    "interpolate": (
        [
            Case(_up("linear", scale_factor=2), "upsample_linear1d", dims=1),
            Case(_up("bilinear", size=(7, 3), align_corners=True), "upsample_bilinear2d"),
            Case(_up("bilinear", size=(3, 4), antialias=True), "_upsample_bilinear2d_aa"),
            Case(_up("bicubic", scale_factor=1.5), "upsample_bicubic2d"),
            Case(_up("bicubic", size=(3, 3), antialias=True), "_upsample_bicubic2d_aa"),
            Case(_up("trilinear", scale_factor=2), "upsample_trilinear3d", dims=3),
        ],
        None,  # every PyTorch interpolation mode's weights sum to one (test_interpolation_weights_sum_to_one)
    ),
    "grid_sample": (
        [
            Case(lambda y: F.grid_sample(y, SAMPLE_GRID, padding_mode="border", align_corners=False), "grid_sampler"),
            Case(
                lambda y: F.grid_sample(y, SAMPLE_GRID, "bicubic", padding_mode="reflection", align_corners=True),
                "grid_sampler",
            ),
        ],
        # samples outside the input are zeros: 0 in the original, t after a naive fold
        Case(
            lambda y: F.grid_sample(y, SAMPLE_GRID, padding_mode="zeros", align_corners=False),
            "grid_sampler",
            reason=reasons.ZERO_PADDING_AFTER_NORM,
        ),
    ),
    "adaptive_avg_pool": (
        [
            Case(lambda y: F.adaptive_avg_pool2d(y, 1).flatten(1), "adaptive_avg_pool2d", linear=True),
            Case(lambda y: F.interpolate(y, size=(3, 2), mode="area"), "adaptive_avg_pool2d"),
            Case(lambda y: F.adaptive_avg_pool3d(y, 2), "adaptive_avg_pool3d", dims=3),
        ],
        None,  # a mean over each window
    ),
    "mean": (
        [
            Case(lambda y: y.mean((2, 3), keepdim=True), "mean"),  # GlobalAveragePool, then a 1x1 conv
            Case(lambda y: y.mean((-1, -2)), "mean", linear=True),
        ],
        None,  # a mean over each plane
    ),
    "avg_pool": (
        [
            Case(lambda y: F.avg_pool2d(y, 2), "avg_pool2d"),
            Case(lambda y: F.avg_pool2d(y, 2, ceil_mode=True), "avg_pool2d"),
            Case(lambda y: F.avg_pool2d(y, 3, 1, 1, count_include_pad=False), "avg_pool2d"),
            Case(lambda y: F.avg_pool3d(y, 2), "avg_pool3d", dims=3),
        ],
        Case(lambda y: F.avg_pool2d(y, 3, 1, 1), "avg_pool2d", reason=reasons.ZERO_PADDING_AFTER_NORM),
    ),
    "max_pool": (
        [Case(lambda y: F.max_pool3d(y, 2), "max_pool3d", dims=3, positive=True)],
        Case(lambda y: F.max_pool2d(y, 2), "max_pool2d", positive=False, reason=reasons.NEGATIVE_SCALE_THROUGH_MAX),
    ),
    "max_pool_indices": (
        [
            Case(lambda y: F.adaptive_max_pool2d(y, 1).flatten(1), "adaptive_max_pool2d", linear=True, positive=True),
            Case(lambda y: F.max_pool2d(y, 2, return_indices=True)[0], "max_pool2d_with_indices", positive=True),
        ],
        Case(
            lambda y: F.adaptive_max_pool2d(y, 2),
            "adaptive_max_pool2d",
            positive=False,
            reason=reasons.NEGATIVE_SCALE_THROUGH_MAX,
        ),
    ),
}


def _refusals() -> list:
    return [pytest.param(block, id=f"{name}-{block.aten}") for name, (_, block) in RESAMPLING.items() if block]


def _fused(case: Case) -> tuple[nn.Module, torch.Tensor, torch.fx.GraphModule, list]:
    model = randomize(Resampled(case.op, case.dims, case.linear), seed=3, positive=case.positive).eval()
    x = grid(case.dims)
    gm, decisions = fuse(model, x)
    assert any(str(n.target).startswith(f"aten.{case.aten}.") for n in gm.graph.nodes), case.aten
    return model, x, gm, decisions


def test_every_resampling_rule_has_cases():
    """Every pooling / resampling rule of the table (forward walk only) is exercised here, and each case's op is
    one of its rule's ops."""
    families = {"interpolate", "grid_sample", "mean", "adaptive_avg_pool", "avg_pool", "max_pool", "max_pool_indices"}
    assert families <= {r.name for r in RULES}
    assert set(RESAMPLING) == families
    for name, (folds, block) in RESAMPLING.items():
        for case in [*folds, *([block] if block else [])]:
            packet = getattr(torch.ops.aten, case.aten)
            assert any(
                RULE_OF.get(getattr(packet, o)) is not None and RULE_OF[getattr(packet, o)].name == name
                for o in packet.overloads()
            ), (name, case.aten)


class AllResampled(nn.Module):
    """One norm read by every folding case of one spatial rank, each op followed by its own layer (``fcs.<i>``);
    the outputs averaged over space and summed (one export for them all)."""

    def __init__(self, cases: list[Case], dims: int) -> None:
        super().__init__()
        self.ops = [c.op for c in cases]
        self.norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](C)
        conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]
        self.fcs = nn.ModuleList(nn.Linear(C, 5) if c.linear else conv(C, 5, 1) for c in cases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        outs = [fc(op(y)) for op, fc in zip(self.ops, self.fcs, strict=True)]
        return sum(o if o.dim() == 2 else o.flatten(2).mean(2) for o in outs)  # type: ignore[return-value]


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_folds_through_the_op(dims):
    """Every folding case of ``RESAMPLING`` (every scale > 0, for the max pools): the norm folds into each layer."""
    cases = [c for folds, _ in RESAMPLING.values() for c in folds if c.dims == dims]
    model = randomize(AllResampled(cases, dims), seed=3, positive=True).eval()
    x = grid(dims)
    gm, decisions = fuse(model, x)
    ops = {str(n.target).removeprefix("aten.").split(".")[0] for n in gm.graph.nodes if n.op == "call_function"}
    assert {c.aten for c in cases} <= ops
    (d,) = decisions
    assert (d.action, sorted(d.into), d.reason) == (
        "folded-forward",
        sorted(f"fcs.{i}" for i in range(len(cases))),
        None,
    )
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


@pytest.mark.parametrize("case", _refusals())
def test_refused_where_the_naive_fold_is_wrong(case):
    model, x, gm, decisions = _fused(case)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", case.reason)
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc")(x), reference) > NAIVE_MIN_ERR
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class PooledOutput(nn.Module):
    """``norm(op(producer(x)))`` returned as the model's output (a classifier's head: a conv, a global average pool,
    a flatten, a BatchNorm1d): no layer after the norm, so only a backward fold into ``producer`` (a 1x1 conv)
    removes it. ``flat``: the op leaves ``(B, C)`` (a BatchNorm1d)."""

    def __init__(self, op: Op, dims: int, flat: bool = False) -> None:
        super().__init__()
        self.producer = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](C, C, 1)
        self.op = op
        self.norm = nn.BatchNorm1d(C) if flat else [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.op(self.producer(x)))


def _naive_backward(model: PooledOutput) -> nn.Module:
    """The norm dropped and its affine folded into the producer's output channels as if nothing stood between
    them."""
    naive = norm_free(model, ["norm"])
    scale, shift = affine_of(model.norm)
    with torch.no_grad():
        w, b = fold.fold_into_producer(naive.producer.weight, naive.producer.bias, scale, shift)
        naive.producer.weight.copy_(w)
        naive.producer.bias.copy_(b)
    return naive


def _backward_cases() -> list:
    return [
        pytest.param(c, id=f"{name}-{c.aten}-{i}")
        for name, (folds, _) in RESAMPLING.items()
        for i, c in enumerate(folds)
    ]


@pytest.mark.parametrize("case", _backward_cases())
def test_folds_backward_through_the_op(case):
    """Every folding case of ``RESAMPLING`` between a producer and a norm that is the model's output: ``op(s y +
    t) = s op(y) + t`` (the same identity as forward), so the norm folds into the producer's rows, exactly (every
    scale > 0 where the op is a max)."""
    model = randomize(PooledOutput(case.op, case.dims, case.linear), seed=3, positive=case.positive).eval()
    x = grid(case.dims)
    gm, decisions = fuse(model, x)
    assert any(str(n.target).startswith(f"aten.{case.aten}.") for n in gm.graph.nodes), case.aten
    (d,) = decisions
    assert (d.action, d.into, d.reason) == ("folded-backward", ["producer"], None), d.no_backward
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        pytest.param(
            block,
            "only when every scale is > 0" if block.positive is False else "with zeros",
            id=f"{name}-{block.aten}",
        )
        for name, (_, block) in RESAMPLING.items()
        if block
    ]
    + [
        # a zero border stays 0 where the producer's shifted output would carry t into it
        pytest.param(Case(lambda y: F.pad(y, (1, 1, 1, 1)), "pad"), "with zeros", id="zero-pad"),
        # sum(s y + t) = s sum(y) + N t: the producer would need t / N; no backward fold scales the shift
        pytest.param(Case(lambda y: y.sum((2, 3)), "sum", linear=True), "aten.sum", id="sum-static-tokens"),
        pytest.param(
            Case(lambda y: y.amax((2, 3)), "amax", linear=True, positive=False),
            "only when every scale is > 0",
            id="amax-negative",
        ),
    ],
)
def test_no_backward_fold_through_the_op_where_it_would_be_wrong(case, why):
    """A padded average pool that counts the padded zeros (they stay 0 where ``t`` would be averaged in), sampling
    outside the input with zeros, a zero border, a max with a negative scale (the max becomes a min), a sum over
    tokens (its shift is ``N t``): the norm stays, kept as an affine at the model's output, and folding it into the
    producer anyway is wrong."""
    model = randomize(PooledOutput(case.op, case.dims, case.linear), seed=3, positive=case.positive).eval()
    x = grid(case.dims)
    reference = model(x)
    gm, decisions = fuse(model, x)
    assert any(str(n.target).startswith(f"aten.{case.aten}.") for n in gm.graph.nodes), case.aten
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", reasons.FEEDS_OUTPUT)
    assert why in (d.no_backward or ""), d.no_backward
    assert rel_err(_naive_backward(model)(x), reference) > NAIVE_MIN_ERR
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


def _shiftless(model: PooledOutput) -> PooledOutput:
    """``model`` with its norm's shift ``t = bias - mean * s`` made 0 (bias and running mean 0)."""
    with torch.no_grad():
        model.norm.bias.zero_()
        model.norm.running_mean.zero_()  # type: ignore[union-attr]
    return model


@pytest.mark.parametrize(
    "op",
    [lambda y: F.pad(y, (1, 1, 1, 1)), lambda y: F.avg_pool2d(y, 3, 1, 1, count_include_pad=True)],
    ids=["zero-pad", "avg-pool-counting-pads"],
)
def test_a_norm_without_shift_folds_backward_through_an_op_that_pads_with_zeros(tmp_path, op):
    """``pad(s y, 0) = s pad(y, 0)``: where every shift is 0 the padded zeros stay zeros, so a norm after a zero
    border (or a pool that counts padded zeros) folds into the producer's rows, through a checkpoint and an ONNX file
    alike (it was kept: the walk refused the op whatever the shift). With a shift the same fold is wrong at the
    border (``test_no_backward_fold_through_the_op_where_it_would_be_wrong``)."""
    model = _shiftless(randomize(PooledOutput(op, 2), seed=3)).eval()
    x = grid(2)
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["producer"])], decisions[0].no_backward
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32] and not bn_nodes(gm) and not kept_affines(gm)
    path = tmp_path / "padded.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"])
    fused, onnx_decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.reason) for d in onnx_decisions] == [("folded-backward", None)]
    assert "BatchNormalization" not in {n.op_type for n in fused.graph}
    want, got = (ort.InferenceSession(m).run(None, {"x": x.numpy()})[0]
                 for m in (str(path), ir.to_proto(fused).SerializeToString()))  # fmt: skip
    assert rel_err(torch.from_numpy(got), torch.from_numpy(want)) <= TOL[torch.float32]


def test_no_backward_fold_through_a_zero_pad_when_a_constant_below_it_gives_a_shift():
    """``norm(pad(producer(x)) + c)`` with no shift of its own: a backward fold writes ``s (y + c) = s y + (s - 1) c
    + c``, the producer taking ``(s - 1) c``, which the zero border would not carry. The norm stays, and the fold by
    hand is wrong at the border."""
    c = 0.75
    model = _shiftless(randomize(PooledOutput(lambda y: F.pad(y, (1, 1, 1, 1)) + c, 2), seed=3)).eval()
    x = grid(2)
    reference = model(x)
    gm, decisions = fuse(model, x)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", reasons.FEEDS_OUTPUT)
    assert "with zeros" in (d.no_backward or ""), d.no_backward
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    naive = norm_free(model, ["norm"])
    scale, _ = affine_of(model.norm)
    with torch.no_grad():
        w, b = fold.fold_into_producer(naive.producer.weight, naive.producer.bias, scale, (scale - 1) * c)
        naive.producer.weight.copy_(w)
        naive.producer.bias.copy_(b)
        naive.op = lambda y: F.pad(y, (1, 1, 1, 1)) + c
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_batchnorm_after_a_global_pool_and_flatten_folds_into_the_conv_in_an_onnx_file(tmp_path, dynamo):
    """A classifier's head exported to ONNX (``Conv``, ``GlobalAveragePool`` or ``ReduceMean``, ``Flatten`` or
    ``Reshape``, ``BatchNormalization`` as the graph's output): the ONNX door folds the norm into the conv as the
    program door does, and the fused file, run by onnxruntime, gives the original's output with no norm left."""
    model = randomize(PooledOutput(lambda y: F.adaptive_avg_pool2d(y, 1).flatten(1), 2, flat=True), seed=3).eval()
    x = grid(2)
    reference = model(x)
    path = tmp_path / "head.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo, opset_version=18, input_names=["x"])
    original = ir.load(str(path))
    assert "BatchNormalization" in {n.op_type for n in original.graph}
    onnx_model, decisions = onnx_fold.fold_file(original, str(path))
    assert [(d.action, d.into, d.reason) for d in decisions] == [("folded-backward", ["producer"], None)]
    assert not {"BatchNormalization", "Mul", "Add"} & {n.op_type for n in onnx_model.graph}
    ir.save(onnx_model, str(tmp_path / "fused.onnx"))
    session = ort.InferenceSession(str(tmp_path / "fused.onnx"), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert rel_err(torch.from_numpy(out), reference) <= TOL[torch.float32]


@pytest.mark.parametrize(
    ("mode", "kw"),
    [
        ("linear", {"scale_factor": 1.7}),
        ("bilinear", {"size": (9, 4)}),
        ("bilinear", {"size": (9, 4), "align_corners": True}),
        ("bilinear", {"size": (3, 2), "antialias": True}),
        ("bicubic", {"size": (9, 4)}),
        ("bicubic", {"size": (3, 2), "antialias": True}),
        ("trilinear", {"scale_factor": 1.5}),
    ],
)
def test_interpolation_weights_sum_to_one(mode, kw):
    """What the ``interpolate`` rule relies on (``slabconv.engine.steps._resample``): interpolating a constant
    plane gives the same constant everywhere, borders and antialiasing included, so
    ``interp(s x + t) = s interp(x) + t``."""
    dims = 3 if mode == "trilinear" else 1 if mode == "linear" else 2
    ones = torch.ones(1, 1, *([5] * dims), dtype=torch.float64)
    out = F.interpolate(ones, mode=mode, **kw)
    assert torch.allclose(out, torch.ones_like(out), rtol=0, atol=1e-12)


class ChannelsLast(nn.Module):
    """A RepBN over the last axis of ``(B, N, C)`` interpolated along that axis: the ``2C`` outputs blend
    neighbouring channels; no per-channel affine survives it."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.norm = RepBN(C)
        self.fc = nn.Linear(2 * C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.interpolate(self.norm(x), scale_factor=2, mode=self.mode))


def test_interpolating_the_channel_axis_is_refused():
    """The naive fold reads the ``2C`` interpolated channels as the ``C`` channels tiled twice (what the fold into
    ``fc`` would do if the rule passed the channel axis); slabconv keeps the affine. (Nearest interpolation of the
    channel axis: ``tests/test_view_rules.py``.)"""
    model = randomize(ChannelsLast("linear")).eval()
    x = torch.randn(B, 6, C)
    reference = model(x)
    scale, shift = affine_of(model.norm)
    naive = norm_free(model, ["norm"])
    with torch.no_grad():
        naive.fc.bias.add_(naive.fc.weight @ shift.repeat(2).float())
        naive.fc.weight.mul_(scale.repeat(2).float())
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.upsample_linear1d")
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


# --------------------------------------------------------------------------------------------- layers


class ConvAfterNorm(nn.Module):
    def __init__(self, kernel: int | tuple[int, int], padding: str | int | tuple[int, int]) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(C)
        self.fc = nn.Conv2d(C, 5, kernel, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class ConvsThatPadNothing(nn.Module):
    """One norm read by convs that pad nothing: ``padding="same"`` with a 1x1 kernel, ``"valid"``, zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(C)
        self.fcs = nn.ModuleList(nn.Conv2d(C, 5, k, padding=p) for k, p in ((1, "same"), (3, "valid"), (3, (0, 0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return sum(fc(y).flatten(2).mean(2) for fc in self.fcs)  # type: ignore[return-value]


def test_a_conv_that_pads_nothing_folds_forward():
    model = randomize(ConvsThatPadNothing()).eval()
    x = grid(2)
    gm, decisions = fuse(model, x)
    assert {"aten.conv2d.padding", "aten.conv2d.default"} <= {str(n.target) for n in gm.graph.nodes}
    assert [(d.action, sorted(d.into)) for d in decisions] == [("folded-forward", ["fcs.0", "fcs.1", "fcs.2"])]
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


@pytest.mark.parametrize(("kernel", "padding"), [(3, "same"), ((1, 3), (0, 1))])
def test_a_conv_that_pads_is_refused(kernel, padding):
    model = randomize(ConvAfterNorm(kernel, padding)).eval()
    x = grid(2)
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc")(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    assert [(d.action, d.reason) for d in decisions] == [("kept-affine", reasons.PADDED_CONV_CONSUMER)]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class PointwiseUp(nn.Module):
    """A BatchNorm read by a pointwise transposed conv (kernel 1, stride 1: one input position per output position,
    padding only crops, dilation changes nothing), a RepBN after it: the first folds forward into the layer's rows
    (its input channels), the second backward into its columns, both into its bias."""

    def __init__(self, dims: int, groups: int, padding: int, dilation: int, bias: bool) -> None:
        super().__init__()
        conv, bn = (nn.ConvTranspose1d, nn.BatchNorm1d) if dims == 1 else (nn.ConvTranspose2d, nn.BatchNorm2d)
        self.norm, self.norm2 = bn(C), bn(6)
        self.fc = conv(C, 6, 1, padding=padding, dilation=dilation, groups=groups, bias=bias)
        self.alpha = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.norm(x))
        return torch.relu(self.norm2(y) + self.alpha * y)


@pytest.mark.parametrize(("dims", "groups", "padding", "dilation", "bias"), [(1, 2, 0, 1, True), (2, 1, 1, 2, False)])
@pytest.mark.parametrize("one_row_blocks", [False, True])
def test_a_pointwise_transposed_conv_folds_forward(dims, groups, padding, dilation, bias, one_row_blocks):
    """The norm before it folds into its rows and its bias ``b + sum_c W[c, j] t[c]``, which takes the shift through
    every row: folded one row of the weight at a time (as a streamed fold splits a large weight), each block folds
    its rows and the bias is folded over the whole weight. A kernel of 3 or a stride of 2 is refused
    (``tests/test_refusals.py``, where the naive fold is wrong)."""
    model = randomize(PointwiseUp(dims, groups, padding, dilation, bias)).eval()
    x = grid(dims)
    gm = engine.capture(model, x)
    decisions, _ = fold_program(gm, block_elements=1 if one_row_blocks else FOLD_BLOCK)
    assert [(d.norm, d.action, d.into) for d in decisions] == [
        ("norm", "folded-forward", ["fc"]),
        ("norm2", "folded-backward", ["fc"]),
    ]
    assert not bn_nodes(gm)
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


class SeparateBias(nn.Module):
    """A bias-free layer whose bias is added on its own (Paddle's ``conv(x, W) + b.view(1, C, 1, 1)``; the ONNX
    ``Conv`` / ``MatMul`` + ``Add`` that exporters write): ``before`` the norm (it folds backward into the layer
    and ``b``) or after it (forward). ``stored4d``: ``b`` is stored as ``(1, C, 1, 1)``."""

    def __init__(self, layer: str, before: bool, stored4d: bool = False) -> None:
        super().__init__()
        self.before, self.conv = before, layer == "conv"
        cin, cout = (4, C) if before else (C, 5)
        self.fc = (
            nn.Conv2d(cin, cout, 3 if before else 1, bias=False) if self.conv else nn.Linear(cin, cout, bias=False)
        )
        shape = (1, cout, 1, 1) if stored4d else (cout,)
        self.b = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(7)))
        self.norm = (nn.BatchNorm2d if self.conv else nn.BatchNorm1d)(C)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        b = self.b.view(1, -1, 1, 1) if self.conv and self.b.dim() == 1 else self.b
        return self.fc(x) + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.layer(x))) if self.before else self.layer(self.norm(x))


@pytest.mark.parametrize(
    ("layer", "before", "stored4d"),
    [("conv", False, False), ("conv", True, True), ("linear", True, False)],
)
def test_a_layer_with_a_separate_bias_add_folds_into_that_bias(layer, before, stored4d):
    """The fold writes the new bias into ``b`` (in ``b``'s own shape): the fused graph is the norm-free one, with
    no bias created on the layer."""
    model = randomize(SeparateBias(layer, before, stored4d)).eval()
    x = torch.randn(B, 4 if before else C, 6, 6) if layer == "conv" else torch.randn(B, 4 if before else C)
    reference = model(x)
    bare_ops = aten_ops(norm_free(model, ["norm"]), x)
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward" if before else "folded-forward", ["fc"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert_affine_only(gm, bare_ops, 0)
    state = fused_state_dict(gm)
    assert "fc.bias" not in state and state["b"].shape == model.b.shape
    assert not torch.equal(state["b"], model.b)


class SharedSeparateBias(nn.Module):
    """``relu(norm(conv1(x) + b)) + conv2(x) + b``: ``b`` (one view of it, or the stored ``(1, C, 1, 1)``
    tensor itself) is read twice."""

    def __init__(self, stored4d: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, C, 3, bias=False)
        self.conv2 = nn.Conv2d(4, C, 3, bias=False)
        self.b = nn.Parameter(torch.randn((1, C, 1, 1) if stored4d else (C,)))
        self.norm = nn.BatchNorm2d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.b.view(1, C, 1, 1)
        return F.relu(self.norm(self.conv1(x) + b)) + self.conv2(x) + b


@pytest.mark.parametrize("stored4d", [False, True])
def test_a_shared_separate_bias_is_not_the_layers_bias(stored4d):
    """Folding the norm backward into ``conv1`` and ``b`` would change ``conv2``'s branch. ``b`` is a constant
    added before the norm, not ``conv1``'s bias: the norm folds into ``conv1`` with the shift ``t + (s - 1) b`` and
    the add of ``b`` stays, as both branches read it."""
    model = randomize(SharedSeparateBias(stored4d)).eval()
    x = torch.randn(B, 4, 6, 6)
    reference = model(x)
    naive = copy.deepcopy(model)
    scale, shift = affine_of(model.norm)
    naive.norm = nn.Identity()
    with torch.no_grad():
        naive.conv1.weight.mul_(scale.float().view(-1, 1, 1, 1))
        naive.b.copy_((scale * model.b.view(-1) + shift).view(model.b.shape))
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    assert [(d.action, d.reason) for d in decisions] == [("folded-backward", None)]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class AffineWithItsOwnAdd(nn.Module):
    """``relu((fc(x) + b) * w + c)``: the add of ``b`` belongs to the norm (its shift is ``w b + c``), so ``b`` is
    not ``fc``'s separate bias: the backward fold creates ``fc``'s bias and ``b`` goes with the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, C, bias=False)
        gen = torch.Generator().manual_seed(3)
        self.b, self.w, self.c = (nn.Parameter(torch.randn(C, generator=gen)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu((self.fc(x) + self.b) * self.w + self.c)


def test_an_add_the_norm_owns_is_not_a_separate_bias():
    model = AffineWithItsOwnAdd().eval()
    x = torch.randn(B, 3, 4)
    gm, decisions = fuse(model, x)
    assert [(d.kind, d.action, d.into) for d in decisions] == [("Affine", "folded-backward", ["fc"])]
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert {str(n.target) for n in gm.graph.nodes if n.op == "call_function"} == {
        "aten.linear.default",
        "aten.relu.default",
    }


# --------------------------------------------------------------------------------------------- concatenation


class AifiUpsampleConcat(nn.Module):
    """YOLO11's head around an AIFI block with RepBN (as the RT-DETR / YOLO repositories that copy SLAB's code
    build it): the encoder's output norm over the flattened grid, ``view`` back to ``(B, C, h, w)``,
    ``nn.Upsample(None, 2, "nearest")``, a channel ``Concat`` with a backbone feature (``first``: the norm's piece
    comes first) and then ``head``:

    - ``cv1``: a C3k2's 1x1 conv: the norm folds into its slice of input channels;
    - ``tokens``: ``flatten(2).transpose(1, 2)`` and a Linear over the channels (the channel axis stays whole);
    - ``mixing``: ``reshape(B, h w, C')`` of the channels-first tensor: each row mixes channels (refused);
    - ``flat``: ``flatten(1)`` and a Linear over ``2C h w`` columns (the backbone's piece has ``C`` channels too):
      the flattened axis looks like the norm's ``C`` channels tiled twice in blocks of ``h w``, but half of it is
      the backbone's (refused);
    - ``padded``: ``cv1(cat) + conv3x3(cat)``: the padded conv keeps an affine after the concat, the identity on
      the backbone's channels;
    - ``two``: the other piece is a second norm's output; each folds into its own slice.
    """

    def __init__(self, head: str, first: bool = True) -> None:
        super().__init__()
        self.head, self.first = head, first
        self.norm = RepBN(C)
        self.up = nn.Upsample(None, 2, "nearest")
        self.skip = nn.BatchNorm2d(C) if head == "two" else nn.Conv2d(C, C if head == "flat" else 4, 3, padding=1)
        wide = 2 * C if head in ("two", "flat") else C + 4
        self.cv1 = nn.Linear(wide, 6) if head in ("tokens", "mixing") else nn.Conv2d(wide, 6, 1)
        if head == "flat":
            self.cv1 = nn.Linear(wide * 64, 6)  # the 8 x 8 grid of ``_aifi``
        self.cv3 = nn.Conv2d(wide, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.norm(F.avg_pool2d(x, 2).flatten(2).permute(0, 2, 1))  # (B, h w / 4, C)
        y = t.permute(0, 2, 1).view(-1, c, h // 2, w // 2)
        pieces = [self.up(y), self.skip(x)]
        cat = torch.cat(pieces if self.first else pieces[::-1], 1)
        if self.head == "tokens":
            return self.cv1(cat.flatten(2).transpose(1, 2))
        if self.head == "mixing":
            return self.cv1(cat.reshape(b, h * w, -1))
        if self.head == "flat":
            return self.cv1(cat.flatten(1))
        if self.head == "padded":
            return self.cv1(cat) + self.cv3(cat)
        return self.cv1(cat)


def _aifi(head: str, first: bool = True) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = randomize(AifiUpsampleConcat(head, first), seed=4).eval()
    x = grid(2, size=8)
    return model, x, model(x)


@pytest.mark.parametrize(("head", "first"), [("cv1", False), ("tokens", False), ("two", True)])
def test_a_norm_concatenated_with_other_channels_folds_into_its_slice(head, first):
    """The layer scales (and shifts through its bias) the norm's input channels only; the other pieces carry the
    identity. With the norm's piece second, a fold into the first ``C`` columns would be wrong."""
    model, x, reference = _aifi(head, first)
    bare_ops = aten_ops(norm_free(model, ["norm", "skip"] if head == "two" else ["norm"]), x)
    gm, decisions = fuse(model, x)
    norms = ["norm", "skip"] if head == "two" else ["norm"]
    assert [(d.norm, d.action, d.into) for d in decisions] == [(n, "folded-forward", ["cv1"]) for n in norms]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert rel_err(gm(x[:1]), model(x[:1])) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)
    assert not aten_ops(gm) - bare_ops  # (the permutes around the norm cancel: fewer ops than without the norm)


@pytest.mark.parametrize("head", ["mixing", "flat"])
def test_a_reshape_that_mixes_a_concatenated_channel_axis_is_refused(head):
    """``mixing``: ``reshape(B, h w, C')`` of ``(B, C', h, w)``; the naive fold (the norm's slice of ``cv1``'s
    columns scaled as if the reshape kept the channels) is wrong. ``flat``: ``flatten(1)`` of ``(B, 2C, h, w)``
    reads as the norm's ``C`` channels tiled twice (blocks of ``h w`` columns), which a tensor with one norm
    (no concat) would be; folding it so scales the backbone's columns too. slabconv keeps the affine before the
    reshape."""
    model, x, reference = _aifi(head)
    scale, shift = affine_of(model.norm)
    naive = norm_free(model, ["norm"])
    if head == "mixing":
        s, t = torch.cat([scale, torch.ones(4)]).float(), torch.cat([shift, torch.zeros(4)]).float()
    else:
        s, t = scale.repeat_interleave(64).repeat(2).float(), shift.repeat_interleave(64).repeat(2).float()
    with torch.no_grad():
        naive.cv1.bias.add_(naive.cv1.weight @ t)
        naive.cv1.weight.mul_(s)
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    assert [(d.action, d.reason) for d in decisions] == [("kept-affine", reasons.CHANNEL_MIXING_RESHAPE)]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


def test_an_affine_kept_after_a_concat_is_the_identity_on_the_other_channels():
    """The padded 3x3 conv reading the concat keeps the norm's affine in front of it, laid out as the concat
    holds it (the norm's scale and shift on its channels, 1 and 0 on the backbone's); ``cv1`` absorbs it."""
    model, x, reference = _aifi("padded")
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into, d.reason, d.kept_on) for d in decisions] == [
        ("kept-affine", ["cv1"], reasons.PADDED_CONV_CONSUMER, ["cv3:aten.conv2d"])
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    (mul,) = kept_affines(gm)
    assert mul.args[0].target is torch.ops.aten.cat.default
    kept_scale = stored(gm, mul.args[1].target).flatten()
    assert torch.equal(kept_scale[C:], torch.ones(4))
    assert torch.allclose(kept_scale[:C].double(), affine_of(model.norm)[0])


def test_an_affine_kept_after_a_concat_is_laid_out_the_same_in_an_onnx_file(tmp_path):
    """The same model through the ONNX door (the TorchScript exporter, what ``yolo export`` runs): the same
    decision, and the kept affine written in front of the padded conv (one ``BatchNormalization``: the channels are
    at axis 1) carries the norm's scale on the norm's channels and 1 on the backbone's. Tiling the ``C`` scales over
    the ``C + 4`` channels cannot be written."""
    model, x, reference = _aifi("padded")
    path = tmp_path / "aifi.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18, input_names=["x"])
    onnx_model, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
    assert [(d.action, d.into, d.reason) for d in decisions] == [("kept-affine", ["cv1"], reasons.PADDED_CONV_CONSUMER)]
    ir.save(onnx_model, str(tmp_path / "fused.onnx"))
    session = ort.InferenceSession(str(tmp_path / "fused.onnx"), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": x.numpy()})
    assert rel_err(torch.from_numpy(out), reference) <= TOL[torch.float32]
    (kept,) = [n for n in onnx_model.graph if n.op_type == "BatchNormalization"]
    assert kept.inputs[0].producer().op_type == "Concat"
    kept_scale = torch.from_numpy(kept.inputs[1].const_value.numpy()).flatten()
    assert torch.equal(kept_scale[C:], torch.ones(4))
    assert torch.allclose(kept_scale[:C].double(), affine_of(model.norm)[0])


# --------------------------------------------------------------------------------------------- chains of affines


class NoNorm(nn.Module):
    """MobileBERT's ``NoNorm``: ``x * weight + bias``."""

    def __init__(self, c: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(c, generator=gen) * 0.5 + 1.0)
        self.bias = nn.Parameter(torch.randn(c, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class ResidualChain(nn.Module):
    """MobileBERT's attention output and FFN, as its code writes them: ``y = NoNorm_a(dense(h) + r)`` with ``r``
    another layer's output, then ``NoNorm_b(out(relu(inter(y))) + y)``, read by a GELU.

    ``y`` feeds ``inter`` and the residual: NoNorm_b folds backward into ``out`` and into ``y``'s producers
    (``dense``, ``r``), and ``inter`` takes the inverse of its scale. ``variant``: ``"tanh"`` also reads ``y``
    with a tanh (no inverse can go there); ``"twice"`` adds ``dense(h)`` to itself; ``"zero"`` gives NoNorm_b
    a zero scale on one channel (no inverse)."""

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        self.dense, self.r, self.inter, self.out = (nn.Linear(C, C) for _ in range(4))
        self.norm_a, self.norm_b = NoNorm(C, 1), NoNorm(C, 2)
        if variant == "zero":
            with torch.no_grad():
                self.norm_b.weight[3] = 0.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        d = self.dense(h)
        y = self.norm_a(d + d if self.variant == "twice" else d + self.r(h))
        z = self.norm_b(self.out(torch.relu(self.inter(y))) + y)
        return F.gelu(z) + torch.tanh(y) if self.variant == "tanh" else F.gelu(z)


def _chain(variant: str = "") -> tuple[nn.Module, torch.Tensor, dict]:
    model = ResidualChain(variant).eval()
    x = torch.randn(B, 5, C, generator=torch.Generator().manual_seed(0))
    gm, decisions = fuse(model, x)
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    if not variant:
        assert not kept_affines(gm) and not aten_ops(gm)["mul.Tensor"]
    return model, x, {d.norm: d for d in decisions}


def _by_hand(model: nn.Module, folds: dict[str, tuple[str, torch.Tensor, torch.Tensor]], norms: list[str]) -> nn.Module:
    """``model`` without the ``norms``, with ``(rows | columns, s, t)`` folded into the named Linears by hand."""
    done = copy.deepcopy(model)
    with torch.no_grad():
        for name in norms:
            setattr(done, name, nn.Identity())
        for name, (direction, s, t) in folds.items():
            fc = getattr(done, name)
            if direction == "rows":
                fc.weight.mul_(s[:, None])
                fc.bias.mul_(s).add_(t)
            else:
                fc.bias.add_(fc.weight @ t)
                fc.weight.mul_(s)
    return done


def _folds(model: nn.Module) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """The exact folds of both NoNorms (float64 would be closer; float32 is within the tolerance here)."""
    sa, ta, sb, tb = (
        t.detach() for t in (model.norm_a.weight, model.norm_a.bias, model.norm_b.weight, model.norm_b.bias)
    )
    zero = torch.zeros(C)
    return {
        "dense": ("rows", sa * sb, ta * sb),
        "r": ("rows", sa * sb, zero),
        "out": ("rows", sb, tb),
        "inter": ("columns", 1 / sb, zero),
    }


def test_a_norm_after_a_residual_sum_folds_into_every_addend_and_compensates_a_shared_one():
    """NoNorm_a folds into both addends (``dense`` takes its shift); NoNorm_b into ``out`` and, through ``y``,
    into ``dense`` and ``r`` again, with ``inter`` taking ``1 / s_b``. Done by hand: exact; without the inverse in
    ``inter``, or with NoNorm_a in one addend only, wrong."""
    model, x, d = _chain()
    assert (d["norm_a"].action, d["norm_a"].into) == ("folded-backward", ["dense", "r"])
    assert (d["norm_b"].action, d["norm_b"].into) == ("folded-backward", ["out", "dense", "r", "inter"])
    reference, folds, both = model(x), _folds(model), ["norm_a", "norm_b"]
    assert rel_err(_by_hand(model, folds, both)(x), reference) <= TOL[torch.float32]
    without_inverse = {k: v for k, v in folds.items() if k != "inter"}
    assert rel_err(_by_hand(model, without_inverse, both)(x), reference) > NAIVE_MIN_ERR
    sa, ta = model.norm_a.weight.detach(), model.norm_a.bias.detach()
    assert rel_err(_by_hand(model, {"dense": ("rows", sa, ta)}, ["norm_a"])(x), reference) > NAIVE_MIN_ERR


@pytest.mark.parametrize(
    ("variant", "norm", "why"),
    [
        ("tanh", "norm_b", "is also read by aten.tanh"),
        ("zero", "norm_b", "a channel's scale is 0"),
        ("twice", "norm_a", "no Linear/conv before the norm: aten.add produces its input"),
    ],
)
def test_no_backward_fold_through_a_sum_where_it_would_be_wrong(variant, norm, why):
    """``y`` also read by a tanh (no inverse goes there), a zero scale in NoNorm_b (``inter`` has no inverse to
    take), an addend added to itself (scaling ``dense``'s rows adds ``t`` twice): the norm stays an affine, with the
    real blocker in ``no_backward``; the fold by hand that ignores it is wrong."""
    model, x, d = _chain(variant)
    assert (d[norm].action, d[norm].reason) == (
        "kept-affine",
        reasons.NONLINEAR if norm == "norm_b" else reasons.RESIDUAL_READS_NORM,
    )
    assert why in (d[norm].no_backward or ""), d[norm].no_backward
    if variant == "twice":
        naive = _by_hand(model, {"dense": ("rows", model.norm_a.weight.detach(), model.norm_a.bias.detach())}, [norm])
    else:
        naive = _by_hand(model, _folds(model), ["norm_a", "norm_b"])
    assert rel_err(naive(x), model(x)) > NAIVE_MIN_ERR


class SharedProducer(nn.Module):
    """``h = fc(x)`` read by the norm (before a GELU) and by ``side``: ``fc`` takes the norm (rows, ``s`` and
    ``t``) and ``side`` the inverse ``(1 / s, -t / s)`` on its columns."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.side = nn.Linear(C, C), nn.Linear(C, 3)
        self.norm = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return F.gelu(self.norm(h))[:, :3] + self.side(h)


def test_a_shared_producer_output_takes_the_shift_and_its_other_reader_the_inverse():
    model = randomize(SharedProducer()).eval()
    x = torch.randn(B, C, generator=torch.Generator().manual_seed(1))
    reference = model(x)
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["fc", "side"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32] and not kept_affines(gm)
    s, t = (v.float() for v in affine_of(model.norm))
    naive = copy.deepcopy(model)  # the inverse scale alone: ``side`` reads s h + t, not s h
    naive.norm = nn.Identity()
    with torch.no_grad():
        naive.fc.weight.mul_(s[:, None])
        naive.fc.bias.mul_(s).add_(t)
        naive.side.weight.div_(s)
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR


class MobileBertEncoder(nn.Module):
    """transformers' ``MobileBertModel`` (random weights, NoNorm weights and biases drawn as if calibrated): the
    last hidden state for token ids."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MobileBertConfig, MobileBertModel

        torch.manual_seed(0)
        config = MobileBertConfig(
            vocab_size=50,
            hidden_size=32,
            embedding_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            intra_bottleneck_size=16,
            true_hidden_size=16,
            num_feedforward_networks=2,
            max_position_embeddings=16,
        )
        self.m = MobileBertModel(config, add_pooling_layer=False).eval()
        with torch.no_grad():
            for name, p in self.m.named_parameters():
                if "LayerNorm" in name:
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, return_dict=False)[0]


def test_mobilebert_folds_every_nonorm():
    """Its NoNorms sit after residual sums of dense layers (and of the embedding projection with the position and
    token-type tables), and the sums feed the next residual: each folds backward into every addend, the layers
    reading a shared addend taking the inverse. Before, three were kept with ``residual-reads-norm``."""
    model = MobileBertEncoder().eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model(ids)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "NoNorm"]
    gm, decisions = fuse(model, ids)
    assert sorted(d.norm for d in decisions) == sorted(names) and len(names) == 7
    actions = {d.norm.removeprefix("m."): d.action for d in decisions}
    for name in ("embeddings.LayerNorm", "encoder.layer.0.attention.output.LayerNorm"):
        assert actions[name] == "folded-backward"
    assert actions["encoder.layer.0.ffn.0.output.LayerNorm"] == "folded-backward"
    assert all(d.action.startswith("folded") for d in decisions)
    assert rel_err(gm(ids), reference) <= TOL[torch.float32]
    assert not kept_affines(gm) and not [k for k in fused_state_dict(gm) if "LayerNorm" in k]  # no NoNorm op left


# --------------------------------------------------------------------------------------------- the real blocker


class WeightNormed(nn.Module):
    """Weight-normalised Linears (``W = g v / |v|``, computed on every call): ``fc`` reads the norm ``norm``;
    ``pre`` produces the input of ``norm2``, which a GELU reads."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.norm, self.norm2 = nn.BatchNorm1d(C), nn.BatchNorm1d(C)
        self.fc, self.pre = weight_norm(nn.Linear(C, 5)), weight_norm(nn.Linear(C, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)) + F.gelu(self.norm2(self.pre(x)))[:, :5]


def test_a_computed_weight_is_named_as_the_blocker():
    """``fc``'s weight is computed: the forward fold is refused with ``computed-weight`` (not
    ``unsupported-op:aten.linear``); scaling ``v``'s columns instead is wrong, as ``|v|`` changes too. ``norm2``
    is kept before the GELU, and the report's ``backward`` says that ``pre`` has no stored weight."""
    model = randomize(WeightNormed()).eval()
    x = torch.randn(B + 2, C, generator=torch.Generator().manual_seed(2))
    reference = model(x)
    naive = copy.deepcopy(model)
    s, t = (v.float() for v in affine_of(model.norm))
    naive.norm = nn.Identity()
    with torch.no_grad():
        naive.fc.bias.add_(model.fc.weight @ t)
        naive.fc.parametrizations.weight.original1.mul_(s)
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    d = {d.norm: d for d in decisions}
    assert (d["norm"].action, d["norm"].reason) == ("kept-affine", reasons.COMPUTED_WEIGHT)
    assert d["norm"].paths == [{"before": "fc:aten.linear", "reason": reasons.COMPUTED_WEIGHT}]
    assert (d["norm2"].action, d["norm2"].reason) == ("kept-affine", reasons.NONLINEAR)
    assert d["norm2"].to_dict()["backward"] == "aten.linear has no stored weight to scale (computed-weight)"
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    said = list(summary_lines(Report("inspect", folds=decisions), verbose=True))  # what --verbose prints
    assert "  norm2: no backward fold: aten.linear has no stored weight to scale (computed-weight)" in said


# ------------------------------------------------------------------------------------------ backward through a concat


class ConcatThenNorm(nn.Module):
    """``norm(cat([a(x), b(x)], channel axis))`` before a GELU (no forward fold): each producer takes its slice of
    the norm's scale and shift on its output rows. ``layer``: 3x3 convs (padded: a backward fold does not care) or
    Linears on ``(B, C)``; ``b`` has no bias (the fold creates its slice's). ``shared``: ``a``'s output is also
    read by a tanh, which a backward fold would change, or by a layer (``side``)."""

    def __init__(self, layer: str, shared: str = "") -> None:
        super().__init__()
        self.shared = shared
        if layer == "conv":
            self.a, self.b = nn.Conv2d(C, 3, 3, padding=1), nn.Conv2d(C, 5, 3, padding=1, bias=False)
            self.norm: nn.Module = nn.BatchNorm2d(8)
        else:
            self.a, self.b = nn.Linear(C, 3), nn.Linear(C, 5, bias=False)
            self.norm = nn.BatchNorm1d(8)
        self.side = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ha = self.a(x)
        y = F.gelu(self.norm(torch.cat([ha, self.b(x)], 1))).flatten(1)
        if self.shared == "layer":
            return y + self.side(ha.transpose(1, -1)).flatten(1).mean(1, keepdim=True)
        return y + torch.tanh(ha).flatten(1).mean(1, keepdim=True) if self.shared else y


def concat_input(layer: str) -> torch.Tensor:
    return grid(2, 4) if layer == "conv" else torch.randn(B * 3, C, generator=torch.Generator().manual_seed(0))


def _sliced_by_hand(model: ConcatThenNorm) -> nn.Module:
    """The backward fold done by hand: ``a``'s rows take ``s[:3], t[:3]``, ``b``'s ``s[3:], t[3:]``."""
    s, t = affine_of(model.norm)
    naive = copy.deepcopy(model).double()
    naive.norm = nn.Identity()
    with torch.no_grad():
        for layer, rows in ((naive.a, slice(0, 3)), (naive.b, slice(3, 8))):
            shape = (-1,) + (1,) * (layer.weight.dim() - 1)
            layer.weight.mul_(s[rows].reshape(shape))
            bias = layer.bias if layer.bias is not None else torch.zeros(rows.stop - rows.start, dtype=s.dtype)
            layer.bias = nn.Parameter(bias * s[rows] + t[rows])
    return naive


@pytest.mark.parametrize("layer", ["conv", "linear"])
def test_a_norm_after_a_channel_concat_folds_backward_into_each_pieces_producer(layer):
    model, x = randomize(ConcatThenNorm(layer)).eval(), concat_input(layer)
    reference = model(x)
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["a", "b"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32] and not kept_affines(gm) and not bn_nodes(gm)
    assert rel_err(_sliced_by_hand(model)(x.double()), model.double()(x.double())) < 1e-12


@pytest.mark.parametrize(("layer", "shared", "reader"), [("conv", "tanh", "aten.tanh"), ("linear", "layer", "aten.")])
def test_no_backward_fold_through_a_concat_whose_piece_is_read_elsewhere(layer, shared, reader):
    """``a``'s output also feeds a tanh (or a Linear): the sliced backward fold would change what it reads, so the
    norm stays an affine before the GELU, with the blocker named. (A Linear could take the inverse of the slice on
    its columns, as a reader of a whole compensated tensor does; that is not done under a concatenation.)"""
    model, x = randomize(ConcatThenNorm(layer, shared=shared)).eval(), concat_input(layer)
    reference = model(x)
    gm, decisions = fuse(model, x)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", reasons.NONLINEAR)
    assert f"is also read by {reader}" in (d.no_backward or ""), d.no_backward
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert rel_err(_sliced_by_hand(model)(x.double()), model.double()(x.double())) > NAIVE_MIN_ERR
