"""The one driver of ``fuse`` (``run_fuse``) and of ``inspect`` (``run_inspect``): every model, whatever its format
and mode, runs the same stages in the same order, against the door its input opens (``open_door``)::

    open and plan -> check before writing -> stage -> write -> verify -> finish

A door (``Door``, a source adapter) is what the stages ask; the driver never asks the format:

=======  ===================================  ===================================  ===================================
stage    ``InMemory`` (checkpoint, ``.pt2``,   ``Streamed`` (a sharded folder,      ``OnnxGraph`` (an ONNX original,
         Hugging Face folder)                 ``--stream``)                        ``slabconv.onnx_in``)
=======  ===================================  ===================================  ===================================
open     ``load_model``, traced by            the full-size model with stand-in    read as data, prepared and lowered
         ``torch.export`` (a dynamic-batch    weights (``slabconv.load.lazy``); a  into the engine's ATen vocabulary
         ``.pt2``: its own program)           deep decoder with three layers       (``slabconv.engine.onnx_lower``)
plan     ``engine.fold_program``: the         the same call, the program left for  ``plan_folds``, the plans written
         decisions and the fold program,      the writer (every norm must fold     back into the ONNX graph
         evaluated over the graph's tensors   away)                                (``slabconv.engine.onnx_apply``)
check    the fused output is finite;          the generation check fits in memory  (nothing more)
         ``--dtype``'s cast
write    ``model.safetensors``, ``model.pt2``, the program over the shards, a block  ``model.onnx`` (+ ``.data``)
         ``model.onnx``; a language model's   of rows at a time; the same Hugging
         Hugging Face folder, ``decoder.onnx`` Face files
verify   the one verifier, ``verify.verifier.verify``, on the original and the folder written, as ``slabconv
         verify ORIGINAL FOLDER`` runs it: every written file (in memory, ONNX), one decoder layer at a time (streamed)
finish   only a fold that passed is moved into place (``write.staging``); ``report.json`` last
=======  ===================================  ===================================  ===================================

The in-memory and the streamed doors write the same tensors bit for bit: each is the fold program's value, every fold
composed in float64 and rounded once.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import fx

from slabconv import engine
from slabconv.errors import (
    InputError,
    KeptNormsError,
    NumericError,
    UnsupportedModelError,
    UsageError,
    VerificationError,
)
from slabconv.load.lazy import BlockSlots, PlanningModel, ShardedFolder, open_sharded, planning_model, stack_depth
from slabconv.load.model import LoadedModel, load_model
from slabconv.load.shards import LazyShards, return_freed_blocks_to_the_os
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report
from slabconv.text import count
from slabconv.util import Progress, frozen_heap, no_progress, quiet, release_memory, sha256_file
from slabconv.verify import faults
from slabconv.verify.results import Verification
from slabconv.write.onnx import export_onnx, onnx_files, provenance
from slabconv.write.pt2 import export_program, save_pt2
from slabconv.write.safetensors import fused_metadata, save_safetensors
from slabconv.write.staging import staging_dir
from slabconv.zoo.llama_std import FAMILY as STANDARD_FAMILY

if TYPE_CHECKING:
    from slabconv.verify.sides import Side

FOLD_BLOCK = engine.FOLD_BLOCK
"""Elements per row block of a streamed fold: the fold program's float64 temporaries, copies and checks."""

# --------------------------------------------------------------------------------------------- open


class Door(Protocol):
    """A model opened for ``fuse``, as its input format and mode need (a source adapter): the stages of ``fuse``
    ask it, never the format. ``InMemory`` (a checkpoint, a ``.pt2`` program, a Hugging Face folder), ``Streamed``
    (a sharded folder, ``--stream``) and ``slabconv.onnx_in.OnnxGraph`` (an ONNX original).

    Attributes:
        mode: ``in-memory`` or ``streamed`` (the report's ``mode``).
        decisions: one per norm, in graph order.
    """

    mode: str

    @property
    def decisions(self) -> list[engine.Decision]:
        """One per norm, in graph order."""
        ...

    def source(self) -> Source:
        """The report's ``source`` block."""
        ...

    def plan_note(self) -> dict[str, str] | None:
        """The report's ``plan`` block (how a streamed plan was made), or None."""
        ...

    def check(self, verify: VerifyOptions | None, write: WriteOptions) -> None:
        """What must hold before anything is written (raises the errors ``api.fuse`` documents)."""
        ...

    def write(self, folder: Path, write: WriteOptions, progress: Progress) -> tuple[Outputs, dict[str, str]]:
        """Write the fused model into ``folder`` (a staging folder); the report's ``outputs`` block (without the
        sha256) and the sha256 of the files the writer hashed as it wrote them."""
        ...

    def verify(self, folder: Path, opts: VerifyOptions, write: WriteOptions, progress: Progress) -> Verification:
        """Both verification questions on what ``write`` wrote into ``folder`` (and greedy generation for a language
        model)."""
        ...

    def ranges(self) -> list[engine.LayerRange] | None:
        """Each folded layer's weight ranges before and after its folds (``engine.ranges``; the report's
        ``ranges``), with each flagged layer's warning added to its norms' decisions; once written for a door that
        measures them as it writes (``Streamed``)."""
        ...


