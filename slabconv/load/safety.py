"""Reading untrusted files without running code from them or allocating what they ask for.

The threat model (``docs/security.md``): every input file is hostile until this module has parsed it. Four
rules hold for every format slabconv reads:

1. **Pickles are read by one weights-only reader** (``torch.load(weights_only=True)``) with one allowlist,
   ``ALLOWED_GLOBALS``: the official SLAB training config (``yacs.config.CfgNode``), training scripts' ``args``
   and numpy numbers, read as plain data. The same reader serves ``.pth`` / ``.pt`` checkpoints,
   ``pytorch_model.bin`` files of Hugging Face folders and the pickles inside ``.pt2`` programs. Only
   ``--trust-pickle`` lifts it (and runs code from the file).
2. **Archives are checked before torch opens them** (``check_zip``): zip entries must be stored uncompressed (as
   ``torch.save`` and ``torch.export.save`` write them; a compressed entry could expand a small file into
   gigabytes), TorchScript archives (code inside) and pre-1.6 pickles (whose storage sizes cannot be checked
   before they are allocated) are refused.
3. **``.pt2`` programs are checked before ``torch.export.load``** (``slabconv.load.program_checks``): no entry that
   holds native code (AOTInductor, ExecuTorch) or an unknown kind; every symbolic-shape expression string
   (``expr_str``), which torch hands to ``sympy.sympify`` (an ``eval``), matches a strict grammar
   (``check_expression``: symbols, integers, arithmetic, comparisons and the sympy functions torch.export
   writes), and the same check guards ``sympy.sympify`` while torch loads; every weight's declared size fits
   the bytes stored for it.
4. **Sizes are checked before memory is touched** (``check_extents``): a tensor can be a view whose size is far
   larger than its storage (``torch.zeros(1).expand(10**6, 10**6)`` saves one float). The elements of every
   tensor, as it would be materialised, must add up to at most ``EXPANSION`` times the file's size (plus
   ``FLOOR_BYTES``); the first tensor over that is named. Counts are bounded before the work they cost: tensors
   per pickle (``MAX_TENSORS``, counted in the pickle's opcodes without running it), nodes per program
   (``program_names.MAX_GRAPH_NODES``), JSON size and depth (``read_json``).
5. **Only regular files are read** (``regular_file``): a FIFO, socket, device or folder where a file is expected is
   refused at once, before anything opens it (opening a FIFO would wait for a writer forever).
6. **A ``.pt2`` names nothing torch would import or look up freely** (``program_names``): every operator name,
   tree-spec type and guard is checked in the JSON, and the check and the load read the same open file.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import stat
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from slabconv.errors import InputError
from slabconv.util import SPECIAL_FILES, sha256_open  # noqa: F401 (safety.sha256_open: the digest of a file read here)

EXPANSION = 4
"""The materialised tensors of a file may take at most this many times its size (tied weights count twice)."""

FLOOR_BYTES = 64 << 20
"""...plus this much, so small files with a few expanded buffers (position ids) still load."""

MAX_ZIP_ENTRIES = 200_000

MAX_TENSORS = 100_000
"""Tensors one pickle may hold (a training checkpoint of a large model with its optimizer state has a few thousand).
Counted in the pickle's opcodes before the weights-only reader builds any of them."""

MAX_PICKLE_OPS = 20_000_000
"""Opcodes one pickle may hold: bounds the time of the count above and of the weights-only reader."""

MAX_JSON_BYTES = 64 << 20
"""Size of a JSON file slabconv parses (``config.json``, an index, ``report.json``): real ones are kilobytes."""

MAX_PROGRAM_JSON_BYTES = 256 << 20
"""Size of the program JSON inside a ``.pt2`` (about 3 KiB a node, with its stack trace)."""

MAX_JSON_DEPTH = 100
"""Nesting of objects and lists in any JSON slabconv parses (real files nest fewer than 20 deep)."""


