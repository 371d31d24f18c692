"""Where a norm's channels sit as a walk passes an op (``Chan``), and what a rule says the op does with them:
pass them on (``Pass``), absorb the affine (``Absorb``) or stop the walk with a reason (``Block``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from slabconv import fold
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

    ``segments``: after a concatenation along the channel axis with tensors the norm did not produce
    (``cat([up(norm(x)), skip], 1)``), the norm's channels fill only the index ranges ``(start, length)`` of the
    axis (each a whole number of ``channels * inner`` blocks, the pattern starting again at each ``start``); the
    other indices carry the identity affine (scale 1, shift 0). Empty: the pattern fills the whole axis.
    """

    axis: int
    channels: int
    inner: int = 1
    segments: tuple[tuple[int, int], ...] = ()

    def at(self, axis: int) -> Chan:
        return replace(self, axis=axis)

    @property
    def plain(self) -> bool:
        return self.inner == 1 and not self.segments

    def lay_out(self, values: torch.Tensor, size: int, fill: float) -> torch.Tensor:
        """Per-channel ``values`` (``(C,)``) along an axis of ``size`` indices laid out as this layout says:
        tiled over the whole axis, or over each segment with ``fill`` elsewhere (1 for a scale, 0 for a shift).

        Raises:
            ValueError: an axis or segment that is not a whole number of ``channels * inner`` blocks.
        """
        if not self.segments:
            return fold.tile_channels(values, self.inner, size)
        out = torch.full((size,), fill, dtype=values.dtype, device=values.device)
        for start, length in self.segments:
            out[start : start + length] = fold.tile_channels(values, self.inner, length)
        return out


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
