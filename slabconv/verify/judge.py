"""The policy applied to numbers: question 2 for one output, question 1 for graphs and for written tensors.

Relative error of an output = ``max |candidate - reference| / max |reference|`` (``rel_err``). Every function
here takes arrays already computed by a runtime; which runtimes ran, and on what, is ``slabconv.verify.run``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from slabconv.fold import rounded as round_once
from slabconv.text import count as count_of
from slabconv.verify import policy
from slabconv.verify.blocks import row_blocks, rows_of
from slabconv.verify.results import ExactCheck, OutputCheck


def rel_err(
    candidate: np.ndarray, reference: np.ndarray, chunk_bytes: int | None = None
) -> tuple[float, float, float, int]:
    """``(relative error, max abs error, mean abs error, worst sample)`` of two arrays ``(B, ...)``.

    Computed in float64 a block of rows (``blocks.rows_of``) at a time, at most ``chunk_bytes``
    (``blocks.CHUNK_BYTES``) of each operand: the maxima are those of the whole arrays, and the mean is the sum of
    per-row sums (each row summed whole), so every block size gives the same numbers, bit for bit. A non-finite
    candidate where the reference is finite gives an infinite error (never NaN; the worst sample is the first
    such); the relative error of two all-zero outputs is 0.

    Raises:
        ValueError: the shapes differ.
    """
    if candidate.shape != reference.shape:
        raise ValueError(f"shapes differ: {candidate.shape} vs {reference.shape}")
    if not reference.size:
        return 0.0, 0.0, 0.0, 0
    ref_rows, cand_rows = rows_of(reference), rows_of(candidate)
    per_sample = ref_rows.shape[0] // (reference.shape[0] if reference.ndim else 1)
    row_max, row_sum, scale = [], [], 0.0
    for block in row_blocks(ref_rows.shape[0], ref_rows.shape[1], chunk_bytes):
        ref = ref_rows[block].astype(np.float64, copy=False)
        diff = cand_rows[block].astype(np.float64)  # a fresh block: the differences are made in it, in place
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(diff, ref, out=diff)
        np.abs(diff, out=diff)
        finite = np.isfinite(diff)
        if not finite.all():
            first = block.start + int((~finite).any(axis=1).argmax())
            return math.inf, math.inf, math.inf, first // per_sample
        row_max.append(diff.max(axis=1))
        row_sum.append(diff.sum(axis=1))
        scale = max(scale, float(np.maximum(np.abs(ref.max()), np.abs(ref.min()))))
    maxima = np.concatenate(row_max).reshape(-1, per_sample).max(axis=1)
    max_abs = float(maxima.max())
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return rel, max_abs, float(np.concatenate(row_sum).sum() / reference.size), int(maxima.argmax())


def is_logits(output: np.ndarray, token_logits: bool) -> bool:
    """Top-1 applies to a ``(B, K)`` output, and with ``token_logits`` to ``(B, T, V)`` at every position."""
    return (output.ndim == 2 or (token_logits and output.ndim >= 2)) and output.shape[-1] > 1


def judge_output(
    name: str,
    candidate: np.ndarray,
    *,
    dtype: str,
    original: np.ndarray,
    reference64: np.ndarray | None,
    rtol: float | None = None,
    atol: float = 0.0,
    strict: bool = False,
    token_logits: bool = False,
) -> OutputCheck:
    """Question 2 for one output: the candidate against the float64 reference, bounded by the original's own error.

    Args:
        name: ``<output> @ <runtime>``.
        candidate: the artifact's output ``(B, ...)``.
        dtype: the dtype the artifact ran in (sets ``tol_dtype``).
        original: the original model's output in its own dtype.
        reference64: the original model's output in float64, or None when there is none (an ``.onnx``
            reference): then the candidate is compared with ``original`` at ``tol_dtype``.
        rtol: ``--rtol``: replaces the bound.
        atol: an absolute error also accepted.
        strict: ``--strict``: the pair comparison (candidate vs original at ``tol_dtype``, top-1 on every sample).
        token_logits: ``(B, T, V)`` logits of a language model: top-1 at every position.

    Raises:
        ValueError: the shapes differ.
    """
    e_pair = rel_err(candidate, original)[0]
    pair_mode = strict or reference64 is None
    reference = original if pair_mode else reference64
    assert reference is not None
    e_fused, max_abs, mean_abs, worst = rel_err(candidate, reference)
    e_orig: float | None = None
    if pair_mode:
        tolerance = rtol if rtol is not None else policy.tol_dtype(dtype)
        why = "--rtol" if rtol is not None else ("--strict" if strict else "tol_dtype")
    else:
        e_orig = rel_err(original, reference)[0]
        e = e_orig if math.isfinite(e_orig) else 0.0
        tolerance, why = policy.fused_bound(dtype, e, rtol)
        bound = policy.fused_bound(dtype, e)[0]  # near-ties: margins within the policy's bound (not --rtol's)
    top1 = decisive_count = near = None
    if is_logits(reference, token_logits):
        if pair_mode:
            mask = np.ones(reference.shape[:-1], dtype=bool)
        else:
            mask = policy.decisive(reference, dtype, bound=bound)
        decisive_count = int(mask.sum())
        near = int(mask.size - decisive_count)
        agree = candidate.argmax(axis=-1) == reference.argmax(axis=-1)
        top1 = float(agree[mask].mean()) if decisive_count else 1.0
    within = e_fused <= tolerance or (atol > 0 and max_abs <= atol)
    passed = math.isfinite(e_fused) and within and (top1 is None or top1 == 1.0)
    return OutputCheck(
        name=name,
        passed=bool(passed),
        dtype=dtype,
        samples=int(reference.shape[0]) if reference.ndim else 1,
        reference="original" if pair_mode else "float64",
        e_fused=e_fused,
        e_orig=e_orig,
        e_pair=e_pair,
        tolerance=float(tolerance),
        tolerance_from=why,
        max_abs_err=max_abs,
        mean_abs_err=mean_abs,
        worst_sample=worst,
        top1_agreement=top1,
        decisive=decisive_count,
        near_ties=near,
        atol=atol,
    )


def exact_graphs(
    names: Sequence[str], fused64: Sequence[np.ndarray], original64: Sequence[np.ndarray], of: int | None = None
) -> ExactCheck:
    """Question 1: every output of the fused float64 graph against the original float64 graph, ``<= EXACT_RTOL``.

    ``of``: how many verification samples there were, when the outputs are those of the first few
    (``policy.EXACT_SAMPLES``); the detail says so."""
    errors = [(rel_err(f, o)[0], n) for n, f, o in zip(names, fused64, original64, strict=True)]
    error, worst = max(errors, key=lambda e: e[0]) if errors else (0.0, "")
    return ExactCheck(
        name="fused graph vs original, both in float64",
        passed=bool(error <= policy.EXACT_RTOL),
        method="graph",
        error=error,
        bound=policy.EXACT_RTOL,
        worst=worst,
        detail=f"relative error {error:.3g} (float64 rounding is about 1e-16 per operation)" + _first(fused64, of),
    )


def _first(outputs: Sequence[np.ndarray], of: int | None) -> str:
    n = len(outputs[0]) if outputs else 0
    return f", on the first {n} of {of} samples" if of is not None and n < of else ""


_SAME_WIDTH_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same numbers bit for bit: same shape and dtype, every element's bits equal,
    and no NaN (a NaN is no number, as ``torch.equal`` has it; ``-0.0`` and ``0.0`` differ here, so the caller's
    slower comparison answers them).

    A floating tensor is compared through an integer view (``Tensor.view(dtype)``), of 8 bytes where both tensors'
    bytes allow it, else of its own width: several times faster on a CPU than ``torch.equal`` on float16, whose
    comparison widens each element (and 8-byte integers 3x faster than 2-byte ones); equal bytes are equal bits
    whatever the grouping. The NaN test is one reduction (``sum`` is NaN where an element is, and may be NaN
    otherwise only from ``inf - inf``, which sends an equal pair to the slower comparison, never a different one to
    this answer).

    Args:
        a, b: tensors of any shape and dtype.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    if _words(a) and _words(b):
        same = torch.equal(a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64))
    else:
        ints = _SAME_WIDTH_INTS[a.element_size()]
        same = torch.equal(a.view(ints), b.view(ints))
    return same and not bool(torch.isnan(a.sum()))


def _words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read as 8-byte integers: contiguous, a multiple of 8 bytes, aligned to 8 (a
    whole block, or a block of rows of a buffer)."""
    return t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0 and t.data_ptr() % 8 == 0


