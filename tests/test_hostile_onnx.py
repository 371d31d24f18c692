"""Hostile ONNX originals (issue 37): every one ends as one line naming the file, exit 2, with nothing run and
nothing left behind; none makes slabconv hang on a FIFO or allocate what a header declares.

Each case edits the small hand-built model of ``tests/onnxcases.py`` one way and runs ``slabconv fuse`` on it
(the door that reads the file with onnx, onnx-ir and onnxruntime). The FIFOs a case makes are watched: a reader
that opens one is let go at once (a writer comes and goes) and recorded, so a regression fails instead of hanging.
Each message must be one documented in ``docs/errors.md``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.errors import InputError
from slabconv.load import onnx_file
from tests import onnxcases as oc
from tests.errordoc import documented
from tests.tinyckpt import snapshot

runner = CliRunner()


def _replace(model: onnx.ModelProto, name: str, tensor: TensorProto) -> None:
    tensor.name = name
    oc.initializer(model, name).CopyFrom(tensor)


def _bn_attribute(model: onnx.ModelProto, attribute: onnx.AttributeProto) -> None:
    model.graph.node[0].attribute.append(attribute)


# --------------------------------------------------------------------------------------------- external data


def offset_past_the_end(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), offset="999999")
    return oc.save(m, d)


def negative_offset(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), offset="-16")
    return oc.save(m, d)


def offset_not_a_number(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), offset="0x10")
    return oc.save(m, d)


def length_too_short(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), length="16")
    return oc.save(m, d)


def length_of_4_gb(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "bn.var"), length=str(4 << 30))
    return oc.save(m, d)


def location_with_a_nul(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), location="model.onnx.data\0.txt")
    return oc.save(m, d)


def location_of_5000_characters(d: Path) -> Path:
    m, _ = oc.external_model(d)
    oc.set_external(oc.initializer(m, "fc.weight"), location="a" * 5000)
    return oc.save(m, d)


def constant_outside_the_folder(d: Path) -> Path:
    m, _ = oc.external_model(d, constant_too=False)
    tensor = oc.constant_tensor(m)
    oc.externalize(tensor, d, "bias.bin")
    shutil.copy(d / "bias.bin", d.parent / "bias.bin")
    oc.set_external(tensor, location="../bias.bin")
    return oc.save(m, d)


def constant_in_a_fifo(d: Path) -> Path:
    m, _ = oc.external_model(d, constant_too=False)
    oc.externalize(oc.constant_tensor(m), d, "bias.bin")
    (d / "bias.bin").unlink()
    oc.fifo(d / "bias.bin")
    return oc.save(m, d)


def subgraph_constant_in_a_fifo(d: Path) -> Path:
    m, _ = oc.external_model(d)
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [1.0])
    oc.externalize(k, d, "k.bin")
    (d / "k.bin").unlink()
    oc.fifo(d / "k.bin")
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["o"], value=k)], "b", [], [helper.make_tensor_value_info("o", 1, [1])]
    )
    m.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch, name="if"))
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    return oc.save(m, d)


def sparse_initializer_in_a_fifo(d: Path) -> Path:
    m, _ = oc.external_model(d)
    values = helper.make_tensor("sparse", TensorProto.FLOAT, [1], [1.0])
    oc.externalize(values, d, "s.bin")
    (d / "s.bin").unlink()
    oc.fifo(d / "s.bin")
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(values, helper.make_tensor("i", 7, [1], [0]), [4]))
    return oc.save(m, d)


def function_constant_in_a_fifo(d: Path) -> Path:
    m, _ = oc.external_model(d)
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [1.0])
    oc.externalize(k, d, "k.bin")
    (d / "k.bin").unlink()
    oc.fifo(d / "k.bin")
    body = [helper.make_node("Constant", [], ["o"], value=k)]
    m.functions.append(helper.make_function("local", "F", [], ["o"], body, [helper.make_opsetid("", 17)]))
    m.opset_import.append(helper.make_opsetid("local", 1))
    return oc.save(m, d)


def function_bomb(d: Path) -> Path:
    """30 model-local functions, each calling the one before twice: 1.7 kB on disk, 2^29 nodes inlined (onnx's own
    strict shape inference, which inlines them, ran for minutes without end)."""
    d.mkdir(parents=True, exist_ok=True)
    local = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    functions = [helper.make_function("local", "F0", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])], local)]
    for i in range(1, 30):
        body = [helper.make_node(f"F{i - 1}", ["x"], ["t"], domain="local"),
                helper.make_node(f"F{i - 1}", ["t"], ["y"], domain="local")]  # fmt: skip
        functions.append(helper.make_function("local", f"F{i}", ["x"], ["y"], body, local))
    info = helper.make_tensor_value_info
    call = helper.make_node("F29", ["x"], ["y"], domain="local", name="call")
    x, y = info("x", TensorProto.FLOAT, [2, 3]), info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([call], "g", [x], [y])
    return oc.save(helper.make_model(graph, opset_imports=local, functions=functions), d)


def data_file_is_a_link(d: Path) -> Path:
    _, path = oc.external_model(d)
    (d / "model.onnx.data").rename(d.parent / "elsewhere.data")
    os.symlink(d.parent / "elsewhere.data", d / "model.onnx.data")
    return path


def external_without_a_location(d: Path) -> Path:
    m = oc.base_model()
    tensor = oc.initializer(m, "fc.weight")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    return oc.save(m, d)


# --------------------------------------------------------------------------------------------- sizes and dtypes


def raw_data_shorter_than_its_dims(d: Path) -> Path:
    m = oc.base_model()
    tensor = oc.initializer(m, "fc.weight")
    tensor.raw_data = tensor.raw_data[:40]
    return oc.save(m, d)


def values_fewer_than_its_dims(d: Path) -> Path:
    m = oc.base_model()
    tensor = oc.initializer(m, "fc.weight")
    tensor.ClearField("raw_data")
    tensor.float_data.extend([1.0] * 3)
    return oc.save(m, d)


def dims_overflow_int64(d: Path) -> Path:
    m = oc.base_model()
    tensor = oc.initializer(m, "fc.weight")
    del tensor.dims[:]
    tensor.dims.extend([2**40, 2**40])
    return oc.save(m, d)


def negative_dims(d: Path) -> Path:
    m = oc.base_model()
    tensor = oc.initializer(m, "fc.weight")
    del tensor.dims[:]
    tensor.dims.extend([-8, -8])
    return oc.save(m, d)


def declares_2_gib(d: Path) -> Path:
    m, _ = oc.external_model(d)
    tensor = oc.initializer(m, "fc.weight")
    del tensor.dims[:]
    tensor.dims.extend([1 << 14, 1 << 15])
    oc.set_external(tensor, length=str(1 << 31))
    return oc.save(m, d)


def sparse_dense_shape_of_a_petabyte(d: Path) -> Path:
    m = oc.base_model()
    values = helper.make_tensor("sparse", TensorProto.FLOAT, [1], [1.0])
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(values, helper.make_tensor("i", 7, [1], [0]), [2**48]))
    return oc.save(m, d)


def string_scale(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.scale", helper.make_tensor("", TensorProto.STRING, [oc.C], [b"a"] * oc.C))
    return oc.save(m, d)


def int4_scale(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.scale", helper.make_tensor("", TensorProto.INT4, [oc.C], [1] * oc.C))
    return oc.save(m, d)


def complex_variance(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.var", numpy_helper.from_array(np.ones(oc.C, np.complex64)))
    return oc.save(m, d)


def float8_variance(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.var", helper.make_tensor("", TensorProto.FLOAT8E4M3FN, [oc.C], [1.0] * oc.C))
    return oc.save(m, d)


def unknown_data_type(d: Path) -> Path:
    m = oc.base_model()
    oc.initializer(m, "fc.weight").data_type = 99
    return oc.save(m, d)


# --------------------------------------------------------------------------------------------- the graph


def batchnorm_spatial_0(d: Path) -> Path:
    m = oc.base_model(opset=8)
    _bn_attribute(m, helper.make_attribute("spatial", 0))
    return oc.save(m, d)


def statistics_of_mismatched_lengths(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.mean", numpy_helper.from_array(np.zeros(oc.C - 1, np.float32)))
    return oc.save(m, d)


def batchnorm_with_three_inputs(d: Path) -> Path:
    m = oc.base_model()
    del m.graph.node[0].input[3:]
    return oc.save(m, d)


def string_epsilon(d: Path) -> Path:
    m = oc.base_model()
    _bn_attribute(m, helper.make_attribute("epsilon", "1e-5"))
    return oc.save(m, d)


def sequence_typed_input(d: Path) -> Path:
    m = oc.base_model()
    element = helper.make_tensor_type_proto(TensorProto.FLOAT, ["batch", oc.C])
    m.graph.input[0].type.CopyFrom(helper.make_sequence_type_proto(element))
    return oc.save(m, d)


def output_no_node_makes(d: Path) -> Path:
    m = oc.base_model()
    m.graph.output.append(helper.make_tensor_value_info("ghost", TensorProto.FLOAT, [1]))
    return oc.save(m, d)


def truncated_protobuf(d: Path) -> Path:
    path = oc.save(oc.base_model(), d)
    path.write_bytes(path.read_bytes()[:200])
    return path


CASES: list[tuple[Callable[[Path], Path], str]] = [
    (offset_past_the_end, "declares 256 bytes but 'model.onnx.data' holds 0 for it"),
    (negative_offset, "offset '-16', which is not a byte count"),
    (offset_not_a_number, "offset '0x10', which is not a byte count"),
    (length_too_short, "declares 256 bytes but its external data length is 16"),
    (length_of_4_gb, "external data length is 4294967296"),
    (location_with_a_nul, "it holds a NUL byte"),
    (location_of_5000_characters, "longer than a file name can be (5000 characters)"),
    (constant_outside_the_folder, "node 'bias_const' (attribute 'value') keeps its data in '../bias.bin'"),
    (constant_in_a_fifo, "keeps its data in 'bias.bin': not a regular file (a FIFO (named pipe))"),
    (subgraph_constant_in_a_fifo, "in a subgraph of node 'if' (attribute 'value') keeps its data in 'k.bin': not a"),
    (sparse_initializer_in_a_fifo, "sparse initializer 'sparse' values keeps its data in 's.bin': not a regular"),
    (function_constant_in_a_fifo, "in function 'F' (attribute 'value') keeps its data in 'k.bin': not a regular"),
    (data_file_is_a_link, "which is not a file inside the model's folder"),
    (external_without_a_location, "keeps its data in '', which names no file"),
    (raw_data_shorter_than_its_dims, "initializer 'fc.weight' declares 256 bytes but holds 40"),
    (values_fewer_than_its_dims, "initializer 'fc.weight' declares 64 values but holds 3"),
    (dims_overflow_int64, "initializer 'fc.weight' (1099511627776x1099511627776 float32) would take"),
    (negative_dims, "initializer 'fc.weight' has a negative size"),
    (declares_2_gib, "(16384x32768 float32) would take 2.0 GiB in memory"),
    (sparse_dense_shape_of_a_petabyte, "values (dense) (281474976710656 float32) would take"),
    (string_scale, "initializer 'bn.scale' is string; slabconv folds"),
    (int4_scale, "initializer 'bn.scale' is int4; slabconv folds"),
    (complex_variance, "initializer 'bn.var' is complex64; slabconv folds"),
    (float8_variance, "initializer 'bn.var' is float8e4m3fn; slabconv folds"),
    (unknown_data_type, "initializer 'fc.weight' has an unknown data type 99"),
    (batchnorm_spatial_0, "BatchNormalization node 'bn' has spatial=0"),
    (statistics_of_mismatched_lengths, "does not type-check (onnx shape inference"),
    (batchnorm_with_three_inputs, "onnx.checker: Node(bn) with schema(::BatchNormalization:15) has input size 3"),
    (string_epsilon, "onnx.checker: Mismatched attribute type in 'bn : epsilon'"),
    (sequence_typed_input, "does not type-check"),
    (output_no_node_makes, "onnx.checker: Graph output 'ghost' is not an output of any node"),
    (truncated_protobuf, "not a readable ONNX model"),
    (function_bomb, "the graph has 536,870,912 nodes once its model-local functions are inlined (at most 1,000,000)"),
]


@pytest.mark.parametrize("case, phrase", CASES, ids=[c.__name__ for c, _ in CASES])
def test_hostile_onnx_is_one_line_exit_2_and_leaves_nothing(
    case: Callable[[Path], Path], phrase: str, tmp_path: Path
) -> None:
    path = case(tmp_path / "m")
    before = snapshot(tmp_path)
    with oc.watched_fifos(tmp_path) as opened:
        result = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out")])
    lines = result.stderr.strip().splitlines()
    assert not opened, f"a FIFO was opened for reading: {opened}"
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), result.stderr
    assert phrase in lines[0], lines[0]
    assert "internal error" not in lines[0] and result.stdout == ""
    assert documented(lines[0]), f"not in docs/errors.md: {lines[0]}"
    assert snapshot(tmp_path) == before, "a file was written or changed"


VERIFY_DOOR = [constant_in_a_fifo, subgraph_constant_in_a_fifo, length_of_4_gb, complex_variance, sequence_typed_input]


@pytest.mark.parametrize("case", VERIFY_DOOR, ids=[c.__name__ for c in VERIFY_DOOR])
def test_verify_reads_an_onnx_file_through_the_same_checks(case: Callable[[Path], Path], tmp_path: Path) -> None:
    """``verify A.onnx B.onnx`` reads both sides with onnx.checker and onnxruntime: the same tensor and input
    checks come first (a Constant in a FIFO hung the checker; a sequence input was a KeyError)."""
    path = case(tmp_path / "m")
    with oc.watched_fifos(tmp_path) as opened:
        result = runner.invoke(app, ["verify", str(path), str(path)])
    lines = result.stderr.strip().splitlines()
    assert not opened, f"a FIFO was opened for reading: {opened}"
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.stderr)
    assert lines[0].startswith(f"error: {path}: ") and "internal error" not in lines[0], lines[0]
    assert documented(lines[0]), f"not in docs/errors.md: {lines[0]}"


def test_the_unchanged_base_model_folds_with_its_external_data(tmp_path: Path) -> None:
    """The control: the model every case edits folds and verifies, its data inline and in an external file."""
    inline = oc.save(oc.base_model(), tmp_path / "inline")
    _, external = oc.external_model(tmp_path / "external")
    for path in (inline, external):
        result = runner.invoke(app, ["fuse", str(path), "--out", str(path.parent / "out"), "--quiet"])
        assert result.exit_code == 0, result.stderr
        assert "verification PASSED" in result.stdout


# --------------------------------------------------------------------------------------------- damaged norms (lead)


def negative_epsilon(d: Path) -> Path:
    m = oc.base_model()
    _bn_attribute(m, helper.make_attribute("epsilon", -1.0))
    return oc.save(m, d)


def nan_epsilon(d: Path) -> Path:
    m = oc.base_model()
    _bn_attribute(m, helper.make_attribute("epsilon", float("nan")))
    return oc.save(m, d)


def negative_variance(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.var", numpy_helper.from_array(-np.ones(oc.C, np.float32)))
    return oc.save(m, d)


def zero_variance_and_epsilon(d: Path) -> Path:
    m = oc.base_model()
    _replace(m, "bn.var", numpy_helper.from_array(np.zeros(oc.C, np.float32)))
    _bn_attribute(m, helper.make_attribute("epsilon", 0.0))
    return oc.save(m, d)


DAMAGED = [negative_epsilon, nan_epsilon, negative_variance, zero_variance_and_epsilon]


@pytest.mark.parametrize("case", DAMAGED, ids=[c.__name__ for c in DAMAGED])
def test_damaged_batchnorm_parameters_name_the_file_and_the_norm(case: Callable[[Path], Path], tmp_path: Path) -> None:
    path = case(tmp_path / "m")
    result = runner.invoke(app, ["fuse", str(path), "--out", str(tmp_path / "out")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: norm bn: "), lines[0]
    assert "inputs are unusable" not in lines[0]


# --------------------------------------------------------------------------------------------- read once


def test_the_fold_reads_the_bytes_that_were_checked_and_hashed(tmp_path: Path) -> None:
    """External data rewritten after the original was read changes neither the model onnx-ir gets nor its hash."""
    _, path = oc.external_model(tmp_path)
    data = tmp_path / "model.onnx.data"
    original = data.read_bytes()
    info = onnx_file.read_onnx(path)
    data.write_bytes(os.urandom(len(original)))
    model = onnx_file.load_ir(info)
    weight = np.asarray(model.graph.initializers["fc.weight"].const_value.numpy())
    expected = numpy_helper.to_array(oc.initializer(oc.base_model(), "fc.weight"))
    assert np.array_equal(weight, expected)
    import hashlib

    assert info.files_sha256["model.onnx.data"] == hashlib.sha256(original).hexdigest()


def test_external_data_that_shrinks_while_it_is_read_is_named(tmp_path: Path, monkeypatch) -> None:
    """The data file is truncated between its check and its read: one line naming it, not a crash or a fold of
    what is left."""
    _, path = oc.external_model(tmp_path)
    data = tmp_path / "model.onnx.data"
    check_graph = onnx_file._check_graph

    def then_truncate(*args, **kwargs):
        check_graph(*args, **kwargs)
        os.truncate(data, 100)

    monkeypatch.setattr(onnx_file, "_check_graph", then_truncate)
    with pytest.raises(InputError, match=r"'model.onnx.data' changed while slabconv read it \(\d+ bytes when checked"):
        onnx_file.read_onnx(path)