def open_door(
    path: Path, load: LoadOptions | None, verify: VerifyOptions | None, write: WriteOptions, progress: Progress
) -> Door:
    """The model at ``path`` opened and planned as its format (``slabconv.load.formats``) and ``write.stream`` say:
    an ONNX original, a sharded folder streamed, or any other input loaded whole.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``load_model``, ``load.lazy.open_sharded``, ``plan``,
            ``slabconv.onnx_in.open_onnx``, and the options a door cannot honour (refused before loading:
            ``load.model.check_options_apply``); a language model loaded whole whose question 2 cannot fit the memory
            available (refused before the trace, ``check_language_checks_fit``), or given another ``--dtype`` (its
            folder keeps the checkpoint's).
    """
    from slabconv.load.formats import engine_of
    from slabconv.load.model import check_options_apply

    check_options_apply(path, load)
    if engine_of(path) == "onnx":
        from slabconv.onnx_in import open_onnx

        return open_onnx(path, load, write, progress, verify)
    check_stream_options(path, verify, write, load.arch if load else None)
    norm_affine = bool(load and load.fold_norm_affine)
    if not write.stream:
        progress(f"loading {path}")
        loaded = load_model(path, load)
        if write_dtype(write) not in (None, loaded.dtype) and _family(loaded) in ("llama", STANDARD_FAMILY):
            raise UsageError(  # before the trace: a complete fold is written as a Hugging Face folder
                "--dtype: a language model's Hugging Face folder keeps the checkpoint's dtype; leave out --dtype"
            )
        if verify is not None and loaded.token_input:  # question 2 before the trace; with generation after the plan
            from slabconv.verify.generate import check_language_checks_fit

            check_language_checks_fit(loaded, replace(verify, generate=0), onnx=False)
        return InMemory(loaded, plan(loaded, progress, norm_affine=norm_affine))
    return_freed_blocks_to_the_os()
    sharded = open_sharded(path, FOLD_BLOCK)
    planning, planned = plan_sharded(
        sharded.shards, sharded.config, load.arch if load else None, sharded.sha256, progress, norm_affine
    )
    return Streamed(planning.loaded, planned, sharded)


# --------------------------------------------------------------------------------------------- plan


@dataclass
class Planned:
    """A model's fold: the traced original, the fused graph, one decision per norm and the fold program.

    Attributes:
        original: the unfolded graph (``engine.capture``), kept for the float64 reference; None for a streamed
            plan (its graph holds stand-ins, and is the ``fused`` one).
        fused: the fused graph (the engine applied every decision; of a plan from three decoder layers, the
            three-layer graph).
        decisions: one per norm, in graph order.
        example: the input the graphs were traced with.
        program: one recipe per tensor the fused model stores (``engine.program``).
        traced_blocks: a streamed plan of a deep decoder made from a capture with fewer layers
            (``engine.repeat``): (layers traced, layers planned); None when every layer was traced.
        exported: the program ``original`` was unlifted from, which the writer lifts ``fused`` back into
            (``engine.lift_program``); None when ``fused`` is not its fold (streamed, ``fuse --dtype``'s cast).
        fold64: the float64 fold ``fused`` was cast from (``fuse --dtype`` with verification,
            ``verify.reference.Float64Fold``): question 1 takes it rather than folding again; else None.
    """

    original: fx.GraphModule | None
    fused: fx.GraphModule
    decisions: list[engine.Decision]
    example: torch.Tensor
    program: engine.FoldProgram | None = None
    traced_blocks: tuple[int, int] | None = None
    exported: torch.export.ExportedProgram | None = None
    fold64: Any = None

    @property
    def complete(self) -> bool:
        """Every norm folded away (nothing kept as an affine or as it was)."""
        return all(d.action.startswith("folded") for d in self.decisions)


def plan(
    loaded: LoadedModel,
    progress: Progress = no_progress,
    unknown: frozenset[str] = frozenset(),
    repeat: engine.Repeat | None = None,
    norm_affine: bool = False,
) -> Planned:
    """Trace ``loaded.model`` (a ``.pt2`` of a dynamic batch: its program is the capture, not traced again; one of a
    static batch is traced again, so that the fused program takes any batch the model's code allows) and fold every
    norm (the engine's capture, plan and apply).

    Args:
        norm_affine: also fold the affine of every LayerNorm, RMSNorm and GroupNorm
            (``LoadOptions.fold_norm_affine``).
        unknown: stand-in tensors of a streamed planning instance: the program is left unevaluated, and every
            norm must fold away.
        repeat: ``loaded.model`` holds three of the real model's ``repeat.depth`` decoder layers
            (``engine.fold_repeated``); raises ``Unrepeatable`` when one layer's plan cannot stand for another's.

    Raises:
        UnsupportedModelError: torch.export cannot trace the model; a streamed plan keeps a norm, or stores a
            tensor the checkpoint does not hold.
        InputError: a norm in train mode; damaged norm statistics.
    """
    example = loaded.trace_example()
    exported = loaded.own_program
    if exported is None:
        progress("tracing the model with torch.export")
        with quiet():
            exported = engine.capture_program(loaded.model, example, sequence=loaded.max_sequence)
    traced = engine.unlifted(exported)
    original = None if unknown else traced
    fused = traced if unknown else engine.copy_sharing(traced)  # the weights are not held twice

    def folded(name: str, done: int, total: int) -> None:
        progress("folding norms", done, total)

    progress("folding norms")
    traced_blocks = None
    if repeat is None:
        decisions, program = engine.fold_program(fused, folded, unknown=unknown, norm_affine=norm_affine)
    else:

        def block(done: int, total: int) -> None:
            progress("planning each decoder layer from its own values", done, total)

        repeated = engine.fold_repeated(fused, repeat, folded, unknown, block, norm_affine)
        if repeated is None:
            raise Unrepeatable()
        decisions, program = repeated
        traced_blocks = (engine.SLOTS, repeat.depth)
    for i, d in enumerate(decisions, 1):  # --verbose: each decision, as the fold table will show it
        into = f" into {', '.join(d.into)}" if d.into else ""
        line = f"{d.norm} ({i}/{len(decisions)}): {d.action}{into}" + (f" ({d.reason})" if d.reason else "")
        progress("folding norms", len(decisions), len(decisions), line)
    in_train = [d for d in decisions if d.action == engine.KEPT and d.reason == engine.reasons.TRAIN_MODE]
    if in_train:
        raise InputError(
            f"{loaded.checkpoint.path}: norm {in_train[0].norm} is in train mode (it normalises with batch "
            "statistics, not a fixed affine); put the model in eval mode (model.eval()) before saving or exporting it"
        )
    if unknown:
        _require_streamable(decisions, program)
    return Planned(original, fused, decisions, example, program, traced_blocks, None if unknown else exported)


