"""Norms in an ONNX graph, found by value (``find_norms``): ``BatchNormalization`` in inference mode, RepBN as
``BN(x) + alpha * x``, and chains of ``Add``/``Sub``/``Mul``/``Div`` by per-axis constants (the decomposed BatchNorm,
LayerScale, ``x * a + b``). Part of the ONNX engine (``slabconv.engine.onnx_graph`` has its tables and walks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from slabconv import fold
from slabconv.engine.onnx_graph import LAYER_OPS, OnnxNorm, Shapes, _rank, _sole_reader, attr, const

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
