"""An ONNX original as the reference of a verification (``docs/onnx.md``, policy: ``slabconv.verify.policy``):
its graph evaluated in float64 (every floating tensor and type cast to float64, run by onnxruntime, or onnx's
reference evaluator where onnxruntime has no float64 kernel), its float64 fold for question 1 and the localisation
(``onnx_fold64``), and the inputs drawn from its graph's input types and shapes (``choose_onnx_inputs``;
``--inputs`` with one array per graph input). ``slabconv.verify.verifier`` runs both questions with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv.engine import onnx_fold
from slabconv.errors import InputError, UsageError, first_line
from slabconv.load.onnx_file import OnnxFile, load_ir, node_label
from slabconv.options import VerifyOptions
from slabconv.verify.inputs import check_token_ids, load_npz_members, read_inputs_file, standard_normal
from slabconv.verify.runtimes import Inputs, run_batched, samples_of, take

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}


def _float64_runner(model: Any, round_to: Any) -> tuple[Callable[[np.ndarray], list[np.ndarray]], str]:
    """Run an ``onnx_ir.Model`` in float64 (or cast to a narrower dtype: ``cast_reference``), its float inputs rounded
    to ``round_to`` first: onnxruntime, else onnx's reference evaluator (every op, in numpy); outputs as float64.

    Returns:
        ``(run, which)``: ``which`` names the evaluator (``onnxruntime`` or ``onnx.reference``).

    Raises:
        InputError: neither runs the graph (onnxruntime lacks a float64 kernel and an op is of a domain onnx's
            reference evaluator lacks, such as the ``com.microsoft`` ops onnxruntime's optimizer writes).
    """
    import onnx
    import onnx_ir as ir

    proto = ir.to_proto(model)
    stored = {t.name for t in proto.graph.initializer}  # an initializer listed as an input too is not fed
    first = next(i.name for i in proto.graph.input if i.name not in stored)
    declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in proto.graph.input}

    def feed(x: Inputs) -> dict[str, np.ndarray]:
        pairs = x.items() if isinstance(x, dict) else [(first, x)]
        return {n: (_round(a, round_to) if a.dtype.kind == "f" else a).astype(declared[n]) for n, a in pairs}

    def runner(evaluator: Any) -> Callable[[Inputs], list[np.ndarray]]:
        """Every output of ``evaluator`` (an onnxruntime session or onnx's reference evaluator) as float64."""
        return lambda x: [np.asarray(o, dtype=np.float64) for o in evaluator.run(None, feed(x))]

    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return runner(session), "onnxruntime"
    except Exception as err:  # noqa: BLE001 - onnxruntime lacks some float64 kernels: the reference evaluator has all
        ort_error = first_line(err, 160)
    from onnx.reference import ReferenceEvaluator

    fixed = [  # ops run as the spec says
        _grouped_conv_transpose(),
        _inference_batch_norm(),
        _torch_average_pool(),
        _gather_elements(),
        _global_max_pool(),
        _grid_sample(),
        *_upsample(),
    ]
    try:
        evaluator = ReferenceEvaluator(proto, new_ops=fixed)
    except NotImplementedError as err:  # an op of another domain (com.microsoft): no reference implementation
        raise InputError(
            f"the original in float64 runs neither in onnxruntime ({ort_error}) nor in onnx's reference evaluator "
            f"({first_line(err, 160)}), so question 1 cannot be answered; fold the model as it was exported, before "
            "an optimizer wrote its runtime's own ops into it (onnxruntime's basic level, ORT_ENABLE_BASIC, writes "
            "none), or pass --no-verify"
        ) from None
    return runner(evaluator), "onnx.reference: onnxruntime lacks a float64 kernel for one of its ops"


def _text(value: Any, default: str = "") -> str:
    """A string attribute as onnx's reference evaluator hands it to an op (``bytes`` or ``str``), as text;
    ``default`` where it is unset or empty."""
    return value.decode() if isinstance(value, bytes) and value else str(value or default)


def _grouped_conv_transpose() -> type:
    """onnx's reference ``ConvTranspose`` computed by torch's ``conv_transpose1d/2d/3d`` in float64 where the node
    gives its geometry (``auto_pad`` ``NOTSET``, no ``output_shape``), else by onnx's own ``group = 1`` path, group
    by group.

    torch: onnx's (1.23) scatters the kernel over the output one input position at a time in Python, about 15 s a
    sample for ViTPose's 256-channel 4x4 deconvolution at 32x24 (many minutes for a fold of its small head), where
    torch takes a tenth of a second. Per the ONNX spec the output is the full transposed convolution (stride,
    dilation, ``group``; the weight ``(C_in, C_out / group, k...)`` as torch lays it out) with ``output_padding``
    zeros added at the end of each axis, ``pads`` cropped from its two ends, and ``B`` added per channel.

    Group by group: onnx's grouped branch slices the ``(C_in, C_out / group, k...)`` weight by output channels and
    places each group's output at one channel, so it raises or returns a wrong tensor. Per the ONNX spec, group ``g``
    reads input channels ``[g * C_in / group, (g + 1) * C_in / group)`` and the same rows of ``W``, and writes
    output channels ``[g * C_out / group, (g + 1) * C_out / group)`` with those entries of ``B``."""
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as OnnxConvTranspose

    class ConvTranspose(OnnxConvTranspose):  # type: ignore[misc]
        op_domain = ""

        def _run(self, X: np.ndarray, W: np.ndarray, B: np.ndarray | None = None, **attrs: Any) -> tuple[np.ndarray]:  # type: ignore[override]
            group, one_group = int(attrs.get("group") or 1), super()._run
            spatial = X.ndim - 2
            if (
                1 <= spatial <= 3
                and _text(attrs.get("auto_pad"), "NOTSET") == "NOTSET"
                and not attrs.get("output_shape")
            ):
                return (_torch_conv_transpose(X, W, B, group, spatial, attrs),)
            if group == 1:
                return one_group(X, W, B, **attrs)  # type: ignore[no-any-return]
            xs, ws = np.split(X, group, axis=1), np.split(W, group, axis=0)
            bs = np.split(B, group) if B is not None else [None] * group
            parts = [one_group(x, w, b, **{**attrs, "group": 1})[0] for x, w, b in zip(xs, ws, bs, strict=True)]
            return (np.concatenate(parts, axis=1),)

    return ConvTranspose


def _torch_conv_transpose(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, group: int, spatial: int, attrs: dict[str, Any]
) -> np.ndarray:
    """A ``ConvTranspose`` node with explicit ``pads`` (``auto_pad`` ``NOTSET``, no ``output_shape``) by torch's
    ``conv_transpose{spatial}d``, in ``x``'s dtype: the full transposed convolution (no padding), ``output_padding``
    zeros appended at the end of each spatial axis, ``pads`` cropped from both ends, then ``b`` per channel.

    Args:
        x: ``(N, C_in, *spatial)``; w: ``(C_in, C_out / group, *kernel)``; b: ``(C_out,)`` or None.
        attrs: the node's ``strides``, ``dilations``, ``pads`` (``[begin..., end...]``), ``output_padding``.
    """
    strides = [int(v) for v in attrs.get("strides") or [1] * spatial]
    dilations = [int(v) for v in attrs.get("dilations") or [1] * spatial]
    pads = [int(v) for v in attrs.get("pads") or [0] * 2 * spatial]
    extra = [int(v) for v in attrs.get("output_padding") or [0] * spatial]
    full = getattr(torch.nn.functional, f"conv_transpose{spatial}d")(
        torch.from_numpy(np.array(x)), torch.from_numpy(np.array(w)), None, strides, 0, 0, group, dilations
    )  # copies: onnx's arrays may be read-only
    if any(extra):
        full = torch.nn.functional.pad(full, [v for e in reversed(extra) for v in (0, e)])
    ends = zip(pads[:spatial], pads[spatial:], full.shape[2:], strict=True)
    window = tuple(slice(begin, size - end) for begin, end, size in ends)
    y = full[(slice(None), slice(None), *window)]
    if b is not None:
        y = y + torch.from_numpy(np.array(b)).reshape(-1, *[1] * spatial)
    return np.ascontiguousarray(y.numpy())


def _inference_batch_norm() -> type:
    """onnx's reference ``BatchNormalization`` with its mode read as the spec defines it. A node with one output
    and no ``training_mode = 1`` is in inference mode: ``scale * (x - mean) / sqrt(var + epsilon) + B`` with the
    stored ``mean`` and ``var``. onnx's reference (1.23) runs ``BatchNormalization`` 9 (opsets 9 to 13: no
    ``training_mode`` attribute, one output in inference) with the statistics of the batch, because the schema's
    default ``momentum`` always reaches it; a tf2onnx or TorchScript export at opset 13 would be judged against
    another function. Other nodes (training mode) go to onnx's version 14."""
    from onnx.reference.ops.op_batch_normalization import BatchNormalization_14

    class BatchNormalization(BatchNormalization_14):  # type: ignore[misc]
        op_domain = ""

        def _run(self, x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray,
                 epsilon: float | None = None, momentum: float | None = None, training_mode: int | None = None,
                 **_: Any) -> tuple[np.ndarray, ...]:  # fmt: skip
            if training_mode or len(self.onnx_node.output) > 1:
                return super()._run(x, scale, bias, mean, var, epsilon, momentum, 1)  # type: ignore[no-any-return]
            axes = (-1,) + (1,) * (x.ndim - 2)  # the channels at axis 1
            eps = 1e-5 if epsilon is None else epsilon
            y = (x - mean.reshape(axes)) / np.sqrt(var.reshape(axes) + eps) * scale.reshape(axes) + bias.reshape(axes)
            return (y.astype(x.dtype),)

    return BatchNormalization


def _torch_average_pool() -> type:
    """onnx's reference ``AveragePool`` with torch's ``avg_pool1d/2d/3d`` where their attributes mean the same
    (no dilation, ``auto_pad`` ``NOTSET`` or ``VALID``, pads the same at both ends and at most half the kernel):
    onnx's (1.23) pads the input out to whole windows under ``ceil_mode`` and then averages what it padded, so a
    window hanging over the edge gets a wrong mean (a 5x5 window, stride 5, on a 7x7 map) or NaN (transformers'
    EfficientNet pooler ``AvgPool2d(1280, ceil_mode=True)`` on a 1x1 map, after padding to 1280 x 1280). torch
    averages a window over the input and padding it covers, as onnxruntime does. Others go to onnx's."""
    from onnx.reference.ops.op_average_pool import AveragePool_19

    class AveragePool(AveragePool_19):  # type: ignore[misc]
        op_domain = ""

        def _run(self, x: np.ndarray, **attrs: Any) -> tuple[np.ndarray]:  # type: ignore[override]
            spatial = x.ndim - 2
            kernel = list(attrs.get("kernel_shape") or [])
            pads = list(attrs.get("pads") or [0] * 2 * spatial)
            auto = _text(attrs.get("auto_pad"), "NOTSET")
            plain = (
                1 <= spatial <= 3
                and len(kernel) == spatial
                and all(int(d) == 1 for d in attrs.get("dilations") or [1] * spatial)
                and auto in ("NOTSET", "VALID")
                and pads[:spatial] == pads[spatial:]
                and all(2 * int(p) <= int(k) for p, k in zip(pads[:spatial], kernel, strict=True))
            )
            if not plain:
                return super()._run(x, **attrs)  # type: ignore[no-any-return]
            pool = getattr(torch.nn.functional, f"avg_pool{spatial}d")
            y = pool(
                torch.from_numpy(np.ascontiguousarray(x)), kernel, list(attrs.get("strides") or [1] * spatial),
                [int(p) for p in pads[:spatial]] if auto == "NOTSET" else 0,
                ceil_mode=bool(attrs.get("ceil_mode")), count_include_pad=bool(attrs.get("count_include_pad")),
            )  # fmt: skip
            return (y.numpy(),)

    return AveragePool


def _gather_elements() -> type:
    """onnx's reference ``GatherElements`` with numpy's ``take_along_axis``: onnx's (1.23) gathers with
    ``np.choose``, which takes at most 64 choices, so it raises ``ValueError`` when the gathered axis has more than 64
    entries (RT-DETR's query selection: ``torch.gather`` of the top-k of a few hundred anchors, behind convs that
    send the float64 reference here). Per the ONNX spec, ``out[i][j][k] = data[index[i][j][k]][j][k]`` along
    ``axis``, a negative index counting from the end; the output has the shape of ``indices``, which on the other
    axes may be shorter than ``data`` (as ``torch.gather`` allows)."""
    from onnx.reference.ops.op_gather_elements import GatherElements as OnnxGatherElements

    class GatherElements(OnnxGatherElements):  # type: ignore[misc]
        op_domain = ""

        def _run(self, data: np.ndarray, indices: np.ndarray, axis: int | None = None) -> tuple[np.ndarray]:  # type: ignore[override]
            axis = int(axis or 0) % data.ndim
            index = np.where(indices < 0, indices + data.shape[axis], indices).astype(np.int64)
            window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(index.shape))
            return (np.take_along_axis(data[window], index, axis=axis),)

    return GatherElements


def _global_max_pool() -> type:
    """onnx's reference ``GlobalMaxPool`` as the spec defines it: the maximum over every axis after the first two,
    each kept with size 1. onnx's (1.23) takes the maximum over axes ``rank - 2`` and ``rank - 1``, right only for a
    4-D input: over the channels too for a 3-D one (tf2onnx's Keras ``GlobalMaxPooling1D``: a ``(N, 1)`` output,
    the ``Squeeze`` after it raised), over the last two of three spatial axes for a 5-D one."""
    from onnx.reference.ops.op_global_max_pool import GlobalMaxPool as OnnxGlobalMaxPool

    class GlobalMaxPool(OnnxGlobalMaxPool):  # type: ignore[misc]
        op_domain = ""

        def _run(self, x: np.ndarray) -> tuple[np.ndarray]:  # type: ignore[override]
            return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)

    return GlobalMaxPool


