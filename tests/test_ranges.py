"""Issue 40, item 2: what each fold does to the weight ranges int8 quantization works with
(``slabconv.engine.ranges``), measured block by block as the fold program runs, flagged above
``STEP_GROWTH_LIMIT``, and the direction a norm takes where both exist.

Expected values are computed here by hand from the module's own weights and the norm's scale, independently of the
engine. Whether a flagged fold really costs int8 agreement (and an ordinary one does not) is
``tests/test_int8.py``'s question.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slabconv import engine, fold
from slabconv.engine import STEP_GROWTH_LIMIT, capture, fold_program
from slabconv.engine.program import TensorStore, evaluate
from slabconv.engine.ranges import RangeTally, spread

C = 16


class Bottleneck(nn.Module):
    """``fc2(bn(fc1(x)))`` on ``(B, 8)``: the BatchNorm folds exactly either way, forward into ``fc2`` or backward
    into ``fc1`` (the pattern of an MLP with BatchNorm before its Linear layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, C)
        self.bn = nn.BatchNorm1d(C)
        self.fc2 = nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.bn(self.fc1(x)))


class PooledHead(nn.Module):
    """``fc(bn(mean(relu(conv(x)))))``: a BatchNorm before the classifier of pooled features (the BNNeck of
    re-identification models); its input is a mean, so it folds forward only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3)
        self.bn = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(torch.relu(self.conv(x)).mean(dim=(2, 3))))


def _statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics within a factor 2 of one another (scale spread below the limit)."""
    gen = torch.Generator().manual_seed(seed)
    bn = model.bn
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(C, generator=gen) * 0.3)
        bn.running_var.copy_(0.5 + torch.rand(C, generator=gen))
        bn.weight.copy_(1 + 0.2 * torch.randn(C, generator=gen))
        bn.bias.copy_(0.1 * torch.randn(C, generator=gen))
    return model.eval()


def _outlier(model: nn.Module, channel: int = 3, k: float = 1e3) -> nn.Module:
    """The same function with channel ``channel`` of the norm's input ``k`` times larger: its producer's output
    row scaled by ``k`` (ReLU and the mean commute with a positive scale) and the statistics with it, so that
    the norm's scale for that channel is about ``k`` times smaller (one tiny channel scale)."""
    out = copy.deepcopy(model)
    producer = out.fc1 if isinstance(out, Bottleneck) else out.conv
    with torch.no_grad():
        producer.weight[channel] *= k
        producer.bias[channel] *= k
        out.bn.running_mean[channel] *= k
        out.bn.running_var[channel] *= k * k
    return out


def _fold(model: nn.Module, x: torch.Tensor) -> tuple[list[engine.Decision], engine.FoldProgram, dict]:
    gm = capture(model, x)
    original = {k: v.detach().clone() for k, v in gm.state_dict().items()}
    decisions, program = fold_program(gm)
    return decisions, program, original


