"""``slabconv bench``: latency and throughput of the original, fused and norm-free models, side by side.

Variants, all built from the same checkpoint:

- ``original``: the model in eval mode, RepBN as trained (BatchNorm + alpha * x, with its transposes).
- ``fused``: slabconv's output.
- ``norm-free``: the same graph with every norm replaced by identity: the bound a fold can reach.
- ``layernorm``: where the checkpoint carries the progressive LayerNorm/RMSNorm branch (``LinearNorm.norm1``),
  the same weights run with that branch: the model a user would ship without SLAB.

Runtimes (``RUNTIMES``: the entries of ``slabconv.verify.backends.BACKENDS`` that ``bench`` takes, the table
``verify`` runs its files with too): ``pytorch`` and ``onnxruntime`` on the CPU, and where a CUDA device is present
``pytorch-cuda`` (float32), ``pytorch-cuda-fp16``, ``pytorch-cuda-graphs-fp16`` (the fp16 model captured once
in a CUDA graph and replayed: no Python or launch overhead), and with ``onnxruntime-gpu`` installed
``onnxruntime-cuda`` / ``onnxruntime-cuda-fp16`` (CUDAExecutionProvider, inputs and outputs bound on the device
with I/O binding). The default is every runtime this machine has (``default_runtimes``).

For PyTorch every variant runs as the ``torch.export`` graph module of the model (so all four pay the same
Python overhead), traced and folded in the runtime's dtype on the CPU and then moved to its device
(``to_device``); for onnxruntime every variant is exported by the same exporter. Timings are interleaved: each
repeat runs every variant once, in turn, so a busy machine slows all of them alike; CUDA timings synchronise the
device after each call. Medians and the inter-quartile range are reported; the headline is fused / norm-free (a
complete fold sits at 1.00).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from slabconv.engine import capture, fold_all, norm_free
from slabconv.errors import UsageError
from slabconv.util import Progress, no_progress, quiet
from slabconv.verify.backends import BACKENDS, Backend, backend_names
from slabconv.verify.runtimes import ORT_LEVELS, Runtime
from slabconv.verify.runtimes import to_device as to_device  # bench.to_device: moving the variants, in one place
from slabconv.write.onnx import export_onnx
from slabconv.write.output_checks import holds_mark
from slabconv.write.staging import check_output_file, staging_file
from slabconv.zoo.norms import LinearNorm

RUNTIMES: dict[str, Backend] = {name: BACKENDS[name] for name in backend_names("bench")}


def default_runtimes() -> list[str]:
    """Every runtime this machine can run: the CPU pair, plus the CUDA ones where a device (and for onnxruntime
    the CUDA provider) is present; the opt-in ones (``onnxruntime-int8``) only when named."""
    return [name for name, spec in RUNTIMES.items() if not spec.opt_in and spec.unavailable() is None]


def check_runtimes(names: list[str]) -> list[Backend]:
    """The backends of ``names``.

    Raises:
        UsageError: an unknown name, or a runtime this machine cannot run (with the reason).
    """
    unknown = [n for n in names if n not in RUNTIMES]
    if unknown or not names:
        raise UsageError(f"--runtime {','.join(unknown) or '(empty)'}: choose from {', '.join(RUNTIMES)}")
    specs = [RUNTIMES[n] for n in names]
    for spec in specs:
        reason = spec.unavailable()
        if reason is not None:
            raise UsageError(f"--runtime {spec.name} cannot run here: {reason}")
    return specs


def build_variants(
    model: nn.Module, example: torch.Tensor, dtype: torch.dtype, progress: Progress = no_progress
) -> dict[str, fx.GraphModule]:
    """The variants as ``torch.export`` graph modules in ``dtype``: ``original``, ``fused`` (``fold_all``),
    ``norm-free`` and, for progressive norms, ``layernorm``. Traced on the CPU."""
    model = copy.deepcopy(model).to(dtype).eval()
    x = example.to(dtype) if example.is_floating_point() else example
    progress(f"tracing the model ({str(dtype).removeprefix('torch.')})")
    with quiet():
        original = capture(model, x)
        fused = copy.deepcopy(original)
        fold_all(fused)
        out = {"original": original, "fused": fused, "norm-free": norm_free(original)}
        layernorm = layernorm_variant(model)
        if layernorm is not None:
            out["layernorm"] = capture(layernorm, x)
    return out


@dataclass
class Timing:
    """One variant on one runtime at one batch size. Times in milliseconds per call."""

    variant: str
    runtime: str
    batch: int
    median_ms: float
    p25_ms: float
    p75_ms: float
    throughput: float  # samples per second at the median

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layernorm_variant(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose ``LinearNorm`` modules run their ``norm1`` (LayerNorm/RMSNorm) branch, or None
    when the model has no progressive norm."""
    if not any(isinstance(m, LinearNorm) for m in model.modules()):
        return None
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, LinearNorm):
            parent = out.get_submodule(name.rpartition(".")[0]) if "." in name else out
            setattr(parent, name.rpartition(".")[2], module.norm1)
    return out.eval()


