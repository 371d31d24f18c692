"""What a verification found, as objects: one per question answered, per output and runtime, per file check.

The two questions of the policy (``slabconv.verify.policy``, ``docs/verification.md``):

- ``ExactCheck`` answers question 1, *is the fold exact?*: the fused graph in float64 against the original in
  float64 (``method="graph"``), or the written tensors against a fresh float64 fold (``method="tensors"``).
- ``OutputCheck`` answers question 2, *are the written files as good as the original?*, for one output of one
  artifact under one runtime: its error against the float64 reference, the original's own error, the bound
  applied and why, top-1 on decisive samples and the near-ties counted.

``IntegrityCheck`` covers file checks that are not numbers (``onnx.checker``, a streamed fold's tensor names). A
``Verification`` holds them all; every check must pass. Failure lines name the question and the numbers in
words that cannot be misread: what was measured, the bound it exceeded, and where the bound came from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from slabconv.text import count, units_in_last_place

QUESTION_1 = "question 1 (is the fold exact?)"
QUESTION_2 = "question 2 (are the written files as good as the original?)"


@dataclass
class ExactCheck:
    """Question 1 for the whole model (``method="graph"``) or for one written file (``method="tensors"``).

    Attributes:
        name: what was checked (``fused graph vs original, both float64`` / ``model.safetensors vs float64 fold``).
        passed: within ``bound``.
        method: ``graph``: relative error of every output, fused float64 graph vs original float64 graph;
            ``tensors``: largest distance of a stored value from the fresh float64 fold correctly rounded to its
            dtype, in units in the last place (0 for a correct file).
        error: the relative error (graph) or the largest distance in ulps (tensors).
        bound: the most allowed (``EXACT_RTOL`` or ``ULPS``).
        worst: the output or tensor where ``error`` was measured.
        detail: one line for people.
        missing: the file (or folder) that lacks ``worst``, a tensor the fold writes (``error`` is then ``inf``);
            empty when ``worst`` was read.
    """

    name: str
    passed: bool
    method: str
    error: float
    bound: float
    worst: str = ""
    detail: str = ""
    missing: str = ""

    def failure(self) -> str:
        """The line that says what failed, for a failed check."""
        if self.method == "graph":
            return (
                f"{QUESTION_1} failed: the fused graph in float64 differs from the original in float64 by "
                f"{self.error:.3g} (relative, at {self.worst}), more than float64 rounding allows ({self.bound:g}): "
                "the fold is wrong"
            )
        if self.missing:
            return (
                f"{QUESTION_1} failed: {self.name}: tensor {self.worst!r}, which the fold writes, is missing from "
                f"{self.missing}: {self.detail}"
            )
        return (
            f"{QUESTION_1} failed: {self.name}: tensor {self.worst!r} is {units_in_last_place(self.error)} "
            f"away from the value it is held to, rounded to its dtype (a correct file is {self.bound:g} away): "
            f"{self.detail}"
        )


@dataclass
class OutputCheck:
    """Question 2 for one output of one artifact under one runtime.

    Attributes:
        name: ``<output> @ <runtime>`` (e.g. ``output @ onnxruntime[all-optimizations]``).
        passed: finite, ``e_fused <= tolerance`` (or ``max_abs_err <= atol``), and top-1 agrees with the reference
            on every decisive sample.
        dtype: the dtype the artifact ran in.
        samples: input samples compared.
        reference: ``float64`` (the original model evaluated in float64) or ``original`` (``--strict``, or no
            float64 reference: an ``.onnx`` reference).
        e_fused: ``max |artifact - reference| / max |reference|`` over the output.
        e_orig: the same for the original model in its own dtype (None without a float64 reference); ``inf``
            when the original overflows its dtype.
        e_pair: ``max |artifact - original| / max |original|``, for information.
        tolerance: the bound ``e_fused`` was held to.
        tolerance_from: ``tol_dtype`` (the dtype's own tolerance), ``2*e_orig`` (twice the original's error, when
            larger), ``--rtol`` (given), ``--strict`` (pair comparison).
        max_abs_err, mean_abs_err: of ``artifact - reference``.
        worst_sample: the sample with the largest absolute error.
        top1_agreement: fraction of decisive samples whose argmax equals the reference's (None: not logits).
        decisive, near_ties: samples (positions, for a language model) judged, and those whose reference margin
            between the first two logits is within ``max(tol_dtype, 2 * e_orig) * max |logit|`` (counted, not
            judged; ``policy.decisive``).
        atol: an absolute tolerance also accepted (0 unless given).
    """

    name: str
    passed: bool
    dtype: str
    samples: int
    reference: str
    e_fused: float
    e_orig: float | None
    e_pair: float
    tolerance: float
    tolerance_from: str
    max_abs_err: float
    mean_abs_err: float
    worst_sample: int
    top1_agreement: float | None = None
    decisive: int | None = None
    near_ties: int | None = None
    atol: float = 0.0

    def summary(self) -> str:
        """One line: the numbers and the bound; on failure, what would have been needed."""
        against = "the float64 reference" if self.reference == "float64" else "the original"
        text = f"{self.name}: error {g3(self.e_fused)} against {against} (allowed {self.tolerance:.3g}, {self._why()})"
        if self.e_orig is not None:
            text += f"; original's own error {g3(self.e_orig)}; this file vs original {g3(self.e_pair)}"
        if self.top1_agreement is not None:
            text += f"; top-1 {self.top1_agreement:.2%} of {self.decisive} decisive"
            text += f", {count(self.near_ties, 'near-tie')} not judged" if self.near_ties else ""
        return text + f"; ran in {self.dtype}"

    def _why(self) -> str:
        return {
            "tol_dtype": f"{self.dtype}'s tolerance",
            "2*e_orig": "twice the original's own error",
            "--rtol": "--rtol",
            "--strict": f"--strict: {self.dtype}'s tolerance on fused vs original",
        }.get(self.tolerance_from, self.tolerance_from)

    def failure(self) -> str:
        """The line that says which question failed and by how much."""
        where = f"{QUESTION_2} failed for {self.name}: "
        if not math.isfinite(self.e_fused):
            return where + "its output is not finite (NaN or Inf) where the reference is finite"
        if self.e_fused > self.tolerance and not (self.atol and self.max_abs_err <= self.atol):
            return (
                where + f"its error {g3(self.e_fused)} is above the allowed {self.tolerance:.3g} ({self._why()}); "
                f"it would have needed --rtol {self.e_fused:.3g} (worst sample {self.worst_sample})"
            )
        bad = self.decisive - round((self.top1_agreement or 0.0) * self.decisive) if self.decisive else 0
        return (
            where + f"its top-1 differs from the reference on {bad} of {self.decisive} decisive samples "
            f"({self.near_ties or 0} near-ties not judged)"
        )


def g3(x: float | None) -> str:
    """``x`` as the report's lines show a number: three significant digits, ``n/a`` for None, ``not finite``."""
    if x is None:
        return "n/a"
    return f"{x:.3g}" if math.isfinite(x) else "not finite"


