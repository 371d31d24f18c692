"""An ONNX file as an original to fold (``fuse``, ``inspect``, ``verify``), read by one checked loader.

Safety (``docs/security.md``): an ONNX file cannot run code, but it names files (external data), declares sizes
and dtypes its readers allocate from, and holds graphs onnx-ir and onnxruntime trust to be well formed. Nothing
else reads an original before this module has:

1. opened the ``.onnx`` once (a regular file, at most protobuf's 2 GiB), hashed and parsed those bytes;
2. checked every tensor the file holds (``check_tensors``): initializers, sparse initializers, the tensors of node
   attributes (``Constant`` values) in the graph, every subgraph (``If``/``Loop`` bodies), every function and
   training graph. Each dtype must be one slabconv folds or an integer (``safety.unfoldable_dtype`` otherwise),
   each dim non-negative, the bytes all tensors take once materialised within the limits checkpoints have
   (``safety.TensorBudget``), and each tensor must hold exactly the bytes its shape declares: inline, or in an
   external data file whose ``location`` is a plain relative path inside the model's folder, not a link, a
   regular file (a FIFO would block its reader forever) that holds ``offset + length`` bytes;
3. checked the graph against ONNX's own rules (``onnx.checker``, strict shape and type inference), its inputs are
   tensors of numbers, and no ``BatchNormalization`` uses ``spatial=0``;
4. read every external data file once, sequentially, hashing it and copying each tensor's bytes into the model
   (``raw_data``): the model that is folded is the one that was checked and hashed, and a file truncated or
   rewritten later changes nothing (one that shrinks while it is read is named).

``load_ir`` hands onnx-ir that checked model; onnx-ir never opens a file of the original. Every failure of the
libraries underneath is one line naming the file (``InputError``, exit 2).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slabconv.errors import InputError, first_line
from slabconv.load import safety
from slabconv.load.source import Source

ONNX_SUFFIX = ".onnx"
"""How an ONNX original is named (``slabconv.load.formats`` recognises it by this suffix, in any case)."""

PROTOBUF_LIMIT_BYTES = 2**31 - 1
"""The largest message protobuf parses: one ``.onnx`` file without external data cannot be larger."""

MAX_LOCATION_CHARS = 4096
"""The longest external data ``location`` (Linux's PATH_MAX); each of its parts at most 255 characters."""

MAX_INLINED_NODES = 1_000_000
"""The most nodes a graph may have once every call of a model-local function is replaced by the function's body
(``onnx_lower.prepare`` inlines them): a function that calls another twice, nested, doubles the count at each
level, so a small file could ask for billions of nodes."""

_FLOAT_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}
"""ONNX ``TensorProto`` element types of floats, by name (onnx/onnx.proto)."""

_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
"""Bytes per element of the ONNX element types an original may hold: the floats slabconv folds and the integers
and booleans of shapes, ids and masks. Every other type (complex, float8 and narrower, int4, string) is refused."""

_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
"""The ``TensorProto`` fields that hold values one by one (instead of ``raw_data``)."""

_EXTERNAL = 1  # TensorProto.EXTERNAL
_BYTE_COUNT = re.compile(r"[0-9]{1,19}")


@dataclass
class OnnxFile:
    """What an ``.onnx`` original is.

    Attributes:
        path: the file.
        sha256: of the ``.onnx`` file; ``files_sha256`` of it and its external data files, by name, each from the
            bytes that were read into ``proto``.
        files: the ``.onnx`` and its external data files, in order.
        external: its tensors live (partly) in external data files.
        opset: the default-domain opset; ``domains``: every imported domain and version.
        producer: ``producer_name producer_version``.
        exporter: which of torch's ONNX exporters wrote it (``torch_exporter``): ``dynamo``, ``torchscript``, or
            None (another producer, or a file that does not tell).
        dtype: the floating dtype of its first float input (else of its largest float initializer): ``float32``,
            ``float16``, ``bfloat16`` or ``float64``.
        input_name: its first graph input.
        input_shape: one sample's input shape without the batch axis, when every axis but the batch is static.
        batch: the batch size when the batch axis is static, else None.
        token_input: the first input is integer ids; ``dynamic_sequence``: it is ``(batch, tokens)`` with a symbolic
            token axis (a language model's sequence).
        inputs: every graph input (``GraphInput``), in order.
        proto: the checked ``onnx.ModelProto``, every tensor's data inside it (none external): what ``load_ir``
            hands onnx-ir.
    """

    path: Path
    sha256: str
    files: list[Path]
    external: bool
    opset: int
    domains: dict[str, int]
    producer: str
    dtype: str
    input_name: str
    input_shape: tuple[int, ...] | None
    batch: int | None
    token_input: bool
    dynamic_sequence: bool = False
    exporter: str | None = None
    files_sha256: dict[str, str] = field(default_factory=dict)
    inputs: list[GraphInput] = field(default_factory=list)
    proto: Any = field(default=None, repr=False)

    def source(self) -> Source:
        """The report's ``source`` block of this file, as ``fuse`` and ``inspect`` report an ONNX original and
        ``verify`` either side: its format, dtype, input shape and batch, opset, producer, exporter, domains, and
        the sha256 of each file."""
        return Source(
            path=str(self.path),
            sha256=self.sha256,
            format="onnx",
            dtype=self.dtype,
            input_shape=list(self.input_shape) if self.input_shape else None,
            batch=self.batch,
            extra={
                "opset": self.opset,
                "producer": self.producer,
                "exporter": self.exporter,
                "domains": self.domains,
                "external_data": self.external,
                "files_sha256": self.files_sha256,
            },
        )


