"""Norms recognised by the value they compute (``slabconv.engine.norms``): every way of writing ``BN(x) + alpha x``
is one RepBN; torchvision-style ``FrozenBatchNorm2d``, MobileBERT's ``NoNorm``, LayerScale and constant per-channel
affines are norms with the same decisions as a BatchNorm; products and sums that are not per-channel affines of a
channel axis are not norms. Every fold is checked numerically (float32, and float64 where noted); every refusal
shows that the naive fold would be wrong."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv.engine import capture, find_norms, fold_all, fused_state_dict, norm_free, reasons
from slabconv.zoo.norms import RepBN, RMSNorm
from tests.conftest import small_vit
from tests.foldcheck import NAIVE_MIN_ERR, TOL, aten_ops, bn_nodes, kept_affines, randomize, rel_err

C, N, B = 8, 6, 4
F64 = 1e-12  # float64 models: the fold is exact up to float64 rounding


def tokens(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, n, C, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fold(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list, torch.Tensor]:
    model = model.eval()
    reference = model(x)
    gm = capture(model, x)
    return gm, fold_all(gm), reference


# --------------------------------------------------------------------------------------------- RepBN by value


class RepBNWritten(nn.Module):
    """``BN(x) + alpha x`` over the channels of ``(B, N, C)``, written in several ways; the transposes are two
    separate calls, so the exported graph has two transpose nodes of the same tensor."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.bn = nn.BatchNorm1d(C)
        self.alpha = nn.Parameter(torch.tensor([0.7]))
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "two_transposes":
            y = self.bn(x.transpose(1, 2)) + self.alpha * x.transpose(1, 2)
        elif self.how == "alpha_first":
            y = self.alpha * x.transpose(1, 2) + self.bn(x.transpose(1, 2))
        elif self.how == "times_alpha":
            y = self.bn(x.transpose(1, 2)) + x.transpose(1, 2) * self.alpha
        elif self.how == "minus":
            y = self.bn(x.transpose(1, 2)) - self.alpha * x.transpose(1, 2)
        elif self.how == "after_pair":  # jax2onnx's RepBN: alpha x added after the transpose back
            return self.fc(self.bn(x.transpose(1, 2)).transpose(1, 2) + self.alpha * x)
        elif self.how == "tokens_of_a_map":  # the tokens are a (B, C, N) map transposed: the TorchScript exporter
            # drops the transpose pair before the BN, which then reads the map, and alpha reads its transpose
            t = torch.relu(x.transpose(1, 2)).transpose(1, 2)
            return self.fc(self.bn(t.transpose(1, 2)).transpose(1, 2) + self.alpha * t)
        else:
            assert self.how == "contiguous"
            y = self.bn(x.transpose(1, 2).contiguous()) + self.alpha * x.transpose(1, 2).contiguous()
        return self.fc(y.transpose(1, 2))


@pytest.mark.parametrize(
    "how", ["two_transposes", "alpha_first", "times_alpha", "minus", "contiguous", "after_pair", "tokens_of_a_map"]
)
def test_repbn_written_with_two_transposes_is_one_repbn(how):
    """Before: two plain BatchNorm decisions were impossible to make exact, the BN was kept with
    ``residual-reads-norm`` before the add. Now one RepBN, folded forward into ``fc``."""
    model = randomize(RepBNWritten(how)).eval()
    x = tokens()
    # the BatchNorm alone, folded as if the alpha x term were not there, is wrong
    from slabconv.fold import fold_into_linear, repbn_affine

    s, t = repbn_affine(model.bn.running_mean, model.bn.running_var, model.bn.eps, model.bn.weight, model.bn.bias)
    naive = copy.deepcopy(model)
    naive.bn = nn.Identity()
    naive.alpha.data.zero_()
    with torch.no_grad():
        w, b = fold_into_linear(model.fc.weight, model.fc.bias, s, t)
        naive.fc.weight.copy_(w)
        naive.fc.bias.copy_(b)
    assert rel_err(naive(x), model(x)) > NAIVE_MIN_ERR
    bare = aten_ops(norm_free(capture(model, x)))
    gm, decisions, reference = fold(model, x)
    (d,) = decisions
    assert (d.kind, d.action, d.into, d.reason) == ("RepBN", "folded-forward", ["fc"], None)
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert aten_ops(gm) == bare  # the norm-free graph: the BN, the alpha term, a transpose pair are gone
    if how == "tokens_of_a_map":
        assert aten_ops(gm) == {"linear.default": 1, "relu.default": 1, "permute": 2}
    elif how != "contiguous":
        assert aten_ops(gm) == {"linear.default": 1}