@dataclass
class IntegrityCheck:
    """A check of a written file that is not a number: ``onnx.checker``, a streamed fold's tensor names.

    Attributes:
        name: ``onnx.checker[full_check] model.onnx``, ``tensor names OUT within SRC``.
        passed: the check succeeded.
        detail: one line: what was checked, or what is wrong.
    """

    name: str
    passed: bool
    detail: str

    def failure(self) -> str:
        return f"{self.name} failed: {self.detail}"


@dataclass
class NotRun:
    """A written file that no runtime here could run, or that one runtime could not and another ran in its place:
    named in the verdict, never covered by it.

    Attributes:
        file: the file (``model.onnx``).
        reason: why (``onnxruntime cannot run model.onnx: ... bfloat16 ...``).
        runtime, ran_in: the runtime that could not run it and the one that did (``onnxruntime``, ``openvino``);
            empty when no runtime ran it.
    """

    file: str
    reason: str
    runtime: str = ""
    ran_in: str = ""

    def line(self) -> str:
        if self.ran_in:
            return f"{self.file}: {self.runtime}: not run: {self.reason}; ran in {self.ran_in}"
        return f"{self.file}: not run: {self.reason}"


@dataclass
class Boundary:
    """One fold boundary compared by the localisation pass: the output of a layer a norm folded into, in the
    candidate, against the output of the same layer after the norm in the reference (equal in exact arithmetic).

    Attributes:
        norm: the norm (``blocks.0.norm1``); ``layer``: the layer it folded into, whose output is compared.
        error: relative error (``max |cand - ref| / max |ref|``) of that output, both sides in float64 on the
            same inputs.
        bound: the most allowed (``policy.EXACT_RTOL``).
        rounding: relative error of the correct fold against the original at this boundary (what storing the
            fused weights in their dtype does there), when measured.
        inherited: the boundary diverges, but its layer holds the correct fold's values: the difference reached it
            from a stored tensor before it (``Localization.first_tensor``), so this fold is not to blame.
    """

    norm: str
    layer: str
    error: float
    bound: float
    rounding: float | None = None
    inherited: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.error <= self.bound)

    def line(self) -> str:
        return f"{self.norm} -> {self.layer} (relative error {g3(self.error)} at its output, allowed {self.bound:g})"


