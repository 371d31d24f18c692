"""The fold on an ONNX graph (``fold_graph``): decide each norm found by ``slabconv.engine.onnx_norms``, fold it
forward into its consumers or backward into its producer with ``slabconv.fold`` in float64, write every changed
initializer once, and remove the norm's nodes. Part of the ONNX engine (``slabconv.engine.onnx_graph``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.onnx_graph import (
    BLOCK,
    PASS,
    Layer,
    OnnxNorm,
    Shapes,
    _readers,
    _where,
    attr,
    const,
    find_producer,
    to_numpy,
    to_torch,
    walk_forward,
)
from slabconv.engine.onnx_norms import find_norms
from slabconv.engine.planner import FOLDED_BACKWARD, FOLDED_FORWARD, KEPT, Decision

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


def to_float64(model: Any) -> None:
    """Cast every floating tensor, value type and ``Cast``/``Constant`` target of an ``onnx_ir.Model`` to float64,
    in place (the float64 evaluation of question 1). Integer tensors (ids, shapes) stay as they are."""
    import onnx_ir as ir

    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    graph = model.graph

    def cast_tensor(tensor: Any) -> Any:
        if tensor is None or tensor.dtype not in floats:
            return None
        return ir.tensor(np.asarray(tensor.numpy(), dtype=np.float64), name=tensor.name)

    values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
    for node in graph.all_nodes():
        values += list(node.outputs)
        for name, attribute in list(node.attributes.items()):
            if attribute.type == ir.AttributeType.TENSOR:
                new = cast_tensor(attribute.value)
                if new is not None:
                    node.attributes[name] = ir.AttrTensor(name, new)
        if node.op_type == "Cast" and node.attributes.get("to") is not None:
            if ir.DataType(node.attributes["to"].value) in floats:
                node.attributes["to"] = ir.AttrInt64("to", ir.DataType.DOUBLE.value)
    for value in values:
        if value.const_value is not None:
            new = cast_tensor(value.const_value)
            if new is not None:
                value.const_value = new
        if value.dtype in floats:
            value.dtype = ir.DataType.DOUBLE


def fold_file(
    model: Any, proto_path: str, progress: Callable[[str], None] = lambda name: None, as_float64: bool = False
) -> tuple[Any, list[Decision]]:
    """Fold every norm of ``model`` (loaded from ``proto_path``, whose static shapes ONNX shape inference gives), in
    place; with ``as_float64`` the graph is cast to float64 first (question 1's float64 fold).

    Returns:
        ``(model, decisions)``: the same model, fused, and one ``Decision`` per norm.
    """
    if as_float64:
        to_float64(model)
    return model, fold_graph(model, infer_shapes(proto_path), progress)
