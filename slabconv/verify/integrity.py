"""Checks of written files that are not numbers: ``onnx.checker``'s full check (what question 1 reads of a fused
``model.safetensors`` is the file itself, read back)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from slabconv.errors import InputError, first_line
from slabconv.write.onnx import PROTOBUF_LIMIT_BYTES, onnx_files


def check_onnx_file(path: Path) -> tuple[bool, str]:
    """Read an ONNX file and run ``onnx.checker`` with ``full_check`` (external data followed).

    Returns:
        ``(passed, one-line detail)``; a model the checker rejects is a failed check, not an error.

    Raises:
        InputError: missing file or not a regular file; an initializer ``check_onnx_tensors`` refuses; one file
            over protobuf's 2 GiB limit (the case ONNX cannot represent without external data); unreadable
            protobuf; external data files that are not beside it.
    """
    import onnx

    from slabconv.load.safety import regular_file

    size = regular_file(path, "the ONNX file").st_size  # a FIFO or device is refused before anything opens it
    if size > PROTOBUF_LIMIT_BYTES:
        raise InputError(
            f"{path}: one ONNX file of {size / 2**30:.1f} GiB is over protobuf's 2 GiB limit and cannot be read; "
            "re-save it with its weights as external data: onnx.save_model(model, path, save_as_external_data=True)"
        )
    try:
        files = onnx_files(path)
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise InputError(f"{path}: not a readable ONNX file ({first_line(err)})") from None
    check_onnx_tensors(path, model)
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


_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def check_onnx_tensors(path: Path, model: Any) -> None:
    """Check every initializer of an ONNX model (read without its external data) before anything reads its data.

    External data must be a plain file name or relative path inside the model's folder, not absolute, not leaving
    it, not a symbolic link, and hold the bytes the tensor declares; data stored inline must be as long as the
    tensor's shape says; complex tensors are refused (verification compares real numbers).

    Args:
        path: the ``.onnx`` file (named in errors).
        model: its ``onnx.ModelProto`` loaded with ``load_external_data=False``.

    Raises:
        InputError: naming the file, the tensor and what is wrong.
    """
    from onnx import TensorProto, helper
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = path.parent.resolve()
    for tensor in model.graph.initializer:
        name = tensor.name[:80]
        if tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
            raise InputError(f"{path}: initializer {name!r} is complex; slabconv verifies models of real tensors only")
        try:
            itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except Exception:  # noqa: BLE001 - a type numpy has no dtype for: onnx.checker judges it
            continue
        numel = math.prod(int(d) for d in tensor.dims)
        if any(int(d) < 0 for d in tensor.dims):
            raise InputError(f"{path}: initializer {name!r} has a negative size; the file is damaged")
        declared = numel * itemsize
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            location = str(info.location)
            target = folder / location
            if (
                not location
                or os.path.isabs(location)
                or ".." in Path(location).parts
                or target.is_symlink()
                or not target.resolve().is_relative_to(folder)
            ):
                raise InputError(
                    f"{path}: initializer {name!r} keeps its data in {location[:120]!r}, which is not a file inside "
                    "the model's folder (absolute, leaving it, or a link); refused: keep the data files beside it"
                )
            if not target.exists():
                continue  # reported by the caller as missing
            stored = target.stat().st_size
            offset = int(info.offset or 0)
            length = int(info.length) if info.length is not None else stored - offset
            if offset < 0 or length < declared or offset + length > stored:
                raise InputError(
                    f"{path}: initializer {name!r} declares {declared} bytes but {location[:120]!r} holds "
                    f"{max(0, min(length, stored - offset))} for it; the file is damaged"
                )
        elif tensor.HasField("raw_data"):
            if len(tensor.raw_data) != declared:
                raise InputError(
                    f"{path}: initializer {name!r} declares {declared} bytes but holds {len(tensor.raw_data)}; "
                    "the file is damaged"
                )
        else:
            held = sum(len(getattr(tensor, field)) for field in _TYPED_FIELDS)
            if held < numel:
                raise InputError(
                    f"{path}: initializer {name!r} declares {numel} values but holds {held}; the file is damaged"
                )
