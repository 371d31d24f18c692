"""``slabconv verify REFERENCE CANDIDATE``: both questions for any two sides.

A side is a checkpoint, a Hugging Face folder, a ``.pt2``, an ``.onnx``, a fused ``model.safetensors``, or a
folder ``fuse`` wrote (in memory or streamed). The reference, when it is a model slabconv can trace, gives the
float64 reference; an ``.onnx`` reference is evaluated in float64 as a graph (``slabconv.verify.onnx_original``),
any other reference a runtime runs in its own dtype (the candidate is then compared with it directly, and the report
says so). Question 1 applies when the candidate is something slabconv wrote: its tensors must equal a fresh float64 fold
of the reference (for an ``.onnx`` reference, when the candidate was folded from that file).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv import engine
from slabconv.errors import InputError, UsageError
from slabconv.load.formats import engine_of
from slabconv.load.fused import FusedMetadata, WrittenReport, is_output_folder
from slabconv.load.model import LoadedModel, load_model
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions
from slabconv.util import Progress, frozen_heap, quiet, sha256_file
from slabconv.verify import judge
from slabconv.verify.inputs import choose_inputs
from slabconv.verify.integrity import check_onnx_file
from slabconv.verify.policy import dtype_name
from slabconv.verify.reference import float64_fold
from slabconv.verify.results import IntegrityCheck, Verification
from slabconv.verify.run import (
    Reference,
    check_reference,
    output_names,
    question_1_graph,
    question_2,
    runtime_summary,
)
from slabconv.verify.runtimes import (
    Runtime,
    RuntimeUnavailable,
    onnx_runtimes,
    run_batched,
    select_runtimes,
    torch_runner,
    torch_runtime,
)
from slabconv.write.onnx import onnx_files, written_by_slabconv


@dataclass
class Side:
    """One side of ``verify``: what it is, how to run it, and what slabconv wrote into it.

    Attributes:
        source: the report entry.
        runtimes: how it runs (onnxruntime for an ``.onnx``, PyTorch for a model; both for a fuse output folder).
        loaded: the model, when the side is one slabconv can build (None for an ``.onnx``).
        input_shape: one sample's input shape, when fixed.
        token_input: it takes integer ids.
        written: the tensors of a slabconv output (for question 1), else None.
        norm_affine: that output was folded with ``fold_norm_affine`` (its metadata or report says so): question 1's
            float64 fold of the reference folds the affine of its LayerNorms / RMSNorms / GroupNorms too.
        integrity, notes: file checks and notes of this side.
    """

    source: Source
    runtimes: list[Runtime]
    loaded: LoadedModel | None
    input_shape: tuple[int, ...] | None
    token_input: bool
    written: dict[str, torch.Tensor] | None = None
    written_by_value: bool = False
    norm_affine: bool = False
    integrity: list[IntegrityCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _onnx_side(path: Path) -> Side:
    import onnx
    from onnx import numpy_helper

    passed, detail = check_onnx_file(path)
    check = IntegrityCheck(f"onnx.checker[full_check] {path.name}", passed, detail)
    model = onnx.load(str(path), load_external_data=False)
    tensor_type = model.graph.input[0].type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    token_input = bool(np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type), np.integer))
    files = onnx_files(path)
    source = Source(
        str(path), sha256_file(path), "onnx", extra={"files_sha256": {f.name: sha256_file(f) for f in files}}
    )
    side = Side(source, [], None, None if any(s <= 0 for s in shape[1:]) else shape[1:], token_input, integrity=[check])
    try:
        side.runtimes = onnx_runtimes(path)
    except RuntimeUnavailable as err:
        side.notes.append(f"{err}: {path.name} got onnx.checker's full check only")
    if written_by_slabconv(path):
        full = onnx.load(str(path))
        side.written = {t.name: _tensor(numpy_helper.to_array(t)) for t in full.graph.initializer}
        side.written_by_value = True
    return side


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor; bfloat16 (``ml_dtypes``, which torch cannot read) through its bits."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def open_side(path: Path, load: LoadOptions) -> Side:
    """Open one side of ``verify`` (see the module docstring).

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``load_model``, or an unreadable ``.onnx``.
    """
    if engine_of(path) == "onnx":
        return _onnx_side(path)
    if is_output_folder(path) and (path / "model.onnx").is_file() and not (path / "model.safetensors").is_file():
        return _onnx_side(path / "model.onnx")  # a folder fuse wrote from an ONNX original: its model.onnx
    loaded = load_model(path, load)
    dtype = loaded.dtype
    what = "fused output" if is_output_folder(path) else loaded.checkpoint.format
    runtimes = [torch_runtime(loaded.model, dtype, what, fixed_batch=loaded.batch)]
    side = Side(loaded.source(path), runtimes, loaded, loaded.input_shape, loaded.token_input)
    fused = FusedMetadata.read(loaded.checkpoint.metadata) if loaded.checkpoint.format != "torch.export" else None
    written = WrittenReport.read(path) if is_output_folder(path) else None  # a folder: its model.pt2 was loaded
    side.norm_affine = (fused is not None and fused.norm_affine) or (written is not None and written.norm_affine)
    if is_output_folder(path):
        side.written = _output_tensors(path)
        if (path / "model.onnx").is_file():
            onnx_side = _onnx_side(path / "model.onnx")
            side.runtimes = onnx_side.runtimes + side.runtimes
            side.integrity += onnx_side.integrity
            side.notes += onnx_side.notes
    elif fused is not None:
        side.written = dict(loaded.checkpoint.state_dict)
    return side


def _output_tensors(folder: Path) -> dict[str, torch.Tensor] | None:
    """The fused weights a fuse output folder holds (one file, or shards with their index)."""
    from slabconv.load.checkpoint import load_checkpoint

    if (folder / "model.safetensors").is_file():
        return dict(load_checkpoint(folder / "model.safetensors").state_dict)
    if (folder / "config.json").is_file():
        return dict(load_checkpoint(folder).state_dict)
    return None


def _reference(
    side: Side,
    x: np.ndarray,
    label: str,
    digest: str | None,
    candidate_dtype: torch.dtype | None = None,
    norm_affine: bool = False,
) -> tuple[Reference, Verification]:
    """The reference outputs: the model in its dtype and in float64 (question 1 for the graph included), or an
    ``.onnx`` reference's own outputs and its graph evaluated in float64
    (``slabconv.verify.onnx_original.float64_reference``).

    A candidate in a narrower dtype than the reference (``fuse --dtype float16`` of a float32 checkpoint) is held
    to the error of the reference cast to that dtype (``e_orig``), as ``fuse`` holds it (``run.make_reference``)."""
    verification = Verification(inputs=label, inputs_sha256=digest)
    if side.loaded is None:
        if not side.runtimes:
            raise InputError(f"{side.source.path}: onnxruntime cannot run the reference; give a model it can run")
        runtime = side.runtimes[0]
        original = run_batched(runtime.run, x, fixed_batch=runtime.fixed_batch)
        names = output_names(len(original), runtime.output_names)
        if engine_of(side.source.path) == "onnx":  # an ONNX original: its graph in float64 (docs/onnx.md)
            from slabconv.verify import onnx_original

            path = Path(side.source.path)
            exact, which = onnx_original.float64_reference(path, x, runtime.dtype, runtime.fixed_batch)
            reference = Reference(x, label, digest, runtime.dtype, original, exact, names)
            check_reference(reference)
            verification.reference = f"the reference ONNX graph in float64 ({which})"
            verification.notes += reference.notes
            return reference, verification
        verification.reference = f"the reference in {runtime.label}"
        verification.notes.append(
            "the reference is an ONNX file, which has no float64 evaluation: question 2 compares the candidate with "
            "it directly, at the dtype's tolerance"
        )
        return Reference(x, label, digest, runtime.dtype, original, None, names), verification
    loaded = side.loaded
    narrower = candidate_dtype is not None and candidate_dtype.itemsize < loaded.dtype.itemsize
    if narrower and loaded.dtype.is_floating_point and candidate_dtype is not None:
        cast = copy.deepcopy(loaded.model).to(candidate_dtype)
        runner = torch_runner(cast, candidate_dtype, round_to=loaded.dtype)
        verification.notes.append(
            f"the candidate computes in {dtype_name(candidate_dtype)}, the reference in {dtype_name(loaded.dtype)}: "
            f"the original's own error is that of the reference cast to {dtype_name(candidate_dtype)}"
        )
    else:
        runner = torch_runner(loaded.model, loaded.dtype)
    original = run_batched(runner, x, fixed_batch=loaded.batch)
    example = loaded.trace_example()
    with quiet():
        graph = engine.capture(loaded.model, example, sequence=loaded.max_sequence)
    original64, fused64, _ = float64_fold(graph, example, norm_affine)
    exact = run_batched(torch_runner(original64, torch.float64, round_to=loaded.dtype), x, fixed_batch=loaded.batch)
    dtype = dtype_name(loaded.dtype)
    reference = Reference(x, label, digest, dtype, original, exact, output_names(len(original)))
    check_reference(reference)
    verification.reference = "the reference model in float64 (pytorch)"
    verification.notes += reference.notes
    reference.fused64 = fused64
    return reference, verification


def _same_outputs(ref: Side, cand: Side, x: np.ndarray, ref_path: Path, cand_path: Path) -> None:
    """Run both sides on one sample first: a different number or shape of outputs means two different models, an
    input error found before the long work starts.

    Raises:
        InputError: naming both paths and what differs.
    """
    if not ref.runtimes or not cand.runtimes:
        return
    got = [run_batched(s.runtimes[0].run, x, fixed_batch=s.runtimes[0].fixed_batch) for s in (ref, cand)]
    shapes = [[tuple(o.shape[1:]) for o in outs] for outs in got]
    if shapes[0] != shapes[1]:
        raise InputError(
            f"{ref_path} gives outputs of shape {shapes[0]} but {cand_path} gives {shapes[1]}: the two are not the "
            "same model (a different architecture or class count?)"
        )


def _pair_inputs(
    ref: Side, cand: Side, reference_path: Path, load: LoadOptions, opts: VerifyOptions, token_input: bool
) -> tuple[np.ndarray, str, str | None]:
    """The verification inputs of a pair ``(N, ...)`` (int64 ids for token inputs), their label and the sha256 of
    the ``--inputs`` file (None for drawn samples).

    Raises:
        UsageError: two ``.onnx`` files taking token ids whose range neither records, without ``--inputs``.
        InputError: as ``choose_inputs``.
    """
    rows = None
    if token_input and not opts.inputs and ref.loaded is None and cand.loaded is None:
        rows = _embedding_rows(reference_path)  # ids below the embedding's row count of an ONNX original
        if rows is None:
            raise UsageError("these models take token ids whose range the .onnx files do not record; pass --inputs NPZ")
    shape = load.input_shape or ref.input_shape or cand.input_shape
    checked = None  # two .onnx files and --inputs: the ids are checked against the embedding's rows
    if token_input and opts.inputs and ref.loaded is None and cand.loaded is None:
        checked = _embedding_rows(reference_path)
    x, label, digest = choose_inputs(
        ref.loaded or cand.loaded,
        opts.inputs,
        opts.sample_count(),
        opts.seed,
        shape,
        limit=opts.samples,
        token_input=token_input,
        id_range=checked,
    )
    if rows is not None:
        x = np.random.default_rng(opts.seed).integers(0, rows, x.shape, dtype=np.int64)
    if token_input and not np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.int64)
    return x, label, digest


def _question_1(
    ref: Side,
    cand: Side,
    reference: Reference,
    verification: Verification,
    x: np.ndarray,
    reference_path: Path,
    candidate_path: Path,
    progress: Progress,
) -> None:
    """Question 1 where it applies (the candidate was folded by slabconv from the reference), into
    ``verification``; a note saying why not elsewhere."""
    fused64 = reference.fused64
    onnx_source = _onnx_source(reference_path, candidate_path, ref)
    if onnx_source is not None and reference.exact is not None:
        from slabconv.verify import onnx_original

        progress("verifying: question 1, is the fold exact?")
        batch = ref.runtimes[0].fixed_batch if ref.runtimes else None
        verification.exact += onnx_original.question_1(
            reference_path, onnx_source, x, reference.dtype, batch, reference.exact
        )
    elif cand.written is not None and fused64 is not None and not is_output_folder(reference_path):
        progress("verifying: question 1, is the fold exact?")
        verification.exact.append(question_1_graph(reference, fused64, ref.loaded.batch if ref.loaded else None))
        fold64 = engine.fused_state_dict(fused64)
        what = f"{candidate_path.name} vs a float64 fold of the reference"
        verification.exact.append(judge.exact_tensors(what, cand.written, fold64, by_value=cand.written_by_value))
    else:
        why = (
            "the candidate is not a slabconv output"
            if cand.written is None
            else "the reference is not a model slabconv traces"
        )
        verification.notes.append(f"question 1 (is the fold exact?) not answered: {why}; question 2 only")


@frozen_heap()
def verify_pair(
    reference_path: Path, candidate_path: Path, load: LoadOptions, opts: VerifyOptions, progress: Progress
) -> tuple[Source, Source, Verification]:
    """Both questions for ``candidate`` against ``reference`` (see the module docstring).

    Raises:
        InputError: the sides take different inputs or give different outputs (not the same model).
        UsageError: no input shape or id range is known (two ``.onnx`` files): pass ``--inputs``; ``--generate``
            without a fused language-model folder as the candidate.
    """
    if opts.generate:
        require_fused_lm_folder(candidate_path)
    progress("opening the reference and the candidate")
    ref, cand = open_side(reference_path, load), open_side(candidate_path, load)
    if opts.runtimes:  # before any work: a runtime that cannot run the candidate is a usage error
        onnx_file = candidate_path / "model.onnx" if is_output_folder(candidate_path) else candidate_path
        found = onnx_file if engine_of(onnx_file) == "onnx" and onnx_file.is_file() else None
        cand.runtimes = select_runtimes(cand.runtimes, opts.runtimes, found, candidate_path)
    if ref.input_shape and cand.input_shape and tuple(ref.input_shape) != tuple(cand.input_shape):
        raise InputError(
            f"{reference_path} takes inputs of shape {ref.input_shape} but {candidate_path} takes {cand.input_shape}; "
            "the two files are not the same model"
        )
    token_input = ref.token_input or cand.token_input
    x, label, digest = _pair_inputs(ref, cand, reference_path, load, opts, token_input)
    _same_outputs(ref, cand, x[:1], reference_path, candidate_path)
    progress("verifying: the reference in its dtype and in float64")
    norm_affine = load.fold_norm_affine or cand.norm_affine  # question 1 folds what the candidate's fold folded
    reference, verification = _reference(ref, x, label, digest, cand.loaded.dtype if cand.loaded else None, norm_affine)
    verification.integrity += ref.integrity + cand.integrity
    verification.notes += ref.notes + cand.notes
    _question_1(ref, cand, reference, verification, x, reference_path, candidate_path, progress)
    if not cand.runtimes:
        raise InputError(f"{candidate_path}: no runtime here can run it ({'; '.join(cand.notes)})")
    for runtime in cand.runtimes:
        progress(f"verifying: question 2, {runtime.label}")
        try:
            verification.checks += question_2(
                reference, runtime, rtol=opts.rtol, atol=opts.atol, strict=opts.strict, token_logits=token_input
            )
        except InputError as err:
            raise InputError(f"{reference_path} vs {candidate_path}: {err}") from None
    verification.runtime = runtime_summary(cand.runtimes)
    ref.source.extra["runtime"] = ref.runtimes[0].label if ref.runtimes else None
    if opts.generate:
        progress("verifying: greedy generation, reference vs candidate")
        verification.generation = _generation(ref, candidate_path, x, opts.generate)
    return ref.source, cand.source, verification


def _embedding_rows(path: Path) -> int | None:
    """The row count of the embedding an ``.onnx`` reference's integer input indexes, else None."""
    if engine_of(path) != "onnx":
        return None
    from slabconv.load.onnx_file import read_onnx
    from slabconv.verify import onnx_original

    return onnx_original.embedding_rows(path, read_onnx(path).input_name)


