"""The stable reason strings for a norm that is not folded away on some path.

These strings appear in ``report.json`` (``folds[].reason``), ``slabconv inspect`` and ``docs/reasons.md``;
users grep for them, so they never change once released. Each is a case where the naive fold gives wrong
numbers; ``docs/reasons.md`` shows the model pattern behind each one.
"""

from __future__ import annotations

from typing import Any

ZERO_PADDING_AFTER_NORM = "zero-padding-after-norm"
MASKED_AFTER_NORM = "masked-after-norm"
RESIDUAL_READS_NORM = "residual-reads-norm"
CONSTANT_ADDED_AFTER_NORM = "constant-added-after-norm"
NONLINEAR = "nonlinear-before-consumer"
CHANNEL_MIXING_RESHAPE = "channel-mixing-reshape"
PADDED_CONV_CONSUMER = "padded-conv-consumer"
TRANSPOSED_CONV_CONSUMER = "transposed-conv-consumer"
NEGATIVE_SCALE_THROUGH_MAX = "negative-scale-through-max"
BATCH_STATS_IN_EVAL = "batch-stats-in-eval"
TRAIN_MODE = "train-mode"
UPDATED_IN_FORWARD = "norm-updated-in-forward"
DYNAMIC_TOKEN_COUNT = "dynamic-token-count"
CONCAT_WITH_UNNORMALIZED = "concat-with-unnormalized"
NARROWING_CAST = "narrowing-cast-after-norm"
FEEDS_OUTPUT = "feeds-model-output"
SHARED_WEIGHT = "shared-consumer-weight"
DTYPE_OVERFLOW = "dtype-overflow"
CONSUMER_OFF_CHANNEL = "consumer-not-on-channel-axis"
COMPUTED_WEIGHT = "computed-weight"
OVERRIDABLE = "overridable-initializer"
FED_DEFAULT = "slabconv_fed_default"
"""Placeholder node meta: True for an ONNX initializer that is also a graph input (IR version 4 on), a default the
caller may replace: an input of the model, never a constant a fold may read or write. An op with no rule that
reads one is blocked with ``overridable-initializer`` (``unsupported``)."""
UNSUPPORTED_PREFIX = "unsupported-op:"

ALL = (
    ZERO_PADDING_AFTER_NORM,
    MASKED_AFTER_NORM,
    RESIDUAL_READS_NORM,
    CONSTANT_ADDED_AFTER_NORM,
    NONLINEAR,
    CHANNEL_MIXING_RESHAPE,
    PADDED_CONV_CONSUMER,
    TRANSPOSED_CONV_CONSUMER,
    NEGATIVE_SCALE_THROUGH_MAX,
    BATCH_STATS_IN_EVAL,
    TRAIN_MODE,
    UPDATED_IN_FORWARD,
    DYNAMIC_TOKEN_COUNT,
    CONCAT_WITH_UNNORMALIZED,
    NARROWING_CAST,
    FEEDS_OUTPUT,
    SHARED_WEIGHT,
    DTYPE_OVERFLOW,
    CONSUMER_OFF_CHANNEL,
    COMPUTED_WEIGHT,
    OVERRIDABLE,
    UNSUPPORTED_PREFIX + "<aten op>",
)


SAME_OP = {
    f"aten.{name}": "aten.batch_norm"
    for name in (
        "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "native_batch_norm",
        "_batch_norm_with_update",
        "_batch_norm_no_update",
    )
}
"""Ops named by the op they are a form of: the batch norm ``torch.export`` writes as ``aten.batch_norm``, its core
ATen forms after ``run_decompositions()`` and the form a lowered ONNX ``BatchNormalization`` takes, so one model
gets one reason through every door."""


def unsupported(node: Any) -> str:
    """``unsupported-op:aten.<name>`` for an fx node whose op has no rule (``SAME_OP``: one name for the forms of
    one op; no overload); ``overridable-initializer`` when it reads a default the caller may replace (``FED_DEFAULT``:
    a ``Conv`` or ``MatMul`` whose weight is an ONNX graph input)."""
    if any(getattr(a, "meta", {}).get(FED_DEFAULT) for a in getattr(node, "args", ())):
        return OVERRIDABLE
    return UNSUPPORTED_PREFIX + op_name(node)


def op_name(node: Any) -> str:
    """``aten.<name>`` (``onnx.<Op>`` for an ONNX op the lowering keeps opaque) of an fx node's op, one name for the
    forms of one op (``SAME_OP``), no overload."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    namespace = getattr(target, "namespace", None)
    if namespace:
        name = f"{namespace}.{name.split('.')[0]}"
    return SAME_OP.get(name, name)
