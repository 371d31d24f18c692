"""Checkpoint -> runnable model: the zoo lookup, a strict load, a ``.pt2`` program or a trusted module.

What goes in: a path (and the ``LoadOptions``). What comes out: a ``LoadedModel`` in eval mode, with what the
later stages need to know about it (its input shape and dtype, how to make valid inputs, where it came from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.load import safety
from slabconv.load.checkpoint import Checkpoint
from slabconv.load.formats import load_checkpoint, sniff_format
from slabconv.load.fused import FUSED_LLAMA_ARCH, FUSED_LLAMA_TYPE, FusedMetadata, is_output_folder
from slabconv.load.source import Source
from slabconv.options import LoadOptions
from slabconv.util import upper_bound
from slabconv.zoo import ArchSpec, detect_arch, get_arch
from slabconv.zoo.llama import SEQ_LEN_KEY
from slabconv.zoo.llama_std import FAMILY as STANDARD_FAMILY
from slabconv.zoo.registry import (
    IMAGE_SIZE_KEY,
    OWN_MODEL,
    ArchMismatch,
    LayoutError,
    UnsupportedSetting,
    with_image_size,
)


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
        batch: the batch size a static program was recorded with (it runs on exactly that many samples), or None
            when the batch axis is dynamic.
        sequence: a program of token ids with a symbolic length: the longest length it takes (else None; a
            model built from a config takes its ``max_position_embeddings``).
        id_range: for integer input, the number of valid ids (the smallest embedding table's rows), or None when
            unknown; ``--inputs`` ids outside ``0 .. id_range - 1`` are refused.
    """

    model: nn.Module
    checkpoint: Checkpoint
    arch: str | None
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    input_dtype: torch.dtype | None = None
    make_input: Callable[[int, int], torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    batch: int | None = None
    sequence: int | None = None
    id_range: int | None = None

    def source(self, path: Path | None = None) -> Source:
        """The report's ``source`` block for this model (``reference`` / ``candidate`` of ``verify``).

        Args:
            path: the path the user gave, when it is not the checkpoint's own (a folder ``fuse`` wrote: its format
                is then ``slabconv-output``).
        """
        ckpt = self.checkpoint
        return Source(
            path=str(path if path is not None else ckpt.path),
            sha256=ckpt.sha256,
            format="slabconv-output" if path is not None and is_output_folder(path) else ckpt.format,
            arch=self.arch,
            weights=ckpt.extra.get("weights"),
            dtype=str(self.dtype).removeprefix("torch."),
            input_shape=list(self.input_shape),
            batch=self.batch,
        )

    @property
    def own_program(self) -> Any:
        """The ``torch.export`` program of a ``.pt2`` whose batch is dynamic: it is its own capture, never traced
        again (one of a static batch is traced again with a symbolic batch, so the fused program takes any batch
        the model's code allows); None for any other model."""
        return self.checkpoint.program if self.batch is None else None

    @property
    def example_batch(self) -> int:
        """The batch size to trace and export with: the recorded one of a static program, else 2 (so the batch
        axis can be symbolic)."""
        return self.batch or 2

    @property
    def token_input(self) -> bool:
        """True when the model takes integer ids (its logits' last axis is the vocabulary)."""
        return self.input_dtype is not None and not self.input_dtype.is_floating_point

    @property
    def max_sequence(self) -> int | None:
        """For a language model taking ids ``(B, T)``: the longest ``T`` it takes (its config's
        ``max_position_embeddings``), so its graph and the programs written from it accept any length up to it;
        None otherwise."""
        limit = self.sequence or (self.config.get("max_position_embeddings") if isinstance(self.config, dict) else None)
        if not self.token_input or len(self.input_shape) != 1 or not isinstance(limit, int) or limit < 2:
            return None
        return limit

    def trace_example(self) -> torch.Tensor:
        """The input to trace and export with: ``example_batch`` seeded samples, or, for integer ids whose range is
        unknown (they feed more than embedding lookups), zeros -- a valid index for any table. Shape
        ``(example_batch, *input_shape)``."""
        try:
            return self.example(self.example_batch, seed=0)
        except UsageError:
            return torch.zeros((self.example_batch, *self.input_shape), dtype=self.input_dtype or self.dtype)

    def example(self, batch: int, seed: int = 0) -> torch.Tensor:
        """``batch`` seeded inputs of the model's input shape and dtype."""
        if self.make_input is not None:
            return self.make_input(batch, seed)
        if self.token_input:
            return torch.zeros((batch, *self.input_shape), dtype=self.input_dtype)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *self.input_shape), generator=gen).to(self.dtype)