@dataclass
class Localization:
    """Where two models first diverge, fold by fold (``slabconv.verify.localize``).

    Attributes:
        method: how the boundaries were compared, in words.
        boundaries: every fold boundary, in the order the data flows through them.
        detail: one line: the first diverging fold, the first stored tensor that differs where no fold wrote it,
            or that none diverges (the difference is the runtime's).
        first_tensor: the first stored tensor, in data-flow order (layer order for two decoder folders), that is
            not the correct fold's value; "" when every one is.
    """

    method: str
    boundaries: list[Boundary] = field(default_factory=list)
    detail: str = ""
    first_tensor: str = ""

    @property
    def first(self) -> Boundary | None:
        """The first boundary that diverges by its own layer's values (``Boundary.inherited`` aside), or None."""
        return next((b for b in self.boundaries if not b.passed and not b.inherited), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "method": self.method,
            "first": asdict(first) if first is not None else None,
            "first_tensor": self.first_tensor or None,
            "boundaries": [asdict(b) for b in self.boundaries],
            "detail": self.detail,
        }


@dataclass
class Case:
    """One check that ran, as a verdict: what ``passed``, ``failures()`` and the JUnit file are all built from, so
    the exit code and the JUnit failure count agree by construction.

    Attributes:
        name: ``question 1: ...``, ``file: ...``, ``question 2: ...``, ``generation: <run>``, ``not run: <file>``
            or ``no check ran``.
        passed: the check's verdict (True for a file not run: it is ``skipped``, named, not failed).
        measured: one line of the numbers measured.
        message: the failure line (empty when it passed), or why a file was not run.
        skipped: a written file no runtime ran (``NotRun``).
    """

    name: str
    passed: bool
    measured: str
    message: str
    skipped: bool = False