class ConfigNode:
    """Stand-in for ``yacs.config.CfgNode`` when reading a checkpoint: plain data, nothing imported or run.

    yacs pickles a ``CfgNode`` (a dict subclass) as ``NEWOBJ(CfgNode)``, its items (``SETITEMS``) and a
    ``BUILD`` with yacs' own flags (``__immutable__``, ...). torch's weights-only unpickler fills only exact
    ``dict``/``OrderedDict`` objects and builds only allowlisted types, so ``__new__`` hands it an
    ``OrderedDict``: the items land in it, the flags land in its ``__dict__`` and are dropped by ``plain``.
    The name ``yacs.config.CfgNode`` is matched as a string; yacs itself is never imported.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - see the class docstring
        return collections.OrderedDict()


class PlainNamespace(dict[str, Any]):
    """Stand-in for ``argparse.Namespace`` when reading a checkpoint: a plain dict of its attributes.

    Training scripts save their command line with the weights (facebookresearch/deit ``main.py`` and timm
    ``train.py`` store ``'args': args``). Protocol 2 pickles a Namespace as ``NEWOBJ(Namespace, ())`` and a
    ``BUILD`` with its ``__dict__``; torch's weights-only unpickler builds an allowlisted type by its
    ``__setstate__``, so the attributes land in this dict (whose values were themselves read under the allowlist).
    The name ``argparse.Namespace`` is matched as a string; nothing is imported.
    """

    def __setstate__(self, state: Any) -> None:  # noqa: D105 - see the class docstring
        if isinstance(state, Mapping):
            self.update(state)


class NumpyDType:
    """Stand-in for ``numpy.dtype`` when reading a numpy scalar (``np.float64(72.1)`` saved as an accuracy): keeps
    the type string (``'f8'``) and the byte order its ``BUILD`` state gives; nothing is imported."""

    def __init__(self, spec: Any = "", align: Any = False, copy: Any = True) -> None:
        self.spec = spec if isinstance(spec, str) else ""
        self.order = "<"

    def __setstate__(self, state: Any) -> None:  # noqa: D105 - numpy's state: (version, byte order, ...)
        if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
            self.order = state[1]


_NUMERIC_SPEC = re.compile(r"[biuf][1248]|c(8|16)")


def numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """Stand-in for ``numpy.core.multiarray.scalar(dtype, bytes)``: a bool, int, float or complex scalar as the
    Python number (numpy's ``frombuffer`` on the stored bytes); anything else as a placeholder string."""
    import numpy as np

    if not (isinstance(dtype, NumpyDType) and isinstance(data, bytes) and _NUMERIC_SPEC.fullmatch(dtype.spec)):
        return "<numpy scalar>"
    order = "<" if dtype.order in ("|", "=") else dtype.order
    kind = np.dtype(order + dtype.spec)
    if len(data) != kind.itemsize:
        return "<numpy scalar>"
    return np.frombuffer(data, dtype=kind)[0].item()


ALLOWED_GLOBALS: dict[str, Any] = {
    "yacs.config.CfgNode": ConfigNode,
    "argparse.Namespace": PlainNamespace,
    "numpy.dtype": NumpyDType,
    "numpy.core.multiarray.scalar": numpy_scalar,
    "numpy._core.multiarray.scalar": numpy_scalar,
}
"""``module.name`` globals the weights-only reader accepts beyond torch's own, each read by a stand-in that imports
and runs nothing of the named module: the official SLAB training config (github xinghaochen/SLAB
``classification/utils.py`` saves ``config``, a yacs ``CfgNode``), the command line other training scripts save
beside the weights (``args``, an ``argparse.Namespace``: facebookresearch/deit ``main.py``, timm ``train.py``) and
numpy numbers (``max_accuracy`` as ``np.float64``). Nothing else."""


def plain(obj: Any, label: str) -> Any:
    """Nested mappings and sequences as plain ``dict`` / ``list`` of JSON-like values (others as ``repr``), after
    ``check_nesting`` (a trusted pickle skips the weights-only reader, not this).

    Raises:
        InputError: nested too deeply, naming ``label``.
    """
    check_nesting(obj, label)
    return _plain(obj)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


# --------------------------------------------------------------------------------------------- files

_SPECIAL = {**SPECIAL_FILES, stat.S_IFDIR: "a folder"}


def regular_file(path: Path | str, what: str = "the file") -> os.stat_result:
    """``os.stat`` of ``path`` after checking it is a regular file (a link to one is followed).

    A FIFO opened for reading blocks until a writer comes, a device can be endless, a folder cannot be read as a
    file: each is refused before anything opens it.

    Args:
        path: the path the user gave (named in the error).
        what: how the message names the file's role, e.g. ``"--inputs"``.

    Raises:
        InputError: ``PATH: not a regular file (a FIFO (named pipe)); give WHAT as a file``, or no such file.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file ({what})") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read {what} ({err.strerror or type(err).__name__})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = _SPECIAL.get(stat.S_IFMT(info.st_mode), "a special file")
        raise InputError(f"{path}: not a regular file ({kind}); give {what} as a regular file")
    return info


def open_regular(path: Path | str, what: str = "the file") -> IO[bytes]:
    """Open ``path`` for reading once, refusing anything but a regular file (checked before opening and again on
    the open file, so a path swapped in between is caught): every later check and read uses this one file object.

    Raises:
        InputError: as ``regular_file``.
    """
    regular_file(path, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{path}: not a regular file (it changed while being opened); give {what} as a file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_depth(value: Any) -> int:
    """The nesting depth of parsed JSON (a scalar is 0, ``[]`` is 1), computed without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
            deepest = max(deepest, depth + 1)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
            deepest = max(deepest, depth + 1)
    return deepest


def json_dicts(value: Any, skip: tuple[str, ...] = ()) -> Iterator[dict[Any, Any]]:
    """Every dict of parsed JSON ``value`` (``value`` itself included), depth first and without recursion; the
    values under a key in ``skip`` are not entered. Each dict is yielded before its children are, so a check that
    raises on a dict stops the walk there."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(v for k, v in item.items() if k not in skip)
        elif isinstance(item, list):
            stack.extend(item)


class InvalidJSON(InputError):
    """``parse_json``'s error for text that is not JSON (or not UTF-8), apart from JSON over the limits: a caller
    that reads an optional entry may take it as absent, never JSON over the limits."""


class _TwiceError(Exception):
    """A JSON object holds a key twice (``args[0]``)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: the object as a dict, refused where a key comes twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _TwiceError(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return out


def parse_json(data: bytes | str, label: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """JSON text parsed within the size and depth limits (``MAX_JSON_BYTES``, ``MAX_JSON_DEPTH``).

    Args:
        data: the file's bytes (UTF-8) or text.
        label: the file (or archive entry) to name in errors.
        max_bytes: the size limit for this kind of file.

    Raises:
        InputError: too large, too deeply nested, or an object with a key twice (which of the two counts differs
            between readers: Python's ``json`` keeps the last, others the first or refuse) -- one line naming
            ``label``.
        InvalidJSON: not UTF-8 or not JSON (an ``InputError`` too).
    """
    if len(data) > max_bytes:
        raise InputError(f"{label}: {_human(len(data))} of JSON, over slabconv's limit of {_human(max_bytes)}; refused")
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys)
    except _TwiceError as twice:
        raise InputError(
            f"{label}: the key {twice.args[0]!r} is in one JSON object twice; which one counts depends on the reader;"
            " refused"
        ) from None
    except RecursionError:
        raise InputError(
            f"{label}: JSON nested deeper than slabconv's limit of {MAX_JSON_DEPTH} levels; refused"
        ) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidJSON(f"{label} is not valid JSON ({str(err)[:120]}); the file is damaged") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InputError(f"{label}: JSON nested deeper than slabconv's limit of {MAX_JSON_DEPTH} levels; refused")
    return value


def read_json(path: Path | str, digests: dict[Path, str] | None = None) -> Any:
    """A JSON file read as ``parse_json`` does, after ``regular_file`` and a size check (``MAX_JSON_BYTES``) before
    reading.

    Args:
        path: the file.
        digests: when given, ``digests[path]`` is set to the sha256 of the bytes parsed (one read, one digest).

    Raises:
        InputError: as ``regular_file`` and ``parse_json``.
    """
    info = regular_file(path, "a JSON file")
    if info.st_size > MAX_JSON_BYTES:
        raise InputError(
            f"{path}: {_human(info.st_size)} of JSON, over slabconv's limit of {_human(MAX_JSON_BYTES)}; refused"
        )
    with open_regular(path, "a JSON file") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    value = parse_json(data, str(path), MAX_JSON_BYTES)
    if digests is not None:
        digests[Path(path)] = hashlib.sha256(data).hexdigest()
    return value


# --------------------------------------------------------------------------------------------- archives


def check_zip(source: Path | bytes | IO[bytes], label: str) -> list[str]:
    """The entry names of a torch zip archive, after checking it can be read without surprises.

    Args:
        source: a path, the archive's bytes (a pickle stored inside a ``.pt2``) or an open binary file.
        label: what to name in errors (the user's path).

    Raises:
        InputError: not a zip archive (a pre-1.6 pickle or not a torch file), a compressed or encrypted entry, an
            entry name that leaves the archive, too many entries, a TorchScript archive.
    """
    return _check_zip(source, label)[0]


def _check_zip(source: Path | bytes | IO[bytes], label: str, read: str | None = None) -> tuple[list[str], bytes | None]:
    """``check_zip``, and the bytes of the first entry whose name ends with ``read`` (when given) from the same
    parse of the archive's directory (parsing a directory of 100,000 entries takes a second)."""
    opened: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    head = _head(opened)
    wrong = content_error(label, head) if sniff_contents(head) == "tar" else None
    if wrong is not None:  # a tar of a checkpoint would open as the zip inside it
        raise wrong
    entries = _declared_entries(opened)
    if entries is not None and entries > MAX_ZIP_ENTRIES:
        raise InputError(f"{label}: the archive has {entries} entries; a checkpoint has far fewer")
    data = None
    try:
        with zipfile.ZipFile(opened) as archive:
            infos = archive.infolist()
            if read is not None and len(infos) <= MAX_ZIP_ENTRIES:
                member = next((i for i in infos if i.filename.endswith(read) and i.compress_type == 0), None)
                data = archive.read(member) if member is not None and not member.flag_bits & 0x1 else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise _not_a_zip(source, label, str(err).strip() or type(err).__name__) from None
    if len(infos) > MAX_ZIP_ENTRIES:
        raise InputError(f"{label}: the archive has {len(infos)} entries; a checkpoint has far fewer")
    relative = {i.filename.split("/", 1)[1] if "/" in i.filename else i.filename for i in infos}
    if "constants.pkl" in relative or any(n.startswith("code/") for n in relative):
        raise InputError(
            f"{label}: a TorchScript archive (torch.jit.save), which holds code; slabconv reads weights only: "
            "save model.state_dict() with torch.save, or export a program with torch.export.save"
        )
    names = []
    for info in infos:
        name = info.filename
        if name.startswith(("/", "\\")) or ".." in Path(name).parts:
            raise InputError(f"{label}: archive entry {name!r} points outside the archive; refused")
        if info.flag_bits & 0x1:
            raise InputError(f"{label}: archive entry {name!r} is encrypted; refused")
        if info.compress_type != zipfile.ZIP_STORED:
            raise InputError(
                f"{label}: archive entry {name!r} is compressed, which torch.save and torch.export.save never do "
                "(a compressed entry can expand a small file into gigabytes); refused: re-save the original"
            )
        names.append(name)
    return names, data


def _declared_entries(f: Any) -> int | None:
    """The entry count the archive's end record declares (read from its last bytes, before the directory is
    parsed), or None when there is no end record to read (``zipfile`` then says what is wrong)."""
    try:
        end = zipfile._EndRecData(f)  # type: ignore[attr-defined] # private, but in every CPython since 2.x
        f.seek(0)
    except (OSError, ValueError, AttributeError):
        return None
    return int(end[zipfile._ECD_ENTRIES_TOTAL]) if end else None  # type: ignore[attr-defined]


def _head(source: Path | bytes | IO[bytes], size: int = 512) -> bytes:
    """The first ``size`` bytes of ``source``, leaving an open file at its start."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            return f.read(size)
    if isinstance(source, (bytes, bytearray)):
        return bytes(source[:size])
    source.seek(0)
    head = source.read(size)
    source.seek(0)
    return head


_LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
"""``torch.serialization.MAGIC_NUMBER`` as pickled (LONG1): the first object of a pre-1.6 ``torch.save`` file."""

_MODEL_FORMATS = {
    "torch.export": ("a torch.export program", ".pt2"),
    "onnx": ("an ONNX model", ".onnx"),
    "safetensors": ("a safetensors file", ".safetensors"),
    "pickle": ("a PyTorch checkpoint (torch.save)", ".pth"),
}
"""The model formats slabconv reads, by the kind ``sniff_contents`` names: how to say it, and the suffix whose reader
reads it (``slabconv.load.formats`` picks a reader by the suffix; any other suffix is read as a pickle)."""


def sniff_contents(head: bytes, names: list[str] | None = None) -> str | None:
    """What a file is, from its first 512 bytes and, for a zip archive, its entry names; None when unknown.

    Returns:
        A key of ``_MODEL_FORMATS`` (``torch.export``, ``onnx``, ``safetensors``, ``pickle``), ``tar``, ``gzip``,
        ``zip`` (an archive neither torch.save nor torch.export.save wrote) or ``plain-pickle`` (a pickle that is not
        a pre-1.6 torch.save file). Nothing is parsed beyond these bytes: the kind is a guess for the message of a
        file its reader refused.
    """
    if names is not None:
        rel = {n.split("/", 1)[1] if "/" in n else n for n in names}
        if "archive_format" in rel or any(r.startswith(("models/", "serialized_")) for r in rel):  # (older torch)
            return "torch.export"
        return "pickle" if "data.pkl" in rel else "zip"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x80"):
        return "pickle" if _LEGACY_MAGIC in head[:32] else "plain-pickle"
    header = int.from_bytes(head[:8], "little") if len(head) >= 9 else 0
    if 2 <= header < 100 << 20 and head[8:9] == b"{":
        return "safetensors"
    # ModelProto: field 1 (ir_version, a small varint), then a field of the model (producer, graph, opsets...)
    if len(head) >= 3 and head[0] == 0x08 and 1 <= head[1] <= 32 and head[2] in b"\x12\x1a\x22\x28\x32\x3a\x42\x72":
        return "onnx"
    return None


class WrongKind(InputError):
    """A file that is not of the format its reader reads (``content_error``): final, also with ``--trust-pickle``."""


def content_error(label: str, head: bytes, names: list[str] | None = None) -> WrongKind | None:
    """The error for a file its reader refused, saying what the file is when its first bytes (and a zip's entry
    names) tell: a model format of another suffix (rename it), an archive to extract, a pickle torch.save did not
    write. None when they tell nothing, or tell the format its suffix already names (a damaged file of that kind).

    Args:
        label: the user's path; its suffix says which reader was used.
        head: the file's first 512 bytes.
        names: a zip archive's entry names, or None for a file that is not one.
    """
    kind = sniff_contents(head, names)
    path = Path(label)
    suffix = path.suffix.lower()
    read_as = next((k for k, (_, s) in _MODEL_FORMATS.items() if s == suffix and k != "pickle"), "pickle")
    if kind in _MODEL_FORMATS and kind != read_as:
        what, right = _MODEL_FORMATS[kind]
        named = f"named {suffix}" if suffix else "without a suffix"
        return WrongKind(
            f"{label}: is {what}, {named}; slabconv reads a file by its suffix: rename it to {path.stem}{right}"
        )
    if kind == "tar":
        return WrongKind(
            f"{label}: is a tar archive, not a model file; extract it (tar -xf {label}) and give the file inside it"
        )
    if kind == "gzip":
        return WrongKind(
            f"{label}: is gzip-compressed, not a model file; decompress it (gunzip, or tar -xzf for a .tar.gz) and "
            "give the file inside it"
        )
    if kind == "zip" and names is not None:
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return WrongKind(
            f"{label}: is a zip archive that neither torch.save nor torch.export.save wrote (it holds {listed}); "
            f"extract it (unzip {label}) and give the file inside it"
        )
    if kind == "plain-pickle":
        return WrongKind(
            f"{label}: is a Python pickle that torch.save did not write (pickle.dump?); save the weights with "
            "torch.save(model.state_dict(), 'weights.pth')"
        )
    return None


def check_archive_kind(source: Path | IO[bytes], label: str, names: list[str]) -> None:
    """Refuse a zip archive (checked by ``check_zip``, entry ``names``) whose entries say it is another format than
    its suffix names, or none slabconv reads (``content_error``): a ``.pt2`` named ``.pth``, a zip of files.

    Raises:
        InputError: saying what the archive is and what to do.
    """
    err = content_error(label, _head(source), names)
    if err is not None:
        raise err


def _not_a_zip(source: Path | bytes | IO[bytes], label: str, detail: str) -> InputError:
    """The error for a file ``zipfile`` cannot open, by what its first bytes say it is."""
    head = _head(source)
    if head.startswith(b"PK"):
        return InputError(
            f"{label}: not a readable PyTorch checkpoint (its zip archive is damaged or truncated: {detail}); "
            "use an intact copy"
        )
    if sniff_contents(head) == "pickle":
        return InputError(
            f"{label}: a pickle in the pre-1.6 torch.save format, whose storage sizes cannot be checked before they "
            "are allocated; re-save it with torch.save under torch >= 1.6 (or pass --trust-pickle if you trust it)"
        )
    return content_error(label, head) or InputError(
        f"{label}: not a readable PyTorch checkpoint (not a zip archive); the file is damaged or not a checkpoint"
    )


# --------------------------------------------------------------------------------------------- tensor sizes


def materialised_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes once made contiguous: ``numel * element_size`` (a stride-0 view counts in full)."""
    return int(t.numel()) * t.element_size()


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts / lists / tuples, with a dotted path naming it."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<tensor>", obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{prefix}.{i}" if prefix else str(i))


class TensorBudget:
    """The tensors of one file against the limits every format shares (``docs/security.md``, Limits): at most
    ``MAX_TENSORS`` of them, and their bytes once materialised at most ``EXPANSION`` times the file's size plus
    ``FLOOR_BYTES``. Checkpoints (``check_extents``) and ONNX files (``slabconv.load.onnx_file``) count through it.

    Args:
        label: the user's path, for errors.
        file_bytes: the size the tensors are budgeted against (a file and the data files it names).
    """

    def __init__(self, label: str, file_bytes: int) -> None:
        self.label = label
        self.file_bytes = file_bytes
        self.limit = EXPANSION * file_bytes + FLOOR_BYTES
        self.count = 0
        self.total = 0

    def add(self, what: str, shape: Any, dtype: str, size: int) -> None:
        """Count one tensor of ``size`` bytes materialised (``what`` names it, e.g. ``tensor 'w'``).

        Raises:
            InputError: more than ``MAX_TENSORS`` tensors, or the bytes so far over the budget (naming the tensor).
        """
        self.count += 1
        if self.count > MAX_TENSORS:
            raise InputError(
                f"{self.label}: the file holds more than {MAX_TENSORS} tensors (slabconv's limit; see "
                "docs/security.md); refused before reading them"
            )
        self.total += size
        if self.total > self.limit:
            dims = "x".join(str(s) for s in shape)
            raise InputError(
                f"{self.label}: {what} ({dims} {dtype}) would take {_human(size)} in memory, more than a "
                f"{_human(self.file_bytes)} file can hold (a view or a shape much larger than its stored data); "
                "refused before allocating it"
            )


def check_extents(obj: Any, file_bytes: int, label: str) -> None:
    """Refuse a loaded object whose tensors, materialised, would take more than the budget (``TensorBudget``).

    torch itself checks that every view lies inside its storage; what it does not check is a view much larger than
    its storage (stride 0), which costs nothing until something copies it.

    Raises:
        InputError: naming the tensor that crosses the budget and its size.
    """
    budget = TensorBudget(label, file_bytes)
    for name, t in iter_tensors(obj):
        budget.add(f"tensor {name!r}", t.shape, str(t.dtype).removeprefix("torch."), materialised_bytes(t))


FOLDABLE_FLOATS = ("float16", "bfloat16", "float32", "float64")
"""The floating dtypes slabconv folds (a fold is computed in float64 and rounded once to one of them)."""


def unfoldable_dtype(label: str, what: str, dtype: str) -> InputError:
    """The one refusal of a tensor whose dtype no fold can be trusted with, in every format: complex (a fold in
    float64 would drop the imaginary part), quantized, float8 and narrower (their storage is not the value), text.
    Both sides of a verification would agree on the wrong numbers, so it is refused, not verified.

    Args:
        label: the user's path; what: the tensor (``tensor 'w'``, ``initializer 'bn.var'``); dtype: its name.
    """
    return InputError(
        f"{label}: {what} is {dtype}; slabconv folds float16, bfloat16, float32 and float64 models: convert the "
        "model to one of those first"
    )


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# --------------------------------------------------------------------------------------------- pickles


def weights_only_load(source: Path | bytes | IO[bytes], label: str, file_bytes: int | None = None) -> Any:
    """``torch.load(weights_only=True)`` on CPU with ``ALLOWED_GLOBALS``, after ``check_zip`` and
    ``count_pickled_tensors``, then ``check_extents``.

    A path is opened once (``open_regular``): the checks and the load read the same open file.

    Args:
        source: a path, bytes (a pickle inside a ``.pt2``) or an open binary file.
        label: the user's path, for errors.
        file_bytes: the size the extents are budgeted against (default: the source's own size).

    Raises:
        InputError: not a regular file, the archive checks fail, too many tensors, the pickle names a global
            outside the allowlist (message names it), the file is damaged, or its tensors are too large for it.
        pickle.UnpicklingError: re-raised for the caller to explain (``refusal``) when the weights-only reader
            refuses the pickle.
    """
    import warnings

    if isinstance(source, Path):
        with open_regular(source, "the checkpoint") as f:
            return weights_only_load(f, label, file_bytes)
    names, pkl = _check_zip(source, label, read="data.pkl")
    if not isinstance(source, (bytes, bytearray)):  # a file (bytes are a pickle inside a program)
        check_archive_kind(source, label, names)
    count_pickled_tensors(source, names, label, pkl)
    if isinstance(source, (bytes, bytearray)):
        size = file_bytes if file_bytes is not None else len(source)
        target: Any = io.BytesIO(source)
    else:
        size = file_bytes if file_bytes is not None else os.fstat(source.fileno()).st_size
        target = source
        target.seek(0)
    allowed: list[Any] = [(cls, name) for name, cls in ALLOWED_GLOBALS.items()]
    with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol N": the error, if any, says enough
        # torch.serialization.load is torch.load itself; no_code_from_pickles replaces only the name torch.load.
        obj = torch.serialization.load(target, map_location="cpu", weights_only=True)
    check_nesting(obj, label)
    check_extents(obj, size, label)
    return obj


def check_nesting(obj: Any, label: str) -> None:
    """Refuse a loaded pickle nested deeper than ``MAX_JSON_DEPTH`` containers, or whose containers are reached
    more than ``MAX_PICKLE_OPS`` times (a pickle can refer to one list from many places, at every level: a few
    bytes that every walk over it, ``plain`` and ``iter_tensors`` included, would take exponential time to visit).
    Walked without recursion, so a 10,000-deep config is one line, not a ``RecursionError``.

    Raises:
        InputError: naming the file and the limit.
    """
    stack = [(obj, 0)]
    visits = 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = item
        else:
            continue
        visits += 1
        if depth >= MAX_JSON_DEPTH:
            raise InputError(
                f"{label}: the pickle nests deeper than slabconv's limit of {MAX_JSON_DEPTH} levels; refused"
            )
        if visits > MAX_PICKLE_OPS:
            raise InputError(
                f"{label}: the pickle refers to its containers more than {MAX_PICKLE_OPS} times (slabconv's limit; "
                "see docs/security.md); refused"
            )
        stack.extend((child, depth + 1) for child in children)


def count_pickled_tensors(source: bytes | IO[bytes], names: list[str], label: str, data: bytes | None = None) -> int:
    """The number of tensors a ``torch.save`` archive's ``data.pkl`` refers to, counted in its opcodes (each tensor
    is one persistent-id reference to its storage) without unpickling anything.

    Args:
        source: the archive (its ``data.pkl`` is read unless ``data`` is given).
        names: its entry names.
        label: the user's path, for errors.
        data: the ``data.pkl`` bytes, when the caller has them already.

    Raises:
        InputError: more than ``MAX_TENSORS`` tensors or ``MAX_PICKLE_OPS`` opcodes (named with the limit).
    """
    if data is None:
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            return 0
        opened: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
        with zipfile.ZipFile(opened) as archive:
            data = archive.read(pkl)
    tensors = ops = 0
    for code in _opcodes(data):
        ops += 1
        if code in _PERSID:
            tensors += 1
            if tensors > MAX_TENSORS:
                raise InputError(
                    f"{label}: the pickle holds more than {MAX_TENSORS} tensors (slabconv's limit; see "
                    "docs/security.md); refused before reading them"
                )
        if ops > MAX_PICKLE_OPS:
            raise InputError(
                f"{label}: the pickle has more than {MAX_PICKLE_OPS} opcodes (slabconv's limit; see "
                "docs/security.md); refused before reading it"
            )
    return tensors


_PERSID = frozenset(b"PQ")  # PERSID, BINPERSID: one per tensor torch.save pickles (its storage reference)


def _opcode_table() -> list[tuple[int, int] | None]:
    """For each opcode byte: how its argument is laid out, as (kind, size): kind 0 a fixed ``size`` bytes, 1 up to
    ``size`` newlines, 2 (3: signed) a little-endian length of ``size`` bytes followed by that many bytes (from
    pickletools' table)."""
    table: list[tuple[int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        arg, code = op.arg, ord(op.code)
        if arg is None:
            table[code] = (0, 0)
        elif arg.n >= 0:
            table[code] = (0, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = (1, 2 if arg.name.endswith("_pair") else 1)
        else:
            width = {
                pickletools.TAKEN_FROM_ARGUMENT1: 1,
                pickletools.TAKEN_FROM_ARGUMENT4: 4,
                pickletools.TAKEN_FROM_ARGUMENT4U: 4,
                pickletools.TAKEN_FROM_ARGUMENT8U: 8,
            }[arg.n]
            table[code] = (3 if arg.n == pickletools.TAKEN_FROM_ARGUMENT4 else 2, width)
    return table


_OPCODE_TABLE = _opcode_table()


def _opcodes(data: bytes) -> Iterator[int]:
    """The opcode bytes of a pickle up to its STOP, skipping their arguments without decoding them: the count above
    walks 100,000 tensors' worth in about a second (``pickletools.genops``, which decodes every argument, takes
    several). A damaged stream ends the walk (the weights-only reader then says what is wrong with it)."""
    pos, end, table = 0, len(data), _OPCODE_TABLE
    while pos < end:
        code = data[pos]
        layout = table[code]
        if layout is None:
            return
        yield code
        if code == 0x2E:  # STOP
            return
        kind, size = layout
        pos += 1
        if kind == 0:
            pos += size
        elif kind == 1:
            for _ in range(size):
                newline = data.find(b"\n", pos)
                if newline < 0:
                    return
                pos = newline + 1
        else:
            length = int.from_bytes(data[pos : pos + size], "little", signed=kind == 3)
            if length < 0:
                return
            pos += size + length


def unsafe_globals(source: Path | IO[bytes]) -> list[str]:
    """The ``module.name`` globals a pickle names outside torch's and slabconv's allowlists (read, not run); an open
    file is read from its start."""
    try:
        if not isinstance(source, Path):
            source.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # noqa: BLE001 - a damaged file: the caller reports the load error instead
        return []
    return [n for n in names if n not in ALLOWED_GLOBALS]


SAVE_PROGRAM = (
    "torch.export.save(torch.export.export(model.eval(), (example,), "
    "dynamic_shapes=({0: torch.export.Dim('batch')},)), 'model.pt2')"
)
"""How to save a model as a program, which loads without its code (docs/own-model.md)."""


def refusal(label: str, err: BaseException, path: Path | IO[bytes] | None = None) -> InputError:
    """The one-line error for a pickle that the weights-only reader refused, naming the offending global."""
    from slabconv.errors import first_line

    text = str(err)
    first = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    unsafe = unsafe_globals(path) if path is not None else []
    if first or unsafe:
        named = first.group(1) if first else unsafe[0]
        named = named if (named in unsafe or not unsafe) else unsafe[0]
        if any(n.startswith("torch.nn.modules.") for n in unsafe) or named.startswith("torch.nn.modules."):
            return InputError(
                f"{label}: holds a whole pickled nn.Module ({named}), and loading one runs code from the file; "
                f"pass --trust-pickle --input-shape C,H,W if you trust it, or save a program instead: {SAVE_PROGRAM}"
            )
        others = [n for n in unsafe if n != named][:3]
        also = f" (also: {', '.join(others)})" if others else ""
        return InputError(
            f"{label}: the pickle names the Python global {named!r}{also}, which slabconv will not import "
            "(loading it could run code); re-save the weights as a plain state_dict, or pass --trust-pickle "
            "if you trust this file"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    reason = detail.group(1).strip()[:200] if detail else first_line(err)
    return InputError(f"{label}: not a readable PyTorch checkpoint ({reason}); the file is damaged or not a checkpoint")


class PickleRefused(pickle.UnpicklingError):
    """Raised instead of unpickling a Python object inside a ``.pt2`` (see ``no_code_from_pickles``)."""


@contextlib.contextmanager
def no_code_from_pickles(label: str, file_bytes: int) -> Iterator[None]:
    """While ``torch.export.load`` runs: every ``torch.load`` is ``weights_only_load`` (archive checks, allowlist,
    extents), and ``pickle.loads`` / ``torch._C._pickle_load_obj`` are refused.

    torch's reader unpickles some entries with ``weights_only=False`` (weights or constants marked ``use_pickle``,
    the sample inputs when the weights-only reader refuses them) and opaque constants with ``pickle.loads``: a
    hostile file could run code there. Patched process-wide for the duration of the call (slabconv loads one file
    at a time).
    """
    from unittest import mock

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        data = f.getvalue() if hasattr(f, "getvalue") else f.read() if hasattr(f, "read") else Path(f).read_bytes()
        return weights_only_load(bytes(data), label, file_bytes)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PickleRefused("the program holds a pickled Python object")

    with (
        mock.patch.object(torch, "load", load),
        mock.patch.object(pickle, "loads", refuse),
        mock.patch.object(torch._C, "_pickle_load_obj", refuse),
    ):
        yield