def ulps(candidate: torch.Tensor, exact: torch.Tensor) -> float:
    """How many units in the last place ``candidate`` is from ``exact`` (float64) correctly rounded to the
    candidate's dtype, at most over all elements: 0 when every element is that rounding (or, where ``exact`` is on
    a tie between two neighbours within ``policy.TIE``, either neighbour); ``inf`` for NaN or another shape."""
    if candidate.shape != exact.shape:
        return math.inf
    rounded = round_once(exact, candidate.dtype)
    differ = candidate != rounded
    if not bool(differ.any()):
        return 0.0
    toward = torch.nextafter(rounded, candidate)
    step = (toward.double() - rounded.double()).abs()
    step = torch.where(step > 0, step, torch.full_like(step, float(torch.finfo(candidate.dtype).tiny)))
    units = (candidate.double() - rounded.double()).abs() / step
    midpoint = (rounded.double() + toward.double()) / 2
    tie = (exact - midpoint).abs() <= policy.TIE * exact.abs().clamp_min(float(torch.finfo(torch.float64).tiny))
    units = torch.where(differ & ~(tie & (units <= 1)), units, torch.zeros_like(units))
    units = torch.where(torch.isnan(units), torch.full_like(units, math.inf), units)
    return float(units.max())


def exact_tensors(
    label: str,
    written: Mapping[str, torch.Tensor],
    fold64: Mapping[str, torch.Tensor],
    ulp_bound: float = policy.ULPS,
    by_value: bool = False,
    against: str = "the float64 fold",
    unchanged: frozenset[str] = frozenset(),
    file: str = "the written file",
) -> ExactCheck:
    """Question 1 for written files: every tensor of the float64 fold, rounded to the written dtype, equals the
    written tensor within ``ulp_bound`` units in the last place (a tensor the file lacks fails).

    A correct writer rounds each float64 value once, to the nearest representable one: an honest file is 0 units
    away. A wrong fold of any size shows up here, in any dtype (float16 and bfloat16 included), where a runtime
    comparison drowns in the model's own rounding.

    Args:
        label: what was checked, for the report.
        written: the file's tensors by name.
        fold64: the fresh float64 fold's tensors by name.
        ulp_bound: the most allowed.
        by_value: a fold tensor missing by name may be any written tensor of its shape or its transposed shape
            (an ONNX exporter stores Linear weights transposed under generated names): the closest one counts.
        against: what ``fold64`` is, for the detail (``fuse --simplify``'s candidates are held to the fold in their
            dtypes, simplified).
        unchanged: with ``by_value``, the fold's tensors that are the original's own (no fold wrote them): one the
            file does not hold by name is looked for by value like the others (an exporter stores a Linear weight
            no fold wrote transposed under a generated name too), but is not counted where the file holds no
            floating tensor of its shape or transposed shape at all (an exporter stores what it computes from such a
            constant, e.g. a Swin relative-position bias gathered by its index; question 2 judges it), nor where
            it is an integer buffer (an index: ``written`` holds floating tensors). One matched only up to size-1
            axes is not counted either where none matches it and the file holds none of its very shape (the
            ``(1, 1, K)`` magnitude of a weight-normed conv, stored only inside the weight the exporter computes).
        file: the file ``written`` was read from, named where a tensor of the fold is missing from it (by name, or
            with ``by_value`` by name and shape: ``ExactCheck.missing``).

    With ``by_value``, a fold tensor that is all zeros and that the file does not hold by name is not counted,
    whether a fold wrote it or not: onnxscript's optimizer (the dynamo exporter's default, and ``fuse --simplify``)
    drops a zero bias (a ``Conv`` without its bias input, no ``Add``), and an op without it adds what the zeros
    add. A tensor the fold makes nonzero is always counted.
    """
    pool = by_shape(written) if by_value else {}
    worst, worst_name, count, missing = 0.0, "", 0, ""
    for key, exact in fold64.items():
        exact64 = exact.detach().cpu().double()
        got, absent = written.get(key), ""
        if got is not None:
            distance = _distance(got.detach().cpu(), exact64)
        elif by_value:
            if not bool(exact64.any()):  # a zero bias the exporter's optimizer dropped
                continue
            nearest_one, distance = nearest(exact64, pool)
            if key in unchanged and (
                not exact.is_floating_point()
                or nearest_one is None
                or (distance > ulp_bound and not holds_shape(written, tuple(exact64.shape)))
            ):
                continue
            absent = f"{file} (no tensor of its name, shape or transposed shape)" if nearest_one is None else ""
        else:
            distance, absent = math.inf, file
        count += 1
        if distance > worst:
            worst, worst_name, missing = distance, key, absent
    return tensors_check(label, count, worst, worst_name, ulp_bound, against, missing)


