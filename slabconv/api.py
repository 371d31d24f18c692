"""The Python API: ``fuse``, ``inspect``, ``export``, ``verify``, ``bench``, ``load_fused``. The CLI calls these.

Data flows one way through one stage per package::

    load (slabconv.load)  ->  plan + apply (slabconv.engine)  ->  write (slabconv.write)
        ->  verify (slabconv.verify)  ->  report (slabconv.report)

Every function here checks its arguments, calls the stages (``fuse``: the one driver, ``slabconv.pipeline``, in
memory or streamed with ``WriteOptions(stream=True)``) and returns a ``slabconv.report.Report``.

Example::

    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions

    report = api.fuse("checkpoint.pth", "checkpoint-fused", verify=VerifyOptions(samples=128))
    assert report.verification.passed
    model = api.load_fused("checkpoint-fused")  # an nn.Module, from model.pt2
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch import nn

from slabconv import engine, pipeline
from slabconv.errors import InputError, UsageError, python_advice
from slabconv.load.checkpoint import check_input
from slabconv.load.model import load_model
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.pipeline import Planned, plan
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, no_progress, sha256_file
from slabconv.write.onnx import check_opset, export_onnx, onnx_files, written_by_slabconv
from slabconv.write.staging import check_output_file, check_output_folder, staging_file

# --------------------------------------------------------------------------------------------- commands

_OPTION_EXAMPLES = {
    LoadOptions: "LoadOptions(arch='deit_tiny_prepbn')",
    VerifyOptions: "VerifyOptions(samples=128)",
    WriteOptions: "WriteOptions(force=True)",
}


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


def _check_runtimes(verify: VerifyOptions | None, stream: bool) -> None:
    """``VerifyOptions.runtimes`` names known, installed runtimes; a streamed run compares in PyTorch only.

    Raises:
        UsageError: as ``verify.backends.check_runtime_names``; a runtime other than pytorch with ``stream``.
    """
    from slabconv.verify.backends import check_runtime_names

    names = verify.runtimes if verify is not None else None
    check_runtime_names(names)
    if stream and names and set(names) != {"pytorch"}:
        raise UsageError("--stream compares two folders layer by layer in PyTorch; leave out --runtime or give pytorch")


def architectures() -> list[dict[str, Any]]:
    """The registered architectures, what ``slabconv list`` prints: one dict per architecture with ``name`` (what
    ``LoadOptions(arch=...)`` takes, case ignored), ``aliases`` (also accepted), ``family`` and ``description``.

    Source: the zoo registry (``slabconv.zoo``), in registration order.
    """
    from slabconv.zoo import list_archs

    return [
        {"name": s.name, "aliases": list(s.aliases), "family": s.family, "description": s.description}
        for s in list_archs()
    ]


@python_advice()
def inspect(path: Path | str, load: LoadOptions | None = None, progress: Progress = no_progress) -> Report:
    """The fold plan for a checkpoint: one entry per norm (action, layers folded into, reason). Nothing is written.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``load_model``.
        TypeError: ``load`` is not a ``LoadOptions``.
    """
    _check_types(load=(load, LoadOptions))
    return pipeline.run_inspect(check_input(path), load, progress)


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
    pipeline.write_dtype(write)  # a mistyped --dtype is answered before anything is read
    check_opset(write.opset, write.dtype)
    if write.simplify and not write.onnx:
        raise UsageError(
            "--simplify simplifies model.onnx, which --no-onnx (or --stream) does not write; leave one out"
        )
    source = check_input(path)  # the input first: a mistyped name is not answered with "output exists"
    out_dir = Path(out) if out is not None else source.with_name(f"{source.stem}-fused")
    inputs = [source, *([verify.inputs] if verify and verify.inputs else [])]
    check_output_folder(out_dir, force=write.force, inputs=inputs)
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
    check_output_file(target, force=force, inputs=[source], owned=written_by_slabconv)
    if target.suffix.lower() != ".onnx":
        raise UsageError(f"--onnx {target}: give a file name ending in .onnx, e.g. {target.with_suffix('.onnx').name}")
    norm_affine = bool(load and load.fold_norm_affine)
    if norm_affine and not fuse:
        raise UsageError("--fold-norm-affine folds norms; --no-fuse exports the original as it is: drop one of them")
    loaded = load_model(source, load)
    decisions: list[engine.Decision] = []
    model: nn.Module = loaded.model
    example = loaded.trace_example()
    if fuse:
        planned = plan(loaded, progress, norm_affine=norm_affine)
        model, decisions, example = planned.fused, planned.decisions, planned.example
    progress(f"exporting {target.name}")
    folds = decisions if fuse else None  # the original model: no fold plan to report (not "0 norms")
    with staging_file(target, force, owned=written_by_slabconv) as tmp:
        info = export_onnx(model, example, tmp / target.name, opset=opset)
        files = onnx_files(tmp / target.name)
        outputs = Outputs(
            files=[f.name for f in files],
            safetensors="",
            onnx=str(target),
            onnx_info=info,
            sha256={f.name: sha256_file(f) for f in files},
        )
    return Report("export", source=loaded.source(), folds=folds, outputs=outputs)


@python_advice()
def verify(
    reference: Path | str,
    candidate: Path | str,
    *,
    load: LoadOptions | None = None,
    verify: VerifyOptions | None = None,
    stream: bool = False,
    progress: Progress = no_progress,
) -> Report:
    """Compare a candidate with a reference on the same inputs: both questions of the verification policy.

    Each side is a checkpoint, a Hugging Face folder, a ``.pt2``, an ``.onnx``, a fused ``model.safetensors`` or a
    folder ``fuse`` wrote (in memory or streamed). With ``stream``, two LLaMA-layout folders are compared one
    decoder layer at a time, in bounded memory.

    Returns:
        A report with ``reference``, ``candidate`` and ``verification`` (the CLI exits 1 when it did not pass).

    Raises:
        InputError, UnsupportedModelError, UsageError: a side cannot be read or run, or the two sides are not the
            same model (exit code 2).
        TypeError: ``load`` or ``verify`` of the wrong type.
    """
    from slabconv.verify import pair

    _check_types(load=(load, LoadOptions), verify=(verify, VerifyOptions))
    _check_runtimes(verify, stream)
    check_input(reference, folders=False)
    check_input(candidate, folders=False)
    opts = verify or VerifyOptions()
    started = time.monotonic()
    if stream:
        from slabconv import stream as streaming

        norm_affine = bool(load and load.fold_norm_affine)
        report = streaming.verify_streamed(Path(reference), Path(candidate), opts, progress, norm_affine)
    else:
        ref, cand, verification = pair.verify_pair(
            Path(reference), Path(candidate), load or LoadOptions(), opts, progress
        )
        report = Report("verify", reference=ref, candidate=cand, verification=verification)
    assert report.verification is not None
    report.verification.seconds = time.monotonic() - started
    return report


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
    from slabconv.load.checkpoint import load_checkpoint
    from slabconv.load.fused import CheckedProgram, is_output_folder

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
    source, opts = Path(path), load or LoadOptions()
    if opts.fold_norm_affine:
        raise UsageError(
            "bench times the original against the fused and norm-free models; fold_norm_affine does not apply: "
            "fuse with it, then bench the folder fuse wrote"
        )
    if source.is_dir() and (source / "report.json").is_file():
        source, opts = bench_mod.source_of_output(source, opts)
    loaded = load_model(source, opts)
    chosen = list(runtimes) if runtimes else bench_mod.default_runtimes()
    timings = bench_mod.bench_models(
        loaded.model, lambda batch: loaded.example(batch, seed=1), list(batches), chosen, warmup, repeats, progress
    )
    result = bench_mod.result(timings, batches, chosen, warmup, repeats)
    if bench_generation.is_language_model(loaded):
        result["generation"] = bench_generation.bench_generation(source, opts, loaded, progress)
    return Report("bench", source=loaded.source(), bench=result)


__all__ = [
    "LoadOptions",
    "Planned",
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
    "plan",
    "verify",
]
