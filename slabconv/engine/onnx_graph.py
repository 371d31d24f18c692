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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from slabconv import fold
from slabconv.engine import reasons, rules
from slabconv.engine.planner import FOLDED_BACKWARD, FOLDED_FORWARD, KEPT, Decision


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
        return tensor.to(torch.bfloat16).view(torch.uint16).numpy().view(like.dtype).reshape(like.shape)
    if tensor.is_floating_point() and like.dtype.kind == "f":  # round as torch does (question 1 rounds with torch)
        tensor = tensor.to(torch.from_numpy(np.empty(0, dtype=like.dtype)).dtype)
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


# --------------------------------------------------------------------------------------------- norms


def _param_prefix(values: Iterable[ir.Value | None], fallback: str) -> str:
    """``blocks.0.norm1.norm2.bn`` from ``blocks.0.norm1.norm2.bn.weight``: the report's name for a norm."""
    for value in values:
        if value is not None and value.name and "." in value.name and not value.name.startswith(("onnx::", "val_")):
            return value.name.rsplit(".", 1)[0]
    return fallback


def find_norms(graph: ir.Graph, shapes: Shapes) -> list[OnnxNorm]:
    """Every inference-mode ``BatchNormalization`` with constant statistics, extended to RepBN when its output is
    only added to ``alpha * x`` of the same input (``alpha`` a constant scalar), in graph order.

    A BatchNormalization whose statistics are not constants, or in training mode, is not a norm slabconv folds
    (its result depends on the batch); it is left alone and not reported.
    """
    norms = []
    for node in graph:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        if attr(node, "training_mode", 0) or len(node.outputs) > 1 and any(o.uses() for o in node.outputs[1:]):
            continue
        x = node.inputs[0]
        stats = [const(v) for v in node.inputs[1:5]]
        if x is None or any(s is None for s in stats):
            continue
        gamma, beta, mean, var = (torch.from_numpy(np.asarray(s, dtype=np.float64)) for s in stats)
        eps = float(attr(node, "epsilon", 1e-5))
        scale, shift = fold.repbn_affine(mean, var, eps, gamma, beta)
        params = [v for v in node.inputs[1:5] if v is not None]
        nodes, out, kind = [node], node.outputs[0], "BatchNorm"
        alpha = _repbn_alpha(node, x)
        if alpha is not None:
            mul, add, eta, alpha_value = alpha
            scale = scale + eta
            nodes, out, kind = [node, mul, add], add.outputs[0], "RepBN"
            params.append(alpha_value)
        name = _param_prefix([params[-1]] if kind == "RepBN" else params, node.name or "BatchNormalization")
        norms.append(OnnxNorm(name, kind, nodes, x, out, 1, scale, shift, params))
    claimed = {id(n) for norm in norms for n in norm.nodes}
    norms += _affine_chains(graph, shapes, claimed)
    order = {id(n): i for i, n in enumerate(graph)}
    return sorted(norms, key=lambda norm: order[id(norm.nodes[0])])