def _time_interleaved(runners: Mapping[str, Callable[..., Any]], warmup: int, repeats: int) -> dict[str, list[float]]:
    for run in runners.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter_ns()
            run()
            samples[name].append((time.perf_counter_ns() - start) / 1e6)
    return samples


def _summary(variant: str, runtime: str, batch: int, ms: list[float]) -> Timing:
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    med = statistics.median(ms)
    return Timing(variant, runtime, batch, med, q[0], q[2], batch / (med / 1e3))


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def _open_variants(
    spec: Backend,
    graphs: dict[str, fx.GraphModule],
    example: torch.Tensor,
    exported: dict[torch.dtype, dict[str, Path]],
    folder: Path,
    progress: Progress,
    calibration: torch.Tensor,
) -> dict[str, Runtime]:
    """Each variant opened in ``spec``: its graph module, or (for a backend that runs ``.onnx`` files) its export in
    ``spec.dtype``, written once per dtype into ``folder`` and kept in ``exported``. onnxruntime runs it with all
    optimisations (its default session); an int8 backend quantizes each export, calibrated on ``calibration``."""
    if spec.takes == "module":
        return {name: spec.open(gm)[0] for name, gm in graphs.items()}
    if spec.dtype not in exported:
        exported[spec.dtype] = {}
        for name, gm in graphs.items():
            dtype = str(spec.dtype).removeprefix("torch.")
            progress(f"exporting {name} ({dtype}) to ONNX")
            path = folder / f"{name}-{dtype}.onnx"
            export_onnx(gm, _cast(example, spec.dtype), path)
            exported[spec.dtype][name] = path
    how: dict[str, Any] = {"levels": ORT_LEVELS[-1:]}
    if spec.quantized:  # int8: each variant quantized alike, calibrated on the same inputs
        how["calibration"] = np.ascontiguousarray(_cast(calibration, spec.dtype).numpy())
    return {name: spec.open(path, **how)[0] for name, path in exported[spec.dtype].items()}


def bench_models(
    model: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    batches: list[int],
    runtimes: list[str],
    warmup: int = 5,
    repeats: int = 20,
    progress: Progress = no_progress,
) -> list[Timing]:
    """Time each variant of ``model`` on each runtime and batch size, interleaved.

    Args:
        model: the loaded model (eval mode); ``build_variants`` makes the variants in each runtime's dtype.
        make_input: ``make_input(batch) -> Tensor``, a valid float32 (or token id) input of that batch size.
        batches: batch sizes.
        runtimes: names from ``RUNTIMES`` (``check_runtimes``).
        warmup, repeats: calls before timing, and timed calls per variant.

    Raises:
        UsageError: an unknown runtime or one this machine cannot run.
    """
    specs = check_runtimes(runtimes)
    example = make_input(2)
    calibration = make_input(CALIBRATION_SAMPLES) if any(s.quantized for s in specs) else example
    graphs = {dtype: build_variants(model, example, dtype, progress) for dtype in dict.fromkeys(s.dtype for s in specs)}
    timings: list[Timing] = []
    with tempfile.TemporaryDirectory() as tmp:
        exported: dict[torch.dtype, dict[str, Path]] = {}
        opened = {
            spec.name: _open_variants(spec, graphs[spec.dtype], example, exported, Path(tmp), progress, calibration)
            for spec in specs
        }
        for batch in batches:
            x = make_input(batch)
            for spec in specs:
                progress(f"timing {spec.name}, batch {batch}")
                feed = np.ascontiguousarray(_cast(x, spec.dtype).numpy())
                with torch.inference_mode():
                    runners = {name: runtime.timed(feed) for name, runtime in opened[spec.name].items()}
                    for name, ms in _time_interleaved(runners, warmup, repeats).items():
                        timings.append(_summary(name, spec.name, batch, ms))
    return timings


