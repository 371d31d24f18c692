"""Verification runs: after a fold (``verify_fold``) and between any two sides (``verify_pair``).

Both follow the policy of ``slabconv.verify.policy``:

1. The float64 reference: the original model's graph with everything in float64 (``reference.float64_fold``),
   run on the inputs rounded to the checkpoint's dtype.
2. Question 1: the fold of that float64 graph against the graph itself (``judge.exact_graphs``), and every
   written tensor against the float64 fold (``judge.exact_tensors``).
3. Question 2: each artifact in its own dtype and runtime against the reference, bounded by the original's own
   error (``judge.judge_output``); a runtime that cannot run an artifact is named in a note and another runs it.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from slabconv import engine
from slabconv.errors import InputError, UsageError
from slabconv.load.model import LoadedModel
from slabconv.options import DEFAULT_SAMPLES, VerifyOptions
from slabconv.util import Progress, no_progress, release_memory, stage_memory
from slabconv.verify import judge
from slabconv.verify.inputs import choose_inputs
from slabconv.verify.integrity import check_onnx_file, check_safetensors_reload
from slabconv.verify.policy import EXACT_SAMPLES, dtype_name
from slabconv.verify.reference import float64_graph, fold64
from slabconv.verify.results import ExactCheck, IntegrityCheck, OutputCheck, Verification
from slabconv.verify.runtimes import (
    ORT_LEVELS,
    Inputs,
    Runtime,
    RuntimeUnavailable,
    onnx_runtimes,
    onnxruntime_version,
    ort_label,
    run_batched,
    samples_of,
    take,
    torch_label,
    torch_runner,
    torch_runtime,
)

FLOAT64_BATCH = 4
"""Samples per call of a float64 graph (the reference, question 1): its activations take twice float32's, and at
16 samples a call they set verification's peak memory (a DeiT-Tiny at 224x224: about 10 MiB a sample). Batches
of 4 took no more CPU time (``docs/performance.md``)."""


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
        original: every output of the original model in its dtype.
        exact: every output of the original graph in float64 (None when there is no float64 graph).
        names: the output names.
        notes: what the reference says about the model (an original that overflows its dtype).
        fused64: the float64 fold of the original graph (for question 1), when there is a graph.
    """

    x: Any
    label: str
    sha256: str | None
    dtype: str
    original: list[np.ndarray]
    exact: list[np.ndarray] | None
    names: list[str]
    notes: list[str] = field(default_factory=list)
    fused64: fx.GraphModule | None = None
    original64: fx.GraphModule | None = None

    def at_length(self, loaded: LoadedModel, length: int) -> Reference:
        """The same reference on the first ``length`` tokens of every input (a language model whose graphs take
        any sequence length): the original in its dtype and the float64 graph run again on ``x[:, :length]``.

        Raises:
            UsageError: there is no float64 graph to run (a reference without one).
        """
        if self.original64 is None:
            raise UsageError("this reference has no float64 graph to run at another length")
        x = self.x[:, :length]
        original = run_batched(torch_runner(loaded.model, loaded.dtype), x, fixed_batch=loaded.batch)
        runner = torch_runner(self.original64, torch.float64, round_to=loaded.dtype)
        exact = run_batched(runner, x, batch=FLOAT64_BATCH, fixed_batch=loaded.batch)
        names = [f"{name}, length {length}" for name in self.names]
        return Reference(x, self.label, self.sha256, self.dtype, original, exact, names, original64=self.original64)


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


def make_reference(
    loaded: LoadedModel,
    original_graph: fx.GraphModule,
    example: torch.Tensor,
    inputs: Path | None,
    samples: int,
    seed: int,
    written: torch.dtype | None = None,
    limit: int | None = None,
    norm_affine: bool = False,
) -> tuple[Reference, fx.GraphModule, list[Any]]:
    """The reference of ``loaded`` on the verification inputs, and its float64 fold (for question 1; with
    ``norm_affine``, of the affine of every LayerNorm / RMSNorm / GroupNorm too, as the fold being checked).

    ``written``: the dtype the files were written in when it is not the checkpoint's (``fuse --dtype``). The
    original's own error (``e_orig`` of question 2) is then that of the original model cast to ``written``: the
    error any model in that dtype has, which the fused files are held to, as for a checkpoint saved in it.

    Returns:
        ``(reference, fused64, decisions64)``; ``reference.exact`` holds the float64 outputs.

    Raises:
        InputError, UsageError: as ``choose_inputs``; inputs on which even float64 output is not finite.
    """
    x, label, digest = choose_inputs(loaded, inputs, samples, seed, limit=limit)
    dtype = loaded.dtype
    if written is not None and written != dtype:
        cast = copy.deepcopy(loaded.model).to(written)
        original = run_batched(torch_runner(cast, written, round_to=dtype), x, fixed_batch=loaded.batch)
    else:
        original = run_batched(torch_runner(loaded.model, dtype), x, fixed_batch=loaded.batch)
    original64 = float64_graph(original_graph, example)
    runner = torch_runner(original64, torch.float64, round_to=dtype)
    exact = run_batched(runner, x, batch=FLOAT64_BATCH, fixed_batch=loaded.batch)
    release_memory(collect=False)  # the float64 activations, before the float64 fold is made
    fused64, decisions64 = fold64(original64, norm_affine)
    name = dtype_name(dtype)
    reference = Reference(x, label, digest, name, original, exact, output_names(len(original)), original64=original64)
    check_reference(reference)
    return reference, fused64, decisions64


