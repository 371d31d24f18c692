"""Ways of running a model, for both accuracy (``verify``, question 2) and timing (``bench``): PyTorch (any
dtype, CPU or CUDA, optionally replayed as a CUDA graph), onnxruntime (CPU or CUDA; optimisations off and on) and
OpenVINO -- the openers of the runtime table (``slabconv.verify.backends.BACKENDS``).

A ``Backend`` is chosen by name (``verify --runtime``, ``bench --runtime``); ``Backend.open`` takes the artifact it
runs (an ``nn.Module`` / ``GraphModule``, or an ``.onnx`` path) and returns ``Runtime``s, each serving both: ``run``
(inputs in, every output as float64 out) and ``timer`` (a zero-argument call on one fixed input that returns when
the device is done). A new backend is one entry in ``BACKENDS``, its opener here and its case in
``tests/test_backends.py``.

Inputs travel as numpy arrays: float32 for floating inputs (numpy has no bfloat16) and int64 token ids. Every
runtime rounds float inputs to the dtype it runs in, the way the model would see them; the float64 reference
rounds them to the checkpoint's dtype first (``round_to``), so all sides compute on the same values. Outputs come
back as float64 numpy arrays.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from slabconv import engine
from slabconv.errors import InputError, UsageError, first_line
from slabconv.util import output_names_of, text_path
from slabconv.verify.backends import BACKENDS, Backend
from slabconv.verify.policy import dtype_name

Inputs = np.ndarray | dict[str, np.ndarray]
"""The inputs of a run: one array ``(N, ...)``, or one per graph input, by name, each ``(N, ...)`` (an ONNX
original with several inputs)."""

Run = Callable[[Any], list[np.ndarray]]

Timer = Callable[[np.ndarray], Callable[[], Any]]
"""``timer(x)``: a call of the model on the fixed input ``x`` (already in the runtime's dtype) that returns when the
device is done; made once per input, called many times."""


@dataclass
class Runtime:
    """One way of running a model: a label for the report and a function from inputs to outputs.

    Attributes:
        label: ``onnxruntime[no-optimizations]``, ``pytorch 2.13.0 float16``, ...
        run: takes an array ``(B, ...)`` (float32 or int64), returns every output as float64 ``(B, ...)``.
        dtype: the dtype the model computes in (``float16``...): it sets the tolerance.
        output_names: names of the outputs when the format has them (ONNX; a program's output pytree), else None.
        fixed_batch: the batch size the model requires when its batch axis is not dynamic.
        kind: the name of the ``Backend`` it came from (what ``--runtime`` calls it).
        timer: the same model timed (``Timer``).
        close: drops what the runtime holds (an onnxruntime session and its memory arena); called once its
            checks are done, so that runtimes run one after another do not hold their memory at once. ``run``
            and ``timed`` may not be called after it.
    """

    label: str
    run: Run
    dtype: str = "float32"
    output_names: list[str] | None = None
    fixed_batch: int | None = None
    kind: str = ""
    timer: Timer | None = None
    close: Callable[[], None] = lambda: None

    def timed(self, x: np.ndarray) -> Callable[[], Any]:
        """``timer(x)``.

        Raises:
            ValueError: a runtime made without a timer.
        """
        if self.timer is None:
            raise ValueError(f"{self.label} has no timer")
        return self.timer(x)


class RuntimeUnavailable(Exception):
    """A runtime cannot run an artifact (onnxruntime's CPU provider has no bfloat16 MatMul): not an error of the
    file; the verification says so in a note and runs the artifact elsewhere."""


def to_device(model: nn.Module, device: str | torch.device) -> nn.Module:
    """A copy of ``model`` on ``device``: parameters, buffers and plain tensor attributes moved, and (in a
    ``GraphModule``) the ``device=`` arguments that ``torch.export`` recorded in the graph (``arange``, ``full``,
    ``zeros``... on the CPU) rewritten, so that no op mixes devices."""
    device = torch.device(device)
    out = copy.deepcopy(model).to(device)
    for owner in out.modules():
        for name, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device != device:
                setattr(owner, name, value.to(device))
    if isinstance(out, fx.GraphModule):
        for node in out.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
                node.update_kwarg("device", device)
        out.recompile()
    return out


def torch_runner(
    model: nn.Module,
    dtype: torch.dtype,
    round_to: torch.dtype | None = None,
    device: str = "cpu",
    *,
    narrow: bool = False,
) -> Run:
    """Run ``model`` (on ``device``) on an array: float inputs rounded to ``round_to`` (when given), then cast to
    ``dtype``; integer ids as they are. Every tensor output (tuples, lists and dicts flattened) comes back as
    float64; with ``narrow``, a floating output computed in float32 or narrower comes back as float32, which holds
    it exactly (half the memory: the reference's outputs in its own dtype, held through question 2). Each call
    starts from the model's own state: the buffers a graph updates as it runs (a call counter,
    ``engine.written_tensors``) are put back after it, so no run changes what a later one computes or what question 1
    reads."""

    stateful = model if isinstance(model, fx.GraphModule) and engine.written_tensors(model) else None  # once

    def run(x: np.ndarray) -> list[np.ndarray]:
        t = torch.from_numpy(x)
        if t.is_floating_point():
            t = t.to(round_to).to(dtype) if round_to is not None else t.to(dtype)
        if device != "cpu":
            t = t.to(device)
        kept = engine.state_kept(stateful) if stateful is not None else contextlib.nullcontext()
        with torch.no_grad(), kept:
            out = model(t)
        leaves = torch.utils._pytree.tree_leaves(out)
        return [as_numpy(o.detach().cpu(), narrow) for o in leaves if isinstance(o, torch.Tensor)]

    return run


def as_numpy(tensor: torch.Tensor, narrow: bool) -> np.ndarray:
    """``tensor`` as float64, or (``narrow``) a float32-or-narrower floating one as float32, which holds it exactly
    (the comparisons convert a block of rows at a time to float64: ``verify.blocks``)."""
    if narrow and tensor.is_floating_point() and tensor.dtype.itemsize <= 4:
        return tensor.float().numpy()
    return tensor.double().numpy()


def _torch_timer(model: nn.Module, backend: Backend) -> Timer:
    """A call of ``model`` on ``x`` that returns when the device is done (CUDA: synchronised; with
    ``cuda_graphs``, the graph captured once here and replayed)."""

    def timer(feed: np.ndarray) -> Callable[[], Any]:
        x = torch.from_numpy(feed).to(backend.device)
        if backend.device != "cuda":
            return lambda: model(x)
        if not backend.cuda_graphs:

            def run() -> None:
                model(x)
                torch.cuda.synchronize()

            return run
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up on a side stream, as CUDA graph capture requires
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x)  # x is the static input; outputs stay in the graph's pool

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        return replay

    return timer


def open_torch(
    backend: Backend,
    model: nn.Module,
    dtype: torch.dtype | None = None,
    what: str = "model",
    fixed_batch: int | None = None,
) -> list[Runtime]:
    """``model`` in PyTorch in ``dtype`` (default the backend's) on the backend's device, labelled
    ``pytorch <version> <dtype> (<what>)``. A model for another device than the CPU is copied there."""
    dtype = dtype or backend.dtype
    name = dtype_name(dtype)
    placed = model if backend.device == "cpu" else to_device(model, backend.device)
    label = torch_label(name, what)
    run = torch_runner(placed, dtype, device=backend.device)
    names = output_names_of(getattr(model, "_out_spec", None))  # a program's module: the names its outputs have
    timer = _torch_timer(placed, backend)
    return [Runtime(label, run, name, fixed_batch=fixed_batch, kind=backend.name, timer=timer, output_names=names)]


def torch_label(dtype: str, what: str) -> str:
    """The label of a PyTorch runtime: ``pytorch <version> <dtype> (<what>)``."""
    return f"pytorch {torch.__version__} {dtype} ({what})"


def ort_label(level: str) -> str:
    """The label of an onnxruntime session at one of ``ORT_LEVELS``: ``onnxruntime[<level>]``."""
    return f"onnxruntime[{level}]"


def torch_runtime(model: nn.Module, dtype: torch.dtype, what: str, fixed_batch: int | None = None) -> Runtime:
    """``model`` in PyTorch on the CPU in ``dtype``, labelled ``pytorch <version> <dtype> (<what>)``."""
    return BACKENDS["pytorch"].open(model, dtype=dtype, what=what, fixed_batch=fixed_batch)[0]


_ORT_INPUT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}
_ORT_OUTPUT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}
_ORT_OUTPUT_DTYPES["tensor(bfloat16)"] = "bfloat16"

ORT_LEVELS = ("no-optimizations", "all-optimizations")
"""The onnxruntime graph optimisation levels ``verify`` runs a file at (an optimiser can change numbers)."""


def _ort_timer(session: Any, device: str) -> Timer:
    """``session.run`` on ``feed``; on CUDA, with the input copied to the device once and outputs bound there."""

    def timer(feed: np.ndarray) -> Callable[[], Any]:
        name = session.get_inputs()[0].name
        if device != "cuda":
            return lambda: session.run(None, {name: feed})
        import onnxruntime as ort

        binding = session.io_binding()
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(feed, "cuda", 0))
        for out in session.get_outputs():
            binding.bind_output(out.name, "cuda")
        return lambda: session.run_with_iobinding(binding)

    return timer


def open_onnxruntime(
    backend: Backend, path: Path, several: bool = False, levels: tuple[str, ...] = ORT_LEVELS
) -> list[Runtime]:
    """onnxruntime on the backend's device, one session per optimisation level of ``levels`` (``ORT_LEVELS``).

    Each ``run`` casts the input to the model's input type and returns every output as float64. With ``several``
    a model may have several inputs; its ``run`` then takes a dict of arrays by input name (``Inputs``).

    Raises:
        RuntimeUnavailable: onnxruntime cannot create a session for it (e.g. bfloat16 ops its CPU provider lacks).
        InputError: the model has more than one input, or an input type slabconv cannot feed.
    """
    import onnxruntime as ort

    provider = "CUDAExecutionProvider" if backend.device == "cuda" else "CPUExecutionProvider"
    graph_levels = {
        "no-optimizations": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "all-optimizations": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    runtimes: list[Runtime] = []
    stored: Any = None  # the file's proto without external data, read once where its outputs are wider than float16
    for label in levels:
        options = ort.SessionOptions()
        options.graph_optimization_level = graph_levels[label]
        options.log_severity_level = 3
        with text_path(path) as text:  # onnxruntime takes UTF-8 paths only
            try:
                session = ort.InferenceSession(text, options, providers=[provider])
            except Exception as err:  # noqa: BLE001 - onnxruntime raises its own exception types
                raise RuntimeUnavailable(f"onnxruntime cannot run {path.name}: {first_line(err, 160)}") from None
        inputs = session.get_inputs()
        if len(inputs) != 1 and not several:
            raise InputError(f"{path}: the model has {len(inputs)} inputs; slabconv verifies models with one input")
        types = {}
        for port in inputs:
            if port.type not in _ORT_INPUT_DTYPES:
                raise InputError(f"{path}: input type {port.type} is not supported (float32, float16, float64, int64)")
            types[port.name] = _ORT_INPUT_DTYPES[port.type]
        outputs = session.get_outputs()
        dtype = _ORT_OUTPUT_DTYPES.get(outputs[0].type, "float32") if outputs else "float32"
        if dtype in ("float32", "float64"):  # float16 weights behind float32 outputs: judged as float16
            import onnx

            from slabconv.load.onnx_file import computed_dtype

            stored = stored if stored is not None else onnx.load_model(str(path), load_external_data=False)
            dtype = computed_dtype(dtype, stored)
        batch = inputs[0].shape[0] if inputs[0].shape else None

        held = [session]  # emptied by close(): the session (and its arena) is freed once its checks are done

        def run(x: Inputs, s: list[Any] = held, t: dict[str, Any] = types) -> list[np.ndarray]:
            feed = x if isinstance(x, dict) else {next(iter(t)): x}
            fed = {n: np.asarray(a).astype(t[n], copy=False) for n, a in feed.items()}
            return [np.asarray(o, dtype=np.float64) for o in s[0].run(None, fed)]

        runtimes.append(
            Runtime(
                label=ort_label(label),
                run=run,
                dtype=dtype,
                output_names=[o.name for o in outputs],
                fixed_batch=batch if isinstance(batch, int) and batch > 0 else None,
                kind=backend.name,
                timer=lambda x, h=held, d=backend.device: _ort_timer(h[0], d)(x),  # type: ignore[misc]
                close=held.clear,
            )
        )
        del session
    return runtimes


def open_onnxruntime_int8(
    backend: Backend,
    path: Path,
    calibration: Inputs | None = None,
    several: bool = False,
    levels: tuple[str, ...] = ORT_LEVELS[-1:],
    fixed_batch: int | None = None,
) -> list[Runtime]:
    """The ``.onnx`` at ``path`` quantized to int8 as deployed (``slabconv.verify.int8.quantize_int8``: QDQ, int8
    weights per output channel, int8 activations per tensor, MinMax calibration on ``calibration``, in batches of
    exactly ``fixed_batch`` when given) and run in onnxruntime on the CPU (with every graph optimisation by default:
    the QDQ pairs become int8 kernels), labelled ``onnxruntime-int8[<level>]``. The quantized file lives in a
    temporary folder until the session is made.

    Raises:
        UsageError: no calibration inputs.
        RuntimeUnavailable: onnxruntime cannot quantize or run the model.
        InputError: as ``open_onnxruntime``.
    """
    import tempfile

    from slabconv.verify.int8 import quantize_int8

    if calibration is None:
        raise UsageError(f"--runtime {backend.name} quantizes {path.name}: it needs calibration inputs")
    with tempfile.TemporaryDirectory(prefix="slabconv-int8-") as tmp:
        quantized = quantize_int8(path, Path(tmp) / f"{path.stem}.int8.onnx", calibration, fixed_batch=fixed_batch)
        opened = open_onnxruntime(backend, quantized, several=several, levels=levels)
    for runtime in opened:
        runtime.label = runtime.label.replace("onnxruntime[", f"{backend.name}[", 1)
    return opened


def onnx_runtimes(path: Path, several: bool = False, levels: tuple[str, ...] = ORT_LEVELS) -> list[Runtime]:
    """onnxruntime on the CPU with graph optimisations disabled and fully enabled, or at ``levels`` only
    (``open_onnxruntime``)."""
    return BACKENDS["onnxruntime"].open(path, several=several, levels=levels)


_OV_PRECISIONS = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}
_WIDTH = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}


def openvino_runtime(path: Path, device: str = "CPU", kind: str = "openvino") -> Runtime:
    """The ``.onnx`` at ``path`` compiled by OpenVINO for ``device`` with its default settings, as deployed. Its
    ``run`` takes an array (the first input) or a dict of arrays by input name (``Inputs``), each fed in the dtype
    its input declares.

    OpenVINO picks its inference precision itself: on CPUs with bfloat16 (AVX-512 BF16, AMX) it runs a float32
    model in bfloat16 (about 6e-3 away from float32). The label names the precision it ran
    (``INFERENCE_PRECISION_HINT``), and question 2 judges it at that precision's tolerance (the lower of it and
    the file's dtype). Source: OpenVINO's "Precision Control" guide.

    Raises:
        RuntimeUnavailable: OpenVINO cannot read or compile the file.
    """
    import openvino as ov

    try:
        core = ov.Core()
        compiled = core.compile_model(str(path), device)
        hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    except Exception as err:  # noqa: BLE001 - OpenVINO raises its own exception types
        raise RuntimeUnavailable(f"openvino cannot run {path.name}: {first_line(err, 160)}") from None
    ran = _OV_PRECISIONS.get(getattr(hint, "get_type_name", lambda: str(hint))(), str(hint))
    port = compiled.inputs[0]
    file_dtype = _ov_dtype(compiled.outputs[0].get_element_type()) if compiled.outputs else "float32"
    dtype = min((ran, file_dtype), key=lambda d: _WIDTH.get(d, 2))
    request = compiled.create_infer_request()
    feeds = {p.get_any_name(): (i, _ov_feed(ov, p.get_element_type())) for i, p in enumerate(compiled.inputs)}

    def fed(x: Inputs) -> dict[int, Any]:
        """Each input port's array, by position: a dict of arrays goes by input name, an array to the first."""
        if not isinstance(x, dict):
            return {0: next(iter(feeds.values()))[1](x)}
        return {feeds[name][0]: feeds[name][1](a) for name, a in x.items()}

    def run(x: Inputs) -> list[np.ndarray]:
        results = request.infer(fed(x))
        return [_ov_output(results[out], out.get_element_type()) for out in compiled.outputs]

    def timer(fed_array: Inputs) -> Callable[[], Any]:
        feed = fed(fed_array)
        return lambda: request.infer(feed)

    shape = port.get_partial_shape()
    batch = shape[0].get_length() if shape.rank.is_static and shape[0].is_static else None
    return Runtime(
        label=f"openvino {ov.__version__} {device} (inference precision {ran})",
        run=run,
        dtype=dtype,
        output_names=[out.get_any_name() for out in compiled.outputs],
        fixed_batch=batch,
        kind=kind,
        timer=timer,
    )


def _ov_dtype(element_type: Any) -> str:
    """The dtype name of an OpenVINO element type (its ``to_dtype`` maps bfloat16 to numpy's float16)."""
    if str(element_type.get_type_name()) == "bf16":
        return "bfloat16"
    return dtype_name(element_type.to_dtype())


def _ov_feed(ov: Any, element_type: Any) -> Callable[[np.ndarray], Any]:
    """How an input array reaches a port of ``element_type``: in the dtype the file declares. A bfloat16 port gets
    bfloat16 values (the array rounded to bfloat16 by ``ml_dtypes``, its bits in an ``ov.Tensor`` of type bf16):
    numpy has no bfloat16, and OpenVINO's own conversion would hand it float16 bits."""
    if _ov_dtype(element_type) != "bfloat16":
        np_dtype = element_type.to_dtype()
        return lambda x: x.astype(np_dtype, copy=False)
    import ml_dtypes

    def feed(x: np.ndarray) -> Any:
        bits = np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
        return ov.Tensor(bits, list(bits.shape), ov.Type.bf16)

    return feed


def _ov_output(value: np.ndarray, element_type: Any) -> np.ndarray:
    """An output as float64: a bfloat16 output (OpenVINO returns its bits as float16) read as bfloat16."""
    if _ov_dtype(element_type) == "bfloat16":
        bits = np.asarray(value).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(value, dtype=np.float64)


def open_openvino(backend: Backend, path: Path) -> list[Runtime]:
    return [openvino_runtime(path, backend.device.upper(), kind=backend.name)]


def samples_of(inputs: Inputs) -> int:
    """The number of samples ``N`` of ``inputs`` (every array of a dict has the same)."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)


def take(inputs: Inputs, start: int, stop: int) -> Inputs:
    """Samples ``start:stop`` of ``inputs``."""
    if isinstance(inputs, dict):
        return {name: a[start:stop] for name, a in inputs.items()}
    return inputs[start:stop]


BATCH = 4
"""Samples per call of every run of a verification: the original, its float64 graph, the fold's and each written
file alike, since an output may depend on the other samples of its batch (``h - h.mean()``) and each side must
compute the same numbers. Float64 activations take twice float32's, and at 16 samples a call they set
verification's peak memory (a DeiT-Tiny at 224x224: about 10 MiB a sample); batches of 4 took no more CPU time
(``docs/performance.md``)."""


def chunks(inputs: Inputs, batch: int = BATCH, fixed_batch: int | None = None) -> Iterator[tuple[int, Inputs, int]]:
    """``(start, chunk, n)`` over ``inputs`` (an array, or a dict of arrays by input name): samples ``start:start +
    n`` in chunks of ``batch``, or of exactly ``fixed_batch`` (the last one padded with copies of its first sample:
    ``n`` of its samples are real), each array contiguous."""
    step = fixed_batch or batch

    def one(a: np.ndarray, start: int) -> np.ndarray:
        chunk = a[start : start + step]
        if fixed_batch and len(chunk) < fixed_batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], fixed_batch - len(chunk), axis=0)])
        return np.ascontiguousarray(chunk)

    total = samples_of(inputs)
    for start in range(0, total, step):
        chunk = {k: one(a, start) for k, a in inputs.items()} if isinstance(inputs, dict) else one(inputs, start)
        yield start, chunk, min(step, total - start)


def run_batched(run: Run, inputs: Inputs, batch: int = BATCH, fixed_batch: int | None = None) -> list[np.ndarray]:
    """Run ``run`` over ``inputs`` (an array, or a dict of arrays by input name) in chunks of ``batch`` samples
    (or exactly ``fixed_batch``, padding the last chunk with copies of its first sample and dropping their
    outputs: an output whose axis 0 is the chunk's rows is cut back to the real samples, any other kept whole) and
    stack each output over the chunks: written into one array per output as the chunks come (every output with a
    batch axis, of one dtype), so the outputs are never held twice (a language model's logits ``(N, T, V)`` are the
    largest arrays of a verification); one chunk is returned as it is."""
    total = samples_of(inputs)
    filled: list[np.ndarray] | None = None
    parts: list[list[np.ndarray]] = []
    for start, chunk, n in chunks(inputs, batch, fixed_batch):
        rows = samples_of(chunk)
        outs = [o[:n] if o.ndim and len(o) == rows else o for o in map(np.asarray, run(chunk))]
        if start == 0 and n < total and outs and all(o.ndim and len(o) == n for o in outs):
            filled = [np.empty((total, *o.shape[1:]), o.dtype) for o in outs]
        if filled is not None and len(outs) == len(filled):
            if all(o.shape == (n, *f.shape[1:]) and o.dtype == f.dtype for o, f in zip(outs, filled, strict=True)):
                for f, o in zip(filled, outs, strict=True):
                    f[start : start + n] = o
                continue
        if filled is not None:  # a chunk unlike the first: stacked as given
            parts, filled = [[f[:start] for f in filled]], None
        parts.append(outs)
    if filled is not None:
        return filled
    return parts[0] if len(parts) == 1 else [np.concatenate(p) for p in zip(*parts, strict=True)]


def onnxruntime_version() -> str:
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__}"
