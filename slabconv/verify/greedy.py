"""Greedy generation compared: the tokens of several runs on the same prompts against the original model's own
greedy choice, with near-ties excused by the verification policy.

The reference is the original model in float64 along one path of tokens (``GreedyRun.tokens``, e.g. what the fused
folder generated): its next-token logits ``logits64`` at every step of that path, so its greedy token (the argmax)
and its exact margin at each step. A run is compared step by step while its prefix is the path's (the steps the
float64 logits were computed for):

- its token is the original's: agreed;
- another token at a decisive step (the margin between the original's first and second logit above
  ``tol_dtype * max |logits|``): a mismatch, the run fails;
- another token at a near-tie: counted, not failed.

A run that leaves the path (a token other than the path's) is compared no further: the prefixes differ from there
on, so the float64 logits say nothing about its later tokens. Where the path is the original's own float64 greedy
run, this is the comparison up to each sequence's first differing token; where the path is another run's (the
fused folder's), it is the same comparison with the original's greedy choice computed on that run's prefix, which
is what the original generating by itself would have chosen at every step up to the first divergence. The runners
that produce the runs are in ``slabconv.verify.generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from slabconv.errors import UsageError
from slabconv.verify.policy import decisive, dtype_name, tol_dtype

ArrayLike = np.ndarray | torch.Tensor

ENDED = -1
"""A step a run did not generate: its sequence had ended at an end-of-sequence token (onnxruntime-genai stops a
sequence there, as a deployment does). The end-of-sequence token itself is compared; the steps after it are not."""


@dataclass
class GreedyRun:
    """Greedy tokens of one runtime.

    Attributes:
        name: which model in which runtime, e.g. ``fused float32 (transformers 5.x, KV cache)``.
        tokens: int64 ``(B, N)``: the N generated tokens of each prompt (``ENDED`` after an end-of-sequence token
            where the runtime stops a sequence there); for a reference, the path its logits were computed along.
        seconds: wall time of the generation loop (loading and one warm-up step excluded), or of the reference's
            pass.
        logits64: float64 ``(B, N, V)``: a reference's next-token logits at each step of ``tokens`` (step ``s``: the
            logits after the prompt and ``tokens[:, :s]``; ``slabconv.verify.generate.exact_path``), else None.
    """

    name: str
    tokens: np.ndarray
    seconds: float
    logits64: np.ndarray | None = None

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (all sequences) per second of ``seconds``."""
        return float(self.tokens.size / self.seconds) if self.seconds > 0 else float("inf")


@dataclass
class RuntimeComparison:
    """One candidate's greedy tokens against the reference's.

    Attributes:
        name: the candidate run.
        tokens_per_second: its throughput.
        tokens_compared: steps compared over all sequences (each while the run's prefix is the reference path's,
            up to and including the step where it leaves the path or its end-of-sequence token where the run stopped
            there: ``ENDED``).
        decisive_mismatches: sequences with a token other than the original's at a decisive step (failures; the
            sequence is compared no further).
        near_ties: compared steps where the original's margin is a near-tie.
        near_tie_divergences: compared steps where the run took another token than the original's at a near-tie.
        first_divergence: per sequence, the first compared step whose token is not the original's, or None.
        decides: whether this comparison decides ``GenerationCheck.passed`` (False for the original's own run in its
            dtype, reported as the baseline).
        first_mismatch: the first decisive mismatch, or None: ``{"prompt": index, "prompt_ids": its first 16 token
            ids, "prompt_truncated": whether it has more, "step": 0-based step, "expected": the reference's token id,
            "got": this run's}`` (``slabconv.verify.results.generation_failure`` words it).
        not_loaded: why the candidate did not load as a model, or None: a fused folder whose tensors do not fill
            the norm-free layout (one missing, one too many, a shape or a bias in some layers only) generates
            nothing and fails (``not_loaded_check``): a difference from the original, not bad input.
        passed: no decisive mismatch, and the candidate loaded.
    """

    name: str
    tokens_per_second: float
    tokens_compared: int
    decisive_mismatches: int
    near_ties: int
    near_tie_divergences: int
    first_divergence: list[int | None]
    decides: bool = True
    first_mismatch: dict[str, Any] | None = None
    not_loaded: str | None = None
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = self.decisive_mismatches == 0 and self.not_loaded is None


