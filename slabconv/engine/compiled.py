"""A streamed fold's sub-block in two compiled loops (numba, the ``fast`` extra), where the portable path makes
about ten passes of torch and numpy calls over it.

``engine.program.LayerRecipe`` folds a streamed weight ``CACHE_BLOCK`` elements of rows at a time. For a
float16 / bfloat16 / float32 Linear weight that receives one fold (forward: ``W diag(s)``, backward: ``diag(s) W``;
``slabconv.fold``) the portable path widens the rows to float32, takes each row's largest and smallest value,
widens to float64, folds, takes the folded rows' ranges and rounds once (``fold.rounded``: to float32, to the
stored dtype, a tie search over every value): each step a pass of its own over the sub-block. Here, after torch's
widening of half precision to float32:

- ``widen``: the rows to float64 (the fold's bias, ``b + W t``, is still torch's product of these rows, as in
  every other fold), and each row's largest and smallest value;
- ``scale_and_round``: the float64 rows scaled in place by the fold's column or row factors (the same float64
  product as ``Tensor.mul_``), each folded row's largest and smallest value, and every value rounded once to the
  stored dtype from its float64 bits (float32: the processor's conversion): to nearest, ties to even,
  subnormals, overflow to an infinity (which the caller refuses from the ranges, ``engine.program.overflows_from``).

The values are the portable path's bit for bit: the rounding is correct, so unique (tests/test_compiled.py checks
every float16 and bfloat16 value, every midpoint of two neighbours and the float64 values on either side of each,
against ``fold.rounded``, and whole sub-blocks against the portable path). Two conventions make the ranges
unique too, in both paths: a row holding a NaN has NaN as its largest and smallest value, and a zero extreme is
``+0.0`` (``engine.ranges.RangeTally.measure`` adds ``0.0`` to torch's). Ranges are reduced as integer keys (a
float's bits with the magnitude bits flipped where the sign bit is set order as the floats do), which the
compiler turns into vector instructions where a float maximum that keeps NaN is not.

numba compiles the loops on first use and keeps them in its cache (``cache=True``: beside this file, or in
numba's per-user cache, or ``NUMBA_CACHE_DIR``); without numba (``pip install slabconv[fast]``) the portable path
runs. Measured on the 350M-layout float16 folder: ``docs/performance.md``.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import numpy as np
import torch

_ABS64, _ABS32 = 0x7FFFFFFFFFFFFFFF, 0x7FFFFFFF  # the magnitude bits
_INF64, _INF32 = 0x7FF0000000000000, 0x7F800000  # +inf: its bits and its key
_NEG_INF64_KEY, _NEG_INF32_KEY = -0x7FF0000000000001, -0x7F800001  # -inf's key: its bits, magnitude flipped
_NAN64, _NAN32 = 0x7FF8000000000000, 0x7FC00000


def _rounding(dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    """The constants ``scale_and_round`` rounds float64 bits to ``dtype`` (float16 / bfloat16) with: the float64
    fraction bits ``dtype`` drops, the exponent rebias (float64's bias less ``dtype``'s, in place), and the float64
    bits of ``dtype``'s smallest normal value, of half its smallest subnormal (at or below: zero), of the smallest
    magnitude that rounds to an infinity (the largest finite value plus half a unit in the last place), and
    ``dtype``'s infinity."""
    fraction, bias = {torch.float16: (10, 15), torch.bfloat16: (7, 127)}[dtype]
    largest = (2.0 - 2.0**-fraction) * 2.0**bias
    magnitudes = [2.0 ** (1 - bias), 2.0 ** (-bias - fraction), largest + 2.0 ** (bias - fraction - 1)]
    normal, zero, overflow = torch.tensor(magnitudes, dtype=torch.float64).view(torch.int64).tolist()
    return 52 - fraction, (1023 - bias) << 52, normal, zero, overflow, ((1 << (15 - fraction)) - 1) << fraction


ROUNDS_TO = (torch.float16, torch.bfloat16, torch.float32)
"""The stored dtypes ``scale_and_round`` rounds to (float32: the processor's conversion of each float64, to
nearest, ties to even, as ``Tensor.to`` and ``fold.rounded`` make it)."""