_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")
_CONST_OPS: dict[str, Callable[..., Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Identity": lambda a: a,
}
"""Ops whose constant-only results ``_const_eval`` computes (the statistics arithmetic of a decomposed BN)."""


def _const_eval(value: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """The value of ``value`` when it is a constant or elementwise arithmetic over constants (``sqrt(var + eps)``),
    in float64; else None."""
    found = const(value)
    if found is not None or value is None or depth > 8:
        return None if found is None else np.asarray(found, dtype=np.float64)
    node = value.producer()
    if node is None or node.op_type not in _CONST_OPS or node.domain not in ("", "ai.onnx"):
        return None
    args = [_const_eval(v, depth + 1) for v in node.inputs]
    if not args or any(a is None for a in args):
        return None
    with np.errstate(all="ignore"):
        return np.asarray(_CONST_OPS[node.op_type](*args), dtype=np.float64)


def _per_channel(array: np.ndarray, rank: int) -> tuple[int, int] | None:
    """``(axis, length)`` when ``array`` broadcast against a rank-``rank`` tensor varies along one axis only
    (``(C,)``, ``(1, C, 1)``...); ``(-1, 1)`` for a scalar; None otherwise."""
    if array.ndim > rank:
        return None
    shape = (1,) * (rank - array.ndim) + tuple(array.shape)
    varying = [i for i, d in enumerate(shape) if d != 1]
    if not varying:
        return -1, 1
    return (varying[0], shape[varying[0]]) if len(varying) == 1 else None


def _affine_step(node: ir.Node, x: ir.Value, shapes: Shapes) -> tuple[np.ndarray, int, int] | None:
    """``(constant, axis, length)`` when ``node`` is ``x`` combined elementwise with a per-axis constant (``x`` the
    left operand of ``Sub`` / ``Div``), else None."""
    if node.op_type not in _ELEMENTWISE or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is x and b is not x:
        other = b
    elif b is x and a is not x and node.op_type in ("Add", "Mul"):
        other = a
    else:
        return None
    value, rank = _const_eval(other), _rank(shapes, x)
    out_rank = _rank(shapes, node.outputs[0])
    if value is None or rank is None or out_rank != rank or not np.isfinite(value).all():
        return None
    found = _per_channel(value, rank)
    if found is None or (node.op_type == "Div" and not value.all()):
        return None
    return value, found[0], found[1]


def _affine_chains(graph: ir.Graph, shapes: Shapes, claimed: set[int]) -> list[OnnxNorm]:
    """Every chain of ``Add`` / ``Sub`` / ``Mul`` / ``Div`` by per-axis constants (the decomposed BatchNorm
    ``(x - mean) / sqrt(var + eps) * gamma + beta`` exporters emit, LayerScale ``gamma * x``, ``x * a + b``), as one
    affine ``s * x + t`` on that axis.

    A chain scales by at least one constant that varies along the axis (scalar arithmetic, such as GELU's or the
    attention scale, and a shift alone, such as a positional or attention bias, are not norms), does not start
    with a bias ``Add`` right after a layer (that is the layer's own bias), and each of its intermediate tensors
    has no other reader.
    """
    norms = []
    for node in graph:
        if id(node) in claimed or not node.inputs:
            continue
        x = next((v for v in node.inputs if v is not None and _const_eval(v) is None), None)
        if x is None or _affine_step(node, x, shapes) is None:
            continue
        producer = x.producer()
        if node.op_type in ("Add", "Sub") and producer is not None and producer.op_type in LAYER_OPS:
            continue
        chain, current, axis = [], x, -1
        scale: np.ndarray | None = None
        shift: np.ndarray | None = None
        step_node: ir.Node | None = node
        while step_node is not None and id(step_node) not in claimed:
            step = _affine_step(step_node, current, shapes)
            if step is None or (axis >= 0 and step[1] >= 0 and step[1] != axis):
                break
            value, ax, length = step
            if ax >= 0:
                axis = ax
            flat = value.reshape(-1) if length > 1 else value.reshape(())
            scale = np.ones(()) if scale is None else scale
            shift = np.zeros(()) if shift is None else shift
            op = step_node.op_type
            if op == "Add":
                shift = shift + flat
            elif op == "Sub":
                shift = shift - flat
            elif op == "Mul":
                scale, shift = scale * flat, shift * flat
            else:
                scale, shift = scale / flat, shift / flat
            chain.append(step_node)
            current = step_node.outputs[0]
            step_node = _sole_reader(current)
        if axis < 0 or scale is None or shift is None or np.size(scale) == 1:
            continue  # a shift alone (a positional or attention bias) or scalar scaling is not a norm
        channels = shapes.get(x.name or "", ())[axis] if axis < len(shapes.get(x.name or "", ())) else None
        size = max(np.size(scale), np.size(shift))
        if not isinstance(channels, int) or size not in (1, channels):
            continue
        s = torch.from_numpy(np.broadcast_to(scale, (channels,)).astype(np.float64).copy())
        t = torch.from_numpy(np.broadcast_to(shift, (channels,)).astype(np.float64).copy())
        claimed.update(id(n) for n in chain)
        params = [v for n in chain for v in n.inputs if v is not None and v is not x and _const_eval(v) is not None]
        kind = "LayerScale" if [n.op_type for n in chain] == ["Mul"] else "Affine"
        name = _param_prefix(params, chain[0].name or chain[0].op_type)
        norms.append(OnnxNorm(name, kind, chain, x, current, axis, s, t, [p for p in params if p.producer() is None]))
    return norms


def _repbn_alpha(bn: ir.Node, x: ir.Value) -> tuple[ir.Node, ir.Node, float, ir.Value] | None:
    """``(Mul, Add, alpha, alpha value)`` when ``bn``'s output is only read by ``Add(bn, Mul(alpha, x))``."""
    add = _sole_reader(bn.outputs[0])
    if add is None or add.op_type != "Add":
        return None
    other = add.inputs[1] if add.inputs[0] is bn.outputs[0] else add.inputs[0]
    mul = other.producer() if other is not None else None
    if mul is None or mul.op_type != "Mul" or _sole_reader(mul.outputs[0]) is not add:
        return None
    a, b = mul.inputs
    alpha_value = b if a is x else a if b is x else None
    alpha = const(alpha_value)
    if alpha_value is None or alpha is None or alpha.size != 1:
        return None
    return mul, add, float(alpha.reshape(())), alpha_value


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


# --------------------------------------------------------------------------------------------- the fold


class _Writes:
    """The new values of initializers, staged so that a refused fold (dtype overflow) changes nothing.

    Values are float64 torch tensors: ``shadow`` (shared by every norm of the graph, keyed by ``id`` of the
    ``ir.Value``) holds each initializer that an earlier fold changed, unrounded, so a layer that absorbs several
    norms gets their composition in float64 rounded once to its dtype (issue 22), as question 1's float64 fold.
    """

    def __init__(self, shadow: dict[int, tuple[ir.Value, torch.Tensor]] | None = None) -> None:
        self.shadow = {} if shadow is None else shadow
        self.values: dict[int, tuple[ir.Value, torch.Tensor, np.ndarray]] = {}  # value, float64, dtype template
        self.new_biases: list[tuple[Layer, torch.Tensor, np.ndarray]] = []

    def like(self, value: ir.Value) -> np.ndarray:
        """The stored array of ``value`` (its dtype and shape are what a new value is rounded to)."""
        return const(value)  # type: ignore[return-value]

    def get(self, value: ir.Value) -> torch.Tensor:
        """``value`` in float64: staged, else its shadow, else the stored array promoted (exactly)."""
        staged = self.values.get(id(value))
        if staged is not None:
            return staged[1]
        shadowed = self.shadow.get(id(value))
        if shadowed is not None and shadowed[0] is value:
            return shadowed[1]
        return to_torch(self.like(value)).to(torch.float64)

    def set(self, value: ir.Value, tensor: torch.Tensor) -> None:
        staged = self.values.get(id(value))
        self.values[id(value)] = (value, tensor, staged[2] if staged is not None else self.like(value))

    def rounded(self) -> list[np.ndarray]:
        return [to_numpy(t, like) for _, t, like in self.values.values()] + [
            to_numpy(t, like) for _, t, like in self.new_biases
        ]

    def finite(self) -> bool:
        """True when every staged value is finite once rounded to its dtype."""
        return all(bool(np.isfinite(np.asarray(a, dtype=np.float64)).all()) for a in self.rounded())


def _bias_like(w: np.ndarray, size: int) -> np.ndarray:
    return np.zeros((size,), dtype=w.dtype)


def _fold_forward(layer: Layer, scale: torch.Tensor, shift: torch.Tensor, writes: _Writes) -> None:
    """``W diag(s)``, ``b + W t`` on the layer's input channels (``fold_into_linear`` / ``fold_into_conv``), in
    float64."""
    op, w = layer.node.op_type, writes.get(layer.weight)
    b = writes.get(layer.bias) if layer.bias is not None else None
    if op == "Conv":
        groups = int(attr(layer.node, "group", 1))
        new_w, new_b = fold.fold_into_conv(w, b, scale, shift, groups)
        writes.set(layer.weight, new_w)
    else:
        transposed = op == "MatMul" or not attr(layer.node, "transB", 0)  # stored (in, out)
        new_w, new_b = fold.fold_into_linear(w.T if transposed else w, b, scale, shift)
        writes.set(layer.weight, new_w.T if transposed else new_w)
    _store_bias(layer, new_b, writes)


def _fold_backward(layer: Layer, scale: torch.Tensor, shift: torch.Tensor, writes: _Writes) -> None:
    """``diag(s) W``, ``s b + t`` on the layer's output channels (``fold_into_producer`` / ``fold_into_embedding``),
    in float64."""
    op, w = layer.node.op_type, writes.get(layer.weight)
    if op == "Gather":
        writes.set(layer.weight, fold.fold_into_embedding(w, scale, shift))
        return
    b = writes.get(layer.bias) if layer.bias is not None else None
    transposed = op == "MatMul" or (op == "Gemm" and not attr(layer.node, "transB", 0))
    new_w, new_b = fold.fold_into_producer(w.T if transposed else w, b, scale, shift)
    writes.set(layer.weight, new_w.T if transposed else new_w)
    _store_bias(layer, new_b, writes)


def _store_bias(layer: Layer, new_b: torch.Tensor, writes: _Writes) -> None:
    if layer.bias is not None:
        writes.set(layer.bias, new_b)
    else:
        writes.new_biases.append((layer, new_b, _bias_like(writes.like(layer.weight), new_b.numel())))


def _commit(writes: _Writes, graph: ir.Graph) -> dict[int, ir.Value]:
    """Store the staged values and create the biases (an ``Add`` after a MatMul, a third input of Gemm / Conv).

    Returns:
        For each MatMul that got a bias ``Add``, ``id(its output) -> the Add's output`` (what now carries it).
    """
    moved: dict[int, ir.Value] = {}
    for value, value64, like in writes.values.values():
        value.const_value = ir.tensor(to_numpy(value64, like), name=value.name)
        writes.shadow[id(value)] = (value, value64)
    for layer, bias64, like in writes.new_biases:
        array = to_numpy(bias64, like)
        base = layer.node.name or layer.weight.name or "layer"
        name = _unique(graph, f"{base}.folded_bias")
        tensor = ir.tensor(array, name=name)
        bias = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(bias)
        writes.shadow[id(bias)] = (bias, bias64)
        if layer.node.op_type in ("Gemm", "Conv"):
            layer.node.resize_inputs(3)
            layer.node.replace_input_with(2, bias)
            if layer.node.op_type == "Gemm":  # beta scales C; without a C it did nothing, with ours it must be 1
                layer.node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
            layer.bias = bias
            continue
        out = layer.node.outputs[0]
        add_out = ir.Value(name=_unique(graph, f"{out.name}_biased"), shape=out.shape, type=out.type)
        out.replace_all_uses_with(add_out, replace_graph_outputs=True)
        if add_out.is_graph_output():
            add_out.name, out.name = out.name, add_out.name  # graph outputs keep their names
        add = ir.Node("", "Add", [out, bias], outputs=[add_out], name=_unique_node(graph, f"{base}/folded_bias_add"))
        graph.insert_after(layer.node, add)
        layer.bias, layer.bias_add, layer.out = bias, add, add_out
        moved[id(out)] = add_out
    return moved


def _unique(graph: ir.Graph, name: str) -> str:
    taken = set(graph.initializers) | {v.name for n in graph for v in n.outputs}
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}.{i}", i + 1
    return candidate


def _unique_node(graph: ir.Graph, name: str) -> str:
    taken = {n.name for n in graph}
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def _remove(norm: OnnxNorm, graph: ir.Graph, shapes: Shapes) -> None:
    """Replace the norm's output by its input, drop its nodes and the constants nothing reads any more, cancel the
    layout pair it leaves behind (``Transpose(p)`` then ``Transpose(p^-1)``; a reshape then a reshape back to the
    shape it started from, as ``x.view(-1, C)`` ... ``.view(B, T, C)``), and drop the shape computations that fed
    only the cancelled pair."""
    if norm.output.is_graph_output():  # folded backward: the graph output keeps its name, now on the norm's input
        name = norm.output.name
        norm.output.name = f"{name}.removed_norm"
        norm.output.replace_all_uses_with(norm.input, replace_graph_outputs=True)
        norm.input.name = name
        norm.input.type, norm.input.shape = norm.output.type, norm.output.shape  # a norm keeps both
    else:
        norm.output.replace_all_uses_with(norm.input)
    freed = [v for node in norm.nodes for v in node.inputs if v is not None]  # read before removal detaches them
    graph.remove(list(reversed(norm.nodes)), safe=True)
    first = norm.input.producer()
    source = first.inputs[0] if first is not None and first.inputs else None
    if first is not None and source is not None and not norm.input.is_graph_output():
        for use in list(norm.input.uses()):
            second = use.node
            if use.idx == 0 and not second.outputs[0].is_graph_output() and _undoes(first, second, source, shapes):
                second.outputs[0].replace_all_uses_with(source)
                freed += [v for v in second.inputs if v is not None]
                graph.remove(second, safe=True)
        if not norm.input.uses():
            freed += [v for v in first.inputs if v is not None]
            graph.remove(first, safe=True)
    _drop_dead(freed, graph)


def _undoes(first: ir.Node, second: ir.Node, source: ir.Value, shapes: Shapes) -> bool:
    """``second`` applied to ``first``'s output gives back ``source`` exactly."""
    if first.op_type == "Transpose" and second.op_type == "Transpose":
        perm, other = attr(first, "perm"), attr(second, "perm")
        return perm is not None and other is not None and [list(perm)[i] for i in other] == list(range(len(perm)))
    views = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
    if first.op_type in views and second.op_type in views:
        back, start = shapes.get(second.outputs[0].name or ""), shapes.get(source.name or "")
        return back is not None and back == start and all(d is not None for d in back)
    return False


def _drop_dead(values: list[ir.Value], graph: ir.Graph) -> None:
    """Remove the nodes and initializers that computed ``values`` when nothing reads them any more (the norm's
    parameters, the shape arithmetic of a cancelled reshape pair), and so on upwards."""
    stack = list(values)
    while stack:
        value = stack.pop()
        if value.graph is None and value.producer() is None and not value.is_initializer():
            continue
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        if value.is_initializer():
            if value.name and value.name in graph.initializers:
                graph.initializers.pop(value.name)
            continue
        node = value.producer()
        if node is None or node.graph is not graph or any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        stack += inputs


def fold_graph(model: ir.Model, shapes: Shapes, progress: Callable[[str], None] = lambda name: None) -> list[Decision]:
    """Fold every norm of ``model`` (in place, in graph order; each on the graph as the earlier folds left it).

    For each norm: ``folded-forward`` when every path from its output ends at a layer that contracts the channel
    axis; else ``folded-backward`` when its input comes from a layer nothing else reads; else ``kept`` (its nodes
    untouched) with the first blocked path's reason. A fold whose weights would not be finite in their dtype is
    refused (``dtype-overflow``).

    Args:
        model: the graph (``onnx_ir``), changed in place.
        shapes: static shapes by value name (ONNX shape inference on the unchanged model).
        progress: called with each norm's name once decided.

    Returns:
        One ``Decision`` per norm, in graph order.
    """
    graph = model.graph
    decisions = []
    shadow: dict[int, tuple[ir.Value, torch.Tensor]] = {}  # initializers already folded, in float64
    for norm in find_norms(graph, shapes):
        decisions.append(_decide(norm, graph, shapes, shadow))
        progress(norm.name)
    return decisions


def _decide(
    norm: OnnxNorm, graph: ir.Graph, shapes: Shapes, shadow: dict[int, tuple[ir.Value, torch.Tensor]]
) -> Decision:
    walk = walk_forward(norm.output, norm.axis, shapes)
    paths = [{"before": where, "reason": why} for where, why in walk.blocked]
    writes = _Writes(shadow)
    if not walk.blocked and walk.layers:
        for layer in walk.layers:
            _fold_forward(layer, norm.scale, norm.shift, writes)
        action, into = FOLDED_FORWARD, walk.layers
    else:
        producer, why = find_producer(norm.input, norm.axis, shapes)
        others = [node for node, _ in _readers(norm.input) if all(node is not n for n in norm.nodes)]
        if others or norm.input.is_graph_output():  # a backward fold would change what they read
            producer, why = None, f"{_where(others[0] if others else None)} also reads the norm's input"
        if producer is None:
            reason = walk.blocked[0][1] if walk.blocked else reasons.FEEDS_OUTPUT
            return Decision(norm.name, norm.kind, KEPT, reason=reason, paths=paths, no_backward=why)
        _fold_backward(producer, norm.scale, norm.shift, writes)
        action, into = FOLDED_BACKWARD, [producer]
    if not writes.finite():
        return Decision(norm.name, norm.kind, KEPT, reason=reasons.DTYPE_OVERFLOW, paths=paths)
    moved = _commit(writes, graph)
    norm.input = moved.get(id(norm.input), norm.input)  # a backward fold's new bias Add now feeds the norm
    _remove(norm, graph, shapes)
    return Decision(norm.name, norm.kind, action, into=[layer.node.name or layer.node.op_type for layer in into])


def infer_shapes(proto_path: str) -> Shapes:
    """Static shapes of every value ONNX shape inference can type, read from the file without its external data.

    Source: ``onnx.shape_inference.infer_shapes`` (with data propagation, so ``Reshape`` targets built from
    ``Shape`` ops resolve where they are static).
    """
    import onnx

    proto = onnx.load(proto_path, load_external_data=False)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help: values it cannot type block the walks that need them
        pass
    shapes = Shapes()
    for info in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]:
        tensor = info.type.tensor_type
        if tensor.elem_type:
            shapes.dtypes[info.name] = int(tensor.elem_type)
        if tensor.HasField("shape"):
            shapes[info.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
            )
    for init in proto.graph.initializer:
        shapes[init.name] = tuple(int(d) for d in init.dims)
        shapes.dtypes[init.name] = int(init.data_type)
    return shapes


__all__ = ["BLOCK", "PASS", "OnnxNorm", "find_norms", "fold_graph", "infer_shapes", "walk_forward"]
