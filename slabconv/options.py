"""The options every command shares, as objects: how to load, how to verify, how to write.

The Python API takes these and the CLI builds them from its flags (``slabconv.cli.options`` defines each flag
once), so an option means the same thing wherever it appears.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slabconv.errors import UsageError


@dataclass(frozen=True)
class LoadOptions:
    """How to read a checkpoint and build its model.

    Attributes:
        arch: a registered architecture name or alias (``slabconv list``); detected from the checkpoint when None.
        ema: take the EMA weights (``state_dict_ema`` or ``model_ema``) of a training checkpoint.
        trust_pickle: load a pickle that names arbitrary globals (a whole ``nn.Module``): runs code from the file.
        input_shape: one sample's input shape without the batch axis (a pickled module records none).
        image_size: build a zoo vision model for ``image_size`` square inputs.
        fold_norm_affine: also fold the affine (weight and bias) of every LayerNorm, RMSNorm, GroupNorm and
            InstanceNorm into the layers that read the norm's output; the normalisation stays, with a unit weight
            (``slabconv.engine.norm_affine``, ``docs/math.md``). ``fuse``, ``inspect``, ``export`` and ``verify``
            (question 1's float64 fold of the reference) take it.
    """

    arch: str | None = None
    ema: bool = False
    trust_pickle: bool = False
    input_shape: tuple[int, ...] | None = None
    image_size: int | None = None
    fold_norm_affine: bool = False


DEFAULT_SAMPLES = 16
"""Seeded random samples a verification runs on when no inputs are given (``--samples N`` or ``--inputs`` for
others). Question 2 takes the largest error over every output value of every sample, and each sample costs a
float64 pass of the original and a float32 pass of the original and of each artifact in each runtime: at 64, the
verification of a DeiT-Tiny cost twice the ONNX export it checks (``docs/performance.md``)."""


@dataclass(frozen=True)
class VerifyOptions:
    """What to verify on, and how strictly (``docs/verification.md``).

    Attributes:
        inputs: an ``.npz`` whose ``x`` array is the input; default ``holdout.npz`` beside the checkpoint, else
            ``samples`` seeded random samples (token ids drawn from the embedding's rows for a language model).
        samples: how many random samples (token sequences for a streamed fold), at least 1 (else ``UsageError``
            when the options are made).
        seed: seed of the random inputs.
        rtol: replaces the bound of question 2 (default: ``max(tol_dtype, 2 * e_orig)``).
        atol: an absolute error also accepted (default 0).
        strict: compare fused vs original directly at the dtype's tolerance with 100% top-1 (the pair comparison).
        generate: greedy tokens to generate and compare for a language model: None for the default (32, in
            ``fuse`` and in ``verify`` of a fused language-model folder), 0 for none.
        runtimes: which runtimes run the candidate for question 2 (``slabconv.verify.backends.RUNTIME_NAMES``:
            ``onnxruntime``, ``pytorch``, ``openvino``); None: every one that can run it (OpenVINO only when asked).
            A quantizing one (``onnxruntime-int8``) runs the int8 check of both sides instead.
        calibration: an ``.npz`` the int8 runtimes calibrate on (``--calibration``); None: the verification inputs.
    """

    inputs: Path | None = None
    samples: int | None = None
    seed: int = 0
    rtol: float | None = None
    atol: float = 0.0
    strict: bool = False
    generate: int | None = None
    runtimes: tuple[str, ...] | None = None
    calibration: Path | None = None

    def __post_init__(self) -> None:  # refused before any work, for every chooser of inputs alike
        if self.samples is not None and self.samples < 1:
            raise UsageError(f"--samples must be at least 1 (got {self.samples})")

    def fuse_steps(self) -> int:
        """Greedy tokens per prompt that ``fuse`` (and ``verify`` of a fused folder) of a language model compares:
        ``generate``, else 32."""
        return self.generate if self.generate is not None else 32

    def sample_count(self, streamed: bool = False) -> int:
        """``samples``, else the default: ``DEFAULT_SAMPLES``, or 2 token sequences for a streamed (layer-by-layer)
        run."""
        return self.samples if self.samples is not None else (2 if streamed else DEFAULT_SAMPLES)

    def check_streamed(self) -> None:
        """What a streamed (layer-by-layer) verification cannot take, refused before any work.

        Raises:
            UsageError: a runtime other than pytorch (it compares the two folders layer by layer in PyTorch).
        """
        if self.runtimes and set(self.runtimes) != {"pytorch"}:
            raise UsageError(
                "--stream compares two folders layer by layer in PyTorch; leave out --runtime or give pytorch"
            )


DTYPE_SPELLINGS: dict[str, str] = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
"""What ``--dtype`` (``WriteOptions(dtype=...)``) takes, case ignored: the names torch, optimum and the Hugging Face
tools use, each -> the dtype it means."""

OPSET_RANGE = (17, 25)
"""The opsets ``--opset`` may ask for: the dynamo exporter writes 18 and later natively and converts down to 17;
it does not reach earlier ones (asked for 15 it writes 18), and 25 is the newest the installed exporter writes."""

BFLOAT16_OPSET = 22
"""The first opset whose Conv, Gemm and friends accept bfloat16 (earlier ones make a bfloat16 model invalid)."""


def check_opset(opset: int | None, dtype: str | None = None) -> None:
    """Refuse, before any work, an ``--opset`` the exporter cannot write or a bfloat16 model cannot use.

    Raises:
        UsageError: naming the range (``OPSET_RANGE``), or ``BFLOAT16_OPSET`` for a bfloat16 model.
    """
    if opset is None:
        return
    low, high = OPSET_RANGE
    if not low <= opset <= high:
        raise UsageError(f"--opset {opset}: slabconv writes ONNX opsets {low} to {high}; choose one of them")
    if dtype == "bfloat16" and opset < BFLOAT16_OPSET:
        raise UsageError(
            f"--opset {opset}: a bfloat16 model needs opset {BFLOAT16_OPSET} or later (earlier Conv and Gemm take no "
            f"bfloat16); choose {BFLOAT16_OPSET} to {high}"
        )


@dataclass(frozen=True)
class WriteOptions:
    """What ``fuse`` writes, and where.

    Attributes:
        force: replace an existing output folder slabconv wrote (``docs/security.md``).
        onnx: write ``model.onnx`` (dynamic batch where the model allows it).
        pt2: write ``model.pt2`` (a ``torch.export`` program that runs without slabconv).
        stream: fold a sharded LLaMA-layout folder shard by shard in bounded memory (safetensors only).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (or a spelling of ``DTYPE_SPELLINGS``: ``fp16``,
            ``half``, ``bf16``, ``fp32``, ...; stored as the canonical name): write the fused model in that dtype
            (folded in float64, cast once, verified at that dtype's tolerance). The checkpoint's own dtype writes
            what no ``dtype`` writes; None keeps the checkpoint's dtype.
        opset: the ONNX opset of ``model.onnx`` (``OPSET_RANGE``); None: the exporter's default (22 for bfloat16).
        simplify: run onnxscript's optimizer on ``model.onnx`` after the fold (constant folding of shape arithmetic,
            dead nodes, layout pairs), then onnxslim when installed (the ``simplify`` extra), kept where it has
            fewer nodes (``slabconv.engine.onnx_fold.simplify_graph``); the simplified file is the one written and
            verified.
        require_folded: write only a norm-free model: when the plan keeps any norm (as a per-channel affine),
            refuse before writing (``KeptNormsError``, exit code 2), naming each kept norm and its reason. For
            targets that reject a normalisation standing on its own (some NPU compilers, ExecuTorch delegates).
    """

    force: bool = False
    onnx: bool = True
    pt2: bool = True
    stream: bool = False
    dtype: str | None = None
    opset: int | None = None
    simplify: bool = False
    require_folded: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype.casefold() in DTYPE_SPELLINGS:
            object.__setattr__(self, "dtype", DTYPE_SPELLINGS[self.dtype.casefold()])

    def check(self) -> None:
        """Refuse, before anything is read, what these options cannot do together.

        Raises:
            UsageError: an unknown ``dtype``; ``dtype`` with ``stream`` (the streamed fold keeps the checkpoint's
                dtype); an ``opset`` outside ``OPSET_RANGE`` or below ``BFLOAT16_OPSET`` for bfloat16; an
                ``opset`` or ``simplify`` when no ONNX file is written (``onnx=False``): an option that would do
                nothing.
        """
        if self.dtype is not None and self.dtype not in DTYPE_SPELLINGS.values():
            raise UsageError(
                f"--dtype {self.dtype}: choose float16 (fp16, half), bfloat16 (bf16) or float32 (fp32); leave it out "
                "to keep the checkpoint's"
            )
        if self.dtype is not None and self.stream:
            raise UsageError(
                "--dtype does not stream: the streamed fold keeps the checkpoint's dtype; leave out --dtype"
            )
        check_opset(self.opset, self.dtype)
        if self.simplify and not self.onnx:
            raise UsageError(
                "--simplify simplifies model.onnx, which --no-onnx (or --stream) does not write; leave one out"
            )
        if self.opset is not None and not self.onnx:
            written = "a streamed fold writes safetensors only" if self.stream else "--no-onnx writes none"
            raise UsageError(f"--opset {self.opset} sets the opset of the ONNX file, and {written}; drop --opset")
