"""The Python API: ``fuse``, ``inspect``, ``export``, ``verify``. The CLI is a thin layer over these.

Data flows one way: load (``io``) -> build (``zoo``) -> capture (``graph``) -> plan and apply (``plan``) ->
write (``io``) -> verify (``verify``) -> report (a plain dict, the ``report.json`` schema of DESIGN.md section 4).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slabconv import __version__
from slabconv.engine import Decision, capture, fold_all, fused_state_dict, reasons
from slabconv.errors import InputError, UsageError, VerificationError
from slabconv.load.model import LoadedModel, load_model
from slabconv.util import quiet, sha256_file
from slabconv.verify.inputs import choose_inputs
from slabconv.verify.integrity import check_onnx_file, check_safetensors_reload
from slabconv.verify.policy import default_rtol
from slabconv.verify.results import IntegrityCheck, Verification, compare_runtimes, failure_line, output_names
from slabconv.verify.runtimes import Runtime, onnx_runtimes, onnxruntime_version, run_batched, torch_runner
from slabconv.write.onnx import export_onnx, onnx_files, written_by_slabconv
from slabconv.write.safetensors import save_safetensors
from slabconv.write.staging import check_output_file, check_output_folder, staging_dir, staging_file

Progress = Callable[[str], None]


def _no_progress(message: str) -> None:
    return None


def _example(loaded: LoadedModel, batch: int = 2) -> torch.Tensor:
    return loaded.example(batch, seed=0)


def _plan(loaded: LoadedModel, progress: Progress) -> tuple[torch.fx.GraphModule, list[Decision]]:
    progress("tracing the model with torch.export")
    with quiet():
        gm = capture(loaded.model, _example(loaded))
    progress("planning folds")
    decisions = fold_all(gm, progress=lambda name: progress(f"folded {name}"))
    in_train = [d for d in decisions if d.action == "kept" and d.reason == reasons.TRAIN_MODE]
    if in_train:
        raise InputError(
            f"{loaded.checkpoint.path}: norm {in_train[0].norm} is in train mode (it normalises with batch "
            "statistics, not a fixed affine); put the model in eval mode (model.eval()) before saving or exporting it"
        )
    return gm, decisions


def _base_report(loaded: LoadedModel, decisions: list[Decision]) -> dict[str, Any]:
    return {
        "slabconv_version": __version__,
        "source": loaded.source(),
        "folds": [d.to_dict() for d in decisions],
        "summary": {
            "norms": len(decisions),
            "folded": sum(d.action.startswith("folded") for d in decisions),
            "kept": sum(not d.action.startswith("folded") for d in decisions),
        },
    }


def inspect(
    path: Path | str,
    arch: str | None = None,
    ema: bool = False,
    progress: Progress = _no_progress,
    *,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
) -> dict:
    """The fold plan for a checkpoint: one entry per norm (action, consumers, reason). Nothing is written.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``load_model``.
    """
    loaded = load_model(
        path, arch=arch, ema=ema, trust_pickle=trust_pickle, input_shape=input_shape, image_size=image_size
    )
    _, decisions = _plan(loaded, progress)
    return _base_report(loaded, decisions)


def fuse(
    path: Path | str,
    out: Path | str | None = None,
    *,
    arch: str | None = None,
    ema: bool = False,
    onnx: bool = True,
    verify: bool = True,
    force: bool = False,
    inputs: Path | str | None = None,
    samples: int = 64,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    progress: Progress = _no_progress,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
) -> dict[str, Any]:
    """Fold every norm of a checkpoint and write ``model.safetensors``, ``model.onnx`` and ``report.json``.

    Args:
        path: the checkpoint.
        out: output folder; default ``<checkpoint stem>-fused`` beside the checkpoint.
        arch: architecture name; detected when None.
        ema: fold the EMA weights.
        onnx: write ``model.onnx`` (dynamic batch axis where the model allows it).
        verify: compare the fused model (onnxruntime, or PyTorch without ONNX) with the original in PyTorch.
        force: replace an existing output folder.
        inputs: ``.npz`` of inputs for verification; default ``holdout.npz`` beside the checkpoint, else random.
        samples, seed: size and seed of the random inputs.
        rtol: relative tolerance; default by dtype (DESIGN.md section 5).
        atol: an absolute tolerance also accepted (default 0: only the relative one counts).
        progress: called with a short message at each stage.
        trust_pickle, input_shape: as ``load_model`` (a whole pickled ``nn.Module``).

    Returns:
        The report (``report.json``). Outputs are written to a staging folder beside ``out`` and renamed
        into place only after verification passed (with ``verify=False``, once writing completed).

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input or options (exit code 2); nothing is written.
        VerificationError: the fused model differs beyond tolerance (exit code 1); nothing is written, the
            report is attached as ``err.report``.
    """
    source = Path(path)
    out_dir = Path(out) if out is not None else source.with_name(f"{source.stem}-fused")
    check_output_folder(out_dir, force=force, inputs=[source, *([Path(inputs)] if inputs else [])])
    progress(f"loading {source}")
    loaded = load_model(
        source, arch=arch, ema=ema, trust_pickle=trust_pickle, input_shape=input_shape, image_size=image_size
    )
    gm, decisions = _plan(loaded, progress)
    report = _base_report(loaded, decisions)
    complete = all(d.action.startswith("folded") for d in decisions)
    metadata = {
        "format": "pt",
        "slabconv_version": __version__,
        "arch": loaded.arch or "",
        "source_sha256": loaded.checkpoint.sha256,
        "complete": "true" if complete else "false",
        "config": json.dumps(loaded.config),
    }
    with staging_dir(out_dir, force) as tmp:
        progress("writing model.safetensors")
        save_safetensors(fused_state_dict(gm), tmp / "model.safetensors", metadata)
        outputs: dict[str, Any] = {"safetensors": "model.safetensors", "onnx": None}
        if onnx:
            progress("exporting model.onnx")
            outputs["onnx"] = "model.onnx"
            outputs["onnx_info"] = export_onnx(gm, _example(loaded), tmp / "model.onnx")
        if verify:
            progress("verifying against the original model")
            report["verification"] = _verify_fused(loaded, gm, tmp, onnx, metadata, inputs, samples, seed, rtol, atol)
        else:
            report["verification"] = None
        written = [tmp / "model.safetensors", *(onnx_files(tmp / "model.onnx") if onnx else [])]
        outputs["sha256"] = {f.name: sha256_file(f) for f in written}
        report["outputs"] = outputs
        report["out_dir"] = str(out_dir)
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if verify and not report["verification"]["passed"]:
            raise VerificationError(
                "the fused model is not equivalent: " + failure_line(report["verification"]) + "; nothing was written",
                report,
            )
    return report


def _verify_fused(
    loaded: LoadedModel,
    gm: torch.fx.GraphModule,
    folder: Path,
    onnx: bool,
    metadata: dict[str, str],
    inputs: Path | str | None,
    samples: int,
    seed: int,
    rtol: float | None,
    atol: float,
) -> dict[str, Any]:
    """Check the staged outputs in ``folder``: the safetensors file reads back bit-equal (with its metadata),
    ``model.onnx`` passes ``onnx.checker`` (full check), and its outputs under onnxruntime (optimisations off
    and fully on) match the original model in PyTorch; without ONNX the fused graph runs in PyTorch."""
    x, label, digest = choose_inputs(loaded, inputs, samples, seed)
    reference = run_batched(torch_runner(loaded.model, loaded.dtype), x)
    names = output_names(len(reference))
    tol = default_rtol(str(loaded.dtype), rtol)
    integrity = [check_safetensors_reload(folder / "model.safetensors", fused_state_dict(gm), metadata)]
    if onnx:
        passed, detail = check_onnx_file(folder / "model.onnx")
        integrity.append(IntegrityCheck("onnx.checker[full_check] model.onnx", passed, detail))
        runtimes = onnx_runtimes(folder / "model.onnx")
    else:
        runtimes = [Runtime(f"pytorch {torch.__version__} (fused graph)", torch_runner(gm, loaded.dtype))]
    checks = []
    for rt in runtimes:
        candidate = run_batched(rt.run, x, fixed_batch=rt.fixed_batch)
        checks += compare_runtimes(reference, names, candidate, rt.label, tol, atol, loaded.token_input)
    return Verification(checks, integrity, _runtime_name(runtimes), label, digest).to_dict()


def _runtime_name(runtimes: list[Runtime]) -> str:
    """The report's ``runtime``: ``onnxruntime 1.x`` when the candidate ran there, else ``pytorch 2.x``."""
    if any(rt.label.startswith("onnxruntime") for rt in runtimes):
        return onnxruntime_version()
    return f"pytorch {torch.__version__}"


