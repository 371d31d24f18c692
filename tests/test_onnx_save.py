"""``write.onnx.save_onnx``: a single-file ONNX written one initializer at a time reads back as the very
``ModelProto`` that ``onnx_ir.save`` writes, and the model is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from slabconv.write.onnx import save_onnx


def _program() -> tuple[torch.onnx.ONNXProgram, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5)
    ).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8)
    program = torch.onnx.export(model, (x,), dynamo=True)
    assert program is not None
    return program, model, x


def test_single_file_reads_back_as_onnx_ir_writes_it(tmp_path):
    program, model, x = _program()
    ours, reference = tmp_path / "ours.onnx", tmp_path / "reference.onnx"
    assert save_onnx(program.model, ours, external=False) is None
    ir.save(program.model, str(reference))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.onnx", "reference.onnx"]  # no external data
    loaded = onnx.load(str(ours))
    assert loaded == onnx.load(str(reference))
    assert len(loaded.graph.initializer) >= 4
    onnx.checker.check_model(str(ours), full_check=True)
    session = ort.InferenceSession(str(ours), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    # the model is unchanged: every initializer keeps its value, and a second save writes the same bytes
    assert all(v.const_value is not None for v in program.model.graph.initializers.values())
    again = tmp_path / "again.onnx"
    save_onnx(program.model, again, external=False)
    assert again.read_bytes() == ours.read_bytes()


def test_external_data_beside_the_file(tmp_path):
    program, _, _ = _program()
    path = tmp_path / "model.onnx"
    assert save_onnx(program.model, path, external=True) == "model.onnx.data"
    assert (tmp_path / "model.onnx.data").stat().st_size > 0
    single = tmp_path / "single.onnx"
    save_onnx(program.model, single, external=False)
    ext, one = onnx.load(str(path)), onnx.load(str(single))
    weights = {t.name: numpy_helper.to_array(t) for t in one.graph.initializer}
    assert {t.name for t in ext.graph.initializer} == set(weights)
    for t in ext.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), weights[t.name])


def test_subgraph_initializers_and_initializer_inputs(tmp_path):
    """An ``If`` branch's own initializer stays in its subgraph; an initializer that is also a graph input (an
    overridable weight) keeps both roles."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    bias = numpy_helper.from_array(np.full((3,), 0.5, dtype=np.float32), "bias")
    branch_value = numpy_helper.from_array(np.ones((1, 3), dtype=np.float32), "branch_value")
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["y", "branch_value"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [1, 3])],
        [branch_value],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["y"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [1, 3])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "bias"], ["y"]),
            helper.make_node("If", ["flag"], ["out"], then_branch=then_graph, else_branch=else_graph),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3])],
        [w, bias],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.serde.deserialize_model(proto)
    ours, reference = tmp_path / "ours.onnx", tmp_path / "reference.onnx"
    save_onnx(model, ours, external=False)
    ir.save(model, str(reference))
    loaded = onnx.load(str(ours))
    assert loaded == onnx.load(str(reference))
    assert [t.name for t in loaded.graph.initializer] == ["w", "bias"]
    session = ort.InferenceSession(str(ours), providers=["CPUExecutionProvider"])
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    (out,) = session.run(None, {"x": x, "flag": np.array(True)})
    np.testing.assert_array_equal(out, x @ numpy_helper.to_array(w) + 0.5 + 1.0)


def test_simplify_runs_on_the_exported_model_onnx_of_a_checkpoint(tmp_path):
    """``fuse --simplify`` of a checkpoint: onnxscript's optimizer on the exported ``model.onnx``, marked in its
    metadata, verified in onnxruntime like the plain file."""
    from slabconv import api
    from slabconv.options import VerifyOptions, WriteOptions
    from slabconv.write.onnx import simplified
    from tests.tinyckpt import save_ckpt

    ckpt = save_ckpt(tmp_path / "ckpt.pth")
    report = api.fuse(ckpt, tmp_path / "out", verify=VerifyOptions(samples=4), write=WriteOptions(simplify=True))
    assert report.verification is not None and report.verification.passed
    assert report.outputs is not None and "simplified" in report.outputs.onnx_info
    assert simplified(onnx.load(tmp_path / "out" / "model.onnx")) and not simplified(onnx.ModelProto())
    assert any("onnxruntime" in c.name for c in report.verification.checks)


