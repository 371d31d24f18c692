"""The engine for ONNX graphs: find every per-channel constant affine by value, fold it into its consumers (or its
producer), and rewrite the graph without it, through onnx-ir (values, uses, initializers), not protobuf lists.

In: an ``onnx_ir.Model`` (``slabconv.load.onnx_file.load_onnx``) and the static shapes ONNX shape inference gives
its values. Out: the same model, changed in place, and one ``Decision`` per norm (the type the PyTorch engine
reports, with the same action names and the reasons of ``slabconv.engine.reasons``).

Norms recognised (``find_norms``), by their constant operands, never by names:

- ``BatchNormalization`` in inference mode (any rank, channel axis 1) with constant scale, bias, mean and variance;
- RepBN, ``BN(x) + alpha * x`` with a constant scalar ``alpha`` (the official ``RepBN``: exporters emit the
  ``Transpose`` pair around it, which the walk passes and the cleanup cancels);
- chains of ``Add`` / ``Sub`` / ``Mul`` / ``Div`` by per-axis constants: the decomposed BatchNorm, LayerScale,
  ``x * a + b``.

The affine ``s * x + t`` comes from ``slabconv.fold.repbn_affine`` (float64, Lemma 4.1 of the SLAB paper), and
every fold from ``slabconv.fold`` (``fold_into_linear``, ``fold_into_conv``, ``fold_into_producer``,
``fold_into_embedding``) in float64; an initializer that several norms fold into gets their composition in float64,
cast back to its dtype once.

What the walks pass (``PASS``) and what stops them (``BLOCK``) mirror the ATen rules of
``slabconv.engine.rules``: ``tests/test_onnx_in.py`` holds the two tables to each other. Consumers: ``MatMul``
whose constant right operand contracts the channel axis (its bias ``Add`` is updated or created), ``Gemm``
(``transB`` either way, ``alpha = beta = 1``), ``Conv`` without zero padding. Producers (the backward fold, when a
path is blocked): the same layers, and ``Gather`` of an embedding table. A norm that can be folded neither way is
kept as it is (its nodes untouched), with the reason of the first blocked path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from slabconv.engine import reasons, rules
from slabconv.fold import rounded


class Shapes(dict[str, tuple[int | str | None, ...]]):
    """Value name -> static shape from ONNX shape inference (an int per known dim, a name or None otherwise);
    ``dtypes``: value name -> its ONNX element type, where inference knows it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dtypes: dict[str, int] = {}


PASS = {
    "Transpose": "permute",
    "Reshape": "reshape",
    "Flatten": "flatten",
    "Squeeze": "squeeze",
    "Unsqueeze": "squeeze",
    "Identity": "identity",
    "Dropout": "dropout",
    "Gather": "index",
    "Slice": "slice",
    "ReduceMean": "mean",
    "Cast": "cast",
}
"""ONNX ops the forward walk passes when the channel axis stays whole, and the name of the ATen rule
(``slabconv.engine.rules.RULES``) that states the same fact for the PyTorch engine (a test holds them together)."""

BACKWARD_PASS = ("Transpose", "Identity", "Dropout", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast")
"""The ops the backward walk passes: each output element a copy of one input element of the same channel (their
ATen rules are ``view_like``)."""

NONLINEAR_OPS = frozenset(
    {"Relu", "Gelu", "Erf", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "HardSigmoid", "HardSwish", "LeakyRelu",
     "Elu", "Selu", "Softplus", "Exp", "Log", "Sqrt", "Pow", "Abs", "Neg", "Reciprocal", "Mish", "Sin", "Cos",
     "LayerNormalization", "RMSNormalization", "ReduceMax", "ReduceMin", "MaxPool", "GlobalMaxPool"}
)  # fmt: skip
"""Ops that do not commute with ``s * x + t``: a path through one is blocked (``nonlinear-before-consumer``)."""

JOIN = {"Concat": "cat"}
"""ONNX ops that join several tensors, and the ATen op of ``slabconv.engine.rules.JOIN_OPS`` with the same rule
(``slabconv.engine.flow._join``): a join passes when every input carries the affine with the same channel axis."""

BLOCK_RULES = {"Pad": "pad", "Where": "masked", **dict.fromkeys(NONLINEAR_OPS, "nonlinear")}
"""The ATen rule for the same fact, for each op of ``BLOCK`` that has one (checked by a test)."""

BLOCK = {
    "Pad": reasons.ZERO_PADDING_AFTER_NORM,
    "Where": reasons.MASKED_AFTER_NORM,
    **dict.fromkeys(NONLINEAR_OPS, reasons.NONLINEAR),
}
"""Ops that stop a forward walk, with the reason the report gives (others: ``unsupported-op:onnx.<Op>``)."""

SHAPE_ONLY = frozenset({"Shape", "Size"})

_TORCH_DTYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64}
"""ONNX element types of the floating dtypes (``TensorProto.FLOAT`` ...); any other is an integer / bool type."""


