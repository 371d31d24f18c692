"""ONNX files from every exporter users take (issue 36): torch's dynamo exporter with and without its optimizer,
the TorchScript exporter with and without constant folding, Keras via tf2onnx, PaddlePaddle via paddle2onnx and
Flax via jax2onnx. The files are committed (``fixtures/onnx-exports/``, written by ``fixtures/make_onnx_exports.py``
in an environment with those frameworks), so this file needs none of them and exports nothing.

On each file: slabconv folds every norm that onnxruntime's optimizer, onnxslim or onnx-simplifier folds, plus the
norms before a MatMul / Gemm / Conv that they keep (``EXPECTED`` lists every norm's action, the few kept ones with the
engine's reason); ``fuse --simplify`` verifies (question 1 exact, question 2 passed), leaves no
``BatchNormalization``, reaches the op histogram of the norm-free twin simplified the same way, and is no larger than
onnxslim's output of the same file. The norms a tool folds are those whose constants (statistics, scale vectors) are
gone from its graph (``benchmarks.onnx_in.norms_left``, which the side-by-side table of docs/onnx.md uses too).
``--simplify`` itself (onnxscript's optimizer, then onnxslim where it has fewer nodes) is held to the same bound on
the text fixture's TorchScript export (one export, module-scoped), and its question 1 to every written tensor.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from benchmarks import onnx_in as bench
from slabconv import api
from slabconv.engine import onnx_fold
from slabconv.load.onnx_file import load_ir
from slabconv.options import VerifyOptions, WriteOptions
from tests.conftest import ROOT

EXPORTS = ROOT / "fixtures" / "onnx-exports"
FILES = [name for name, _, _ in bench.committed()]

_CNN_ALL = ["folded-backward", "folded-forward", "folded-forward"]  # after the conv, before the 1x1 conv, before fc
_CNN_EXPORTER_FOLDED = ["folded-forward", "folded-forward"]  # the exporter folded the first BatchNorm into its conv
_BLOCK = ["folded-forward", "folded-backward", "folded-forward", "folded-backward", "folded-forward"]
EXPECTED: dict[str, list[str]] = {
    "torch-cnn-dynamo.onnx": _CNN_EXPORTER_FOLDED,
    "torch-cnn-dynamo-noopt.onnx": _CNN_ALL,
    "torch-cnn-torchscript.onnx": _CNN_EXPORTER_FOLDED,
    "torch-cnn-torchscript-nofold.onnx": _CNN_ALL,
    "keras-cnn.onnx": _CNN_EXPORTER_FOLDED,  # tf2onnx folds the first BatchNorm into its conv
    "paddle-cnn.onnx": _CNN_ALL,
    "jax-cnn.onnx": _CNN_ALL,
    **{f"torch-block-{s}.onnx": _BLOCK for s in ("dynamo", "dynamo-noopt", "torchscript", "torchscript-nofold")},
    "keras-block.onnx": _BLOCK,
    "paddle-block.onnx": _BLOCK,
    # jax2onnx writes a BatchNorm on tokens as Transpose -> BatchNormalization -> Transpose and adds ``alpha * x``
    # after the second Transpose: the affine values follow the BatchNorm's affine through the Transpose pair, so the
    # sum is one RepBN of x and folds forward like the torch layout's. No other tool folds these two.
    "jax-block.onnx": _BLOCK,
}


def _nodes(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def test_every_committed_export_is_listed():
    assert sorted(FILES) == sorted(EXPECTED)
    for name, _path, twin in bench.committed():
        assert twin.exists(), f"{name} has no norm-free twin"


@pytest.mark.parametrize("name", FILES)
def test_slabconv_folds_what_every_tool_folds_and_the_norms_they_keep(name, tmp_path):
    path = EXPORTS / name
    constants = bench.norm_constants(path)
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4), write=WriteOptions(simplify=True))
    assert [d.action for d in report.folds] == EXPECTED[name]
    assert list(constants) == [d.norm for d in report.folds]
    folded = {d.norm for d in report.folds if d.action.startswith("folded")}
    tools = bench.third_party(path, tmp_path)
    for tool, written in tools.items():
        assert isinstance(written, Path), f"{tool} failed on {name}: {written}"
        gone = set(constants) - set(bench.norms_left(constants, written))
        assert gone <= folded, f"{tool} folds {sorted(gone - folded)}, which slabconv keeps"

    verification = report.verification
    assert verification is not None and verification.exact and verification.checks
    assert all(e.passed for e in verification.exact) and all(c.passed for c in verification.checks)
    fused = tmp_path / "out" / "model.onnx"
    counts = bench.histogram(fused)
    assert counts["BatchNormalization"] == 0
    onnxslim_file = next(p for tool, p in tools.items() if tool.startswith("onnxslim"))
    assert isinstance(onnxslim_file, Path)
    assert sum(counts.values()) <= _nodes(onnxslim_file)
    if all(d.action.startswith("folded") for d in report.folds):
        _, simplified = bench.twin_histograms(EXPORTS / name.replace(".onnx", ".nonorm.onnx"), tmp_path)
        assert counts == simplified  # every bias the folds change is one the layer had


def test_norms_left_sees_a_norm_a_tool_kept_and_not_one_it_folded(tmp_path):
    """The measure the test above holds the tools to: a BatchNorm still in the graph is left, one folded into the
    conv before it (onnxruntime's Conv+BatchNorm fusion on the TorchScript export without constant folding) is
    not, and a norm whose constants were only reshaped is still left."""
    path = EXPORTS / "torch-cnn-torchscript-nofold.onnx"
    constants = bench.norm_constants(path)
    assert list(constants) == ["bn1", "bn2", "bn3"]
    assert bench.norms_left(constants, path) == ["bn1", "bn2", "bn3"]
    optimized = bench.ort_optimized(path, tmp_path / "ort.onnx")
    assert "bn1" not in bench.norms_left(constants, optimized)
    assert "bn3" in bench.norms_left(constants, optimized)  # before the Gemm: no tool but slabconv folds it
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name.startswith("bn3."):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).reshape(1, -1), init.name))
    onnx.save(model, str(tmp_path / "reshaped.onnx"))
    assert "bn3" in bench.norms_left(constants, tmp_path / "reshaped.onnx")


def test_norms_left_sees_a_learned_scalar_affine_by_its_one_element_tensors(tmp_path):
    """A learned scalar affine (``scale * x + bias``, PP-LCNetV3's and HGNetV2's learnable affine block) has no
    per-channel constant: its one-element tensors are its constants, so a tool that keeps it is counted as leaving
    it (with vectors only, every tool counted it as folded), and one whose graph no longer holds them is not."""
    import warnings

    import torch
    from torch import nn

    class _Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.scale, self.bias = nn.Parameter(torch.tensor([0.7])), nn.Parameter(torch.tensor([0.3]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c2(nn.functional.hardswish(self.scale * self.c1(x) + self.bias))

    path = tmp_path / "scalar.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Scalar().eval(), (torch.randn(1, 3, 8, 8),), str(path), dynamo=False, opset_version=18)
    constants = bench.norm_constants(path)
    assert [(k, [a.tolist() for a in v]) for k, v in constants.items()] == [
        ("scale", [[pytest.approx(0.7)], [pytest.approx(0.3)]])
    ]
    assert bench.norms_left(constants, path) == ["scale"]
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if numpy_helper.to_array(init).size == 1:  # what a tool that folded it leaves: neither value
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
    onnx.save(model, str(tmp_path / "gone.onnx"))
    assert bench.norms_left(constants, tmp_path / "gone.onnx") == []


# --------------------------------------------------------------------------------------------- the lowering's fixes


def _dense_on_tokens(keep_last_axis: bool, bias_shape: tuple[int, ...]) -> onnx.ModelProto:
    """``x (B, 5, 4)`` -> BatchNorm over the channels (as Keras writes it: ``x * s + t``) -> ``Reshape(-1, 4)`` ->
    ``MatMul W (4, 6)`` -> ``Reshape`` -> ``Add`` bias: tf2onnx's Keras ``Dense`` on tokens. With
    ``keep_last_axis`` the second reshape is ``(-1, 5, 6)``, else ``(-1, 5, 2, 3)`` with a ``(2, 3)`` bias."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(1, 0.3, 4).astype(np.float32), "s"),
        numpy_helper.from_array(rng.normal(0, 0.5, 4).astype(np.float32), "t"),
        numpy_helper.from_array(np.array([-1, 4], np.int64), "flat"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 6)).astype(np.float32), "dense.kernel"),
        numpy_helper.from_array(np.array([-1, 5, 6] if keep_last_axis else [-1, 5, 2, 3], np.int64), "back"),
        numpy_helper.from_array(rng.normal(0, 0.5, bias_shape).astype(np.float32), "dense.bias"),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["scaled"], name="norm/mul"),
        helper.make_node("Add", ["scaled", "t"], ["normed"], name="norm/add"),
        helper.make_node("Reshape", ["normed", "flat"], ["rows"], name="dense/Tensordot/Reshape"),
        helper.make_node("MatMul", ["rows", "dense.kernel"], ["mm"], name="dense/Tensordot/MatMul"),
        helper.make_node("Reshape", ["mm", "back"], ["tokens"], name="dense/Tensordot"),
        helper.make_node("Add", ["tokens", "dense.bias"], ["y"], name="dense/BiasAdd"),
    ]
    out = [None, 5, 6] if keep_last_axis else [None, 5, 2, 3]
    graph = helper.make_graph(
        nodes,
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", *out[1:]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("keep_last_axis", [True, False])
def test_a_bias_add_after_a_reshape_is_the_layers_bias_only_when_the_reshape_keeps_the_last_axis(
    tmp_path, keep_last_axis
):
    """A fold into a Keras ``Dense`` updates the ``BiasAdd`` after its reshape back to tokens (no second bias
    ``Add``). Where the reshape splits the last axis the ``Add`` is not taken as the layer's bias (taking a bias of
    another layout as the layer's ``(6,)`` bias needs the reshape to keep each row whole): the fold then adds a bias
    of its own, and stays exact."""
    path = tmp_path / "dense.onnx"
    onnx.save(_dense_on_tokens(keep_last_axis, (6,) if keep_last_axis else (2, 3)), str(path))
    report = api.fuse(path, tmp_path / "out", verify=VerifyOptions(samples=4))
    assert [(d.action, d.into) for d in report.folds] == [("folded-forward", ["dense.Tensordot"])]
    verification = report.verification
    assert verification is not None and all(e.passed for e in verification.exact)
    counts = bench.histogram(tmp_path / "out" / "model.onnx")
    assert counts == collections.Counter({"Reshape": 2, "MatMul": 1, "Add": 1 if keep_last_axis else 2})


def test_a_conv_bias_the_dynamo_exporter_computes_with_expand_is_folded_to_a_constant_and_the_bn_folds(tmp_path):
    """The dynamo exporter without its optimizer writes a bias-free conv's zero bias as ``Expand(CastLike(0, x),
    Shape(W)[0:1])``; its size is known only once the ``Shape`` is folded. Prepared, the bias is a constant and the
    BatchNorm after the conv folds backward into it (before, the ``Expand`` stayed and the norm was kept)."""
    path = EXPORTS / "torch-cnn-dynamo-noopt.onnx"
    assert collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)["Expand"] == 2
    lowered, plans = onnx_fold.plan_file(load_ir(path), str(path))
    assert [(p.decision.norm, p.decision.action) for p in plans][0] == ("bn1", "folded-backward")