def test_the_exporter_registry_the_tests_reuse_is_a_fresh_builds_and_each_export_gets_its_own_copy():
    """tests/conftest.py keeps the dynamo exporter's op registry between exports: each copy holds the entries a fresh
    build holds, an op one export registers stays in its copy, and an export through a copy writes the same model."""
    from torch.onnx._internal.exporter import _registration

    kept = _registration.ONNXRegistry.__dict__["from_torchlib"]
    from_torchlib = _registration.ONNXRegistry.from_torchlib
    build = kept.__func__.build  # the exporter's own build; the conftest's patch names it
    from_torchlib(18)  # kept, then ops registered after it (as test_int8's imports do) are in the next build
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (the quantized_decomposed ops torchlib converts)

    fresh, first, second = build(_registration.ONNXRegistry, 18), from_torchlib(18), from_torchlib(18)

    def entries(registry) -> dict:
        return {
            target: [(m.onnx_function, m.fx_target, m.is_complex, m.is_custom, m.signature) for m in metas]
            for target, metas in registry.functions.items()
        }

    assert len(fresh.functions) > 100 and entries(first) == entries(fresh) and first.opset_version == 18
    target = torch.ops.aten.relu.default
    first.register_op(target, lambda x: x, is_complex=False)  # what custom_translation_table does to its copy
    assert len(first.functions[target.name()]) == len(fresh.functions[target.name()]) + 1
    assert entries(second) == entries(fresh) == entries(from_torchlib(18))
    cached = _program()[0].model_proto
    try:
        _registration.ONNXRegistry.from_torchlib = classmethod(build)
        rebuilt = _program()[0].model_proto
    finally:
        _registration.ONNXRegistry.from_torchlib = kept
    assert cached == rebuilt


def test_an_onnx_export_the_exporter_fails_says_its_root_cause_and_the_way_around(tmp_path, monkeypatch):
    """torch's dynamo exporter fails some programs that ``torch.export`` takes (Hugging Face's Swin: "Cannot view a
    tensor with shape ..." while it decomposes). ``fuse`` said only the exporter's wrapper line, terminal colour codes
    included, and not that ``--no-onnx`` writes the rest. The error line now names the innermost cause, plain."""
    from typer.testing import CliRunner

    from slabconv.cli import app
    from tests.tinyckpt import error_lines, save_ckpt

    def failing_export(*args, **kwargs):
        try:
            raise ValueError(
                "Cannot view a tensor with shape torch.Size([8, 16, 2, 16]) as a tensor with shape (8, 16, 32)!"
            )
        except ValueError as cause:
            raise RuntimeError(
                "Failed to decompose the FX graph. \x1b[96mThis is step 2/3\x1b[0m of exporting"
            ) from cause

    monkeypatch.setattr(torch.onnx, "export", failing_export)
    ckpt = save_ckpt(tmp_path / "ckpt.pth")
    done = CliRunner().invoke(app, ["fuse", str(ckpt), "-o", str(tmp_path / "out"), "--samples", "2", "--no-pt2"])
    assert done.exit_code == 2, done.output
    (line,) = error_lines(done.stderr)
    assert "ValueError: Cannot view a tensor with shape" in line and "--no-onnx" in line, line
    assert "\x1b" not in line and not (tmp_path / "out").exists()
    done = CliRunner().invoke(
        app, ["fuse", str(ckpt), "-o", str(tmp_path / "out"), "--samples", "2", "--no-pt2", "--no-onnx"]
    )
    assert done.exit_code == 0, done.output
