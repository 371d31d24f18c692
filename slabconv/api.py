"""The Python API: ``fuse``, ``inspect``, ``export``, ``verify``. The CLI is a thin layer over these.

Data flows one way: load (``io``) -> build (``zoo``) -> capture (``graph``) -> plan and apply (``plan``) ->
write (``io``) -> verify (``verify``) -> report (a plain dict, the ``report.json`` schema of DESIGN.md section 4).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slabconv import __version__, reasons
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError
from slabconv.graph import capture
from slabconv.io import (
    Checkpoint,
    check_onnx_file,
    export_onnx,
    load_checkpoint,
    onnx_files,
    quiet,
    save_safetensors,
    sha256_file,
    staging_dir,
    staging_file,
)
from slabconv.plan import Decision, fold_all, fused_state_dict
from slabconv.verify import (
    DEFAULT_RTOL,
    IntegrityCheck,
    Runtime,
    Verification,
    check_safetensors_reload,
    compare_runtimes,
    failure_line,
    onnx_runtimes,
    onnxruntime_version,
    output_names,
    run_batched,
)
from slabconv.zoo import ArchSpec, detect_arch, get_arch
from slabconv.zoo.registry import with_image_size

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
        dtype: the floating dtype of the weights (and of a float input).
        input_dtype: the input's dtype when it is not a float tensor in ``dtype`` (``torch.int64`` token ids of
            a language model), else None.
        make_input: ``make_input(batch, seed) -> Tensor``: valid seeded inputs (token ids in range for a
            language model); None: standard-normal samples of ``input_shape`` (zeros for integer inputs).
        config: the config the model was built from (the saved one, plus an ``--image-size`` override).
    """

    model: nn.Module
    checkpoint: Checkpoint
    arch: str | None
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    input_dtype: torch.dtype | None = None
    make_input: Callable[[int, int], torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def token_input(self) -> bool:
        """True when the model takes integer ids (its logits' last axis is the vocabulary)."""
        return self.input_dtype is not None and not self.input_dtype.is_floating_point

    def example(self, batch: int, seed: int = 0) -> torch.Tensor:
        """``batch`` seeded inputs of the model's input shape and dtype."""
        if self.make_input is not None:
            return self.make_input(batch, seed)
        if self.token_input:
            return torch.zeros((batch, *self.input_shape), dtype=self.input_dtype)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *self.input_shape), generator=gen).to(self.dtype)

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


def _load_strict(model: nn.Module, state_dict: dict[str, torch.Tensor], arch: str, path: Path | None = None) -> None:
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
        where = f"{path}: " if path is not None else ""
        raise InputError(
            f"{where}the checkpoint does not fit architecture {arch!r}: "
            + "; ".join(problems)
            + " (a different model or a damaged file? check --arch, see `slabconv list`)"
        )
    model.load_state_dict(state_dict, strict=True)


def load_model(
    path: Path | str,
    arch: str | None = None,
    ema: bool = False,
    *,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
) -> LoadedModel:
    """Read a checkpoint and build the model it holds, in eval mode.

    Args:
        path: checkpoint (``.pth``), a ``.pt2`` program, or a fused ``model.safetensors`` written by ``fuse``.
        arch: a registered architecture name or alias; detected from the checkpoint when None.
        ema: use the EMA weights of a training checkpoint.
        trust_pickle: allow a pickle that names arbitrary globals, such as a whole ``nn.Module`` saved with
            ``torch.save(model)`` (this runs code from the file; only for files you trust).
        input_shape: one sample's input shape without the batch axis; required for a pickled ``nn.Module``
            (nothing in the file records it), ignored otherwise.
        image_size: build a zoo vision model for ``image_size`` square inputs (Swin pads its windows, PVT
            resamples position embeddings; models whose weights fix the resolution refuse another size).

    Raises:
        InputError: unreadable or unsafe file, weights that do not fit the architecture, a pickled module in
            train mode.
        UnsupportedModelError: unknown or undetectable architecture.
        UsageError: a pickled module without ``input_shape``.
    """
    ckpt = load_checkpoint(path, ema=ema, trust_pickle=trust_pickle)
    _check_values(ckpt)
    if ckpt.format == "torch.export":
        return _load_program(ckpt)
    if ckpt.format == "pickled-module":
        return _load_module(ckpt, input_shape)
    norm = "checkpoint"
    config = ckpt.config
    if (
        ckpt.format in ("safetensors", "hf-safetensors", "hf-safetensors-sharded")
        and "slabconv_version" in ckpt.metadata
    ):
        if ckpt.metadata.get("complete") != "true":
            raise UnsupportedModelError(
                f"{ckpt.path}: this fused model keeps some norms as affines; verify the model.onnx beside it"
            )
        arch = arch or ckpt.metadata.get("arch")
        config = json.loads(ckpt.metadata.get("config", "{}"))
        norm = "identity"
    if image_size is not None:
        config = with_image_size(config, image_size)
    try:
        spec: ArchSpec = get_arch(arch) if arch else detect_arch(ckpt.state_dict, config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{ckpt.path}: {err}") from None
    try:
        model = spec.build(ckpt.state_dict, config, norm)
    except UnsupportedModelError:
        raise
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise InputError(
            f"{ckpt.path}: cannot build {spec.name!r} from this checkpoint ({type(err).__name__}: {err}); "
            "it is another architecture: check --arch (see `slabconv list`)"
        ) from None
    dtype = _float_dtype(ckpt.state_dict)
    model.to(dtype)
    _load_strict(model, ckpt.state_dict, spec.name, ckpt.path)
    model.eval()
    shape = tuple(spec.input_shape(ckpt.state_dict, config))
    state = ckpt.state_dict

    def make_input(batch: int, seed: int) -> torch.Tensor:
        return spec.example(state, config, batch, seed, dtype)

    return LoadedModel(model, ckpt, spec.name, shape, dtype, spec.input_dtype, make_input, dict(config))


# Inf is refused only in tensors that are weights or norm statistics: some models keep -inf in mask buffers.
_FINITE_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "alpha")


