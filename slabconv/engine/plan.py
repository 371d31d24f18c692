"""Former home of the decisions and the rewrite, kept so that older imports keep working.

New code imports from ``slabconv.engine`` (or from ``planner`` / ``rewriter`` / ``cleanup``).
"""

from slabconv.engine.cleanup import cancel_inverse_views, drop_unused_attrs, fused_state_dict, norm_free
from slabconv.engine.planner import (
    FOLDED_BACKWARD,
    FOLDED_FORWARD,
    KEPT,
    KEPT_AFFINE,
    Decision,
    schedule_warnings,
)
from slabconv.engine.rewriter import fold_all

__all__ = [
    "FOLDED_BACKWARD",
    "FOLDED_FORWARD",
    "KEPT",
    "KEPT_AFFINE",
    "Decision",
    "cancel_inverse_views",
    "drop_unused_attrs",
    "fold_all",
    "fused_state_dict",
    "norm_free",
    "schedule_warnings",
]
