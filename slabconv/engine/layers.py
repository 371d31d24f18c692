"""The layers a norm folds into (``LAYERS``; ``layer_of``: node -> ``LayerKind``), forward as a consumer (SLAB
Lemma 4.1 then ``W diag(s)``, ``b + W t``) or backward as a producer (``diag(s) W``, ``s b + t``).

Each entry holds where its input, weight and bias are, its exactness check (a reason string, never a silent skip),
its fold and how a created bias attaches. The fold itself is ``LayerKind.fold_values``: node-free, on tensors and
a row range, so the planner (on the graph), the fold program (``slabconv.engine.program``, in memory and one block
of rows at a time in the streamed mode) and question 1 all run the same algebra (``slabconv.fold``). Adding a
layer kind is one entry and one test (``tests/test_engine_plan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.capture import is_param, op_arg, rank, same_shape, same_size, shape_of, static_int
from slabconv.engine.rules import PERMUTE_OPS, RESHAPE_OPS, RULES, Chan, _ops, aten, op_name


def _transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.permute(1, 0)`` of a stored 2-D weight (decomposed Linear)."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):  # type: ignore[arg-type]
        w = node.args[0]
        if isinstance(w, fx.Node) and w.op == "get_attr":
            return w
    return None


GroupedFold = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""A ``slabconv.fold`` function of ``(weight, bias, s, t, groups, *, first, total, inplace)``."""


