"""The engine's entry for an ONNX original: ``fold_file`` prepares the graph, lowers it into the engine's ATen
vocabulary (``slabconv.engine.onnx_lower``), plans every norm with the same code as a checkpoint
(``slabconv.engine.planner.plan_folds``) and carries the plans back into the ONNX graph
(``slabconv.engine.onnx_apply``). ``to_float64`` casts a graph to float64 for question 1, ``cast_floats`` to any
float dtype (an ONNX reference in a narrower candidate's dtype).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from slabconv.engine.norm_affine import split_norm_affines
from slabconv.engine.onnx_apply import apply_plans, folded_values
from slabconv.engine.onnx_lower import FLOATS, Lowered, OnnxOp, lower, prepare, subgraphs
from slabconv.engine.planner import Decision, NormPlan, plan_folds
from slabconv.engine.ranges import LayerRange, flag_warnings
from slabconv.engine.reasons import OVERRIDABLE, UNSUPPORTED_PREFIX, unsupported


def plan_file(model: Any, proto_path: str | None = None, norm_affine: bool = False) -> tuple[Any, list[NormPlan]]:
    """Prepare ``model`` in place (``onnx_lower.prepare``), lower it and plan every norm (``norm_affine``: the
    affine of every LayerNormalization / RMSNormalization / GroupNormalization too, split from the lowered op as for
    a checkpoint: ``slabconv.engine.norm_affine``).

    Returns:
        ``(lowered, plans)``: the ``Lowered`` graph and one ``NormPlan`` per norm, in graph order.

    Raises:
        InputError: a norm's statistics are NaN/Inf or its running_var + eps <= 0.
        UnsupportedModelError: a BatchNormalization whose statistics are computed from the model's input.
    """
    prepare(model, proto_path)
    lowered = lower(model)
    if norm_affine:
        split_norm_affines(lowered.gm)
    # the ONNX rewrite folds in float64 (``onnx_apply``): the values the overflow checks rounded are not held
    return lowered, [replace(p, folded={}) for p in plan_folds(lowered.gm)]


def fold_file(
    model: Any,
    proto_path: str | None = None,
    progress: Callable[[str], None] = lambda name: None,
    as_float64: bool = False,
    norm_affine: bool = False,
    ranges: list[LayerRange] | None = None,
) -> tuple[Any, list[Decision]]:
    """Fold every norm of ``model`` (read from ``proto_path``), in place; with ``as_float64`` the graph is cast to
    float64 after planning and every fold written unrounded (question 1's float64 fold: the same decisions, made on
    the file's own dtypes); with ``norm_affine`` the affines of the norm ops fold too (``plan_file``). The fold is
    never simplified here: ``fuse --simplify`` runs ``simplify_graph`` on the fold it writes. With
    ``ranges`` (a list), each folded layer's weight ranges before and after its folds are appended to it
    (``onnx_apply.folded_values``) and each flagged layer's warning is added to its norms' decisions.

    Returns:
        ``(model, decisions)``: the same model, fused, and one ``Decision`` per norm, in graph order.

    Raises:
        as ``plan_file``.
    """
    lowered, plans = plan_file(model, proto_path, norm_affine)
    for p in plans:
        progress(p.decision.norm)
    values, layer_ranges = folded_values(lowered, plans)
    if ranges is not None:
        ranges += layer_ranges
        flag_warnings([p.decision for p in plans], ranges)
    inner = opaque_norms(lowered) + subgraph_norms(model)
    return fold_planned(model, lowered, plans, as_float64, values), [p.decision for p in plans] + inner


def opaque_norms(lowered: Lowered) -> list[Decision]:
    """A ``kept`` decision for each top-level ``BatchNormalization`` the lowering read as an opaque node
    (``onnx.BatchNormalization``): one whose input's rank no shape inference gives (behind the ``com.microsoft`` ops
    onnxruntime's optimizer writes, ``FusedMatMul`` and ``BiasGelu``, which neither inference types) or whose
    attributes have no rule (``spatial = 0``). The planner never sees such a norm and it stays as it is; listed so
    that the report, ``inspect``, the summary and ``--require-folded`` count it (it went unmentioned: a file with no
    other norm was reported as having none). The reason names the blocker: ``overridable-initializer`` for a scale,
    bias or statistic the caller may feed (an initializer that is also a graph input), else the opaque op whose
    output, the norm's input, no inference types (``unsupported-op:com.microsoft.FusedMatMul``), else
    ``onnx.BatchNormalization``."""
    kept = []
    for node in lowered.gm.graph.nodes:
        target = node.target
        if not (isinstance(target, OnnxOp) and target.namespace == "onnx" and target.__name__ == "BatchNormalization"):
            continue
        norm = node.meta.get("onnx") or node.name
        reason = OVERRIDABLE if unsupported(node) == OVERRIDABLE else UNSUPPORTED_PREFIX + _blocker(node)
        kept.append(_kept_batchnorm(norm, f"{norm}:onnx.BatchNormalization", reason))
    return kept


def _blocker(node: Any) -> str:
    """What keeps the opaque BatchNorm ``node`` unread: the opaque op (``<domain>.<Op>``) that makes its untyped
    input, else the BatchNorm itself (``onnx.BatchNormalization``). An ONNX op that is opaque only because its own
    input is untyped (a ``ReduceMean`` after onnxruntime's ``FusedConv``) is passed for the op that hides it."""
    found = None
    x = _untyped_opaque(node.args[0] if node.args else None)
    while x is not None and x not in (found, node):
        found = x
        if x.target.namespace != "onnx":
            break
        x = next((u for u in map(_untyped_opaque, x.args) if u is not None), None)
    return repr((found or node).target)


def _untyped_opaque(x: Any) -> Any:
    """The opaque node that makes ``x`` (an output of an op of several read through its ``getitem``) when ``x``
    is untyped, else None."""
    if isinstance(x, torch.fx.Node) and x.target is operator.getitem:
        x = x.args[0]
    if (
        isinstance(x, torch.fx.Node)
        and isinstance(x.target, OnnxOp)
        and not isinstance(x.meta.get("val"), torch.Tensor)
    ):
        return x
    return None


def _kept_batchnorm(norm: str, where: str, reason: str) -> Decision:
    """A BatchNorm the planner never sees, ``kept`` with ``reason`` at ``where`` (the op that holds or hides it)."""
    return Decision(norm, "BatchNorm", "kept", reason=reason, paths=[{"before": where, "reason": reason}])


def subgraph_norms(model: Any) -> list[Decision]:
    """A ``kept`` decision for each ``BatchNormalization`` inside a subgraph (an ``If`` branch, a ``Loop`` or
    ``Scan`` body): the lowering reads such an op as one opaque node (``onnx.<Op>``), so the planner never sees the
    norms inside it, and they stay as they are. Listed so that the report, ``inspect`` and the summary count them
    with the op that holds them (``unsupported-op:onnx.Loop``), rather than saying the model has no norms."""
    kept = []
    for holder in model.graph:  # the top-level nodes: the op a norm inside is kept by
        reason = f"{UNSUPPORTED_PREFIX}onnx.{holder.op_type}"
        for graph in subgraphs(holder):
            for node in graph.all_nodes():
                if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
                    where = f"{holder.name or holder.op_type}:onnx.{holder.op_type}"
                    norm = node.name or node.outputs[0].name or "BatchNormalization"
                    kept.append(_kept_batchnorm(norm, where, reason))
    return kept


def fold_planned(model: Any, lowered: Lowered, plans: list[NormPlan], as_float64: bool, values: Any = None) -> Any:
    """The second half of ``fold_file``: carry ``plans`` (made by ``plan_file`` on ``model``, ``lowered``, or on a
    copy of the prepared model that keeps its names) into ``model``, in place, cast to float64 first with
    ``as_float64``.
    ``lowered`` and ``plans`` keep naming the prepared graph's ONNX nodes and values (``LayerSite``,
    ``meta["onnx_value"]``): what the localisation of an ONNX original reads its fold boundaries from.
    ``values``: the fold program's (``onnx_apply.folded_values``) when the caller already ran it.

    Returns:
        the same model, fused.
    """
    if as_float64:
        cast_floats(model, ir.DataType.DOUBLE)
    apply_plans(model, lowered, plans, exact=as_float64, values=values)
    if as_float64:  # after the plans, which name the nodes as the lowering read them
        expand_fused_convs(model)
    return model


ONNXSCRIPT = "onnxscript"
ONNXSLIM = "onnxslim"
SIMPLIFY_EXTRA = "pip install 'slabconv[simplify]'"
"""How to install onnxslim, the second simplifier of ``fuse --simplify`` (the ``simplify`` extra)."""
ONNXSLIM_BYTES_LIMIT = 1536 * 1024 * 1024
"""Bytes of initializers above which onnxslim is not run: it works on an in-memory ``ModelProto``, which protobuf
cannot serialise past 2 GiB (the same threshold as ``slabconv.write.onnx.ONNX_EXTERNAL_DATA_BYTES``)."""


def simplify_graph(model: Any, simplifiers: list[str] | None = None) -> dict[str, Any]:
    """``fuse --simplify``: onnxscript's optimizer (``onnxscript.optimizer.optimize``: constant folding of
    constants up to its default sizes, which leaves weights as they are; dead nodes; its rewrite rules, such as
    cancelling layout pairs) on an onnx-ir ``model``, in place, then onnxslim (``onnxslim.slim``: its constant
    folding, dead nodes, shape-arithmetic and fusion patterns) when it is installed, whose graph replaces the
    model's only when it has fewer nodes. onnxslim runs twice, with all its patterns and without ``FusionGemm``
    (which turns a ``MatMul`` on 3-D tokens and its bias ``Add`` into ``Reshape`` -> ``Gemm`` -> ``Reshape``: more
    nodes, where the other patterns shrink the graph), and the smaller graph is kept (all patterns on a tie). Every
    constant either folds is computed in the model's own dtypes. onnxscript's optimizer does not run on a graph
    holding a ``BatchNormalization`` in training mode: its ``FuseBatchNormIntoConv`` rule folds the running
    statistics of such a norm (which normalises by the batch's) into the Conv before it.

    Args:
        model: an ``onnx_ir.Model``; its metadata, opset imports and graph input / output names stay.
        simplifiers: None to choose as above (what ``fuse --simplify`` runs), else the ``"<name> <version>"`` list a
            ``fuse --simplify`` recorded (``SIMPLIFIED_KEY``), run in that order, each kept (what question 1 repeats
            on its reference, ``slabconv.verify.onnx_original.onnx_fold64``).

    Returns:
        ``{"nodes_before": n, "nodes_after": m, "simplifiers": ["onnxscript 0.7.2", ...]}`` (nodes of the main
        graph; the simplifiers whose output was kept, in order), ``"onnxslim"``, a line saying why onnxslim's
        output was not kept, when it was not, and ``"onnxscript"``, why onnxscript's optimizer did not run, when it
        did not.

    Raises:
        UsageError: ``simplifiers`` names onnxslim and it is not installed.
    """
    import logging

    import onnxscript
    from onnxscript.optimizer import optimize

    before = len(list(model.graph))
    info: dict[str, Any] = {"simplifiers": []}
    training = [
        node.name or node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.op_type == "BatchNormalization" and node.attributes.get_int("training_mode")
    ]
    if simplifiers is None and training:
        info[ONNXSCRIPT] = (
            f"onnxscript's optimizer not run: {training[0]} is a BatchNormalization in training mode (it normalises "
            "by the batch's statistics), whose running statistics its rewrite rules fold into the Conv before it"
        )
    elif simplifiers is None or any(s.split()[0] == ONNXSCRIPT for s in simplifiers):
        chatty = logging.getLogger("onnxscript")
        level = chatty.level
        chatty.setLevel(logging.ERROR)  # it logs each node it leaves as it is
        try:
            optimize(model)
        finally:
            chatty.setLevel(level)
        _register_orphan_constants(model.graph)
        _no_allowzero_before_opset_14(model)
        info["simplifiers"].append(f"{ONNXSCRIPT} {onnxscript.__version__}")
    wanted = simplifiers is not None and any(s.split()[0] == ONNXSLIM for s in simplifiers)
    if simplifiers is None or wanted:
        recorded = [s for s in simplifiers or [] if s.split()[0] == ONNXSLIM]
        skips = [_skipped(recorded[0])] if recorded else [(), ("FusionGemm",)]
        slim, why = _onnxslim(model, keep_larger=wanted, skips=skips)
        if slim is not None:
            info["simplifiers"].append(slim)
        elif wanted:
            from slabconv.errors import UsageError

            raise UsageError(
                f"the candidate was simplified with onnxslim (fuse --simplify), which question 1 repeats, but {why}"
            )
        else:
            info[ONNXSLIM] = why
    return {"nodes_before": before, "nodes_after": len(list(model.graph)), **info}


def _register_orphan_constants(graph: Any) -> None:
    """Register as an initializer of ``graph`` every constant a node reads that has no producer and is neither a
    graph input nor an initializer, in place. onnxscript 0.7's ``Flatten`` -> ``Reshape`` rewrite creates the
    ``Reshape``'s shape with ``op.initializer``, and where two ``Flatten`` nodes read one value (DETR's
    TorchScript export: the encoder's and the decoder's position masks) the second shape is never registered: the
    saved file reads a value nothing defines, which ``onnx.checker`` and onnxruntime refuse ("Nodes in a graph
    must be topologically sorted"). Registering it keeps the value the rewrite computed."""
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.inputs:
            if value is None or value.const_value is None or value.producer() is not None:
                continue
            if value.is_graph_input() or value.is_initializer() or value.graph is not None:
                continue
            name, n = value.name or "constant", 0
            while value.name is None or value.name in graph.initializers:
                n += 1
                value.name = f"{name}_{n}"
            graph.register_initializer(value)


def _no_allowzero_before_opset_14(model: Any) -> None:
    """Take ``allowzero`` off every ``Reshape`` of a model below opset 14 (the attribute came with opset 14) whose
    shape is a constant without a 0, where it changes nothing; in place. onnxscript 0.7's
    ``MaterializeReshapeShape`` rewrite writes ``Reshape(x, constant, allowzero=1)`` whatever the opset: the fused
    opset-11 file of a paddle2onnx ResNet failed ``onnx.checker`` ("Unrecognized attribute: allowzero"). A shape
    holding a 0 keeps the attribute (and the checker refuses the file) rather than change what the graph
    computes."""
    if model.opset_imports.get("", model.opset_imports.get("ai.onnx", 14)) >= 14:
        return
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or "allowzero" not in node.attributes:
            continue
        shape = node.inputs[1] if len(node.inputs) > 1 else None
        tensor = ir.convenience.get_const_tensor(shape) if shape is not None else None  # an initializer or Constant
        if tensor is not None and (tensor.numpy() != 0).all():
            del node.attributes["allowzero"]


_WITHOUT = " without "
"""What separates onnxslim's name and version from the fusion patterns it skipped, in a recorded simplifier
(``onnxslim 0.1.98 without FusionGemm``)."""


def _skipped(recorded: str) -> tuple[str, ...]:
    """The onnxslim fusion patterns a recorded simplifier skipped (``()`` for ``onnxslim 0.1.98``)."""
    return tuple(recorded.split(_WITHOUT, 1)[1].split("+")) if _WITHOUT in recorded else ()


def _onnxslim(model: Any, keep_larger: bool, skips: list[tuple[str, ...]]) -> tuple[str | None, str]:
    """onnxslim on ``model`` (after onnxscript's optimizer), once for each entry of ``skips`` (the fusion patterns
    it skips: ``onnxslim.slim(..., skip_fusion_patterns=...)``), the graph with the fewest nodes (the first of
    equals) put in place of the model's when it has fewer nodes than the model (or always, with ``keep_larger``).

    Returns:
        ``("onnxslim <version>", "")`` or ``("onnxslim <version> without FusionGemm", "")`` when its graph was
        kept, else ``(None, why)``.
    """
    try:
        import onnxslim
    except ImportError:
        return None, f"onnxslim is not installed ({SIMPLIFY_EXTRA})"
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if size > ONNXSLIM_BYTES_LIMIT:
        return None, f"onnxslim was not run: the weights exceed {ONNXSLIM_BYTES_LIMIT >> 20} MiB"
    import warnings

    nodes = len(list(model.graph))
    best: tuple[int, Any, tuple[str, ...]] | None = None
    for skip in skips:
        with warnings.catch_warnings():  # it prints nothing by default; its dependencies may warn
            warnings.simplefilter("ignore")
            slimmed = ir.from_proto(onnxslim.slim(ir.to_proto(model), skip_fusion_patterns=list(skip) or None))
        if best is None or len(list(slimmed.graph)) < best[0]:
            best = (len(list(slimmed.graph)), slimmed, skip)
    assert best is not None  # skips is never empty
    after, slimmed, skip = best
    name = f"{ONNXSLIM} {onnxslim.__version__}" + (_WITHOUT + "+".join(skip) if skip else "")
    if after >= nodes and not keep_larger:
        return None, f"{name} gave {after} nodes, not fewer than {nodes}: not kept"
    model.graph = slimmed.graph
    return name, ""


def to_float64(model: Any) -> None:
    """Cast every floating tensor, value type and ``Cast``/``Constant`` target of ``model`` to float64, in place (the
    float64 evaluation of question 1). Integer tensors (ids, shapes) stay as they are. An onnxruntime ``FusedConv``
    (float32 kernels only; onnx's reference evaluator has none) becomes the ``Conv`` and activation it computes
    (``expand_fused_convs``)."""
    expand_fused_convs(model)
    cast_floats(model, ir.DataType.DOUBLE)


_FUSED_ACTIVATIONS = {"Relu": (), "Sigmoid": (), "Tanh": (), "LeakyRelu": ("alpha",), "HardSigmoid": ("alpha", "beta")}
"""The ``activation`` values of a ``FusedConv`` that ``expand_fused_convs`` writes as one ONNX op: the names its
``activation_params`` give, in order (onnxruntime's contrib op schema)."""


def expand_fused_convs(model: Any) -> None:
    """Replace each ``com.microsoft`` ``FusedConv`` (onnxruntime's extended-level optimizer's ``Conv`` with the
    activation after it taken in: ``activation(Conv(X, W, B))``) of ``model`` (an ``onnx_ir.Model``) by that ``Conv``
    and that activation, in place; the activation's output keeps the node's output name (onnx-ir's
    ``replace_nodes_and_values``). One with a ``Z`` input or another activation stays."""
    for node in list(model.graph.all_nodes()):
        activation = node.attributes.get_string("activation")
        if (node.domain, node.op_type) != ("com.microsoft", "FusedConv") or activation not in _FUSED_ACTIVATIONS:
            continue
        if node.graph is None or (len(node.inputs) > 3 and node.inputs[3] is not None):
            continue
        params = list(node.attributes.get_floats("activation_params") or [])
        names = _FUSED_ACTIVATIONS[activation]
        if len(params) < len(names):
            continue
        kept = [a for k, a in node.attributes.items() if k not in ("activation", "activation_params")]
        conv = ir.Node("", "Conv", list(node.inputs[:3]), attributes=kept, name=f"{node.name}/conv")
        conv.outputs[0].name = f"{node.outputs[0].name}/conv"
        attributes = [ir.AttrFloat32(name, value) for name, value in zip(names, params[: len(names)], strict=True)]
        act = ir.Node("", activation, [conv.outputs[0]], attributes=attributes, name=f"{node.name}/{activation}")
        ir.convenience.replace_nodes_and_values(
            node.graph, node, [node], [conv, act], [node.outputs[0]], [act.outputs[0]]
        )


def cast_floats(model: Any, to: ir.DataType) -> None:
    """Cast every floating tensor, value type and ``Cast``/``Constant`` target of ``model`` (an ``onnx_ir.Model``)
    to ``to`` (DOUBLE, FLOAT, FLOAT16 or BFLOAT16), in place, each value rounded once; integer tensors (ids, shapes)
    stay as they are. The float64 evaluation of question 1, and an ONNX original in a candidate's narrower dtype."""
    graph = model.graph

    def cast_tensor(tensor: ir.TensorProtocol | None) -> ir.TensorProtocol | None:
        if tensor is None or tensor.dtype not in FLOATS:
            return None
        return ir.tensor(np.asarray(tensor.numpy(), dtype=to.numpy()), name=tensor.name)

    values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
    for node in graph.all_nodes():
        values += list(node.outputs)
        for name, attribute in list(node.attributes.items()):
            if attribute.type == ir.AttributeType.TENSOR:
                new = cast_tensor(attribute.value)
                if new is not None:
                    node.attributes[name] = ir.AttrTensor(name, new)
        if node.op_type == "Cast" and node.attributes.get("to") is not None:
            if ir.DataType(node.attributes["to"].value) in FLOATS:
                node.attributes["to"] = ir.AttrInt64("to", to.value)
    for value in values:
        if value.const_value is not None:
            new = cast_tensor(value.const_value)
            if new is not None:
                value.const_value = new
        if value.dtype in FLOATS:
            value.dtype = to


__all__ = [
    "ONNXSCRIPT",
    "ONNXSLIM",
    "SIMPLIFY_EXTRA",
    "cast_floats",
    "expand_fused_convs",
    "fold_file",
    "fold_planned",
    "plan_file",
    "simplify_graph",
    "to_float64",
]
