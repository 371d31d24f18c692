"""What a ``.pt2`` program may name: checked in its JSON before ``torch.export.load`` resolves any of it.

torch's deserializer (``torch/_export/serde/serialize.py``, torch 2.13) turns strings of the program's JSON into
Python objects in five places, and each can be steered by the file:

- **operator names** (``nodes[].target``, ``as_operator`` arguments, the ``source_fn_stack`` metadata):
  ``deserialize_operator`` walks ``getattr`` from ``torch`` / ``operator`` / ``math`` along any name that starts
  with ``torch``, ``_operator`` or ``math`` and accepts whatever callable it reaches (``torch.hub.load``,
  ``torch.ops.import_module``, the dangerous higher-order ops such as ``inductor_compiled_code``); ``#ns/op``
  looks up an extension registry.
- **tree specs** (``module_call_graph[].signature.in_spec`` / ``out_spec``): ``treespec_loads`` imports the module
  an ``{"__enum__": true, "fqn": "module:Name"}`` context names (``torch.utils._pytree.enum_object_hook``) and the
  ``default_factory_module`` of a ``collections.defaultdict`` context, then looks the name up in it.
- **guards** (``guards_code``): ``ExportedProgram.module()`` pastes each string into Python source and ``exec``\\ s
  it (``torch.export._unlift._convert_guards_code_to_fn``); the guard runs with every call of the model.
- **symbolic shapes** (``expr_str``): ``sympy.sympify`` -- checked by ``program_checks.check_expression``.

``check_program_document`` accepts only: operator names of the namespaces torch itself ships (``aten``, ``prims``)
and the higher-order ops in ``HIGHER_ORDER_OPS`` (control flow and grad/autocast wrappers, which hold only
subgraphs of the same program), the symbolic-integer helpers torch.export writes for shapes (``SYM_OPS``), tree
spec types of plain containers, no enum or ``defaultdict`` context, guards of the shape grammar (``L['x'].size()[0]``
compared with integers), at most ``MAX_GRAPH_NODES`` nodes, and in ``source_fn_stack`` (metadata torch stores,
never calls) the functions a strict export records (``_source_function``). Nothing is imported to check it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

from slabconv.errors import InputError
from slabconv.load.safety import json_dicts

MAX_GRAPH_NODES = 10_000
"""Nodes in a program's graphs (all subgraphs counted). torch deserializes about 200 nodes a second on one core (a
program padded with 30,000 nodes took 152 s), so this bounds the load to under a minute; a DeiT-B program has about
750 nodes, a 32-layer LLaMA about 3,000 (measured on small zoo models: 60 and 90 nodes a block)."""

MAX_NAME_CHARS = 200

OPERATOR_NAMESPACES = ("aten", "prims")
"""``torch.ops.<namespace>.<op>[.<overload>]`` names slabconv accepts: the operator libraries torch itself ships.
Looking an operator up there is a lookup in torch's C++ registry (no import, no Python attribute chosen freely)."""

HIGHER_ORDER_OPS = frozenset(
    {
        "cond",
        "while_loop",
        "while_loop_stack_output",
        "map_impl",
        "scan",
        "associative_scan",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "invoke_subgraph",
    }
)
"""``torch.ops.higher_order.<name>`` ops that only run subgraphs of the same program (and so only ATen ops). Others
are refused: some run code outside the graph (``inductor_compiled_code``, ``invoke_leaf_function``,
``flat_apply``, ``call_torchbind``, ``triton_kernel_wrapper_*``, ``executorch_call_delegate``,
``aoti_call_delegate``, ``autograd_function_apply``, ...)."""

