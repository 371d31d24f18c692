"""Capture a model as an export graph, and read what the graph stores.

In: an ``nn.Module`` in the state it should be folded in (eval mode) and one example input. Out: the unlifted
``torch.export`` graph (``ExportedProgram.module()``, an in-place op on a tensor nothing else reads written as its
out-of-place form: ``unlifted``): an fx ``GraphModule`` of ATen ops whose parameters and buffers are ``get_attr``
nodes and whose nodes carry ``meta["val"]`` (a fake tensor with possibly symbolic sizes) and
``meta["nn_module_stack"]`` (the modules that ran the op).

The other helpers here answer questions about that graph without changing it: the tensor behind a ``get_attr``, a
node's shape, whether two symbolic sizes are equal, which modules enclose a node, the op that writes a node's
tensor in place (``written_in_place``).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from slabconv.errors import UnsupportedModelError
from slabconv.util import upper_bound


def graph_axes(model: torch.nn.Module) -> dict[int, Any]:
    """The dynamic axes of a graph captured with symbolic sizes, as ``torch.export.Dim``s for exporting it again.

    For an ``fx.GraphModule`` from ``capture`` (or a loaded ``.pt2``), each axis of its first input whose size is
    symbolic: axis 0 as ``Dim("batch")``, axis 1 as ``Dim("sequence", min=1, max=<its upper bound>)``, others as
    ``Dim("axis<i>")`` with their bounds. Empty for a module that is not such a graph or has static sizes.
    """
    if not isinstance(model, fx.GraphModule):
        return {}
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    val = placeholders[0].meta.get("val") if placeholders else None
    if not isinstance(val, torch.Tensor):
        return {}
    axes: dict[int, Any] = {}
    for i, size in enumerate(val.shape):
        if not isinstance(size, torch.SymInt):
            continue
        if i == 0:
            axes[0] = torch.export.Dim("batch")
            continue
        upper = upper_bound(size)
        name = "sequence" if i == 1 else f"axis{i}"
        axes[i] = torch.export.Dim(name, min=1, max=upper) if upper else torch.export.Dim(name, min=1)
    return axes


def axis_attempts(model: torch.nn.Module, sequence: int | None = None) -> list[dict[int, Any] | None]:
    """The dynamic axes to try exporting ``model`` with, most dynamic first, ending with a static export.

    Args:
        model: a module, or a graph captured with symbolic sizes (``graph_axes``: those axes are tried first).
        sequence: for token-id inputs ``(B, T)``: the longest ``T`` the model takes (``max_position_embeddings``);
            axis 1 is then tried as ``Dim("sequence", min=1, max=sequence)``.
    """
    batch = {0: torch.export.Dim("batch")}
    attempts: list[dict[int, Any] | None] = []
    axes = graph_axes(model)
    if len(axes) > 1:
        attempts.append(axes)
    if sequence is not None and sequence > 1:
        attempts.append({**batch, 1: torch.export.Dim("sequence", min=1, max=int(sequence))})
    return [*attempts, batch, None]


def capture(
    model: torch.nn.Module, example: torch.Tensor, dynamic_batch: bool = True, sequence: int | None = None
) -> fx.GraphModule:
    """Export ``model`` (eval mode) with ``torch.export`` and return the unlifted fx ``GraphModule``
    (``unlifted(capture_program(...))``; arguments and errors as there)."""
    return unlifted(capture_program(model, example, dynamic_batch, sequence))


def unlifted(program: torch.export.ExportedProgram) -> fx.GraphModule:
    """``program.module()`` with every in-place ATen op whose written tensor no other node can read as its
    out-of-place form (``x += y`` on a sum: ``aten.add_.Tensor`` becomes ``aten.add.Tensor``), so the rules see
    the op they name; the values are the same. An op stays in place when the tensor it writes is a graph input,
    a stored tensor, a view or alias of another (its producer's schema returns alias information), or is read by
    any other node (``FunctionSchema`` of ``torch._ops.OpOverload``)."""
    gm = program.module()
    for node in gm.graph.nodes:
        if node.op == "call_function" and (functional := _out_of_place(node)) is not None:
            node.target = functional
    gm.recompile()
    return gm


def written_in_place(node: fx.Node) -> fx.Node | None:
    """The first in-place op (a ``FunctionSchema`` argument with write alias information) that writes ``node``'s
    tensor or a view of it (through ops whose schema returns alias information: ``view``, ``t``, ``add_``'s
    result), None when none does: a reader of ``node`` after that op reads the written values."""
    todo, seen = [node], {node}
    while todo:
        tensor = todo.pop()
        for user in tensor.users:
            op = user.target
            if user.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
                continue
            written = [
                user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
                for i, a in enumerate(op._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            ]
            if any(w is tensor for w in written):
                return user
            if any(r.alias_info is not None for r in op._schema.returns) and user not in seen:
                seen.add(user)
                todo.append(user)
    return None


def _out_of_place(node: fx.Node) -> Any:
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or not op.__name__.split(".")[0].endswith("_"):
        return None
    args = op._schema.arguments
    written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    packet = getattr(torch.ops.aten, op.__name__.split(".")[0][:-1], None)
    src = node.args[0] if node.args else None
    if packet is None or written != args[:1] or not isinstance(src, fx.Node) or len(src.users) != 1:
        return None
    made = src.target
    if src.op != "call_function" or not isinstance(made, torch._ops.OpOverload) or made._schema.is_mutable:
        return None
    if any(r.alias_info is not None for r in made._schema.returns) or op.namespace != "aten":
        return None
    return getattr(packet, op._overloadname, None)


def capture_program(
    model: torch.nn.Module, example: torch.Tensor, dynamic_batch: bool = True, sequence: int | None = None
) -> torch.export.ExportedProgram:
    """Export ``model`` (eval mode) with ``torch.export``: the program whose ``module()`` the engine folds, and
    which ``slabconv.engine.lift.lift_program`` turns the fused graph back into.

    Args:
        model: the network, already in the state it should be folded in (eval mode).
        example: one example input ``(B, ...)`` with ``B >= 2`` so the batch axis can be symbolic.
        dynamic_batch: mark axis 0 of the input dynamic; falls back to a static batch when the model's code
            specialises it.
        sequence: token-id models: the longest sequence the model takes; axis 1 is then symbolic up to it (falls
            back to the example's length when the model's code specialises it).

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the model (the message carries its reason).
    """
    attempts = axis_attempts(model, sequence) if dynamic_batch else [None]
    last: Exception | None = None
    for axes in attempts:
        try:
            return torch.export.export(model, (example,), dynamic_shapes=(axes,) if axes else None)
        except Exception as err:  # noqa: BLE001 - report torch.export's own reason
            last = err
    first_line = str(last).strip().splitlines()[0] if last else "unknown error"
    raise UnsupportedModelError(
        f"torch.export could not trace the model: {first_line}; make the model's code exportable and pass the "
        "program instead: torch.export.save(torch.export.export(model, (x,), "
        "dynamic_shapes=({0: torch.export.Dim('batch')},)), 'model.pt2')"
    )


def attr(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node names, None for None; raises ``TypeError`` for anything else."""
    if node is None:
        return None
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return stored(gm, str(node.target))
    raise TypeError(f"{node} is not a parameter")


def stored(gm: fx.GraphModule, target: str) -> Any:
    """The attribute at the dotted ``target`` of ``gm`` (a parameter, buffer or constant tensor)."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


STATE = "slabconv_state"
"""``get_attr`` node meta: True when its tensor is the model's own state, False when it is a constant the
exporter computed or wrote (set by the ONNX lowering, whose graph module holds every initializer as a buffer)."""

LIFTED = re.compile(r"(c_)?(lifted_tensor|_tensor_constant)_?\d+")
"""How ``torch.export`` names a tensor the forward made (``torch.tensor([0.5])``) when it lifts it as a constant
(``lifted_tensor_0``; ``_tensor_constant0`` in older releases; ``c_`` as a program input)."""


def is_state(node: fx.Node) -> bool:
    """True when ``node`` is a ``get_attr`` of a tensor the model holds: a parameter, a buffer, or a tensor
    attribute (``self.scale = torch.tensor([0.5])``, which ``torch.export`` keeps under its name), not a tensor its
    forward made (a lifted constant, ``LIFTED``). ONNX stores both as named initializers, so the model's own
    names are what both doors can tell apart; an ONNX original's ``get_attr`` says so in ``node.meta[STATE]``
    (``slabconv.engine.onnx_lower``)."""
    if node.op != "get_attr":
        return False
    if STATE in node.meta:
        return bool(node.meta[STATE])
    return not LIFTED.fullmatch(str(node.target).rsplit(".", 1)[-1])


def written_tensors(gm: fx.GraphModule) -> set[str]:
    """The ``get_attr`` targets ``gm`` may write into as it runs (a buffer a model updates in its forward, a call
    counter; ``torch.export`` keeps such updates as in-place ops, parameters included).

    Conservative: a stored tensor counts as written unless every use is an ATen op that writes none of its
    arguments (``FunctionSchema.is_mutable``) and every view an op returns of it (a return with alias
    information, ``t``, ``view``) is used the same way. Any other use (a higher-order op, a submodule, the graph's
    output) counts as a write.
    """
    return {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(stored(gm, str(n.target)), torch.Tensor) and _may_write(n)
    }


@contextlib.contextmanager
def state_kept(*gms: fx.GraphModule) -> Iterator[None]:
    """Run ``gms`` inside and leave the tensors they write (``written_tensors``: a call counter or running
    statistic a forward updates in place) as they were: a probe run must not change the state a file is written
    with (the program's own values)."""
    saved = [(t, t.detach().clone()) for gm in gms for name in written_tensors(gm) for t in [stored(gm, name)]]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)


def copy_sharing(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` that shares every stored tensor the graph never writes (``written_tensors``): the
    engine and the float64 promotion replace a tensor (``set_tensor``, a new attribute), never write into one, so
    the copy costs the graph and modules, not the weights. A tensor the graph updates as it runs (a counter in a
    forward) is copied, so running one graph leaves the other's state alone."""
    written = written_tensors(gm)
    stored = [*gm.named_parameters(), *gm.named_buffers()]
    with warnings.catch_warnings():  # torch's own copy of its pytree specs warns about torch's deprecated LeafSpec
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        return copy.deepcopy(gm, {id(t): t for name, t in stored if name not in written})


def _may_write(node: fx.Node) -> bool:
    for user in node.users:
        op = user.target
        if user.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            return True
        schema = op._schema
        if schema.is_mutable:
            return True
        if any(r.alias_info is not None for r in schema.returns) and _may_write(user):
            return True
    return False


def is_param(node: Any) -> bool:
    """True for None (an absent bias) or a ``get_attr`` node (a stored tensor)."""
    return node is None or (isinstance(node, fx.Node) and node.op == "get_attr")


def op_arg(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    """An op's argument as ``torch.export`` may record it: positional at ``position``, else the keyword ``name``,
    else the schema's ``default``."""
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def shape_of(node: Any) -> tuple[Any, ...] | None:
    """The (possibly symbolic) shape of a node's value, None when it is not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def rank(node: fx.Node) -> int:
    """The number of axes of a node's tensor; raises ``UnsupportedModelError`` without shape metadata."""
    shape = shape_of(node)
    if shape is None:
        raise UnsupportedModelError(f"node {node.name} has no shape metadata")
    return len(shape)


def is_float(node: fx.Node) -> bool:
    """True when the node's value is a floating-point tensor."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def expr(x: Any) -> sympy.Expr:
    """A size as a sympy expression (symbolic sizes keep their symbols)."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def same_size(a: Any, b: Any) -> bool:
    """True when two (possibly symbolic) sizes are equal for every value of the symbols."""
    return sympy.simplify(expr(a) - expr(b)) == 0


def same_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """True when two shapes have the same rank and equal sizes on every axis."""
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def static_int(x: Any) -> int | None:
    """The size as an int when it does not depend on a symbol, else None."""
    e = expr(x)
    return int(e) if e.is_Integer else None


def norm_dim(d: int, ndim: int) -> int:
    """A possibly negative axis index as a non-negative one."""
    return d + ndim if d < 0 else d


def module_path(node: fx.Node) -> list[str]:
    """Module paths enclosing ``node``, outermost first (from ``nn_module_stack``; root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [fqn for fqn, _ in stack.values() if fqn]
