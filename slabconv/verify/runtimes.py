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

Run = Callable[[np.ndarray], list[np.ndarray]]


@dataclass
class Runtime:
    """One way of running a model: a label for the report and a function from inputs to outputs.

    Attributes:
        label: ``onnxruntime[no-optimizations]``, ``pytorch 2.13.0 float16``, ...
        run: takes an array ``(B, ...)`` (float32 or int64), returns every output as float64 ``(B, ...)``.
        dtype: the dtype the model computes in (``float16``...): it sets the tolerance.
        output_names: names of the outputs when the format has them (ONNX), else None.
        fixed_batch: the batch size the model requires when its batch axis is not dynamic.
    """

    label: str
    run: Run
    dtype: str = "float32"
    output_names: list[str] | None = None
    fixed_batch: int | None = None


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
}
_ORT_OUTPUT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}
_ORT_OUTPUT_DTYPES["tensor(bfloat16)"] = "bfloat16"


def onnx_runtimes(path: Path) -> list[Runtime]:
    """onnxruntime on CPU with graph optimisations disabled and fully enabled (an optimiser can change numbers).

    Each ``run`` casts the input to the model's input type and returns every output as float64.

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
        if len(inputs) != 1:
            raise InputError(f"{path}: the model has {len(inputs)} inputs; slabconv verifies models with one input")
        found = _ORT_DTYPES.get(inputs[0].type)
        if found is None:
            raise InputError(f"{path}: input type {inputs[0].type} is not supported (float32, float16, float64, int64)")
        np_dtype = found[0]
        outputs = session.get_outputs()
        dtype = _ORT_OUTPUT_DTYPES.get(outputs[0].type, "float32") if outputs else "float32"
        batch = inputs[0].shape[0] if inputs[0].shape else None

        def run(x: np.ndarray, s: Any = session, n: str = inputs[0].name, d: Any = np_dtype) -> list[np.ndarray]:
            return [np.asarray(o, dtype=np.float64) for o in s.run(None, {n: x.astype(d, copy=False)})]

        runtimes.append(
            Runtime(
                label=f"onnxruntime[{label}]",
                run=run,
                dtype=dtype,
                output_names=[o.name for o in outputs],
                fixed_batch=batch if isinstance(batch, int) and batch > 0 else None,
            )
        )
    return runtimes


def run_batched(run: Run, inputs: np.ndarray, batch: int = 16, fixed_batch: int | None = None) -> list[np.ndarray]:
    """Run ``run`` over ``inputs`` in chunks of ``batch`` samples (or exactly ``fixed_batch``, padding the last
    chunk with copies of its first sample and dropping their outputs) and stack each output over the chunks."""
    step = fixed_batch or batch
    chunks: list[list[np.ndarray]] = []
    for start in range(0, len(inputs), step):
        chunk = inputs[start : start + step]
        n = len(chunk)
        if fixed_batch and n < fixed_batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], fixed_batch - n, axis=0)])
        chunks.append([np.asarray(o)[:n] for o in run(np.ascontiguousarray(chunk))])
    return [np.concatenate(parts) for parts in zip(*chunks, strict=True)]


def onnxruntime_version() -> str:
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__}"
