"""One decision per norm, with the folds that carry it out, as records. Pure: the graph is not changed.

In: the export graph and its norms (``slabconv.engine.norms.find_norms``). Out: one ``NormPlan`` per norm, in graph
order, each with its ``Decision`` (what the report says) and what the rewriter must do: the folds into layers
(``LayerFold``), biases to create, the blocked edges that keep a per-channel affine, whether the norm's ops go.

For each norm, in order of preference:

1. ``folded-forward``: every path from the norm's output ends at a layer that can absorb the affine (Linear /
   unpadded conv, ``slabconv.engine.layers.LAYERS``): scale their input columns, shift their bias
   (``W diag(s)``, ``b + W t``), drop the norm. Unless the norm's scale spans more than int8 can take in a
   column scale (``ranges.spread(s) > ranges.STEP_GROWTH_LIMIT``) and a backward fold is possible too: then 2.
2. ``folded-backward``: some path is blocked (or the scale's spread says so, above), but the norm's input is
   produced by a Linear/conv that nothing else reads: scale its output rows (``diag(s) W``, ``s b + t``), drop the
   norm. Exact on every path at once.
3. ``kept-affine``: neither is possible. Layers that can absorb the affine still get it; on each blocked path one
   per-channel ``x * scale + shift`` stays (no transposes; ``slabconv.engine.onnx_apply`` writes it), with the
   reason.
4. ``kept``: the norm is not a fixed affine (batch statistics, train mode), or its affine does not fit the model's
   dtype; its ops are left as they are.

Norms are planned in graph order, each on the graph as the earlier plans will leave it: ``_Weights`` holds the
folds planned so far into each layer (a layer may absorb one norm forward and another backward) and the names of
biases to be created; ``VirtualGraph`` makes a folded norm's output stand for its input (two norms in a row).

A plan holds decisions and fold records (``LayerFold``), never folded values: those come only from the fold
program (``slabconv.engine.program``), which composes every fold a tensor receives in float64 and rounds once. The
planner asks the program too, for the one value question it has: whether a layer's weight and bias, with every
fold so far and the next one, still fit their dtypes (``_Weights.fits``; a streamed plan's stand-ins wait for the
program's own check as it writes).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.affine_values import Constants
from slabconv.engine.capture import module_path, shape_of, stored, written_in_place, written_tensors
from slabconv.engine.flow import Backward, BlockedEdge, ConsumerUse, VirtualGraph, find_producers, follow
from slabconv.engine.layers import LayerKind, layer_name, separate_bias
from slabconv.engine.norm_affine import MARK, is_norm_affine, unit_weight
from slabconv.engine.norms import NormSite, find_norms
from slabconv.engine.program import Folded, LayerFold, TensorStore, layer_recipe
from slabconv.engine.ranges import STEP_GROWTH_LIMIT, spread
from slabconv.engine.rules import Chan, op_name
from slabconv.errors import InputError, UnsupportedModelError
from slabconv.tolerances import dtype_name, tol_dtype

FOLDED_FORWARD = "folded-forward"
FOLDED_BACKWARD = "folded-backward"
KEPT_AFFINE = "kept-affine"
KEPT = "kept"


@dataclass
class Decision:
    """What happens to one norm. ``to_dict`` is the ``folds[]`` entry of ``report.json``.

    Attributes:
        norm: module path of the norm (``blocks.0.norm1``).
        kind: ``BatchNorm``, ``RepBN``, ``FrozenBatchNorm``, ``Affine``, ``LayerScale``, ``LayerNorm-affine``,
            ``RMSNorm-affine`` or ``GroupNorm-affine``.
        action: ``folded-forward``, ``folded-backward``, ``kept-affine`` or ``kept``.
        into: the layers that absorbed the affine (module paths).
        reason: why an affine (or the norm) stays, None when folded away.
        kept_on: the ops in front of which an affine stays (``kept-affine``).
        paths: every blocked path as ``{"before": <module>:<op>, "reason": <reason>}``, in graph order (the
            ``reason`` field is the first of these).
        warnings: facts the user should know (unfinished progressive schedule, a fold flagged for int8, ...).
        direction: why this direction, where the norm's scale made it a question (``_choose_direction``): a
            forward fold could coarsen its consumers' int8 step more than ``ranges.STEP_GROWTH_LIMIT``; None
            otherwise.
        no_backward: why no backward fold was possible, when one was tried because a path is blocked (plain text;
            ``backward`` in ``to_dict``): with ``reason`` it names both blockers, e.g. a residual that reads the
            norm and a producer whose weight is computed.
    """

    norm: str
    kind: str
    action: str
    into: list[str] = field(default_factory=list)
    reason: str | None = None
    kept_on: list[str] = field(default_factory=list)
    paths: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    direction: str | None = None
    no_backward: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "norm": self.norm,
            "kind": self.kind,
            "action": self.action,
            "into": self.into,
            "reason": self.reason,
            "kept_on": self.kept_on,
            "paths": self.paths,
            "warnings": self.warnings,
            "backward": self.no_backward if self.action in (KEPT_AFFINE, KEPT) else None,
            "direction": self.direction,
        }


@dataclass(frozen=True)
class NewBias:
    """Give ``layer`` (of kind ``kind``, without a bias) a bias stored at ``target`` in the dtype of its weight;
    its value is the fold program's (``slabconv.engine.program``)."""

    layer: fx.Node
    kind: LayerKind
    target: str