def _grid_sample() -> type:
    """onnx's reference ``GridSample`` with torch's ``grid_sample`` for a 4-D or 5-D input (the op was specified
    after it, and onnxruntime computes it so): onnx's (1.23) knows only opset 20's mode names (``linear``,
    ``cubic``) and raises on opset 16's (``bilinear``, ``bicubic``), which the TorchScript exporter writes below
    opset 20 (RT-DETR's deformable attention); it unnormalizes the grid's coordinates into float32 (a relative error
    near 1e-7 in a float64 graph, above question 1's 1e-9) and interpolates one point at a time in Python. Other
    ranks go to onnx's with the mode renamed."""
    from onnx.reference.ops.op_grid_sample import GridSample as OnnxGridSample

    torch_modes = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
                   "cubic": "bicubic"}  # fmt: skip
    onnx_modes = {"bilinear": "linear", "bicubic": "cubic"}  # opset 16's names -> opset 20's

    class GridSample(OnnxGridSample):  # type: ignore[misc]
        op_domain = ""

        def _run(self, X: np.ndarray, grid: np.ndarray, mode: Any = None, padding_mode: Any = None,  # type: ignore[override]
                 align_corners: Any = None) -> tuple[np.ndarray]:  # fmt: skip
            node = vars(self)  # the node's attributes, set by OpRun
            mode, padding = _text(mode or node["mode"]), _text(padding_mode or node["padding_mode"])
            align = bool(align_corners if align_corners is not None else node["align_corners"])
            torch_mode = torch_modes.get(mode)
            if torch_mode is not None and (X.ndim == 4 or (X.ndim == 5 and torch_mode != "bicubic")):
                y = torch.nn.functional.grid_sample(
                    torch.from_numpy(np.array(X)), torch.from_numpy(np.array(grid)),  # copies: onnx's may be read-only
                    mode=torch_mode, padding_mode=padding, align_corners=align,
                )  # fmt: skip
                return (y.numpy(),)
            return super()._run(X, grid, onnx_modes.get(mode, mode), padding, int(align))  # type: ignore[no-any-return]

    return GridSample