class MapReadTwice(nn.Module):
    """A BatchNorm on a ``(B, C, N)`` map, transposed into ``fc``, and the map transposed alike again into ``fc2``
    (after it): the BN's transposed affine is also one of that second transpose, but no sum joins them."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)
        self.fc, self.fc2 = nn.Linear(C, 5), nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x.transpose(1, 2))
        return self.fc(self.bn(y).transpose(1, 2)) + self.fc2(y.transpose(1, 2))


def test_a_batchnorm_whose_input_another_layer_reads_transposed_folds_forward_alone():
    """The BN folds forward into ``fc`` through its transpose, ``fc`` reading the transpose of ``y`` that its own
    path computes: taking the BN as an affine of ``fc2``'s transpose of ``y`` (computed after ``fc``) raised
    ``AssertionError: no node of [batch_norm, transpose_1] reads transpose_2``."""
    model = randomize(MapReadTwice()).eval()
    x = tokens()
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [("bn", "BatchNorm", "folded-forward", ["fc"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class PermutedNotBack(nn.Module):
    """``permute(BN2d(permute(x, p)), q) + alpha x`` on ``x: (B, S, S, S)`` where ``q`` does not undo ``p``: the
    sum has ``x``'s shape, but its first term reads ``x`` at permuted positions, so it is no affine of ``x``."""

    def __init__(self, back: tuple[int, ...]) -> None:
        super().__init__()
        self.back = back
        self.bn = nn.BatchNorm2d(4)
        self.alpha = nn.Parameter(torch.tensor([0.7]))
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x.permute(0, 3, 1, 2)).permute(*self.back) + self.alpha * x)


def permuted_input() -> torch.Tensor:
    return torch.randn(B, 4, 4, 4, generator=gen(0)) * 2 + 0.5


def test_a_permute_that_does_not_undo_the_first_leaves_the_batchnorm_a_norm_of_its_own():
    """``(0, 3, 1, 2)`` twice is not the identity: the RepBN reading of the sum (the BN's affine on ``x``'s last
    axis, plus alpha) is far off, so the BN stays a BatchNorm kept before the sum (``residual-reads-norm``); with
    the inverse ``(0, 2, 3, 1)`` the same model is one RepBN, folded forward. ``alpha x`` alone is then a learned
    scalar affine before the same sum, kept for the same reason."""
    from slabconv.fold import fold_into_linear, repbn_affine

    x = permuted_input()
    for back, expected in (((0, 3, 1, 2), ("BatchNorm", "kept-affine")), ((0, 2, 3, 1), ("RepBN", "folded-forward"))):
        model = randomize(PermutedNotBack(back)).eval()
        s, t = repbn_affine(model.bn.running_mean, model.bn.running_var, model.bn.eps, model.bn.weight, model.bn.bias)
        naive = copy.deepcopy(model).double()
        naive.bn, naive.back = nn.Identity(), (0, 2, 3, 1)
        with torch.no_grad():
            w, b = fold_into_linear(model.fc.weight.double(), model.fc.bias.double(), s + model.alpha.double(), t)
            naive.alpha.zero_()
            naive.fc.weight.copy_(w)
            naive.fc.bias.copy_(b)
        naive_err = rel_err(naive(x.double()), model.double()(x.double()))
        model.float()
        gm, decisions, reference = fold(model, x)
        d = decisions[0]
        assert (d.norm, d.kind, d.action) == ("bn", *expected)
        if back == (0, 3, 1, 2):  # alpha x alone: a learned scalar beside the BN's output, kept as that BN is
            assert [(e.norm, e.kind, e.action, e.reason) for e in decisions[1:]] == [
                ("alpha", "LayerScale", "kept-affine", reasons.RESIDUAL_READS_NORM)
            ]
        else:
            assert len(decisions) == 1
        assert rel_err(gm(x), reference) <= TOL[torch.float32]
        if d.action == "kept-affine":
            assert d.reason == reasons.RESIDUAL_READS_NORM
            assert naive_err > NAIVE_MIN_ERR
        else:
            assert naive_err < F64  # the RepBN reading is the model itself where the permutes cancel
            assert aten_ops(gm) == {"linear.default": 1}


