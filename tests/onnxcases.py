"""Small hand-built ONNX originals and the ways a hostile file can break them (``tests/test_hostile_onnx.py``,
``tests/test_fuzz.py``).

The base model is ``x (batch, 8) -> BatchNormalization -> MatMul -> Add(bias from a Constant node) -> y``: the
norm folds forward into the MatMul, so a fold, a verification and every reader of an ONNX file (onnx, onnx-ir,
onnxruntime) run on it in a fraction of a second. ``three_folds_model`` has a norm folded each way (backward, forward
into a conv, forward into a MatMul), for the localisation of a failure (``tests/test_verify_sides.py``). Built with
``onnx.helper``; no exporter runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

C = 8


def base_model(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """The base model: one BatchNormalization folded forward into a MatMul whose bias a ``Constant`` node holds."""
    rng = np.random.default_rng(seed)

    def f32(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.float32)

    inits = [
        numpy_helper.from_array(f32(rng.random(C) + 0.5), "bn.scale"),
        numpy_helper.from_array(f32(rng.standard_normal(C)), "bn.bias"),
        numpy_helper.from_array(f32(rng.standard_normal(C)), "bn.mean"),
        numpy_helper.from_array(f32(rng.random(C) + 0.5), "bn.var"),
        numpy_helper.from_array(f32(rng.standard_normal((C, C))), "fc.weight"),
    ]
    bias = numpy_helper.from_array(f32(rng.standard_normal(C)), "fc.bias_value")
    nodes = [
        helper.make_node("BatchNormalization", ["x", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n"], name="bn"),
        helper.make_node("MatMul", ["n", "fc.weight"], ["m"], name="fc"),
        helper.make_node("Constant", [], ["fc.bias"], value=bias, name="bias_const"),
        helper.make_node("Add", ["m", "fc.bias"], ["y"], name="fc_add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", C])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", C])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="hand")


def three_folds_model(seed: int = 0) -> onnx.ModelProto:
    """Three BatchNormalizations that fold three ways (node names ``/<module>/<Op>``, as the TorchScript exporter
    writes them, so the norms and layers are named as a checkpoint names them)::

        x (batch, 3, 4, 4) -> Conv conv1 (bias) -> bn1 -> Relu -> bn2 -> Conv conv2 (no bias) -> Relu -> Flatten
          -> bn3 -> MatMul fc (no bias) -> y (batch, 6)

    ``bn1`` folds backward into ``conv1`` (the Relu after it blocks the forward path), ``bn2`` forward into
    ``conv2`` (a created bias, the Conv's third input ``conv2.bias``), ``bn3`` forward into ``fc`` (a created bias
    ``Add`` whose output is the graph output ``y``)."""
    rng = np.random.default_rng(seed)
    inits: list[TensorProto] = []

    def tensor(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def bn(name: str, c: int) -> list[str]:
        return [tensor(f"{name}.weight", rng.random(c) + 0.5), tensor(f"{name}.bias", rng.standard_normal(c)),
                tensor(f"{name}.running_mean", rng.standard_normal(c)),
                tensor(f"{name}.running_var", rng.random(c) + 0.5)]  # fmt: skip

    def node(op: str, inputs: list[str], output: str, module: str) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=f"/{module}/{op}")

    conv1 = [
        tensor("conv1.weight", rng.standard_normal((4, 3, 3, 3)) * 0.3),
        tensor("conv1.bias", rng.standard_normal(4)),
    ]
    nodes = [
        node("Conv", ["x", *conv1], "c1", "conv1"),
        node("BatchNormalization", ["c1", *bn("bn1", 4)], "n1", "bn1"),
        node("Relu", ["n1"], "r1", "relu1"),
        node("BatchNormalization", ["r1", *bn("bn2", 4)], "n2", "bn2"),
        node("Conv", ["n2", tensor("conv2.weight", rng.standard_normal((5, 4, 1, 1)) * 0.5)], "c2", "conv2"),
        node("Relu", ["c2"], "r2", "relu2"),
        node("Flatten", ["r2"], "f", "flatten"),
        node("BatchNormalization", ["f", *bn("bn3", 20)], "n3", "bn3"),
        node("MatMul", ["n3", tensor("fc.weight", rng.standard_normal((20, 6)) * 0.3)], "y", "fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "three_folds",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="hand")


def initializer(model: onnx.ModelProto, name: str) -> TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def constant_tensor(model: onnx.ModelProto) -> TensorProto:
    """The tensor the base model's ``Constant`` node holds (the MatMul's bias)."""
    node = next(n for n in model.graph.node if n.op_type == "Constant")
    return node.attribute[0].t


def externalize(tensor: TensorProto, folder: Path, location: str, offset: int = 0) -> None:
    """Move ``tensor``'s data into the file ``folder/location`` at ``offset`` (appended when the file exists) and
    point the tensor at it, as ``onnx.save_model(save_as_external_data=True)`` does for initializers."""
    data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
    target = folder / location
    start = target.stat().st_size if target.exists() else offset
    with open(target, "ab") as f:
        f.write(b"\0" * max(0, start - (target.stat().st_size if target.exists() else 0)))
        f.write(data)
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data"):
        tensor.ClearField(field)
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(start)), ("length", str(len(data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def set_external(tensor: TensorProto, **fields: str) -> None:
    """Overwrite (or add) ``external_data`` entries of ``tensor``."""
    for key, value in fields.items():
        entry = next((e for e in tensor.external_data if e.key == key), None) or tensor.external_data.add()
        entry.key, entry.value = key, value


def save(model: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> Path:
    """Write ``model`` to ``folder/name`` as it is (no checker, no external data conversion)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def external_model(folder: Path, constant_too: bool = True) -> tuple[onnx.ModelProto, Path]:
    """The base model with every initializer (and the Constant's tensor) in ``folder/model.onnx.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    model = base_model()
    for tensor in model.graph.initializer:
        externalize(tensor, folder, "model.onnx.data")
    if constant_too:
        externalize(constant_tensor(model), folder, "model.onnx.data")
    return model, save(model, folder)


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@contextlib.contextmanager
def watched_fifos(folder: Path) -> Iterator[list[str]]:
    """While active, every FIFO under ``folder`` is polled for a reader: one that opened it is recorded and let go
    (a writer opens and closes the FIFO, so the read ends with nothing instead of blocking forever)."""
    fifos = [p for p in folder.rglob("*") if p.is_fifo()]
    opened: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for fifo in fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless a reader has it open
                except OSError:
                    continue
                opened.append(fifo.name)
                os.close(fd)
            stop.wait(0.01)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        stop.set()
        thread.join()


def nudge_initializer(path: Path, value: np.ndarray | None = None) -> str:
    """Raise element 0 of one float32 initializer of the ``.onnx`` at ``path`` by one unit in the last place, in
    place: the one equal to ``value`` (an exporter stores a Linear weight transposed under a generated name: pass
    the weight transposed), else the first 2-D one. Returns its name."""
    model = onnx.load(str(path))
    if value is None:
        init = next(t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) == 2)
    else:
        [init] = [t for t in model.graph.initializer if np.array_equal(numpy_helper.to_array(t), value)]
    array = numpy_helper.to_array(init).copy()
    array.flat[0] = np.nextafter(array.flat[0], np.float32(np.inf))
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    onnx.save(model, str(path))
    return init.name
