"""A model slabconv has never seen, as a user brings it: defined here, exported with torch.export.save, fused
through the console app. The fused ONNX is checked against the original module here, independently of
slabconv's own verification."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from slabconv.cli import app
from tests.conftest import op_histogram, randomize_norms

pytestmark = pytest.mark.slow


class RepBNNLP(nn.Module):
    """The seed's RepBN_NLP: BatchNorm1d over the embedding axis of (batch, seq, embed), plus alpha * x."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        return (self.bn(x) + self.alpha * x).transpose(1, 2)


class Tagger(nn.Module):
    """Pre-norm block into two heads, then a post-norm (after the residual add) that the residual also reads."""

    def __init__(self, dim: int = 24, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(12, dim)
        self.norm_in = RepBNNLP(dim)
        self.ff = nn.Linear(dim, dim)
        self.norm_post = RepBNNLP(dim)
        self.tag = nn.Linear(dim, classes)
        self.score = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.norm_post(h + torch.relu(self.ff(self.norm_in(h))))
        h = h + torch.tanh(h)  # the residual reads the normalised tensor
        return torch.cat([self.tag(h), self.score(h)], dim=-1).mean(dim=1)


def test_fuse_a_custom_pt2_exactly(tmp_path):
    torch.manual_seed(0)
    model = randomize_norms(Tagger(), seed=3).eval()
    x = torch.randn(6, 10, 12)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, tmp_path / "tagger.pt2")

    result = CliRunner().invoke(app, ["fuse", str(tmp_path / "tagger.pt2"), "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    folds = {f["norm"]: f for f in report["folds"]}
    assert folds["norm_in"]["action"] == "folded-forward" and folds["norm_in"]["into"] == ["ff"]
    assert folds["norm_post"]["action"] == "kept-affine"
    assert {p["reason"] for p in folds["norm_post"]["paths"]} == {"residual-reads-norm", "nonlinear-before-consumer"}
    assert folds["norm_post"]["reason"] == folds["norm_post"]["paths"][0]["reason"]
    assert report["verification"]["passed"] and report["verification"]["max_rel_err"] <= 1e-5

    onnx_path = tmp_path / "out" / "model.onnx"
    assert op_histogram(onnx_path)["BatchNormalization"] == 0
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for batch in (1, 7):  # the batch axis is dynamic
        xb = torch.randn(batch, 10, 12)
        expected = model(xb).detach().numpy()
        got = session.run(None, {session.get_inputs()[0].name: xb.numpy()})[0]
        assert np.abs(got - expected).max() / np.abs(expected).max() <= 1e-5