def test_an_expand_larger_than_the_folding_limit_stays_a_node(tmp_path, monkeypatch):
    """The size of an ``Expand`` whose output inference left unknown is worked out from its constant shape, and one
    that would make a constant larger than its inputs and ``FOLD_OUTPUT_LIMIT`` together is not folded: a hostile
    file cannot make preparing it allocate what it asks for."""
    from slabconv.engine import onnx_lower

    def model(n: int) -> ir.Model:
        nodes = [  # as the dynamo exporter writes a conv's zero bias without its optimizer
            helper.make_node("Shape", ["w"], ["w_rows"], start=0, end=1),
            helper.make_node("Expand", ["w_rows", "one"], ["size"]),
            helper.make_node("CastLike", ["zero", "x"], ["zero_like_x"]),
            helper.make_node("Expand", ["zero_like_x", "size"], ["b"]),
            helper.make_node("Add", ["x", "b"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", n])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", n])],
            [
                numpy_helper.from_array(np.zeros((n, 1), np.float32), "w"),
                numpy_helper.from_array(np.array(0.5, np.float32), "zero"),
                numpy_helper.from_array(np.array([1], np.int64), "one"),
            ],
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        return ir.serde.deserialize_model(proto)

    monkeypatch.setattr(onnx_lower, "FOLD_OUTPUT_LIMIT", 16)
    for n, folded in ((8, True), (64, False)):
        m = model(n)
        onnx_lower.prepare(m)
        ops = [node.op_type for node in m.graph]
        assert ("Expand" not in ops) is folded, (n, ops)


