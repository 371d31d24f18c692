"""Helpers for the refusal, custom-model and property tests: tiny norm modules users bring, the naive fold a
careless tool would apply, the verification's relative error, and structural checks on a fused graph."""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterable

import torch
from torch import fx, nn

from slabconv import engine, fold
from slabconv.engine.norms import BN_OPS
from tests.conftest import randomize_norms

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
"""The verification tolerance: max|candidate - reference| / max|reference| per output, by dtype."""

NAIVE_MIN_ERR = 1e-3
"""A naive fold must be off by at least this much for a refusal test to prove anything."""


class RepBN_NLP(nn.Module):  # noqa: N801 - the seed module's own name
    """The seed ``RepBN_NLP`` (the RepBN users bring for NLP models): BatchNorm1d over the embedding axis of
    ``(B, N, C)`` plus a learnable scalar ``alpha``, with the transposes around it, as the seed writes it."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.bn = nn.BatchNorm1d(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        x_bn = self.bn(x)
        x = x_bn + self.alpha * x
        return x.transpose(1, 2)


class Transpose(nn.Module):
    """PatchTST's ``Transpose(1, 2)`` helper module."""

    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(*self.dims)


def patchtst_norm(channels: int) -> nn.Sequential:
    """PatchTST's BatchNorm over ``(B, N, C)``: ``Sequential(Transpose(1, 2), BatchNorm1d(C), Transpose(1, 2))``."""
    return nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(channels), Transpose(1, 2))


def randomize(model: nn.Module, seed: int = 0, positive: bool | None = None) -> nn.Module:
    """``tests.conftest.randomize_norms``, then ``positive=True`` / ``False`` forces every scale ``s`` > 0 /
    some < 0."""
    randomize_norms(model, seed)
    with torch.no_grad():
        if positive is not None:
            for mod in model.modules():
                if isinstance(getattr(mod, "alpha", None), nn.Parameter):
                    mod.alpha.copy_(mod.alpha.abs() + 0.5 if positive else -(mod.alpha.abs() + 2.0))
                elif isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.affine:
                    w = mod.weight.abs() + 0.1
                    if not positive:
                        w[::2] = -w[::2]
                    mod.weight.copy_(w)
    return model