@dataclass
class GraphInput:
    """One graph input: ``name``, its numpy ``dtype`` (``bool``, ``int64``, ``float32``...), ``shape`` (one
    sample's shape without the batch axis, None when an axis besides the batch is dynamic), ``dims`` (the declared
    shape, a dynamic axis None; ``()`` for a scalar)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] | None
    dims: tuple[int | None, ...] = ()

    @property
    def integer(self) -> bool:
        return bool(np.issubdtype(self.dtype, np.integer) or self.dtype == np.bool_)


def _graph_input(info: Any) -> GraphInput:
    import onnx

    tensor = info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    rest = dims[1:]
    elem = tensor.elem_type
    dtype = np.dtype(np.float32) if elem == 16 else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    shape = tuple(int(d or 0) for d in rest) if all(d is not None and d > 0 for d in rest) else None
    return GraphInput(info.name, dtype, shape if dims else None, tuple(d or None for d in dims))


# --------------------------------------------------------------------------------------------- every tensor


def tensors(model: Any) -> Iterator[tuple[str, Any, list[int] | None]]:
    """Every tensor an ONNX reader could read from ``model`` (an ``onnx.ModelProto``), named for messages:
    ``(what, TensorProto, dense dims)``, the dense dims given for the values of a sparse tensor (a reader
    may expand it to them), else None.

    Walks the graph, its subgraphs (node attributes ``g`` / ``graphs``, at any depth: protobuf bounds the
    nesting), the model's functions and training graphs; in each, initializers, sparse initializers and the
    tensors of node attributes (``t``, ``tensors``, ``sparse_tensor``, ``sparse_tensors``), whatever the
    attribute's declared type says.
    """
    stack: list[tuple[Any, str, bool]] = [(model.graph, "", True)]
    stack += [(g, " in a training graph", True) for t in model.training_info for g in (t.initialization, t.algorithm)]
    stack += [(f.node, f" in function {f.name[:80]!r}", False) for f in model.functions]
    while stack:
        item, where, is_graph = stack.pop()
        nodes = item.node if is_graph else item
        if is_graph:
            for t in item.initializer:
                yield f"initializer {t.name[:80]!r}{where}", t, None
            for s in item.sparse_initializer:
                yield from _sparse(f"sparse initializer {s.values.name[:80]!r}{where}", s)
        for node in nodes:
            at = f"node {node_label(node)[:80]!r}{where}"
            for a in node.attribute:
                what = f"the tensor of {at} (attribute {a.name[:40]!r})"
                if a.HasField("t"):
                    yield what, a.t, None
                for t in a.tensors:
                    yield what, t, None
                if a.HasField("sparse_tensor"):
                    yield from _sparse(what, a.sparse_tensor)
                for s in a.sparse_tensors:
                    yield from _sparse(what, s)
                if a.HasField("g"):
                    stack.append((a.g, f" in a subgraph of {at}", True))
                stack += [(g, f" in a subgraph of {at}", True) for g in a.graphs]


def _sparse(what: str, sparse: Any) -> Iterator[tuple[str, Any, list[int] | None]]:
    yield f"{what} values", sparse.values, list(sparse.dims)
    yield f"{what} indices", sparse.indices, None


@dataclass
class _Stored:
    """A tensor whose bytes are in an external data file: ``file`` (resolved, ``file_size`` bytes when checked),
    ``offset``, ``size`` in bytes."""

    tensor: Any
    location: str
    file: Path
    file_size: int
    offset: int
    size: int


def node_label(node: Any) -> str:
    """A node of an ``onnx.NodeProto`` (or ``onnx_ir.Node``) as the file lets a user find it: its name, or for an
    unnamed node (``onnx.helper`` writes none) its first output's name, as onnxruntime and Netron show it (its op
    type when it has neither)."""
    outputs = list(node.output if hasattr(node, "output") else (o.name for o in node.outputs))
    return node.name or next((o for o in outputs if o), node.op_type)


def _dtype_name(code: int) -> str:
    """An ONNX element type's name as slabconv writes dtypes (``float32``, ``complex64``, ``int4``).

    Raises:
        ValueError: not an ONNX element type.
    """
    import onnx

    return _FLOAT_TYPES.get(code) or str(onnx.TensorProto.DataType.Name(code)).lower()


def _damaged(label: str, what: str, detail: str) -> InputError:
    return InputError(f"{label}: {what} {detail}; the file is damaged")


def check_tensors(path: Path, model: Any) -> list[_Stored]:
    """Check every tensor of ``model`` (``tensors``) before anything reads its data; nothing is opened.

    Args:
        path: the ``.onnx`` file (its folder is where external data must be).
        model: its ``onnx.ModelProto`` parsed without external data.

    Returns:
        The tensors whose bytes are in external data files, checked (``_read_external`` reads them).

    Raises:
        InputError: one line naming the file, the tensor and what is wrong: an unknown or unfoldable dtype
            (``safety.unfoldable_dtype``), a negative dim, more tensors or bytes than ``safety.TensorBudget``
            allows, data that does not hold what the shape declares, an external ``location`` that is not a
            plain file inside the model's folder (empty, a NUL byte, too long, absolute, ``..``, a link, a FIFO
            or device, missing), an ``offset`` / ``length`` that is not a byte count or leaves the file.
    """
    label = str(path)
    folder = path.parent.resolve()
    sizes: dict[Path, int] = {}
    total = path.stat().st_size
    checked: list[tuple[str, Any, list[int] | None]] = []
    stored: list[_Stored] = []
    for what, tensor, dense in tensors(model):
        code = int(tensor.data_type)
        if code not in _ITEMSIZE:
            try:
                name = _dtype_name(code)
            except ValueError:
                raise _damaged(label, what, f"has an unknown data type {code}") from None
            if code == 0:
                raise _damaged(label, what, "has no data type")
            raise safety.unfoldable_dtype(label, what, name)
        if tensor.data_location == _EXTERNAL:
            location = _location(label, what, tensor)
            target, file_size = _data_file(label, what, folder, location)
            if target not in sizes:
                sizes[target] = file_size
                total += file_size
        checked.append((what, tensor, dense))
    budget = safety.TensorBudget(label, total)
    for what, tensor, dense in checked:
        code = int(tensor.data_type)
        dims = _dims(label, what, tensor.dims)
        numel = math.prod(dims)
        size = numel * _ITEMSIZE[code]
        budget.add(what, dims, _dtype_name(code), size)
        if dense is not None:
            full = _dims(label, what, dense)
            budget.add(f"{what} (dense)", full, _dtype_name(code), math.prod(full) * _ITEMSIZE[code])
        if tensor.data_location == _EXTERNAL:
            stored.append(_external(label, what, tensor, folder, size, sizes))
            continue
        fields = [f for f in _TYPED_FIELDS if len(getattr(tensor, f))]
        if len(fields) + tensor.HasField("raw_data") > 1:  # readers differ in which one they read
            raise _damaged(label, what, "holds its values in two fields at once")
        if tensor.HasField("raw_data"):
            if len(tensor.raw_data) != size:
                raise _damaged(label, what, f"declares {size} bytes but holds {len(tensor.raw_data)}")
        else:
            held = sum(len(getattr(tensor, f)) for f in fields)
            if held != numel:
                raise _damaged(label, what, f"declares {numel} values but holds {held}")
    return stored


def _dims(label: str, what: str, dims: Any) -> list[int]:
    out = [int(d) for d in dims]
    if any(d < 0 for d in out):
        raise _damaged(label, what, "has a negative size")
    return out


def _location(label: str, what: str, tensor: Any) -> str:
    """The external data ``location`` of ``tensor``, refused unless it is a plain relative path."""
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    reason = ""
    if not location:
        reason = "names no file"
    elif "\0" in location:
        reason = "is not a file name (it holds a NUL byte)"
    elif len(location) > MAX_LOCATION_CHARS or any(len(p.encode(errors="replace")) > 255 for p in location.split("/")):
        reason = f"is longer than a file name can be ({len(location)} characters)"
    elif os.path.isabs(location) or location.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", location):
        reason = "is not a file inside the model's folder (absolute, leaving it, or a link)"
    if reason:
        raise InputError(
            f"{label}: {what} keeps its data in {location[:120]!r}, which {reason}; refused: keep the data files "
            "beside it"
        )
    return location


def _data_file(label: str, what: str, folder: Path, location: str) -> tuple[Path, int]:
    """The resolved external data file of ``location`` and its size: inside ``folder``, not a link, present, a
    regular file (``safety.regular_file``: a FIFO is refused before anything opens it)."""
    target = folder / location
    try:
        link = target.is_symlink()
        resolved = target.resolve()
        exists = resolved.exists()
    except (OSError, RuntimeError) as err:  # ENAMETOOLONG, ELOOP, EACCES
        raise InputError(
            f"{label}: {what} keeps its data in {location[:120]!r}, which cannot be opened "
            f"({getattr(err, 'strerror', None) or type(err).__name__}); refused: keep the data files beside it"
        ) from None
    if link or not resolved.is_relative_to(folder):
        raise InputError(
            f"{label}: {what} keeps its data in {location[:120]!r}, which is not a file inside the model's folder "
            "(absolute, leaving it, or a link); refused: keep the data files beside it"
        )
    if not exists:
        raise InputError(
            f"{label}: its external data file {location[:120]!r} is missing; copy it beside the .onnx file"
        )
    try:
        return resolved, safety.regular_file(resolved, "external data").st_size
    except InputError as err:
        raise InputError(
            f"{label}: {what} keeps its data in {location[:120]!r}: {err.args[0].removeprefix(f'{resolved}: ')}"
        ) from None


def _external(label: str, what: str, tensor: Any, folder: Path, size: int, sizes: dict[Path, int]) -> _Stored:
    """Check the ``offset`` and ``length`` of an external tensor of ``size`` bytes against its file."""
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries["location"]
    target = (folder / location).resolve()
    fields = {}
    for key in ("offset", "length"):
        value = entries.get(key)
        if value is not None and not _BYTE_COUNT.fullmatch(value):
            raise _damaged(label, what, f"has the external data {key} {value[:40]!r}, which is not a byte count")
        fields[key] = int(value) if value is not None else None
    offset = fields["offset"] or 0
    length = fields["length"]
    stored = sizes[target]
    if length is not None and length != size:
        raise _damaged(label, what, f"declares {size} bytes but its external data length is {length}")
    if offset + size > stored:
        held = max(0, stored - offset)
        raise _damaged(label, what, f"declares {size} bytes but {location[:120]!r} holds {held} for it")
    return _Stored(tensor, location, target, stored, offset, size)


def _read_external(label: str, stored: list[_Stored]) -> dict[Path, str]:
    """Read every external data file once, from start to end through one open file: hash it and copy each
    tensor's bytes into its ``raw_data`` (the tensor is then no longer external). Returns each file's sha256.

    Raises:
        InputError: a file that is not the size it was checked at (it changed meanwhile), or cannot be read.
    """
    digests: dict[Path, str] = {}
    by_file: dict[Path, list[_Stored]] = {}
    for item in stored:
        by_file.setdefault(item.file, []).append(item)
    for file, found in by_file.items():
        items = sorted(found, key=lambda i: i.offset)
        buffers = [bytearray(i.size) for i in items]
        digest = hashlib.sha256()
        pos = first = 0
        name, expected = items[0].location, items[0].file_size
        try:
            with safety.open_regular(file, "external data") as f:
                while chunk := f.read(16 << 20):
                    end = pos + len(chunk)
                    while first < len(items) and items[first].offset + items[first].size <= pos:
                        first += 1
                    j = first
                    while j < len(items) and items[j].offset < end:
                        item = items[j]
                        lo, hi = max(item.offset, pos), min(item.offset + item.size, end)
                        if lo < hi:
                            buffers[j][lo - item.offset : hi - item.offset] = chunk[lo - pos : hi - pos]
                        j += 1
                    digest.update(chunk)
                    pos = end
        except OSError as err:
            raise InputError(f"{label}: cannot read its external data {name[:120]!r} ({err.strerror or err})") from None
        if pos != expected:
            raise InputError(
                f"{label}: its external data {name[:120]!r} changed while slabconv read it ({expected} bytes when "
                f"checked, {pos} read); nothing was folded: use a file nothing is writing"
            )
        digests[file] = digest.hexdigest()
        for item, buffer in zip(items, buffers, strict=True):
            tensor = item.tensor
            del tensor.external_data[:]
            tensor.data_location = 0  # DEFAULT
            tensor.raw_data = bytes(buffer)
    return digests


# --------------------------------------------------------------------------------------------- the graph


@contextlib.contextmanager
def _without_external_data(proto: Any) -> Iterator[None]:
    """While active, each external tensor of ``proto`` is an empty inline tensor (dims ``[0]``), restored after.

    ``onnx.checker.check_model`` given a model (rather than a path, which it cannot take for a name that is not
    UTF-8) looks for external data relative to the current folder. The tensors themselves were checked by
    ``check_tensors``; what the checker is asked about here is the graph: nodes, attributes, names, opsets.
    """
    saved = []
    for _, tensor, _ in tensors(proto):
        if tensor.data_location == _EXTERNAL:
            saved.append((tensor, list(tensor.dims), [(e.key, e.value) for e in tensor.external_data]))
            tensor.data_location = 0
            del tensor.external_data[:]
            del tensor.dims[:]
            tensor.dims.append(0)
    try:
        yield
    finally:
        for tensor, dims, entries in saved:
            del tensor.dims[:]
            tensor.dims.extend(dims)
            for key, value in entries:
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            tensor.data_location = _EXTERNAL


_QUANTIZED_OPS = frozenset(
    {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
     "MatMulInteger", "DynamicQuantizeMatMul", "QGemm", "QAttention", "MatMulIntegerToFloat", "MatMulNBits"}
)  # fmt: skip
"""Ops of a quantized graph (ONNX's and onnxruntime's ``com.microsoft`` ones): QDQ pairs, integer layers."""


def check_foldable(path: Path, proto: Any) -> None:
    """Refuse an original no norm of which can be folded exactly: a quantized graph (``_QUANTIZED_OPS``; a
    quantized file stays readable as a ``verify`` candidate).

    Raises:
        InputError: naming the file, the op and what to do.
    """
    quantized = Counter(n.op_type for n in proto.graph.node if n.op_type in _QUANTIZED_OPS)
    if quantized:
        ops = ", ".join(f"{count} {op}" for op, count in quantized.most_common())
        raise InputError(
            f"{path}: a quantized graph ({ops}, as "
            "onnxruntime.quantization writes it): its weights are integers and each quantize step rounds, so no "
            "fold of a norm into them is exact; fold the float model, then quantize slabconv's model.onnx"
        )


def _check_graph(path: Path, proto: Any) -> None:
    """The graph against ONNX's own rules (``onnx.checker``; strict shape and type inference), and what slabconv
    cannot fold or feed: a ``BatchNormalization`` with ``spatial=0``, opset 18's deprecated ``GroupNormalization``
    (scale and bias per group), graph inputs that are not tensors of
    numbers.

    Raises:
        InputError: naming the file and the rule, with the library's own first line.
    """
    import onnx

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    for node in proto.graph.node:
        if node.op_type == "GroupNormalization" and node.domain in ("", "ai.onnx") and opset < 21:
            raise InputError(
                f"{path}: GroupNormalization node {node_label(node)[:80]!r} is opset {opset}'s, which ONNX deprecates "
                "(onnx.checker refuses it): its scale and bias hold one value per group, not one per channel as "
                "opset 21's and the frameworks' GroupNorm; export the model at opset 21 or later"
            )
        spatial = next((a for a in node.attribute if a.name == "spatial"), None)
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and spatial and spatial.i == 0:
            raise InputError(
                f"{path}: BatchNormalization node {node_label(node)[:80]!r} has spatial=0 (statistics per element, "
                "ONNX opset 8 and earlier), not one affine per channel; export the model at opset 9 or later"
            )
    try:
        with _without_external_data(proto):
            onnx.checker.check_model(proto)
    except Exception as err:  # noqa: BLE001 - ValidationError and what the C++ checker raises
        raise InputError(
            f"{path}: not a valid ONNX model (onnx.checker: {first_line(err, 160)}); export it again"
        ) from None
    inlined = _inlined_nodes(proto)
    if inlined > MAX_INLINED_NODES:
        raise InputError(
            f"{path}: the graph has {inlined:,} nodes once its model-local functions are inlined (at most "
            f"{MAX_INLINED_NODES:,}); slabconv (and shape inference) inlines them to find the norms inside"
        )
    try:
        with _without_annotations(proto):  # a stale declared shape is an annotation, not a graph that cannot run
            onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as err:  # noqa: BLE001 - InferenceError and friends
        text = " ".join(str(err).split())
        raise InputError(
            f"{path}: the graph does not type-check (onnx shape inference: {text[:200]}); export it again"
        ) from None
    check_graph_inputs(path, proto)


def _inlined_nodes(proto: Any) -> int:
    """The nodes of ``proto``'s graph (its subgraphs included) once every call of a model-local function is
    replaced by its body, counted without building them (each function's count once; ``onnx.checker`` has refused
    recursive functions)."""
    functions = {(f.domain, f.name, getattr(f, "overload", "")): f for f in proto.functions}
    counts: dict[tuple[str, str, str], int] = {}

    def nodes(items: Any) -> int:
        total = 0
        for node in items:
            key = (node.domain, node.op_type, getattr(node, "overload", ""))
            if key in functions:
                if key not in counts:
                    counts[key] = 0  # a cycle the checker missed counts as nothing, not forever
                    counts[key] = nodes(functions[key].node)
                total += counts[key]
            else:
                total += 1
            for attr in node.attribute:
                total += sum(nodes(g.node) for g in [*([attr.g] if attr.HasField("g") else []), *attr.graphs])
        return total

    return nodes(proto.graph.node)


@contextlib.contextmanager
def _without_annotations(proto: Any) -> Iterator[None]:
    """``proto`` without what an exporter only declares about intermediate values and outputs (``value_info``, the
    graph outputs' shapes) while the block runs: strict shape inference then judges the nodes, their attributes and
    the inputs' and initializers' types (a three-input ``BatchNormalization``, a string ``epsilon``, statistics of
    another length), not a stale annotation that onnxruntime ignores (jax2onnx writes some); the verification
    judges such a file against its own ``onnx.checker`` result. Restored afterwards."""
    value_info = list(proto.graph.value_info)
    shapes = []
    for output in proto.graph.output:
        tensor = output.type.tensor_type if output.type.HasField("tensor_type") else None
        shapes.append(copy.deepcopy(tensor.shape) if tensor is not None and tensor.HasField("shape") else None)
        if tensor is not None and tensor.HasField("shape"):
            tensor.ClearField("shape")
    del proto.graph.value_info[:]
    try:
        yield
    finally:
        proto.graph.value_info.extend(value_info)
        for output, shape in zip(proto.graph.output, shapes, strict=True):
            if shape is not None:
                output.type.tensor_type.shape.CopyFrom(shape)


_PARAMETER_INPUTS = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "BatchNormalization": (1, 2, 3, 4),
    "InstanceNormalization": (1, 2), "LayerNormalization": (1, 2), "GroupNormalization": (1, 2),
}  # fmt: skip
"""The inputs of an op that hold a layer's parameters (weight and bias, a norm's scale, shift and statistics)."""


def check_graph_inputs(path: Path, proto: Any) -> None:
    """Refuse graph inputs slabconv cannot draw or feed: not tensors (a sequence, map or optional value), or
    tensors whose element type is not a real number (``_ITEMSIZE``), or a layer's or norm's parameters
    (``_PARAMETER_INPUTS``) given as a graph input without a value (``torch.onnx.export(...,
    export_params=False)``: random samples would stand in for the weights). Initializers listed as inputs (as
    ``keep_initializers_as_inputs=True`` writes them) are skipped.

    Raises:
        InputError: naming the file and the input (and the node whose parameter it is).
    """
    initializers = {t.name for t in proto.graph.initializer}
    fed = {i.name for i in proto.graph.input} - initializers
    for node in proto.graph.node:
        for position in _PARAMETER_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            name = node.input[position] if position < len(node.input) else ""
            if name in fed:
                raise InputError(
                    f"{path}: the graph input {name[:80]!r} is a parameter of {node.op_type} node "
                    f"{node_label(node)[:80]!r} and holds no value (exported with export_params=False?); export the "
                    "model with its parameters (torch.onnx.export's default, export_params=True)"
                )
    for graph_input in proto.graph.input:
        if graph_input.name in initializers:
            continue
        kind = graph_input.type.WhichOneof("value")
        if kind != "tensor_type":
            shown = (kind or "value without a type").removesuffix("_type").replace("_", " ")
            raise InputError(
                f"{path}: the graph input {graph_input.name[:80]!r} is a {shown}, not a tensor; slabconv folds and "
                "verifies models whose inputs are tensors"
            )
        elem = graph_input.type.tensor_type.elem_type
        if elem not in _ITEMSIZE:
            raise InputError(
                f"{path}: the graph input {graph_input.name[:80]!r} is {_dtype_name(elem) if elem else 'untyped'}; "
                "slabconv feeds models with real float or integer inputs"
            )


# --------------------------------------------------------------------------------------------- the loader


def wrong_kind(path: Path, data: bytes | None = None) -> InputError | None:
    """What a file named ``.onnx`` that is no ONNX model is (``safety.content_error``: a ``.pt2`` renamed says so
    and names the suffix to give it), when its bytes tell; None when they do not, or say it is an ONNX model.

    Args:
        path: the file.
        data: its bytes, when read already; None: its first 512 bytes and, for a zip archive, its entry names are
            read from ``path``.
    """
    import io
    import zipfile

    head = safety._head(path if data is None else data)
    names = None
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(io.BytesIO(data) if data is not None else path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return None
    return safety.content_error(str(path), head, names)


def read_onnx(path: Path | str) -> OnnxFile:
    """Read and check an ``.onnx`` original (the module docstring): its facts, and the checked model in ``proto``.

    Raises:
        InputError: no such file, not a regular file, over protobuf's 2 GiB, not a readable or valid ONNX model;
            a tensor ``check_tensors`` refuses; a graph ``_check_graph`` refuses; a model without graph inputs;
            external data that changed while it was read.
    """
    import onnx

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    check_protobuf_size(path)
    with safety.open_regular(path, "the ONNX file") as f:
        data = f.read(min(os.fstat(f.fileno()).st_size, PROTOBUF_LIMIT_BYTES) + 1)
    try:
        proto = onnx.ModelProto.FromString(data)
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError (and RecursionError, ValueError)
        wrong = wrong_kind(path, data)
        if wrong is not None:
            raise wrong from None
        raise InputError(
            f"{path}: not a readable ONNX model ({first_line(err, 120)}); export it again, or point at the .pth / "
            ".safetensors / .pt2 file"
        ) from None
    if not proto.graph.node:
        raise InputError(f"{path}: not a readable ONNX model (its graph has no nodes); export it again")
    stored = check_tensors(path, proto)
    _sort_nodes(proto)
    _check_graph(path, proto)
    digests = _read_external(str(path), stored)
    files = [path, *digests]
    inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    if not inputs:
        raise InputError(f"{path}: the model has no inputs; slabconv verifies a model on inputs, export it with one")
    first = _graph_input(inputs[0])
    axes = inputs[0].type.tensor_type.shape.dim
    dtype = _FLOAT_TYPES.get(inputs[0].type.tensor_type.elem_type) or _weights_dtype(proto)
    domains = {o.domain or "ai.onnx": int(o.version) for o in proto.opset_import}
    sha256 = hashlib.sha256(data).hexdigest()
    return OnnxFile(
        path=path,
        sha256=sha256,
        files=files,
        external=len(files) > 1,
        opset=domains.get("ai.onnx", 0),
        domains=domains,
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        dtype=dtype,
        input_name=inputs[0].name,
        input_shape=first.shape or None,
        batch=first.dims[0] if first.dims else None,
        token_input=bool(np.issubdtype(first.dtype, np.integer)),
        dynamic_sequence=len(axes) == 2 and bool(axes[1].dim_param) and not axes[1].HasField("dim_value"),
        exporter=torch_exporter(proto),
        files_sha256={path.name: sha256, **{f.name: digest for f, digest in digests.items()}},
        inputs=[_graph_input(i) for i in inputs],
        proto=proto,
    )


TORCH_METADATA_PREFIX = "pkg.torch.onnx."
"""The prefix of the metadata the dynamo exporter writes on each node (``pkg.torch.onnx.name_scopes``,
``pkg.torch.onnx.stack_trace``...); the TorchScript exporter writes none."""


def torch_exporter(proto: Any) -> str | None:
    """Which of torch's exporters wrote ``proto`` (an ``onnx.ModelProto``), read from what each writes.

    Both write ``producer_name`` ``pytorch``. The dynamo exporter (``torch.onnx.export(..., dynamo=True)``, the
    default since torch 2.9) writes ``torch.__version__`` as ``producer_version``, local tag included
    (``2.13.0+cpu``), and ``pkg.torch.onnx.*`` metadata on its nodes; the TorchScript exporter
    (``dynamo=False``) writes the bare release (``torch._C._onnx.PRODUCER_VERSION``: ``2.13.0``) and names its
    nodes by module scope (``/conv/Conv``). Sources: ``torch/onnx/_internal/exporter/_core.py``,
    ``torch/onnx/__init__.py``.

    Returns:
        ``"dynamo"``, ``"torchscript"``, or None: another producer (tf2onnx, a file made by hand), or a torch
        file whose marks are gone (an optimizer that renamed the nodes and dropped their metadata).
    """
    if proto.producer_name != "pytorch":
        return None
    nodes = proto.graph.node
    if "+" in proto.producer_version or any(
        p.key.startswith(TORCH_METADATA_PREFIX) for n in nodes for p in n.metadata_props
    ):
        return "dynamo"
    if any(n.name.startswith("/") for n in nodes):
        return "torchscript"
    return None


def _sort_nodes(proto: Any) -> None:
    """Put the nodes of ``proto``'s graph in topological order, in place, when they are not (onnx-ir's stable
    ``Graph.sort``: a sorted graph keeps its order). onnxruntime runs a graph whatever its node order, and
    onnxruntime's ``float16.convert_float_to_float16(..., keep_io_types=True)`` (as onnxconverter-common writes it)
    appends the ``Cast`` of each graph input after the nodes that read it; ``onnx.checker`` refused such a file.
    A graph onnx-ir cannot read or sort (a cycle) is left as it is, for ``onnx.checker`` to name what is wrong."""
    import onnx_ir as ir

    try:
        graph = ir.serde.deserialize_graph(proto.graph)
        index = {node: i for i, node in enumerate(graph)}
        graph.sort()
    except Exception:  # noqa: BLE001 - whatever onnx-ir meets in a graph the checker then judges
        return
    order = [index[node] for node in graph]
    if order != sorted(order):
        nodes = list(proto.graph.node)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes[i] for i in order)


def check_protobuf_size(path: Path) -> None:
    """``path`` is a regular file protobuf can parse whole (at most ``PROTOBUF_LIMIT_BYTES``).

    Raises:
        InputError: as ``safety.regular_file``; one file over protobuf's 2 GiB limit (weights not in external data).
    """
    size = safety.regular_file(path, "the ONNX file").st_size  # a FIFO or device is refused before anything opens it
    if size > PROTOBUF_LIMIT_BYTES:
        raise InputError(
            f"{path}: one ONNX file of {size / 2**30:.1f} GiB is over protobuf's 2 GiB limit and cannot be read; "
            "re-save it with its weights as external data: onnx.save_model(model, path, save_as_external_data=True)"
        )


def computed_dtype(fed: str | None, proto: Any) -> str:
    """The floating dtype the model ``proto`` computes in: ``fed`` (the dtype of its float inputs or outputs), or
    that of its float initializers where they are narrower (``float16`` weights behind ``float32`` inputs and
    outputs, as onnxruntime's ``convert_float_to_float16(..., keep_io_types=True)`` writes them); without ``fed``,
    the weights' (``_weights_dtype``)."""
    weights = _weights_dtype(proto)
    if fed is None:
        return weights
    size = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
    return weights if size[weights] < size[fed] else fed


def _weights_dtype(proto: Any) -> str:
    """The dtype of the largest floating initializer (``float32`` when there is none)."""
    sizes: dict[str, int] = {}
    for init in proto.graph.initializer:
        name = _FLOAT_TYPES.get(init.data_type)
        if name:
            sizes[name] = sizes.get(name, 0) + math.prod(init.dims)
    return max(sizes, key=lambda k: sizes[k]) if sizes else "float32"


def load_ir(source: Path | str | OnnxFile) -> Any:
    """The checked model as an ``onnx_ir.Model``, every tensor in memory (onnx-ir opens no file).

    Args:
        source: an ``OnnxFile`` (``read_onnx``'s model, not read again: each call deserialises the same checked
            bytes into a new model the caller may change), or a path, read and checked by ``read_onnx`` first.

    Raises:
        InputError: as ``read_onnx``; onnx-ir cannot build the model (its message named).
    """
    import onnx_ir as ir

    info = source if isinstance(source, OnnxFile) else read_onnx(source)
    try:
        return ir.serde.deserialize_model(info.proto)
    except Exception as err:  # noqa: BLE001 - onnx-ir raises what its deserializer meets
        raise InputError(
            f"{info.path}: not a readable ONNX model (onnx-ir: {first_line(err, 120)}); export it again"
        ) from None
