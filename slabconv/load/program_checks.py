"""What a ``.pt2`` program may hold before torch reads it (``check_program_archive``): its JSON bounded, every
symbolic shape expression parsed by Python's ``ast`` and checked to be arithmetic over shape symbols before sympy
sees it (``check_expression``, ``guarded_sympify``), and every tensor payload's declared size held to the bytes
the archive stores. The names a program may call are checked by ``slabconv.load.program_names``; the archive
and pickle rules it shares with checkpoints are ``slabconv.load.safety``'s.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from slabconv.errors import InputError
from slabconv.load.safety import (
    MAX_JSON_BYTES,
    MAX_PROGRAM_JSON_BYTES,
    TensorBudget,
    _human,
    check_archive_kind,
    check_zip,
    json_dicts,
    open_regular,
    parse_json,
)

# --------------------------------------------------------------------------------------------- expressions

# What torch.export writes into ``expr_str``: sympy's ``srepr`` of shape expressions, e.g.
# ``Add(Mul(Integer(2), Symbol('s27', positive=True, integer=True)), Integer(12))``, built from sympy's core
# classes and the functions of ``torch.utils._sympy.functions`` (the deserializer's own ``locals``).
_SYMPY_NAMES = frozenset(
    {"Add", "Mul", "Pow", "Integer", "Rational", "Float", "Symbol", "Max", "Min", "Mod", "Abs", "floor", "ceiling"}
    | {"sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan"}
    | {"StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Piecewise", "ExprCondPair", "ITE", "BooleanTrue"}
    | {"BooleanFalse", "true", "false", "True", "False", "oo", "zoo", "nan", "Infinity", "NegativeInfinity", "NaN"}
    | {"One", "Zero", "NegativeOne", "Half"}
)
_ASSUMPTIONS = frozenset(
    {"positive", "negative", "integer", "real", "finite", "nonnegative", "nonpositive", "nonzero", "zero"}
    | {"rational", "even", "odd", "prime", "composite", "extended_real", "commutative", "complex"}
)
_SYMBOL = re.compile(r"^[a-z]{1,3}\d{1,9}$")  # s0, u12, ... (the prefixes of torch.utils._sympy.symbol)
_FLOAT_TEXT = re.compile(r"^-?\d{1,30}(\.\d{0,30})?(e-?\d{1,3})?$")
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift"})  # whose second argument could blow up
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_CMPOPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
MAX_EXPRESSION_CHARS = 4096
MAX_EXPRESSION_NODES = 2000
MAX_EXPONENT = 64


def _torch_sympy_functions() -> frozenset[str]:
    try:
        from torch.utils._sympy import functions
    except ImportError:  # pragma: no cover - every supported torch has it
        return frozenset()
    return frozenset(n for n in dir(functions) if not n.startswith("_") and n[:1].isupper())


_FUNCTIONS = _SYMPY_NAMES | _torch_sympy_functions()


def check_expression(text: object) -> None:
    """Check one symbolic-shape expression string against the grammar torch.export writes.

    Allowed: integer and float literals; shape symbols (``s0``, ``u3``); sympy core / ``torch.utils._sympy``
    function names, called with allowed arguments; ``+ - * / // % **``, comparisons, ``and`` / ``or`` / ``not``.
    A string literal only as the name in ``Symbol('s27', positive=True, integer=True)`` (keywords: sympy
    assumptions set to True/False) or the digits in ``Float('1.5', precision=53)``. Exponents (``**``, ``Pow``,
    ``PowByNatural``, ``FloatPow``, ``LShift``) only small integers, so evaluation cannot run for long. No
    attributes, subscripts, lambdas, comprehensions, dunder names. Parsed with ``ast``, which runs nothing.

    Raises:
        ValueError: the string is not of that grammar (the message says which part).
    """
    if not isinstance(text, str):
        raise ValueError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(text)} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_EXPRESSION_NODES:
        raise ValueError("expression of too many parts")
    _check(tree.body)


def _small_integer(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer":
        node = node.args[0] if len(node.args) == 1 and not node.keywords else node
    return isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= MAX_EXPONENT


def _check(node: ast.AST) -> None:
    """Recursive descent over the allowed node kinds (see ``check_expression``)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is bool or (type(value) is int and abs(value) <= 2**64):
            return
        if type(value) is float and math.isfinite(value):
            return
        raise ValueError(f"literal {str(value)[:20]!r}")
    if isinstance(node, ast.Name):
        if node.id in _FUNCTIONS or _SYMBOL.match(node.id):
            return
        raise ValueError(f"name {node.id[:30]!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
        return _check(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
        if isinstance(node.op, ast.Pow) and not _small_integer(node.right):
            raise ValueError("a power whose exponent is not a small integer")
        _check(node.left)
        return _check(node.right)
    if isinstance(node, ast.Compare) and all(isinstance(op, _CMPOPS) for op in node.ops):
        for part in (node.left, *node.comparators):
            _check(part)
        return None
    if isinstance(node, ast.BoolOp):
        for part in node.values:
            _check(part)
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        return _check_call(node.func.id, node)
    raise ValueError(f"{type(node).__name__} syntax")


def _check_call(name: str, node: ast.Call) -> None:
    args = list(node.args)
    if any(isinstance(a, ast.Starred) for a in args):
        raise ValueError("a starred argument")
    if name == "Symbol":
        if len(args) != 1 or not (isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
            raise ValueError("a Symbol without one name")
        if not _SYMBOL.match(args[0].value):
            raise ValueError(f"symbol name {args[0].value[:30]!r}")
        for kw in node.keywords:
            if kw.arg not in _ASSUMPTIONS or not (isinstance(kw.value, ast.Constant) and type(kw.value.value) is bool):
                raise ValueError(f"Symbol keyword {kw.arg!r}")
        return None
    if name == "Float":
        if not args or not isinstance(args[0], ast.Constant):
            raise ValueError("a Float without a value")
        value = args[0].value
        if isinstance(value, str) and not _FLOAT_TEXT.match(value):
            raise ValueError(f"Float text {value[:30]!r}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or len(args) > 1:
            raise ValueError("a Float of something other than a number")
        for kw in node.keywords:
            if (
                kw.arg not in ("precision", "dps")
                or not _small_integer(kw.value)
                and not (
                    isinstance(kw.value, ast.Constant) and type(kw.value.value) is int and 0 < kw.value.value <= 1024
                )
            ):
                raise ValueError(f"Float keyword {kw.arg!r}")
        return None
    if node.keywords:
        raise ValueError(f"keyword arguments to {name}")
    if name in _POWERS and (len(args) != 2 or not _small_integer(args[1])):
        raise ValueError(f"{name} whose exponent is not a small integer")
    for a in args:
        _check(a)
    return None


@contextlib.contextmanager
def guarded_sympify(label: str) -> Iterator[None]:
    """While a program loads, ``sympy.sympify`` accepts only strings that pass ``check_expression``."""
    import sympy

    real = sympy.sympify

    def checked(a: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(a, str):
            try:
                check_expression(a)
            except ValueError as err:
                raise InputError(
                    f"{label}: a symbolic shape in the program is not a shape expression ({err})"
                ) from None
        return real(a, *args, **kwargs)

    sympy.sympify = checked  # type: ignore[assignment]
    try:
        yield
    finally:
        sympy.sympify = real


# --------------------------------------------------------------------------------------------- .pt2 archives

# Entry kinds of a .pt2 (torch.export.pt2_archive), relative to the archive's root folder. Anything else is
# refused: ``data/aotinductor/`` and ``data/executorch/`` hold native code that torch would load and run.
_PT2_ALLOWED = re.compile(
    r"^(archive_format|archive_version|byteorder|version|\.data/[\w.-]+|models/[\w.-]+\.json|"
    r"data/(weights|constants|sample_inputs)/[\w.-]+|extra/[\w./-]+|extra_files/[\w./-]+|"
    r"serialized_(exported_program|state_dict|constants)\.json|serialized_(state_dict|constants|example_inputs)\.pt)$"
)


def check_program_archive(
    source: Path | IO[bytes], trust_pickle: bool = False, label: str | None = None, file_bytes: int | None = None
) -> None:
    """Check a ``.pt2`` before ``torch.export.load`` sees it (rules 2, 3, 4 and 6 of the module docstring).

    Args:
        source: the open file that ``torch.export.load`` will then read (so both read the same bytes), or a path.
        trust_pickle: accept pickled Python objects in weights and constants (``--trust-pickle``).
        label: the user's path, for errors (default: ``source`` when it is a path).
        file_bytes: the file's size (default: measured).

    Raises:
        InputError: naming the entry, expression, node, name or tensor that breaks a rule.
    """
    from slabconv.load.program_names import check_program_document

    if isinstance(source, Path):
        with open_regular(source, "the program") as f:
            return check_program_archive(f, trust_pickle, label or str(source), file_bytes)
    label = label or "program"
    file_bytes = file_bytes if file_bytes is not None else os.fstat(source.fileno()).st_size
    names = check_zip(source, label)
    check_archive_kind(source, label, names)
    with zipfile.ZipFile(source) as archive:
        sizes = {info.filename: info.file_size for info in archive.infolist()}
        roots = {n.split("/", 1)[0] for n in names if "/" in n}
        for name in names:
            rel = name.split("/", 1)[1] if "/" in name else name
            if name.endswith("/"):
                continue
            if not _PT2_ALLOWED.match(rel):
                what = (
                    "native code (AOTInductor / ExecuTorch), which torch would load and run"
                    if (rel.startswith(("data/aotinductor/", "data/executorch/", "data/mtia")))
                    else "an entry of a kind slabconv does not read"
                )
                raise InputError(f"{label}: archive entry {rel!r} holds {what}; refused")
        for name in names:
            if not name.endswith(".json"):
                continue
            rel = name.split("/", 1)[1] if "/" in name else name
            is_program = rel.startswith("models/") or rel == "serialized_exported_program.json"
            limit = MAX_PROGRAM_JSON_BYTES if is_program else MAX_JSON_BYTES
            if sizes[name] > limit:
                raise InputError(
                    f"{label}: archive entry {rel!r} is {_human(sizes[name])} of JSON, over slabconv's limit of "
                    f"{_human(limit)}; refused"
                )
            document = parse_json(archive.read(name), f"{label}: {rel}", limit)
            if is_program:
                check_program_document(document, label, rel)
            _check_expressions(document, label, name)
            if name.endswith(("_weights_config.json", "_constants_config.json")):
                folder = name.rsplit("/", 1)[0]
                _check_payloads(document, sizes, folder, label, file_bytes, trust_pickle)
    source.seek(0)
    if len(roots) > 1:
        raise InputError(f"{label}: the archive has {len(roots)} root folders; a .pt2 has one")
    return None


def _check_expressions(document: Any, label: str, entry: str) -> None:
    for item in json_dicts(document, skip=("expr_str",)):
        if "expr_str" not in item:
            continue
        try:
            check_expression(item["expr_str"])
        except ValueError as err:
            shown = str(item["expr_str"])[:60]
            raise InputError(
                f"{label}: {entry} has a symbolic shape {shown!r} that is not a shape expression ({err}); "
                "torch would evaluate it as Python: refused"
            ) from None


def _dtype(code: Any) -> tuple[str, int]:
    """The name and bytes per element of a torch.export schema ``ScalarType`` code (16, the largest, if unknown)."""
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    for key, dtype in _SERIALIZE_TO_TORCH_DTYPE.items():
        if int(key) == int(code):
            return str(dtype).removeprefix("torch."), torch.empty((), dtype=dtype).element_size()
    return f"dtype {code}", 16


def _check_payloads(
    document: Any, sizes: Mapping[str, int], folder: str, label: str, file_bytes: int, trust_pickle: bool
) -> None:
    """Weights / constants config: every tensor's declared extent fits its stored bytes, the total fits the file
    (``safety.TensorBudget``), and nothing is a pickled Python object (unless trusted)."""
    config = document.get("config") if isinstance(document, dict) else None
    if not isinstance(config, dict):
        raise InputError(f"{label}: {folder} has no payload config; the program is damaged")
    budget = TensorBudget(label, file_bytes)
    for fqn, meta in config.items():
        if not isinstance(meta, dict):
            raise InputError(f"{label}: payload {fqn!r} is not described; the program is damaged")
        path_name = str(meta.get("path_name", ""))
        pickled = bool(meta.get("use_pickle")) or path_name.startswith(("custom_obj_", "opaque_obj_"))
        if pickled and not trust_pickle:
            raise InputError(
                f"{label}: the program holds pickled Python objects ({fqn!r}), which slabconv will not load "
                "(loading them could run code); re-export it with tensor weights only, or pass --trust-pickle "
                "if you trust this file"
            )
        tmeta = meta.get("tensor_meta")
        if pickled or not isinstance(tmeta, dict):
            continue
        try:
            shape = [_as_int(s) for s in tmeta["sizes"]]
            strides = [_as_int(s) for s in tmeta["strides"]]
            offset = _as_int(tmeta["storage_offset"])
            dtype, itemsize = _dtype(tmeta["dtype"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{label}: payload {fqn!r} has no static size; the program is damaged") from None
        if any(s < 0 for s in shape) or any(s < 0 for s in strides) or offset < 0 or len(shape) != len(strides):
            raise InputError(f"{label}: payload {fqn!r} has a negative or mismatched size; the program is damaged")
        numel = math.prod(shape)
        stored = sizes.get(f"{folder}/{path_name}")
        if stored is None:
            raise InputError(f"{label}: payload {fqn!r} names {path_name!r}, which the archive lacks")
        extent = 0 if numel == 0 else offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
        if extent * itemsize > max(stored, 0) and not (numel == 0):
            raise InputError(
                f"{label}: payload {fqn!r} declares {shape} elements but {path_name!r} stores {stored} bytes; refused"
            )
        budget.add(f"payload {fqn!r}", shape, dtype, numel * itemsize)


def _as_int(value: Any) -> int:
    if isinstance(value, dict) and "as_int" in value and type(value["as_int"]) is int:
        return int(value["as_int"])
    raise ValueError("not a static size")
