r"""The affine of a LayerNorm, RMSNorm, GroupNorm or InstanceNorm, split from its normalisation so it folds like any
other norm (``fold_norm_affine``, issue 41).

A LayerNorm computes ``y = γ ⊙ x̂ + β`` with ``x̂`` the normalised input (mean and variance over the normalised
axes of each sample); an RMSNorm ``y = γ ⊙ x / rms(x)``; a GroupNorm ``y = γ ⊙ x̂ + β`` with ``x̂`` normalised per
group of channels, ``γ``, ``β`` per channel (axis 1); an InstanceNorm the same with one channel per group. The
normalisation depends on the input and stays; the affine ``(γ, β)`` is a constant per-channel map, exactly what
``slabconv.engine.norms`` finds and the planner folds.

``split_norm_affines`` rewrites each such op in the graph into the op without its affine followed by the affine
as ATen writes it elsewhere (``aten.mul.Tensor`` by the stored ``γ``, then ``aten.add.Tensor`` of the stored
``β``), marked so that ``norms.find_norms`` names the norm ``LayerNorm-affine`` / ``RMSNorm-affine`` /
``GroupNorm-affine`` / ``InstanceNorm-affine``. The split graph computes the same function (the float64 values are
equal; a float16 / bfloat16 graph rounds ``x̂`` once more). The ops it splits, as ``torch.export`` (2.8 .. 2.13)
writes them:

=============================  =====================================================  ========================
op                             written by                                             channels
=============================  =====================================================  ========================
``aten.layer_norm``            ``nn.LayerNorm``, ``F.layer_norm`` (export graph)      last axis
``aten.native_layer_norm``     the same after ``run_decompositions()`` (core ATen)    last axis
``aten.rms_norm``              ``nn.RMSNorm``, ``F.rms_norm`` (export graph)          last axis
``aten.group_norm``            ``nn.GroupNorm``, ``F.group_norm`` (export graph)      axis 1
``aten.native_group_norm``     the same after ``run_decompositions()``                axis 1
``aten.instance_norm``         ``nn.InstanceNorm1d/2d/3d(affine=True)`` (export       axis 1
                               graph); ONNX ``InstanceNormalization``
=============================  =====================================================  ========================

After ``run_decompositions()`` an InstanceNorm is a batch norm with batch statistics over a ``(1, B * C, ...)``
view, its ``γ`` repeated ``B`` times: not split. An ``instance_norm`` that is a written-out GroupNorm's
normalisation (``_instance_normed``) is not split either: its affine is the ``Mul`` / ``Add`` after it.

The normalised shape must be the last axis alone (a LayerNorm over several axes has no single channel axis) and
``γ`` (and ``β`` where present) a constant of the output's dtype that only norm ops read; a norm with ``β`` but no
``γ`` is left whole.
An RMSNorm written out (transformers' ``LlamaRMSNorm`` / ``Qwen2RMSNorm``: ``γ * (x * rsqrt(mean(x²) + ε))`` with
casts around it, and ``nn.RMSNorm`` after ``run_decompositions()``) already has its ``γ`` as a separate multiply:
``split_norm_affines`` only marks that multiply (``_rms_weight``; also ``x / sqrt(...)`` and
``x * reciprocal(sqrt(...))``, ``ε`` a number or a stored one-element tensor, as ONNX exporters write it); on
``x - mean(x, -1)`` it is a LayerNorm written out (the TorchScript exporter below opset 17, ``_centred``), marked
so. So with a GroupNorm an ONNX exporter wrote as ``Reshape -> InstanceNormalization -> Reshape -> Mul -> Add``
(``_group_weight``). Without the option a written-out RMSNorm's multiply (a LayerNorm's multiply and add) is found
as before (a ``LayerScale``, an ``Affine``, where its axis is a channel axis, ``docs/reasons.md``); a written-out
GroupNorm's multiply and add are no norm (``holds_group_norm_weight``), as ``aten.group_norm`` keeps its
affine.

A folded affine leaves the op with a unit weight (``unit_weight``: the stored ``γ`` replaced by ones under the
same name, ``β`` dropped), so a Hugging Face LLaMA keeps its layout with every norm weight 1. A norm whose affine
does not fold away entirely is kept whole: ``join_norm_affines`` puts ``γ`` and ``β`` back into the op (an affine
split from its normalisation and kept beside it would only add two ops).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from slabconv.engine.affine_values import MARK, Constants
from slabconv.engine.capture import op_arg, shape_of, static_int, stored
from slabconv.engine.rules import RESHAPE_OPS

aten = torch.ops.aten


KINDS = ("LayerNorm-affine", "RMSNorm-affine", "GroupNorm-affine", "InstanceNorm-affine")
"""The kinds of these norms in ``Decision.kind`` / ``folds[].kind``."""


@dataclass(frozen=True)
class NormOp:
    """Where an ATen norm op keeps its affine: the positions of ``γ`` and ``β`` (None: the op has no ``β``), the
    axis of its output that holds the channels (-1: the last), and whether it returns ``(out, mean, rstd)``."""

    kind: str
    weight: int
    bias: int | None
    axis: int
    tuple_out: bool
    shape_arg: int | None  # the normalized_shape argument (LayerNorm, RMSNorm)


NORM_OPS: dict[Any, NormOp] = {
    aten.layer_norm.default: NormOp("LayerNorm", 2, 3, -1, False, 1),
    aten.native_layer_norm.default: NormOp("LayerNorm", 2, 3, -1, True, 1),
    aten.group_norm.default: NormOp("GroupNorm", 2, 3, 1, False, None),
    aten.native_group_norm.default: NormOp("GroupNorm", 1, 2, 1, True, None),
    aten.instance_norm.default: NormOp("InstanceNorm", 1, 2, 1, False, None),
}
if hasattr(aten, "rms_norm"):  # torch >= 2.4
    NORM_OPS[aten.rms_norm.default] = NormOp("RMSNorm", 2, None, -1, False, 1)


def is_norm_affine(kind: str) -> bool:
    """True for the kinds this module makes (``LayerNorm-affine``, ``RMSNorm-affine``, ``GroupNorm-affine``,
    ``InstanceNorm-affine``)."""
    return kind in KINDS


def folds_norm_affine(decisions: Any) -> bool:
    """True when a plan's decisions (``Decision`` or ``folds[]`` dicts) hold a norm of these kinds: the plan was
    made with ``split_norm_affines`` (a float64 fold that checks it must split too). A plan made with it that has
    none computes exactly what one made without it does."""
    return any(is_norm_affine(d["kind"] if isinstance(d, dict) else d.kind) for d in decisions)


def affine_kind(nodes: Any) -> str | None:
    """The kind of a norm whose ops are ``nodes`` when one of them is a marked multiply, else None."""
    for node in nodes:
        mark = node.meta.get(MARK)
        if mark is not None and mark != "shift":
            return f"{mark}-affine"
    return None


def split_axis(node: fx.Node) -> int | None:
    """The channel axis of ``node`` (-1: the last) when it is a normalisation whose affine ``split_norm_affines``
    split off or marked (a norm op, ``getitem(op, 0)`` of a tuple op, a written-out RMSNorm or GroupNorm), else
    None."""
    kinds = {str(u.meta[MARK]) for u in node.users if u.meta.get(MARK) not in (None, "shift")}
    return _AXES.get(kinds.pop()) if len(kinds) == 1 else None


_AXES = {"LayerNorm": -1, "RMSNorm": -1, "GroupNorm": 1, "InstanceNorm": 1}


def _arg(node: fx.Node, position: int | None) -> Any:
    if position is None:
        return None
    return node.args[position] if len(node.args) > position else None


def _out(node: fx.Node, op: NormOp) -> fx.Node | None:
    """The node holding the normalised output: the op itself, or the one ``getitem(op, 0)``."""
    if not op.tuple_out:
        return node
    getters = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    return getters[0] if len(getters) == 1 else None


def _constant_vector(consts: Constants, node: Any, channels: int, dtype: torch.dtype) -> bool:
    """``node`` is a constant ``(C,)`` tensor of ``dtype`` (a stored parameter, or computed from stored tensors)
    that only norm ops read (one norm module called twice reads its weight twice)."""
    if not isinstance(node, fx.Node) or not consts.is_const(node):
        return False
    if not all(_norm_reader(u) for u in node.users):
        return False
    shape = shape_of(node)
    val = node.meta.get("val")
    if shape is None and node.op == "get_attr":
        value = stored(node.graph.owning_module, str(node.target))  # type: ignore[arg-type]
        shape, val = (tuple(value.shape), value) if isinstance(value, torch.Tensor) else (None, None)
    if shape is None or len(shape) != 1 or static_int(shape[0]) != channels:
        return False
    return isinstance(val, torch.Tensor) and val.dtype == dtype


def _norm_reader(user: fx.Node) -> bool:
    """``user`` is a norm op or the affine split from one (its multiply or add, or the view of ``γ`` / ``β`` that
    feeds them)."""
    if user.op != "call_function":
        return False
    if user.target in NORM_OPS or MARK in user.meta:
        return True
    return user.target is aten.view.default and bool(user.users) and all(MARK in u.meta for u in user.users)


def _splittable(node: fx.Node, op: NormOp, consts: Constants) -> fx.Node | None:
    """The output node of a norm op whose affine can be split off (see the module docstring), else None."""
    out = _out(node, op)
    shape = shape_of(out) if out is not None else None
    val = out.meta.get("val") if out is not None else None
    if out is None or shape is None or not isinstance(val, torch.Tensor) or len(shape) < 2:
        return None
    if op.shape_arg is not None:
        normalized = _arg(node, op.shape_arg)
        if not isinstance(normalized, (list, tuple)) or len(normalized) != 1:
            return None
    channels = static_int(shape[op.axis])
    weight, bias = _arg(node, op.weight), _arg(node, op.bias)
    if channels is None or weight is None:
        return None
    if not _constant_vector(consts, weight, channels, val.dtype):
        return None
    if bias is not None and not _constant_vector(consts, bias, channels, val.dtype):
        return None
    return out


def _new(graph: fx.Graph, after: fx.Node, target: Any, args: tuple[Any, ...], like: fx.Node, val: Any) -> fx.Node:
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    node.meta["val"] = val
    node.meta["nn_module_stack"] = dict(like.meta.get("nn_module_stack") or {})
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def _split(gm: fx.GraphModule, node: fx.Node, op: NormOp, out: fx.Node) -> None:
    graph = gm.graph
    weight, bias = _arg(node, op.weight), _arg(node, op.bias)
    val = out.meta["val"]
    node.update_arg(op.weight, None)
    if op.bias is not None and bias is not None:
        node.update_arg(op.bias, None)
    scale: fx.Node = weight
    last = out
    if op.axis != -1 and op.axis != val.dim() - 1:  # GroupNorm: gamma as (C, 1, ..., 1) against (N, C, ...)
        view_shape = [int(val.shape[op.axis]), *([1] * (val.dim() - 1 - op.axis))]

        def viewed(vector: fx.Node, after: fx.Node) -> fx.Node:
            value = vector.meta.get("val")
            if not isinstance(value, torch.Tensor):
                value = stored(gm, str(vector.target)) if vector.op == "get_attr" else None
            return _new(graph, after, aten.view.default, (vector, view_shape), node, value.view(view_shape))  # type: ignore[union-attr]

        scale = last = viewed(weight, last)
        if bias is not None:
            bias = last = viewed(bias, last)
    mul = _new(graph, last, aten.mul.Tensor, (out, scale), node, val)
    mul.meta[MARK] = op.kind
    result = mul
    if bias is not None:
        result = _new(graph, mul, aten.add.Tensor, (mul, bias), node, val)
        result.meta[MARK] = "shift"
    out.replace_all_uses_with(result, delete_user_cb=lambda user: user is not mul)


# --------------------------------------------------------------------------------------------- written-out RMSNorm

_CASTS = {aten._to_copy.default, aten.to.dtype, aten.type_as.default}


def _uncast(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node


def _scalar(node: Any) -> bool:
    """``node`` is a number: a Python int or float, or a stored one-element tensor (an ONNX exporter's ``ε``
    initializer, lowered to a ``get_attr``)."""
    if isinstance(node, (int, float)):
        return True
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False
    value = stored(node.graph.owning_module, str(node.target))  # type: ignore[arg-type]
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point


def _rms_of(node: Any, x: Any, root: Any = aten.rsqrt.default) -> bool:
    """``node`` is ``rsqrt(mean(x ** 2, -1, keepdim=True) + eps)`` of the same ``x`` (through casts), or
    ``reciprocal(sqrt(...))`` of it (an ONNX exporter's ``Reciprocal(Sqrt(...))``), or with ``root`` ``sqrt`` the
    ``sqrt(...)`` that ``x`` is divided by."""
    if isinstance(node, fx.Node) and node.target is aten.reciprocal.default and root is aten.rsqrt.default:
        return _rms_of(node.args[0], x, aten.sqrt.default)
    if not (isinstance(node, fx.Node) and node.target is root):
        return False
    added = node.args[0]
    if not (isinstance(added, fx.Node) and added.target in (aten.add.Tensor, aten.add.Scalar)):
        return False
    mean = added.args[0]
    if not (isinstance(mean, fx.Node) and mean.target is aten.mean.dim and _scalar(added.args[1])):
        return False
    square = mean.args[0]
    if not _over_last_axis(mean):
        return False
    if not (isinstance(square, fx.Node) and square.target is aten.pow.Tensor_Scalar and square.args[1] == 2):
        return False
    return _uncast(square.args[0]) is _uncast(x)


def _centred(normed: fx.Node) -> bool:
    """The RMS-normalised ``x̂`` (``_rms_weight``) normalises ``x - mean(x, -1, keepdim=True)``: a LayerNorm written
    out (the TorchScript exporter below opset 17: ``ReduceMean``, ``Sub``, ``Pow``, ``ReduceMean``, ``Add``,
    ``Sqrt``, ``Div``), not an RMSNorm."""
    inner = _uncast(normed)
    for x in inner.args if isinstance(inner, fx.Node) else ():
        x = _uncast(x)
        if not (isinstance(x, fx.Node) and x.target is aten.sub.Tensor and len(x.args) == 2):
            continue
        y, mean = x.args
        if not (isinstance(mean, fx.Node) and mean.target is aten.mean.dim and _uncast(mean.args[0]) is _uncast(y)):
            continue
        if _over_last_axis(mean):
            return True
    return False


def _over_last_axis(mean: fx.Node) -> bool:
    """An ``aten.mean.dim`` over the last axis alone, the axis kept (``keepdim=True``): a norm's statistic."""
    dims = op_arg(mean, 1, "dim")
    keepdim = op_arg(mean, 2, "keepdim", False)
    return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [len(shape_of(mean) or ()) - 1]) and bool(keepdim)


