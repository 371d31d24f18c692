"""Where a norm's channels sit as a walk passes an op (``Chan``), and what a rule says the op does with them:
pass them on (``Pass``), absorb the affine (``Absorb``) or stop the walk with a reason (``Block``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.reasons import op_name  # noqa: F401 (the rules' face: rules.py re-exports it)

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

    ``segments``: where the norm's channels fill only part of the axis, the index ranges ``(start, length, phase)``
    they fill, index ``start + j`` holding channel ``((phase + j) // inner) % channels``; the other indices carry
    the identity affine (scale 1, shift 0). A concatenation along the channel axis with tensors the norm did not
    produce (``cat([up(norm(x)), skip], 1)``) makes them, and so does a slice or split of the channel axis
    (``y[:, 2:5]`` holds channels 2 to 4: ``((0, 3, 2),)``). Empty: the pattern fills the whole axis, a whole
    number of ``channels * inner`` blocks.
    """

    axis: int
    channels: int
    inner: int = 1
    segments: tuple[tuple[int, int, int], ...] = ()

    def at(self, axis: int) -> Chan:
        return replace(self, axis=axis)

    @property
    def plain(self) -> bool:
        return self.inner == 1 and not self.segments

    def lay_out(self, values: torch.Tensor, size: int, fill: float) -> torch.Tensor:
        """Per-channel ``values`` (``(C,)``) along an axis of ``size`` indices laid out as this layout says:
        tiled over the whole axis, or over each segment from its phase with ``fill`` elsewhere (1 for a scale, 0
        for a shift).

        Raises:
            ValueError: an axis without segments that is not a whole number of ``channels * inner`` blocks.
        """
        if not self.segments:
            return fold.tile_channels(values, self.inner, size)
        out = torch.full((size,), fill, dtype=values.dtype, device=values.device)
        for start, length, phase in self.segments:
            index = torch.arange(phase, phase + length, device=values.device)
            out[start : start + length] = values[(index // self.inner) % self.channels]
        return out

    def spans(self, size: int) -> tuple[tuple[int, int, int], ...]:
        """The segments of an axis of ``size`` indices (the whole axis from phase 0 when there are none)."""
        return self.segments or ((0, size, 0),)

    def with_segments(self, segments: list[tuple[int, int, int]], size: int) -> Chan:
        """This layout with ``segments`` on an axis of ``size`` indices: adjacent ones whose phases continue are
        merged, and one that fills the whole axis with whole channel blocks from phase 0 is no segment at all."""
        period = self.channels * self.inner
        assert any(length for _, length, _ in segments), "a layout with segments holds some of the norm's channels"
        merged: list[tuple[int, int, int]] = []
        for start, length, phase in segments:
            if not length:
                continue
            if merged:
                s0, l0, p0 = merged[-1]
                if s0 + l0 == start and (p0 + l0 - phase) % period == 0:
                    merged[-1] = (s0, l0 + length, p0)
                    continue
            merged.append((start, length, phase % period))
        if len(merged) == 1 and merged[0][:2] == (0, size) and merged[0][2] == 0 and size % period == 0:
            merged = []
        return replace(self, segments=tuple(merged))

    def part(self, start: int, length: int, size: int) -> Chan | None:
        """The layout of indices ``[start, start + length)`` of this axis (of ``size`` indices): a slice or a
        split piece of it. None when no index of the part holds a channel of the norm."""
        return self.pick(range(start, start + length), size)

    def pick(self, indices: Sequence[int], size: int) -> Chan | None:
        """The layout of an axis whose index ``j`` is index ``indices[j]`` of this axis (of ``size`` indices): a
        part, a strided slice (``y[:, 1::2]``: ``range(1, size, 2)``). None when no index picked holds a channel
        of the norm."""
        out = [
            (j, 1, p0 + i - s0) for j, i in enumerate(indices) for s0, l0, p0 in self.spans(size) if s0 <= i < s0 + l0
        ]
        return self.with_segments(out, len(indices)) if out else None


@dataclass(frozen=True)
class Pass:
    """The op commutes with the affine: the channels are now at ``chan``; the shift is multiplied by ``mult``;
    with ``needs_positive_scale`` it commutes only when every channel's scale is > 0 (max / min); with
    ``needs_zero_shift`` only when every shift is 0 (it pads or samples with zeros: ``s * 0`` is 0, ``s * 0 + t`` is
    not), else it blocks with ``zero-padding-after-norm``.

    ``items``: for an op of several outputs whose outputs hold different parts of the channels (a split of the
    channel axis), the state of each output (``getitem`` ``i`` reads ``items[i]``; None: that output holds none
    of the norm's channels); ``chan`` is then the input's. None: every output has the state ``chan``."""

    chan: Chan
    mult: float = 1.0
    needs_positive_scale: bool = False
    needs_zero_shift: bool = False
    items: tuple[Chan | None, ...] | None = None

    def item(self, index: int) -> Chan | None:
        """The state of output ``index`` of an op of several outputs."""
        return self.chan if self.items is None else self.items[index]


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
