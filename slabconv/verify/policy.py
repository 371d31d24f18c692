"""The tolerance policy: how close a candidate must be, by dtype (one place for every check that needs it)."""

from __future__ import annotations

DEFAULT_RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2, "float64": 1e-5}


def default_rtol(dtype: str, rtol: float | None = None) -> float:
    """``rtol`` when given, else the tolerance of ``dtype`` (a name such as ``float16``; float32's when unknown)."""
    return rtol if rtol is not None else DEFAULT_RTOL.get(dtype.removeprefix("torch."), 1e-5)
