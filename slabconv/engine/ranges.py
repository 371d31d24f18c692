"""What each fold does to the weight ranges int8 quantization works with (``docs/verification.md``, "Weight
ranges and int8").

Per-output-channel int8 (onnxruntime's QDQ quantizer with ``per_channel=True``, TensorRT, OpenVINO's NNCF) rounds
row ``i`` of a weight (output channel ``i``: dim 0 of the stored weight; a transposed convolution's output
channels are columns of its ``(C_in, C_out / groups, ...)`` weight, ``LayerKind.channel_dim``) to multiples of its
step ``range_i / 127``, ``range_i = max_j |W_ij|``. A fold multiplies each stored element by a factor the fold program
knows, its *magnification* ``M_ij``: a forward fold (``W diag(s)``) scales the columns, a backward fold
(``diag(s) W``) the rows, a backward fold into an embedding the table's columns (``slabconv.fold``). ``M`` is the
fold of an all-ones weight with zero shift (``LayerKind.fold_values``, so every layer kind and every composition of
folds is measured by the algebra that makes the weights).

Element ``(i, j)`` of the fused weight multiplies a tensor ``1 / |M_ij|`` times the one the original element
multiplied (the norm's input instead of its output, or the reverse for a backward fold), so in the original's units
the fused row's int8 step for that element is ``step'_i / |M_ij|``. Per output channel:

- ``growth_i = range'_i / range_i``: how the range itself changes (what the fused weight shows);
- ``int8_step_growth_i = growth_i / min_j |M_ij|`` (over ``M_ij != 0``; a zeroed element is exact in int8): how
  much coarser the int8 grid becomes for the element the fold scaled least, in the original's units: that input
  channel keeps ``127 / int8_step_growth`` of its levels.

A uniform scale costs nothing (``growth = c``, ``min |M| = c``: 1); a backward fold scales whole rows, which a
per-channel step absorbs exactly (1); a forward fold whose scale spans ``spread = max |s| / min |s|`` costs at most
``spread``, reached when a row's largest weight sits in the column scaled most. ``STEP_GROWTH_LIMIT`` is the
largest growth that is not flagged. The per-tensor figures (one step for the whole weight) are reported beside.

Ranges are accumulated one block of rows at a time (``RangeTally``), the blocks the fold program folds in both
modes (``slabconv.engine.program``): in memory while the fused weights are evaluated, streamed while they are
written.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from slabconv.engine.planner import Decision
    from slabconv.engine.program import LayerRecipe

STEP_GROWTH_LIMIT = 16.0
"""The largest per-output-channel int8 step growth a fold may cause before it is flagged (and before a norm that
can fold either way folds backward instead, ``forward_spread``): 16 leaves the least-scaled input channel 8 of
int8's 127 levels per sign, 3 of its 7 bits. Measured (``benchmarks/int8_agreement.py``, docs/verification.md):
the digits fixture's folds reach 7.4 and cost no int8 agreement; the text fixture's attention norms of layers 1
and 2 reach 20 and 53, and its fused model agrees with the float original on fewer tokens at int8 than the original
does."""


def spread(scale: torch.Tensor) -> float:
    """``max |s| / min |s|`` over the nonzero entries of a norm's scale ``(C,)`` (1 for an all-zero scale): the most
    a forward fold of it can grow a row's int8 step (module docstring); a backward fold grows it by 1."""
    mags = scale.detach().abs().to(torch.float64)
    mags = mags[mags > 0]
    if not mags.numel():
        return 1.0
    return float(mags.max() / mags.min())


