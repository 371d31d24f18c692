"""The engine: capture a model as an export graph, find every norm, decide each fold, and apply it.

What goes in: an ``nn.Module`` in eval mode and one example input. What comes out: the fused ``GraphModule``
(every norm folded or kept as one per-channel affine) and one ``Decision`` per norm, in graph order.
"""

from slabconv.engine import reasons
from slabconv.engine.graph import capture, find_norms
from slabconv.engine.plan import Decision, fold_all, fused_state_dict

__all__ = ["Decision", "capture", "find_norms", "fold_all", "fused_state_dict", "reasons"]