class LayerKind:
    """One kind of layer as ATen writes it (``aten.linear``, ``addmm``, ``mm``, ``conv2d``, ...).

    A layer reads its data input at ``data_arg``, contracts ``in_axis`` of it and writes its output channels
    (dim 0 of the stored weight) at ``out_axis`` of its output. The weight must be a stored ``(out, in, ...)``
    tensor and the bias a stored ``(out,)`` tensor or absent; anything else is ``unsupported-op``.
    """

    name = ""
    ops: tuple[Any, ...] = ()
    data_arg = 0
    separate_bias = True  # a bias-free layer may take its bias from a lone ``add`` after it (``separate_bias``)
    shift_in_weight = False
    """A backward fold adds the shift to the stored weight itself (an embedding's table), never to a bias: the
    layer needs no bias to carry a shift, and none is created for it."""
    pure_scale = True
    """Its folds only scale stored weight elements, the shift going to the bias: a forward fold scales the input
    columns alike in every row of a group, a backward fold each output row by its own factor
    (``slabconv.engine.ranges`` measures the magnification so)."""
    bias_by_rows = True
    """The bias has one value per row of the stored weight (dim 0 is the output channels): a block of rows folds
    with its rows of the bias. False: the bias is folded whole with every block (``fold_values`` returns all of it;
    a transposed convolution, whose rows are its input channels); a forward fold's bias then takes the shift through
    every row, so the fold program folds the bias over the whole weight (``LayerRecipe.needs_all_rows``)."""

    channel_dim = 0
    """The stored weight's axis of its output channels, along which per-channel int8 steps it
    (``slabconv.engine.ranges``): 0, its rows; 1 for a transposed convolution (columns, within each group)."""
    groups_arg: int | None = None
    """The position of the op's ``groups`` argument (a convolution's); None: one group."""
    grouped_forward: ClassVar[GroupedFold | None] = None
    """The forward fold of a kind whose weight's rows fall into ``groups``; None: ``fold_into_linear``, ``s`` and
    ``t`` whole."""
    grouped_backward: ClassVar[GroupedFold | None] = None
    """The backward fold of such a kind; None: ``fold_into_producer`` on the block's rows of ``s`` and ``t``."""

    def claims(self, node: fx.Node) -> bool:
        """True when ``node`` (one of ``ops``) is this kind of layer: of the kinds that share an op
        (``aten.convolution``, transposed or not), the one whose ``claims`` holds (``layer_of``)."""
        return True

    def bias_size(self, weight_shape: list[int] | tuple[int, ...], groups: int) -> int:
        """The length of the layer's ``(C_out,)`` bias, from its stored weight's shape."""
        return int(weight_shape[0])

    def weight(self, node: fx.Node) -> fx.Node | None:
        """The ``get_attr`` of the stored ``(out, in, ...)`` weight, None when it is computed."""
        w = node.args[1]
        return w if isinstance(w, fx.Node) and w.op == "get_attr" else None

    def bias(self, node: fx.Node) -> Any:
        """The bias argument: None, a ``get_attr`` node, or something else (then no fold)."""
        return op_arg(node, 2, "bias")

    def in_axis(self, node: fx.Node) -> int:
        return 1

    def out_axis(self, node: fx.Node) -> int:
        return 1

    def groups(self, node: fx.Node) -> int:
        """The layer's ``groups`` (positional at ``groups_arg``, else the keyword, default 1)."""
        if self.groups_arg is None:
            return 1
        return int(op_arg(node, self.groups_arg, "groups", 1))

    def _structure(self, node: fx.Node) -> str | None:
        """``computed-weight`` when the weight or bias is not a stored tensor (a weight-normalised layer computes
        ``g v / |v|`` as it runs; an exporter's ``Transpose`` of a weight left unfolded): nothing to rescale."""
        if self.weight(node) is None or not is_param(self.bias(node)):
            return reasons.COMPUTED_WEIGHT
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
            if reason == reasons.COMPUTED_WEIGHT:
                return f"{op_name(node)} has no stored weight to scale ({reasons.COMPUTED_WEIGHT})"
            return reason
        if not ch.plain or ch.axis != self.out_axis(node):
            return f"the norm's channels are not the output channels of {op_name(node)}"
        return None

    def fold_values(
        self,
        forward: bool,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        s: torch.Tensor,
        t: torch.Tensor,
        groups: int = 1,
        first: int = 0,
        total: int | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fold on tensors alone (no graph): ``weight`` / ``bias`` are rows ``first:first + len(weight)`` of
        the stored weight (dim 0, its output channels; ``total`` rows in all, default ``len(weight)``) and of the
        bias. Forward: ``s``, ``t`` along the input axis (whole); backward: along the output channels (whole; the
        rows' part is taken here). Rows are independent, so a block folds exactly as the whole weight would. With
        ``inplace`` the float64 ``weight`` is the caller's to overwrite (``slabconv.fold``: a streamed block).
        A kind with ``grouped_forward`` / ``grouped_backward`` hands the block and its place to that fold; one with
        ``shift_in_weight`` (an embedding, backward only) returns ``(W * s + t, None)``, the table (any rows of it)
        with the whole affine in its columns, and no bias."""
        if self.shift_in_weight:
            if forward:
                raise AssertionError(f"a {self.name} is never a consumer (consumer_check refuses it)")
            return fold.fold_into_embedding(weight, s, t, inplace=inplace), None
        grouped = self.grouped_forward if forward else self.grouped_backward
        if grouped is not None:
            return grouped(weight, bias, s, t, groups, first=first, total=total, inplace=inplace)
        if forward:
            return fold.fold_into_linear(weight, bias, s, t, inplace=inplace)
        rows = slice(first, first + weight.shape[0])
        return fold.fold_into_producer(weight, bias, s[rows], t[rows], inplace=inplace)

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
    grouped_forward = staticmethod(fold.fold_into_conv)

    def padded(self, node: fx.Node) -> bool:
        padding: Any = op_arg(node, self.padding_arg, "padding", 0)
        if isinstance(padding, str):
            kernel = shape_of(node.args[1]) or ()
            return padding == "same" and any(int(k) > 1 for k in kernel[2:])
        return any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))

    def consumer_check(self, node: fx.Node, src: fx.Node, ch: Chan) -> str | None:
        reason = super().consumer_check(node, src, ch)
        if reason is None and self.padded(node):
            return reasons.PADDED_CONV_CONSUMER
        return reason


class Convolution(Conv):
    """``aten.convolution(x, W, b, stride, padding, dilation, transposed, output_padding, groups)`` with
    ``transposed`` False (core ATen's convolution; the transposed one is ``ConvolutionTransposed``)."""

    name = "convolution"
    ops = _ops("convolution")
    padding_arg, groups_arg = 4, 8

    def claims(self, node: fx.Node) -> bool:
        return not _transposed(node)


def _transposed(node: fx.Node) -> bool:
    """The ``transposed`` argument of an ``aten.convolution``."""
    return bool(op_arg(node, 6, "transposed", False))


class ConvTranspose(LayerKind):
    """``aten.conv_transpose1d/2d/3d(x, W, b, stride, padding, output_padding, groups, dilation)``
    (``nn.ConvTranspose*d``): reads and writes axis 1, its weight stored ``(C_in, C_out / groups, *kernel)``.

    A producer only: a norm after it folds backward exactly, each output channel ``o = g * (C_out / groups) + j``
    being column ``j`` of group ``g``'s rows, scaled by ``s[o]``, and the bias ``s * b + t``
    (``slabconv.fold.fold_into_conv_transpose``; onnxruntime's and onnxslim's ConvTranspose + BatchNormalization
    fusion, for every group count).

    A consumer only when pointwise (``pointwise``: every kernel size 1, stride 1, no output padding, each output
    position one input position, padding only cropping): a Linear over the channels, into whose rows a norm before
    it folds forward (``slabconv.fold.fold_into_pointwise_conv_transpose``). Any other is refused
    (``transposed-conv-consumer``): the layer spreads each input value over a kernel window of the output, so a
    shift ``t`` of its input reaches each output position through the taps covering it, fewer between the strides
    and at the borders, a pattern that is no per-channel bias."""

    name = "conv_transpose"
    ops = _ops("conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input")
    stride_arg, padding_arg, output_padding_arg = 3, 4, 5
    groups_arg = 6
    pure_scale = False  # a backward fold scales the columns of each group's rows (``ranges`` probes the folds)
    bias_by_rows = False  # the rows are the input channels; the bias is per output channel
    channel_dim = 1
    # ``weight``: rows ``first:first + len(weight)`` of ``total``; ``bias`` and the returned bias whole ``(C_out,)``.
    # A forward fold (a pointwise layer, ``consumer_check``) gives a bias that takes the shift through the given
    # rows only (``needs_all_rows``).
    grouped_forward = staticmethod(fold.fold_into_pointwise_conv_transpose)
    grouped_backward = staticmethod(fold.fold_into_conv_transpose)

    def bias_size(self, weight_shape: list[int] | tuple[int, ...], groups: int) -> int:
        return int(weight_shape[1]) * groups

    def _ints(self, node: fx.Node, arg: int, name: str, default: int, spatial: int) -> list[int] | None:
        """The op's int-or-list argument ``arg`` (keyword ``name``) as one int per spatial axis; None when it is
        not a static int."""
        value: Any = op_arg(node, arg, name, default)
        values = list(value) if isinstance(value, (list, tuple)) else [value] * spatial
        ints = [static_int(v) for v in values]
        known = [v for v in ints if v is not None]
        return known if len(known) == len(ints) == spatial else None

    def pointwise(self, node: fx.Node) -> bool:
        """Every output position of the layer is one input position times the ``(C_in, C_out / groups)`` matrix,
        plus the bias: a kernel of size 1 (the stored weight's), stride 1, no output padding, and each static output
        size the input's less the padding at both ends, for every value of a symbolic size (so no position past
        the input is written: an ONNX
        ``output_shape`` or asymmetric ``pads`` that the lowering sees otherwise counts as not pointwise)."""
        weight, x = shape_of(node.args[1]), shape_of(node.args[0])
        out = shape_of(node)
        if weight is None or x is None or out is None or len(x) != len(weight) or len(out) != len(x):
            return False
        spatial = len(weight) - 2
        if any(static_int(k) != 1 for k in weight[2:]):
            return False
        stride = self._ints(node, self.stride_arg, "stride", 1, spatial)
        padding = self._ints(node, self.padding_arg, "padding", 0, spatial)
        extra = self._ints(node, self.output_padding_arg, "output_padding", 0, spatial)
        if stride is None or padding is None or extra is None or any(s != 1 for s in stride) or any(extra):
            return False
        return all(p >= 0 and same_size(m, n - 2 * p) for n, m, p in zip(x[2:], out[2:], padding, strict=True))

    def consumer_check(self, node: fx.Node, src: fx.Node, ch: Chan) -> str | None:
        reason = super().consumer_check(node, src, ch)
        if reason is None and not self.pointwise(node):
            return reasons.TRANSPOSED_CONV_CONSUMER
        return reason


class ConvolutionTransposed(ConvTranspose):
    """``aten.convolution(x, W, b, stride, padding, dilation, True, output_padding, groups)``: core ATen's
    transposed convolution, and what an ONNX ``ConvTranspose`` is lowered to (``slabconv.engine.onnx_lower``)."""

    name = "convolution_transposed"
    ops = _ops("convolution")
    stride_arg, padding_arg, output_padding_arg = 3, 4, 7
    groups_arg = 8

    def claims(self, node: fx.Node) -> bool:
        return _transposed(node)


class Embedding(LayerKind):
    """``aten.embedding(W, ids, padding_idx, ...)``: a producer only. It gathers rows of the stored
    ``(num_embeddings, C)`` table, so its output channels are the last axis and a norm right after it folds into
    the table's columns (``slabconv.fold.fold_into_embedding``). It reads token ids, never features: a norm's
    output cannot be its input, so it is no consumer. A table also read elsewhere (tied to an ``lm_head``) is
    shared, and the planner leaves it alone."""

    name = "embedding"
    ops = _ops("embedding")
    data_arg = 1
    pure_scale = False  # the shift is added to every row of the table
    shift_in_weight = True
    separate_bias = False

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

    def attach_bias(self, node: fx.Node, bias: fx.Node) -> None:
        raise AssertionError("an embedding has no bias (its fold_values returns None for it)")


LAYERS: tuple[LayerKind, ...] = (
    Linear(), Addmm(), Mm(), Conv(), Convolution(), ConvTranspose(), ConvolutionTransposed(), Embedding()
)  # fmt: skip
LAYER_OF: dict[Any, tuple[LayerKind, ...]] = {
    op: tuple(kind for kind in LAYERS if op in kind.ops) for op in dict.fromkeys(op for k in LAYERS for op in k.ops)
}


def layer_of(node: Any) -> LayerKind | None:
    """The kind of layer ``node`` is (``LAYER_OF`` by its op, then the kind that ``claims`` it), None when it is no
    layer."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    return next((kind for kind in LAYER_OF.get(node.target, ()) if kind.claims(node)), None)


# Ops that may lie between a stored bias and the ``add`` that applies it: they only change its shape.
_BIAS_VIEWS = RESHAPE_OPS | PERMUTE_OPS | {op for rule in RULES if rule.name == "identity" for op in rule.ops}


@dataclass(frozen=True)
class BiasAdd:
    """A layer's separate bias: ``add`` computes ``layer(x) + bias`` with ``bias`` a stored tensor (``get_attr``)
    of ``C`` values laid along the layer's output channels."""

    add: fx.Node
    bias: fx.Node


def _one_axis(shape: Any) -> bool:
    """At most one axis longer than 1 (reshapes and permutes then keep the order of the values)."""
    return shape is not None and sum(static_int(n) != 1 for n in shape) <= 1


def separate_bias(node: fx.Node, kind: LayerKind) -> BiasAdd | None:
    """The bias a bias-free layer takes from a lone ``add`` right after it: ``conv(x, W) + b.view(1, C, 1, 1)``
    (Paddle's pattern; ONNX ``Conv`` / ``MatMul`` followed by ``Add``), ``linear(x, W) + b``.

    ``layer(x) + b`` is ``layer(x)`` with bias ``b`` when the layer has no bias of its own, its output is read by
    the add alone and has the add's shape, and ``b`` is a stored tensor of ``C`` values (one per output channel,
    ``C`` the size of the output axis), broadcast along that axis only, reached from its ``get_attr`` through
    reshapes, permutes and copies that nothing else reads (each with at most one axis longer than 1, so the values
    keep their order). A fold then treats ``b`` (flattened to ``(C,)``) as the layer's bias and writes the new
    bias back in ``b``'s stored shape: both fold directions, no new op.

    Args:
        node: the layer's op (a ``layer_of`` node).
        kind: its ``LayerKind``.

    Returns:
        The add and the stored bias's ``get_attr``, or None when the pattern does not hold.
    """
    if not kind.separate_bias or kind.bias(node) is not None or len(node.users) != 1:
        return None
    (add,) = node.users
    if add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    out, const = shape_of(node), shape_of(other)
    if not isinstance(other, fx.Node) or other is node or out is None or const is None:
        return None
    axis, lead = kind.out_axis(node), len(out) - len(const)
    channels = static_int(out[axis])
    if channels is None or lead < 0 or axis < lead or not same_shape(shape_of(add), out):
        return None
    if any(static_int(n) != (channels if i + lead == axis else 1) for i, n in enumerate(const)):
        return None
    cur = other
    while cur.op == "call_function" and cur.target in _BIAS_VIEWS and len(cur.users) == 1 and _one_axis(shape_of(cur)):
        cur = cur.args[0]  # type: ignore[assignment]
        if not isinstance(cur, fx.Node):
            return None
    val = cur.meta.get("val")
    if cur.op != "get_attr" or len(cur.users) != 1 or not isinstance(val, torch.Tensor):
        return None
    if not val.dtype.is_floating_point or val.numel() != channels or not _one_axis(val.shape):
        return None
    return BiasAdd(add, cur)


def layer_name(node: fx.Node) -> str:
    """A readable name for a layer: its weight's dotted path without ``.weight`` (the node's name otherwise)."""
    kind = layer_of(node)
    weight = kind.weight(node) if kind is not None else None
    return str(weight.target).removesuffix(".weight") if weight is not None else node.name
