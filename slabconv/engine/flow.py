"""Data flow of a per-channel affine through the graph, with the op tables of ``slabconv.engine.rules``.

Three walks, all read-only:

- ``follow(start, chan)``: forward from a norm's output. In: the node and where its channels sit. Out: a
  ``Flow``: every consumer that can absorb the affine (``ConsumerUse``) and every edge where it is blocked
  (``BlockedEdge``, with a reason). Every user of every tensor on the way is classified; nothing is skipped.
- ``find_producers(start, chan, owned, graph, stop)``: backward from a norm's input through view-like ops, means
  and pools that keep the shift, a layer's separate bias add and sums, to the Linears / convs / embeddings whose
  outputs make it, every tensor on the way read by the way alone or by layers that can take the inverse affine.
  Out: a ``Backward``, or the plain-text reason there is none.
- ``source_chan(node, known)`` and ``reaches_layer(start, chan)``: layout only (no affine flows): where the channel
  axis of the nearest layer or norm upstream sits on ``node``, and whether a layer downstream contracts a given
  axis. Used to tell a per-channel constant on a channel axis from one on a token axis.

The backward walk sees the graph as it will be once earlier norms are folded: ``VirtualGraph`` makes a removed
norm's output stand for its input, so a planner can decide every norm before the graph is rewritten.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from slabconv.engine import reasons
from slabconv.engine.affine_values import Constants
from slabconv.engine.capture import is_float, norm_dim, op_arg, rank, same_shape, same_size, shape_of, static_int
from slabconv.engine.layers import LayerKind, layer_of, separate_bias
from slabconv.engine.rules import (
    CAT_OPS,
    INDEX_OUTPUTS,
    JOIN_OPS,
    RULE_OF,
    RULES,
    Absorb,
    Block,
    Chan,
    Outcome,
    Pass,
    holds_every_value,
    op_name,
    reads_data,
    unsupported,
)

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class ConsumerUse:
    """A layer the norm can fold into: ``node`` reads the normalised ``src`` (channels at ``chan``); the shift
    reaching it is multiplied by ``mult``."""

    node: fx.Node
    src: fx.Node
    layer: LayerKind
    chan: Chan
    mult: float


@dataclass(frozen=True)
class BlockedEdge:
    """The edge ``src -> dst`` where the fold stops: ``dst`` must still see the normalised ``src``
    (channels at ``chan`` of ``src``, shift multiplied by ``mult``)."""

    src: fx.Node
    dst: fx.Node
    chan: Chan
    mult: float
    reason: str


@dataclass
class Flow:
    """Where one norm's output goes: the consumers that can absorb it, the edges where it is blocked, and every
    node the affine reached on the way (the norm's output first)."""

    consumers: list[ConsumerUse] = field(default_factory=list)
    blocked: list[BlockedEdge] = field(default_factory=list)
    reached: tuple[fx.Node, ...] = ()


def classify(user: fx.Node, src: fx.Node, ch: Chan, shiftless: bool = False) -> Outcome:
    """What ``user`` does with the affine arriving on its input ``src`` (channels at ``ch``). ``shiftless``: the
    affine has no shift (every ``t`` is 0), so a conv's padded zeros stay zeros once scaled, and a padded conv
    takes the scale into its input columns exactly."""
    layer = layer_of(user)
    if layer is not None:
        reason = layer.consumer_check(user, src, ch)
        if reason == reasons.PADDED_CONV_CONSUMER and shiftless:
            reason = None
        return Absorb(layer) if reason is None else Block(reason)
    rule = RULE_OF.get(user.target)
    return rule.step(user, src, ch) if rule is not None else unsupported(user)


def _join(user: fx.Node, arrived: Mapping[fx.Node, tuple[Chan, float]]) -> Outcome:
    """What a ``cat`` / ``stack`` does with the affine on the pieces that derive from the norm (``arrived``: their
    channel state and shift multiplier), every other piece being something the norm did not produce.

    - Every piece from the norm with the same state: the result has that state (tokens split and put back
      together; along the channel axis each piece holds whole channel blocks).
    - A ``cat`` along the channel axis with other tensors (YOLO's ``cat([upsample(aifi(x)), skip], 1)``): the
      result carries the norm's affine on the norm's pieces and the identity (scale 1, shift 0) on the others,
      recorded as ``Chan.segments``; a layer contracting that axis folds the norm into its slice of input channels.
      The norm's pieces must agree on the axis, ``inner`` and shift multiplier; the other pieces' sizes along the
      axis must be static. Pieces of the channel axis (slices, a split) join the same way, each with its channels:
      put back in order they are the whole axis again, in another order a permutation of it.
    - Anything else with a piece the norm did not produce (along a token axis: the naive fold would scale and
      shift those tokens too; a ``stack``): ``concat-with-unnormalized``.
    """
    tensors: list[Any] = list(user.args[0])  # type: ignore[arg-type]
    pieces = [arrived.get(t) if isinstance(t, fx.Node) else None for t in tensors]
    states = {p for p in pieces if p is not None}
    if len({(c.axis, c.channels, c.inner, m) for c, m in states}) != 1:
        return unsupported(user)  # pieces with different channel layouts or shift multipliers
    ch, _ = next(iter(states))
    dim = norm_dim(op_arg(user, 1, "dim", 0), rank(user))  # type: ignore[arg-type]
    if user.target is aten.stack.default or dim != ch.axis:
        if None in pieces:
            return Block(reasons.CONCAT_WITH_UNNORMALIZED)
        if len(states) != 1:
            return unsupported(user)  # pieces of the norm with different segments
        return Pass(ch.at(ch.axis + 1 if dim <= ch.axis else ch.axis) if user.target is aten.stack.default else ch)
    if None not in pieces and len(states) == 1 and not ch.segments:
        return Pass(ch)  # along the channel axis each piece holds whole channel blocks (its size is k * C * inner)
    segments: list[tuple[int, int, int]] = []
    offset = 0
    for t, piece in zip(tensors, pieces, strict=True):
        size = static_int(shape_of(t)[dim])  # type: ignore[index]
        if size is None:
            return unsupported(user)
        if piece is not None:
            segments += [(offset + start, length, phase) for start, length, phase in piece[0].spans(size)]
        offset += size
    return Pass(ch.with_segments(segments, offset))  # the pieces of a split put back in order: the whole axis again


class _Walk:
    """One forward walk (``follow``): a work list of (node, channels, shift multiplier) and the joins waiting
    for all their inputs."""

    def __init__(self, start: fx.Node, chan: Chan, positive_scale: bool, stop: Collection[fx.Node], shiftless: bool):
        self.flow = Flow()
        self.positive_scale, self.shiftless = positive_scale, shiftless
        self.stop = stop
        self.states: dict[fx.Node, tuple[Chan, float]] = {}
        self.arrivals: dict[fx.Node, dict[fx.Node, tuple[Chan, float]]] = {}
        self.todo: list[tuple[fx.Node, Chan, float]] = [(start, chan, 1.0)]
        self.order: dict[fx.Node, int] | None = None
        self.decided: set[fx.Node] = set()
        self.items: dict[fx.Node, Pass] = {}  # an op of several outputs whose outputs hold different channels

    def settle(self, src: fx.Node, user: fx.Node, ch: Chan, mult: float, outcome: Outcome) -> None:
        rule = RULE_OF.get(user.target)
        if isinstance(outcome, Pass) and outcome.needs_positive_scale and not self.positive_scale:
            outcome = Block(reasons.NEGATIVE_SCALE_THROUGH_MAX)
        if isinstance(outcome, Pass) and outcome.needs_zero_shift and not self.shiftless:
            outcome = Block(reasons.ZERO_PADDING_AFTER_NORM)
        if isinstance(outcome, Pass) and not (rule and rule.tuple_out) and not is_float(user):
            outcome = unsupported(user)  # e.g. a cast to an integer type
        if isinstance(outcome, Pass):
            if outcome.items is not None:
                self.items[user] = outcome
            self.todo.append((user, outcome.chan, mult * outcome.mult))
        elif isinstance(outcome, Absorb):
            self.flow.consumers.append(ConsumerUse(user, src, outcome.layer, ch, mult))
        else:
            self.flow.blocked.append(BlockedEdge(src, user, ch, mult, outcome.reason))

    def visit(self, node: fx.Node, user: fx.Node, ch: Chan, mult: float) -> None:
        """Classify one user of a normalised tensor (shape-only reads carry no data and are left as they are)."""
        if user.op == "output":
            self.flow.blocked.append(BlockedEdge(node, user, ch, mult, reasons.FEEDS_OUTPUT))
        elif not reads_data(user, node):
            return
        elif user.target is operator.getitem:
            item = self.items[node].item(user.args[1]) if node in self.items else ch  # type: ignore[arg-type]
            # integer indices are unchanged by s > 0; a piece holding none of the norm's channels is not its output
            if INDEX_OUTPUTS.get(node.target) != user.args[1] and item is not None:
                self.todo.append((user, item, mult))
        elif user.target in JOIN_OPS:
            assert user not in self.decided, f"{user.name} was decided before all its pieces arrived"
            self.arrivals.setdefault(user, {})[node] = (ch, mult)
        else:
            outcome = classify(user, node, ch, self.shiftless)
            if user in self.stop and not isinstance(outcome, Block):
                named = self.stop[user] if isinstance(self.stop, Mapping) else user
                outcome = unsupported(named)  # another norm's own op: each norm is decided on its own
            self.settle(node, user, ch, mult, outcome)

    def drain(self) -> None:
        while self.todo:
            node, ch, mult = self.todo.pop()
            if node not in self.states:
                self.states[node] = (ch, mult)
                for user in list(node.users):
                    self.visit(node, user, ch, mult)

    def joins(self) -> None:
        """Decide the first waiting join in graph order. Called when nothing else is left to walk: every path from
        the norm to it runs through ops already walked or through joins before it, all decided, so every piece
        that will ever arrive has arrived (a piece not in ``arrivals`` is not the norm's)."""
        if self.order is None:
            self.order = {n: i for i, n in enumerate(next(iter(self.arrivals)).graph.nodes)}
        join = min(self.arrivals, key=self.order.__getitem__)
        got = self.arrivals.pop(join)
        self.decided.add(join)
        outcome = _join(join, got)
        if isinstance(outcome, Pass):
            self.settle(next(iter(got)), join, outcome.chan, next(iter(got.values()))[1], outcome)
        else:
            assert isinstance(outcome, Block)
            for src, (ch, mult) in got.items():
                self.flow.blocked.append(BlockedEdge(src, join, ch, mult, outcome.reason))


def follow(
    start: fx.Node, chan: Chan, positive_scale: bool = True, stop: Collection[fx.Node] = (), shiftless: bool = False
) -> Flow:
    """Follow a tensor whose channels are at ``chan`` through every user, to consumers and blockers.

    ``positive_scale`` says whether every channel's scale is > 0; max/min over tokens commute with the
    affine only then (otherwise they block with ``negative-scale-through-max``). ``shiftless`` says whether every
    shift is 0: a zero-padded conv then absorbs the scale (``classify``), and an op that pads or samples with zeros
    passes it (``Pass.needs_zero_shift``).

    Every user of every tensor on the way is classified (``classify``); nothing is skipped. A join
    (``cat``/``stack``) is decided once all its inputs are known: it passes only when every input derives from
    ``start`` through commuting ops with the same channel state and shift multiplier; otherwise each normalised
    input is blocked. The ops in ``stop`` (other norms' own ops) always block: an affine never flows through
    another norm, whose own decision covers it. The reason names the op itself, or, where ``stop`` maps each op to
    one, the op it maps to (the other norm's BatchNorm op: the transpose a RepBN starts with is spelled
    ``aten.transpose`` in a program and ``aten.permute`` in a lowered ONNX graph).
    """
    walk = _Walk(start, chan, positive_scale, stop, shiftless)
    walk.drain()
    while walk.arrivals:
        walk.joins()
        walk.drain()
    walk.flow.reached = tuple(walk.states)
    return walk.flow


# --------------------------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class Producer:
    """A Linear/conv whose output (channels at its output axis) flows only into the norm's input; ``rows``: the
    norm's channels ``[start, stop)`` its output makes (a piece of a concatenation on the channel axis), None for
    all of them."""

    node: fx.Node
    layer: LayerKind
    weight: fx.Node
    bias: fx.Node | None
    rows: tuple[int, int] | None = None


class VirtualGraph:
    """The graph as it will be once some norms are removed: a removed norm's output stands for its input.

    ``removed`` maps a removed norm's output node to ``(input node, the norm's own nodes)``; ``kept`` holds the
    edges ``(src, dst)`` on which a per-channel affine will be inserted (``dst`` will read that affine).
    """

    def __init__(self) -> None:
        self.removed: dict[fx.Node, tuple[fx.Node, list[fx.Node]]] = {}
        self.gone: set[fx.Node] = set()
        self.into: dict[fx.Node, list[fx.Node]] = {}
        self.kept: set[tuple[fx.Node, fx.Node]] = set()

    def remove(self, output: fx.Node, input: fx.Node, region: Iterable[fx.Node]) -> None:
        """Record that the norm computing ``output`` from ``input`` with the nodes ``region`` goes."""
        self.removed[output] = (input, list(region))
        self.gone.update(region)
        self.into.setdefault(input, []).append(output)

    def resolve(self, node: fx.Node) -> fx.Node:
        """The node that will hold ``node``'s value (a removed norm's input for its output)."""
        while node in self.removed:
            node = self.removed[node][0]
        return node

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """Users that read ``node``'s data once the removed norms are gone (shape-only reads left out)."""
        return [user for _, user in self.read_edges(node)]

    def read_edges(self, node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
        """``(src, user)`` for each reader of ``node``'s data once the removed norms are gone: ``src`` is the node
        ``user`` reads in the graph as it is (``node``, or the output of a removed norm that stands for it)."""
        out = [(node, u) for u in node.users if u not in self.gone and reads_data(u, node)]
        for removed_output in self.into.get(node, []):
            out += self.read_edges(removed_output)
        return out


def _through(node: fx.Node, ch: Chan, positive_scale: bool, shiftless: bool) -> tuple[fx.Node, Chan, bool] | str:
    """One step up an op whose rule passes the affine with the shift unchanged: its data input (the first argument),
    where the channels sit there, and whether the op pads or samples with zeros.

    A rule's ``Pass(chan)`` (``mult`` 1) says ``op(s y + t) = s op(y) + t`` for the affine on that input, which is
    what a backward fold needs: the producer's output scaled and shifted makes the norm's output. So the walk goes
    up view-like ops and also up the means and pools of the forward table (``mean`` over tokens, adaptive / global
    average pooling, average pooling that does not count padded zeros, interpolation), and up max / min and max
    pooling when every scale is > 0 (``positive_scale``), and up an op that pads or samples with zeros when every
    shift is 0 (``shiftless``: ``pad(s y, 0) = s pad(y, 0)``). A rule that scales the shift (``sum`` over N
    tokens, ``x * c``) or blocks stops the walk."""
    rule = RULE_OF.get(node.target)
    if rule is None:
        return f"no Linear/conv before the norm: {op_name(node)} produces its input"
    src = node.args[0]
    if not isinstance(src, fx.Node) or not is_float(src):
        return f"{op_name(node)} does not read a float tensor"
    if rule.name in ("cast", "type_as"):
        narrower = _widening_before_norm(node, src)
        if narrower is not None:
            return narrower
    sizes = shape_of(src) or ()
    outcomes = {
        a: rule.step(node, src, Chan(a, ch.channels)) for a, size in enumerate(sizes) if same_size(size, ch.channels)
    }
    signs, shifts = {False, positive_scale}, {False, shiftless}
    wanted = [Pass(ch, needs_positive_scale=p, needs_zero_shift=z) for p in signs for z in shifts]
    found = [a for a, outcome in outcomes.items() if outcome in wanted]
    if len(found) != 1:
        if not found and Pass(ch, needs_positive_scale=True) in outcomes.values():
            return f"{op_name(node)} commutes with the norm's affine only when every scale is > 0"
        zeros = [o for o in outcomes.values() if isinstance(o, Pass) and o.needs_zero_shift]
        if not found and (zeros or Block(reasons.ZERO_PADDING_AFTER_NORM) in outcomes.values()):
            return f"{op_name(node)} pads or samples with zeros, which would become the shift t"
        if not found and not rule.view_like and not any(isinstance(o, Pass) for o in outcomes.values()):
            return f"no Linear/conv before the norm: {op_name(node)} produces its input"
        return f"the norm's channels are not one axis before {op_name(node)}"
    return src, Chan(found[0], ch.channels), outcomes[found[0]].needs_zero_shift  # type: ignore[union-attr]


def _widening_before_norm(cast: fx.Node, src: fx.Node) -> str | None:
    """Why no backward fold crosses ``cast``, a widening of the producer's output (a float16 Linear / conv whose
    output is cast to float32 for the norm), else None: the fold would compute ``s y + t`` in the producer's
    narrower dtype, where the original computes it in the wider one (a value ``s y + t`` past 65504 is ``inf`` in
    float16 where ``y`` was not); the mirror of ``narrowing-cast-after-norm`` (``steps.cast_outcome``)."""
    before, after = (n.meta.get("val") for n in (src, cast))
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    if holds_every_value(before.dtype, after.dtype):
        return None
    narrow, wide = (str(d).removeprefix("torch.") for d in (before.dtype, after.dtype))
    return (
        f"{op_name(cast)} casts the producer's {narrow} output to {wide} for the norm: a backward fold would "
        f"compute the norm's affine in {narrow}"
    )


ROWS_ADDEND = "rows_addend"
"""``meta`` key of an ``add`` that applies a layer's own addend of another shape than ``(C,)`` (an ONNX ``Gemm``'s C
per row, ``(M, N)`` or ``(M, 1)``, or one number, lowered ``linear(x, W) + C``): a backward fold passes it to the
layer, and whoever writes the fold rewrites that addend too (``slabconv.engine.onnx_apply``: ``s C``)."""


def _bias_add_layer(node: fx.Node) -> fx.Node | None:
    """The layer when ``node`` is the ``add`` of its separate bias (``layer(x) + b``, ``separate_bias``) or of its
    own addend (``ROWS_ADDEND``)."""
    if node.target is not aten.add.Tensor:
        return None
    if node.meta.get(ROWS_ADDEND):
        return node.args[0]  # type: ignore[return-value]
    for arg in node.args:
        kind = layer_of(arg)
        if kind is not None and (found := separate_bias(arg, kind)) is not None and found.add is node:  # type: ignore[arg-type]
            return arg  # type: ignore[return-value]
    return None


@dataclass
class Backward:
    """How a norm folds backward (``find_producers``).

    Attributes:
        producers: the Linear / conv / embedding ops whose outputs make the norm's input: one, or the addends of a
            sum (a residual add of two layers' outputs). Each scales its output channels by ``s``; one of them
            (the planner picks it) also takes the shift ``t``.
        shared: per producer, the indices of ``compensations`` groups it lies under.
        compensations: per tensor on the way that something else reads too (``shared``), the layers reading it
            (through view-like ops): that tensor becomes ``s x + t'`` (``t' = t`` when the producer taking the
            shift lies under it, else 0), so each of them takes the inverse affine ``(1 / s, -t' / s)`` on its
            input, exactly as a forward fold.
    """

    producers: list[Producer] = field(default_factory=list)
    shared: list[tuple[int, ...]] = field(default_factory=list)
    compensations: list[list[ConsumerUse]] = field(default_factory=list)
    constants: list[ConstantAddend] = field(default_factory=list)


@dataclass(frozen=True)
class ConstantAddend:
    """A constant added on the way from the producers to the norm (``conv(x) + c``, ``h - 0.5``): ``value``, a
    Python number or a constant node (stored tensors and literals only) broadcast along every axis but the
    channels (``chan``: where they sit on it, None for a number or a single value), added with ``sign`` (-1 for a
    subtraction) to the norm's channels ``rows`` (None: all). It stays in the graph: the producers' shift makes up
    for the norm's scale of it, ``s (y + c) + t = s y + (t + (s - 1) c) + c``."""

    value: Any
    sign: float
    chan: Chan | None
    rows: tuple[int, int] | None


def _sum_operands(node: fx.Node, ch: Chan) -> list[tuple[fx.Node, Chan]] | None:
    """The two addends of ``a + b`` with where the channels sit on each, when both are distinct float tensors
    that hold the whole channel axis (broadcast along other axes only, as a ``(1, N, C)`` position embedding
    is over the batch) and there is no ``alpha``; else None."""
    if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    shape = shape_of(node)
    assert shape is not None
    out = []
    for t in (a, b):
        sizes = shape_of(t)
        if not is_float(t) or sizes is None or len(sizes) > len(shape):
            return None
        lead = len(shape) - len(sizes)
        if ch.axis < lead or not same_size(sizes[ch.axis - lead], shape[ch.axis]):
            return None
        if any(not same_size(n, m) and static_int(n) != 1 for n, m in zip(sizes, shape[lead:], strict=True)):
            return None
        out.append((t, ch.at(ch.axis - lead)))
    return out


_CONSTANT_ADDS: dict[Any, float] = {
    aten.add.Tensor: 1.0,
    aten.add.Scalar: 1.0,
    aten.sub.Tensor: -1.0,
    aten.sub.Scalar: -1.0,
}


def _constant_addend(node: fx.Node, ch: Chan, constants: Constants) -> tuple[fx.Node, Any, float, Chan | None] | None:
    """``(data, constant, sign, where the channels sit on the constant)`` when ``node`` is ``data + c`` (or
    ``c + data``, ``data - c``) with ``data`` a float tensor of the node's shape and dtype and ``c`` a constant
    (a number, or a node of stored tensors and literals) broadcast along every axis but the (plain) channel axis
    ``ch``; else None."""
    sign = _CONSTANT_ADDS.get(node.target)
    if sign is None or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or not ch.plain:
        return None
    a, b = node.args
    data, const = (a, b) if isinstance(a, fx.Node) and not constants.is_const(a) else (b, a)
    if sign < 0 and data is not a:
        return None  # ``c - data`` negates the data
    if not isinstance(data, fx.Node) or not is_float(data) or constants.is_const(data):
        return None
    out, val = shape_of(node), node.meta.get("val")
    if not same_shape(shape_of(data), out) or not isinstance(val, torch.Tensor):
        return None
    if val.dtype != data.meta["val"].dtype:
        return None
    if isinstance(const, (int, float)) and not isinstance(const, bool):
        return data, float(const), sign, None
    if not isinstance(const, fx.Node) or not constants.is_const(const) or not is_float(const):
        return None
    sizes = shape_of(const)
    assert sizes is not None and out is not None
    lead = len(out) - len(sizes)
    if lead < 0 or any(static_int(n) != 1 for i, n in enumerate(sizes) if i + lead != ch.axis):
        return None
    if ch.axis < lead or static_int(sizes[ch.axis - lead]) == 1:
        return data, const, sign, None  # one value for every channel
    if not same_size(sizes[ch.axis - lead], ch.channels):
        return None
    return data, const, sign, ch.at(ch.axis - lead)


def _channel_pieces(node: fx.Node, ch: Chan) -> list[tuple[fx.Node, Chan, int]] | None:
    """``(piece, where its channels sit, its first channel)`` for each piece of a ``cat`` along the (plain)
    channel axis ``ch``, when every piece is a float tensor of the same rank with a static size there; else None."""
    if node.target not in CAT_OPS or not ch.plain or not isinstance(node.args[0], (list, tuple)):
        return None
    tensors = node.args[0]
    dim = op_arg(node, 1, "dim", 0)
    if not isinstance(dim, int) or norm_dim(dim, rank(node)) != ch.axis:
        return None
    out: list[tuple[fx.Node, Chan, int]] = []
    start = 0
    for t in tensors:
        if not isinstance(t, fx.Node):
            return None
        sizes = shape_of(t)
        if sizes is None or len(sizes) != rank(node) or not is_float(t):
            return None
        size = static_int(sizes[ch.axis])
        if size is None:
            return None
        if size:
            out.append((t, Chan(ch.axis, size), start))
        start += size
    return out if start == ch.channels else None


def shown(node: fx.Node) -> str:
    """The name a reason gives ``node``: its ONNX node's name for an ONNX original (``meta["onnx"]``, what Netron
    shows), else the fx node's name."""
    return str(node.meta.get("onnx") or node.name)


class _Up:
    """One backward walk (``find_producers``): a depth-first walk up from the norm's input."""

    def __init__(self, graph: VirtualGraph, stop: Collection[fx.Node], inverse: bool, gm: fx.GraphModule) -> None:
        self.graph, self.stop, self.inverse = graph, stop, inverse
        self.positive_scale = self.shiftless = False  # every scale > 0, every shift 0 (``find_producers``)
        self.padded: fx.Node | None = None  # an op passed that pads or samples with zeros (``shiftless`` only)
        self.constants = Constants(gm)
        self.found = Backward()
        self.seen: set[fx.Node] = set()
        self.rows: tuple[int, int] | None = None  # under a piece of a channel concatenation: its channels

    def reader_name(self, node: fx.Node) -> str:
        return op_name(node) if node.op != "output" else "the output"

    def compensate(self, node: fx.Node, ch: Chan, path: Collection[fx.Node]) -> list[ConsumerUse] | str:
        """The layers that read ``node`` (channels at ``ch``) other than ``path``, through view-like ops only:
        they can take the inverse of the affine ``node`` will carry. A reason when anything else reads it."""
        uses: list[ConsumerUse] = []
        todo: list[tuple[fx.Node, Chan, Collection[fx.Node]]] = [(node, ch, path)]
        items: dict[fx.Node, Pass] = {}
        while todo:
            n, c, skip = todo.pop()
            for src, user in self.graph.read_edges(n):
                if user in skip:
                    continue
                why = f"{shown(node)} is also read by {self.reader_name(user)}"
                if not self.inverse:
                    why += " (and it has no inverse: a channel's scale is 0)"
                if not self.inverse or (src, user) in self.graph.kept or user in self.stop:
                    return why
                if user.op != "call_function":
                    return why
                layer = layer_of(user)
                rule = RULE_OF.get(user.target)
                if user in self.seen and layer is None:
                    return why  # the walk's own tree: two paths to the norm
                if layer is not None:
                    if layer.consumer_check(user, src, c) is not None:
                        return why
                    uses.append(ConsumerUse(user, src, layer, c, 1.0))
                elif user.target is operator.getitem:
                    item = items[n].item(user.args[1]) if n in items else c  # type: ignore[arg-type]
                    if item is not None:  # a piece without the norm's channels is unchanged
                        todo.append((user, item, ()))
                elif rule is not None and rule.view_like and user.args and user.args[0] is src:
                    outcome = rule.step(user, src, c)
                    if not isinstance(outcome, Pass) or not (rule.tuple_out or is_float(user)):
                        return why
                    if outcome.needs_zero_shift:  # the inverse affine's shift -t/s would reach the padded zeros
                        return why
                    if outcome.items is not None:
                        items[user] = outcome
                    todo.append((user, outcome.chan, ()))
                else:
                    return why
        return uses

    def walk(self, node: fx.Node, ch: Chan, path: Collection[fx.Node], shared: tuple[int, ...]) -> str | None:
        """Walk up from ``node`` (read by ``path``, channels at ``ch``) to its producers; None when every branch
        ends at one, else why not."""
        node = self.graph.resolve(node)
        if node in self.seen:
            return f"{shown(node)} reaches the norm on two paths"
        self.seen.add(node)
        if any(u not in path for u in self.graph.readers(node)):
            if self.rows is not None:  # a piece of a concatenation carries a slice of the affine: no inverse here
                readers = [self.reader_name(u) for u in self.graph.readers(node) if u not in path]
                return f"{shown(node)} is also read by {readers[0]}"
            uses = self.compensate(node, ch, path)
            if isinstance(uses, str):
                return uses
            shared = (*shared, len(self.found.compensations))
            self.found.compensations.append(uses)
        if node.op != "call_function":
            return f"the norm's input is a {node.op}, not a layer's output"
        layer = layer_of(node)
        if layer is not None:
            reason = layer.producer_check(node, ch)
            if reason is not None:
                return reason
            self.found.producers.append(Producer(node, layer, layer.weight(node), layer.bias(node), self.rows))  # type: ignore[arg-type]
            self.found.shared.append(shared)
            return None
        below = _bias_add_layer(node)
        if below is not None:  # ``layer(x) + b``: the layer with its separate bias
            return self.walk(below, ch, {node}, shared)
        if node.target is operator.getitem:
            tup = node.args[0]
            assert isinstance(tup, fx.Node)
            if any(self.graph.readers(g) for g in tup.users if g is not node):
                return f"another output of {op_name(tup)} is read elsewhere"
            return self.walk(tup, ch, set(tup.users), shared)
        pieces = _channel_pieces(node, ch)
        if pieces is not None:  # s cat(a, b) + t = cat(s[:k] a + t[:k], s[k:] b + t[k:]): each piece its slice
            outer = self.rows
            for piece, piece_ch, start in pieces:
                if (piece, node) in self.graph.kept:
                    return f"an earlier norm keeps an affine before {op_name(node)}"
                first = start + (outer[0] if outer is not None else 0)
                self.rows = (first, first + piece_ch.channels)
                reason = self.walk(piece, piece_ch, {node}, shared)
                self.rows = outer
                if reason is not None:
                    return reason
            return None
        added = _constant_addend(node, ch, self.constants)
        if added is not None:  # s (y + c) + t = s y + (t + (s - 1) c) + c: the producers make up for s c
            data, const, sign, const_ch = added
            if (data, node) in self.graph.kept:
                return f"an earlier norm keeps an affine before {op_name(node)}"
            self.found.constants.append(ConstantAddend(const, sign, const_ch, self.rows))
            return self.walk(data, ch, {node}, shared)
        addends = _sum_operands(node, ch)
        if addends is not None:  # s (a + b) + t = (s a + t) + s b: each addend's producers take s
            for a, a_ch in addends:
                if (a, node) in self.graph.kept:
                    return f"an earlier norm keeps an affine before {op_name(node)}"
                if a.op == "get_attr":  # a constant _constant_addend did not take: not one value per channel
                    return f"{op_name(node)} adds {a.target}, a stored tensor that is not one value per channel"
                if (reason := self.walk(a, a_ch, {node}, shared)) is not None:
                    return reason
            return None
        step = _through(node, ch, self.positive_scale, self.shiftless)
        if isinstance(step, str):
            return step
        if step[2]:
            self.padded = node
        if (step[0], node) in self.graph.kept:
            return f"an earlier norm keeps an affine before {op_name(node)}"
        return self.walk(step[0], step[1], {node}, shared)


def find_producers(
    start: fx.Node,
    chan: Chan,
    owned: Iterable[fx.Node],
    graph: VirtualGraph | None = None,
    stop: Collection[fx.Node] = (),
    inverse: bool = True,
    positive_scale: bool = False,
    shiftless: bool = False,
) -> Backward | str:
    """The layers whose outputs make ``start`` (the norm's input, channels at ``chan``): a Linear / conv /
    embedding through view-like ops and the means and pools ``_through`` passes, or the addends of a sum of such (a
    residual add of two layers' outputs, the sum of MobileBERT's ``embedding_transformation`` and its position and
    token-type embeddings). Scaling their output channels by ``s`` (and one of them shifting by ``t``) makes
    ``start`` equal to the norm's output: a backward fold (``slabconv.fold.fold_into_producer``), exact on every path
    at once.

    Every tensor on the way changes value, so each must be read by the way alone, or (``inverse``) only by
    layers on the channel axis through view-like ops, which then take the inverse affine (``Backward``): in
    MobileBERT, ``NoNorm_b(dense(h) + y_a)`` where ``y_a`` (the sum an earlier NoNorm folded into) also feeds the
    next intermediate Linear. A tensor reached twice (``x + x``), a sum with broadcasting, another norm's op or a
    kept affine among the readers: no backward fold.

    Args:
        start: the norm's input.
        chan: where its channels sit (plain).
        owned: the norm's own nodes (they read ``start``).
        graph: the graph as earlier planned removals leave it (default: as it is).
        stop: the other norms' ops (a tensor they read cannot change).
        inverse: allow compensation by the inverse affine (the norm's scale has no zero).
        positive_scale: every channel's scale is > 0: the walk may go up max / min and max pooling.
        shiftless: every shift is 0: the walk may go up an op that pads or samples with zeros (``s * 0`` is 0),
            unless a constant added on the way gives the fold a shift.

    Returns:
        The ``Backward``, or why there is none (plain text).
    """
    graph = graph or VirtualGraph()
    allowed = set(owned)
    if any((start, o) in graph.kept for o in allowed):
        return "an earlier norm keeps an affine before this one"
    up = _Up(graph, stop, inverse, start.graph.owning_module)  # type: ignore[arg-type]
    up.positive_scale, up.shiftless = positive_scale, shiftless
    reason = up.walk(start, chan, allowed, ())
    if reason is None and up.padded is not None and up.found.constants:
        reason = f"{op_name(up.padded)} pads or samples with zeros, which would become the shift a constant adds"
    return reason if reason is not None else up.found


_LAYOUT_KEEPING = {
    op
    for rule in RULES
    if rule.name in ("nonlinear", "residual", "scalar_mul", "masked", "avg_pool", "max_pool")
    for op in rule.ops
}


def _layout_input(node: fx.Node) -> fx.Node | None:
    """For an op whose output keeps an input's layout (elementwise ops, residual adds, softmax, a pooling of stride
    1 whose output has its input's shape: PoolFormer's token mixer): that input."""
    if node.op != "call_function" or node.target not in _LAYOUT_KEEPING:
        return None
    shape = shape_of(node)
    return next((a for a in node.args if isinstance(a, fx.Node) and same_shape(shape_of(a), shape)), None)


def source_chan(node: fx.Node, known: Callable[[fx.Node], Chan | None]) -> Chan | None:
    """Where the channels of the nearest node with a known channel axis (``known``) sit on ``node``: walk up
    view-like ops (mapped with their rules) and ops that keep their input's layout (elementwise, residual adds)
    to it. None when the walk meets any other op first. Layout only: no affine flows along this walk."""
    path: list[fx.Node] = []
    cur: fx.Node | None = node
    ch: Chan | None = None
    while cur is not None and (ch := known(cur)) is None:
        path.append(cur)
        rule = RULE_OF.get(cur.target) if cur.op == "call_function" else None
        if cur.target is operator.getitem:
            cur = cur.args[0]  # type: ignore[assignment]
        elif rule is not None and rule.view_like and isinstance(cur.args[0], fx.Node):
            cur = cur.args[0]
        else:
            cur = _layout_input(cur)
    if cur is None or ch is None:
        return None
    items: Pass | None = None  # the op of several outputs just passed, when its outputs hold different channels
    for down in reversed(path):
        rule = RULE_OF.get(down.target)
        if down.target is operator.getitem:
            if items is not None and (ch := items.item(down.args[1])) is None:  # type: ignore[arg-type]
                return None
            items = None
        elif rule is not None and rule.view_like:
            outcome = rule.step(down, cur, ch)
            if not isinstance(outcome, Pass):
                return None
            ch, items = outcome.chan, outcome if outcome.items is not None else None
        else:
            items = None
        cur = down  # getitem: a tuple op's state is that of each output; layout-keeping ops: unchanged
    return ch


def reaches_layer(start: fx.Node, chan: Chan, limit: int = 256) -> bool:
    """True when a Linear / conv downstream of ``start`` (through view-like and layout-keeping ops) contracts the
    axis ``chan`` names: that axis is a channel axis of the model. Layout only: no affine flows along this walk."""
    todo, seen = [(start, chan)], set[fx.Node]()
    while todo and len(seen) < limit:
        node, ch = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            layer = layer_of(user)
            rule = RULE_OF.get(user.target)
            if layer is not None:
                if user.args[layer.data_arg] is node and ch.plain and layer.in_axis(user) == ch.axis:
                    return True
            elif user.target is operator.getitem:
                todo.append((user, ch))
            elif rule is not None and rule.view_like and user.args and user.args[0] is node:
                outcome = rule.step(user, node, ch)
                if isinstance(outcome, Pass):
                    todo.append((user, outcome.chan))
            elif _layout_input(user) is not None and same_shape(shape_of(user), shape_of(node)):
                todo.append((user, ch))
    return False