@dataclass
class GenerationCheck:
    """The end-to-end greedy check.

    Attributes:
        dtype: the dtype whose tolerance judges near-ties (``policy.tol_dtype``): the checkpoint's, or the one the
            runs computed in where that is the looser.
        steps: N, tokens generated per prompt.
        sequences: B, prompts.
        reference: the reference run's name.
        tokens_per_second: run name -> tokens/s, the reference included, measured on the same prompts.
        runs: one comparison per candidate (and baseline).
        passed: every deciding candidate passed.
        notes: what was not run, and why (a runtime that is not installed).
        compute_dtype: the dtype the PyTorch runs (the fused folder and the original in transformers) computed in
            (``slabconv.verify.generate.compute_dtype``); None where not recorded.
        tolerance: the relative near-tie threshold, ``tol_dtype(dtype)``.
    """

    dtype: str
    steps: int
    sequences: int
    reference: str
    tokens_per_second: dict[str, float]
    runs: list[RuntimeComparison]
    passed: bool
    notes: list[str] = field(default_factory=list)
    compute_dtype: str | None = None
    tolerance: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def not_loaded_check(
    name: str, reason: str, dtype: object, steps: int, sequences: int, compute_dtype: object
) -> GenerationCheck:
    """The failed check of a candidate that does not load as a model (``reason``: the loader's message, e.g. a
    projection with a bias in some layers only): one deciding run ``name`` that compared no token, ``not_loaded``
    set, ``passed`` False. ``dtype`` judges near-ties as in ``compare_greedy``; ``steps`` and ``sequences`` are the
    check's N and B."""
    run = RuntimeComparison(name, 0.0, 0, 0, 0, 0, [None] * sequences, not_loaded=reason)
    return GenerationCheck(
        dtype=dtype_name(dtype),
        steps=steps,
        sequences=sequences,
        reference=REFERENCE_NOT_RUN,
        tokens_per_second={},
        runs=[run],
        passed=False,
        compute_dtype=dtype_name(compute_dtype),
        tolerance=tol_dtype(dtype),
    )


REFERENCE_NOT_RUN = "not run: the candidate did not load"
"""``GenerationCheck.reference`` where the candidate did not load (``not_loaded_check``): nothing to compare with."""


def _as_ids(prompts: ArrayLike, what: str = "prompts") -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(prompts) if not isinstance(prompts, torch.Tensor) else prompts)
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0:
        raise UsageError(
            f"{what} must be integer token ids of shape (batch, length), got {tuple(ids.shape)} {ids.dtype}"
        )
    return ids.to(torch.int64)


