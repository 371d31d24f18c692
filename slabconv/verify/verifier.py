"""The one verifier: both questions for a reference side and a candidate side (``slabconv.verify.sides``).

``fuse`` calls it on the original and the folder it has just written, exactly as ``slabconv verify ORIGINAL
FOLDER`` does in CI; ``verify`` calls it on any two sides. The steps, whatever the sides are:

1. the relation (``sides.fold_relation``): question 1 applies when the candidate is a fold of the reference;
   swapped arguments are refused;
2. the candidate's runtimes, chosen before any work (``--runtime``): ``model.onnx`` / an ``.onnx`` in onnxruntime
   (optimisations off and on) and any opt-in runtime named, ``model.pt2`` / a model in PyTorch;
3. the inputs and the reference: the reference model in its dtype and in float64 (a traced graph promoted to
   float64, or an ONNX graph cast to float64);
4. question 1: the float64 fold of the reference against the reference in float64, and every written tensor
   against that fold rounded to its dtype;
5. file checks: ``onnx.checker``'s full check, judged against the reference's own result for an ONNX original;
6. question 2: each runtime in the dtype its file declares; a file no runtime here can run is named
   (``NotRun``), never covered by the verdict;
7. greedy generation and the task metrics for a fused language-model folder; the int8 check of both sides when a
   quantizing runtime is named (``--runtime onnxruntime-int8``: ``slabconv.verify.int8``);
8. on a failure (or ``localize``), the localisation pass (``slabconv.verify.localize``).

Two decoder folders compared one layer at a time (``streamed`` sides) take the same steps through
``slabconv.verify.layerwise`` in bounded memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from slabconv import engine
from slabconv.errors import InputError, UsageError, first_line
from slabconv.options import LoadOptions, VerifyOptions
from slabconv.util import Progress, no_progress, release_memory, stage_memory
from slabconv.verify import judge, sides
from slabconv.verify.backends import BACKENDS
from slabconv.verify.inputs import choose_inputs
from slabconv.verify.integrity import check_onnx_file
from slabconv.verify.policy import dtype_name
from slabconv.verify.reference import Float64Fold, float64_fold, float64_graph, fold64
from slabconv.verify.results import IntegrityCheck, Localization, NotRun, OutputCheck, Verification, g3
from slabconv.verify.run import (
    Reference,
    check_reference,
    decisions_note,
    exact_samples,
    original_cast,
    original_runs,
    output_names,
    question_1_graph,
    question_2,
    runtime_summary,
)
from slabconv.verify.runtimes import (
    ORT_LEVELS,
    Inputs,
    Runtime,
    RuntimeUnavailable,
    onnx_runtimes,
    ort_label,
    run_batched,
    samples_of,
    torch_label,
    torch_runtime,
)
from slabconv.verify.sides import Side

Opener = Callable[[], Runtime]
"""Opens one runtime of question 2 (an onnxruntime session, the ``.pt2`` loaded back) when its turn comes."""


@dataclass(frozen=True)
class Pending:
    """A runtime of question 2 not opened yet.

    Attributes:
        artifact: the file it runs (``model.onnx``); ``label``: the label it will have; ``open``: its opener.
        backend: the ``BACKENDS`` name (what ``--runtime`` calls it).
        rescue: it runs ``artifact`` only when every other runtime of it could not (OpenVINO, installed, for an
            ``.onnx`` onnxruntime's CPU provider has no kernels for).
    """

    artifact: str
    label: str
    open: Opener
    backend: str
    rescue: bool = False


def candidate_runs(
    candidate: Side, names: tuple[str, ...] | None, load: LoadOptions | None = None
) -> tuple[list[Pending], Pending | None]:
    """The runtimes question 2 runs the candidate in, in order, and the fallback (the candidate in PyTorch, run
    only when nothing else ran): every one that can run it, or those ``names`` asks for (``--runtime``). Nothing
    is opened here.

    Raises:
        UsageError: a runtime of ``names`` that cannot run the candidate (checked before any work).
    """
    dtype = getattr(torch, candidate.dtype)
    names = question_2_names(names)
    pending: list[Pending] = []
    if candidate.onnx is not None:
        path = candidate.onnx.path
        ort = BACKENDS["onnxruntime"]
        pending += [
            Pending(path.name, ort_label(level), functools.partial(_first, ort, path, several=True, levels=(level,)),
                    "onnxruntime")
            for level in ORT_LEVELS
        ]  # fmt: skip
        for backend in _opt_in():
            asked = names is not None and backend.name in names
            if asked or (names is None and backend.unavailable() is None):
                pending.append(Pending(path.name, backend.name, functools.partial(_first, backend, path),
                                       backend.name, rescue=not asked))  # fmt: skip
    if candidate.pt2 is not None:
        pt2, batch = candidate.pt2, candidate.source.batch
        opener = functools.partial(_pt2_runtime, pt2, dtype, batch)
        pending.append(Pending(pt2.name, torch_label(candidate.dtype, pt2.name), opener, "pytorch"))
    fallback = None
    if candidate.kind == "model":
        loaded = candidate.loaded
        what = "fused output" if candidate.source.format == "slabconv-output" else loaded.checkpoint.format
        opener = functools.partial(torch_runtime, loaded.model, loaded.dtype, what, loaded.batch)
        pending.append(Pending(candidate.path.name, torch_label(candidate.dtype, what), opener, "pytorch"))
    elif candidate.kind == "folder" and (candidate.module is not None or candidate.weights is not None):
        what = "fused graph" if candidate.module is not None else "fused output"
        opener = functools.partial(_folder_module, candidate, dtype, what, load)
        fallback = Pending(what, torch_label(candidate.dtype, what), opener, "pytorch")
    if names is not None:
        # the opt-in runtimes installed here run an .onnx too, though only when named (OpenVINO)
        opt_in = [b.name for b in _opt_in() if candidate.onnx is not None and b.unavailable() is None]
        for name in dict.fromkeys(names):
            if not any(p.backend == name for p in pending) and not (fallback and fallback.backend == name):
                can = [*(p.backend for p in pending), *opt_in, *([fallback.backend] if fallback else [])]
                have = ", ".join(dict.fromkeys(can)) or "none"
                raise UsageError(
                    f"--runtime {name} cannot run {candidate.path} (runtimes that can: {have}); choose one of those"
                )
        pending = [p for p in pending if p.backend in names]
        fallback = fallback if fallback is not None and fallback.backend in names else None
    return pending, fallback


def _opt_in() -> list[Any]:
    """The runtimes of question 2 that run an ``.onnx`` besides onnxruntime (OpenVINO): opt-in ``BACKENDS`` of
    ``verify`` that do not quantize."""
    return [b for b in BACKENDS.values() if b.opt_in and "verify" in b.commands and not b.quantized]


def question_2_names(names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The ``--runtime`` names that run question 2: all but the quantizing ones (``Backend.quantized``, which
    answer the int8 check instead); None (every runtime that can) when only quantizing ones were named."""
    if names is None:
        return None
    return tuple(n for n in names if not (n in BACKENDS and BACKENDS[n].quantized)) or None


def int8_backends(opts: VerifyOptions) -> list[Any]:
    """The quantizing runtimes ``--runtime`` names (``onnxruntime-int8``): each runs the int8 check."""
    return [BACKENDS[n] for n in dict.fromkeys(opts.runtimes or ()) if n in BACKENDS and BACKENDS[n].quantized]


def _first(backend: Any, path: Path, **how: Any) -> Runtime:
    """The first runtime ``backend.open(path, **how)`` opens."""
    opened: list[Runtime] = backend.open(path, **how)
    return opened[0]


def _pt2_runtime(path: Path, dtype: torch.dtype, batch: int | None) -> Runtime:
    """A written ``model.pt2`` in PyTorch, at the batch its program was recorded with when that is fixed."""
    from slabconv.load.model import load_model

    loaded = load_model(path)
    return torch_runtime(loaded.model, dtype, path.name, fixed_batch=batch or loaded.batch)


def _folder_module(side: Side, dtype: torch.dtype, what: str, load: LoadOptions | None) -> Runtime:
    """The fused model of a folder in PyTorch: the graph ``fuse`` holds, else the model built from the folder."""
    if side.module is not None:
        return torch_runtime(side.module, dtype, what, side.source.batch)
    try:
        loaded = side.built(load)
    except (InputError, UsageError) as err:
        raise RuntimeUnavailable(
            f"PyTorch cannot build the fused model of {side.path.name}: {first_line(err)}"
        ) from None
    return torch_runtime(loaded.model, loaded.dtype, what, loaded.batch)


def question_2_each(
    reference: Reference,
    shorter: Reference | None,
    pending: Sequence[Pending],
    *,
    opts: VerifyOptions,
    token_logits: bool,
    fallback: Pending | None = None,
    progress: Progress = no_progress,
) -> tuple[list[OutputCheck], list[Runtime], list[NotRun]]:
    """Question 2 for each runtime of ``pending`` on ``reference`` and, when given, on ``shorter`` (the same inputs
    at a shorter length): the checks of every runtime on ``reference``, then those on ``shorter``.

    One runtime at a time: each is opened when its turn comes and closed (``Runtime.close``) once both its runs are
    done, so the runtimes never hold their memory at once. A runtime that cannot run its artifact
    (``RuntimeUnavailable``) leaves the artifact to a ``rescue`` runtime; an artifact no runtime ran is returned as
    ``NotRun``, and one a rescue ran as a ``NotRun`` of the runtime that could not. ``fallback`` runs only when
    nothing else ran.

    Returns:
        ``(checks, the runtimes that ran, the files not run)``.
    """
    checks: list[OutputCheck] = []
    at_length: list[OutputCheck] = []
    ran: list[Runtime] = []
    why: dict[str, str] = {}
    failed_in: dict[str, str] = {}
    not_run: list[NotRun] = []
    done: set[str] = set()
    for one in [*pending, fallback]:
        if (
            one is None
            or (one is fallback and ran)
            or (one.rescue and (one.artifact in done or one.artifact not in why))
        ):
            continue
        if one.artifact in why and not one.rescue:
            continue  # one runtime of this file could not open it: the others (optimisation levels) cannot either
        progress(f"verifying: question 2, {one.label}")
        try:
            runtime = one.open()
        except RuntimeUnavailable as err:
            why.setdefault(one.artifact, str(err))
            failed_in.setdefault(one.artifact, one.backend)
            continue
        ran.append(runtime)
        done.add(one.artifact)
        if one.rescue:  # the runtime that could not is named beside it: a person would believe it ran
            not_run.append(NotRun(one.artifact, why[one.artifact], failed_in[one.artifact], one.backend))
        run = functools.partial(
            question_2, runtime=runtime, rtol=opts.rtol, atol=opts.atol, strict=opts.strict, progress=progress
        )
        checks += run(reference, token_logits=token_logits)
        if shorter is not None:
            progress(f"verifying: question 2, {runtime.label}, length {shorter.x.shape[1]}")
            at_length += run(shorter, token_logits=True, names=shorter.names)
        runtime.close()
        del runtime
        release_memory(collect=False)
    not_run += [NotRun(artifact, reason) for artifact, reason in why.items() if artifact not in done]
    return checks + at_length, ran, not_run


# --------------------------------------------------------------------------------------------- the reference


def norm_affine(reference: Side, candidate: Side, load: LoadOptions | None) -> bool:
    """Whether question 1's float64 fold of the reference folds the affine of its LayerNorms / RMSNorms /
    GroupNorms too: the candidate records a fold made so (``Provenance.norm_affine``), the plan being checked made
    it (``fuse``), or ``LoadOptions.fold_norm_affine`` asks."""
    from slabconv import engine

    if load is not None and load.fold_norm_affine:
        return True
    if candidate.provenance is not None and candidate.provenance.norm_affine:
        return True
    return reference.decisions is not None and engine.folds_norm_affine(reference.decisions)


@dataclass
class _Reference:
    """The reference side as ``_whole`` and the localisation ask it, one class per kind (``REFERENCES``): ``run``
    (the verification inputs, the reference on them in its dtype and in float64; with ``fold``, the float64 fold),
    ``fold`` (what question 1 compares: the candidate's first file's tensors, the float64 original's and fold's by
    name, the ``NormSite`` of each norm the fold removes), ``question_1`` and ``kept_fold`` (the localisation's
    float64 fold: question 1's where it kept it).

    Attributes:
        side, candidate: the two sides; ``load``: how a side's model is built.
        headline: the report's ``verification.reference``.
        notes: what the verdict says of the reference before question 1 (a candidate stored in a narrower dtype).
        decisions64: the float64 fold's decisions, compared with ``side.decisions`` (``run.decisions_note``).
        x: the first ``policy.EXACT_SAMPLES`` verification inputs (set by ``_whole``): what the localisation runs on.
    """

    side: Side
    candidate: Side
    load: LoadOptions | None = None
    headline: str = ""
    notes: list[str] = field(default_factory=list)
    decisions64: list[Any] = field(default_factory=list)
    x: Any = None


@dataclass
class ModelReference(_Reference):
    """A reference PyTorch runs (a ``model`` side): the model in its dtype, its traced graph promoted to float64
    (``float64_graph``) and the engine's float64 fold of that graph (``fused64``, of the norms' affines too with
    ``affine``: ``norm_affine``), kept for the localisation by ``question_1`` where it will run."""

    headline: str = "the reference model in float64 (pytorch)"
    fused64: Any = None
    affine: bool = False

    def run(self, opts: VerifyOptions, fold: bool, fusing: bool = False) -> Reference:
        """The reference model in its dtype and its graph in float64 on the verification inputs (``choose_inputs``),
        and (``fold``) the float64 fold: the one the side holds (``Side.take_fold64``), else made now.

        A candidate stored in a narrower dtype than the reference (``fuse --dtype float16`` of a float32 checkpoint)
        is held to the error of the reference cast to that dtype (``e_orig``): the error any model in that dtype has.

        Raises:
            UsageError, InputError: as ``choose_inputs``.
        """
        reference, candidate, loaded, load = self.side, self.candidate, self.side.loaded, self.load
        drawn_for = loaded or (candidate.loaded if candidate.kind == "model" else None)
        shape = (load.input_shape if load else None) or (tuple(candidate.source.input_shape or ()) or None)
        tokens = bool(candidate.onnx and candidate.onnx.token_input)
        x, label, digest = choose_inputs(drawn_for, opts.inputs, opts.sample_count(), opts.seed, shape,
                                         limit=opts.samples, token_input=tokens)  # fmt: skip
        self.affine = norm_affine(reference, candidate, self.load)
        written, dtype = getattr(torch, candidate.dtype, None), loaded.dtype
        original = original_dtype = None
        if isinstance(written, torch.dtype) and written.itemsize < dtype.itemsize and dtype.is_floating_point:
            original = original_cast(loaded, written, x)
            original_dtype = candidate.dtype
            self.notes.append(
                f"the candidate is stored in {candidate.dtype}, the reference in {dtype_name(dtype)}: the "
                f"original's own error is that of the reference cast to {candidate.dtype}"
            )
        graph, example = reference.traced()
        made = reference.take_fold64(self.affine)
        original64 = made.original64 if made is not None else float64_graph(graph, example)
        original, exact = original_runs(loaded, original64, x, original)
        release_memory(collect=False)  # the float64 activations, before the float64 fold is made
        if made is not None and fold:
            self.fused64, self.decisions64 = made.fused64, made.decisions64
        elif fold:
            self.fused64, self.decisions64 = fold64(original64, self.affine)
        del made
        names = output_names(len(original))

        def cast_to(to: str, x: Any) -> tuple[list[np.ndarray], str]:
            return original_cast(loaded, getattr(torch, to), x), f"the reference cast to {to}"

        ref = Reference(x, label, digest, dtype_name(dtype), original, exact, names, original64=original64,
                        model=loaded, original_dtype=original_dtype, batch=loaded.batch, cast_to=cast_to)  # fmt: skip
        check_reference(ref)
        return ref

    def fold(self, ref: Reference) -> tuple[Written, Tensors, Tensors, list[Any]]:
        """Of the candidate's first file (``written_files``) and ``engine.fused_state_dict``."""
        assert ref.original64 is not None
        first = written_files(self.candidate)[0][1]()
        original, fold = engine.fused_state_dict(ref.original64), engine.fused_state_dict(self.fused64)
        folded_away = {d.norm for d in self.decisions64 if d.action.startswith("folded")}
        removed = [site for site in engine.find_norms(ref.original64) if site.name in folded_away]
        return first, original, fold, removed

    def question_1(
        self, ref: Reference, original: Tensors, fold: Tensors, first: Written, progress: Progress, keep: bool
    ) -> list[Any]:
        """Question 1: the float64 fold's graph, then the tensors of every file the candidate holds against that
        fold rounded to their dtypes (``written_files``; ``first``: the first file's, read already): a folder's
        weights, and its ``model.onnx`` too (by value where the exporter renamed a tensor), one file at a time: each
        is deployed on its own, and a runtime's rounding (OpenVINO's bfloat16) can hide a changed weight from
        question 2. The float64 fold is kept for the localisation (``Side.fold64``) where it will run (``keep``, or
        a failed check)."""
        progress("verifying: question 1, is the fold exact?")
        checks = [question_1_graph(ref, self.fused64)]
        for i, (name, read) in enumerate(written_files(self.candidate)):
            written = first if i == 0 else read()
            unchanged = unchanged_tensors(original, fold) if written.by_value else frozenset()
            checks.append(judge.exact_tensors(f"{name} vs a float64 fold of the reference", written.tensors, fold,
                                              by_value=written.by_value, unchanged=unchanged, file=name))  # fmt: skip
            del written
        if keep or not all(c.passed for c in checks):
            assert ref.original64 is not None and self.fused64 is not None
            traced = self.side.traced()[0]
            self.side.fold64 = Float64Fold(ref.original64, self.fused64, self.decisions64, traced, self.affine)
        self.fused64 = None
        return checks

    def kept_fold(self) -> Float64Fold:
        """The localisation's float64 fold: question 1's where it kept it (``Side.take_fold64``), else made now."""
        return self.side.take_fold64(self.affine) or float64_fold(*self.side.traced(), self.affine)


@dataclass
class OnnxReference(_Reference):
    """An ONNX original (an ``onnx`` side): onnxruntime runs it in its dtype, its graph cast to float64 runs as
    ``onnx_original.float64_reference`` runs it, and its float64 fold is the engine's fold of that graph
    (``folded``: ``onnx_original.onnx_fold64``, made by ``fold``)."""

    headline: str = "the reference ONNX graph in float64"
    folded: Any = None

    def run(self, opts: VerifyOptions, fold: bool, fusing: bool = False) -> Reference:
        """The original in its dtype (onnxruntime) and its graph in float64 (``headline`` names the evaluator that
        ran it) on the verification inputs (``onnx_original.choose_onnx_inputs``: a dict by input name for a graph
        with several inputs); the fold is made by ``fold``.

        Args:
            fusing: ``fuse`` verifies the fold it has just written (the advice for an original onnxruntime cannot run
                is ``fuse``'s); else ``verify`` was given this reference (its advice is ``verify``'s).

        Raises:
            UsageError, InputError: as ``choose_onnx_inputs``; a graph that draws random numbers; an original
                onnxruntime cannot run (a bfloat16 one).
        """
        from slabconv.verify import onnx_original

        info = self.side.onnx
        x, label, digest = onnx_original.choose_onnx_inputs(info, opts)
        onnx_original.check_deterministic(info)
        try:
            runtime = onnx_runtimes(info.path, several=True, levels=ORT_LEVELS[:1])[0]
        except RuntimeUnavailable as err:
            if info.dtype == "bfloat16" and fusing:  # the CPU provider lacks bfloat16 kernels (BatchNorm, MatMul)
                raise InputError(
                    f"{info.path}: onnxruntime cannot run this bfloat16 model ({first_line(err, 160)}); slabconv "
                    "verifies what onnxruntime runs: fold it with --no-verify and check model.onnx in a runtime with "
                    "bfloat16 kernels, or fold a float32 or float16 export"
                ) from None
            if info.dtype == "bfloat16":  # verify: the reference runs in onnxruntime, whatever --runtime names
                raise InputError(
                    f"{info.path}: onnxruntime cannot run this bfloat16 model as the reference "
                    f"({first_line(err, 160)}); verify runs its reference in onnxruntime (--runtime chooses the "
                    "candidate's runtimes only): give as the reference the model it was made from (a checkpoint or "
                    "folder, which PyTorch runs in bfloat16), or a float32 or float16 export of it"
                ) from None
            raise InputError(f"{info.path}: {err}; slabconv verifies what onnxruntime runs") from None
        batch = runtime.fixed_batch
        try:
            original = run_batched(runtime.run, x, fixed_batch=batch)
        except Exception as err:  # noqa: BLE001 - onnxruntime's Fail, InvalidArgument, RuntimeException
            _batch_fixed_in_graph(info.path, runtime, x, batch, err)
            raise
        names = output_names(len(original), runtime.output_names)
        runtime.close()
        exact, which = onnx_original.float64_reference(info.path, x, info.dtype, batch)
        self.headline += f" ({which})"
        ref = Reference(x, label, digest, info.dtype, original, exact, names, onnx=info.path, batch=batch,
                        cast_to=functools.partial(onnx_original.cast_reference, info.path, batch=batch))  # fmt: skip
        check_reference(ref)
        return ref

    def fold(self, ref: Reference) -> tuple[Written, Tensors, Tensors, list[Any]]:
        """Of the candidate's ``.onnx`` and the prepared original's float64 fold (``onnx_original.stored_tensors``)."""
        from slabconv.verify import onnx_original

        self.folded = onnx_original.onnx_fold64(self.side.onnx.path, self.candidate.onnx, keep_original=True)
        original = onnx_original.stored_tensors(self.folded.original, float64=True)
        fold = onnx_original.stored_tensors(self.folded.fused, float64=True)
        removed = [p.site for p in self.folded.plans if p.decision.action.startswith("folded")]
        return _onnx_tensors(self.candidate.onnx.path), original, fold, removed

    def question_1(
        self, ref: Reference, original: Tensors, fold: Tensors, first: Written, progress: Progress, keep: bool
    ) -> list[Any]:
        """Question 1: the float64 fold (``fold``: its stored tensors) against the original in float64 (the fold
        alone, never simplified), and the candidate's tensors (``first``: its ``.onnx``'s, read already) against
        that fold rounded to their dtypes. The original it is held to is the graph the engine planned
        (``onnx_lower.prepare``: a weight the exporter computes from constants, such as a ``weight_norm``'s ``g * v
        / ||v||``, folded into a constant at the file's precision, as its runtime computes it on every call), in
        float64: the fold alone is judged, and question 2 holds the written file to the original as the file was. A
        candidate ``fuse --simplify`` wrote is held to the fold in the file's dtypes simplified by the same
        simplifiers at that precision, and that fold, before simplification, to the float64 fold
        (``onnx_original.onnx_fold64``): every written tensor is checked, the ones the simplifiers computed against
        the simplifiers' own result (their numbers are question 2's to judge). The float64 fold is kept for the
        localisation (``kept_fold``) where it will run (``keep``, or a failed check)."""
        from slabconv.verify import onnx_original

        progress("verifying: question 1, is the fold exact?")
        folded = self.folded
        assert ref.exact is not None
        x1, _, total = exact_samples(ref.x, ref.exact)
        outputs = onnx_original.run_float64(folded.fused, x1, ref.dtype, ref.batch)
        exact1 = onnx_original.run_float64(folded.original, x1, ref.dtype, ref.batch)
        name = self.candidate.onnx.path.name
        checks = [judge.exact_graphs(ref.names, outputs, exact1, of=total)]
        if folded.simplified is None:
            checks.append(judge.exact_tensors(f"{name} vs a float64 fold of the reference", first.tensors, fold,
                                              file=name))  # fmt: skip
        else:
            rounded = onnx_original.stored_tensors(folded.rounded)
            simplifiers = ", ".join(folded.simplified_by or [])
            if folded.simplified_by != folded.simplifiers:  # another release here than the one that simplified it
                simplifiers += f"; the file names {', '.join(folded.simplifiers or [])}"
            checks += [
                judge.exact_tensors("the fold in the file's dtypes, before --simplify, vs a float64 fold of the "
                                    "reference", rounded, fold),
                judge.exact_tensors(
                    f"{name} vs that fold simplified at the file's precision ({simplifiers})",
                    first.tensors, onnx_original.stored_tensors(folded.simplified, float64=True),
                    against="that fold, simplified", file=name,
                ),
            ]  # fmt: skip
        if not keep and all(c.passed for c in checks):
            self.folded = None
        return checks

    def kept_fold(self) -> Any:
        """The localisation's float64 fold (``onnx_original.Fold64``, its original kept): question 1's where it kept
        it, else made now."""
        from slabconv.verify import onnx_original

        folded, self.folded = self.folded, None
        return folded or onnx_original.onnx_fold64(self.side.onnx.path, self.candidate.onnx, keep_original=True)


REFERENCES: dict[str, type[ModelReference | OnnxReference]] = {"model": ModelReference, "onnx": OnnxReference}
"""The reference adapter of each kind of reference side (``_whole`` verifies a ``folder`` as its fused model)."""


def _batch_fixed_in_graph(path: Path, runtime: Runtime, x: Inputs, batch: int | None, err: Exception) -> None:
    """An ONNX original whose batch axis is declared dynamic but that onnxruntime runs only one sample at a time
    (an exporter traced a batch of 1 into a ``Split`` or ``Reshape``: transformers' ZoeDepth under the TorchScript
    exporter) is an input problem, not slabconv's: said so, with what to do. Returns (the caller re-raises ``err``)
    when the batch is fixed by the file, there is one sample, or one sample fails too.

    Raises:
        InputError: the original runs on the first sample alone but not on several at once.
    """
    n = samples_of(x)
    if batch is not None or n < 2:
        return
    try:
        run_batched(runtime.run, x[:1] if isinstance(x, np.ndarray) else {k: a[:1] for k, a in x.items()})
    except Exception:  # noqa: BLE001 - one sample fails too: not the batch
        return
    raise InputError(
        f"{path}: onnxruntime runs the original on one sample but not on {min(n, 16)} at once "
        f"({first_line(err, 200)}): its batch axis is declared dynamic, but the graph fixes it at 1 (an exporter "
        "traced a batch of 1 into a Split or Reshape); verify it one sample a call with --samples 1 (or --inputs NPZ "
        "of one sample), or export it with a batch its graph follows"
    ) from None


# --------------------------------------------------------------------------------------------- question 1


Tensors = dict[str, torch.Tensor]


class Written(NamedTuple):
    """One file's stored tensors for question 1 (``written_files``)."""

    tensors: dict[str, torch.Tensor]
    by_value: bool
    """Matched by value rather than by name: an ``.onnx`` (the exporter stores Linear weights transposed under
    generated names)."""


def _written_tensors(candidate: Side) -> Written:
    """The candidate's stored tensors for question 1."""
    from slabconv.load.formats import load_checkpoint

    if candidate.kind == "folder" and candidate.weights is not None:
        target = candidate.weights if candidate.weights.suffix == ".safetensors" else candidate.path
        return Written(dict(load_checkpoint(target).state_dict), False)
    if candidate.kind == "model":
        checkpoint = candidate.loaded.checkpoint
        tensors = _program_tensors(checkpoint) if checkpoint.program is not None else dict(checkpoint.state_dict)
        return Written(tensors, False)
    return _onnx_tensors(candidate.onnx.path)


def _a_fold_lacks_its_norms(
    candidate: Side,
    first: Written,
    sites: list[Any],
    original: dict[str, torch.Tensor],
    fold: dict[str, torch.Tensor],
    just_folded: bool,
) -> bool:
    """Whether a candidate whose provenance records a fold of the reference is one: its first file (``first``, the
    one question 1 reads first) lacks the norms that fold removes: of each norm folded away (``sites``, its
    ``NormSite``), the tensors behind its parameters (``param_names``) that ``original`` (the reference's graph, by
    name) holds and ``fold`` does not (``sides.kept_norm_tensors``). One that holds some of every such norm's is the
    unfused model with a fold's metadata (copied by hand): ``candidate.unfused`` names them, and the pair is verified
    as two models (question 2 only, ``sides.why_not_a_fold`` says why).

    Raises:
        RuntimeError: ``just_folded`` (``fuse``'s own fold) and it holds them: a bug in slabconv.
    """
    removed = [
        {
            n: original[n]
            for n in site.param_names.values()
            if n in original and n not in fold and original[n].is_floating_point()
        }
        for site in sites
    ]
    candidate.unfused = sides.kept_norm_tensors(first.tensors, removed, fold, first.by_value)
    if candidate.unfused and just_folded:
        raise RuntimeError(
            f"the fold just written holds the tensors of the norms it removes ({candidate.unfused[0]}...)"
        )
    return not candidate.unfused


def _program_tensors(checkpoint: Any) -> dict[str, torch.Tensor]:
    """A ``.pt2``'s stored tensors by name: its state_dict and its constants (the non-persistent buffers, such as
    a Swin block's attention mask, ``torch.export`` keeps among the constants)."""
    constants = {k: v for k, v in dict(checkpoint.program.constants).items() if isinstance(v, torch.Tensor)}
    return {**constants, **checkpoint.state_dict}


def unchanged_tensors(original: Tensors, fold: Tensors) -> frozenset[str]:
    """The float64 fold's tensors (``fold``) that are the float64 original graph's own (``original``: its
    ``engine.fused_state_dict``), bit for bit (no fold wrote them)."""
    return frozenset(k for k, v in fold.items() if k in original and torch.equal(original[k], v))


def written_files(candidate: Side) -> list[tuple[str, Callable[[], Written]]]:
    """The candidate's files question 1 reads, each with a reader of its stored tensors (``_written_tensors``):
    a folder's weights, its ``model.onnx`` and a fused language model's ``decoder.onnx`` (its weights under the
    transformers module's names, Linear weights transposed: read by value); another side's own file (the
    localisation reads the same). A folder's ``model.pt2`` is not read here: ``torch.export.load`` costs seconds,
    and it holds the program that ``model.onnx`` was translated from (``verify CKPT FOLDER/model.pt2`` reads its
    tensors)."""
    if candidate.kind != "folder" or candidate.weights is None:
        return [(candidate.path.name, functools.partial(_written_tensors, candidate))]
    files: list[tuple[str, Callable[[], Written]]]
    files = [(candidate.weights.name, functools.partial(_written_tensors, candidate))]
    for path in (candidate.onnx.path if candidate.onnx is not None else None, candidate.path / "decoder.onnx"):
        if path is not None and path.is_file():
            files.append((path.name, functools.partial(_onnx_tensors, path)))
    return files


def _onnx_tensors(path: Path) -> Written:
    """An ``.onnx``'s floating initializers for question 1, matched by value."""
    from slabconv.verify.onnx_original import float_tensors

    return Written(float_tensors(path), True)


# --------------------------------------------------------------------------------------------- file checks


def checker_check(candidate: Side, reference: Side) -> IntegrityCheck | None:
    """``onnx.checker``'s full check of the candidate's ``.onnx``, judged against the reference's own result when
    the reference is an ONNX file: a candidate that fails as its original does was not broken by the fold (the
    check passes, its detail says so); None when the candidate has no ``.onnx``."""
    if candidate.onnx is None:
        return None
    path = candidate.onnx.path
    passed, detail = check_onnx_file(path)
    name = f"onnx.checker[full_check] {path.name}"
    if passed or reference.onnx is None:
        return IntegrityCheck(name, passed, detail)
    ref_passed, ref_detail = check_onnx_file(reference.onnx.path)
    if ref_passed:
        return IntegrityCheck(name, False, detail + f" (the reference {reference.onnx.path.name} passes it)")
    same = _checker_text(detail) == _checker_text(ref_detail)
    why = f"the reference {reference.onnx.path.name} fails it too: {ref_detail}"
    return IntegrityCheck(name, same, f"{detail} ({why}: not the fold's doing)" if same else f"{detail} ({why})")


def _checker_text(detail: str) -> str:
    """A checker message without the file's path (the two files have different names)."""
    return detail.split(": ", 1)[-1] if detail.startswith("/") else detail


# --------------------------------------------------------------------------------------------- the verifier


def verify(
    reference: Side,
    candidate: Side,
    opts: VerifyOptions,
    *,
    load: LoadOptions | None = None,
    localize: bool = False,
    just_folded: bool = False,
    progress: Progress = no_progress,
) -> Verification:
    """Both questions for ``candidate`` against ``reference`` (see the module docstring).

    Args:
        opts: the inputs, tolerances and runtimes; ``opts.generate``: greedy tokens to compare for a fused
            language-model folder (None or 0: not checked).
        load: how to build a side's model (``--arch``, ``--input-shape``...).
        localize: run the localisation pass even when everything passed (``verify --localize``).
        just_folded: the candidate is the fold ``fuse`` has just written of the reference, so question 1 must apply:
            where the sides do not say so, that is a bug, raised, never a verdict on question 2 alone.

    Raises:
        UsageError: swapped arguments; a runtime that cannot run the candidate; ``--generate`` without a fused
            language-model folder; no input shape known.
        InputError: unusable inputs (a non-finite float64 output, an original that overflows its dtype as the
            candidate does); sides that are not the same model.
        RuntimeError: ``just_folded`` and question 1 does not apply (a bug in slabconv).
    """
    started = time.monotonic()
    related = sides.fold_relation(reference, candidate, load)
    if just_folded and not related:
        why = sides.why_not_a_fold(reference, candidate)
        raise RuntimeError(f"question 1 does not apply to the fold just written ({why})")
    if opts.generate and not candidate.language_model:
        raise UsageError(
            f"--generate needs a fused language-model folder as the candidate; {candidate.path} is not one"
        )
    _same_decoder(reference, candidate)
    _same_inputs(reference, candidate)
    _checks_fit(reference, candidate, opts)
    adapter = None
    if "streamed" in (reference.kind, candidate.kind):
        verification = _layerwise(reference, candidate, related, opts, progress)
    else:
        with stage_memory():  # one full collection, then each stage's release_memory walks only what it made
            verification, adapter = _whole(reference, candidate, related, opts, load, progress, just_folded, localize)
    if opts.generate:
        _language_checks(reference, candidate, opts, verification, progress)
    elif candidate.language_model and opts.generate == 0:
        verification.notes.append("greedy generation not checked (--generate 0)")
    if candidate.language_model:
        verification.notes += _tokenizer_notes(reference, candidate)
    if localize or not verification.passed:
        from slabconv.verify import localize as localizer

        progress("verifying: localising, fold by fold")
        try:
            verification.localization = localizer.localize(reference, candidate, opts, verification.exact, adapter)
        except InputError as err:
            if verification.passed:
                raise
            verification.localization = Localization("none", detail=f"not localised: {first_line(err)}")
    verification.seconds = time.monotonic() - started
    return verification


def _tokenizer_notes(reference: Side, candidate: Side) -> list[str]:
    """A note naming the tokenizer files the original folder holds and the fused language-model folder lacks
    (``hf_llama.tokenizer_files``, what ``fuse`` copies): the weights may pass every check while
    ``AutoTokenizer.from_pretrained`` of the folder fails or reads another tokenizer."""
    from slabconv.write.hf_llama import tokenizer_files

    source = reference.path if reference.path.is_dir() else reference.path.parent
    present = set(tokenizer_files(candidate.path))
    missing = [n for n in tokenizer_files(source) if n not in present]
    if not missing:
        return []
    return [
        f"{candidate.path} lacks the original's tokenizer files ({', '.join(missing)}): AutoTokenizer cannot read "
        f"the original's tokenizer there; copy them from {source}"
    ]


def _whole(
    reference: Side,
    candidate: Side,
    related: bool,
    opts: VerifyOptions,
    load: LoadOptions | None,
    progress: Progress,
    just_folded: bool = False,
    localize: bool = False,
) -> tuple[Verification, ModelReference | OnnxReference]:
    """Both questions with whole models (every side but ``streamed``), and the int8 check when asked, and the
    reference adapter (``REFERENCES``) that answered them, for the localisation. A candidate
    whose provenance records a fold of the reference but that holds the norms the fold removes is verified as
    another model (``_a_fold_lacks_its_norms``); with ``just_folded`` that raises RuntimeError. A model reference
    keeps question 1's float64 fold (``Side.fold64``) for the localisation where it will run (``localize``, or a
    failed question 1)."""
    pending, fallback = candidate_runs(candidate, opts.runtimes, load)
    quantizing = int8_backends(opts)
    if quantizing and candidate.onnx is None:
        raise UsageError(
            f"--runtime {quantizing[0].name} quantizes the candidate's .onnx, and {candidate.path} has none; give "
            "an .onnx or a folder with model.onnx"
        )
    # why question 1 does not apply, said of the sides as given (a folder's fused model is built from its model.pt2,
    # whose bytes are not the folder's weights: the same folder on both sides would not read as itself)
    unrelated = None if related else sides.why_not_a_fold(reference, candidate)
    if reference.kind == "folder":
        reference = sides.model_side(reference.built(), reference.path)  # a folder fuse wrote: its fused model
    a, b = reference.source.input_shape, candidate.source.input_shape
    if a and b and tuple(a) != tuple(b):
        raise InputError(
            f"{reference.path} takes inputs of shape {tuple(a)} but {candidate.path} takes {tuple(b)}; the two files "
            "are not the same model"
        )
    progress("verifying: the reference in its dtype and in float64")
    adapter = REFERENCES[reference.kind](reference, candidate, load)
    ref = adapter.run(opts, related, fusing=just_folded)
    adapter.x = exact_samples(ref.x, [])[0]
    token_logits = bool((reference.loaded or reference.onnx).token_input)
    verification = Verification(inputs=ref.label, inputs_sha256=ref.sha256)
    verification.reference = adapter.headline
    verification.notes += adapter.notes
    if related:
        first, original, fold, removed = adapter.fold(ref)
        related = _a_fold_lacks_its_norms(candidate, first, removed, original, fold, just_folded)
    if reference.decisions is not None and related:
        verification.notes += decisions_note(reference.decisions, adapter.decisions64)
    verification.notes += ref.notes
    if related:
        verification.exact += adapter.question_1(ref, original, fold, first, progress, keep=localize)
        del first, original, fold
    else:
        # a candidate related as given but lacking its fold's norms (``_a_fold_lacks_its_norms``): said of its norms
        verification.question_2_only(unrelated or sides.why_not_a_fold(reference, candidate))
    release_memory()
    check = checker_check(candidate, reference)
    if check is not None:
        verification.integrity.append(check)
    shorter = None
    length = ref.x.shape[1] // 2 if isinstance(ref.x, np.ndarray) and ref.x.ndim == 2 else 0
    if candidate.dynamic_sequence and token_logits and length >= 1 and ref.original64 is not None:
        # The programs take any length: check a second one, so a program that only runs (or only computes right)
        # at the verification inputs' length cannot pass.
        shorter = ref.at_length(reference.loaded, length)
        shorter.original64 = None
    ref.original64 = None
    checks, ran, not_run = question_2_each(
        ref, shorter, pending, opts=opts, token_logits=token_logits, fallback=fallback, progress=progress
    )
    if not ran and not_run and all(e.passed for e in verification.exact):  # else question 1 says what differs
        why = "; ".join(n.line() for n in not_run)
        if opts.runtimes:  # the runtimes named: the others may run it
            named = ", ".join(dict.fromkeys(opts.runtimes))
            raise InputError(f"{candidate.path}: --runtime {named} cannot run it ({why}); name another runtime, or "
                             "leave out --runtime to run it in every runtime that can")  # fmt: skip
        raise InputError(f"{candidate.path}: no runtime here can run it ({why})")
    verification.checks += checks
    verification.not_run += not_run
    listed = "missing from the folder, though its report.json lists it among the files fuse wrote"
    verification.not_run += [NotRun(name, listed) for name in candidate.missing]
    verification.notes += [f"{n} is not the file fuse wrote: its sha256 is not the one report.json records; the "
                           "checks above are of the file as it is" for n in candidate.changed]  # fmt: skip
    for dtype, backend, how in dict.fromkeys(ref.cast_by.values()):
        own = {b for d, b, _ in ref.cast_by.values() if d == dtype and b}  # runtimes that ran the original themselves
        labels = ", ".join(
            rt.label for rt in ran if rt.dtype == dtype and backend == (rt.kind if rt.kind in own else "")
        )
        verification.notes.append(f"{labels} computed in {dtype}: the original's own error there is that of {how}")
    verification.notes += ref.runtime_notes + (shorter.runtime_notes if shorter is not None else [])
    verification.runtime = runtime_summary(ran)
    _overflowing_inputs(verification, ref)
    _constant_outputs(verification, ref, related)
    _bound_admits_zero(verification, related)
    for backend in quantizing:
        progress(f"verifying: {backend.name}, the reference and the candidate quantized alike")
        verification.int8.append(_int8(backend, reference, candidate, ref, opts, load).to_dict())
    return verification, adapter


def _int8(
    backend: Any, reference: Side, candidate: Side, ref: Reference, opts: VerifyOptions, load: LoadOptions | None
) -> Any:
    """The int8 check (``slabconv.verify.int8.check_int8``) of the reference's and the candidate's ``.onnx``,
    quantized alike and calibrated on ``opts.calibration`` or the verification inputs: a reference that is not an
    ``.onnx`` (``ref.onnx``) is exported to ONNX in its dtype (``run.export_original``: once, the export question
    2's runtimes run the original from too).

    Raises:
        InputError: an unreadable calibration file; outputs that cannot be judged (``compare_int8``).
        UnsupportedModelError, UsageError: the reference cannot be exported to ONNX.
        RuntimeUnavailable: onnxruntime cannot quantize or run a side.
    """
    from slabconv.verify.int8 import check_int8
    from slabconv.verify.run import export_original

    calibration, label = ref.x, "the verification inputs"
    if opts.calibration is not None:
        calibration = _calibration(ref, opts.calibration)
        label = str(opts.calibration)
    name = f"int8 @ {backend.name}"
    original = ref.onnx or export_original(reference.built(load), ref.exported, required=True)
    assert original is not None  # required: export_original raises where it cannot export
    try:
        return check_int8(
            name, original, candidate.onnx.path, ref.x, ref.original, ref.exact, calibration=calibration,
            calibration_label=label, fixed_batch=ref.batch,
        )  # fmt: skip
    except RuntimeUnavailable as err:
        raise InputError(f"{name}: {err}") from None


def _calibration(ref: Reference, path: Path) -> Any:
    """The ``--calibration`` inputs, read as ``--inputs`` are (``verify.inputs.read_inputs_file``: the ``x`` array,
    sized before it is read), of the verification inputs' shape per sample and integer for token ids."""
    from slabconv.verify.inputs import read_inputs_file

    if not isinstance(ref.x, np.ndarray):
        raise UsageError("--calibration takes one input array; this model takes several inputs")
    return read_inputs_file(path, tuple(ref.x.shape[1:]), ref.x.dtype.kind in "iu", None)[0]


def _overflowing_inputs(verification: Verification, reference: Reference) -> None:
    """Inputs on which the original overflows its own dtype and the candidate does too are an input problem, not
    a fold's: the error is raised (exit 2) instead of a failed question 2.

    Raises:
        InputError: naming the inputs, when every failing check of question 2 is a non-finite output where the
            original in its own dtype is not finite either.
    """
    overflow = [i for i, o in enumerate(reference.original) if not np.isfinite(o).all()]
    if not overflow:
        return
    failing = [c for c in verification.checks if not c.passed]
    if failing and all(not np.isfinite(c.e_fused) for c in failing):
        raise InputError(
            f"{reference.label}: the original model's own output is not finite in {reference.dtype} on these inputs, "
            "nor is the candidate's: the inputs overflow the model itself (values too large for its dtype?); pass "
            "inputs the model was made for with --inputs NPZ"
        )


# what a note on a question 2 that cannot tell models apart says where question 1 ran
_QUESTION_1_SHOWS = "question 1, which holds every stored tensor to the fold, is what shows the fold exact"


def _constant_outputs(verification: Verification, reference: Reference, related: bool) -> None:
    """Note when the original's outputs are the same on every sample (a model saturated on these inputs, or one
    whose outputs do not depend on them): question 2 then compares constants, and would pass any model with the
    same constants. Question 1 still holds every stored tensor to the fold; a verification without it says nothing
    about the candidate beyond those constants.
    """
    outputs = reference.exact if reference.exact is not None else reference.original
    n = samples_of(reference.x)
    if n < 2 or not outputs or any(o.ndim == 0 or o.shape[0] != n for o in outputs):
        return  # one sample, or an output without a batch axis: nothing to compare across samples
    if not all(np.array_equal(o, np.broadcast_to(o[:1], o.shape)) for o in outputs):
        return
    which = _QUESTION_1_SHOWS if related else "this verification says nothing about the candidate beyond them"
    verification.notes.append(
        f"the original's outputs are the same on all {n} samples ({reference.label}): question 2 compares constants "
        f"here and cannot tell one model from another; {which}; pass inputs the model was made for with --inputs NPZ"
    )


def _bound_admits_zero(verification: Verification, related: bool) -> None:
    """Note each output whose passed question 2 bound, twice the original's own error, is 1 or more: the original
    in its own dtype is at least half its output's scale away from its float64 self on these inputs (an overflow, a
    cancellation, a ``TopK`` or ``ArgMax`` that decides otherwise), and an error of 1 is what an all-zero output has
    (``max |0 - ref| / max |ref|``): the check would pass a candidate that computes nothing. Question 1 still holds
    every stored tensor of a fold; a verification without it says nothing about that output.
    """
    vacuous = [c for c in verification.checks if c.passed and c.tolerance_from == "2*e_orig" and c.tolerance >= 1]
    if not vacuous:
        return
    which = _QUESTION_1_SHOWS if related else "this verification says nothing about the candidate's values there"
    worst = max(vacuous, key=lambda c: c.tolerance)
    names = ", ".join(dict.fromkeys(c.name for c in vacuous))
    verification.notes.append(
        f"the original is itself {g3(worst.e_orig)} of its output's scale away from its float64 reference on these "
        f"inputs ({names}): question 2's bound, twice that ({worst.tolerance:.3g}), admits an all-zero output and "
        f"cannot tell one model from another there; {which}; pass inputs the model was made for with --inputs NPZ"
    )


def _same_inputs(reference: Side, candidate: Side) -> None:
    """Refuse, before any work, an ``.onnx`` candidate that takes inputs the reference does not give: both sides are
    fed the reference's inputs (one array; an ONNX reference's graph inputs by name), so such a candidate cannot
    run on them (a fused language model's ``decoder.onnx`` takes the attention mask, positions and key/value cache).

    Raises:
        InputError: naming the candidate's inputs and what the reference gives.
    """
    if candidate.onnx is None or len(candidate.onnx.inputs) < 2:
        return
    names = [i.name for i in candidate.onnx.inputs]
    given = [i.name for i in reference.onnx.inputs] if reference.kind == "onnx" and reference.onnx is not None else []
    if len(given) > 1 and set(names) <= set(given):
        return
    shown = ", ".join(n[:80] for n in names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
    gives = f"{len(given)} ({', '.join(n[:80] for n in given[:8])})" if len(given) > 1 else "one"
    raise InputError(
        f"{candidate.onnx.path}: it takes {len(names)} inputs ({shown}), the reference gives {gives}; verify feeds "
        "both sides the reference's inputs: give a candidate that takes them (of a fused language model: its folder "
        "or model.onnx; decoder.onnx, which takes the key/value cache, is run by the folder's generation check)"
    )


def _same_decoder(reference: Side, candidate: Side) -> None:
    """Refuse, before any work, a fused language-model folder whose weights are not the reference model's sizes: a
    weight both name with other shapes, or another number of decoder layers (``model.layers.{i}``), read from the
    folder's safetensors headers only. ``verify --stream`` refuses the same pair (``layerwise``'s config check);
    without this, a fold of another LLaMA of the same vocabulary would reach question 2 and the generation check.

    Raises:
        InputError: the sizes differ (``REF and CAND differ in ...; they are not the same model``).
    """
    if reference.kind != "model" or reference.loaded is None or candidate.kind != "folder":
        return
    if not candidate.language_model:
        return
    from slabconv.errors import SlabconvError
    from slabconv.write.hf_llama import folder_weight_specs

    try:
        specs = folder_weight_specs(candidate.path)
    except SlabconvError:  # no weights to read here: the checks that open the folder say why
        return
    ref = {k: tuple(v.shape) for k, v in reference.loaded.model.state_dict().items()}
    if not any(k in ref for k in specs):
        return  # another naming (a program's): nothing to compare by name

    def layers(keys: Any) -> int:
        return len({k.split(".")[2] for k in keys if k.startswith("model.layers.") and k.count(".") > 2})

    differ = ""
    if layers(ref) != layers(specs):
        differ = f"the number of decoder layers ({layers(ref)} vs {layers(specs)})"
    else:
        shapes = [(k, ref[k], tuple(shape)) for k, (_, shape) in specs.items() if k in ref and ref[k] != tuple(shape)]
        if shapes:
            key, a, b = shapes[0]
            more = f" and {len(shapes) - 1} more" if len(shapes) > 1 else ""
            differ = f"{key} ({list(a)} vs {list(b)}){more}"
    if differ:
        raise InputError(f"{reference.path} and {candidate.path} differ in {differ}; they are not the same model")


def _checks_fit(reference: Side, candidate: Side, opts: VerifyOptions) -> None:
    """Refuse, before any work, the checks of a language model that cannot fit this machine's memory: in memory
    ``verify.generate.check_language_checks_fit`` (a model side: question 2, and with ``--generate`` greedy
    generation and the task metrics, with the original cast to the candidate folder's dtype where narrower),
    streamed ``verify.generate_streamed.check_generation_fits`` (``verify --stream`` and ``fuse --stream`` check it
    earlier, before planning or writing).

    Raises:
        UsageError: the checks need more memory than is available (the message says how much).
    """
    loaded = reference.loaded if reference.kind == "model" else None
    if loaded is None or not loaded.token_input:
        return
    from slabconv.errors import SlabconvError
    from slabconv.verify.generate import check_language_checks_fit
    from slabconv.write.hf_llama import weights_dtype

    checked = opts if opts.generate else dataclasses.replace(opts, generate=0)  # verify generates when asked to
    stored = None
    if checked.generate and candidate.path.is_dir():  # the task metrics cast the original to a narrower folder's
        try:
            stored = getattr(torch, weights_dtype(candidate.path))
        except SlabconvError:  # no weights to read here: the checks that open the folder say why
            pass
    check_language_checks_fit(loaded, checked, onnx=(candidate.path / "decoder.onnx").is_file(), stored=stored)


def _language_checks(
    reference: Side, candidate: Side, opts: VerifyOptions, verification: Verification, progress: Progress
) -> None:
    """Greedy generation of the reference model against the candidate folder (``verify.generate``; where two
    streamed sides were checked beside question 2 by ``_layerwise``, already in ``verification``), then, on
    the same sequences and runtimes, the task metrics (``verify.task_metrics``: teacher-forced perplexity and
    next-token KL of the original and the fused folder), into ``verification``. The task metrics are not measured
    (a note says why) where the fused folder does not load as a model (the generation check failed on it already)
    or where generation is checked streamed, which never holds a model whole.

    Raises:
        UsageError: the reference is not a language model slabconv builds; transformers is missing.
    """
    from slabconv.verify.generate import check_fused_folder
    from slabconv.verify.task_metrics import check_task_metrics
    from slabconv.write.hf_llama import require_transformers

    assert opts.generate
    require_transformers()
    loaded = None
    if verification.generation is None:  # not checked streamed beside question 2 (``_layerwise``)
        loaded = reference.built() if reference.kind in ("model", "streamed") else None
        if loaded is None or not loaded.token_input:
            raise UsageError(
                "--generate needs an original language model as the reference (a checkpoint or folder, not .onnx, "
                f"not a folder fuse wrote); {reference.path} is not one"
            )
        progress("verifying: greedy generation, original vs fused folder")
        streamed = reference.kind == "streamed"  # a standard decoder's streamed fold: --samples as streamed
        x = choose_inputs(loaded, opts.inputs, opts.sample_count(streamed), opts.seed, limit=opts.samples)
        onnx = (candidate.path / "decoder.onnx").is_file()
        verification.generation = check_fused_folder(loaded.model, candidate.path, x[0], opts.generate, onnx=onnx)
        if onnx and loaded.dtype == torch.bfloat16:
            verification.generation.setdefault("notes", []).append(
                "onnxruntime's CPU provider has no bfloat16 kernels: greedy generation ran in transformers only, "
                "decoder.onnx got onnx.checker's full check"
            )
    if any(run.get("not_loaded") for run in verification.generation.get("runs", [])):
        verification.notes.append(
            "task metrics (perplexity, next-token KL) not measured: the fused folder does not load as a model"
        )
    elif loaded is None:
        verification.notes.append(
            "task metrics (perplexity, next-token KL) not measured: the streamed generation check never holds a "
            "model whole, and they need both"
        )
    else:
        progress("verifying: task metrics (perplexity, next-token KL), original vs fused folder")
        verification.task_metrics = check_task_metrics(
            loaded.model, candidate.path, x[0], onnx=onnx, batch=loaded.batch
        )


def _layerwise(
    reference: Side, candidate: Side, related: bool, opts: VerifyOptions, progress: Progress
) -> Verification:
    """Both questions one decoder layer at a time, in bounded memory (``layerwise.verify_folders``), and the greedy
    generation check of a streamed fold (``generate_streamed``): the fused folder generates first, and question 2
    runs on its prompts and tokens, so that question 2's float64 chain is also the generation check's reference
    (the only float64 pass of the original)."""
    from slabconv.verify import layerwise

    if reference.kind != "streamed" or candidate.kind != "streamed":
        raise UsageError("--stream compares two Hugging Face style decoder folders; give a folder on both sides")
    opts.check_streamed()
    from slabconv.verify.generate import torch_threads
    from slabconv.verify.generate_streamed import generate_fused, given_sequences, streams
    from slabconv.write.hf_llama import require_transformers

    program = reference.program if related else None
    exact: list[tuple[torch.Tensor, float]] = []
    run = None
    # each layer reads its weights a block at a time; more threads than cores slowed it. Question 1 runs in a thread
    # of its own beside the generation and question 2, which leave a core idle at times (``layerwise.ExactBeside``)
    with torch_threads(1), contextlib.ExitStack() as stack:
        beside = None
        if program is not None:
            progress("verifying: question 1, the written tensors against a float64 fold (beside the other checks)")
            beside = stack.enter_context(
                layerwise.ExactBeside(reference.path, candidate.path, program, engine.FOLD_BLOCK)
            )
        original = layerwise.Folder.open(reference.path, engine.FOLD_BLOCK)
        given = given_sequences(original, opts.inputs, opts.samples)  # --inputs: else seeded sequences
        if opts.generate and streams(original):
            require_transformers()
            run = generate_fused(
                reference.path, candidate.path, opts.generate, sequences=opts.sample_count(streamed=True),
                seed=opts.seed, block_elements=engine.FOLD_BLOCK, given=given, progress=progress,
            )  # fmt: skip
        ids = run.sequences() if run is not None else (given[0] if given else None)
        inputs = run.inputs() if run is not None else (given[1] if given else "")
        try:
            verification = layerwise.verify_folders(
                reference.path, candidate.path, sequences=opts.sample_count(streamed=True), seed=opts.seed,
                rtol=opts.rtol, atol=opts.atol, strict=opts.strict, block_elements=engine.FOLD_BLOCK, ids=ids,
                inputs=inputs, inputs_sha256=given[2] if given else None, progress=progress,
                on_exact_logits=lambda logits, seconds: exact.append((logits, seconds)),
            )  # fmt: skip
        except InputError as err:  # a candidate that question 1 finds lacking: a difference, which it names
            first = beside.result() if beside is not None else None
            if first is None or first.passed:
                raise
            verification = Verification(inputs=inputs, inputs_sha256=given[2] if given else None, exact=[first])
            verification.not_run.append(NotRun(candidate.path.name, f"question 2 cannot read it: {err}"))
            beside = None
        if beside is not None:
            if not beside.done():
                progress("verifying: question 1, the written tensors against a float64 fold (finishing)")
            verification.exact.insert(0, beside.result())
    if run is not None:
        verification.generation = run.judged(*(exact[0] if ids is not None else (None, 0.0)))
    if program is None:
        why = sides.why_not_a_fold(reference, candidate) if not related else "no fold program was given"
        verification.question_2_only(why)
    return verification