class Unrepeatable(Exception):
    """A plan from a capture with fewer decoder layers cannot stand for every layer (``engine.fold_repeated``)."""


def plan_sharded(
    shards: LazyShards,
    config: dict[str, Any],
    arch: str | None,
    sha256: str,
    progress: Progress = no_progress,
    norm_affine: bool = False,
) -> tuple[PlanningModel, Planned]:
    """The streamed plan of a safetensors folder read by ``shards``: what ``fuse --stream`` folds by, and what
    ``verify --stream`` checks a fused folder against (question 1).

    A decoder whose layers are alike (``load.lazy.stack_depth``: the same names, dtypes and shapes in every
    layer) and has more than three is planned from a capture of three of them, each layer from its own values
    (``engine.repeat``); when that is not sound for this model (a fold that crosses layers, layers that fold
    differently), or the architecture cannot be built with three layers, every layer is traced.

    Raises:
        UnsupportedModelError, InputError: as ``load.lazy.planning_model`` and ``plan``.
    """
    from slabconv.zoo.registry import ArchMismatch, checked_against

    progress("building the full-size architecture with stand-in weights")
    stack = _stack(shards)
    if stack is not None:
        prefix, depth = stack
        # stand-ins of every tensor, for the --arch check only (shapes are what names a preset)
        whole = {k: torch.zeros((), dtype=d).expand(shape) for k, (d, shape) in shards.specs().items()} if arch else {}
        try:
            with checked_against(arch, whole, config):  # --arch names the whole depth (llama_350m_prepbn: 18)
                planning = planning_model(BlockSlots(shards, prefix, (0, 1, depth - 1)), config, arch, sha256)
        except ArchMismatch:
            raise
        except (InputError, UnsupportedModelError):
            pass  # the architecture is not built from the layers it is given: trace every layer
        else:
            repeat = engine.Repeat(prefix, depth, functools.partial(planning.block_values, shards, prefix))
            try:
                return planning, plan(planning.loaded, progress, frozenset(planning.unknown), repeat, norm_affine)
            except Unrepeatable:
                progress("the decoder layers fold differently: tracing every layer")
    planning = planning_model(shards, config, arch, sha256)
    return planning, plan(planning.loaded, progress, frozenset(planning.unknown), norm_affine=norm_affine)


def _stack(shards: LazyShards) -> tuple[str, int] | None:
    """The decoder layer prefix and depth of a folder whose model is planned from three layers, else None."""
    from slabconv.zoo.decoder import family_of

    try:
        prefix = family_of(shards.weight_map).layer_prefix
    except UnsupportedModelError:
        return None
    depth = stack_depth(shards.specs(), prefix)
    return (prefix, depth) if depth is not None and depth > engine.SLOTS else None


def _require_streamable(decisions: list[engine.Decision], program: engine.FoldProgram) -> None:
    """A streamed output is weights only: every norm folds away (or, the affine of a LayerNorm / RMSNorm / GroupNorm,
    stays whole in its op) and every stored tensor comes from the checkpoint."""
    kept = [d for d in decisions if not _whole(d)]
    if kept:
        d = kept[0]
        raise UnsupportedModelError(
            f"a streamed fold needs every norm to fold away; the plan for {d.norm} is {d.action} ({d.reason}); "
            "fold this model in memory without --stream"
        )
    made = sorted(k for k, r in program.tensors.items() if r.op == "const")
    if made:
        raise UnsupportedModelError(
            f"the fused model stores {made[0]!r}, which the checkpoint does not hold; "
            "fold it in memory without --stream"
        )


def measured_ranges(planned: Planned) -> list[engine.LayerRange] | None:
    """Each folded layer's weight ranges before and after (``engine.ranges``), measured as the fold program ran
    (in memory when it was planned, streamed as it was written), with each flagged layer's warning added to its
    norms' decisions; None without a program."""
    if planned.program is None:
        return None
    ranges = list(planned.program.ranges.values())
    engine.flag_warnings(planned.decisions, ranges)
    return ranges


# --------------------------------------------------------------------------------------------- checks