def affine_of(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, t)`` of an eval-mode norm module (a BatchNorm, a module with ``bn`` and ``alpha``, or a Sequential
    holding one BatchNorm) from its running statistics, via ``slabconv.fold.repbn_affine``."""
    bn = next(m for m in norm.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    alpha = getattr(norm, "alpha", None)
    mean = bn.running_mean if bn.running_mean is not None else torch.zeros(bn.num_features)
    var = bn.running_var if bn.running_var is not None else torch.ones(bn.num_features)
    return fold.repbn_affine(mean, var, bn.eps, bn.weight, bn.bias, alpha)


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    *parent, leaf = path.split(".")
    owner = model.get_submodule(".".join(parent)) if parent else model
    setattr(owner, leaf, module)


def naive_fold(model: nn.Module, norm: str, layer: str, shift_mult: float = 1.0) -> nn.Module:
    """What a careless tool does: drop ``norm`` and fold its affine into ``layer`` (a Linear, Conv or ConvTranspose
    of one group) as if the layer read the norm's output directly, ignoring whatever is in between or beside. In
    place on a copy; tied weights stay tied (the copy keeps the sharing)."""
    naive = copy.deepcopy(model)
    scale, shift = affine_of(_get(naive, norm))
    _set(naive, norm, nn.Identity())
    target = _get(naive, layer)
    with torch.no_grad():
        if isinstance(target, nn.Linear):
            w, b = fold.fold_into_linear(target.weight, target.bias, scale, shift * shift_mult)
        elif isinstance(target, nn.modules.conv._ConvTransposeNd):  # as if t reached every output through every tap
            assert target.groups == 1
            w, b = fold.fold_into_conv(target.weight.transpose(0, 1), target.bias, scale, shift * shift_mult)
            w = w.transpose(0, 1)
        else:
            assert isinstance(target, nn.modules.conv._ConvNd)
            w, b = fold.fold_into_conv(target.weight, target.bias, scale, shift * shift_mult, target.groups)
        target.weight.copy_(w)
        if target.bias is None:
            target.bias = nn.Parameter(b)
        else:
            target.bias.copy_(b)
    return naive


def norm_free(model: nn.Module, norms: Iterable[str]) -> nn.Module:
    """The same network with the named norm modules replaced by identity (the norm-free bound)."""
    bare = copy.deepcopy(model)
    for path in norms:
        _set(bare, path, nn.Identity())
    return bare


def _outputs(y: object) -> list[torch.Tensor]:
    if isinstance(y, torch.Tensor):
        return [y]
    assert isinstance(y, (tuple, list))
    return [t for item in y for t in _outputs(item)]


def rel_err(candidate: object, reference: object) -> float:
    """The largest relative error over the outputs: ``max|c - r| / max|r|``, computed in float64; inf when the
    candidate is not finite where the reference is."""
    worst = 0.0
    for c, r in zip(_outputs(candidate), _outputs(reference), strict=True):
        c, r = c.detach().double(), r.detach().double()
        if not bool(torch.isfinite(c).all()):
            return float("inf")
        worst = max(worst, float((c - r).abs().max() / r.abs().max()))
    return worst


def exact(model: nn.Module, x: torch.Tensor) -> object:
    """The original model evaluated in float64 (its own weights, upcast): the reference for float16 / bfloat16,
    whose own outputs are rounded to 1-2 ulps of the tolerance (the fused half model must be
    within the dtype's tolerance of the exact result, as the original half model is)."""
    wide = copy.deepcopy(model).double()
    return wide(x.double() if x.is_floating_point() else x)


def assert_half_close(out: object, model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> None:
    """A fused half-precision model is judged against the exact (float64) result: within the dtype's tolerance,
    or at most 1.5x the original half model's own error when that is already larger (its outputs carry 1-2 ulps
    of rounding, the size of the tolerance itself)."""
    truth = exact(model, x)
    own = rel_err(model(x), truth)
    assert rel_err(out, truth) <= max(TOL[dtype], 1.5 * own), (rel_err(out, truth), own)


def fuse(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list[engine.Decision]]:
    """Capture and fold, as ``slabconv fuse`` does."""
    gm = engine.capture(model, x)
    return gm, engine.fold_all(gm)


_PERMUTES = {"permute.default", "transpose.int", "t.default"}


def aten_ops(gm: nn.Module | fx.GraphModule, x: torch.Tensor | None = None) -> collections.Counter[str]:
    """The ATen ops of a graph (or of a module, captured with ``x``), counted by name; transpose / permute / t
    count as one kind (``permute``), since cancelling a pair may leave either of the two."""
    if not isinstance(gm, fx.GraphModule):
        assert x is not None
        gm = engine.capture(gm, x)
    names = (str(n.target).removeprefix("aten.") for n in gm.graph.nodes if n.op == "call_function")
    return collections.Counter("permute" if name in _PERMUTES else name for name in names)


def bn_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target in BN_OPS]


def kept_affines(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``mul`` nodes of the per-channel affines slabconv kept (their scale is a ``<norm>.scale`` tensor)."""
    return [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.mul.Tensor
        and isinstance(n.args[1], fx.Node)
        and n.args[1].op == "get_attr"
        and ".scale" in str(n.args[1].target)
    ]


def assert_affine_only(gm: fx.GraphModule, bare_ops: collections.Counter[str], kept: int) -> None:
    """The fused graph is the norm-free graph plus ``kept`` multiply/add pairs: no BN op, no transposes or
    other ops left from the norms."""
    assert not bn_nodes(gm)
    assert len(kept_affines(gm)) == kept
    expected = bare_ops.copy()
    expected["mul.Tensor"] += kept
    expected["add.Tensor"] += kept
    got = aten_ops(gm)
    assert +got == +expected, (
        f"fused graph ops differ from the norm-free graph + {kept} affines: {got - expected} / {expected - got}"
    )
