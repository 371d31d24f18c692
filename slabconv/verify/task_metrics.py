"""Task metrics of a fused language model: teacher-forced perplexity and the KL divergence between next-token
distributions, the original against the fused model in every runtime that generates (issue 40;
``docs/verification.md``, "Task metrics of a language model").

Greedy tokens (``slabconv.verify.generate``) say whether the argmax survives; these say how far the whole
next-token distribution moved, in the numbers language-model users compare after folding norms (perplexity drift,
per-token KL). On the verification sequences (the ``holdout.npz`` beside a checkpoint: held-out text), teacher
forced: every position ``t < T - 1`` predicts the sequence's own token ``t + 1``.

- ``perplexity = exp(mean NLL)`` of each run; the original's in float64 is the reference, the original's in its
  own dtype the baseline (cast to the fused folder's dtype where that is narrower: question 2's rule);
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from slabconv.verify.blocks import row_blocks
from slabconv.verify.greedy import ArrayLike, _as_ids
from slabconv.verify.policy import ORIGINAL_ERROR_FACTOR, dtype_name, tol_dtype
from slabconv.verify.runtimes import chunks

TASK_SEQUENCES = 256
"""At most this many verification sequences are scored (the first ones): each costs a float64 and a dtype pass of
the original and one pass per runtime."""

BATCH = 16
"""Sequences per forward pass."""

Logits = Callable[[np.ndarray], np.ndarray]
"""Token ids int64 ``(B, T)`` -> next-token logits ``(B, T, V)`` in the dtype the runtime computed them in (bfloat16
as float32, which holds it exactly): the scoring converts a block at a time to float64 (``Scorer``)."""


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


class Scorer:
    """The task metrics accumulated a batch of sequences at a time, so that no run's logits are held whole but the
    float64 reference's log-probabilities ``(N, T - 1, V)`` and the baseline's logits in their own dtype (the
    original's, e.g. float32): each run's next-token distributions are reduced to per-position numbers (NLL, KL)
    as its batches come, a block of positions at a time (``blocks.CHUNK_BYTES`` of float64 per operand). Every
    per-position number is computed row by row as ``log_softmax``, ``nll`` and ``kl`` compute it on whole arrays,
    and the means and maxima are taken over the whole ``(N, T - 1)`` arrays, so the results are those of the whole
    arrays (``score``), bit for bit, for every batch and block size.

    Use: ``reference`` once (the float64 original), then ``run`` for the baseline (``decides=False``, first: its
    logits are kept for ``kl_to_original_*``) and for each fused run, then ``metrics``.

    Args:
        ids: int64 ``(N, T)``, ``T >= 2``: the sequences; position ``t`` predicts ``ids[:, t + 1]``.
        dtype: the checkpoint's dtype (its tolerance sets the floors).
        chunk_bytes: the float64 bytes of each operand converted at once (``blocks.CHUNK_BYTES`` when None).

    Raises:
        ValueError: sequences shorter than 2 tokens.
    """

    def __init__(self, ids: np.ndarray, dtype: object, chunk_bytes: int | None = None):
        if ids.ndim != 2 or ids.shape[1] < 2:
            raise ValueError("task metrics need sequences of at least 2 tokens")
        self.ids, self.targets, self.dtype, self.chunk_bytes = ids, ids[:, 1:], dtype, chunk_bytes
        self.ref_logp: np.ndarray | None = None
        self.ref_nll = np.empty(self.targets.shape)
        self.scale = 0.0
        self.base: np.ndarray | None = None
        self.runs: list[tuple[str, bool, np.ndarray, np.ndarray, np.ndarray]] = []

    def _rows(self, name: str, batches: Iterable[np.ndarray]) -> Iterator[tuple[int, slice, np.ndarray]]:
        """``(sequence, block of positions, logits (positions, V))`` over ``batches`` (logits ``(b, T, V)`` of the
        sequences in order), checked against the sequences' count and length and the reference's vocabulary."""
        n, length = self.ids.shape
        vocab = self.ref_logp.shape[-1] if self.ref_logp is not None else None
        row = 0
        for logits in batches:
            want = (min(len(logits), n - row), length, vocab if vocab is not None else logits.shape[-1])
            if logits.ndim != 3 or logits.shape != want or not len(logits):
                raise ValueError(f"{name}: logits of shape {logits.shape} for sequences {row}.., expected {want}")
            for j in range(len(logits)):
                for block in row_blocks(length - 1, logits.shape[-1], self.chunk_bytes):
                    yield row + j, block, logits[j, block]
            row += len(logits)
        if row != n:
            raise ValueError(f"{name}: logits of {row} sequences, expected {n}")

    def reference(self, batches: Iterable[np.ndarray]) -> None:
        """The float64 original's logits ``(b, T, V)``, batch by batch: its log-probabilities are kept."""

        def last_positions(batches: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
            for logits in batches:  # the last position predicts nothing, but its logits set the floors' scale too
                if logits.ndim == 3 and logits.size:
                    self.scale = float(np.max([self.scale, np.abs(logits[:, -1]).max()]))  # NaN stays
                yield logits

        for row, block, logits in self._rows("reference", last_positions(batches)):
            if self.ref_logp is None:
                self.ref_logp = np.empty((*self.targets.shape, logits.shape[-1]))
            logp = log_softmax(logits)
            self.ref_logp[row, block] = logp
            self.ref_nll[row, block] = nll(logp, self.targets[row, block])
            self.scale = float(np.max([self.scale, np.abs(logits).max()]))

    def run(self, name: str, batches: Iterable[np.ndarray], decides: bool = True) -> None:
        """One run's logits ``(b, T, V)``, batch by batch (the baseline first, ``decides=False``)."""
        if self.ref_logp is None:
            raise ValueError("the reference's logits come first")
        baseline = not self.runs
        shape = self.targets.shape
        nlls, div, to_original = np.empty(shape), np.empty(shape), np.empty(shape)
        for row, block, logits in self._rows(name, batches):
            if baseline:
                if self.base is None:
                    self.base = np.empty((*shape, logits.shape[-1]), dtype=logits.dtype)
                self.base[row, block] = logits
            assert self.base is not None
            logq = log_softmax(logits)
            base = logq if baseline else log_softmax(self.base[row, block])
            nlls[row, block] = nll(logq, self.targets[row, block])
            div[row, block] = kl(self.ref_logp[row, block], logq)
            to_original[row, block] = kl(base, logq)
        self.runs.append((name, decides, nlls, div, to_original))

    def metrics(self) -> TaskMetrics:
        """The metrics of every run (module docstring gives the rule)."""
        ref_ppl = float(np.exp(self.ref_nll.mean()))
        delta = tol_dtype(self.dtype) * self.scale
        runs = [
            TaskRun(
                name,
                float(np.exp(nlls.mean())),
                float(div.mean()),
                float(div.max()),
                float(to_original.mean()),
                float(to_original.max()),
                decides=decides,
            )
            for name, decides, nlls, div, to_original in self.runs
        ]
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
            sequences=int(self.ids.shape[0]),
            positions=int(self.targets.size),
            dtype=dtype_name(self.dtype),
            reference={"name": "original float64 (pytorch, reference)", "perplexity": ref_ppl},
            runs=runs,
        )


def score(
    reference: np.ndarray,
    original: tuple[str, np.ndarray],
    candidates: list[tuple[str, np.ndarray]],
    ids: np.ndarray,
    dtype: object,
    chunk_bytes: int | None = None,
) -> TaskMetrics:
    """The task metrics of ``candidates`` against the float64 ``reference`` logits, with the original in its own
    dtype as the baseline (the module docstring gives the rule): ``Scorer`` on whole arrays.

    Args:
        reference: float64 logits ``(N, T, V)`` of the original in float64.
        original: ``(name, logits)`` of the original in its own dtype.
        candidates: ``(name, logits)`` of each fused run, ``(N, T, V)``.
        ids: the token ids ``(N, T)`` the logits were computed on; position ``t`` predicts ``ids[:, t + 1]``.
        dtype: the checkpoint's dtype (its tolerance sets the floors).
        chunk_bytes: as ``Scorer``'s (the results do not depend on it).

    Raises:
        ValueError: logits of another shape than the reference's, or sequences shorter than 2 tokens.
    """
    scorer = Scorer(ids, dtype, chunk_bytes)
    scorer.reference([reference])
    for name, logits, decides in [(original[0], original[1], False), *((n, lg, True) for n, lg in candidates)]:
        if logits.shape != reference.shape:
            raise ValueError(f"{name}: logits of shape {logits.shape}, the reference has {reference.shape}")
        scorer.run(name, [logits], decides)
    return scorer.metrics()


def _batches(fn: Logits, ids: np.ndarray, fixed_batch: int | None = None) -> Iterator[np.ndarray]:
    """``fn``'s logits on ``ids``, ``BATCH`` sequences at a time, or exactly ``fixed_batch`` (the last batch padded
    with copies of its first sequence, whose logits are dropped)."""
    for _, chunk, n in chunks(ids, BATCH, fixed_batch):
        yield fn(cast(np.ndarray, chunk))[:n]  # ids: one array


def torch_logits(model: torch.nn.Module) -> Logits:
    """Logits of a model mapping ids ``(B, T)`` to logits (a tensor, or an output with ``.logits``)."""

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.from_numpy(ids))
        logits = (out.logits if hasattr(out, "logits") else out).detach().cpu()
        return (logits.float() if logits.dtype == torch.bfloat16 else logits).numpy()  # numpy has no bfloat16

    return run


