"""Arrays compared a block of rows at a time: the checks of a language model compare logits ``(B, T, V)`` whose
float64 copies would be gigabytes (16 sequences of 64 tokens over a 128k vocabulary: 1 GiB each), so every
comparison (``judge.rel_err``, ``policy.decisive``, the task metrics) converts and reduces one block at a time,
with results that do not depend on the block size."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

CHUNK_BYTES = 16 << 20
"""The float64 bytes of each operand a comparison converts at once: a block of rows of this size or one row."""


def rows_of(array: np.ndarray) -> np.ndarray:
    """``array`` ``(B, ..., K)`` as ``(rows, K)`` (a view where it is contiguous): a 0-d array as ``(1, 1)``, a 1-d
    one ``(B,)`` as ``(B, 1)``."""
    return array.reshape(-1, array.shape[-1]) if array.ndim >= 2 else array.reshape(-1, 1)


def row_blocks(rows: int, width: int, chunk_bytes: int | None = None) -> Iterator[slice]:
    """Blocks of ``rows`` rows of ``width`` float64 values, in order, each at most ``chunk_bytes`` (``CHUNK_BYTES``
    when None; one row at least)."""
    per = max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // max(1, 8 * width))
    for start in range(0, rows, per):
        yield slice(start, min(rows, start + per))