def _float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    for value in state_dict.values():
        if value.is_floating_point():
            return value.dtype
    return torch.float32


def load_strict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    arch: str,
    path: Path | str | None = None,
    assign: bool = False,
) -> None:
    """``load_state_dict(strict=True, assign=assign)`` with one readable line for missing, unexpected and
    mis-shaped keys (in memory and for the streamed plan's stand-ins alike).

    Raises:
        InputError: naming up to four keys of each kind and the architecture.
    """
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
    model.load_state_dict(state_dict, strict=True, assign=assign)


def check_options_apply(path: Path | str, options: LoadOptions | None) -> None:
    """Refuse, before anything is read, the options that build a checkpoint's model (``--arch``, ``--image-size``,
    ``--ema``) for a ``torch.export`` program, which is its model, and ``--ema`` for a safetensors file or a Hugging
    Face folder, which hold one set of weights: they would be ignored. (``verify`` gives one set of options to both
    sides, so it does not call this.)

    Raises:
        UsageError: naming the first such option.
    """
    opts = options or LoadOptions()
    found = sniff_format(Path(path))
    if opts.ema and found is not None and found.name in ("safetensors", "hf-folder"):
        what = "a safetensors file" if found.name == "safetensors" else "a Hugging Face style folder"
        raise UsageError(
            f"{path}: --ema does not apply to {what} (it holds one set of weights; --ema takes the EMA weights of "
            "a .pth training checkpoint); drop it"
        )
    if found is None or found.name != "torch.export":
        return
    given = [flag for flag, on in (("--arch", opts.arch), ("--image-size", opts.image_size), ("--ema", opts.ema)) if on]
    if given:
        raise UsageError(
            f"{path}: {given[0]} does not apply to a torch.export program (the program is the model: its graph, "
            "weights and input shape); drop it"
        )


def check_ema_applies(paths: tuple[Path | str, ...], options: LoadOptions | None) -> None:
    """Refuse ``--ema`` for a ``verify`` whose sides are none of them a PyTorch pickle (``.pth``): only a training
    checkpoint holds EMA weights, and every other side would ignore the option.

    Raises:
        UsageError: ``options.ema`` set and no side is read as a pickle (``FORMATS``' ``pickle`` entry).
    """
    if not (options and options.ema):
        return
    if not any((found := sniff_format(Path(p))) is not None and found.name == "pickle" for p in paths):
        raise UsageError(
            f"--ema takes the EMA weights of a .pth training checkpoint, and neither {paths[0]} nor {paths[1]} is "
            "one; drop it"
        )


def check_build_options_apply(paths: tuple[Path | str, ...], options: LoadOptions | None) -> None:
    """Refuse ``--arch`` and ``--image-size`` for a ``verify`` whose sides are all ONNX graphs (an ``.onnx``, or a
    folder ``fuse`` wrote from one: its ``model.onnx`` without fused weights or a program): they say how to build a
    checkpoint's model, and an ONNX graph is its own model, so every side would ignore them.

    Raises:
        UsageError: naming the first such option given.
    """
    opts = options or LoadOptions()
    given = [flag for flag, on in (("--arch", opts.arch), ("--image-size", opts.image_size)) if on]
    if given and all(_onnx_graph_side(Path(p)) for p in paths):
        raise UsageError(
            f"{given[0]} says how to build a checkpoint's model, and neither {paths[0]} nor {paths[1]} is built "
            "(an ONNX graph is its own model); drop it"
        )