def _torch_dtype(elem: int | None) -> torch.dtype | None:
    return None if elem is None else _TORCH_DTYPES.get(int(elem), torch.int64)


def value_dtype(value: ir.Value, shapes: Shapes) -> torch.dtype | None:
    """The dtype of ``value`` in the file: what shape inference found on it (the float64 graph of question 1 is
    decided on the file's dtypes, so it folds exactly what the file's fold does), else its own type, else a
    ``Cast``'s target."""
    if (value.name or "") in shapes.dtypes:
        return _torch_dtype(shapes.dtypes[value.name or ""])
    if value.dtype is not None:
        return _torch_dtype(value.dtype.value)
    node = value.producer()
    return _torch_dtype(attr(node, "to")) if node is not None and node.op_type == "Cast" else None


def _cast_chain(value: ir.Value, shapes: Shapes) -> list[torch.dtype]:
    """The dtypes ``value`` had through the exact (widening) ``Cast`` nodes that produced it, its own last (as
    ``slabconv.engine.rules._cast_chain``)."""
    chain: list[torch.dtype] = []
    v: ir.Value | None = value
    while v is not None and (dtype := value_dtype(v, shapes)) is not None:
        chain.insert(0, dtype)
        node = v.producer()
        if node is None or node.op_type != "Cast" or not node.inputs or node.inputs[0] is None:
            break
        before = value_dtype(node.inputs[0], shapes)
        if before is None or not rules.holds_every_value(dtype, before):
            break
        v = node.inputs[0]
    return chain


def cast_passes(node: ir.Node, src: ir.Value, shapes: Shapes) -> str | None:
    """None when the ``Cast`` ``node`` of ``src`` holds every value of it (``rules.cast_outcome``), else the reason
    it blocks: ``narrowing-cast-after-norm``, or ``unsupported-op:onnx.Cast`` for a non-floating target."""
    chain, dst = _cast_chain(src, shapes), value_dtype(node.outputs[0], shapes)
    unsupported = reasons.UNSUPPORTED_PREFIX + "onnx.Cast"
    if dst is None or not chain:
        return unsupported
    outcome = rules.cast_outcome(chain, dst, rules.Chan(0, 1), unsupported)
    return outcome.reason if isinstance(outcome, rules.Block) else None


"""Readers of a tensor's shape only: a fold changes no shape, so they do not block."""


@dataclass
class OnnxNorm:
    """One per-channel constant affine of the graph.

    Attributes:
        name: the report name (the norm's parameter prefix, ``blocks.0.norm1.norm2``, else its node's name).
        kind: ``BatchNorm`` or ``RepBN``.
        nodes: the nodes that compute it (removed when it folds).
        input, output: the tensor it normalises and its result.
        axis: the channel axis of ``input`` (non-negative).
        scale, shift: ``(C,)`` float64, ``output = scale * input + shift`` on ``axis``.
        params: the constants it reads (dropped with it when nothing else reads them).
    """

    name: str
    kind: str
    nodes: list[ir.Node]
    input: ir.Value
    output: ir.Value
    axis: int
    scale: torch.Tensor
    shift: torch.Tensor
    params: list[ir.Value] = field(default_factory=list)


@dataclass
class Layer:
    """A layer that can absorb a norm: ``node`` (MatMul / Gemm / Conv / Gather), its weight and bias values.

    Attributes:
        weight: the initializer holding the weight.
        bias: the initializer holding the bias, or None (a fold creates one).
        bias_add: for a ``MatMul``, the ``Add`` node that adds ``bias`` (None when there is none yet).
        out: the tensor the layer gives (the bias ``Add``'s output for a MatMul with one).
    """

    node: ir.Node
    weight: ir.Value
    bias: ir.Value | None
    bias_add: ir.Node | None
    out: ir.Value