def export(
    path: Path | str,
    onnx_path: Path | str,
    *,
    arch: str | None = None,
    ema: bool = False,
    fuse: bool = True,
    force: bool = False,
    progress: Progress = _no_progress,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
) -> dict[str, Any]:
    """Write one ONNX file: the fused model, or with ``fuse=False`` the original one (norms as they are).

    Weights over ``slabconv.io.ONNX_EXTERNAL_DATA_BYTES`` go to ``<onnx_path>.data`` beside it. The file is
    written beside the target and moved into place only when complete.

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``fuse``.
    """
    source, target = Path(path), Path(onnx_path)
    check_output_file(target, force=force, inputs=[source], owned=written_by_slabconv)
    loaded = load_model(
        source, arch=arch, ema=ema, trust_pickle=trust_pickle, input_shape=input_shape, image_size=image_size
    )
    decisions: list[Decision] = []
    model: nn.Module = loaded.model
    if fuse:
        model, decisions = _plan(loaded, progress)
    progress(f"exporting {target.name}")
    with staging_file(target, force) as tmp:
        info = export_onnx(model, _example(loaded), tmp / target.name)
        digests = {f.name: sha256_file(f) for f in onnx_files(tmp / target.name)}
    report = _base_report(loaded, decisions)
    report["outputs"] = {"onnx": str(target), "onnx_info": info, "sha256": digests}
    return report