def _rms_weight(node: fx.Node, consts: Constants) -> tuple[fx.Node, fx.Node] | None:
    """``(γ, x̂)`` when ``node`` multiplies a constant ``(C,)`` ``γ`` by an RMS-normalised tensor
    ``x̂ = x * rsqrt(mean(x²) + ε)`` (casts allowed around it): the weight of an RMSNorm written out; else None."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    a, b = node.args
    weight, normed = (a, b) if isinstance(a, fx.Node) and consts.is_const(a) else (b, a)
    shape = shape_of(node)
    if shape is None or not isinstance(normed, fx.Node) or consts.is_const(normed) or not isinstance(weight, fx.Node):
        return None
    channels = static_int(shape[-1])
    val = node.meta.get("val")
    if channels is None or not isinstance(val, torch.Tensor) or not consts.is_const(weight):
        return None
    w_shape = shape_of(weight)
    if w_shape is None or [static_int(s) for s in w_shape] != [channels]:
        return None
    inner = _uncast(normed)
    if not (isinstance(inner, fx.Node) and inner.target in (aten.mul.Tensor, aten.div.Tensor) and len(inner.args) == 2):
        return None
    x, r = inner.args
    if inner.target is aten.div.Tensor:  # x / sqrt(mean(x²) + ε)
        return (weight, normed) if _rms_of(r, x, aten.sqrt.default) else None
    return (weight, normed) if _rms_of(r, x) or _rms_of(x, r) else None


def _instance_normed(node: Any, consts: Constants) -> bool:
    """``node`` is a GroupNorm's normalisation as ONNX exporters write it (opset < 21, and the TorchScript exporter):
    ``Reshape(InstanceNormalization(Reshape(x, (N, G, -1)), ones, zeros), shape of x)``, lowered to
    ``reshape(instance_norm(reshape(x)))`` with a constant unit weight and zero bias on the groups."""
    if not (isinstance(node, fx.Node) and node.target in RESHAPE_OPS):
        return False
    inst = node.args[0]
    if not (isinstance(inst, fx.Node) and inst.target is aten.instance_norm.default):
        return False
    w, b = inst.args[1], inst.args[2]
    for value, unit in ((w, 1.0), (b, 0.0)):
        if value is None:
            continue
        if not consts.is_const(value):
            return False
        try:
            if not bool((torch.as_tensor(consts.value(value)) == unit).all()):
                return False
        except Exception:  # noqa: BLE001 - a constant that cannot be evaluated here does not count
            return False
    return True


def _group_weight(node: fx.Node, consts: Constants) -> bool:
    """``node`` multiplies a GroupNorm's normalisation written through an instance norm (``_instance_normed``) by a
    constant ``(C, 1, ..., 1)`` weight on its channel axis 1: the GroupNorm's weight."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return False
    a, b = node.args
    weight, normed = (a, b) if isinstance(a, fx.Node) and consts.is_const(a) else (b, a)
    shape, w_shape = shape_of(normed), shape_of(weight)
    if shape is None or w_shape is None or len(shape) < 3 or not _instance_normed(normed, consts):
        return False
    sizes = [static_int(d) for d in w_shape]
    channels = static_int(shape[1])
    padded = [1] * (len(shape) - len(sizes)) + sizes
    return channels is not None and padded[1] == channels and all(d == 1 for i, d in enumerate(padded) if i != 1)