def test_repbn_parameters_are_reported_with_their_stored_names():
    model = randomize(RepBNWritten("two_transposes")).eval()
    (site,) = find_norms(capture(model, tokens()))
    assert site.kind == "RepBN"
    assert site.param_names == {
        "weight": "bn.weight",
        "bias": "bn.bias",
        "running_mean": "bn.running_mean",
        "running_var": "bn.running_var",
        "alpha": "alpha",
    }
    assert site.params["alpha"] is model.alpha


# --------------------------------------------------------------------------------------------- FrozenBatchNorm


class FrozenBatchNorm2d(nn.Module):
    """torchvision's ``FrozenBatchNorm2d``, written from its documented behaviour: BatchNorm2d with fixed
    statistics and affine parameters in buffers; ``x * scale + shift`` computed in the forward."""

    def __init__(self, c: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(c))
        self.register_buffer("bias", torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


def randomize_frozen(model: nn.Module, seed: int = 0) -> nn.Module:
    g = gen(seed)
    for m in model.modules():
        if isinstance(m, FrozenBatchNorm2d):
            c = m.weight.numel()
            m.weight.copy_(torch.randn(c, generator=g))
            m.bias.copy_(torch.randn(c, generator=g))
            m.running_mean.copy_(torch.randn(c, generator=g))
            m.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
    return model


class FrozenNet(nn.Module):
    """ResNet-style ``relu(bn(conv(x)))`` with frozen BNs: one after a private conv (backward), one feeding a
    1x1 conv (forward) and one feeding a padded 3x3 conv (refused)."""

    def __init__(self, third: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, C, 3, padding=1, bias=False)
        self.bn1 = FrozenBatchNorm2d(C)
        self.bn2 = FrozenBatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 1) if third == "pointwise" else nn.Conv2d(C, C, 3, padding=1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(img)))
        return self.conv2(self.bn2(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frozen_batchnorm_folds_backward_and_forward(dtype):
    model = randomize_frozen(FrozenNet("pointwise")).to(dtype)
    img = torch.randn(B, 3, 6, 6, generator=gen(), dtype=dtype)
    gm, decisions, reference = fold(model, img)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("bn1", "FrozenBatchNorm", "folded-backward", ["conv1"]),
        ("bn2", "FrozenBatchNorm", "folded-forward", ["conv2"]),
    ]
    assert rel_err(gm(img), reference) <= (TOL[torch.float32] if dtype == torch.float32 else F64)
    assert not [k for k in fused_state_dict(gm) if k.startswith(("bn1.", "bn2."))]
    assert aten_ops(gm) == {"conv2d.default": 2, "relu.default": 1}


def test_frozen_batchnorm_before_a_padded_conv_keeps_its_affine():
    model = randomize_frozen(FrozenNet("padded")).eval()
    img = torch.randn(B, 3, 6, 6, generator=gen())
    reference = model(img)
    naive = copy.deepcopy(model)  # fold bn2 into the padded conv2 anyway
    scale = model.bn2.weight * (model.bn2.running_var + model.bn2.eps).rsqrt()
    shift = model.bn2.bias - model.bn2.running_mean * scale
    from slabconv.fold import fold_into_conv

    with torch.no_grad():
        w, b = fold_into_conv(model.conv2.weight, model.conv2.bias, scale, shift)
        naive.conv2.weight.copy_(w)
        naive.conv2.bias.copy_(b)
    naive.bn2 = nn.Identity()
    assert rel_err(naive(img), reference) > NAIVE_MIN_ERR
    gm, decisions, _ = fold(model, img)
    assert [(d.kind, d.action, d.reason) for d in decisions] == [
        ("FrozenBatchNorm", "folded-backward", None),
        ("FrozenBatchNorm", "kept-affine", reasons.PADDED_CONV_CONSUMER),
    ]
    assert rel_err(gm(img), reference) <= TOL[torch.float32]
    assert len(kept_affines(gm)) == 1


def test_frozen_batchnorm_in_bfloat16():
    torch.manual_seed(0)
    model = randomize_frozen(FrozenNet("pointwise")).eval()
    img = torch.randn(B, 3, 6, 6, generator=gen())
    truth = copy.deepcopy(model).double()(img.double())
    half = copy.deepcopy(model).to(torch.bfloat16)
    gm, decisions, reference = fold(half, img.to(torch.bfloat16))
    assert [d.action for d in decisions] == ["folded-backward", "folded-forward"]
    own = rel_err(reference, truth)
    assert rel_err(gm(img.to(torch.bfloat16)), truth) <= max(TOL[torch.bfloat16], 1.5 * own)


# --------------------------------------------------------------------------------------------- NoNorm, Affine


class NoNorm(nn.Module):
    """MobileBERT's ``NoNorm``: ``x * weight + bias`` over the last axis."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, generator=gen(3)))
        self.bias = nn.Parameter(torch.randn(c, generator=gen(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class MobileBertStyle(nn.Module):
    """A bottleneck ``NoNorm(dense(x))`` (backward into ``dense``) and a post-residual ``NoNorm(h + x)`` that
    feeds ``fc`` and the next residual (folded into ``fc``, kept on the residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(C, C)
        self.bottleneck_norm = NoNorm(C)
        self.fc = nn.Linear(C, C)
        self.out_norm = NoNorm(C)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.bottleneck_norm(self.dense(x)))
        y = self.out_norm(h + x)
        return self.head(y + self.fc(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonorm_is_an_affine_norm(dtype):
    model = MobileBertStyle().to(dtype)
    x = tokens().to(dtype)
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into, d.reason) for d in decisions] == [
        ("bottleneck_norm", "Affine", "folded-backward", ["dense"], None),
        ("out_norm", "Affine", "kept-affine", ["fc"], reasons.RESIDUAL_READS_NORM),
    ]
    assert rel_err(gm(x), reference) <= (TOL[torch.float32] if dtype == torch.float32 else F64)
    assert len(kept_affines(gm)) == 1


def test_nonorm_before_a_residual_cannot_be_folded_into_the_next_linear():
    """The naive fold of ``out_norm`` into ``fc`` ignores the residual that reads it."""
    model = MobileBertStyle().eval()
    x = tokens()
    naive = copy.deepcopy(model)
    naive.out_norm = nn.Identity()
    with torch.no_grad():
        naive.fc.bias.add_(model.fc.weight @ model.out_norm.bias)
        naive.fc.weight.mul_(model.out_norm.weight)
    assert rel_err(naive(x), model(x)) > NAIVE_MIN_ERR


class ChannelAffine(nn.Module):
    """``fc(x * w + b)`` with constant buffers on the channel axis, and a channels-first ``conv -> * w + b``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(C, generator=gen(5)))
        self.register_buffer("b", torch.randn(C, generator=gen(6)))
        self.fc = nn.Linear(C, 4)
        self.conv = nn.Conv1d(N, C, 1)
        self.register_buffer("w2", torch.randn(C, 1, generator=gen(7)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.fc(x * self.w + self.b)
        second = F.relu(self.conv(x) * self.w2)  # (B, C, C): w2 on axis 1, the conv's output channels
        return first, second


def test_constant_per_channel_affines_fold_like_norms():
    model = ChannelAffine().eval()
    x = tokens()
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("w", "Affine", "folded-forward", ["fc"]),
        ("w2", "LayerScale", "folded-backward", ["conv"]),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert aten_ops(gm) == {"linear.default": 1, "conv1d.default": 1, "relu.default": 1}


# --------------------------------------------------------------------------------------------- LayerScale


class LayerScaleBlock(nn.Module):
    """``x + gamma * branch(x)``: the branch ends in a private Linear (``mlp``) or in a GELU (``gelu``)."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch
        self.fc1 = nn.Linear(C, 2 * C)
        self.fc2 = nn.Linear(2 * C, C)
        self.gamma = nn.Parameter(torch.randn(C, generator=gen(8)))
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(x)))
        if self.branch == "gelu":
            h = F.gelu(h)
        return self.head(x + self.gamma * h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layerscale_after_a_private_linear_folds_backward(dtype):
    model = LayerScaleBlock("mlp").to(dtype)
    x = tokens().to(dtype)
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("gamma", "LayerScale", "folded-backward", ["fc2"])
    ]
    assert rel_err(gm(x), reference) <= (TOL[torch.float32] if dtype == torch.float32 else F64)
    assert "gamma" not in fused_state_dict(gm)