def _widen_loop(wide, w64, high, low):  # type: ignore[no-untyped-def]
    rows, cols = wide.shape
    for r in range(rows):
        for j in range(cols):
            w64[r, j] = np.float64(wide[r, j])
        bits = wide[r].view(np.int32)
        kmax = np.int32(-2147483648)
        kmin = np.int32(2147483647)
        for j in range(cols):
            b = bits[j]
            key = b ^ ((b >> 31) & _ABS32)
            kmax = max(kmax, key)
            kmin = min(kmin, key)
        nan = kmax > _INF32 or kmin < _NEG_INF32_KEY  # a NaN's key lies past an infinity's
        high[r] = _NAN32 if nan else (0 if kmax == -1 else kmax ^ ((kmax >> 31) & _ABS32))  # key -1: -0.0
        low[r] = _NAN32 if nan else (0 if kmin == -1 else kmin ^ ((kmin >> 31) & _ABS32))


def _scale_and_round_loop(w64, col, row, out, high, low, shift, rebias, normal, zero, overflow, infinity):  # type: ignore[no-untyped-def]
    rows, cols = w64.shape
    below_half = (np.int64(1) << (shift - 1)) - 1
    for r in range(rows):
        factor = row[r]
        for j in range(cols):
            w64[r, j] = (w64[r, j] * col[j]) * factor
        bits = w64[r].view(np.int64)
        stored = out[r]
        kmax = np.int64(-9223372036854775807 - 1)
        kmin = np.int64(9223372036854775807)
        subnormal = False
        for j in range(cols):
            b = bits[j]
            key = b ^ ((b >> 63) & _ABS64)
            kmax = max(kmax, key)
            kmin = min(kmin, key)
            magnitude = b & _ABS64
            subnormal |= (magnitude > zero) & (magnitude < normal)
            # a normal value: its bits rebiased in place, the dropped bits rounded to nearest, ties to even
            rebiased = magnitude - rebias
            kept = (rebiased + below_half + ((rebiased >> shift) & 1)) >> shift
            kept = 0 if magnitude <= zero else kept
            kept = infinity if magnitude >= overflow else kept
            stored[j] = np.uint16(((b >> 48) & 0x8000) | kept)
        if subnormal:  # the row again, each value rounded at its own binade's step
            min_e = normal >> 52
            for j in range(cols):
                b = bits[j]
                magnitude = b & _ABS64
                if zero < magnitude < normal:
                    exponent = magnitude >> 52
                    significand = (magnitude & 0xFFFFFFFFFFFFF) | 0x10000000000000
                    step = min(shift + (min_e - exponent), 63)
                    dropped = significand & ((np.int64(1) << step) - 1)
                    half = np.int64(1) << (step - 1)
                    kept = significand >> step
                    kept += (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
                    stored[j] = np.uint16(((b >> 48) & 0x8000) | kept)
        nan = kmax > _INF64 or kmin < _NEG_INF64_KEY
        high[r] = _NAN64 if nan else (0 if kmax == -1 else kmax ^ ((kmax >> 63) & _ABS64))
        low[r] = _NAN64 if nan else (0 if kmin == -1 else kmin ^ ((kmin >> 63) & _ABS64))


def _scale_and_round32_loop(w64, col, row, out, high, low):  # type: ignore[no-untyped-def]
    rows, cols = w64.shape
    for r in range(rows):
        factor = row[r]
        for j in range(cols):
            w64[r, j] = (w64[r, j] * col[j]) * factor
        bits = w64[r].view(np.int64)
        kmax = np.int64(-9223372036854775807 - 1)
        kmin = np.int64(9223372036854775807)
        for j in range(cols):
            b = bits[j]
            key = b ^ ((b >> 63) & _ABS64)
            kmax = max(kmax, key)
            kmin = min(kmin, key)
            out[r, j] = np.float32(w64[r, j])
        nan = kmax > _INF64 or kmin < _NEG_INF64_KEY
        high[r] = _NAN64 if nan else (0 if kmax == -1 else kmax ^ ((kmax >> 63) & _ABS64))
        low[r] = _NAN64 if nan else (0 if kmin == -1 else kmin ^ ((kmin >> 63) & _ABS64))


_LOCK = threading.Lock()
_LOADED: list[tuple[Any, Any, Any] | None] = []  # the loops once loaded (one entry), or None: no numba


def _kernels() -> tuple[Any, Any, Any] | None:
    """The three loops compiled (numba: ``nogil``, so that the fold's lanes run them at once), loaded once per
    process (a caller that comes while another thread loads them waits), or None without a numba that imports (one
    built for another numpy refuses to) or compiles them: the portable path runs then, the same values."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_load())
        return _LOADED[0]


def _load() -> tuple[Any, Any, Any] | None:
    """numba's import and the loops, each compiled (or loaded from numba's cache: beside this file, or in numba's
    per-user cache where this folder is read-only, or nowhere where neither is writable) for the arrays a fold
    passes, on one-element ones: about a second from the cache."""
    if importlib.util.find_spec("numba") is None:
        return None
    try:
        import numba
        from numba.core.errors import NumbaError
    except ImportError:
        return None
    loops = (_widen_loop, _scale_and_round_loop, _scale_and_round32_loop)
    try:
        jitted = tuple(numba.njit(nogil=True, cache=True)(f) for f in loops)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        jitted = tuple(numba.njit(nogil=True)(f) for f in loops)
    one = np.zeros((1, 1))
    ranges32, ranges64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    try:
        jitted[0](one.astype(np.float32), one, ranges32, ranges32)
        jitted[1](one, one[0], one[0], one.astype(np.uint16), ranges64, ranges64, *_rounding(torch.float16))
        jitted[2](one, one[0], one[0], one.astype(np.float32), ranges64, ranges64)
    except NumbaError:
        return None
    return jitted  # type: ignore[return-value]


def available() -> bool:
    """True when the compiled loops are used: numba imports and compiles them (``_kernels``)."""
    return _kernels() is not None


def _array(t: torch.Tensor, view: torch.dtype | None = None) -> Any:
    """``t``'s numpy view (its bits as ``view`` when given): no copy."""
    return (t if view is None else t.view(view)).numpy()


