"""The view-like op table, walked rule by rule.

Every rule of ``slabconv.engine.rules.RULES`` with ``view_like=True`` serves both the forward walk (norm -> op ->
consumer) and the backward walk (producer -> op -> norm). For each such rule this file has a forward case that
folds forward, a backward case that folds backward, and a case where the fold must not happen, each a small model
whose exported graph really holds the rule's op (checked). ``test_every_view_rule_has_cases`` fails when a rule is
added to the table without its cases here.

Then LeViT's ``MLPLayerWithBN`` (``bn(linear(x).flatten(0, 1)).reshape_as(linear(x))``) in a LeViT-style model of
our own, whose every BatchNorm folds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv.engine import capture, fold_all, reasons
from slabconv.engine import norm_free as engine_norm_free
from slabconv.engine.rules import RULE_OF, RULES, Chan, Pass
from slabconv.zoo.norms import RepBN
from tests.foldcheck import (
    NAIVE_MIN_ERR,
    TOL,
    assert_affine_only,
    aten_ops,
    bn_nodes,
    kept_affines,
    naive_fold,
    randomize,
    rel_err,
)

C, N, B = 8, 6, 3
Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def flat_repbn() -> nn.Module:
    """A RepBN over ``x.reshape(-1, C)``: channels on the last axis of a tensor of any rank."""
    return RepBN(C, flatten_tokens=True)


class LevitBN(nn.Module):
    """LeViT's BatchNorm over ``(B * N, C)``: ``bn(x.flatten(0, 1))``."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.flatten(0, 1))


class ChannelsFirstBN(nn.Module):
    """BatchNorm1d over ``x.transpose(1, 2)``, returned as ``(B, C, N)``."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2))


@dataclass(frozen=True)
class Case:
    """``op(y, x)`` applied to the normalised ``y`` (forward, block) or to the producer's output (backward); ``x``
    is the model's input (a shape / dtype template). ``aten``: the op the exported graph must hold."""

    op: Op
    aten: str
    norm: Callable[[], nn.Module] = flat_repbn
    consumer: Callable[[], nn.Module] = lambda: nn.Linear(C, 5)
    reason: str | None = None  # block cases: the reason slabconv must give
    naive_wrong: bool = True  # block cases: the naive fold into ``fc`` is checked to be wrong
    n: int = N


def _perm() -> torch.Tensor:
    return torch.tensor([3, 1, 7, 0, 5, 2, 6, 4])


def _idx() -> torch.Tensor:
    return torch.tensor([4, 0, 2])


UNSUPPORTED = reasons.UNSUPPORTED_PREFIX
OFF = reasons.CONSUMER_OFF_CHANNEL

