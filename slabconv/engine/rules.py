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
- ``LAYERS`` (``LAYER_OF``: op -> ``LayerKind``): the layers a norm folds into, forward (as a consumer, SLAB
  Lemma 4.1 then ``W diag(s)``, ``b + W t``) or backward (as a producer, ``diag(s) W``, ``s b + t``). Each entry
  holds where its input, weight and bias are, its exactness check (a reason string, never a silent skip), its
  fold (``slabconv.fold``) and how a created bias attaches. Adding a layer kind is one entry and one test.

Ops that no rule names block with ``unsupported-op:<aten op>``: slabconv never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.capture import is_param, rank, shape_of
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


# --------------------------------------------------------------------------------------------- layers


def _transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.permute(1, 0)`` of a stored 2-D weight (decomposed Linear)."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):  # type: ignore[arg-type]
        w = node.args[0]
        if isinstance(w, fx.Node) and w.op == "get_attr":
            return w
    return None


class LayerKind:
    """One kind of layer as ATen writes it (``aten.linear``, ``addmm``, ``mm``, ``conv2d``, ...).

    A layer reads its data input at ``data_arg``, contracts ``in_axis`` of it and writes its output channels
    (dim 0 of the stored weight) at ``out_axis`` of its output. The weight must be a stored ``(out, in, ...)``
    tensor and the bias a stored ``(out,)`` tensor or absent; anything else is ``unsupported-op``.
    """

    name = ""
    ops: tuple[Any, ...] = ()
    data_arg = 0

    def weight(self, node: fx.Node) -> fx.Node | None:
        """The ``get_attr`` of the stored ``(out, in, ...)`` weight, None when it is computed."""
        w = node.args[1]
        return w if isinstance(w, fx.Node) and w.op == "get_attr" else None

    def bias(self, node: fx.Node) -> Any:
        """The bias argument: None, a ``get_attr`` node, or something else (then no fold)."""
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")

    def in_axis(self, node: fx.Node) -> int:
        return 1

    def out_axis(self, node: fx.Node) -> int:
        return 1

    def groups(self, node: fx.Node) -> int:
        return 1

    def _structure(self, node: fx.Node) -> str | None:
        if self.weight(node) is None or not is_param(self.bias(node)):
            return reasons.unsupported(node)
        return None

    def consumer_check(self, node: fx.Node, src: fx.Node, ch: Chan) -> str | None:
        """None when folding ``s * src + t`` (channels at ``ch``) into the layer's input is exact, else the
        reason."""
        if node.args[self.data_arg] is not src or list(node.args).count(src) != 1:
            return reasons.unsupported(node)
        if (reason := self._structure(node)) is not None:
            return reason
        return reasons.CONSUMER_OFF_CHANNEL if ch.axis != self.in_axis(node) else None

    def producer_check(self, node: fx.Node, ch: Chan) -> str | None:
        """None when the channels at ``ch`` of the layer's output are its output channels (a backward fold
        scales weight rows), else why not (plain text; backward folds have no public reasons)."""
        if (reason := self._structure(node)) is not None:
            return reason
        if not ch.plain or ch.axis != self.out_axis(node):
            return f"the norm's channels are not the output channels of {op_name(node)}"
        return None

    def fold_forward(
        self, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W', b')`` for the layer reading ``s * x + t`` (``s``, ``t`` laid out along its input axis)."""
        return fold.fold_into_linear(weight, bias, s, t)

    def fold_backward(
        self, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(diag(s) W, s b + t)``: the layer's output followed by the norm (``slabconv.fold.fold_into_producer``).
        A layer without a bias argument returns None for it (the shift is then in the weight)."""
        return fold.fold_into_producer(weight, bias, s, t)

    def attach_bias(self, node: fx.Node, bias: fx.Node) -> None:
        """Make the layer (which had no bias) read ``bias``."""
        args = list(node.args)
        while len(args) < 3:
            args.append(None)
        args[2] = bias
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}


class Linear(LayerKind):
    """``aten.linear(x, W, b)``: contracts the last axis of ``x``, writes the last axis."""

    name = "linear"
    ops = _ops("linear")

    def in_axis(self, node: fx.Node) -> int:
        return rank(node.args[0]) - 1  # type: ignore[arg-type]

    def out_axis(self, node: fx.Node) -> int:
        return rank(node) - 1


class Addmm(LayerKind):
    """Decomposed Linear ``addmm(b, x, W.t())`` on a 2-D ``x``."""

    name = "addmm"
    ops = _ops("addmm")
    data_arg = 1

    def weight(self, node: fx.Node) -> fx.Node | None:
        return _transposed_weight(node.args[2])

    def bias(self, node: fx.Node) -> Any:
        return node.args[0]

    def _structure(self, node: fx.Node) -> str | None:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or node.args[0] is None:
            return reasons.unsupported(node)
        return super()._structure(node)


