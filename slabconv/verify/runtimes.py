"""Ways of running a model on an array of inputs: PyTorch, onnxruntime (optimisations off and on), in chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slabconv.errors import InputError, first_line

Run = Callable[[np.ndarray], list[np.ndarray]]


@dataclass
class Runtime:
    """One way of running a model: a label for the report and a function from inputs to outputs.

    Attributes:
        label: ``onnxruntime[no-optimizations]``, ``pytorch 2.13.0``, ...
        run: takes a float32 array ``(B, ...)``, returns every output as a numpy array ``(B, ...)``.
        output_names: names of the outputs when the format has them (ONNX), else None.
        fixed_batch: the batch size the model requires when its batch axis is not dynamic.
    """

    label: str
    run: Run
    output_names: list[str] | None = None
    fixed_batch: int | None = None


def torch_runner(model: nn.Module, dtype: torch.dtype) -> Run:
    """Run ``model`` on an array (float inputs cast to ``dtype``, integer ids as they are), returning every
    tensor output (tuples, lists and dicts flattened)."""

    def run(x: np.ndarray) -> list[np.ndarray]:
        t = torch.from_numpy(x)
        with torch.no_grad():
            out = model(t.to(dtype) if t.is_floating_point() else t)
        leaves = torch.utils._pytree.tree_leaves(out)
        return [t.detach().float().cpu().numpy() for t in leaves if isinstance(t, torch.Tensor)]

    return run


_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
}


def onnx_runtimes(path: Path) -> list[Runtime]:
    """onnxruntime on CPU with graph optimisations disabled and fully enabled (an optimiser can change numbers).

    Each ``run`` casts the input to the model's input type and returns every output.

    Raises:
        InputError: onnxruntime cannot load the file or the model has more than one input.
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
            raise InputError(f"{path}: onnxruntime cannot load it ({first_line(err)})") from None
        inputs = session.get_inputs()
        if len(inputs) != 1:
            raise InputError(f"{path}: the model has {len(inputs)} inputs; slabconv verifies models with one input")
        dtype = _ORT_DTYPES.get(inputs[0].type)
        if dtype is None:
            raise InputError(f"{path}: input type {inputs[0].type} is not supported (float32, float16, float64)")
        batch = inputs[0].shape[0] if inputs[0].shape else None
        runtimes.append(
            Runtime(
                label=f"onnxruntime[{label}]",
                run=lambda x, s=session, n=inputs[0].name, d=dtype: [  # type: ignore[misc]
                    np.asarray(o) for o in s.run(None, {n: x.astype(d, copy=False)})
                ],
                output_names=[o.name for o in session.get_outputs()],
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