@dataclass
class NormPlan:
    """One norm's decision and the rewrite that carries it out.

    Attributes:
        site: the norm.
        decision: what the report says.
        new_biases: the biases the folds create.
        folds: each fold into a layer, as data (the fold program's input: ``slabconv.engine.program``).
        kept: the blocked edges that get the per-channel affine (``scale``, ``shift`` float64 ``(C,)``).
        remove: the norm's ops go (every action but ``kept``).
        unit: the affine of a LayerNorm / RMSNorm / GroupNorm op folded away: ``(norm op, position of its weight,
            the stored weight)``; the op keeps that weight as ones (``slabconv.engine.norm_affine``).
        folded: the values of the layers it folds into as the overflow checks made them (``program.Folded``).
    """

    site: NormSite
    decision: Decision
    new_biases: list[NewBias] = field(default_factory=list)
    folds: list[LayerFold] = field(default_factory=list)
    kept: list[BlockedEdge] = field(default_factory=list)
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    remove: bool = False
    unit: tuple[fx.Node, int, fx.Node] | None = None
    folded: dict[str, Folded] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- warnings, checks


def op_site(node: fx.Node) -> str:
    """``<module path>:<op>`` for a blocking op, e.g. ``blocks.0:aten.add``; ``<output>`` for the output."""
    if node.op == "output":
        return "<output>"
    paths = module_path(node)
    return f"{paths[-1] if paths else '<model>'}:{op_name(node)}"


def schedule_warnings(warm: int, it: int, total: int) -> list[str]:
    """The warning for a ``LinearNorm`` whose counters (``warm``, ``iter``, ``total_step``) had not reached pure
    RepBN, with the weight the LayerNorm/RMSNorm branch still had; empty when the schedule finished."""
    if warm <= 0 and it <= 0:
        return []
    lam = 1.0 if warm > 0 else it / max(total, 1)
    return [
        f"progressive schedule unfinished: warm={warm}, iter={it}, total_step={total}; the LayerNorm/RMSNorm "
        f"branch still had weight {lam:.4g} in training, eval uses the RepBN branch alone (converted as eval)"
    ]


def _progressive_warnings(gm: fx.GraphModule, site: NormSite) -> list[str]:
    """A warning when the norm's ops run inside a ``LinearNorm`` whose schedule had not reached pure RepBN: the
    innermost module around the norm's output that holds the counters (each call of a module called twice warns;
    the second call's name, ``<path>_1``, is no module)."""
    for path in reversed(module_path(site.output)):
        owner: Any = gm
        for part in path.split("."):
            owner = getattr(owner, part, None)
        counters = [getattr(owner, k, None) for k in ("warm", "iter", "total_step")]
        if all(isinstance(v, torch.Tensor) for v in counters):
            return schedule_warnings(*(int(v) for v in counters))  # type: ignore[arg-type]
    return []


_HALF = (torch.float16, torch.bfloat16)


