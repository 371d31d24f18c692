r"""Norm discovery: every constant per-channel affine of a tensor, recognised by the value it computes.

In: an export graph (``slabconv.engine.capture``). Out: one ``NormSite`` per norm, in graph order:
``output = scale * input + shift`` per channel on ``channel_axis`` of ``input``, with the nodes that compute it
(``region``, removed when it is folded), its ``kind`` and its stored parameters.

Which patterns count (``docs/reasons.md``, "Which patterns count"):

1. Every BatchNorm op (``aten.batch_norm`` and its core-ATen forms, ``BN_LAYOUT``), in eval or train mode, is a
   norm of its own: ``BatchNorm``. Its statistics may be stored or computed from stored tensors only.
2. Ops that follow it elementwise with constants keep extending it while the result is still one per-channel
   affine of the BN's input on its channel axis: ``+ / - / *`` by a constant scalar or a constant vector on that
   axis, and ``+ / -`` of another affine of the same input, which is how RepBN writes ``BN(x) + alpha * x``
   (SLAB eq. 4): ``RepBN``. Two ops that compute the same value are the same input (``x.transpose(1, 2)``
   written twice; ``value_numbers`` is common-subexpression analysis on the graph).
3. Without a BN op, a multiplication of a tensor ``x`` by a constant vector along one channel axis of ``x``
   starts a norm, extended as in 2: ``FrozenBatchNorm`` when its constants normalise by a stored variance
   (``rsqrt`` / ``sqrt`` of stored tensors, torchvision's ``FrozenBatchNorm2d``), else ``Affine`` when a constant
   is added (MobileBERT's ``NoNorm``: ``x * weight + bias``), else ``LayerScale`` (``gamma * x``). The axis must
   be a channel axis: the channel axis of the Linear / conv / norm that produced ``x`` (through view-like and
   elementwise ops), or an axis that a Linear / conv downstream contracts. A vector over a token axis is not a
   norm.

Not norms: products with Python scalars or one-element constants alone (attention's ``q * scale``), constant
additions alone (a bias, a position embedding), anything that reads the input twice (``x * x``). "Constant" means
computed from parameters, buffers and constants only, never from the model's input; such subgraphs are evaluated
once, in float64.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops
from torch.utils._pytree import tree_map

from slabconv import fold
from slabconv.engine.capture import attr, module_path, same_size, shape_of, static_int
from slabconv.engine.flow import reaches_layer, source_chan
from slabconv.engine.layers import LAYER_OF
from slabconv.engine.rules import VIEW_OPS, Chan
from slabconv.errors import UnsupportedModelError

aten = torch.ops.aten
Tensor = torch.Tensor

# BatchNorm ops as they appear in export graphs (``aten.batch_norm``) and in core-ATen / decomposed programs:
# op -> (positions of input, weight, bias, running_mean, running_var; training flag position or constant; eps
# position; returns a tuple whose item 0 is the output).
BN_LAYOUT: dict[Any, tuple[tuple[int | None, ...], int | bool, int, bool]] = {
    aten.batch_norm.default: ((0, 1, 2, 3, 4), 5, 7, False),
    aten._native_batch_norm_legit_no_training.default: ((0, 1, 2, 3, 4), False, 6, True),
    aten._native_batch_norm_legit.default: ((0, 1, 2, 3, 4), 5, 7, True),
    aten._native_batch_norm_legit.no_stats: ((0, 1, 2, None, None), 3, 5, True),
    aten._native_batch_norm_legit_functional.default: ((0, 1, 2, 3, 4), 5, 7, True),
    aten.native_batch_norm.default: ((0, 1, 2, 3, 4), 5, 7, True),
}
for _name, _layout in (
    ("_batch_norm_with_update", ((0, 1, 2, 3, 4), True, 6, True)),
    ("_batch_norm_no_update", ((0, 1, 2, 3, 4), False, 6, True)),
):
    if hasattr(aten, _name):
        BN_LAYOUT[getattr(aten, _name).default] = _layout  # type: ignore[assignment]
BN_OPS = set(BN_LAYOUT)
_BN_ROLES = ("weight", "bias", "running_mean", "running_var")


def is_batch_norm(node: fx.Node) -> bool:
    """True for an aten batch-norm call (any of the ``BN_LAYOUT`` overloads), in train or eval form."""
    return node.op == "call_function" and node.target in BN_LAYOUT


def bn_args(node: fx.Node) -> tuple[Any, ...]:
    """``(input, weight, bias, running_mean, running_var, training, eps)`` of a BN node (see ``BN_LAYOUT``)."""
    positions, training, eps, _ = BN_LAYOUT[node.target]
    a = node.args
    tensors = [a[i] if i is not None else None for i in positions]
    flag = bool(a[training]) if not isinstance(training, bool) else training
    return (*tensors, flag, float(a[eps]))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- the norm


@dataclass
class NormSite:
    """One norm found in the graph: ``output = scale * input + shift`` per channel on ``channel_axis``.

    Attributes:
        name: module path of the norm (e.g. ``blocks.0.norm1``), or its first node's name without module
            metadata.
        kind: ``BatchNorm``, ``RepBN``, ``FrozenBatchNorm``, ``Affine`` or ``LayerScale``.
        input: the tensor the norm reads (``(B, C, ...)`` for a BN, any layout for the others);
            ``output`` the node whose value is the norm's output (same shape and dtype).
        region: the nodes that compute the norm, in graph order (removed when it is folded).
        channel_axis: the axis of ``input`` that holds the channels.
        training: a BN op in training mode or without running statistics (not a fixed affine).
        scale, shift: the per-channel affine, ``(C,)`` float64 (SLAB Lemma 4.1 for a BN / RepBN); None when
            ``training``.
        params: for BN kinds ``running_mean``, ``running_var``, ``weight``, ``bias``, ``alpha`` (tensors or
            None); for the others ``scale`` and ``shift`` (``(C,)`` float64).
        eps: the BN eps stored in the graph (0.0 without a BN op).
        param_names: the dotted name of the stored tensor behind each of ``params`` (None where absent or
            computed).
    """

    name: str
    kind: str
    input: fx.Node
    output: fx.Node
    region: list[fx.Node]
    channel_axis: int
    training: bool
    params: dict[str, torch.Tensor | None]
    eps: float
    param_names: dict[str, str | None] = field(default_factory=dict)
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    input_slot: tuple[fx.Node, int] | None = None

    @property
    def channels(self) -> int:
        shape = shape_of(self.input)
        assert shape is not None
        return int(shape[self.channel_axis])

    @property
    def bn(self) -> fx.Node | None:
        """The BN op of a BN kind, None for the others."""
        return next((n for n in self.region if is_batch_norm(n)), None)

    @property
    def anchor(self) -> fx.Node:
        """The norm's first op (its module metadata names the norm)."""
        return self.region[0]

    def current_input(self) -> fx.Node:
        """The node the norm reads now: ``input``, or what replaced it once earlier norms rewrote the graph (their
        input for a removed norm, their kept affine)."""
        if self.input_slot is None:
            return self.input
        node, position = self.input_slot
        current = node.args[position]
        assert isinstance(current, fx.Node)
        return current


