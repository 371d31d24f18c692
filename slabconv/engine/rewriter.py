"""Carry out the plans: write the new weights, attach created biases, insert kept affines, remove the norms.

In: the export graph and its ``NormPlan`` list (``slabconv.engine.planner.plan_folds``), in graph order. Out: the same
``GraphModule``, rewritten in place. ``fold_all`` runs the whole engine: find the norms, plan, apply, clean up. The
folded layers' tensors are the fold program's values (``slabconv.engine.program``), the plans' only source of
values: each is every fold the tensor receives composed in float64 and rounded once.

A kept affine is inserted before its norm is removed and replaces only the blocked op's reads of the normalised
tensor: a blocked op that also reads the norm's input (``x * bn(x)``) keeps that operand. A norm's input is read
from the graph when its plan is applied (``NormSite.current_input``): an earlier norm may have replaced it by its
own input or by its kept affine.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx, nn

from slabconv.engine.capture import stored
from slabconv.engine.cleanup import cancel_inverse_views, drop_unused_attrs, fused_state_dict, remove_dead_code
from slabconv.engine.flow import BlockedEdge
from slabconv.engine.norm_affine import join_norm_affines, split_norm_affines
from slabconv.engine.planner import Decision, NormPlan, plan_folds
from slabconv.engine.program import (
    FOLD_BLOCK,
    FoldProgram,
    TensorStore,
    build_program,
    evaluate,
    kept_affine,
    layer_recipes,
)
from slabconv.engine.ranges import flag_warnings
from slabconv.engine.rules import Chan

FoldProgress = Callable[[str, int, int], None]
"""``(norm name, norms applied so far, norms in the graph)``, called as each norm is applied."""


def set_tensor(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Store ``value`` at the dotted ``target`` of ``gm`` (creating parent modules): in a buffer's place as the
    buffer, else as a parameter whose ``requires_grad`` is that of the parameter it replaces, or for a new one
    (a created bias) that of its module's other parameters (False when there are none).

    The fused graph's parameters thus behave as the original's: ``requires_grad`` changes which kernels torch runs
    even under ``torch.no_grad`` (on CUDA a graph whose folded weights alone are frozen runs slower than the same
    graph with every weight requiring grad: ``benchmarks/inference.py --gpu`` times both)."""
    *path, leaf = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
        return
    replaced = owner._parameters.get(leaf)
    if replaced is not None:
        requires_grad = replaced.requires_grad
    else:
        requires_grad = any(p.requires_grad for p in owner._parameters.values() if p is not None)
    if hasattr(owner, leaf) and leaf not in owner._parameters:
        delattr(owner, leaf)
    value = value.detach()
    owner._parameters[leaf] = nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())


def free_target(gm: fx.GraphModule, wanted: str) -> str:
    """``wanted``, or ``wanted_<i>`` when the graph or the module already uses that name; a path through a stored
    tensor (``gamma.scale`` beside a parameter ``gamma``) becomes ``gamma_scale``."""
    *path, leaf = wanted.split(".")
    owner: Any = gm
    for i, part in enumerate(path):
        owner = getattr(owner, part, None)
        if owner is None:
            break
        if not isinstance(owner, nn.Module):
            wanted = ".".join([*path[:i], "_".join([*path[i:], leaf])])
            break
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    names = set(dict(gm.named_parameters(remove_duplicate=False))) | set(dict(gm.named_buffers()))
    target, i = wanted, 1
    while target in used or target in names:
        target, i = f"{wanted}_{i}", i + 1
    return target


def new_attr(gm: fx.GraphModule, target: str, value: torch.Tensor) -> fx.Node:
    """Store ``value`` at ``target`` (which must be free) and return a ``get_attr`` node for it, placed first."""
    assert free_target(gm, target) == target, f"{target} is already used"
    set_tensor(gm, target, value)
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(target)
    node.meta["val"] = value
    return node


