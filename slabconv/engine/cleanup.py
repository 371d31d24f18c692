"""Graph cleanup after folding, and what the other stages read from a fused graph.

In: a ``GraphModule`` whose norms were rewritten (``slabconv.engine.rewriter``). Out: the same module with the
transposes and reshapes left around removed norms cancelled (``cancel_inverse_views``) and the tensors no node
reads any more deleted (``drop_unused_attrs``); the fused weights by name (``fused_state_dict``); and the
norm-free bound of a graph (``norm_free``: every norm replaced by identity).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx

from slabconv.engine.capture import attr, same_shape, shape_of
from slabconv.engine.rules import PERMUTE_OPS, RESHAPE_OPS, permutation


def _cancel(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` can be replaced by when it undoes the layout op that produced its input: two permutes
    that compose to the identity, or two reshapes that return their source's shape."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or src.op != "call_function" or not isinstance(src.args[0], fx.Node):
        return None
    if node.target in PERMUTE_OPS and src.target in PERMUTE_OPS:
        outer, inner = permutation(node), permutation(src)
        if outer is not None and inner is not None and [inner[i] for i in outer] == list(range(len(outer))):
            return src.args[0]
    elif node.target in RESHAPE_OPS and src.target in RESHAPE_OPS:
        if same_shape(shape_of(node), shape_of(src.args[0])):
            return src.args[0]
    return None


def cancel_inverse_views(gm: fx.GraphModule) -> int:
    """Remove permute pairs that compose to the identity and reshape pairs that return the shape their source
    started from (what is left of a norm's transposes once the norm is gone). Returns the count."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not node.users:
                continue
            replacement = _cancel(node)
            if replacement is not None:
                node.replace_all_uses_with(replacement)
                removed += 1
                changed = True
        remove_dead_code(gm)
    return removed


def remove_dead_code(gm: fx.GraphModule) -> None:
    """``Graph.eliminate_dead_code`` that also keeps every call of a higher-order op and every submodule call.

    fx keeps the in-place ATen ops it knows (``mul_``), but not a higher-order op whose result nobody reads:
    ``torch.export`` records a ``torch.no_grad()`` block as ``wrap_with_set_grad_enabled`` over a submodule, and
    an update of a parameter inside it (a forward that decays a gain as it runs) would be dropped with it, so the
    folded graph would stop updating what the original updates.
    """

    def impure(node: fx.Node) -> bool:
        if node.op == "call_module":
            return True
        return isinstance(node.target, torch._ops.HigherOrderOperator) or node.is_impure()

    gm.graph.eliminate_dead_code(is_impure_node=impure)


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


def norm_free(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every norm's output replaced by its input (weights untouched): the norm-free bound,
    the fastest a complete fold can make the model."""
    from slabconv.engine.norms import find_norms

    out = copy.deepcopy(gm)
    for site in find_norms(out):
        site.output.replace_all_uses_with(site.current_input())
    remove_dead_code(out)
    cancel_inverse_views(out)
    remove_dead_code(out)
    drop_unused_attrs(out)
    out.recompile()
    return out