def _check_values(ckpt: Checkpoint) -> None:
    """Refuse NaN anywhere, Inf in weights and norm statistics, and a negative ``running_var``, naming the first
    tensor that has them (``plan`` checks ``running_var + eps > 0`` again for models built in memory).

    Raises:
        InputError: a damaged checkpoint.
    """
    for key, value in ckpt.state_dict.items():
        if not value.is_floating_point() or value.numel() == 0:
            continue
        if bool(torch.isnan(value).any()) or (key.endswith(_FINITE_SUFFIXES) and not bool(torch.isfinite(value).all())):
            raise InputError(
                f"{ckpt.path}: tensor {key!r} holds NaN or Inf; the checkpoint is damaged (a diverged run or a bad "
                "save): use an earlier or intact checkpoint"
            )
        if key.endswith("running_var") and bool((value < 0).any()):
            raise InputError(
                f"{ckpt.path}: tensor {key!r} has running_var < 0 (a variance cannot be negative); the checkpoint is "
                "damaged: use an earlier or intact checkpoint"
            )


def _load_module(ckpt: Checkpoint, input_shape: tuple[int, ...] | None) -> LoadedModel:
    """A whole ``nn.Module`` read with ``trust_pickle``: used as it is, traced like any model."""
    model: nn.Module = ckpt.module
    if input_shape is None:
        raise UsageError(
            f"{ckpt.path}: a pickled nn.Module does not record its input shape; pass --input-shape with one "
            "sample's shape without the batch axis (e.g. --input-shape 3,224,224)"
        )
    in_train = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    norms = [name for name, m in model.named_modules() if m.training and isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if in_train:
        where = f"norm {norms[0]}" if norms else f"module {in_train[0]}"
        raise InputError(
            f"{ckpt.path}: {where} is in train mode (a norm would use batch statistics, not a fixed affine); "
            "call model.eval() before torch.save(model)"
        )
    return LoadedModel(model, ckpt, None, tuple(int(s) for s in input_shape), _float_dtype(ckpt.state_dict))


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
    input_dtype = None if val.dtype.is_floating_point else val.dtype
    weights_dtype = val.dtype if val.dtype.is_floating_point else _float_dtype(ckpt.state_dict)
    return LoadedModel(program.module(), ckpt, None, shape, weights_dtype, input_dtype)


def _inputs(
    loaded: LoadedModel | None,
    inputs: Path | str | None,
    samples: int,
    seed: int,
    input_shape: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, str, str | None]:
    """The verification inputs: ``inputs`` (an ``.npz``), else ``holdout.npz`` beside the checkpoint, else
    ``samples`` seeded standard-normal samples of the model's input shape.

    Returns:
        ``(x, label, sha256 of the .npz or None)``.

    Raises:
        UsageError: no input shape is known (dynamic ONNX axes) and no ``inputs`` were given.
        InputError: an unreadable ``.npz`` or one of the wrong shape.
    """
    shape = loaded.input_shape if loaded is not None else input_shape
    path = Path(inputs) if inputs else None
    if path is None and loaded is not None:
        ckpt_path = loaded.checkpoint.path
        beside = (ckpt_path if ckpt_path.is_dir() else ckpt_path.parent) / "holdout.npz"
        path = beside if beside.exists() else None
    if path is None:
        if shape is None:
            raise UsageError("the input shape is not fixed by the models; pass --inputs NPZ or --input-shape C,H,W")
        if samples < 1:
            raise UsageError(f"--samples must be at least 1 (got {samples})")
        label = f"random(seed={seed}, samples={samples})"
        if loaded is not None:
            if loaded.token_input and loaded.make_input is None:
                raise UsageError("the model takes token ids and their range is unknown; pass --inputs NPZ")
            x = loaded.example(samples, seed)
            # numpy has no bfloat16: float inputs travel as float32 and each runner casts them to its dtype.
            return (x.float() if x.is_floating_point() else x).numpy(), label, None
        rng = np.random.default_rng(seed)
        return rng.standard_normal((samples, *shape)).astype(np.float32), label, None
    if not path.is_file():
        raise InputError(f"{path}: no such file (--inputs)")
    integer = loaded is not None and loaded.token_input
    return load_npz_inputs(path, shape, integer=integer), str(path), sha256_file(path)


def load_npz_inputs(path: Path, input_shape: tuple[int, ...] | None, integer: bool = False) -> np.ndarray:
    """The ``x`` array of an ``.npz`` (or its only array), checked against the model's input shape.

    ``x`` is read as float32, or as int64 with ``integer`` (token ids of a language model).

    Raises:
        InputError: unreadable file, no array, or a shape that is not ``(N, *input_shape)``.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            key = "x" if "x" in data.files else (data.files[0] if len(data.files) == 1 else None)
            if key is None:
                raise InputError(f"{path}: expected an array named 'x' (found {', '.join(data.files)})")
            x = np.asarray(data[key], dtype=np.int64 if integer else np.float32)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"{path}: not a readable .npz file ({str(err).strip()[:200]})") from None
    if x.ndim < 1 or len(x) == 0:
        raise InputError(f"{path}: the input array is empty; give at least one sample")
    if input_shape is not None and tuple(x.shape[1:]) != tuple(input_shape):
        wanted = ", ".join(map(str, input_shape))
        raise InputError(f"{path}: inputs have shape {x.shape}, the model takes (N, {wanted}); give matching inputs")
    return x


def _torch_runner(model: nn.Module, dtype: torch.dtype) -> Callable[[np.ndarray], list[np.ndarray]]:
    """Run ``model`` on an array (float inputs cast to ``dtype``, integer ids as they are), returning every
    tensor output (tuples, lists and dicts flattened)."""

    def run(x: np.ndarray) -> list[np.ndarray]:
        t = torch.from_numpy(x)
        with torch.no_grad():
            out = model(t.to(dtype) if t.is_floating_point() else t)
        leaves = torch.utils._pytree.tree_leaves(out)
        return [t.detach().float().cpu().numpy() for t in leaves if isinstance(t, torch.Tensor)]

    return run


def _example(loaded: LoadedModel, batch: int = 2) -> torch.Tensor:
    return loaded.example(batch, seed=0)


def _rtol(dtype: torch.dtype, rtol: float | None) -> float:
    return rtol if rtol is not None else DEFAULT_RTOL.get(str(dtype).removeprefix("torch."), 1e-5)


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


def _check_out(source: Path, out: Path) -> None:
    src, dst = source.resolve(), out.resolve()
    if dst == src or src.is_relative_to(dst):
        raise UsageError(f"the output folder {out} would replace the input {source}; choose another --out")
    if dst.is_relative_to(src) and src.is_file():
        raise UsageError(f"the output folder {out} is inside the input file {source}; choose another --out")


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
    _check_out(source, out_dir)
    if out_dir.exists() and not force:
        raise UsageError(f"{out_dir} already exists; pass --force to replace it")
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
    x, label, digest = _inputs(loaded, inputs, samples, seed)
    reference = run_batched(_torch_runner(loaded.model, loaded.dtype), x)
    names = output_names(len(reference))
    tol = _rtol(loaded.dtype, rtol)
    integrity = [check_safetensors_reload(folder / "model.safetensors", fused_state_dict(gm), metadata)]
    if onnx:
        passed, detail = check_onnx_file(folder / "model.onnx")
        integrity.append(IntegrityCheck("onnx.checker[full_check] model.onnx", passed, detail))
        runtimes = onnx_runtimes(folder / "model.onnx")
    else:
        runtimes = [Runtime(f"pytorch {torch.__version__} (fused graph)", _torch_runner(gm, loaded.dtype))]
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
    if target.resolve() == source.resolve():
        raise UsageError(f"--onnx {target} is the input file; choose another path")
    if target.exists() and not force:
        raise UsageError(f"{target} already exists; pass --force to replace it")
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
    runtime = Runtime(f"pytorch {torch.__version__}", _torch_runner(loaded.model, loaded.dtype))
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
    x, label, digest = _inputs(ref.loaded or cand.loaded, inputs, samples, seed, shape)
    if token_input and not np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.int64)
    ref_runtime = ref.runtimes[0]
    reference_out = run_batched(ref_runtime.run, x, fixed_batch=ref_runtime.fixed_batch)
    names = output_names(len(reference_out), ref_runtime.output_names or cand.runtimes[0].output_names)
    tol = rtol if rtol is not None else DEFAULT_RTOL.get(ref.dtype, 1e-5)
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
    from slabconv import hf, layerwise

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