def _scale(bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    return fold.repbn_affine(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)[0]


def test_a_forward_fold_is_measured_in_the_units_of_the_input_it_scales_least() -> None:
    model = _statistics(PooledHead())
    decisions, program, original = _fold(model, torch.randn(2, 3, 6, 6))
    assert [d.action for d in decisions] == ["folded-forward"]
    (r,) = program.ranges.values()
    w = original["fc.weight"].double()
    s = _scale(model.bn)
    fused = w * s
    growth = fused.abs().amax(1) / w.abs().amax(1)
    step = growth / s.abs().min()
    assert r.layer == "fc" and r.channels == 5 and r.folds == [{"norm": "bn", "direction": "forward"}]
    assert r.tensor_original == pytest.approx(float(w.abs().max()), rel=1e-12)
    assert r.tensor_fused == pytest.approx(float(fused.abs().max()), rel=1e-12)
    assert r.growth_min == pytest.approx(float(growth.min()), rel=1e-12)
    assert r.growth_max == pytest.approx(float(growth.max()), rel=1e-12)
    assert r.step_growth == pytest.approx(float(step.max()), rel=1e-12)
    assert r.worst_channel == int(step.argmax())
    tensor_step = float(fused.abs().max() / w.abs().max() / s.abs().min())
    assert r.step_growth_tensor == pytest.approx(tensor_step, rel=1e-12)
    assert 1 <= r.step_growth <= spread(s) * (1 + 1e-12)  # the bound the planner decides by
    assert not r.flagged and not decisions[0].warnings and decisions[0].direction is None


def test_a_backward_fold_costs_per_channel_int8_nothing() -> None:
    """A backward fold scales whole rows: each row's range and its magnification move together (step growth 1),
    whatever the spread; the per-tensor step does grow with it."""
    model = _statistics(Bottleneck())
    with torch.no_grad():
        model.bn.weight.copy_(torch.linspace(0.05, 5, C))  # a spread of 100, above the limit: folds backward
    decisions, program, original = _fold(model, torch.randn(4, 8))
    assert [d.action for d in decisions] == ["folded-backward"] and decisions[0].into == ["fc1"]
    (r,) = program.ranges.values()
    s = _scale(model.bn)
    w = original["fc1.weight"].double()
    assert r.folds == [{"norm": "bn", "direction": "backward"}]
    assert r.step_growth == pytest.approx(1.0, rel=1e-12)
    assert r.growth_max == pytest.approx(float(s.abs().max()), rel=1e-12)
    rows = (w * s[:, None]).abs().amax(1)
    tensor_step = float(rows.max() / w.abs().max() / s.abs().min())
    assert r.step_growth_tensor == pytest.approx(tensor_step, rel=1e-12) and r.step_growth_tensor > 10


def test_a_uniform_scale_costs_nothing() -> None:
    model = _statistics(PooledHead())
    with torch.no_grad():
        model.bn.running_var.fill_(1e-2)  # every channel scaled by about 10: the ranges grow 10x, the steps not
        model.bn.weight.fill_(1.0)
    _, program, _ = _fold(model, torch.randn(2, 3, 6, 6))
    (r,) = program.ranges.values()
    assert r.growth_min > 9 and r.step_growth == pytest.approx(1.0, rel=1e-9)


def test_one_tiny_channel_scale_folded_forward_is_flagged_and_named() -> None:
    model = _outlier(_statistics(PooledHead()))
    decisions, program, _ = _fold(model, torch.randn(2, 3, 6, 6))
    (d,) = decisions
    (r,) = program.ranges.values()
    assert d.action == "folded-forward"  # no backward fold exists: the input is a mean
    assert r.flagged and r.step_growth > 50 * STEP_GROWTH_LIMIT
    assert d.direction is not None and d.direction.startswith("forward:") and "cannot fold backward" in d.direction
    (warning,) = [w for w in d.warnings if w.startswith("int8:")]
    assert "fc" in warning and f"{r.step_growth:.3g}x" in warning and f"{STEP_GROWTH_LIMIT:g}x" in warning


def test_a_norm_that_can_fold_either_way_folds_backward_when_forward_would_be_flagged() -> None:
    """The same function, two scale spreads: within the limit the norm folds forward (the existing behaviour),
    with one tiny channel scale it folds backward and no layer is flagged; both folds are exact."""
    ordinary = _statistics(Bottleneck())
    outlier = _outlier(ordinary)
    x = torch.randn(32, 8)
    assert spread(_scale(ordinary.bn)) <= STEP_GROWTH_LIMIT < spread(_scale(outlier.bn))
    decisions, program, _ = _fold(ordinary, x)
    assert [(d.action, d.into, d.direction) for d in decisions] == [("folded-forward", ["fc2"], None)]
    decisions, program, _ = _fold(outlier, x)
    (d,) = decisions
    assert (d.action, d.into) == ("folded-backward", ["fc1"])
    assert d.direction is not None and d.direction.startswith("backward: both directions are exact")
    assert not any(r.flagged for r in program.ranges.values())
    gm = capture(outlier, x)
    fold_program(gm)
    with torch.no_grad():
        assert torch.allclose(gm(x), outlier(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_ranges_are_the_same_block_by_block(which: str) -> None:
    """The streamed writer measures ranges one block of rows at a time: the result is the whole tensor's (a
    backward fold's magnification depends on which rows a block holds)."""
    if which == "forward":
        model, x = _outlier(_statistics(PooledHead())), torch.randn(2, 3, 6, 6)
    else:
        model, x = _outlier(_statistics(Bottleneck())), torch.randn(4, 8)
    gm = capture(model, x)
    original = {k: v.detach().clone() for k, v in gm.state_dict().items()}
    _, program = fold_program(gm)
    whole = dict(program.ranges)
    program.ranges.clear()
    evaluate(program, TensorStore(original), block_elements=8)  # one row at a time
    assert {k: r.to_dict() for k, r in program.ranges.items()} == {k: r.to_dict() for k, r in whole.items()}
    (la,) = program.layers.values()
    tally = RangeTally(la)
    store = TensorStore(original)
    for _ in la.blocks(store, 24, scratch=engine.program.Scratch(), tally=tally):  # the writer's path, 2-3 rows
        pass
    assert tally.result().to_dict() == whole[la.weight].to_dict()


def test_the_onnx_door_chooses_the_same_direction(tmp_path) -> None:
    """An ONNX export of the same two models: the same decisions as the checkpoint's (``slabconv.onnx_in``)."""
    from slabconv import api

    x = torch.randn(4, 8)
    for model in (_statistics(Bottleneck()), _outlier(_statistics(Bottleneck()))):
        path = tmp_path / "m.onnx"
        torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"])
        (d,) = api.inspect(path).folds or []
        (expected,) = _fold(model, x)[0]
        assert d.action == expected.action
        assert (d.direction or "").split(":")[0] == (expected.direction or "").split(":")[0]


class EmbedNorm(nn.Module):
    """``relu(bn(emb(ids)))``: the ReLU blocks a forward fold, so the norm folds backward into the embedding table,
    whose columns it scales and whose rows it shifts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, C)
        self.bn = nn.BatchNorm1d(C)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.emb(ids).transpose(1, 2)).transpose(1, 2))


def test_an_embedding_table_is_measured_in_the_units_of_its_columns() -> None:
    model = _statistics(EmbedNorm())
    decisions, program, original = _fold(model, torch.randint(0, 50, (2, 7)))
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["emb"])]
    (r,) = program.ranges.values()
    w = original["emb.weight"].double()
    s, t = fold.repbn_affine(model.bn.running_mean, model.bn.running_var, model.bn.eps, model.bn.weight, model.bn.bias)
    growth = (w * s + t).abs().amax(1) / w.abs().amax(1)
    assert r.growth_max == pytest.approx(float(growth.max()), rel=1e-12)
    assert r.step_growth == pytest.approx(float((growth / s.abs().min()).max()), rel=1e-12)


class UpNorm(nn.Module):
    """``relu(bn(up(x)))`` with ``up`` a transposed conv of 2 groups: the norm folds backward into the columns of
    its ``(C_in, C / 2, 2, 2)`` weight, the output channels int8 steps it by (axis 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(6, C, 2, stride=2, groups=2)
        self.bn = nn.BatchNorm2d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.up(x)))


def test_a_transposed_conv_is_measured_per_output_channel_where_its_backward_fold_costs_nothing() -> None:
    """Its rows are its input channels; measured per row, the fold's spread (here 100) would be its cost. Per output
    channel (each group's columns), as per-channel int8 steps it, the fold scales whole channels: step growth 1, in
    one block and one row at a time."""
    model = _statistics(UpNorm())
    with torch.no_grad():
        model.bn.weight.copy_(torch.linspace(0.05, 5, C))
    x = torch.randn(2, 6, 3, 3)
    decisions, program, original = _fold(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["up"])]
    (r,) = program.ranges.values()
    s = _scale(model.bn)
    w = original["up.weight"].double()  # (6, 8, 2, 2): output channel o = (row // 3) * 8 + column
    channels = torch.stack([w[g * 3 : (g + 1) * 3, j].abs().max() for g in range(2) for j in range(C // 2)])
    assert r.channels == C and r.step_growth == pytest.approx(1.0, rel=1e-12) and not r.flagged
    assert r.growth_max == pytest.approx(float(s.abs().max()), rel=1e-12)
    assert r.tensor_original == pytest.approx(float(channels.max()), rel=1e-12)
    assert r.step_growth_tensor > 10
    whole = r.to_dict()
    program.ranges.clear()
    evaluate(program, TensorStore(original), block_elements=32)  # one row at a time
    assert program.ranges["up.weight"].to_dict() == whole