def _precision_warnings(site: NormSite, scale: torch.Tensor, shift: torch.Tensor) -> list[str]:
    """A warning when a forward fold / kept affine of a BN in float16 or bfloat16 amplifies rounding past the
    tolerance.

    The original BN computes ``s (x - mu) + E[y]`` (in float32 inside); the fold computes ``s x`` in the model's
    dtype and adds ``t`` (in the consumer's weights or the kept affine). Rounding then scales with ``|s| rms(x)``
    instead of ``rms(y)``: by ``kappa = |s| sqrt(m^2 + v) / sqrt((s m + t)^2 + s^2 v)`` per channel, large when a
    channel's mean ``m`` at the norm's input is many standard deviations ``sqrt(v)`` from 0. ``m`` and ``v`` are
    the BN's running statistics, taken back through the affine ``(s1, t1)`` composed before it
    (``NormSite.before``: ``m = (mu - t1) / s1``, ``v = var / s1^2``; a channel with ``s1 = 0`` reaches no output).
    The estimated relative error ``kappa * eps/2`` is compared with the float16 / bfloat16 tolerance of
    ``slabconv.tolerances``; the fold stays exact in exact arithmetic, so this is a warning with the numbers
    (verification decides), not a refusal. Norms without a BN op compute ``x * s + t`` themselves: no warning.
    """
    dtype = site.input.meta["val"].dtype
    if dtype not in _HALF or site.bn is None:
        return []
    mean = site.params["running_mean"].detach().double()  # type: ignore[union-attr]
    var = site.params["running_var"].detach().double().clamp_min(0)  # type: ignore[union-attr]
    if site.before is not None:
        s1, t1 = site.before
        live = s1 != 0
        mean = torch.where(live, (mean - t1) / torch.where(live, s1, 1.0), 0.0)
        var = torch.where(live, var / torch.where(live, s1, 1.0) ** 2, 0.0)
    rms_sx = scale.abs() * torch.sqrt(mean**2 + var)
    rms_y = torch.sqrt((scale * mean + shift) ** 2 + scale**2 * var).clamp_min(torch.finfo(torch.float64).tiny)
    kappa = rms_sx / rms_y
    worst = int(kappa.argmax())
    estimate = float(kappa[worst]) * torch.finfo(dtype).eps / 2
    name, tolerance = dtype_name(dtype), tol_dtype(dtype)
    if estimate <= tolerance:
        return []
    ratio = float(mean[worst].abs() / var[worst].sqrt().clamp_min(1e-30))
    return [
        f"{name} precision: channel {worst} of the norm's input has |mean| / std = {ratio:.3g} (from the running "
        f"statistics); computing s*x + t in {name} amplifies rounding {float(kappa[worst]):.3g}x (estimated "
        f"relative error {estimate:.2g} > tolerance {tolerance:g}); verification decides"
    ]


def _check_stats(site: NormSite) -> None:
    """Raises ``InputError`` for NaN / Inf parameters or ``running_var + eps <= 0`` (a damaged checkpoint)."""
    for key, t in site.params.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            raise InputError(f"norm {site.name}: {key} holds NaN or Inf; the checkpoint is damaged")
    var = site.params.get("running_var")
    if var is not None and not math.isfinite(site.eps):
        raise InputError(f"norm {site.name}: eps is {site.eps}; the checkpoint is damaged")
    if var is not None and bool((var.double() + site.eps <= 0).any()):
        raise InputError(f"norm {site.name}: running_var + eps <= 0 for some channel; the checkpoint is damaged")


# --------------------------------------------------------------------------------------------- pending weights


