"""The architecture registry: the builders of the names in ``slabconv.zoo.names``, and detection from a checkpoint.

An ``ArchSpec`` knows how to build a model from a name and a state_dict (the state_dict settles what the name
leaves open: the norm layout, the class count), the model's input shape, and how to build the same network
with every norm replaced by identity (the norm-free bound: the fastest a complete fold can be, docs/math.md).

A name given by the user (``--arch``) is checked against the weights (``check_arch``): a fixed-size preset takes
only its own widths, depths and, where the weights fix it, resolution, and the refusal names the registered
architecture the weights are.

The names, aliases and descriptions are data (``slabconv.zoo.names.NAMES``, read without torch); the family modules
that build them are imported on the first look-up that needs a builder (``get_arch``, ``list_archs``,
``detect_arch``), so ``slabconv list`` and the ``--arch`` completion never import torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.names import BY_NAME, NAMES, canonical, close_names, complete_names, unknown_arch_message

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ArchSpec",
    "Preset",
    "StateDict",
    "check_arch",
    "checking_names",
    "close_names",
    "complete_names",
    "detect_arch",
    "get_arch",
    "list_archs",
    "register_arch",
    "register_family",
    "unknown_arch_message",
]

StateDict = Mapping[str, "torch.Tensor"]

OWN_MODEL = (
    "for an architecture of your own, export a torch.export program (.pt2) and give that instead (docs/own-model.md)"
)
"""The advice for weights of no registered architecture: slabconv folds any model given as a program."""


class LayoutError(UnsupportedModelError):
    """Weights that lack what a family's key layout needs (``not a DeiT-layout checkpoint: key ... is missing``):
    ``--arch`` named a family these weights are not. The loader adds the file and ``OWN_MODEL``."""


class ArchMismatch(UnsupportedModelError):
    """``--arch`` names another registered architecture than the weights are (``check_arch``); the message names
    the one that fits. The loader adds the file, not a request to fix its config."""


class UnsupportedSetting(UnsupportedModelError):
    """A config setting that fits the weights but that the family's forward does not compute (a rope other than the
    plain, llama3 and linear ones, another activation): the config is right, the
    model is one slabconv does not build. The loader names the config file and does not ask to fix it."""


@dataclass(frozen=True)
class ArchSpec:
    """One registered architecture.

    Attributes:
        name: the canonical name (the official release file stem).
        family: the model family (``deit``, ...), used by detection.
        build: ``build(state_dict, config, norm) -> nn.Module``; ``norm`` is ``"checkpoint"`` (the layout the
            state_dict carries) or ``"identity"`` (the norm-free bound).
        input_shape: ``(C, H, W)`` of one sample, without the batch axis; float32.
        matches: ``matches(state_dict, config) -> bool``, True when the checkpoint is this architecture.
        aliases: other accepted names (official README names, registered ``MODEL.NAME`` names).
        source: provenance: the official file and function the layout comes from.
        description: one line for ``slabconv list``.
        extra: free-form per-arch facts.
        image_size: the input side of the released weights (e.g. 224); None when read from the checkpoint.
        resizable: True when the build honours ``image_size_override`` with a size other than the one the
            weights were trained at (window attention with padding, interpolated position embeddings); False
            when the weights fix the resolution (a token-count positional encoding).
        input_dtype: the dtype of the model's input when it is not a float tensor in the weights' dtype (the
            default, None: images); ``torch.int64`` for token ids ``(B, T)`` (causal language models).
        example_input: ``example_input(state_dict, config, batch, seed) -> Tensor``: ``batch`` valid inputs
            (e.g. token ids in ``[0, vocab_size)``); None: standard-normal samples of ``input_shape``.
    """

    name: str
    family: str
    build: Callable[[StateDict, Mapping[str, Any], str], nn.Module]
    input_shape: Callable[[StateDict, Mapping[str, Any]], tuple[int, ...]]
    matches: Callable[[StateDict, Mapping[str, Any]], bool]
    aliases: tuple[str, ...] = ()
    source: str = ""
    description: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    image_size: int | None = None
    resizable: bool = False
    input_dtype: torch.dtype | None = None
    example_input: Callable[[StateDict, Mapping[str, Any], int, int], torch.Tensor] | None = None

    def example(
        self,
        state_dict: StateDict,
        config: Mapping[str, Any],
        batch: int,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``batch`` seeded inputs for this architecture: ``example_input`` when set, else standard-normal samples of
        ``input_shape`` in ``dtype`` (the weights' dtype; default float32). Token models return ``input_dtype`` whatever
        ``dtype``."""
        if self.example_input is not None:
            return self.example_input(state_dict, config, batch, seed)
        import torch

        dtype = torch.float32 if dtype is None else dtype
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *self.input_shape(state_dict, config)), generator=gen).to(dtype)