def _input_slot(region: list[fx.Node], base: fx.Node) -> tuple[fx.Node, int]:
    """One of the norm's ops that reads its input, and the argument position."""
    for node in region:
        for i, a in enumerate(node.args):
            if a is base:
                return node, i
    raise AssertionError(f"no node of {region} reads {base}")


# --------------------------------------------------------------------------------------------- constants


class Constants:
    """Which nodes are constant (computed from stored tensors and literals only) and their values in float64."""

    # random ops (the list torch's own CSE pass bans) and uninitialised memory are never constants
    _BANNED = get_CSE_banned_ops() | {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty}

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self._const: dict[fx.Node, bool] = {}
        self._value: dict[fx.Node, Any] = {}

    def is_const(self, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return True
        if node not in self._const:
            self._const[node] = self._check(node)
        return self._const[node]

    def _check(self, node: fx.Node) -> bool:
        if node.op == "get_attr":
            return True
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) in self._BANNED:
            return False
        return all(self.is_const(a) for a in node.all_input_nodes)

    def value(self, node: Any) -> Any:
        """The value of a constant (tensors read from the model in float64, then the ops run on them)."""
        if not isinstance(node, fx.Node):
            return node
        if node not in self._value:
            if node.op == "get_attr":
                t = attr(self.gm, node)
                assert t is not None
                self._value[node] = t.detach().double() if t.is_floating_point() else t.detach()
            else:
                args, kwargs = tree_map(self.value, (node.args, node.kwargs))
                self._value[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        return self._value[node]

    def ancestors(self, node: fx.Node) -> Iterable[fx.Node]:
        """Every node of a constant's subgraph."""
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += n.all_input_nodes
                yield n


# --------------------------------------------------------------------------------------------- value numbers


def _pure(node: fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    schema = getattr(node.target, "_schema", None)
    mutable = schema is not None and schema.is_mutable
    return node.op == "call_function" and packet not in Constants._BANNED and not mutable and not is_batch_norm(node)


def value_numbers(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Common-subexpression analysis: each node -> the first node that computes the same value (itself when it
    is the first). Pure ops with the same target and the same (canonical) arguments are the same value;
    ``get_attr`` nodes of the same tensor too. The graph is not changed."""
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}

    def key(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return rep[a]
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(key, a))
        if isinstance(a, dict):
            return tuple(sorted((k, key(v)) for k, v in a.items()))
        return (type(a).__name__, a)

    for node in gm.graph.nodes:
        rep[node] = node  # placeholders, impure ops and BN ops stand for themselves
        if node.op == "get_attr" or _pure(node):
            k: Any = (
                ("get_attr", node.target) if node.op == "get_attr" else (node.target, key(node.args), key(node.kwargs))
            )
            try:
                rep[node] = seen.setdefault(k, node)
            except TypeError:  # an unhashable literal argument: the node stands for itself
                rep[node] = node
    return rep


# --------------------------------------------------------------------------------------------- affine values


@dataclass(frozen=True)
class Affine:
    """``node = scale * base + shift`` per channel on ``axis`` of ``base`` (``axis`` None: scalars only).

    ``scale`` / ``shift`` are float64 scalars or ``(C,)`` vectors (None when not constant: a BN in train mode).
    ``nodes`` compute it from ``base``; ``bns`` are the BN ops among them; ``seeded``: a BN op or a product with
    a per-channel constant (a norm, not a mere rescaling); ``base_term``: a multiple of ``base`` is added beside
    a BN (RepBN's ``eta x``, ``eta`` in ``eta``); ``shifted``: a constant is added; ``consts``: the constant
    operands; ``dups``: other nodes with ``base``'s value that the nodes read; ``core``: the nodes that name the
    norm (a BN op and RepBN's ``eta x`` term; all nodes without a BN op).
    """

    base: fx.Node
    axis: int | None
    scale: Tensor | None
    shift: Tensor | None
    nodes: tuple[fx.Node, ...] = ()
    bns: tuple[fx.Node, ...] = ()
    seeded: bool = False
    base_term: bool = False
    shifted: bool = False
    consts: tuple[Any, ...] = ()
    dups: tuple[fx.Node, ...] = ()
    eta: Any = None
    core: tuple[fx.Node, ...] = ()


def _identity(node: fx.Node) -> Affine:
    return Affine(node, None, torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))


def _axis(a: int | None, b: int | None) -> int | None | bool:
    """The common channel axis of two affines (None: both scalar); False when they disagree."""
    return a if b is None else b if a is None or a == b else False


def _mul(t: Tensor | None, c: Tensor) -> Tensor | None:
    return None if t is None else t * c


def _add(t: Tensor | None, u: Tensor | None) -> Tensor | None:
    return None if t is None or u is None else t + u


class _Analysis:
    """The affine value of every node (``Affine``) in one pass over the graph, in graph order."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.consts = Constants(gm)
        self.rep = value_numbers(gm)
        self.aff: dict[fx.Node, Affine] = {}
        self.fresh: dict[fx.Node, Affine] = {}  # a per-channel product as a norm of its own input
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self._visit(node)

    def get(self, node: fx.Node) -> Affine:
        return self.aff.get(node) or _identity(node)

    def _constant(self, c: Any, like: fx.Node, out: fx.Node) -> tuple[Tensor, int | None] | None:
        """``(value, axis)`` when ``c`` is a constant scalar (axis None) or a constant vector along one axis of
        ``like`` (value ``(C,)``) and ``like op c`` keeps ``like``'s shape and dtype."""
        if isinstance(c, bool) or not isinstance(c, (int, float, fx.Node)):
            return None
        if not (shape_of(out) and _same(shape_of(out), shape_of(like)) and _dtype(out) == _dtype(like)):
            return None
        if not isinstance(c, fx.Node):
            return torch.tensor(float(c), dtype=torch.float64), None
        if not self.consts.is_const(c) or shape_of(c) is None:
            return None
        axis = _vector_axis(shape_of(c), shape_of(like))  # type: ignore[arg-type]
        if axis is False:
            return None
        try:
            value = torch.as_tensor(self.consts.value(c)).detach().double()
        except Exception:  # noqa: BLE001 - a constant that cannot be evaluated here is not taken as one
            return None
        return (value.reshape(()) if axis is None else value.reshape(-1)), axis  # type: ignore[return-value]

    def _visit(self, node: fx.Node) -> None:
        t = node.target
        if is_batch_norm(node):
            self._bn(node)
        elif t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            self._product(node, divide=t in (aten.div.Tensor, aten.div.Scalar))
        elif t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar):
            self._sum(node)
        elif t is aten.neg.default and isinstance(node.args[0], fx.Node) and not self.consts.is_const(node.args[0]):
            self.aff[node] = replace(
                self._scaled(self.get(node.args[0]), -1.0), nodes=(*self.get(node.args[0]).nodes, node)
            )

    def _bn(self, node: fx.Node) -> None:
        x, w, b, mean, var, training, eps = bn_args(node)
        tensors = {"weight": w, "bias": b, "running_mean": mean, "running_var": var}
        if any(isinstance(v, fx.Node) and not self.consts.is_const(v) for v in tensors.values()):
            raise UnsupportedModelError(
                f"BatchNorm node {node.name}: its weight or statistics are computed, not stored parameters "
                "(they depend on the model's input)"
            )
        out, nodes = node, [node]
        if BN_LAYOUT[node.target][3]:
            getters = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
            if len(getters) != 1 and not training:
                raise UnsupportedModelError(f"BatchNorm node {node.name} has an unexpected output structure")
            if not getters:
                return
            out = getters[0]
            nodes.append(out)
        scale = shift = None
        if not training and mean is not None and var is not None:
            v = {k: self.consts.value(n) for k, n in tensors.items()}
            scale, shift = fold.repbn_affine(v["running_mean"], v["running_var"], eps, v["weight"], v["bias"])
        self.aff[out] = Affine(x, 1, scale, shift, tuple(nodes), (node,), seeded=True, core=tuple(nodes))

    def _product(self, node: fx.Node, divide: bool) -> None:
        a, c = node.args[0], node.args[1]
        if not divide and isinstance(c, fx.Node) and not self.consts.is_const(c):
            a, c = c, a
        if not isinstance(a, fx.Node) or self.consts.is_const(a):
            return
        found = self._constant(c, a, node)
        if found is None:
            return
        value, axis = found
        if divide:
            if bool((value == 0).any()):
                return
            value = 1.0 / value
        vector = axis is not None
        base = self.get(a)
        common = _axis(base.axis, axis)
        if common is not False:
            self.aff[node] = replace(
                base,
                axis=common,
                scale=_mul(base.scale, value),
                shift=_mul(base.shift, value),
                nodes=(*base.nodes, node),
                seeded=base.seeded or vector,
                consts=(*base.consts, c),
            )
        if vector and (common is False or a in self.aff):
            zero = torch.zeros_like(value)
            self.fresh[node] = Affine(a, axis, value, zero, (node,), seeded=True, consts=(c,))

    def _sum(self, node: fx.Node) -> None:
        """``x + k y`` (``add`` / ``sub`` with their ``alpha``) and ``c - x`` (``rsub``)."""
        x, y = node.args[0], node.args[1]
        k = float(node.kwargs.get("alpha", 1))  # type: ignore[arg-type]
        k = -k if node.target in (aten.sub.Tensor, aten.sub.Scalar) else k
        if node.target is aten.rsub.Scalar:
            x, y, k = y, x, -k  # c - k x: the affine side is y = x, scaled by -k
        live = [isinstance(a, fx.Node) and not self.consts.is_const(a) for a in (x, y)]
        if all(live):
            self._combine(node, self.get(x), self._scaled(self.get(y), k), k == 1.0)  # type: ignore[arg-type]
        elif live[0] and node.target is not aten.rsub.Scalar:
            self._shift(node, self.get(x), y, k)  # type: ignore[arg-type]
        elif live[1]:
            self._shift(node, self._scaled(self.get(y), k), x, 1.0)  # type: ignore[arg-type]

    def _shift(self, node: fx.Node, left: Affine, c: Any, k: float) -> None:
        """``left + k c`` for a constant ``c``."""
        found = self._constant(c, left.base, node)
        if found is None:
            return
        value, axis = found
        common = _axis(left.axis, axis)
        if common is not False:
            self.aff[node] = replace(
                left,
                axis=common,
                shift=_add(left.shift, value * k),
                nodes=(*left.nodes, node),
                shifted=True,
                consts=(*left.consts, c),
            )

    @staticmethod
    def _scaled(a: Affine, k: float) -> Affine:
        if k == 1.0:
            return a
        c = torch.tensor(k, dtype=torch.float64)
        return replace(a, scale=_mul(a.scale, c), shift=_mul(a.shift, c), eta=None)

    def _combine(self, node: fx.Node, left: Affine, right: Affine, plain: bool) -> None:
        """``left + right``: one affine when both are affines of the same value (RepBN's ``BN(x) + eta x``).
        ``plain``: ``right`` is added as it is (not negated or scaled)."""
        if self.rep[left.base] is not self.rep[right.base] or left.nodes == right.nodes == ():
            return
        if left.bns and right.bns:
            return  # each BN op is a norm of its own
        common = _axis(left.axis, right.axis)
        if common is False or not _same(shape_of(node), shape_of(left.base)):
            return
        with_bn, other = (left, right) if left.bns else (right, left)
        base_term = bool(with_bn.bns) and not other.bns
        eta = with_bn.eta
        if base_term and other.scale is not None and other.scale.dim() == 0 and not other.shifted:
            single = plain and len(other.nodes) == 1 and len(other.consts) == 1
            eta = 1.0 if other.nodes == () and plain else other.consts[0] if single else float(other.scale)
        base = self.rep[with_bn.base]  # the first node with this value: every reader of a duplicate comes after it
        dups = {*left.dups, *right.dups, left.base, right.base} - {base}
        nodes = (*left.nodes, *right.nodes, node)
        core = nodes if base_term and not with_bn.base_term else with_bn.core
        self.aff[node] = Affine(
            base,
            common,
            _add(left.scale, right.scale),
            _add(left.shift, right.shift),
            nodes,
            (*left.bns, *right.bns),
            left.seeded or right.seeded,
            base_term or left.base_term or right.base_term,
            left.shifted or right.shifted,
            (*left.consts, *right.consts),
            tuple(dups),
            eta,
            core,
        )


def _same(a: Any, b: Any) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def _dtype(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _vector_axis(const: tuple[Any, ...], x: tuple[Any, ...]) -> int | None | bool:
    """The one axis of ``x`` a constant of shape ``const`` varies along (None: it has one element), False when
    it varies along several axes, broadcasts ``x`` up or does not match ``x``'s size there."""
    sizes = [static_int(s) for s in const]
    if None in sizes or len(const) > len(x):
        return False
    if all(s == 1 for s in sizes):
        return None
    padded = [1] * (len(x) - len(const)) + sizes
    axes = [i for i, s in enumerate(padded) if s != 1]
    if len(axes) != 1 or static_int(x[axes[0]]) != padded[axes[0]]:
        return False
    return axes[0]


# --------------------------------------------------------------------------------------------- regions


def _closed(cand: Affine, out: fx.Node) -> bool:
    """True when nothing outside the candidate reads its intermediate values (so it can be removed whole). A BN
    op's other outputs (batch statistics) are not read as the normalised tensor and do not count."""
    inside = set(cand.nodes)
    for node in cand.nodes:
        if node is out:
            continue
        for user in node.users:
            stats = node in cand.bns and user.target is operator.getitem and user.args[1] != 0
            if user not in inside and not stats:
                return False
    return True


def _known_chan(analysis: _Analysis) -> Callable[[fx.Node], Chan | None]:
    """Nodes whose channel axis is known: a layer's output, a BN's output, any affine value with an axis, the
    features of an embedding or a LayerNorm."""

    def known(node: fx.Node) -> Chan | None:
        shape = shape_of(node)
        if shape is None or node.op != "call_function":
            return None
        layer = LAYER_OF.get(node.target)
        axis: int | None = None
        if layer is not None:
            axis = layer.out_axis(node)
        elif node in analysis.aff and analysis.aff[node].axis is not None:
            axis = analysis.aff[node].axis
        elif node.target is aten.layer_norm.default:
            axis = len(shape) - 1
        size = static_int(shape[axis]) if axis is not None else None
        return Chan(axis, size) if axis is not None and size is not None else None

    return known


def _is_channel_axis(cand: Affine, out: fx.Node, known: Callable[[fx.Node], Chan | None]) -> bool:
    """A per-channel constant without a BN op counts only on a channel axis: the producer's channel axis
    (through view-like and elementwise ops), or one that a Linear / conv downstream contracts."""
    if cand.bns:
        return True
    assert cand.axis is not None
    shape = shape_of(cand.base)
    assert shape is not None
    channels = static_int(shape[cand.axis])
    assert channels is not None
    source = source_chan(cand.base, known)
    if source is not None and source.plain and (source.axis, source.channels) == (cand.axis, channels):
        return True
    return reaches_layer(out, Chan(cand.axis, channels))


def _is_norm(cand: Affine | None, out: fx.Node, claimed: set[fx.Node], known: Callable[[fx.Node], Chan | None]) -> bool:
    """A norm: a BN op or a per-channel constant product (``seeded``) on a channel axis, whose ops nothing outside
    reads (``_closed``) and no norm chosen before holds."""
    return (
        cand is not None
        and cand.seeded
        and (cand.axis is not None or bool(cand.bns))
        and not claimed.intersection(cand.nodes)
        and _closed(cand, out)
        and _is_channel_axis(cand, out, known)
    )


def _choose(analysis: _Analysis) -> list[tuple[fx.Node, Affine]]:
    """The norms: from the graph's end, the largest affine ending at each node that is a norm (``_is_norm``),
    else the per-channel product at that node alone; in graph order."""
    known = _known_chan(analysis)
    claimed: set[fx.Node] = set()
    chosen: list[tuple[fx.Node, Affine]] = []
    for node in reversed(analysis.gm.graph.nodes):
        cand = next(
            (c for c in (analysis.aff.get(node), analysis.fresh.get(node)) if _is_norm(c, node, claimed, known)), None
        )
        if cand is not None:
            claimed.update(cand.nodes)
            chosen.append((node, cand))
    return chosen[::-1]


# --------------------------------------------------------------------------------------------- sites


def _name_norm(gm: fx.GraphModule, region: list[fx.Node], fallback: str) -> str:
    """The norm's module path: the deepest module holding the whole region, climbed while the parent
    module runs nothing else in the graph but view-like ops (a ``LinearNorm`` in eval mode is just its ``norm2``;
    PatchTST's ``Sequential(Transpose, BatchNorm1d, Transpose)`` is the norm)."""
    paths = [module_path(n) for n in region]
    if not all(paths):
        return fallback
    common: list[str] = []
    for level in zip(*paths, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if not common:
        return fallback
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target not in VIEW_OPS:
            for p in module_path(n):
                counts[p] = counts.get(p, 0) + 1
    i = len(common) - 1
    while i > 0 and counts.get(common[i - 1], 0) == counts.get(common[i], 0):
        i -= 1
    return common[i]


def _stored_name(node: Any) -> str | None:
    """The dotted name of the stored tensor a constant reads directly (through view-like ops), else None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return str(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _kind(analysis: _Analysis, cand: Affine) -> str:
    if cand.bns:
        return "RepBN" if cand.base_term else "BatchNorm"
    normalising = {aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.reciprocal.default}
    for c in cand.consts:
        if isinstance(c, fx.Node) and any(n.target in normalising for n in analysis.consts.ancestors(c)):
            return "FrozenBatchNorm"
    return "Affine" if cand.shifted else "LayerScale"


def _params(
    analysis: _Analysis, cand: Affine, region: list[fx.Node]
) -> tuple[dict[str, Tensor | None], dict[str, str | None], float]:
    """``params``, ``param_names`` and ``eps`` of a norm (see ``NormSite``)."""
    if not cand.bns:
        c = cand.scale.shape[0] if cand.scale is not None and cand.scale.dim() else 1
        scale, shift = (torch.broadcast_to(t, (c,)) if t is not None else None for t in (cand.scale, cand.shift))
        ops = [n.target for n in region]
        names: dict[str, str | None] = {"scale": None, "shift": None}
        if ops[:1] == [aten.mul.Tensor] and ops[1:] in ([], [aten.add.Tensor]):
            names["scale"] = _stored_name(cand.consts[0])
            names["shift"] = _stored_name(cand.consts[1]) if len(ops) == 2 else None
        return {"scale": scale, "shift": shift}, names, 0.0
    _, w, b, mean, var, _, eps = bn_args(cand.bns[0])
    nodes = {"weight": w, "bias": b, "running_mean": mean, "running_var": var}
    params: dict[str, Tensor | None] = {}
    for role, n in nodes.items():
        value = analysis.consts.value(n) if n is not None else None
        params[role] = attr(analysis.gm, n) if isinstance(n, fx.Node) and n.op == "get_attr" else value
    names = {role: _stored_name(n) for role, n in nodes.items()}
    eta = cand.eta
    if isinstance(eta, fx.Node):
        params["alpha"] = attr(analysis.gm, eta) if eta.op == "get_attr" else analysis.consts.value(eta)
    else:
        params["alpha"] = torch.tensor([float(eta)], dtype=torch.float64) if eta is not None else None
    names["alpha"] = _stored_name(eta)
    return params, names, eps


def _site(analysis: _Analysis, out: fx.Node, cand: Affine, base: fx.Node) -> NormSite:
    order = {n: i for i, n in enumerate(analysis.gm.graph.nodes)}
    region = sorted(cand.nodes, key=order.__getitem__)
    params, names, eps = _params(analysis, cand, region)
    core = sorted(cand.core, key=order.__getitem__) if cand.bns else region
    c = int(static_int(shape_of(base)[cand.axis if cand.axis is not None else 1]))  # type: ignore[arg-type,index]
    scale, shift = cand.scale, cand.shift
    if scale is not None and shift is not None:
        scale, shift = torch.broadcast_to(scale, (c,)).clone(), torch.broadcast_to(shift, (c,)).clone()
    name = _name_norm(analysis.gm, core, "")
    if not name and cand.bns:  # RepBN's eta x written outside any module: the BN's own module names it
        name = _name_norm(analysis.gm, [n for n in region if n in cand.bns or n.target is operator.getitem], "")
    if not cand.bns and names["scale"]:  # a stored scale names its norm (``ls1.gamma``, ``norm.weight`` -> ``norm``)
        name = names["scale"].removesuffix(".weight")
    return NormSite(
        name=name or region[0].name,
        kind=_kind(analysis, cand),
        input=base,
        output=out,
        region=region,
        channel_axis=cand.axis if cand.axis is not None else 1,
        training=cand.scale is None,
        params=params,
        eps=eps,
        param_names=names,
        scale=scale,
        shift=shift,
        input_slot=_input_slot(region, base),
    )


def _merge_duplicates(
    gm: fx.GraphModule, chosen: list[tuple[fx.Node, Affine]], rep: dict[fx.Node, fx.Node]
) -> dict[fx.Node, fx.Node]:
    """Make each norm read one input node: the other nodes computing the same value (``x.transpose(1, 2)``
    written twice) are replaced by it and erased when nothing else reads them. Returns replaced -> kept."""
    replaced: dict[fx.Node, fx.Node] = {}
    for _, cand in chosen:
        keep = cand.base
        while keep in replaced:
            keep = replaced[keep]
        for dup in cand.dups:
            if dup in replaced or dup is keep:
                continue
            dup.replace_all_uses_with(keep)
            replaced[dup] = keep
            todo = [dup]
            while todo:
                node = todo.pop()
                erased = getattr(node, "_erased", False)
                if not erased and not node.users and _pure(node) and rep[node] is not node:
                    todo += node.all_input_nodes
                    gm.graph.erase_node(node)
    return replaced


def find_norms(gm: fx.GraphModule) -> list[NormSite]:
    """Every norm of the graph (see the module docstring for which patterns count), in graph order.

    The graph computes the same values afterwards; it may change in one way: where a norm reads two nodes that
    compute the same value (``bn(x.transpose(1, 2)) + alpha * x.transpose(1, 2)``), they become one.

    Raises:
        UnsupportedModelError: a BN op whose weight or statistics depend on the model's input, or whose outputs
            are not read the usual way.
    """
    analysis = _Analysis(gm)
    chosen = _choose(analysis)
    replaced = _merge_duplicates(gm, chosen, analysis.rep)

    def kept(node: fx.Node) -> fx.Node:
        while node in replaced:
            node = replaced[node]
        return node

    return [_site(analysis, out, cand, kept(cand.base)) for out, cand in chosen]