def require_folded(report: Report) -> None:
    """``--require-folded``: refuse, before anything is written, a plan that keeps a norm.

    Raises:
        KeptNormsError: naming each kept norm and its reason (the first ``KEPT_NAMED``), with ``report`` (the plan)
            for the caller's JUnit file.
    """
    kept = [d for d in report.folds or [] if not d.action.startswith("folded")]
    if not kept:
        return
    named = ", ".join(f"{d.norm} ({d.reason or d.action})" for d in kept[:KEPT_NAMED])
    more = f" and {len(kept) - KEPT_NAMED} more" if len(kept) > KEPT_NAMED else ""
    raise KeptNormsError(
        f"--require-folded: {count(len(kept), 'norm')} of {len(report.folds or [])} would be kept: {named}{more}; "
        "nothing was written (each reason: docs/reasons.md; slabconv inspect shows the plan)",
        report,
    )


KEPT_NAMED = 8
"""How many kept norms the ``--require-folded`` message names (the JUnit file and ``inspect`` list them all)."""


def write_dtype(write: WriteOptions) -> torch.dtype | None:
    """The dtype ``write`` asks the fused model to be written in (``WriteOptions.dtype``: a torch dtype's name),
    checked before any work.

    Raises:
        UsageError: as ``WriteOptions.check`` (an unknown name, ``dtype`` with ``stream``, ...).
    """
    write.check()
    return None if write.dtype is None else getattr(torch, write.dtype)


def check_stream_options(
    path: Path, verify: VerifyOptions | None, write: WriteOptions, arch: str | None = None
) -> None:
    """What a streamed fold cannot do, refused before any work.

    Raises:
        UsageError: ``onnx`` (a streamed fold writes safetensors only); verify options a streamed verification
            cannot take (``VerifyOptions.check_streamed``: a runtime other than pytorch); verification
            of a model that is not a decoder language model (no streamed question 2).
        UnsupportedModelError: that model's architecture is not named (``arch``) and its weights' names and shapes
            fit no registered layout (``zoo.detect_arch`` on the shard headers): no streamed fold could load it,
            with or without verification.
    """
    if not write.stream:
        return
    from slabconv.load.hf import hf_weights_file
    from slabconv.zoo.decoder import decoder_layout, family_of

    if write.onnx:
        raise UsageError(
            "--stream writes safetensors only: ONNX export of a multi-GB model is not supported in streaming mode; "
            "add --no-onnx"
        )
    if verify is None:
        return
    verify.check_streamed()
    found = hf_weights_file(path) if path.is_dir() else None
    if found is not None and found[1] in ("hf-safetensors-sharded", "hf-safetensors"):
        shards = LazyShards.open(path)
        weight_map = shards.weight_map
        try:
            family_of(weight_map)
        except UnsupportedModelError:
            if decoder_layout(weight_map):  # a decoder streamed mode refuses for a reason of its own: loading names it
                return
            if arch is None:
                _detectable(shards)
            raise UsageError(
                f"--stream verifies decoder language models one layer at a time; {path} has no streamed question 2: "
                "fold it in memory, or pass --no-verify and run slabconv verify on the two folders"
            ) from None