def generation_failure(run: dict[str, Any]) -> str:
    """The failure line of one greedy-generation comparison (a ``RuntimeComparison`` as a dict): the runtime, the
    prompt (its first token ids), the first step that differs and the two tokens; or why the candidate did not load
    (``not_loaded``)."""
    if run.get("not_loaded"):
        reason = run["not_loaded"]
        return f"greedy generation failed for {run['name']}: the fused folder does not load as a model: {reason}"
    m = run.get("first_mismatch")
    if not m:
        return f"greedy generation failed for {run['name']}: {run['decisive_mismatches']} decisive mismatches"
    ids = ", ".join(str(i) for i in m["prompt_ids"]) + (", ..." if m.get("prompt_truncated") else "")
    return (
        f"greedy generation failed for {run['name']}: prompt {m['prompt']} (ids {ids}) differs at step {m['step']}: "
        f"expected token {m['expected']}, got {m['got']} ({run['decisive_mismatches']} of "
        f"{len(run['first_divergence'])} prompts differ at a decisive step)"
    )


def task_metric_failure(run: dict[str, Any], reference: float) -> str:
    """The failure line of one run of a ``task_metrics`` block (``slabconv.verify.task_metrics``): the first of its
    numbers above its bound."""
    drift = abs(math.log(run["perplexity"]) - math.log(reference)) if run["perplexity"] > 0 else math.inf
    bounds = run["bounds"]
    words = {
        "log_perplexity": (
            drift,
            f"perplexity {run['perplexity']:.6g} against the float64 reference's {reference:.6g} "
            f"(|d ln ppl| {drift:.3g})",
        ),
        "kl_mean": (run["kl_mean"], f"mean next-token KL {run['kl_mean']:.3g} from the float64 reference"),
        "kl_max": (run["kl_max"], f"largest next-token KL {run['kl_max']:.3g} from the float64 reference"),
    }
    for key, (value, text) in words.items():
        if not value <= bounds[key]:
            return (
                f"task metrics failed for {run['name']}: {text}, above the allowed {bounds[key]:.3g} (twice the "
                "original's own, or its dtype's floor)"
            )
    return f"task metrics failed for {run['name']}"


def task_metric_cases(block: dict[str, Any] | None) -> list[Case]:
    """One case per deciding run of a ``task_metrics`` block."""
    if not block:
        return []
    reference = block["reference"]["perplexity"]
    out = []
    for run in block["runs"]:
        if not run.get("decides", True):
            continue
        measured = (
            f"perplexity={run['perplexity']:.6g} reference_perplexity={reference:.6g} kl_mean={run['kl_mean']:.6g} "
            f"kl_max={run['kl_max']:.6g} bound_log_perplexity={run['bounds']['log_perplexity']:.6g} "
            f"bound_kl_mean={run['bounds']['kl_mean']:.6g} bound_kl_max={run['bounds']['kl_max']:.6g}"
        )
        ok = bool(run["passed"])
        out.append(
            Case(f"task metrics: {run['name']}", ok, measured, "" if ok else task_metric_failure(run, reference))
        )
    return out


def int8_summary(check: dict[str, Any]) -> str:
    """One line of an int8 check (``Int8Check.to_dict()``): both sides' agreement with the float original and
    error against float64, the paired counts and the test's p-value."""
    o, f = check["original"], check["fused"]
    unit = "sample" if check["units"] == "samples" else "sequence"
    return (
        f"top-1 kept from the float original: candidate {f['agreement']:.2%}, reference {o['agreement']:.2%} of "
        f"{o['decisions']}; {check['worse']} {unit}s worse, {check['better']} better for the candidate (one-sided "
        f"p {check['p_value']:.3g}, failing below {check['alpha']:g}); error against float64: candidate "
        f"{f['error']:.3g}, reference {o['error']:.3g}"
    )


def int8_failure(check: dict[str, Any]) -> str:
    """The failure line of an int8 check."""
    o, f = check["original"], check["fused"]
    return (
        f"{check['name']} failed: quantized alike, the candidate keeps the float reference's top-1 on "
        f"{f['agreement']:.2%} where the reference keeps {o['agreement']:.2%} ({check['worse']} {check['units']} "
        f"worse, {check['better']} better; one-sided p {check['p_value']:.3g} < {check['alpha']:g}): the fold "
        "costs int8 accuracy (the int8 step growth of each fold: slabconv inspect)"
    )


