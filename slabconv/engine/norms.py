r"""Norm discovery: every constant per-channel affine of a tensor, recognised by the value it computes.

In: an export graph (``slabconv.engine.capture``). Out: one ``NormSite`` per norm, in graph order:
``output = scale * input + shift`` per channel on ``channel_axis`` of ``input``, with the nodes that compute it
(``region``, removed when it is folded), its ``kind`` and its stored parameters.

Which patterns count (``docs/reasons.md``, "Which patterns count"):

1. Every BatchNorm op (``aten.batch_norm`` and its core-ATen forms, ``BN_LAYOUT``), in eval or train mode, is a
   norm of its own: ``BatchNorm``. Its statistics may be stored or computed from stored tensors only. With stored
   statistics in eval mode, a norm that only the BN reads joins it (``bn(w x + b)`` of kind 3 or 4, another BN or
   RepBN in eval mode, also through permutes that give back its layout), composed.
2. Ops that follow it elementwise with constants keep extending it while the result is still one per-channel
   affine of the BN's input on its channel axis: ``+ / - / *`` by a constant scalar or a constant vector on that
   axis, and ``+ / -`` of another affine of the same input, which is how RepBN writes ``BN(x) + alpha * x``
   (SLAB eq. 4): ``RepBN``. Two ops that compute the same value are the same input (``x.transpose(1, 2)``
   written twice; ``value_numbers`` is common-subexpression analysis on the graph). A constant added after the
   transpose pair around a BN over tokens extends it too (``bn(x^T)^T + c``).
3. Without a BN op, a multiplication of a tensor ``x`` by a constant vector along one channel axis of ``x``
   starts a norm, extended as in 2: ``FrozenBatchNorm`` when its constants normalise by a stored variance
   (``rsqrt`` / ``sqrt`` of stored tensors, torchvision's ``FrozenBatchNorm2d``), else ``Affine`` when a constant
   is added (MobileBERT's ``NoNorm``: ``x * weight + bias``), else ``LayerScale`` (``gamma * x``). The axis must
   be a channel axis: the channel axis of the Linear / conv / norm that produced ``x`` (through view-like and
   elementwise ops), or an axis that a Linear / conv downstream contracts. A vector over a token axis is not a
   norm.
4. A product with a learned scalar, a one-element tensor the model holds (``capture.is_state``: HGNetV2's
   ``LearnableAffineBlock``, ReZero's ``alpha``), starts a norm as a vector does, on the channel axis it can fold
   along (``_on_channels``).

Not norms: products with Python scalars or other one-element constants alone (attention's ``q * scale``), constant
additions alone (a bias, a position embedding), anything that reads the input twice (``x * x``). "Constant" means
computed from parameters, buffers and constants only, never from the model's input; such subgraphs are evaluated
once, in float64.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from slabconv.engine.affine_values import (  # noqa: F401 (BN_OPS, BN_LAYOUT: part of this module's face)
    BN_LAYOUT,
    BN_OPS,
    Affine,
    _Analysis,
    _pure,
    bn_args,
    is_batch_norm,
    value_numbers,
)
from slabconv.engine.capture import attr, module_path, shape_of, static_int
from slabconv.engine.flow import ROWS_ADDEND, reaches_layer, source_chan
from slabconv.engine.layers import layer_of
from slabconv.engine.norm_affine import affine_kind, holds_group_norm_weight, split_axis
from slabconv.engine.rules import PERMUTE_OPS, VIEW_OPS, Chan

aten = torch.ops.aten
Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------- the norm


@dataclass
class NormSite:
    """One norm found in the graph: ``output = scale * input + shift`` per channel on ``channel_axis``.

    Attributes:
        name: module path of the norm (e.g. ``blocks.0.norm1``), or its first node's name without module
            metadata.
        kind: ``BatchNorm``, ``RepBN``, ``FrozenBatchNorm``, ``Affine``, ``LayerScale``, or the affine of a
            LayerNorm / RMSNorm / GroupNorm split from it (``LayerNorm-affine``, ``RMSNorm-affine``,
            ``GroupNorm-affine``; ``slabconv.engine.norm_affine``).
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
        shifted: a constant is added (``shift`` may still be 0 where that constant is); a norm kind without a BN
            op and without a shift creates no bias where it folds.
        before: where the BN op reads an affine of ``input`` composed into this norm (``bn(s1 x + t1)``: BN ->
            BN, RepBN -> BN, a learned affine -> BN), ``(s1, t1)``, ``(C,)`` float64: the BN's running statistics
            are those of ``s1 * input + t1``. None when the BN reads ``input``.
        composed: the name of that first norm (its module path, or its first node's name), "" without one.
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
    shifted: bool = True
    before: tuple[torch.Tensor, torch.Tensor] | None = None
    composed: str = ""

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
    features of an embedding or a LayerNorm, the channels of a GroupNorm."""

    def known(node: fx.Node) -> Chan | None:
        if node.meta.get(ROWS_ADDEND):  # a layer's own addend per row keeps the layer's channels where they are
            node = node.args[0]  # type: ignore[assignment]
        shape = shape_of(node)
        if shape is None or node.op != "call_function":
            return None
        layer = layer_of(node)
        axis: int | None = None
        if layer is not None:
            axis = layer.out_axis(node)
        elif node in analysis.aff and analysis.aff[node].axis is not None:
            axis = analysis.aff[node].axis
        elif node.target is aten.layer_norm.default:
            axis = len(shape) - 1
        elif node.target is aten.group_norm.default:  # (N, C, ...), its weight per channel of axis 1
            axis = 1
        elif (split := split_axis(node)) is not None:  # a norm op whose affine was split off
            axis = split % len(shape)
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


def _on_channels(cand: Affine | None, out: fx.Node, known: Callable[[fx.Node], Chan | None]) -> Affine | None:
    """A learned scalar affine (``Affine.seeded`` by a one-element tensor of the model's state, no BN op, no
    vector) on the channel axis it may fold along: the output-channel axis of the layer that produced its input
    (through view-like and elementwise ops), else the last or the second axis when a Linear / conv downstream
    contracts it. A scalar is the same affine on every axis; the axis only says where the fold puts it. ``cand``
    unchanged when it has an axis or a BN op; None when no channel axis is found (not a norm)."""
    if cand is None or cand.axis is not None or cand.bns or not cand.seeded:
        return cand
    shape = shape_of(cand.base)
    if not shape:
        return None
    source = source_chan(cand.base, known)
    if source is not None and source.plain and static_int(shape[source.axis]) == source.channels:
        return replace(cand, axis=source.axis)
    for axis in dict.fromkeys((len(shape) - 1, min(1, len(shape) - 1))):
        size = static_int(shape[axis])
        if size is not None and reaches_layer(out, Chan(axis, size)):
            return replace(cand, axis=axis)
    return None


def _is_norm(
    cand: Affine | None,
    out: fx.Node,
    claimed: set[fx.Node],
    known: Callable[[fx.Node], Chan | None],
    analysis: _Analysis,
) -> bool:
    """A norm: a BN op or a per-channel constant product (``seeded``) on a channel axis, whose ops nothing outside
    reads (``_closed``), no norm chosen before holds, and that is not the weight of a GroupNorm an exporter wrote
    out (``holds_group_norm_weight``: without ``fold_norm_affine`` that affine stays the GroupNorm's)."""
    return (
        cand is not None
        and cand.seeded
        and (cand.axis is not None or bool(cand.bns))
        and not claimed.intersection(cand.nodes)
        and _closed(cand, out)
        and _is_channel_axis(cand, out, known)
        and not holds_group_norm_weight(cand.nodes, analysis.consts)
    )


def _choose(analysis: _Analysis) -> list[tuple[fx.Node, Affine]]:
    """The norms: from the graph's end, the largest affine ending at each node that is a norm (``_is_norm``),
    else the per-channel product at that node alone; in graph order."""
    known = _known_chan(analysis)
    claimed: set[fx.Node] = set()
    chosen: list[tuple[fx.Node, Affine]] = []
    for node in reversed(analysis.gm.graph.nodes):
        cands = [_on_channels(c, node, known) for c in (analysis.aff.get(node), analysis.back.get(node))]
        cands.append(analysis.fresh.get(node))
        cand = next((c for c in cands if _is_norm(c, node, claimed, known, analysis)), None)
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
    split = affine_kind(cand.nodes)  # the affine of a LayerNorm / RMSNorm / GroupNorm (``fold_norm_affine``)
    if split is not None and not cand.bns:
        return split
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
        # a learned scalar broadcast over every channel (a vector has the channels' size already)
        c = int(static_int(shape_of(cand.base)[cand.axis]))  # type: ignore[arg-type,index]
        scale, shift = (torch.broadcast_to(t, (c,)) if t is not None else None for t in (cand.scale, cand.shift))
        ops = [n.target for n in region]
        names: dict[str, str | None] = {"scale": None, "shift": None}
        if ops[:1] == [aten.mul.Tensor] and ops[1:] in ([], [aten.add.Tensor]):
            names["scale"] = _stored_name(cand.consts[0])
            names["shift"] = _stored_name(cand.consts[1]) if len(ops) == 2 else None
        elif len(cand.consts) == len(ops):  # a scalar product before it (GELU's * 0.5): the stored vector names it
            vectors = [
                _stored_name(c) for op, c in zip(ops, cand.consts, strict=True)
                if op is aten.mul.Tensor and isinstance(c, fx.Node) and (shape_of(c) or (1,))[-1] != 1
            ]  # fmt: skip
            names["scale"] = vectors[0] if len(vectors) == 1 else None
        return {"scale": scale, "shift": shift}, names, 0.0
    _, w, b, mean, var, _, eps = bn_args(cand.bns[0])
    nodes = {"weight": w, "bias": b, "running_mean": mean, "running_var": var}
    params: dict[str, Tensor | None] = {}
    for role, n in nodes.items():
        value = analysis.consts.value(n) if n is not None and analysis.consts.is_const(n) else None
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
    scale, shift, before = cand.scale, cand.shift, cand.before
    if scale is not None and shift is not None:  # (batch statistics: no affine, and channels may be a symbol)
        c = int(static_int(shape_of(base)[cand.axis if cand.axis is not None else 1]))  # type: ignore[arg-type,index]
        scale, shift = torch.broadcast_to(scale, (c,)).clone(), torch.broadcast_to(shift, (c,)).clone()
        before = tuple(torch.broadcast_to(t, (c,)).clone() for t in before) if before else None  # type: ignore[assignment]
    name = _name_norm(analysis.gm, core, "")
    if not name and cand.bns:  # RepBN's eta x written outside any module: the BN's own module names it
        name = _name_norm(analysis.gm, [n for n in region if n in cand.bns or n.target is operator.getitem], "")
    split = affine_kind(cand.nodes) is not None  # a norm op's affine: the norm's module names it, as it names the op
    first = [n for n in region if n not in cand.core and n.target not in PERMUTE_OPS] if before else []
    if not cand.bns and names["scale"] and not (split and name):  # a stored scale names its norm (``ls1.gamma``)
        name = names["scale"].removesuffix(".weight")
    return NormSite(
        name=name or region[0].meta.get("onnx") or region[0].name,  # an ONNX original: its node's name
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
        shifted=bool(cand.bns) or cand.shifted,
        before=before,
        composed=_name_norm(analysis.gm, first, first[0].meta.get("onnx") or first[0].name) if first else "",
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
    """Every norm of the graph (see the module docstring for which patterns count), in graph order, each of its own
    name (a module called twice makes two norms: the second is named ``<path>_1``, the TorchScript exporter's name
    for that call's scope).

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

    sites = [_site(analysis, out, cand, kept(cand.base)) for out, cand in chosen]
    taken, seen = {s.name for s in sites}, set[str]()
    for i, site in enumerate(sites):  # a module called twice: its second call's norm is `<path>_1`, as TorchScript's
        name, k = site.name, 0
        while name in seen or (k and name in taken):
            k, name = k + 1, f"{site.name}_{k + 1}"
        seen.add(name)
        sites[i] = replace(site, name=name)
    return sites
