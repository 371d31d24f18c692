"""ONNX graphs in the engine's vocabulary: an ONNX model lowered into an fx graph of the ATen ops that
``torch.export`` writes, so an ONNX original is found, planned and refused by the same code as a checkpoint
(``find_norms``, ``plan_folds``, the rule table ``RULES`` and the layer table ``LAYERS``).

In: an ``onnx_ir.Model`` (``slabconv.load.onnx_file.load_ir``). ``prepare`` gets it ready in place: unique names for
every node and value (onnx-ir's ``NameFixPass``; an unnamed node takes its first output's name), shapes from
symbolic shape inference (onnxruntime's ``SymbolicShapeInference``, else ONNX's own), and weights an exporter
computes from constants (``Transpose``, ``Reshape``, ``Cast`` of an initializer, ``Constant`` nodes) folded into
initializers by onnxscript's constant folding.
``lower`` then builds:

- one fx node per ONNX node output (``meta["onnx"]``: the node's name, ``meta["onnx_value"]``: the value's name,
  ``meta["val"]``: a fake tensor of the value's dtype and shape, symbolic dimensions as ``SymInt``s;
  ``meta["nn_module_stack"]``: the module path the exporter recorded, which names norms as for a checkpoint);
- a ``get_attr`` node per constant input: the initializer's array, viewed as the layer kind expects it (a ``MatMul``
  weight ``(in, out)`` is seen as ``(out, in)``, a ``(1, C, 1, 1)`` bias as ``(C,)``). ``Binding`` says where each
  target lives in the ONNX graph; a weight or bias shared with other nodes gets a target of its own per node (copy
  on write: a fold writes a new initializer for that node only).

The lowering table ``LOWER`` holds one entry per ONNX op: the ATen op and the arguments the rules read. ONNX spells a
Linear as ``MatMul`` + bias ``Add`` and Paddle a conv as ``Conv`` + bias ``Add``: such a pair is one ``aten.linear`` /
``aten.convolution`` node. An op without an entry, an op of another domain, an op with a subgraph or an op whose
outputs are not floating tensors becomes an opaque node whose op is named ``onnx.<Op>`` (``<domain>.<Op>``): the walks
stop there with ``unsupported-op:onnx.<Op>``, and it reads everything it reads in the ONNX graph (outer-scope values
of its subgraphs included). ``Shape`` and ``Size`` read a tensor's shape only (``aten.sym_size``).

The graph is for analysis only: it is never run (``slabconv.engine.onnx_apply`` carries a plan back into the ONNX
graph).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import keyword
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import to_torch_dtype
from torch import fx, nn

from slabconv.engine.capture import LIFTED, STATE
from slabconv.engine.flow import ROWS_ADDEND
from slabconv.engine.onnx_shapes import Dims, infer_shapes, known_elements, merge_shapes, unknowns
from slabconv.engine.reasons import FED_DEFAULT
from slabconv.load.onnx_file import node_label

aten = torch.ops.aten

ONNX_DOMAINS = ("", "ai.onnx")

FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8)
READ_DTYPES = FLOATS | {*_INTEGERS, ir.DataType.BOOL}
"""The ONNX element types the engine reads (as torch's dtypes: ``torch_dtype``); a value of any other type is
opaque."""


def torch_dtype(dtype: ir.DataType | None) -> torch.dtype | None:
    """The torch dtype of an ONNX element type of ``READ_DTYPES`` (onnx-ir's ``to_torch_dtype``), else None."""
    return to_torch_dtype(dtype) if dtype in READ_DTYPES else None


# --------------------------------------------------------------------------------------------- preparing the model


def prepare(model: ir.Model, proto_path: str | None = None) -> None:
    """Make ``model`` ready to lower, in place: every call of a model-local function (the TorchScript exporter's
    ``export_modules_as_functions``) replaced by the function's body (onnx-ir's ``InlinePass``), unique node and
    value names, external data read into memory, every
    ``Constant`` node's tensor an initializer (onnx-ir's ``LiftConstantsToInitializersPass``), shapes
    (symbolic where known) on every value inference can type, weights computed from constants folded into
    initializers, nodes nothing reads dropped, and shapes inferred once more on the folded graph (the shape arithmetic
    an exporter writes, folded, resolves sizes the first inference left unknown).

    Args:
        model: the graph as read (``slabconv.load.onnx_file.load_ir``).
        proto_path: the file it was read from; shape inference reads it without its external data.
    """
    from onnx_ir.passes.common import InlinePass, LiftConstantsToInitializersPass, RemoveUnusedFunctionsPass
    from onnx_ir.passes.common.naming import NameFixPass
    from onnx_ir.passes.common.unused_removal import RemoveUnusedNodesPass

    if model.ir_version >= 4:  # an initializer listed as a graph input is a default the caller may replace
        for value in model.graph.inputs:
            value.meta[FED_DEFAULT] = value.is_initializer()
    InlinePass()(model)  # a model-local function's call is its body: a norm inside one is a norm of the graph
    RemoveUnusedFunctionsPass()(model)
    NameFixPass(_Names())(model)
    ir.external_data.load_to_model(model)  # folded constants may be views of the data: never of a memory map
    LiftConstantsToInitializersPass(size_limit=1)(model)  # a Constant node's tensor is a weight a fold may write
    _read_shared_initializers(model)
    declared = _forget_declared_shapes(model)
    merge_shapes(model, infer_shapes(model, proto_path))
    for value, shape in declared:  # an annotation adds what inference left unknown, never contradicts it
        if value.shape is None or (_agree(value.shape, shape) and unknowns(shape) < unknowns(value.shape)):
            value.shape = shape
    # a default the caller may feed is no constant to fold with (onnxscript's op evaluators read its value)
    fed = {v: v.const_value for v in model.graph.inputs if v.meta.get(FED_DEFAULT)}
    for value in fed:
        value.const_value = None
    _static_sizes(model)
    _fold_constants(model)
    for value, tensor in fed.items():
        value.const_value = tensor
    RemoveUnusedNodesPass()(model)  # what the folder bypassed (a Cast it replaced by its input) reads nothing
    merge_shapes(model, infer_shapes(model))  # the folded shape arithmetic resolves what the file's could not


class _Names:
    """``NameFixPass``'s names: an unnamed node (``onnx.helper`` writes none) is named by its first output, as
    onnxruntime's messages and Netron show it: the name a user finds in the file."""

    def generate_node_name(self, node: ir.Node) -> str:
        return node_label(node)

    def generate_value_name(self, value: ir.Value) -> str:
        return value.name or "v"


def _read_shared_initializers(model: ir.Model) -> None:
    """Each ``Identity`` of an initializer in the main graph (the TorchScript exporter's copy of a parameter equal to
    another, ``l2.scale = Identity(l1.scale)``, after its deduplication of equal initializers) is dropped, its
    readers reading the initializer itself, as the dynamo exporter writes the same deduplication: the copy is the
    module's parameter, not a constant computed from one (which the folder would make it, and no fold reads). An
    ``Identity`` that gives a graph output stays."""
    outputs = {id(v) for v in model.graph.outputs}
    for node in list(model.graph):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        src, (out,) = node.inputs[0], node.outputs
        if src is None or not src.is_initializer() or id(out) in outputs:
            continue
        out.replace_all_uses_with(src)
        model.graph.remove(node, safe=True)


def _forget_declared_shapes(model: ir.Model) -> list[tuple[ir.Value, ir.Shape]]:
    """Take from each intermediate value of the main graph (a node's output that is not a graph output) the shape
    the file declares for it (its ``value_info``), and return them. A declaration is an annotation onnxruntime
    ignores, and may be stale (a hand-edited or merged file): taken over the shapes inference computes from the
    inputs and weights, a wrong channel count reached the engine (an internal error where a ``BatchNormalization``'s
    statistics did not match it), and a wrong size could mislead a rule. ``prepare`` gives a value back its
    declared shape where no inference types it, or where the declaration knows more sizes and contradicts none."""
    outputs = {id(v) for v in model.graph.outputs}
    declared = []
    for node in model.graph:
        for value in node.outputs:
            if value.shape is not None and id(value) not in outputs:
                declared.append((value, value.shape))
                value.shape = None
    return declared


def _agree(inferred: ir.Shape, declared: ir.Shape) -> bool:
    """The same rank, and no axis whose size both give as a number with two different numbers."""
    return len(inferred) == len(declared) and all(
        not (isinstance(a, int) and isinstance(b, int)) or a == b for a, b in zip(inferred, declared, strict=True)
    )


def _static_sizes(model: ir.Model) -> None:
    """Each ``Gather(Shape(x), i)`` with a scalar index ``i`` (the TorchScript exporter's ``x.size(i)``) whose size
    is static in the inferred shape of ``x`` becomes that size, a 0-D int64 initializer. onnxscript's folder turns a
    ``Shape`` of static sizes into a constant and gathers a 1-D index from a ``Shape`` (``_constant_folding.gather``),
    but not a scalar index, so under a dynamic batch the sizes of the other axes (8 and 8 in ``(batch, 16, 8, 8)``)
    stayed computed, and with them what is computed from them: Swin's window ``Pad`` amounts (0 at these sizes),
    which then block a fold as an ``unsupported-op:onnx.Pad``. The size is the one onnxscript's ``Shape`` folding
    reads (the merged inference, ``infer_shapes``)."""
    for node in list(model.graph):
        shape = node.inputs[0].producer() if node.op_type == "Gather" and node.inputs[0] is not None else None
        index = node.inputs[1] if len(node.inputs) > 1 else None
        if shape is None or shape.op_type != "Shape" or {shape.domain, node.domain} - set(ONNX_DOMAINS):
            continue
        axis = node.attributes.get_int("axis", 0)
        if index is None or index.const_value is None or index.const_value.shape != () or axis != 0:
            continue
        dims = list(shape.inputs[0].shape or []) if shape.inputs[0] is not None else []
        start, end = shape.attributes.get_int("start", 0), shape.attributes.get_int("end")
        dims = dims[start:end]
        i = int(index.const_value.numpy())
        out = node.outputs[0]
        if not -len(dims) <= i < len(dims) or not isinstance(dims[i], int) or not _sizes_only(out):
            continue
        size = ir.Value(name=f"{out.name}.static", const_value=ir.tensor(np.array(dims[i], dtype=np.int64)))
        model.graph.register_initializer(size)
        out.replace_all_uses_with(size)


_SIZE_INPUTS = frozenset(
    {("Pad", 1), ("Reshape", 1), ("Expand", 1), ("Tile", 1), ("ConstantOfShape", 0), ("Squeeze", 1),
     ("Unsqueeze", 1), ("Split", 1), ("Resize", 3), ("Upsample", 1)} | {("Slice", i) for i in range(1, 5)}
)  # fmt: skip
"""Inputs that give an op's sizes, amounts or axes: an integer computed there moves or pads data, never rounds it."""


def _sizes_only(value: ir.Value) -> bool:
    """Whether every use of the integer ``value``, followed through the integer values computed from it, is a size
    input (``_SIZE_INPUTS``). A floating value computed from it (a rotary table from ``Range(0, x.size(1))``) must
    not become a constant: the folder would compute it in the file's float32, where the float64 original of
    question 1 computes it in float64."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.is_graph_output() or v.dtype in FLOATS or v.dtype is None:
            return False
        for use in v.uses():
            if (use.node.op_type, use.idx) in _SIZE_INPUTS and use.node.domain in ONNX_DOMAINS:
                continue
            todo += use.node.outputs
    return True


_GROWING = frozenset({"Expand", "Tile", "ConstantOfShape", "Range", "Resize", "Pad", "Upsample"})
"""Ops that make a constant larger than their inputs, which onnxscript's folder keeps by default."""
FOLD_OUTPUT_LIMIT = 1 << 16
"""Elements a folded constant may have beyond its inputs' (an ``Expand`` of a bias, a small ``ConstantOfShape``): a
larger one would grow the fused file, and a hostile file could ask for any size."""


def _fold_constants(model: ir.Model) -> None:
    """onnxscript's constant folding: every floating tensor an exporter computes from constants (a weight written as
    ``Transpose(W)``, ``Reshape(b)``, ``Cast(W)``, ``Identity(W)``, a ``Constant``) becomes an initializer, and the
    folder's own exact simplifications apply (a ``Cast`` to the dtype its input has goes, a ``Shape`` of static sizes
    becomes a constant; integer arithmetic on constants, such as the pads the TorchScript exporter computes, becomes
    one constant; a ``SplitToSequence`` of constant sizes, which the TorchScript exporter writes for ``tensor_split``,
    becomes a ``Split``). A node is folded only when its outputs' sizes are known (a ``Concat``'s: its inputs'; a
    folded value's: its constant's) and they hold no more elements than its inputs and ``FOLD_OUTPUT_LIMIT``
    together: nothing is computed that the file did not already hold. A graph the
    folder cannot process is lowered as it is (its computed weights then block their folds)."""
    from onnxscript.optimizer import fold_constants

    def elements(values: Iterable[ir.Value | None]) -> int | None:
        total = 0
        for v in values:
            if v is None:
                continue
            shape = v.const_value.shape if v.const_value is not None else v.shape  # a folded value's shape is stale
            if shape is None or unknowns(shape):
                return None
            total += known_elements(shape)
        return total

    def should_fold(node: ir.Node) -> bool | None:
        out, into = elements(node.outputs), elements(node.inputs)
        if out is None:
            out = into if node.op_type == "Concat" else _grown_elements(node)
        if out is None or out > (into or 0) + FOLD_OUTPUT_LIMIT:
            return False
        return True if node.op_type in _GROWING else None  # else the folder's own choice

    quiet = logging.getLogger("onnxscript")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it logs each node it skips
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fold_constants(model, input_size_limit=1 << 62, output_size_limit=1 << 62, should_fold=should_fold)
    except Exception:  # noqa: BLE001 - the folder raises RuntimeError for an op it cannot evaluate
        pass
    finally:
        quiet.setLevel(level)


def _grown_elements(node: ir.Node) -> int | None:
    """Elements of the output of an ``Expand``, ``ConstantOfShape`` or ``Tile`` whose sizes are constants but which
    inference left unknown (the dynamo exporter without its optimizer writes a conv's zero bias as
    ``Expand(CastLike(0, x), Shape(W)[0:1])``: its size is known only once the ``Shape`` is folded); None for any
    other node or a size that is not a valid constant."""
    src = node.inputs[0] if node.inputs else None
    if node.op_type == "ConstantOfShape":
        sizes = _ints(src)
        return math.prod(sizes) if sizes is not None and all(d >= 0 for d in sizes) else None
    if node.op_type not in ("Expand", "Tile") or len(node.inputs) != 2 or src is None or src.shape is None:
        return None
    given = _ints(node.inputs[1])
    dims = [d for d in src.shape if isinstance(d, int)]
    if given is None or any(d < 0 for d in given) or len(dims) != len(src.shape):
        return None
    if node.op_type == "Tile":
        return math.prod([d * r for d, r in zip(dims, given, strict=False)]) if len(given) == len(dims) else None
    try:
        return math.prod(np.broadcast_shapes(tuple(dims), tuple(given)))
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Binding:
    """Where a stored tensor of the lowered graph lives in the ONNX graph.

    Attributes:
        initializer: the initializer's name.
        transposed: the engine sees the initializer transposed (a ``MatMul`` / ``Gemm`` weight stored ``(in, out)``).
        shape: the initializer's own shape (a bias stored ``(1, C, 1, 1)`` is seen as ``(C,)``).
        users: the nodes whose reads this target stands for; a fold writes a copy for them when other nodes read the
            initializer too (copy on write). Empty: every reader.
        scaled: ``(node, attribute, factor)``: that node multiplies this tensor by its attribute, ``factor`` (a
            ``Gemm``'s ``alpha`` or ``beta``, not 1). The engine plans on the tensor as stored; the fold program
            starts from it times ``factor`` in float64 (exact: a float32 times a float32) and a fold writes that,
            setting the attribute to 1.
    """

    initializer: str
    transposed: bool = False
    shape: tuple[int, ...] = ()
    users: tuple[str, ...] = ()
    scaled: tuple[str, str, float] | None = None


@dataclass
class Lowered:
    """An ONNX graph as the engine sees it.

    Attributes:
        gm: the fx graph (never run); its stored tensors are the initializers' arrays (views, not copies).
        bindings: get_attr target -> ``Binding``.
        layers: the fx node of each layer -> ``LayerSite`` (which ONNX nodes it stands for).
    """

    gm: fx.GraphModule
    bindings: dict[str, Binding] = field(default_factory=dict)
    layers: dict[str, LayerSite] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerSite:
    """The ONNX nodes one layer of the lowered graph stands for: ``node`` (``MatMul``, ``Gemm``, ``Conv``, ``Gather``)
    and the bias ``Add`` after it (None: the bias, if any, is the node's own input)."""

    node: str
    bias_add: str | None = None


# --------------------------------------------------------------------------------------------- lowering


class OnnxOp:
    """The op of an opaque node: an ONNX op the engine has no rule for. Its ``__name__`` and ``namespace`` make
    ``slabconv.engine.reasons.unsupported`` say ``unsupported-op:onnx.<Op>``. ``runs`` is False: the engine never
    calls it, so no value computed through it is a constant (a ``DequantizeLinear`` of an initializer)."""

    runs = False

    def __init__(self, domain: str, op_type: str):
        self.namespace = "onnx" if domain in ONNX_DOMAINS else domain
        self.__name__ = op_type
        self.__qualname__ = op_type
        self.__module__ = "slabconv.engine.onnx_lower"

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError(f"{self.namespace}.{self.__name__} is not run by slabconv")

    def __repr__(self) -> str:
        return f"{self.namespace}.{self.__name__}"

    @classmethod
    @functools.cache
    def of(cls, domain: str, op_type: str) -> OnnxOp:
        """The op of ``domain`` and ``op_type``, made once (every node of that op has the same target)."""
        return cls(domain, op_type)


def _opaque_ir_value(*args: Any) -> Any:
    raise NotImplementedError("an ONNX tensor of a type slabconv does not read")


class _Lowering:
    def __init__(self, model: ir.Model):
        self.model = model
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.dims = Dims()
        self.env: dict[ir.Value, fx.Node] = {}
        self.out = Lowered(gm=None)  # type: ignore[arg-type]
        self.owners: dict[str, str] = {}  # target prefix -> "module" | "tensor"
        self.reserved = {n for n, v in model.graph.initializers.items() if _parameter_like(v)}  # for their initializer
        self.consts: dict[tuple[ir.Value, str], fx.Node] = {}  # a constant's get_attr, per name it is read under
        self.current: ir.Node | None = None  # the node being lowered (it names the constants it reads)
        self.fused: set[ir.Node] = set()  # bias Adds folded into the layer before them
        self.moved: dict[ir.Node, tuple[ir.Node, ir.Value]] = {}  # a bias Add after a reshape: (layer, its input)

    # ------------------------------------------------------------------ values

    def fake(self, value: ir.Value) -> torch.Tensor | None:
        dtype = torch_dtype(value.dtype)
        if dtype is None or value.shape is None:
            return None
        return self.dims.fake(dtype, list(value.shape))

    def read(self, value: ir.Value | None) -> Any:
        """The fx node holding ``value`` (None for an omitted optional input)."""
        if value is None:
            return None
        if value in self.env:
            return self.env[value]
        if _const_tensor(value) is not None:
            name = _constant_name(value, self.current)
            if (value, name) not in self.consts:
                self.consts[value, name] = self.constant(value, name)
            return self.consts[value, name]
        node = self.graph.call_function(_opaque_ir_value, ())  # a value from outside this graph, or untyped
        node.meta["val"] = self.fake(value)
        node.meta["onnx_value"] = value.name
        self.env[value] = node
        return node

    def constant(
        self,
        value: ir.Value,
        wanted: str,
        view: Callable[[torch.Tensor], torch.Tensor] | None = None,
        binding: Binding | None = None,
    ) -> fx.Node:
        """A ``get_attr`` of ``value``'s array (viewed through ``view``), stored at a free target near ``wanted``."""
        tensor = _as_torch(_const_tensor(value))
        if tensor is None:
            node = self.graph.call_function(_opaque_ir_value, ())
            node.meta["val"] = None
            return node
        if view is not None:
            tensor = view(tensor)
        target = self.store(wanted, tensor, value.name if value.is_initializer() else None)
        node = self.graph.get_attr(target)
        node.meta["val"] = tensor
        node.meta[STATE] = _state_like(value)
        if binding is not None:
            self.out.bindings[target] = binding
        elif value.is_initializer():
            self.out.bindings[target] = Binding(value.name or "", shape=tuple(tensor.shape))
        return node

    def store(self, wanted: str, tensor: torch.Tensor, own: str | None = None) -> str:
        """Register ``tensor`` on the root module at a free dotted target derived from ``wanted``; a name that is an
        initializer's parameter path (``own``: this tensor's initializer) is left to that initializer."""
        parts = [_attr_part(p) for p in wanted.split(".") if p] or ["t"]
        target = ".".join(parts)
        i = 1
        while not self._free(target) or (target in self.reserved and target != own):
            target, i = ".".join([*parts[:-1], f"{parts[-1]}_{i}"]), i + 1
        *path, leaf = target.split(".")
        owner = self.root
        for depth, part in enumerate(path):
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
            self.owners[".".join(path[: depth + 1])] = "module"
        owner.register_buffer(leaf, tensor, persistent=True)
        self.owners[target] = "tensor"
        return target

    def _free(self, target: str) -> bool:
        parts = target.split(".")
        for i in range(1, len(parts)):
            if self.owners.get(".".join(parts[:i])) == "tensor":
                raise _Unlowerable
        return target not in self.owners

    # ------------------------------------------------------------------ nodes

    def emit(
        self, onnx_node: ir.Node, target: Any, args: tuple[Any, ...], value: ir.Value | None, val: Any = None
    ) -> fx.Node:
        """An fx node for ``onnx_node`` computing ``value`` (its fake tensor unless ``val`` is given)."""
        node = self.graph.call_function(target, args)
        node.name = self.graph._graph_namespace.create_name(_identifier(onnx_node.name or onnx_node.op_type), node)
        node.meta["val"] = self.value_meta(target, args, value) if val is None and value is not None else val
        node.meta["onnx"] = onnx_node.name
        node.meta["onnx_value"] = value.name if value is not None else None
        node.meta["nn_module_stack"] = self.module_stack(onnx_node)
        if value is not None:
            self.env[value] = node
        return node

    def value_meta(self, target: Any, args: tuple[Any, ...], value: ir.Value) -> torch.Tensor | None:
        """The fake tensor of ``value``: its inferred type and shape, or, where inference left a size unknown, what
        torch's own shape rules give for the ATen op on its inputs' fake tensors (an elementwise op's output then
        has its input's sizes, unknown ones included), when that agrees with every size inference knows."""
        inferred = self.fake(value)
        if inferred is not None and value.shape is not None and not unknowns(value.shape):
            return inferred
        if target not in _SAME_SIZES:
            return inferred
        try:
            with self.dims.mode:
                out = target(*fx.node.map_arg(args, lambda n: n.meta.get("val")))
        except Exception:  # noqa: BLE001 - torch cannot say either: keep what inference found
            return inferred
        if not isinstance(out, torch.Tensor) or inferred is None or out.dtype != inferred.dtype:
            return inferred
        shape = list(value.shape or ())
        if len(shape) != out.dim() or any(isinstance(d, int) and out.shape[i] != d for i, d in enumerate(shape)):
            return inferred
        return out

    def module_stack(self, node: ir.Node) -> dict[str, tuple[str, str]]:
        paths = _module_paths(node)
        return {f"L__{i}": (p, "onnx") for i, p in enumerate(paths)}

    def _forget(self, node: ir.Node) -> None:
        """Drop what a lowering that gave up emitted for ``node`` (the node is then lowered as opaque)."""
        made = [n for n in self.graph.nodes if n.meta.get("onnx") == node.name and n.op == "call_function"]
        for fx_node in reversed(made):
            if not fx_node.users:
                self.graph.erase_node(fx_node)
        for value in node.outputs:
            self.env.pop(value, None)
        self.fused = {a for a in self.fused if not any(v in node.outputs for v in a.inputs)}
        for add in [a for a, (layer, _) in self.moved.items() if layer is node]:
            self.fused.discard(add)
            del self.moved[add]

    def opaque(self, node: ir.Node) -> None:
        reads = [self.read(v) for v in node.inputs if v is not None]
        reads += [self.read(v) for v in _captured(node)]
        target = OnnxOp.of(node.domain, node.op_type)
        if len(node.outputs) == 1:
            self.emit(node, target, tuple(reads), node.outputs[0])
            return
        self.emit_outputs(node, target, tuple(reads), used_only=True)

    def emit_outputs(self, node: ir.Node, target: Any, args: tuple[Any, ...], used_only: bool = False) -> None:
        """An fx node for ``node`` of several outputs (a tuple) and a ``getitem`` per output (with ``used_only``: per
        output something reads)."""
        tup = self.emit(node, target, args, None, val=tuple(self.fake(o) for o in node.outputs))
        for i, out in enumerate(node.outputs):
            if not used_only or out.uses() or out.is_graph_output():
                self.getitem(node, tup, i, out)

    def getitem(self, node: ir.Node, tup: fx.Node, i: int, value: ir.Value) -> fx.Node:
        import operator

        vals = tup.meta.get("val")
        known = value.shape is not None and not unknowns(value.shape)
        val = vals[i] if isinstance(vals, tuple) and not known and isinstance(vals[i], torch.Tensor) else None
        return self.emit(node, operator.getitem, (tup, i), value, val=val)

    def lower_node(self, node: ir.Node) -> None:
        self.current = node
        if node in self.moved:  # the layer adds this bias: the Add's output is the reshape's value it reads
            self.emit(node, aten.alias.default, (self.read(self.moved[node][1]),), node.outputs[0])
            return
        if node in self.fused or (node.op_type == "Constant" and node.domain in ONNX_DOMAINS):
            return  # a bias Add taken into its layer; a Constant's value is read where it is used
        rule = LOWER.get(node.op_type if node.domain in ONNX_DOMAINS else f"{node.domain}.{node.op_type}")
        plain = not subgraphs(node)
        floats = any(o.dtype in FLOATS for o in node.outputs) or node.op_type in ("Shape", "Size", "Cast", "CastLike")
        if rule is not None and plain and floats:
            try:
                rule(self, node)
                return
            except Exception:  # noqa: BLE001 - _Unlowerable, or attributes no exporter writes: opaque, so it blocks
                self._forget(node)
        self.opaque(node)


class _Unlowerable(Exception):
    """This node cannot be written as its ATen op (an argument is not a constant, a shape is unknown...)."""


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs ``node`` holds in its attributes (an ``If``'s branches, a ``Loop``'s or ``Scan``'s body)."""
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs += attr.value or ()
    return graphs


def _captured(node: ir.Node) -> list[ir.Value]:
    """Values of the outer graphs that the subgraphs of ``node`` read."""
    out: list[ir.Value] = []
    for sub in subgraphs(node):
        nodes = list(sub.all_nodes())
        inner = set(sub.inputs) | set(sub.initializers.values()) | {o for n in nodes for o in n.outputs}
        out += [v for n in nodes for v in n.inputs if v is not None and v not in inner and v not in out]
    return out


def _identifier(text: str) -> str:
    """``text`` as a Python identifier (an fx node name, a part of a ``get_attr`` target: fx writes ``self.<target>``
    into Python code, so a keyword, an initializer or module named ``is`` or ``in``, gets a ``_`` after it)."""
    out = re.sub(r"\W", "_", text)
    out = out if out and not out[0].isdigit() else f"_{out}" if out else "_"
    return f"{out}_" if keyword.iskeyword(out) else out


def _attr_part(text: str) -> str:
    """One part of a dotted target: an identifier, or digits (``blocks.0``, as ``nn.Sequential`` names children)."""
    return text if text.isdigit() else _identifier(text)


def _module_paths(node: ir.Node) -> list[str]:
    """The module paths the exporter recorded for ``node``, outermost first: the dynamo exporter's
    ``pkg.torch.onnx.name_scopes``, else the scope of a ``/a/b/Op`` node name (TorchScript exporter, tf2onnx)."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            names = ast.literal_eval(scopes) if len(scopes) < 10_000 else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            names = None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return [n for n in names[:-1] if n]
    name = node.name or ""
    if "/" not in name:
        return []
    paths: list[str] = []
    for part in name.strip("/").split("/")[:-1]:
        if part:
            paths.append(_scope_path(paths[-1] if paths else "", part))
    return paths


def _scope_path(outer: str, part: str) -> str:
    """The module path of one scope of a TorchScript node name (``/blocks/blocks.0/mlp/mlp.0/MatMul``) inside the
    module path ``outer`` of the scope around it. The TorchScript exporter names each module it calls by its path
    from the last atom that is not an index on (``torch.onnx``'s ``_unqualified_variable_name``: ``blocks.0.mlp.0``
    is ``mlp.0``), so a container's child repeats the container's name (``blocks.0`` in ``blocks``, ``mlp.0`` in
    ``blocks.0.mlp``; a path of indices alone is named whole: ``0.1`` in ``0``) and anything else is an attribute of
    ``outer`` (``mlp`` in ``blocks.0``)."""
    if not outer:
        return part
    atoms = outer.split(".")
    last = max((i for i, atom in enumerate(atoms) if not atom.isdigit()), default=0)  # all indices: the whole path
    unqualified = ".".join(atoms[last:])
    if part.startswith(unqualified + ".") and all(atom.isdigit() for atom in part[len(unqualified) + 1 :].split(".")):
        return ".".join([*atoms[:last], part])
    return f"{outer}.{part}"


_PARAMETER = re.compile(r"[A-Za-z_]\w*(\.\w+)*")
_ANONYMOUS = re.compile(rf"(val|_val|const|constant)_?\d*|onnx__\w+_\d+|{LIFTED.pattern}", re.IGNORECASE)
"""Names no module gives (``val_18``; the TorchScript exporter's ``onnx::Mul_47``, tools spell ``onnx__Mul_47``)."""


_PARAMETER_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def _parameter_like(value: ir.Value) -> bool:
    """An initializer that is a module's parameter or buffer (``blocks.0.norm1.bn.weight``), not a constant an
    exporter or its optimizer computed (``onnx::MatMul_25``, ``val_18``, ``view_2``): the dynamo exporter marks its
    parameters (``InputSpec.kind``) and onnxscript what it folds (``folded_from``); other names count by their
    look."""
    props, name = value.metadata_props, value.name or ""
    if _FOLDED_FROM in props:
        return False
    if _PARAMETER_KIND in props:
        return True
    return bool(_PARAMETER.fullmatch(name)) and not _ANONYMOUS.fullmatch(name)


def _state_like(value: ir.Value) -> bool:
    """An initializer that holds the model's own state (``capture.is_state``): named as a parameter is
    (``_parameter_like``), and not as paddle2onnx names the constants it writes, with a number for the last part
    (``helper.constant.11``, ``auto.cast.5``, ``p2o.pd_op.full_int_array.1.0``), where a parameter ends in a name
    (``blocks.0.lab.scale``; paddle's ``rep_bn_0.w_0``)."""
    return value.is_initializer() and _parameter_like(value) and not (value.name or "").rsplit(".", 1)[-1].isdigit()


def _constant_name(value: ir.Value, reader: ir.Node | None) -> str:
    """The target a constant's tensor is stored at, named as a checkpoint's parameter would be: its initializer's
    parameter path (``blocks.0.ls1.gamma``); under the reader's module path when several modules read one
    initializer (an exporter's deduplication of equal tensors: ``out_norm.weight`` for a copy of
    ``bottleneck_norm.weight``); for a computed constant, ``<module path of its reader>.weight`` (a norm whose scale
    it is is then named after that module)."""
    name = value.name or ""
    paths = _module_paths(reader) if reader is not None else []
    scope = paths[-1] if paths else None
    if _parameter_like(value):
        scopes = {p[-1] for u in value.uses() if (p := _module_paths(u.node))}
        if scope is not None and len(scopes) > 1 and not name.startswith(f"{scope}."):
            return f"{scope}.{name.rsplit('.', 1)[-1]}"
        return name
    if scope is None:
        scope = next((p[-1] for u in value.uses() if (p := _module_paths(u.node))), None)
    return f"{scope}.weight" if scope is not None else name or "constant"


def _const_tensor(value: ir.Value | None) -> Any:
    if value is None or value.meta.get(FED_DEFAULT):  # a default the caller may replace is not a constant
        return None
    try:
        return ir.convenience.get_const_tensor(value)
    except Exception:  # noqa: BLE001 - a damaged constant is not a constant the engine can read
        return None


def _as_torch(tensor: Any) -> torch.Tensor | None:
    """An ONNX tensor's array as a torch tensor (a view: ``to_torch(copy=False)``); None for element types torch has
    no dtype for."""
    if tensor is None or tensor.dtype not in READ_DTYPES:
        return None
    return to_torch(tensor.numpy(), copy=False)


def to_torch(array: np.ndarray, copy: bool = True) -> torch.Tensor:
    """A numpy array as a torch tensor: a copy, or with ``copy=False`` a view where numpy allows (memory-mapped
    external data stays mapped); bfloat16 (``ml_dtypes``) through its bits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memory maps: the engine never writes a stored tensor
        if array.dtype.name == "bfloat16":
            bits = np.ascontiguousarray(array).view(np.uint16)
            return torch.from_numpy(bits.copy() if copy else bits).view(torch.bfloat16)
        return torch.from_numpy(np.array(array, copy=True)) if copy else torch.as_tensor(np.asarray(array))


def _array(value: ir.Value | None) -> np.ndarray | None:
    tensor = _const_tensor(value)
    if tensor is None:
        return None
    try:
        return np.asarray(tensor.numpy())
    except Exception:  # noqa: BLE001
        return None


def _ints(value: ir.Value | None) -> list[int] | None:
    array = _array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def _rank(value: ir.Value | None) -> int:
    return len(_dims(value))


def _dims(value: ir.Value | None) -> list[Any]:
    if value is None or value.shape is None:
        raise _Unlowerable
    return list(value.shape)


# --------------------------------------------------------------------------------------------- the lowering table

_SAME_SIZES: set[Any] = set()
"""The ATen ops whose output sizes torch works out from their inputs' without looking at a size's value
(elementwise and unary ops, casts): ``_Lowering.value_meta`` asks them where inference left a size unknown."""

LowerFn = Callable[[_Lowering, ir.Node], None]
LOWER: dict[str, LowerFn] = {}
"""ONNX op type -> its lowering (the ATen op ``torch.export`` writes for the same computation). A lowering raises
``_Unlowerable`` when this node cannot be written that way (an argument that is not a constant, an unknown shape):
the node is then opaque."""


def lowers(*ops: str) -> Callable[[LowerFn], LowerFn]:
    def register(fn: LowerFn) -> LowerFn:
        for op in ops:
            LOWER[op] = fn
        return fn

    return register


_TWINS = {
    "CumSum": aten.cumsum.default,
    "Einsum": aten.einsum.default,
    "TopK": aten.topk.default,
    "ArgMax": aten.argmax.default,
    "ArgMin": aten.argmin.default,
    "ReduceProd": aten.prod.dim_int,
    "ReduceL2": aten.linalg_vector_norm.default,
    "Trilu": aten.triu.default,
    "ScatterND": aten.index_put.default,
    "ScatterElements": aten.scatter.src,
    "DepthToSpace": aten.pixel_shuffle.default,
    "SpaceToDepth": aten.pixel_unshuffle.default,
}
"""ONNX ops with an ATen twin that no rule passes: lowered to it, so a path through one is blocked with the reason a
checkpoint gives (``unsupported-op:aten.cumsum``)."""


_UNARY = {
    "Relu": aten.relu.default,
    "Sigmoid": aten.sigmoid.default,
    "Tanh": aten.tanh.default,
    "Erf": aten.erf.default,
    "Exp": aten.exp.default,
    "Log": aten.log.default,
    "Sqrt": aten.sqrt.default,
    "Abs": aten.abs.default,
    "Reciprocal": aten.reciprocal.default,
    "Sin": aten.sin.default,
    "Cos": aten.cos.default,
    "Floor": aten.floor.default,
    "Ceil": aten.ceil.default,
    "Round": aten.round.default,
    "Sign": aten.sign.default,
    "Softplus": aten.softplus.default,
    "Softsign": aten.softsign.default if hasattr(aten, "softsign") else aten.abs.default,
    "Mish": aten.mish.default,
    "HardSwish": aten.hardswish.default,
    "HardSigmoid": aten.hardsigmoid.default,
    "Selu": aten.selu.default,
    "Neg": aten.neg.default,
    "Gelu": aten.gelu.default,
    "LeakyRelu": aten.leaky_relu.default,
    "Elu": aten.elu.default,
    "Clip": aten.clamp.default,
    "Identity": aten.alias.default,
}
"""ONNX ops that map their first input elementwise: the ATen op reads that input only (a ``Clip``'s bounds, a
``LeakyRelu``'s slope are the op's own; the rules treat every such op alike)."""


@lowers(*_UNARY)
def _unary(lo: _Lowering, node: ir.Node) -> None:
    lo.emit(node, _UNARY[node.op_type], (lo.read(node.inputs[0]),), node.outputs[0])


@lowers("Softmax", "LogSoftmax")
def _softmax(lo: _Lowering, node: ir.Node) -> None:
    op = aten._softmax.default if node.op_type == "Softmax" else aten._log_softmax.default
    axis = node.attributes.get_int("axis", -1)
    lo.emit(node, op, (lo.read(node.inputs[0]), axis, False), node.outputs[0])


@lowers("Pow")
def _pow(lo: _Lowering, node: ir.Node) -> None:
    exponent = _array(node.inputs[1])
    if exponent is not None and exponent.size == 1:
        lo.emit(node, aten.pow.Tensor_Scalar, (lo.read(node.inputs[0]), float(exponent.reshape(()))), node.outputs[0])
    else:
        lo.emit(node, aten.pow.Tensor_Tensor, (lo.read(node.inputs[0]), lo.read(node.inputs[1])), node.outputs[0])


_BINARY = {
    "Add": aten.add.Tensor,
    "Sub": aten.sub.Tensor,
    "Mul": aten.mul.Tensor,
    "Div": aten.div.Tensor,
    "Max": aten.maximum.default,
    "Min": aten.minimum.default,
}
"""ONNX ops of two inputs (``Max`` / ``Min`` of any other count are opaque)."""

_EVERY_INPUT = {**_TWINS, **_BINARY, "Where": aten.where.self}


@lowers(*_EVERY_INPUT)
def _every_input(lo: _Lowering, node: ir.Node) -> None:
    """An op whose ATen op reads every input, in order, and writes one output."""
    if len(node.outputs) != 1 or (node.op_type in _BINARY and len(node.inputs) != 2):
        raise _Unlowerable
    lo.emit(node, _EVERY_INPUT[node.op_type], tuple(lo.read(v) for v in node.inputs), node.outputs[0])


_GRID_MODES = {"bilinear": 0, "linear": 0, "nearest": 1, "bicubic": 2, "cubic": 2}
_GRID_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


@lowers("GridSample")
def _grid_sample(lo: _Lowering, node: ir.Node) -> None:
    """``aten.grid_sampler(x, grid, mode, padding_mode, align_corners)`` with the node's attributes as torch numbers
    them (modes of opset 16 and 20 alike), so the rule reads the padding: a border or reflection pads with input
    elements, which pass a shift."""
    mode = _GRID_MODES.get(node.attributes.get_string("mode", "bilinear"))
    padding = _GRID_PADDINGS.get(node.attributes.get_string("padding_mode", "zeros"))
    if len(node.outputs) != 1 or len(node.inputs) != 2 or mode is None or padding is None:
        raise _Unlowerable
    args = (
        lo.read(node.inputs[0]),
        lo.read(node.inputs[1]),
        mode,
        padding,
        bool(node.attributes.get_int("align_corners", 0)),
    )
    lo.emit(node, aten.grid_sampler.default, args, node.outputs[0])


@lowers("Dropout")
def _dropout(lo: _Lowering, node: ir.Node) -> None:
    if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
        raise _Unlowerable
    training = _array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    train = bool(training.reshape(-1)[0]) if training is not None and training.size else False
    if len(node.inputs) > 2 and node.inputs[2] is not None and training is None:
        train = True  # decided at run time: it may be on
    ratio = _array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    p = float(ratio.reshape(-1)[0]) if ratio is not None and ratio.size else node.attributes.get_float("ratio", 0.5)
    lo.emit(node, aten.dropout.default, (lo.read(node.inputs[0]), p, train), node.outputs[0])


@lowers("Cast", "CastLike")
def _cast(lo: _Lowering, node: ir.Node) -> None:
    out = node.outputs[0]
    dtype = torch_dtype(out.dtype)
    if dtype is None:
        raise _Unlowerable
    lo.emit(node, aten.to.dtype, (lo.read(node.inputs[0]), dtype), out)


_TO_SIZES = {
    "Reshape": aten.reshape.default,
    "Flatten": aten.reshape.default,
    "Squeeze": aten.reshape.default,
    "Unsqueeze": aten.reshape.default,
    "Expand": aten.expand.default,
}
"""ONNX ops whose output is their input viewed or broadcast to the output's inferred sizes."""


@lowers(*_TO_SIZES)
def _to_sizes(lo: _Lowering, node: ir.Node) -> None:
    if any(v is not None and v.meta.get(FED_DEFAULT) for v in node.inputs[1:]):
        raise _Unlowerable  # sizes or axes the caller may feed: the inferred output sizes hold for the default only
    out = node.outputs[0]
    sizes = [lo.dims.size(d) for d in _dims(out)]
    lo.emit(node, _TO_SIZES[node.op_type], (lo.read(node.inputs[0]), sizes), out)


@lowers("Transpose")
def _transpose(lo: _Lowering, node: ir.Node) -> None:
    rank = _rank(node.inputs[0])
    perm = node.attributes.get_ints("perm")
    order = [int(p) % rank for p in perm] if perm is not None else list(range(rank - 1, -1, -1))
    lo.emit(node, aten.permute.default, (lo.read(node.inputs[0]), order), node.outputs[0])


@lowers("Tile")
def _tile(lo: _Lowering, node: ir.Node) -> None:
    repeats = _ints(node.inputs[1])
    if repeats is None:
        raise _Unlowerable
    lo.emit(node, aten.repeat.default, (lo.read(node.inputs[0]), repeats), node.outputs[0])


@lowers("Concat")
def _concat(lo: _Lowering, node: ir.Node) -> None:
    """``aten.cat``; a ``Concat`` of ``Slice``s of one tensor along its own axis, read by nothing else (the
    TorchScript exporter's ``roll``: ``cat([x[:, -k:], x[:, :-k]], 1)``), is ``aten.index_select`` of the indices
    they pick, in order: one op reading the tensor once (a backward walk then reaches the layer that made it)."""
    rank = _rank(node.outputs[0])
    axis = node.attributes.get_int("axis", 0) % rank
    picked = _picked_by_slices(node, axis)
    if picked is None:
        lo.emit(node, aten.cat.default, ([lo.read(v) for v in node.inputs], axis), node.outputs[0])
        return
    src, index = picked
    indices = ir.Value(name=f"{node.name}.index", const_value=ir.tensor(np.array(index, dtype=np.int64)))
    args = (lo.read(src), axis, lo.read(indices))
    for value in node.inputs:  # each Slice's node: this Concat read it, and it reads nothing now
        lo.graph.erase_node(lo.env.pop(value))  # type: ignore[arg-type]
    lo.emit(node, aten.index_select.default, args, node.outputs[0])


def _picked_by_slices(node: ir.Node, axis: int) -> tuple[ir.Value, list[int]] | None:
    """``(x, indices)`` when every input of the ``Concat`` ``node`` (two or more) is a ``Slice`` of the same ``x``
    along ``axis`` only, of constant bounds, whose output nothing else reads, and the size of that axis of ``x`` is
    static: the ``Concat`` is then ``x`` indexed by ``indices`` along ``axis``."""
    slices = [v.producer() if v is not None and _sole_reader(v) is node else None for v in node.inputs]
    if len(slices) < 2 or any(s is None or s.op_type != "Slice" or s.domain not in ONNX_DOMAINS for s in slices):
        return None
    src = slices[0].inputs[0]  # type: ignore[union-attr]
    index: list[int] = []
    for s in slices:
        try:
            starts, ends, axes, steps = _slice_args(s, _rank(src))  # type: ignore[arg-type]
        except _Unlowerable:
            return None
        size = _dims(src)[axis] if s.inputs[0] is src else None  # type: ignore[union-attr]
        if not isinstance(size, int) or axes != [axis] or len(s.outputs) != 1:  # type: ignore[union-attr]
            return None
        index += range(size)[slice(starts[0], ends[0], steps[0])]
    return src, index  # type: ignore[return-value]


@lowers("Split")
def _split(lo: _Lowering, node: ir.Node) -> None:
    rank = _rank(node.inputs[0])
    axis = node.attributes.get_int("axis", 0) % rank
    sizes = []
    for out in node.outputs:
        dims = _dims(out)
        if not isinstance(dims[axis], int):
            raise _Unlowerable
        sizes.append(int(dims[axis]))
    lo.emit_outputs(node, aten.split_with_sizes.default, (lo.read(node.inputs[0]), sizes, axis))


def _slice_args(node: ir.Node, rank: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """A ``Slice``'s constant ``(starts, ends, axes, steps)``, axes non-negative (inputs from opset 10, attributes
    before); raises ``_Unlowerable`` for a bound that is not a constant."""
    found: list[Sequence[int] | None]
    if len(node.inputs) == 1:  # before opset 10: attributes
        found = [node.attributes.get_ints(k) for k in ("starts", "ends", "axes")] + [None]
    else:  # opset 10 on: starts, ends, axes, steps as inputs
        given = [*node.inputs[1:5], None, None][:4]
        found = [_ints(v) if v is not None else None for v in given]
        if any(v is not None and f is None for v, f in zip(given, found, strict=True)):
            raise _Unlowerable
    starts, ends, axes, steps = found
    if starts is None or ends is None:
        raise _Unlowerable
    axes = [int(a) % rank for a in axes] if axes is not None else list(range(len(starts)))
    steps = list(steps) if steps is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps) or 0 in steps:
        raise _Unlowerable
    return [int(v) for v in starts], [int(v) for v in ends], axes, [int(v) for v in steps]


@lowers("Slice")
def _slice(lo: _Lowering, node: ir.Node) -> None:
    src, out = node.inputs[0], node.outputs[0]
    rank = _rank(src)
    starts, ends, axes, steps = _slice_args(node, rank)
    current = lo.read(src)
    shape = _dims(src)
    final = _dims(out)
    if any(int(step) < 0 for step in steps):
        # a negative step reverses its axis: aten.slice takes positive steps only; a whole reversal is aten.flip
        sizes = [shape[int(a) % rank] for a in axes]
        whole = all(
            int(step) == -1 and isinstance(n, int) and int(start) + (n if int(start) < 0 else 0) >= n - 1
            and int(end) <= -n - 1
            for n, start, end, step in zip(sizes, starts, ends, steps, strict=False)
        )  # fmt: skip
        if not whole:
            raise _Unlowerable
        lo.emit(node, aten.flip.default, (current, sorted(int(a) % rank for a in axes)), out)
        return
    for i, (axis, start, end, step) in enumerate(zip(axes, starts, ends, steps, strict=False)):
        axis = int(axis) % rank
        shape = [*shape[:axis], final[axis], *shape[axis + 1 :]]
        last = i == len(axes) - 1
        val = None if last else lo.dims.fake(torch_dtype(out.dtype) or torch.float32, shape)
        current = lo.emit(
            node, aten.slice.Tensor, (current, axis, int(start), int(end), int(step)), out if last else None, val=val
        )
    if not axes:
        lo.emit(node, aten.alias.default, (current,), out)


@lowers("Gather")
def _gather(lo: _Lowering, node: ir.Node) -> None:
    data, indices = node.inputs
    if data is None or indices is None:
        raise _Unlowerable
    rank = _rank(data)
    axis = node.attributes.get_int("axis", 0) % rank
    table = _const_tensor(data)
    if table is not None and data.is_initializer() and rank == 2 and axis == 0 and _const_tensor(indices) is None:
        weight = _weight(lo, node, data, "weight", Binding(data.name or "", shape=tuple(table.shape)))
        layer = lo.emit(node, aten.embedding.default, (weight, lo.read(indices)), node.outputs[0])
        lo.out.layers[layer.name] = LayerSite(node.name or "")
        return
    idx = _array(indices)
    if idx is not None and idx.ndim == 0:
        lo.emit(node, aten.select.int, (lo.read(data), axis, int(idx)), node.outputs[0])
    elif indices is not None and indices.shape is not None and len(indices.shape) == 1:
        lo.emit(node, aten.index_select.default, (lo.read(data), axis, lo.read(indices)), node.outputs[0])
    else:
        index = [None] * axis + [lo.read(indices)]
        lo.emit(node, aten.index.Tensor, (lo.read(data), index), node.outputs[0])


@lowers("GatherND")
def _gather_nd(lo: _Lowering, node: ir.Node) -> None:
    """``GatherND`` with ``batch_dims = 0`` and indices ``(*K, m)``: ``data[i_0, ..., i_{m-1}]`` with ``i_j =
    indices[..., j]`` (each ``(*K)``), which is ``aten.index.Tensor`` over the first ``m`` axes (the dynamo
    exporter's ``y[:, idx]``: a ``GatherND`` of ``(k, 1)`` indices between two ``Transpose``s). Each ``i_j`` is an
    ``aten.select`` of the indices: a constant where they are one (``steps._picked`` reads the channels it picks)."""
    data, indices = node.inputs
    dims, rank = _dims(indices), _rank(data)
    if node.attributes.get_int("batch_dims", 0) or not isinstance(dims[-1], int) or not 0 < dims[-1] <= rank:
        raise _Unlowerable
    index = lo.read(indices)
    found = index.meta.get("val")
    if not isinstance(found, torch.Tensor):
        raise _Unlowerable
    each = []
    for j in range(dims[-1]):
        val = lo.dims.fake(found.dtype, dims[:-1])
        each.append(lo.emit(node, aten.select.int, (index, -1, j), None, val=val))
    lo.emit(node, aten.index.Tensor, (lo.read(data), each), node.outputs[0])


@lowers("GatherElements")
def _gather_elements(lo: _Lowering, node: ir.Node) -> None:
    axis = node.attributes.get_int("axis", 0) % _rank(node.inputs[0])
    args = (lo.read(node.inputs[0]), axis, lo.read(node.inputs[1]))
    lo.emit(node, aten.gather.default, args, node.outputs[0])


@lowers("Shape", "Size")
def _shape(lo: _Lowering, node: ir.Node) -> None:
    lo.emit(node, aten.sym_size.int, (lo.read(node.inputs[0]), 0), node.outputs[0], val=0)


def _reduce_axes(node: ir.Node, rank: int) -> list[int] | None:
    """The reduced axes (sorted, non-negative), or None when every axis is reduced; raises for unknown axes."""
    if node.op_type.startswith("Global"):
        return list(range(2, rank))
    axes = node.attributes.get_ints("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = _ints(node.inputs[1])
        if axes is None:
            raise _Unlowerable
    if not axes:
        if node.attributes.get_int("noop_with_empty_axes", 0):
            return []
        return None
    return sorted({int(a) % rank for a in axes})


_REDUCE = {
    "ReduceMean": aten.mean.dim,
    "ReduceSum": aten.sum.dim_IntList,
    "ReduceMax": aten.amax.default,
    "ReduceMin": aten.amin.default,
    "GlobalAveragePool": aten.mean.dim,
    "GlobalMaxPool": aten.amax.default,
}
"""ONNX reductions (a global pool reduces every axis after the channels, keeping them) and their ATen op."""


@lowers(*_REDUCE)
def _reduce(lo: _Lowering, node: ir.Node) -> None:
    rank = _rank(node.inputs[0])
    axes = _reduce_axes(node, rank)
    keep = bool(node.attributes.get_int("keepdims", 1))
    if axes == []:
        lo.emit(node, aten.alias.default, (lo.read(node.inputs[0]),), node.outputs[0])
        return
    dims = list(range(rank)) if axes is None else axes
    lo.emit(node, _REDUCE[node.op_type], (lo.read(node.inputs[0]), dims, keep), node.outputs[0])


def _pads(node: ir.Node, spatial: int) -> list[int]:
    """Per spatial axis, the larger of the begin and end padding (the rules ask only whether a conv or pool pads);
    ``auto_pad`` SAME_* worked out from the kernel (``kernel_shape``, else a Conv's weight: the attribute is
    optional) and the input size where it is static (a 1x1, stride-1 kernel pads nothing); an axis whose kernel or
    size is unknown counts as padded."""
    auto = node.attributes.get_string("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        weight = node.inputs[1] if node.op_type == "Conv" and len(node.inputs) > 1 else None
        shape = weight.shape if weight is not None else None
        kernel: Any = node.attributes.get_ints("kernel_shape") or (list(shape)[2:] if shape is not None else [])
        strides = node.attributes.get_ints("strides") or [1] * spatial
        dilations = node.attributes.get_ints("dilations") or [1] * spatial
        sizes = list(node.inputs[0].shape)[2:] if node.inputs[0] is not None and node.inputs[0].shape else None
        out = []
        for i in range(spatial):
            k = int(kernel[i]) if i < len(kernel) and isinstance(kernel[i], int) else None
            s, d, n = int(strides[i]), int(dilations[i]), sizes[i] if sizes is not None else None
            if k is not None and (k - 1) * d + 1 == 1 and s == 1:
                out.append(0)
            elif k is None or not isinstance(n, int):
                out.append(1)  # unknown: count it as padded
            else:
                out.append(max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0))
        return out
    if auto == "VALID":
        return [0] * spatial
    pads = node.attributes.get_ints("pads") or [0] * (2 * spatial)
    return [max(pads[i], pads[i + spatial]) for i in range(spatial)]


@lowers("MaxPool", "AveragePool")
def _pool(lo: _Lowering, node: ir.Node) -> None:
    rank = _rank(node.inputs[0])
    spatial = rank - 2
    if spatial not in (1, 2):
        raise _Unlowerable
    kernel = list(node.attributes.get_ints("kernel_shape", []))
    strides = list(node.attributes.get_ints("strides") or [1] * spatial)
    pads = _pads(node, spatial)
    ceil = bool(node.attributes.get_int("ceil_mode", 0))
    x = lo.read(node.inputs[0])
    if node.op_type == "AveragePool":
        op = aten.avg_pool2d.default if spatial == 2 else aten.avg_pool1d.default
        count_pad = bool(node.attributes.get_int("count_include_pad", 0))
        lo.emit(node, op, (x, kernel, strides, pads, ceil, count_pad, None), node.outputs[0])
        return
    dilations = list(node.attributes.get_ints("dilations") or [1] * spatial)
    indices = len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output())
    if indices and spatial == 2:
        lo.emit_outputs(node, aten.max_pool2d_with_indices.default, (x, kernel, strides, pads, dilations, ceil))
        return
    if indices:
        raise _Unlowerable
    op = aten.max_pool2d.default if spatial == 2 else aten.max_pool1d.default
    lo.emit(node, op, (x, kernel, strides, pads, dilations, ceil), node.outputs[0])


@lowers("Pad")
def _pad(lo: _Lowering, node: ir.Node) -> None:
    src = node.inputs[0]
    rank = _rank(src)
    pads = (
        _ints(node.inputs[1])
        if len(node.inputs) > 1 and node.inputs[1] is not None
        else node.attributes.get_ints("pads")
    )
    if pads is None:
        raise _Unlowerable
    axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else list(range(rank))
    if axes is None or len(pads) != 2 * len(axes):
        raise _Unlowerable
    begin, end = dict.fromkeys(range(rank), 0), dict.fromkeys(range(rank), 0)
    for i, a in enumerate(axes):
        begin[int(a) % rank], end[int(a) % rank] = int(pads[i]), int(pads[i + len(axes)])
    torch_pads = [p for d in range(rank - 1, -1, -1) for p in (begin[d], end[d])]
    mode = node.attributes.get_string("mode", "constant")
    x = lo.read(src)
    if mode == "constant":  # the value: input 2 (opset 11 on, absent: 0), the attribute ``value`` before
        given = node.inputs[2] if len(node.inputs) > 2 else None
        value = _array(given) if given is not None else np.asarray(node.attributes.get_float("value", 0.0))
        if value is None or value.size != 1:
            raise _Unlowerable
        lo.emit(node, aten.constant_pad_nd.default, (x, torch_pads, float(value.reshape(()))), node.outputs[0])
        return
    op_name = {"reflect": "reflection_pad", "edge": "replication_pad"}.get(mode)
    spatial = sum(1 for d in range(rank) if begin[d] or end[d])
    if mode == "wrap":
        lo.emit(node, aten._pad_circular.default, (x, torch_pads), node.outputs[0])
        return
    if op_name is None:
        raise _Unlowerable
    dims = max(1, min(3, rank - 2))
    trimmed = torch_pads[: 2 * dims]
    if spatial and any(torch_pads[2 * dims :]):
        raise _Unlowerable
    lo.emit(node, getattr(aten, f"{op_name}{dims}d").default, (x, trimmed), node.outputs[0])


@lowers("Resize", "Upsample")
def _resize(lo: _Lowering, node: ir.Node) -> None:
    src, out = node.inputs[0], node.outputs[0]
    ins, outs = _dims(src), _dims(out)
    rank = len(ins)
    scales = _array(node.inputs[2]) if len(node.inputs) > 2 else None
    if node.op_type == "Upsample" or len(node.inputs) == 2:  # opsets 7 to 10: the attribute, else input 1
        scales = (
            _array(node.inputs[1]) if len(node.inputs) > 1 else np.asarray(node.attributes.get_floats("scales", []))
        )
    unscaled = scales is not None and scales.size == rank and bool((scales[:2] == 1.0).all())  # floor(1.0*batch)
    if rank not in (3, 4, 5) or len(outs) != rank or (ins[:2] != outs[:2] and not unscaled):
        raise _Unlowerable  # only the spatial axes may be resized
    mode = node.attributes.get_string("mode", "nearest")
    coords = node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    if coords == "tf_crop_and_resize":
        raise _Unlowerable
    sizes = [lo.dims.size(d) for d in outs[2:]]
    spatial = rank - 2
    x = lo.read(src)
    align = coords == "align_corners"
    if mode == "nearest":
        op = getattr(aten, f"upsample_nearest{spatial}d").vec
        lo.emit(node, op, (x, sizes, None), out)
    elif mode == "linear":
        name = {1: "upsample_linear1d", 2: "upsample_bilinear2d", 3: "upsample_trilinear3d"}[spatial]
        lo.emit(node, getattr(aten, name).vec, (x, sizes, align, None), out)
    elif mode == "cubic" and spatial == 2:
        lo.emit(node, aten.upsample_bicubic2d.vec, (x, sizes, align, None), out)
    else:
        raise _Unlowerable


@lowers("BatchNormalization")
def _batch_norm(lo: _Lowering, node: ir.Node) -> None:
    if len(node.inputs) != 5 or any(v is None for v in node.inputs):
        raise _Unlowerable
    if not node.attributes.get_int("spatial", 1):
        raise _Unlowerable  # opset < 9, one statistic per element: not per channel
    x, w, b, mean, var = (lo.read(v) for v in node.inputs)
    if any(p.meta.get(FED_DEFAULT) for p in (w, b, mean, var)):
        raise _Unlowerable  # kept (``overridable-initializer``): the caller may feed its scale or statistics
    xv, wv = x.meta.get("val"), w.meta.get("val")
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or not isinstance(wv, torch.Tensor):
        raise _Unlowerable
    if not isinstance(xv.shape[1], int):  # a size inference left unknown is the channel count the statistics have
        x.meta["val"] = lo.dims.fake(xv.dtype, [xv.shape[0], wv.numel(), *xv.shape[2:]])
    eps, momentum = node.attributes.get_float("epsilon", 1e-5), node.attributes.get_float("momentum", 0.9)
    # training mode: the attribute (opset 14+), or any output declared besides Y, read or not (opsets 9 to 13 have
    # no attribute: onnxruntime and the spec normalise with the batch's statistics when the node lists them)
    training = bool(node.attributes.get_int("training_mode", 0)) or len(node.outputs) > 1
    fake = lo.value_meta(aten.alias.default, (x,), node.outputs[0])  # the input's sizes, as every BN output
    val = (fake, fake, fake)
    args: tuple[Any, ...]
    if training:
        args = (x, w, b, mean, var, True, 1.0 - momentum, eps)
        tup = lo.emit(node, aten._native_batch_norm_legit.default, args, None, val=val)
    else:
        args = (x, w, b, mean, var, 1.0 - momentum, eps)
        tup = lo.emit(node, aten._native_batch_norm_legit_no_training.default, args, None, val=val)
    lo.getitem(node, tup, 0, node.outputs[0])


@lowers("LayerNormalization", "RMSNormalization")
def _layer_norm(lo: _Lowering, node: ir.Node) -> None:
    """``aten.layer_norm`` / ``aten.rms_norm`` (torch 2.4+) over the axes from ``axis`` on, whose sizes must be
    static; a LayerNormalization whose mean or inverse deviation is read is opaque."""
    rms = node.op_type == "RMSNormalization"
    if (rms and not hasattr(aten, "rms_norm")) or any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        raise _Unlowerable
    dims = _dims(node.inputs[0])
    shape = dims[node.attributes.get_int("axis", -1) % len(dims) :]
    if not all(isinstance(d, int) for d in shape):
        raise _Unlowerable
    x, w = lo.read(node.inputs[0]), lo.read(node.inputs[1])
    sizes, eps = [int(d) for d in shape], node.attributes.get_float("epsilon", 1e-5)
    if rms:
        lo.emit(node, aten.rms_norm.default, (x, sizes, w, eps), node.outputs[0])
    else:
        b = lo.read(node.inputs[2]) if len(node.inputs) > 2 else None
        lo.emit(node, aten.layer_norm.default, (x, sizes, w, b, eps), node.outputs[0])


@lowers("GroupNormalization")
def _group_norm(lo: _Lowering, node: ir.Node) -> None:
    opset = lo.model.opset_imports.get("", lo.model.opset_imports.get("ai.onnx", 0))
    if opset < 21:
        raise _Unlowerable  # opset 18's scale and bias are per group, not per channel
    groups = node.attributes.get_int("num_groups")
    eps = node.attributes.get_float("epsilon", 1e-5)
    x, w, b = (lo.read(v) for v in node.inputs[:3])
    lo.emit(node, aten.group_norm.default, (x, groups, w, b, eps), node.outputs[0])


@lowers("InstanceNormalization")
def _instance_norm(lo: _Lowering, node: ir.Node) -> None:
    x, w, b = (lo.read(v) for v in node.inputs[:3])
    eps = node.attributes.get_float("epsilon", 1e-5)
    lo.emit(node, aten.instance_norm.default, (x, w, b, None, None, True, 0.0, eps, False), node.outputs[0])


# --------------------------------------------------------------------------------------------- layers


def _sole_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return next(iter(uses)).node


def _bias_after(node: ir.Node, channels: int, axis_from_end: int) -> tuple[ir.Node, ir.Value, np.ndarray] | None:
    """The ``Add`` right after ``node`` that adds a constant per-channel vector (``(C,)``, ``(1, C)``, ``(C, 1, 1)``
    ...) on the output's channel axis (``axis_from_end`` from the last), when it is the output's only reader."""
    add = _sole_reader(node.outputs[0])
    if add is None or add.op_type != "Add" or add.domain not in ONNX_DOMAINS or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
    if other is None or other is node.outputs[0] or not other.is_initializer():
        return None
    array = _array(other)
    if array is None or array.dtype.kind != "f" or array.size != channels:
        return None
    shape = list(array.shape)
    if channels > 1 and (len(shape) < axis_from_end or shape[len(shape) - axis_from_end] != channels):
        return None
    if node.outputs[0].shape is not None and len(shape) > len(node.outputs[0].shape):
        return None
    return add, other, array


def _bias_after_reshape(node: ir.Node, channels: int) -> tuple[ir.Node, ir.Node, ir.Value, np.ndarray] | None:
    """``(reshape, add, bias, array)`` where ``node``'s output goes only into a ``Reshape`` that keeps the last axis
    whole (``channels`` last before and after: every row of the output is one row of the input) and that reshape's
    output only into an ``Add`` of a constant ``(channels,)`` vector on the last axis, as tf2onnx writes a Keras
    ``Dense`` on tokens (``Reshape`` -> ``MatMul`` -> ``Reshape`` -> ``BiasAdd``): adding the bias before the
    reshape gives the same tensor, so it is the layer's bias."""
    reshape = _sole_reader(node.outputs[0])
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain not in ONNX_DOMAINS:
        return None
    if reshape.inputs[0] is not node.outputs[0]:
        return None
    before, after = node.outputs[0].shape, reshape.outputs[0].shape
    if before is None or after is None or not len(before) or not len(after):
        return None
    if not (isinstance(before[-1], int) and isinstance(after[-1], int) and before[-1] == after[-1] == channels):
        return None
    found = _bias_after(reshape, channels, 1)
    if found is None:
        return None
    add, value, array = found
    return reshape, add, value, array


def _bias_add(
    lo: _Lowering, node: ir.Node, channels: int, axis_from_end: int, reshaped: bool = False
) -> tuple[fx.Node | None, LayerSite, ir.Value]:
    """The bias ``Add`` after a layer without a bias input, taken into the layer: the one right after it
    (``_bias_after``), or with ``reshaped`` one after a ``Reshape`` that keeps the channel axis whole
    (``_bias_after_reshape``; the ``Add``'s output is then that reshape's value, ``_Lowering.moved``).

    Returns:
        ``(bias, site, out)``: the bias's ``get_attr`` (None: no such ``Add``), the layer's ``LayerSite`` and the
        ONNX value the layer's fx node computes.
    """
    found = _bias_after(node, channels, axis_from_end)
    later = _bias_after_reshape(node, channels) if found is None and reshaped else None
    if found is None and later is None:
        return None, LayerSite(node.name or ""), node.outputs[0]
    add, value, array = found if found is not None else later[1:]  # type: ignore[index]
    lo.fused.add(add)
    if later is not None:
        lo.moved[add] = (node, later[0].outputs[0])
    bias = _weight(lo, add, value, "bias", Binding(value.name or "", False, array.shape), torch.Tensor.flatten)
    return bias, LayerSite(node.name or "", add.name), add.outputs[0] if later is None else node.outputs[0]


def _layer_scope(lo: _Lowering, node: ir.Node, fallback: ir.Value) -> str:
    """The name a layer's tensors get: its module path (the exporter's scope), else its weight initializer's name
    without ``.weight``."""
    paths = _module_paths(node)
    if paths:
        return paths[-1]
    name = fallback.name or node.name or node.op_type
    return name.removesuffix(".weight")


def _weight(
    lo: _Lowering,
    node: ir.Node,
    value: ir.Value,
    role: str,
    binding: Binding,
    view: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> fx.Node:
    """A ``get_attr`` of a layer's weight or bias: a target of its own when other nodes read the initializer too
    (copy on write), named ``<module path>.<role>``."""
    shared = len({id(u.node) for u in value.uses()}) > 1 or value.is_graph_output()
    binding = dataclasses.replace(binding, users=(node.name or "",) if shared else ())
    scope = _layer_scope(lo, node, value)
    return lo.constant(value, f"{scope}.{role}", view, binding)


def _linear_weight(
    lo: _Lowering, node: ir.Node, b: ir.Value, w: Any, transposed: bool, scaled: tuple[str, str, float] | None = None
) -> tuple[fx.Node, int]:
    """``(weight, N)``: the ``get_attr`` of the constant weight ``b`` (its array ``w``) of a layer lowered to
    ``aten.linear``, seen ``(N, K)``; ``w`` is stored ``(K, N)`` (or ``(1, K, N)``, a batch of one) when
    ``transposed``, else ``(N, K)``. ``scaled``: its ``Binding.scaled``."""
    shape = tuple(int(d) for d in w.shape)
    binding = Binding(b.name or "", transposed, shape, scaled=scaled)
    view = (lambda t: t.reshape(shape[-2:]).t()) if transposed else None
    return _weight(lo, node, b, "weight", binding, view), shape[-1] if transposed else shape[0]


def _linear(
    lo: _Lowering, node: ir.Node, x: fx.Node, b: ir.Value, w: Any, transposed: bool, alpha: float = 1.0
) -> None:
    """``aten.linear`` of ``x`` by the constant weight ``b`` (``_linear_weight``; ``alpha``, not 1, in its
    ``Binding.scaled``), with the bias ``Add`` after it (or after a reshape that keeps the channels whole) taken in."""
    scaled = (node.name or "", "alpha", alpha) if alpha != 1.0 else None
    weight, n = _linear_weight(lo, node, b, w, transposed, scaled)
    bias, site, out = _bias_add(lo, node, n, 1, reshaped=True)
    layer = lo.emit(node, aten.linear.default, (x, weight, bias), out)
    lo.out.layers[layer.name] = site


@lowers("MatMul")
def _matmul(lo: _Lowering, node: ir.Node) -> None:
    """``MatMul`` by a constant ``(K, N)`` weight, or a ``(1, K, N)`` one (a batch of one, broadcast) read by an
    input of rank 3 or more, which the broadcast leaves as it is: ``aten.linear`` (with the bias ``Add`` after it);
    any other ``MatMul`` is ``aten.matmul``."""
    a, b = node.inputs
    w = _const_tensor(b)
    rank = len(a.shape) if a is not None and a.shape is not None else 0
    batched = w is not None and len(w.shape) == 3 and w.shape[0] == 1 and rank >= 3
    if (
        w is None
        or b is None
        or not b.is_initializer()
        or (len(w.shape) != 2 and not batched)
        or _const_tensor(a) is not None
    ):
        lo.emit(node, aten.matmul.default, (lo.read(a), lo.read(b)), node.outputs[0])
        return
    _linear(lo, node, lo.read(a), b, w, True)


@lowers("com.microsoft.FusedMatMul")
def _fused_matmul(lo: _Lowering, node: ir.Node) -> None:
    """onnxruntime's ``FusedMatMul`` (its extended-level optimizer's ``MatMul`` with a ``Transpose`` and a scalar
    ``Mul`` taken in: ``alpha A' B'``, ``'`` the last two axes swapped with ``transA`` / ``transB``): by a constant
    2-D B as ``Gemm`` is lowered without C, ``aten.linear`` of ``A'`` with the weight ``B'`` seen ``(N, K)``,
    ``alpha`` in its ``Binding.scaled`` and the bias ``Add`` after it; any other as ``aten.matmul`` of ``A'`` and
    ``B'`` (times ``alpha``), as ``MatMul``. Opaque with ``transBatchA`` / ``transBatchB`` or ``alpha`` 0."""
    a, b = node.inputs
    w = _const_tensor(b)
    alpha, trans_b = node.attributes.get_float("alpha", 1.0), node.attributes.get_int("transB", 0)
    if alpha == 0.0 or any(node.attributes.get_int(k, 0) for k in ("transBatchA", "transBatchB")):
        raise _Unlowerable

    def swapped(x: fx.Node) -> fx.Node:
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 2:
            raise _Unlowerable
        rank = val.dim()
        return lo.emit(node, aten.transpose.int, (x, rank - 2, rank - 1), None, val=val.transpose(-2, -1))

    x = swapped(lo.read(a)) if node.attributes.get_int("transA", 0) else lo.read(a)
    out = node.outputs[0]
    if w is None or b is None or not b.is_initializer() or len(w.shape) != 2 or _const_tensor(a) is not None:
        y = swapped(lo.read(b)) if trans_b else lo.read(b)
        if alpha == 1.0:
            lo.emit(node, aten.matmul.default, (x, y), out)
        else:
            product = lo.emit(node, aten.matmul.default, (x, y), None, val=lo.fake(out))
            lo.emit(node, aten.mul.Tensor, (product, alpha), out)
        return
    _linear(lo, node, x, b, w, not trans_b, alpha)


@lowers("Einsum")
def _einsum(lo: _Lowering, node: ir.Node) -> None:
    """``Einsum`` of a tensor and a constant 2-D weight that contracts the tensor's last axis and puts the weight's
    other axis last (``btc,cd->btd``, ``...c,dc->...d``: Keras' ``EinsumDense``) as ``MatMul`` is lowered:
    ``aten.linear`` with the weight seen ``(N, K)``, and the bias ``Add`` after it; any other as ``aten.einsum``."""
    terms = node.attributes.get_string("equation", "").replace(" ", "").split("->")
    inputs = terms[0].split(",")
    b = node.inputs[-1]
    w = _const_tensor(b) if len(inputs) == 2 and len(node.inputs) == 2 else None
    if w is None or b is None or len(terms) != 2 or len(inputs[1]) != 2 or not b.is_initializer():
        return _every_input(lo, node)
    (x, weight), out = inputs, terms[1]
    k = x[-1:]
    n = weight.replace(k, "", 1)
    if len(n) != 1 or n in x or k in x[:-1] or out != x[:-1] + n or _const_tensor(node.inputs[0]) is not None:
        return _every_input(lo, node)
    _linear(lo, node, lo.read(node.inputs[0]), b, w, weight.index(k) == 0)  # transposed: stored (K, N)


@lowers("Gemm")
def _gemm(lo: _Lowering, node: ir.Node) -> None:
    """``Gemm``: ``alpha * A' B' + beta * C`` (``A'`` is ``A`` transposed with ``transA``, ``B'`` likewise) as
    ``aten.linear`` of ``A'`` (``aten.t`` of ``A`` with ``transA``), the weight ``B'`` seen ``(N, K)`` and the bias
    ``C`` seen ``(N,)`` (a C of ``N`` values), ``alpha`` and ``beta`` in their ``Binding.scaled``; a C per row
    (``(M, N)``, ``(M, 1)``) or of one number, ``beta C``, is added after the layer (``ROWS_ADDEND``: a backward
    fold passes it, ``onnx_apply`` rescales it). Opaque when ``B`` or ``C`` is no initializer or ``alpha`` is 0."""
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    w = _const_tensor(b)
    alpha, beta = node.attributes.get_float("alpha", 1.0), node.attributes.get_float("beta", 1.0)
    trans_a, trans_b = node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)
    if w is None or b is None or not b.is_initializer() or len(w.shape) != 2 or alpha == 0.0:
        raise _Unlowerable
    name = node.name or ""
    weight, n = _linear_weight(lo, node, b, w, not trans_b, (name, "alpha", alpha) if alpha != 1.0 else None)
    bias = rows = None
    if c is not None:
        array = _array(c)
        if array is None or not c.is_initializer() or array.ndim > 2:
            raise _Unlowerable
        if array.size == n and (array.ndim < 2 or array.shape[0] == 1):
            scaled = (name, "beta", beta) if beta != 1.0 else None
            binding = Binding(c.name or "", False, tuple(array.shape), scaled=scaled)
            bias = _weight(lo, node, c, "bias", binding, torch.Tensor.flatten)
        else:  # a C per row, (M, N) or (M, 1), or one number: added after the layer
            rows = lo.constant(c, f"{name or 'Gemm'}.C", lambda t: t if beta == 1.0 else t.double() * beta)
    x = lo.read(a)
    if trans_a:
        val = x.meta.get("val")
        x = lo.emit(
            node, aten.t.default, (x,), None, val=val.t() if isinstance(val, torch.Tensor) and val.dim() == 2 else None
        )
    out = node.outputs[0]
    layer = lo.emit(
        node, aten.linear.default, (x, weight, bias), *((None, lo.fake(out)) if rows is not None else (out,))
    )
    lo.out.layers[layer.name] = LayerSite(name)
    if rows is not None:
        lo.emit(node, aten.add.Tensor, (layer, rows), out).meta[ROWS_ADDEND] = True


@lowers("Conv", "ConvTranspose", "com.microsoft.FusedConv")
def _convolution(lo: _Lowering, node: ir.Node) -> None:
    """``Conv`` / ``ConvTranspose`` as ``aten.convolution`` (``transposed`` for a ``ConvTranspose``: the weight is
    ``(C_in, C_out / group, *kernel)``, ``output_padding`` read). A ``ConvTranspose``'s padding is the larger of its
    begin and end ``pads`` (or ``auto_pad``) per axis, as a ``Conv``'s; its ``output_shape`` is not read: the layer
    folds forward only when the output size inferred for it is the input's less twice that padding
    (``layers.ConvTranspose.pointwise``), which asymmetric ``pads`` or an ``output_shape`` that crops otherwise never
    are.

    onnxruntime's ``FusedConv`` (its extended-level optimizer's ``Conv`` with the activation after it taken in,
    ``activation`` one of ``_UNARY``'s ops) is that ``aten.convolution`` and the activation after it: a norm before
    it folds into its weight and bias ``B``; a bias a fold creates becomes ``B`` (the activation reads the biased
    sum, never an ``Add`` after the node); behind it a norm meets the activation. Opaque with a ``Z`` input (a tensor
    added before the activation) or another activation."""
    x, wv = node.inputs[0], node.inputs[1]
    bv = node.inputs[2] if len(node.inputs) > 2 else None
    activation = node.attributes.get_string("activation") if node.op_type == "FusedConv" else None
    if activation is not None and (activation not in _UNARY or (len(node.inputs) > 3 and node.inputs[3] is not None)):
        raise _Unlowerable
    transposed = node.op_type == "ConvTranspose"
    w = _const_tensor(wv)
    rank = _rank(x)
    spatial = rank - 2
    if w is None or wv is None or not wv.is_initializer():
        raise _Unlowerable
    strides = list(node.attributes.get_ints("strides") or [1] * spatial)
    dilations = list(node.attributes.get_ints("dilations") or [1] * spatial)
    groups = node.attributes.get_int("group", 1)
    pads = _pads(node, spatial)
    out_channels = int(w.shape[1]) * groups if transposed else int(w.shape[0])
    output_padding = list(node.attributes.get_ints("output_padding") or [0] * spatial) if transposed else [0] * spatial
    weight = _weight(lo, node, wv, "weight", Binding(wv.name or "", False, tuple(w.shape)))
    if bv is None and activation is not None:
        bias, site, out = None, LayerSite(node.name or ""), node.outputs[0]
    elif bv is None:
        bias, site, out = _bias_add(lo, node, out_channels, spatial + 1)
    else:
        array = _array(bv)
        if array is None or not bv.is_initializer() or array.ndim != 1:
            raise _Unlowerable
        bias = _weight(lo, node, bv, "bias", Binding(bv.name or "", False, tuple(array.shape)))
        site, out = LayerSite(node.name or ""), node.outputs[0]
    args = (lo.read(x), weight, bias, strides, pads, dilations, transposed, output_padding, groups)
    if activation is None:
        layer = lo.emit(node, aten.convolution.default, args, out)
    else:
        layer = lo.emit(node, aten.convolution.default, args, None, val=lo.fake(out))
        lo.emit(node, _UNARY[activation], (layer,), out)
    lo.out.layers[layer.name] = site


_SAME_SIZES.update(_UNARY.values(), _BINARY.values())
_SAME_SIZES.update(
    {aten._softmax.default, aten._log_softmax.default, aten.where.self, aten.alias.default, aten.to.dtype,
     aten.dropout.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor}
)  # fmt: skip

# --------------------------------------------------------------------------------------------- the entry point


def lower(model: ir.Model) -> Lowered:
    """The main graph of ``model`` (prepared: ``prepare``) as an fx graph of ATen ops, for analysis.

    Returns:
        ``Lowered``: the graph, where each of its stored tensors lives in the ONNX graph, and each layer's ONNX nodes.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx warns about the SymInts the rules read from the nodes' arguments
        return _lower(model)


def _lower(model: ir.Model) -> Lowered:
    lo = _Lowering(model)
    graph = model.graph
    for value in graph.inputs:
        if value.is_initializer() and not value.meta.get(FED_DEFAULT):
            continue
        node = lo.graph.placeholder(_identifier(value.name or "input"))
        node.meta["val"] = lo.fake(value)
        node.meta["onnx_value"] = value.name
        node.meta[FED_DEFAULT] = bool(value.meta.get(FED_DEFAULT))
        lo.env[value] = node
    for onnx_node in graph:
        lo.lower_node(onnx_node)
    outputs = [lo.read(v) for v in graph.outputs]
    lo.graph.output(tuple(outputs) if len(outputs) != 1 else outputs[0])
    lo.out.gm = fx.GraphModule(lo.root, lo.graph)
    return lo.out