def int8_cases(checks: list[dict[str, Any]]) -> list[Case]:
    """One case per int8 check (``Int8Check.to_dict()``)."""
    out = []
    for c in checks:
        measured = (
            f"kept_candidate={c['fused']['agreement']:.6g} kept_reference={c['original']['agreement']:.6g} "
            f"worse={c['worse']} better={c['better']} p_value={c['p_value']:.6g} alpha={c['alpha']:g}"
        )
        ok = bool(c["passed"])
        out.append(Case(c["name"], ok, measured, "" if ok else int8_failure(c)))
    return out


@dataclass
class Verification:
    """Every check of one verification run; ``to_dict`` is the report's ``verification`` block.

    Attributes:
        exact: question 1 (empty when it does not apply: a candidate slabconv did not write; see ``notes``).
        checks: question 2, one per output, artifact and runtime.
        integrity: file checks.
        notes: one line each for what was not checked, and why (a runtime that cannot run an artifact, an
            original that overflows its dtype, question 1 not applicable).
        inputs: the ``.npz`` used, or ``random(seed=S, samples=N)``.
        inputs_sha256: sha256 of the inputs file's bytes (``--inputs``, ``holdout.npz``), in memory and streamed;
            None for seeded inputs.
        reference: what the reference was (``the reference model in float64 (pytorch)``).
        runtime: the runtime(s) the artifacts ran in, in short (``onnxruntime 1.x``, ``pytorch 2.x``).
        generation: the greedy-generation comparison of a language model (``--generate``), or None.
        task_metrics: a language model's teacher-forced perplexity and next-token KL, original vs fused, in each
            runtime that generates (``slabconv.verify.task_metrics``), or None.
        int8: one ``Int8Check.to_dict()`` per quantizing runtime named (``verify --runtime onnxruntime-int8``):
            the reference and the candidate quantized alike, each against the float reference
            (``slabconv.verify.int8``).
        seconds: how long the verification took (wall time).
        not_run: written files no runtime could run (``NotRun``), named in the verdict.
        localization: where the two models first diverge fold by fold (``Localization``): after a failure, or on
            request (``verify --localize``); None when not run.
    """

    exact: list[ExactCheck] = field(default_factory=list)
    checks: list[OutputCheck] = field(default_factory=list)
    integrity: list[IntegrityCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: str = ""
    inputs_sha256: str | None = None
    reference: str = ""
    runtime: str = ""
    generation: dict[str, Any] | None = None
    task_metrics: dict[str, Any] | None = None
    int8: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    not_run: list[NotRun] = field(default_factory=list)
    localization: Localization | None = None

    def cases(self) -> list[Case]:
        """Every check that ran, in order: question 1, the file checks, question 2, greedy generation and the task
        metrics (one case per deciding runtime each). With no question-2 check at all, one failing ``no check ran``
        case."""
        out = []
        for e in self.exact:
            measured = f"method={e.method} error={e.error:.6g} bound={e.bound:g} worst={e.worst}"
            out.append(Case(f"question 1: {e.name}", e.passed, measured, "" if e.passed else e.failure()))
        for i in self.integrity:
            out.append(Case(f"file: {i.name}", i.passed, i.detail, "" if i.passed else i.failure()))
        for c in self.checks:
            top1 = "n/a" if c.top1_agreement is None else f"{c.top1_agreement:.2%}"
            measured = (
                f"e_fused={c.e_fused:.6g} e_orig={c.e_orig if c.e_orig is None else format(c.e_orig, '.6g')} "
                f"e_pair={c.e_pair:.6g} tolerance={c.tolerance:.6g} ({c.tolerance_from}) "
                f"max_abs_err={c.max_abs_err:.6g} top1_decisive={top1} decisive={c.decisive} "
                f"near_ties={c.near_ties} samples={c.samples} worst_sample={c.worst_sample} dtype={c.dtype} "
                f"reference={c.reference}"
            )
            out.append(Case(f"question 2: {c.name}", c.passed, measured, "" if c.passed else c.failure()))
        for skipped in self.not_run:
            name = f"not run: {skipped.file}" + (f" in {skipped.runtime}" if skipped.ran_in else "")
            out.append(Case(name, True, skipped.reason, skipped.line(), skipped=True))
        if not self.checks:
            out.append(Case("no check ran", False, "", "no check ran: no written file was compared"))
        for run in (self.generation or {}).get("runs", []):
            if not run.get("decides", True):
                continue
            measured = (
                f"tokens_compared={run['tokens_compared']} decisive_mismatches={run['decisive_mismatches']} "
                f"near_ties={run['near_ties']} tokens_per_second={run['tokens_per_second']:.6g}"
            )
            ok = bool(run["passed"])
            out.append(Case(f"generation: {run['name']}", ok, measured, "" if ok else generation_failure(run)))
        out += task_metric_cases(self.task_metrics)
        out += int8_cases(self.int8)
        where = self.where()
        for case in out:
            if not case.passed and where:
                case.message += f"; {where}"
        return out

    def question_2_only(self, why: str) -> None:
        """Notes that question 1 (is the fold exact?) was not answered, and why (``sides.why_not_a_fold``)."""
        self.notes.append(f"{QUESTION_1} not answered: {why}; question 2 only")

    def where(self) -> str:
        """The localisation's verdict in words, for failure lines: the first diverging fold, or that none does."""
        if self.localization is None:
            return ""
        return self.localization.detail

    def headline(self) -> str:
        """``PASSED``, ``FAILED``, or ``PASSED for what ran; model.onnx: not run: ...`` (a file no runtime ran
        is named, never covered by the verdict; so is a runtime that could not run a file another ran in its place:
        ``model.onnx: onnxruntime: not run: ...; ran in openvino``)."""
        if not self.passed:
            return "FAILED"
        if not self.not_run:
            return "PASSED"
        return "PASSED for what ran; " + "; ".join(n.line() for n in self.not_run)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases())

    def failures(self) -> list[str]:
        """One line per failed check: question 1 first, then the files, then question 2, then generation (each
        with the first diverging fold, when the localisation ran)."""
        return [c.message for c in self.cases() if not c.passed]

    def failure_line(self) -> str:
        """The first failure, for the one-line error of ``fuse`` / ``verify``."""
        failures = self.failures()
        return failures[0] if failures else "no check ran"

    def to_dict(self) -> dict[str, Any]:
        pair = [c.e_pair for c in self.checks]
        top1 = [c.top1_agreement for c in self.checks if c.top1_agreement is not None]
        return {
            "passed": self.passed,
            "question_1_exact": (all(c.passed for c in self.exact) if self.exact else None),
            "question_2_files": all(c.passed for c in self.checks) and all(i.passed for i in self.integrity),
            "samples": self.checks[0].samples if self.checks else 0,
            "max_abs_err": max((c.max_abs_err for c in self.checks), default=0.0),
            "max_rel_err": max(pair, default=0.0),
            "top1_agreement": min(top1) if top1 else None,
            "tolerance": max((c.tolerance for c in self.checks), default=None),
            "reference": self.reference,
            "runtime": self.runtime,
            "inputs": self.inputs,
            "inputs_sha256": self.inputs_sha256,
            "exact": [asdict(c) for c in self.exact],
            "checks": [asdict(c) for c in self.checks],
            "integrity": [asdict(c) for c in self.integrity],
            "notes": list(self.notes),
            "generation": self.generation,
            "task_metrics": self.task_metrics,
            "int8": list(self.int8),
            "seconds": self.seconds,
            "not_run": [{k: v for k, v in asdict(n).items() if v} for n in self.not_run],
            "localization": self.localization.to_dict() if self.localization is not None else None,
        }
