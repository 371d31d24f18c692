"""The architecture registry: ``@register_arch`` names, aliases, and detection from a checkpoint.

An ``ArchSpec`` knows how to build a model from a name and a state_dict (the state_dict settles what the name
leaves open: the norm layout, the class count), the model's input shape, and how to build the same network
with every norm replaced by identity (the norm-free bound of DESIGN.md section 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slabconv.errors import UnsupportedModelError

StateDict = Mapping[str, torch.Tensor]


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


_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    """Add ``spec`` to the registry under its name and aliases. Raises ``ValueError`` on a duplicate name."""
    for key in (spec.name, *spec.aliases):
        if key in _ALIASES:
            raise ValueError(f"architecture name {key!r} is registered twice")
        _ALIASES[key] = spec.name
    _REGISTRY[spec.name] = spec
    return spec


def list_archs() -> list[ArchSpec]:
    """Every registered architecture, in registration order."""
    return list(_REGISTRY.values())


def get_arch(name: str) -> ArchSpec:
    """The spec registered under ``name`` or one of its aliases.

    Raises:
        UnsupportedModelError: unknown name (the message lists the known names).
    """
    key = _ALIASES.get(name)
    if key is None:
        known = ", ".join(sorted(_REGISTRY))
        raise UnsupportedModelError(f"unknown architecture {name!r}; known: {known} (see `slabconv list`)")
    return _REGISTRY[key]


def config_model_name(config: Mapping[str, Any]) -> str | None:
    """``config['MODEL']['NAME']`` when the checkpoint's saved config has one (official yacs layout)."""
    model = config.get("MODEL") if isinstance(config, Mapping) else None
    name = model.get("NAME") if isinstance(model, Mapping) else None
    return name if isinstance(name, str) else None


def detect_arch(state_dict: StateDict, config: Mapping[str, Any]) -> ArchSpec:
    """Pick the architecture of a checkpoint from its saved config name, else from its keys and shapes.

    Raises:
        UnsupportedModelError: no registered architecture matches, or several do (use ``--arch``).
    """
    name = config_model_name(config)
    if name is not None and name in _ALIASES:
        spec = _REGISTRY[_ALIASES[name]]
        if spec.matches(state_dict, config):
            return spec
    candidates = [spec for spec in _REGISTRY.values() if spec.matches(state_dict, config)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise UnsupportedModelError(
            "could not detect the architecture from the checkpoint's keys and shapes; "
            "pass --arch NAME (see `slabconv list`)"
        )
    names = ", ".join(spec.name for spec in candidates)
    raise UnsupportedModelError(f"the checkpoint matches several architectures ({names}); pass --arch NAME")
