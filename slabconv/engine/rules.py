r"""The op tables: what each ATen op does to a per-channel affine ``s * x + t`` that flows through it.

In: an fx node (``user``), the input that carries the affine (``src``) and where the norm's channels sit on
``src`` (a ``Chan``). Out: an ``Outcome``:

- ``Pass(chan, mult)``: the op commutes with the affine; the channels are now at ``chan`` of the op's output and
  the shift is multiplied by ``mult`` (a sum over N tokens gives ``N t``).
- ``Absorb(layer)``: a Linear / conv that contracts the channel axis takes the affine into its weights.
- ``Block(reason)``: the fold stops here, with one of the stable reasons of ``slabconv.engine.reasons``.

Two tables, one entry per kind of op:

- ``RULES`` (``RULE_OF``: op -> ``OpRule``). A rule with ``view_like=True`` only moves or copies elements (each
  output element is one input element of the same channel, whenever its step passes); those rules serve both the
  forward walk from a norm's output and the backward walk from its input to a producer
  (``slabconv.engine.flow``). The other rules (reductions, pools, scalar multiplies, nonlinearities, residual
  adds, masks) serve the forward walk only. ``shape_args`` names the arguments read for their shape or dtype
  only (``reshape_as(x, other)``): no data flows from them.
- ``LAYERS`` (``LAYER_OF``: op -> ``LayerKind``): the layers a norm folds into, in ``slabconv.engine.layers``.

Ops that no rule names block with ``unsupported-op:<aten op>``: slabconv never guesses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx

from slabconv.engine import reasons
from slabconv.engine.capture import expr, norm_dim, rank, same_size, shape_of, static_int

if TYPE_CHECKING:
    from slabconv.engine.layers import LayerKind

aten = torch.ops.aten


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


@dataclass(frozen=True)
class Pass:
    """The op commutes with the affine: the channels are now at ``chan``; the shift is multiplied by ``mult``;
    with ``needs_positive_scale`` it commutes only when every channel's scale is > 0 (max / min)."""

    chan: Chan
    mult: float = 1.0
    needs_positive_scale: bool = False


@dataclass(frozen=True)
class Absorb:
    """The op is a layer (``LayerKind``) that takes the affine into its weights."""

    layer: LayerKind


@dataclass(frozen=True)
class Block:
    """The op breaks the fold; ``reason`` is one of ``slabconv.engine.reasons``."""

    reason: str


Outcome = Pass | Absorb | Block
Step = Callable[[fx.Node, fx.Node, Chan], Outcome]


def unsupported(user: fx.Node) -> Block:
    return Block(reasons.unsupported(user))


def op_name(node: fx.Node) -> str:
    """``aten.<name>`` of an fx node's op."""
    return reasons.unsupported(node).removeprefix(reasons.UNSUPPORTED_PREFIX)


def _ops(*names: str) -> tuple[Any, ...]:
    """ATen overloads by ``packet.overload`` name (``default`` when none is given); names this torch lacks are
    left out."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            out.append(getattr(op, overload or "default"))
    return tuple(out)


# --------------------------------------------------------------------------------------------- view-like steps


def _identity(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch)


def _cast(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A cast between floating dtypes (or the same dtype, or a device move) commutes; to an integer type it
    does not (the walker blocks non-float outputs)."""
    return Pass(ch)