_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    """Add ``spec`` to the registry under its name and aliases.

    Raises:
        ValueError: a duplicate name, or a name, family or aliases that ``slabconv.zoo.names.NAMES`` does not list
            as given (the table is what ``slabconv list`` and ``--arch`` read without importing the family).
    """
    entry = BY_NAME.get(spec.name)
    if entry is None or (entry.family, entry.aliases) != (spec.family, spec.aliases):
        raise ValueError(
            f"architecture {spec.name!r} ({spec.family}, aliases {spec.aliases}) is not in slabconv.zoo.names.NAMES "
            "as given; add it there"
        )
    for key in (spec.name, *spec.aliases):
        if key in _ALIASES:
            raise ValueError(f"architecture name {key!r} is registered twice")
        _ALIASES[key] = spec.name
    _REGISTRY[spec.name] = spec
    return spec


@dataclass(frozen=True)
class Preset:
    """One named model of a family, for ``register_family``.

    Attributes:
        name: the canonical name (the official release file stem).
        signature: what the family's ``signature(state_dict)`` returns for these weights (sizes, depths, attention
            kinds); None for the family's any-size entry, which matches what no fixed preset matches.
        defaults: facts the weights do not show (attention heads, window size, ...); the saved config wins.
        source: the official file and function.
        image_size: the released input side (None for the any-size entry).

    Its aliases and description are the ``slabconv.zoo.names.NAMES`` entry of ``name``.
    """

    name: str
    signature: Any
    defaults: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    image_size: int | None = None


def register_family(
    family: str,
    presets: list[Preset],
    *,
    signature: Callable[[StateDict], Any],
    build: Callable[[Preset, StateDict, Mapping[str, Any], str], nn.Module],
    input_shape: Callable[[Preset, StateDict, Mapping[str, Any]], tuple[int, ...]],
    resizable: Callable[[Preset], bool] = lambda preset: False,
    input_dtype: torch.dtype | None = None,
    example_input: Callable[[Preset, StateDict, Mapping[str, Any], int, int], torch.Tensor] | None = None,
) -> None:
    """Register every preset of a family.

    ``signature(state_dict)`` returns None for weights of another family (or without PRepBN norms); a fixed-size
    preset matches its own signature, the any-size entry (``signature=None``) whatever no fixed preset matches.
    ``build(preset, state_dict, config, norm)``, ``input_shape(preset, state_dict, config)`` and
    ``example_input(preset, state_dict, config, batch, seed)`` are the ``ArchSpec`` callables with the preset
    first; ``resizable(preset)`` fills ``ArchSpec.resizable``; ``input_dtype`` is ``ArchSpec.input_dtype``.
    """
    fixed = {p.signature for p in presets if p.signature is not None}

    def matcher(preset: Preset) -> Callable[[StateDict, Mapping[str, Any]], bool]:
        def matches(sd: StateDict, config: Mapping[str, Any]) -> bool:
            found = signature(sd)
            if found is None:
                return False
            return found == preset.signature if preset.signature is not None else found not in fixed

        return matches

    for preset in presets:
        entry = BY_NAME.get(preset.name)
        if entry is None:
            raise ValueError(f"architecture {preset.name!r} is not in slabconv.zoo.names.NAMES; add it there")
        register_arch(
            ArchSpec(
                name=preset.name,
                family=family,
                build=partial(build, preset),
                input_shape=partial(input_shape, preset),
                matches=matcher(preset),
                aliases=entry.aliases,
                source=preset.source,
                description=entry.description,
                extra={"preset": preset},
                image_size=preset.image_size,
                resizable=resizable(preset),
                input_dtype=input_dtype,
                example_input=partial(example_input, preset) if example_input is not None else None,
            )
        )