CALIBRATION_SAMPLES = 32
"""Inputs an int8 runtime (``onnxruntime-int8``) is calibrated on in ``bench``: drawn like the timed ones."""

NOISY_WIDTH = 0.2
"""A ratio's spread (``high - low``) above this is reported as too noisy to read."""


def ratios(timings: list[Timing]) -> list[dict[str, Any]]:
    """``median(fused) / median(norm-free)`` per runtime and batch size (1.00 = the bound is reached), with its
    spread: ``low = p25(fused) / p75(norm-free)``, ``high = p75(fused) / p25(norm-free)``, and ``noisy`` when that
    spread is wider than ``NOISY_WIDTH`` (the machine was busy: rerun with more repeats)."""
    table = {(t.variant, t.runtime, t.batch): t for t in timings}
    out = []
    for (variant, runtime, batch), t in table.items():
        other = table.get(("norm-free", runtime, batch))
        if variant != "fused" or other is None:
            continue
        low, high = t.p25_ms / other.p75_ms, t.p75_ms / other.p25_ms
        out.append(
            {
                "runtime": runtime,
                "batch": batch,
                "ratio": t.median_ms / other.median_ms,
                "low": low,
                "high": high,
                "noisy": bool(high - low > NOISY_WIDTH),
            }
        )
    return out


PLOT_FORMATS = {"png": "Software", "svg": "Creator", "pdf": "Creator"}
"""The image formats ``--plot`` writes, each with the metadata key that marks the file as slabconv's."""

PLOT_MARK = "slabconv bench"


def plot_written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is a chart ``plot`` wrote (its metadata, in its first 8 MiB, names ``PLOT_MARK``)."""
    return holds_mark(path, PLOT_MARK.encode(), 8 << 20)


def check_plot_path(path: Path, force: bool, inputs: list[Path]) -> None:
    """Check before any timing that ``--plot PATH`` can be written: matplotlib is installed, the name ends in a
    format it writes here (``PLOT_FORMATS``), the path is no folder, no input and writable, and an existing file is
    replaced only with ``force`` and only when ``plot`` wrote it.

    Raises:
        UsageError: naming the path and what to do.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install slabconv[plot]")
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"--plot {path} is a folder; give a file path such as {path / 'bench.png'}")
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in PLOT_FORMATS:
        what = f"'.{suffix}' files" if suffix else "a name without an extension"
        raise UsageError(f"--plot {path}: slabconv cannot write {what}; give a name ending in .png, .svg or .pdf")
    try:
        check_output_file(path, force=force, inputs=inputs, owned=plot_written_by_slabconv)
    except UsageError as err:
        raise UsageError(f"--plot {err}") from None