def test_layerscale_before_a_residual_without_a_producer_is_kept_as_it_was():
    """Folding ``gamma`` into ``head`` (the next Linear) would scale the residual ``x`` too: it stays, as a single
    multiply (its shift is zero), and the graph has the same ops as the original."""
    model = LayerScaleBlock("gelu").eval()
    x = tokens()
    reference = model(x)
    naive = copy.deepcopy(model)
    with torch.no_grad():
        naive.head.weight.mul_(model.gamma)
        naive.gamma.fill_(1.0)
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    original_ops = aten_ops(model, x)
    gm, decisions, _ = fold(model, x)
    (d,) = decisions
    assert (d.kind, d.action, d.reason, d.into) == ("LayerScale", "kept-affine", reasons.RESIDUAL_READS_NORM, [])
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert aten_ops(gm) == original_ops


class BNThenLayerScale(nn.Module):
    """EfficientFormerV2's ``x + ls * norm(conv(x))`` on NCHW: the LayerScale multiplies the BatchNorm's output
    directly, so the two are one per-channel affine (one decision, named by the BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.norm = nn.BatchNorm2d(C)
        self.ls = nn.Parameter(torch.randn(C, 1, 1, generator=gen(9)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ls * self.norm(self.conv(x))


def test_a_layerscale_on_a_batchnorm_output_is_part_of_that_norm():
    model = randomize(BNThenLayerScale()).eval()
    img = torch.randn(B, C, 4, 4, generator=gen())
    gm, decisions, reference = fold(model, img)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("norm", "BatchNorm", "folded-backward", ["conv"])
    ]
    assert rel_err(gm(img), reference) <= TOL[torch.float32]
    assert aten_ops(gm) == {"conv2d.default": 1, "add.Tensor": 1}


class RMSNormBlock(nn.Module):
    """A hand-written RMSNorm (``weight * x / rms(x)``) before q / k / v: its weight is a per-channel scale of the
    normalised tensor, and folds into the three Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(C)
        self.q, self.k, self.v = (nn.Linear(C, C, bias=False) for _ in range(3))
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(C, generator=gen(10)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return F.scaled_dot_product_attention(self.q(y), self.k(y), self.v(y))


def test_the_weight_of_a_hand_written_rmsnorm_folds_forward():
    model = RMSNormBlock().eval()
    x = tokens()
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("norm", "LayerScale", "folded-forward", ["k", "q", "v"])
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert "norm.weight" not in fused_state_dict(gm) and "q.bias" not in fused_state_dict(gm)


# --------------------------------------------------------------------------------------------- not norms


# --------------------------------------------------------------------------------------------- learned scalars


class LearnableAffine(nn.Module):
    """HGNetV2's ``LearnableAffineBlock``: ``scale * x + bias`` with one-element parameters."""

    def __init__(self, scale: float = 1.3, bias: float = 0.4) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([scale]))
        self.bias = nn.Parameter(torch.tensor([bias]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


class ConvLab(nn.Module):
    """HGNetV2's ``ConvBNAct`` with ``use_lab``: conv -> BN -> ReLU -> LearnableAffineBlock, then a conv of
    ``kernel`` (1: unpadded, the fold is exact; 3: zero-padded, where the affine's bias is not what the padding
    adds). ``bn=False``: no BN (an exporter folds an eval-mode BN into its conv itself)."""

    def __init__(self, kernel: int, bn: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C) if bn else nn.Identity()
        self.lab = LearnableAffine()
        self.out = nn.Conv2d(C, 4, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lab(F.relu(self.bn(self.conv(x)))))


class ReZero(nn.Module):
    """``x + alpha * mlp(x)`` with a one-element ``alpha`` (ReZero, SkipInit): the branch ends in a private Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(C, 2 * C), nn.Linear(2 * C, C), nn.Linear(C, 3)
        self.alpha = nn.Parameter(torch.tensor(0.37))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.alpha * self.fc2(F.gelu(self.fc1(x))))


class ScalarsNotLearned(nn.Module):
    """Products with one-element tensors that are not the model's state, and a learned scalar no layer reads along
    a channel axis: none is a norm. ``torch.tensor([0.5])`` made in the forward is a constant ``torch.export``
    lifts (``lifted_tensor_0``); ``temperature`` scales attention logits before a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.fc = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.temperature = nn.Parameter(torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x) * torch.tensor([0.5]) * 0.25
        attn = (h @ self.k(x).transpose(1, 2) * self.temperature).softmax(-1)
        return self.fc(attn @ x)


def image(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, 3, 6, 6, generator=gen(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_learned_scalar_affine_before_an_unpadded_conv_folds_into_it(dtype):
    """``scale * x + bias`` after the activation is a per-channel affine on every channel alike: it folds into the
    1x1 conv after it (the BN folds backward into its conv), and both disappear."""
    model = randomize(ConvLab(1)).to(dtype)
    x = image().to(dtype)
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("bn", "BatchNorm", "folded-backward", ["conv"]),
        ("lab.scale", "Affine", "folded-forward", ["out"]),
    ]
    assert rel_err(gm(x), reference) <= (TOL[torch.float32] if dtype == torch.float32 else F64)
    assert not {"lab.scale", "lab.bias"} & set(fused_state_dict(gm))
    assert aten_ops(gm) == {"conv2d.default": 2, "relu.default": 1}


def test_a_learned_scalar_affine_before_a_padded_conv_is_kept():
    """At the border a zero-padded conv reads zeros where the original read ``bias`` (the affine of the padding's
    zero): the naive fold is wrong there, and the affine stays."""
    from slabconv.fold import fold_into_conv

    model = randomize(ConvLab(3)).eval()
    x = image()
    reference = model(x)
    naive = copy.deepcopy(model)
    scale = model.lab.scale.detach().double().expand(C)
    shift = model.lab.bias.detach().double().expand(C)
    with torch.no_grad():
        w, b = fold_into_conv(model.out.weight.double(), model.out.bias.double(), scale, shift)
        naive.out.weight.copy_(w)
        naive.out.bias.copy_(b)
        naive.lab.scale.fill_(1.0)
        naive.lab.bias.zero_()
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions, _ = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.reason) for d in decisions] == [
        ("bn", "BatchNorm", "folded-backward", None),
        ("lab.scale", "Affine", "kept-affine", reasons.PADDED_CONV_CONSUMER),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


def test_a_learned_scalar_after_a_private_linear_folds_backward():
    model = ReZero()
    x = tokens()
    gm, decisions, reference = fold(model, x)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("alpha", "LayerScale", "folded-backward", ["fc2"])
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert "alpha" not in fused_state_dict(gm)


class NotNorms(nn.Module):
    """Products and sums that are not per-channel affines of a channel axis."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("per_token", torch.randn(N, 1, generator=gen(11)))  # a vector over the token axis
        self.scale = nn.Parameter(torch.tensor([0.3]))  # a learned scalar, on the token-axis product
        self.bias = nn.Parameter(torch.randn(C, generator=gen(12)))  # a constant vector added alone
        self.pos = nn.Parameter(torch.randn(1, N, C, generator=gen(13)))  # varies over tokens and channels
        self.fc = nn.Linear(C, C)
        self.fc2 = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.per_token  # token axis of a Linear's output
        h = h * self.scale * 0.125 + self.bias  # scalars, then a bias
        h = h + self.pos
        return self.fc2(h * h)


@pytest.mark.parametrize("cls", [NotNorms, ScalarsNotLearned])
def test_products_that_are_not_channel_affines_are_not_norms(cls):
    model = cls().eval()
    x = tokens()
    reference = model(x)
    gm = capture(model, x)
    before = aten_ops(gm)
    assert find_norms(gm) == []
    assert fold_all(gm) == []
    assert aten_ops(gm) == before
    assert torch.equal(gm(x), reference)


def test_zoo_models_have_exactly_their_batchnorms_as_norms():
    """DeiT-PRepBN and LLaMA-PRepBN: attention's ``q * scale``, rotary ``cos`` / ``sin`` products, masks and
    position embeddings add no norm; every norm is one of the model's RepBNs."""
    from tests.test_llama import tiny_model
    from tests.test_llama import tokens as ids

    for model, x in ((small_vit("repbn"), torch.randn(2, 1, 8, 8)), (tiny_model(), ids())):
        sites = find_norms(capture(model, x))
        repbns = [n for n, m in model.named_modules() if isinstance(m, RepBN)]
        assert len(sites) == len(repbns) > 0
        assert all(s.kind == "RepBN" and any(r.startswith(s.name) for r in repbns) for s in sites)


def test_no_bn_ops_are_left_after_folding_norms_of_every_kind():
    """One model with a RepBN, a FrozenBatchNorm, a NoNorm and a LayerScale: all folded, exact."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, C, 2, stride=2)
            self.frozen = FrozenBatchNorm2d(C)
            self.norm = RepBN(C)
            self.fc = nn.Linear(C, C)
            self.nonorm = NoNorm(C)
            self.gamma = nn.Parameter(torch.randn(C, generator=gen(14)))
            self.head = nn.Linear(C, 3)

        def forward(self, img: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.frozen(self.stem(img))).flatten(2).transpose(1, 2)
            x = x + self.gamma * F.gelu(self.nonorm(self.fc(self.norm(x))))
            return self.head(x.mean(1))

    model = randomize_frozen(randomize(Mixed())).eval()
    img = torch.randn(B, 3, 8, 8, generator=gen())
    gm, decisions, reference = fold(model, img)
    assert [(d.kind, d.action) for d in decisions] == [
        ("FrozenBatchNorm", "folded-backward"),
        ("RepBN", "folded-forward"),
        ("Affine", "folded-backward"),
        ("LayerScale", "kept-affine"),
    ]
    assert rel_err(gm(img), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm)


class ComputedStatistics(nn.Module):
    """``F.batch_norm`` whose statistics are computed: from stored tensors (a constant: folds) or from the input
    (not a fixed affine: refused)."""

    def __init__(self, from_input: bool) -> None:
        super().__init__()
        self.from_input = from_input
        self.register_buffer("mean", torch.randn(C, generator=gen(15)))
        self.register_buffer("log_var", torch.randn(C, generator=gen(16)) * 0.3)
        self.fc = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0) if self.from_input else self.mean * 2
        y = F.batch_norm(x, mean, self.log_var.exp(), training=False, eps=1e-5)
        return self.fc(y)


def test_batchnorm_statistics_computed_from_stored_tensors_fold():
    model = ComputedStatistics(from_input=False).eval()
    x = torch.randn(B, C, generator=gen()) * 2 + 1
    gm, decisions, reference = fold(model, x)
    assert [(d.kind, d.action, d.into) for d in decisions] == [("BatchNorm", "folded-forward", ["fc"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


def test_batchnorm_statistics_computed_from_the_input_are_kept_as_batch_statistics():
    """Statistics computed from the input (as an exporter writes a BatchNorm without running statistics) are the
    batch's own: not one fixed affine, so the norm stays as it is (``batch-stats-in-eval``) and the rest folds."""
    model = ComputedStatistics(from_input=True).eval()
    x = torch.randn(B, C, generator=gen())
    gm, decisions, reference = fold(model, x)
    assert [(d.kind, d.action, d.reason) for d in decisions] == [("BatchNorm", "kept", reasons.BATCH_STATS_IN_EVAL)]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    x2 = torch.randn(B, C, generator=gen(3)) * 3  # another batch: its own statistics, as the original
    assert rel_err(gm(x2), model(x2)) <= TOL[torch.float32]