def _detectable(shards: LazyShards) -> None:
    """Refuse a folder whose architecture ``zoo.detect_arch`` finds in no registered layout, from its shard headers
    alone (``shards``, already open: tensors of their shapes on the meta device; detection reads names and shapes,
    never values).

    Raises:
        UnsupportedModelError: ``FOLDER: could not detect the architecture ...``, as loading would.
    """
    from slabconv.load import hf
    from slabconv.zoo import detect_arch

    folder = shards.folder
    specs = shards.specs()
    state = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in specs.items()}
    config = hf.read_hf_config(folder) if (folder / hf.CONFIG).is_file() else {}
    try:
        detect_arch(state, config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{folder}: {err}") from None
    except Exception:  # noqa: BLE001 - a layout whose detection reads values: loading decides
        return


def writes_hf_folder(loaded: LoadedModel, planned: Planned) -> bool:
    """A fused language model of a zoo family is written as a Hugging Face folder: LLaMA-PRepBN when every norm
    folded (the norm-free model), a standard decoder (LLaMA, Mistral, Qwen2) always (its own architecture, the norms
    it keeps included)."""
    family = _family(loaded)
    return (family == "llama" and planned.complete) or family == STANDARD_FAMILY


def _family(loaded: LoadedModel) -> str | None:
    from slabconv.zoo import get_arch

    return get_arch(loaded.arch).family if loaded.arch is not None else None


def _check_one_dtype(sharded: ShardedFolder, program: engine.FoldProgram) -> None:
    """A streamed fold writes each tensor in the dtype the writer gives it (a folded layer's weight in the plan's
    dtype, a copied tensor in its own), and the Hugging Face folder it writes has one ``torch_dtype``: refuse,
    before writing, a fold whose written tensors would mix float dtypes (an input whose shards mix them). Norm
    statistics in another dtype are not written, so they do not count.

    Raises:
        UsageError: naming the input folder and a written tensor of each dtype.
    """
    specs = sharded.shards.specs()
    floats: dict[torch.dtype, str] = {}
    for key, recipe in program.tensors.items():
        layer = program.layers.get(key)
        written = [(key, layer.dtype)] if layer is not None else [(key, specs[key][0])] if recipe.op == "copy" else []
        if layer is not None and layer.bias_out is not None:
            written.append((layer.bias_out, layer.bias_dtype))
        for name, dtype in written:
            if dtype.is_floating_point and not name.endswith("inv_freq"):
                floats.setdefault(dtype, name)
    if len(floats) > 1:
        each = ", ".join(f"{name} is {str(d).removeprefix('torch.')}" for d, name in floats.items())
        raise UsageError(
            f"{sharded.shards.folder}: the weights mix dtypes ({each}), and the Hugging Face folder a streamed fold "
            "writes has one dtype; fold it in memory without --stream (it writes one dtype)"
        )


def cast_planned(loaded: LoadedModel, planned: Planned, dtype: torch.dtype, keep: bool = False) -> Planned:
    """The fused model in ``dtype``: the float64 fold (``verify.reference.float64_fold``) cast once, so each
    written value is the exact fold correctly rounded (question 1 checks it to 0 units in the last place). ``keep``:
    the float64 fold is kept (``Planned.fold64``) for the verification.

    Raises:
        NumericError: a fused tensor overflows ``dtype`` (named).
    """
    from slabconv.verify.policy import dtype_name
    from slabconv.verify.reference import cast_graph, float64_fold

    if dtype == loaded.dtype:
        return planned
    assert planned.original is not None
    fold64 = float64_fold(planned.original, planned.example, engine.folds_norm_affine(planned.decisions))
    cast = cast_graph(fold64.fused64, dtype)
    for name, tensor in engine.fused_state_dict(cast).items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NumericError(
                f"{loaded.checkpoint.path}: the fused tensor {name} does not fit {dtype_name(dtype)} (a value beyond "
                "its range); nothing was written: leave out --dtype, or write bfloat16"
            )
    example = planned.example.to(dtype) if planned.example.is_floating_point() else planned.example
    return Planned(planned.original, cast, planned.decisions, example, planned.program, fold64=fold64 if keep else None)


# --------------------------------------------------------------------------------------------- write


def _metadata(loaded: LoadedModel, planned: Planned) -> dict[str, str]:
    """The fused safetensors metadata of a fold (``load.fused``): with ``norm_affine`` where it folded the affine of
    a LayerNorm / RMSNorm / GroupNorm, whose normalisation stays; ``complete`` when every norm folded away or, such
    an affine, stayed whole in its op."""
    norm_affine = engine.folds_norm_affine(planned.decisions)
    complete = planned.complete or (norm_affine and all(_whole(d) for d in planned.decisions))
    weights = _source_weights(loaded)
    return fused_metadata(loaded.arch, loaded.checkpoint.sha256, complete, loaded.config, norm_affine, weights)


def _source_weights(loaded: LoadedModel) -> str | None:
    """Which weights of a training checkpoint or release were taken (``model``, ``state_dict_ema`` with
    ``--ema``...); None for any other format."""
    fmt = loaded.checkpoint.format
    return loaded.checkpoint.extra.get("weights") if fmt in ("training-checkpoint", "release") else None


def onnx_provenance(loaded: LoadedModel, decisions: list[engine.Decision] | None) -> dict[str, str]:
    """The ``metadata_props`` of an ``.onnx`` made from ``loaded`` (``write.onnx.provenance``): its fold by
    ``decisions``, or with None the original (``export --no-fuse``)."""
    folded = decisions is not None
    norm_affine = folded and engine.folds_norm_affine(decisions or [])
    return provenance(loaded.checkpoint.sha256, loaded.arch, folded, norm_affine, _source_weights(loaded))


def _whole(decision: engine.Decision) -> bool:
    """A norm folded away, or the affine of a LayerNorm / RMSNorm / GroupNorm kept whole in its op: the fused
    weights then hold the architecture's own tensors."""
    return decision.action.startswith("folded") or decision.kind in engine.NORM_AFFINE_KINDS


def _write_files(
    folder: Path,
    loaded: LoadedModel,
    planned: Planned,
    write: WriteOptions,
    metadata: dict[str, str],
    progress: Progress,
) -> Outputs:
    """In memory: ``model.safetensors`` (with ``metadata``, ``_metadata``), then one ``torch.export`` of the fused
    graph saved as ``model.pt2`` and translated to ``model.onnx`` (recording its source: ``onnx_provenance``)."""
    tensors = engine.fused_state_dict(planned.fused)
    progress("writing model.safetensors")
    save_safetensors(tensors, folder / "model.safetensors", metadata)
    outputs = Outputs(files=["model.safetensors"], safetensors="model.safetensors")
    exported = None
    if write.pt2 or write.onnx:  # one exported program of the fused model (lifted, or traced again) serves both
        progress("exporting the fused program")
        try:
            exported = export_program(planned.fused, planned.example, planned.exported)
        except UnsupportedModelError:
            if write.pt2:
                raise
            # --no-pt2: the ONNX exporter's own capture (it has fallbacks torch.export lacks) gets its chance
    if write.pt2 and exported is not None:
        progress("writing model.pt2")
        kept = ("arch", "source_sha256", "norm_affine", "source_weights")
        recorded: dict[str, str] = {k: metadata[k] for k in kept if k in metadata}
        save_pt2(exported[0], {**exported[1], **recorded}, folder / "model.pt2")  # its provenance, as the others
        outputs.pt2 = "model.pt2"
        outputs.files.append("model.pt2")
    if write.onnx:
        progress("exporting model.onnx")
        release_memory(collect=False)  # what was freed goes back first: the translation does not reuse it
        info = export_onnx(
            planned.fused, planned.example, folder / "model.onnx", opset=write.opset, program=exported,
            simplify=write.simplify, metadata=onnx_provenance(loaded, planned.decisions),
        )  # fmt: skip
        outputs.onnx = "model.onnx"
        outputs.files += ["model.onnx", *([info["external_data"]] if info["external_data"] else [])]
        outputs.onnx_info = info
    if write.pt2 and exported is not None:
        pt2_axes = {f"pt2_{key}": exported[1][key] for key in ("dynamic_batch", "dynamic_sequence")}
        outputs.onnx_info = {**(outputs.onnx_info or {}), **pt2_axes}
    return outputs


# --------------------------------------------------------------------------------------------- the doors


@dataclass
class _TorchDoor:
    """What the two doors of a model planned from its PyTorch graph share (``InMemory``, ``Streamed``): the model,
    its plan, whether the fused model goes out as a Hugging Face folder, and the writing of that folder."""

    loaded: LoadedModel
    planned: Planned

    @property
    def hf_folder(self) -> bool:
        """The fused model goes out as a Hugging Face folder (``writes_hf_folder``)."""
        return writes_hf_folder(self.loaded, self.planned)

    def require_transformers(self, verify: VerifyOptions | None, write: WriteOptions) -> None:
        """transformers, where a language model's ``decoder.onnx`` or its generation check needs it; then, where
        transformers is installed, an original ``config.json`` that it reads (``check_transformers_reads``), as the
        fused folder must be read: said before writing.

        Raises:
            UsageError: transformers is not installed.
            InputError: transformers refuses the original's ``config.json``.
        """
        if not self.hf_folder:
            return
        from slabconv.write.hf_llama import check_transformers_reads, require_transformers

        if write.onnx or (verify is not None and verify.generate != 0):
            require_transformers(fusing=True)
        if importlib.util.find_spec("transformers") is not None:
            check_transformers_reads(self.loaded.config, self.loaded.checkpoint.path / "config.json")

    def write_hf_folder(
        self, folder: Path, outputs: Outputs, metadata: dict[str, str], progress: Progress, write: WriteOptions
    ) -> None:
        """Where the fused model goes out as a Hugging Face folder, its files written into ``folder`` and named in
        ``outputs``: the Hugging Face model folder files of a fused language model (with the original's tokenizer
        files and the settings of its ``generation_config.json``), and with ``write.onnx`` its decoder ONNX with
        past key/values in ``write.opset`` (None: the exporter's). ``config.json`` records the weights' fused
        ``metadata`` too (its provenance: what transformers' ``save_pretrained`` keeps)."""
        from slabconv.write.decoder_onnx import export_decoder_onnx, write_genai_config
        from slabconv.write.hf_llama import (
            STANDARD_TYPES,
            copy_tokenizer_files,
            original_generation,
            write_hf_llama_metadata,
            write_hf_standard_metadata,
        )

        if not self.hf_folder:
            return
        loaded = self.loaded
        progress("writing the Hugging Face model folder")
        generation = original_generation(loaded.checkpoint.path)
        if loaded.config.get("model_type") in STANDARD_TYPES and loaded.arch in STANDARD_TYPES:
            folded = engine.folds_norm_affine(self.planned.decisions)  # the norm weights folded (all 1)
            made = write_hf_standard_metadata(
                folder, loaded.config, folded=folded, generation=generation, provenance=metadata
            )
        else:
            made = write_hf_llama_metadata(folder, loaded.config, generation=generation, provenance=metadata)
        outputs.files += [p.name for p in made] + [p.name for p in copy_tokenizer_files(loaded.checkpoint.path, folder)]
        outputs.hf_folder = True
        if write.onnx:
            progress("exporting decoder.onnx (with past key/values)")
            info = export_decoder_onnx(folder, folder / "decoder.onnx", opset=write.opset)
            outputs.files += [f.name for f in onnx_files(folder / "decoder.onnx")]
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            outputs.files.append(write_genai_config(folder, info, config).name)
            outputs.decoder_onnx = "decoder.onnx"

    @property
    def decisions(self) -> list[engine.Decision]:
        return self.planned.decisions

    def source(self) -> Source:
        return self.loaded.source()

    def ranges(self) -> list[engine.LayerRange] | None:
        return measured_ranges(self.planned)

    def plan_note(self) -> dict[str, str] | None:
        return None


@dataclass
class InMemory(_TorchDoor):
    """A model loaded whole (a checkpoint, a ``.pt2`` program, a Hugging Face folder, a fused safetensors file) and its
    plan: written as ``model.safetensors``, ``model.onnx`` and ``model.pt2`` (and a language model's Hugging Face
    folder with ``decoder.onnx``), verified file by file (``verify.verifier.verify``)."""

    mode: str = "in-memory"

    def check(self, verify: VerifyOptions | None, write: WriteOptions) -> None:
        """transformers where a language model needs it; a language model's checks (question 2, greedy generation,
        the task metrics) that fit in memory; a fused output that is finite (named norm otherwise); then the fused
        model cast to ``--dtype``.

        Raises:
            UsageError: transformers missing for ``decoder.onnx`` or the generation check; a language model's checks
                too big for the memory available.
            NumericError: the fused model's output is not finite on the example, or overflows ``--dtype``.
        """
        self.require_transformers(verify, write)
        if verify is not None and self.loaded.token_input:
            from slabconv.verify.generate import check_language_checks_fit

            folder = self.hf_folder  # greedy generation checks the folder it writes
            opts = verify if folder else replace(verify, generate=0)
            check_language_checks_fit(self.loaded, opts, onnx=write.onnx and folder)
        assert self.planned.original is not None
        faults.check_finite(
            self.loaded, self.planned.original, self.planned.fused, self.planned.decisions, self.planned.example
        )
        dtype = write_dtype(write)
        if dtype is not None and dtype != self.loaded.dtype:  # ``--dtype float32`` of a float32 checkpoint: its own
            self.planned = cast_planned(self.loaded, self.planned, dtype, keep=verify is not None)

    def write(self, folder: Path, write: WriteOptions, progress: Progress) -> tuple[Outputs, dict[str, str]]:
        loaded, planned = self.loaded, self.planned
        metadata = _metadata(loaded, planned)
        outputs = _write_files(folder, loaded, planned, write, metadata, progress)
        self.write_hf_folder(folder, outputs, metadata, progress, write)
        return outputs, {}

    def verify(self, folder: Path, opts: VerifyOptions, write: WriteOptions, progress: Progress) -> Verification:
        """The one verifier on the original (with the graph traced and the plan made) and the folder written."""
        from slabconv.verify import sides, verifier

        planned = self.planned
        reference = sides.model_side(self.loaded, graph=planned.original, example=planned.example,
                                     decisions=planned.decisions, fold64=planned.fold64)  # fmt: skip
        planned.fold64 = None  # held by the side alone: question 1 lets it go
        candidate = sides.output_side(folder, Source(str(folder), None, "slabconv-output"))
        candidate.module = planned.fused  # what PyTorch runs when no program was written (--no-onnx --no-pt2)
        return verifier.verify(reference, candidate, _steps(opts, self.hf_folder), just_folded=True, progress=progress)


@dataclass
class Streamed(_TorchDoor):
    """A sharded folder folded shard by shard (``--stream``): planned on the full-size architecture with stand-in
    weights (``slabconv.load.lazy``), written one block of rows at a time with the input's shard boundaries,
    verified one decoder layer at a time (``verify.verifier.verify`` on two streamed sides)."""

    sharded: ShardedFolder
    mode: str = "streamed"

    def source(self) -> Source:
        return self.sharded.source(self.loaded.arch)

    def plan_note(self) -> dict[str, str] | None:
        note = {"planning": "the full-size architecture, stand-in weights (slabconv.load.lazy)"}
        if self.planned.traced_blocks is not None:
            traced, depth = self.planned.traced_blocks
            note["planning"] = (
                f"the architecture with {traced} of its {depth} decoder layers (the first, the second, the last), "
                "stand-in weights (slabconv.load.lazy); every layer planned from its own values "
                "(slabconv.engine.repeat)"
            )
        return note

    def check(self, verify: VerifyOptions | None, write: WriteOptions) -> None:
        """transformers where a language model needs it, one dtype for what a language model's folder gets
        (``_check_one_dtype``), and a generation check that fits in memory (each block is checked for overflow as
        the writer folds it).

        Raises:
            UsageError: transformers missing; written tensors of two dtypes; a generation check too big for the
                memory available.
            InputError: ``--inputs`` the model cannot take (``generate_streamed.given_sequences``).
        """
        self.require_transformers(verify, write)
        if self.hf_folder and self.planned.program is not None:
            _check_one_dtype(self.sharded, self.planned.program)
        if verify is not None and self.hf_folder:  # the inputs (--inputs, holdout.npz) are read whatever the steps
            from slabconv.verify.generate_streamed import check_generation_fits

            folder, sequences = self.sharded.shards.folder, verify.sample_count(streamed=True)
            steps, seed = verify.fuse_steps(), verify.seed
            check_generation_fits(folder, steps, sequences, seed, inputs=verify.inputs, limit=verify.samples)

    def write(self, folder: Path, write: WriteOptions, progress: Progress) -> tuple[Outputs, dict[str, str]]:
        from slabconv.load.hf import SAFETENSORS_INDEX
        from slabconv.write.shards import write_program_shards

        loaded, planned, sharded = self.loaded, self.planned, self.sharded
        assert planned.program is not None
        metadata = _metadata(loaded, planned)
        weight_map, total, digests = write_program_shards(
            folder, sharded.shards, sharded.shard_names, planned.program, metadata, progress, FOLD_BLOCK
        )
        if sharded.sharded:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            outputs = Outputs(files=[SAFETENSORS_INDEX, *sharded.shard_names], safetensors=SAFETENSORS_INDEX)
        else:  # one model.safetensors in, one out (no index)
            outputs = Outputs(files=list(sharded.shard_names), safetensors=sharded.shard_names[0])
        self.write_hf_folder(folder, outputs, metadata, progress, write)  # write.onnx: never with --stream
        return outputs, digests

    def verify(self, folder: Path, opts: VerifyOptions, write: WriteOptions, progress: Progress) -> Verification:
        """The one verifier on two streamed sides: the source with its fold program, and the folder written."""
        from slabconv.verify import sides, verifier

        reference = sides.streamed_side(self.sharded.shards.folder, self.planned.program)
        candidate = sides.streamed_side(folder)
        return verifier.verify(reference, candidate, _steps(opts, self.hf_folder), just_folded=True, progress=progress)


def _steps(opts: VerifyOptions, language_model: bool) -> VerifyOptions:
    """``opts`` with the greedy-generation steps ``fuse`` compares: ``fuse_steps()`` for a language model, none
    otherwise (``verify`` compares them only when asked)."""
    return replace(opts, generate=opts.fuse_steps() if language_model else None)


# --------------------------------------------------------------------------------------------- finish


def finish(
    report: Report, folder: Path, out_dir: Path, outputs: Outputs, written: dict[str, str] | None = None
) -> None:
    """Name ``out_dir`` in the report instead of the staging ``folder``; refuse a fold that did not pass; record
    every written file's sha256 and write ``report.json`` (the staging folder then moves into place).

    Args:
        written: the sha256 of files whose writer hashed the bytes as it wrote them (file name -> hex digest);
            every other file is read back and hashed here.

    Raises:
        VerificationError: a check failed; nothing is written, the report names no output file.
    """
    report.rename(folder, out_dir)
    if report.verification is not None and not report.verification.passed:
        raise VerificationError(
            "the fused model is not equivalent: " + report.verification.failure_line() + "; nothing was written",
            report,
        )
    known = written or {}
    outputs.sha256 = {name: known.get(name) or sha256_file(folder / name) for name in outputs.files}
    report.outputs = outputs
    report.write(folder / "report.json")


# --------------------------------------------------------------------------------------------- verify


def open_sides(
    reference: Path, candidate: Path, load: LoadOptions | None, opts: VerifyOptions, stream: bool, progress: Progress
) -> tuple[Side, Side, VerifyOptions]:
    """The two sides ``api.verify`` compares, and the options the verifier takes: ``opts``, where a fused
    language-model folder is compared with its original (a model slabconv builds: not an ``.onnx``, not a folder
    ``fuse`` wrote, with its ``report.json`` or without), with greedy generation checked as ``fuse`` does
    (``VerifyOptions.fuse_steps`` tokens unless ``opts.generate`` says otherwise). With ``stream``, two decoder
    folders compared one layer at a time, in bounded memory (``slabconv.verify.layerwise``); when the candidate is a
    fold of the reference, the reference carries its fold program (a fresh streamed plan, ``plan_sharded``; with the
    norms' affines folded too when ``load.fold_norm_affine`` or the candidate records a fold made so) for question 1.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``verify.sides.open_side`` and ``streamed_side`` (a side
            that is a file, or no decoder folder of a family slabconv streams, with ``stream``); a generation check
            that cannot fit in memory.
    """
    from slabconv.load.formats import engine_of
    from slabconv.load.paths import is_output_folder
    from slabconv.verify import sides

    def fused_folder(path: Path) -> bool:  # a folder fuse wrote for a language model (report.json or not)
        return path.is_dir() and sides.is_fused_language_model(path)

    original = engine_of(reference) != "onnx" and not is_output_folder(reference) and not fused_folder(reference)
    fused = fused_folder(candidate)
    if opts.generate is None and original and fused:
        opts = replace(opts, generate=opts.fuse_steps())
    if not stream:
        progress("opening the reference and the candidate")
        ref = sides.open_side(reference, load)
        return ref, sides.open_side(candidate, load, reference=ref), opts
    from slabconv.verify.generate_streamed import check_generation_fits

    ref, cand = sides.streamed_side(reference), sides.streamed_side(candidate)
    sequences = opts.sample_count(streamed=True)  # the inputs (--inputs, holdout.npz) are read whatever the steps
    check_generation_fits(reference, opts.generate, sequences, opts.seed, inputs=opts.inputs, limit=opts.samples)
    if sides.folded_from(ref, cand):
        progress("planning the reference's fold, for question 1")
        affine = bool(load and load.fold_norm_affine) or (cand.provenance is not None and cand.provenance.norm_affine)
        src = open_sharded(reference, FOLD_BLOCK)  # as fuse --stream opens it
        digest = ref.source.sha256 or ""  # the folder's, hashed once (``hf.folder_sha256``)
        ref.program = plan_sharded(src.shards, src.config, None, digest, norm_affine=affine)[1].program
    return ref, cand, opts


# --------------------------------------------------------------------------------------------- the driver


@frozen_heap()
def run_fuse(
    path: Path,
    out_dir: Path,
    *,
    load: LoadOptions | None,
    verify: VerifyOptions | None,
    write: WriteOptions,
    progress: Progress = no_progress,
) -> Report:
    """Fold every norm of the model at ``path`` into ``out_dir`` (checked by the caller), whatever its format and mode
    (``open_door``): open and plan -> check -> stage -> write -> verify -> finish. Returns the report (also written
    as ``report.json``) and raises what ``api.fuse`` documents; whatever it raises, nothing is written."""
    write_dtype(write)
    door = open_door(path, load, verify, write, progress)
    if write.require_folded:  # before any work on the files: the plan alone decides
        require_folded(Report("fuse", source=door.source(), folds=door.decisions, out_dir=str(out_dir)))
    door.check(verify, write)
    report = Report("fuse", source=door.source(), folds=door.decisions, out_dir=str(out_dir), mode=door.mode)
    report.plan = door.plan_note()
    with staging_dir(out_dir, write.force) as tmp:
        outputs, written = door.write(tmp, write, progress)
        report.ranges = door.ranges()  # a streamed door measures them as it writes
        if verify is not None:
            started = time.monotonic()
            report.verification = door.verify(tmp, verify, write, progress)
            report.verification.seconds = time.monotonic() - started
        finish(report, tmp, out_dir, outputs, written)
    return report


def run_inspect(path: Path, load: LoadOptions | None, progress: Progress = no_progress) -> Report:
    """The fold plan of the model at ``path``, whatever its format (``open_door``); nothing is written.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``open_door``.
    """
    door = open_door(path, load, None, WriteOptions(), progress)
    return Report("inspect", source=door.source(), folds=door.decisions, ranges=door.ranges())
