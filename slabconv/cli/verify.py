"""``slabconv verify``: both questions for any two sides, with JUnit for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slabconv.cli import options as o
from slabconv.cli.errors import errors
from slabconv.cli.output import Output


def verify(
    reference: Annotated[
        Path,
        typer.Argument(
            metavar="REFERENCE",
            help="The reference: checkpoint, Hugging Face folder, .pt2, .onnx, fused .safetensors or fuse output "
            "folder.",
            show_default=False,
        ),
    ],
    candidate: Annotated[
        Path, typer.Argument(metavar="CANDIDATE", help="The candidate, any of the same kinds.", show_default=False)
    ],
    arch: o.Arch = None,
    inputs: o.Inputs = None,
    samples: o.Samples = None,
    seed: o.Seed = 0,
    rtol: o.Rtol = None,
    atol: o.Atol = 0.0,
    strict: o.Strict = False,
    generate: o.VerifyGenerate = None,
    runtime: o.VerifyRuntime = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            metavar="NPZ",
            help="With --runtime onnxruntime-int8: calibrate the quantizer on this .npz (its x array, shaped as "
            "--inputs) instead of the verification inputs.",
        ),
    ] = None,
    junit: o.Junit = None,
    stream: o.VerifyStream = False,
    localize: Annotated[
        bool,
        typer.Option(
            "--localize",
            help="Compare the two at every fold boundary (the output of each layer a norm folded into) and print one "
            "row per boundary, even when they agree; a failure is localised anyway.",
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="With --localize: write the error at every fold boundary as a chart (.png, .svg, "
            ".pdf; needs matplotlib).",
        ),
    ] = None,
    force: o.Force = False,
    fold_norm_affine: o.FoldNormAffine = False,
    ema: o.Ema = False,
    trust_pickle: o.TrustPickle = False,
    input_shape: o.InputShape = None,
    image_size: o.ImageSize = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    verbose: o.Verbose = False,
    debug: o.Debug = False,
) -> None:
    """Compare CANDIDATE with REFERENCE on the same inputs; exit 0 when equivalent, 1 when not, 2 on bad input.

    Question 1 (is the fold exact?) applies when the candidate is a fold of the reference (it records the
    reference's sha256 as its source): its tensors must equal a fresh float64 fold of the reference. Question 2:
    the candidate, in its own dtype and runtime, against the reference evaluated in float64, within
    max(tol_dtype, 2 x the original's own error). An .onnx side also gets onnx.checker's full check and runs in
    onnxruntime with optimisations off and on. Inputs: --inputs NPZ, else holdout.npz beside a checkpoint, else
    --samples seeded random samples. See docs/verification.md.

    Examples:

    \b
      slabconv verify checkpoint.pth checkpoint-fused --junit equivalence.xml
      slabconv verify checkpoint.pth fused.onnx --samples 256 --seed 1
      slabconv verify llama-folder llama-fused --generate 32
      slabconv verify checkpoint.pth checkpoint-fused --runtime openvino
      slabconv verify checkpoint.pth checkpoint-fused --runtime onnxruntime-int8
      slabconv verify checkpoint.pth checkpoint-fused --localize --plot boundaries.png
    """
    from slabconv import api
    from slabconv.report.junit import check_report_path, write_junit

    output = Output(json=as_json, quiet=quiet, verbose=verbose)
    with errors(output, debug):
        if junit is not None:
            check_report_path(
                junit, [reference, candidate, *([inputs] if inputs else []), *([calibration] if calibration else [])]
            )
        if plot is not None:
            from slabconv.bench import check_plot_path
            from slabconv.errors import UsageError

            if not localize:
                raise UsageError("--plot draws the fold boundaries of --localize; add --localize")
            check_plot_path(plot, force, [reference, candidate])
        load = o.load_options(arch, ema, trust_pickle, input_shape, image_size, fold_norm_affine)
        names = o.runtime_names(runtime, "verify")
        check = o.verify_options(inputs, samples, seed, rtol, atol, strict, generate, names, calibration)
        with output.progress() as progress:
            report = api.verify(
                reference, candidate, load=load, verify=check, stream=stream, localize=localize, progress=progress
            )
        if junit is not None:
            write_junit(report, junit)
        v = report.verification
        assert v is not None
        if localize:
            from slabconv.report.render import localization_table

            table = localization_table(v)
            if table is not None:
                output.table(table)
            if plot is not None and v.localization is not None:
                from slabconv.bench import plot_boundaries

                plot_boundaries(v.localization, plot)
        output.report(report, f"verification {v.headline()}" if v.passed else None)
        if not v.passed:
            output.error(f"error: not equivalent: {v.failure_line()}")
            raise typer.Exit(1)
