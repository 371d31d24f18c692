"""The ``slabconv`` command line (DESIGN.md section 4): parse, call ``slabconv.api``, render. No logic here.

Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance; 2 bad input, unsupported model or usage
error (one line on stderr, no traceback unless ``--debug``, nothing written).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from slabconv import __version__
from slabconv.errors import SlabconvError, UsageError, VerificationError

EXIT_HELP = """Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance (verification failed, nothing
written); 2 bad input, unsupported model or usage error (one line on stderr, nothing written; --debug shows the
traceback). Loading never runs code from a file unless --trust-pickle is given. Errors: docs/errors.md."""

app = typer.Typer(
    name="slabconv",
    help=(
        "Fold SLAB RepBN / BatchNorm norms into the layers around them, exactly, write safetensors + ONNX, and "
        "prove the result equals the original with onnxruntime.\n\n"
        "  slabconv fuse fixtures/digits-prepbn/checkpoint.pth\n\n"
        "  slabconv inspect ckpt.pth --arch deit_tiny_prepbn\n\n" + EXIT_HELP
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

err_console = Console(stderr=True)
out_console = Console(soft_wrap=True)

Ckpt = Annotated[
    Path,
    typer.Argument(
        metavar="CKPT",
        help="Checkpoint: .pth/.pt (training, release or state_dict), .pt2, fused .safetensors, or a Hugging Face "
        "style folder (config.json + weights).",
    ),
]
Arch = Annotated[
    str | None, typer.Option("--arch", help="Architecture name or alias (see `slabconv list`); detected when left out.")
]
Json = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout instead of the table.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show the Python traceback on errors.")]
Ema = Annotated[bool, typer.Option("--ema", help="Use the EMA weights (state_dict_ema) of a training checkpoint.")]
Inputs = Annotated[
    Path | None, typer.Option("--inputs", help="An .npz whose 'x' array is the verification input (N, ...).")
]
TrustPickle = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Load a pickle that names arbitrary Python globals, e.g. a whole nn.Module saved with torch.save(model). "
        "This RUNS CODE from the file: only for files you trust. Without it loading is weights-only.",
    ),
]
InputShape = Annotated[
    str | None,
    typer.Option(
        "--input-shape",
        help="One sample's input shape without the batch axis, e.g. 1,8,8. Needed for a pickled nn.Module "
        "(--trust-pickle) and for ONNX models whose axes besides the batch are dynamic.",
    ),
]
ImageSize = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        help="Build a zoo vision model for NxN inputs (default: the size its weights were trained at). Swin pads "
        "its windows, PVT resamples position embeddings; SLA models (SLAB-DeiT/PVT/CSWin) are fixed at 224.",
        min=1,
    ),
]


def _shape(value: str | None) -> tuple[int, ...] | None:
    """``"1,8,8"`` -> ``(1, 8, 8)``; a ``UsageError`` (exit 2, one line) for anything else."""
    if value is None:
        return None
    try:
        shape = tuple(int(part) for part in value.split(","))
    except ValueError:
        shape = ()
    if not shape or any(size <= 0 for size in shape):
        raise UsageError(f"--input-shape {value!r}: expected positive sizes separated by commas, e.g. 1,8,8")
    return shape


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slabconv {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """slabconv: fold SLAB RepBN norms exactly."""
    if not os.environ.get("SLABCONV_DEBUG"):
        # Library warnings and log lines are not slabconv's messages: stderr carries one line per failure.
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)


@contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """The one map from exception to message and exit code."""
    debug = debug or bool(os.environ.get("SLABCONV_DEBUG"))
    try:
        yield
    except (VerificationError, typer.Exit):
        raise
    except SlabconvError as err:
        if debug:
            traceback.print_exc()
        err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted; nothing was written", markup=False)
        raise typer.Exit(2) from None
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line, traceback with --debug
        if debug:
            traceback.print_exc()
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        err_console.print(
            f"internal error: {type(err).__name__}: {first} (a bug in slabconv; rerun with --debug and report it)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(2) from None


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr showing the current stage (silent when stderr is not a terminal)."""
    if not enabled or not err_console.is_terminal:
        yield lambda message: None
        return
    with err_console.status("starting") as status:
        yield lambda message: status.update(message)


def _folds_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"folds ({report['source'].get('arch') or report['source']['format']})")
    for col in ("norm", "kind", "action", "into", "reason"):
        table.add_column(col)
    for f in report["folds"]:
        into = ", ".join(f["into"]) or "-"
        reason = f["reason"] or ""
        if f.get("kept_on"):
            reason += f" (before {', '.join(f['kept_on'])})"
        table.add_row(f["norm"], f["kind"], f["action"], into, reason)
    return table