def _onnx_source(reference_path: Path, candidate_path: Path, ref: Side) -> Path | None:
    """The candidate's ``model.onnx`` when it was folded from the reference ``.onnx`` (question 1 applies)."""
    if engine_of(reference_path) != "onnx":
        return None
    from slabconv.verify import onnx_original

    onnx_path = candidate_path / "model.onnx" if candidate_path.is_dir() else candidate_path
    if engine_of(onnx_path) != "onnx" or not onnx_path.is_file():
        return None
    return onnx_path if onnx_original.folded_from(onnx_path) == ref.source.sha256 else None


def require_fused_lm_folder(path: Path) -> None:
    """Refuse ``--generate`` for a candidate that is not a fused language-model folder.

    Raises:
        UsageError: ``path`` is not a folder holding the fused LLaMA's modeling file.
    """
    from slabconv.write.hf_llama import MODELING_FILE

    if not (path.is_dir() and (path / MODELING_FILE).is_file()):
        raise UsageError(f"--generate needs a fused language-model folder as the candidate; {path} is not one")


def _generation(ref: Side, candidate: Path, x: np.ndarray, steps: int) -> dict[str, Any]:
    """``--generate N``: ``verify.generate.check_fused_folder`` with the reference's model.

    Raises:
        UsageError: the reference is not a language model slabconv builds.
    """
    from slabconv.verify.generate import check_fused_folder

    if ref.loaded is None or not ref.token_input:
        raise UsageError("--generate needs a language model as the reference (a checkpoint or folder, not .onnx)")
    return check_fused_folder(ref.loaded.model, candidate, x, steps)