# --------------------------------------------------------------------------------------------- verify


@dataclass
class _Side:
    """One side of ``verify``: what it is (the report entry), how to run it, and what it says about inputs."""

    info: dict[str, Any]
    runtimes: list[Runtime]
    loaded: LoadedModel | None
    input_shape: tuple[int, ...] | None
    dtype: str
    integrity: list[IntegrityCheck]
    token_input: bool = False


def _side(
    path: Path,
    arch: str | None,
    ema: bool,
    trust_pickle: bool,
    input_shape: tuple[int, ...] | None,
    image_size: int | None = None,
) -> _Side:
    """An ``.onnx`` runs in onnxruntime (optimisations off and fully on) after ``onnx.checker``; anything else
    is loaded as a model and runs in PyTorch."""
    if path.suffix == ".onnx":
        passed, detail = check_onnx_file(path)
        runtimes = onnx_runtimes(path)
        shape, dtype, token_input = _onnx_input(path)
        files = onnx_files(path)
        info = {
            "path": str(path),
            "sha256": sha256_file(path),
            "format": "onnx",
            "arch": None,
            "files_sha256": {f.name: sha256_file(f) for f in files},
        }
        check = IntegrityCheck(f"onnx.checker[full_check] {path.name}", passed, detail)
        return _Side(info, runtimes, None, shape, dtype, [check], token_input)
    loaded = load_model(
        path, arch=arch, ema=ema, trust_pickle=trust_pickle, input_shape=input_shape, image_size=image_size
    )
    integrity = []
    if loaded.checkpoint.format == "safetensors":
        count = len(loaded.checkpoint.state_dict)
        integrity.append(
            IntegrityCheck(f"safetensors reload {path.name}", True, f"{count} tensors read, model built strictly")
        )
    runtime = Runtime(f"pytorch {torch.__version__}", torch_runner(loaded.model, loaded.dtype))
    dtype = str(loaded.dtype).removeprefix("torch.")
    return _Side(loaded.source(), [runtime], loaded, loaded.input_shape, dtype, integrity, loaded.token_input)


