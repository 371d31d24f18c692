r"""The op tables: what each ATen op does to a per-channel affine ``s * x + t`` that flows through it.

In: an fx node (``user``), the input that carries the affine (``src``) and where the norm's channels sit on
``src`` (a ``Chan``). Out: an ``Outcome``:

- ``Pass(chan, mult)``: the op commutes with the affine; the channels are now at ``chan`` of the op's output and
  the shift is multiplied by ``mult`` (a sum over N tokens gives ``N t``).
- ``Absorb(layer)``: a Linear / conv that contracts the channel axis takes the affine into its weights.
- ``Block(reason)``: the fold stops here, with one of the stable reasons of ``slabconv.engine.reasons``.

The table, one entry per kind of op: ``RULES`` (``RULE_OF``: op -> ``OpRule``; the step functions are in
``slabconv.engine.steps``). A rule with ``view_like=True`` only moves or copies elements (each output element is one
input element of the same channel, whenever its step passes); those rules serve both the forward walk from a norm's
output and the backward walk from its input to a producer (``slabconv.engine.flow``). Of the other rules
(reductions, pools, scalar multiplies, nonlinearities, residual adds, masks) the backward walk passes those whose
step passes with the shift unchanged (``mult`` 1: means, average and max pools, interpolation; a max only when
every scale is > 0), since ``op(s y + t) = s op(y) + t`` read backward is what a fold into the producer needs; the
rest serve the forward walk only. ``shape_args`` names
the arguments read for their shape or dtype only (``reshape_as(x, other)``): no data flows from them. The layers a
norm folds into (``LAYERS``) are the other table, in ``slabconv.engine.layers``.

Ops that no rule names block with ``unsupported-op:<aten op>``: slabconv never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from slabconv.engine.chan import Absorb, Block, Chan, Outcome, Pass, Step, _ops, op_name, unsupported  # noqa: F401 (the rules' face)
from slabconv.engine.steps import (  # noqa: F401 (the rules' face)
    _CAST_NAMES,
    _adaptive_avg_pool,
    _as_strided,
    _avg_pool,
    _cast,
    _cast_chain,
    _dropout,
    _expand,
    _grid_sample,
    _identity,
    _index,
    _masked,
    _max_like,
    _max_pool,
    _mean,
    _nonlinear,
    _pad,
    _permute,
    _repeat,
    _resample,
    _reshape,
    _residual,
    _roll_or_flip,
    _scalar_mul,
    _slice,
    _split,
    _sum,
    cast_outcome,
    holds_every_value,
    permutation,
    reduce_dims,
)

aten = torch.ops.aten

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

_MAX_POOL_INDICES: tuple[str, ...] = ("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices")
_MAX_POOL_INDICES += ("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")
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
_POOLS: tuple[str, ...] = ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool3d")
_POOLS += ("_adaptive_avg_pool3d",)
_NEAREST = tuple(
    f"{name}{d}d{overload}"
    for name in ("upsample_nearest", "_upsample_nearest_exact")
    for d in (1, 2, 3)
    for overload in ("", ".vec")
)
_INTERPOLATE = tuple(
    f"{name}{overload}"
    for name in ("upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_bicubic2d")
    + ("_upsample_bicubic2d_aa", "upsample_trilinear3d")
    for overload in ("", ".vec")
)

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
    OpRule("upsample_nearest", _ops(*_NEAREST), _resample, True),
    # arithmetic: forward walk, and the backward walk where a step passes with the shift unchanged
    OpRule("mean", _ops("mean.dim", "mean"), _mean),
    OpRule("sum", _ops("sum.dim_IntList", "sum"), _sum),
    OpRule("max", _ops("amax", "amin"), _max_like),
    OpRule("max_dim", _ops("max.dim", "min.dim"), _max_like, tuple_out=True),
    OpRule("adaptive_avg_pool", _ops(*_POOLS), _adaptive_avg_pool),
    OpRule("interpolate", _ops(*_INTERPOLATE), _resample),
    OpRule("grid_sample", _ops("grid_sampler", "grid_sampler_2d", "grid_sampler_3d"), _grid_sample),
    OpRule("avg_pool", _ops("avg_pool1d", "avg_pool2d", "avg_pool3d"), _avg_pool),
    OpRule("max_pool", _ops("max_pool1d", "max_pool2d", "max_pool3d"), _max_pool),
    OpRule("max_pool_indices", _ops(*_MAX_POOL_INDICES), _max_pool, tuple_out=True),
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
INDEX_OUTPUTS = {op: 1 for op in _ops("max.dim", "min.dim", *_MAX_POOL_INDICES)}
CAT_OPS = set(_ops("cat", "concat", "concatenate"))  # torch.export keeps torch.concat / torch.concatenate as named
JOIN_OPS = CAT_OPS | set(_ops("stack"))
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
