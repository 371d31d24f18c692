"""One decision per norm, with its reason, and the graph rewrite that carries it out.

For each norm (``slabconv.graph.find_norms``) in topological order:

1. ``folded-forward``: every path from the norm's output ends at a consumer that can absorb the affine
   (Linear / unpadded conv): scale their input columns, shift their bias (``slabconv.fold``), drop the norm.
2. ``folded-backward``: some path is blocked, but the norm's input is produced by a Linear/conv that nothing
   else reads: scale its output rows, drop the norm. Exact on every path at once.
3. ``kept-affine``: neither is possible. Consumers that can absorb the affine still get it; on each blocked
   path one per-channel ``x * scale + shift`` stays (no BN op, no transposes), with the reason.
4. ``kept``: the norm is not a fixed affine at all (batch statistics, train mode), or its affine does not fit
   the model's dtype; the BN op is left as it is.

The kept affine is inserted before the norm is removed and replaces only the blocked op's reads of the
normalised tensor: a blocked op that also reads the norm's input (``x + bn(x)``) keeps that operand.

Decisions are data (``Decision``); the report, ``inspect`` and the docs are rendered from them. The graph is
then cleaned: transposes/reshapes that cancel out are removed, dead nodes and unused weights dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from slabconv import fold
from slabconv.engine import reasons
from slabconv.engine.graph import (
    BlockedEdge,
    Chan,
    ConsumerUse,
    NormSite,
    Producer,
    attr,
    conv_params,
    find_norms,
    find_producer,
    follow,
    module_path,
    same_size,
    shape_of,
)
from slabconv.errors import InputError

aten = torch.ops.aten

FOLDED_FORWARD = "folded-forward"
FOLDED_BACKWARD = "folded-backward"
KEPT_AFFINE = "kept-affine"
KEPT = "kept"


@dataclass
class Decision:
    """What happens to one norm. ``to_dict`` is the ``folds[]`` entry of ``report.json``.

    Attributes:
        norm: module path of the norm (``blocks.0.norm1``).
        kind: ``RepBN`` or ``BatchNorm``.
        action: ``folded-forward``, ``folded-backward``, ``kept-affine`` or ``kept``.
        into: the layers that absorbed the affine (module paths).
        reason: why an affine (or the norm) stays, None when folded away.
        kept_on: the ops in front of which an affine stays (``kept-affine``).
        paths: every blocked path as ``{"before": <module>:<op>, "reason": <reason>}``, in graph order (the
            ``reason`` field is the first of these).
        warnings: facts the user should know (unfinished progressive schedule, ...).
    """

    norm: str
    kind: str
    action: str
    into: list[str] = field(default_factory=list)
    reason: str | None = None
    kept_on: list[str] = field(default_factory=list)
    paths: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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
        }


def layer_name(node: fx.Node) -> str:
    """A readable name for a consumer/producer: its weight's path without ``.weight``."""
    weight = node.args[1] if node.target is not aten.addmm.default else node.args[2]
    if isinstance(weight, fx.Node) and weight.op != "get_attr":
        weight = weight.args[0]
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        return str(weight.target).removesuffix(".weight")
    return node.name


def op_site(node: fx.Node) -> str:
    """``<module path>:<op>`` for a blocking op, e.g. ``blocks.0:aten.add``."""
    paths = module_path(node)
    return f"{paths[-1] if paths else '<model>'}:{reasons.unsupported(node).removeprefix(reasons.UNSUPPORTED_PREFIX)}"


def _progressive_warnings(gm: fx.GraphModule, name: str) -> list[str]:
    """A warning when the norm sits in a ``LinearNorm`` whose schedule had not reached pure RepBN."""
    owner: Any = gm
    for part in name.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return []
    counters = {k: getattr(owner, k, None) for k in ("warm", "iter", "total_step")}
    if any(not isinstance(v, torch.Tensor) for v in counters.values()):
        return []
    warm, it, total = (int(counters[k]) for k in ("warm", "iter", "total_step"))  # type: ignore[arg-type]
    return schedule_warnings(warm, it, total)


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


_HALF = (torch.float16, torch.bfloat16)


