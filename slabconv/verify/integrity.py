"""Checks of written files that are not numbers: ``onnx.checker``'s full check (what question 1 reads of a fused
``model.safetensors`` is the file itself, read back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slabconv.errors import InputError, SlabconvError, first_line
from slabconv.load.onnx_file import check_graph_inputs, check_protobuf_size, check_tensors
from slabconv.util import text_path


def check_onnx_file(path: Path) -> tuple[bool, str]:
    """Read an ONNX file and run ``onnx.checker`` with ``full_check`` (external data followed).

    Returns:
        ``(passed, one-line detail)``; a model the checker rejects is a failed check, not an error.

    Raises:
        InputError: missing file or not a regular file; a tensor ``check_onnx_tensors`` refuses (external data
            missing or not beside it included); one file over protobuf's 2 GiB limit (the case ONNX cannot
            represent without external data); unreadable protobuf.
    """
    import onnx

    check_protobuf_size(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise InputError(f"{path}: not a readable ONNX file ({first_line(err)})") from None
    check_onnx_tensors(path, model)  # every tensor, its external data beside it (missing files named)
    check_graph_inputs(path, model)
    try:
        with text_path(path) as text:  # the C++ checker takes UTF-8 paths only
            onnx.checker.check_model(text, full_check=True)
    except SlabconvError:
        raise
    except Exception as err:  # noqa: BLE001 - ValidationError, InferenceError, ...
        return False, first_line(err)
    return True, "onnx.checker full_check passed"


def check_onnx_tensors(path: Path, model: Any) -> None:
    """Check every tensor of an ONNX model (read without its external data) before anything reads its data: the
    one checked loader's ``slabconv.load.onnx_file.check_tensors`` (initializers, ``Constant`` values, subgraphs,
    sparse tensors, functions; dtypes, sizes, where external data lives).

    Args:
        path: the ``.onnx`` file (named in errors).
        model: its ``onnx.ModelProto`` loaded with ``load_external_data=False``.

    Raises:
        InputError: naming the file, the tensor and what is wrong.
    """
    check_tensors(path, model)