def _onnx_input(path: Path) -> tuple[tuple[int, ...] | None, str, bool]:
    """One sample's input shape (None when an axis besides the batch is dynamic), the dtype name that sets the
    tolerance (the first output's: an int64 token input says nothing about precision), and whether the input
    is integer token ids."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    tensor_type = model.graph.input[0].type.tensor_type
    dims = tensor_type.shape.dim
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
    input_dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
    output_type = model.graph.output[0].type.tensor_type.elem_type if model.graph.output else tensor_type.elem_type
    dtype = str(onnx.helper.tensor_dtype_to_np_dtype(output_type))
    token_input = bool(np.issubdtype(input_dtype, np.integer))
    return (None if any(s <= 0 for s in shape[1:]) else shape[1:]), dtype, token_input


def verify(
    reference: Path | str,
    candidate: Path | str,
    *,
    arch: str | None = None,
    ema: bool = False,
    inputs: Path | str | None = None,
    samples: int = 64,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """Compare a candidate model with a reference on the same inputs.

    Each side is a checkpoint (``--arch`` or detection), a ``.pt2``, a fused ``model.safetensors`` (its
    metadata names the architecture) or an ``.onnx`` (``onnx.checker`` full check, then onnxruntime with
    optimisations off and fully on: both must pass). Inputs: ``inputs`` (``.npz``), else ``holdout.npz``
    beside a checkpoint side, else ``samples`` seeded random samples of the model's input shape. The
    tolerance defaults by the reference's dtype (DESIGN.md section 5).

    With ``stream``, both sides are LLaMA-layout safetensors folders (sharded or not) compared one decoder layer
    at a time in bounded memory (``layerwise.verify_folders``; ``samples`` token sequences), for models too big
    to load whole.

    Returns:
        ``{"slabconv_version", "reference", "candidate", "verification"}``; ``verification.passed`` says
        whether every check passed (the CLI exits 1 when not). ``verification.checks`` has one entry per
        output and candidate runtime, ``verification.integrity`` one per file check.

    Raises:
        InputError, UnsupportedModelError, UsageError: a side cannot be read or run, or the two sides are
            not the same model (exit code 2).
    """
    ref_path, cand_path = Path(reference), Path(candidate)
    if stream:
        return _verify_streaming(ref_path, cand_path, inputs, samples, seed, rtol, atol)
    ref = _side(ref_path, arch, ema, trust_pickle, input_shape, image_size)
    cand = _side(cand_path, arch, ema, trust_pickle, input_shape, image_size)
    if ref.input_shape and cand.input_shape and ref.input_shape != cand.input_shape:
        raise InputError(
            f"{ref_path} takes inputs of shape {ref.input_shape} but {cand_path} takes {cand.input_shape}; "
            "the two files are not the same model"
        )
    shape = tuple(input_shape) if input_shape else (ref.input_shape or cand.input_shape)
    token_input = ref.token_input or cand.token_input
    if token_input and not inputs and ref.loaded is None and cand.loaded is None:
        raise UsageError("these models take token ids whose range the .onnx files do not record; pass --inputs NPZ")
    x, label, digest = choose_inputs(ref.loaded or cand.loaded, inputs, samples, seed, shape)
    if token_input and not np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.int64)
    ref_runtime = ref.runtimes[0]
    reference_out = run_batched(ref_runtime.run, x, fixed_batch=ref_runtime.fixed_batch)
    names = output_names(len(reference_out), ref_runtime.output_names or cand.runtimes[0].output_names)
    tol = default_rtol(ref.dtype, rtol)
    checks = []
    for rt in cand.runtimes:
        candidate_out = run_batched(rt.run, x, fixed_batch=rt.fixed_batch)
        try:
            checks += compare_runtimes(reference_out, names, candidate_out, rt.label, tol, atol, token_input)
        except InputError as err:
            raise InputError(f"{ref_path} vs {cand_path}: {err}") from None
    verification = Verification(checks, ref.integrity + cand.integrity, _runtime_name(cand.runtimes), label, digest)
    return {
        "slabconv_version": __version__,
        "reference": {**ref.info, "runtime": ref_runtime.label},
        "candidate": cand.info,
        "verification": verification.to_dict(),
    }


def _verify_streaming(
    ref_path: Path,
    cand_path: Path,
    inputs: Path | str | None,
    samples: int,
    seed: int,
    rtol: float | None,
    atol: float,
) -> dict[str, Any]:
    from slabconv.load import hf
    from slabconv.verify import layerwise

    if inputs is not None:
        raise UsageError("--stream draws seeded random token sequences (--samples, --seed); --inputs is not supported")
    for path in (ref_path, cand_path):
        if not path.is_dir():
            raise UsageError(f"{path}: --stream compares Hugging Face style folders; give the folder, not a file")
    verification = layerwise.verify_folders(ref_path, cand_path, sequences=samples, seed=seed, rtol=rtol, atol=atol)

    def info(path: Path) -> dict[str, Any]:
        found = hf.hf_weights_file(path)
        assert found is not None  # LazyShards.open accepted the folder
        return {"path": str(path), "format": found[1], "index_sha256": sha256_file(found[0]), "arch": "llama_prepbn"}

    return {
        "slabconv_version": __version__,
        "reference": {**info(ref_path), "runtime": verification.runtime},
        "candidate": info(cand_path),
        "verification": verification.to_dict(),
    }


# --------------------------------------------------------------------------------------------- bench


def bench(
    path: Path | str,
    *,
    arch: str | None = None,
    ema: bool = False,
    batches: tuple[int, ...] = (1, 8, 64),
    runtimes: tuple[str, ...] | None = None,
    warmup: int = 5,
    repeats: int = 20,
    image_size: int | None = None,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Latency and throughput of the original, fused, norm-free and (if any) LayerNorm-branch models.

    ``path`` is a checkpoint, or a folder written by ``fuse`` (its report names the checkpoint).
    ``runtimes``: names from ``slabconv.bench.RUNTIMES``; default every runtime this machine has (the CPU
    pair, plus CUDA ones where a device is present). See ``slabconv.bench`` for what each variant is and how
    timings are taken.

    Raises:
        UsageError: a runtime this machine cannot run (``--runtime pytorch-cuda`` without CUDA).

    Returns:
        ``{"slabconv_version", "source", "timings": [...], "fused_over_norm_free": [...], "settings": {...}}``.
    """
    import platform

    from slabconv import bench as bench_mod

    source = Path(path)
    if source.is_dir():
        report_path = source / "report.json"
        if not report_path.exists():
            raise InputError(f"{source}: a folder without report.json; give a checkpoint or a fuse output folder")
        source = Path(json.loads(report_path.read_text())["source"]["path"])
        arch = arch or json.loads(report_path.read_text())["source"].get("arch")
    loaded = load_model(source, arch=arch, ema=ema, image_size=image_size)
    chosen = list(runtimes) if runtimes else bench_mod.default_runtimes()
    timings = bench_mod.bench_models(
        loaded.model, lambda batch: loaded.example(batch, seed=1), list(batches), chosen, warmup, repeats, progress
    )
    return {
        "slabconv_version": __version__,
        "source": loaded.source(),
        "timings": [t.to_dict() for t in timings],
        "fused_over_norm_free": bench_mod.ratios(timings),
        "settings": {
            "batches": list(batches),
            "runtimes": chosen,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "warmup": warmup,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
    }