@dataclass
class LayerRange:
    """The ranges of one folded layer's weight, before and after its folds. ``to_dict`` is a ``ranges[]`` entry of
    ``report.json``.

    Attributes:
        layer: the layer (its weight's name without ``.weight``).
        weight: the stored weight.
        folds: ``{"norm": ..., "direction": "forward" | "backward"}`` per fold it receives, in plan order.
        channels: output channels (rows; a transposed convolution's: columns of each group's rows).
        tensor_original, tensor_fused: ``max |W|`` of the whole weight before and after.
        growth_min, growth_max: the smallest and largest ``range'_i / range_i`` over the output channels (rows whose
            original range is 0 are left out: int8 stores a zero row exactly).
        step_growth: ``max_i int8_step_growth_i`` (module docstring); ``worst_channel`` is that row.
        step_growth_tensor: the same for one int8 step over the whole tensor (per-tensor quantization).
        flagged: ``step_growth > STEP_GROWTH_LIMIT``.
    """

    layer: str
    weight: str
    folds: list[dict[str, str]]
    channels: int
    tensor_original: float
    tensor_fused: float
    growth_min: float
    growth_max: float
    step_growth: float
    worst_channel: int
    step_growth_tensor: float
    flagged: bool = field(init=False)

    def __post_init__(self) -> None:
        self.flagged = bool(self.step_growth > STEP_GROWTH_LIMIT)

    @property
    def norms(self) -> list[str]:
        return list(dict.fromkeys(f["norm"] for f in self.folds))

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "weight": self.weight,
            "folds": self.folds,
            "channels": self.channels,
            "per_tensor": {
                "original": self.tensor_original,
                "fused": self.tensor_fused,
                "growth": _ratio(self.tensor_fused, self.tensor_original),
                "int8_step_growth": self.step_growth_tensor,
            },
            "per_channel": {
                "growth_min": self.growth_min,
                "growth_max": self.growth_max,
                "int8_step_growth": self.step_growth,
                "worst_channel": self.worst_channel,
            },
            "flagged": self.flagged,
            "limit": STEP_GROWTH_LIMIT,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


