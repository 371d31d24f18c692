"""``slabconv bench``: original vs fused vs norm-free timings, with the noise shown."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from slabconv.cli import options as o
from slabconv.cli.errors import errors
from slabconv.cli.output import Output
from slabconv.errors import UsageError
from slabconv.report.data import Report
from slabconv.report.render import text_table


def bench(
    ckpt: Annotated[
        Path,
        typer.Argument(metavar="CKPT", help="Checkpoint, or a folder written by `slabconv fuse`.", show_default=False),
    ],
    arch: o.Arch = None,
    batch: Annotated[str, typer.Option("--batch", metavar="SIZES", help="Comma-separated batch sizes.")] = "1,8,64",
    runtime: o.BenchRuntime = None,
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", min=0, help="Untimed calls per variant first.")] = 5,
    repeats: Annotated[
        int, typer.Option("--repeats", metavar="N", min=1, help="Timed calls per variant (interleaved).")
    ] = 20,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", metavar="FILE", help="Write a bar chart: .png, .svg or .pdf (needs matplotlib)."),
    ] = None,
    force: o.Force = False,
    ema: o.Ema = False,
    trust_pickle: o.TrustPickle = False,
    input_shape: o.InputShape = None,
    image_size: o.ImageSize = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    verbose: o.Verbose = False,
    debug: o.Debug = False,
) -> None:
    """Time the original, fused and norm-free models (and the LayerNorm branch, if the checkpoint has one).

    The headline is fused / norm-free: a complete fold sits at 1.00. Each ratio shows its spread (p25/p75 of the
    timings); a spread that crosses 1.00 or is wider than 0.2 is flagged: the machine was busy, rerun with more
    --repeats.

    Examples:

    \b
      slabconv bench fixtures/digits-prepbn/checkpoint.pth --batch 1,64 --plot build/bench.png -f
      slabconv bench checkpoint-fused --runtime onnxruntime --repeats 100 --json
    """
    from slabconv import api
    from slabconv.load.paths import check_input

    output = Output(json=as_json, quiet=quiet, verbose=verbose)
    with errors(output, debug):
        check_input(ckpt)  # a mistyped path is answered before torch is imported
        batches = _batches(batch)
        from slabconv.bench import check_plot_path, check_runtimes, default_runtimes

        if plot is not None:  # before minutes of timing
            check_plot_path(plot, force, [ckpt])
        runtimes = o.runtime_names(runtime, "bench") or tuple(default_runtimes())
        check_runtimes(list(runtimes))
        load = o.load_options(arch, ema, trust_pickle, input_shape, image_size)
        with output.progress() as progress:
            report = api.bench(
                ckpt, load=load, batches=batches, runtimes=runtimes, warmup=warmup, repeats=repeats, progress=progress
            )
        assert report.bench is not None
        if plot is not None:
            _plot(report.bench, plot)
        if output.json:
            output.report(report)
            return
        _show(output, report)
        if plot is not None:
            output.final(f"wrote {plot}")


def _batches(batch: str) -> tuple[int, ...]:
    """``--batch 1,8,64`` as integers, each at least 1.

    Raises:
        UsageError: not a comma-separated list of positive integers.
    """
    try:
        batches = tuple(int(b) for b in batch.split(",") if b.strip())
    except ValueError:
        raise UsageError(f"--batch {batch!r}: expected comma-separated integers like 1,8,64") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"--batch {batch!r}: every batch size must be at least 1, e.g. 1,8,64")
    return batches


def _plot(bench: dict[str, Any], plot: Path) -> None:
    """Draw the timings to ``plot`` and name it in the report.

    Raises:
        UsageError: matplotlib is not installed.
    """
    from slabconv.bench import Timing
    from slabconv.bench import plot as draw

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draw([Timing(**t) for t in bench["timings"]], plot)
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install slabconv[plot]") from None
    bench["plot"] = str(plot)


def _show(output: Output, report: Report) -> None:
    """The timing table, one fused / norm-free line per runtime and batch, and the generation line."""
    assert report.bench is not None
    title = f"bench ({report.source.arch or report.source.format if report.source else ''})"
    columns = dict.fromkeys(("runtime", "batch", "variant", "median ms", "p25-p75 ms", "samples/s"), False)
    columns["runtime"] = columns["variant"] = True
    rows = [
        [
            t["runtime"],
            str(t["batch"]),
            t["variant"],
            f"{t['median_ms']:.3f}",
            f"{t['p25_ms']:.3f}-{t['p75_ms']:.3f}",
            f"{t['throughput']:.0f}",
        ]
        for t in report.bench["timings"]
    ]
    output.table(text_table(title, columns, rows))
    for r in report.bench["fused_over_norm_free"]:
        where = f"{r['runtime']}, batch {r['batch']}"
        line = f"fused / norm-free ({where}): {r['ratio']:.2f} (p25-p75 spread {r['low']:.2f}-{r['high']:.2f})"
        if r["noisy"]:
            line += "; warning: too noisy to read, rerun with more --repeats on a quieter machine"
        elif r["high"] < 1.0:  # the fused model computes what the norm-free one does, plus any bias a fold added
            line += (
                "; warning: below 1.00, faster than the bound it can at best reach: noise (the machine's load "
                "changed during the run), rerun with more --repeats on a quieter machine"
            )
        elif r["low"] < 1.0 < r["high"] and abs(r["ratio"] - 1.0) > 0.02:
            line += "; the spread includes 1.00: no difference measurable in this run"
        output.final(line)
    generation = report.bench.get("generation")
    if generation and "note" in generation:
        output.final(generation["note"])
    elif generation:
        output.final(
            f"greedy generation ({generation['runtime']}; {generation['prompts']} prompts of "
            f"{generation['prompt_length']} tokens, {generation['steps']} new tokens each): original "
            f"{generation['original_tokens_per_second']:,.0f} tokens/s, fused "
            f"{generation['fused_tokens_per_second']:,.0f} tokens/s: fused / original "
            f"{generation['fused_over_original']:.2f}"
            + ("" if generation["same_tokens"] else "; warning: the runs generated different tokens")
        )