class Mm(LayerKind):
    """Decomposed bias-free Linear ``mm(x, W.t())``; a created bias turns it into ``addmm``."""

    name = "mm"
    ops = _ops("mm")

    def weight(self, node: fx.Node) -> fx.Node | None:
        return _transposed_weight(node.args[1])

    def bias(self, node: fx.Node) -> Any:
        return None

    def attach_bias(self, node: fx.Node, bias: fx.Node) -> None:
        node.target = aten.addmm.default
        node.args = (bias, *node.args)


class Conv(LayerKind):
    """``aten.conv1d/2d/3d(x, W, b, stride, padding, dilation, groups)`` (and the ``padding="same"`` overloads):
    contracts and writes axis 1. A forward fold is exact only when the conv pads nothing (a padded zero would
    have had to be the shift ``t``): ``padded-conv-consumer``."""

    name = "conv"
    ops = _ops("conv1d", "conv2d", "conv3d", "conv1d.padding", "conv2d.padding", "conv3d.padding")
    padding_arg, groups_arg = 4, 6

    def groups(self, node: fx.Node) -> int:
        a = node.args
        return int(a[self.groups_arg] if len(a) > self.groups_arg else node.kwargs.get("groups", 1))  # type: ignore[arg-type]

    def transposed(self, node: fx.Node) -> bool:
        return False

    def padded(self, node: fx.Node) -> bool:
        a = node.args
        padding: Any = a[self.padding_arg] if len(a) > self.padding_arg else node.kwargs.get("padding", 0)
        if isinstance(padding, str):
            kernel = shape_of(node.args[1]) or ()
            return padding == "same" and any(int(k) > 1 for k in kernel[2:])
        return any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))

    def _structure(self, node: fx.Node) -> str | None:
        return reasons.unsupported(node) if self.transposed(node) else super()._structure(node)

    def consumer_check(self, node: fx.Node, src: fx.Node, ch: Chan) -> str | None:
        reason = super().consumer_check(node, src, ch)
        if reason is None and self.padded(node):
            return reasons.PADDED_CONV_CONSUMER
        return reason

    def fold_forward(
        self, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fold.fold_into_conv(weight, bias, s, t, self.groups(node))


class Convolution(Conv):
    """``aten.convolution(x, W, b, stride, padding, dilation, transposed, output_padding, groups)``; transposed
    convolutions are not folded."""

    name = "convolution"
    ops = _ops("convolution")
    padding_arg, groups_arg = 4, 8

    def transposed(self, node: fx.Node) -> bool:
        return bool(node.args[6])


class Embedding(LayerKind):
    """``aten.embedding(W, ids, padding_idx, ...)``: a producer only. It gathers rows of the stored
    ``(num_embeddings, C)`` table, so its output channels are the last axis and a norm right after it folds into
    the table's columns (``slabconv.fold.fold_into_embedding``). It reads token ids, never features: a norm's
    output cannot be its input, so it is no consumer. A table also read elsewhere (tied to an ``lm_head``) is
    shared, and the planner leaves it alone."""

    name = "embedding"
    ops = _ops("embedding")
    data_arg = 1

    def weight(self, node: fx.Node) -> fx.Node | None:
        w = node.args[0]
        return w if isinstance(w, fx.Node) and w.op == "get_attr" else None

    def bias(self, node: fx.Node) -> Any:
        return None

    def in_axis(self, node: fx.Node) -> int:
        return -1  # no feature axis is contracted

    def out_axis(self, node: fx.Node) -> int:
        return rank(node) - 1

    def consumer_check(self, node: fx.Node, src: fx.Node, ch: Chan) -> str | None:
        return reasons.unsupported(node)

    def fold_forward(
        self, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("an embedding is never a consumer (consumer_check refuses it)")

    def fold_backward(
        self, node: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(W * s + t, None)``: the table with the whole affine in its rows; there is no bias."""
        return fold.fold_into_embedding(weight, s, t), None

    def attach_bias(self, node: fx.Node, bias: fx.Node) -> None:
        raise AssertionError("an embedding has no bias (its fold_backward returns None for it)")


LAYERS: tuple[LayerKind, ...] = (Linear(), Addmm(), Mm(), Conv(), Convolution(), Embedding())
LAYER_OF: dict[Any, LayerKind] = {op: kind for kind in LAYERS for op in kind.ops}


def layer_name(node: fx.Node) -> str:
    """A readable name for a layer: its weight's dotted path without ``.weight`` (the node's name otherwise)."""
    kind = LAYER_OF.get(node.target)
    weight = kind.weight(node) if kind is not None else None
    return str(weight.target).removesuffix(".weight") if weight is not None else node.name