def test_preparing_a_graph_shape_inference_cannot_finish_writes_nothing_in_the_working_directory(tmp_path, monkeypatch):
    """onnxruntime's symbolic shape inference saves a partial model (``sym_shape_infer_temp.onnx`` and external
    data files) into the current directory when it cannot type every value (here: the graph onnxruntime's own
    optimizer wrote, its first ``FusedConv`` made an op of another domain that no inference knows): slabconv drives
    the inference without that step, so nothing of the user's is written or replaced, and never changes the working
    directory (process-wide: the Python API may run in a thread beside others that open relative paths)."""
    import os

    import onnxruntime as ort

    from slabconv.engine import onnx_shapes

    optimized = tmp_path / "ort.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # FusedConv
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(EXPORTS / "torch-cnn-torchscript.onnx"), options, providers=["CPUExecutionProvider"])
    proto = onnx.load(str(optimized))
    proto.graph.node[0].domain = "org.example"
    proto.opset_import.append(onnx.helper.make_opsetid("org.example", 1))
    onnx.save(proto, str(optimized))
    with pytest.raises(RuntimeError, match="incomplete"):  # the inference this test is about does not finish
        onnx_shapes._infer_symbolic(onnx.load(str(optimized)))
    work = tmp_path / "work"
    work.mkdir()
    (work / "sym_shape_infer_temp.onnx").write_text("the user's file")
    monkeypatch.chdir(work)
    moved: list[str] = []
    monkeypatch.setattr(os, "chdir", lambda path: moved.append(str(path)))
    onnx_fold.plan_file(load_ir(optimized), str(optimized))
    assert moved == []
    assert sorted(p.name for p in work.iterdir()) == ["sym_shape_infer_temp.onnx"]
    assert (work / "sym_shape_infer_temp.onnx").read_text() == "the user's file"


