"""Task metrics of a fused language model: teacher-forced perplexity and the KL divergence between next-token
distributions, the original against the fused model in every runtime that generates (issue 40;
``docs/verification.md``, "Task metrics of a language model").

Greedy tokens (``slabconv.verify.generate``) say whether the argmax survives; these say how far the whole
next-token distribution moved, in the numbers language-model users compare after folding norms (perplexity drift,
per-token KL). On the verification sequences (the ``holdout.npz`` beside a checkpoint: held-out text), teacher
forced: every position ``t < T - 1`` predicts the sequence's own token ``t + 1``.

- ``perplexity = exp(mean NLL)`` of each run; the original's in float64 is the reference, the original's in its
  own dtype the baseline;
- ``KL(P_ref || P_run)`` per position, its mean and its maximum: against the float64 reference (what decides) and
  against the original in its own dtype (``kl_to_original_*``: what users compare; for information).

A run passes when each of its three numbers, ``|ln ppl_run - ln ppl_ref|``, the mean KL and the largest KL, is
within the larger of the dtype's floor and twice the original's own (``policy.ORIGINAL_ERROR_FACTOR``): question
2's rule on the task's numbers. The floors are what question 2's tolerance already allows: every logit within
``delta = tol_dtype * max |reference logit|`` of the reference moves a log-probability by at most ``2 delta``, so
``|d ln ppl| <= 2 delta`` and each position's KL ``<= 2 delta**2``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv.verify.greedy import ArrayLike, _as_ids
from slabconv.verify.policy import ORIGINAL_ERROR_FACTOR, dtype_name, tol_dtype

TASK_SEQUENCES = 256
"""At most this many verification sequences are scored (the first ones): each costs a float64 and a dtype pass of
the original and one pass per runtime."""

BATCH = 16
"""Sequences per forward pass."""

Logits = Callable[[np.ndarray], np.ndarray]
"""Token ids int64 ``(B, T)`` -> next-token logits ``(B, T, V)`` as float64."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log softmax`` over the last axis, in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def nll(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The negative log-likelihood of ``targets`` ``(N, P)`` under log-probabilities ``(N, P, V)``, per position."""
    return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def kl(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """``KL(P || Q) = sum_v p (log p - log q)`` per position of two log-probability arrays ``(N, P, V)``; never
    negative (rounding below 0 is clipped)."""
    return np.clip((np.exp(logp) * (logp - logq)).sum(axis=-1), 0.0, None)


@dataclass
class TaskRun:
    """The task metrics of one run on the scored positions.

    Attributes:
        name: which model in which runtime (the generation check's names).
        perplexity: ``exp(mean NLL)`` of the sequences' own next tokens.
        kl_mean, kl_max: ``KL(P_float64 reference || P_run)``, mean and largest over the positions.
        kl_to_original_mean, kl_to_original_max: the same against the original in its own dtype (information).
        bounds: what each judged number was held to: ``log_perplexity``, ``kl_mean``, ``kl_max``.
        decides: False for the original's own run (the baseline); True for a fused run.
        passed: within every bound (always True for the baseline).
    """

    name: str
    perplexity: float
    kl_mean: float
    kl_max: float
    kl_to_original_mean: float
    kl_to_original_max: float
    bounds: dict[str, float] = field(default_factory=dict)
    decides: bool = True
    passed: bool = True


@dataclass
class TaskMetrics:
    """The task-metrics block of ``verification.task_metrics``.

    Attributes:
        sequences, positions: sequences scored and positions in all (``T - 1`` each).
        dtype: the checkpoint's dtype (its ``tol_dtype`` sets the floors).
        reference: the float64 original's name and ``perplexity``.
        runs: the original in its dtype (``decides`` False), then each fused runtime.
        notes: runtimes not run, and why.
        passed: every deciding run passed.
    """

    sequences: int
    positions: int
    dtype: str
    reference: dict[str, Any]
    runs: list[TaskRun]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.runs if r.decides)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


def score(
    reference: np.ndarray,
    original: tuple[str, np.ndarray],
    candidates: list[tuple[str, np.ndarray]],
    ids: np.ndarray,
    dtype: object,
) -> TaskMetrics:
    """The task metrics of ``candidates`` against the float64 ``reference`` logits, with the original in its own
    dtype as the baseline (the module docstring gives the rule).

    Args:
        reference: float64 logits ``(N, T, V)`` of the original in float64.
        original: ``(name, logits)`` of the original in its own dtype.
        candidates: ``(name, logits)`` of each fused run, ``(N, T, V)``.
        ids: the token ids ``(N, T)`` the logits were computed on; position ``t`` predicts ``ids[:, t + 1]``.
        dtype: the checkpoint's dtype (its tolerance sets the floors).

    Raises:
        ValueError: logits of another shape than the reference's, or sequences shorter than 2 tokens.
    """
    if ids.shape[1] < 2:
        raise ValueError("task metrics need sequences of at least 2 tokens")
    targets = ids[:, 1:]
    cut = slice(None, -1)
    ref = log_softmax(reference[:, cut])
    ref_ppl = float(np.exp(nll(ref, targets).mean()))
    delta = tol_dtype(dtype) * float(np.abs(reference).max())
    runs = []
    base = log_softmax(original[1][:, cut])
    for name, logits, decides in [(original[0], original[1], False), *((n, lg, True) for n, lg in candidates)]:
        if logits.shape != reference.shape:
            raise ValueError(f"{name}: logits of shape {logits.shape}, the reference has {reference.shape}")
        logq = log_softmax(logits[:, cut])
        div, to_original = kl(ref, logq), kl(base, logq)
        runs.append(
            TaskRun(
                name,
                float(np.exp(nll(logq, targets).mean())),
                float(div.mean()),
                float(div.max()),
                float(to_original.mean()),
                float(to_original.max()),
                decides=decides,
            )
        )
    baseline = runs[0]
    own = {
        "log_perplexity": abs(math.log(baseline.perplexity) - math.log(ref_ppl)),
        "kl_mean": baseline.kl_mean,
        "kl_max": baseline.kl_max,
    }
    floors = {"log_perplexity": 2 * delta, "kl_mean": 2 * delta**2, "kl_max": 2 * delta**2}
    bounds = {k: max(floors[k], ORIGINAL_ERROR_FACTOR * own[k]) for k in own}
    for run in runs:
        run.bounds = dict(bounds)
        if run.decides:
            drift = abs(math.log(run.perplexity) - math.log(ref_ppl))
            values = {"log_perplexity": drift, "kl_mean": run.kl_mean, "kl_max": run.kl_max}
            run.passed = all(values[k] <= bounds[k] for k in bounds)  # False for NaN
    return TaskMetrics(
        sequences=int(ids.shape[0]),
        positions=int(targets.size),
        dtype=dtype_name(dtype),
        reference={"name": "original float64 (pytorch, reference)", "perplexity": ref_ppl},
        runs=runs,
    )


