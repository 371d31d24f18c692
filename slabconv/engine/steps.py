"""The steps of the op table (``slabconv.engine.rules.RULES``): for one op, where a per-channel affine's channels go
(view-like steps: reshapes, permutes, slices, casts...) or whether it commutes at all (arithmetic steps: means,
sums, pools, scalar products, residual adds, masks, nonlinear ops).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx

from slabconv.engine import reasons
from slabconv.engine.capture import (
    expr,
    norm_dim,
    op_arg,
    rank,
    same_size,
    shape_of,
    static_int,
    stored,
    written_tensors,
)
from slabconv.engine.chan import Block, Chan, Outcome, Pass, _ops, unsupported

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------- view-like steps


def _identity(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Pass(ch)


_WIDER: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.float64: (torch.float64,),
}
"""For each floating dtype, the dtypes that hold every one of its values exactly."""


def holds_every_value(dst: torch.dtype, src: torch.dtype) -> bool:
    """True when every value of ``src`` is a value of ``dst`` (a cast ``src -> dst`` is exact)."""
    return dst in _WIDER.get(src, (src,))


def cast_outcome(chain: Sequence[torch.dtype], dst: torch.dtype, ch: Chan, unsupported_reason: str) -> Outcome:
    """What a cast to ``dst`` does to the affine, for both engines (the ONNX ``Cast`` and ATen ``_to_copy``).

    ``chain`` holds the dtypes the cast's input had through the casts right before it (the input's own dtype
    last; each earlier one its value was widened from exactly). The cast commutes with ``s * x + t`` when every
    value of its input is a value of ``dst``: ``dst`` holds one of the chain's dtypes (a widening, a round trip
    ``float32 -> float64 -> float32``). A narrowing cast does not: the original rounds (or overflows)
    ``s * x + t`` to ``dst`` where the fold would round ``x`` (``narrowing-cast-after-norm``). A cast to a
    non-floating dtype blocks with ``unsupported_reason``.
    """
    if not dst.is_floating_point:
        return Block(unsupported_reason)
    if any(holds_every_value(dst, d) for d in chain):
        return Pass(ch)
    return Block(reasons.NARROWING_CAST)


_CAST_NAMES = ("_to_copy", "to.dtype", "to.dtype_layout", "to.device", "type_as")
_CAST_OPS = set(_ops(*_CAST_NAMES))


def _dtype_of(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _cast_chain(src: fx.Node) -> list[torch.dtype]:
    """The dtypes ``src`` had through the exact (widening) casts that produced it, its own dtype last."""
    chain: list[torch.dtype] = []
    node: Any = src
    while (dtype := _dtype_of(node)) is not None:
        chain.insert(0, dtype)
        if node.op != "call_function" or node.target not in _CAST_OPS or not node.args:
            break
        before = _dtype_of(node.args[0])
        if before is None or not holds_every_value(dtype, before):
            break
        node = node.args[0]
    return chain


def _cast(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A cast to a floating dtype that holds every value of its input (a widening, a device move, a round trip
    back) commutes; a narrowing cast blocks (``narrowing-cast-after-norm``), a cast to an integer type is
    ``unsupported-op`` (``cast_outcome``, shared with the ONNX engine)."""
    dst, chain = _dtype_of(user), _cast_chain(src)
    if dst is None or not chain:
        return unsupported(user)
    return cast_outcome(chain, dst, ch, reasons.unsupported(user))