def compare_greedy(
    reference: GreedyRun,
    candidates: Sequence[GreedyRun],
    dtype: object,
    *,
    baselines: Sequence[GreedyRun] = (),
    prompts: ArrayLike | None = None,
    compute_dtype: object | None = None,
) -> GenerationCheck:
    """Compare runs' greedy tokens with the original's greedy choice along the reference path, excusing near-ties
    (module docstring).

    Args:
        reference: the original in float64 along a path: ``tokens`` ``(B, N)`` the path, ``logits64`` ``(B, N, V)``
            its logits at each step of it (``generate.exact_path``; or ``greedy_original`` of the float64 model, whose
            path is its own greedy run).
        candidates: runs on the same prompts, tokens ``(B, N)``; they decide ``passed``.
        dtype: the dtype whose tolerance judges near-ties (``torch.float16``, ``"float32"`` ...): a near-tie where
            the original's margin between its first and second logit is at most ``tol_dtype(dtype) * max |logits|``
            at that step.
        baselines: runs compared and reported the same way that do not decide ``passed`` (the original in the
            dtype the runs computed in).
        prompts: the prompts ``(B, T)`` the runs continued, named in a mismatch's report (None: not named).
        compute_dtype: the dtype the PyTorch runs computed in, recorded in the result.

    Returns:
        A ``GenerationCheck``.

    Raises:
        UsageError: the reference has no logits, or a run's tokens differ in shape from the reference's.
    """
    if reference.logits64 is None:
        raise UsageError(f"the reference run {reference.name!r} kept no logits; run it with keep_logits=True")
    path = reference.tokens
    if reference.logits64.shape[:2] != path.shape:
        raise UsageError(f"the reference's logits {reference.logits64.shape} do not follow its path {path.shape}")
    prompt_ids = _as_ids(prompts).tolist() if prompts is not None else None
    expected = reference.logits64.argmax(-1)  # the original's greedy token at each step of the path
    steps_decisive = decisive_steps(reference.logits64, dtype)
    runs = []
    for run, decides in [*((c, True) for c in candidates), *((b, False) for b in baselines)]:
        if run.tokens.shape != path.shape:
            raise UsageError(f"{run.name}: tokens of shape {run.tokens.shape}, the reference has {path.shape}")
        runs.append(_compare_run(run, decides, path, expected, steps_decisive, prompt_ids))
    speeds = {r.name: r.tokens_per_second for r in (reference, *candidates, *baselines)}
    return GenerationCheck(
        dtype=dtype_name(dtype),
        steps=int(path.shape[1]),
        sequences=int(path.shape[0]),
        reference=reference.name,
        tokens_per_second=speeds,
        runs=runs,
        passed=all(r.passed for r in runs if r.decides),
        compute_dtype=dtype_name(compute_dtype) if compute_dtype is not None else None,
        tolerance=tol_dtype(dtype),
    )


def _compare_run(
    run: GreedyRun,
    decides: bool,
    path: np.ndarray,
    expected: np.ndarray,
    decisive: np.ndarray,
    prompt_ids: list[list[int]] | None,
) -> RuntimeComparison:
    """One run's tokens ``(B, N)`` against the original's greedy tokens ``expected`` ``(B, N)`` along ``path``
    ``(B, N)``, each sequence while the run's prefix is the path's; ``decisive`` ``(B, N)`` bool marks the steps
    that are not near-ties."""
    compared = mismatches = ties = tie_divergences = 0
    first: list[int | None] = []
    first_mismatch: dict[str, Any] | None = None
    for b in range(path.shape[0]):
        diverged = None
        for s in range(path.shape[1]):
            token = run.tokens[b, s]
            if token == ENDED:
                break
            compared += 1
            ties += int(not decisive[b, s])
            if token != expected[b, s]:
                diverged = s if diverged is None else diverged
                if decisive[b, s]:
                    mismatches += 1
                    if first_mismatch is None:
                        shown = prompt_ids[b] if prompt_ids is not None else []
                        first_mismatch = {
                            "prompt": b,
                            "prompt_ids": [int(t) for t in shown[:16]],
                            "prompt_truncated": len(shown) > 16,
                            "step": s,
                            "expected": int(expected[b, s]),
                            "got": int(token),
                        }
                    break
                tie_divergences += 1
            if token != path[b, s]:
                break  # the run left the path: no float64 logits for its later steps
        first.append(diverged)
    return RuntimeComparison(
        run.name, run.tokens_per_second, compared, mismatches, ties, tie_divergences, first, decides, first_mismatch
    )


def decisive_steps(logits64: np.ndarray, dtype: object) -> np.ndarray:
    """``(B, N)`` bool: at which steps the reference's next token is decisive for ``dtype`` (``policy.decisive`` on
    each step's ``(V,)`` logits, so the scale ``max |logits|`` is that step's)."""
    out = np.zeros(logits64.shape[:2], dtype=bool)
    for b in range(logits64.shape[0]):
        for s in range(logits64.shape[1]):
            out[b, s] = bool(decisive(logits64[b, s], dtype))
    return out