# rule -> (forward cases, backward cases, block case or None when the rule's op can never break a fold by itself)
CASES: dict[str, tuple[list[Case], list[Case], Case | None]] = {
    "identity": (
        [
            Case(lambda y, x: torch.ops.aten.alias(y), "alias.default"),
            Case(lambda y, x: y.clone(), "clone.default"),
            Case(lambda y, x: y.detach(), "detach.default"),
            Case(lambda y, x: y.transpose(1, 2).contiguous().transpose(1, 2), "contiguous.default"),
        ],
        [Case(lambda h, x: torch.ops.aten.alias(h), "alias.default"), Case(lambda h, x: h.clone(), "clone.default")],
        None,  # the output is the input
    ),
    "dropout": (
        [Case(lambda y, x: F.dropout(y, 0.3, training=False), "dropout.default")],
        [Case(lambda h, x: F.dropout(h, 0.3, training=False), "dropout.default")],
        Case(lambda y, x: torch.ops.aten.dropout(y, 0.3, True), "dropout.default", reason=reasons.TRAIN_MODE),
    ),
    "cast": (
        [Case(lambda y, x: y.float(), "to.dtype"), Case(lambda y, x: y.double().float(), "to.dtype")],
        [Case(lambda h, x: h.float(), "to.dtype")],
        Case(lambda y, x: y.to(torch.int32).float(), "to.dtype", reason=UNSUPPORTED + "aten.to"),
    ),
    "type_as": (
        [Case(lambda y, x: y.type_as(x), "type_as.default")],
        [Case(lambda h, x: h.type_as(x), "type_as.default")],
        Case(lambda y, x: y.type_as(x.long()).type_as(x), "type_as.default", reason=UNSUPPORTED + "aten.type_as"),
    ),
    "reshape": (
        [
            Case(lambda y, x: y.reshape(y.shape[0], -1), "reshape.default", consumer=lambda: nn.Linear(N * C, 5)),
            Case(lambda y, x: y.view(y.shape[0], -1), "view.default", consumer=lambda: nn.Linear(N * C, 5)),
            Case(lambda y, x: y.ravel(), "ravel.default", consumer=lambda: nn.Linear(B * N * C, 5)),
        ],
        [Case(lambda h, x: h.reshape(-1, C), "reshape.default", norm=lambda: nn.BatchNorm1d(C))],
        Case(
            lambda y, x: y.transpose(1, 2).reshape(x.shape),  # (B, C, N) data read as (B, N, C), N != C
            "reshape.default",
            reason=reasons.CHANNEL_MIXING_RESHAPE,
        ),
    ),
    "reshape_as": (
        [
            Case(lambda y, x: y.reshape_as(x), "reshape_as.default", norm=LevitBN),
            Case(lambda y, x: y.view_as(x), "view_as.default", norm=LevitBN),
        ],
        [
            Case(lambda h, x: h.reshape_as(x.flatten(0, 1)), "reshape_as.default", norm=lambda: nn.BatchNorm1d(C)),
            Case(lambda h, x: h.view_as(x.flatten(0, 1)), "view_as.default", norm=lambda: nn.BatchNorm1d(C)),
        ],
        Case(
            lambda y, x: y.reshape_as(x),
            "reshape_as.default",
            norm=ChannelsFirstBN,
            reason=reasons.CHANNEL_MIXING_RESHAPE,
        ),
    ),
    "flatten": (
        [
            Case(lambda y, x: y.transpose(1, 2).flatten(1), "flatten.using_ints", consumer=lambda: nn.Linear(N * C, 5)),
            Case(lambda y, x: y.unflatten(1, (2, N // 2)), "unflatten.int"),
        ],
        [
            Case(lambda h, x: h.flatten(0, 1), "flatten.using_ints", norm=lambda: nn.BatchNorm1d(C)),
            Case(lambda h, x: h.unflatten(1, (2, N // 2)), "unflatten.int"),
        ],
        Case(
            lambda y, x: y.unflatten(-1, (2, C // 2)).transpose(-1, -2).flatten(-2),
            "unflatten.int",
            reason=reasons.CHANNEL_MIXING_RESHAPE,
        ),
    ),
    "squeeze": (
        [
            Case(lambda y, x: y.unsqueeze(2), "unsqueeze.default"),
            Case(lambda y, x: y.unsqueeze(1).squeeze(1), "squeeze.dim"),
            Case(lambda y, x: y.unsqueeze(1).squeeze((1,)), "squeeze.dims"),
            Case(lambda y, x: y[:, :1].squeeze(), "squeeze.default"),
        ],
        [
            Case(lambda h, x: h.unsqueeze(2), "unsqueeze.default"),
            Case(lambda h, x: h[:, :1].squeeze(), "squeeze.default"),
        ],
        None,  # only axes of size 1 come and go; a channel axis of size C > 1 is never one of them
    ),
    "permute": (
        [
            Case(lambda y, x: y.permute(0, 2, 1), "permute.default", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.transpose(1, 2), "transpose.int", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.swapaxes(1, 2), "swapaxes.default", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.swapdims(1, 2), "swapdims.default", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.movedim(2, 1), "movedim.int", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.movedim((1, 2), (2, 1)), "movedim.intlist", consumer=lambda: nn.Conv1d(C, 5, 1)),
            Case(lambda y, x: y.mT, "mT.default", consumer=lambda: nn.Conv1d(C, 5, 1)),
        ],
        [
            Case(lambda h, x: h.transpose(1, 2), "transpose.int", norm=lambda: nn.BatchNorm1d(C)),
            Case(lambda h, x: h.movedim(2, 1), "movedim.int", norm=lambda: nn.BatchNorm1d(C)),
            Case(lambda h, x: h.swapaxes(1, 2), "swapaxes.default", norm=lambda: nn.BatchNorm1d(C)),
            Case(lambda h, x: h.mT, "mT.default", norm=lambda: nn.BatchNorm1d(C)),
        ],
        Case(lambda y, x: y.transpose(1, 2), "transpose.int", reason=OFF, n=C),
    ),
    "expand": (
        [Case(lambda y, x: y.unsqueeze(1).expand(-1, 3, -1, -1), "expand.default")],
        [Case(lambda h, x: h[:, :1].expand(-1, N, -1), "expand.default")],
        Case(lambda y, x: y.unsqueeze(-1).expand(-1, -1, -1, C), "expand.default", reason=OFF),
    ),
    "expand_as": (
        [Case(lambda y, x: y[:, :1].expand_as(x), "expand_as.default")],
        [Case(lambda h, x: h[:, :1].expand_as(x), "expand_as.default")],
        Case(
            lambda y, x: y.unsqueeze(-1).expand_as(x.unsqueeze(-1) * x.unsqueeze(-2)), "expand_as.default", reason=OFF
        ),
    ),
    "repeat": (
        [
            Case(lambda y, x: y.repeat(1, 2, 1), "repeat.default"),
            Case(
                lambda y, x: y.repeat_interleave(2, dim=-1),
                "repeat_interleave.self_int",
                consumer=lambda: nn.Linear(2 * C, 5),
            ),
        ],
        [Case(lambda h, x: h.repeat(1, 2, 1), "repeat.default")],
        Case(lambda y, x: y.unsqueeze(-1).repeat(1, 1, 1, C), "repeat.default", reason=OFF),
    ),
    "slice": (
        [
            Case(lambda y, x: y[:, 1:4], "slice.Tensor"),
            Case(lambda y, x: y.narrow(1, 0, 3), "narrow.default"),
            Case(lambda y, x: y[:, 0], "select.int"),
            # a contiguous part of the channel axis: its channels' scale and shift (tests/test_two_door_folds.py)
            Case(lambda y, x: y[..., 2:6], "slice.Tensor", consumer=lambda: nn.Linear(4, 5)),
            # strided parts: the channels they pick (tests/test_two_door_folds.py shows a contiguous part's wrong)
            Case(lambda y, x: y[..., ::2], "slice.Tensor", consumer=lambda: nn.Linear(C // 2, 5)),
            Case(lambda y, x: y[..., -7:-1:3], "slice.Tensor", consumer=lambda: nn.Linear(2, 5)),
        ],
        [Case(lambda h, x: h[:, 1:], "slice.Tensor"), Case(lambda h, x: h.select(1, 2), "select.int")],
        # one channel selected: its axis is gone, and no layout holds one channel without it (the naive fold does
        # not even have the right shapes)
        Case(
            lambda y, x: y[..., 2].unsqueeze(-1),
            "select.int",
            consumer=lambda: nn.Linear(1, 5),
            reason=UNSUPPORTED + "aten.select",
            naive_wrong=False,
        ),
    ),
    "index": (
        [
            Case(lambda y, x: y[:, _idx()], "index.Tensor"),
            Case(lambda y, x: y.index_select(1, _idx()), "index_select.default"),
            Case(lambda y, x: torch.gather(y, 1, _idx().view(1, 3, 1).expand(y.shape[0], 3, C)), "gather.default"),
            # constant channel indices: the channels they pick, in their order (a repeat too)
            Case(lambda y, x: y[..., _idx()], "index.Tensor", consumer=lambda: nn.Linear(3, 5)),
            Case(
                lambda y, x: y.index_select(-1, _perm()[:5]),
                "index_select.default",
                consumer=lambda: nn.Linear(5, 5),
            ),
        ],
        [
            Case(lambda h, x: h[:, _idx()], "index.Tensor"),
            Case(lambda h, x: h.index_select(1, _idx()), "index_select.default"),
        ],
        Case(
            lambda y, x: torch.gather(y, 2, _perm().expand(y.shape[0], N, C)),
            "gather.default",
            reason=UNSUPPORTED + "aten.gather",
        ),
    ),
    "roll_flip": (
        [Case(lambda y, x: y.roll(2, 1), "roll.default"), Case(lambda y, x: y.flip(1), "flip.default")],
        [Case(lambda h, x: h.roll(2, 1), "roll.default"), Case(lambda h, x: h.flip(1), "flip.default")],
        Case(lambda y, x: y.flip(-1), "flip.default", reason=UNSUPPORTED + "aten.flip"),
    ),
    "as_strided": (
        [Case(lambda y, x: torch.as_strided(y, y.shape, y.stride()), "as_strided.default")],
        [Case(lambda h, x: torch.as_strided(h, h.shape, h.stride()), "as_strided.default")],
        Case(
            lambda y, x: torch.as_strided(y, (y.shape[0], C, C), (C * C, 1, C)),
            "as_strided.default",
            reason=UNSUPPORTED + "aten.as_strided",
            n=C,
        ),
    ),
    "pad": (
        [
            Case(lambda y, x: F.pad(y.transpose(1, 2), (1, 1), mode="reflect").transpose(1, 2), "pad.default"),
            Case(lambda y, x: F.pad(y.transpose(1, 2), (2, 1), mode="replicate").transpose(1, 2), "pad.default"),
            Case(lambda y, x: F.pad(y, (0, 0, -1, 0)), "pad.default"),
        ],
        [
            Case(
                lambda h, x: F.pad(h.transpose(1, 2), (1, 1), mode="reflect"),
                "pad.default",
                norm=lambda: nn.BatchNorm1d(C),
            )
        ],
        Case(lambda y, x: F.pad(y, (0, 0, 1, 1)), "pad.default", reason=reasons.ZERO_PADDING_AFTER_NORM),
    ),
    "split": (
        [
            Case(lambda y, x: torch.cat(y.split([2, N - 2], 1)[::-1], 1), "split_with_sizes.default"),
            Case(lambda y, x: torch.cat(y.split(2, 1)[::-1], 1), "split.Tensor"),
            Case(lambda y, x: torch.cat(y.chunk(2, 1)[::-1], 1), "chunk.default"),
            Case(lambda y, x: torch.stack(y.unbind(1)[::-1], 1), "unbind.int"),
            Case(lambda y, x: torch.cat(y.tensor_split(2, 1)[::-1], 1), "tensor_split.sections"),
            Case(lambda y, x: torch.cat(y.tensor_split([2], 1)[::-1], 1), "tensor_split.indices"),
            # the channel axis in two halves, put back swapped: a permutation of the norm's channels
            Case(lambda y, x: torch.cat(y.chunk(2, -1)[::-1], -1), "chunk.default"),
        ],
        [
            Case(lambda h, x: h.chunk(2, 1)[0], "chunk.default"),
            Case(lambda h, x: h.split([2, N - 2], 1)[1], "split_with_sizes.default"),
            Case(lambda h, x: h.unbind(1)[0], "unbind.int", norm=lambda: nn.BatchNorm1d(C)),
        ],
        # the channel axis in single channels (unbind removes the axis), stacked back reversed
        Case(lambda y, x: torch.stack(y.unbind(-1)[::-1], -1), "unbind.int", reason=UNSUPPORTED + "aten.unbind"),
    ),
    "upsample_nearest": (
        [
            Case(
                lambda y, x: F.interpolate(y.transpose(1, 2), scale_factor=2).transpose(1, 2), "upsample_nearest1d.vec"
            ),
            Case(
                lambda y, x: F.interpolate(y.transpose(1, 2), size=9, mode="nearest-exact").transpose(1, 2),
                "_upsample_nearest_exact1d.vec",
            ),
        ],
        [
            Case(
                lambda h, x: F.interpolate(h.transpose(1, 2), scale_factor=2),
                "upsample_nearest1d.vec",
                norm=lambda: nn.BatchNorm1d(C),
            )
        ],
        # interpolating the channel axis itself: 2C positions, each a copy of some channel (the naive fold does
        # not even have the right shapes)
        Case(
            lambda y, x: F.interpolate(y, scale_factor=2),
            "upsample_nearest1d.vec",
            consumer=lambda: nn.Linear(2 * C, 5),
            reason=UNSUPPORTED + "aten.upsample_nearest1d",
            naive_wrong=False,
        ),
    ),
}


class Forward(nn.Module):
    """``fc(op(norm(x), x))``."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.op = case.op
        self.norm = case.norm()
        self.fc = case.consumer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.op(self.norm(x), x))


class Backward(nn.Module):
    """``gelu(norm(op(producer(x), x)))``: the GELU blocks the forward fold; the producer is private."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.op = case.op
        self.producer = nn.Linear(C, C)
        self.norm = case.norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.op(self.producer(x), x)))


def _tokens(n: int) -> torch.Tensor:
    return torch.randn(B, n, C, generator=torch.Generator().manual_seed(0)) * 2 + 0.5


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(5)  # a train-mode dropout draws the same mask in the original and in the fused graph
    return model(x)


def _fold(
    model: nn.Module, case: Case, before: Callable[[torch.fx.GraphModule], None] | None = None
) -> tuple[torch.fx.GraphModule, list, torch.Tensor, torch.Tensor]:
    """Randomised eval model, its reference output, and its captured graph (which must hold the case's op),
    folded (``before`` sees the graph first)."""
    model = randomize(model, seed=1).eval()
    x = _tokens(case.n)
    reference = _run(model, x)
    gm = capture(model, x)
    assert f"aten.{case.aten}" in {str(n.target) for n in gm.graph.nodes}, f"the graph has no aten.{case.aten}"
    if before is not None:
        before(gm)
    return gm, fold_all(gm), x, reference


def _cases(direction: int) -> list:
    out = []
    for name, cases in CASES.items():
        entries = cases[direction] if direction < 2 else [cases[2]] if cases[2] is not None else []
        out += [pytest.param(name, case, id=f"{name}-{case.aten}-{i}") for i, case in enumerate(entries)]
    return out


def _rule_of(case: Case) -> str:
    packet, overload = case.aten.split(".")
    return RULE_OF[getattr(getattr(torch.ops.aten, packet), overload)].name


def test_every_view_rule_has_cases():
    view_rules = {r.name for r in RULES if r.view_like}
    assert set(CASES) == view_rules
    for name, (forward, backward, block) in CASES.items():
        assert forward and backward, name
        for case in [*forward, *backward, *([block] if block else [])]:
            assert _rule_of(case) == name, (name, case.aten)


def _channels_pass_whole(name: str, case: Case) -> Callable[[torch.fx.GraphModule], None]:
    """For a rule without a block case: it moves no element across channels, so the channels on the last axis of
    the op's input come out whole (checked on the captured graph)."""

    def check(gm: torch.fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if str(node.target) == f"aten.{case.aten}":
                last = node.args[0].meta["val"].dim() - 1
                outcome = RULE_OF[node.target].step(node, node.args[0], Chan(last, C))
                assert isinstance(outcome, Pass) and outcome.chan.plain, (name, outcome)

    return check


@pytest.mark.parametrize(("name", "case"), _cases(0))
def test_forward_through_the_op(name, case):
    """Folds forward; for the rules without a block case, also ``_channels_pass_whole``."""
    model = Forward(case)
    gm, decisions, x, reference = _fold(
        model, case, _channels_pass_whole(name, case) if CASES[name][2] is None else None
    )
    (d,) = decisions
    assert (d.action, d.into, d.reason) == ("folded-forward", ["fc"], None)
    assert rel_err(_run(gm, x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


@pytest.mark.parametrize(("name", "case"), _cases(1))
def test_backward_through_the_op(name, case):
    model = Backward(case)
    gm, decisions, x, reference = _fold(model, case)
    (d,) = decisions
    assert (d.action, d.into, d.reason) == ("folded-backward", ["producer"], None), d
    assert rel_err(_run(gm, x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


@pytest.mark.parametrize(("name", "case"), _cases(2))
def test_the_op_blocks_where_the_fold_would_be_wrong(name, case):
    model = randomize(Forward(case), seed=1).eval()
    x = _tokens(case.n)
    reference = _run(model, x)
    if case.naive_wrong:
        assert rel_err(_run(naive_fold(model, "norm", "fc"), x), reference) > NAIVE_MIN_ERR
    gm, decisions, _, _ = _fold(model, case)
    (d,) = decisions
    assert (d.action, d.reason, d.into) == ("kept-affine", case.reason, []), d
    assert rel_err(_run(gm, x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm) and len(kept_affines(gm)) == 1


# --------------------------------------------------------------------------------------------- LeViT


class MLPLayerWithBN(nn.Module):
    """LeViT's Linear + BatchNorm (as Hugging Face writes it): the BN runs over ``(B * N, C)`` and the result is
    put back with ``reshape_as`` of the Linear's own output."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cin, cout, bias=False)
        self.batch_norm = nn.BatchNorm1d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return self.batch_norm(h.flatten(0, 1)).reshape_as(h)


class ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout))


class LevitAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 2, key: int = 4) -> None:
        super().__init__()
        self.heads, self.key = heads, key
        self.qkv = MLPLayerWithBN(dim, heads * key * 3)
        self.projection = MLPLayerWithBN(heads * key, dim)
        self.attention_biases = nn.Parameter(torch.randn(heads, 1, 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.heads, -1).split([self.key] * 3, dim=3)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        attn = (q @ k.transpose(-2, -1) / math.sqrt(self.key) + self.attention_biases).softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, self.heads * self.key)
        return self.projection(F.hardswish(out))


class LevitMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_up = MLPLayerWithBN(dim, 2 * dim)
        self.linear_down = MLPLayerWithBN(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_down(F.hardswish(self.linear_up(x)))


class LevitStyle(nn.Module):
    """Conv-BN stem, residual attention and MLP blocks of ``MLPLayerWithBN``, mean pool, BatchNorm1d + Linear
    head: 11 BatchNorms in three shapes."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvBN(3, 8), nn.Hardswish(), ConvBN(8, dim))
        self.blocks = nn.ModuleList([m for _ in range(2) for m in (LevitAttention(dim), LevitMLP(dim))])
        self.head_bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.stem(img).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.head_bn(x.mean(1)))


def test_levit_style_model_folds_every_batchnorm():
    """``reshape_as(h)`` reads ``h`` for its shape only: ``h`` stays private to the BatchNorm, so every
    ``MLPLayerWithBN`` folds backward into its Linear (before, ``reshape_as`` had no rule and ``h`` counted as
    read twice: every one of them was kept as a multiply and an add)."""
    torch.manual_seed(0)
    model = randomize(LevitStyle()).eval()
    x = torch.randn(B, 3, 16, 16)
    reference = model(x)
    bn_count = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    gm = capture(model, x)
    bare_ops = aten_ops(engine_norm_free(gm))
    decisions = fold_all(gm)
    assert len(decisions) == bn_count == 11
    actions = [(d.norm, d.action) for d in decisions]
    assert actions.count(("head_bn", "folded-forward")) == 1
    assert sum(a == "folded-backward" for _, a in actions) == 10, actions
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert rel_err(gm(x[:1]), model(x[:1])) <= TOL[torch.float32]
    assert_affine_only(gm, bare_ops, 0)