class _Weights:
    """Stored tensors as the plans so far leave them: the folds planned into each layer, biases to be created,
    names taken."""

    def __init__(self, gm: fx.GraphModule, unknown: Collection[str] = (), owned: Collection[fx.Node] = ()):
        self.gm, self.unknown, self.owned = gm, frozenset(unknown), frozenset(owned)
        self.folds: dict[str, list[LayerFold]] = {}  # weight target -> the folds planned into it so far
        self.created: dict[fx.Node, str] = {}  # layer -> the target of the bias a plan creates for it
        self.taken = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.taken |= set(dict(gm.named_parameters(remove_duplicate=False))) | set(dict(gm.named_buffers()))
        self.written = written_tensors(gm)  # what the graph updates in place as it runs
        self.folded: dict[str, Folded] = {}  # weight target -> its values as the last ``fits`` made them

    def bias_node(self, layer: fx.Node, kind: LayerKind) -> Any:
        """The layer's bias argument (None, a ``get_attr``, or something else), or for a bias-free layer the
        ``get_attr`` of its separate bias (``separate_bias``) unless that ``add`` is a norm's own op (then the
        norm's affine holds it)."""
        node = kind.bias(layer)
        if node is None and layer not in self.created:
            sep = separate_bias(layer, kind)
            if sep is not None and sep.add not in self.owned:
                return sep.bias
        return node

    def bias(self, layer: fx.Node, kind: LayerKind) -> str | None:
        """The target of a layer's bias (stored, separate or created by an earlier plan), None when it has none."""
        node = self.bias_node(layer, kind)
        return str(node.target) if isinstance(node, fx.Node) else self.created.get(layer)

    def private(self, param: Any) -> bool:
        """True when one layer alone reads this weight or bias (a tied tensor must not be rescaled for one reader).
        A missing bias (None) is private: the fold creates a new one."""
        if not isinstance(param, fx.Node):
            return True
        same_target = [n for n in self.gm.graph.nodes if n.op == "get_attr" and n.target == param.target]
        return len(same_target) == 1 and len(param.users) == 1

    def fits(self, f: _Fold) -> bool:
        """True when the layer's weight and bias, with every fold planned into it so far and ``f``, round to finite
        values in their dtypes: the fold program's values (``LayerRecipe.folded``, kept in ``folded``). A streamed
        plan's stand-ins (``unknown``) are checked when the program writes them."""
        folds = [*self.folds.get(f.record.weight, []), f.record]
        created = self.created.get(f.record.layer) or next((nb.target for nb in f.new_biases), None)
        recipe = layer_recipe(self.gm, folds, created)
        read = [k for k in (recipe.weight, recipe.bias) if k is not None]
        if set(read) & self.unknown:
            return True
        try:
            self.folded[recipe.weight] = recipe.folded(TensorStore({k: stored(self.gm, k) for k in read}))
        except UnsupportedModelError:
            return False
        return True

    def commit(self, p: NormPlan) -> NormPlan:
        """Record a plan's folds; name the biases it creates (``<layer>.bias``, or with a suffix when taken)."""
        named = []
        for nb in p.new_biases:
            stem, i = f"{nb.target}", 1
            target = stem
            while target in self.taken:
                target, i = f"{stem}_{i}", i + 1
            self.taken.add(target)
            self.created[nb.layer] = target
            named.append(replace(nb, target=target))
        for f in p.folds:
            self.folds.setdefault(f.weight, []).append(f)
        made = {f.weight: self.folded[f.weight] for f in p.folds if f.weight in self.folded}
        return replace(p, new_biases=named, folded=made)


@dataclass
class _Fold:
    """One fold into a layer, and the bias it creates there (none, or one)."""

    new_biases: list[NewBias]
    record: LayerFold


def _fold(
    weights: _Weights,
    layer: fx.Node,
    kind: LayerKind,
    forward: bool,
    s: torch.Tensor,
    t: torch.Tensor,
    shifts: bool = True,
    norm: str = "",
) -> _Fold:
    """The fold of ``(s, t)`` into ``layer``, forward or backward (``slabconv.fold``), as a record, with the bias it
    creates when the layer has none: ``<layer>.bias``, in the weight's dtype. ``shifts=False``: the norm has no
    shift at all (a LayerScale); a layer without bias then stays without. An embedding takes the shift in its
    table's rows and has no bias (``LayerKind.shift_in_weight``)."""
    w_node = kind.weight(layer)
    assert w_node is not None
    w_target = str(w_node.target)
    b_target = weights.bias(layer, kind)
    record = LayerFold(layer, kind, w_target, forward, s, t, norm, b_target)
    if b_target is not None or not shifts or kind.shift_in_weight:
        return _Fold([], record)
    return _Fold([NewBias(layer, kind, f"{w_target.removesuffix('.weight')}.bias")], record)


def _tiled(values: torch.Tensor, chan: Chan, src: fx.Node, fill: float) -> torch.Tensor:
    """Per-channel ``values`` laid out along the axis ``chan`` names on ``src`` (``fill`` outside the norm's
    segments of a concatenation: 1 for a scale, 0 for a shift)."""
    shape = shape_of(src)
    assert shape is not None
    return chan.lay_out(values, int(shape[chan.axis]), fill)


