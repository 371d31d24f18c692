"""Numeric faults, named before anything is written: a fused model whose output is not finite.

A fold is exact in exact arithmetic, but its weights and activations live in the checkpoint's dtype. When a
norm's affine is extreme (an ``alpha`` of 3e38 in float32), the folded layer overflows. ``check_finite`` runs the
fused graph once on the example input; if its output is not finite, it walks the graph node by node to the first
value that is not finite, and names the norm whose fold fed that node, with its largest scale or shift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from slabconv import engine
from slabconv.errors import NumericError
from slabconv.load.model import LoadedModel
from slabconv.verify.policy import dtype_name


def _finite(value: Any) -> bool:
    leaves = torch.utils._pytree.tree_leaves(value)
    return all(bool(torch.isfinite(t).all()) for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())


class _FirstNonFinite(fx.Interpreter):
    """Runs a graph and stops at the first node whose floating output is not finite while its inputs were."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.culprit: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if self.culprit is None and n.op == "call_function" and not _finite(value):
            self.culprit = n
        return value


def first_non_finite(gm: fx.GraphModule, example: torch.Tensor) -> fx.Node | None:
    """The first node of ``gm`` whose output is not finite on ``example``, or None."""
    interpreter = _FirstNonFinite(gm)
    with torch.no_grad():
        interpreter.run(example)
    return interpreter.culprit


def _extremes(original: fx.GraphModule) -> dict[str, float]:
    """Each norm's largest ``|scale|`` or ``|shift|`` (its affine as found, ``NormSite.scale`` / ``shift``, float64:
    a BatchNorm's Lemma 4.1 affine, a LayerScale's vector, a chain composed into one norm), by name."""
    out: dict[str, float] = {}
    for site in engine.find_norms(original):
        if site.scale is not None and site.shift is not None:
            out[site.name] = float(torch.cat([site.scale.abs().reshape(-1), site.shift.abs().reshape(-1)]).max())
    return out


def _layer_of(node: fx.Node) -> str:
    """The layer a node belongs to: the stem of the weight it reads, else its module path."""
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            return str(arg.target).rsplit(".", 1)[0]
    stack = node.meta.get("nn_module_stack") or {}
    paths = [fqn for fqn, _ in stack.values() if fqn]
    return paths[-1] if paths else node.name


def check_finite(
    loaded: LoadedModel,
    original: fx.GraphModule,
    fused: fx.GraphModule,
    decisions: Sequence[engine.Decision],
    example: torch.Tensor,
) -> None:
    """Stop before anything is written when the fused model's output is not finite on ``example``.

    Raises:
        NumericError: naming the first non-finite node, the norm whose fold fed it (with its largest scale or
            shift), and whether the original overflows too.
    """
    with torch.no_grad(), engine.state_kept(original, fused):  # a probe: the state written is the program's own
        if _finite(fused(example)):
            return
        original_finite = _finite(original(example))
        node = first_non_finite(fused, example)
    layer = _layer_of(node) if node is not None else "the output"
    dtype = dtype_name(loaded.dtype)
    extremes = _extremes(original)
    norm = next((d for d in decisions if layer in d.into or layer.startswith(d.norm)), None)
    if norm is None and extremes:  # the overflow surfaced a few ops later: the norm with the most extreme affine
        name = max(extremes, key=lambda n: extremes[n])
        norm = next((d for d in decisions if d.norm == name), None)
        layer = ", ".join(norm.into) if norm is not None and norm.into else layer
    also = "; the original model overflows too" if not original_finite else ""
    if norm is not None:
        value = extremes.get(norm.norm)
        shown = f" (its scale or shift reaches {value:.3g})" if value is not None else ""
        raise NumericError(
            f"{loaded.checkpoint.path}: norm {norm.norm}{shown} makes {layer} overflow {dtype} after the fold "
            f"(first value that is not finite){also}: the statistics are extreme for this dtype; nothing was written"
        )
    raise NumericError(
        f"{loaded.checkpoint.path}: the fused model overflows {dtype} at {layer} (first value that is not finite)"
        f"{also}; nothing was written"
    )
