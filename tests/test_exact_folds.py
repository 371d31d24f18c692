"""Exact folds through the ops models put between a norm and its layer (issue 36): interpolation and pooling.

Each op family has cases that fold (the fused graph matches the original; the naive fold, which is then exact, is
what slabconv did) and a case where the naive fold would be wrong and slabconv keeps the affine with the reason.
``test_every_resampling_rule_has_cases`` fails when a pooling or resampling rule is added to the table without
its cases here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv.engine import reasons
from slabconv.engine.rules import RULE_OF, RULES
from slabconv.zoo.norms import RepBN
from tests.foldcheck import NAIVE_MIN_ERR, TOL, bn_nodes, fuse, kept_affines, naive_fold, randomize, rel_err

C, B = 8, 2
Op = Callable[[torch.Tensor], torch.Tensor]


def grid(dims: int, size: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, C, *([size] * dims), generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def sample_grid(seed: int = 1) -> torch.Tensor:
    """Sampling positions for ``F.grid_sample`` of a 2-D input, a quarter of them outside ``[-1, 1]``."""
    return torch.rand(B, 4, 4, 2, generator=torch.Generator().manual_seed(seed)) * 2.6 - 1.3


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
            Case(_up("bilinear", scale_factor=2), "upsample_bilinear2d"),
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
            Case(lambda y: F.grid_sample(y, sample_grid(), padding_mode="border", align_corners=False), "grid_sampler"),
            Case(
                lambda y: F.grid_sample(y, sample_grid(), "bicubic", padding_mode="reflection", align_corners=True),
                "grid_sampler",
            ),
        ],
        # samples outside the input are zeros: 0 in the original, t after a naive fold
        Case(
            lambda y: F.grid_sample(y, sample_grid(), padding_mode="zeros", align_corners=False),
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


def _params(refusals: bool) -> list:
    out = []
    for name, (folds, block) in RESAMPLING.items():
        cases = ([block] if block is not None else []) if refusals else folds
        out += [pytest.param(case, id=f"{name}-{case.aten}-{i}") for i, case in enumerate(cases)]
    return out


def _fused(case: Case) -> tuple[nn.Module, torch.Tensor, torch.fx.GraphModule, list]:
    model = randomize(Resampled(case.op, case.dims, case.linear), seed=3, positive=case.positive).eval()
    x = grid(case.dims)
    gm, decisions = fuse(model, x)
    assert any(str(n.target).startswith(f"aten.{case.aten}.") for n in gm.graph.nodes), case.aten
    return model, x, gm, decisions


def test_every_resampling_rule_has_cases():
    """Every pooling / resampling rule of the table (forward walk only) is exercised here, and each case's op is
    one of its rule's ops."""
    families = {"interpolate", "grid_sample", "adaptive_avg_pool", "avg_pool", "max_pool", "max_pool_indices"}
    assert families <= {r.name for r in RULES}
    assert set(RESAMPLING) == families
    for name, (folds, block) in RESAMPLING.items():
        for case in [*folds, *([block] if block else [])]:
            packet = getattr(torch.ops.aten, case.aten)
            assert any(
                RULE_OF.get(getattr(packet, o)) is not None and RULE_OF[getattr(packet, o)].name == name
                for o in packet.overloads()
            ), (name, case.aten)


@pytest.mark.parametrize("case", _params(refusals=False))
def test_folds_through_the_op(case):
    model, x, gm, decisions = _fused(case)
    (d,) = decisions
    assert (d.action, d.into, d.reason) == ("folded-forward", ["fc"], None)
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


@pytest.mark.parametrize("case", _params(refusals=True))
def test_refused_where_the_naive_fold_is_wrong(case):
    model, x, gm, decisions = _fused(case)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", case.reason)
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc")(x), reference) > NAIVE_MIN_ERR
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


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
    """(Nearest interpolation of the channel axis: ``tests/test_view_rules.py``.)"""
    model = randomize(ChannelsLast("linear")).eval()
    x = torch.randn(B, 6, C)
    gm, decisions = fuse(model, x)
    (d,) = decisions
    assert (d.action, d.reason) == ("kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.upsample_linear1d")
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