def _precision_warnings(site: NormSite, scale: torch.Tensor, shift: torch.Tensor) -> list[str]:
    """A warning when a forward fold / kept affine in float16 or bfloat16 amplifies rounding past the tolerance.

    The original BN computes ``s (x - mu) + E[y]`` (in float32 inside); the fold computes ``s x`` in the model's
    dtype and adds ``t`` (in the consumer's weights or the kept affine). Rounding then scales with
    ``|s| rms(x)`` instead of ``rms(y)``: by ``kappa = |s| sqrt(mu^2 + v) / sqrt((s mu + t)^2 + s^2 v)`` per
    channel, large when a channel's running mean is many standard deviations from 0. Estimated relative error
    ``kappa * eps/2`` is compared with DESIGN.md section 5's tolerance; the fold stays exact in exact arithmetic,
    so this is a warning with the numbers (verification decides), not a refusal.
    """
    dtype = site.input.meta["val"].dtype
    if dtype not in _HALF:
        return []
    from slabconv.verify.policy import DEFAULT_RTOL

    mean = site.params["running_mean"].detach().double()  # type: ignore[union-attr]
    var = site.params["running_var"].detach().double().clamp_min(0)  # type: ignore[union-attr]
    rms_sx = scale.abs() * torch.sqrt(mean**2 + var)
    rms_y = torch.sqrt((scale * mean + shift) ** 2 + scale**2 * var).clamp_min(torch.finfo(torch.float64).tiny)
    kappa = rms_sx / rms_y
    worst = int(kappa.argmax())
    estimate = float(kappa[worst]) * torch.finfo(dtype).eps / 2
    tolerance = DEFAULT_RTOL[str(dtype).removeprefix("torch.")]
    if estimate <= tolerance:
        return []
    ratio = float(mean[worst].abs() / var[worst].sqrt().clamp_min(1e-30))
    return [
        f"{str(dtype).removeprefix('torch.')} precision: channel {worst} has |running_mean| / std = {ratio:.3g}; "
        f"computing s*x + t in {str(dtype).removeprefix('torch.')} amplifies rounding {float(kappa[worst]):.3g}x "
        f"(estimated relative error {estimate:.2g} > tolerance {tolerance:g}); verification decides"
    ]


def _check_stats(site: NormSite) -> None:
    for key in ("running_mean", "running_var", "weight", "bias", "alpha"):
        t = site.params[key]
        if t is not None and not bool(torch.isfinite(t).all()):
            raise InputError(f"norm {site.name}: {key} holds NaN or Inf; the checkpoint is damaged")
    var = site.params["running_var"]
    if var is not None and bool((var.double() + site.eps <= 0).any()):
        raise InputError(f"norm {site.name}: running_var + eps <= 0 for some channel; the checkpoint is damaged")


@dataclass
class _Fold:
    """A pending weight update: ``target -> tensor``, and a bias to create when the layer had none."""

    updates: dict[str, torch.Tensor]
    new_bias: tuple[fx.Node, torch.Tensor] | None = None


def _is_private(gm: fx.GraphModule, param: fx.Node | None) -> bool:
    """True when one layer alone reads this weight or bias (a tied tensor must not be rescaled for one reader).
    A missing bias (None) is private: the fold creates a new one."""
    if param is None:
        return True
    same_target = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == param.target]
    return len(same_target) == 1 and len(param.users) == 1


def _bias_of(node: fx.Node) -> fx.Node | None:
    if node.target is aten.addmm.default:
        return node.args[0]  # type: ignore[return-value]
    if node.target is aten.mm.default:
        return None
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")  # type: ignore[return-value]


def _tiled(values: torch.Tensor, chan: Chan, src: fx.Node) -> torch.Tensor:
    """Per-channel ``values`` laid out along the axis ``chan`` names on ``src``."""
    shape = shape_of(src)
    assert shape is not None
    return fold.tile_channels(values, chan.inner, int(shape[chan.axis]))


def _forward_fold(gm: fx.GraphModule, use: ConsumerUse, scale: torch.Tensor, shift: torch.Tensor) -> _Fold:
    bias_node = _bias_of(use.node)
    weight = attr(gm, use.weight)
    bias = attr(gm, bias_node)
    assert weight is not None
    s, t = _tiled(scale, use.chan, use.src), _tiled(shift * use.mult, use.chan, use.src)
    if use.kind == "linear":
        w, b = fold.fold_into_linear(weight, bias, s, t)
    else:
        w, b = fold.fold_into_conv(weight, bias, s, t, int(conv_params(use.node)["groups"]))
    result = _Fold({str(use.weight.target): w})
    if bias_node is None:
        result.new_bias = (use.node, b)
    else:
        result.updates[str(bias_node.target)] = b
    return result