def _register_families() -> None:
    """Import the module of every family ``NAMES`` lists (``slabconv.zoo.<family>``), which registers its builders;
    a second call costs a dictionary look-up per family."""
    for family in dict.fromkeys(entry.family for entry in NAMES):
        importlib.import_module(f"slabconv.zoo.{family}")


def list_archs() -> list[ArchSpec]:
    """Every registered architecture, in the order of ``slabconv.zoo.names.NAMES`` (what ``slabconv list`` prints).

    Raises:
        ValueError: a name of the table that no family module registers.
    """
    _register_families()
    missing = [entry.name for entry in NAMES if entry.name not in _REGISTRY]
    if missing:
        raise ValueError(f"slabconv.zoo.names.NAMES lists {missing}, which no family module registers")
    return [_REGISTRY[entry.name] for entry in NAMES]


def get_arch(name: str) -> ArchSpec:
    """The spec registered under ``name`` or one of its aliases.

    Case is ignored (``DeiT_Tiny_PRepBN`` is ``deit_tiny_prepbn``) when no name matches exactly. Inside
    ``checking_names()`` the spec's ``build`` first checks the weights against the name (``check_arch``).

    Raises:
        UnsupportedModelError: unknown name (the message gives the closest registered names).
    """
    key = canonical(name)
    if key is None:
        raise UnsupportedModelError(unknown_arch_message(name))
    _register_families()
    spec = _REGISTRY[key]
    return _checked(spec) if _CHECK_NAMES.get() else spec


_CHECK_NAMES: ContextVar[bool] = ContextVar("slabconv_check_arch_names", default=False)


@contextmanager
def checking_names() -> Iterator[None]:
    """While active, a spec that ``get_arch`` returns refuses (at ``build`` with the checkpoint's norms) weights
    that are another registered architecture: what the command line wants for ``--arch``. Off by default, so a
    test or benchmark can still build a preset's class from weights of another size on purpose."""
    token = _CHECK_NAMES.set(True)
    try:
        yield
    finally:
        _CHECK_NAMES.reset(token)


@contextmanager
def checked_against(name: str | None, state_dict: StateDict, config: Mapping[str, Any]) -> Iterator[None]:
    """Inside ``checking_names``: check ``--arch name`` against ``state_dict`` now (``check_arch``), then build
    unchecked inside the block, from part of those weights (a decoder planned from three of its layers,
    ``pipeline.plan_sharded``, is the preset its whole depth is). Outside it, or without a name: nothing.

    Raises:
        ArchMismatch: as ``check_arch``.
        UnsupportedModelError: an unknown name.
    """
    if not name or not _CHECK_NAMES.get():
        yield
        return
    token = _CHECK_NAMES.set(False)
    try:
        check_arch(get_arch(name), state_dict, config)
        yield
    finally:
        _CHECK_NAMES.reset(token)


