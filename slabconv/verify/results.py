"""Equivalence checks: a reference model against a candidate, per output, with the DESIGN.md section 5 policy.

Relative error = max |candidate - reference| / max |reference| over an output. Default tolerances by the
reference's dtype: float32 1e-5, float16 1e-3, bfloat16 1e-2. Top-1 agreement (argmax over the last axis of
a ``(B, K)`` output) must be 100%. NaN anywhere fails. A failing result says the tolerance that would have
been needed, never widens its own.

Besides the numbers, a verification holds integrity checks of the written files: ``onnx.checker`` with
``full_check`` on every ONNX file, and a reload of every safetensors file (bit-equal to what was written).
Every check, numeric or integrity, must pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from slabconv.errors import InputError


@dataclass
class Comparison:
    """One output compared under one runtime setting.

    Attributes:
        name: what was compared (``output @ onnxruntime[all-optimizations]``).
        passed: relative error within ``tolerance`` (or absolute error within ``atol``), top-1 agreement 1.0,
            no NaN/Inf.
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


@dataclass
class IntegrityCheck:
    """A check of a written file that is not a number: ``onnx.checker``, a safetensors reload.

    Attributes:
        name: ``onnx.checker[full_check] model.onnx``, ``safetensors reload model.safetensors``.
        passed: the check succeeded.
        detail: one line: what was checked, or what is wrong.
    """

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Verification:
    """Every check of one verification run; ``to_dict`` is the report's ``verification`` block."""

    checks: list[Comparison]
    integrity: list[IntegrityCheck] = field(default_factory=list)
    runtime: str = ""
    inputs: str = ""
    inputs_sha256: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks) and all(i.passed for i in self.integrity)

    def to_dict(self) -> dict[str, Any]:
        agreements = [c.top1_agreement for c in self.checks if c.top1_agreement is not None]
        return {
            "passed": self.passed,
            "samples": self.checks[0].samples if self.checks else 0,
            "max_abs_err": max((c.max_abs_err for c in self.checks), default=0.0),
            "max_rel_err": max((c.max_rel_err for c in self.checks), default=0.0),
            "top1_agreement": min(agreements) if agreements else None,
            "tolerance": self.checks[0].tolerance if self.checks else None,
            "atol": self.checks[0].atol if self.checks else 0.0,
            "runtime": self.runtime,
            "inputs": self.inputs,
            "inputs_sha256": self.inputs_sha256,
            "checks": [c.to_dict() for c in self.checks],
            "integrity": [i.to_dict() for i in self.integrity],
        }


def failure_line(verification: Mapping[str, Any]) -> str:
    """One line naming the worst failing check of a ``verification`` block and the tolerance it needed."""
    bad_files = [i for i in verification.get("integrity", []) if not i["passed"]]
    if bad_files:
        return f"{bad_files[0]['name']} failed: {bad_files[0]['detail']}"
    failing = [c for c in verification["checks"] if not c["passed"]] or verification["checks"]
    worst = max(failing, key=lambda c: (np.nan_to_num(c["max_rel_err"], nan=np.inf), c["name"]))
    top1 = "" if worst["top1_agreement"] is None else f", top-1 agreement {worst['top1_agreement']:.2%}"
    return (
        f"{worst['name']}: max rel err {worst['max_rel_err']:.3g} > tolerance {worst['tolerance']:g}{top1} "
        f"(worst sample {worst['worst_sample']}); it would have needed rtol >= {worst['max_rel_err']:.3g}"
    )


def compare(
    name: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    rtol: float,
    atol: float = 0.0,
    token_logits: bool = False,
) -> Comparison:
    """Compare two outputs of shape ``(B, ...)`` (float arrays, same shape).

    Top-1 agreement is taken over the last axis of a ``(B, K)`` output, and with ``token_logits`` (a language
    model's ``(B, T, V)`` logits) over the last axis at every one of the ``B * T`` positions.

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
    per_sample = diff.reshape(diff.shape[0], -1).max(axis=1) if diff.ndim and diff.size else np.zeros(1)
    top1 = None
    if (ref.ndim == 2 or (token_logits and ref.ndim >= 2)) and ref.shape[-1] > 1:
        top1 = float((ref.argmax(axis=-1) == cand.argmax(axis=-1)).mean())
    passed = finite and (max_rel <= rtol or max_abs <= atol) and (top1 is None or top1 == 1.0)
    return Comparison(
        name=name,
        passed=passed,
        samples=int(ref.shape[0]) if ref.ndim else 1,
        max_abs_err=max_abs if finite else float("nan"),
        max_rel_err=max_rel if finite else float("nan"),
        mean_abs_err=float(diff.mean()) if diff.size and finite else (0.0 if finite else float("nan")),
        top1_agreement=top1,
        worst_sample=int(np.nan_to_num(per_sample, nan=np.inf).argmax()),
        tolerance=rtol,
        atol=atol,
    )


def compare_runtimes(
    reference: Sequence[np.ndarray],
    reference_names: Sequence[str],
    candidate: Sequence[np.ndarray],
    label: str,
    rtol: float,
    atol: float = 0.0,
    token_logits: bool = False,
) -> list[Comparison]:
    """One ``Comparison`` per output, named ``<output> @ <label>``.

    Raises:
        InputError: the two models have different numbers of outputs or different output shapes (they are
            not the same model, e.g. a checkpoint of another architecture).
    """
    if len(reference) != len(candidate):
        raise InputError(
            f"the reference has {len(reference)} outputs but {label} gives {len(candidate)}; "
            "compare two versions of the same model"
        )
    out = []
    for name, ref, cand in zip(reference_names, reference, candidate, strict=True):
        if ref.shape != cand.shape:
            raise InputError(
                f"output {name!r}: the reference gives shape {ref.shape} but {label} gives {cand.shape}; "
                "the two files are not the same model (a different architecture or class count?)"
            )
        out.append(compare(f"{name} @ {label}", ref, cand, rtol, atol, token_logits))
    return out


def output_names(count: int, names: Sequence[str] | None = None) -> list[str]:
    """The names used in check names: the ONNX names when known, else ``output`` / ``output.<i>``."""
    if names is not None and len(names) == count:
        return list(names)
    return ["output"] if count == 1 else [f"output.{i}" for i in range(count)]
