"""Data-flow analysis on a ``torch.export`` graph: find every norm, follow its output to every consumer.

The model is captured with ``torch.export`` (a dynamic batch axis where the model allows one) and unlifted
with ``ExportedProgram.module()``: an fx graph of ATen ops whose parameters are ``get_attr`` nodes. Norms are
found by their ops, not by module names: every ``aten.batch_norm`` (or ``_native_batch_norm_legit_no_training``)
is a norm, and when its input ``x`` also feeds ``alpha * x`` that is added to the BN output, the norm is a
RepBN (SLAB eq. 4).

From the norm's output the channel axis is tracked through every op that commutes with a per-channel affine
(DESIGN.md section 2): each op is one entry of ``FORWARD_RULES`` saying where the channel axis goes and whether
the shift picks up a factor (a sum over N tokens multiplies it by N). A path ends at a consumer that can
absorb the affine (Linear on the last axis, unpadded conv on axis 1) or at an op that blocks the fold, with a
named reason (``slabconv.reasons``). Nothing is skipped silently: an op with no rule blocks with
``unsupported-op:<aten op>``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from slabconv import reasons
from slabconv.errors import UnsupportedModelError

aten = torch.ops.aten

BN_OPS = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}


# --------------------------------------------------------------------------------------------- capture


def capture(model: torch.nn.Module, example: torch.Tensor, dynamic_batch: bool = True) -> fx.GraphModule:
    """Export ``model`` (eval mode) with ``torch.export`` and return the unlifted fx ``GraphModule``.

    Args:
        model: the network, already in the state it should be folded in (eval mode).
        example: one example input ``(B, ...)`` with ``B >= 2`` so the batch axis can be symbolic.
        dynamic_batch: mark axis 0 of the input dynamic; falls back to a static batch when the model's code
            specialises it.

    Raises:
        UnsupportedModelError: ``torch.export`` cannot trace the model (the message carries its reason).
    """
    batch = torch.export.Dim("batch")
    attempts = [{"x": {0: batch}}, None] if dynamic_batch else [None]
    last: Exception | None = None
    for shapes in attempts:
        try:
            ep = torch.export.export(model, (example,), dynamic_shapes=(shapes and (shapes["x"],)))
            return ep.module()
        except Exception as err:  # noqa: BLE001 - report torch.export's own reason
            last = err
    first_line = str(last).strip().splitlines()[0] if last else "unknown error"
    raise UnsupportedModelError(f"torch.export could not trace the model: {first_line}")


def attr(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node names, None for None; raises ``TypeError`` for anything else."""
    if node is None:
        return None
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    raise TypeError(f"{node} is not a parameter")