def _upsample() -> list[type]:
    """onnx's reference ``Upsample`` (opsets 7 to 9) and opset 10's ``Resize`` (``X`` and ``scales``, the same op
    renamed) as onnxruntime computes them: the ``scales`` an attribute (opsets 7 and 8) or an input (opsets 9 and
    10), ``mode`` ``nearest`` or ``linear``, on any rank. onnx's (1.23) ``Upsample`` takes ``scales`` as an input only
    (a ``TypeError`` on an opset 7 or 8 node) and computes ``nearest`` with whole scales only; its ``Resize`` reads
    opset 10's ``scales`` as opset 11's ``roi`` (a ``ValueError``: no scales, no sizes). Per axis ``d`` of size
    ``n`` and scale ``s``, the output has ``floor(n * s)`` entries and entry ``o`` reads the input at ``x = o / s``
    (the ``asymmetric`` coordinates of ``Resize``): ``nearest`` takes ``floor(x)`` (``ceil(x)`` where ``s < 1``),
    ``linear`` interpolates between ``floor(x)`` and the entry after it, ``x`` held to ``[0, n - 1]``: onnxruntime's
    ``Upsample`` (which refuses a scale below 1) and its ``Resize`` below opset 11 (``NearestPixel_SIMPLE``). A
    ``Resize`` of opset 11 on runs as onnx's."""
    from onnx.reference.ops.op_resize import Resize as OnnxResize
    from onnx.reference.ops.op_upsample import Upsample as OnnxUpsample

    def upsampled(x: np.ndarray, factors: list[float], how: str) -> tuple[np.ndarray]:
        if how not in ("nearest", "linear") or len(factors) != x.ndim:
            raise ValueError(f"Upsample: mode {how!r} with scales {factors} on a rank-{x.ndim} input")
        y = x
        for axis, factor in enumerate(factors):
            n = y.shape[axis]
            at = np.arange(int(np.floor(n * factor))) / factor
            if how == "nearest":
                index = (np.ceil(at) if factor < 1 else np.floor(at)).astype(np.int64).clip(0, n - 1)
                y = np.take(y, index, axis=axis)
                continue
            at = at.clip(0, n - 1)
            low = np.floor(at).astype(np.int64)
            high = np.minimum(low + 1, n - 1)
            weight = (at - low).reshape([-1 if d == axis else 1 for d in range(y.ndim)]).astype(y.dtype)
            y = np.take(y, low, axis=axis) * (1 - weight) + np.take(y, high, axis=axis) * weight
        return (y.astype(x.dtype),)

    class Upsample(OnnxUpsample):  # type: ignore[misc]
        op_domain = ""

        def _run(self, x: np.ndarray, scale: np.ndarray | None = None, mode: Any = None,  # type: ignore[override]
                 scales: Any = None) -> tuple[np.ndarray]:  # fmt: skip
            return upsampled(x, [float(f) for f in (scale if scale is not None else scales)], _text(mode, "nearest"))

    class Resize(OnnxResize):  # type: ignore[misc]
        op_domain = ""

        def _run(self, x: np.ndarray, *inputs: Any, **attrs: Any) -> tuple[np.ndarray]:  # type: ignore[override]
            if len(self.onnx_node.input) == 2:  # opset 10: (X, scales); from 11 on scales or sizes is a third input
                return upsampled(
                    x, [float(f) for f in inputs[0]], _text(attrs.get("mode") or vars(self)["mode"], "nearest")
                )
            return super()._run(x, *inputs, **attrs)  # type: ignore[no-any-return]

    return [Upsample, Resize]


