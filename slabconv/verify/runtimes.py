"""Ways of running a model on an array of inputs: PyTorch (any dtype), onnxruntime (optimisations off and on).

Inputs travel as numpy arrays: float32 for floating inputs (numpy has no bfloat16) and int64 token ids. Every
runtime rounds float inputs to the dtype it runs in, the way the model would see them; the float64 reference
rounds them to the checkpoint's dtype first (``round_to``), so all sides compute on the same values. Outputs come
back as float64 numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slabconv.errors import InputError, first_line
from slabconv.verify.policy import dtype_name

Inputs = np.ndarray | dict[str, np.ndarray]
"""The inputs of a run: one array ``(N, ...)``, or one per graph input, by name, each ``(N, ...)`` (an ONNX
original with several inputs)."""

Run = Callable[[Any], list[np.ndarray]]


@dataclass
class Runtime:
    """One way of running a model: a label for the report and a function from inputs to outputs.

    Attributes:
        label: ``onnxruntime[no-optimizations]``, ``pytorch 2.13.0 float16``, ...
        run: takes an array ``(B, ...)`` (float32 or int64), returns every output as float64 ``(B, ...)``.
        dtype: the dtype the model computes in (``float16``...): it sets the tolerance.
        output_names: names of the outputs when the format has them (ONNX), else None.
        fixed_batch: the batch size the model requires when its batch axis is not dynamic.
        close: drops what the runtime holds (an onnxruntime session and its memory arena); called once its
            checks are done, so that runtimes run one after another do not hold their memory at once. ``run``
            may not be called after it.
    """

    label: str
    run: Run
    dtype: str = "float32"
    output_names: list[str] | None = None
    fixed_batch: int | None = None
    close: Callable[[], None] = lambda: None


class RuntimeUnavailable(Exception):
    """A runtime cannot run an artifact (onnxruntime's CPU provider has no bfloat16 MatMul): not an error of the
    file; the verification says so in a note and runs the artifact elsewhere."""


def torch_runner(model: nn.Module, dtype: torch.dtype, round_to: torch.dtype | None = None) -> Run:
    """Run ``model`` on an array: float inputs rounded to ``round_to`` (when given), then cast to ``dtype``;
    integer ids as they are. Every tensor output (tuples, lists and dicts flattened) comes back as float64."""

    def run(x: np.ndarray) -> list[np.ndarray]:
        t = torch.from_numpy(x)
        if t.is_floating_point():
            t = t.to(round_to).to(dtype) if round_to is not None else t.to(dtype)
        with torch.no_grad():
            out = model(t)
        leaves = torch.utils._pytree.tree_leaves(out)
        return [o.detach().cpu().double().numpy() for o in leaves if isinstance(o, torch.Tensor)]

    return run


def torch_runtime(model: nn.Module, dtype: torch.dtype, what: str, fixed_batch: int | None = None) -> Runtime:
    """``model`` in PyTorch in ``dtype``, labelled ``pytorch <version> <dtype> (<what>)``."""
    name = dtype_name(dtype)
    label = f"pytorch {torch.__version__} {name} ({what})"
    return Runtime(label, torch_runner(model, dtype), name, fixed_batch=fixed_batch)


_ORT_DTYPES = {
    "tensor(float)": (np.float32, "float32"),
    "tensor(float16)": (np.float16, "float16"),
    "tensor(double)": (np.float64, "float64"),
    "tensor(int64)": (np.int64, None),
    "tensor(int32)": (np.int32, None),
    "tensor(bool)": (np.bool_, None),
}
_ORT_OUTPUT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}
_ORT_OUTPUT_DTYPES["tensor(bfloat16)"] = "bfloat16"


def onnx_runtimes(path: Path, several: bool = False) -> list[Runtime]:
    """onnxruntime on CPU with graph optimisations disabled and fully enabled (an optimiser can change numbers).

    Each ``run`` casts the input to the model's input type and returns every output as float64. With ``several``
    a model may have several inputs; its ``run`` then takes a dict of arrays by input name (``Inputs``).

    Raises:
        RuntimeUnavailable: onnxruntime cannot create a session for it (e.g. bfloat16 ops its CPU provider lacks).
        InputError: the model has more than one input, or an input type slabconv cannot feed.
    """
    import onnxruntime as ort

    runtimes: list[Runtime] = []
    for label, level in (
        ("no-optimizations", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        ("all-optimizations", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise RuntimeUnavailable(f"onnxruntime cannot run {path.name}: {first_line(err, 160)}") from None
        inputs = session.get_inputs()
        if len(inputs) != 1 and not several:
            raise InputError(f"{path}: the model has {len(inputs)} inputs; slabconv verifies models with one input")
        types = {}
        for port in inputs:
            found = _ORT_DTYPES.get(port.type)
            if found is None:
                raise InputError(f"{path}: input type {port.type} is not supported (float32, float16, float64, int64)")
            types[port.name] = found[0]
        outputs = session.get_outputs()
        dtype = _ORT_OUTPUT_DTYPES.get(outputs[0].type, "float32") if outputs else "float32"
        batch = inputs[0].shape[0] if inputs[0].shape else None

        held = [session]  # emptied by close(): the session (and its arena) is freed once its checks are done

        def run(x: Inputs, s: list[Any] = held, t: dict[str, Any] = types) -> list[np.ndarray]:
            feed = x if isinstance(x, dict) else {next(iter(t)): x}
            fed = {n: np.asarray(a).astype(t[n], copy=False) for n, a in feed.items()}
            return [np.asarray(o, dtype=np.float64) for o in s[0].run(None, fed)]

        runtimes.append(
            Runtime(
                label=f"onnxruntime[{label}]",
                run=run,
                dtype=dtype,
                output_names=[o.name for o in outputs],
                fixed_batch=batch if isinstance(batch, int) and batch > 0 else None,
                close=held.clear,
            )
        )
        del session
    return runtimes


RUNTIME_NAMES = ("onnxruntime", "pytorch", "openvino")
"""What ``verify --runtime`` takes (``VerifyOptions(runtimes=...)``): the runtimes that run a candidate."""

OPENVINO_INSTALL = "pip install openvino"


def runtime_kind(runtime: Runtime) -> str:
    """``onnxruntime``, ``pytorch`` or ``openvino``: the name ``--runtime`` uses for ``runtime``."""
    return next((name for name in RUNTIME_NAMES if runtime.label.startswith(name)), runtime.label)


def check_runtime_names(names: tuple[str, ...] | None) -> None:
    """Refuse, before any work, a runtime name slabconv does not know or one that is not installed.

    Raises:
        UsageError: an unknown name (the known ones listed), or ``openvino`` without the package (the install line).
    """
    import importlib.util

    from slabconv.errors import UsageError

    for name in names or ():
        if name not in RUNTIME_NAMES:
            raise UsageError(f"--runtime {name}: choose from {', '.join(RUNTIME_NAMES)}")
        if name == "openvino" and importlib.util.find_spec("openvino") is None:
            raise UsageError(f"--runtime openvino: OpenVINO is not installed; {OPENVINO_INSTALL}")


_OV_PRECISIONS = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}
_WIDTH = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}


def openvino_runtime(path: Path, device: str = "CPU") -> Runtime:
    """The ``.onnx`` at ``path`` compiled by OpenVINO for ``device`` with its default settings, as deployed.

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
    file_dtype = dtype_name(compiled.outputs[0].get_element_type().to_dtype()) if compiled.outputs else "float32"
    dtype = min((ran, file_dtype), key=lambda d: _WIDTH.get(d, 2))
    np_dtype = port.get_element_type().to_dtype()
    request = compiled.create_infer_request()

    def run(x: np.ndarray) -> list[np.ndarray]:
        results = request.infer({0: x.astype(np_dtype, copy=False)})
        return [np.asarray(results[out], dtype=np.float64) for out in compiled.outputs]

    shape = port.get_partial_shape()
    batch = shape[0].get_length() if shape.rank.is_static and shape[0].is_static else None
    return Runtime(
        label=f"openvino {ov.__version__} {device} (inference precision {ran})",
        run=run,
        dtype=dtype,
        output_names=[out.get_any_name() for out in compiled.outputs],
        fixed_batch=batch,
    )


def select_runtimes(
    runtimes: list[Runtime], names: tuple[str, ...], onnx_path: Path | None, what: Path
) -> list[Runtime]:
    """The runtimes ``names`` asks for, in that order: those of ``runtimes`` of each kind, and OpenVINO on
    ``onnx_path``.

    Raises:
        UsageError: a runtime that cannot run ``what`` (a PyTorch run of an ``.onnx``, an ONNX runtime for a
            checkpoint without an ``.onnx``), or an OpenVINO that cannot compile it.
    """
    from slabconv.errors import UsageError

    chosen: list[Runtime] = []
    for name in dict.fromkeys(names):
        if name == "openvino":
            if onnx_path is None:
                raise UsageError(f"--runtime openvino runs an .onnx file, and {what} has none; give the .onnx")
            try:
                chosen.append(openvino_runtime(onnx_path))
            except RuntimeUnavailable as err:
                raise UsageError(f"--runtime openvino: {err}") from None
            continue
        found = [rt for rt in runtimes if runtime_kind(rt) == name]
        if not found:
            have = ", ".join(dict.fromkeys(runtime_kind(rt) for rt in runtimes)) or "none"
            raise UsageError(f"--runtime {name} cannot run {what} (runtimes that can: {have}); choose one of those")
        chosen += found
    return chosen


def samples_of(inputs: Inputs) -> int:
    """The number of samples ``N`` of ``inputs`` (every array of a dict has the same)."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)


def take(inputs: Inputs, start: int, stop: int) -> Inputs:
    """Samples ``start:stop`` of ``inputs``."""
    if isinstance(inputs, dict):
        return {name: a[start:stop] for name, a in inputs.items()}
    return inputs[start:stop]


def _chunk(inputs: Inputs, start: int, step: int, fixed_batch: int | None) -> tuple[Inputs, int]:
    def one(a: np.ndarray) -> np.ndarray:
        chunk = a[start : start + step]
        if fixed_batch and len(chunk) < fixed_batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], fixed_batch - len(chunk), axis=0)])
        return np.ascontiguousarray(chunk)

    n = min(step, samples_of(inputs) - start)
    return ({k: one(a) for k, a in inputs.items()} if isinstance(inputs, dict) else one(inputs)), n


def run_batched(run: Run, inputs: Inputs, batch: int = 16, fixed_batch: int | None = None) -> list[np.ndarray]:
    """Run ``run`` over ``inputs`` (an array, or a dict of arrays by input name) in chunks of ``batch`` samples
    (or exactly ``fixed_batch``, padding the last chunk with copies of its first sample and dropping their
    outputs) and stack each output over the chunks."""
    step = fixed_batch or batch
    chunks: list[list[np.ndarray]] = []
    for start in range(0, samples_of(inputs), step):
        chunk, n = _chunk(inputs, start, step, fixed_batch)
        chunks.append([np.asarray(o)[:n] for o in run(chunk)])
    return [np.concatenate(parts) for parts in zip(*chunks, strict=True)]


def onnxruntime_version() -> str:
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__}"