def shape_of(node: fx.Node) -> tuple[Any, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _expr(x: Any) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def same_size(a: Any, b: Any) -> bool:
    """True when two (possibly symbolic) sizes are equal for every value of the symbols."""
    return sympy.simplify(_expr(a) - _expr(b)) == 0


def _prod(sizes: Sequence[Any]) -> sympy.Expr:
    out: sympy.Expr = sympy.Integer(1)
    for s in sizes:
        out = out * _expr(s)
    return out


def static_int(x: Any) -> int | None:
    e = _expr(x)
    return int(e) if e.is_Integer else None


def module_path(node: fx.Node) -> list[str]:
    """Module paths enclosing ``node``, outermost first (from ``nn_module_stack``; root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [fqn for fqn, _ in stack.values() if fqn]


def module_types(node: fx.Node) -> dict[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    return {fqn: str(kind) for fqn, kind in stack.values() if fqn}


# --------------------------------------------------------------------------------------------- norms


@dataclass
class NormSite:
    """One norm found in the graph: ``output = scale * input + shift`` per channel on ``channel_axis``.

    Attributes:
        name: module path of the norm (e.g. ``blocks.0.norm1``), or the BN node's name when the graph has no
            module metadata.
        kind: ``RepBN`` (BN plus ``alpha * x``) or ``BatchNorm``.
        bn: the BN node; ``input`` is its input tensor, ``output`` the node whose value is the norm's output.
        region: the nodes that compute the norm (BN, getitem, mul, add), removed when it is folded.
        channel_axis: 1 (BatchNorm's channel axis on its input).
        training: the BN op runs in training mode (batch statistics).
        params: ``running_mean``, ``running_var``, ``weight``, ``bias``, ``alpha`` tensors (or None).
        eps: the BN eps stored in the graph.
    """

    name: str
    kind: str
    bn: fx.Node
    input: fx.Node
    output: fx.Node
    region: list[fx.Node]
    channel_axis: int
    training: bool
    params: dict[str, torch.Tensor | None]
    eps: float
    param_targets: list[str] = field(default_factory=list)

    @property
    def channels(self) -> int:
        shape = shape_of(self.input)
        assert shape is not None
        return int(shape[self.channel_axis])


def _bn_args(node: fx.Node) -> tuple[Any, ...]:
    """``(input, weight, bias, running_mean, running_var, training, eps)`` of a BN node."""
    a = node.args
    if node.target is aten.batch_norm.default:
        return a[0], a[1], a[2], a[3], a[4], bool(a[5]), float(a[7])
    return a[0], a[1], a[2], a[3], a[4], False, float(a[6])


def _scalar_param(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        t = attr(gm, node)
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            return t
    return None


def _name_norm(gm: fx.GraphModule, region: list[fx.Node], fallback: str) -> str:
    """The norm's module path: the deepest module holding the whole region, climbed while the parent
    module runs nothing else in the graph (a ``LinearNorm`` in eval mode is just its ``norm2``)."""
    paths = [module_path(n) for n in region]
    if not all(paths):
        return fallback
    common: list[str] = []
    for level in zip(*paths):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if not common:
        return fallback
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            for p in module_path(n):
                counts[p] = counts.get(p, 0) + 1
    i = len(common) - 1
    while i > 0 and counts.get(common[i - 1], 0) == counts.get(common[i], 0):
        i -= 1
    return common[i]


def find_norms(gm: fx.GraphModule) -> list[NormSite]:
    """Every BatchNorm / RepBN in the graph, in topological order.

    Raises:
        UnsupportedModelError: a BN op whose statistics are not parameters of the model.
    """
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in BN_OPS:
            continue
        x, w, b, mean, var, training, eps = _bn_args(node)
        region = [node]
        out = node
        if node.target is aten._native_batch_norm_legit_no_training.default:
            getters = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
            if len(getters) != 1:
                raise UnsupportedModelError(f"BatchNorm node {node.name} has an unexpected output structure")
            out = getters[0]
            region.append(out)
        alpha = None
        users = list(out.users)
        if len(users) == 1 and users[0].target is aten.add.Tensor and len(users[0].kwargs) == 0:
            add = users[0]
            other = add.args[1] if add.args[0] is out else add.args[0]
            if (
                isinstance(other, fx.Node)
                and other.target is aten.mul.Tensor
                and len(other.users) == 1
                and x in other.args
            ):
                factor = other.args[1] if other.args[0] is x else other.args[0]
                alpha = _scalar_param(gm, factor)
                if alpha is not None:
                    region += [other, add]
                    out = add
        try:
            params = {
                "running_mean": attr(gm, mean),
                "running_var": attr(gm, var),
                "weight": attr(gm, w),
                "bias": attr(gm, b),
                "alpha": alpha,
            }
        except TypeError:
            raise UnsupportedModelError(
                f"BatchNorm node {node.name}: its weight or statistics are computed, not stored parameters"
            ) from None
        targets = [a.target for a in (w, b, mean, var) if isinstance(a, fx.Node)]
        if alpha is not None:
            mul = region[-2]
            targets += [a.target for a in mul.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        name = _name_norm(gm, region, node.name)
        sites.append(
            NormSite(
                name=name,
                kind="RepBN" if alpha is not None else "BatchNorm",
                bn=node,
                input=x,
                output=out,
                region=region,
                channel_axis=1,
                training=training,
                params=params,
                eps=eps,
                param_targets=targets,
            )
        )
    return sites


# --------------------------------------------------------------------------------------------- forward rules


@dataclass(frozen=True)
class Pass:
    """The op commutes with the affine: the channel axis is now ``axis``; the shift is multiplied by ``mult``."""

    axis: int
    mult: float = 1.0
    needs_positive_scale: bool = False


@dataclass(frozen=True)
class Consumer:
    """The op absorbs the affine: ``kind`` is ``linear`` or ``conv``; ``weight`` is its get_attr node."""

    kind: str
    weight: fx.Node


@dataclass(frozen=True)
class Block:
    """The op breaks the fold; ``reason`` is one of ``slabconv.reasons``."""

    reason: str


Outcome = Pass | Consumer | Block
Rule = Callable[[fx.Node, fx.Node, int], Outcome]


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _rank(node: fx.Node) -> int:
    shape = shape_of(node)
    if shape is None:
        raise UnsupportedModelError(f"node {node.name} has no shape metadata")
    return len(shape)


def _passthrough(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Pass(axis)


def _dropout(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train", False)
    return Block(reasons.TRAIN_MODE) if train else Pass(axis)


def _transpose(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    rank = _rank(src)
    d0, d1 = _norm_dim(user.args[1], rank), _norm_dim(user.args[2], rank)
    return Pass(d1 if axis == d0 else d0 if axis == d1 else axis)


def _t(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Pass(1 - axis) if _rank(src) == 2 else Pass(axis)


def _permute(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    rank = _rank(src)
    dims = [_norm_dim(d, rank) for d in user.args[1]]
    return Pass(dims.index(axis))


def _view(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    """A reshape keeps the channel axis whole when some output axis has size C with the same number of
    elements before and after it as the input's channel axis."""
    ins, outs = shape_of(src), shape_of(user)
    if ins is None or outs is None:
        return Block(reasons.unsupported(user))
    before, after = _prod(ins[:axis]), _prod(ins[axis + 1 :])
    for k, size in enumerate(outs):
        if (
            same_size(size, ins[axis])
            and sympy.simplify(_prod(outs[:k]) - before) == 0
            and sympy.simplify(_prod(outs[k + 1 :]) - after) == 0
        ):
            return Pass(k)
    return Block(reasons.CHANNEL_MIXING_RESHAPE)


def _select(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    dim = _norm_dim(user.args[1], _rank(src))
    if dim == axis:
        return Block(reasons.unsupported(user))
    return Pass(axis - 1 if dim < axis else axis)


def _slice(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    dim = _norm_dim(user.args[1] if len(user.args) > 1 else 0, _rank(src))
    if dim == axis and not same_size(shape_of(user)[axis], shape_of(src)[axis]):  # type: ignore[index]
        return Block(reasons.unsupported(user))
    return Pass(axis)


def _index(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    """``x[idx]`` with index tensors on token axes only; the channel axis is found by its place after the
    indexed axes (PyTorch puts the broadcast index dims where the first indexed axis was when they are
    adjacent)."""
    indices = list(user.args[1])
    used = [i for i, ix in enumerate(indices) if ix is not None]
    if axis in used or not used or used != list(range(used[0], used[-1] + 1)):
        return Block(reasons.unsupported(user))
    if axis < used[0]:
        return Pass(axis)
    ins, outs = shape_of(src), shape_of(user)
    assert ins is not None and outs is not None
    return Pass(len(outs) - (len(ins) - axis))


def _index_select(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    if user.args[0] is not src or _norm_dim(user.args[1], _rank(src)) == axis:
        return Block(reasons.unsupported(user))
    return Pass(axis)


def _gather(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    if user.args[0] is not src or _norm_dim(user.args[1], _rank(src)) == axis:
        return Block(reasons.unsupported(user))
    index = user.args[2]
    if not isinstance(index, fx.Node) or not same_size(shape_of(index)[axis], shape_of(src)[axis]):  # type: ignore[index]
        return Block(reasons.unsupported(user))
    return Pass(axis)


def _roll_or_flip(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    rank = _rank(src)
    dims = user.args[2] if user.target is aten.roll.default else user.args[1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims and user.target is aten.roll.default:
        return Block(reasons.unsupported(user))  # roll over the flattened tensor mixes channels
    return Block(reasons.unsupported(user)) if axis in [_norm_dim(d, rank) for d in dims] else Pass(axis)


def _reduce_dims(user: fx.Node, src: fx.Node) -> tuple[list[int], bool]:
    rank = _rank(src)
    dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    keepdim = bool(user.args[2]) if len(user.args) > 2 else bool(user.kwargs.get("keepdim", False))
    return sorted(_norm_dim(d, rank) for d in dims), keepdim


def _after_reduce(axis: int, dims: list[int], keepdim: bool) -> int:
    return axis if keepdim else axis - sum(1 for d in dims if d < axis)


def _mean(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    dims, keepdim = _reduce_dims(user, src)
    if axis in dims:
        return Block(reasons.unsupported(user))
    return Pass(_after_reduce(axis, dims, keepdim))


def _sum(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    dims, keepdim = _reduce_dims(user, src)
    if axis in dims:
        return Block(reasons.unsupported(user))
    shape = shape_of(src)
    assert shape is not None
    count = 1
    for d in dims:
        n = static_int(shape[d])
        if n is None:
            return Block(reasons.DYNAMIC_TOKEN_COUNT)
        count *= n
    return Pass(_after_reduce(axis, dims, keepdim), mult=float(count))


def _max_like(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    dims, keepdim = _reduce_dims(user, src)
    if axis in dims:
        return Block(reasons.unsupported(user))
    return Pass(_after_reduce(axis, dims, keepdim), needs_positive_scale=True)


def _adaptive_avg_pool(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Pass(axis) if axis == 1 else Block(reasons.unsupported(user))


def _avg_pool(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    if axis != 1:
        return Block(reasons.unsupported(user))
    padding = user.args[3] if len(user.args) > 3 else user.kwargs.get("padding", 0)
    count_include_pad = user.args[5] if len(user.args) > 5 else user.kwargs.get("count_include_pad", True)
    padded = any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))
    if padded and count_include_pad:
        return Block(reasons.ZERO_PADDING_AFTER_NORM)
    return Pass(1)


def _max_pool(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Pass(1, needs_positive_scale=True) if axis == 1 else Block(reasons.unsupported(user))


def _scalar_mul(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    """``x * c`` or ``x / c`` with a Python number: commutes, the shift scales by c (or 1/c)."""
    other = user.args[1] if user.args[0] is src else user.args[0]
    if isinstance(other, (int, float)) and user.args.count(src) == 1:
        if user.target in (aten.div.Tensor, aten.div.Scalar):
            return Pass(axis, mult=1.0 / float(other)) if user.args[0] is src else Block(reasons.NONLINEAR)
        return Pass(axis, mult=float(other))
    if isinstance(other, fx.Node) and (shape_of(other) or (None,)) and other.op == "get_attr":
        return Block(reasons.MASKED_AFTER_NORM)
    return Block(reasons.MASKED_AFTER_NORM)


def _add(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Block(reasons.RESIDUAL_READS_NORM)


def _masked(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Block(reasons.MASKED_AFTER_NORM)


def _pad(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Block(reasons.ZERO_PADDING_AFTER_NORM)


def _nonlinear(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    return Block(reasons.NONLINEAR)


def _linear(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    if user.args[0] is not src or axis != _rank(src) - 1:
        return Block(reasons.CHANNEL_MIXING_RESHAPE if user.args[0] is src else reasons.unsupported(user))
    weight = user.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return Block(reasons.unsupported(user))
    return Consumer("linear", weight)


def _transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()`` / ``W.permute(1, 0)`` of a 2-D parameter (decomposed Linear)."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        w = node.args[0]
        if isinstance(w, fx.Node) and w.op == "get_attr":
            return w
    return None


def _addmm(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    """Decomposed Linear: ``addmm(bias, x, W.t())`` or ``mm(x, W.t())``."""
    x_pos = 1 if user.target is aten.addmm.default else 0
    if user.args[x_pos] is not src or axis != 1:
        return Block(reasons.unsupported(user))
    weight = _transposed_weight(user.args[x_pos + 1])
    return Consumer("linear", weight) if weight is not None else Block(reasons.unsupported(user))


def conv_params(node: fx.Node) -> dict[str, Any]:
    """``padding``, ``groups``, ``transposed`` of a conv node, for ``aten.convN`` and ``aten.convolution``."""
    a = node.args
    if node.target is aten.convolution.default:
        return {"padding": a[4], "groups": a[8], "transposed": bool(a[6])}
    padding = a[4] if len(a) > 4 else node.kwargs.get("padding", 0)
    groups = a[6] if len(a) > 6 else node.kwargs.get("groups", 1)
    return {"padding": padding, "groups": groups, "transposed": False}


def _conv_is_padded(node: fx.Node) -> bool:
    padding = conv_params(node)["padding"]
    if isinstance(padding, str):
        weight = node.args[1]
        kernel = shape_of(weight)[2:] if isinstance(weight, fx.Node) else ()  # type: ignore[index]
        return padding == "same" and any(int(k) > 1 for k in kernel)
    values = padding if isinstance(padding, (list, tuple)) else [padding]
    return any(int(p) != 0 for p in values)


def _conv(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    weight = user.args[1]
    if user.args[0] is not src or axis != 1 or conv_params(user)["transposed"]:
        return Block(reasons.unsupported(user))
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return Block(reasons.unsupported(user))
    if _conv_is_padded(user):
        return Block(reasons.PADDED_CONV_CONSUMER)
    return Consumer("conv", weight)


def _ops(*names: str) -> list[Any]:
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            out.append(getattr(op, overload or "default"))
    return out


FORWARD_RULES: dict[Any, Rule] = {}


def _rule(rule: Rule, *names: str) -> None:
    for op in _ops(*names):
        FORWARD_RULES[op] = rule


_rule(
    _passthrough,
    "clone",
    "contiguous",
    "alias",
    "detach",
    "lift_fresh_copy",
    "_to_copy",
    "to.dtype",
    "to.dtype_layout",
    "expand",
    "feature_dropout",
)
_rule(_dropout, "dropout")
_rule(_transpose, "transpose.int", "swapaxes", "swapdims")
_rule(_t, "t")
_rule(_permute, "permute")
_rule(_view, "view", "reshape", "_unsafe_view", "flatten.using_ints", "unflatten.int", "squeeze.dim", "squeeze.dims")
_rule(_view, "squeeze", "unsqueeze")
_rule(_select, "select.int")
_rule(_slice, "slice.Tensor")
_rule(_index, "index.Tensor")
_rule(_index_select, "index_select")
_rule(_gather, "gather")
_rule(_roll_or_flip, "roll", "flip")
_rule(_mean, "mean.dim", "mean")
_rule(_sum, "sum.dim_IntList", "sum")
_rule(_max_like, "amax", "amin", "max.dim", "min.dim")
_rule(_adaptive_avg_pool, "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d")
_rule(_avg_pool, "avg_pool1d", "avg_pool2d")
_rule(_max_pool, "max_pool1d", "max_pool2d", "max_pool2d_with_indices")
_rule(_scalar_mul, "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar")
_rule(_add, "add.Tensor", "sub.Tensor", "add.Scalar", "sub.Scalar", "rsub.Scalar")
_rule(_masked, "masked_fill.Scalar", "masked_fill.Tensor", "where.self", "where.ScalarOther", "where.ScalarSelf")
_rule(_pad, "constant_pad_nd", "pad")
_rule(
    _nonlinear,
    "gelu",
    "relu",
    "silu",
    "sigmoid",
    "tanh",
    "softmax.int",
    "_softmax",
    "exp",
    "log",
    "pow.Tensor_Scalar",
    "sqrt",
    "rsqrt",
    "abs",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "elu",
    "layer_norm",
    "native_layer_norm",
    "square",
    "clamp",
    "mish",
    "erf",
)
_rule(_linear, "linear")
_rule(_addmm, "addmm", "mm")
_rule(_conv, "conv1d", "conv2d", "conv3d", "convolution")

# Ops that read only the shape of a tensor: no data flows through them.
SHAPE_ONLY = set(_ops("sym_size.int", "sym_numel", "sym_stride.int", "sym_storage_offset"))
# Ops that return several tensors; their users are ``getitem`` nodes.
TUPLE_OPS = set(_ops("max.dim", "min.dim", "max_pool2d_with_indices", "unbind.int", "split.Tensor"))
TUPLE_OPS |= set(_ops("split_with_sizes", "chunk"))
JOIN_OPS = set(_ops("cat", "stack"))


# --------------------------------------------------------------------------------------------- the walk


@dataclass(frozen=True)
class ConsumerUse:
    """A consumer the norm can fold into: ``node`` reads the normalised tensor on ``axis``; the shift reaching
    it is multiplied by ``mult``."""

    node: fx.Node
    kind: str
    weight: fx.Node
    mult: float


@dataclass(frozen=True)
class BlockedEdge:
    """The edge ``src -> dst`` where the fold stops: ``dst`` must still see the normalised ``src``
    (channel axis ``axis`` of ``src``, shift multiplied by ``mult``)."""

    src: fx.Node
    dst: fx.Node
    axis: int
    mult: float
    reason: str


@dataclass
class Flow:
    """Where one norm's output goes: the consumers that can absorb it and the edges where it is blocked."""

    consumers: list[ConsumerUse] = field(default_factory=list)
    blocked: list[BlockedEdge] = field(default_factory=list)


def _reachable(start: fx.Node) -> set[fx.Node]:
    seen, todo = {start}, [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def follow(start: fx.Node, axis: int, positive_scale: bool = True) -> Flow:
    """Follow a tensor with its channel on ``axis`` through every user, to consumers and blockers.

    ``positive_scale`` says whether every channel's scale is > 0; max/min over tokens commute with the
    affine only then (otherwise they block with ``negative-scale-through-max``).

    Every user of every tensor on the way is classified; nothing is skipped. A join (``cat``/``stack``) is
    passed only when all its inputs derive from ``start`` on the same channel axis.
    """
    flow = Flow()
    reach = _reachable(start)
    visited: set[fx.Node] = set()
    todo: list[tuple[fx.Node, int, float]] = [(start, axis, 1.0)]
    while todo:
        node, ax, mult = todo.pop()
        if node in visited:
            continue
        visited.add(node)
        for user in list(node.users):
            if user.op == "output":
                flow.blocked.append(BlockedEdge(node, user, ax, mult, reasons.FEEDS_OUTPUT))
                continue
            if user.target in SHAPE_ONLY:
                continue
            if user.target is operator.getitem:
                if node.target is aten.unbind.int:
                    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, _rank(node.args[0]))
                    todo.append((user, ax - 1 if dim < ax else ax, mult))
                else:
                    todo.append((user, ax, mult))
                continue
            if user.target in TUPLE_OPS:
                outcome = _tuple_op(user, node, ax)
            elif user.target in JOIN_OPS:
                outcome = _join(user, node, ax, reach)
            else:
                rule = FORWARD_RULES.get(user.target)
                outcome = rule(user, node, ax) if rule else Block(reasons.unsupported(user))
            if isinstance(outcome, Pass) and outcome.needs_positive_scale and not positive_scale:
                outcome = Block(reasons.NEGATIVE_SCALE_THROUGH_MAX)
            if isinstance(outcome, Pass):
                todo.append((user, outcome.axis, mult * outcome.mult))
            elif isinstance(outcome, Consumer):
                flow.consumers.append(ConsumerUse(user, outcome.kind, outcome.weight, mult))
            else:
                flow.blocked.append(BlockedEdge(node, user, ax, mult, outcome.reason))
    return flow


def _tuple_op(user: fx.Node, src: fx.Node, axis: int) -> Outcome:
    if user.target in (aten.max.dim, aten.min.dim):
        return _max_like(user, src, axis)
    if user.target is aten.max_pool2d_with_indices.default:
        return _max_pool(user, src, axis)
    if user.target is aten.unbind.int:
        dim = _norm_dim(user.args[1] if len(user.args) > 1 else 0, _rank(src))
        return Block(reasons.unsupported(user)) if dim == axis else Pass(axis)
    dim = _norm_dim(user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0), _rank(src))
    return Block(reasons.unsupported(user)) if dim == axis else Pass(axis)


def _join(user: fx.Node, src: fx.Node, axis: int, reach: set[fx.Node]) -> Outcome:
    tensors = [t for t in user.args[0] if isinstance(t, fx.Node)]
    rank = _rank(src)
    dim = _norm_dim(user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0), rank + (user.target is aten.stack.default))
    if any(t not in reach for t in tensors):
        return Block(reasons.CONCAT_WITH_UNNORMALIZED)
    if user.target is aten.stack.default:
        return Pass(axis + 1 if dim <= axis else axis)
    return Block(reasons.unsupported(user)) if dim == axis else Pass(axis)


# --------------------------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class Producer:
    """A Linear/conv whose output (channel axis known) flows only into the norm's input."""

    node: fx.Node
    kind: str
    weight: fx.Node
    bias: fx.Node | None


_BACKWARD_VIEWS = set(_ops("transpose.int", "permute", "view", "reshape", "_unsafe_view", "flatten.using_ints"))
_BACKWARD_VIEWS |= set(_ops("contiguous", "clone", "unflatten.int"))


def find_producer(site: NormSite) -> Producer | None:
    """The Linear/conv that produces the norm's input through channel-preserving view ops, when nothing else
    reads any tensor on the way (so scaling its output channels changes nothing but the norm's input)."""
    node, axis = site.input, site.channel_axis
    if any(u not in site.region for u in site.input.users):
        return None  # something besides the norm reads its input
    while True:
        if node.op != "call_function":
            return None
        if node.target in _BACKWARD_VIEWS:
            src = node.args[0]
            if not isinstance(src, fx.Node) or len(src.users) != 1:
                return None
            # The axis on ``src`` that maps to ``axis`` on ``node``: run the forward rule on each candidate.
            rule = FORWARD_RULES[node.target]
            src_rank = _rank(src)
            match = [a for a in range(src_rank) if (o := rule(node, src, a)) == Pass(axis)]
            if len(match) != 1:
                return None
            node, axis = src, match[0]
            continue
        if node.target is aten.linear.default and axis == _rank(node) - 1:
            w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
            if isinstance(w, fx.Node) and w.op == "get_attr" and (b is None or b.op == "get_attr"):
                return Producer(node, "linear", w, b)
            return None
        if node.target in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default) and axis == 1:
            w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
            if isinstance(w, fx.Node) and w.op == "get_attr" and (b is None or b.op == "get_attr"):
                return Producer(node, "conv", w, b)
            return None
        return None
