"""The ``slabconv`` command line (DESIGN.md section 4): parse, call ``slabconv.api``, render. No logic here.

Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance; 2 bad input, unsupported model or usage
error (one line on stderr, no traceback unless ``--debug``, nothing written).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from slabconv import __version__
from slabconv.errors import SlabconvError, VerificationError

EXIT_HELP = """Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance; 2 bad input, unsupported
model or usage error (one line on stderr, nothing written; --debug shows the traceback)."""

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

Ckpt = Annotated[Path, typer.Argument(help="Checkpoint: .pth/.pt (training, release or state_dict), .pt2, or fused .safetensors.")]
Arch = Annotated[str | None, typer.Option("--arch", help="Architecture name or alias (see `slabconv list`); detected when left out.")]
Json = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout instead of the table.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show the Python traceback on errors.")]
Ema = Annotated[bool, typer.Option("--ema", help="Use the EMA weights (state_dict_ema) of a training checkpoint.")]
Inputs = Annotated[Path | None, typer.Option("--inputs", help="An .npz whose 'x' array is the verification input (N, ...).")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slabconv {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """slabconv: fold SLAB RepBN norms exactly."""


@contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """The one map from exception to message and exit code."""
    debug = debug or bool(os.environ.get("SLABCONV_DEBUG"))
    try:
        yield
    except VerificationError:
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
            f"  {c['name']}: max abs err {c['max_abs_err']:.3g}, max rel err {c['max_rel_err']:.3g} "
            f"(tolerance {c['tolerance']:g}){top1}"
        )
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
        out_console.print(f"wrote {report['out_dir']}/: model.safetensors, "
                          f"{'model.onnx, ' if report['outputs'].get('onnx') else ''}report.json", highlight=False)
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
    out: Annotated[Path | None, typer.Option("--out", help="Output folder (default: <checkpoint stem>-fused beside it).")] = None,
    no_onnx: Annotated[bool, typer.Option("--no-onnx", help="Write safetensors only.")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the equivalence check.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    inputs: Inputs = None,
    samples: Annotated[int, typer.Option("--samples", help="Random samples when no inputs are found.")] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance (default by dtype: fp32 1e-5).")] = None,
    ema: Ema = False,
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
        try:
            with _progress(not as_json) as progress:
                report = api.fuse(ckpt, out, arch=arch, ema=ema, onnx=not no_onnx, verify=not no_verify,
                                  force=force, inputs=inputs, samples=samples, seed=seed, rtol=rtol,
                                  progress=progress)
        except VerificationError as err:
            _fail_verification(err, as_json)
        _render(report, as_json)


@app.command()
def inspect(ckpt: Ckpt, arch: Arch = None, ema: Ema = False, as_json: Json = False, debug: Debug = False) -> None:
    """Show the fold plan: for every norm, the action, the layers it folds into, and why it is kept if it is.

    Nothing is written. Example: slabconv inspect fixtures/digits-prepbn/checkpoint.pth --json
    """
    from slabconv import api

    with _errors(debug), _progress(not as_json) as progress:
        report = api.inspect(ckpt, arch=arch, ema=ema, progress=progress)
    _render(report, as_json)


@app.command()
def export(
    ckpt: Ckpt,
    onnx: Annotated[Path, typer.Option("--onnx", help="Where to write the ONNX file.")],
    arch: Arch = None,
    no_fuse: Annotated[bool, typer.Option("--no-fuse", help="Export the original model, norms as they are.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    ema: Ema = False,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Write one ONNX file (dynamic batch axis): the fused model, or the original with --no-fuse.

    Example: slabconv export ckpt.pth --onnx fused.onnx
    """
    from slabconv import api

    with _errors(debug), _progress(not as_json) as progress:
        report = api.export(ckpt, onnx, arch=arch, ema=ema, fuse=not no_fuse, force=force, progress=progress)
    if as_json:
        _render(report, True)
        return
    if report["folds"]:
        _render({k: report[k] for k in ("source", "folds", "summary")}, False)
    out_console.print(f"wrote {onnx}", highlight=False)


@app.command()
def verify(
    reference: Annotated[Path, typer.Argument(help="The reference: checkpoint, .pt2, fused .safetensors or .onnx.")],
    candidate: Annotated[Path, typer.Argument(help="The candidate, any of the same kinds.")],
    arch: Arch = None,
    inputs: Inputs = None,
    samples: Annotated[int, typer.Option("--samples", help="Random samples when no inputs are given.")] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance (default by dtype).")] = None,
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance, also accepted.")] = 0.0,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML report (one case per check).")] = None,
    ema: Ema = False,
    as_json: Json = False,
    debug: Debug = False,
) -> None:
    """Compare CANDIDATE with REFERENCE on the same inputs; exit 1 when they differ beyond tolerance.

    An .onnx side runs in onnxruntime with graph optimisations off and fully on; both must pass.
    Example: slabconv verify ckpt.pth ckpt-fused/model.onnx --junit equivalence.xml
    """
    from slabconv import api
    from slabconv.report import write_junit

    with _errors(debug):
        report = api.verify(reference, candidate, arch=arch, ema=ema, inputs=inputs, samples=samples, seed=seed,
                            rtol=rtol, atol=atol)
        if junit is not None:
            write_junit(report, junit)
    _render(report, as_json)
    if not report["verification"]["passed"]:
        raise typer.Exit(1)


@app.command("list")
def list_archs(as_json: Json = False) -> None:
    """List the registered architectures with their aliases."""
    from slabconv.zoo import list_archs as archs

    rows = [{"name": s.name, "aliases": list(s.aliases), "family": s.family, "description": s.description}
            for s in archs()]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="architectures")
    for col in ("name", "aliases", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], ", ".join(r["aliases"]), r["description"])
    out_console.print(table)


def run() -> None:
    """Console-script entry point."""
    app()