def _dropout(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    train = op_arg(user, 2, "train", False)
    return Block(reasons.TRAIN_MODE) if train else Pass(ch)


def _strides(shape: Sequence[Any]) -> list[sympy.Expr]:
    """Row-major element strides of a (possibly symbolic) shape."""
    out = [sympy.Integer(1)] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * expr(shape[k + 1])
    return out


@functools.lru_cache(maxsize=4096)
def _positive_int(e: sympy.Expr) -> int | None:
    """``e`` as an int when it is a positive integer for every value of its symbols, else None; cached (sympy
    expressions are immutable and hashable), as the same ratios come back for every block of a deep model and
    ``sympy.simplify`` takes milliseconds each."""
    if not e.is_Integer and e.free_symbols:
        e = sympy.simplify(e)
    return int(e) if e.is_Integer and int(e) >= 1 else None


def _reshape(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """A reshape (row-major) keeps the fold exact when each channel still lives on one output axis.

    On the input the channel index of flat element ``L`` is ``(L // P) % C`` with ``P = inner * stride(axis)``.
    An output axis ``k`` of stride ``P'`` and size ``S`` holds it as ``(i_k // m) % C`` with ``m = P / P'``
    when ``P'`` divides ``P`` and ``P * C`` divides ``P' * S`` (the channel digit lies inside axis ``k``).
    Otherwise the reshape mixes channels with other axes: ``channel-mixing-reshape``. A channel axis with segments
    (``Chan.segments``: part of it is another tensor) must come out whole, as one output axis with the same
    stride and size.
    """
    ins, outs = shape_of(src), shape_of(user)
    if ins is None or outs is None:
        return unsupported(user)
    if ch.segments:
        stride, size = _strides(ins)[ch.axis], ins[ch.axis]
        for k, (n, st) in enumerate(zip(outs, _strides(outs), strict=True)):
            if same_size(n, size) and sympy.simplify(st - stride) == 0:
                return Pass(ch.at(k))
        return Block(reasons.CHANNEL_MIXING_RESHAPE)
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
        shift = rank(user) - rank(src)
        if ch.segments and static_int(shape_of(user)[ch.axis + shift]) != static_int(shape_of(src)[ch.axis]):  # type: ignore[index]
            return unsupported(user)  # tiling a channel axis that is only partly the norm's
        return Pass(ch.at(ch.axis + shift))
    a: Any = user.args
    repeats = a[1] if len(a) > 1 else user.kwargs.get("repeats")
    dim: Any = a[2] if len(a) > 2 else user.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None or a[0] is not src:
        return unsupported(user)
    if norm_dim(dim, rank(src)) != ch.axis:
        return Pass(ch)
    if ch.segments:
        return unsupported(user)
    return Pass(Chan(ch.axis, ch.channels, ch.inner * repeats))


def _slice(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``select`` / ``slice`` / ``narrow`` of token axes pass the layout on. A part of the channel axis with static
    bounds (``y[:, 2:5]``, ``narrow``, a strided ``y[:, 1::2]``) holds the channels it picks (``Chan.pick``): a
    layer reading it folds the norm's scale and shift of those channels. A ``select`` of one channel or a part that
    holds none of the norm's channels blocks (``unsupported-op``)."""
    dim = norm_dim(user.args[1] if len(user.args) > 1 else 0, rank(src))  # type: ignore[arg-type]
    if user.target is aten.select.int:
        return unsupported(user) if dim == ch.axis else Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    if dim != ch.axis or same_size(outs[dim], ins[dim]):
        return Pass(ch)
    picked = channel_indices(user, src)
    piece = ch.pick(*picked) if picked is not None else None
    return Pass(piece) if piece is not None else unsupported(user)


def channel_indices(user: fx.Node, src: fx.Node) -> tuple[range, int] | None:
    """``(indices, size)``: the indices of an axis of ``src`` (of ``size``) that a ``slice`` (any step > 0) or
    ``narrow`` with static bounds keeps, in order (Python's slice semantics: negative bounds count from the end,
    bounds past the axis are clamped), checked against the output's size. None for anything else."""
    dim = norm_dim(user.args[1] if len(user.args) > 1 else 0, rank(src))  # type: ignore[arg-type]
    size, length = static_int(shape_of(src)[dim]), static_int(shape_of(user)[dim])  # type: ignore[index]
    if size is None or length is None:
        return None
    if user.target is aten.narrow.default:
        first = static_int(op_arg(user, 2, "start"))
        if first is None:
            return None
        first = first + size if first < 0 else first
        picked = range(first, first + length) if 0 <= first and first + length <= size else range(0)
    else:
        bounds = [op_arg(user, i, name, None) for i, name in ((2, "start"), (3, "end"))]
        ints = [None if b is None else static_int(b) for b in bounds]
        step = static_int(op_arg(user, 4, "step", 1))
        if step is None or step < 1 or any(b is not None and i is None for b, i in zip(bounds, ints, strict=True)):
            return None
        picked = range(size)[slice(ints[0], ints[1], step)]
    return (picked, size) if len(picked) == length else None


def _index(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x[idx]`` with index tensors on token axes only; the channel axis is found by its place counted from
    the end (PyTorch puts the broadcast index dims where the first indexed axis was when they are adjacent;
    a boolean mask over several axes counts as one index entry). ``index_select`` / ``gather`` over a token
    axis, the gather index keeping the whole channel axis. Channels picked by a constant 1-D integer index
    (``y.index_select(1, idx)``, ``y[:, idx]``) hold the channels they pick (``Chan.pick``, ``_picked``)."""
    if user.args[0] is not src:
        return unsupported(user)
    if user.target is not aten.index.Tensor:
        if norm_dim(user.args[1], rank(src)) == ch.axis:  # type: ignore[arg-type]
            picked = _picked(user, src, ch, user.args[2]) if user.target is aten.index_select.default else None
            return Pass(picked) if picked is not None else unsupported(user)
        if user.target is aten.gather.default:
            idx, ins = shape_of(user.args[2]), shape_of(src)
            if idx is None or ins is None or not same_size(idx[ch.axis], ins[ch.axis]):
                return unsupported(user)
        return Pass(ch)
    indices = list(user.args[1])  # type: ignore[arg-type]
    used = [i for i, ix in enumerate(indices) if ix is not None]
    if used == [ch.axis]:
        picked = _picked(user, src, ch, indices[ch.axis])
        return Pass(picked) if picked is not None else unsupported(user)
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


def _picked(user: fx.Node, src: fx.Node, ch: Chan, index: Any) -> Chan | None:
    """The layout after ``user`` picks indices of the channel axis of ``src`` (channels at ``ch``) by ``index``: a
    1-D integer tensor that is a constant of the graph (``affine_values.Constants``: stored tensors the graph never
    writes and ops on them), each index in range (negative ones count from the end); None otherwise."""
    from slabconv.engine.affine_values import Constants  # (it imports the rule table, which imports this module)

    gm = user.graph.owning_module
    size = static_int(shape_of(src)[ch.axis])  # type: ignore[index]
    if gm is None or size is None or not isinstance(index, fx.Node):
        return None
    constants = Constants(gm)
    if not constants.is_const(index):
        return None
    if any(n.op == "get_attr" and str(n.target) in written_tensors(gm) for n in Constants.ancestors(index)):
        return None
    value = constants.value(index)
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != 1
        or value.is_floating_point()
        or value.dtype == torch.bool
    ):
        return None
    picked = [int(i) + size if int(i) < 0 else int(i) for i in value.tolist()]
    return ch.pick(picked, size) if all(0 <= i < size for i in picked) else None


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
    Constant padding adds values the fold would shift (``zero-padding-after-norm``), except zeros when every shift
    is 0: ``pad(s x, 0) = s pad(x, 0)`` (``Pass.needs_zero_shift``); a non-zero value ``v`` would have to become
    ``v / s``. A negative constant pad (a crop) of token axes is a slice. ``constant_pad_nd(x, pad, value=0)``,
    ``pad(x, pad, mode, value=None)`` (None: 0)."""
    pad = list(user.args[1])  # type: ignore[arg-type]
    n = rank(src)
    mode = op_arg(user, 2, "mode", "constant")
    constant = user.target is aten.constant_pad_nd.default or (user.target is aten.pad.default and mode == "constant")
    value = op_arg(user, 2 if user.target is aten.constant_pad_nd.default else 3, "value", 0)
    zeros = value is None or (isinstance(value, (int, float)) and float(value) == 0.0)
    padded = False
    for i, amount in enumerate(pad):
        dim, size = n - 1 - i // 2, static_int(amount)
        if constant and (size is None or size > 0):
            if not zeros:
                return Block(reasons.ZERO_PADDING_AFTER_NORM)
            padded = True
        if dim == ch.axis and size != 0:
            return unsupported(user)
    return Pass(ch, needs_zero_shift=padded)


def _split(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``split`` / ``split_with_sizes`` / ``chunk`` / ``tensor_split`` / ``unbind`` along a token axis: every
    piece holds the whole channel axis (``unbind`` removes its axis). The state applies to each ``getitem``.

    Along the channel axis (static sizes) the pieces are consecutive parts of it, each holding its part of the
    channels (``Chan.part``): ``Pass.items`` gives each ``getitem`` its own state (None for a piece that holds
    none of the norm's channels). ``unbind`` of the channel axis blocks (``unsupported-op``)."""
    n = rank(src)
    if user.target is aten.unbind.int:
        dim = norm_dim(user.args[1] if len(user.args) > 1 else 0, n)  # type: ignore[arg-type]
        return unsupported(user) if dim == ch.axis else Pass(ch.at(ch.axis - 1 if dim < ch.axis else ch.axis))
    if norm_dim(op_arg(user, 2, "dim", 0), n) != ch.axis:
        return Pass(ch)
    outs, size = user.meta.get("val"), static_int(shape_of(src)[ch.axis])  # type: ignore[index]
    if not isinstance(outs, (list, tuple)) or size is None:
        return unsupported(user)
    items: list[Chan | None] = []
    start = 0
    for out in outs:
        length = static_int(out.shape[ch.axis]) if isinstance(out, torch.Tensor) else None
        if length is None:
            return unsupported(user)
        items.append(ch.part(start, length, size) if length else None)
        start += length
    return Pass(ch, items=tuple(items)) if start == size else unsupported(user)


# --------------------------------------------------------------------------------------------- arithmetic steps


def reduce_dims(user: fx.Node, src: fx.Node) -> tuple[list[int], bool]:
    """The reduced axes (sorted, non-negative) and ``keepdim`` of a reduction node."""
    n = rank(src)
    dims: Any = op_arg(user, 1, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(n))
    dims = [dims] if isinstance(dims, int) else list(dims)
    keepdim = bool(op_arg(user, 2, "keepdim", False))
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


_SPATIAL = re.compile(r"(\d)d")


def spatial_axes(user: fx.Node, src: fx.Node) -> int:
    """How many trailing axes of ``src`` a pooling or resampling op works on: the ``Nd`` of its name
    (``avg_pool2d``, ``upsample_trilinear3d``: 2, 3), else every axis after the first two (``grid_sampler``).
    Each plane over those axes (one per index of the leading axes: batch and channels) is pooled or resampled on
    its own."""
    found = _SPATIAL.search(getattr(user.target, "__name__", "").split(".")[0])
    return int(found.group(1)) if found else rank(src) - 2


def _on_leading_axis(user: fx.Node, src: fx.Node, ch: Chan) -> bool:
    """True when the channels sit on an axis the op does not pool or resample (batch or channel axis)."""
    return ch.axis < rank(src) - spatial_axes(user, src)


def _adaptive_avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Adaptive average pooling (to any size, ``1x1`` being a global average pool) is a mean over each window:
    ``mean(s x + t) = s mean(x) + t``, exact when the channel axis is not pooled."""
    return Pass(ch) if _on_leading_axis(user, src, ch) else unsupported(user)


def _resample(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Interpolation (``F.interpolate`` / ``nn.Upsample``: ``upsample_nearest*``, ``_upsample_nearest_exact*``,
    ``upsample_linear1d``, ``upsample_bilinear2d``, ``upsample_bicubic2d``, ``upsample_trilinear3d``, their
    ``.vec`` overloads and the ``_aa`` antialiased ones): each output element is ``sum_k w_k x_k`` over input
    elements of its own plane with weights that sum to one, so ``interp(s x + t) = s interp(x) + t`` when the
    channel axis is not resampled.

    The weights sum to one for every mode PyTorch has: nearest copies one element; linear, bilinear and
    trilinear weights are products of ``(1 - l, l)`` pairs; the cubic convolution kernel (``A = -0.75``) is a
    partition of unity; indices past a border are clamped to it (the weight stays on a real element); the
    antialiased kernels divide each output's weights by their total (``aten/src/ATen/native/cpu/UpSampleKernel.cpp``).
    ``align_corners`` and the scale factors only move the sample positions."""
    return Pass(ch) if _on_leading_axis(user, src, ch) else unsupported(user)


def _grid_sample(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``F.grid_sample(x, grid, mode, padding_mode, align_corners)`` (``aten.grid_sampler*``; an ONNX ``GridSample``
    lowered with its attributes as torch's numbers): bilinear, nearest or bicubic weights that sum to one over the
    elements sampled, as ``_resample``, when the samples outside the input are border or reflected elements
    (``padding_mode`` 1, 2). With ``padding_mode="zeros"`` (0) they are zeros, which the fold would shift by ``t``:
    ``zero-padding-after-norm``, unless every shift is 0 (``Pass.needs_zero_shift``: the samples are then a weighted
    sum of ``s x`` and zeros).
    The grid itself holds sampling positions: a normalised grid is a nonlinear use."""
    if user.args[0] is not src:
        return Block(reasons.NONLINEAR)
    padding_mode = op_arg(user, 3, "padding_mode")
    if not _on_leading_axis(user, src, ch):
        return unsupported(user)
    return Pass(ch, needs_zero_shift=padding_mode not in (1, 2))


def _avg_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Average pooling is a mean over each window, unless padded zeros count in it (then it commutes only when every
    shift is 0, ``Pass.needs_zero_shift``: the average of ``s x`` and zeros is ``s`` times that of ``x`` and zeros).
    (``ceil_mode`` windows that run past the input are divided by the elements they hold: still a mean.) A forced
    divisor ``d`` makes it a sum over the window divided by ``d``: the shift is multiplied by ``k / d`` (``k`` the
    window's elements) where every window is whole (no padding, no ``ceil_mode``), else the shift must be 0 (the
    windows at the border hold fewer of it)."""
    if not _on_leading_axis(user, src, ch):
        return unsupported(user)
    a: Any = user.args
    padding: Any = a[3] if len(a) > 3 else user.kwargs.get("padding", 0)
    ceil_mode = a[4] if len(a) > 4 else user.kwargs.get("ceil_mode", False)
    count_include_pad = a[5] if len(a) > 5 else user.kwargs.get("count_include_pad", True)
    divisor = a[6] if len(a) > 6 else user.kwargs.get("divisor_override")
    padded = any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))
    if divisor is not None:
        if padded or ceil_mode:
            return Pass(ch, needs_zero_shift=True)
        kernel: Any = a[1]
        spatial = int(re.search(r"avg_pool(\d)d", str(user.target)).group(1))  # type: ignore[union-attr]
        sizes = list(kernel) if isinstance(kernel, (list, tuple)) else [kernel] * spatial
        return Pass(ch, mult=math.prod(int(k) for k in sizes) / int(divisor))  # type: ignore[arg-type]
    return Pass(ch, needs_zero_shift=padded and bool(count_include_pad))


def _max_pool(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """Max pooling (fixed or adaptive windows; padding is ``-inf``) is a max over each window: it commutes when
    every scale is > 0 and the channel axis is not pooled."""
    return Pass(ch, needs_positive_scale=True) if _on_leading_axis(user, src, ch) else unsupported(user)


def _stored_scalar(node: Any) -> float | None:
    """The value of a one-element floating tensor the graph stores and never writes (a stored scale, a constant
    an exporter keeps as an initializer), else None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    gm = node.graph.owning_module
    value = stored(gm, str(node.target))
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        return None
    return None if str(node.target) in written_tensors(gm) else float(value.reshape(()))


def _scalar_mul(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """``x * c`` or ``x / c`` with a Python number or a stored one-element constant: ``c (s x + t) = s (c x) + c t``,
    the shift scales by c. A product with another tensor (a mask, another activation) blocks:
    ``masked-after-norm``."""
    other = user.args[1] if user.args[0] is src else user.args[0]
    scalar = _stored_scalar(other)
    if scalar is not None:
        other = scalar
    if isinstance(other, (int, float)) and not isinstance(other, bool) and user.args.count(src) == 1:
        if user.target in (aten.div.Tensor, aten.div.Scalar):
            if user.args[0] is not src or float(other) == 0.0:
                return Block(reasons.NONLINEAR)
            return Pass(ch, mult=1.0 / float(other))
        return Pass(ch, mult=float(other))
    return Block(reasons.MASKED_AFTER_NORM)


def _residual(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    """An add/sub reading the norm's output: a residual (``residual-reads-norm``), or, where the other operand is a
    constant (a number, or a node of stored tensors and literals: ``affine_values.Constants``, what a constant added
    before a norm is too), ``constant-added-after-norm``: after the norm is removed the add would need
    ``(1 - s) c`` more shift, which no step carries."""
    from slabconv.engine.affine_values import Constants  # (it imports the rule table, which imports this module)

    others = [a for a in user.args[:2] if a is not src]
    gm = user.graph.owning_module
    if others and (not isinstance(others[0], fx.Node) or (gm is not None and Constants(gm).is_const(others[0]))):
        return Block(reasons.CONSTANT_ADDED_AFTER_NORM)
    return Block(reasons.RESIDUAL_READS_NORM)


def _masked(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.MASKED_AFTER_NORM)


def _nonlinear(user: fx.Node, src: fx.Node, ch: Chan) -> Outcome:
    return Block(reasons.NONLINEAR)