class RangeTally:
    """The per-row ranges of one layer's weight, accumulated block by block as the fold program folds it.

    ``add`` takes a block's stored rows (as read) and the same rows folded in float64 (before rounding): the row
    ranges of both, and the smallest nonzero magnification of each row (``_least``). A streamed fold measures the
    two as it makes them (``measure``: the largest and smallest value of each row, written into tensors of every
    row, so that a block's sub-blocks may be measured from several threads at once; ``result`` combines them).
    """

    def __init__(self, recipe: LayerRecipe):
        self.recipe = recipe
        self.total: int | None = None  # the weight's rows, from the first block measured
        self.extremes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # "before" / "after": each row's max, min
        self.least: torch.Tensor | None = None  # (total,) float64: ``_least`` of each row measured
        self.columns: torch.Tensor | None = None  # per group: the forward folds' least column magnification
        self.rows_least: torch.Tensor | None = None  # per row of a pure-scale layer: ``_least`` of every row
        self.by_column = recipe.kind.channel_dim == 1  # output channels in the columns (a transposed convolution)
        self.column_stats: dict[str, torch.Tensor] = {}  # by_column: "before" / "after" max |x|, "least", per channel
        self._lock = threading.Lock()  # by_column: sub-blocks measured from several threads update the same channels

    def add(self, original: torch.Tensor, fused: torch.Tensor, first: int, total: int) -> None:
        """Rows ``first:first + len(original)`` of the layer's ``total``: ``original`` as stored, ``fused`` the
        float64 fold of them (same shape)."""
        self.measure("before", original, first, total)
        self.measure("after", fused, first, total)

    def prepare(self, shape: torch.Size | list[int], total: int) -> None:
        """Make what every block of the layer shares before blocks are measured from several threads at once
        (``engine.program.Scratch.spread``): the rows' tensors and a pure-scale layer's ``_least``; ``shape``: a
        block's."""
        if self.total is not None:
            return
        if self.recipe.kind.pure_scale:
            self.least = self._least(torch.Size(shape), 0, total, total)  # every row's, made once
        else:
            self.least = torch.empty(total, dtype=torch.float64)
        if self.by_column:
            size = self.recipe.kind.bias_size(list(shape), self.recipe.groups)
            zeros = torch.zeros(size, dtype=torch.float64)
            self.column_stats = {"before": zeros, "after": zeros.clone(), "least": torch.full_like(zeros, math.inf)}
        self.total = total

    def measure(self, which: str, values: torch.Tensor, first: int, total: int) -> None:
        """Record the largest and smallest value of each of the rows ``first:first + len(values)`` (of the layer's
        ``total``): ``which`` is ``"before"`` (the stored rows, in any dtype that holds them exactly) or
        ``"after"`` (the float64 fold of the same rows, which also records each row's ``_least``). Each row is
        written once, into its own place: sub-blocks may be measured from several threads at once once
        ``prepare`` has run (in one thread)."""
        if self.total is None:
            self.prepare(values.shape, total)
        rows = int(values.shape[0]) if values.dim() else 1
        flat = values.detach() if values.dim() == 2 else values.detach().reshape(rows, -1)
        extremes = self.extremes.get(which)
        if extremes is None:  # both threads may make it: the one stored first is kept (dict.setdefault is atomic)
            made = torch.empty((2, total), dtype=flat.dtype)
            extremes = self.extremes.setdefault(which, (made[0], made[1]))
        if extremes[0].dtype != flat.dtype:
            raise ValueError(f"ranges {which}: a block in {flat.dtype} after one in {extremes[0].dtype}")
        torch.amax(flat, dim=1, out=extremes[0].narrow(0, first, rows))
        torch.amin(flat, dim=1, out=extremes[1].narrow(0, first, rows))
        if self.by_column:
            self._into_columns(which, values.detach().abs().to(torch.float64), first, total, largest=True)
            if which == "after":
                self._into_columns("least", self._magnification(values.shape, first, rows, total), first, total)
        elif which == "after" and self.least is not None and not self.recipe.kind.pure_scale:
            self.least.narrow(0, first, rows).copy_(self._least(values.shape, first, rows, total))

    def largest(self, which: str, first: int, stop: int) -> torch.Tensor:
        """``max |x|`` of each of the rows ``first:stop`` measured as ``which`` (float64; NaN where a row holds
        one): the larger of the row's maximum and its negated minimum."""
        high, low = (t[first:stop] for t in self.extremes[which])
        return torch.maximum(high, low.neg()).to(torch.float64)

    def _least(self, shape: torch.Size, first: int, rows: int, total: int) -> torch.Tensor:
        """The smallest nonzero magnification of each of the rows ``first:first + rows`` (``inf``: none).

        A layer whose folds only scale (``LayerKind.pure_scale``): the forward folds' column magnification, the
        same in every row of a group, measured once per group on a one-row all-ones probe (tiny: a stream of
        multi-GB weights pays nothing per block), times each row's backward factors. Otherwise (an embedding
        table, which a backward fold also shifts; a transposed convolution, whose backward fold scales the columns
        of each group's rows) the folds run on an all-ones block with zero shifts."""
        recipe = self.recipe
        if not recipe.kind.pure_scale:
            return self._magnification(shape, first, rows, total).reshape(rows, -1).amin(dim=1)
        if self.rows_least is None or len(self.rows_least) != total:  # every row's at once: a slice per block
            per = max(total // recipe.groups, 1)
            per_group = [self._group_least(shape, g * per, total) for g in range(recipe.groups)]
            self.columns = torch.tensor(per_group, dtype=torch.float64)
            index = torch.arange(total) // per
            least = self.columns[index.clamp_max(recipe.groups - 1)].to(torch.float64)
            for f in recipe.folds:
                if not f.forward:
                    factor = f.scale.detach().to(torch.float64)[:total].abs()
                    least = torch.where(factor > 0, least * factor, math.inf)  # a zeroed row is exact in int8
            self.rows_least = least
        return self.rows_least[first : first + rows]

    def _magnification(self, shape: torch.Size, first: int, rows: int, total: int) -> torch.Tensor:
        """``|M|`` of the rows ``first:first + rows`` (float64, their shape; ``inf`` where 0): the folds run on an
        all-ones block with zero shifts."""
        recipe = self.recipe
        probe = torch.ones((rows, *shape[1:]), dtype=torch.float64)
        for f in recipe.folds:
            probe, _ = recipe.kind.fold_values(
                f.forward, probe, None, f.scale, torch.zeros_like(f.shift), recipe.groups, first, total, True
            )
        mags = probe.abs_()
        return torch.where(mags > 0, mags, math.inf)

    def _into_columns(self, name: str, values: torch.Tensor, first: int, total: int, largest: bool = False) -> None:
        """Take ``values`` (float64, the shape of the rows ``first:first + len(values)`` of a ``(C_in, C_out /
        groups, ...)`` weight with ``total`` rows) into the per-output-channel statistic ``name``: its largest
        (``largest``) or smallest value over the rows of each group and the kernel, channel ``o = g * (C_out /
        groups) + j`` being column ``j`` of group ``g``'s rows (``by_column``). Sub-blocks may come from several
        threads at once."""
        rows, per_group = int(values.shape[0]), int(values.shape[1])
        flat = values.reshape(rows, per_group, -1)
        reduced = flat.amax(dim=2) if largest else flat.amin(dim=2)
        group = torch.arange(first, first + rows) // max(total // self.recipe.groups, 1)
        into = self.column_stats[name]
        with self._lock:
            for g in group.unique().tolist():
                part = reduced[group == g]
                channels = into[g * per_group : (g + 1) * per_group]
                if largest:
                    torch.maximum(channels, part.amax(dim=0), out=channels)
                else:
                    torch.minimum(channels, part.amin(dim=0), out=channels)

    def _group_least(self, shape: torch.Size, row: int, total: int) -> float:
        """The smallest nonzero magnification the forward folds give the columns of ``row`` (inf: none)."""
        recipe = self.recipe
        probe = torch.ones((1, *shape[1:]), dtype=torch.float64)
        for f in recipe.folds:
            if f.forward:
                probe, _ = recipe.kind.fold_values(
                    True, probe, None, f.scale, torch.zeros_like(f.shift), recipe.groups, row, total, True
                )
        mags = probe.abs_()
        mags = mags[mags > 0]
        return float(mags.min()) if mags.numel() else math.inf

    def result(self) -> LayerRange:
        """The layer's ``LayerRange`` over every row measured (every row must have been).

        Raises:
            RuntimeError: nothing was measured.
        """
        if self.total is None or self.least is None or set(self.extremes) != {"before", "after"}:
            raise RuntimeError(f"ranges of {self.recipe.weight}: no block was measured")
        before, after = self.largest("before", 0, self.total), self.largest("after", 0, self.total)
        least = self.least
        if self.by_column:  # per output channel, the columns of each group's rows
            before, after, least = (self.column_stats[k] for k in ("before", "after", "least"))
        live = before > 0  # a zero row is exact in int8 whatever its fold
        least = torch.where(torch.isfinite(least), least, torch.ones_like(least))  # an all-zero fold: nothing scaled
        growth = torch.where(live, after / before.clamp_min(1e-300), torch.ones_like(after))
        step = torch.where(live, growth / least, torch.ones_like(growth))
        worst = int(step.argmax()) if step.numel() else 0
        t_before, t_after = float(before.max()), float(after.max())
        t_least = float(least[live].min()) if bool(live.any()) else 1.0
        recipe = self.recipe
        return LayerRange(
            layer=recipe.weight.removesuffix(".weight"),
            weight=recipe.weight,
            folds=[{"norm": f.norm, "direction": "forward" if f.forward else "backward"} for f in recipe.folds],
            channels=int(before.numel()),
            tensor_original=t_before,
            tensor_fused=t_after,
            growth_min=float(growth[live].min()) if bool(live.any()) else 1.0,
            growth_max=float(growth[live].max()) if bool(live.any()) else 1.0,
            step_growth=float(step[worst]) if step.numel() else 1.0,
            worst_channel=worst,
            step_growth_tensor=_ratio(t_after, t_before) / t_least if t_before > 0 else 1.0,
        )


def flag_warnings(decisions: list[Decision], ranges: list[LayerRange]) -> None:
    """Add to the decision of each norm folded into a flagged layer one warning naming those layers and the worst
    growth (``STEP_GROWTH_LIMIT``)."""
    flagged: dict[str, list[LayerRange]] = {}
    for r in ranges:
        if r.flagged:
            for norm in r.norms:
                flagged.setdefault(norm, []).append(r)
    for d in decisions:
        layers = flagged.get(d.norm)
        if not layers:
            continue
        worst = max(layers, key=lambda r: r.step_growth)
        names = ", ".join(r.layer for r in layers)
        line = (
            f"int8: folding it into {names} makes per-channel int8 steps up to {worst.step_growth:.3g}x coarser for "
            f"the input scaled least ({worst.layer}, output channel {worst.worst_channel}; flagged above "
            f"{STEP_GROWTH_LIMIT:g}x): that input keeps about {127 / worst.step_growth:.3g} of int8's 127 levels "
            "(docs/verification.md)"
        )
        if line not in d.warnings:
            d.warnings.append(line)
