"""The relative tolerance of each floating dtype: the one number per dtype that both the planner (which warns when
a fold's rounding would approach it) and the verification policy (``slabconv.verify.policy``, which judges outputs
with it) read. It sits below both so the engine never imports a later stage.
"""

from __future__ import annotations

TOL_DTYPE = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
"""Relative tolerance of an output computed in each dtype (float32 1e-5, float16 1e-3, bfloat16 1e-2)."""


def dtype_name(dtype: object) -> str:
    """``torch.float16`` / ``np.float16`` / ``"float16"`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.").removeprefix("<class 'numpy.").removesuffix("'>")


def tol_dtype(dtype: object) -> float:
    """The relative tolerance of ``dtype`` (float32's for a dtype that is not a float, e.g. int64 token ids).

    Raises:
        Nothing; unknown names get float32's tolerance.
    """
    return TOL_DTYPE.get(dtype_name(dtype), TOL_DTYPE["float32"])