def _backward_fold(gm: fx.GraphModule, producer: Producer, scale: torch.Tensor, shift: torch.Tensor) -> _Fold:
    weight, bias = attr(gm, producer.weight), attr(gm, producer.bias)
    assert weight is not None
    w, b = fold.fold_into_producer(weight, bias, scale, shift)
    result = _Fold({str(producer.weight.target): w})
    if producer.bias is None:
        result.new_bias = (producer.node, b)
    else:
        result.updates[str(producer.bias.target)] = b
    return result


def _fits(f: _Fold) -> bool:
    tensors = list(f.updates.values()) + ([f.new_bias[1]] if f.new_bias else [])
    return fold.fits_dtype(*tensors)


def _affine_fits(site: NormSite, edges: list[BlockedEdge], scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """True when the per-channel affine kept on each blocked edge is finite in that tensor's dtype."""
    for edge in edges:
        dtype = _base(site, edge).meta["val"].dtype
        if not fold.fits_dtype(scale.to(dtype), (shift * edge.mult).to(dtype)):
            return False
    return True


# --------------------------------------------------------------------------------------------- rewriting


def set_tensor(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Store ``value`` at the dotted ``target`` of ``gm`` as a frozen parameter (creating parent modules)."""
    *path, leaf = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        if hasattr(owner, leaf) and leaf not in owner._parameters:
            delattr(owner, leaf)
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _free_target(gm: fx.GraphModule, wanted: str) -> str:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    names = set(dict(gm.named_parameters(remove_duplicate=False))) | set(dict(gm.named_buffers()))
    target, i = wanted, 1
    while target in used or target in names:
        target, i = f"{wanted}_{i}", i + 1
    return target


def _new_attr(gm: fx.GraphModule, wanted: str, value: torch.Tensor) -> fx.Node:
    target = _free_target(gm, wanted)
    set_tensor(gm, target, value)
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(target)
    node.meta["val"] = value
    return node


def _attach_bias(gm: fx.GraphModule, layer: fx.Node, weight: fx.Node, bias: torch.Tensor) -> None:
    stem = str(weight.target).removesuffix(".weight")
    node = _new_attr(gm, f"{stem}.bias", bias)
    if layer.target is aten.mm.default:
        layer.target = aten.addmm.default
        layer.args = (node, *layer.args)
    else:
        args = list(layer.args)
        while len(args) < 3:
            args.append(None)
        args[2] = node
        layer.args = tuple(args)
        layer.kwargs = {k: v for k, v in layer.kwargs.items() if k != "bias"}


def _apply_fold(gm: fx.GraphModule, f: _Fold, weight_of: Callable[[fx.Node], fx.Node]) -> None:
    for target, value in f.updates.items():
        set_tensor(gm, target, value)
    if f.new_bias is not None:
        layer, bias = f.new_bias
        _attach_bias(gm, layer, weight_of(layer), bias)


def _weight_node(layer: fx.Node) -> fx.Node:
    w = layer.args[2] if layer.target is aten.addmm.default else layer.args[1]
    if layer.target in (aten.addmm.default, aten.mm.default):
        w = w.args[0]  # type: ignore[union-attr]
    assert isinstance(w, fx.Node)
    return w


def _base(site: NormSite, edge: BlockedEdge) -> fx.Node:
    """The tensor the kept affine reads: the norm's input when the blocked op reads the norm's output itself."""
    return site.input if edge.src is site.output else edge.src


def _insert_affines(
    gm: fx.GraphModule, site: NormSite, edges: list[BlockedEdge], scale: torch.Tensor, shift: torch.Tensor
) -> None:
    """One ``x * scale + shift`` per (source, channel layout, multiplier), fed to each blocked op in place of
    ``edge.src``. Runs before the norm is removed, so a blocked op that also reads the norm's input (``x + bn(x)``)
    keeps that operand: only its reads of ``edge.src`` are rewired."""
    made: dict[tuple[fx.Node, Chan, float], fx.Node] = {}
    for edge in edges:
        base = _base(site, edge)
        key = (edge.src, edge.chan, edge.mult)
        if key not in made:
            val = base.meta["val"]
            bshape = (-1, *([1] * (val.dim() - 1 - edge.chan.axis)))
            s = _tiled(scale, edge.chan, base).to(device=val.device, dtype=val.dtype).reshape(bshape)
            t = _tiled(shift * edge.mult, edge.chan, base).to(device=val.device, dtype=val.dtype).reshape(bshape)
            s_node = _new_attr(gm, f"{site.name}.scale", s)
            t_node = _new_attr(gm, f"{site.name}.shift", t)
            with gm.graph.inserting_after(base):
                mul = gm.graph.call_function(aten.mul.Tensor, (base, s_node))
            with gm.graph.inserting_after(mul):
                add = gm.graph.call_function(aten.add.Tensor, (mul, t_node))
            mul.meta["val"] = add.meta["val"] = val
            mul.meta["nn_module_stack"] = add.meta["nn_module_stack"] = site.bn.meta.get("nn_module_stack", {})
            made[key] = add
        edge.dst.replace_input_with(edge.src, made[key])


def _remove_region(gm: fx.GraphModule, site: NormSite) -> None:
    site.output.replace_all_uses_with(site.input)
    for node in reversed(site.region):
        if not node.users:
            gm.graph.erase_node(node)


def _graph_order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def decide_and_apply(gm: fx.GraphModule, site: NormSite) -> Decision:
    """Decide what to do with one norm and rewrite ``gm`` accordingly (weights and graph).

    Order of preference: fold forward into every consumer (nothing blocked); else fold backward into the
    producer (exact on every path at once); else fold forward where possible and keep one per-channel affine on
    each blocked path. A norm that is not a fixed affine (batch statistics) stays as it is (``kept``), and so
    does one whose kept affine would overflow its dtype.
    """
    decision = Decision(norm=site.name, kind=site.kind, action=KEPT)
    decision.warnings += _progressive_warnings(gm, site.name)
    if site.training:
        has_stats = site.params["running_mean"] is not None
        decision.reason = reasons.TRAIN_MODE if has_stats else reasons.BATCH_STATS_IN_EVAL
        decision.paths = [{"before": op_site(site.bn), "reason": decision.reason}]
        return decision
    _check_stats(site)
    assert site.params["running_mean"] is not None and site.params["running_var"] is not None
    scale, shift = fold.repbn_affine(
        site.params["running_mean"],
        site.params["running_var"],
        site.eps,
        site.params["weight"],
        site.params["bias"],
        site.params["alpha"],
    )
    chan = Chan(site.channel_axis, site.channels)
    flow = follow(site.output, chan, positive_scale=bool((scale > 0).all()))
    folds: list[tuple[ConsumerUse, _Fold]] = []
    blocked = list(flow.blocked)
    for use in flow.consumers:
        if not (_is_private(gm, use.weight) and _is_private(gm, _bias_of(use.node))):
            blocked.append(BlockedEdge(use.src, use.node, use.chan, use.mult, reasons.SHARED_WEIGHT))
            continue
        f = _forward_fold(gm, use, scale, shift)
        if not _fits(f):
            blocked.append(BlockedEdge(use.src, use.node, use.chan, use.mult, reasons.DTYPE_OVERFLOW))
            continue
        folds.append((use, f))
    order = _graph_order(gm)
    blocked.sort(key=lambda e: (order[e.dst], order[e.src]))

    if not blocked:
        for _, f in folds:
            _apply_fold(gm, f, _weight_node)
        _remove_region(gm, site)
        decision.action = FOLDED_FORWARD
        decision.into = sorted({layer_name(use.node) for use, _ in folds})
        decision.warnings += _precision_warnings(site, scale, shift)
        return decision

    producer = find_producer(site)
    if producer is not None and _is_private(gm, producer.weight) and _is_private(gm, producer.bias):
        f = _backward_fold(gm, producer, scale, shift)
        if _fits(f):
            _apply_fold(gm, f, _weight_node)
            _remove_region(gm, site)
            decision.action = FOLDED_BACKWARD
            decision.into = [layer_name(producer.node)]
            return decision

    decision.paths = _paths(blocked)
    if not _affine_fits(site, blocked, scale, shift):
        decision.reason = reasons.DTYPE_OVERFLOW
        return decision  # the BN stays as it is: its scale or shift is not representable in the model's dtype
    for _, f in folds:
        _apply_fold(gm, f, _weight_node)
    _insert_affines(gm, site, blocked, scale, shift)
    _remove_region(gm, site)
    decision.action = KEPT_AFFINE
    decision.into = sorted({layer_name(use.node) for use, _ in folds})
    decision.warnings += _precision_warnings(site, scale, shift)
    decision.reason = blocked[0].reason
    decision.kept_on = sorted({op_site(e.dst) if e.dst.op != "output" else "<output>" for e in blocked})
    return decision


def _paths(blocked: list[BlockedEdge]) -> list[dict[str, str]]:
    """``{"before": <module>:<op>, "reason": ...}`` for every blocked path, in graph order, without repeats."""
    out: list[dict[str, str]] = []
    for e in blocked:
        entry = {"before": op_site(e.dst) if e.dst.op != "output" else "<output>", "reason": e.reason}
        if entry not in out:
            out.append(entry)
    return out


# --------------------------------------------------------------------------------------------- cleanup


_PERMUTES = {aten.permute.default, aten.transpose.int, aten.t.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _perm(node: fx.Node) -> list[int] | None:
    shape = shape_of(node.args[0])  # type: ignore[arg-type]
    if shape is None:
        return None
    rank = len(shape)
    if node.target is aten.permute.default:
        dims: Any = node.args[1]
        return [d % rank for d in dims]
    order = list(range(rank))
    if node.target is aten.t.default:
        return order[::-1] if rank == 2 else order
    args: Any = node.args
    a, b = args[1] % rank, args[2] % rank
    order[a], order[b] = order[b], order[a]
    return order


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    sa, sb = shape_of(a), shape_of(b)
    return (
        sa is not None
        and sb is not None
        and len(sa) == len(sb)
        and all(same_size(x, y) for x, y in zip(sa, sb, strict=True))
    )


def cancel_inverse_views(gm: fx.GraphModule) -> int:
    """Remove ``permute(permute(x))`` pairs that compose to the identity and reshapes that return the shape
    their source started from (what is left of a norm's transposes once the norm is gone). Returns the count."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not node.users:
                continue
            src = node.args[0] if node.args else None
            if not isinstance(src, fx.Node) or src.op != "call_function":
                continue
            if node.target in _PERMUTES and src.target in _PERMUTES:
                p_outer, p_inner = _perm(node), _perm(src)
                if p_outer is None or p_inner is None:
                    continue
                if [p_inner[i] for i in p_outer] == list(range(len(p_outer))):
                    node.replace_all_uses_with(src.args[0])
                    removed += 1
                    changed = True
            elif node.target in _VIEWS and src.target in _VIEWS and _same_shape(node, src.args[0]):  # type: ignore[arg-type]
                node.replace_all_uses_with(src.args[0])
                removed += 1
                changed = True
        gm.graph.eliminate_dead_code()
    return removed


def drop_unused_attrs(gm: fx.GraphModule) -> None:
    """Delete parameters and buffers that no ``get_attr`` node reads any more (the folded norms' weights)."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n, _ in gm.named_parameters(remove_duplicate=False)] + [n for n, _ in gm.named_buffers()]:
        if name in used:
            continue
        *path, leaf = name.split(".")
        owner: Any = gm
        for part in path:
            owner = getattr(owner, part)
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)


def fused_state_dict(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the fused graph reads, by its dotted name (the original state_dict keys where they exist)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attr(gm, node)
            if isinstance(value, torch.Tensor):
                out[node.target] = value.detach()
    return out


def fold_all(gm: fx.GraphModule, progress: Callable[[str], None] | None = None) -> list[Decision]:
    """Decide and apply a fold for every norm of ``gm`` (in place), then clean the graph.

    Args:
        gm: an unlifted export graph (``slabconv.graph.capture``).
        progress: called with each norm's name as it is processed.

    Returns:
        One ``Decision`` per norm, in graph order.

    Raises:
        InputError: a norm's statistics are NaN/Inf or its running_var + eps <= 0.
    """
    decisions: list[Decision] = []
    done: set[fx.Node] = set()
    while True:
        pending = [s for s in find_norms(gm) if s.bn not in done]
        if not pending:
            break
        site = pending[0]
        decisions.append(decide_and_apply(gm, site))
        done.add(site.bn)
        if progress is not None:
            progress(site.name)
    cancel_inverse_views(gm)
    gm.graph.eliminate_dead_code()
    drop_unused_attrs(gm)
    gm.graph.lint()
    gm.recompile()
    return decisions


def norm_free(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every norm's output replaced by its input (weights untouched): the norm-free bound,
    the fastest a complete fold can make the model."""
    import copy

    out = copy.deepcopy(gm)
    for site in find_norms(out):
        site.output.replace_all_uses_with(site.input)
    out.graph.eliminate_dead_code()
    cancel_inverse_views(out)
    out.graph.eliminate_dead_code()
    drop_unused_attrs(out)
    out.recompile()
    return out
