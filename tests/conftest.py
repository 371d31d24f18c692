"""Shared helpers: small random-statistics models of the zoo, ONNX op histograms, the real fixture's paths."""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from slabconv.zoo.deit import VisionTransformer, norm_factory

ROOT = Path(__file__).resolve().parents[1]

# transformers copies a folder's modeling file into a module cache: keep it out of the user's home, and never
# let a test reach the network.
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="slabconv-hf-modules-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
FIXTURE = ROOT / "fixtures" / "digits-prepbn"


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random eval statistics and affine weights, and every RepBN a random alpha,
    so a fold that drops or misplaces any term shows up in the outputs. Progressive counters are set to 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                c = mod.num_features
                mod.running_mean.copy_(torch.randn(c, generator=gen))
                mod.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.2)
                if mod.affine:
                    mod.weight.copy_(torch.randn(c, generator=gen))
                    mod.bias.copy_(torch.randn(c, generator=gen))
            if hasattr(mod, "alpha") and isinstance(mod.alpha, nn.Parameter):
                mod.alpha.copy_(torch.randn(1, generator=gen))
            for counter in ("warm", "iter"):
                if isinstance(getattr(mod, counter, None), torch.Tensor):
                    getattr(mod, counter).zero_()
    return model


def small_vit(layout: str = "linearnorm", global_pool: str = "token", seed: int = 0, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    model = VisionTransformer(
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        embed_dim=32,
        depth=depth,
        num_heads=4,
        mlp_ratio=2.0,
        norm_layer=norm_factory(layout),
        global_pool=global_pool,
    )
    return randomize_norms(model, seed).eval()


def op_histogram(path: Path) -> collections.Counter[str]:
    """ONNX op types of the main graph and every local function, counted."""
    model = onnx.load(str(path))
    counts = collections.Counter(n.op_type for n in model.graph.node)
    for fn in model.functions:
        counts.update(n.op_type for n in fn.node)
    return counts


@pytest.fixture(scope="session")
def fixture_ckpt() -> Path:
    path = FIXTURE / "checkpoint.pth"
    assert path.exists(), "the committed fixture is missing; run `make fixtures`"
    return path
