"""The runtime table (``slabconv.verify.backends.BACKENDS``): one entry per backend serves ``verify`` (accuracy)
and ``bench`` (timing), each command's ``--runtime`` takes the names of its entries, and a runtime's kind is its
entry's name."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from slabconv import bench
from slabconv.cli import app
from slabconv.errors import UsageError
from slabconv.verify import backends as bk
from slabconv.verify import runtimes as rt
from slabconv.verify.policy import tol_dtype

WEIGHT = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
BIAS = np.arange(3, dtype=np.float32)


def _linear(dtype: torch.dtype) -> torch.nn.Module:
    layer = torch.nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(WEIGHT.T.copy()))
        layer.bias.copy_(torch.from_numpy(BIAS))
    return layer.to(dtype).eval()


def _onnx_linear(path, dtype: torch.dtype):
    """``x @ WEIGHT + BIAS`` as an ``.onnx`` file in ``dtype`` (written with onnx.helper: no exporter)."""
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    elem = TensorProto.FLOAT16 if dtype == torch.float16 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", elem, ["N", 4])],
        [helper.make_tensor_value_info("y", elem, ["N", 3])],
        [numpy_helper.from_array(WEIGHT.astype(np_dtype), "w"), numpy_helper.from_array(BIAS.astype(np_dtype), "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("name", list(bk.BACKENDS))
def test_every_backend_runs_for_accuracy_and_for_timing(name, tmp_path):
    """Each entry opens its artifact; its runtimes compute the model within the dtype's tolerance (``run``) and
    time it (``timed``). A new entry is checked here as soon as it is in the table (where this machine runs it)."""
    backend = bk.BACKENDS[name]
    reason = backend.unavailable()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    if backend.takes == "module":
        artifact = _linear(backend.dtype)
    else:
        artifact = _onnx_linear(tmp_path / "linear.onnx", backend.dtype)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    exact = x.astype(np.float64) @ WEIGHT.astype(np.float64) + BIAS
    opened = backend.open(artifact, **({"calibration": x} if backend.quantized else {}))
    assert opened and all(r.kind == name for r in opened)
    for runtime in opened:
        (out,) = runtime.run(x)
        assert out.dtype == np.float64 and out.shape == (5, 3)
        tol = 2 / 127 if backend.quantized else tol_dtype(runtime.dtype) * 10  # int8: steps of range / 127;
        # otherwise the precision the runtime says it ran in (OpenVINO: bfloat16)
        assert np.abs(out - exact).max() <= tol * np.abs(exact).max(), runtime.label
        feed = np.ascontiguousarray(x.astype(np.float16 if backend.dtype == torch.float16 else np.float32))
        call = runtime.timed(feed)
        call()
        call()


def test_openvino_is_fed_and_read_in_the_bfloat16_its_file_declares(tmp_path):
    """A bfloat16 ``.onnx`` gets bfloat16 inputs (OpenVINO's own numpy conversion hands it float16 bits: errors
    near 1 and a wrong top-1) and its bfloat16 outputs are read as bfloat16; the label names the precision."""
    pytest.importorskip("openvino")
    import ml_dtypes

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", 3])],
        [
            numpy_helper.from_array(WEIGHT.astype(ml_dtypes.bfloat16), "w"),
            numpy_helper.from_array(BIAS.astype(ml_dtypes.bfloat16), "b"),
        ],
    )
    path = tmp_path / "bf16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), str(path))
    (runtime,) = bk.BACKENDS["openvino"].open(path)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    exact = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ WEIGHT.astype(ml_dtypes.bfloat16).astype(np.float64)
    exact += BIAS
    (out,) = runtime.run(x)
    assert runtime.dtype == "bfloat16" and "inference precision" in runtime.label
    assert np.abs(out - exact).max() <= 4 * tol_dtype("bfloat16") * np.abs(exact).max()


def test_openvino_feeds_each_input_of_a_model_with_several_by_name(tmp_path):
    """A model with several inputs (``input_ids`` and ``attention_mask``, two merged models) is fed a dict of arrays
    by input name, each in its declared dtype, whatever the dict's order (the first input alone was fed: an
    ``AttributeError`` on the dict)."""
    pytest.importorskip("openvino")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["xw", "kf"], ["y"]),
        ],
        "two_inputs",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["N", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(WEIGHT, "w")],
    )
    path = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    (runtime,) = bk.BACKENDS["openvino"].open(path)
    x = np.random.default_rng(2).standard_normal((5, 4))
    k = np.arange(5).reshape(5, 1)
    (out,) = runtime.run({"k": k, "x": x})
    exact = x.astype(np.float32).astype(np.float64) @ WEIGHT.astype(np.float64) + k
    assert np.abs(out - exact).max() <= 4 * tol_dtype(runtime.dtype) * np.abs(exact).max(), runtime.label


def _help(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    joined = re.sub(r"-\n\s+", "-", result.output)  # a name wrapped after a hyphen reads whole
    return re.sub(r"\s+", " ", joined)


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_each_command_takes_the_names_of_its_entries(command):
    names = bk.backend_names(command)
    text = _help(command)
    for backend in bk.BACKENDS.values():
        listed = re.search(rf"(?<![\w-]){re.escape(backend.name)}(?![\w-])", text) is not None
        assert listed == (command in backend.commands), (command, backend.name)
    assert set(names) == {b.name for b in bk.BACKENDS.values() if command in b.commands}


def test_existing_names_and_orders_are_kept():
    assert bk.RUNTIME_NAMES == ("onnxruntime", "pytorch", "openvino", "onnxruntime-int8")
    assert list(bench.RUNTIMES) == [
        "pytorch",
        "onnxruntime",
        "pytorch-cuda",
        "pytorch-cuda-fp16",
        "pytorch-cuda-graphs-fp16",
        "onnxruntime-cuda",
        "onnxruntime-cuda-fp16",
        "onnxruntime-int8",
    ]
    assert "onnxruntime-int8" not in bench.default_runtimes()  # opt-in: timed only when named
    assert all(bench.RUNTIMES[n] is bk.BACKENDS[n] for n in bench.RUNTIMES)  # one table, not two


def test_every_entry_names_an_opener_of_the_runners():
    """An entry names its opener (the table imports no runtime); a misspelt name would fail only on a machine
    that has the backend (CUDA), so each is looked up here."""
    for backend in bk.BACKENDS.values():
        assert callable(getattr(rt, backend.opener, None)), (backend.name, backend.opener)
        assert backend.dtype in (torch.float32, torch.float16), backend.name


def test_a_missing_package_is_named_with_its_install_line(monkeypatch):
    missing = bk.Backend("fake", "onnxruntime", bk.BACKENDS["onnxruntime"].opener, package="no_such_module_xyz")
    assert missing.unavailable() == "no_such_module_xyz is not installed"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"^--runtime openvino: OpenVINO is not installed; pip install openvino$"):
        bk.check_runtime_names(("openvino",))
    with pytest.raises(UsageError, match="choose from onnxruntime, pytorch, openvino, onnxruntime-int8"):
        bk.check_runtime_names(("pytorch-cuda",))  # a bench runtime verify does not take
