"""Equivalence checks: a reference model against a candidate, per output, with the DESIGN.md section 5 policy.

Relative error = max |candidate - reference| / max |reference| over an output. Default tolerances by the
reference's dtype: float32 1e-5, float16 1e-3, bfloat16 1e-2. Top-1 agreement (argmax over the last axis of
a ``(B, K)`` output) must be 100%. NaN anywhere fails. A failing result says the tolerance that would have
been needed, never widens its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2, "float64": 1e-5}

Runner = Callable[[np.ndarray], np.ndarray]


@dataclass
class Comparison:
    """One output compared under one runtime setting.

    Attributes:
        name: what was compared (``output @ onnxruntime[all-optimizations]``).
        passed: relative error within ``tolerance``, top-1 agreement 1.0, no NaN.
        samples: number of input samples.
        max_abs_err: max |candidate - reference|.
        max_rel_err: max_abs_err / max |reference| (DESIGN.md section 5).
        mean_abs_err: mean |candidate - reference|.
        top1_agreement: fraction of samples whose argmax agrees (None for outputs that are not logits).
        worst_sample: index of the sample with the largest absolute error.
        tolerance: the relative tolerance applied.
        atol: an absolute tolerance also accepted (0 unless given).
    """

    name: str
    passed: bool
    samples: int
    max_abs_err: float
    max_rel_err: float
    mean_abs_err: float
    top1_agreement: float | None
    worst_sample: int
    tolerance: float
    atol: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def summary(self) -> str:
        """A line saying what happened; on failure, the tolerance that would have been needed."""
        top1 = "" if self.top1_agreement is None else f", top-1 agreement {self.top1_agreement:.2%}"
        text = f"{self.name}: max rel err {self.max_rel_err:.3g} (tolerance {self.tolerance:g}){top1}"
        if not self.passed:
            text += f"; it would have needed rtol >= {self.max_rel_err:.3g} (worst sample {self.worst_sample})"
        return text


def compare(
    name: str, reference: np.ndarray, candidate: np.ndarray, rtol: float, atol: float = 0.0
) -> Comparison:
    """Compare two outputs of shape ``(B, ...)`` (float arrays, same shape).

    Raises:
        ValueError: the shapes differ.
    """
    if reference.shape != candidate.shape:
        raise ValueError(f"{name}: output shapes differ: reference {reference.shape}, candidate {candidate.shape}")
    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    diff = np.abs(cand - ref)
    finite = bool(np.isfinite(ref).all() and np.isfinite(cand).all())
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    per_sample = diff.reshape(diff.shape[0], -1).max(axis=1) if diff.ndim else diff.reshape(1)
    top1 = None
    if ref.ndim == 2 and ref.shape[1] > 1:
        top1 = float((ref.argmax(axis=1) == cand.argmax(axis=1)).mean())
    passed = finite and (max_rel <= rtol or max_abs <= atol) and (top1 is None or top1 == 1.0)
    return Comparison(
        name=name,
        passed=passed,
        samples=int(ref.shape[0]) if ref.ndim else 1,
        max_abs_err=max_abs if finite else float("nan"),
        max_rel_err=max_rel if finite else float("nan"),
        mean_abs_err=float(diff.mean()) if diff.size else 0.0,
        top1_agreement=top1,
        worst_sample=int(per_sample.argmax()) if per_sample.size else 0,
        tolerance=rtol,
        atol=atol,
    )


def onnx_runners(path: Path) -> dict[str, Runner]:
    """onnxruntime on CPU with graph optimisations disabled and fully enabled (an optimiser can change numbers).

    Returns:
        ``{"onnxruntime[no-optimizations]": run, "onnxruntime[all-optimizations]": run}``; each ``run`` takes a
        float array ``(B, ...)`` and returns the first output.
    """
    import onnxruntime as ort

    runners: dict[str, Runner] = {}
    for label, level in (
        ("no-optimizations", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        ("all-optimizations", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        input_name = session.get_inputs()[0].name
        runners[f"onnxruntime[{label}]"] = (
            lambda x, s=session, n=input_name: np.asarray(s.run(None, {n: x})[0])  # type: ignore[misc]
        )
    return runners


def run_batched(run: Runner, inputs: np.ndarray, batch: int = 64, fixed_batch: int | None = None) -> np.ndarray:
    """Run ``run`` over ``inputs`` in chunks of ``batch`` samples (or exactly ``fixed_batch``, padding the last
    chunk with copies of its first sample and dropping their outputs) and stack the outputs."""
    step = fixed_batch or batch
    outs = []
    for start in range(0, len(inputs), step):
        chunk = inputs[start : start + step]
        n = len(chunk)
        if fixed_batch and n < fixed_batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], fixed_batch - n, axis=0)])
        outs.append(run(np.ascontiguousarray(chunk))[:n])
    return np.concatenate(outs)


def onnxruntime_version() -> str:
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__}"
