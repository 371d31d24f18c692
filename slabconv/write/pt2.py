"""The fused model as a ``torch.export`` program (``model.pt2``): what ``torch.compile``, AOTInductor,
ExecuTorch and torch-TensorRT take, loadable with ``torch.export.load`` without slabconv installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from slabconv.engine.capture import axis_attempts
from slabconv.errors import UnsupportedModelError, first_line
from slabconv.util import quiet
from slabconv.version import __version__

MARK = "slabconv.json"
"""The extra file every ``.pt2`` slabconv writes carries: its version, and what the program takes."""


def export_program(
    model: torch.nn.Module, example: torch.Tensor
) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """``torch.export`` of the fused model, once: ``model.pt2`` saves it and ``model.onnx`` is translated from it.

    Axis 0 (batch) is dynamic unless the model's code fixes it (a program recorded with a static batch whose graph
    bakes that size in); a graph captured with a symbolic sequence axis (a language model, ``engine.capture`` with
    ``sequence``) keeps it, with its bounds.

    Args:
        model: the fused model (a ``GraphModule`` from the engine).
        example: one input ``(B, ...)`` in the model's dtype (int64 ids for a language model).

    Returns:
        The ``ExportedProgram`` and ``{"dynamic_batch": bool, "batch": int or None, "dynamic_sequence": bool}``
        (``batch``: the fixed batch size when not dynamic).

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the fused model.
    """
    last: Exception | None = None
    for axes in axis_attempts(model):
        try:
            with quiet():
                program = torch.export.export(model, (example,), dynamic_shapes=(axes,) if axes else None)
        except Exception as err:  # noqa: BLE001 - torch.export raises many types
            last = err
            continue
        dynamic = bool(axes)
        info = {
            "dynamic_batch": dynamic,
            "batch": None if dynamic else int(example.shape[0]),
            "dynamic_sequence": bool(axes and 1 in axes),
        }
        return program, info
    raise UnsupportedModelError(f"torch.export could not export the fused model: {first_line(last)}")


def save_pt2(program: torch.export.ExportedProgram, info: dict[str, Any], path: Path) -> None:
    """Save ``program`` to ``path`` with slabconv's extra file (``MARK``: its version and ``info``)."""
    extra = {MARK: json.dumps({"slabconv_version": __version__, **info})}
    with quiet():
        torch.export.save(program, str(path), extra_files=extra)


def export_pt2(model: torch.nn.Module, example: torch.Tensor, path: Path) -> dict[str, Any]:
    """``export_program`` then ``save_pt2``: export ``model`` with ``torch.export`` and save it to ``path``.

    Returns:
        ``{"dynamic_batch": bool, "batch": int or None, "dynamic_sequence": bool}``.

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the fused model.
    """
    program, info = export_program(model, example)
    save_pt2(program, info, path)
    return info
