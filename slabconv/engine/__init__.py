"""The engine: capture a model as an export graph, find every norm, decide each fold, and apply it.

What goes in: an ``nn.Module`` in eval mode and one example input. What comes out: the fused ``GraphModule``
(every norm folded or kept as one per-channel affine) and one ``Decision`` per norm, in graph order.

The names below are the engine's whole public surface; the other stages import nothing else from it.
"""

from slabconv.engine import reasons
from slabconv.engine.graph import NormSite, capture, find_norms
from slabconv.engine.plan import (
    FOLDED_BACKWARD,
    FOLDED_FORWARD,
    KEPT,
    KEPT_AFFINE,
    Decision,
    fold_all,
    fused_state_dict,
    norm_free,
    schedule_warnings,
)

__all__ = [
    "FOLDED_BACKWARD",
    "FOLDED_FORWARD",
    "KEPT",
    "KEPT_AFFINE",
    "Decision",
    "NormSite",
    "capture",
    "find_norms",
    "fold_all",
    "fused_state_dict",
    "norm_free",
    "reasons",
    "schedule_warnings",
]
