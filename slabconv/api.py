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
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError
from slabconv.graph import capture
from slabconv.io import (
    Checkpoint,
    export_onnx,
    load_checkpoint,
    quiet,
    save_safetensors,
    sha256_file,
    staging_dir,
)
from slabconv.plan import Decision, fold_all, fused_state_dict
from slabconv.verify import DEFAULT_RTOL, Comparison, compare, onnx_runners, onnxruntime_version, run_batched
from slabconv.zoo import ArchSpec, detect_arch, get_arch

Progress = Callable[[str], None]


def _no_progress(message: str) -> None:
    return None


@dataclass
class LoadedModel:
    """A checkpoint built into a runnable model.

    Attributes:
        model: the network in eval mode (an ``nn.Module`` or the ``GraphModule`` of a ``.pt2``).
        checkpoint: what was read from the file.
        arch: the registered architecture name (None for a ``.pt2``).
        input_shape: one sample's input shape, without the batch axis.
        dtype: the floating dtype of the weights (and of the input).
    """

    model: nn.Module
    checkpoint: Checkpoint
    arch: str | None
    input_shape: tuple[int, ...]
    dtype: torch.dtype

    def source(self) -> dict[str, Any]:
        """The ``source`` block of the report."""
        ckpt = self.checkpoint
        return {
            "path": str(ckpt.path),
            "sha256": ckpt.sha256,
            "format": ckpt.format,
            "arch": self.arch,
            "weights": ckpt.extra.get("weights"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "input_shape": list(self.input_shape),
        }


def _float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    for value in state_dict.values():
        if value.is_floating_point():
            return value.dtype
    return torch.float32


def _load_strict(model: nn.Module, state_dict: dict[str, torch.Tensor], arch: str) -> None:
    """``load_state_dict(strict=True)`` with one readable line for missing, unexpected and mis-shaped keys."""
    expected = model.state_dict()
    problems = []
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    for label, items in (("shape mismatch", shapes), ("missing keys", missing), ("unexpected keys", unexpected)):
        if items:
            shown = ", ".join(items[:4]) + (f", ... ({len(items) - 4} more)" if len(items) > 4 else "")
            problems.append(f"{label} ({len(items)}): {shown}")
    if problems:
        raise InputError(f"the checkpoint does not fit architecture {arch!r}: " + "; ".join(problems))
    model.load_state_dict(state_dict, strict=True)


def load_model(path: Path | str, arch: str | None = None, ema: bool = False) -> LoadedModel:
    """Read a checkpoint and build the model it holds, in eval mode.

    Args:
        path: checkpoint (``.pth``), a ``.pt2`` program, or a fused ``model.safetensors`` written by ``fuse``.
        arch: a registered architecture name or alias; detected from the checkpoint when None.
        ema: use the EMA weights of a training checkpoint.

    Raises:
        InputError: unreadable file or weights that do not fit the architecture.
        UnsupportedModelError: unknown or undetectable architecture.
    """
    ckpt = load_checkpoint(path, ema=ema)
    if ckpt.format == "torch.export":
        return _load_program(ckpt)
    norm = "checkpoint"
    config = ckpt.config
    if ckpt.format == "safetensors" and "slabconv_version" in ckpt.metadata:
        if ckpt.metadata.get("complete") != "true":
            raise UnsupportedModelError(
                f"{ckpt.path}: this fused model keeps some norms as affines; verify the model.onnx beside it"
            )
        arch = arch or ckpt.metadata.get("arch")
        config = json.loads(ckpt.metadata.get("config", "{}"))
        norm = "identity"
    spec: ArchSpec = get_arch(arch) if arch else detect_arch(ckpt.state_dict, config)
    try:
        model = spec.build(ckpt.state_dict, config, norm)
    except UnsupportedModelError:
        raise
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise InputError(f"{ckpt.path}: cannot build {spec.name!r} from this checkpoint ({err})") from None
    dtype = _float_dtype(ckpt.state_dict)
    model.to(dtype)
    _load_strict(model, ckpt.state_dict, spec.name)
    model.eval()
    return LoadedModel(model, ckpt, spec.name, tuple(spec.input_shape(ckpt.state_dict, config)), dtype)


def _load_program(ckpt: Checkpoint) -> LoadedModel:
    program = ckpt.program
    user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    if len(user_inputs) != 1:
        raise UnsupportedModelError(f"{ckpt.path}: slabconv handles programs with one tensor input")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == user_inputs[0])
    val = node.meta["val"]
    shape = tuple(int(s) if isinstance(s, int) else -1 for s in val.shape[1:])
    if any(s < 0 for s in shape):
        raise UnsupportedModelError(f"{ckpt.path}: only the batch axis of the input may be dynamic")
    return LoadedModel(program.module(), ckpt, None, shape, val.dtype)