# --------------------------------------------------------------------------------------------- fuse --simplify


def _simplified(name: str, **kwargs) -> tuple[ir.Model, dict]:
    path = EXPORTS / name
    model = load_ir(path)
    onnx_fold.fold_file(model, str(path))
    return model, onnx_fold.simplify_graph(model, **kwargs)


def test_simplify_keeps_onnxslims_graph_only_when_smaller_and_says_so_without_it(monkeypatch):
    """``--simplify``: onnxscript's optimizer, then onnxslim, whose graph is kept only when it has fewer nodes (on
    the dynamo block it writes each ``MatMul`` on tokens and its bias ``Add`` as ``Reshape`` -> ``Gemm`` ->
    ``Reshape``: 31 nodes to onnxscript's 29); without onnxslim the info says so, and a candidate whose mark names
    onnxslim cannot be simplified again for question 1 (exit 2, naming the extra)."""
    from slabconv.errors import UsageError

    model, info = _simplified("torch-block-torchscript.onnx")
    assert [s.split()[0] for s in info["simplifiers"]] == ["onnxscript", "onnxslim"] and "onnxslim" not in info
    assert info["nodes_after"] == len(list(model.graph)) < info["nodes_before"]
    model, info = _simplified("torch-block-dynamo.onnx")
    assert [s.split()[0] for s in info["simplifiers"]] == ["onnxscript"]
    assert "not fewer than 29: not kept" in info["onnxslim"] and info["nodes_after"] == len(list(model.graph)) == 29
    monkeypatch.setitem(__import__("sys").modules, "onnxslim", None)  # import onnxslim raises ImportError
    _, info = _simplified("torch-block-torchscript.onnx")
    assert [s.split()[0] for s in info["simplifiers"]] == ["onnxscript"]
    assert "onnxslim is not installed (pip install 'slabconv[simplify]')" == info["onnxslim"]
    with pytest.raises(UsageError, match=r"which question 1 repeats, but onnxslim is not installed"):
        _simplified("torch-block-torchscript.onnx", simplifiers=["onnxscript 0.7.2", "onnxslim 0.1.98"])


