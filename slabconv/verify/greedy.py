"""Greedy generation compared: the tokens of several runs on the same prompts against a reference run, with
near-ties excused by the verification policy.

A sequence is compared up to its first differing token: on a decisive step (the reference's float64 margin between
its first and second logit above ``tol_dtype * max |logits|``) that is a mismatch (failure); on a near-tie the rest
of that sequence is reported, not failed (the prefixes differ from there on, so later tokens have nothing to be
compared with). The runners that produce the runs are in ``slabconv.verify.generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from slabconv.errors import UsageError
from slabconv.verify.policy import decisive, dtype_name

ArrayLike = np.ndarray | torch.Tensor

ENDED = -1
"""A step a run did not generate: its sequence had ended at an end-of-sequence token (onnxruntime-genai stops a
sequence there, as a deployment does). The end-of-sequence token itself is compared; the steps after it are not."""


@dataclass
class GreedyRun:
    """Greedy tokens of one runtime.

    Attributes:
        name: which model in which runtime, e.g. ``original float32 (pytorch, no cache)``.
        tokens: int64 ``(B, N)``: the N generated tokens of each prompt (``ENDED`` after an end-of-sequence token
            where the runtime stops a sequence there).
        seconds: wall time of the generation loop (loading and one warm-up step excluded).
        logits64: float64 ``(B, N, V)``: the next-token logits at each step (kept by ``greedy_original``, to judge
            near-ties), else None.
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
        tokens_compared: steps compared over all sequences (each up to and including its first differing token,
            or its end-of-sequence token where the run stopped there: ``ENDED``).
        decisive_mismatches: sequences whose first differing token is at a decisive step (failures).
        near_ties: compared steps where the reference's margin is a near-tie.
        near_tie_divergences: sequences whose first differing token is at a near-tie (the rest is not compared).
        first_divergence: per sequence, the step of the first differing token, or None when all N agree.
        decides: whether this comparison decides ``GenerationCheck.passed`` (False for the original's own run in its
            dtype, reported as the baseline).
        first_mismatch: the first decisive mismatch, or None: ``{"prompt": index, "prompt_ids": its first 16 token
            ids, "prompt_truncated": whether it has more, "step": 0-based step, "expected": the reference's token id,
            "got": this run's}`` (``slabconv.verify.results.generation_failure`` words it).
        passed: no decisive mismatch.
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
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = self.decisive_mismatches == 0


@dataclass
class GenerationCheck:
    """The end-to-end greedy check.

    Attributes:
        dtype: the checkpoint dtype whose tolerance judges near-ties (``policy.tol_dtype``).
        steps: N, tokens generated per prompt.
        sequences: B, prompts.
        reference: the reference run's name.
        tokens_per_second: run name -> tokens/s, the reference included, measured on the same prompts.
        runs: one comparison per candidate (and baseline).
        passed: every deciding candidate passed.
        notes: what was not run, and why (a runtime that is not installed).
    """

    dtype: str
    steps: int
    sequences: int
    reference: str
    tokens_per_second: dict[str, float]
    runs: list[RuntimeComparison]
    passed: bool
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


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
) -> GenerationCheck:
    """Compare candidates' greedy tokens with the reference's, excusing near-ties (module docstring).

    Args:
        reference: a run with ``logits64`` ``(B, N, V)`` (``greedy_original``; the original in float64 gives the
            exact margins).
        candidates: runs on the same prompts, tokens ``(B, N)``; they decide ``passed``.
        dtype: the checkpoint dtype (``torch.float16``, ``"float32"`` ...): near-tie when the reference's margin
            between its first and second logit is at most ``tol_dtype(dtype) * max |logits|`` at that step.
        baselines: runs compared and reported the same way that do not decide ``passed`` (the original in its own
            dtype).
        prompts: the prompts ``(B, T)`` the runs continued, named in a mismatch's report (None: not named).

    Returns:
        A ``GenerationCheck``.

    Raises:
        UsageError: the reference has no logits, or a run's tokens differ in shape from the reference's.
    """
    if reference.logits64 is None:
        raise UsageError(f"the reference run {reference.name!r} kept no logits; run it with keep_logits=True")
    ref = reference.tokens
    prompt_ids = _as_ids(prompts).tolist() if prompts is not None else None
    steps_decisive = decisive_steps(reference.logits64, dtype)
    runs = []
    for run, decides in [*((c, True) for c in candidates), *((b, False) for b in baselines)]:
        if run.tokens.shape != ref.shape:
            raise UsageError(f"{run.name}: tokens of shape {run.tokens.shape}, the reference has {ref.shape}")
        runs.append(_compare_run(run, decides, ref, steps_decisive, prompt_ids))
    speeds = {r.name: r.tokens_per_second for r in (reference, *candidates, *baselines)}
    return GenerationCheck(
        dtype=dtype_name(dtype),
        steps=int(ref.shape[1]),
        sequences=int(ref.shape[0]),
        reference=reference.name,
        tokens_per_second=speeds,
        runs=runs,
        passed=all(r.passed for r in runs if r.decides),
    )


def _compare_run(
    run: GreedyRun, decides: bool, ref: np.ndarray, decisive: np.ndarray, prompt_ids: list[list[int]] | None
) -> RuntimeComparison:
    """One run's tokens ``(B, N)`` against the reference's ``ref`` ``(B, N)``, sequence by sequence up to the first
    divergence; ``decisive`` ``(B, N)`` bool marks the steps that are not near-ties."""
    compared = mismatches = ties = tie_divergences = 0
    first: list[int | None] = []
    first_mismatch: dict[str, Any] | None = None
    for b in range(ref.shape[0]):
        diverged = None
        for s in range(ref.shape[1]):
            if run.tokens[b, s] == ENDED:
                break
            compared += 1
            ties += int(not decisive[b, s])
            if run.tokens[b, s] == ref[b, s]:
                continue
            diverged = s
            if not decisive[b, s]:
                tie_divergences += 1
                break
            mismatches += 1
            if first_mismatch is None:
                shown = prompt_ids[b] if prompt_ids is not None else []
                first_mismatch = {
                    "prompt": b,
                    "prompt_ids": [int(t) for t in shown[:16]],
                    "prompt_truncated": len(shown) > 16,
                    "step": s,
                    "expected": int(ref[b, s]),
                    "got": int(run.tokens[b, s]),
                }
            break
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
