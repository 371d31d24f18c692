"""Every command-line option, defined once: the same name means the same thing on every command."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from slabconv.errors import UsageError
from slabconv.options import LoadOptions, VerifyOptions
from slabconv.verify.backends import BACKENDS, RUNTIME_NAMES, backend_names

Ckpt = Annotated[
    Path,
    typer.Argument(
        metavar="CKPT",
        help="Checkpoint: .pth/.pt (training, release or state_dict), .pt2 program, fused .safetensors, a Hugging "
        "Face style folder (config.json + weights), or a folder slabconv fuse wrote.",
        show_default=False,
    ),
]


def complete_arch(incomplete: str) -> list[str]:
    """Shell completion of ``--arch``: the registered names and aliases (case ignored)."""
    from slabconv.zoo.names import complete_names

    return complete_names(incomplete)


Arch = Annotated[
    str | None,
    typer.Option(
        "--arch",
        metavar="NAME",
        help="Architecture name or alias, case ignored (see `slabconv list`); detected when left out.",
        autocompletion=complete_arch,
    ),
]
Ema = Annotated[
    bool, typer.Option("--ema", help="Use the EMA weights (state_dict_ema or model_ema) of a training checkpoint.")
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
        metavar="C,H,W",
        help="One sample's input shape without the batch axis, e.g. 3,224,224: needed for a pickled nn.Module "
        "(--trust-pickle), which records none, and for .onnx files whose axes besides the batch are dynamic.",
    ),
]
ImageSize = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        metavar="N",
        help="Build a zoo vision model for NxN inputs (default: the size its weights were trained at). Swin pads "
        "its windows, PVT resamples position embeddings; SLA models (SLAB-DeiT/PVT/CSWin) are fixed at 224.",
        min=1,
    ),
]
FoldNormAffine = Annotated[
    bool,
    typer.Option(
        "--fold-norm-affine",
        help="Also fold the weight and bias of every LayerNorm, RMSNorm, GroupNorm and InstanceNorm into the layers "
        "that read the norm (the normalisation stays, with weight 1): a Hugging Face LLaMA, Mistral or Qwen2 stays "
        "that architecture with every norm weight 1. See docs/math.md.",
    ),
]
Inputs = Annotated[
    Path | None,
    typer.Option(
        "--inputs",
        metavar="NPZ",
        help="An .npz whose 'x' array is the verification input (N, ...); default holdout.npz beside CKPT.",
    ),
]
Samples = Annotated[
    int | None,
    typer.Option(
        "--samples",
        metavar="N",
        min=1,
        help="Random samples when no inputs are given (default 16; 2 token sequences with --stream); with an .npz "
        "(--inputs, or holdout.npz beside the checkpoint), its first N samples.",
    ),
]


def complete_runtime(command: str) -> Callable[[str], list[str]]:
    """Shell completion of ``command``'s ``--runtime``: the names it takes (``backend_names``), after the last comma
    of a list."""

    def complete(incomplete: str) -> list[str]:
        head, _, last = incomplete.rpartition(",")
        return [f"{head},{name}" if head else name for name in backend_names(command) if name.startswith(last)]

    return complete


def runtime_names(values: list[str] | None, command: str) -> tuple[str, ...] | None:
    """The runtimes ``command``'s ``--runtime`` names, each value one name or several separated by commas, in the
    order given; None when it is not given (the command's default).

    Raises:
        UsageError: it is given and names none (``--runtime ""``): the default is not run in its place.
    """
    if not values:
        return None
    names = tuple(name.strip() for value in values for name in value.split(",") if name.strip())
    if not names:
        raise UsageError(f"--runtime '{values[0]}' names no runtime: choose from {', '.join(backend_names(command))}")
    return names


def _verify_runtime_help() -> str:
    """``verify --runtime``'s help: the names of the ``BACKENDS`` entries ``verify`` takes."""
    *first, last = RUNTIME_NAMES
    return (
        f"Run the candidate in this runtime only: {', '.join(first)} or {last} (OpenVINO when installed; the report "
        "names the precision it ran). Repeat it, or separate names by commas. Default: every runtime that can run "
        "the candidate, except OpenVINO. onnxruntime-int8 adds the int8 check: both sides quantized alike, the "
        "candidate's top-1 agreement not worse than the reference's beyond noise (docs/verification.md)."
    )


def _bench_runtime_help() -> str:
    """``bench --runtime``'s help: the names of the ``BACKENDS`` entries ``bench`` takes, CPU ones first."""
    names = backend_names("bench")
    cpu = ", ".join(n for n in names if BACKENDS[n].device == "cpu")
    gpu = ", ".join(n for n in names if BACKENDS[n].device != "cpu")
    return f"{cpu} (CPU); {gpu} (GPU). Repeat it, or separate names by commas. Default: all this machine has."


VerifyRuntime = Annotated[
    list[str] | None,
    typer.Option("--runtime", metavar="NAME", help=_verify_runtime_help(), autocompletion=complete_runtime("verify")),
]
BenchRuntime = Annotated[
    list[str] | None,
    typer.Option("--runtime", metavar="NAME", help=_bench_runtime_help(), autocompletion=complete_runtime("bench")),
]
Seed = Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the random inputs.")]
Rtol = Annotated[
    float | None,
    typer.Option(
        "--rtol",
        metavar="X",
        help="Replace question 2's bound (default max(tol_dtype, 2 x the original's own error); tol_dtype is 1e-5, "
        "1e-3, 1e-2 for float32, float16, bfloat16). See docs/verification.md.",
    ),
]
Atol = Annotated[float, typer.Option("--atol", metavar="X", help="An absolute error also accepted (default 0).")]
Strict = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Compare fused vs original directly at the dtype's tolerance with 100% top-1 (no float64 reference).",
    ),
]
Generate = Annotated[
    int | None,
    typer.Option(
        "--generate",
        metavar="N",
        min=0,
        help="Language models: greedy tokens to generate and compare, original vs fused folder (default 32; 0: off).",
    ),
]
VerifyGenerate = Annotated[
    int | None,
    typer.Option(
        "--generate",
        metavar="N",
        min=0,
        help="Language models: greedy tokens to generate and compare, reference vs the fused folder CANDIDATE "
        "(default 32, as fuse; 0: off).",
    ),
]
Stream = Annotated[
    bool,
    typer.Option(
        "--stream",
        help="Big LLaMA-layout folders in bounded memory: fold the safetensors (one file, or an index and its "
        "shards) block by block, write the fused weights and the Hugging Face folder files (no ONNX file, no "
        ".pt2), and check them one decoder layer at a time on --samples seeded token sequences.",
    ),
]
VerifyStream = Annotated[
    bool,
    typer.Option(
        "--stream",
        help="Big LLaMA-layout folders in bounded memory: compare the two folders one decoder layer at a time, on "
        "--samples seeded token sequences.",
    ),
]
Opset = Annotated[
    int | None,
    typer.Option(
        "--opset",
        metavar="N",
        help="ONNX opset of the files written (model.onnx; a language model's decoder.onnx too), 17 to 25 "
        "(default: the exporter's; 22 for bfloat16).",
    ),
]
RequireFolded = Annotated[
    bool,
    typer.Option(
        "--require-folded",
        help="Write only a norm-free model: when any norm would be kept (as a per-channel affine), exit 2 before "
        "writing, naming each kept norm and its reason (for targets that reject a standalone norm).",
    ),
]
Junit = Annotated[
    Path | None,
    typer.Option(
        "--junit",
        metavar="FILE.xml",
        help="Write a JUnit XML report: one case per check, and for fuse one per norm (fold: NORM).",
    ),
]
Force = Annotated[
    bool, typer.Option("--force", "-f", help="Replace an existing output slabconv wrote (never anything else).")
]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables and lines.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors and the final line.")]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Also print where the model came from (format, architecture, dtype, input shape, sha256), each "
        "written file's sha256, each norm's blocked paths, and on stderr a progress line per norm and step.",
    ),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show the Python traceback on errors.")]


