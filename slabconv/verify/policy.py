"""The verification policy: the one place that says how close is close enough, and why.

Two questions (``docs/verification.md`` gives the reasoning):

1. **Is the fold exact?** The fused graph in float64 with the fold's float64 weights against the original in
   float64: in exact arithmetic they are equal, so the relative error must be at float64 rounding level
   (``EXACT_RTOL``). For written files, each stored value must be the fresh float64 fold correctly rounded to its
   dtype (``ULPS`` = 0 units in the last place away; where the float64 fold sits on an exact tie between two
   neighbours, either one).
2. **Are the written files as good as the original?** Each artifact in its own dtype and runtime, and the
   original in its own dtype, against the float64 reference: pass when
   ``e_fused <= max(tol_dtype, 2 * e_orig)``; a check that fails is judged again with ``e_orig`` of the original
   run by the candidate's own runtime, where that is larger (``slabconv.verify.run.question_2``).

Relative error of an output = ``max |candidate - reference| / max |reference|``. Top-1 is judged against the
float64 reference only where the exact margin between the first and second logit exceeds the bound in force times
``max |logit|`` (``tol_dtype``, or ``2 * e_orig`` where that is larger); closer samples are near-ties: counted, not
failed.
"""

from __future__ import annotations

import numpy as np

from slabconv.tolerances import TOL_DTYPE, dtype_name, tol_dtype  # noqa: F401 (the policy's own names too)
from slabconv.verify.blocks import row_blocks

EXACT_RTOL = 1e-9
"""Question 1: the fused graph vs the original, both in float64 (float64 rounding is ~1e-16 per op)."""

ULPS = 0
"""Question 1 for written files: how many units in the last place a stored value may be from the correctly rounded
float64 fold. A correct writer rounds once, so 0: one unit would let a bfloat16 weight be 0.4-0.8% off."""

EXACT_SAMPLES = 4
"""Question 1's graph check runs on the first this many verification samples. Exactness needs no statistics: a
correct fold is within float64 rounding on every input, and a wrong one changes the output of almost every input
(a wrong weight or bias reaches every sample's activations), so more samples would only repeat float64 passes
that question 2 does not need."""

TIE = 1e-12
"""A float64 fold this close (relatively) to the midpoint of two neighbours may round to either of them."""

ORIGINAL_ERROR_FACTOR = 2.0
"""Question 2: the fused artifact may be up to this many times the original's own error against float64."""


def fused_bound(dtype: object, e_orig: float, rtol: float | None = None) -> tuple[float, str]:
    """The largest relative error a fused artifact in ``dtype`` may have, and which term set it.

    Returns:
        ``(bound, why)``: ``why`` is ``"tol_dtype"``, ``"2*e_orig"`` or ``"--rtol"``.
    """
    if rtol is not None:
        return rtol, "--rtol"
    base = tol_dtype(dtype)
    doubled = ORIGINAL_ERROR_FACTOR * e_orig
    return (doubled, "2*e_orig") if doubled > base else (base, "tol_dtype")


def decisive(
    logits64: np.ndarray, dtype: object, bound: float | None = None, chunk_bytes: int | None = None
) -> np.ndarray:
    """Which positions of exact (float64) logits ``(..., K)`` have a top-1 that a ``dtype`` model must keep.

    A position is decisive when its margin between the largest and second-largest logit exceeds
    ``bound * max |logits|`` (the largest logit over the whole array); the others are near-ties. ``bound`` is the
    relative error the policy allows (``fused_bound`` without ``--rtol``), ``tol_dtype(dtype)`` when not given:
    where the original is itself further from the exact output than the dtype's tolerance (a runtime computing a
    float32 file in bfloat16), the artifact may be as far, and a margin below that distance is one the original's
    own precision does not order either. Computed in float64 a block of positions at a time (at most
    ``chunk_bytes``, ``blocks.CHUNK_BYTES`` when None): the same for every block size.

    Returns:
        A boolean array of shape ``logits64.shape[:-1]``.
    """
    if logits64.shape[-1] < 2 or not logits64.size:
        return np.zeros(logits64.shape[:-1], dtype=bool)
    rows = logits64.reshape(-1, logits64.shape[-1])  # one row per position (a view where contiguous)
    margin = np.empty(rows.shape[0], dtype=np.float64)
    maxima = []  # of each block: their max is the whole array's, NaN included
    for block in row_blocks(rows.shape[0], rows.shape[1], chunk_bytes):
        x = rows[block].astype(np.float64)
        top2 = np.partition(x, -2, axis=-1)[:, -2:]
        margin[block] = top2[:, 1] - top2[:, 0]
        maxima.append(np.abs(x).max())
    scale = float(np.max(maxima))
    return (margin > (tol_dtype(dtype) if bound is None else bound) * scale).reshape(logits64.shape[:-1])