def holds_group_norm_weight(nodes: Any, consts: Constants) -> bool:
    """One of ``nodes`` multiplies a GroupNorm's normalisation, as ONNX exporters write it (``_group_weight``), by
    its weight, unmarked (``split_norm_affines`` did not run: no ``fold_norm_affine``). Such an affine is the
    GroupNorm's own and stays with it, as an ``aten.group_norm`` from a checkpoint keeps its weight and bias
    (``slabconv.engine.norms`` finds no norm in it)."""
    return any(MARK not in n.meta and _group_weight(n, consts) for n in nodes)


def _after_cast(gm: fx.GraphModule, mul: fx.Node, weight: fx.Node, normed: fx.Node) -> fx.Node:
    """The weight multiply of a written-out RMSNorm, moved after the cast back to the input's dtype where it
    computes in float32 and the cast narrows (``nn.RMSNorm`` in float16 / bfloat16 after ``run_decompositions()``:
    ``(x̂₃₂ * γ).to(float16)`` becomes ``x̂₃₂.to(float16) * γ``, as transformers' ``LlamaRMSNorm`` writes it), so
    the affine is on the tensor the consumers read; otherwise ``mul`` itself."""
    users = list(mul.users)
    if len(users) != 1 or users[0].target not in (aten._to_copy.default, aten.to.dtype):
        return mul
    cast = users[0]
    w_val, c_val = weight.meta.get("val"), cast.meta.get("val")
    m_val = mul.meta.get("val")
    if not (isinstance(w_val, torch.Tensor) and isinstance(c_val, torch.Tensor) and isinstance(m_val, torch.Tensor)):
        return mul
    if c_val.dtype != w_val.dtype or c_val.dtype.itemsize >= m_val.dtype.itemsize or not c_val.dtype.is_floating_point:
        return mul
    graph = gm.graph
    cast.update_arg(0, normed)
    moved = _new(graph, cast, aten.mul.Tensor, (cast, weight), mul, c_val)
    cast.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    graph.erase_node(mul)
    return moved