def test_simplify_registers_the_shape_onnxscripts_flatten_rewrite_leaves_unregistered():
    """Two ``Flatten`` nodes reading one value (DETR's TorchScript export): onnxscript's optimizer rewrites each
    into a ``Reshape`` whose shape it creates as an initializer, and registers only the first; the second ``Reshape``
    read a value nothing defines, so ``fuse --simplify`` wrote a file that ``onnx.checker`` refused. Every constant
    a node reads is an initializer of the simplified graph, and it computes the two flattens."""
    import onnxruntime as ort

    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    nodes += [helper.make_node("Flatten", ["r"], [f"f{i}"]) for i in range(2)]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, ["batch", 4, 3])],
                              [info(f"f{i}", TensorProto.FLOAT, None) for i in range(2)])  # fmt: skip
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    model = ir.from_proto(proto)
    onnx_fold.simplify_graph(model)
    simplified = ir.to_proto(model)
    assert [n.op_type for n in simplified.graph.node] == ["Relu", "Reshape", "Reshape"]
    onnx.checker.check_model(simplified, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    session = ort.InferenceSession(simplified.SerializeToString(), providers=["CPUExecutionProvider"])
    for out in session.run(None, {"x": x}):
        np.testing.assert_array_equal(out, np.maximum(x, 0).reshape(2, 12))


def test_question_1_holds_every_tensor_of_a_simplified_file(tmp_path, monkeypatch):
    """A ``model.onnx`` that ``--simplify`` wrote (onnxscript's optimizer and onnxslim: the TorchScript block) with
    one weight one unit in the last place off: question 2 cannot see it, question 1's check of the file against the
    fold simplified at the file's precision does, and nothing is written."""
    from slabconv import onnx_in
    from slabconv.errors import VerificationError

    real = onnx_in.simplify_model

    def one_ulp_off(model):
        info = real(model)
        value = max(model.graph.initializers.values(), key=lambda v: v.const_value.size)
        array = value.const_value.numpy().copy()
        array.flat[0] = np.nextafter(array.flat[0], np.float32(np.inf))
        value.const_value = ir.tensor(array)
        return info

    monkeypatch.setattr(onnx_in, "simplify_model", one_ulp_off)
    with pytest.raises(VerificationError, match="not equivalent") as caught:
        api.fuse(EXPORTS / "torch-block-torchscript.onnx", tmp_path / "out", verify=VerifyOptions(samples=4),
                 write=WriteOptions(simplify=True))  # fmt: skip
    exact = caught.value.report.verification.exact
    assert [e.passed for e in exact] == [True, True, False]
    assert "simplified at the file's precision (onnxscript" in exact[2].name and exact[2].error == 1
    assert all(c.passed for c in caught.value.report.verification.checks)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def text_torchscript(tmp_path_factory) -> Path:
    """The text fixture (LLaMA-PRepBN, 7 RepBN) exported by the TorchScript exporter, as ``benchmarks.onnx_in``
    exports it: its shapes and rotary tables computed at run time."""
    build = next(b for name, b, _ in bench._networks() if name.startswith("text fixture"))
    model, x = build()
    path = tmp_path_factory.mktemp("text") / "text-torchscript.onnx"
    return bench._torch_export(model, x, path, bench.TORCH_SETTINGS["TorchScript"])


def test_simplify_of_the_text_fixture_is_no_larger_than_onnxslim_and_verified(text_torchscript, tmp_path):
    """onnxscript's optimizer alone leaves more of the text fixture's shape arithmetic than onnxslim (175 nodes to
    157); ``--simplify`` runs onnxslim after it, and ends no larger than onnxslim on the unfused file. onnxslim folds
    the rotary ``sin`` / ``cos`` tables in float32: question 1 judges the fold in float64, unsimplified, and holds the
    file to the fold simplified at the file's precision (a float64 simplification would be thousands of units in the
    last place away), the three checks named for what they compared."""
    import onnxslim

    report = api.fuse(text_torchscript, tmp_path / "out", verify=VerifyOptions(samples=2),
                      write=WriteOptions(simplify=True))  # fmt: skip
    info = report.outputs.onnx_info["simplified"]
    assert [s.split()[0] for s in info["simplifiers"]] == ["onnxscript", "onnxslim"]
    verification = report.verification
    assert verification.passed and all(c.passed for c in verification.checks)
    assert [e.passed for e in verification.exact] == [True, True, True]
    assert "before --simplify" in verification.exact[1].name and "simplified" in verification.exact[2].name
    assert _nodes(tmp_path / "out" / "model.onnx") == info["nodes_after"]
    assert info["nodes_after"] <= len(onnxslim.slim(onnx.load(str(text_torchscript))).graph.node)