def _onnx_graph_side(path: Path) -> bool:
    """An ``.onnx`` file, or a folder ``fuse`` wrote holding only ``model.onnx`` (the fold of an ONNX original)."""
    if path.is_dir():
        built = any((path / n).exists() for n in ("model.pt2", "model.safetensors", "config.json"))
        return is_output_folder(path) and (path / "model.onnx").is_file() and not built
    found = sniff_format(path)
    return found is not None and found.engine == "onnx"


def load_model(
    path: Path | str, options: LoadOptions | None = None, fused_like: tuple[str, dict[str, Any]] | None = None
) -> LoadedModel:
    """Read a checkpoint and build the model it holds, in eval mode.

    Args:
        path: a checkpoint (``.pth``), a ``.pt2`` program, a Hugging Face folder, a fused ``model.safetensors``,
            or a folder ``fuse`` wrote (its ``model.pt2``, else its fused weights in the norm-free model).
        options: ``LoadOptions`` (architecture, EMA weights, ``--trust-pickle``, input shape, image size).
        fused_like: ``(arch, config)`` of a reference model: a safetensors file without slabconv's metadata is
            read as the fused weights of that model (its norm-free model, as a fused file's metadata would say:
            ``verify`` of a fused ``model.safetensors`` whose metadata was stripped); one with it is read as plain
            weights, its metadata set aside (a fold's metadata copied onto the unfused weights).

    Raises:
        InputError: unreadable or unsafe file, weights that do not fit the architecture, a pickled module in
            train mode.
        UnsupportedModelError: unknown or undetectable architecture.
        UsageError: a pickled module without ``input_shape``; an ``.onnx`` file (an export, not a model to build:
            ``fuse`` / ``inspect`` / ``verify`` take it through ``slabconv.onnx_in``).
    """
    opts = options or LoadOptions()
    arch, image_size = opts.arch, opts.image_size
    path = Path(path)
    found = sniff_format(path)
    if found is not None and found.engine != "torch" and path.is_file():
        found.read(path, opts.ema, opts.trust_pickle)  # raises: its engine, not load_model, takes it
    if is_output_folder(path):
        path = _output_folder_model(path)
    ckpt = load_checkpoint(path, ema=opts.ema, trust_pickle=opts.trust_pickle)
    _check_values(ckpt)
    if ckpt.format == "torch.export":
        program = _load_program(ckpt)
        _check_given_shape(ckpt, opts.input_shape, program.input_shape)
        return program
    if ckpt.format == "pickled-module":
        return _load_module(ckpt, opts.input_shape)
    norm = "checkpoint"
    config = ckpt.config
    fused = (
        FusedMetadata.read(ckpt.metadata, str(ckpt.path)) if ckpt.format.endswith(("safetensors", "-sharded")) else None
    )
    plain = fused_like is not None and fused is not None  # read as plain weights, whatever its metadata says
    if fused_like is not None and plain:  # the reference's architecture and config, its norms as the weights hold
        fused = None
        arch, config = arch or fused_like[0], dict(fused_like[1])
    if fused is not None:
        if not fused.complete:
            raise UnsupportedModelError(
                f"{ckpt.path}: this fused model keeps some norms as affines, so no zoo model holds it; verify the "
                "model.pt2 or model.onnx beside it"
            )
        arch = arch or fused.arch
        config = fused.config
        # the norm-free model of the architecture, unless the norms stay: a norm whose affine folded keeps its
        # normalisation, and a standard decoder's fused weights are its own architecture's (norms included)
        standard = arch is not None and get_arch(arch).family == STANDARD_FAMILY
        norm = "checkpoint" if fused.norm_affine or standard else "identity"
    elif fused_like is not None and not plain and ckpt.format == "safetensors":  # a fused file, metadata stripped
        arch, config = arch or fused_like[0], dict(fused_like[1])
        norm = "checkpoint" if get_arch(arch).family == STANDARD_FAMILY else "identity"
    elif ckpt.format.startswith("hf-") and isinstance(config, dict) and config.get("model_type") == FUSED_LLAMA_TYPE:
        # a fused LLaMA folder whose weights lost slabconv's metadata (saved again by transformers): its config
        # names the norm-free model; weights with a norm left in them fail load_strict below
        arch, norm = arch or FUSED_LLAMA_ARCH, "identity"
    if image_size is not None:
        config = with_image_size(config, image_size)
    # A Hugging Face folder's sizes come from its config.json: name that file in what the config gets blamed for.
    config_label = str(ckpt.path / "config.json") if ckpt.format.startswith("hf-") else str(ckpt.path)
    check_config_sizes(config, config_label)
    spec, model = _build(ckpt, arch, config, norm, config_label)
    dtype = _float_dtype(ckpt.state_dict)
    model.to(dtype)
    load_strict(model, ckpt.state_dict, spec.name, ckpt.path)
    model.eval()
    shape = tuple(spec.input_shape(ckpt.state_dict, config))
    _check_given_shape(ckpt, opts.input_shape, shape)
    state = ckpt.state_dict

    def make_input(batch: int, seed: int) -> torch.Tensor:
        return spec.example(state, config, batch, seed, dtype)

    id_range = None
    if spec.input_dtype is not None and not spec.input_dtype.is_floating_point:
        tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
        id_range = min(tables) if tables else None
    return LoadedModel(
        model, ckpt, spec.name, shape, dtype, spec.input_dtype, make_input, dict(config), id_range=id_range
    )