@dataclass
class Walk:
    """The forward walk from a norm's output: the layers reached, the blocked paths ``(where, reason)``."""

    layers: list[Layer] = field(default_factory=list)
    blocked: list[tuple[str, str]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- reading the graph


def const(value: ir.Value | None) -> np.ndarray | None:
    """The array of a constant value (an initializer or a ``Constant`` node's output), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else np.asarray(tensor.numpy())


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor; bfloat16 (``ml_dtypes``) through its bits."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def to_numpy(tensor: torch.Tensor, like: np.ndarray) -> np.ndarray:
    """``tensor`` as a numpy array of ``like``'s dtype (bfloat16 through its bits)."""
    if like.dtype.name == "bfloat16":
        return rounded(tensor, torch.bfloat16).view(torch.uint16).numpy().view(like.dtype).reshape(like.shape)
    if tensor.is_floating_point() and like.dtype.kind == "f":  # rounded once, as question 1 rounds
        tensor = rounded(tensor, torch.from_numpy(np.empty(0, dtype=like.dtype)).dtype)
    return tensor.detach().numpy().astype(like.dtype, copy=False)


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    """An attribute's value, or ``default``."""
    found = node.attributes.get(name)
    return default if found is None else found.value


def _readers(value: ir.Value) -> list[tuple[ir.Node, int]]:
    """The ``(node, input index)`` uses of ``value``, shape-only readers left out."""
    return [(u.node, u.idx) for u in value.uses() if u.node.op_type not in SHAPE_ONLY]


def _sole_reader(value: ir.Value) -> ir.Node | None:
    """The one node that reads ``value`` (shape-only readers aside), when it is not also a graph output."""
    readers = _readers(value)
    if len(readers) != 1 or value.is_graph_output():
        return None
    return readers[0][0]


def _shared(value: ir.Value) -> bool:
    """A constant read by more than one node (a tied weight): folding into it would change the other reader."""
    return len(value.uses()) > 1 or value.is_graph_output() or value.is_graph_input()


def _where(node: ir.Node | None) -> str:
    return "<output>" if node is None else f"{node.name or node.op_type}:{node.op_type}"


# --------------------------------------------------------------------------------------------- the walks


def _static(dims: Iterable[int | str | None]) -> int | None:
    total = 1
    for d in dims:
        if not isinstance(d, int) or d < 0:
            return None
        total *= d
    return total


def _view_axis(shapes: Shapes, src: ir.Value, dst: ir.Value, axis: int) -> int | None:
    """Where channel axis ``axis`` of ``src`` is in ``dst`` after a reshape-like op, or None when the reshape mixes
    channels with other axes: the channel length and the element count behind it must both be static and equal."""
    a, b = shapes.get(src.name or ""), shapes.get(dst.name or "")
    if a is None or b is None or axis >= len(a):
        return None
    channels, inner = a[axis], _static(a[axis + 1 :])
    if not isinstance(channels, int) or inner is None:
        return None
    for j in range(len(b) - 1, -1, -1):
        if b[j] == channels and _static(b[j + 1 :]) == inner:
            return j
    return None


def _rank(shapes: Shapes, value: ir.Value) -> int | None:
    shape = shapes.get(value.name or "")
    return None if shape is None else len(shape)


def _pass(node: ir.Node, idx: int, axis: int, shapes: Shapes, src: ir.Value) -> tuple[int | None, str | None]:
    """Through one op of ``PASS``: ``(channel axis of its output, None)``, or ``(None, reason)`` when blocked."""
    op, out = node.op_type, node.outputs[0]
    unsupported = reasons.UNSUPPORTED_PREFIX + f"onnx.{op}"
    if idx != 0:
        return None, unsupported
    if op in ("Identity", "Dropout"):
        return axis, None
    if op == "Cast":
        reason = cast_passes(node, src, shapes)
        return (axis, None) if reason is None else (None, reason)
    if op == "Transpose":
        perm = attr(node, "perm")
        rank = _rank(shapes, src)
        order = list(perm) if perm is not None else list(range((rank or 0) - 1, -1, -1))
        return (order.index(axis), None) if axis in order else (None, unsupported)
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        new = _view_axis(shapes, src, out, axis)
        return (new, None) if new is not None else (None, reasons.CHANNEL_MIXING_RESHAPE)
    rank = _rank(shapes, src)
    if rank is None:
        return None, unsupported
    if op == "Gather":
        gather_axis = int(attr(node, "axis", 0)) % rank
        indices = _rank(shapes, node.inputs[1]) if node.inputs[1] is not None else None
        if gather_axis == axis or indices is None:
            return None, reasons.CONSUMER_OFF_CHANNEL if gather_axis == axis else unsupported
        return (axis if gather_axis > axis else axis - 1 + indices), None
    if op == "Slice":
        axes = const(node.inputs[3]) if len(node.inputs) > 3 else None
        chosen = {int(a) % rank for a in axes.reshape(-1)} if axes is not None else set(range(rank))
        return (axis, None) if axis not in chosen else (None, reasons.CONSUMER_OFF_CHANNEL)
    if op == "ReduceMean":
        raw = attr(node, "axes")
        if raw is None and len(node.inputs) > 1:
            found = const(node.inputs[1])
            raw = None if found is None else [int(a) for a in found.reshape(-1)]
        if raw is None or len(raw) == 0:  # no axes: every axis is reduced (or none, with noop_with_empty_axes)
            noop = raw is not None and attr(node, "noop_with_empty_axes", 0)
            return (axis, None) if noop else (None, reasons.CHANNEL_MIXING_RESHAPE)
        axes_set = {int(a) % rank for a in raw}
        if axis in axes_set:
            return None, reasons.CHANNEL_MIXING_RESHAPE
        keep = int(attr(node, "keepdims", 1))
        return (axis if keep else axis - sum(a < axis for a in axes_set)), None
    return None, unsupported


def _linear_bias(out: ir.Value, width: int) -> tuple[ir.Value | None, ir.Node | None, ir.Value]:
    """The bias ``Add`` right after a ``MatMul``: ``(bias value, Add node, Add output)`` when the MatMul's only
    reader adds a constant ``(width,)`` vector; else ``(None, None, out)``."""
    add = _sole_reader(out)
    if add is None or add.op_type != "Add":
        return None, None, out
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    array = const(other)
    if other is None or array is None or not other.is_initializer() or array.shape != (width,) or _shared(other):
        return None, None, out
    return other, add, add.outputs[0]


def _consumer(node: ir.Node, idx: int, axis: int, shapes: Shapes, src: ir.Value) -> Layer | str:
    """The layer ``node`` is, when it contracts the channel axis of input ``idx``; else the reason it blocks."""
    op = node.op_type
    rank = _rank(shapes, src)
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    w = const(weight)
    if idx != 0 or weight is None or w is None:
        return reasons.UNSUPPORTED_PREFIX + f"onnx.{op}"
    if not weight.is_initializer():
        return reasons.UNSUPPORTED_PREFIX + f"onnx.{op}"
    if _shared(weight):
        return reasons.SHARED_WEIGHT
    if op == "MatMul":
        if rank is None or axis != rank - 1 or w.ndim != 2:
            return reasons.CONSUMER_OFF_CHANNEL
        bias, add, out = _linear_bias(node.outputs[0], w.shape[1])
        return Layer(node, weight, bias, add, out)
    if op == "Gemm":
        if axis != 1 or attr(node, "transA", 0) or float(attr(node, "alpha", 1.0)) != 1.0:
            return reasons.CONSUMER_OFF_CHANNEL if axis != 1 else reasons.UNSUPPORTED_PREFIX + "onnx.Gemm"
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and (float(attr(node, "beta", 1.0)) != 1.0 or not _plain_bias(bias)):
            return reasons.UNSUPPORTED_PREFIX + "onnx.Gemm"
        return Layer(node, weight, bias, None, node.outputs[0])
    if op == "Conv":
        if axis != 1:
            return reasons.CONSUMER_OFF_CHANNEL
        pads = attr(node, "pads") or []
        if any(int(p) for p in pads) or attr(node, "auto_pad", "NOTSET") not in (
            "NOTSET",
            "VALID",
            b"NOTSET",
            b"VALID",
        ):
            return reasons.PADDED_CONV_CONSUMER
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and not _plain_bias(bias):
            return reasons.UNSUPPORTED_PREFIX + "onnx.Conv"
        return Layer(node, weight, bias, None, node.outputs[0])
    return reasons.UNSUPPORTED_PREFIX + f"onnx.{op}"


def _plain_bias(value: ir.Value) -> bool:
    """A bias the fold may rewrite: an unshared initializer of one axis."""
    array = const(value)
    return array is not None and value.is_initializer() and array.ndim == 1 and not _shared(value)


LAYER_OPS = frozenset({"MatMul", "Gemm", "Conv"})


def walk_forward(value: ir.Value, axis: int, shapes: Shapes) -> Walk:
    """Every path from ``value`` (channel axis ``axis``): the layers that absorb the affine, the blocked paths."""
    walk = Walk()
    seen: set[int] = set()
    joins: dict[int, tuple[ir.Node, dict[int, int]]] = {}  # Concat -> the inputs the affine reached, and its axis
    decided: set[int] = set()

    def visit(v: ir.Value, ax: int) -> None:
        if v.is_graph_output():
            walk.blocked.append(("<output>", reasons.FEEDS_OUTPUT))
        for node, idx in _readers(v):
            key = id(node)
            op = node.op_type
            if op in JOIN and node.graph is v.graph and node.domain in ("", "ai.onnx"):
                if key in decided:  # reached again after it was decided (blocked): this path is blocked too
                    walk.blocked.append((_where(node), reasons.CONCAT_WITH_UNNORMALIZED))
                else:
                    joins.setdefault(key, (node, {}))[1][idx] = ax
                continue
            if key in seen:
                continue
            seen.add(key)
            if node.graph is not v.graph:  # read inside an If / Loop body: not followed
                walk.blocked.append((_where(node), reasons.UNSUPPORTED_PREFIX + f"onnx.{op} (in a subgraph)"))
            elif node.domain not in ("", "ai.onnx"):
                walk.blocked.append((_where(node), reasons.UNSUPPORTED_PREFIX + f"{node.domain}.{op}"))
            elif op in LAYER_OPS:
                found = _consumer(node, idx, ax, shapes, v)
                if isinstance(found, Layer):
                    walk.layers.append(found)
                else:
                    walk.blocked.append((_where(node), found))
            elif op in PASS:
                new_axis, reason = _pass(node, idx, ax, shapes, v)
                if new_axis is None:
                    walk.blocked.append((_where(node), reason or reasons.UNSUPPORTED_PREFIX + f"onnx.{op}"))
                else:
                    visit(node.outputs[0], new_axis)
            elif op in ("Add", "Sub", "Mul", "Div") and all(const(i) is None for i in node.inputs if i is not v):
                reason = reasons.RESIDUAL_READS_NORM if op in ("Add", "Sub") else reasons.MASKED_AFTER_NORM
                walk.blocked.append((_where(node), reason))
            else:
                walk.blocked.append((_where(node), BLOCK.get(op, reasons.UNSUPPORTED_PREFIX + f"onnx.{op}")))

    visit(value, axis)
    while pending := [key for key in joins if key not in decided]:
        ready = [k for k in pending if len(joins[k][1]) == len(joins[k][0].inputs)]
        key = (ready or pending)[0]
        decided.add(key)
        node, got = joins[key]
        new_axis, reason = _join(node, got, shapes)
        if new_axis is None:
            walk.blocked.append((_where(node), reason or reasons.UNSUPPORTED_PREFIX + "onnx.Concat"))
        else:
            visit(node.outputs[0], new_axis)
    return walk


def _join(node: ir.Node, got: dict[int, int], shapes: Shapes) -> tuple[int | None, str | None]:
    """A ``Concat`` whose inputs ``got`` (input index -> channel axis) carry the affine: it passes when every input
    carries it on the same axis and the concatenation runs along another axis (tokens: a split put back
    together); an input the norm did not produce (a class token) blocks with ``concat-with-unnormalized``, as
    ATen's ``cat`` (``slabconv.engine.flow._join``). Along the channel axis the channels would repeat (the ATen
    engine tiles the affine there; this engine does not): ``unsupported-op:onnx.Concat``."""
    if len(got) != len(node.inputs):
        return None, reasons.CONCAT_WITH_UNNORMALIZED
    axes = set(got.values())
    rank = _rank(shapes, node.outputs[0])
    if len(axes) != 1 or rank is None:
        return None, reasons.UNSUPPORTED_PREFIX + "onnx.Concat"
    axis = axes.pop()
    if int(attr(node, "axis", 0)) % rank == axis:
        return None, reasons.UNSUPPORTED_PREFIX + "onnx.Concat (along the channel axis)"
    return axis, None


def find_producer(value: ir.Value, axis: int, shapes: Shapes) -> tuple[Layer | None, str]:
    """The layer whose output channels become ``value``'s channel axis through view-like ops nothing else reads
    (for a backward fold), or ``(None, why not)``."""
    v, ax = value, axis
    for _ in range(64):
        node = v.producer()
        if node is None:
            return None, "the norm reads a graph input"
        op = node.op_type
        if op in ("Add",) and len(node.inputs) == 2:
            for i, other in enumerate(node.inputs):
                mm = other.producer() if other is not None else None
                bias = node.inputs[1 - i]
                if other is None or mm is None or mm.op_type != "MatMul" or _sole_reader(other) is not node:
                    continue
                layer, _ = _producer_layer(mm, ax, shapes, v)
                if layer is not None and bias is not None and _plain_bias(bias):
                    w, b = const(layer.weight), const(bias)
                    if w is not None and b is not None and b.shape == (w.shape[1],):
                        return Layer(mm, layer.weight, bias, node, v), ""
            return None, f"{_where(node)} is not a layer"
        if op in LAYER_OPS or op == "Gather":
            return _producer_layer(node, ax, shapes, v)
        if op in BACKWARD_PASS:
            src = node.inputs[0]
            if src is None or _sole_reader(src) is not node:
                return None, f"another node reads the input of {_where(node)}"
            if op == "Transpose":
                perm = attr(node, "perm")
                if perm is None:
                    return None, "a Transpose without perm"
                ax = list(perm)[ax]
            elif op == "Cast":
                reason = cast_passes(node, src, shapes)
                if reason is not None:
                    return None, f"{_where(node)}: {reason}"
            elif op not in ("Identity", "Dropout"):
                back = _view_axis(shapes, v, src, ax)
                if back is None:
                    return None, f"{_where(node)} mixes channels"
                ax = back
            v = src
            continue
        return None, f"{_where(node)} is not a layer"
    return None, "too deep"


def _producer_layer(node: ir.Node, axis: int, shapes: Shapes, out: ir.Value) -> tuple[Layer | None, str]:
    op = node.op_type
    rank = _rank(shapes, out)
    if op == "Gather":
        table, ids = node.inputs[0], node.inputs[1]
        array = const(table)
        if table is None or array is None or array.ndim != 2 or int(attr(node, "axis", 0)) != 0:
            return None, f"{_where(node)} is not an embedding lookup"
        if not table.is_initializer() or _shared(table) or rank is None or axis != rank - 1 or ids is None:
            return None, f"{_where(node)}: a shared table or another axis"
        return Layer(node, table, None, None, out), ""
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    w = const(weight)
    if weight is None or w is None or not weight.is_initializer() or _shared(weight):
        return None, f"{_where(node)} has no unshared constant weight"
    if _sole_reader(node.outputs[0]) is None and node.outputs[0] is not out:
        return None, f"another node reads the output of {_where(node)}"
    if op == "MatMul" and w.ndim == 2 and rank is not None and axis == rank - 1:
        return Layer(node, weight, None, None, out), ""
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None and not _plain_bias(bias):
        return None, f"{_where(node)} has a shared or broadcast bias"
    if op == "Gemm" and axis == 1 and not attr(node, "transA", 0) and float(attr(node, "alpha", 1.0)) == 1.0:
        if bias is None or float(attr(node, "beta", 1.0)) == 1.0:
            return Layer(node, weight, bias, None, out), ""
    if op == "Conv" and axis == 1:
        return Layer(node, weight, bias, None, out), ""
    return None, f"{_where(node)} does not produce the channel axis"
