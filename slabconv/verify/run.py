"""The pieces of a verification run (the run itself is ``slabconv.verify.verifier.verify``), after the policy
of ``slabconv.verify.policy``:

- ``Reference``: the reference's outputs in its own dtype and in float64, on the verification inputs;
- question 1 for graphs (``question_1_graph``: the float64 fold against the float64 original);
- question 2 for one runtime (``question_2``: each output against the float64 reference, bounded by the
  original's own error).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from slabconv.errors import InputError, UsageError
from slabconv.load.model import LoadedModel
from slabconv.util import Progress, no_progress
from slabconv.verify import judge
from slabconv.verify.policy import EXACT_SAMPLES, fused_bound
from slabconv.verify.results import ExactCheck, OutputCheck, g3
from slabconv.verify.runtimes import (
    BATCH,
    Inputs,
    Runtime,
    onnxruntime_version,
    run_batched,
    samples_of,
    take,
    torch_runner,
)


def output_names(count: int, names: Sequence[str] | None = None) -> list[str]:
    """The names used in check names: the ONNX names when known, else ``output`` / ``output.<i>``."""
    if names is not None and len(names) == count:
        return list(names)
    return ["output"] if count == 1 else [f"output.{i}" for i in range(count)]


@dataclass
class Reference:
    """The original model's outputs on the verification inputs: in its own dtype, and in float64.

    Attributes:
        x: the inputs ``(N, ...)`` (float32 or int64 ids); for an ONNX original with several inputs, a dict of
            such arrays by input name (``slabconv.verify.runtimes.Inputs``).
        label, sha256: where they came from (``.npz`` path or ``random(...)``) and the file's digest.
        dtype: the checkpoint's dtype name.
        original: every output of the original model in its dtype (float32 for a float32, float16 or bfloat16
            model: exact, and half the memory of float64; ``judge`` compares in float64).
        exact: every output of the original graph in float64 (None when there is no float64 graph).
        names: the output names.
        notes: what the reference says about the model (an original that overflows its dtype).
        original64: the original graph in float64 (``float64_graph``), when there is a graph: what ``at_length``
            runs again; let go once question 2 no longer needs it.
        model: the reference model in PyTorch (a torch reference; None for an ONNX original): what ``at_length``
            runs, exported to ONNX for a runtime's own bound (``original_by_runtime``).
        original_dtype: the precision ``original`` was computed in, when not ``dtype`` (a candidate stored in a
            narrower dtype: the reference cast to it).
        cast: the original's outputs in each narrower precision a runtime computed in (``original_in``).
        onnx: the path of an ONNX original (no PyTorch model): ``original_in`` runs it in the runtime that computed
            in a narrower precision.
        cast_to: ``(dtype, x) -> (outputs, how)``: the original cast to a narrower ``dtype`` on ``x`` and how, in
            words (the reference adapter's: the PyTorch model cast, ``original_cast``; an ONNX original cast,
            ``onnx_original.cast_reference``), or None where no evaluator here runs it.
        cast_by: for each entry of ``cast``, ``(dtype, backend, how)``: the precision, the backend that computed
            it (empty: PyTorch, the reference cast) and how, in words, for the report's note.
        batch: the batch the original runs in when its batch is fixed (a program or ONNX file recorded with a
            static batch); every candidate is then run in the same batches, since an output may depend on the
            other samples of its batch (``h - h.mean()``).
        in_runtime: the original's outputs computed by a candidate's ONNX runtime, by its label
            (``original_by_runtime``; None where it cannot run them).
        exported: the temporary folder holding the original exported to ONNX (a torch reference), once made; shared
            with ``at_length``'s reference.
        runtime_notes: for the report, each check held to the original's error in the candidate's own runtime,
            and each output whose original moves with the order of its sums (``_order_note``).
        alone: the original's outputs run by PyTorch one sample at a time, once a check failed (``_order_note``).
    """

    x: Any
    label: str
    sha256: str | None
    dtype: str
    original: list[np.ndarray]
    exact: list[np.ndarray] | None
    names: list[str]
    notes: list[str] = field(default_factory=list)
    original64: fx.GraphModule | None = None
    model: LoadedModel | None = None
    original_dtype: str | None = None
    cast: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)
    onnx: Path | None = None
    cast_by: dict[str, tuple[str, str, str]] = field(default_factory=dict, repr=False)
    batch: int | None = None
    in_runtime: dict[str, list[np.ndarray] | None] = field(default_factory=dict, repr=False)
    exported: list[Any] = field(default_factory=list, repr=False)
    runtime_notes: list[str] = field(default_factory=list)
    alone: list[np.ndarray] | None = field(default=None, repr=False)
    cast_to: Callable[[str, Any], tuple[list[np.ndarray], str] | None] | None = field(default=None, repr=False)

    def original_in(self, dtype: str, runtime: Runtime | None = None) -> tuple[list[np.ndarray], str]:
        """The original's outputs in the precision a runtime computed in, and that precision: ``original`` (in
        ``original_dtype``), or, where ``dtype`` keeps fewer mantissa bits (OpenVINO computing a float32 file in
        bfloat16 on CPUs with bfloat16), the reference cast to ``dtype`` on the same inputs (``cast_to``; computed
        once per dtype): the error any model has in that precision, as for a file stored in it
        (docs/verification.md). An ONNX original is run by ``runtime``'s backend first (``original_onnx_in``), where
        it computes the original in that precision too; ``original`` where neither can be had."""
        have = self.original_dtype or self.dtype
        want = getattr(torch, dtype, None)
        if not isinstance(want, torch.dtype) or not want.is_floating_point:
            return self.original, have
        if torch.finfo(want).eps <= torch.finfo(getattr(torch, have)).eps:
            return self.original, have
        found = self.original_onnx_in(dtype, runtime)
        if found is not None:
            return found
        made = self.cast_to(dtype, self.x) if dtype not in self.cast and self.cast_to is not None else None
        if made is not None:
            self.cast[dtype] = made[0]
            self.cast_by[dtype] = (dtype, "", made[1])
        return (self.cast[dtype], dtype) if dtype in self.cast else (self.original, have)

    def original_onnx_in(self, dtype: str, runtime: Runtime | None) -> tuple[list[np.ndarray], str] | None:
        """An ONNX original's outputs computed in ``dtype`` by the backend of ``runtime`` (``runtime.kind``: OpenVINO
        compiles the original as it compiled the candidate, in bfloat16 on CPUs with bfloat16), or None where it
        cannot (no ONNX original, a runtime of no backend, one that cannot run the original or computes it in
        another precision): ``original_by_runtime``, computed once per runtime (its label)."""
        if self.onnx is None or runtime is None or runtime.dtype != dtype:
            return None
        found = self.original_by_runtime(runtime)
        if found is None:
            return None
        how = f"the reference {self.onnx.name} run by the same runtime"
        self.cast_by[f"{dtype} ({runtime.label})"] = (dtype, runtime.kind, how)
        return found, dtype

    def original_by_runtime(self, runtime: Runtime) -> list[np.ndarray] | None:
        """The original's outputs computed by ``runtime`` itself, with its settings (an ONNX runtime: its
        optimisation level, its precision), on the reference's inputs: an ONNX original as it is, a torch reference
        exported to ONNX as it is (``export_original``, once); None where that cannot be had (a PyTorch or int8
        runtime, an export that fails, a runtime that computes the original in another precision than the
        candidate). Computed once per runtime (its label)."""
        if runtime.label not in self.in_runtime:
            found = None
            if _onnx_backend(runtime) is not None:  # (a PyTorch runtime: nothing to export for)
                path = self.onnx or (export_original(self.model, self.exported) if self.model is not None else None)
                found = run_original(path, runtime, self.x) if path is not None else None
            self.in_runtime[runtime.label] = found
        return self.in_runtime[runtime.label]

    def at_length(self, loaded: LoadedModel, length: int) -> Reference:
        """The same reference on the first ``length`` tokens of every input (a language model whose graphs take
        any sequence length): the original in its dtype and the float64 graph run again on ``x[:, :length]``.

        Raises:
            UsageError: there is no float64 graph to run (a reference without one).
        """
        if self.original64 is None:
            raise UsageError("this reference has no float64 graph to run at another length")
        x = self.x[:, :length]
        original, exact = original_runs(loaded, self.original64, x)
        names = [f"{name}, length {length}" for name in self.names]
        return Reference(x, self.label, self.sha256, self.dtype, original, exact, names, original64=self.original64,
                         model=self.model, batch=self.batch, exported=self.exported, cast_to=self.cast_to)  # fmt: skip


def export_original(loaded: LoadedModel, exported: list[Any], required: bool = False) -> Path | None:
    """The original model exported to ONNX as it is (``slabconv.write.onnx.export_onnx``, as ``export --no-fuse``
    writes it) into a temporary folder kept in ``exported`` (removed with it), once, for every check that runs the
    original in an ONNX runtime (a runtime's own bound, the int8 check); None where the exporter cannot export it
    (the first failure is remembered too).

    Raises:
        UnsupportedModelError, UsageError: ``required`` and the exporter cannot export it (its error).
    """
    import tempfile

    from slabconv.errors import UnsupportedModelError
    from slabconv.util import quiet
    from slabconv.write.onnx import export_onnx

    if not exported:
        folder = tempfile.TemporaryDirectory(prefix="slabconv-original-")
        path = Path(folder.name) / "original.onnx"
        try:
            with quiet():
                export_onnx(loaded.model, loaded.trace_example(), path)
        except (UnsupportedModelError, UsageError) as err:
            folder.cleanup()
            exported.append(err)
        else:
            exported.append((folder, path))
    if isinstance(exported[0], Exception) and required:
        raise exported[0]
    return exported[0][1] if isinstance(exported[0], tuple) else None


def _onnx_backend(runtime: Runtime) -> Any:
    """The ``BACKENDS`` entry that ran ``runtime`` when it runs ``.onnx`` files in floating point, else None."""
    from slabconv.verify.backends import BACKENDS

    backend = BACKENDS.get(runtime.kind)
    return backend if backend is not None and backend.takes == "onnx" and not backend.quantized else None


def run_original(path: Path, runtime: Runtime, x: Inputs) -> list[np.ndarray] | None:
    """The ``.onnx`` at ``path`` run on ``x`` by ``runtime``'s backend with ``runtime``'s settings (onnxruntime
    opens one session per optimisation level: the one of the same label), or None where it cannot (a runtime of
    no ONNX backend, an int8 one, one that cannot open the file or computes it in another precision)."""
    from slabconv.verify.runtimes import ORT_LEVELS, RuntimeUnavailable, ort_label

    backend = _onnx_backend(runtime)
    if backend is None:
        return None
    how: dict[str, Any] = {}
    if backend.framework == "onnxruntime":  # the one session of the candidate's level; several inputs by name
        how = {"levels": tuple(level for level in ORT_LEVELS if ort_label(level) == runtime.label) or ORT_LEVELS}
        how["several"] = isinstance(x, dict)
    try:
        opened = backend.open(path, **how)
    except (RuntimeUnavailable, InputError):
        return None
    try:
        original = next((r for r in opened if r.label == runtime.label), opened[0])
        if original.dtype != runtime.dtype:
            return None
        return run_batched(original.run, x, fixed_batch=original.fixed_batch)
    finally:
        for r in opened:
            r.close()


def original_runs(
    loaded: LoadedModel, original64: fx.GraphModule, x: Any, original: list[np.ndarray] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(original, exact)`` on ``x`` (``(N, ...)``, in ``loaded``'s fixed batch): every output of ``loaded``'s
    model in its dtype (as float32, ``torch_runner``'s ``narrow``; ``original`` where given, computed already: the
    reference cast to a narrower dtype) and of its float64 graph ``original64`` (``float64_graph``) on ``x``
    rounded to the model's dtype (float64): ``Reference.original`` and ``Reference.exact``."""
    if original is None:
        original = run_batched(torch_runner(loaded.model, loaded.dtype, narrow=True), x, fixed_batch=loaded.batch)
    exact = run_batched(torch_runner(original64, torch.float64, round_to=loaded.dtype), x, fixed_batch=loaded.batch)
    return original, exact


def original_cast(loaded: LoadedModel, dtype: torch.dtype, x: Any) -> list[np.ndarray]:
    """The outputs of ``loaded``'s model cast to ``dtype`` (a copy; the model is left as it is) on ``x`` rounded
    to the model's own dtype first (the inputs every side sees), each ``(N, ...)`` as float32 (which holds a
    float32, float16 or bfloat16 output exactly; ``torch_runner``'s ``narrow``)."""
    from slabconv.verify.reference import cast_from

    model = loaded.model
    if isinstance(model, fx.GraphModule) and loaded.dtype.is_floating_point:
        cast: nn.Module = cast_from(model, loaded.dtype, dtype)
    else:
        cast = copy.deepcopy(model).to(dtype)
    try:
        return run_batched(torch_runner(cast, dtype, round_to=loaded.dtype, narrow=True), x, fixed_batch=loaded.batch)
    finally:
        del cast


def check_reference(reference: Reference) -> None:
    """Non-finite float64 output: the inputs are unusable (exit 2); a non-finite original with a finite float64
    output: the original overflows its dtype (a note; the fused model is still judged against float64)."""
    if reference.exact is None:
        return
    for name, exact, orig in zip(reference.names, reference.exact, reference.original, strict=True):
        if not np.isfinite(exact).all():
            raise InputError(
                f"the model's own output {name!r} is not finite even in float64 on {reference.label}: these inputs "
                "are unusable; pass inputs the model was made for with --inputs NPZ"
            )
        if not np.isfinite(orig).all():
            reference.notes.append(
                f"the original model overflows {reference.dtype} on these inputs (output {name!r} is not finite, its "
                "float64 evaluation is): the fused model is judged against float64 at the dtype's tolerance"
            )


def question_2(
    reference: Reference,
    runtime: Runtime,
    *,
    rtol: float | None,
    atol: float,
    strict: bool,
    token_logits: bool,
    names: Sequence[str] | None = None,
    progress: Progress = no_progress,
) -> list[OutputCheck]:
    """Run ``runtime`` on the reference's inputs and judge each output (``progress``: a line before the original
    is exported to ONNX for the runtime's own bound, ``_by_runtime``).

    Raises:
        InputError: the runtime gives another number of outputs or other shapes (not the same model).
    """
    outputs = run_batched(runtime.run, reference.x, fixed_batch=runtime.fixed_batch or reference.batch)
    if len(outputs) != len(reference.original):
        raise InputError(
            f"the reference has {len(reference.original)} outputs but {runtime.label} gives {len(outputs)}; "
            "compare two versions of the same model"
        )
    labels = output_names(len(outputs), names or runtime.output_names)
    baseline, _ = reference.original_in(runtime.dtype, runtime)
    checks = []
    for i, (label, cand) in enumerate(zip(labels, outputs, strict=True)):
        ref = baseline[i]
        if cand.shape != ref.shape:
            raise InputError(
                f"output {label!r}: the reference gives shape {ref.shape} but {runtime.label} gives {cand.shape}; "
                "the two are not the same model (a different architecture or class count?)"
            )
        checks.append(
            judge.judge_output(
                f"{label} @ {runtime.label}",
                cand,
                dtype=runtime.dtype,
                original=ref,
                reference64=reference.exact[i] if reference.exact is not None else None,
                rtol=rtol,
                atol=atol,
                strict=strict,
                token_logits=token_logits,
            )
        )
    if rtol is None and not strict and reference.exact is not None and not all(c.passed for c in checks):
        exports = reference.onnx is None and not reference.exported and reference.model is not None
        if exports and _onnx_backend(runtime) is not None:
            progress(f"verifying: question 2, {runtime.label}: the original exported to ONNX and run by it")
        checks = _by_runtime(reference, runtime, outputs, checks, atol=atol, token_logits=token_logits)
        if not token_logits and not all(c.passed for c in checks):
            _order_note(reference)
    return checks


def _order_note(reference: Reference) -> None:
    """Once a check has failed, whether the order of the original's own float32 sums moves its error past the
    bound: the original run by PyTorch one sample at a time (other kernels, so other summation orders, than in
    batches of ``BATCH``), once per reference, not for an original recorded with a static batch. Where either run is
    further from the float64 output than the bound the other's error sets (``fused_bound``), the original fails
    question 2 against itself, and a note says so for that output (``Reference.runtime_notes``): at that level the
    check cannot tell a file from another order of the same sums (an ill-conditioned model: random weights whose
    squeeze-excitation gates amplify rounding a hundredfold). The verdict stands."""
    loaded, exact = reference.model, reference.exact
    if loaded is None or exact is None or reference.batch is not None or reference.original_dtype is not None:
        return  # no PyTorch original, a static batch, or an original computed cast to another dtype
    if reference.alone is not None or samples_of(reference.x) < 2:
        return
    reference.alone = run_batched(torch_runner(loaded.model, loaded.dtype, narrow=True), reference.x, batch=1)
    for name, batched, alone, exact64 in zip(reference.names, reference.original, reference.alone, exact, strict=True):
        e_batched, e_alone = judge.rel_err(batched, exact64)[0], judge.rel_err(alone, exact64)[0]
        if e_alone > fused_bound(reference.dtype, e_batched)[0] or e_batched > fused_bound(reference.dtype, e_alone)[0]:
            reference.runtime_notes.append(
                f"{name}: the original itself, run by PyTorch one sample at a time, is {g3(e_alone)} from its "
                f"float64 output, and {g3(e_batched)} in batches of {BATCH}: held to either run's error, the other "
                "would fail question 2, so the order of this model's float32 sums alone moves it past the bound, and "
                "a failed check of this output cannot tell a file from another order of the same sums (question 1 "
                "says whether the fold is exact); judge the file on more samples (--samples) or on inputs the model "
                "was made for (--inputs NPZ)"
            )


def _by_runtime(
    reference: Reference,
    runtime: Runtime,
    outputs: Sequence[np.ndarray],
    checks: list[OutputCheck],
    *,
    atol: float,
    token_logits: bool,
) -> list[OutputCheck]:
    """The failed ``checks`` of ``runtime`` judged again with the original's own error taken in that runtime
    (``Reference.original_by_runtime``: the original run by the same runtime with the same settings), kept where
    that bound is the larger: a file is as good as the original when it is within twice the original's own error
    in the runtime it is deployed in. A runtime may compute a model further from float64 than the reference's
    PyTorch run does (onnxruntime's convolutions sum in another order than PyTorch's, its Tanh is several units in
    the last place off): on an ill-conditioned model the original itself then fails the first bound, there, as
    much as a correct fold. Each check so judged adds a note (``Reference.runtime_notes``)."""
    by_runtime = reference.original_by_runtime(runtime)
    if by_runtime is None or len(by_runtime) != len(checks):
        return checks
    assert reference.exact is not None
    judged = []
    for i, check in enumerate(checks):
        if check.passed or by_runtime[i].shape != outputs[i].shape:
            judged.append(check)
            continue
        again = judge.judge_output(check.name, outputs[i], dtype=runtime.dtype, original=by_runtime[i],
                                   reference64=reference.exact[i], atol=atol, token_logits=token_logits)  # fmt: skip
        if again.tolerance <= check.tolerance or again.e_orig is None or check.e_orig is None:
            judged.append(check)
            continue
        judged.append(again)
        how = f"{reference.onnx.name} run by it" if reference.onnx is not None else "exported to ONNX, run by it"
        reference.runtime_notes.append(
            f"{check.name}: held to the original's own error in that runtime ({how}), {g3(again.e_orig)}, where the "
            f"reference computes the original {g3(check.e_orig)} from its float64 output: the runtime itself computes "
            "the original that far from it"
        )
    return judged


def exact_samples(x: Inputs, exact: Sequence[np.ndarray]) -> tuple[Inputs, list[np.ndarray], int]:
    """The inputs question 1's graph check runs on, the float64 reference outputs for them, and how many samples
    there were: the first ``policy.EXACT_SAMPLES`` (a fold is exact on every input or wrong on almost every one;
    question 2 needs every sample, question 1 does not)."""
    total = samples_of(x)
    n = min(EXACT_SAMPLES, total)
    return take(x, 0, n), [e[:n] for e in exact], total


def question_1_graph(reference: Reference, fused64: nn.Module) -> ExactCheck:
    """The fused float64 graph against the original float64 outputs of ``reference`` (on ``exact_samples``), in
    the reference's batches."""
    assert reference.exact is not None
    dtype = getattr(torch, reference.dtype)
    x, exact, total = exact_samples(reference.x, reference.exact)
    outputs = run_batched(torch_runner(fused64, torch.float64, round_to=dtype), x, fixed_batch=reference.batch)
    return judge.exact_graphs(reference.names, outputs, exact, of=total)


def decisions_note(decisions: Sequence[Any], decisions64: Sequence[Any]) -> list[str]:
    """A note when the float64 fold decided differently from the model's (a fold that overflows only the model's
    dtype): question 1 then checks the float64 decision for those norms."""
    differ = [d.norm for d, e in zip(decisions, decisions64, strict=False) if d.action != e.action]
    if not differ and len(decisions) == len(decisions64):
        return []
    return [
        f"the float64 fold decided differently for {', '.join(differ[:3]) or 'some norms'} (a fold that overflows "
        "only the model's dtype): question 1 checked the float64 decision there"
    ]


def runtime_summary(runtimes: Sequence[Runtime]) -> str:
    """The report's ``runtime``: ``onnxruntime 1.x``, ``pytorch 2.x`` and/or ``openvino 2025.x CPU (inference
    precision bfloat16)``."""
    kinds = []
    if any(rt.label.startswith("onnxruntime") for rt in runtimes):
        kinds.append(onnxruntime_version())
    if any(rt.label.startswith("pytorch") for rt in runtimes):
        kinds.append(f"pytorch {torch.__version__}")
    kinds += sorted({rt.label for rt in runtimes if rt.label.startswith("openvino")})
    return ", ".join(kinds)
