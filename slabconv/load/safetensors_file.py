"""A ``.safetensors`` file read once: its header is counted and checked, its tensors are read from the same open
file, and its sha256 is taken from the very bytes read (so the digest a report records is of the weights folded).

The format (github huggingface/safetensors, ``docs``): 8 bytes little-endian header length ``N``, ``N`` bytes of
JSON (``{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}``),
then the data; offsets are relative to the data's start, and the tensors cover it exactly, without gaps or
overlaps.

Limits (``docs/security.md``): the header is at most ``MAX_HEADER_BYTES`` (the library's own limit); its entries
are counted in the raw bytes (one ``data_offsets`` per tensor) before the JSON is parsed, and more than
``safety.MAX_TENSORS`` is refused: no per-key object is built for a file with a million keys.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path
from typing import IO, Any

import torch

from slabconv.errors import InputError
from slabconv.load import safety

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors library itself accepts (``N_MAX_HEADER_SIZE``)."""

_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "C64": torch.complex64,
    }.items()
    if dtype is not None
}

_BLOCK = 1 << 24


def read_safetensors(
    path: Path | str, what: str = "the checkpoint"
) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Every tensor of a ``.safetensors`` file, its string metadata and the sha256 of the bytes read.

    The path is opened once (``safety.open_regular``); the header, the data and the digest all come from that open
    file, read front to back.

    Raises:
        InputError: not a regular file, a header over the limits (size, more than ``safety.MAX_TENSORS`` tensors),
            a damaged header (offsets that do not tile the data, a shape that does not match its bytes, an unknown
            dtype), or a file shorter than its header says. One line naming the file.
    """
    label = str(path)
    with safety.open_regular(path, what) as f:
        digest = hashlib.sha256()
        metadata, entries, _ = read_header(f, label, digest)
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, _, nbytes in entries:
            flat = torch.empty(nbytes, dtype=torch.uint8)
            buffer = flat.numpy().data  # the tensor's own memory: read into it, hashed from it
            if nbytes and f.readinto(buffer) != nbytes:  # type: ignore[attr-defined]
                raise _damaged(label, f"the file ends inside tensor {name!r}")
            digest.update(buffer)
            tensor = flat.view(dtype)
            if sys.byteorder == "big" and dtype.itemsize > 1:  # pragma: no cover - safetensors is little-endian
                tensor = torch.from_numpy(tensor.numpy().byteswap())
            tensors[name] = tensor.reshape(shape)
        for block in iter(lambda: f.read(_BLOCK), b""):  # trailing bytes, if any: the digest covers the whole file
            digest.update(block)
    return tensors, metadata, digest.hexdigest()


Entry = tuple[str, torch.dtype, list[int], int, int]
"""One tensor of a header: ``(name, dtype, shape, begin, nbytes)``, ``begin`` relative to the data's start."""


def read_header(f: IO[bytes], label: str, digest: Any = None) -> tuple[dict[str, str], list[Entry], int]:
    """The header of the open safetensors file ``f``, read from its start and checked (``read_safetensors``).

    Args:
        f: the file, at its start; left at the start of the data.
        label: the user's path, for errors.
        digest: a ``hashlib`` object fed the bytes read, when given.

    Returns:
        ``(metadata, entries, data_start)``: the string metadata, the tensors in file order (``Entry``; they tile
        the data exactly) and the byte offset of the data in the file.

    Raises:
        InputError: a header over the limits or damaged, as ``read_safetensors``.
    """
    size = os.fstat(f.fileno()).st_size
    head = _read(f, 8, digest)
    if len(head) < 8:
        raise _damaged(label, "shorter than its 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        raise _damaged(label, f"its header length {n} is past the end of the file")
    if n > MAX_HEADER_BYTES:
        raise InputError(f"{label}: a safetensors header of {n} bytes, over the limit of {MAX_HEADER_BYTES}; refused")
    raw = _read(f, n, digest)
    count = raw.count(b'"data_offsets"')
    if count > safety.MAX_TENSORS:
        raise InputError(
            f"{label}: the safetensors header lists more than {safety.MAX_TENSORS} tensors (slabconv's limit; "
            "see docs/security.md); refused before reading them"
        )
    header = _parse_header(raw, label)
    if not isinstance(header, dict):
        raise _damaged(label, "its header is not a JSON object")
    metadata = _metadata(header.pop("__metadata__", None), label)
    return metadata, _entries(header, label, size - 8 - n), 8 + n


def _parse_header(raw: bytes, label: str) -> Any:
    """The header's JSON, parsed as every JSON input is (``safety.parse_json``: its depth bounded, a key twice
    refused: a tensor named twice would be one tensor to one reader and another to the next)."""
    try:
        return safety.parse_json(raw, label, len(raw))
    except safety.InvalidJSON:
        raise _damaged(label, "its header is not JSON") from None


def _read(f: IO[bytes], n: int, digest: Any) -> bytes:
    data = f.read(n)
    if digest is not None:
        digest.update(data)
    return data


def _damaged(label: str, why: str) -> InputError:
    return InputError(f"{label}: not a readable safetensors file ({why}); the header or data is damaged")


def _metadata(value: Any, label: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _damaged(label, "its __metadata__ is not a map of strings")
    return dict(value)


def _entries(header: dict[str, Any], label: str, data_bytes: int) -> list[Entry]:
    """The tensors in file order (``Entry``), after checking that they tile the data exactly."""
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _damaged(label, f"entry {name!r} is not an object")
        dtype = _DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise _damaged(label, f"tensor {name!r} has dtype {entry.get('dtype')!r}, which slabconv does not read")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise _damaged(label, f"tensor {name!r} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(label, f"tensor {name!r} has no valid data_offsets")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise _damaged(label, f"tensor {name!r}: its shape {shape} does not match its {end - begin} bytes")
        spans.append((begin, end, name, dtype, shape))
    spans.sort(key=lambda s: (s[0], s[1]))
    position = 0
    for begin, end, name, _, _ in spans:
        if begin != position:
            raise _damaged(label, f"tensor {name!r} does not start where the one before it ends")
        position = end
    if position != data_bytes:
        raise _damaged(label, f"the tensors cover {position} of its {data_bytes} data bytes")
    return [(name, dtype, shape, begin, end - begin) for begin, end, name, dtype, shape in spans]