def _round(x: np.ndarray, dtype: Any) -> np.ndarray:
    """Float inputs rounded to the file's dtype, then float64 (integer ids as they are)."""
    if not np.issubdtype(x.dtype, np.floating):
        return x
    return np.asarray(x, dtype=dtype).astype(np.float64) if dtype is not None else x.astype(np.float64)


def embedding_rows(info: OnnxFile, input_name: str) -> int | None:
    """The row count of the embedding table the integer input indexes (``Gather(table, ids)``), or None."""
    tables = {t.name: list(t.dims) for t in info.proto.graph.initializer}
    names = {input_name}
    for node in info.proto.graph.node:
        if node.op_type == "Cast" and node.input and node.input[0] in names:
            names.add(node.output[0])
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in names and node.input[0] in tables:
            dims = tables[node.input[0]]
            return int(dims[0]) if dims else None
    return None


def choose_onnx_inputs(info: OnnxFile, opts: VerifyOptions) -> tuple[Inputs, str, str | None]:
    """The verification inputs: ``--inputs`` (an ``.npz``), else seeded samples drawn from the graph's input type
    and shape (``_drawn``). A model with several inputs gets a dict of arrays by input name (``--inputs``: one
    array per input name, ``_several_inputs``). With ``--samples N`` an ``.npz``'s first ``N``
    samples only, as ``verify.inputs.choose_inputs`` takes them.

    Raises:
        UsageError: a dynamic axis other than the batch, or integer inputs whose range no embedding gives.
        InputError: an unreadable ``.npz`` or one of the wrong shape; an input without the batch axis.
    """
    check_batch_axes(info)
    if not opts.inputs:
        return _drawn(info, opts)
    if len(info.inputs) > 1:
        found, label, digest = _several_inputs(info, Path(opts.inputs))
    else:
        rows = embedding_rows(info, info.input_name) if info.token_input else None
        found, digest = read_inputs_file(Path(opts.inputs), info.input_shape, info.token_input, rows)
        label = str(opts.inputs)
    total = samples_of(found)
    if digest is not None and opts.samples is not None and opts.samples < total:  # a file's first N samples
        return (
            take(found, 0, opts.samples),
            f"{label} (its first {opts.samples} of {total} samples: --samples {opts.samples})",
            digest,
        )
    return found, label, digest


