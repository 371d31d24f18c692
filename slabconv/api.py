"""The Python API: ``fuse``, ``inspect``, ``export``, ``verify``, ``bench``, ``load_fused``. The CLI calls these.

Data flows one way through one stage per package::

    load (slabconv.load)  ->  plan + apply (slabconv.engine)  ->  write (slabconv.write)
        ->  verify (slabconv.verify)  ->  report (slabconv.report)

Every function here strings stages together and returns a ``slabconv.report.Report``; none holds logic of
its own. A streamed fold (``WriteOptions(stream=True)``) is the same pipeline in bounded memory
(``slabconv.stream``).

Example::

    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions

    report = api.fuse("checkpoint.pth", "checkpoint-fused", verify=VerifyOptions(samples=128))
    assert report.verification.passed
    model = api.load_fused("checkpoint-fused")  # an nn.Module, from model.pt2
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from slabconv import engine
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError, python_advice
from slabconv.load.checkpoint import check_input
from slabconv.load.model import LoadedModel, load_model
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, no_progress, quiet, sha256_file
from slabconv.verify import faults
from slabconv.verify.run import Artifacts, verify_written
from slabconv.write.onnx import check_opset, export_onnx, onnx_files, written_by_slabconv
from slabconv.write.pt2 import export_program, save_pt2
from slabconv.write.safetensors import fused_metadata, save_safetensors
from slabconv.write.staging import check_output_file, check_output_folder, staging_dir, staging_file

# --------------------------------------------------------------------------------------------- stages


@dataclass
class Planned:
    """A model's fold: the traced original, the fused graph and one decision per norm.

    Attributes:
        original: the unfolded graph (``engine.capture``), kept for the float64 reference.
        fused: the fused graph (the engine applied every decision).
        decisions: one per norm, in graph order.
        example: the input the graphs were traced with.
    """

    original: fx.GraphModule
    fused: fx.GraphModule
    decisions: list[engine.Decision]
    example: torch.Tensor

    @property
    def complete(self) -> bool:
        """Every norm folded away (nothing kept as an affine or as it was)."""
        return all(d.action.startswith("folded") for d in self.decisions)


def plan(loaded: LoadedModel, progress: Progress = no_progress) -> Planned:
    """Trace ``loaded.model`` and fold every norm (the engine's capture, plan and apply).

    Raises:
        UnsupportedModelError: torch.export cannot trace the model.
        InputError: a norm in train mode; damaged norm statistics.
    """
    example = loaded.trace_example()
    progress("tracing the model with torch.export")
    with quiet():
        original = engine.capture(loaded.model, example, sequence=loaded.max_sequence)
    fused = copy.deepcopy(original)

    def folded(name: str, done: int, total: int) -> None:
        progress("folding norms", done, total)

    progress("folding norms")
    decisions = engine.fold_all(fused, progress=folded)
    for i, d in enumerate(decisions, 1):  # --verbose: each decision, as the fold table will show it
        into = f" into {', '.join(d.into)}" if d.into else ""
        progress(
            "folding norms",
            len(decisions),
            len(decisions),
            f"{d.norm} ({i}/{len(decisions)}): {d.action}{into}" + (f" ({d.reason})" if d.reason else ""),
        )
    in_train = [d for d in decisions if d.action == engine.KEPT and d.reason == engine.reasons.TRAIN_MODE]
    if in_train:
        raise InputError(
            f"{loaded.checkpoint.path}: norm {in_train[0].norm} is in train mode (it normalises with batch "
            "statistics, not a fixed affine); put the model in eval mode (model.eval()) before saving or exporting it"
        )
    return Planned(original, fused, decisions, example)


def source_of(loaded: LoadedModel) -> Source:
    """The report's ``source`` block for a loaded model (``LoadedModel.source``)."""
    return loaded.source()


WRITE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""What ``fuse --dtype`` writes (``WriteOptions(dtype=...)``)."""


def write_dtype(write: WriteOptions) -> torch.dtype | None:
    """The dtype ``write`` asks the fused model to be written in, checked before any work.

    Raises:
        UsageError: an unknown name, or ``dtype`` with ``stream`` (the streamed fold keeps the checkpoint's dtype).
    """
    if write.dtype is None:
        return None
    if write.dtype not in WRITE_DTYPES:
        raise UsageError(f"--dtype {write.dtype}: choose float16 or bfloat16 (leave it out to keep the checkpoint's)")
    if write.stream:
        raise UsageError("--dtype does not stream: the streamed fold keeps the checkpoint's dtype; leave out --dtype")
    return WRITE_DTYPES[write.dtype]


def cast_planned(loaded: LoadedModel, planned: Planned, dtype: torch.dtype) -> Planned:
    """The fused model in ``dtype``: the float64 fold (``verify.reference.float64_fold``) cast once, so each
    written value is the exact fold correctly rounded (question 1 checks it to 0 units in the last place).

    Raises:
        UsageError: a language model (its Hugging Face folder keeps the checkpoint's dtype).
        NumericError: a fused tensor overflows ``dtype`` (named).
    """
    from slabconv.errors import NumericError
    from slabconv.verify.policy import dtype_name
    from slabconv.verify.reference import cast_graph, float64_fold

    if _writes_hf_folder(loaded, planned):
        raise UsageError(
            "--dtype: a language model's Hugging Face folder keeps the checkpoint's dtype; leave out --dtype"
        )
    if dtype == loaded.dtype:
        return planned
    _, fused64, _ = float64_fold(planned.original, planned.example)
    cast = cast_graph(fused64, dtype)
    for name, tensor in engine.fused_state_dict(cast).items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NumericError(
                f"{loaded.checkpoint.path}: the fused tensor {name} does not fit {dtype_name(dtype)} (a value beyond "
                "its range); nothing was written: leave out --dtype, or write bfloat16"
            )
    example = planned.example.to(dtype) if planned.example.is_floating_point() else planned.example
    return Planned(planned.original, cast, planned.decisions, example)


def _writes_hf_folder(loaded: LoadedModel, planned: Planned) -> bool:
    """A fused language model of a zoo family is written as a Hugging Face folder, when every norm folded."""
    from slabconv.zoo import get_arch

    return loaded.arch is not None and get_arch(loaded.arch).family == "llama" and planned.complete


def write_fused(
    folder: Path, loaded: LoadedModel, planned: Planned, write: WriteOptions, progress: Progress
) -> tuple[Outputs, Artifacts]:
    """Write the fused model into ``folder`` (a staging folder): ``model.safetensors``, ``model.onnx``,
    ``model.pt2``, and for a language model the Hugging Face folder files and ``decoder.onnx``.

    Returns:
        The report's ``outputs`` block (without the sha256, taken once everything is verified) and what
        verification needs to know about the files.
    """
    tensors = engine.fused_state_dict(planned.fused)
    metadata = fused_metadata(loaded.arch, loaded.checkpoint.sha256, planned.complete, loaded.config)
    progress("writing model.safetensors")
    save_safetensors(tensors, folder / "model.safetensors", metadata)
    outputs = Outputs(files=["model.safetensors"], safetensors="model.safetensors")
    artifacts = Artifacts(folder, folder / "model.safetensors", tensors, metadata, fused_graph=planned.fused)
    dynamic: list[bool] = []  # per program written: does it take any sequence length?
    artifacts.dtype = WRITE_DTYPES.get(write.dtype or "")
    program = None
    if write.pt2 or write.onnx:  # one torch.export of the fused model serves both files
        progress("exporting the fused program")
        try:
            program = export_program(planned.fused, planned.example)
        except UnsupportedModelError:
            if write.pt2:
                raise
            # --no-pt2: the ONNX exporter's own capture (it has fallbacks torch.export lacks) gets its chance
    if write.pt2 and program is not None:
        progress("writing model.pt2")
        save_pt2(*program, folder / "model.pt2")
        info = program[1]
        outputs.pt2, artifacts.pt2 = "model.pt2", folder / "model.pt2"
        outputs.files.append("model.pt2")
        dynamic.append(info["dynamic_sequence"])
    if write.onnx:
        progress("exporting model.onnx")
        onnx_info = export_onnx(
            planned.fused, planned.example, folder / "model.onnx", opset=write.opset, program=program
        )
        dynamic.append(onnx_info["dynamic_sequence"])
        outputs.onnx, artifacts.onnx = "model.onnx", folder / "model.onnx"
        outputs.files += [f.name for f in onnx_files(folder / "model.onnx")]
        outputs.onnx_info = onnx_info
    if write.pt2 and program is not None:
        outputs.onnx_info = {
            **(outputs.onnx_info or {}),
            "pt2_dynamic_batch": program[1]["dynamic_batch"],
            "pt2_dynamic_sequence": program[1]["dynamic_sequence"],
        }
    artifacts.dynamic_sequence = bool(dynamic) and all(dynamic)
    if _writes_hf_folder(loaded, planned):
        outputs.files += _write_hf_folder(folder, loaded, write, progress)
        outputs.hf_folder = True
        outputs.decoder_onnx = "decoder.onnx" if write.onnx else None
    return outputs, artifacts


def _write_hf_folder(folder: Path, loaded: LoadedModel, write: WriteOptions, progress: Progress) -> list[str]:
    """The Hugging Face model folder files of a fused language model, and its decoder ONNX with past key/values."""
    from slabconv.write.decoder_onnx import export_decoder_onnx, write_genai_config
    from slabconv.write.hf_llama import write_hf_llama_metadata

    progress("writing the Hugging Face model folder")
    written = [p.name for p in write_hf_llama_metadata(folder, loaded.config)]
    if write.onnx:
        progress("exporting decoder.onnx (with past key/values)")
        info = export_decoder_onnx(folder, folder / "decoder.onnx")
        written += [f.name for f in onnx_files(folder / "decoder.onnx")]
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        written.append(write_genai_config(folder, info, config).name)
    return written


# --------------------------------------------------------------------------------------------- commands

_OPTION_EXAMPLES = {
    LoadOptions: "LoadOptions(arch='deit_tiny_prepbn')",
    VerifyOptions: "VerifyOptions(samples=128)",
    WriteOptions: "WriteOptions(force=True)",
}


def _is_onnx(path: Path | str) -> bool:
    """An ``.onnx`` original goes to ``slabconv.onnx_in`` (the ONNX engine), everything else to ``load_model``:
    the engine of its entry in ``slabconv.load.formats.FORMATS``."""
    from slabconv.load.formats import engine_of

    return engine_of(path) == "onnx"


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
        UsageError: as ``verify.runtimes.check_runtime_names``; a runtime other than pytorch with ``stream``.
    """
    from slabconv.verify.runtimes import check_runtime_names

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
    if _is_onnx(path):
        from slabconv import onnx_in

        return onnx_in.inspect(Path(check_input(path)), load, progress)
    loaded = load_model(check_input(path), load)
    planned = plan(loaded, progress)
    return Report("inspect", source=source_of(loaded), folds=planned.decisions)


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
    dtype = write_dtype(write)
    check_opset(write.opset, write.dtype)
    source = check_input(path)  # the input first: a mistyped name is not answered with "output exists"
    out_dir = Path(out) if out is not None else source.with_name(f"{source.stem}-fused")
    inputs = [source, *([verify.inputs] if verify and verify.inputs else [])]
    check_output_folder(out_dir, force=write.force, inputs=inputs)
    if _is_onnx(source):  # an ONNX original: the graph is folded as it is (docs/onnx.md)
        from slabconv import onnx_in

        return onnx_in.fuse(source, out_dir, load=load, verify=verify, write=write, progress=progress)
    if write.stream:
        from slabconv import stream

        return stream.fuse_streamed(source, out_dir, verify=verify, write=write, load=load, progress=progress)
    progress(f"loading {source}")
    loaded = load_model(source, load)
    planned = plan(loaded, progress)
    if _writes_hf_folder(loaded, planned) and (write.onnx or (verify is not None and verify.generate != 0)):
        from slabconv.write.hf_llama import require_transformers

        require_transformers(fusing=True)  # decoder.onnx and the generation check need it: say so before writing
    faults.check_finite(loaded, planned.original, planned.fused, planned.decisions, planned.example)
    if dtype is not None:
        planned = cast_planned(loaded, planned, dtype)
    report = Report("fuse", source=source_of(loaded), folds=planned.decisions, out_dir=str(out_dir), mode="in-memory")
    with staging_dir(out_dir, write.force) as tmp:
        outputs, artifacts = write_fused(tmp, loaded, planned, write, progress)
        if verify is not None:
            report.verification = verify_written(
                loaded, planned.original, planned.decisions, planned.example, artifacts, verify,
                hf_folder=outputs.hf_folder, onnx=write.onnx, progress=progress,
            )  # fmt: skip
        report.rename(tmp, out_dir)
        if report.verification is not None and not report.verification.passed:
            # Nothing is written: the report names no output file.
            raise VerificationError(
                "the fused model is not equivalent: " + report.verification.failure_line() + "; nothing was written",
                report,
            )
        outputs.sha256 = {name: sha256_file(tmp / name) for name in outputs.files}
        report.outputs = outputs
        report.write(tmp / "report.json")
    return report


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
    loaded = load_model(source, load)
    decisions: list[engine.Decision] = []
    model: nn.Module = loaded.model
    example = loaded.trace_example()
    if fuse:
        planned = plan(loaded, progress)
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
    return Report("export", source=source_of(loaded), folds=folds, outputs=outputs)


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

        report = streaming.verify_streamed(Path(reference), Path(candidate), opts, progress)
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

    _check_types(load=(load, LoadOptions))
    source, opts = Path(path), load or LoadOptions()
    if source.is_dir() and (source / "report.json").is_file():
        source, opts = bench_mod.source_of_output(source, opts)
    loaded = load_model(source, opts)
    chosen = list(runtimes) if runtimes else bench_mod.default_runtimes()
    timings = bench_mod.bench_models(
        loaded.model, lambda batch: loaded.example(batch, seed=1), list(batches), chosen, warmup, repeats, progress
    )
    result = bench_mod.result(timings, batches, chosen, warmup, repeats)
    if _is_language_model(loaded):
        result["generation"] = _bench_generation(source, opts, loaded, progress)
    return Report("bench", source=source_of(loaded), bench=result)


def _is_language_model(loaded: LoadedModel) -> bool:
    """A zoo language model (its fused folder is a Hugging Face folder that generates)."""
    from slabconv.zoo import get_arch

    return loaded.arch is not None and loaded.token_input and get_arch(loaded.arch).family == "llama"


def _bench_generation(source: Path, opts: LoadOptions, loaded: LoadedModel, progress: Progress) -> dict[str, Any]:
    """Greedy generation of the original and the fused model timed like for like (``slabconv.bench_generation``),
    the fused folder made in a temporary folder; a note instead when transformers is not installed."""
    import tempfile

    from slabconv import bench_generation
    from slabconv.errors import UsageError
    from slabconv.verify.inputs import choose_inputs
    from slabconv.write.hf_llama import require_transformers

    try:
        require_transformers()
    except UsageError as err:
        return {"note": f"greedy generation not timed: {err}"}
    progress("timing greedy generation: original and fused, transformers with the KV cache")
    with tempfile.TemporaryDirectory(prefix="slabconv-bench-") as tmp:
        folder = Path(tmp) / "fused"
        fuse(source, folder, load=opts, verify=None, write=WriteOptions(onnx=False, pt2=False))
        x = choose_inputs(loaded, None, bench_generation.PROMPTS, 1)[0]
        return bench_generation.time_generation(loaded, folder, x)


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