def _batched(fn: Logits, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([fn(ids[i : i + BATCH]) for i in range(0, len(ids), BATCH)])


def torch_logits(model: torch.nn.Module) -> Logits:
    """Logits of a model mapping ids ``(B, T)`` to logits (a tensor, or an output with ``.logits``)."""

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.from_numpy(ids))
        logits = out.logits if hasattr(out, "logits") else out
        return logits.detach().to(torch.float64).cpu().numpy()

    return run


def onnx_logits(path: Path) -> Logits:
    """Logits of the decoder ONNX (``slabconv.write.decoder_onnx``) in onnxruntime: the whole sequence in one call,
    with empty pasts, as its first generation step runs it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    float_type = np.float16 if pasts and pasts[0].type == "tensor(float16)" else np.float32

    def run(ids: np.ndarray) -> np.ndarray:
        b, t = ids.shape
        feeds: dict[str, np.ndarray] = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "position_ids": np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy(),
        }
        for p in pasts:
            feeds[p.name] = np.zeros((b, int(p.shape[1]), 0, int(p.shape[3])), float_type)
        (logits,) = session.run(["logits"], feeds)
        return np.asarray(logits, dtype=np.float64)

    return run


def genai_logits(folder: Path) -> Logits:
    """Logits of the fused folder in onnxruntime-genai: the sequences appended to a generator, every position's
    logits read back (``Generator.get_output("logits")``)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(ids: np.ndarray) -> np.ndarray:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=ids.shape[1], do_sample=False, batch_size=ids.shape[0])
        generator = og.Generator(model, params)
        generator.append_tokens(ids.astype(np.int32))
        return np.asarray(generator.get_output("logits"), dtype=np.float64)

    return run


def check_task_metrics(
    original: torch.nn.Module, folder: Path | str, token_ids: ArrayLike, *, onnx: bool = True
) -> dict[str, Any]:
    """The task metrics of ``fuse`` and ``verify --generate``, beside the greedy-generation check and over the same
    runtimes (``generate.check_fused_folder``): the original in float64 (the reference) and in its dtype, the fused
    folder in transformers and, with ``onnx``, its ``decoder.onnx`` in onnxruntime and (installed, with a
    ``genai_config.json``) the folder in onnxruntime-genai; not for bfloat16 in onnxruntime (no CPU kernels).

    Args:
        original: ids int64 ``(B, T)`` -> logits ``(B, T, V)``, eval mode.
        folder: the fused Hugging Face folder.
        token_ids: int64 ``(S, T)`` verification sequences; the first ``TASK_SEQUENCES`` are scored.
        onnx: also run ``folder/decoder.onnx`` when it exists.

    Returns:
        ``TaskMetrics.to_dict()``: the report's ``verification.task_metrics`` block.

    Raises:
        UsageError: transformers is not installed; bad ids.
    """
    from slabconv.verify.generate import genai_available
    from slabconv.write.hf_llama import load_fused_llama, require_transformers

    transformers = require_transformers()
    ids = _as_ids(token_ids)[:TASK_SEQUENCES].numpy()
    dtype = next(original.parameters()).dtype
    exact = copy.deepcopy(original).to(torch.float64).eval()
    reference = _batched(torch_logits(exact), ids)
    del exact
    baseline = (f"original {dtype_name(dtype)} (pytorch)", _batched(torch_logits(original), ids))
    fused = load_fused_llama(folder)
    name = f"fused {dtype_name(fused.dtype)} (transformers {transformers.__version__})"
    candidates = [(name, _batched(torch_logits(fused), ids))]
    del fused
    notes = []
    decoder = Path(folder) / "decoder.onnx"
    if onnx and decoder.is_file() and dtype != torch.bfloat16:
        import onnxruntime as ort

        candidates.append((f"decoder.onnx (onnxruntime {ort.__version__})", _batched(onnx_logits(decoder), ids)))
        if (Path(folder) / "genai_config.json").is_file():
            if genai_available():
                import onnxruntime_genai as og

                logits = _batched(genai_logits(Path(folder)), ids)
                candidates.append((f"fused folder (onnxruntime-genai {og.__version__})", logits))
            else:
                notes.append("onnxruntime-genai is not installed: its task metrics were not measured")
    metrics = score(reference, baseline, candidates, ids, dtype)
    metrics.notes += notes
    return metrics.to_dict()
