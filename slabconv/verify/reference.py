"""The float64 reference: the same traced graph with every floating tensor and every dtype argument in float64.

Verification compares everything against the model's exact output, and float64 is as exact as a CPU gets: its
rounding (about 1e-16 per operation) is far below any dtype tolerance. A traced graph records the dtypes its
code named (``softmax(..., dtype=float32)``, ``x.to(float16)``, ``full(..., dtype=float16)``), so casting its
weights alone would leave float32 and float16 steps inside; ``promote_to_float64`` rewrites those arguments too.

Question 1 (is the fold exact?) then folds the float64 graph itself: the fold's float64 weights are exactly what
the folds compute before they cast to the checkpoint's dtype, and the fused float64 graph must agree with the
original float64 graph to float64 rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import fx

from slabconv import engine
from slabconv.fold import rounded
from slabconv.util import quiet

_LOWER = (torch.float16, torch.bfloat16, torch.float32)


def _retype_arg(a: Any, source: tuple[torch.dtype, ...], dtype: torch.dtype) -> Any:
    """``a`` (a node argument) with every dtype of ``source`` replaced by ``dtype``, inside lists and dicts too."""
    if isinstance(a, torch.dtype) and a in source:
        return dtype
    if isinstance(a, (list, tuple)):
        return type(a)(_retype_arg(x, source, dtype) for x in a)
    if isinstance(a, dict):
        return {k: _retype_arg(v, source, dtype) for k, v in a.items()}
    return a


def _retyped(gm: fx.GraphModule, source: tuple[torch.dtype, ...], dtype: torch.dtype) -> fx.GraphModule:
    """A copy of ``gm`` computing in ``dtype``: the dtype arguments of ``source`` replaced by it, and every floating
    parameter, buffer and constant cast to it once."""
    out = engine.copy_sharing(gm)  # every floating tensor is replaced below, never written into
    graphs = [m for m in out.modules() if isinstance(m, fx.GraphModule)]  # with the bodies of higher-order ops
    for node in (n for m in graphs for n in m.graph.nodes):  # (torch.autocast regions: ``wrap_with_autocast``)
        node.args = _retype_arg(node.args, source, dtype)
        node.kwargs = _retype_arg(node.kwargs, source, dtype)
        if _default_dtype_factory(node, source):  # torch.ones(n): the default dtype, named by no argument
            node.kwargs = {**node.kwargs, "dtype": dtype}
    for module in out.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point():
                module._parameters[name] = torch.nn.Parameter(rounded(param.detach(), dtype), requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = rounded(buf, dtype)
    for name, value in list(vars(out).items()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(out, name, rounded(value, dtype))
    for m in graphs:
        m.recompile()
    return out


def _default_dtype_factory(node: fx.Node, source: tuple[torch.dtype, ...]) -> bool:
    """Whether ``node`` creates a tensor from no tensor (``aten.ones``, ``full``, ``arange``...) without a dtype
    argument, of a ``source`` dtype: torch's default dtype (float32), which a retyped graph must name. SqueezeBERT's
    ``torch.ones(shape)`` mask, then ``.to(float32)``: retyped, the ``_assert_tensor_metadata`` of that ``.to`` expected
    float64 and the mask stayed float32 (the float64 reference raised)."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node.kwargs.get("dtype"):
        return False
    schema = node.target._schema.arguments
    return (
        isinstance(val, torch.Tensor)
        and val.dtype in source
        and any(a.name == "dtype" for a in schema)
        and not any(isinstance(a.type, torch.TensorType) for a in schema)
    )