def _check_given_shape(ckpt: Checkpoint, given: tuple[int, ...] | None, shape: tuple[int, ...]) -> None:
    """``--input-shape`` where the model fixes its own input ``shape`` (weights, a program): the same shape is
    accepted, another refused (it would be ignored: an option that does nothing).

    Raises:
        UsageError: ``given`` is not the model's shape.
    """
    if given is not None and tuple(given) != tuple(shape):
        what = "program" if ckpt.format == "torch.export" else "weights"
        resize = " (--image-size N builds a zoo vision model for NxN inputs)" if what == "weights" else ""
        raise UsageError(
            f"--input-shape {','.join(map(str, given))}: {ckpt.path} takes inputs of shape "
            f"({', '.join(map(str, shape))}), fixed by its {what}; --input-shape is for a pickled nn.Module "
            f"(--trust-pickle) or an .onnx file with dynamic axes: drop it{resize}"
        )


def _build(
    ckpt: Checkpoint, arch: str | None, config: dict[str, Any], norm: str, config_label: str
) -> tuple[ArchSpec, nn.Module]:
    """The zoo architecture (named, or detected from the keys and config) and its model built for the weights.

    Raises:
        UnsupportedModelError: unknown or undetectable architecture; a Hugging Face config that does not fit the
            weights (naming ``config_label``).
        InputError: the weights are another architecture's.
    """
    try:
        spec: ArchSpec = get_arch(arch) if arch else detect_arch(ckpt.state_dict, config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{ckpt.path}: {err}") from None
    try:
        return spec, spec.build(ckpt.state_dict, config, norm)
    except LayoutError as err:
        raise UnsupportedModelError(
            f"{ckpt.path}: {err}; --arch {spec.name} is not what these weights are: leave --arch out to detect a "
            f"registered architecture, or, {OWN_MODEL}"
        ) from None
    except UnsupportedSetting as err:  # the config is right: the model is one slabconv does not build
        raise UnsupportedModelError(f"{config_label}: {err}") from None
    except ArchMismatch:  # --arch names another architecture (said as for any format): nothing to fix in the config
        raise
    except UnsupportedModelError as err:
        if ckpt.format.startswith("hf-"):
            raise UnsupportedModelError(
                f"{config_label}: {err}; the config does not fit the weights: fix config.json"
            ) from None
        raise
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise InputError(
            f"{ckpt.path}: cannot build {spec.name!r} from this checkpoint ({type(err).__name__}: {err}); "
            f"it is another architecture: check --arch (see `slabconv list`); {OWN_MODEL}"
        ) from None


def _output_folder_model(folder: Path) -> Path:
    """The file to load from a folder ``fuse`` wrote: ``model.pt2`` (the fused program, any model), else the
    fused weights (in-memory: ``model.safetensors``; streamed: the folder itself, a Hugging Face folder).

    Raises:
        InputError: the folder holds neither.
    """
    for name in ("model.pt2", "model.safetensors"):
        if (folder / name).is_file():
            return folder / name
    if (folder / "config.json").is_file():
        return folder
    raise InputError(f"{folder}: a slabconv output folder without model.pt2 or model.safetensors; it is incomplete")


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
# Config values that are a norm's eps: a positive number below 1 (a negative one makes the norm divide by the square
# root of a negative number, and the fold would inherit the NaN).
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def check_config_sizes(config: Any, label: str) -> None:
    """Refuse a saved config (training config or ``config.json``) whose sizes would allocate an absurd model.

    Raises:
        InputError: naming the key and its value.
    """
    for item in safety.json_dicts(config):
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
            if str(key) in _EPS_KEYS and value is not None and not _valid_eps(value):
                raise InputError(
                    f"{label}: config {key} = {str(value)[:40]} is not a positive number below 1 (a norm's eps); "
                    "the config is damaged: fix it"
                )


def _valid_eps(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1


# Inf is refused only in tensors that are weights or norm statistics: some models keep -inf in mask buffers.
_FINITE_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "alpha")
_FOLDABLE_DTYPES = tuple(getattr(torch, name) for name in safety.FOLDABLE_FLOATS)
_INTEGER_INPUTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def refuse_unfoldable_dtype(value: torch.Tensor, key: str, label: str) -> None:
    """Refuse a complex, quantized or float8 tensor, naming it: a fold in float64 would drop an imaginary part or
    misread quantized storage, and both sides of a verification would agree on the wrong numbers.

    Raises:
        InputError: naming the file (``label``), the tensor and its dtype.
    """
    dtype = value.dtype
    if not (value.is_complex() or value.is_quantized or (dtype.is_floating_point and dtype not in _FOLDABLE_DTYPES)):
        return
    raise safety.unfoldable_dtype(label, f"tensor {key!r}", str(dtype).removeprefix("torch."))


def _check_values(ckpt: Checkpoint) -> None:
    """Refuse NaN anywhere, Inf in weights and norm statistics, and a negative ``running_var``, naming the first
    tensor that has them (``plan`` checks ``running_var + eps > 0`` again for models built in memory).

    Raises:
        InputError: a damaged checkpoint.
    """
    constants = dict(getattr(ckpt.program, "constants", None) or {}) if ckpt.program is not None else {}
    for key, value in constants.items():
        if isinstance(value, torch.Tensor):
            refuse_unfoldable_dtype(value, key, str(ckpt.path))
    for key, value in ckpt.state_dict.items():
        refuse_unfoldable_dtype(value, key, str(ckpt.path))
        if not value.is_floating_point() or value.numel() == 0:
            continue
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
    """A ``torch.export`` program: its one tensor input gives the input shape and dtype. A batch axis recorded as a
    number (``torch.export.export(model, (x,))``, the default) makes the program static: it runs on exactly that
    many samples. Integer input that only indexes embedding tables gets random ids below the smallest table's row
    count."""
    program = ckpt.program
    user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    if len(user_inputs) != 1:
        raise UnsupportedModelError(
            f"{ckpt.path}: the program takes {len(user_inputs)} inputs; slabconv folds programs of one tensor input"
        )
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == user_inputs[0])
    val = node.meta["val"]
    dims = [int(d) if isinstance(d, int) else None for d in val.shape]
    if not dims:
        raise UnsupportedModelError(f"{ckpt.path}: the program's input is a scalar; slabconv needs a batch axis")
    sequence = None
    if len(dims) == 2 and dims[1] is None and not val.dtype.is_floating_point:
        # token ids (B, T) with a symbolic length (a fused language model's program): run it at its longest length
        sequence = upper_bound(val.shape[1])
        dims[1] = sequence
    if any(d is None for d in dims[1:]):
        raise UnsupportedModelError(
            f"{ckpt.path}: only the batch axis of the input may be dynamic; export with the other axes at the size "
            "you deploy: torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim('batch')},))"
        )
    shape = tuple(int(d) for d in dims[1:] if d is not None)
    if val.dtype.is_complex or val.dtype not in (*_FOLDABLE_DTYPES, *_INTEGER_INPUTS):
        raise InputError(
            f"{ckpt.path}: the program's input {user_inputs[0]!r} is {str(val.dtype).removeprefix('torch.')}; "
            "slabconv folds models of real float16, bfloat16, float32, float64 or integer-id input"
        )
    input_dtype = None if val.dtype.is_floating_point else val.dtype
    weights_dtype = val.dtype if val.dtype.is_floating_point else _float_dtype(ckpt.state_dict)
    make_input = None
    rows = None
    if input_dtype is not None:
        rows = _id_range(program, node)
        make_input = partial(_random_ids, rows, shape, input_dtype)
    return LoadedModel(
        ckpt.module,
        ckpt,
        None,
        shape,
        weights_dtype,
        input_dtype,
        make_input,
        batch=dims[0],
        sequence=sequence,
        id_range=rows,
    )


