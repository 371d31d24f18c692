"""``slabconv inspect`` (the fold plan) and ``slabconv export`` (one ONNX file)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slabconv.cli import options as o
from slabconv.cli.errors import errors
from slabconv.cli.output import Output
from slabconv.text import count


def inspect(
    ckpt: o.Ckpt,
    arch: o.Arch = None,
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
    """Show the fold plan: for every norm, the action, the layers it folds into, and why it is kept if it is.

    Nothing is written.

    Examples:

    \b
      slabconv inspect fixtures/digits-prepbn/checkpoint.pth
      slabconv inspect model.pt2 --json
      slabconv inspect vit.pt2 --fold-norm-affine
    """
    from slabconv import api

    output = Output(json=as_json, quiet=quiet, verbose=verbose)
    with errors(output, debug):
        load = o.load_options(arch, ema, trust_pickle, input_shape, image_size, fold_norm_affine)
        with output.progress() as progress:
            report = api.inspect(ckpt, load, progress)
        s = report.summary
        plan = f"{count(s.norms, 'norm')}: {s.folded} would fold away, {s.kept} would be kept" if s else None
        output.report(report, plan)


def export(
    ckpt: o.Ckpt,
    onnx: Annotated[
        Path, typer.Option("--onnx", metavar="FILE.onnx", help="Where to write the ONNX file.", show_default=False)
    ],
    arch: o.Arch = None,
    no_fuse: Annotated[bool, typer.Option("--no-fuse", help="Export the original model, norms as they are.")] = False,
    fold_norm_affine: o.FoldNormAffine = False,
    force: o.Force = False,
    opset: o.Opset = None,
    ema: o.Ema = False,
    trust_pickle: o.TrustPickle = False,
    input_shape: o.InputShape = None,
    image_size: o.ImageSize = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    verbose: o.Verbose = False,
    debug: o.Debug = False,
) -> None:
    """Write one ONNX file (dynamic batch axis where the model allows): the fused model, or the original.

    Weights over 1.5 GiB are written as ONNX external data, PATH.data beside PATH. Not verified: use
    `slabconv verify CKPT PATH` (or `fuse`, which verifies what it writes).

    Examples:

    \b
      slabconv export checkpoint.pth --onnx fused.onnx
      slabconv export checkpoint.pth --onnx original.onnx --no-fuse
    """
    from slabconv import api

    output = Output(json=as_json, quiet=quiet, verbose=verbose)
    with errors(output, debug):
        load = o.load_options(arch, ema, trust_pickle, input_shape, image_size, fold_norm_affine)
        with output.progress() as progress:
            report = api.export(ckpt, onnx, load=load, fuse=not no_fuse, force=force, opset=opset, progress=progress)
        s = report.summary
        what = f"{count(s.norms, 'norm')}: {s.folded} folded away, {s.kept} kept" if s else None
        what = what or "the original model, not fused"
        output.report(report, f"wrote {onnx} ({what})")