def promote_to_float64(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that computes in float64: floating parameters, buffers and constants cast to float64, and
    every float16 / bfloat16 / float32 dtype argument of every node replaced by float64.

    Args:
        gm: a traced graph (``engine.capture``), original or fused, in any floating dtype.

    Returns:
        A new ``GraphModule`` taking the same inputs (floating ones in float64; integer ids unchanged).
    """
    return _retyped(gm, _LOWER, torch.float64)


def cast_graph(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of a float64 graph (``float64_fold``) that computes in ``dtype``: each floating parameter, buffer and
    constant rounded once from float64, and every float64 dtype argument replaced by ``dtype``.

    This is how ``fuse --dtype`` writes a float16 / bfloat16 model: the fold's float64 weights cast once, never
    through the checkpoint's dtype first (double rounding would put a weight one unit off, which question 1
    refuses).
    """
    return _retyped(gm, (torch.float64,), dtype)


def cast_from(gm: fx.GraphModule, source: torch.dtype, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of a graph captured in ``source`` (a ``.pt2`` program's module) that computes in ``dtype``: every
    floating tensor cast once and every ``source`` dtype argument replaced, as ``cast_graph`` writes the fused
    model. ``Module.to`` casts only the tensors: a program whose model called ``Tensor.to(torch.float32)``
    (transformers' Wav2Vec2) keeps that dtype in its ``aten.to`` and ``aten._assert_tensor_metadata`` nodes, and
    cast to float16 so it raised at its first call."""
    return _retyped(gm, (source,), dtype)


def float64_example(example: torch.Tensor) -> torch.Tensor:
    """``example`` in float64 when it is floating (token ids stay integer)."""
    return example.double() if example.is_floating_point() else example


def _float_inputs(node: fx.Node, floats: set[fx.Node]) -> bool:
    """Whether ``node`` reads a floating tensor of ``floats`` or names a float64 dtype in its arguments."""
    found = False

    def visit(a: Any) -> Any:
        nonlocal found
        found = found or (isinstance(a, fx.Node) and a in floats) or a is torch.float64
        return a

    fx.node.map_aggregate((node.args, node.kwargs), visit)
    return found


def _retype_by_promotion(gm: fx.GraphModule, mode: Any) -> bool:
    """Give every node of ``gm`` (a promoted copy of a captured graph) whose captured value is floating the same
    value in float64 (sizes, symbolic ones included, and strides kept), without running anything: after
    ``promote_to_float64`` every floating input, weight and dtype argument is float64, so each op that reads a
    floating tensor or names a dtype computes in float64 (type promotion never lowers float64 when every floating
    operand is float64).

    False, with nothing changed, when some node makes a floating value from no floating input and no dtype
    argument (``torch.arange(n) / n``, ``torch.ones(k)``: torch's default dtype decides, not the promotion): the
    caller then propagates the values (``_retype_metadata``)."""
    floats: set[fx.Node] = set()
    retyped: dict[fx.Node, Any] = {}

    def as_float64(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return torch.empty_strided(v.shape, v.stride(), dtype=torch.float64, device=v.device)
        if isinstance(v, (list, tuple)):
            return type(v)(as_float64(x) for x in v)
        return v

    def floating(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return any(floating(x) for x in v)
        return isinstance(v, torch.Tensor) and v.is_floating_point()

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "output" or not floating(val):
            continue
        if node.op == "call_function" and not _float_inputs(node, floats):
            return False
        with mode:
            retyped[node] = as_float64(val)
        floats.add(node)
    for node, val in retyped.items():
        node.meta["val"] = val
    return True


def _retype_metadata(gm: fx.GraphModule) -> bool:
    """Record on every node of ``gm`` (a promoted copy of a captured graph) the fake value it computes now, as a
    capture of ``gm`` would: by promotion where that is certain (``_retype_by_promotion``: a quarter to an eighth
    of the propagation's time on the zoo's models), else the placeholders' fake inputs (their symbolic sizes
    kept) with floating ones in float64, propagated node by node in the capture's own fake mode
    (``torch.fx.passes.fake_tensor_prop``). False when the graph has no fake inputs to start from, this torch
    lacks what it uses (``torch._guards`` is not public API) or the propagation fails: the caller then captures
    the graph again."""
    try:
        from torch._guards import detect_fake_mode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    except ImportError:
        return False

    class FakeProp(FakeTensorProp):
        """``FakeTensorProp`` that reads each stored tensor (``get_attr``) as a fake tensor of its own dtype."""

        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
            value = super().get_attr(target, args, kwargs)
            return self._mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value

    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(placeholders) if placeholders else None
    if mode is None or not all(isinstance(v, torch.Tensor) for v in placeholders):
        return False
    try:
        if _retype_by_promotion(gm, mode):
            return True
    except Exception:  # noqa: BLE001 - any failure: propagate the values instead
        pass
    try:
        with mode:
            inputs = [v.to(torch.float64) if v.is_floating_point() else v for v in placeholders]
        FakeProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    except Exception:  # noqa: BLE001 - any failure: fall back to a capture, which reports its own reason
        return False
    return True


def float64_graph(original: fx.GraphModule, example: torch.Tensor) -> fx.GraphModule:
    """The original graph in float64 (``promote_to_float64``) with float64 metadata, ready for the engine.

    The metadata comes from ``_retype_metadata``: the capture's fake values retyped to float64 where promotion makes
    that certain, else propagated again in float64; capturing the graph again with ``torch.export`` (about three
    times the propagation's cost) remains the fallback.

    Args:
        original: the unfolded graph of the model (``engine.capture``) in the checkpoint's dtype.
        example: one example input ``(B, ...)`` as the model takes it.
    """
    original64 = promote_to_float64(original)
    if not _retype_metadata(original64):
        with quiet():
            original64 = engine.capture(original64, float64_example(example))
    return original64


def fold64(original64: fx.GraphModule, norm_affine: bool = False) -> tuple[fx.GraphModule, list[Any]]:
    """``(fused64, decisions64)``: a copy of ``original64`` (``float64_graph``) folded by the same engine as the
    model's own fold (``norm_affine``: with the affine of every LayerNorm / RMSNorm / GroupNorm, as
    ``LoadOptions.fold_norm_affine``); its decisions equal the model's except where a fold overflows only the
    model's dtype."""
    fused64 = engine.copy_sharing(original64)
    decisions64 = engine.fold_all(fused64, norm_affine=norm_affine)
    return fused64, decisions64


class Float64Fold(NamedTuple):
    """The original graph and its fold, both in float64 (``float64_fold``), and what they were made of: ``graph``
    (the traced original) and ``norm_affine``."""

    original64: fx.GraphModule
    fused64: fx.GraphModule
    decisions64: list[Any]
    graph: fx.GraphModule
    norm_affine: bool


def float64_fold(original: fx.GraphModule, example: torch.Tensor, norm_affine: bool = False) -> Float64Fold:
    """The original graph and its fold, both in float64 (``float64_graph`` then ``fold64``)."""
    original64 = float64_graph(original, example)
    return Float64Fold(original64, *fold64(original64, norm_affine), original, norm_affine)
