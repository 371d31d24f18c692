"""The values a graph computes, as per-channel affines of one input: BatchNorm ops in every form export graphs
write (``BN_LAYOUT``), constant subgraphs evaluated once in float64 (``Constants``), common subexpressions
(``value_numbers``) and, for every node, the affine ``scale * x + shift`` of some input it computes, if any
(``Affine``, one pass in graph order). ``slabconv.engine.norms`` chooses the norms among them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops
from torch.utils._pytree import tree_leaves, tree_map

from slabconv import fold
from slabconv.engine.capture import attr, is_state, same_size, shape_of, static_int, stored
from slabconv.engine.rules import PERMUTE_OPS, VIEW_OPS, permutation
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


def _reads_input(node: fx.Node) -> bool:
    """True when ``node`` is computed from a graph input (a placeholder among its ancestors)."""
    return any(n.op == "placeholder" for n in Constants.ancestors(node))


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


MARK = "slabconv_norm_affine"
"""``node.meta`` key on the multiply (value: the norm's kind, ``LayerNorm`` ...) and add (``"shift"``) of a
LayerNorm / RMSNorm / GroupNorm affine split from its op (``slabconv.engine.norm_affine``)."""

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
        """Whether ``node`` is computed from stored tensors and literals only. Walked with a stack, not recursion:
        a value's inputs may go back thousands of nodes (a deep network's residual stream)."""
        if not isinstance(node, fx.Node):
            return True
        todo = [node]
        while todo:
            n = todo[-1]
            if n in self._const:
                todo.pop()
                continue
            own = self._own(n)
            if own is not None:
                self._const[n] = own
                todo.pop()
                continue
            for a in n.all_input_nodes:  # the first input not yet known is walked first; a non-constant one ends it
                if a not in self._const:
                    todo.append(a)
                    break
                if not self._const[a]:
                    self._const[n] = False
                    todo.pop()
                    break
            else:
                self._const[n] = True
                todo.pop()
        return self._const[node]

    def _own(self, node: fx.Node) -> bool | None:
        """Whether ``node`` is constant whatever its inputs are (``None``: as constant as its inputs)."""
        if node.op == "get_attr":  # a stored tensor; not a submodule (the body of a higher-order op)
            return isinstance(stored(self.gm, str(node.target)), torch.Tensor)
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) in self._BANNED:
            return False
        if isinstance(node.target, torch._ops.HigherOrderOperator):  # runs a submodule (``torch.no_grad()`` code)
            return False
        if getattr(node.target, "runs", True) is False:  # an op the engine cannot run (an opaque ONNX node)
            return False
        if any(isinstance(a, torch.SymInt) and not is_concrete_int(a) for a in tree_leaves((node.args, node.kwargs))):
            return False  # sized by a symbol (a lowered ONNX ``Expand`` to a dynamic batch's size): no one value
        return None

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

    @staticmethod
    def ancestors(node: fx.Node) -> Iterable[fx.Node]:
        """``node`` and every node it is computed from (a constant's subgraph), each once."""
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
    ``nodes`` compute it from ``base``; ``bns`` are the BN ops among them; ``seeded``: a BN op, a product with
    a per-channel constant, or a product with a one-element tensor of the model's state (a learned scalar:
    ``stored_scalar``) (a norm, not a mere rescaling by a number); ``base_term``: a multiple of ``base`` is added beside
    a BN (RepBN's ``eta x``, ``eta`` in ``eta``); ``shifted``: a constant is added; ``consts``: the constant
    operands; ``dups``: other nodes with ``base``'s value that the nodes read; ``core``: the nodes that name the
    norm (a BN op and RepBN's ``eta x`` term; all nodes without a BN op); ``before``: where the BN op reads an
    affine of ``base`` composed into this one (``bn(s1 x + t1)``), that affine's ``(s1, t1)``, which maps ``base``
    to the tensor the BN's running statistics describe (None: the BN reads ``base``).
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
    before: tuple[Tensor, Tensor] | None = None


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
        self.back: dict[fx.Node, Affine] = {}  # a permute undoing the one before an affine (``_permuted_back``)
        self.twin: dict[fx.Node, Affine] = {}  # a permuted affine as one of a permute beside it, for sums only
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
        elif t in PERMUTE_OPS and isinstance(node.args[0], fx.Node) and node.args[0] in self.aff:
            self._permuted_back(node)
        elif t is aten.neg.default and isinstance(node.args[0], fx.Node) and not self.consts.is_const(node.args[0]):
            self.aff[node] = replace(
                self._scaled(self.get(node.args[0]), -1.0), nodes=(*self.get(node.args[0]).nodes, node)
            )

    def _bn(self, node: fx.Node) -> None:
        x, w, b, mean, var, training, eps = bn_args(node)
        tensors = {"weight": w, "bias": b, "running_mean": mean, "running_var": var}
        computed = [v for v in tensors.values() if isinstance(v, fx.Node) and not self.consts.is_const(v)]
        if computed and not any(_reads_input(v) for v in computed):
            raise UnsupportedModelError(
                f"BatchNorm node {node.name}: its weight or statistics are computed, not stored parameters "
                "(from tensors the model updates as it runs)"
            )
        if computed:  # statistics of the batch itself, as an exporter writes a BatchNorm without running statistics
            training = True
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
        inner = self._same_layout(x) if isinstance(x, fx.Node) else None
        if scale is not None and shift is not None and inner is not None and self._feeds_only(inner, node):
            # bn(s x + t) with stored statistics: one affine of x, composed in float64 (PP-LCNetV3's
            # LearnableAffineBlock -> BatchNorm2d, BN -> BN, RepBN -> BN); the BN names it and its statistics
            # stay its params
            self.aff[out] = replace(
                inner,
                axis=1,
                scale=inner.scale * scale,  # type: ignore[operator]
                shift=inner.shift * scale + shift,  # type: ignore[operator]
                nodes=(*inner.nodes, *nodes),
                bns=(node,),
                base_term=False,
                shifted=True,
                eta=None,
                core=tuple(nodes),
                before=(inner.scale, inner.shift),  # type: ignore[arg-type]
            )
            return
        self.aff[out] = Affine(x, 1, scale, shift, tuple(nodes), (node,), seeded=True, core=tuple(nodes))

    def _same_layout(self, x: fx.Node) -> Affine | None:
        """The affine of ``x`` (``aff``, or ``back`` after a transpose pair), also where ``x`` is that affine's
        node read through permutes that give back its layout (``y.transpose(1, 2)`` of ``y = bn(z).transpose(1,
        2)``, between two BatchNorms over tokens): ``x`` then holds the same elements in the same places, and the
        permutes join the affine's nodes. None when no such affine is found."""
        chain: list[fx.Node] = []
        a = x
        while True:
            for inner in (self.aff.get(a), self.back.get(a)):
                if inner is not None and _gives_back(chain, a):
                    return replace(inner, nodes=(*inner.nodes, *reversed(chain)))
            if a.target not in PERMUTE_OPS or not isinstance(a.args[0], fx.Node):
                return None
            chain.append(a)
            a = a.args[0]

    @staticmethod
    def _feeds_only(inner: Affine, bn: fx.Node) -> bool:
        """True when ``inner`` is a norm of its own (``seeded``: a BN op in eval mode with stored statistics, a
        per-channel or learned product; not a norm op's split affine) on the BN's channel axis (or scalar), with
        constant values, whose nodes nothing but ``inner`` and ``bn`` reads: the BN's affine composed with it stays
        as closed as the BN alone."""
        if not inner.seeded or inner.axis not in (None, 1) or inner.scale is None or inner.shift is None:
            return False
        if any(MARK in n.meta for n in inner.nodes):
            return False  # the affine of a LayerNorm / RMSNorm / GroupNorm op: it stays that norm's own
        inside = {*inner.nodes, bn}
        return all(set(n.users) <= inside for n in inner.nodes)

    def _permuted_back(self, node: fx.Node) -> None:
        """``permute(a, q)`` where ``a = scale * b + shift`` on axis ``k`` of ``b = permute(y, p)`` and ``q``
        undoes ``p`` (jax2onnx's BatchNorm on tokens: Transpose -> BatchNormalization -> Transpose): the result
        has ``y``'s layout and is the same per-channel affine of ``y``, on ``y``'s axis ``p[k]`` (the vector is
        the same, only its axis moves). A permute that leaves another layout is no affine of any node; nor is one
        whose affine reads a second node computing ``b`` (``dups``: the norm would read that node, not ``y``).

        Kept apart (``back``), not as the node's affine: a sum may read it (``BN(x^T)^T + alpha x``; a constant
        added, ``BN(x^T)^T + c``, is kept apart with it) and a norm may end at it, but ops after it start from the
        node itself, so a RepBN that reads this node (Swin's ``norm1``
        after its patch embedding's norm) still sees its ``alpha x`` term as a multiple of its own input."""
        inner = self.aff[node.args[0]]  # type: ignore[index]
        first, q = inner.base, permutation(node)
        if inner.axis is None or inner.dups or q is None:
            return
        if first.op != "call_function" or first.target not in PERMUTE_OPS:
            twin = self._permuted_twin(first, node, q)
            if twin is not None:
                self.twin[node] = replace(inner, base=twin, axis=q.index(inner.axis), nodes=(*inner.nodes, node))
            return
        p = permutation(first)
        y = first.args[0]
        if p is None or q is None or not isinstance(y, fx.Node) or [p[i] for i in q] != list(range(len(p))):
            return
        if not _same(shape_of(node), shape_of(y)) or _dtype(node) != _dtype(y):
            return
        self.back[node] = replace(
            inner,
            base=y,
            axis=p[inner.axis],
            nodes=(first, *inner.nodes, node),  # ``core`` stays: the permutes do not name the norm
        )

    @staticmethod
    def _permuted_twin(y: fx.Node, node: fx.Node, q: list[int]) -> fx.Node | None:
        """Another reader of ``y`` that permutes it as ``node`` permutes ``y``'s affine (``q``), when there is one:
        ``permute(s y + t, q)`` is then the same per-channel affine of it, on its axis ``q.index(k)``. The
        TorchScript exporter writes RepBN on tokens, ``bn(x^T)^T + alpha x`` with ``x = y^T``, as ``bn(y)^T +
        alpha y^T``: it drops the transpose pair before the BatchNorm, so the two terms read ``y`` and its
        transpose. Kept apart (``twin``) and read by a sum only, whose other term reads the permute: a norm that
        ended at ``node`` would have layers read a permute that no node of it reads, perhaps computed after them."""
        for z in y.users:
            if z is node or z.op != "call_function" or z.target not in PERMUTE_OPS or z.args[0] is not y:
                continue
            if permutation(z) == q and _same(shape_of(z), shape_of(node)) and _dtype(z) == _dtype(node):
                return z
        return None

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
        learned = not vector and stored_scalar(c)
        common = _axis(base.axis, axis)
        if common is not False:
            self.aff[node] = replace(
                base,
                axis=common,
                scale=_mul(base.scale, value),
                shift=_mul(base.shift, value),
                nodes=(*base.nodes, node),
                seeded=base.seeded or vector or learned,
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
            # each operand as it is, else as the affine its transpose pair computes (jax2onnx's RepBN), or as that
            # of the permute beside it the other operand reads (``bn(y)^T + alpha y^T``)
            for left in (self.get(x), self.back.get(x), self.twin.get(x)):  # type: ignore[arg-type]
                for right in (self.get(y), self.back.get(y), self.twin.get(y)):  # type: ignore[arg-type]
                    if left is not None and right is not None and node not in self.aff:
                        self._combine(node, left, self._scaled(right, k), k == 1.0)
        elif live[0] and node.target is not aten.rsub.Scalar:
            self._shift(node, self.get(x), y, k)  # type: ignore[arg-type]
            if x in self.back:  # ``bn(y^T)^T + c``: the constant joins the affine the transpose pair computes
                self._shift(node, self.back[x], y, k, self.back)  # type: ignore[index]
        elif live[1]:
            self._shift(node, self._scaled(self.get(y), k), x, 1.0)  # type: ignore[arg-type]
            if y in self.back:
                self._shift(node, self._scaled(self.back[y], k), x, 1.0, self.back)  # type: ignore[index]

    def _shift(self, node: fx.Node, left: Affine, c: Any, k: float, into: dict[fx.Node, Affine] | None = None) -> None:
        """``left + k c`` for a constant ``c`` (a scalar or a vector on ``left``'s axis), as ``node``'s affine in
        ``into`` (``aff`` unless told)."""
        found = self._constant(c, left.base, node)
        if found is None:
            return
        value, axis = found
        common = _axis(left.axis, axis)
        if common is not False:
            (self.aff if into is None else into)[node] = replace(
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


def stored_scalar(c: Any) -> bool:
    """True when ``c`` reads (through view-like ops) a one-element tensor of the model's state: a learned scale
    such as HGNetV2's ``LearnableAffineBlock.scale`` or a ReZero ``alpha``, not a Python number or a constant
    the forward made (``capture.is_state``)."""
    while isinstance(c, fx.Node) and c.op == "call_function" and c.target in VIEW_OPS and c.args:
        c = c.args[0]
    return isinstance(c, fx.Node) and is_state(c)


def _gives_back(chain: list[fx.Node], a: fx.Node) -> bool:
    """True when ``chain`` (each op reading the next, the last reading ``a``) computes ``a`` again: permutes
    alone whose axis orders compose to the identity (none at all included)."""
    order = list(range(len(shape_of(a) or ())))
    for n in reversed(chain):
        p = permutation(n) if n.target in PERMUTE_OPS else None
        if p is None or len(p) != len(order):
            return False
        order = [order[i] for i in p]
    return order == sorted(order)


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