def _insert_affines(gm: fx.GraphModule, p: NormPlan, base_of_output: fx.Node) -> None:
    """One ``x * scale + shift`` per (source, channel layout, multiplier), fed to each blocked op in place of
    ``edge.src``; without shift (exactly zero) only the multiply."""
    site = p.site
    made: dict[tuple[fx.Node, Chan, float], fx.Node] = {}
    for edge in p.kept:
        base = base_of_output if edge.src is site.output else edge.src
        key = (edge.src, edge.chan, edge.mult)
        if key not in made:
            made[key] = _affine(gm, p, edge, base)
        edge.dst.replace_input_with(edge.src, made[key])


def _affine(gm: fx.GraphModule, p: NormPlan, edge: BlockedEdge, base: fx.Node) -> fx.Node:
    val = base.meta["val"]
    bshape = (-1, *([1] * (val.dim() - 1 - edge.chan.axis)))
    s, t = (v.to(device=val.device, dtype=val.dtype) for v in kept_affine(p, edge, int(val.shape[edge.chan.axis])))
    s = s.reshape(bshape)
    s_node = new_attr(gm, free_target(gm, f"{p.site.name}.scale"), s)
    with gm.graph.inserting_after(base):
        mul = gm.graph.call_function(torch.ops.aten.mul.Tensor, (base, s_node))
    out = mul
    if bool(t.any()):
        t_node = new_attr(gm, free_target(gm, f"{p.site.name}.shift"), t.reshape(bshape))
        with gm.graph.inserting_after(mul):
            out = gm.graph.call_function(torch.ops.aten.add.Tensor, (mul, t_node))
    for node in {mul, out}:
        node.meta["val"] = val
        node.meta["nn_module_stack"] = p.site.anchor.meta.get("nn_module_stack", {})
    return out


def apply_plan(gm: fx.GraphModule, p: NormPlan, values: dict[str, torch.Tensor]) -> None:
    """Rewrite ``gm`` for one norm's plan (nothing for ``kept``): attach the biases it creates, holding their
    ``values`` (the fold program's, ``apply_folds``), keep its affines, remove the norm."""
    if not p.remove:
        return
    for nb in p.new_biases:
        nb.kind.attach_bias(nb.layer, new_attr(gm, nb.target, values[nb.target]))
    if p.unit is not None:  # a LayerNorm / RMSNorm / GroupNorm op keeps a weight of ones where its affine was
        norm, position, weight = p.unit
        set_tensor(gm, str(weight.target), torch.ones_like(stored(gm, str(weight.target))))
        norm.update_arg(position, weight)
    base = p.site.current_input()
    _insert_affines(gm, p, base)
    p.site.output.replace_all_uses_with(base)
    for node in reversed(p.site.region):
        if not node.users:
            gm.graph.erase_node(node)


def apply_folds(
    gm: fx.GraphModule,
    plans: list[NormPlan],
    progress: FoldProgress | None = None,
    values: dict[str, torch.Tensor] | None = None,
) -> None:
    """Apply every plan in order (``apply_plan``), then drop dead nodes and recompile ``gm``; ``progress`` is
    called with each norm's name, how many are applied and how many there are. The plans must come from
    ``plan_folds`` on this graph, unchanged since. ``values``: every folded layer's weight and bias by target (the
    fold program's, ``program.evaluate``); by default the program of ``plans`` run over ``gm``'s tensors now."""
    if values is None:
        values = evaluate(FoldProgram({}, layer_recipes(gm, plans)), TensorStore(_stored_tensors(gm)))
    created = {nb.target for p in plans if p.remove for nb in p.new_biases}
    for target, value in values.items():
        if target not in created:
            set_tensor(gm, target, value)
    for i, p in enumerate(plans, 1):
        apply_plan(gm, p, values)
        if progress is not None:
            progress(p.site.name, i, len(plans))
    remove_dead_code(gm)
    gm.recompile()


