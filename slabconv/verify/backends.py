"""The runtime table (``BACKENDS``): every way of running a model, by the name ``verify --runtime`` and ``bench
--runtime`` take, for both accuracy (question 2) and timing.

This module imports neither torch nor numpy nor any runtime: the command line reads the names for its ``--help``
and its shell completion from here, and both stay instant. An entry names its opener, a function of
``slabconv.verify.runtimes`` (where the runners live), and ``Backend.open`` imports that module on first use.
A new backend is one entry here, its opener there, and its case in ``tests/test_backends.py``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slabconv.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from slabconv.verify.runtimes import Runtime


@dataclass(frozen=True)
class Backend:
    """One entry of ``BACKENDS``: a runtime, chosen by name, that runs a model for accuracy and for timing.

    Attributes:
        name: what ``--runtime`` calls it.
        framework: ``pytorch`` (runs an ``nn.Module``), ``onnxruntime`` or ``openvino`` (run an ``.onnx`` file).
        opener: the name of a function of ``slabconv.verify.runtimes``, ``opener(backend, artifact, **how) ->
            list[Runtime]`` (``Backend.open``).
        device: ``cpu`` or ``cuda``.
        dtype_name: the dtype ``bench`` traces and exports the model in for it (``float32``, ``float16``);
            ``dtype`` is the torch dtype.
        cuda_graphs: PyTorch captures the call once in a CUDA graph and replays it (timing).
        commands: the commands whose ``--runtime`` takes it (``verify``, ``bench``).
        opt_in: ``verify`` runs it only when ``--runtime`` names it (on the candidate's ``.onnx``).
        package: the Python module it needs, and ``missing``: what to say when that is not installed.
        quantized: it quantizes the ``.onnx`` it opens to int8, calibrated on the inputs ``open`` is given
            (``calibration=``); ``verify`` judges it with the int8 check of both sides
            (``slabconv.verify.int8``), not question 2.
    """

    name: str
    framework: str
    opener: str
    device: str = "cpu"
    dtype_name: str = "float32"
    cuda_graphs: bool = False
    commands: tuple[str, ...] = ("verify", "bench")
    opt_in: bool = False
    package: str = ""
    missing: str = ""
    quantized: bool = False

    @property
    def takes(self) -> str:
        """``module`` (an ``nn.Module`` or ``GraphModule``) or ``onnx`` (an ``.onnx`` path): what ``open`` takes."""
        return "module" if self.framework == "pytorch" else "onnx"

    @property
    def dtype(self) -> torch.dtype:
        """``dtype_name`` as a ``torch.dtype``."""
        import torch

        dtype = getattr(torch, self.dtype_name)
        assert isinstance(dtype, torch.dtype), self.dtype_name
        return dtype

    def open(self, artifact: Any, **how: Any) -> list[Runtime]:
        """The runtimes of ``artifact`` here (see each opener for ``how``: ``dtype``, ``what``, ``fixed_batch``,
        ``several``, ``levels``).

        Raises:
            RuntimeUnavailable: the backend cannot run this artifact.
            InputError: an input it cannot feed.
        """
        from slabconv.verify import runtimes

        opened: list[Runtime] = getattr(runtimes, self.opener)(self, artifact, **how)
        return opened

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine (with what to install), or None when it can."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return self.missing or f"{self.package} is not installed"
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                return "no CUDA device (torch.cuda.is_available() is False)"
        if self.framework == "onnxruntime" and self.device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
        return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("pytorch", "pytorch", "open_torch"),
        Backend("onnxruntime", "onnxruntime", "open_onnxruntime", package="onnxruntime"),
        Backend("pytorch-cuda", "pytorch", "open_torch", "cuda", commands=("bench",)),
        Backend("pytorch-cuda-fp16", "pytorch", "open_torch", "cuda", "float16", commands=("bench",)),
        Backend("pytorch-cuda-graphs-fp16", "pytorch", "open_torch", "cuda", "float16", True, commands=("bench",)),
        Backend(
            "onnxruntime-cuda", "onnxruntime", "open_onnxruntime", "cuda", commands=("bench",), package="onnxruntime"
        ),
        Backend(
            "onnxruntime-cuda-fp16",
            "onnxruntime",
            "open_onnxruntime",
            "cuda",
            "float16",
            commands=("bench",),
            package="onnxruntime",
        ),
        Backend(
            "openvino",
            "openvino",
            "open_openvino",
            commands=("verify",),
            opt_in=True,
            package="openvino",
            missing="OpenVINO is not installed; pip install openvino",
        ),
        Backend(
            "onnxruntime-int8",
            "onnxruntime",
            "open_onnxruntime_int8",
            commands=("verify", "bench"),
            opt_in=True,
            package="onnxruntime",
            quantized=True,
        ),
    )
}
"""Every runtime, by name: the one table ``verify --runtime`` and ``bench --runtime`` choose from."""


def backend_names(command: str) -> tuple[str, ...]:
    """The names ``command``'s ``--runtime`` takes. ``bench``: in table order. ``verify``: the runtimes it runs by
    default in the order it runs them (the ``.onnx`` file's, then PyTorch), then the opt-in ones."""
    chosen = [b for b in BACKENDS.values() if command in b.commands]
    if command == "verify":
        chosen.sort(key=lambda b: (b.opt_in, b.takes != "onnx"))
    return tuple(b.name for b in chosen)


RUNTIME_NAMES = backend_names("verify")
"""What ``verify --runtime`` takes (``VerifyOptions(runtimes=...)``): the runtimes that run a candidate."""


def check_runtime_names(names: tuple[str, ...] | None, calibration: Path | None = None) -> None:
    """Refuse, before any work, a runtime name ``verify`` does not take or one that is not installed, and a
    ``calibration`` file (``--calibration``) without a runtime that quantizes.

    Raises:
        UsageError: an unknown name (the known ones listed), a runtime without its package (the install line), or
            ``--calibration`` without ``--runtime onnxruntime-int8``.
    """
    for name in names or ():
        if name not in RUNTIME_NAMES:
            raise UsageError(f"--runtime {name}: choose from {', '.join(RUNTIME_NAMES)}")
        reason = BACKENDS[name].unavailable()
        if reason is not None:
            raise UsageError(f"--runtime {name}: {reason}")
    if calibration is not None and not any(BACKENDS[n].quantized for n in names or ()):
        raise UsageError("--calibration calibrates an int8 runtime; add --runtime onnxruntime-int8")
