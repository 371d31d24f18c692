"""Data-flow analysis on a ``torch.export`` graph: find every norm, follow its output to every consumer.

The model is captured with ``torch.export`` (a dynamic batch axis where the model allows one) and unlifted
with ``ExportedProgram.module()``: an fx graph of ATen ops whose parameters are ``get_attr`` nodes. Norms are
found by their ops, not by module names: every ``aten.batch_norm`` (or a core-ATen form such as
``_native_batch_norm_legit_no_training``; see ``_BN_LAYOUT``) is a norm, and when its input ``x`` also feeds
``alpha * x`` that is added to the BN output, the norm is a RepBN (SLAB eq. 4).

From the norm's output the channels are tracked through every op that commutes with a per-channel affine
(DESIGN.md section 2): each op is one entry of ``FORWARD_RULES`` saying where the channels go (a ``Chan``: the
axis, and how a reshape that merged the channel axis with token axes lays them out) and whether the shift picks
up a factor (a sum over N tokens multiplies it by N). A path ends at a consumer that can absorb the affine
(Linear contracting the channel axis, unpadded conv on axis 1) or at an op that blocks the fold, with a named
reason (``slabconv.reasons``). Nothing is skipped silently: an op with no rule blocks with
``unsupported-op:<aten op>``. A ``cat``/``stack`` is decided once all its inputs are known: it passes only
when every piece comes from the same norm with the same layout and shift factor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from slabconv.engine import reasons
from slabconv.errors import UnsupportedModelError

aten = torch.ops.aten

# BatchNorm ops as they appear in export graphs (``aten.batch_norm``) and in core-ATen / decomposed programs:
# op -> (positions of input, weight, bias, running_mean, running_var; training flag position or constant; eps
# position; returns a tuple whose item 0 is the output).
_BN_LAYOUT: dict[Any, tuple[tuple[int | None, ...], int | bool, int, bool]] = {
    aten.batch_norm.default: ((0, 1, 2, 3, 4), 5, 7, False),
    aten._native_batch_norm_legit_no_training.default: ((0, 1, 2, 3, 4), False, 6, True),
    aten._native_batch_norm_legit.default: ((0, 1, 2, 3, 4), 5, 7, True),
    aten._native_batch_norm_legit.no_stats: ((0, 1, 2, None, None), 3, 5, True),
    aten._native_batch_norm_legit_functional.default: ((0, 1, 2, 3, 4), 5, 7, True),
    aten.native_batch_norm.default: ((0, 1, 2, 3, 4), 5, 7, True),
}
for _name, _layout in (
    ("_batch_norm_with_update", ((0, 1, 2, 3, 4), True, 6, True)),
    ("_batch_norm_no_update", ((0, 1, 2, 3, 4), False, 6, True)),
):
    if hasattr(aten, _name):
        _BN_LAYOUT[getattr(aten, _name).default] = _layout  # type: ignore[assignment]
BN_OPS = set(_BN_LAYOUT)


# --------------------------------------------------------------------------------------------- capture


def capture(model: torch.nn.Module, example: torch.Tensor, dynamic_batch: bool = True) -> fx.GraphModule:
    """Export ``model`` (eval mode) with ``torch.export`` and return the unlifted fx ``GraphModule``.

    Args:
        model: the network, already in the state it should be folded in (eval mode).
        example: one example input ``(B, ...)`` with ``B >= 2`` so the batch axis can be symbolic.
        dynamic_batch: mark axis 0 of the input dynamic; falls back to a static batch when the model's code
            specialises it.

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the model (the message carries its reason).
    """
    batch = torch.export.Dim("batch")
    attempts = [{"x": {0: batch}}, None] if dynamic_batch else [None]
    last: Exception | None = None
    for shapes in attempts:
        try:
            ep = torch.export.export(model, (example,), dynamic_shapes=(shapes and (shapes["x"],)))
            return ep.module()
        except Exception as err:  # noqa: BLE001 - report torch.export's own reason
            last = err
    first_line = str(last).strip().splitlines()[0] if last else "unknown error"
    raise UnsupportedModelError(f"torch.export could not trace the model: {first_line}")


def attr(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node names, None for None; raises ``TypeError`` for anything else."""
    if node is None:
        return None
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return value
    raise TypeError(f"{node} is not a parameter")