def _checked(spec: ArchSpec) -> ArchSpec:
    build = spec.build

    def checked_build(state_dict: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
        if norm == "checkpoint":  # fused weights (norm "identity") have no norms to recognise the preset by
            check_arch(spec, state_dict, config)
        return build(state_dict, config, norm)

    return replace(spec, build=checked_build)


def trained_side(spec: ArchSpec, state_dict: StateDict, config: Mapping[str, Any]) -> int | None:
    """The input side the weights fix for a fixed-size preset that cannot change resolution, else None (a
    resizable model, an any-size entry, a language model, or weights whose side cannot be read)."""
    if spec.image_size is None or spec.resizable or spec.input_dtype is not None:
        return None
    try:
        shape = spec.input_shape(state_dict, with_image_size(config, None))
    except (UnsupportedModelError, KeyError, ValueError, IndexError, RuntimeError, TypeError):
        return None
    return int(shape[-1]) if len(shape) == 3 else None


def fits(spec: ArchSpec, state_dict: StateDict, config: Mapping[str, Any]) -> bool:
    """True when the weights are ``spec``: its widths and depths (``matches``) and, where the weights fix the
    resolution, its input side."""
    if not spec.matches(state_dict, config):
        return False
    side = trained_side(spec, state_dict, config)
    return side is None or side == spec.image_size


def _any_size_entry(family: str) -> ArchSpec | None:
    """The entry of ``family`` that reads every size from the weights (no fixed image size), if it has one."""
    _register_families()
    return next((s for s in _REGISTRY.values() if s.family == family and s.image_size is None), None)


def check_arch(spec: ArchSpec, state_dict: StateDict, config: Mapping[str, Any]) -> None:
    """Refuse weights that are not ``spec`` but another registered architecture.

    Weights that match no registered architecture at all (no PRepBN norms, an unknown layout) pass: the build
    and the strict load then say what is missing.

    Raises:
        ArchMismatch: naming what the weights are and the ``--arch`` that fits them.
    """
    if fits(spec, state_dict, config):
        return
    try:
        found: ArchSpec | None = detect_arch(state_dict, config)
    except UnsupportedModelError:
        found = None
    if found is not None and found.name == spec.name:
        return  # the family's any-size entry, for weights of a preset's widths at another resolution
    side = trained_side(spec, state_dict, config) if spec.matches(state_dict, config) else None
    if side is not None:
        why = f"{spec.name} is for {spec.image_size}x{spec.image_size} inputs, these weights for {side}x{side}"
    elif found is not None and found.family != spec.family:  # --arch values, not the zoo's family names
        model_type = config.get("model_type")
        named = f" (config.json's model_type is {model_type!r})" if model_type else ""
        why = f"they are {found.name} weights, not {spec.name} weights{named}"
    elif found is not None and config.get("model_type") == found.name:  # the same layout, told apart by the config
        why = f"their config.json's model_type is {found.name!r}, not {spec.name!r}"
    elif found is not None:
        why = f"their widths and depths are those of {found.name}, not {spec.name}"
    else:
        return
    fix = f"pass --arch {found.name}, or leave --arch out to detect it" if found else "leave --arch out"
    raise ArchMismatch(f"--arch {spec.name} does not fit these weights: {why}; {fix}")


# The key of the build config that asks for another input resolution (the CLI's ``--image-size``); it rides in the
# same config dict that the fused safetensors metadata keeps, so a fused model is rebuilt at the same size.
IMAGE_SIZE_KEY = "slabconv_image_size"


def with_image_size(config: Mapping[str, Any] | None, image_size: int | None) -> dict[str, Any]:
    """A copy of ``config`` that asks ``ArchSpec.build`` / ``input_shape`` for ``image_size`` square inputs."""
    out = dict(config or {})
    if image_size is None:
        out.pop(IMAGE_SIZE_KEY, None)
    else:
        out[IMAGE_SIZE_KEY] = int(image_size)
    return out


def image_size_override(config: Mapping[str, Any] | None) -> int | None:
    """The input side asked for with ``with_image_size``, or None."""
    value = config.get(IMAGE_SIZE_KEY) if isinstance(config, Mapping) else None
    return int(value) if value is not None else None


def square_input(hp: Mapping[str, Any], config: Mapping[str, Any] | None, what: str) -> tuple[int, ...]:
    """``(in_chans, side, side)`` of a model that runs at its training size only: ``hp["img_size"]``, checked
    against the config's ``DATA.IMG_SIZE`` (``resolve_image_size``, not resizable)."""
    side = resolve_image_size(hp["img_size"], config, resizable=False, what=what)
    return (hp["in_chans"], side, side)


def resolve_image_size(trained: int, config: Mapping[str, Any] | None, *, resizable: bool, what: str) -> int:
    """The input side to build for: the override when there is one, else ``trained``.

    Raises:
        UnsupportedModelError: an override other than ``trained`` for a model whose weights fix its resolution.
    """
    wanted = image_size_override(config)
    if wanted is None or wanted == trained:
        return trained
    if not resizable:
        raise UnsupportedModelError(
            f"{what}: the weights fix the input at {trained}x{trained}; --image-size {wanted} would need "
            "resampled position encodings, which changes the model"
        )
    if wanted <= 0:
        raise UnsupportedModelError(f"--image-size must be positive, got {wanted}")
    return wanted


def config_model_name(config: Mapping[str, Any]) -> str | None:
    """``config['MODEL']['NAME']`` when the checkpoint's saved config has one (official yacs layout)."""
    model = config.get("MODEL") if isinstance(config, Mapping) else None
    name = model.get("NAME") if isinstance(model, Mapping) else None
    return name if isinstance(name, str) else None


def _wrapper_prefix(state_dict: StateDict, config: Mapping[str, Any]) -> str:
    """``'model.'`` when every key starts with that one name and the keys without it are a registered layout (a
    model kept as an attribute of a training wrapper: Lightning saves ``model.blocks.0...``), else ``''``."""
    heads = {key.split(".", 1)[0] for key in state_dict}
    if len(heads) != 1 or any("." not in key for key in state_dict):
        return ""
    prefix = f"{heads.pop()}."
    inner = {key[len(prefix) :]: value for key, value in state_dict.items()}
    return prefix if any(spec.matches(inner, config) for spec in _REGISTRY.values()) else ""


def detect_arch(state_dict: StateDict, config: Mapping[str, Any]) -> ArchSpec:
    """Pick the architecture of a checkpoint from its saved config name, else from its keys and shapes.

    A fixed-size preset whose widths and depths match but whose weights fix another resolution gives way to its
    family's any-size entry.

    Raises:
        UnsupportedModelError: no registered architecture matches, or several do (use ``--arch``).
    """
    _register_families()
    name = config_model_name(config)
    if name is not None and name in _ALIASES:
        spec = _REGISTRY[_ALIASES[name]]
        if fits(spec, state_dict, config):
            return spec
    candidates: list[ArchSpec] = []
    for spec in _REGISTRY.values():
        if spec.matches(state_dict, config):
            chosen = spec if fits(spec, state_dict, config) else (_any_size_entry(spec.family) or spec)
            if chosen.name not in {c.name for c in candidates}:
                candidates.append(chosen)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        wrapped = _wrapper_prefix(state_dict, config)
        if wrapped:
            raise UnsupportedModelError(
                f"could not detect the architecture from the checkpoint's keys: every key starts with {wrapped!r} "
                "(the model saved as an attribute of a wrapper, such as a LightningModule); without it they are "
                "a registered layout: re-save the weights without the prefix: torch.save({k.removeprefix("
                f"{wrapped!r}): v for k, v in state_dict.items()}}, 'weights.pth')"
            )
        raise UnsupportedModelError(
            "could not detect the architecture from the checkpoint's keys and shapes: no registered layout fits "
            f"(`slabconv list`; if it is one of them saved another way, pass --arch NAME); {OWN_MODEL}"
        )
    names = ", ".join(spec.name for spec in candidates)
    raise UnsupportedModelError(f"the checkpoint matches several architectures ({names}); pass --arch NAME")