# --------------------------------------------------------------------------------------------- deciding


def _forward(
    weights: _Weights,
    flow_consumers: list[ConsumerUse],
    scale: torch.Tensor,
    shift: torch.Tensor,
    shifts: bool,
    norm: str = "",
) -> tuple[list[tuple[ConsumerUse, _Fold]], list[BlockedEdge]]:
    """The forward folds into each consumer, and the consumers that cannot take theirs (blocked, with why)."""
    folds, blocked = [], []
    for use in flow_consumers:
        kind, node = use.layer, use.node
        if not (weights.private(kind.weight(node)) and weights.private(weights.bias_node(node, kind))):
            blocked.append(BlockedEdge(use.src, node, use.chan, use.mult, reasons.SHARED_WEIGHT))
            continue
        s, t = _tiled(scale, use.chan, use.src, 1.0), _tiled(shift * use.mult, use.chan, use.src, 0.0)
        f = _fold(weights, node, kind, True, s, t, shifts, norm)
        if not weights.fits(f):
            blocked.append(BlockedEdge(use.src, node, use.chan, use.mult, reasons.DTYPE_OVERFLOW))
            continue
        folds.append((use, f))
    return folds, blocked


def _backward(
    weights: _Weights,
    graph: VirtualGraph,
    site: NormSite,
    scale: torch.Tensor,
    shift: torch.Tensor,
    stop: Collection[fx.Node] = (),
) -> tuple[list[str], list[_Fold]] | str:
    """``(the layers' names, their folds)`` when the norm folds backward (``find_producers``), else why not.

    Every producer scales its output channels by ``s`` (a producer of one piece of a channel concatenation: by
    its slice of ``s``, ``Producer.rows``); one of them, the carrier (one per piece), also adds ``t`` (its slice):
    a producer no compensated tensor lies above, preferably one that has a bias already (stored, separate or
    created) or an embedding (its table takes ``t``), so no bias is created. Every layer reading a compensated
    tensor takes the inverse affine ``(1 / s, -t' / s)`` forward (``t' = t`` when the carriers lie under that
    tensor)."""
    found = find_producers(
        site.input,
        Chan(site.channel_axis, site.channels),
        site.region,
        graph,
        stop,
        bool((scale != 0).all()),
        bool((scale > 0).all()),
        not bool(shift.any()),
    )
    if isinstance(found, str):
        return found
    if found.constants:
        added = _constants_added(weights, found, site.channels, scale.dtype)
        if isinstance(added, str):
            return added
        shift = shift + (scale - 1) * added  # s (y + c) + t = s y + (t + (s - 1) c) + c: c stays in the graph
    layers = [p.node for p in found.producers] + [u.node for uses in found.compensations for u in uses]
    if len(set(layers)) != len(layers):
        return "a layer would take two folds of this norm"
    for node, kind in [(p.node, p.layer) for p in found.producers] + [
        (u.node, u.layer) for uses in found.compensations for u in uses
    ]:
        if not (weights.private(kind.weight(node)) and weights.private(weights.bias_node(node, kind))):
            return f"the weight of {layer_name(node)} is shared"
    shifts = _shifts(site) or bool(found.constants)
    carriers = _carriers(weights, found, site.channels) if shifts else []
    if isinstance(carriers, str):
        return carriers
    zero = torch.zeros_like(shift)
    folds = []
    for i, p in enumerate(found.producers):
        rows = slice(*p.rows) if p.rows is not None else slice(None)
        t = shift[rows] if i in carriers else zero[rows]
        folds.append(_fold(weights, p.node, p.layer, False, scale[rows], t, i in carriers, site.name))
    inverse = 1.0 / scale if found.compensations else scale
    for g, uses in enumerate(found.compensations):
        under = [c for c in carriers if g in found.shared[c]]
        if under and len(under) != len(carriers):
            return f"{layer_name(uses[0].node)} would read part of the shift"
        carried = bool(under)
        t = -shift / scale if carried else zero
        for use in uses:
            s_in, t_in = _tiled(inverse, use.chan, use.src, 1.0), _tiled(t, use.chan, use.src, 0.0)
            folds.append(_fold(weights, use.node, use.layer, True, s_in, t_in, carried, site.name))
    for node, f in zip(layers, folds, strict=True):
        if not weights.fits(f):
            return f"{reasons.DTYPE_OVERFLOW} in {layer_name(node)}"
    return list(dict.fromkeys(layer_name(n) for n in layers)), folds


