"""``slabconv bench``: latency and throughput of the original, fused and norm-free models, side by side.

Variants, all built from the same checkpoint:

- ``original``: the model in eval mode, RepBN as trained (BatchNorm + alpha * x, with its transposes).
- ``fused``: slabconv's output.
- ``norm-free``: the same graph with every norm replaced by identity: the bound a fold can reach.
- ``layernorm``: where the checkpoint carries the progressive LayerNorm/RMSNorm branch (``LinearNorm.norm1``),
  the same weights run with that branch: the model a user would ship without SLAB.

For PyTorch every variant runs as the ``torch.export`` graph module of the model (so all four pay the same
Python overhead); for onnxruntime every variant is exported by the same exporter. Timings are interleaved:
each repeat runs every variant once, in turn, so a busy machine slows all of them alike. Medians and the
inter-quartile range are reported; the headline is fused / norm-free (a complete fold sits at 1.00).
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

from slabconv.graph import capture, find_norms
from slabconv.io import export_onnx, quiet
from slabconv.nn import LinearNorm
from slabconv.plan import cancel_inverse_views, drop_unused_attrs

Progress = Callable[[str], None]


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


def norm_free(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every norm's output replaced by its input (weights untouched): the norm-free bound."""
    out = copy.deepcopy(gm)
    for site in find_norms(out):
        site.output.replace_all_uses_with(site.input)
    out.graph.eliminate_dead_code()
    cancel_inverse_views(out)
    out.graph.eliminate_dead_code()
    drop_unused_attrs(out)
    out.recompile()
    return out


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


def bench_models(
    variants: dict[str, nn.Module],
    make_input: Callable[[int], torch.Tensor],
    batches: list[int],
    runtimes: list[str],
    warmup: int = 5,
    repeats: int = 20,
    progress: Progress = lambda message: None,
) -> list[Timing]:
    """Time each model of ``variants`` on each runtime and batch size, interleaved.

    Args:
        variants: name -> model (eval mode), all taking the same input.
        make_input: ``make_input(batch) -> Tensor``, a valid input of that batch size.
        batches: batch sizes.
        runtimes: ``pytorch`` (the torch.export graph module) and/or ``onnxruntime`` (CPU).
        warmup, repeats: calls before timing, and timed calls per variant.
    """
    timings: list[Timing] = []
    example = make_input(2)
    graphs = {name: model if isinstance(model, fx.GraphModule) else None for name, model in variants.items()}
    with quiet():
        for name, model in variants.items():
            if graphs[name] is None:
                progress(f"tracing {name}")
                graphs[name] = capture(model, example)
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        if "onnxruntime" in runtimes:
            import onnxruntime as ort

            for name, gm in graphs.items():
                progress(f"exporting {name} to ONNX")
                path = Path(tmp) / f"{name}.onnx"
                export_onnx(gm, example, path)  # type: ignore[arg-type]
                options = ort.SessionOptions()
                options.log_severity_level = 3
                sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for batch in batches:
            x = make_input(batch)
            if "pytorch" in runtimes:
                progress(f"timing pytorch, batch {batch}")
                with torch.inference_mode():
                    runners = {n: (lambda g=g, x=x: g(x)) for n, g in graphs.items()}
                    for name, ms in _time_interleaved(runners, warmup, repeats).items():
                        timings.append(_summary(name, "pytorch", batch, ms))
            if sessions:
                progress(f"timing onnxruntime, batch {batch}")
                feed = np.ascontiguousarray(x.numpy())
                runners = {
                    n: (lambda s=s, feed=feed: s.run(None, {s.get_inputs()[0].name: feed})) for n, s in sessions.items()
                }
                for name, ms in _time_interleaved(runners, warmup, repeats).items():
                    timings.append(_summary(name, "onnxruntime", batch, ms))
    return timings


def ratios(timings: list[Timing], numerator: str = "fused", denominator: str = "norm-free") -> list[dict[str, Any]]:
    """``median(numerator) / median(denominator)`` per runtime and batch size (1.00 = the bound is reached)."""
    table = {(t.variant, t.runtime, t.batch): t.median_ms for t in timings}
    out = []
    for (variant, runtime, batch), ms in table.items():
        if variant == numerator and (denominator, runtime, batch) in table:
            out.append({"runtime": runtime, "batch": batch, "ratio": ms / table[(denominator, runtime, batch)]})
    return out


def plot(timings: list[Timing], path: Path) -> None:
    """Bar chart of median latency per variant, one panel per runtime (matplotlib, Agg backend).

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
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
            values = [
                next((t.median_ms for t in timings if (t.variant, t.runtime, t.batch) == (variant, runtime, b)), 0.0)
                for b in batches
            ]
            ax.bar([j + i * width for j in range(len(batches))], values, width, label=variant)
        ax.set_xticks(
            [j + width * (len(variants) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches]
        )
        ax.set_ylabel("median latency (ms)")
        ax.set_yscale("log")
        ax.set_title(runtime)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