def _drawn(info: OnnxFile, opts: VerifyOptions) -> tuple[Inputs, str, None]:
    """``--samples`` seeded samples of each graph input, drawn from its type and shape: standard normal floats
    (``standard_normal``, as every door draws them; the ``i``-th input seeded ``seed + i``), integer ids below the
    row count of the embedding an input indexes, an integer or boolean input named like a mask (``attention_mask``)
    all ones (every token attended), any other integer input beside others 0 or 1 (``token_type_ids``). One array
    for a graph of one input, else a dict by input name (``choose_onnx_inputs``).

    Raises:
        UsageError: an input with dynamic axes besides the batch; a graph whose one input is integer ids whose range
            no embedding shows.
    """
    samples, seed = opts.sample_count(), opts.seed
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, graph_input in enumerate(info.inputs):
        if graph_input.shape is None:
            raise UsageError(
                f"{info.path}: the input {graph_input.name!r} has dynamic axes besides the batch; pass --inputs NPZ"
            )
        shape = (samples, *graph_input.shape)
        rows = embedding_rows(info, graph_input.name) if graph_input.integer else None
        if not graph_input.integer:
            out[graph_input.name] = standard_normal(samples, graph_input.shape, seed + i)
        elif "mask" in graph_input.name.lower():
            out[graph_input.name] = np.ones(shape, dtype=np.int64)
        elif rows is None and len(info.inputs) == 1:
            raise UsageError(
                f"{info.path}: the model takes integer ids whose range it does not show; pass --inputs NPZ"
            )
        else:
            out[graph_input.name] = rng.integers(0, rows if rows is not None else 2, shape, dtype=np.int64)
    found = out if len(out) > 1 else next(iter(out.values()))
    return found, f"random(seed={seed}, samples={samples})", None