def question_2(
    reference: Reference,
    runtime: Runtime,
    *,
    rtol: float | None,
    atol: float,
    strict: bool,
    token_logits: bool,
    names: Sequence[str] | None = None,
) -> list[OutputCheck]:
    """Run ``runtime`` on the reference's inputs and judge each output.

    Raises:
        InputError: the runtime gives another number of outputs or other shapes (not the same model).
    """
    outputs = run_batched(runtime.run, reference.x, fixed_batch=runtime.fixed_batch)
    if len(outputs) != len(reference.original):
        raise InputError(
            f"the reference has {len(reference.original)} outputs but {runtime.label} gives {len(outputs)}; "
            "compare two versions of the same model"
        )
    labels = output_names(len(outputs), names or runtime.output_names)
    checks = []
    for i, (label, cand) in enumerate(zip(labels, outputs, strict=True)):
        ref = reference.original[i]
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
    return checks


def exact_samples(x: Inputs, exact: Sequence[np.ndarray]) -> tuple[Inputs, list[np.ndarray], int]:
    """The inputs question 1's graph check runs on, the float64 reference outputs for them, and how many samples
    there were: the first ``policy.EXACT_SAMPLES`` (a fold is exact on every input or wrong on almost every one;
    question 2 needs every sample, question 1 does not)."""
    total = samples_of(x)
    n = min(EXACT_SAMPLES, total)
    return take(x, 0, n), [e[:n] for e in exact], total


def question_1_graph(reference: Reference, fused64: nn.Module, batch: int | None = None) -> ExactCheck:
    """The fused float64 graph against the original float64 outputs of ``reference`` (on ``exact_samples``)."""
    assert reference.exact is not None
    dtype = getattr(torch, reference.dtype)
    x, exact, total = exact_samples(reference.x, reference.exact)
    outputs = run_batched(
        torch_runner(fused64, torch.float64, round_to=dtype), x, batch=FLOAT64_BATCH, fixed_batch=batch
    )
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


@dataclass
class Artifacts:
    """What ``fuse`` wrote into its (staging) folder, for ``verify_fold``.

    Attributes:
        folder: the folder.
        safetensors: the fused weights file, and the tensors and metadata written into it.
        onnx: ``model.onnx`` or None.
        pt2: ``model.pt2`` or None.
        fused_graph: the in-memory fused graph (run in PyTorch when neither ONNX nor ``.pt2`` was written).
        dynamic_sequence: the written programs take any sequence length (a language model): question 2 then also
            runs them on a shorter length.
        dtype: the dtype the files were written in (``fuse --dtype``), None for the checkpoint's.
        sha256: files hashed by their writer as it wrote them (name -> hex digest; the streamed shards).
    """

    folder: Path
    safetensors: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    onnx: Path | None = None
    pt2: Path | None = None
    fused_graph: nn.Module | None = None
    dynamic_sequence: bool = False
    dtype: torch.dtype | None = None
    sha256: dict[str, str] = field(default_factory=dict)


Opener = Callable[[], Runtime]
"""Opens one runtime of question 2 (an onnxruntime session, the ``.pt2`` loaded back) when its turn comes."""


@dataclass(frozen=True)
class Pending:
    """A runtime of question 2 not opened yet: the artifact it runs, the label it will have, and its opener."""

    artifact: str
    label: str
    open: Opener


