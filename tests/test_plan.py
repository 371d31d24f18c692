"""Folding whole models: every norm found from the graph, folded away, outputs unchanged, and the fused ONNX
has the op histogram of the same network with every norm replaced by identity (the norm-free bound)."""

from __future__ import annotations

import pytest
import torch

from slabconv import engine
from slabconv.engine.norms import BN_OPS
from slabconv.write.onnx import export_onnx
from tests.conftest import op_histogram, small_vit


def _fold(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[engine.Decision]]:
    gm = engine.capture(model, x)
    return gm, engine.fold_all(gm)


@pytest.mark.parametrize("layout", ["repbn", "linearnorm"])
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_deit_folds_completely_and_exactly(layout, pool):
    model = small_vit(layout, pool)
    x = torch.randn(6, 1, 8, 8)
    reference = model(x)
    gm, decisions = _fold(model, x)
    assert [d.norm for d in decisions] == [
        "blocks.0.norm1",
        "blocks.0.norm2",
        "blocks.1.norm1",
        "blocks.1.norm2",
        "norm",
    ]
    assert all(d.action == "folded-forward" and d.reason is None for d in decisions)
    assert [d.into for d in decisions] == [
        ["blocks.0.attn.qkv"],
        ["blocks.0.mlp.fc1"],
        ["blocks.1.attn.qkv"],
        ["blocks.1.mlp.fc1"],
        ["head"],
    ]
    assert not [n for n in gm.graph.nodes if n.target in BN_OPS]
    torch.testing.assert_close(gm(x), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_fused_state_dict_has_no_norm_weights_and_loads_into_the_norm_free_model():
    model = small_vit("linearnorm")
    x = torch.randn(4, 1, 8, 8)
    gm, _ = _fold(model, x)
    fused = engine.fused_state_dict(gm)
    assert not [k for k in fused if ".norm" in k or k.startswith("norm.")]
    bare = small_vit("identity")
    bare.load_state_dict(fused, strict=True)
    torch.testing.assert_close(bare.eval()(x), model(x), rtol=1e-5, atol=1e-5)


def test_fused_onnx_reaches_the_norm_free_bound(tmp_path):
    model = small_vit("repbn")
    x = torch.randn(2, 1, 8, 8)
    gm, _ = _fold(model, x)
    export_onnx(gm, x, tmp_path / "fused.onnx")
    export_onnx(small_vit("identity"), x, tmp_path / "bound.onnx")
    export_onnx(model, x, tmp_path / "original.onnx")
    fused, bound, original = (op_histogram(tmp_path / f"{n}.onnx") for n in ("fused", "bound", "original"))
    assert fused["BatchNormalization"] == 0 and original["BatchNormalization"] == 5
    assert fused == bound
    assert original["Transpose"] > fused["Transpose"]


def test_the_original_model_is_not_modified():
    model = small_vit("repbn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _fold(model, torch.randn(2, 1, 8, 8))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_unfinished_progressive_schedule_is_reported():
    model = small_vit("linearnorm")
    model.blocks[0].norm1.iter.fill_(120)
    model.blocks[0].norm1.total_step.fill_(1000)
    _, decisions = _fold(model, torch.randn(2, 1, 8, 8))
    first = decisions[0]
    assert first.action == "folded-forward"
    schedule = [[w for w in d.warnings if not w.startswith("int8:")] for d in decisions]  # random BN weights
    assert len(schedule[0]) == 1 and "iter=120" in schedule[0][0] and "0.12" in schedule[0][0]  # flag int8 too
    assert not any(schedule[1:])


def test_nan_statistics_are_refused():
    model = small_vit("repbn")
    model.blocks[1].norm2.bn.running_var[3] = float("nan")
    with pytest.raises(Exception, match="blocks.1.norm2: running_var holds NaN"):
        _fold(model, torch.randn(2, 1, 8, 8))


def test_the_fused_graph_shares_the_tensors_no_fold_changed_and_the_original_stays_as_loaded():
    """``pipeline.plan`` copies the traced graph without its parameters (a DeiT-Tiny's 23 MB not held twice): a
    parameter no fold changed is the original's own, a folded one is new, and the original graph (the reference
    verification runs) still holds the loaded values, bit for bit."""
    from pathlib import Path

    from slabconv import pipeline
    from slabconv.api import load_model

    loaded = load_model(Path(__file__).resolve().parents[1] / "fixtures" / "digits-prepbn" / "checkpoint.pth")
    before = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    planned = pipeline.plan(loaded)
    assert planned.original is not None
    original = engine.fused_state_dict(planned.original)
    fused = engine.fused_state_dict(planned.fused)
    assert planned.program is not None
    layers = planned.program.layers.values()
    into = {la.weight for la in layers} | {la.bias_out for la in layers if la.bias_out is not None}
    assert {f"{layer}.weight" for d in planned.decisions for layer in d.into} <= into <= set(fused)
    parameters = dict(planned.original.named_parameters())
    assert len(set(parameters) & set(fused) - into) >= 10  # the patch embedding, attention outputs, MLPs...
    for name, tensor in fused.items():
        if name in into:
            assert tensor.data_ptr() != original[name].data_ptr()
            assert not torch.equal(tensor, original[name])
        elif name in parameters:
            assert tensor.data_ptr() == original[name].data_ptr(), name  # the same memory
    state = loaded.model.state_dict()
    for name, value in before.items():
        assert torch.equal(state[name], value), name
    assert set(original) <= set(before)
    for name, tensor in original.items():
        assert torch.equal(tensor, before[name]), name


def test_a_tensor_the_graph_updates_as_it_runs_is_not_shared():
    """A model that updates a buffer (a call counter) and a parameter in its forward: running the fused graph must
    not move the original graph's tensors, which verification runs afterwards."""
    from pathlib import Path

    from slabconv import pipeline
    from slabconv.load.checkpoint import Checkpoint
    from slabconv.load.model import LoadedModel

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(8)
            self.fc = torch.nn.Linear(8, 4)
            self.register_buffer("calls", torch.zeros(()))
            self.gain = torch.nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            with torch.no_grad():  # a parameter updated in place: torch.export keeps it too
                self.gain.view(2, 2).mul_(0.5)
            return self.fc(self.bn(x)) * self.gain + self.calls

    model = Counting().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    module = Checkpoint({}, {}, "pickled-module", Path("model.pt"), "", module=model)  # a module, not a program
    loaded = LoadedModel(model, module, None, (8,), torch.float32)
    planned = pipeline.plan(loaded)
    assert planned.original is not None
    assert [(d.norm, d.action) for d in planned.decisions] == [("bn", "folded-forward"), ("gain", "kept")]
    x = torch.randn(3, 8)
    assert engine.written_tensors(planned.original) == {"calls", "gain"}
    planned.fused(x)
    planned.fused(x)
    assert float(planned.original.calls) == 0.0
    assert planned.original.gain.tolist() == [1.0] * 4
    expected = model.fc(model.bn(x)) * 0.5 + 1
    torch.testing.assert_close(planned.original(x), expected, rtol=0, atol=1e-6)