def _inputs(loaded: LoadedModel, inputs: Path | str | None, samples: int, seed: int) -> tuple[np.ndarray, str]:
    """The verification inputs: ``inputs`` (an ``.npz``), else ``holdout.npz`` beside the checkpoint, else
    ``samples`` seeded standard-normal samples of the model's input shape."""
    path = Path(inputs) if inputs else None
    if path is None and (loaded.checkpoint.path.parent / "holdout.npz").exists():
        path = loaded.checkpoint.path.parent / "holdout.npz"
    if path is None:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((samples, *loaded.input_shape)).astype(np.float32)
        return x, f"random(seed={seed}, samples={samples})"
    return load_npz_inputs(path, loaded.input_shape), str(path)


def load_npz_inputs(path: Path, input_shape: tuple[int, ...]) -> np.ndarray:
    """The ``x`` array of an ``.npz`` (or its only array), checked against the model's input shape.

    Raises:
        InputError: unreadable file, no array, or a shape that is not ``(N, *input_shape)``.
    """
    try:
        with np.load(path) as data:
            key = "x" if "x" in data.files else (data.files[0] if len(data.files) == 1 else None)
            if key is None:
                raise InputError(f"{path}: expected an array named 'x' (found {', '.join(data.files)})")
            x = np.asarray(data[key], dtype=np.float32)
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: not a readable .npz file ({err})") from None
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise InputError(f"{path}: inputs have shape {x.shape}, the model takes (N, {', '.join(map(str, input_shape))})")
    return x


def _torch_runner(model: nn.Module, dtype: torch.dtype) -> Callable[[np.ndarray], np.ndarray]:
    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.from_numpy(x).to(dtype))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out.float().numpy()

    return run


