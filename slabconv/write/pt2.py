"""The fused model as a ``torch.export`` program (``model.pt2``): what ``torch.compile``, AOTInductor,
ExecuTorch and torch-TensorRT take, loadable with ``torch.export.load`` without slabconv installed."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from slabconv.engine import lift_program
from slabconv.engine.capture import axis_attempts, graph_axes
from slabconv.errors import HeldInterrupts, UnsupportedModelError, first_line
from slabconv.load.fused import PROGRAM_INFO
from slabconv.util import quiet
from slabconv.version import __version__

MARK = PROGRAM_INFO
"""The extra file every ``.pt2`` slabconv writes carries: its version, and what the program takes."""


def export_program(
    model: torch.nn.Module, example: torch.Tensor, original: torch.export.ExportedProgram | None = None
) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """The fused model as a ``torch.export`` program, made once: ``model.pt2`` saves it and ``model.onnx`` is
    translated from it.

    With ``original`` (the program the engine's graph was unlifted from), the fused graph is lifted back into a
    program of that capture (``engine.lift_program``: no second trace, same dynamic axes). Otherwise, or where the
    graph holds what the lift does not cover, ``torch.export`` traces the fused model: axis 0 (batch) is dynamic
    unless the model's code fixes it (a program recorded with a static batch whose graph bakes that size in); a
    graph captured with a symbolic sequence axis (a language model, ``engine.capture`` with ``sequence``) keeps
    it, with its bounds.

    Args:
        model: the fused model (a ``GraphModule`` from the engine).
        example: one input ``(B, ...)`` in the model's dtype (int64 ids for a language model).
        original: the original's program (``engine.capture_program``), when ``model`` is the engine's fold of it.

    Returns:
        The ``ExportedProgram`` and ``{"dynamic_batch": bool, "batch": int or None, "dynamic_sequence": bool}``
        (``batch``: the fixed batch size when not dynamic).

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the fused model.
    """
    lifted = lift_program(model, original) if original is not None and isinstance(model, fx.GraphModule) else None
    if lifted is not None:
        return lifted, _axes_info(graph_axes(model), example)  # the lifted program keeps the graph's own axes
    last: Exception | None = None
    for axes in axis_attempts(model):
        try:
            with quiet():
                program = torch.export.export(model, (example,), dynamic_shapes=(axes,) if axes else None)
        except Exception as err:  # noqa: BLE001 - torch.export raises many types
            last = err
            continue
        return program, _axes_info(axes, example)
    raise UnsupportedModelError(f"torch.export could not export the fused model: {first_line(last)}")


def _axes_info(axes: dict[int, Any] | None, example: torch.Tensor) -> dict[str, Any]:
    """``export_program``'s info from the dynamic axes the program was made with (``Dim``s by axis)."""
    dynamic = bool(axes)
    return {
        "dynamic_batch": dynamic,
        "batch": None if dynamic else int(example.shape[0]),
        "dynamic_sequence": bool(axes and 1 in axes),
    }


class _Guarded(io.RawIOBase):
    """An open file for torch's C++ zip writer that never raises into it: the first ``OSError`` (a full disk, an
    I/O error) is kept and later writes are dropped, so the writer finishes (and its destructor, which writes the
    zip's end, runs) without an exception crossing C++; ``save_pt2`` raises the kept error once torch returns.

    Source: torch's ``PyTorchFileWriter`` turns an exception of a Python ``write`` into ``pybind11::error_already_set``;
    one raised while the writer is destroyed ends the process with ``std::terminate`` (SIGABRT), as does its own
    file writer on a failed ``fwrite`` (``[enforce fail at inline_container.cc]``).
    """

    def __init__(self, file: io.BufferedWriter) -> None:
        super().__init__()
        self.file = file
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _guarded(self, call: Callable[[], Any], default: Any) -> Any:
        """``call()`` until the first ``OSError``, which is kept; ``default`` from then on."""
        if self.error is None:
            try:
                return call()
            except OSError as err:
                self.error = err
        return default

    def write(self, data: Any) -> int:
        self._guarded(lambda: self.file.write(data), None)
        return memoryview(data).nbytes

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._guarded(lambda: self.file.seek(offset, whence), 0))

    def tell(self) -> int:
        return int(self._guarded(self.file.tell, 0))

    def flush(self) -> None:
        self._guarded(self.file.flush, None)


def save_pt2(program: torch.export.ExportedProgram, info: dict[str, Any], path: Path) -> None:
    """Save ``program`` to ``path`` with slabconv's extra file (``MARK``: its version and ``info``).

    torch writes into a file opened here, through ``_Guarded``: a full disk or an I/O error is an ``OSError``
    raised here (the staging folder maps it to one line and removes itself), never a C++ abort; a path whose name
    is not UTF-8 is opened by Python, which torch's own writer cannot do. A signal that lands while torch writes
    is held until the file is whole (``errors.HeldInterrupts``): a ``KeyboardInterrupt`` unwinding through torch's
    zip writer makes its destructor throw ("unexpected pos"), which aborts the process (SIGABRT) and leaves the
    staging folder behind.

    Raises:
        OSError: the file cannot be written (ENOSPC, EIO, EACCES, ...).
    """
    extra = {MARK: json.dumps({"slabconv_version": __version__, **info})}
    with open(path, "wb") as file:
        guarded = _Guarded(file)
        with quiet(), HeldInterrupts():
            torch.export.save(program, guarded, extra_files=extra)  # type: ignore[arg-type] # a RawIOBase
        guarded.flush()
        if guarded.error is not None:
            raise guarded.error