_SHAPE_ONLY = ("aten.sym_size", "aten.sym_numel", "aten.sym_stride", "aten._assert_tensor_metadata")
_PASS_THROUGH = {"aten.view.default", "aten.reshape.default", "aten.clone.default", "aten.contiguous.default"}


def _id_range(program: Any, node: Any) -> int | None:
    """The number of rows every table the integer input ``node`` indexes has in common (the smallest), or None
    when some use of the input is not a table lookup (then the id range is unknown)."""
    rows: list[int] = []
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            target = str(user.target)
            if target.startswith(_SHAPE_ONLY):
                continue  # reads the shape, not the ids
            if target in _PASS_THROUGH or target.startswith("aten.unsqueeze") or target.startswith("aten.squeeze"):
                todo.append(user)
                continue
            if target == "aten.embedding.default":
                table = user.args[0]
            elif target == "aten.index.Tensor" and current in (user.args[1] or []):
                table = user.args[0]
            elif target == "aten.index_select.default" and user.args[2] is current and user.args[1] == 0:
                table = user.args[0]
            else:
                table = None
            value = getattr(table, "meta", {}).get("val") if table is not None else None
            if not isinstance(value, torch.Tensor) or not isinstance(value.shape[0], int):
                return None
            rows.append(int(value.shape[0]))
    return min(rows) if rows else None


def _random_ids(rows: int | None, shape: tuple[int, ...], dtype: torch.dtype, batch: int, seed: int) -> torch.Tensor:
    """Seeded ids in ``[0, rows)`` of shape ``(batch, *shape)``.

    Raises:
        UsageError: ``rows`` is None: the ids feed something other than embedding lookups.
    """
    if rows is None:
        raise UsageError(
            "the program takes integer input that does not only index embedding tables (it feeds other ops too), so "
            "random values could be out of range; pass the inputs to verify on with --inputs NPZ"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows, (batch, *shape), generator=gen, dtype=dtype)