def tensors_check(
    label: str,
    count: int,
    worst: float,
    worst_name: str,
    bound: float = policy.ULPS,
    against: str = "the float64 fold",
    missing: str = "",
) -> ExactCheck:
    """Question 1's verdict on ``count`` written tensors, the farthest ``worst`` units in the last place from
    ``against`` (``worst_name``): passed within ``bound`` (in memory ``exact_tensors``, streamed
    ``layerwise.exact_streamed``); ``missing``: the file that lacks ``worst_name``, a tensor the fold writes
    (``ExactCheck.missing``)."""
    return ExactCheck(
        name=label,
        passed=bool(worst <= bound),
        method="tensors",
        error=worst,
        bound=bound,
        worst=worst_name,
        detail=(
            f"{count_of(count, 'tensor')} within {worst:.2g} ulps of {against}"
            if worst <= bound
            else "the written weights are not the fold of this source"
            if against == "the float64 fold"
            else f"the written tensors are not {against}"
        ),
        missing=missing,
    )


def holds_shape(written: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> bool:
    """Whether ``written`` holds a tensor of ``shape`` exactly, or (a matrix) of its transposed shape."""
    shapes = {tuple(t.shape) for t in written.values()}
    return shape in shapes or (len(shape) == 2 and shape[::-1] in shapes)


def by_shape(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """``tensors`` grouped by shape without its size-1 axes (``squeezed``), for ``nearest``."""
    pool: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for tensor in tensors.values():
        pool.setdefault(squeezed(tensor.shape), []).append(tensor)
    return pool


def squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` without its size-1 axes: an exporter stores a ``(C,)`` parameter it broadcasts as ``(C, 1, 1)``
    (the dynamo exporter's GroupNorm weight and bias, after its ``InstanceNormalization``)."""
    return tuple(int(s) for s in shape if s != 1)


def nearest(
    exact64: torch.Tensor, pool: Mapping[tuple[int, ...], list[torch.Tensor]]
) -> tuple[torch.Tensor | None, float]:
    """A tensor matched by value (an ONNX exporter stores Linear weights transposed under generated names, and a
    ``(C,)`` parameter it broadcasts as ``(C, 1, 1)``): of the tensors of ``pool`` (``by_shape``) of ``exact64``'s
    shape up to size-1 axes, and (a matrix) the transposes of those of its transposed shape, the first nearest
    ``exact64`` (float64) in units in the last place (``_distance``), seen in ``exact64``'s shape, and its distance;
    ``(None, inf)`` where the pool holds none of either shape."""
    shape = tuple(exact64.shape)
    views = [t.reshape(shape) for t in pool.get(squeezed(shape), [])]
    if len(squeezed(shape)) == 2 == exact64.dim():  # a matrix (a row or a column is its own transpose's values)
        views += [t.reshape(shape[::-1]).T for t in pool.get(squeezed(shape[::-1]), [])]
    best, distance = None, math.inf
    for view in views:
        d = _distance(view, exact64)
        if best is None or d < distance:
            best, distance = view, d
    return best, distance


def _distance(got: torch.Tensor, exact64: torch.Tensor) -> float:
    if got.shape != exact64.shape:
        return math.inf
    if got.is_floating_point():
        return ulps(got, exact64)
    return 0.0 if torch.equal(got, exact64.to(got.dtype)) else math.inf
