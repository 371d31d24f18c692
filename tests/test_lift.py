"""The fused graph lifted back into a program of the original's capture (``engine.lift_program``) is the program a
second ``torch.export`` of the fused graph gives: the same signature, the same outputs at other batch sizes and
lengths, the same after ``torch.export.save`` / ``load`` and after the ONNX translation. Where the graph holds
what the lift does not cover, it returns None and the writer traces again."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from slabconv import engine, pipeline
from slabconv.load.checkpoint import Checkpoint
from slabconv.load.model import LoadedModel
from slabconv.verify.reference import cast_graph, float64_fold
from slabconv.write.pt2 import export_program
from tests.conftest import randomize_norms, small_vit
from tests.test_llama import TINY, tiny_model
from tests.test_refusals import DecayingGain, ResidualReadsNorm


class ConvBN(nn.Module):
    """conv -> BatchNorm2d (folds backward into the conv) -> ReLU -> BatchNorm2d (forward into a bias-free
    conv, which gets a bias) -> pool -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.bn2, self.conv2 = nn.BatchNorm2d(6), nn.Conv2d(6, 8, 1, bias=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.bn2(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(y.mean((2, 3)))


def _loaded(model: nn.Module, shape: tuple[int, ...], tokens: bool = False) -> LoadedModel:
    model = randomize_norms(model).eval()
    module = Checkpoint({}, {}, "pickled-module", Path("model.pt"), "", module=model)  # a module, not a program
    if tokens:
        return LoadedModel(model, module, None, shape, torch.float32, input_dtype=torch.int64, sequence=16)
    return LoadedModel(model, module, None, shape, torch.float32)


CASES = {
    "vit": lambda: _loaded(small_vit("repbn"), (1, 8, 8)),
    "conv-bn": lambda: _loaded(ConvBN(), (1, 6, 6)),
    "kept-affine": lambda: _loaded(ResidualReadsNorm(), (9, 8)),
    "llama": lambda: _loaded(tiny_model(), (16,), tokens=True),
}


def _inputs(loaded: LoadedModel, batch: int, length: int | None = None) -> torch.Tensor:
    if loaded.input_dtype == torch.int64:
        return torch.randint(
            0, TINY.vocab_size, (batch, length or loaded.input_shape[0]), generator=torch.Generator().manual_seed(3)
        )
    return torch.randn(batch, *loaded.input_shape, generator=torch.Generator().manual_seed(3))


def _specs(program: torch.export.ExportedProgram) -> list[tuple[object, ...]]:
    sig = program.graph_signature
    return [(s.kind, s.target, s.persistent) for s in sig.input_specs] + [(s.kind, s.target) for s in sig.output_specs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_lifted_program_is_the_one_a_second_export_gives(case: str) -> None:
    loaded = CASES[case]()
    planned = pipeline.plan(loaded)
    assert planned.exported is not None
    lifted = engine.lift_program(planned.fused, planned.exported)
    assert lifted is not None
    traced, info = export_program(planned.fused, planned.example)  # no original: traced again
    assert _specs(lifted) == _specs(traced)
    assert export_program(planned.fused, planned.example, planned.exported)[1] == info
    buffer = io.BytesIO()
    torch.export.save(lifted, buffer)
    buffer.seek(0)
    reloaded = torch.export.load(buffer).module()
    sizes = [(1, None), (5, None)] + ([(2, 7)] if case == "llama" else [])  # other batches; a shorter length
    with torch.no_grad():
        for batch, length in sizes:
            x = _inputs(loaded, batch, length)
            expected = planned.fused(x)
            assert torch.equal(lifted.module()(x), expected)
            assert torch.equal(reloaded(x), expected)
            assert torch.equal(traced.module()(x), expected)
    onnx_lifted = torch.onnx.export(lifted, dynamo=True, verbose=False).model_proto  # type: ignore[union-attr]
    onnx_traced = torch.onnx.export(traced, dynamo=True, verbose=False).model_proto  # type: ignore[union-attr]
    assert sorted(i.name for i in onnx_lifted.graph.initializer) == sorted(
        i.name for i in onnx_traced.graph.initializer
    )
    feed = _inputs(loaded, 3).numpy()
    runs = []
    for proto in (onnx_lifted, onnx_traced):
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        runs.append(session.run(None, {session.get_inputs()[0].name: feed})[0])
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_graph_that_writes_a_tensor_is_traced_again() -> None:
    """A forward that updates a stored tensor in place: a program returns such an update as an extra output, which
    the lift does not make; it leaves the graph to ``torch.export``."""
    loaded = _loaded(DecayingGain(), (9, 8))
    planned = pipeline.plan(loaded)
    assert planned.exported is not None
    assert engine.lift_program(planned.fused, planned.exported) is None
    program, _ = export_program(planned.fused, planned.example, planned.exported)
    x = _inputs(loaded, 3)
    fused = copy.deepcopy(planned.fused)  # before the program runs: it may update the tensors it shares
    with torch.no_grad():
        assert torch.equal(program.module()(x), fused(x))  # the first run of each


def test_a_graph_retyped_after_capture_is_traced_again() -> None:
    """``fuse --dtype`` writes the float64 fold cast to float16: its nodes' metadata still says float64, which a
    lifted program would carry into ``model.onnx``'s types; the lift refuses it, and the traced program runs in
    float16."""
    loaded = CASES["vit"]()
    planned = pipeline.plan(loaded)
    assert planned.original is not None and planned.exported is not None
    cast = cast_graph(float64_fold(planned.original, planned.example)[1], torch.float16)
    assert engine.lift_program(cast, planned.exported) is None
    program, _ = export_program(cast, planned.example.half(), planned.exported)
    user = [n for n in program.graph.nodes if n.op == "placeholder"][-1]
    assert user.meta["val"].dtype == torch.float16
