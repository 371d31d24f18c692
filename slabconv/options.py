"""The options every command shares, as objects: how to load, how to verify, how to write.

The Python API takes these and the CLI builds them from its flags (``slabconv.cli.options`` defines each flag
once), so an option means the same thing wherever it appears.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoadOptions:
    """How to read a checkpoint and build its model.

    Attributes:
        arch: a registered architecture name or alias (``slabconv list``); detected from the checkpoint when None.
        ema: take the EMA weights (``state_dict_ema``) of a training checkpoint.
        trust_pickle: load a pickle that names arbitrary globals (a whole ``nn.Module``): runs code from the file.
        input_shape: one sample's input shape without the batch axis (a pickled module records none).
        image_size: build a zoo vision model for ``image_size`` square inputs.
        fold_norm_affine: also fold the affine (weight and bias) of every LayerNorm, RMSNorm and GroupNorm into
            the layers that read the norm's output; the normalisation stays, with a unit weight
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
        samples: how many random samples (token sequences for a streamed fold).
        seed: seed of the random inputs.
        rtol: replaces the bound of question 2 (default: ``max(tol_dtype, 2 * e_orig)``).
        atol: an absolute error also accepted (default 0).
        strict: compare fused vs original directly at the dtype's tolerance with 100% top-1 (the pair comparison).
        generate: greedy tokens to generate and compare for a language model: None for the default (32 in
            ``fuse``, none in ``verify``), 0 for none.
        runtimes: which runtimes run the candidate for question 2 (``slabconv.verify.backends.RUNTIME_NAMES``:
            ``onnxruntime``, ``pytorch``, ``openvino``); None: every one that can run it (OpenVINO only when asked).
    """

    inputs: Path | None = None
    samples: int | None = None
    seed: int = 0
    rtol: float | None = None
    atol: float = 0.0
    strict: bool = False
    generate: int | None = None
    runtimes: tuple[str, ...] | None = None

    def fuse_steps(self) -> int:
        """Greedy tokens per prompt that ``fuse`` of a language model compares: ``generate``, else 32."""
        return self.generate if self.generate is not None else 32

    def sample_count(self, streamed: bool = False) -> int:
        """``samples``, else the default: ``DEFAULT_SAMPLES``, or 2 token sequences for a streamed (layer-by-layer)
        run."""
        return self.samples if self.samples is not None else (2 if streamed else DEFAULT_SAMPLES)


@dataclass(frozen=True)
class WriteOptions:
    """What ``fuse`` writes, and where.

    Attributes:
        force: replace an existing output folder slabconv wrote (``docs/security.md``).
        onnx: write ``model.onnx`` (dynamic batch where the model allows it).
        pt2: write ``model.pt2`` (a ``torch.export`` program that runs without slabconv).
        stream: fold a sharded LLaMA-layout folder shard by shard in bounded memory (safetensors only).
        dtype: ``"float16"`` or ``"bfloat16"``: write the fused model in that dtype (folded in float64, cast once,
            verified at that dtype's tolerance); None keeps the checkpoint's dtype.
        opset: the ONNX opset of ``model.onnx`` (``slabconv.write.onnx.OPSET_RANGE``); None: the exporter's
            default (22 for bfloat16).
        simplify: run onnxscript's optimizer on ``model.onnx`` after the fold (constant folding of shape arithmetic,
            dead nodes, layout pairs); the simplified file is the one written and verified.
    """

    force: bool = False
    onnx: bool = True
    pt2: bool = True
    stream: bool = False
    dtype: str | None = None
    opset: int | None = None
    simplify: bool = False