def widen(wide: torch.Tensor, w64: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None:
    """``w64 = wide`` in float64, and each row's largest and smallest value into ``high`` / ``low``.

    Args:
        wide: ``(rows, cols)`` contiguous float32 (a float32 sub-block, or a half-precision one widened exactly).
        w64: ``(rows, cols)`` contiguous float64, written.
        high, low: ``(rows,)`` float32 views, written (NaN for a row holding one; a zero extreme is ``+0.0``).

    Raises:
        RuntimeError: numba is not installed (``available``).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the compiled fold needs numba (pip install slabconv[fast])")
    kernels[0](_array(wide), _array(w64), _array(high, torch.int32), _array(low, torch.int32))


def scale_and_round(
    w64: torch.Tensor,
    col: torch.Tensor | None,
    row: torch.Tensor | None,
    out: torch.Tensor,
    high: torch.Tensor,
    low: torch.Tensor,
) -> None:
    """Scale float64 rows in place, take each folded row's range, and round every value once into ``out``.

    Args:
        w64: ``(rows, cols)`` contiguous float64 rows; scaled in place: ``w64[r, j] * col[j] * row[r]`` (one of
            the two factors absent: a single fold, the product ``Tensor.mul_`` makes).
        col: ``(cols,)`` float64 column factors (a forward fold's scale), or None.
        row: ``(rows,)`` float64 row factors (a backward fold's scale for these rows), or None.
        out: ``(rows, cols)`` contiguous float16 / bfloat16 / float32 (``ROUNDS_TO``), written: each value
            rounded once, to nearest, ties to even (``fold.rounded``'s value); a magnitude at or past the largest
            finite value plus half a unit in the last place is an infinity.
        high, low: ``(rows,)`` float64 views, written: each folded row's largest and smallest value (NaN for a
            row holding one; a zero extreme is ``+0.0``).

    Raises:
        RuntimeError: numba is not installed (``available``).
        KeyError: ``out`` is not float16, bfloat16 or float32.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the compiled fold needs numba (pip install slabconv[fast])")
    rows, cols = w64.shape
    ones = torch.ones(max(rows, cols), dtype=torch.float64)
    col = ones[:cols] if col is None else col.to(torch.float64).contiguous()
    row = ones[:rows] if row is None else row.to(torch.float64).contiguous()
    ranges = _array(high, torch.int64), _array(low, torch.int64)
    if out.dtype == torch.float32:
        kernels[2](_array(w64), _array(col), _array(row), _array(out), *ranges)
        return
    kernels[1](
        _array(w64),
        _array(col),
        _array(row),
        _array(out, torch.int16).view("uint16"),
        *ranges,
        *_rounding(out.dtype),
    )