def _dropout(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train", False)
    return Block(reasons.TRAIN_MODE) if train else Pass(ch)


def _strides(shape: Sequence[Any]) -> list[sympy.Expr]:
    """Row-major element strides of a (possibly symbolic) shape."""
    out = [sympy.Integer(1)] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * expr(shape[k + 1])
    return out


def _positive_int(e: sympy.Expr) -> int | None:
    if not e.is_Integer and e.free_symbols:
        e = sympy.simplify(e)
    return int(e) if e.is_Integer and int(e) >= 1 else None


def _reshape(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A reshape (row-major) keeps the fold exact when each channel still lives on one output axis.

    On the input the channel index of flat element ``L`` is ``(L // P) % C`` with ``P = inner * stride(axis)``.
    An output axis ``k`` of stride ``P'`` and size ``S`` holds it as ``(i_k // m) % C`` with ``m = P / P'``
    when ``P'`` divides ``P`` and ``P * C`` divides ``P' * S`` (the channel digit lies inside axis ``k``).
    Otherwise the reshape mixes channels with other axes: ``channel-mixing-reshape``.
    """
    ins, outs = shape_of(src), shape_of(user)
    if ins is None or outs is None:
        return unsupported(user)
    period = ch.inner * _strides(ins)[ch.axis]
    for k, (size, stride) in enumerate(zip(outs, _strides(outs), strict=True)):
        inner = _positive_int(period / stride)
        if (
            inner is not None
            and static_int(size) is not None
            and _positive_int(stride * expr(size) / (period * ch.channels)) is not None
        ):
            return Pass(Chan(k, ch.channels, inner))
    return Block(reasons.CHANNEL_MIXING_RESHAPE)


_SWAPS = set(_ops("transpose.int", "swapaxes", "swapdims"))


def permutation(node: fx.Node) -> list[int] | None:
    """The axis order of a permute-like op (output axis ``i`` is input axis ``order[i]``), None for other ops."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or shape_of(src) is None:
        return None
    n, a = rank(src), node.args
    order = list(range(n))
    if node.target is aten.permute.default:
        return [norm_dim(d, n) for d in a[1]]  # type: ignore[union-attr,arg-type]
    if node.target in _SWAPS or node.target is aten.mT.default:
        d0, d1 = (-2, -1) if node.target is aten.mT.default else (a[1], a[2])
        i, j = norm_dim(d0, n), norm_dim(d1, n)  # type: ignore[arg-type]
        order[i], order[j] = order[j], order[i]
        return order
    if node.target is aten.t.default:
        return order[::-1] if n == 2 else order
    if node.target in (aten.movedim.int, aten.movedim.intlist):
        sources = [a[1]] if isinstance(a[1], int) else list(a[1])  # type: ignore[arg-type]
        dests = [a[2]] if isinstance(a[2], int) else list(a[2])  # type: ignore[arg-type]
        out: list[int | None] = [None] * n
        for s, d in zip(sources, dests, strict=True):
            out[norm_dim(d, n)] = norm_dim(s, n)
        rest = iter(i for i in order if i not in out)
        return [i if i is not None else next(rest) for i in out]
    return None


def _permute(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    order = permutation(user)
    return Pass(ch.at(order.index(ch.axis))) if order is not None else unsupported(user)


def _expand(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``expand`` / ``expand_as`` may add leading axes; the channel axis must keep its size (a size-1 channel
    axis broadcast to k copies would no longer be the norm's layout)."""
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    axis = ch.axis + len(outs) - len(ins)
    return Pass(ch.at(axis)) if same_size(outs[axis], ins[ch.axis]) else unsupported(user)


def _repeat(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x.repeat(*sizes)`` tiles whole axes (new ones in front): a tiled channel axis is still whole channel
    blocks. ``x.repeat_interleave(r, dim)`` with an int ``r``: over a token axis it copies tokens; over the
    channel axis index ``i`` holds what index ``i // r`` held (``inner`` grows by r)."""
    if user.target is aten.repeat.default:
        return Pass(ch.at(ch.axis + rank(user) - rank(src)))
    a: Any = user.args
    repeats = a[1] if len(a) > 1 else user.kwargs.get("repeats")
    dim: Any = a[2] if len(a) > 2 else user.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None or a[0] is not src:
        return unsupported(user)
    if norm_dim(dim, rank(src)) != ch.axis:
        return Pass(ch)
    return Pass(Chan(ch.axis, ch.channels, ch.inner * repeats))


def _slice(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``select`` / ``slice`` / ``narrow`` of token axes; a part of the channel axis is not the norm's layout."""
    dim = norm_dim(user.args[1] if len(user.args) > 1 else 0, rank(src))  # type: ignore[arg-type]
    if user.target is aten.select.int:
        return unsupported(user) if dim == ch.axis else Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    return unsupported(user) if dim == ch.axis and not same_size(outs[dim], ins[dim]) else Pass(ch)


def _index(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x[idx]`` with index tensors on token axes only; the channel axis is found by its place counted from
    the end (PyTorch puts the broadcast index dims where the first indexed axis was when they are adjacent;
    a boolean mask over several axes counts as one index entry). ``index_select`` / ``gather`` over a token
    axis, the gather index keeping the whole channel axis."""
    if user.args[0] is not src:
        return unsupported(user)
    if user.target is not aten.index.Tensor:
        if norm_dim(user.args[1], rank(src)) == ch.axis:  # type: ignore[arg-type]
            return unsupported(user)
        if user.target is aten.gather.default:
            idx, ins = shape_of(user.args[2]), shape_of(src)
            if idx is None or ins is None or not same_size(idx[ch.axis], ins[ch.axis]):
                return unsupported(user)
        return Pass(ch)
    indices = list(user.args[1])  # type: ignore[arg-type]
    used = [i for i, ix in enumerate(indices) if ix is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        return unsupported(user)
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    spans = []
    for i in used:
        val = indices[i].meta.get("val") if isinstance(indices[i], fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return unsupported(user)
        spans.append(val.dim() if val.dtype in (torch.bool, torch.uint8) else 1)
    first, last = used[0], used[0] + sum(spans)
    if first <= ch.axis < last:
        return unsupported(user)
    return Pass(ch) if ch.axis < first else Pass(ch.at(len(outs) - (len(ins) - ch.axis)))


def _roll_or_flip(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    dims: Any = user.args[2] if user.target is aten.roll.default else user.args[1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims and user.target is aten.roll.default:
        return unsupported(user)  # roll over the flattened tensor mixes channels
    return unsupported(user) if ch.axis in [norm_dim(d, rank(src)) for d in dims] else Pass(ch)


def _as_strided(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``as_strided`` that only restates the input's own layout (what core-ATen decompositions of pooling emit:
    same sizes, same strides on every axis longer than 1, no offset) is the identity; anything else may move
    elements across channels."""
    val, out = src.meta.get("val"), user.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() != val.dim():
        return unsupported(user)
    if not all(same_size(a, b) for a, b in zip(out.shape, val.shape, strict=True)):
        return unsupported(user)
    if static_int(val.storage_offset()) != 0 or static_int(out.storage_offset()) != 0:
        return unsupported(user)
    for n, want, have in zip(val.shape, out.stride(), val.stride(), strict=True):
        if static_int(n) != 1 and not same_size(want, have):
            return unsupported(user)
    return Pass(ch)


def _pad(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Reflection / replication / circular padding copies values and commutes unless it pads the channel axis.
    Constant padding adds values the fold would shift (``zero-padding-after-norm``); a negative constant pad
    (a crop) of token axes is a slice."""
    pad = list(user.args[1])  # type: ignore[arg-type]
    n = rank(src)
    mode = user.args[2] if len(user.args) > 2 else user.kwargs.get("mode", "constant")
    constant = user.target is aten.constant_pad_nd.default or (user.target is aten.pad.default and mode == "constant")
    for i, amount in enumerate(pad):
        dim, size = n - 1 - i // 2, static_int(amount)
        if constant and (size is None or size > 0):
            return Block(reasons.ZERO_PADDING_AFTER_NORM)
        if dim == ch.axis and size != 0:
            return unsupported(user)
    return Pass(ch)


def _split(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``split`` / ``split_with_sizes`` / ``chunk`` / ``tensor_split`` / ``unbind`` along a token axis: every
    piece holds the whole channel axis (``unbind`` removes its axis). The state applies to each ``getitem``."""
    n = rank(src)
    if user.target is aten.unbind.int:
        dim = norm_dim(user.args[1] if len(user.args) > 1 else 0, n)  # type: ignore[arg-type]
        return unsupported(user) if dim == ch.axis else Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))
    split_dim: Any = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    return unsupported(user) if norm_dim(split_dim, n) == ch.axis else Pass(ch)


# --------------------------------------------------------------------------------------------- arithmetic steps


def reduce_dims(user: fx.Node, src: fx.Node) -> tuple[list[int], bool]:
    """The reduced axes (sorted, non-negative) and ``keepdim`` of a reduction node."""
    n = rank(src)
    dims: Any = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(n))
    dims = [dims] if isinstance(dims, int) else list(dims)
    keepdim = bool(user.args[2]) if len(user.args) > 2 else bool(user.kwargs.get("keepdim", False))
    return sorted(norm_dim(d, n) for d in dims), keepdim


def _after_reduce(ch: Chan, dims: list[int], keepdim: bool) -> Chan:
    return ch if keepdim else ch.at(ch.axis - sum(1 for d in dims if d < ch.axis))


def _mean(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Mean over token axes: ``mean(s x + t) = s mean(x) + t``."""
    dims, keepdim = reduce_dims(user, src)
    return unsupported(user) if ch.axis in dims else Pass(_after_reduce(ch, dims, keepdim))


def _sum(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Sum over N token axes: ``sum(s x + t) = s sum(x) + N t``; N must be static."""
    dims, keepdim = reduce_dims(user, src)
    if ch.axis in dims:
        return unsupported(user)
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
    dims, keepdim = reduce_dims(user, src)
    if ch.axis in dims:
        return unsupported(user)
    return Pass(_after_reduce(ch, dims, keepdim), needs_positive_scale=True)


def _adaptive_avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch) if ch.axis == 1 else unsupported(user)


def _avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Average pooling is a mean over each window, unless padded zeros count in it or the divisor is forced."""
    if ch.axis != 1:
        return unsupported(user)
    a: Any = user.args
    padding: Any = a[3] if len(a) > 3 else user.kwargs.get("padding", 0)
    count_include_pad = a[5] if len(a) > 5 else user.kwargs.get("count_include_pad", True)
    divisor = a[6] if len(a) > 6 else user.kwargs.get("divisor_override")
    if divisor is not None:
        return unsupported(user)
    padded = any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))
    return Block(reasons.ZERO_PADDING_AFTER_NORM) if padded and count_include_pad else Pass(ch)


def _max_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch, needs_positive_scale=True) if ch.axis == 1 else unsupported(user)


def _scalar_mul(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x * c`` or ``x / c`` with a Python number: ``c (s x + t) = s (c x) + c t``, the shift scales by c.
    A product with a tensor (a mask, another activation) blocks: ``masked-after-norm``."""
    other = user.args[1] if user.args[0] is src else user.args[0]
    if isinstance(other, (int, float)) and not isinstance(other, bool) and user.args.count(src) == 1:
        if user.target in (aten.div.Tensor, aten.div.Scalar):
            if user.args[0] is not src or float(other) == 0.0:
                return Block(reasons.NONLINEAR)
            return Pass(ch, mult=1.0 / float(other))
        return Pass(ch, mult=float(other))
    return Block(reasons.MASKED_AFTER_NORM)


def _residual(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.RESIDUAL_READS_NORM)


def _masked(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.MASKED_AFTER_NORM)


def _nonlinear(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.NONLINEAR)


# --------------------------------------------------------------------------------------------- the op table


@dataclass(frozen=True)
class OpRule:
    """How one family of ops treats a per-channel affine on its data input.

    Attributes:
        name: the rule's name (``docs/math.md`` and the table test refer to it).
        ops: the ATen overloads it covers.
        step: ``(user, src, chan) -> Outcome`` for the affine arriving on input ``src`` of ``user``.
        view_like: whenever ``step`` passes, each output element is a copy of one input element of the same
            channel, so the rule also serves the backward walk (a producer's output reaching the norm's input).
        shape_args: argument positions read only for their shape or dtype (no data flows from them).
        tuple_out: the op returns several tensors, read through ``getitem`` nodes; ``step`` gives the state of
            each of them.
    """

    name: str
    ops: tuple[Any, ...]
    step: Step
    view_like: bool = False
    shape_args: tuple[int, ...] = ()
    tuple_out: bool = False


_NONLINEAR: tuple[str, ...] = (
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
)
_NONLINEAR += ("sqrt", "rsqrt", "abs", "hardswish", "hardtanh", "leaky_relu", "elu", "layer_norm", "native_layer_norm")
_NONLINEAR += ("square", "clamp", "mish", "erf")

_WHERE = ("where.ScalarOther", "where.ScalarSelf")
_PERMUTES = ("permute", "transpose.int", "swapaxes", "swapdims", "t", "mT", "movedim.int", "movedim.intlist")
_COPY_PADS: tuple[str, ...] = (
    "reflection_pad1d",
    "reflection_pad2d",
    "reflection_pad3d",
    "replication_pad1d",
    "replication_pad2d",
)
_COPY_PADS += ("replication_pad3d", "_pad_circular")
_SPLITS = ("split.Tensor", "split_with_sizes", "chunk", "unbind.int", "tensor_split.sections", "tensor_split.indices")
_POOLS = ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d")

RULES: tuple[OpRule, ...] = (
    # view-like: forward and backward walks
    OpRule("identity", _ops("alias", "clone", "contiguous", "detach", "lift_fresh_copy"), _identity, True),
    OpRule("dropout", _ops("dropout", "feature_dropout", "alpha_dropout"), _dropout, True),
    OpRule("cast", _ops("_to_copy", "to.dtype", "to.dtype_layout", "to.device"), _cast, True),
    OpRule("type_as", _ops("type_as"), _cast, True, shape_args=(1,)),
    OpRule("reshape", _ops("view", "reshape", "_unsafe_view", "ravel"), _reshape, True),
    OpRule("reshape_as", _ops("reshape_as", "view_as"), _reshape, True, shape_args=(1,)),
    OpRule("flatten", _ops("flatten.using_ints", "unflatten.int"), _reshape, True),
    OpRule("squeeze", _ops("squeeze", "squeeze.dim", "squeeze.dims", "unsqueeze"), _reshape, True),
    OpRule("permute", _ops(*_PERMUTES), _permute, True),
    OpRule("expand", _ops("expand"), _expand, True),
    OpRule("expand_as", _ops("expand_as"), _expand, True, shape_args=(1,)),
    OpRule("repeat", _ops("repeat", "repeat_interleave.self_int"), _repeat, True),
    OpRule("slice", _ops("slice.Tensor", "narrow", "select.int"), _slice, True),
    OpRule("index", _ops("index.Tensor", "index_select", "gather"), _index, True),
    OpRule("roll_flip", _ops("roll", "flip"), _roll_or_flip, True),
    OpRule("as_strided", _ops("as_strided"), _as_strided, True),
    OpRule("pad", _ops("constant_pad_nd", "pad", *_COPY_PADS), _pad, True),
    OpRule("split", _ops(*_SPLITS), _split, True, tuple_out=True),
    # arithmetic: forward walk only
    OpRule("mean", _ops("mean.dim", "mean"), _mean),
    OpRule("sum", _ops("sum.dim_IntList", "sum"), _sum),
    OpRule("max", _ops("amax", "amin"), _max_like),
    OpRule("max_dim", _ops("max.dim", "min.dim"), _max_like, tuple_out=True),
    OpRule("adaptive_avg_pool", _ops(*_POOLS), _adaptive_avg_pool),
    OpRule("avg_pool", _ops("avg_pool1d", "avg_pool2d"), _avg_pool),
    OpRule("max_pool", _ops("max_pool1d", "max_pool2d"), _max_pool),
    OpRule("max_pool_indices", _ops("max_pool2d_with_indices"), _max_pool, tuple_out=True),
    OpRule("scalar_mul", _ops("mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar"), _scalar_mul),
    OpRule("residual", _ops("add.Tensor", "sub.Tensor", "add.Scalar", "sub.Scalar", "rsub.Scalar"), _residual),
    OpRule("masked", _ops("masked_fill.Scalar", "masked_fill.Tensor", "where.self", *_WHERE), _masked),
    OpRule("nonlinear", _ops(*_NONLINEAR), _nonlinear),
)
RULE_OF: dict[Any, OpRule] = {op: rule for rule in RULES for op in rule.ops}

# Ops that read only the shape, dtype or device of a tensor: no data flows through them.
SHAPE_ONLY = set(_ops("sym_size.int", "sym_numel", "sym_stride.int", "sym_storage_offset", "_assert_tensor_metadata"))
# Outputs of tuple ops that are integer indices: with every scale > 0 (which a Pass through these ops
# requires) they are the same for ``s x + t`` as for ``x``, so no affine flows into them.
INDEX_OUTPUTS = {op: 1 for op in _ops("max.dim", "min.dim", "max_pool2d_with_indices")}
JOIN_OPS = set(_ops("cat", "stack"))
VIEW_OPS = {op for rule in RULES if rule.view_like for op in rule.ops}
PERMUTE_OPS = set(_ops(*_PERMUTES))
RESHAPE_OPS = {op for rule in RULES if rule.name in ("reshape", "reshape_as", "flatten", "squeeze") for op in rule.ops}


def reads_data(user: fx.Node, src: fx.Node) -> bool:
    """False when ``user`` reads ``src`` only for its shape, dtype or device (``sym_size``, the template of
    ``reshape_as``): a fold that changes ``src``'s values changes nothing there."""
    if user.op != "call_function" or user.target in SHAPE_ONLY:
        return user.op == "output"
    rule = RULE_OF.get(user.target)
    positions = [i for i, a in enumerate(user.args) if a is src]
    in_kwargs = any(v is src for v in user.kwargs.values())
    return in_kwargs or rule is None or any(i not in rule.shape_args for i in positions)