def _stored_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor ``gm``'s graph reads (``get_attr``), by target."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return {t: v for t in targets if isinstance(v := stored(gm, t), torch.Tensor)}


def _stand_ins(plans: list[NormPlan], gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The biases a streamed plan creates, as meta tensors of their shape (the layer's output channels,
    ``LayerKind.bias_size``) and dtype: their values are the program's, made as it writes them."""
    created = {nb.layer: nb.target for p in plans if p.remove for nb in p.new_biases}
    folds = {created[f.layer]: f for p in plans if p.remove for f in p.folds if f.layer in created}
    out = {}
    for target, f in folds.items():
        w = stored(gm, f.weight)
        size = f.kind.bias_size(tuple(w.shape), f.kind.groups(f.layer))
        out[target] = torch.empty(size, dtype=w.dtype, device="meta")
    return out


def fold_all(gm: fx.GraphModule, progress: FoldProgress | None = None, norm_affine: bool = False) -> list[Decision]:
    """Find every norm of ``gm``, decide and apply a fold for each (in place), then clean the graph; the folded
    layers' tensors are the fold program's (``fold_program``).

    Args:
        gm: an unlifted export graph (``slabconv.engine.capture``).
        progress: called as each norm is applied, with its name, how many are done and how many there are.
        norm_affine: also fold the affine of every LayerNorm, RMSNorm and GroupNorm
            (``slabconv.engine.norm_affine``; ``LoadOptions.fold_norm_affine``).

    Returns:
        One ``Decision`` per norm, in graph order.

    Raises:
        InputError: a norm's statistics are NaN/Inf or its running_var + eps <= 0.
        UnsupportedModelError: a BN whose statistics depend on the input (``find_norms``).
    """
    return fold_program(gm, progress, norm_affine=norm_affine)[0]


def fold_program(
    gm: fx.GraphModule,
    progress: FoldProgress | None = None,
    unknown: Collection[str] = (),
    block_elements: int = FOLD_BLOCK,
    plans: list[NormPlan] | None = None,
    norm_affine: bool = False,
) -> tuple[list[Decision], FoldProgram]:
    """``fold_all`` that also returns the fold program (``slabconv.engine.program``).

    Without ``unknown``, the program is evaluated over ``gm``'s original tensors (one block of rows at a time, as
    the streamed mode does) and its results are what the fused graph stores. With ``unknown`` (a streamed plan:
    those tensors are stand-ins, ``planner.plan_folds``), nothing is evaluated: the caller runs the program over
    the real weights. ``plans``: ``plan_folds(gm, unknown=unknown)`` when the caller already made it (on this
    graph, as it is now). ``norm_affine``: split the affine of every LayerNorm / RMSNorm / GroupNorm first
    (``norm_affine.split_norm_affines``; a caller that passes ``plans`` splits before planning). Every split
    affine that does not fold away goes back into its op (``join_norm_affines``).
    """
    if norm_affine and plans is None:
        split_norm_affines(gm)
    original = _stored_tensors(gm)
    plans = plan_folds(gm, unknown=unknown) if plans is None else plans
    layers = layer_recipes(gm, plans)
    evaluated = FoldProgram({}, layers, folded={w: v for p in plans for w, v in p.folded.items()})
    if unknown:
        values = _stand_ins(plans, gm)
    else:
        values = evaluate(evaluated, TensorStore(original), block_elements)
    apply_folds(gm, plans, progress, values)
    join_norm_affines(gm)
    cancel_inverse_views(gm)
    remove_dead_code(gm)
    drop_unused_attrs(gm)
    gm.graph.lint()
    gm.recompile()
    units = {str(p.unit[2].target) for p in plans if p.remove and p.unit is not None}
    program = build_program(layers, set(original), fused_state_dict(gm), units)
    program.ranges = evaluated.ranges
    decisions = [p.decision for p in plans]
    if not unknown:
        flag_warnings(decisions, list(program.ranges.values()))
    return decisions, program