def check_batch_axes(info: OnnxFile) -> None:
    """Refuse a graph input that does not share the first input's batch axis (axis 0: a static size equal to the
    first input's, or a dynamic one): every input, drawn or from ``--inputs``, is fed N samples along axis 0, split
    into the calls the graph takes. A scalar (an ``If``'s condition) or an input of static leading size 1 beside a
    batch of 2 (a scale fed at run time) cannot be split so; onnxruntime refused the call after the reference's
    work (an internal error).

    Raises:
        InputError: naming the input, its declared shape and the batch it does not follow.
    """
    if not info.inputs:
        return
    first = info.inputs[0]
    batch = first.dims[0] if first.dims else None  # None: dynamic (or the first input is itself a scalar)
    for graph_input in info.inputs:
        if graph_input.dims and graph_input.dims[0] in (None, batch):
            continue
        shown = "[" + ", ".join("?" if d is None else str(d) for d in graph_input.dims) + "]"
        raise InputError(
            f"{info.path}: the input {graph_input.name!r} (shape {shown}) has no batch axis like the first input "
            f"{first.name!r} (axis 0 of size {'dynamic' if batch is None else batch}), so slabconv cannot feed it "
            "samples; fold it "
            "with --no-verify and check model.onnx on your own inputs, or export the model with that value inside it"
        )


def _several_inputs(info: OnnxFile, path: Path) -> tuple[Inputs, str, str | None]:
    """The ``--inputs`` of a model with several graph inputs: an ``.npz`` with one array per input name.

    Raises:
        InputError: an unreadable ``.npz``, one without an array per input or of the wrong shapes.
    """
    arrays, digest = load_npz_members(path, {i.name: i.shape for i in info.inputs})
    for graph_input in info.inputs:  # in the file's own dtype: a cast to int64 wraps a uint64 id above its range
        if graph_input.integer and "mask" not in graph_input.name.lower():
            check_token_ids(arrays[graph_input.name], path, embedding_rows(info, graph_input.name))
    cast = {i.name: arrays[i.name].astype(np.int64 if i.integer else np.float32) for i in info.inputs}
    return cast, str(path), digest


_RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli"})
"""Ops that draw random numbers: a graph with one gives other outputs on every run (a dropout exported in training
mode), so no two runs can be compared."""


def check_deterministic(info: OnnxFile) -> None:
    """Refuse a graph that draws random numbers: its outputs differ from run to run, so verification would
    blame the fold for the noise.

    Raises:
        InputError: a ``RandomUniformLike`` / ``RandomNormal`` / ``Bernoulli`` node, or a ``Dropout`` whose
            ``training_mode`` input is not a constant false.
    """
    import onnx

    graph = info.proto.graph  # read_onnx holds every tensor's data inside it
    # the scalar constants that are false (a dropout's training_mode)
    false = {t.name for t in graph.initializer if len(t.dims) == 0 and not onnx.numpy_helper.to_array(t).any()}
    for node in graph.node:
        training = node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] not in ("", *false)
        if node.op_type in _RANDOM_OPS or training:
            raise InputError(
                f"{info.path}: the graph draws random numbers ({node.op_type} node {node_label(node)[:80]!r}: a "
                "dropout or batch statistics exported in training mode?), so no two runs agree; export the model "
                "after model.eval()"
            )


def float64_reference(path: Path, x: Inputs, dtype: str, batch: int | None) -> tuple[list[np.ndarray], str]:
    """The outputs of the ONNX graph at ``path`` evaluated in float64 on ``x`` (rounded to ``dtype`` first), and
    which evaluator ran it (the float64 reference of ``verify`` when the reference is an ``.onnx`` file)."""
    model: Any = load_ir(path)
    onnx_fold.to_float64(model)
    run, which = _float64_runner(model, _NP_DTYPES.get(dtype))
    return run_batched(run, x, fixed_batch=batch), which


def cast_reference(path: Path, dtype: str, x: Inputs, batch: int | None) -> tuple[list[np.ndarray], str] | None:
    """The outputs of the ONNX graph at ``path`` cast to ``dtype`` (float16 or bfloat16: every floating tensor and
    type, ``onnx_fold.cast_floats``) on ``x`` rounded to it, as float64, and how, in words, naming the evaluator
    that ran it (onnxruntime, else onnx's reference evaluator): the original's own error in a narrower candidate's
    precision, as ``run.original_cast`` gives it for a PyTorch original (``run.Reference.cast_to``). None for
    another dtype, or where neither runs the cast graph.
    """
    import onnx_ir as ir

    if dtype not in ("float16", "bfloat16"):
        return None
    model: Any = load_ir(path)
    onnx_fold.cast_floats(model, getattr(ir.DataType, dtype.upper()))
    try:
        run, which = _float64_runner(model, getattr(ir.DataType, dtype.upper()).numpy())
        outputs = run_batched(run, x, fixed_batch=batch)
    except Exception:  # noqa: BLE001 - onnxruntime and onnx's evaluator lack a kernel of this dtype
        return None
    return outputs, f"the reference {path.name} cast to {dtype} ({which.split(':')[0]})"


@dataclass
class Fold64:
    """The float64 fold of an ONNX original (``onnx_fold64``) and what it was made from.

    Attributes:
        fused: the fold, an ``onnx_ir.Model`` whose floating tensors and types are float64, never simplified: what
            question 1 runs against the original in float64 (the fold alone is judged).
        original: the prepared original (``onnx_lower.prepare``: the node and value names ``lowered`` and the fused
            graph use) cast to float64, unfused; None unless asked for.
        lowered: the prepared original as the engine saw it (``onnx_lower.Lowered``: each layer's ONNX nodes).
        plans: one ``NormPlan`` per norm, in graph order (``plan.decision``: the report's decision).
        rounded: for a candidate ``fuse --simplify`` wrote, the same fold made in the file's own dtypes (each fold
            composed in float64 and rounded once, as ``fuse`` writes it), unsimplified; else None.
        simplified: ``rounded`` simplified by the simplifiers the candidate names (``simplify_graph``), at the
            file's own precision: the tensors such a candidate must hold; else None.
        simplifiers: the candidate's simplifiers, as its mark names them (``["onnxscript 0.7.2", "onnxslim
            0.1.98"]``), or None.
        simplified_by: the simplifiers that made ``simplified`` here (their installed versions), or None.
    """

    fused: Any
    original: Any
    lowered: Any
    plans: list[Any]
    rounded: Any = None
    simplified: Any = None
    simplifiers: list[str] | None = None
    simplified_by: list[str] | None = None


