"""Where a norm's channels sit as a walk passes an op (``Chan``), and what a rule says the op does with them:
pass them on (``Pass``), absorb the affine (``Absorb``) or stop the walk with a reason (``Block``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from slabconv.engine import reasons

if TYPE_CHECKING:
    from slabconv.engine.layers import LayerKind

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------- channel state


@dataclass(frozen=True)
class Chan:
    """Where a norm's ``channels`` sit on a tensor: along ``axis``, index ``i`` of that axis holds channel
    ``(i // inner) % channels``.

    A plain layout is ``inner == 1`` with the axis of size ``channels``. A reshape that merges the channel axis
    with neighbouring axes keeps the fold exact when each channel still lives on one axis (``flatten(-2)`` of
    ``(B, C, P)`` gives ``inner = P``; of ``(B, P, C)`` the axis has size ``P * C``, ``inner = 1``): the scale
    and shift are then tiled along that axis (``slabconv.fold.tile_channels``).
    """

    axis: int
    channels: int
    inner: int = 1

    def at(self, axis: int) -> Chan:
        return Chan(axis, self.channels, self.inner)

    @property
    def plain(self) -> bool:
        return self.inner == 1


@dataclass(frozen=True)
class Pass:
    """The op commutes with the affine: the channels are now at ``chan``; the shift is multiplied by ``mult``;
    with ``needs_positive_scale`` it commutes only when every channel's scale is > 0 (max / min)."""

    chan: Chan
    mult: float = 1.0
    needs_positive_scale: bool = False


@dataclass(frozen=True)
class Absorb:
    """The op is a layer (``LayerKind``) that takes the affine into its weights."""

    layer: LayerKind


@dataclass(frozen=True)
class Block:
    """The op breaks the fold; ``reason`` is one of ``slabconv.engine.reasons``."""

    reason: str


Outcome = Pass | Absorb | Block
Step = Callable[[fx.Node, fx.Node, Chan], Outcome]


def unsupported(user: fx.Node) -> Block:
    return Block(reasons.unsupported(user))


def op_name(node: fx.Node) -> str:
    """``aten.<name>`` of an fx node's op."""
    return reasons.unsupported(node).removeprefix(reasons.UNSUPPORTED_PREFIX)


def _ops(*names: str) -> tuple[Any, ...]:
    """ATen overloads by ``packet.overload`` name (``default`` when none is given); names this torch lacks are
    left out."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            out.append(getattr(op, overload or "default"))
    return tuple(out)