def artifact_runtimes(
    artifacts: Artifacts, dtype: torch.dtype, batch: int | None
) -> tuple[list[Pending], Pending | None]:
    """The runtimes question 2 runs, in order: onnxruntime on ``model.onnx`` with graph optimisations off, then on
    (``ORT_LEVELS``), PyTorch on ``model.pt2`` loaded back from the file; and the fallback, the fused graph in
    PyTorch (run when none of them could). Each runs in the files' dtype (``dtype`` for files in the checkpoint's
    dtype).

    Nothing is opened here: ``question_2_each`` opens each runtime only after the one before it is closed, so two
    sessions (or a session and the loaded program) never hold their weights and arenas at once."""
    dtype = artifacts.dtype or dtype
    name = dtype_name(dtype)
    pending: list[Pending] = []
    if (onnx := artifacts.onnx) is not None:
        pending += [
            Pending(onnx.name, ort_label(level), functools.partial(_ort_level, onnx, level)) for level in ORT_LEVELS
        ]
    if (pt2 := artifacts.pt2) is not None:
        pending.append(
            Pending(pt2.name, torch_label(name, pt2.name), functools.partial(_pt2_runtime, pt2, dtype, batch))
        )
    fallback = None
    if (graph := artifacts.fused_graph) is not None:
        what = "fused graph"
        fallback = Pending(what, torch_label(name, what), functools.partial(torch_runtime, graph, dtype, what, batch))
    return pending, fallback


def _ort_level(path: Path, level: str) -> Runtime:
    return onnx_runtimes(path, levels=(level,))[0]


def _pt2_runtime(path: Path, dtype: torch.dtype, batch: int | None) -> Runtime:
    from slabconv.load.checkpoint import load_checkpoint

    return torch_runtime(load_checkpoint(path).module, dtype, path.name, fixed_batch=batch)


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


def question_2_each(
    reference: Reference,
    shorter: Reference | None,
    pending: Sequence[Pending],
    *,
    rtol: float | None,
    atol: float,
    strict: bool,
    token_logits: bool,
    fallback: Pending | None = None,
    progress: Progress = no_progress,
) -> tuple[list[OutputCheck], list[Runtime], list[str]]:
    """Question 2 for each runtime of ``pending`` (``artifact_runtimes``) on ``reference`` and, when given, on
    ``shorter`` (the same inputs at a shorter length): the checks of every runtime on ``reference``, then those on
    ``shorter``.

    One runtime at a time: each is opened when its turn comes and closed (``Runtime.close``: its onnxruntime
    session and memory arena freed) once both its runs are done, so the runtimes never hold their memory at once.
    A runtime that cannot run its artifact (``RuntimeUnavailable``: onnxruntime's CPU provider has no bfloat16
    kernels) is named in a note and the artifact's other runtimes are skipped; when none ran, ``fallback`` (the
    fused graph in PyTorch) does.

    Returns:
        ``(checks, the runtimes that ran, notes)``.
    """
    checks: list[OutputCheck] = []
    at_length: list[OutputCheck] = []
    ran: list[Runtime] = []
    notes: list[str] = []
    unavailable: set[str] = set()
    for one in [*pending, fallback]:
        if one is None or (one is fallback and ran) or one.artifact in unavailable:
            continue
        progress(f"verifying: question 2, {one.label}")
        try:
            runtime = one.open()
        except RuntimeUnavailable as err:
            unavailable.add(one.artifact)
            notes.append(
                f"{err}; {one.artifact} got onnx.checker's full check, and question 2 ran the PyTorch program instead"
            )
            continue
        ran.append(runtime)
        checks += question_2(reference, runtime, rtol=rtol, atol=atol, strict=strict, token_logits=token_logits)
        if shorter is not None:
            progress(f"verifying: question 2, {runtime.label}, length {shorter.x.shape[1]}")
            at_length += question_2(
                shorter, runtime, rtol=rtol, atol=atol, strict=strict, token_logits=True, names=shorter.names
            )
        runtime.close()
        del runtime
        release_memory(collect=False)
    return checks + at_length, ran, notes