def _example(loaded: LoadedModel, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn((batch, *loaded.input_shape), generator=gen).to(loaded.dtype)


def _rtol(dtype: torch.dtype, rtol: float | None) -> float:
    return rtol if rtol is not None else DEFAULT_RTOL.get(str(dtype).removeprefix("torch."), 1e-5)


def _summarise(checks: list[Comparison], runtime: str, inputs: str) -> dict[str, Any]:
    """The report's ``verification`` block: the worst numbers over every check, and each check."""
    agreements = [c.top1_agreement for c in checks if c.top1_agreement is not None]
    return {
        "passed": all(c.passed for c in checks),
        "samples": checks[0].samples if checks else 0,
        "max_abs_err": max(c.max_abs_err for c in checks),
        "max_rel_err": max(c.max_rel_err for c in checks),
        "top1_agreement": min(agreements) if agreements else None,
        "tolerance": checks[0].tolerance,
        "runtime": runtime,
        "inputs": inputs,
        "checks": [c.to_dict() for c in checks],
    }


def _plan(loaded: LoadedModel, progress: Progress) -> tuple[torch.fx.GraphModule, list[Decision]]:
    progress("tracing the model with torch.export")
    with quiet():
        gm = capture(loaded.model, _example(loaded))
    progress("planning folds")
    decisions = fold_all(gm, progress=lambda name: progress(f"folded {name}"))
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


def inspect(path: Path | str, arch: str | None = None, ema: bool = False, progress: Progress = _no_progress) -> dict:
    """The fold plan for a checkpoint: one entry per norm (action, consumers, reason). Nothing is written.

    Raises:
        InputError, UnsupportedModelError: as ``load_model``.
    """
    loaded = load_model(path, arch=arch, ema=ema)
    _, decisions = _plan(loaded, progress)
    return _base_report(loaded, decisions)


def _check_out(source: Path, out: Path) -> None:
    src, dst = source.resolve(), out.resolve()
    if dst == src or src.is_relative_to(dst):
        raise UsageError(f"the output folder {out} would replace the input {source}; choose another --out")


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
    progress: Progress = _no_progress,
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
        progress: called with a short message at each stage.

    Returns:
        The report (``report.json``).

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input or options (exit code 2); nothing is written.
        VerificationError: the fused model differs beyond tolerance (exit code 1); nothing is written, the
            report is attached as ``err.report``.
    """
    source = Path(path)
    out_dir = Path(out) if out is not None else source.with_name(f"{source.stem}-fused")
    _check_out(source, out_dir)
    if out_dir.exists() and not force:
        raise UsageError(f"{out_dir} already exists; pass --force to replace it")
    progress(f"loading {source}")
    loaded = load_model(source, arch=arch, ema=ema)
    gm, decisions = _plan(loaded, progress)
    report = _base_report(loaded, decisions)
    complete = all(d.action.startswith("folded") for d in decisions)
    metadata = {
        "format": "pt",
        "slabconv_version": __version__,
        "arch": loaded.arch or "",
        "source_sha256": loaded.checkpoint.sha256,
        "complete": "true" if complete else "false",
        "config": json.dumps(loaded.checkpoint.config),
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
            report["verification"] = _verify_fused(loaded, gm, tmp / "model.onnx" if onnx else None, inputs,
                                                   samples, seed, rtol)
        else:
            report["verification"] = None
        outputs["sha256"] = {name: sha256_file(tmp / name) for name in ("model.safetensors", "model.onnx")
                             if (tmp / name).exists()}
        report["outputs"] = outputs
        report["out_dir"] = str(out_dir)
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if verify and not report["verification"]["passed"]:
            raise VerificationError(_failure_line(report["verification"]), report)
    return report


def _failure_line(verification: dict[str, Any]) -> str:
    worst = max(verification["checks"], key=lambda c: c["max_rel_err"])
    return (
        f"the fused model differs from the original: {worst['name']} max rel err {worst['max_rel_err']:.3g} "
        f"(tolerance {worst['tolerance']:g}), top-1 agreement {worst['top1_agreement']}; nothing was written"
    )


def _verify_fused(
    loaded: LoadedModel,
    gm: torch.fx.GraphModule,
    onnx_path: Path | None,
    inputs: Path | str | None,
    samples: int,
    seed: int,
    rtol: float | None,
) -> dict[str, Any]:
    x, label = _inputs(loaded, inputs, samples, seed)
    reference = run_batched(_torch_runner(loaded.model, loaded.dtype), x)
    tol = _rtol(loaded.dtype, rtol)
    if onnx_path is None:
        cand = run_batched(_torch_runner(gm, loaded.dtype), x)
        return _summarise([compare("output @ pytorch", reference, cand, tol)], f"torch {torch.__version__}", label)
    checks = []
    for name, run in onnx_runners(onnx_path).items():
        checks.append(compare(f"output @ {name}", reference, run_batched(run, x), tol))
    return _summarise(checks, onnxruntime_version(), label)


def export(
    path: Path | str,
    onnx_path: Path | str,
    *,
    arch: str | None = None,
    ema: bool = False,
    fuse: bool = True,
    force: bool = False,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Write one ONNX file: the fused model, or with ``fuse=False`` the original one (norms as they are).

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``fuse``.
    """
    source, target = Path(path), Path(onnx_path)
    if target.resolve() == source.resolve():
        raise UsageError(f"--onnx {target} is the input file; choose another path")
    if target.exists() and not force:
        raise UsageError(f"{target} already exists; pass --force to replace it")
    loaded = load_model(source, arch=arch, ema=ema)
    decisions: list[Decision] = []
    model: nn.Module = loaded.model
    if fuse:
        model, decisions = _plan(loaded, progress)
    progress(f"exporting {target.name}")
    with staging_dir(target.with_name(target.name + ".d"), force=True) as tmp:
        info = export_onnx(model, _example(loaded), tmp / target.name)
        (tmp / target.name).replace(target)
    report = _base_report(loaded, decisions)
    report["outputs"] = {"onnx": str(target), "onnx_info": info, "sha256": {target.name: sha256_file(target)}}
    return report


# --------------------------------------------------------------------------------------------- verify


def _side(path: Path, arch: str | None, ema: bool) -> tuple[dict[str, Any], dict[str, Callable], LoadedModel | None]:
    """Runners for one side of ``verify``: onnxruntime settings for ``.onnx``, PyTorch for anything else."""
    if path.suffix == ".onnx":
        if not path.exists():
            raise InputError(f"{path}: no such file")
        try:
            runners = onnx_runners(path)
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own types
            raise InputError(f"{path}: onnxruntime cannot load it ({str(err).strip().splitlines()[0][:200]})") from None
        info = {"path": str(path), "sha256": sha256_file(path), "format": "onnx", "arch": None}
        return info, runners, None
    loaded = load_model(path, arch=arch, ema=ema)
    return loaded.source(), {f"pytorch {torch.__version__}": _torch_runner(loaded.model, loaded.dtype)}, loaded


def _onnx_input_shape(path: Path) -> tuple[tuple[int, ...], int | None]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
    if any(s <= 0 for s in shape[1:]):
        raise UsageError(f"{path}: the input has dynamic axes besides the batch; pass --inputs NPZ")
    return shape[1:], (shape[0] if shape[0] > 0 else None)


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
) -> dict[str, Any]:
    """Compare a candidate model with a reference on the same inputs.

    Each side is a checkpoint (``--arch`` or detection), a ``.pt2``, a fused ``model.safetensors`` or an
    ``.onnx`` (run by onnxruntime with optimisations off and fully on: both must pass).

    Returns:
        ``{"slabconv_version", "reference", "candidate", "verification"}``; ``verification.passed`` says
        whether every check is within tolerance (the CLI exits 1 when not).

    Raises:
        InputError, UnsupportedModelError, UsageError: a side cannot be read or run (exit code 2).
    """
    ref_path, cand_path = Path(reference), Path(candidate)
    ref_info, ref_runners, ref_loaded = _side(ref_path, arch, ema)
    cand_info, cand_runners, cand_loaded = _side(cand_path, arch, ema)
    loaded = ref_loaded or cand_loaded
    fixed_batch = {}
    for p in (ref_path, cand_path):
        if p.suffix == ".onnx":
            shape, fixed_batch[p] = _onnx_input_shape(p)
    if loaded is not None:
        x, label = _inputs(loaded, inputs, samples, seed)
        dtype = loaded.dtype
    else:
        onnx_shape = _onnx_input_shape(ref_path)[0]
        if inputs:
            x, label = load_npz_inputs(Path(inputs), onnx_shape), str(inputs)
        else:
            x = np.random.default_rng(seed).standard_normal((samples, *onnx_shape)).astype(np.float32)
            label = f"random(seed={seed}, samples={samples})"
        dtype = torch.float32
    ref_name, ref_run = next(iter(ref_runners.items()))
    reference_out = run_batched(ref_run, x, fixed_batch=fixed_batch.get(ref_path))
    tol = _rtol(dtype, rtol)
    checks = [
        compare(f"output @ {name}", reference_out, run_batched(run, x, fixed_batch=fixed_batch.get(cand_path)), tol, atol)
        for name, run in cand_runners.items()
    ]
    runtime = ", ".join(cand_runners)
    return {
        "slabconv_version": __version__,
        "reference": {**ref_info, "runtime": ref_name},
        "candidate": cand_info,
        "verification": _summarise(checks, runtime, label),
    }