def onnx_logits(path: Path) -> Logits:
    """Logits of the decoder ONNX in onnxruntime: the whole sequence in one call, with empty pasts, as its first
    generation step runs it (``generate.decoder_session``)."""
    from slabconv.verify.generate import decoder_session

    session, _, feeds = decoder_session(path)
    return lambda ids: np.asarray(session.run(["logits"], feeds(ids))[0])


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
        return np.asarray(generator.get_output("logits"))

    return run


def check_task_metrics(
    original: torch.nn.Module, folder: Path | str, token_ids: ArrayLike, *, onnx: bool = True, batch: int | None = None
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
        batch: the batch the original runs in when its batch is fixed (a program recorded with a static batch,
            ``LoadedModel.batch``): every run is scored in batches of exactly that many, as question 2 runs such an
            original; None: ``BATCH`` sequences at a time.

    Returns:
        ``TaskMetrics.to_dict()``: the report's ``verification.task_metrics`` block.

    Raises:
        UsageError: transformers is not installed; bad ids.
    """
    from slabconv.verify.generate import genai_available
    from slabconv.write.hf_llama import load_fused_llama, require_transformers, weights_dtype

    transformers = require_transformers()
    ids = _as_ids(token_ids)[:TASK_SEQUENCES].numpy()
    dtype = next(original.parameters()).dtype
    # the folder's dtype from its safetensors headers: the fused model is loaded once the float64 copy is gone
    stored = getattr(torch, weights_dtype(folder))
    exact = copy.deepcopy(original).to(torch.float64).eval()
    if stored.itemsize < dtype.itemsize:  # held to the original cast to the folder's dtype, as question 2 holds it
        original, dtype = copy.deepcopy(original).to(stored).eval(), stored
    scorer = Scorer(ids, dtype)
    scorer.reference(_batches(torch_logits(exact), ids, batch))
    del exact
    scorer.run(f"original {dtype_name(dtype)} (pytorch)", _batches(torch_logits(original), ids, batch), decides=False)
    fused = load_fused_llama(folder)
    scorer.run(f"fused {dtype_name(fused.dtype)} (transformers {transformers.__version__})",
               _batches(torch_logits(fused), ids, batch))  # fmt: skip
    del fused
    notes = []
    decoder = Path(folder) / "decoder.onnx"
    if onnx and decoder.is_file() and dtype != torch.bfloat16:
        import onnxruntime as ort

        scorer.run(f"decoder.onnx (onnxruntime {ort.__version__})", _batches(onnx_logits(decoder), ids, batch))
        if (Path(folder) / "genai_config.json").is_file():
            if genai_available():
                import onnxruntime_genai as og

                name = f"fused folder (onnxruntime-genai {og.__version__})"
                scorer.run(name, _batches(genai_logits(Path(folder)), ids, batch))
            else:
                notes.append("onnxruntime-genai is not installed: its task metrics were not measured")
    metrics = scorer.metrics()
    metrics.notes += notes
    return metrics.to_dict()
