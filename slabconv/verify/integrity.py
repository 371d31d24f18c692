"""Checks of written files that are not numbers: a safetensors reload, ``onnx.checker``'s full check."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slabconv.errors import InputError, first_line
from slabconv.verify.results import IntegrityCheck
from slabconv.write.onnx import PROTOBUF_LIMIT_BYTES, onnx_files


def check_safetensors_reload(
    path: Path, expected: Mapping[str, Any], expected_metadata: Mapping[str, str] | None = None
) -> IntegrityCheck:
    """Read ``path`` back and compare every tensor, bit for bit, with ``expected`` (name -> torch tensor), and
    its string metadata with ``expected_metadata``."""
    import torch
    from safetensors.torch import load_file, safe_open

    name = f"safetensors reload {path.name}"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        loaded = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types on a bad file
        return IntegrityCheck(name, False, f"cannot read it back: {first_line(err)}")
    if expected_metadata is not None and metadata != dict(expected_metadata):
        keys = sorted(k for k in set(metadata) | set(expected_metadata) if metadata.get(k) != expected_metadata.get(k))
        return IntegrityCheck(name, False, f"metadata read back differs from what was written: {keys}")
    if set(loaded) != set(expected):
        diff = sorted(set(loaded) ^ set(expected))[:4]
        return IntegrityCheck(name, False, f"tensor names differ from what was written: {diff}")
    for key, value in expected.items():
        got = loaded[key]
        if got.dtype != value.dtype or got.shape != value.shape or not torch.equal(got, value.detach().cpu()):
            return IntegrityCheck(name, False, f"tensor {key!r} read back differs from what was written")
    return IntegrityCheck(name, True, f"{len(loaded)} tensors read back bit-equal")


def check_onnx_file(path: Path) -> tuple[bool, str]:
    """Read an ONNX file and run ``onnx.checker`` with ``full_check`` (external data followed).

    Returns:
        ``(passed, one-line detail)``; a model the checker rejects is a failed check, not an error.

    Raises:
        InputError: missing file; one file over protobuf's 2 GiB limit (the case ONNX cannot represent
            without external data); unreadable protobuf; external data files that are not beside it.
    """
    import onnx

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    size = path.stat().st_size
    if size > PROTOBUF_LIMIT_BYTES:
        raise InputError(
            f"{path}: one ONNX file of {size / 2**30:.1f} GiB is over protobuf's 2 GiB limit and cannot be read; "
            "re-save it with its weights as external data: onnx.save_model(model, path, save_as_external_data=True)"
        )
    try:
        files = onnx_files(path)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise InputError(f"{path}: not a readable ONNX file ({first_line(err)})") from None
    missing = [f.name for f in files[1:] if not f.is_file()]
    if missing:
        raise InputError(
            f"{path}: its weights are in external data file(s) {', '.join(missing)} that are not beside it; "
            "copy them next to the .onnx"
        )
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as err:  # noqa: BLE001 - ValidationError, InferenceError, ...
        return False, first_line(err)
    return True, "onnx.checker full_check passed"