SYM_OPS = frozenset(
    {f"_operator.{n}" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "getitem")}
    | {f"_operator.{n}" for n in ("eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "lshift", "rshift")}
    | {"math.trunc", "torch.sym_int", "torch.sym_float", "torch.sym_ite", "torch.sym_max", "torch.sym_min"}
    | {"torch.sym_not", "torch._sym_sqrt"}
)
"""The Python-level operators on symbolic sizes torch.export writes (``torch._export.serde.serialize._SYM_OPS``
named as ``serialize_operator`` names them)."""

_OPERATOR = re.compile(
    r"^torch\.ops\.(?:(?:" + "|".join(OPERATOR_NAMESPACES) + r")\.[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?"
    r"|higher_order\.(?P<hop>[A-Za-z_][A-Za-z0-9_]*))$"
)
_RESOLVED_PREFIXES = ("torch", "_operator", "math", "#")  # what deserialize_operator looks up (else kept a string)

TREESPEC_TYPES = frozenset(
    {
        "builtins.tuple",
        "builtins.list",
        "builtins.dict",
        "collections.OrderedDict",
        "collections.namedtuple",
        "collections.deque",
        "torch.fx.immutable_collections.immutable_list",
        "torch.fx.immutable_collections.immutable_dict",
        "torch.Size",
    }
)
"""Container types a program's input/output tree may have (looked up by name in torch's pytree registry)."""

# Guards: what torch.export writes (``L['x'].size()[0] <= 1024``, ``2 <= L['x'].size()[0]``), sympy-printed
# arithmetic on those sizes, and a few pure functions of numbers.
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_FUNCTIONS = frozenset(
    {"Eq", "Ne", "Max", "Min", "Mod", "FloorDiv", "CleanDiv", "PythonMod", "IntTrueDiv", "TruncToInt", "floor"}
    | {"ceiling", "sqrt", "abs", "int", "float", "min", "max", "round"}
)
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf", "isfinite", "inf"})
MAX_GUARD_CHARS = 4096
MAX_GUARDS = 10_000


def _refuse(label: str, where: str, what: str) -> InputError:
    return InputError(f"{label}: {where} {what}; slabconv reads programs of ATen operators only: refused")


def _shown(text: object) -> str:
    return repr(str(text)[:80])


def operator_problem(name: object) -> str | None:
    """Why an operator name of a program is refused, or None when it is accepted (see the module docstring)."""
    if not isinstance(name, str):
        return f"is not a name ({type(name).__name__})"
    if len(name) > MAX_NAME_CHARS:
        return f"is a name of {len(name)} characters"
    if name in SYM_OPS:
        return None
    match = _OPERATOR.match(name)
    if match is None:
        return f"names {_shown(name)}, which is not an operator torch ships"
    hop = match.group("hop")
    if hop is not None and hop not in HIGHER_ORDER_OPS:
        return f"names the higher-order op {_shown(name)}, which can run code outside the program"
    return None


def _source_function(target: str) -> bool:
    """True when a ``source_fn_stack`` entry names a function a strict ``torch.export`` traced: one name, a function
    (not a module or a class) already in the namespace of ``torch.nn.functional``, ``torch._C._nn``, ``torch`` or
    ``_operator`` (``torch.nn.functional.batch_norm``, ``torch._C._nn.gelu``, ``torch.conv2d``, ``torch._weight_norm``,
    ``_operator.matmul``). Such an entry is metadata: torch's deserializer (``deserialize_meta_func``) looks it up and
    stores it; nothing calls it. It is looked up here in the module's ``__dict__`` only, which imports nothing (a
    ``getattr`` on ``torch`` may import a submodule). A module class (``torch.nn.modules.linear.Linear``) is checked
    by the caller."""
    import operator
    import types

    import torch

    spaces = (("torch.nn.functional.", torch.nn.functional), ("torch._C._nn.", torch._C._nn), ("torch.", torch),
              ("_operator.", operator))  # fmt: skip
    for prefix, module in spaces:
        if target.startswith(prefix):
            name = target[len(prefix) :]
            if not re.fullmatch(r"_?[A-Za-z][A-Za-z0-9_]*", name):
                return False
            found = vars(module).get(name)
            return callable(found) and not isinstance(found, (type, types.ModuleType))
    return False


def _resolved(name: object) -> bool:
    """True when torch's deserializer would look ``name`` up (rather than keep it as a string)."""
    return isinstance(name, str) and name.startswith(_RESOLVED_PREFIXES)


def check_program_document(document: Any, label: str, entry: str) -> None:
    """Check one program JSON (``models/<name>.json`` of a ``.pt2``) before torch resolves anything in it.

    Args:
        document: the parsed JSON (``torch._export.serde.schema.ExportedProgram`` as dicts).
        label: the user's path, for errors.
        entry: the archive entry, for errors.

    Raises:
        InputError: naming the node and the name that breaks a rule of the module docstring, or the number of nodes.
    """
    if not isinstance(document, dict):
        raise InputError(f"{label}: {entry} is not a program (a JSON object is expected); the file is damaged")
    nodes = 0
    for graph in _graphs(document):
        listed = graph.get("nodes")
        if not isinstance(listed, list):
            continue
        nodes += len(listed)
        if nodes > MAX_GRAPH_NODES:
            raise InputError(
                f"{label}: the program has more than {MAX_GRAPH_NODES} nodes (slabconv's limit; see "
                "docs/security.md); refused before reading it"
            )
        for node in listed:
            _check_node(node, label)
    for signature in _signatures(document):
        for key in ("in_spec", "out_spec"):
            if key in signature:
                _check_treespec(signature[key], label, key)
    _check_guards(document.get("guards_code"), label)


def _graphs(document: Any) -> Iterator[dict[str, Any]]:
    """Every graph object in the document: the main graph and every subgraph (``as_graph`` arguments)."""
    for item in json_dicts(document):
        if isinstance(item.get("nodes"), list) and "inputs" in item and "outputs" in item:
            yield item


def _signatures(document: Any) -> Iterator[dict[str, Any]]:
    module = document.get("graph_module")
    calls = module.get("module_call_graph") if isinstance(module, dict) else None
    for call in calls if isinstance(calls, list) else []:
        signature = call.get("signature") if isinstance(call, dict) else None
        if isinstance(signature, dict):
            yield signature


def _node_name(node: Any) -> str:
    name = node.get("name") if isinstance(node, dict) else None
    return f"node {str(name)[:60]!r}" if name else "a node"


def _check_node(node: Any, label: str) -> None:
    if not isinstance(node, dict):
        raise InputError(f"{label}: a graph node is not an object; the program is damaged")
    problem = operator_problem(node.get("target"))
    if problem is not None:
        raise _refuse(label, f"{_node_name(node)} of the program", problem)
    # subgraphs (as_graph) are checked as graphs of their own
    for item in json_dicts([node.get("inputs"), node.get("outputs")], skip=("as_operator", "as_graph")):
        problem = operator_problem(item["as_operator"]) if "as_operator" in item else None
        if problem is not None:
            raise _refuse(label, f"an argument of {_node_name(node)}", problem)
    metadata = node.get("metadata")
    if isinstance(metadata, dict):
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise InputError(
                    f"{label}: the program's metadata {key!r} of {_node_name(node)} is not text; the program is damaged"
                )
        for part in (metadata.get("source_fn_stack") or "").split(";"):
            target = part.split(",", 1)[1] if "," in part else ""
            if _source_function(target):
                continue
            if _resolved(target) and not target.startswith("torch.nn.") and operator_problem(target) is not None:
                raise _refuse(label, f"the source_fn_stack of {_node_name(node)}", f"names {_shown(target)}")
            if target.startswith("torch.nn.") and not re.match(r"^torch\.nn\.(modules\.\w+\.)?[A-Z]\w*$", target):
                raise _refuse(label, f"the source_fn_stack of {_node_name(node)}", f"names {_shown(target)}")


def _check_treespec(text: Any, label: str, key: str) -> None:
    """A serialized pytree spec: plain container types, contexts without enum or import references."""
    where = f"the program's {key}"
    if not isinstance(text, str):
        raise InputError(f"{label}: {where} is not text; the program is damaged")
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError(f"{label}: {where} is not valid JSON; the program is damaged") from None
    stack = [spec[1] if isinstance(spec, list) and len(spec) == 2 else spec]
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            raise InputError(f"{label}: {where} is not a tree spec; the program is damaged")
        kind = item.get("type")
        if kind is not None and kind not in TREESPEC_TYPES:
            raise _refuse(label, where, f"names the type {_shown(kind)} (torch would look it up or import it)")
        context = item.get("context")
        if isinstance(context, str):
            try:
                parsed = json.loads(context)
            except (ValueError, RecursionError):
                parsed = None  # a context torch does not parse as JSON is handed to the type's own reader
            if _has_enum(parsed):
                raise _refuse(label, where, "names an enum class, which torch would import")
        children = item.get("children_spec")
        if isinstance(children, list):
            stack.extend(children)


def _has_enum(value: Any) -> bool:
    return any("__enum__" in item for item in json_dicts(value))


def _check_guards(guards: Any, label: str) -> None:
    """``guards_code``: each string an expression of the shape grammar (torch ``exec``\\ s them)."""
    if guards is None:
        return
    if not isinstance(guards, list) or len(guards) > MAX_GUARDS:
        raise InputError(f"{label}: the program's guards_code is not a list of guards; the program is damaged")
    for guard in guards:
        try:
            check_guard(guard)
        except ValueError as err:
            raise InputError(
                f"{label}: the program's guard {_shown(guard)} is not a shape check ({err}); torch would run it as "
                "Python: refused"
            ) from None


def check_guard(text: object) -> None:
    """Check one guard string against the grammar torch.export writes (``L['x'].size()[0] <= 1024``).

    Allowed: integer and float literals; ``L[...]`` subscripted by string or integer constants, then ``.size()``,
    ``.stride()``, ``.storage_offset()``, ``.dim()``, ``.numel()`` and integer subscripts; arithmetic,
    comparisons, ``and`` / ``or`` / ``not``; calls of the sympy printer's functions (``Eq``, ``Max``, ``Mod``, ...)
    and of ``math.floor`` / ``ceil`` / ``trunc`` / ``sqrt`` / ``isnan`` / ``isinf`` / ``isfinite``. One line. Parsed
    with ``ast``, which runs nothing.

    Raises:
        ValueError: the string is not of that grammar.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_GUARD_CHARS or "\n" in text or "\r" in text:
        raise ValueError("not one short line")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None
    _guard(tree.body)


def _guard(node: ast.AST) -> None:
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float, bool):
            return
        raise ValueError("a literal that is not a number")
    if isinstance(node, ast.Name):
        if node.id in ("L", "inf"):
            return
        raise ValueError(f"name {node.id[:30]!r}")
    if isinstance(node, ast.Subscript):
        index = node.slice
        if not (isinstance(index, ast.Constant) and type(index.value) in (int, str)):
            raise ValueError("a subscript that is not a constant")
        if isinstance(index.value, str) and not re.match(r"^\w{1,200}$", index.value):
            raise ValueError("a subscript that is not an argument name")
        return _guard(node.value)
    if isinstance(node, ast.Attribute):  # only math.<function> reaches here (methods are checked as calls)
        if isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _GUARD_MATH:
            return None
        raise ValueError(f"attribute {node.attr[:30]!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
        return _guard(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(
        node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
    ):
        _guard(node.left)
        return _guard(node.right)
    if isinstance(node, ast.Compare):
        for part in (node.left, *node.comparators):
            _guard(part)
        return None
    if isinstance(node, ast.BoolOp):
        for part in node.values:
            _guard(part)
        return None
    if isinstance(node, ast.Call) and not node.keywords:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _GUARD_METHODS and not isinstance(func.value, ast.Name):
            if node.args:
                raise ValueError(f"arguments to {func.attr}()")
            return _guard(func.value)
        if isinstance(func, ast.Name) and func.id in _GUARD_FUNCTIONS:
            pass
        elif not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math"):
            raise ValueError("a call of something other than a size or a number function")
        else:
            _guard(func)
        for arg in node.args:
            _guard(arg)
        return None
    raise ValueError(f"{type(node).__name__} syntax")
