"""Checkpoint -> runnable model: the zoo lookup, a strict load, a ``.pt2`` program or a trusted module.

What goes in: a path (and the ``LoadOptions``). What comes out: a ``LoadedModel`` in eval mode, with what the
later stages need to know about it (its input shape and dtype, how to make valid inputs, where it came from).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.load.checkpoint import Checkpoint, load_checkpoint
from slabconv.zoo import ArchSpec, detect_arch, get_arch
from slabconv.zoo.llama import SEQ_LEN_KEY
from slabconv.zoo.registry import IMAGE_SIZE_KEY, with_image_size


@dataclass
class LoadedModel:
    """A checkpoint built into a runnable model.

    Attributes:
        model: the network in eval mode (an ``nn.Module`` or the ``GraphModule`` of a ``.pt2``).
        checkpoint: what was read from the file.
        arch: the registered architecture name (None for a ``.pt2``).
        input_shape: one sample's input shape, without the batch axis.
        dtype: the floating dtype of the weights (and of a float input).
        input_dtype: the input's dtype when it is not a float tensor in ``dtype`` (``torch.int64`` token ids of
            a language model), else None.
        make_input: ``make_input(batch, seed) -> Tensor``: valid seeded inputs (token ids in range for a
            language model); None: standard-normal samples of ``input_shape`` (zeros for integer inputs).
        config: the config the model was built from (the saved one, plus an ``--image-size`` override).
    """

    model: nn.Module
    checkpoint: Checkpoint
    arch: str | None
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    input_dtype: torch.dtype | None = None
    make_input: Callable[[int, int], torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def token_input(self) -> bool:
        """True when the model takes integer ids (its logits' last axis is the vocabulary)."""
        return self.input_dtype is not None and not self.input_dtype.is_floating_point

    def example(self, batch: int, seed: int = 0) -> torch.Tensor:
        """``batch`` seeded inputs of the model's input shape and dtype."""
        if self.make_input is not None:
            return self.make_input(batch, seed)
        if self.token_input:
            return torch.zeros((batch, *self.input_shape), dtype=self.input_dtype)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *self.input_shape), generator=gen).to(self.dtype)

    def source(self) -> dict[str, Any]:
        """The ``source`` block of the report."""
        ckpt = self.checkpoint
        return {
            "path": str(ckpt.path),
            "sha256": ckpt.sha256,
            "format": ckpt.format,
            "arch": self.arch,
            "weights": ckpt.extra.get("weights"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "input_shape": list(self.input_shape),
        }


def _float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    for value in state_dict.values():
        if value.is_floating_point():
            return value.dtype
    return torch.float32


def _load_strict(model: nn.Module, state_dict: dict[str, torch.Tensor], arch: str, path: Path | None = None) -> None:
    """``load_state_dict(strict=True)`` with one readable line for missing, unexpected and mis-shaped keys."""
    expected = model.state_dict()
    problems = []
    shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    for label, items in (("shape mismatch", shapes), ("missing keys", missing), ("unexpected keys", unexpected)):
        if items:
            shown = ", ".join(items[:4]) + (f", ... ({len(items) - 4} more)" if len(items) > 4 else "")
            problems.append(f"{label} ({len(items)}): {shown}")
    if problems:
        where = f"{path}: " if path is not None else ""
        raise InputError(
            f"{where}the checkpoint does not fit architecture {arch!r}: "
            + "; ".join(problems)
            + " (a different model or a damaged file? check --arch, see `slabconv list`)"
        )
    model.load_state_dict(state_dict, strict=True)


def load_model(
    path: Path | str,
    arch: str | None = None,
    ema: bool = False,
    *,
    trust_pickle: bool = False,
    input_shape: tuple[int, ...] | None = None,
    image_size: int | None = None,
) -> LoadedModel:
    """Read a checkpoint and build the model it holds, in eval mode.

    Args:
        path: checkpoint (``.pth``), a ``.pt2`` program, or a fused ``model.safetensors`` written by ``fuse``.
        arch: a registered architecture name or alias; detected from the checkpoint when None.
        ema: use the EMA weights of a training checkpoint.
        trust_pickle: allow a pickle that names arbitrary globals, such as a whole ``nn.Module`` saved with
            ``torch.save(model)`` (this runs code from the file; only for files you trust).
        input_shape: one sample's input shape without the batch axis; required for a pickled ``nn.Module``
            (nothing in the file records it), ignored otherwise.
        image_size: build a zoo vision model for ``image_size`` square inputs (Swin pads its windows, PVT
            resamples position embeddings; models whose weights fix the resolution refuse another size).

    Raises:
        InputError: unreadable or unsafe file, weights that do not fit the architecture, a pickled module in
            train mode.
        UnsupportedModelError: unknown or undetectable architecture.
        UsageError: a pickled module without ``input_shape``.
    """
    ckpt = load_checkpoint(path, ema=ema, trust_pickle=trust_pickle)
    _check_values(ckpt)
    if ckpt.format == "torch.export":
        return _load_program(ckpt)
    if ckpt.format == "pickled-module":
        return _load_module(ckpt, input_shape)
    norm = "checkpoint"
    config = ckpt.config
    if (
        ckpt.format in ("safetensors", "hf-safetensors", "hf-safetensors-sharded")
        and "slabconv_version" in ckpt.metadata
    ):
        if ckpt.metadata.get("complete") != "true":
            raise UnsupportedModelError(
                f"{ckpt.path}: this fused model keeps some norms as affines; verify the model.onnx beside it"
            )
        arch = arch or ckpt.metadata.get("arch")
        config = json.loads(ckpt.metadata.get("config", "{}"))
        norm = "identity"
    if image_size is not None:
        config = with_image_size(config, image_size)
    check_config_sizes(config, str(ckpt.path))
    try:
        spec: ArchSpec = get_arch(arch) if arch else detect_arch(ckpt.state_dict, config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{ckpt.path}: {err}") from None
    try:
        model = spec.build(ckpt.state_dict, config, norm)
    except UnsupportedModelError:
        raise
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise InputError(
            f"{ckpt.path}: cannot build {spec.name!r} from this checkpoint ({type(err).__name__}: {err}); "
            "it is another architecture: check --arch (see `slabconv list`)"
        ) from None
    dtype = _float_dtype(ckpt.state_dict)
    model.to(dtype)
    _load_strict(model, ckpt.state_dict, spec.name, ckpt.path)
    model.eval()
    shape = tuple(spec.input_shape(ckpt.state_dict, config))
    state = ckpt.state_dict

    def make_input(batch: int, seed: int) -> torch.Tensor:
        return spec.example(state, config, batch, seed, dtype)

    return LoadedModel(model, ckpt, spec.name, shape, dtype, spec.input_dtype, make_input, dict(config))


# Config values that size what a build allocates beyond the weights (inputs, masks, caches), with their bounds.
# The other sizes come from the weights' shapes, which the file's own size bounds.
_SIZE_LIMITS = {
    "IMG_SIZE": 8192,
    IMAGE_SIZE_KEY: 8192,
    SEQ_LEN_KEY: 1 << 16,
    "WINDOW_SIZE": 1024,
    "PATCH_SIZE": 1024,
    "max_position_embeddings": 1 << 24,
    "num_attention_heads": 1 << 16,
    "num_key_value_heads": 1 << 16,
}


def check_config_sizes(config: Any, label: str) -> None:
    """Refuse a saved config (training config or ``config.json``) whose sizes would allocate an absurd model.

    Raises:
        InputError: naming the key and its value.
    """
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                limit = _SIZE_LIMITS.get(str(key))
                values = value if isinstance(value, list) else [value]
                if limit is not None and any(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 < v <= limit for v in values
                ):
                    raise InputError(
                        f"{label}: config {key} = {value} is outside 1..{limit}; a model of that size cannot be "
                        "built from these weights (a damaged or hostile config)"
                    )
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


# Inf is refused only in tensors that are weights or norm statistics: some models keep -inf in mask buffers.
_FINITE_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "alpha")
_FOLDABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_values(ckpt: Checkpoint) -> None:
    """Refuse NaN anywhere, Inf in weights and norm statistics, and a negative ``running_var``, naming the first
    tensor that has them (``plan`` checks ``running_var + eps > 0`` again for models built in memory).

    Raises:
        InputError: a damaged checkpoint.
    """
    for key, value in ckpt.state_dict.items():
        if not value.is_floating_point() or value.numel() == 0:
            continue
        if value.dtype not in _FOLDABLE_DTYPES:
            raise InputError(
                f"{ckpt.path}: tensor {key!r} is {str(value.dtype).removeprefix('torch.')}; slabconv folds float16, "
                "bfloat16, float32 and float64 models: convert the checkpoint to one of those first"
            )
        if bool(torch.isnan(value).any()) or (key.endswith(_FINITE_SUFFIXES) and not bool(torch.isfinite(value).all())):
            raise InputError(
                f"{ckpt.path}: tensor {key!r} holds NaN or Inf; the checkpoint is damaged (a diverged run or a bad "
                "save): use an earlier or intact checkpoint"
            )
        if key.endswith("running_var") and bool((value < 0).any()):
            raise InputError(
                f"{ckpt.path}: tensor {key!r} has running_var < 0 (a variance cannot be negative); the checkpoint is "
                "damaged: use an earlier or intact checkpoint"
            )


def _load_module(ckpt: Checkpoint, input_shape: tuple[int, ...] | None) -> LoadedModel:
    """A whole ``nn.Module`` read with ``trust_pickle``: used as it is, traced like any model."""
    model: nn.Module = ckpt.module
    if input_shape is None:
        raise UsageError(
            f"{ckpt.path}: a pickled nn.Module does not record its input shape; pass --input-shape with one "
            "sample's shape without the batch axis (e.g. --input-shape 3,224,224)"
        )
    in_train = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    norms = [name for name, m in model.named_modules() if m.training and isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if in_train:
        where = f"norm {norms[0]}" if norms else f"module {in_train[0]}"
        raise InputError(
            f"{ckpt.path}: {where} is in train mode (a norm would use batch statistics, not a fixed affine); "
            "call model.eval() before torch.save(model)"
        )
    return LoadedModel(model, ckpt, None, tuple(int(s) for s in input_shape), _float_dtype(ckpt.state_dict))


def _load_program(ckpt: Checkpoint) -> LoadedModel:
    program = ckpt.program
    user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    if len(user_inputs) != 1:
        raise UnsupportedModelError(f"{ckpt.path}: slabconv handles programs with one tensor input")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == user_inputs[0])
    val = node.meta["val"]
    shape = tuple(int(s) if isinstance(s, int) else -1 for s in val.shape[1:])
    if any(s < 0 for s in shape):
        raise UnsupportedModelError(f"{ckpt.path}: only the batch axis of the input may be dynamic")
    input_dtype = None if val.dtype.is_floating_point else val.dtype
    weights_dtype = val.dtype if val.dtype.is_floating_point else _float_dtype(ckpt.state_dict)
    return LoadedModel(ckpt.module, ckpt, None, shape, weights_dtype, input_dtype)
