"""``slabconv fuse``: fold, write, verify."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slabconv.cli import options as o
from slabconv.cli.errors import errors
from slabconv.cli.output import Output
from slabconv.options import WriteOptions
from slabconv.text import count


def fuse(
    ctx: typer.Context,
    ckpt: o.Ckpt,
    arch: o.Arch = None,
    fold_norm_affine: o.FoldNormAffine = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", metavar="DIR", help="Output folder (default: <checkpoint stem>-fused beside it)."),
    ] = None,
    force: o.Force = False,
    no_onnx: Annotated[bool, typer.Option("--no-onnx", help="Write no ONNX file.")] = False,
    no_pt2: Annotated[bool, typer.Option("--no-pt2", help="Write no model.pt2 (torch.export program).")] = False,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Write the fused model in float16 (fp16, half) or bfloat16 (bf16) (folded in float64, cast once, "
            "verified at that dtype's tolerance), or float32 (fp32: a float16 or bfloat16 checkpoint's fold in "
            "float32). Default: the checkpoint's dtype.",
            autocompletion=lambda incomplete: [
                d for d in ("float16", "bfloat16", "float32") if d.startswith(incomplete)
            ],
        ),
    ] = None,
    opset: o.Opset = None,
    simplify: Annotated[
        bool,
        typer.Option(
            "--simplify",
            help="Run onnxscript's optimizer on model.onnx after the fold (shape arithmetic folded, dead nodes and "
            "layout pairs removed), then onnxslim when it is installed (pip install 'slabconv[simplify]'; without "
            "it, onnxscript's optimizer alone, and the report says so), kept where it has fewer nodes; the "
            "simplified file is the one verified.",
        ),
    ] = False,
    require_folded: o.RequireFolded = False,
    junit: o.Junit = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip verification (not recommended).")] = False,
    stream: o.Stream = False,
    inputs: o.Inputs = None,
    samples: o.Samples = None,
    seed: o.Seed = 0,
    rtol: o.Rtol = None,
    atol: o.Atol = 0.0,
    strict: o.Strict = False,
    generate: o.Generate = None,
    ema: o.Ema = False,
    trust_pickle: o.TrustPickle = False,
    input_shape: o.InputShape = None,
    image_size: o.ImageSize = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    verbose: o.Verbose = False,
    debug: o.Debug = False,
) -> None:
    """Fold every norm, write the fused model into a folder, and prove it equals the original.

    Writes DIR/model.safetensors, DIR/model.onnx, DIR/model.pt2 and DIR/report.json (a language model's folder is
    also a Hugging Face model folder, with decoder.onnx). Verification answers two questions: is the fold exact
    (float64), and are the written files as good as the original (each in its own dtype and runtime, against
    the float64 reference). Outputs appear only when it passes.

    Examples:

    \b
      slabconv fuse fixtures/digits-prepbn/checkpoint.pth --out build/demo
      slabconv fuse checkpoint.pth --arch deit_tiny_prepbn --ema --json > report.json
      slabconv fuse llama-folder --stream --out llama-fused
      slabconv fuse model.onnx --simplify --out model-fused
      slabconv fuse model.pt2 --require-folded --junit folds.xml
      slabconv fuse qwen2-folder --fold-norm-affine --out qwen2-unit-norms
    """
    from slabconv import api
    from slabconv.errors import KeptNormsError, UsageError, VerificationError
    from slabconv.report.junit import check_report_path, write_junit

    output = Output(json=as_json, quiet=quiet, verbose=verbose)
    with errors(output, debug):
        unused = o.given(ctx, "inputs", "samples", "seed", "rtol", "atol", "strict", "generate") if no_verify else []
        if unused:
            raise UsageError(
                f"{unused[0]} sets how the result is verified, and --no-verify skips verification; drop one of them"
            )
        check = None if no_verify else o.verify_options(inputs, samples, seed, rtol, atol, strict, generate)
        write = WriteOptions(
            force=force,
            onnx=not (no_onnx or stream),
            pt2=not (no_pt2 or stream),
            stream=stream,
            dtype=dtype,
            opset=opset,
            simplify=simplify,
            require_folded=require_folded,
        )
        if junit is not None:
            check_report_path(junit, [ckpt, *([inputs] if inputs else [])])
        load = o.load_options(arch, ema, trust_pickle, input_shape, image_size, fold_norm_affine)
        try:
            with output.progress() as progress:
                report = api.fuse(ckpt, out, load=load, verify=check, write=write, progress=progress)
        except (KeptNormsError, VerificationError) as err:  # the JUnit file says which norm or check failed
            if junit is not None and err.report is not None:
                write_junit(err.report, junit, require_folded)
            raise
        if junit is not None:
            write_junit(report, junit, require_folded)
        s = report.summary
        v = report.verification
        verdict = f"verification {v.headline()}" if v is not None else "not verified (--no-verify)"
        counts = f"{count(s.norms, 'norm')} ({s.folded} folded away, {s.kept} kept)" if s else "the model"
        where = f"{report.out_dir} ({write.dtype})" if write.dtype else f"{report.out_dir}"
        if s is not None and s.norms == 0:
            from slabconv.zoo.llama_std import MODEL_TYPES

            standard = report.source is not None and report.source.arch in MODEL_TYPES
            why = "no norm that folds without --fold-norm-affine" if standard else "no norms (already fused?)"
            # an ONNX original is written as prepared: the weights its exporter computed from constants folded
            onnx = report.source is not None and report.source.format == "onnx"
            how = f"into {where} with its computed constants folded" if onnx else f"unchanged into {where}"
            output.report(report, f"nothing to fold: {ckpt} has {why}; wrote it {how}: {verdict}")
            return
        output.report(report, f"fused {counts} into {where}: {verdict}")
