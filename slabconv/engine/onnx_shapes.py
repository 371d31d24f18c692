"""Shapes of an ONNX graph for the engine: symbolic shape inference, and sizes and fake tensors the rules read.

``infer_shapes`` runs two inferences on the file (onnxruntime's ``SymbolicShapeInference`` and ONNX's own) and merges
what they find dim by dim; ``merge_shapes`` writes it onto the values of an ``onnx_ir`` graph. ``Dims`` turns each
value's type and shape into the fake tensor an fx node of ``slabconv.engine.onnx_lower`` carries in ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import onnx_ir as ir
import torch

from slabconv.engine.reasons import FED_DEFAULT


def infer_shapes(model: ir.Model, proto_path: str | None = None) -> dict[str, tuple[int, tuple[Any, ...] | None]]:
    """Value name -> ``(ONNX element type, dims)`` from two shape inferences, merged dim by dim: onnxruntime's
    ``SymbolicShapeInference`` (it carries symbolic sizes through ``Shape`` -> ``Gather`` -> ``Concat`` -> ``Reshape``,
    as dynamo and TorchScript exports with a dynamic batch write them) and ONNX's ``infer_shapes`` with data
    propagation (it knows some ops the first one leaves unknown, such as a ``Flatten`` of symbolic sizes). A static
    size wins over a symbolic one, a symbolic one over an unknown one (onnxruntime names its unknowns ``unk__N`` or
    ``<Op>_N_o0__dK``: those count as unknown). Dims are ints, ``dim_param`` strings or None; empty when both fail
    (the values keep what the file declares).

    Initializers stored outside the file are given to inference as graph inputs of their type and shape: inference
    needs no weights, only the small constants that shapes are computed from.
    """
    import onnx

    proto = _fused_convs_as_convs(_shape_proto(model, proto_path))
    found: dict[str, tuple[int, tuple[Any, ...] | None]] = {}
    for infer in (_infer_symbolic, _infer_onnx):
        try:
            inferred = infer(proto)
        except Exception:  # noqa: BLE001 - inference is a help: what it cannot type stays unknown
            continue
        for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if not info.type.HasField("tensor_type") or not info.type.tensor_type.elem_type:
                continue
            tensor = info.type.tensor_type
            dims = None
            if tensor.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else _known(d.dim_param) for d in tensor.shape.dim)
            found[info.name] = (int(tensor.elem_type), _better(found.get(info.name, (0, None))[1], dims))
    del onnx
    return found


def _infer_symbolic(proto: Any) -> Any:
    """onnxruntime's symbolic shape inference of ``proto``, driven as ``SymbolicShapeInference.infer_shapes`` drives
    it (``_preprocess``, ``_infer_impl`` until it stops asking for another pass, ``_update_output_from_vi``) but
    without its last step: where it cannot type every value, ``infer_shapes`` saves its partial result as
    ``sym_shape_infer_temp.onnx`` (and the tensors' external data files) in the current working directory before it
    raises, which would write into (or replace files in) the user's folder, and any way around that (a ``chdir``)
    changes the whole process's working directory under every other thread. Here nothing is written: an incomplete
    inference raises, as ``infer_shapes`` does, and ``infer_shapes`` (ours) falls back to ONNX's inference.

    Relies on those three members of ``onnxruntime.tools.symbolic_shape_infer.SymbolicShapeInference`` (the same
    from onnxruntime 1.18, the floor, to 1.32); where a release lacks one, the ``AttributeError`` is caught like any
    failed inference.

    Raises:
        RuntimeError: the inference left some value untyped.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_opset

    opset = get_opset(proto)
    if not opset or opset < 7:
        raise RuntimeError("symbolic shape inference needs opset 7 or above")
    proto = _named_loop_inputs(proto)
    inference = SymbolicShapeInference(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess_output_rank, verbose
    complete = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference._preprocess(proto)
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
    if not complete:
        raise RuntimeError("incomplete symbolic shape inference")
    return inference.out_mp_


def _named_loop_inputs(proto: Any) -> Any:
    """``proto``, or a copy of it where each ``Loop`` (in any graph) that omits its optional trip count or initial
    condition (the input name is "", as the spec allows) reads a graph input of that input's type (an int64 or a bool
    scalar) instead. onnxruntime's ``SymbolicShapeInference`` types a ``Loop`` body's inputs from the node's and
    raises ``KeyError: ''`` on an omitted one, so every value after such a ``Loop`` would stay untyped (ONNX's own
    inference gives its loop-carried outputs a type but no shape). The input only types the body's iteration count
    and condition: the shapes inferred for the loop-carried values come from the body and are those of any trip count
    and condition (a dim the body changes becomes a symbol of its own). The copy is for shape inference only."""
    import onnx

    def loops(graph: Any) -> list[Any]:
        return [n for n in _all_nodes(graph) if n.op_type == "Loop" and n.domain in ("", "ai.onnx")]

    if not any("" in list(node.input[:2]) for node in loops(proto.graph)):
        return proto
    proto = copy.deepcopy(proto)
    taken = {name for node in _all_nodes(proto.graph) for name in [*node.input, *node.output]}
    taken |= {v.name for v in [*proto.graph.input, *proto.graph.initializer]}
    named = []
    for stem, elem in [("trip_count", onnx.TensorProto.INT64), ("cond", onnx.TensorProto.BOOL)]:
        name = f"slabconv.loop.{stem}"
        while name in taken:
            name += "_"
        named.append(name)
        proto.graph.input.append(onnx.helper.make_tensor_value_info(name, elem, []))
    for node in loops(proto.graph):
        for i in range(min(2, len(node.input))):
            if not node.input[i]:
                node.input[i] = named[i]
    return proto


def _all_nodes(graph: Any) -> Iterable[Any]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from _all_nodes(sub)


def _infer_onnx(proto: Any) -> Any:
    """ONNX's inference with data propagation, and the output of each onnxruntime ``FusedMatMul`` typed from its
    inputs (no inference knows that op: its optimizer's extended level writes it, and everything after it stayed
    unknown), again until no more are typed."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    fused = [n for n in proto.graph.node if (n.domain, n.op_type) == ("com.microsoft", "FusedMatMul")]
    while fused:
        known = {v.name: v.type.tensor_type for v in [*inferred.graph.input, *inferred.graph.value_info]}
        known.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, t.dims).tensor_type
                      for t in inferred.graph.initializer})  # fmt: skip
        typed = [v for v in map(lambda n: _fused_matmul_type(n, known), fused) if v is not None]
        if not typed:
            return inferred
        fused = [n for n in fused if n.output[0] not in {v.name for v in typed}]
        proto = copy.deepcopy(proto)
        proto.graph.value_info.extend(typed)
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    return inferred


def _fused_convs_as_convs(proto: Any) -> Any:
    """``proto`` (a copy for shape inference only) with each onnxruntime ``com.microsoft`` ``FusedConv`` written as
    the ``Conv`` it starts with (its activation keeps the conv's shape; neither inference knows the op, so every value
    after one stayed untyped): the activation's attributes and the ``Z`` input dropped."""
    for node in _all_nodes(proto.graph):
        if (node.domain, node.op_type) != ("com.microsoft", "FusedConv"):
            continue
        node.domain, node.op_type = "", "Conv"
        del node.input[3:]
        kept = [a for a in node.attribute if a.name not in ("activation", "activation_params")]
        del node.attribute[:]
        node.attribute.extend(kept)
    return proto


def _fused_matmul_type(node: Any, known: dict[str, Any]) -> Any:
    """The output's value info of a ``FusedMatMul`` (``alpha A' B'``, ``'`` the last two axes swapped with
    ``transA`` / ``transB``) of a typed A and a B of no more axes (A's batch axes), batch transposes off; None
    otherwise."""
    import onnx

    a, b = (known.get(name) for name in node.input[:2])
    attrs = {attr.name: attr.i for attr in node.attribute if attr.type == onnx.AttributeProto.INT}
    if a is None or b is None or not 2 <= len(b.shape.dim) <= len(a.shape.dim) or node.output[0] in known:
        return None
    if attrs.get("transBatchA") or attrs.get("transBatchB"):
        return None
    dims = list(a.shape.dim)
    if attrs.get("transA"):
        dims[-2], dims[-1] = dims[-1], dims[-2]
    dims[-1] = b.shape.dim[-2 if attrs.get("transB") else -1]
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
    return onnx.helper.make_tensor_value_info(node.output[0], a.elem_type, shape)


_PLACEHOLDER = re.compile(r"(unk__\d+|.*_o\d+__d\d+)")


def _known(param: str) -> str | None:
    """A ``dim_param``, or None for an inference's name for an unknown size."""
    return None if not param or _PLACEHOLDER.fullmatch(param) else param


def _better(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """Dim by dim, the more informative of two inferred shapes of one value (int > symbol > unknown)."""
    if a is None or b is None or len(a) != len(b):
        return b if b is not None else a

    def rank(d: Any) -> int:
        return 2 if isinstance(d, int) and d > 0 else 1 if isinstance(d, str) else 0

    return tuple(x if rank(x) >= rank(y) else y for x, y in zip(a, b, strict=True))


SMALL_CONSTANT = 4096
"""Elements above which an initializer is given to shape inference as a typed graph input, not as data: shapes are
computed from small constants only, and the weights are not copied."""


def _shape_proto(model: ir.Model, proto_path: str | None) -> Any:
    """The model as a ``ModelProto`` for shape inference, its large initializers (``SMALL_CONSTANT``) as graph inputs
    of their type and shape: read from ``proto_path`` without external data and without the shapes the file
    declares for intermediate values (``value_info``), or serialised from ``model`` (whose large initializers are set
    aside meanwhile, so their data is not copied).

    An initializer that is also a graph input (IR 4 on: a default the caller may feed, ``FED_DEFAULT``) is given as
    that input alone, whatever its size: a shape computed from its default (a ``Reshape`` reading it) holds only
    until the caller feeds another value, so inference must leave what depends on it unknown."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    if proto_path is not None:
        proto = onnx.load(proto_path, load_external_data=False)
        del proto.graph.value_info[:]  # declared, not inferred: a stale one would stand (``prepare`` sets them aside)
        fed_names = {v.name for v in model.graph.inputs if v.meta.get(FED_DEFAULT)}
        for tensor in [t for t in proto.graph.initializer if t.name in fed_names]:
            proto.graph.initializer.remove(tensor)
        big = [t for t in proto.graph.initializer if uses_external_data(t) or math.prod(t.dims) > SMALL_CONSTANT]
        for tensor in big:
            info = onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
            proto.graph.input.append(info)
            proto.graph.initializer.remove(tensor)
        return proto
    graph = model.graph
    fed = [v for v in graph.initializers.values() if v.meta.get(FED_DEFAULT)]
    aside = [
        v
        for v in graph.initializers.values()
        if not v.meta.get(FED_DEFAULT) and v.shape is not None and known_elements(v.shape) > SMALL_CONSTANT
    ]
    for value in [*fed, *aside]:
        graph.initializers.pop(value.name or "")
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        for value in [*fed, *aside]:
            graph.register_initializer(value)
    for value in aside:
        dtype = value.dtype.value if value.dtype is not None else 0
        dims = [d if isinstance(d, int) else None for d in value.shape or ()]
        proto.graph.input.append(onnx.helper.make_tensor_value_info(value.name or "", dtype, dims))
    return proto


def merge_shapes(model: ir.Model, found: dict[str, tuple[int, tuple[Any, ...] | None]]) -> None:
    """Give each value of the main graph the inferred type and shape where the file declares none (or less)."""
    g = model.graph
    for value in (*g.inputs, *g.initializers.values(), *(v for node in g for v in node.outputs)):
        info = found.get(value.name or "")
        if info is None:
            continue
        elem, dims = info
        if value.dtype is None and elem:
            with contextlib.suppress(ValueError):
                value.dtype = ir.DataType(elem)
        if dims is not None and (value.shape is None or unknowns(value.shape) > unknowns(dims)):
            value.shape = ir.Shape(list(dims))


def unknowns(dims: Iterable[Any]) -> int:
    return sum(1 for d in dims if not isinstance(d, int))


def known_elements(dims: Iterable[Any]) -> int:
    """The product of the known sizes of ``dims`` (an unknown one counts as 1)."""
    return math.prod(d for d in dims if isinstance(d, int))


class Dims:
    """Symbolic sizes as the engine's rules read them (``SymInt``s of a ``ShapeEnv``): each distinct ``dim_param``
    (``batch``, ``2*batch``) becomes one symbol, an unknown dim a fresh symbol of its own, so that nothing unknown
    looks static and two sizes are equal only when inference wrote the same name. A ``dim_param`` is a name, never
    parsed: it comes from the file."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)
        self.symbols: dict[str, torch.SymInt] = {}
        self.made: dict[tuple[Any, ...], torch.Tensor] = {}  # fake tensors are metadata: one per dtype and shape

    def size(self, dim: Any) -> int | torch.SymInt:
        """An ONNX dim (an int, an ``ir.SymbolicDim``, a ``dim_param`` string or None) as a size."""
        if isinstance(dim, torch.SymInt) or (isinstance(dim, int) and dim >= 0):
            return dim
        name = dim.value if isinstance(dim, ir.SymbolicDim) else dim
        if not isinstance(name, str) or not name:
            return self.env.create_unbacked_symint()
        if name not in self.symbols:
            self.symbols[name] = self.env.create_unbacked_symint()
        return self.symbols[name]

    def fake(self, dtype: torch.dtype, shape: Sequence[Any]) -> torch.Tensor:
        sizes = [self.size(d) for d in shape]
        key = (dtype, *(str(s) for s in sizes))
        if key not in self.made:
            with self.mode:
                self.made[key] = torch.empty(sizes, dtype=dtype)
        return self.made[key]
