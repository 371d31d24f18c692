"""Former home of capture and norm discovery, kept so that older imports keep working.

New code imports from ``slabconv.engine`` (or from ``capture`` / ``norms`` / ``flow`` / ``rules``).
"""

from slabconv.engine.capture import attr, capture, module_path, same_size, shape_of, static_int
from slabconv.engine.flow import follow
from slabconv.engine.norms import BN_OPS, NormSite, bn_args, find_norms, is_batch_norm
from slabconv.engine.rules import Chan

__all__ = [
    "BN_OPS",
    "Chan",
    "NormSite",
    "attr",
    "bn_args",
    "capture",
    "find_norms",
    "follow",
    "is_batch_norm",
    "module_path",
    "same_size",
    "shape_of",
    "static_int",
]