def _constants_added(weights: _Weights, found: Backward, channels: int, dtype: torch.dtype) -> torch.Tensor | str:
    """The constants added on the way from the producers to the norm (``Backward.constants``), summed per channel
    of the norm (``(C,)``, float64), or why a backward fold cannot make up for them: a compensated tensor on the way
    (its readers' inverse would depend on which side of the add it lies), a constant the plan does not hold (a
    streamed plan's stand-in)."""
    if found.compensations:
        return "a constant is added on the way and another layer reads a tensor there"
    constants = Constants(weights.gm)
    total = torch.zeros(channels, dtype=dtype)
    for c in found.constants:
        if isinstance(c.value, fx.Node):
            reads = {str(n.target) for n in Constants.ancestors(c.value) if n.op == "get_attr"}
            if reads & weights.unknown:
                return f"the constant added before the norm ({sorted(reads)[0]}) is not read in this plan"
            value = torch.as_tensor(constants.value(c.value), dtype=dtype)
            value = value.reshape(-1) if c.chan is None else value.movedim(c.chan.axis, 0).reshape(c.chan.channels)
        else:
            value = torch.tensor([float(c.value)], dtype=dtype)
        rows = slice(*c.rows) if c.rows is not None else slice(None)
        total[rows] += c.sign * value.expand_as(total[rows])
    return total


def _carriers(weights: _Weights, found: Backward, channels: int) -> list[int] | str:
    """The producers that take the shift ``t`` (see ``_backward``): one producer of all the norm's channels, or
    else one per piece of a channel concatenation (``Producer.rows``), when those pieces cover every channel
    once; else why not."""

    def rank(i: int) -> tuple[bool, bool, int]:
        p = found.producers[i]
        has_bias = p.layer.shift_in_weight or weights.bias(p.node, p.layer) is not None
        return (bool(found.shared[i]), not has_bias, i)

    by_rows: dict[tuple[int, int] | None, list[int]] = {}
    for i, p in enumerate(found.producers):
        by_rows.setdefault(p.rows, []).append(i)
    if None in by_rows:
        return [min(by_rows[None], key=rank)]
    chosen = sorted((rows, min(group, key=rank)) for rows, group in by_rows.items() if rows is not None)
    starts = [start for (start, _), _ in chosen] + [channels]
    if starts[0] != 0 or any(stop != after for ((_, stop), _), after in zip(chosen, starts[1:], strict=True)):
        return "the pieces of the concatenations before the norm split its channels differently"
    return [i for _, i in chosen]


def _shifts(site: NormSite) -> bool:
    """False for a norm without any shift (a LayerScale: ``gamma * x``; an RMSNorm's weight; a LayerNorm without
    bias); BN kinds always count as shifting (their folds create biases whatever the statistics, as the streamed
    fold expects), and so does a LayerNorm / GroupNorm with a bias, whatever its values."""
    if is_norm_affine(site.kind):
        return site.shifted
    return site.bn is not None or site.kind != "LayerScale"


def _unit(site: NormSite) -> tuple[fx.Node, int, fx.Node] | None:
    """Where the norm op of a split LayerNorm / RMSNorm / GroupNorm affine keeps a unit weight once it folds."""
    mul = next((n for n in site.region if n.meta.get(MARK) not in (None, "shift")), None)
    return unit_weight(mul) if mul is not None else None


def _reads(site: NormSite) -> set[str]:
    """The stored tensors the norm's ops read (its statistics, weights, scale)."""
    names = {n for n in site.param_names.values() if n}
    for node in site.region:
        names |= {str(a.target) for a in node.all_input_nodes if a.op == "get_attr"}
    return names


def _base(site: NormSite, edge: BlockedEdge) -> fx.Node:
    """The tensor the kept affine reads: the norm's input when the blocked op reads the norm's output itself."""
    return site.input if edge.src is site.output else edge.src