def _save_plot(fig: Any, path: Path) -> None:
    """``fig`` written to ``path`` (its folders made), marked ``PLOT_MARK``, staged as ``check_plot_path`` allowed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = PLOT_FORMATS.get(path.suffix.lower().removeprefix("."), "Creator")
    with staging_file(path, force=True, owned=plot_written_by_slabconv) as tmp:
        fig.savefig(tmp / path.name, dpi=120, metadata={key: PLOT_MARK})
    plt.close(fig)


def plot(timings: list[Timing], path: Path) -> None:
    """Bar chart of median latency per variant, one panel per runtime, error bars from p25 to p75 (matplotlib, Agg
    backend).

    The file's metadata names ``PLOT_MARK`` (so a rerun with ``--force`` may replace it); missing folders on the
    way are made. ``check_plot_path`` checks the path first.

    Raises:
        ImportError: matplotlib is not installed (``pip install slabconv[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtimes = sorted({t.runtime for t in timings})
    batches = sorted({t.batch for t in timings})
    variants = list(dict.fromkeys(t.variant for t in timings))
    fig, axes = plt.subplots(1, len(runtimes), figsize=(5 * len(runtimes), 3.6), squeeze=False)
    width = 0.8 / len(variants)
    for ax, runtime in zip(axes[0], runtimes, strict=True):
        for i, variant in enumerate(variants):
            found = [
                next((t for t in timings if (t.variant, t.runtime, t.batch) == (variant, runtime, b)), None)
                for b in batches
            ]
            values = [t.median_ms if t else 0.0 for t in found]
            spread = [
                [t.median_ms - t.p25_ms if t else 0.0 for t in found],
                [t.p75_ms - t.median_ms if t else 0.0 for t in found],
            ]
            xs = [j + i * width for j in range(len(batches))]
            ax.bar(xs, values, width, label=variant, yerr=spread, capsize=2)
        ax.set_xticks(
            [j + width * (len(variants) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches]
        )
        ax.set_ylabel("median latency (ms)")
        ax.set_yscale("log")
        ax.set_title(runtime)
        ax.legend(fontsize=8)
    _save_plot(fig, path)


def source_of_output(folder: Path, options: Any) -> tuple[Path, Any]:
    """The checkpoint a ``fuse`` output folder came from (its report names it), and the load options with the
    architecture the report recorded (unless given).

    Raises:
        InputError: the report is unreadable or names no source.
    """
    from dataclasses import replace

    from slabconv.errors import InputError
    from slabconv.load.fused import WrittenReport

    report = WrittenReport.read(folder)
    source = report.source if report is not None else None
    if source is None or not isinstance(source.get("path"), str):
        raise InputError(f"{folder}: its report.json names no source checkpoint; give the checkpoint")
    path = Path(source["path"])
    return path, (options if options.arch else replace(options, arch=source.get("arch")))


def result(
    timings: list[Timing], batches: tuple[int, ...], runtimes: list[str], warmup: int, repeats: int
) -> dict[str, Any]:
    """The report's bench blocks: ``timings``, the headline ratios and the settings they were taken with."""
    import platform

    return {
        "timings": [t.to_dict() for t in timings],
        "fused_over_norm_free": ratios(timings),
        "settings": {
            "batches": list(batches),
            "runtimes": runtimes,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "warmup": warmup,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
    }


def plot_boundaries(localization: Any, path: Path) -> None:
    """``verify --localize --plot``: the relative error at every fold boundary (``Localization.boundaries``, in
    data-flow order) on a log scale, the candidate against the correct fold and the correct fold against the
    original, with the bound; the same marked, staged file as ``plot`` (``check_plot_path`` checks the path first).

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    boundaries = localization.boundaries
    floor = 1e-18  # an exact 0 on a log scale
    xs = list(range(len(boundaries)))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(boundaries)), 3.6))
    ax.plot(xs, [max(b.error, floor) for b in boundaries], "o-", label="candidate vs the correct fold")
    rounding = [max(b.rounding, floor) if b.rounding is not None else None for b in boundaries]
    if any(r is not None for r in rounding):
        ax.plot(xs, [r if r is not None else float("nan") for r in rounding], "s--", label="correct fold vs original")
    if boundaries:
        ax.axhline(boundaries[0].bound, color="red", linewidth=1, label="bound")
    ax.set_xticks(xs, [f"{b.norm} -> {b.layer}" for b in boundaries], rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("relative error at the boundary")
    ax.legend(fontsize=8)
    _save_plot(fig, path)