def onnx_fold64(path: Path, candidate: OnnxFile, keep_original: bool = False) -> Fold64:
    """The float64 fold of the ONNX original at ``path`` (question 1's reference): the engine's fold of the graph
    cast to float64 (``onnx_fold.plan_file`` then ``onnx_fold.fold_planned(..., as_float64=True)``: what
    ``onnx_fold.fold_file`` does, the contract ``slabconv.onnx_in.fold_onnx`` keeps), with the affines of the norm
    ops folded as ``candidate`` (the ``.onnx`` checked) was (its ``NORM_AFFINE_KEY`` mark: ``--fold-norm-affine``).
    The one place verification folds an ONNX graph.

    A candidate ``fuse --simplify`` wrote (``SIMPLIFIED_KEY``) holds tensors no fold made: the simplifiers fold
    constants (a rotary ``sin`` table, shape arithmetic) in the file's own dtype. Its tensors are held to
    ``Fold64.simplified``: the same plans applied to a copy of the prepared original in its own dtypes (the rounded
    fold, itself held to ``fused`` tensor by tensor), then the candidate's simplifiers, in that order, at that
    precision. The fold is judged in float64, unsimplified; what the simplifiers computed is judged by question 2.

    Args:
        keep_original: also keep a float64 copy of the prepared original, unfused (``Fold64.original``: the
            localisation's values at each fold boundary before the fold).

    Raises:
        as ``onnx_fold.plan_file``; UsageError: the candidate names a simplifier not installed here.
    """
    import onnx_ir as ir

    from slabconv.write.onnx import NORM_AFFINE_KEY, simplified

    affine = any(p.key == NORM_AFFINE_KEY and p.value == "true" for p in candidate.proto.metadata_props)
    model = load_ir(path)
    lowered, plans = onnx_fold.plan_file(model, str(path), norm_affine=affine)
    original = None
    if keep_original:
        original = ir.from_proto(ir.to_proto(model))
        onnx_fold.to_float64(original)
    simplifiers = simplified(candidate.proto)
    rounded = small = by = values = None
    if simplifiers is not None:
        from slabconv.engine.onnx_apply import folded_values

        values = folded_values(lowered, plans)[0]  # the fold program, run once for both applications
        rounded = onnx_fold.fold_planned(ir.from_proto(ir.to_proto(model)), lowered, plans, False, values)
        small = ir.from_proto(ir.to_proto(rounded))
        by = onnx_fold.simplify_graph(small, simplifiers)["simplifiers"]
    fused = onnx_fold.fold_planned(model, lowered, plans, as_float64=True, values=values)
    return Fold64(fused, original, lowered, plans, rounded, small, simplifiers, by)


def run_float64(model: Any, x: Inputs, dtype: str, batch: int | None) -> list[np.ndarray]:
    """Every output of a float64 ``onnx_ir.Model`` on ``x`` (float inputs rounded to ``dtype`` first)."""
    return run_batched(_float64_runner(model, _NP_DTYPES.get(dtype))[0], x, fixed_batch=batch)


def float_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every floating initializer of an ONNX file, by name, in its stored dtype."""
    import onnx_ir as ir

    return stored_tensors(ir.load(str(path)))


def stored_tensors(model: Any, float64: bool = False) -> dict[str, torch.Tensor]:
    """Every floating initializer of an in-memory ``onnx_ir.Model``, by name, in its stored dtype (``float64``: cast
    to float64, which holds every value of a narrower floating dtype exactly)."""
    from slabconv.engine.onnx_lower import to_torch

    out = {}
    for name, value in model.graph.initializers.items():
        if value.const_value is not None and value.dtype is not None and value.dtype.is_floating_point():
            array = np.asarray(value.const_value.numpy())
            out[name] = torch.from_numpy(array.astype(np.float64)) if float64 else to_torch(array)
    return out