def verify_fold(
    loaded: LoadedModel,
    original_graph: fx.GraphModule,
    decisions: Sequence[Any],
    example: torch.Tensor,
    artifacts: Artifacts,
    *,
    inputs: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    strict: bool = False,
    limit: int | None = None,
    progress: Progress = no_progress,
) -> Verification:
    """Both questions for what ``fuse`` wrote (``limit``: an explicit ``--samples``, see ``choose_inputs``).

    Question 1: the float64 fold against the float64 original, and every tensor of ``model.safetensors`` against
    the float64 fold rounded to its dtype. Question 2: ``model.onnx`` (onnxruntime, optimisations off and on) and
    ``model.pt2`` (PyTorch), each in the checkpoint's dtype, against the float64 reference. Integrity: the
    safetensors file reads back bit-equal with its metadata; ``onnx.checker`` passes.

    Raises:
        InputError, UsageError: unusable inputs (as ``make_reference``).
    """
    progress("verifying: the original model in its dtype and in float64")
    release_memory()  # what writing the files left: the exports' traces and translations (cheap in stage_memory)
    reference, fused64, decisions64 = make_reference(
        loaded, original_graph, example, inputs, samples, seed, written=artifacts.dtype, limit=limit,
        norm_affine=engine.folds_norm_affine(decisions),
    )  # fmt: skip
    length = reference.x.shape[1] // 2 if reference.x.ndim == 2 else 0
    shorter = None
    if artifacts.dynamic_sequence and loaded.token_input and length >= 1:
        # The programs take any length up to max_position_embeddings: check a second one, so a program that only
        # runs (or only computes right) at the verification inputs' length cannot pass.
        shorter = reference.at_length(loaded, length)
        shorter.original64 = None
    reference.original64 = None  # every float64 output of the original is computed: its graph is not needed
    release_memory()
    verification = Verification(
        inputs=reference.label,
        inputs_sha256=reference.sha256,
        reference="the original model in float64 (pytorch)",
        notes=list(reference.notes) + decisions_note(decisions, decisions64),
    )
    progress("verifying: question 1, is the fold exact?")
    verification.exact.append(question_1_graph(reference, fused64, loaded.batch))
    fold64 = engine.fused_state_dict(fused64)
    del fused64  # its tensors are in fold64; the graph itself is not needed any more
    verification.exact.append(
        judge.exact_tensors(f"{artifacts.safetensors.name} vs the float64 fold", artifacts.tensors, fold64)
    )
    del fold64
    release_memory()
    verification.integrity.append(
        check_safetensors_reload(artifacts.safetensors, artifacts.tensors, artifacts.metadata)
    )
    if artifacts.onnx is not None:
        passed, detail = check_onnx_file(artifacts.onnx)
        verification.integrity.append(IntegrityCheck(f"onnx.checker[full_check] {artifacts.onnx.name}", passed, detail))
    if artifacts.dtype is not None and artifacts.dtype != loaded.dtype:
        written = dtype_name(artifacts.dtype)
        verification.notes.append(
            f"the files are written in {written} (--dtype): folded in float64 and cast once; question 2 judges them "
            f"at {written}'s tolerance against the float64 reference, the original's own error being that of the "
            f"original model cast to {written}",
        )
    pending, fallback = artifact_runtimes(artifacts, loaded.dtype, loaded.batch)
    checks, ran, notes = question_2_each(
        reference, shorter, pending, rtol=rtol, atol=atol, strict=strict, token_logits=loaded.token_input,
        fallback=fallback, progress=progress,
    )  # fmt: skip
    verification.checks += checks
    verification.notes += notes
    verification.runtime = runtime_summary(ran)
    return verification


def verify_written(
    loaded: LoadedModel,
    original_graph: fx.GraphModule,
    decisions: Sequence[Any],
    example: torch.Tensor,
    artifacts: Artifacts,
    opts: VerifyOptions,
    *,
    hf_folder: bool,
    onnx: bool,
    progress: Progress = no_progress,
) -> Verification:
    """Everything ``fuse`` checks before it publishes a fold: both questions (``verify_fold`` with ``opts``) and,
    for a language model written as a Hugging Face folder (``hf_folder``), greedy generation of the original
    against the folder in transformers and, with ``onnx``, its ``decoder.onnx`` (``opts.generate`` steps; 0 skips
    the check with a note saying so).

    Raises:
        InputError, UsageError: unusable inputs (as ``make_reference``).
    """
    started = time.monotonic()
    with stage_memory():  # one full collection, then each stage's release_memory walks only what it made
        verification = verify_fold(
            loaded, original_graph, decisions, example, artifacts,
            inputs=opts.inputs, samples=opts.sample_count(), seed=opts.seed, rtol=opts.rtol, atol=opts.atol,
            strict=opts.strict, limit=opts.samples, progress=progress,
        )  # fmt: skip
    if hf_folder and opts.generate == 0:
        verification.notes.append("greedy generation not checked (--generate 0)")
    elif hf_folder:
        from slabconv.verify.generate import check_fused_folder

        progress("verifying: greedy generation, original vs fused folder")
        x = choose_inputs(loaded, opts.inputs, opts.sample_count(), opts.seed)[0]
        verification.generation = check_fused_folder(loaded.model, artifacts.folder, x, opts.fuse_steps(), onnx=onnx)
        if onnx and loaded.dtype == torch.bfloat16:
            verification.notes.append(
                "onnxruntime's CPU provider has no bfloat16 kernels: greedy generation ran in transformers only, "
                "decoder.onnx got onnx.checker's full check"
            )
    verification.seconds = time.monotonic() - started
    return verification