def _affine_fits(site: NormSite, edges: list[BlockedEdge], scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """True when the per-channel affine kept on each blocked edge is finite in that tensor's dtype."""
    for edge in edges:
        dtype = _base(site, edge).meta["val"].dtype
        if not fold.fits_dtype(scale.to(dtype), (shift * edge.mult).to(dtype)):
            return False
    return True


def _paths(blocked: list[BlockedEdge]) -> list[dict[str, str]]:
    """``{"before": <module>:<op>, "reason": ...}`` for every blocked path, in graph order, without repeats."""
    out: list[dict[str, str]] = []
    for e in blocked:
        entry = {"before": op_site(e.dst), "reason": e.reason}
        if entry not in out:
            out.append(entry)
    return out


def _kept(site: NormSite, decision: Decision, reason: str | None = None) -> NormPlan:
    """A norm that is not a fixed affine: batch statistics in eval, a BN still in train mode, or (``reason``) one
    whose tensors the graph updates as it runs."""
    if reason is None:
        reason = reasons.TRAIN_MODE if site.params.get("running_mean") is not None else reasons.BATCH_STATS_IN_EVAL
    decision.reason = reason
    decision.paths = [{"before": op_site(site.anchor), "reason": decision.reason}]
    return NormPlan(site, decision)


def _backward_plan(plan: NormPlan, producers: list[str], folds: list[_Fold]) -> NormPlan:
    """``plan`` carried out as a backward fold into ``producers`` (one fold each)."""
    plan.decision.action, plan.decision.into = FOLDED_BACKWARD, producers
    for f in folds:
        plan.new_biases += f.new_biases
        plan.folds.append(f.record)
    plan.unit = _unit(plan.site)
    return plan


def _choose_direction(
    weights: _Weights, graph: VirtualGraph, site: NormSite, decision: Decision, stop: Collection[fx.Node] = ()
) -> tuple[list[str], list[_Fold]] | None:
    """The backward fold to take instead of a possible forward one, or None (forward stays).

    Per-output-channel int8 absorbs a backward fold's row scale exactly, while a forward fold can make a consumer
    row's int8 step up to ``ranges.spread(scale)`` times coarser for the input it scales least
    (``slabconv.engine.ranges``). Where that bound is above ``ranges.STEP_GROWTH_LIMIT`` and the norm's input comes
    from a layer it can fold into exactly, the norm folds backward; either way ``decision.direction`` says what
    was weighed. The bound reads the norm's scale alone, so a streamed plan (whose big weights are stand-ins)
    decides as an in-memory one does (docs/math.md, "Which direction")."""
    assert site.scale is not None and site.shift is not None
    wide = spread(site.scale)
    if wide <= STEP_GROWTH_LIMIT:
        return None
    consumers = ", ".join(decision.into)
    backward = _backward(weights, graph, site, site.scale, site.shift, stop)
    if isinstance(backward, str) or len(backward[0]) != 1 or len(backward[1]) != 1:
        # only a fold into the rows of one producer is free for int8: a sum of producers, or readers of the
        # norm's input that take the inverse scale, move a column scale elsewhere
        decision.direction = (
            f"forward: a forward fold may make the per-channel int8 step of {consumers} up to {wide:.3g}x coarser "
            f"(the norm's scale spread; above {STEP_GROWTH_LIMIT:g}x), and the norm cannot fold backward into the "
            "rows of one layer alone (no layer it alone reads produces its input)"
        )
        return None
    decision.direction = (
        f"backward: both directions are exact; a forward fold may make the per-channel int8 step of {consumers} "
        f"up to {wide:.3g}x coarser (the norm's scale spread; above {STEP_GROWTH_LIMIT:g}x), a backward fold into "
        f"{', '.join(backward[0])} scales whole output channels, which per-channel int8 absorbs (1x)"
    )
    return backward


def plan_norm(
    gm: fx.GraphModule,
    site: NormSite,
    weights: _Weights,
    graph: VirtualGraph,
    stop: Collection[fx.Node] = (),
) -> NormPlan:
    """Decide one norm (see the module docstring); ``stop`` holds the other norms' ops (a walk never crosses
    another norm)."""
    decision = Decision(norm=site.name, kind=site.kind, action=KEPT)
    decision.warnings += _progressive_warnings(gm, site)
    if site.composed:
        decision.warnings.append(
            f"composed with {site.composed}: this BatchNorm alone reads it, so the two are one affine of "
            f"{site.composed}'s input (composed in float64)"
        )
    if site.training:
        return _kept(site, decision)
    if _reads(site) & weights.written:  # its affine is what the tensors hold at the time: not one fixed affine
        return _kept(site, decision, reasons.UPDATED_IN_FORWARD)
    _check_stats(site)
    scale, shift = site.scale, site.shift
    assert scale is not None and shift is not None
    positive, shiftless = bool((scale > 0).all()), not bool(shift.any())
    flow = follow(site.output, Chan(site.channel_axis, site.channels), positive, stop, shiftless)
    writer = next((w for n in flow.reached if (w := written_in_place(n)) is not None), None)
    if writer is not None:  # a tensor on the norm's path written in place: its readers after the write read others
        return _kept(site, decision, reasons.unsupported(writer))
    folds, refused = _forward(weights, flow.consumers, scale, shift, _shifts(site), site.name)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    blocked = sorted(flow.blocked + refused, key=lambda e: (order[e.dst], order[e.src]))
    plan = NormPlan(site, decision, scale=scale, shift=shift, remove=True)
    into = sorted({layer_name(use.node) for use, _ in folds})
    if not blocked:
        decision.action, decision.into = FOLDED_FORWARD, into
        chosen = _choose_direction(weights, graph, site, decision, stop)
        if chosen is not None:
            return _backward_plan(plan, *chosen)
    else:
        backward = _backward(weights, graph, site, scale, shift, stop)
        if not isinstance(backward, str):
            return _backward_plan(plan, *backward)
        decision.no_backward, decision.paths = backward, _paths(blocked)
        if is_norm_affine(site.kind):  # kept whole: its affine beside the normalisation would only add two ops
            decision.reason = blocked[0].reason
            return replace(plan, remove=False)
        if not _affine_fits(site, blocked, scale, shift):
            decision.reason = reasons.DTYPE_OVERFLOW  # the affine itself is not representable: the BN stays
            return replace(plan, remove=False)
        decision.action, decision.into, decision.reason = KEPT_AFFINE, into, blocked[0].reason
        decision.kept_on = sorted({op_site(e.dst) for e in blocked})
        plan.kept = blocked
    decision.warnings += _precision_warnings(site, scale, shift)
    plan.unit = _unit(site)
    for _, f in folds:
        plan.new_biases += f.new_biases
        plan.folds.append(f.record)
    return plan


def plan_folds(
    gm: fx.GraphModule, sites: list[NormSite] | None = None, unknown: Collection[str] = (), until: int | None = None
) -> list[NormPlan]:
    """One ``NormPlan`` per norm of ``gm``, in graph order; ``gm`` is not changed (except that ``find_norms`` may
    merge duplicate inputs of a norm when ``sites`` is not given).

    ``unknown``: stored tensors whose values are not in ``gm`` (a streamed plan holds stand-ins of the right
    shape and dtype for the big weights, ``slabconv.pipeline``): their folds are planned on the meta device and
    their overflow check waits for the fold program, which reads the real values.

    ``until``: plan only the first ``until`` norms (the rest still stop every walk, as they do in a whole plan):
    the plans are those of a whole plan's first ``until`` norms, as each norm is planned on what the earlier ones
    leave.

    Raises:
        InputError: a norm's statistics are NaN/Inf or its running_var + eps <= 0.
    """
    sites = find_norms(gm) if sites is None else sites
    owner = {n: i for i, site in enumerate(sites) for n in site.region}
    weights, graph = _Weights(gm, unknown, owner), VirtualGraph()
    plans = []
    for i, site in enumerate(sites[:until]):
        stop = {n: sites[j].bn or n for n, j in owner.items() if j != i}  # a BN kind is blocked by its BN op
        p = weights.commit(plan_norm(gm, site, weights, graph, stop))
        if p.decision.action in (FOLDED_FORWARD, FOLDED_BACKWARD):
            graph.remove(site.output, site.input, site.region)
        graph.kept.update((e.src, e.dst) for e in p.kept)
        plans.append(p)
    return plans