def _verification_lines(v: dict[str, Any] | None) -> list[str]:
    if not v:
        return ["verification: skipped (--no-verify)"]
    lines = [
        f"verification: {'PASSED' if v['passed'] else 'FAILED'} on {v['samples']} samples ({v['inputs']}), "
        f"{v['runtime']}"
    ]
    for c in v["checks"]:
        top1 = "" if c["top1_agreement"] is None else f", top-1 agreement {c['top1_agreement']:.2%}"
        lines.append(
            f"  {'ok  ' if c['passed'] else 'FAIL'} {c['name']}: max abs err {c['max_abs_err']:.3g}, "
            f"max rel err {c['max_rel_err']:.3g} (tolerance {c['tolerance']:g}){top1}, "
            f"worst sample {c['worst_sample']}"
        )
    for i in v.get("integrity", []):
        lines.append(f"  {'ok  ' if i['passed'] else 'FAIL'} {i['name']}: {i['detail']}")
    return lines


def _render(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return
    if "folds" in report:
        out_console.print(_folds_table(report))
        s = report["summary"]
        out_console.print(f"{s['norms']} norms: {s['folded']} folded away, {s['kept']} kept", highlight=False)
        for f in report["folds"]:
            for w in f.get("warnings", []):
                out_console.print(f"warning: {f['norm']}: {w}", markup=False, highlight=False)
    if "outputs" in report and report.get("out_dir"):
        weights = report["outputs"].get("safetensors")
        if isinstance(weights, list):  # a streamed fold: the shards and their index
            weights = f"{report['outputs']['index']} + {len(weights)} shards"
        out_console.print(
            f"wrote {report['out_dir']}/: {weights or 'model.safetensors'}, "
            f"{'model.onnx, ' if report['outputs'].get('onnx') else ''}report.json",
            highlight=False,
        )
    if "verification" in report:
        for line in _verification_lines(report["verification"]):
            out_console.print(line, markup=False, highlight=False)


def _fail_verification(err: VerificationError, as_json: bool) -> None:
    if err.report:
        _render(err.report, as_json)
    err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@app.command()
def fuse(
    ckpt: Ckpt,
    arch: Arch = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default: <checkpoint stem>-fused beside it).")
    ] = None,
    no_onnx: Annotated[bool, typer.Option("--no-onnx", help="Write safetensors only.")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the equivalence check.")] = False,
    stream: Annotated[
        bool,
        typer.Option(
            "--stream",
            help="Fold a sharded LLaMA-PRepBN safetensors folder shard by shard in bounded memory (needs --no-onnx and "
            "--out; verifies one decoder layer at a time, --samples token sequences).",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    inputs: Inputs = None,
    samples: Annotated[
        int | None,
        typer.Option(
            "--samples", help="Random samples when no inputs are found (default 64; with --stream, 2 token sequences)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    rtol: Annotated[
        float | None, typer.Option("--rtol", help="Relative tolerance (default by dtype: fp32 1e-5).")
    ] = None,
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance, also accepted (default 0).")] = 0.0,
    ema: Ema = False,
    trust_pickle: TrustPickle = False,
    input_shape: InputShape = None,
    image_size: ImageSize = None,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Fold every norm, write DIR/model.safetensors, DIR/model.onnx and DIR/report.json, and verify.

    Verification runs the original model in PyTorch and the fused ONNX in onnxruntime on holdout.npz beside
    the checkpoint (or --inputs, or seeded random inputs). Outputs appear only when it passes.

    Example: slabconv fuse fixtures/digits-prepbn/checkpoint.pth --out build/demo
    """
    from slabconv import api

    with _errors(debug):
        if stream:
            from slabconv.stream import fuse_streaming
            from slabconv.verify import layerwise

            if not no_onnx:
                raise UsageError(
                    "--stream writes safetensors only: ONNX export of a multi-GB model is not supported in streaming "
                    "mode; add --no-onnx"
                )
            if out is None:
                raise UsageError("--stream needs --out")
        try:
            with _progress(not as_json) as progress:
                if stream:
                    assert out is not None  # checked above
                    report = fuse_streaming(
                        ckpt,
                        out,
                        force=force,
                        verify=not no_verify,
                        samples=samples if samples is not None else layerwise.DEFAULT_SEQUENCES,
                        seed=seed,
                        rtol=rtol,
                        atol=atol,
                        progress=progress,
                    )
                    _render(report, as_json)
                    return
                report = api.fuse(
                    ckpt,
                    out,
                    arch=arch,
                    ema=ema,
                    onnx=not no_onnx,
                    verify=not no_verify,
                    force=force,
                    inputs=inputs,
                    samples=samples if samples is not None else 64,
                    seed=seed,
                    rtol=rtol,
                    atol=atol,
                    progress=progress,
                    trust_pickle=trust_pickle,
                    input_shape=_shape(input_shape),
                    image_size=image_size,
                )
        except VerificationError as err:
            _fail_verification(err, as_json)
        _render(report, as_json)


@app.command()
def inspect(
    ckpt: Ckpt,
    arch: Arch = None,
    ema: Ema = False,
    trust_pickle: TrustPickle = False,
    input_shape: InputShape = None,
    image_size: ImageSize = None,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Show the fold plan: for every norm, the action, the layers it folds into, and why it is kept if it is.

    Nothing is written. Example: slabconv inspect fixtures/digits-prepbn/checkpoint.pth --json
    """
    from slabconv import api

    with _errors(debug), _progress(not as_json) as progress:
        report = api.inspect(
            ckpt,
            arch=arch,
            ema=ema,
            progress=progress,
            trust_pickle=trust_pickle,
            input_shape=_shape(input_shape),
            image_size=image_size,
        )
    _render(report, as_json)


@app.command()
def export(
    ckpt: Ckpt,
    onnx: Annotated[Path, typer.Option("--onnx", help="Where to write the ONNX file.")],
    arch: Arch = None,
    no_fuse: Annotated[bool, typer.Option("--no-fuse", help="Export the original model, norms as they are.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    ema: Ema = False,
    trust_pickle: TrustPickle = False,
    input_shape: InputShape = None,
    image_size: ImageSize = None,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Write one ONNX file (dynamic batch axis): the fused model, or the original with --no-fuse.

    Weights over 1.5 GiB are written as ONNX external data, PATH.data beside PATH.

    Example: slabconv export ckpt.pth --onnx fused.onnx
    """
    from slabconv import api

    with _errors(debug), _progress(not as_json) as progress:
        report = api.export(
            ckpt,
            onnx,
            arch=arch,
            ema=ema,
            fuse=not no_fuse,
            force=force,
            progress=progress,
            trust_pickle=trust_pickle,
            input_shape=_shape(input_shape),
            image_size=image_size,
        )
    if as_json:
        _render(report, True)
        return
    if report["folds"]:
        _render({k: report[k] for k in ("source", "folds", "summary")}, False)
    out_console.print(f"wrote {onnx}", highlight=False)


@app.command()
def verify(
    reference: Annotated[
        Path,
        typer.Argument(
            metavar="REFERENCE", help="The reference: checkpoint, HF folder, .pt2, fused .safetensors or .onnx."
        ),
    ],
    candidate: Annotated[Path, typer.Argument(metavar="CANDIDATE", help="The candidate, any of the same kinds.")],
    arch: Arch = None,
    inputs: Inputs = None,
    samples: Annotated[
        int | None,
        typer.Option(
            "--samples", help="Random samples when no inputs are given (default 64; with --stream, 2 token sequences)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance (default by dtype).")] = None,
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance, also accepted.")] = 0.0,
    junit: Annotated[
        Path | None, typer.Option("--junit", help="Write a JUnit XML report (one case per check).")
    ] = None,
    ema: Ema = False,
    trust_pickle: TrustPickle = False,
    input_shape: InputShape = None,
    image_size: ImageSize = None,
    stream: Annotated[
        bool,
        typer.Option(
            "--stream",
            help="Compare two LLaMA-PRepBN folders (sharded or not) one decoder layer at a time, in bounded memory.",
        ),
    ] = False,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Compare CANDIDATE with REFERENCE on the same inputs; exit 0 when equivalent, 1 when not, 2 on bad input.

    Each side is a checkpoint (+ --arch), a Hugging Face folder, a .pt2, an .onnx or a fused model.safetensors
    (or a fused folder). An .onnx side gets onnx.checker's full check and runs in onnxruntime with graph
    optimisations off and fully on; both must pass.
    Inputs: --inputs NPZ, else holdout.npz beside a checkpoint, else --samples seeded random samples.
    Tolerance: --rtol (default by dtype: fp32 1e-5, fp16 1e-3, bf16 1e-2) or --atol; top-1 must agree.
    --stream: for LLaMA folders too big to load whole (what `fuse --stream` writes): every decoder layer and the
    logits are compared, one layer in memory at a time.

    Example: slabconv verify ckpt.pth ckpt-fused/model.onnx --junit equivalence.xml
    """
    from slabconv import api
    from slabconv.report.junit import check_report_path, write_junit
    from slabconv.verify.results import failure_line

    with _errors(debug):
        if junit is not None:
            check_report_path(junit, [reference, candidate, *([inputs] if inputs else [])])
        report = api.verify(
            reference,
            candidate,
            arch=arch,
            ema=ema,
            inputs=inputs,
            samples=samples if samples is not None else (2 if stream else 64),
            seed=seed,
            rtol=rtol,
            atol=atol,
            trust_pickle=trust_pickle,
            input_shape=_shape(input_shape),
            image_size=image_size,
            stream=stream,
        )
        if junit is not None:
            write_junit(report, junit)
    _render(report, as_json)
    if not report["verification"]["passed"]:
        err_console.print(
            f"error: not equivalent: {failure_line(report['verification'])}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


@app.command()
def bench(
    ckpt: Annotated[Path, typer.Argument(metavar="CKPT", help="Checkpoint, or a folder written by `slabconv fuse`.")],
    arch: Arch = None,
    batch: Annotated[str, typer.Option("--batch", help="Comma-separated batch sizes.")] = "1,8,64",
    runtime: Annotated[
        str | None,
        typer.Option(
            "--runtime",
            help="Comma-separated: pytorch, onnxruntime (CPU); pytorch-cuda, pytorch-cuda-fp16, "
            "pytorch-cuda-graphs-fp16, onnxruntime-cuda, onnxruntime-cuda-fp16 (GPU). Default: all this machine has.",
        ),
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed calls per variant first.")] = 5,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed calls per variant (interleaved).")] = 20,
    image_size: ImageSize = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a bar chart PNG (needs matplotlib).")] = None,
    ema: Ema = False,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Time the original, fused and norm-free models (and the LayerNorm branch, if the checkpoint has one).

    The headline is fused / norm-free: a complete fold sits at 1.00. Example:
    slabconv bench fixtures/digits-prepbn/checkpoint.pth --batch 1,64 --plot bench.png
    """
    from slabconv import api

    with _errors(debug):
        try:
            batches = tuple(int(b) for b in batch.split(",") if b.strip())
        except ValueError:
            raise UsageError(f"--batch {batch!r}: expected comma-separated integers like 1,8,64") from None
        from slabconv.bench import check_runtimes, default_runtimes

        runtimes = (
            tuple(r.strip() for r in runtime.split(",") if r.strip())
            if runtime is not None
            else tuple(default_runtimes())
        )
        check_runtimes(list(runtimes))
        if not batches or min(batches) < 1 or repeats < 1:
            raise UsageError("--batch and --repeats must be >= 1")
        with _progress(not as_json) as progress:
            report = api.bench(
                ckpt,
                arch=arch,
                ema=ema,
                batches=batches,
                runtimes=runtimes,
                warmup=warmup,
                repeats=repeats,
                image_size=image_size,
                progress=progress,
            )
        if plot is not None:
            from slabconv.bench import Timing
            from slabconv.bench import plot as draw

            try:
                draw([Timing(**t) for t in report["timings"]], plot)
            except ImportError:
                raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
            report["plot"] = str(plot)
    if as_json:
        _render(report, True)
        return
    table = Table(title=f"bench ({report['source'].get('arch') or report['source']['format']})")
    for col in ("runtime", "batch", "variant", "median ms", "p25-p75 ms", "samples/s"):
        table.add_column(col)
    for t in report["timings"]:
        table.add_row(
            t["runtime"],
            str(t["batch"]),
            t["variant"],
            f"{t['median_ms']:.3f}",
            f"{t['p25_ms']:.3f}-{t['p75_ms']:.3f}",
            f"{t['throughput']:.0f}",
        )
    out_console.print(table)
    for r in report["fused_over_norm_free"]:
        out_console.print(f"fused / norm-free ({r['runtime']}, batch {r['batch']}): {r['ratio']:.2f}", highlight=False)


@app.command("list")
def list_archs(as_json: Json = False) -> None:
    """List the registered architectures with their aliases."""
    from slabconv.zoo import list_archs as archs

    rows = [
        {"name": s.name, "aliases": list(s.aliases), "family": s.family, "description": s.description} for s in archs()
    ]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="architectures")
    for col in ("name", "aliases", "description"):
        table.add_column(col)
    for s in archs():
        table.add_row(s.name, ", ".join(s.aliases), s.description)
    out_console.print(table)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run() -> None:
    """Console-script entry point. SIGTERM (a cancelled CI job) is handled like Ctrl-C: staged outputs are
    removed and nothing is written."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    app()
