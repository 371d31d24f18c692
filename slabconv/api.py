"""The Python API of slabconv: what the ``slabconv`` command does, as functions that return a ``Report``.

- ``fuse(path, out)``: fold every norm, write ``model.safetensors``, ``model.onnx``, ``model.pt2`` and
  ``report.json`` into ``out``, and verify them (``slabconv fuse``);
- ``inspect(path)``: the fold plan, nothing written (``slabconv inspect``);
- ``export(path, onnx_path)``: one ONNX file (``slabconv export``);
- ``verify(reference, candidate)``: both verification questions for any two models (``slabconv verify``);
- ``bench(path)``: original vs fused vs norm-free timings (``slabconv bench``);
- ``load_fused(out)``: the fused model of a folder ``fuse`` wrote, as an ``nn.Module``;
- ``load_model(path)``: a checkpoint read as slabconv reads it (the model in eval mode, its input shape, dtype);
- ``architectures()``: the registered architectures (``slabconv list``).

How to load, verify and write are option objects: ``LoadOptions``, ``VerifyOptions``, ``WriteOptions`` (from
``slabconv.options``, also importable from here). Errors are the exceptions of ``slabconv.errors``, with advice in
Python's spelling (``pass WriteOptions(force=True)``). Importing this module loads neither torch nor numpy: a
function imports what it needs when called.

Example::

    from slabconv import api
    from slabconv.options import VerifyOptions

    report = api.fuse("checkpoint.pth", "checkpoint-fused", verify=VerifyOptions(samples=128))
    assert report.verification.passed
    model = api.load_fused("checkpoint-fused")  # an nn.Module, from model.pt2
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slabconv.errors import InputError, UsageError, python_advice
from slabconv.load.paths import MODEL_SUFFIXES, check_input, is_output_folder
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions, check_opset
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, no_progress
from slabconv.write.staging import check_output_file, check_output_folder, staging_file

if TYPE_CHECKING:
    from torch import nn

    from slabconv.load.model import LoadedModel

# --------------------------------------------------------------------------------------------- commands

_OPTION_EXAMPLES = {
    LoadOptions: "LoadOptions(arch='deit_tiny_prepbn')",
    VerifyOptions: "VerifyOptions(samples=128)",
    WriteOptions: "WriteOptions(force=True)",
}


def _empty_folder(path: Path) -> bool:
    """True for an existing, empty real folder (not a link); False for anything else or a path that cannot be read."""
    try:
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    except OSError:
        return False


def _check_types(**given: tuple[Any, type]) -> None:
    """Each option argument is None or an instance of its option class.

    Raises:
        TypeError: naming the argument, what it got and how to write it (``load={"arch": ...}`` is a dict).
    """
    for name, (value, cls) in given.items():
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"{name} must be a {cls.__name__} (from slabconv.options), e.g. {name}={_OPTION_EXAMPLES[cls]}; "
                f"got {type(value).__name__}"
            )


def architectures() -> list[dict[str, Any]]:
    """The registered architectures, what ``slabconv list`` prints: one dict per architecture with ``name`` (what
    ``LoadOptions(arch=...)`` takes, case ignored), ``aliases`` (also accepted), ``family`` and ``description``.

    Source: the zoo's table of names (``slabconv.zoo.names.NAMES``, read without importing torch), in its order.
    """
    from slabconv.zoo.names import NAMES

    return [
        {"name": s.name, "aliases": list(s.aliases), "family": s.family, "description": s.description} for s in NAMES
    ]


@python_advice()
def inspect(path: Path | str, load: LoadOptions | None = None, progress: Progress = no_progress) -> Report:
    """The fold plan for a checkpoint: one entry per norm (action, layers folded into, reason). Nothing is written.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``load_model``.
        TypeError: ``load`` is not a ``LoadOptions``.
    """
    _check_types(load=(load, LoadOptions))
    source = check_input(path)
    from slabconv import pipeline

    return pipeline.run_inspect(source, load, progress)


@python_advice({"--no-verify": "verify=None"})
def fuse(
    path: Path | str,
    out: Path | str | None = None,
    *,
    load: LoadOptions | None = None,
    verify: VerifyOptions | None = VerifyOptions(),
    write: WriteOptions | None = None,
    progress: Progress = no_progress,
) -> Report:
    """Fold every norm of a checkpoint; write and verify the fused model.

    Writes into ``out`` (default ``<checkpoint stem>-fused`` beside the checkpoint): ``model.safetensors`` (fused
    weights, provenance in their metadata), ``model.onnx`` (dynamic batch where the model allows), ``model.pt2``
    (a ``torch.export`` program), ``report.json``; for a language model also ``config.json``,
    ``generation_config.json`` and the modeling file (a Hugging Face folder) and ``decoder.onnx`` (past key/values).
    Everything is staged beside ``out`` and moved into place only after verification passed.

    Args:
        path: the checkpoint (see ``load_model``).
        out: the output folder.
        load: how to load it.
        verify: how to verify (None: ``--no-verify``).
        write: what to write (``force``, ``onnx``, ``pt2``, ``stream``).
        progress: called with a short message at each stage.

    Returns:
        The report (also written as ``report.json``).

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input or options (exit code 2); nothing is written.
        NumericError: the fused model overflows its dtype (exit code 2, naming the norm); nothing is written.
        VerificationError: a check failed (exit code 1); nothing is written, the report is ``err.report``.
        TypeError: an option argument of the wrong type (``load={"arch": ...}``: use ``LoadOptions(arch=...)``).
    """
    _check_types(load=(load, LoadOptions), verify=(verify, VerifyOptions), write=(write, WriteOptions))
    write = write or WriteOptions()
    write.check()  # a mistyped --dtype is answered before anything is read
    if verify is not None:
        from slabconv.verify.backends import check_runtime_names

        check_runtime_names(verify.runtimes, verify.calibration)
    source = check_input(path)  # the input first: a mistyped name is not answered with "output exists"
    if write.stream and not source.is_dir():
        raise UsageError(
            f"{source}: --stream folds a Hugging Face style folder (config.json + safetensors) block by block; give "
            "the folder, or drop --stream to fold this file in memory"
        )
    out_dir = Path(out) if out is not None else source.with_name(f"{source.stem}-fused")
    if out_dir.suffix.lower() in MODEL_SUFFIXES and not os.path.lexists(out_dir):
        raise UsageError(
            f"--out {out_dir}: fuse writes a folder (model.safetensors, model.onnx, model.pt2, report.json), not one "
            f"{out_dir.suffix} file; give a folder name such as {out_dir.with_suffix('')}-fused (slabconv export "
            "CKPT --onnx FILE writes one ONNX file)"
        )
    inputs = [source, *([verify.inputs] if verify and verify.inputs else [])]
    if verify is not None and verify.inputs is not None:
        from slabconv.verify.inputs import check_inputs_file

        check_inputs_file(Path(verify.inputs))  # not after the fold and its files
    if _empty_folder(out_dir):  # it holds nothing to lose: filled as a new one, without --force
        write = dataclasses.replace(write, force=True)
    try:
        check_output_folder(out_dir, force=write.force, inputs=inputs)
    except UsageError as err:
        if out is None and str(err).startswith("cannot write to"):  # the user named no folder: say how to
            raise UsageError(f"{err} with --out DIR (by default the output goes beside the checkpoint)") from None
        raise
    from slabconv import pipeline

    return pipeline.run_fuse(source, out_dir, load=load, verify=verify, write=write, progress=progress)


@python_advice({"--force": "force=True", "--onnx": "onnx_path", "--opset": "opset="})
def export(
    path: Path | str,
    onnx_path: Path | str,
    *,
    load: LoadOptions | None = None,
    fuse: bool = True,
    force: bool = False,
    opset: int | None = None,
    progress: Progress = no_progress,
) -> Report:
    """Write one ONNX file: the fused model, or with ``fuse=False`` the original one (norms as they are).

    Weights over ``slabconv.write.onnx.ONNX_EXTERNAL_DATA_BYTES`` go to ``<onnx_path>.data`` beside it. The file is
    written beside the target and moved into place only when complete; ``force`` replaces only an ONNX file
    slabconv wrote. ``opset``: the ONNX opset (``slabconv.write.onnx.OPSET_RANGE``; default the exporter's).

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``fuse``.
        TypeError: ``load`` is not a ``LoadOptions``.
    """
    _check_types(load=(load, LoadOptions))
    check_opset(opset)
    source, target = check_input(path), Path(onnx_path)
    check_output_file(target, force=force, inputs=[source], owned=_written_by_slabconv)
    if target.suffix.lower() != ".onnx":
        raise UsageError(f"--onnx {target}: give a file name ending in .onnx, e.g. {target.with_suffix('.onnx').name}")
    from slabconv import engine
    from slabconv.load.model import check_options_apply
    from slabconv.load.model import load_model as load_checkpoint_model
    from slabconv.pipeline import measured_ranges, onnx_provenance, plan
    from slabconv.util import sha256_file
    from slabconv.write.onnx import export_onnx, onnx_files

    norm_affine = bool(load and load.fold_norm_affine)
    if norm_affine and not fuse:
        raise UsageError("--fold-norm-affine folds norms; --no-fuse exports the original as it is: drop one of them")
    check_options_apply(source, load)
    loaded = load_checkpoint_model(source, load)
    decisions: list[engine.Decision] = []
    model: nn.Module = loaded.model
    example = loaded.trace_example()
    ranges = None
    if fuse:
        planned = plan(loaded, progress, norm_affine=norm_affine)
        model, decisions, example = planned.fused, planned.decisions, planned.example
        ranges = measured_ranges(planned)
    progress(f"exporting {target.name}")
    folds = decisions if fuse else None  # the original model: no fold plan to report (not "0 norms")
    with staging_file(target, force, owned=_written_by_slabconv) as tmp:
        info = export_onnx(model, example, tmp / target.name, opset=opset, metadata=onnx_provenance(loaded, folds))
        files = onnx_files(tmp / target.name)
        outputs = Outputs(
            files=[f.name for f in files],
            safetensors="",
            onnx=str(target),
            onnx_info=info,
            sha256={f.name: sha256_file(f) for f in files},
        )
    return Report("export", source=loaded.source(), folds=folds, outputs=outputs, ranges=ranges)


@python_advice({"--stream": "stream=True"})
def verify(
    reference: Path | str,
    candidate: Path | str,
    *,
    load: LoadOptions | None = None,
    verify: VerifyOptions | None = None,
    stream: bool = False,
    localize: bool = False,
    progress: Progress = no_progress,
) -> Report:
    """Compare a candidate with a reference on the same inputs: both questions of the verification policy, by the
    one verifier ``fuse`` runs too (``slabconv.verify.verifier``).

    Each side is a checkpoint, a Hugging Face folder, a ``.pt2``, an ``.onnx``, a fused ``model.safetensors`` or a
    folder ``fuse`` wrote (in memory or streamed). With ``stream``, two LLaMA-layout folders are compared one
    decoder layer at a time, in bounded memory. Question 1 applies when the candidate is a fold of the reference
    (it records the reference's sha256 as its source). ``localize``: compare the two at every fold boundary even
    when they agree (the report's ``verification.localization``; a failure is localised anyway).

    Returns:
        A report with ``reference``, ``candidate`` and ``verification`` (the CLI exits 1 when it did not pass).

    Raises:
        InputError, UnsupportedModelError, UsageError: a side cannot be read or run, the two sides are not the
            same model, or the arguments are swapped (the reference is a fold of the candidate) (exit code 2).
        TypeError: ``load`` or ``verify`` of the wrong type.
    """
    _check_types(load=(load, LoadOptions), verify=(verify, VerifyOptions))
    check_input(reference, folders=False)
    check_input(candidate, folders=False)
    from slabconv.verify.backends import check_runtime_names

    if verify is not None:
        check_runtime_names(verify.runtimes, verify.calibration)
    if verify is not None and verify.inputs is not None:
        from slabconv.verify.inputs import check_inputs_file

        check_inputs_file(Path(verify.inputs))  # before either side is opened
    if stream and verify is not None:
        verify.check_streamed()
    from slabconv.load.model import check_build_options_apply, check_ema_applies
    from slabconv.pipeline import open_sides  # torch: after the path checks, which answer without it
    from slabconv.verify import verifier

    check_ema_applies((reference, candidate), load)
    check_build_options_apply((reference, candidate), load)

    ref, cand, opts = open_sides(Path(reference), Path(candidate), load, verify or VerifyOptions(), stream, progress)
    verification = verifier.verify(ref, cand, opts, load=load, localize=localize, progress=progress)
    ref.source.extra.setdefault("runtime", None)
    return Report("verify", reference=ref.source, candidate=cand.source, verification=verification)


@python_advice()
def load_fused(out_dir: Path | str) -> nn.Module:
    """The fused model a ``fuse`` output folder holds, as an ``nn.Module`` (its ``model.pt2``, read by the same
    safe loader as every input).

    Example::

        model = slabconv.load_fused("checkpoint-fused")
        logits = model(images)                        # (B, 1, 8, 8) float32 -> (B, 10)
        fast = torch.compile(model)

    The module checks its input first: another dtype, rank or size (a sequence longer than the model's
    ``max_position_embeddings``, a batch other than a static program's) raises one line naming what it takes.

    Raises:
        InputError: not a folder ``fuse`` wrote, or one written with ``--no-pt2``.
        UsageError: when called, an input the program does not take.
    """
    from slabconv.load.formats import load_checkpoint
    from slabconv.load.fused import CheckedProgram

    folder = Path(out_dir)
    if not is_output_folder(folder):
        raise InputError(f"{folder}: not a folder slabconv fuse wrote (no report.json)")
    if not (folder / "model.pt2").is_file():
        raise InputError(f"{folder}: has no model.pt2 (it was fused with --no-pt2); fuse again without it")
    return CheckedProgram(load_checkpoint(folder / "model.pt2").module, f"{folder / 'model.pt2'}")


@python_advice()
def bench(
    path: Path | str,
    *,
    load: LoadOptions | None = None,
    batches: tuple[int, ...] = (1, 8, 64),
    runtimes: tuple[str, ...] | None = None,
    warmup: int = 5,
    repeats: int = 20,
    progress: Progress = no_progress,
) -> Report:
    """Latency and throughput of the original, fused, norm-free and (if any) LayerNorm-branch models.

    ``path`` is a checkpoint, or a folder ``fuse`` wrote (its report names the checkpoint). ``runtimes``: names
    from ``slabconv.bench.RUNTIMES``; default every runtime this machine has. See ``slabconv.bench``.

    Raises:
        UsageError: a runtime this machine cannot run (``--runtime pytorch-cuda`` without CUDA).
        InputError: a folder that ``fuse`` did not write.
        TypeError: ``load`` is not a ``LoadOptions``.
    """
    from slabconv import bench as bench_mod
    from slabconv import bench_generation

    _check_types(load=(load, LoadOptions))
    source, opts = check_input(path), load or LoadOptions()
    if opts.fold_norm_affine:
        raise UsageError(
            "bench times the original against the fused and norm-free models; fold_norm_affine does not apply: "
            "fuse with it, then bench the folder fuse wrote"
        )
    if source.is_dir() and (source / "report.json").is_file():
        source, opts = bench_mod.source_of_output(source, opts)
    from slabconv.load.model import load_model as load_checkpoint_model

    loaded = load_checkpoint_model(source, opts)
    chosen = list(runtimes) if runtimes else bench_mod.default_runtimes()
    timings = bench_mod.bench_models(
        loaded.model, lambda batch: loaded.example(batch, seed=1), list(batches), chosen, warmup, repeats, progress
    )
    result = bench_mod.result(timings, batches, chosen, warmup, repeats)
    if bench_generation.is_language_model(loaded):
        result["generation"] = bench_generation.bench_generation(source, opts, loaded, progress)
    return Report("bench", source=loaded.source(), bench=result)


@python_advice()
def load_model(path: Path | str, load: LoadOptions | None = None) -> LoadedModel:
    """A checkpoint read and built as every command reads it (nothing folded): ``.model`` (the ``nn.Module`` in eval
    mode), ``.arch``, ``.input_shape`` (one sample, without the batch axis), ``.dtype``, ``.example(batch, seed)``
    (seeded inputs of that shape and dtype). See ``slabconv.load.model.load_model``.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``fuse``.
        TypeError: ``load`` is not a ``LoadOptions``.
    """
    from slabconv.load.model import load_model as load_checkpoint_model

    _check_types(load=(load, LoadOptions))
    return load_checkpoint_model(check_input(path), load)


def _written_by_slabconv(path: Path) -> bool:
    """True for an ONNX file slabconv wrote (its ``metadata_props`` mark): what ``export --force`` may replace."""
    from slabconv.write.onnx import written_by_slabconv

    return written_by_slabconv(path)


__all__ = [
    "LoadOptions",
    "Report",
    "VerifyOptions",
    "WriteOptions",
    "architectures",
    "bench",
    "export",
    "fuse",
    "inspect",
    "load_fused",
    "load_model",
    "verify",
]
