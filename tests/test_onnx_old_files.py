"""ONNX files as older tools write them: IR version 3 (every initializer a graph input too), opset 7 and 8
``Upsample`` with its ``scales`` an attribute, ``onnx.version_converter`` output (a later opset, IR 3 kept), and
initializers listed as graph inputs before the data input. Each is folded and verified through ``api.fuse``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from slabconv import api
from slabconv.load.source import Source
from slabconv.options import VerifyOptions, WriteOptions
from slabconv.verify import onnx_original, sides


def _cnn(opset: int, mode: str = "nearest", listed: bool = True, ir_version: int = 3) -> onnx.ModelProto:
    """Conv -> BatchNorm -> Upsample (x2, ``mode``) -> BatchNorm -> 1x1 Conv, an IR version 3 file at ``opset`` (7
    or 8: ``scales`` an attribute; 10: a ``Resize`` of ``scales``) with every initializer listed as a graph input
    (``listed``); ``ir_version`` 4 or later where not listed."""
    rng = np.random.default_rng(0)
    arrays = {"w1": rng.standard_normal((4, 3, 3, 3)) * 0.3, "w2": rng.standard_normal((5, 4, 1, 1)) * 0.3}
    for bn in ("bn1", "bn2"):
        arrays.update({f"{bn}_s": rng.uniform(0.5, 1.5, 4), f"{bn}_b": rng.uniform(-1, 1, 4),
                       f"{bn}_m": rng.uniform(-1, 1, 4), f"{bn}_v": rng.uniform(0.5, 2, 4)})  # fmt: skip
    if opset == 10:  # Resize (X, scales): opset 9's Upsample renamed
        arrays["scales"] = np.array([1.0, 1.0, 2.0, 2.0])
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    up = (helper.make_node("Resize", ["n1", "scales"], ["u"], name="up", mode=mode) if opset == 10 else
          helper.make_node("Upsample", ["n1"], ["u"], name="up", mode=mode, scales=[1.0, 1.0, 2.0, 2.0]))  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["n1"], name="bn1"),
        up,
        helper.make_node("BatchNormalization", ["u", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["n2"], name="bn2"),
        helper.make_node("Conv", ["n2", "w2"], ["y"], name="conv2"),
    ]
    info = helper.make_tensor_value_info
    inputs = [info("x", TensorProto.FLOAT, ["N", 3, 4, 4])]
    inputs += [info(t.name, t.data_type, list(t.dims)) for t in inits] if listed else []
    graph = helper.make_graph(nodes, "g", inputs, [info("y", TensorProto.FLOAT, ["N", 5, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    onnx.checker.check_model(model)
    return model


def _same_outputs(original, fused) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                 for p in (original, fused))  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [7, 10])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_an_opset_7_upsample_and_an_opset_10_resize_are_verified(tmp_path, mode, opset):
    """onnxruntime has no float64 ``Conv``, so question 1 runs onnx's reference evaluator, whose ``Upsample``
    takes ``scales`` only as an input (opset 9): an opset 7 or 8 node raised ``TypeError`` there, an internal error
    after the fold was written; its ``Resize`` reads opset 10's ``(X, scales)`` as opset 11's ``(X, roi)`` and
    raised ``ValueError`` (no scales, no sizes), the same internal error."""
    path = tmp_path / f"op{opset}.onnx"
    onnx.save(_cnn(opset, mode, listed=opset < 9, ir_version=3 if opset < 9 else 5), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-backward", "folded-forward"]
    _same_outputs(path, tmp_path / "out" / "model.onnx")


@pytest.mark.parametrize("opset", [7, 9, 10])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 1.5, 2.5], [1, 1, 0.6, 0.5]])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_the_reference_upsample_computes_what_onnxruntime_computes(opset, scales, mode):
    """The float64 reference's ``Upsample`` and opset 10 ``Resize`` (``onnx_original._upsample``) against
    onnxruntime's, whole and fractional scales (below 1: opset 10's ``Resize`` only), both modes, the scales an
    attribute (opset 7) or an input (opsets 9 and 10)."""
    from onnx.reference import ReferenceEvaluator

    if scales[-1] < 1 and opset < 10:
        pytest.skip("onnxruntime's Upsample refuses a scale below 1")
    info = helper.make_tensor_value_info
    inits = [] if opset < 9 else [numpy_helper.from_array(np.array(scales, np.float32), "s")]
    node = helper.make_node("Resize" if opset == 10 else "Upsample", ["x", *(["s"] if inits else [])], ["y"],
                            mode=mode, **({} if inits else {"scales": [float(s) for s in scales]}))  # fmt: skip
    graph = helper.make_graph([node], "g", [info("x", TensorProto.FLOAT, None)], [info("y", TensorProto.FLOAT, None)],
                              inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=4)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ReferenceEvaluator(model, new_ops=onnx_original._upsample()).run(None, {"x": x.astype(np.float64)})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("simplify", [False, True])
def test_an_ir_3_file_raised_to_opset_12_lists_every_initializer_the_fold_left_as_an_input(tmp_path, simplify):
    """``onnx.version_converter`` raises an opset 7 file to opset 12 and keeps IR version 3, writing ``Upsample`` as
    ``Resize`` with ``Constant`` scales. The preparation folds those into initializers (and ``--simplify`` makes
    more): not listed as graph inputs, the fused file failed ``onnx.checker`` ('not a valid ONNX model ... export it
    again', exit 2, of slabconv's own output)."""
    from onnx import version_converter

    converted = version_converter.convert_version(_cnn(7), 12)
    assert converted.ir_version == 3 and any(n.op_type == "Constant" for n in converted.graph.node)
    path = tmp_path / "op12_ir3.onnx"
    onnx.save(converted, str(path))
    report = api.fuse(path, tmp_path / "out", write=WriteOptions(simplify=simplify), verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    onnx.checker.check_model(fused)
    assert fused.ir_version == 3
    assert {t.name for t in fused.graph.initializer} <= {i.name for i in fused.graph.input}
    _same_outputs(path, tmp_path / "out" / "model.onnx")


def test_initializers_listed_before_the_data_input_are_not_taken_for_it(tmp_path):
    """An old-style file may list its initializers as graph inputs before the data input: the float64 reference
    fed the samples to the first graph input, a weight (an internal error: 'Unable to find input 'x'')."""
    model = _cnn(8, listed=True)
    inputs = list(model.graph.input)
    del model.graph.input[:]
    model.graph.input.extend(inputs[1:] + inputs[:1])
    path = tmp_path / "first.onnx"
    onnx.save(model, str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    _same_outputs(path, tmp_path / "out" / "model.onnx")


def test_a_stale_value_info_does_not_override_the_shapes_inference_computes(tmp_path):
    """A ``value_info`` that disagrees with the graph (a hand-edited or merged file; onnxruntime ignores it) was
    taken over the inferred shapes: the conv's output declared with 7 channels met a BatchNorm of 4 statistics, an
    internal error in ``inspect`` and ``fuse``. The inferred shapes win; the fused file declares them."""
    model = _cnn(8, listed=False, ir_version=4)
    model.graph.value_info.extend([helper.make_tensor_value_info("c1", TensorProto.FLOAT, ["N", 7, 4, 4]),
                                   helper.make_tensor_value_info("u", TensorProto.FLOAT, ["N", 4, 3, 3])])  # fmt: skip
    path = tmp_path / "stale.onnx"
    onnx.save(model, str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-backward", "folded-forward"]
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    shapes = fused.graph.value_info
    declared = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim][1:] for v in shapes}
    assert declared.get("c1", [4, 4, 4]) == [4, 4, 4] and declared.get("u", [4, 8, 8]) == [4, 8, 8]
    _same_outputs(path, tmp_path / "out" / "model.onnx")


def test_a_batchnorm_inside_a_model_local_function_is_found_and_folded(tmp_path):
    """The TorchScript exporter's ``export_modules_as_functions={nn.BatchNorm2d}`` writes each BatchNorm as a call
    of a model-local function whose body is the ``BatchNormalization``: the call was an opaque node and the norm
    was not even listed ('0 norms'), where onnxruntime inlines the function and runs the norm. The body is inlined
    before planning, and the norm folds into the conv after it."""
    rng = np.random.default_rng(0)
    arrays = {"g": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "k": rng.standard_normal((5, 4, 1, 1))}  # fmt: skip
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    body = helper.make_function(
        "torch.nn.modules.batchnorm", "BatchNorm2d", ["x", "g", "b", "m", "v"], ["y"],
        [helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], epsilon=1e-5)],
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    nodes = [helper.make_node("BatchNorm2d", ["x", "g", "b", "m", "v"], ["n"], name="/bn/BatchNorm2d",
                              domain="torch.nn.modules.batchnorm"),
             helper.make_node("Conv", ["n", "k"], ["z"], name="/conv/Conv")]  # fmt: skip
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, ["N", 4, 3, 3])],
                              [info("z", TensorProto.FLOAT, ["N", 5, 3, 3])], inits)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("torch.nn.modules.batchnorm", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[body])
    onnx.checker.check_model(model)
    path = tmp_path / "fn.onnx"
    onnx.save(model, str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert report.verification is not None and report.verification.passed
    assert [d.action for d in report.folds] == ["folded-forward"]
    fused = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [n.op_type for n in fused.graph.node] == ["Conv"] and not fused.functions
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                 for p in (path, tmp_path / "out" / "model.onnx"))  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _token_model(listed_first: bool) -> onnx.ModelProto:
    """``ids (batch, seq) -> Gather(table) -> y``, its ``(10, 4)`` table an initializer also listed as a graph input
    (``keep_initializers_as_inputs=True``), before the ids (``listed_first``) or after them."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32), "table")
    info = helper.make_tensor_value_info
    ids = info("ids", TensorProto.INT64, ["batch", "seq"])
    listed = info("table", TensorProto.FLOAT, [10, 4])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="embed")],
        "g",
        [listed, ids] if listed_first else [ids, listed],
        [info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("listed_first", [True, False])
def test_the_sequence_axis_is_read_from_the_first_real_input_not_a_listed_initializer(tmp_path, listed_first):
    """A side takes any sequence length when its first real input's axis 1 is symbolic (question 2 then runs a
    shorter length too); an initializer listed as a graph input before it (a ``(10, 4)`` table, static) was taken
    for that input, and the second length was never checked."""
    path = tmp_path / "tokens.onnx"
    onnx.save(_token_model(listed_first), str(path))
    assert sides.onnx_side(path).dynamic_sequence
    folder = tmp_path / "folder"
    folder.mkdir()
    onnx.save(_token_model(listed_first), str(folder / "model.onnx"))
    assert sides.output_side(folder, Source(str(folder), None, "slabconv-output")).dynamic_sequence


@pytest.mark.parametrize("opset", [9, 10])
def test_a_norm_before_an_upsample_of_a_dynamic_batch_folds_at_opsets_9_and_10(tmp_path, opset):
    """The TorchScript exporter writes ``nn.Upsample`` as ``Upsample`` (opset 9) or ``Resize`` (opset 10) with its
    ``scales`` the second input, where opset 11's ``Resize`` has them third: under a dynamic batch, inference gives
    the output a batch of its own, and only the scales (1 on the batch and channels) say the op resizes the spatial
    axes alone. They were read from the third input only: the op was opaque, and the BatchNorm before it was kept
    (``unsupported-op:onnx.Resize``) where it folds into the conv after it."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(4), nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(4, 3, 1))
    norm = model[0]
    assert isinstance(norm, nn.BatchNorm2d)
    norm.running_mean.uniform_(-1, 1)
    norm.running_var.uniform_(0.5, 2)
    path = tmp_path / f"op{opset}.onnx"
    torch.onnx.export(model.eval(), (torch.randn(2, 4, 5, 5),), str(path), dynamo=False, opset_version=opset,
                      input_names=["x"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    assert any(n.op_type == ("Upsample" if opset == 9 else "Resize") for n in onnx.load(str(path)).graph.node)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=2))
    assert [(d.action, d.reason) for d in report.folds] == [("folded-forward", None)]
    assert report.verification is not None and report.verification.passed
    x = np.random.default_rng(1).standard_normal((3, 4, 5, 5)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                 for p in (path, tmp_path / "out" / "model.onnx"))  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [9, 10])
@pytest.mark.parametrize("axis", [2, 1])
def test_a_slice_of_attributes_and_a_slice_of_inputs_are_the_same_aten_slice(opset, axis):
    """``BatchNormalization -> Slice -> 1x1 Conv``: a ``Slice`` before opset 10 holds its bounds in attributes,
    from opset 10 in inputs; both are one ``aten.slice`` of the same bounds, and the norm folds forward through
    either: a crop of a spatial axis passes it whole, a slice of the channels (1 and 2 of 4) passes those channels'
    scale and shift into the conv's two columns. Read wrongly (the attributes not read, or the axis taken as 0), the
    slice is opaque or slices the batch, and the channel case is kept."""
    import onnx_ir as ir

    from slabconv.engine import onnx_fold

    rng = np.random.default_rng(0)
    arrays = {"s": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(-1, 1, 4), "m": rng.uniform(-1, 1, 4),
              "v": rng.uniform(0.5, 2, 4), "w": rng.standard_normal((5, 4 if axis == 2 else 2, 1, 1))}  # fmt: skip
    bounds = {"starts": [1], "ends": [3], "axes": [axis]}
    slice_node = helper.make_node("Slice", ["n"], ["c"], name="crop", **bounds)
    if opset == 10:
        arrays.update({k: np.array(v) for k, v in bounds.items()})
        slice_node = helper.make_node("Slice", ["n", "starts", "ends", "axes"], ["c"], name="crop")
    inits = [numpy_helper.from_array(a.astype(np.int64 if a.dtype.kind == "i" else np.float32), k)
             for k, a in arrays.items()]  # fmt: skip
    nodes = [
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["n"], name="bn"),
        slice_node,
        helper.make_node("Conv", ["c", "w"], ["y"], name="conv"),
    ]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, ["N", 4, 4, 4])],
                              [info("y", TensorProto.FLOAT, ["N", 5, None, None])], inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    _, plans = onnx_fold.plan_file(ir.from_proto(model))
    assert [(p.decision.action, p.decision.reason) for p in plans] == [("folded-forward", None)]
