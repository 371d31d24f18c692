"""The training-time modules have the official SLAB state_dict layout and behaviour."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from slabconv.zoo.norms import LinearNorm, RepBN, RMSNorm


def test_repbn_keys_and_forward():
    norm = RepBN(6).eval()
    assert set(norm.state_dict()) == {
        "alpha",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    }
    assert norm.alpha.shape == (1,) and norm.bn.eps == 1e-5
    x = torch.randn(2, 5, 6)
    expected = norm.bn(x.transpose(1, 2)).transpose(1, 2) + norm.alpha * x
    torch.testing.assert_close(norm(x), expected)


def test_linearnorm_keys_match_the_official_layout():
    norm = LinearNorm(8, partial(nn.LayerNorm, eps=1e-6), RepBN, warm=2, step=4)
    keys = set(norm.state_dict())
    assert {"warm", "iter", "total_step", "norm1.weight", "norm1.bias", "norm2.alpha", "norm2.bn.running_var"} <= keys
    assert norm.iter.dtype == torch.int64 and int(norm.total_step) == 4


def test_linearnorm_schedule_counts_down_and_eval_is_repbn():
    norm = LinearNorm(4, nn.LayerNorm, RepBN, warm=2, step=3)
    x = torch.randn(3, 5, 4)
    blend = []
    for _ in range(7):
        blend.append(norm.blend_weight())
        norm(x)
    assert blend == [1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0, 0.0]
    assert int(norm.warm) == 0 and int(norm.iter) == 0
    norm.eval()
    torch.testing.assert_close(norm(x), norm.norm2(x))


def test_rmsnorm_matches_its_formula():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(2, 3, 8)
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)