def shape_of(node: fx.Node) -> tuple[Any, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _expr(x: Any) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def same_size(a: Any, b: Any) -> bool:
    """True when two (possibly symbolic) sizes are equal for every value of the symbols."""
    return sympy.simplify(_expr(a) - _expr(b)) == 0


def _prod(sizes: Sequence[Any]) -> sympy.Expr:
    out: sympy.Expr = sympy.Integer(1)
    for s in sizes:
        out = out * _expr(s)
    return out


def static_int(x: Any) -> int | None:
    e = _expr(x)
    return int(e) if e.is_Integer else None


def module_path(node: fx.Node) -> list[str]:
    """Module paths enclosing ``node``, outermost first (from ``nn_module_stack``; root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [fqn for fqn, _ in stack.values() if fqn]


def module_types(node: fx.Node) -> dict[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    return {fqn: str(kind) for fqn, kind in stack.values() if fqn}


# --------------------------------------------------------------------------------------------- norms


@dataclass
class NormSite:
    """One norm found in the graph: ``output = scale * input + shift`` per channel on ``channel_axis``.

    Attributes:
        name: module path of the norm (e.g. ``blocks.0.norm1``), or the BN node's name when the graph has no
            module metadata.
        kind: ``RepBN`` (BN plus ``alpha * x``) or ``BatchNorm``.
        bn: the BN node; ``input`` is its input tensor, ``output`` the node whose value is the norm's output.
        region: the nodes that compute the norm (BN, getitem, mul, add), removed when it is folded.
        channel_axis: 1 (BatchNorm's channel axis on its input).
        training: the BN op runs in training mode (batch statistics).
        params: ``running_mean``, ``running_var``, ``weight``, ``bias``, ``alpha`` tensors (or None).
        eps: the BN eps stored in the graph.
        param_names: the dotted name of the stored tensor behind each of ``params`` (None where absent).
    """

    name: str
    kind: str
    bn: fx.Node
    input: fx.Node
    output: fx.Node
    region: list[fx.Node]
    channel_axis: int
    training: bool
    params: dict[str, torch.Tensor | None]
    eps: float
    param_names: dict[str, str | None] = field(default_factory=dict)

    @property
    def channels(self) -> int:
        shape = shape_of(self.input)
        assert shape is not None
        return int(shape[self.channel_axis])


def is_batch_norm(node: fx.Node) -> bool:
    """True for an aten batch-norm call (any of the ``_BN_LAYOUT`` overloads), in train or eval form."""
    return node.op == "call_function" and node.target in _BN_LAYOUT


def bn_args(node: fx.Node) -> tuple[Any, ...]:
    """``(input, weight, bias, running_mean, running_var, training, eps)`` of a BN node (see ``_BN_LAYOUT``)."""
    positions, training, eps, _ = _BN_LAYOUT[node.target]
    a = node.args
    tensors = [a[i] if i is not None else None for i in positions]
    flag = bool(a[training]) if not isinstance(training, bool) else training
    return (*tensors, flag, float(a[eps]))  # type: ignore[arg-type]


def _scalar_param(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        t = attr(gm, node)
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            return t
    return None


def _name_norm(gm: fx.GraphModule, region: list[fx.Node], fallback: str) -> str:
    """The norm's module path: the deepest module holding the whole region, climbed while the parent
    module runs nothing else in the graph but layout ops (a ``LinearNorm`` in eval mode is just its ``norm2``;
    PatchTST's ``Sequential(Transpose, BatchNorm1d, Transpose)`` is the norm)."""
    paths = [module_path(n) for n in region]
    if not all(paths):
        return fallback
    common: list[str] = []
    for level in zip(*paths, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if not common:
        return fallback
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target not in _LAYOUT_OPS:
            for p in module_path(n):
                counts[p] = counts.get(p, 0) + 1
    i = len(common) - 1
    while i > 0 and counts.get(common[i - 1], 0) == counts.get(common[i], 0):
        i -= 1
    return common[i]


def find_norms(gm: fx.GraphModule) -> list[NormSite]:
    """Every BatchNorm / RepBN in the graph, in topological order.

    Raises:
        UnsupportedModelError: a BN op whose statistics are not parameters of the model.
    """
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in BN_OPS:
            continue
        x, w, b, mean, var, training, eps = bn_args(node)
        region = [node]
        out = node
        if _BN_LAYOUT[node.target][3]:
            getters = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
            if len(getters) != 1 and not training:
                raise UnsupportedModelError(f"BatchNorm node {node.name} has an unexpected output structure")
            if getters:
                out = getters[0]
                region.append(out)
        alpha = None
        users = list(out.users)
        if len(users) == 1 and users[0].target is aten.add.Tensor and len(users[0].kwargs) == 0:
            add = users[0]
            other = add.args[1] if add.args[0] is out else add.args[0]
            if (
                isinstance(other, fx.Node)
                and other.target is aten.mul.Tensor
                and len(other.users) == 1
                and x in other.args
            ):
                factor = other.args[1] if other.args[0] is x else other.args[0]
                alpha = _scalar_param(gm, factor)
                if isinstance(factor, (int, float)) and not isinstance(factor, bool):
                    alpha = torch.tensor([float(factor)], dtype=torch.float64)  # a fixed eta
                if alpha is not None:
                    region += [other, add]
                    out = add
        try:
            params = {
                "running_mean": attr(gm, mean),
                "running_var": attr(gm, var),
                "weight": attr(gm, w),
                "bias": attr(gm, b),
                "alpha": alpha,
            }
        except TypeError:
            raise UnsupportedModelError(
                f"BatchNorm node {node.name}: its weight or statistics are computed, not stored parameters"
            ) from None
        roles = {"weight": w, "bias": b, "running_mean": mean, "running_var": var, "alpha": None}
        if alpha is not None:
            mul = region[-2]
            roles["alpha"] = next((a for a in mul.args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
        names = {role: str(a.target) if isinstance(a, fx.Node) else None for role, a in roles.items()}
        name = _name_norm(gm, region, node.name)
        sites.append(
            NormSite(
                name=name,
                kind="RepBN" if alpha is not None else "BatchNorm",
                bn=node,
                input=x,
                output=out,
                region=region,
                channel_axis=1,
                training=training,
                params=params,
                eps=eps,
                param_names=names,
            )
        )
    return sites


# --------------------------------------------------------------------------------------------- channel state


@dataclass(frozen=True)
class Chan:
    """Where a norm's ``channels`` sit on a tensor: along ``axis``, index ``i`` of that axis holds channel
    ``(i // inner) % channels``.

    A plain layout is ``inner == 1`` with the axis of size ``channels``. A reshape that merges the channel axis
    with neighbouring axes keeps the fold exact when each channel still lives on one axis (``flatten(-2)`` of
    ``(B, C, P)`` gives ``inner = P``; of ``(B, P, C)`` the axis has size ``P * C``, ``inner = 1``): the scale
    and shift are then tiled along that axis (``slabconv.fold.tile_channels``).
    """

    axis: int
    channels: int
    inner: int = 1

    def at(self, axis: int) -> Chan:
        return Chan(axis, self.channels, self.inner)

    @property
    def plain(self) -> bool:
        return self.inner == 1


# --------------------------------------------------------------------------------------------- forward rules


@dataclass(frozen=True)
class Pass:
    """The op commutes with the affine: the channels are now at ``chan``; the shift is multiplied by ``mult``;
    with ``needs_positive_scale`` it commutes only when every channel's scale is > 0 (max / min)."""

    chan: Chan
    mult: float = 1.0
    needs_positive_scale: bool = False


@dataclass(frozen=True)
class Consumer:
    """The op absorbs the affine: ``kind`` is ``linear`` or ``conv``; ``weight`` is its get_attr node."""

    kind: str
    weight: fx.Node


@dataclass(frozen=True)
class Block:
    """The op breaks the fold; ``reason`` is one of ``slabconv.reasons``."""

    reason: str


Outcome = Pass | Consumer | Block
Rule = Callable[[fx.Node, fx.Node, Chan], Outcome]


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _rank(node: fx.Node) -> int:
    shape = shape_of(node)
    if shape is None:
        raise UnsupportedModelError(f"node {node.name} has no shape metadata")
    return len(shape)


def _unsupported(user: fx.Node) -> Block:
    return Block(reasons.unsupported(user))


def _passthrough(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch)


def _dropout(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train", False)
    return Block(reasons.TRAIN_MODE) if train else Pass(ch)


def _expand(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``expand`` may add leading axes; the channel axis must keep its size (no broadcast of a size-1 axis)."""
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    axis = ch.axis + len(outs) - len(ins)
    return Pass(ch.at(axis)) if same_size(outs[axis], ins[ch.axis]) else _unsupported(user)


def _repeat(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x.repeat(*sizes)`` tiles whole axes (new ones in front): a tiled channel axis is still whole channel
    blocks."""
    return Pass(ch.at(ch.axis + _rank(user) - _rank(src)))


def _repeat_interleave(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x.repeat_interleave(r, dim)`` with an int ``r``: over a token axis it copies tokens; over the channel
    axis index ``i`` holds what index ``i // r`` held (``inner`` grows by r)."""
    a: Any = user.args
    repeats = a[1] if len(a) > 1 else user.kwargs.get("repeats")
    dim: Any = a[2] if len(a) > 2 else user.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None or a[0] is not src:
        return _unsupported(user)
    if _norm_dim(dim, _rank(src)) != ch.axis:
        return Pass(ch)
    return Pass(Chan(ch.axis, ch.channels, ch.inner * repeats))


def _narrow(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``narrow(x, dim, start, length)``: a slice."""
    dim = _norm_dim(user.args[1], _rank(src))  # type: ignore[arg-type]
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    return _unsupported(user) if dim == ch.axis and not same_size(outs[dim], ins[dim]) else Pass(ch)


def _transpose(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    rank = _rank(src)
    d0, d1 = _norm_dim(user.args[1], rank), _norm_dim(user.args[2], rank)  # type: ignore[arg-type]
    return Pass(ch.at(d1 if ch.axis == d0 else d0 if ch.axis == d1 else ch.axis))


def _t(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch.at(1 - ch.axis)) if _rank(src) == 2 else Pass(ch)


def _permute(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    rank = _rank(src)
    order: Any = user.args[1]
    dims = [_norm_dim(d, rank) for d in order]
    return Pass(ch.at(dims.index(ch.axis)))


def _strides(shape: Sequence[Any]) -> list[sympy.Expr]:
    """Row-major element strides of a (possibly symbolic) shape."""
    out = [sympy.Integer(1)] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * _expr(shape[k + 1])
    return out


def _positive_int(e: sympy.Expr) -> int | None:
    if not e.is_Integer and e.free_symbols:
        e = sympy.simplify(e)
    return int(e) if e.is_Integer and int(e) >= 1 else None


def _view(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A reshape (row-major) keeps the fold exact when each channel still lives on one output axis.

    On the input the channel index of flat element ``L`` is ``(L // P) % C`` with ``P = inner * stride(axis)``.
    An output axis ``k`` of stride ``P'`` and size ``S`` holds it as ``(i_k // m) % C`` with ``m = P / P'``
    when ``P'`` divides ``P`` and ``P * C`` divides ``P' * S`` (the channel digit lies inside axis ``k``).
    Otherwise the reshape mixes channels with other axes: ``channel-mixing-reshape``.
    """
    ins, outs = shape_of(src), shape_of(user)
    if ins is None or outs is None:
        return _unsupported(user)
    period = ch.inner * _strides(ins)[ch.axis]
    for k, (size, stride) in enumerate(zip(outs, _strides(outs), strict=True)):
        inner = _positive_int(period / stride)
        if (
            inner is not None
            and static_int(size) is not None
            and _positive_int(stride * _expr(size) / (period * ch.channels)) is not None
        ):
            return Pass(Chan(k, ch.channels, inner))
    return Block(reasons.CHANNEL_MIXING_RESHAPE)


def _as_strided(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``as_strided`` that only restates the input's own layout (what core-ATen decompositions of pooling emit:
    same sizes, same strides on every axis longer than 1, no offset) is the identity; anything else may move
    elements across channels."""
    val, out = src.meta.get("val"), user.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() != val.dim():
        return _unsupported(user)
    if not all(same_size(a, b) for a, b in zip(out.shape, val.shape, strict=True)):
        return _unsupported(user)
    if static_int(val.storage_offset()) != 0 or static_int(out.storage_offset()) != 0:
        return _unsupported(user)
    for n, want, have in zip(val.shape, out.stride(), val.stride(), strict=True):
        if static_int(n) != 1 and not same_size(want, have):
            return _unsupported(user)
    return Pass(ch)


def _select(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    dim = _norm_dim(user.args[1], _rank(src))  # type: ignore[arg-type]
    if dim == ch.axis:
        return _unsupported(user)
    return Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))


def _slice(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    dim = _norm_dim(user.args[1] if len(user.args) > 1 else 0, _rank(src))  # type: ignore[arg-type]
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    if dim == ch.axis and not same_size(outs[dim], ins[dim]):
        return _unsupported(user)  # a slice of the channels
    return Pass(ch)


def _index(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x[idx]`` with index tensors on token axes only; the channel axis is found by its place counted from
    the end (PyTorch puts the broadcast index dims where the first indexed axis was when they are adjacent;
    a boolean mask over several axes counts as one index entry)."""
    indices = list(user.args[1])  # type: ignore[arg-type]
    used = [i for i, ix in enumerate(indices) if ix is not None]
    if user.args[0] is not src or not used or used != list(range(used[0], used[-1] + 1)):
        return _unsupported(user)
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    spans = []
    for i in used:
        ix = indices[i]
        val = ix.meta.get("val") if isinstance(ix, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return _unsupported(user)
        spans.append(val.dim() if val.dtype in (torch.bool, torch.uint8) else 1)
    first, last = used[0], used[0] + sum(spans)
    if first <= ch.axis < last:
        return _unsupported(user)
    if ch.axis < first:
        return Pass(ch)
    return Pass(ch.at(len(outs) - (len(ins) - ch.axis)))


def _index_select(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    if user.args[0] is not src or _norm_dim(user.args[1], _rank(src)) == ch.axis:  # type: ignore[arg-type]
        return _unsupported(user)
    return Pass(ch)


def _gather(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``gather(x, dim, index)`` over a token axis: output channel ``c`` reads input channel ``c`` as long as
    the index keeps the full channel axis."""
    if user.args[0] is not src or _norm_dim(user.args[1], _rank(src)) == ch.axis:  # type: ignore[arg-type]
        return _unsupported(user)
    index = user.args[2]
    ins = shape_of(src)
    if not isinstance(index, fx.Node) or ins is None:
        return _unsupported(user)
    idx = shape_of(index)
    if idx is None or not same_size(idx[ch.axis], ins[ch.axis]):
        return _unsupported(user)
    return Pass(ch)


def _roll_or_flip(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    rank = _rank(src)
    dims: Any = user.args[2] if user.target is aten.roll.default else user.args[1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims and user.target is aten.roll.default:
        return _unsupported(user)  # roll over the flattened tensor mixes channels
    return _unsupported(user) if ch.axis in [_norm_dim(d, rank) for d in dims] else Pass(ch)


def _reduce_dims(user: fx.Node, src: fx.Node) -> tuple[list[int], bool]:
    rank = _rank(src)
    dims: Any = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    keepdim = bool(user.args[2]) if len(user.args) > 2 else bool(user.kwargs.get("keepdim", False))
    return sorted(_norm_dim(d, rank) for d in dims), keepdim


def _after_reduce(ch: Chan, dims: list[int], keepdim: bool) -> Chan:
    return ch if keepdim else ch.at(ch.axis - sum(1 for d in dims if d < ch.axis))


def _mean(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Mean over token axes: ``mean(s x + t) = s mean(x) + t``."""
    dims, keepdim = _reduce_dims(user, src)
    if ch.axis in dims:
        return _unsupported(user)
    return Pass(_after_reduce(ch, dims, keepdim))


def _sum(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Sum over N token axes: ``sum(s x + t) = s sum(x) + N t``; N must be static."""
    dims, keepdim = _reduce_dims(user, src)
    if ch.axis in dims:
        return _unsupported(user)
    shape = shape_of(src)
    assert shape is not None
    count = 1
    for d in dims:
        n = static_int(shape[d])
        if n is None:
            return Block(reasons.DYNAMIC_TOKEN_COUNT)
        count *= n
    return Pass(_after_reduce(ch, dims, keepdim), mult=float(count))


def _max_like(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Max / min over token axes: ``max(s x + t) = s max(x) + t`` only when every ``s > 0``."""
    dims, keepdim = _reduce_dims(user, src)
    if ch.axis in dims:
        return _unsupported(user)
    return Pass(_after_reduce(ch, dims, keepdim), needs_positive_scale=True)


def _adaptive_avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch) if ch.axis == 1 else _unsupported(user)


def _avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Average pooling is a mean over each window, unless padded zeros count in it or the divisor is forced."""
    if ch.axis != 1:
        return _unsupported(user)
    a: Any = user.args
    padding: Any = a[3] if len(a) > 3 else user.kwargs.get("padding", 0)
    count_include_pad = a[5] if len(a) > 5 else user.kwargs.get("count_include_pad", True)
    divisor = a[6] if len(a) > 6 else user.kwargs.get("divisor_override")
    if divisor is not None:
        return _unsupported(user)
    padded = any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))
    if padded and count_include_pad:
        return Block(reasons.ZERO_PADDING_AFTER_NORM)
    return Pass(ch)


def _max_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch, needs_positive_scale=True) if ch.axis == 1 else _unsupported(user)


def _scalar_mul(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x * c`` or ``x / c`` with a Python number: ``c (s x + t) = s (c x) + c t``, the shift scales by c."""
    other = user.args[1] if user.args[0] is src else user.args[0]
    if isinstance(other, (int, float)) and not isinstance(other, bool) and user.args.count(src) == 1:
        if user.target in (aten.div.Tensor, aten.div.Scalar):
            if user.args[0] is not src or float(other) == 0.0:
                return Block(reasons.NONLINEAR)
            return Pass(ch, mult=1.0 / float(other))
        return Pass(ch, mult=float(other))
    return Block(reasons.MASKED_AFTER_NORM)


def _add(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.RESIDUAL_READS_NORM)


def _masked(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.MASKED_AFTER_NORM)


def _constant_pad(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``constant_pad_nd(x, pad, value)``: padding adds constants that the fold would shift; negative pads (crops)
    of token axes commute."""
    pad = list(user.args[1])  # type: ignore[arg-type]
    rank = _rank(src)
    for i, amount in enumerate(pad):
        dim = rank - 1 - i // 2
        if static_int(amount) is None or int(amount) > 0:
            return Block(reasons.ZERO_PADDING_AFTER_NORM)
        if int(amount) < 0 and dim == ch.axis:
            return _unsupported(user)
    return Pass(ch)


def _pad(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``aten.pad(x, pad, mode, value)``: reflect / replicate / circular copy values and commute; constant pads
    do not."""
    mode = user.args[2] if len(user.args) > 2 else user.kwargs.get("mode", "constant")
    if mode == "constant":
        return _constant_pad(user, src, ch)
    return _copy_pad(user, src, ch)


def _copy_pad(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Reflection / replication / circular padding of the trailing axes copies values: commutes unless it pads
    the channel axis."""
    pad = list(user.args[1])  # type: ignore[arg-type]
    rank = _rank(src)
    padded = {rank - 1 - i // 2 for i, amount in enumerate(pad) if static_int(amount) != 0}
    return _unsupported(user) if ch.axis in padded else Pass(ch)


def _nonlinear(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.NONLINEAR)


def _param(node: Any) -> bool:
    return node is None or (isinstance(node, fx.Node) and node.op == "get_attr")


def _linear(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``linear(x, W, b)`` contracts the last axis: absorbs the affine when the channels are on it."""
    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    if user.args[0] is not src or not _param(user.args[1]) or user.args[1] is None or not _param(bias):
        return _unsupported(user)
    if ch.axis != _rank(src) - 1:
        return Block(reasons.CONSUMER_OFF_CHANNEL)
    return Consumer("linear", user.args[1])  # type: ignore[arg-type]


def _transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.permute(1, 0)`` of a 2-D parameter (decomposed Linear)."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):  # type: ignore[arg-type]
        w = node.args[0]
        if isinstance(w, fx.Node) and w.op == "get_attr":
            return w
    return None


def _addmm(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Decomposed Linear: ``addmm(bias, x, W.t())`` or ``mm(x, W.t())``."""
    x_pos = 1 if user.target is aten.addmm.default else 0
    if user.args[x_pos] is not src or (x_pos == 1 and not _param(user.args[0])):
        return _unsupported(user)
    if ch.axis != 1:
        return Block(reasons.CONSUMER_OFF_CHANNEL)
    weight = _transposed_weight(user.args[x_pos + 1])
    return Consumer("linear", weight) if weight is not None else _unsupported(user)


def conv_params(node: fx.Node) -> dict[str, Any]:
    """``padding``, ``groups``, ``transposed`` of a conv node, for ``aten.convN`` and ``aten.convolution``."""
    a = node.args
    if node.target is aten.convolution.default:
        return {"padding": a[4], "groups": a[8], "transposed": bool(a[6])}
    padding = a[4] if len(a) > 4 else node.kwargs.get("padding", 0)
    groups = a[6] if len(a) > 6 else node.kwargs.get("groups", 1)
    return {"padding": padding, "groups": groups, "transposed": False}


def _conv_is_padded(node: fx.Node) -> bool:
    padding = conv_params(node)["padding"]
    if isinstance(padding, str):
        weight = node.args[1]
        kernel = shape_of(weight)[2:] if isinstance(weight, fx.Node) else ()  # type: ignore[index]
        return padding == "same" and any(int(k) > 1 for k in kernel)
    values = padding if isinstance(padding, (list, tuple)) else [padding]
    return any(int(p) != 0 for p in values)


def _conv(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A convolution contracts axis 1 (its input channels): absorbs the affine when it pads nothing."""
    weight = user.args[1]
    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    if user.args[0] is not src or conv_params(user)["transposed"] or weight is None:
        return _unsupported(user)
    if not (_param(weight) and _param(bias)):
        return _unsupported(user)
    if ch.axis != 1:
        return Block(reasons.CONSUMER_OFF_CHANNEL)
    if _conv_is_padded(user):
        return Block(reasons.PADDED_CONV_CONSUMER)
    return Consumer("conv", weight)  # type: ignore[arg-type]


def _ops(*names: str) -> list[Any]:
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            out.append(getattr(op, overload or "default"))
    return out


FORWARD_RULES: dict[Any, Rule] = {}


def _rule(rule: Rule, *names: str) -> None:
    for op in _ops(*names):
        FORWARD_RULES[op] = rule


_rule(_passthrough, "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to.dtype")
_rule(_passthrough, "to.dtype_layout", "to.device", "type_as")
_rule(_expand, "expand")
_rule(_repeat, "repeat")
_rule(_repeat_interleave, "repeat_interleave.self_int")
_rule(_narrow, "narrow")
_rule(_dropout, "dropout", "feature_dropout")
_rule(_transpose, "transpose.int", "swapaxes", "swapdims")
_rule(_t, "t")
_rule(_permute, "permute")
_rule(_view, "view", "reshape", "_unsafe_view", "flatten.using_ints", "unflatten.int", "squeeze.dim", "squeeze.dims")
_rule(_view, "squeeze", "unsqueeze")
_rule(_as_strided, "as_strided")
_rule(_select, "select.int")
_rule(_slice, "slice.Tensor")
_rule(_index, "index.Tensor")
_rule(_index_select, "index_select")
_rule(_gather, "gather")
_rule(_roll_or_flip, "roll", "flip")
_rule(_mean, "mean.dim", "mean")
_rule(_sum, "sum.dim_IntList", "sum")
_rule(_max_like, "amax", "amin", "max.dim", "min.dim")
_rule(_adaptive_avg_pool, "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d")
_rule(_avg_pool, "avg_pool1d", "avg_pool2d")
_rule(_max_pool, "max_pool1d", "max_pool2d", "max_pool2d_with_indices")
_rule(_scalar_mul, "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar")
_rule(_add, "add.Tensor", "sub.Tensor", "add.Scalar", "sub.Scalar", "rsub.Scalar")
_rule(_masked, "masked_fill.Scalar", "masked_fill.Tensor", "where.self", "where.ScalarOther", "where.ScalarSelf")
_rule(_constant_pad, "constant_pad_nd")
_rule(_pad, "pad")
_rule(_copy_pad, "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d")
_rule(_copy_pad, "replication_pad2d", "replication_pad3d", "_pad_circular")
_rule(
    _nonlinear,
    "gelu",
    "relu",
    "silu",
    "sigmoid",
    "tanh",
    "softmax.int",
    "_softmax",
    "exp",
    "log",
    "pow.Tensor_Scalar",
    "sqrt",
    "rsqrt",
    "abs",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "elu",
    "layer_norm",
    "native_layer_norm",
    "square",
    "clamp",
    "mish",
    "erf",
)
_rule(_linear, "linear")
_rule(_addmm, "addmm", "mm")
_rule(_conv, "conv1d", "conv2d", "conv3d", "convolution")

# Ops that only move data around (a norm is named by its wrapper module when the wrapper adds only these).
_LAYOUT_OPS = set(_ops("transpose.int", "permute", "t", "view", "reshape", "_unsafe_view", "contiguous", "clone"))
_LAYOUT_OPS |= set(_ops("alias", "flatten.using_ints", "unflatten.int", "squeeze.dim", "unsqueeze", "expand"))
# Ops that read only the shape of a tensor: no data flows through them.
SHAPE_ONLY = set(_ops("sym_size.int", "sym_numel", "sym_stride.int", "sym_storage_offset"))
# Ops that return several tensors; their users are ``getitem`` nodes.
TUPLE_OPS = set(_ops("max.dim", "min.dim", "max_pool2d_with_indices", "unbind.int", "split.Tensor"))
TUPLE_OPS |= set(_ops("split_with_sizes", "chunk"))
# Outputs of tuple ops that are integer indices: with every scale > 0 (which a Pass through these ops
# requires) they are the same for ``s x + t`` as for ``x``, so no affine flows into them.
INDEX_OUTPUTS = {op: 1 for op in _ops("max.dim", "min.dim", "max_pool2d_with_indices")}
JOIN_OPS = set(_ops("cat", "stack"))


# --------------------------------------------------------------------------------------------- the walk


@dataclass(frozen=True)
class ConsumerUse:
    """A consumer the norm can fold into: ``node`` reads the normalised ``src`` (channels at ``chan``); the shift
    reaching it is multiplied by ``mult``."""

    node: fx.Node
    src: fx.Node
    kind: str
    weight: fx.Node
    chan: Chan
    mult: float


@dataclass(frozen=True)
class BlockedEdge:
    """The edge ``src -> dst`` where the fold stops: ``dst`` must still see the normalised ``src``
    (channels at ``chan`` of ``src``, shift multiplied by ``mult``)."""

    src: fx.Node
    dst: fx.Node
    chan: Chan
    mult: float
    reason: str


@dataclass
class Flow:
    """Where one norm's output goes: the consumers that can absorb it and the edges where it is blocked."""

    consumers: list[ConsumerUse] = field(default_factory=list)
    blocked: list[BlockedEdge] = field(default_factory=list)


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _tuple_op(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """The channel state of each tensor a tuple op returns (its ``getitem`` users)."""
    if user.target in (aten.max.dim, aten.min.dim):
        return _max_like(user, src, ch)
    if user.target is aten.max_pool2d_with_indices.default:
        return _max_pool(user, src, ch)
    rank = _rank(src)
    if user.target is aten.unbind.int:
        dim = _norm_dim(user.args[1] if len(user.args) > 1 else 0, rank)  # type: ignore[arg-type]
        return _unsupported(user) if dim == ch.axis else Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))
    split_dim: Any = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    return _unsupported(user) if _norm_dim(split_dim, rank) == ch.axis else Pass(ch)


def _join(user: fx.Node, arrived: dict[fx.Node, tuple[Chan, float]]) -> Outcome:
    """``cat`` / ``stack`` whose every input derives from the norm with the same channel state and shift
    multiplier (e.g. tokens of one norm put back together). ``cat`` along the channel axis keeps the channel
    pattern when each piece holds whole channel blocks (``inner`` equal)."""
    tensors = list(user.args[0])  # type: ignore[arg-type]
    if any(not isinstance(t, fx.Node) or t not in arrived for t in tensors):
        return Block(reasons.CONCAT_WITH_UNNORMALIZED)
    states = {arrived[t] for t in tensors}  # type: ignore[index]
    if len(states) != 1:
        return _unsupported(user)  # pieces with different channel layouts or shift multipliers
    ch, _ = states.pop()
    stack = user.target is aten.stack.default
    dim = _norm_dim(user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0), _rank(user))  # type: ignore[arg-type]
    if stack:
        return Pass(ch.at(ch.axis + 1 if dim <= ch.axis else ch.axis))
    return Pass(ch)  # along the channel axis each piece holds whole channel blocks (its size is k * C * inner)


def follow(start: fx.Node, chan: Chan, positive_scale: bool = True) -> Flow:
    """Follow a tensor whose channels are at ``chan`` through every user, to consumers and blockers.

    ``positive_scale`` says whether every channel's scale is > 0; max/min over tokens commute with the
    affine only then (otherwise they block with ``negative-scale-through-max``).

    Every user of every tensor on the way is classified; nothing is skipped. A join (``cat``/``stack``) is
    decided once all its inputs are known: it passes only when every input derives from ``start`` through
    commuting ops with the same channel state and shift multiplier; otherwise each normalised input is blocked.
    """
    flow = Flow()
    states: dict[fx.Node, tuple[Chan, float]] = {}
    arrivals: dict[fx.Node, dict[fx.Node, tuple[Chan, float]]] = {}
    todo: list[tuple[fx.Node, Chan, float]] = [(start, chan, 1.0)]

    def settle(src: fx.Node, user: fx.Node, ch: Chan, mult: float, outcome: Outcome) -> None:
        if isinstance(outcome, Pass) and outcome.needs_positive_scale and not positive_scale:
            outcome = Block(reasons.NEGATIVE_SCALE_THROUGH_MAX)
        if isinstance(outcome, Pass) and user.target not in TUPLE_OPS and not _is_float(user):
            outcome = _unsupported(user)  # e.g. a cast to an integer type
        if isinstance(outcome, Pass):
            todo.append((user, outcome.chan, mult * outcome.mult))
        elif isinstance(outcome, Consumer):
            flow.consumers.append(ConsumerUse(user, src, outcome.kind, outcome.weight, ch, mult))
        else:
            flow.blocked.append(BlockedEdge(src, user, ch, mult, outcome.reason))

    def walk() -> None:
        while todo:
            node, ch, mult = todo.pop()
            if node in states:
                continue
            states[node] = (ch, mult)
            for user in list(node.users):
                if user.op == "output":
                    flow.blocked.append(BlockedEdge(node, user, ch, mult, reasons.FEEDS_OUTPUT))
                elif user.target in SHAPE_ONLY:
                    continue
                elif user.target is operator.getitem:
                    if INDEX_OUTPUTS.get(node.target) == user.args[1]:
                        continue  # integer indices: unchanged by a positive per-channel affine
                    todo.append((user, ch, mult))
                elif user.target in JOIN_OPS:
                    arrivals.setdefault(user, {})[node] = (ch, mult)
                elif user.target in TUPLE_OPS:
                    settle(node, user, ch, mult, _tuple_op(user, node, ch))
                else:
                    rule = FORWARD_RULES.get(user.target)
                    settle(node, user, ch, mult, rule(user, node, ch) if rule else _unsupported(user))

    walk()
    while arrivals:
        ready = [j for j, got in arrivals.items() if all(t in got for t in j.args[0])]  # type: ignore[union-attr]
        for join in ready or list(arrivals):
            got = arrivals.pop(join)
            outcome = _join(join, got)
            if isinstance(outcome, Pass):
                pieces: Any = join.args[0]
                settle(pieces[0], join, outcome.chan, next(iter(got.values()))[1], outcome)
            else:
                assert isinstance(outcome, Block)
                for src, (ch, mult) in got.items():
                    flow.blocked.append(BlockedEdge(src, join, ch, mult, outcome.reason))
        walk()
    return flow


# --------------------------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class Producer:
    """A Linear/conv whose output (channel axis known) flows only into the norm's input."""

    node: fx.Node
    kind: str
    weight: fx.Node
    bias: fx.Node | None


_BACKWARD_VIEWS = set(_ops("transpose.int", "permute", "view", "reshape", "_unsafe_view", "flatten.using_ints"))
_BACKWARD_VIEWS |= set(_ops("contiguous", "clone", "unflatten.int"))


def find_producer(site: NormSite) -> Producer | None:
    """The Linear/conv that produces the norm's input through channel-preserving view ops, when nothing else
    reads any tensor on the way (so scaling its output channels changes nothing but the norm's input)."""
    node, axis = site.input, site.channel_axis
    channels = site.channels
    if any(u not in site.region for u in site.input.users):
        return None  # something besides the norm reads its input
    while True:
        if node.op != "call_function":
            return None
        if node.target in _BACKWARD_VIEWS:
            src = node.args[0]
            if not isinstance(src, fx.Node) or len(src.users) != 1:
                return None
            # The axis on ``src`` that maps to ``axis`` on ``node``: run the forward rule on each candidate.
            rule = FORWARD_RULES[node.target]
            target = Pass(Chan(axis, channels))
            sizes = shape_of(src) or ()
            candidates = [a for a, size in enumerate(sizes) if same_size(size, channels)]
            match = [a for a in candidates if rule(node, src, Chan(a, channels)) == target]
            if len(match) != 1:
                return None
            node, axis = src, match[0]
            continue
        if node.target is aten.linear.default and axis == _rank(node) - 1:
            w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
            if isinstance(w, fx.Node) and w.op == "get_attr" and _param(b):
                return Producer(node, "linear", w, b)  # type: ignore[arg-type]
            return None
        if node.target in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default) and axis == 1:
            w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
            if isinstance(w, fx.Node) and w.op == "get_attr" and _param(b):
                return Producer(node, "conv", w, b)  # type: ignore[arg-type]
            return None
        return None