# --------------------------------------------------------------------------------------------- the passes


def split_norm_affines(gm: fx.GraphModule) -> int:
    """Split the affine of every LayerNorm, RMSNorm, GroupNorm and InstanceNorm op of ``gm`` from its normalisation
    (in place; see the module docstring for which ops and when), and mark the weight multiply of every written-out
    RMSNorm. ``gm`` computes the same function afterwards; it is recompiled. Returns how many norms were split or
    marked.

    Source: the op schemas of ``native_functions.yaml`` (``layer_norm(input, normalized_shape, weight, bias, eps,
    cudnn_enable)``, ``native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)``,
    ``rms_norm(input, normalized_shape, weight, eps)``, ``group_norm(input, num_groups, weight, bias, eps,
    cudnn_enabled)``, ``native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)``,
    ``instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled)``).
    """
    consts = Constants(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        op = NORM_OPS.get(node.target)
        if op is not None and any(_instance_normed(u, consts) for u in node.users):
            continue  # a written-out GroupNorm's normalisation: its affine is the Mul / Add after it (_group_weight)
        if op is not None:
            out = _splittable(node, op, consts)
            if out is not None:
                _split(gm, node, op, out)
                count += 1
        elif MARK not in node.meta and (found := _rms_weight(node, consts)) is not None:
            _after_cast(gm, node, *found).meta[MARK] = "LayerNorm" if _centred(found[1]) else "RMSNorm"
            count += 1
        elif MARK not in node.meta and _group_weight(node, consts):
            node.meta[MARK] = "GroupNorm"
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _split_parts(mul: fx.Node) -> tuple[fx.Node, NormOp, fx.Node, fx.Node, fx.Node | None, fx.Node | None] | None:
    """``(norm op, its NormOp, γ, the γ operand, β, the add)`` of a split affine whose multiply is ``mul`` and
    which is still whole; None for a marked written-out RMSNorm or a split that is no longer intact."""
    out, scale = mul.args
    if not isinstance(out, fx.Node) or not isinstance(scale, fx.Node):
        return None
    norm = out.args[0] if out.target is operator.getitem else out
    op = NORM_OPS.get(norm.target) if isinstance(norm, fx.Node) else None
    if op is None or _arg(norm, op.weight) is not None:  # type: ignore[arg-type]
        return None
    weight = scale.args[0] if scale.target is aten.view.default else scale
    users = list(mul.users)
    add = users[0] if len(users) == 1 and users[0].meta.get(MARK) == "shift" else None
    bias = add.args[1] if add is not None else None
    if isinstance(bias, fx.Node) and bias.target is aten.view.default:
        bias = bias.args[0]
    return norm, op, weight, scale, bias, add  # type: ignore[return-value]


def join_norm_affines(gm: fx.GraphModule) -> int:
    """Put back into its op every split affine that is still in the graph (a norm kept whole), in place; returns
    how many. The graph computes what the original op computed (its own kernel, one rounding)."""
    joined = 0
    for mul in [n for n in gm.graph.nodes if n.meta.get(MARK) not in (None, "shift")]:
        parts = _split_parts(mul)
        if parts is None:
            continue
        norm, op, weight, _, bias, add = parts
        norm.update_arg(op.weight, weight)
        if op.bias is not None and bias is not None:
            norm.update_arg(op.bias, bias)
        end = add if add is not None else mul
        end.replace_all_uses_with(mul.args[0])
        operands = (mul.args[1], add.args[1] if add is not None else None)
        views = [a for a in operands if a is not weight and a is not bias]
        for node in (add, mul, *views):
            if isinstance(node, fx.Node) and not node.users:
                gm.graph.erase_node(node)
        joined += 1
    if joined:
        gm.recompile()
    return joined


def unit_weight(mul: fx.Node) -> tuple[fx.Node, int, fx.Node] | None:
    """For the marked multiply of a split affine: ``(norm op, position of γ, the stored γ)``, where the folded
    norm keeps a weight of ones (``rewriter.apply_plan``); None for a written-out RMSNorm (its multiply goes
    whole) and for a ``γ`` that something else reads too (another call of the same norm module, which may keep
    its affine: the folded op then has no weight)."""
    parts = _split_parts(mul)
    if parts is None:
        return None
    norm, op, weight, scale, _, _ = parts
    if weight.op != "get_attr" or len(weight.users) != 1 or len(scale.users) != 1:
        return None
    same = [n for n in weight.graph.nodes if n.op == "get_attr" and n.target == weight.target]
    return (norm, op.weight, weight) if len(same) == 1 else None