def parse_shape(value: str | None) -> tuple[int, ...] | None:
    """``"1,8,8"`` -> ``(1, 8, 8)``.

    Raises:
        UsageError: anything but positive integers separated by commas.
    """
    if value is None:
        return None
    try:
        shape = tuple(int(part) for part in value.split(","))
    except ValueError:
        shape = ()
    if not shape or any(size <= 0 for size in shape):
        raise UsageError(f"--input-shape {value!r}: expected positive sizes separated by commas, e.g. 1,8,8")
    return shape


def load_options(
    arch: str | None,
    ema: bool,
    trust_pickle: bool,
    input_shape: str | None,
    image_size: int | None,
    fold_norm_affine: bool = False,
) -> LoadOptions:
    """``LoadOptions`` from the shared flags. An unknown ``--arch`` is refused here, before anything is loaded.

    Raises:
        UnsupportedModelError: ``arch`` is no registered name or alias (the message gives the closest ones).
        UsageError: a malformed ``--input-shape``.
    """
    if arch is not None:
        from slabconv.zoo.names import check_name

        check_name(arch)
    return LoadOptions(arch, ema, trust_pickle, parse_shape(input_shape), image_size, fold_norm_affine)


def given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among ``names`` (parameter names, e.g. ``rtol``) typed on the command line, as their long flag
    (``--rtol``), in the command's order; one given its default value (``--seed 0``) counts too."""
    return [
        max(p.opts, key=len)
        for p in ctx.command.params
        if p.name in names and getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"
    ]


def verify_options(
    inputs: Path | None,
    samples: int | None,
    seed: int,
    rtol: float | None,
    atol: float,
    strict: bool,
    generate: int | None = None,
    runtimes: tuple[str, ...] | None = None,
    calibration: Path | None = None,
) -> VerifyOptions:
    """``VerifyOptions`` from the shared flags. Unknown or missing runtimes are refused here, before any work, and
    so is ``--calibration`` without a runtime that quantizes.

    Raises:
        UsageError: as ``slabconv.verify.backends.check_runtime_names``.
    """
    from slabconv.verify.backends import check_runtime_names

    check_runtime_names(runtimes, calibration)
    return VerifyOptions(inputs, samples, seed, rtol, atol, strict, generate, runtimes, calibration)
