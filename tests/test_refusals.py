"""Every named refusal matters: for each reason a tiny model where the naive fold (drop the norm, fold its affine
into the nearest downstream layer, applied here anyway) is far off, while slabconv stays exact and names the
reason. Structure is checked too: where an affine suffices no BN op is left, and the fused graph is the norm-free
graph plus one multiply/add per kept path (no transposes left from the norm)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv import engine, fold
from slabconv.engine import reasons
from slabconv.errors import UnsupportedModelError
from slabconv.zoo.norms import RepBN
from tests.foldcheck import (
    NAIVE_MIN_ERR,
    TOL,
    RepBN_NLP,
    affine_of,
    assert_affine_only,
    assert_half_close,
    aten_ops,
    bn_nodes,
    exact,
    fuse,
    kept_affines,
    naive_fold,
    norm_free,
    patchtst_norm,
    randomize,
    rel_err,
)

C, N, B = 8, 6, 4


def tokens(n: int = N, c: int = C, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, n, c, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def only(decisions: list[engine.Decision], norm: str = "norm") -> engine.Decision:
    found = [d for d in decisions if d.norm == norm]
    assert len(found) == 1, decisions
    return found[0]


def check_refusal(
    model: nn.Module,
    x: torch.Tensor,
    reason: str,
    *,
    layer: str = "fc",
    into: list[str] | None = None,
    kept: int = 1,
) -> tuple[torch.fx.GraphModule, engine.Decision]:
    """The naive fold into ``layer`` is wrong, slabconv keeps an affine with ``reason`` and is exact."""
    model = model.eval()
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", layer)(x), reference) > NAIVE_MIN_ERR
    bare_ops = aten_ops(norm_free(model, ["norm"]), x)
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason) == ("kept-affine", reason)
    assert d.paths[0]["reason"] == reason
    assert d.into == (into or [])
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert_affine_only(gm, bare_ops, kept)
    return gm, d


# --------------------------------------------------------------------------------------------- the reasons


class Plain(nn.Module):
    """``fc(norm(x))``: folds forward whenever the norm is a fixed, representable affine."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class PadAfterNorm(nn.Module):
    """Swin with a resolution that is not a multiple of the window: norm, then zero-pad the token grid."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x).view(x.shape[0], 3, 3, C)
        return self.fc(F.pad(y, (0, 0, 0, 1, 0, 1)))


def test_zero_padding_after_norm():
    model = randomize(PadAfterNorm())
    check_refusal(model, tokens(9), reasons.ZERO_PADDING_AFTER_NORM)


class MaskAfterNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)
        self.register_buffer("pad_mask", torch.tensor([False, False, False, False, True, True]).view(1, N, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).masked_fill(self.pad_mask, 0.0))


def test_masked_after_norm():
    check_refusal(randomize(MaskAfterNorm()), tokens(), reasons.MASKED_AFTER_NORM)


class ResidualReadsNorm(nn.Module):
    """A post-norm residual: the normalised tensor is both the Linear's input and the skip."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.fc = nn.Linear(C, C)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.head(y + self.fc(y))


def test_residual_reads_norm_keeps_the_affine_on_the_skip_only():
    gm, d = check_refusal(randomize(ResidualReadsNorm()), tokens(), reasons.RESIDUAL_READS_NORM, into=["fc"])
    assert d.kept_on == ["<model>:aten.add"]
    # the kept affine is applied to the raw input, on the skip path only
    (mul,) = kept_affines(gm)
    assert mul.args[0].op == "placeholder"


class ProductOfInputAndNorm(nn.Module):
    """``x * bn(x)``: the blocked op reads the norm's input *and* its output (a plain BatchNorm over (B, C))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * self.norm(x))


def test_blocked_op_reading_the_norms_input_keeps_that_operand():
    """Regression: the affine used to replace *every* read of the norm's input in the blocked op, giving
    ``affine(x) * affine(x)`` instead of ``x * affine(x)``. (``x + bn(x)`` was the example before norms were
    recognised by value; it is a RepBN now, see the next test.)"""
    model = randomize(ProductOfInputAndNorm()).eval()
    x = torch.randn(B, C) * 2
    reference = model(x)
    gm, decisions = fuse(model, x)
    assert (only(decisions).action, only(decisions).reason) == ("kept-affine", reasons.MASKED_AFTER_NORM)
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    (kept,) = kept_affines(gm)
    (prod,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor and n is not kept]
    assert prod.args[0].op == "placeholder"  # x * (x * s + t)
    assert prod.args[1].target is torch.ops.aten.add.Tensor and prod.args[1].args[0] is kept


class ResidualReadsInputAndNorm(nn.Module):
    """``x + bn(x)`` is ``BN(x) + 1 * x``: a RepBN with eta = 1, folded as one affine."""

    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 4)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.norm(x)
        return self.fc(torch.relu(y) if self.relu else y)


@pytest.mark.parametrize("relu", [False, True])
def test_input_plus_norm_is_a_repbn_with_eta_one(relu):
    model = randomize(ResidualReadsInputAndNorm(relu)).eval()
    x = torch.randn(B, C) * 2
    reference = model(x)
    bare_ops = aten_ops(norm_free(model, ["norm"]), x)
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert d.kind == "RepBN"
    if relu:  # one affine s * x + t with s = gamma / sigma + 1 before the relu, the add is gone
        assert (d.action, d.reason) == ("kept-affine", reasons.NONLINEAR)
        bare_ops["add.Tensor"] -= 1
    else:
        assert (d.action, d.into) == ("folded-forward", ["fc"])
        bare_ops["add.Tensor"] -= 1
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert_affine_only(gm, bare_ops, int(relu))
    # the naive fold of the BatchNorm alone (without the + x) is wrong
    scale, shift = affine_of(model.norm)
    naive = norm_free(model, ["norm"])
    with torch.no_grad():
        w, b = fold.fold_into_linear(model.fc.weight, model.fc.bias, scale, shift)
        naive.fc.weight.copy_(w)
        naive.fc.bias.copy_(b)
    if not relu:
        assert rel_err(naive(x), reference) > NAIVE_MIN_ERR


class NonlinearBeforeConsumer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.norm(x)))


def test_nonlinear_before_consumer():
    check_refusal(randomize(NonlinearBeforeConsumer()), tokens(), reasons.NONLINEAR)


class ChannelMixingReshape(nn.Module):
    """``(B, C, N)`` data reshaped (not transposed) to ``(B, N, C)``: each new row mixes channels."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x).transpose(1, 2)
        return self.fc(y.reshape(x.shape[0], N, C))


def test_channel_mixing_reshape():
    check_refusal(randomize(ChannelMixingReshape()), tokens(), reasons.CHANNEL_MIXING_RESHAPE)


class PaddedConv(nn.Module):
    def __init__(self, with_pointwise: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(C)
        self.fc = nn.Conv2d(C, 4, 3, padding=1)
        self.pw = nn.Conv2d(C, 4, 1) if with_pointwise else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        out = self.fc(y)
        return out + self.pw(y) if self.pw is not None else out


@pytest.mark.parametrize("with_pointwise", [False, True])
def test_padded_conv_consumer_is_refused_on_that_path_only(with_pointwise):
    x = torch.randn(B, C, 5, 5) + 0.5
    model = randomize(PaddedConv(with_pointwise))
    gm, d = check_refusal(model, x, reasons.PADDED_CONV_CONSUMER, into=["pw"] if with_pointwise else [])
    assert d.kept_on == ["fc:aten.conv2d"]


class ConvTransposeConsumer(nn.Module):
    """``up(norm(x))``: a transposed conv (kernel 3, stride 2: outputs between the strides and at the borders see
    fewer taps) reads the norm; the BatchNorm after it folds backward (checked in ``tests/test_engine_plan.py``)."""

    def __init__(self, kernel: int = 3, stride: int = 2, **kw: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(C)
        self.fc = nn.ConvTranspose2d(C, 4, kernel, stride=stride, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


@pytest.mark.parametrize(
    ("kernel", "stride", "kw"),
    [(3, 2, {}), (2, 2, {}), (1, 2, {}), (3, 1, {"padding": 1}), (1, 1, {"dilation": 2, "output_padding": 1})],
)
def test_a_transposed_conv_consumer_is_refused(kernel, stride, kw):
    """The naive forward fold (``W`` scaled on its input rows, ``b + sum_k W t`` as if every output position saw
    every tap) is wrong even where the windows do not overlap (stride = kernel: each position sees one tap, a
    different one per position; kernel 1, stride 2: the positions between the strides see none; kernel 3, stride 1:
    the borders see fewer taps); a 1x1 kernel of stride 1 with output padding writes a last row and column that
    see none. Only the pointwise one folds (``tests/test_exact_folds.py``)."""
    x = torch.randn(B, C, 4, 4) + 0.5
    model = randomize(ConvTransposeConsumer(kernel, stride, **kw))
    gm, d = check_refusal(model, x, reasons.TRANSPOSED_CONV_CONSUMER)
    assert d.kept_on == ["fc:aten.conv_transpose2d"]


class MaxOverTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).amax(dim=1))


def test_negative_scale_through_max():
    model = randomize(MaxOverTokens(), positive=False)
    scale, _ = affine_of(model.norm)
    assert bool((scale < 0).any())
    check_refusal(model, tokens(), reasons.NEGATIVE_SCALE_THROUGH_MAX)


def test_max_over_tokens_folds_when_every_scale_is_positive():
    model = randomize(MaxOverTokens(), positive=True).eval()
    assert bool((affine_of(model.norm)[0] > 0).all())
    x = tokens()
    gm, decisions = fuse(model, x)
    assert (only(decisions).action, only(decisions).into) == ("folded-forward", ["fc"])
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)


class BatchStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Sequential(
            *patchtst_norm(C)[:1], nn.BatchNorm1d(C, track_running_stats=False), *patchtst_norm(C)[2:]
        )
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def test_batch_stats_in_eval_leaves_the_norm_as_it_is():
    """``track_running_stats=False``: the BN normalises with the statistics of each batch, even in eval mode;
    it is not a fixed affine, so no fold is exact. slabconv keeps the BN op (action ``kept``) and says why."""
    model = randomize(BatchStats()).eval()
    x = tokens()
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc")(x), reference) > NAIVE_MIN_ERR  # with mean 0, var 1
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason, d.into) == ("kept", reasons.BATCH_STATS_IN_EVAL, [])
    assert len(bn_nodes(gm)) == 1
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    x2 = tokens(seed=3) * 3 - 1  # another batch: still the model's own batch statistics
    assert rel_err(gm(x2), model(x2)) <= TOL[torch.float32]


def test_train_mode_leaves_the_norm_as_it_is():
    """A model captured in train mode normalises with batch statistics: ``kept`` with ``train-mode``."""
    model = randomize(Plain())
    x = tokens()
    naive = naive_fold(model.eval(), "norm", "fc")  # exact for the eval-mode model
    assert rel_err(naive(x), model(x)) <= TOL[torch.float32]
    model.train()
    reference = copy.deepcopy(model)(x)
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm = engine.capture(copy.deepcopy(model), x)
    decisions = engine.fold_all(gm)
    d = only(decisions)
    assert (d.action, d.reason) == ("kept", reasons.TRAIN_MODE)
    assert len(bn_nodes(gm)) == 1
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class DecayingGain(nn.Module):
    """A LayerScale (``fc(x) * gain``) whose ``gain`` the forward itself halves before using it (state kept in the
    model): what it computes depends on how many times the model ran, so it is not one fixed affine."""

    def __init__(self, decay: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.gain = nn.Parameter(torch.linspace(0.5, 2.0, C), requires_grad=False)
        self.decay = decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decay:
            with torch.no_grad():
                self.gain.view(2, C // 2).mul_(0.5)  # (through a view: the same update)
        return F.gelu(self.fc(x) * self.gain)


def test_a_norm_the_forward_updates_is_kept():
    """The naive fold (``gain`` into ``fc``'s rows, backward) takes ``gain`` as it is when folding; the model's
    next run uses half of it. slabconv keeps it (``norm-updated-in-forward``), and its graph goes on updating the
    value as the model does. Without the update the same model folds."""
    model = DecayingGain().eval()
    x = tokens()
    naive = DecayingGain(decay=False).eval()
    with torch.no_grad():
        naive.fc.weight.copy_(model.fc.weight * model.gain[:, None])
        naive.fc.bias.copy_(model.fc.bias * model.gain)
        naive.gain.fill_(1.0)
    reference = copy.deepcopy(model)(x)  # one run: gain halved, then used
    assert rel_err(naive(x), reference) > NAIVE_MIN_ERR
    gm, decisions = fuse(copy.deepcopy(model), x)
    d = only(decisions, "gain")
    assert (d.kind, d.action, d.reason, d.into) == ("LayerScale", "kept", reasons.UPDATED_IN_FORWARD, [])
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    second = copy.deepcopy(model)
    second(x)
    assert rel_err(gm(x), second(x)) <= TOL[torch.float32]  # the second run of each: a quarter of the gain
    steady = DecayingGain(decay=False).eval()
    _, decisions = fuse(steady, x)
    assert only(decisions, "gain").action == "folded-backward"


class DecayingStatistics(nn.Module):
    """A BatchNorm whose ``running_mean`` the forward halves (inside ``torch.no_grad()``) before the norm reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(C), nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.bn.running_mean.mul_(0.5)
        return self.fc(self.bn(x))


def test_statistics_the_forward_updates_stop_the_fuse_with_a_named_reason():
    """torch.export records the update as a higher-order op running a submodule; its body was taken for a stored
    tensor and the fuse died with an AttributeError. The norm reads statistics computed as the model runs, so
    the fold stops with the engine's reason (naming the BatchNorm) instead."""
    model = DecayingStatistics().eval()
    model.bn.running_mean.uniform_(-1, 1)
    with pytest.raises(UnsupportedModelError, match="BatchNorm node .*statistics are computed"):
        fuse(model, torch.randn(B, C))


class SumOverTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).sum(dim=1))


def test_dynamic_token_count_refuses_a_sum_over_tokens():
    """With a dynamic sequence length the shift of a sum over tokens is ``N t`` with N known only at run time."""
    model = randomize(SumOverTokens()).eval()
    x = tokens()
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc")(x), reference) > NAIVE_MIN_ERR
    seq = torch.export.Dim("seq", min=2, max=64)
    gm = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch"), 1: seq},)).module()
    d = only(engine.fold_all(gm))
    assert (d.action, d.reason) == ("kept-affine", reasons.DYNAMIC_TOKEN_COUNT)
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    longer = tokens(n=11, seed=5)
    assert rel_err(gm(longer), model(longer)) <= TOL[torch.float32]
    assert not bn_nodes(gm)


def test_sum_over_a_static_token_count_folds_with_the_shift_times_n():
    model = randomize(SumOverTokens()).eval()
    x = tokens()
    reference = model(x)
    assert rel_err(naive_fold(model, "norm", "fc", shift_mult=N)(x), reference) <= TOL[torch.float32]
    gm, decisions = fuse(model, x)
    assert (only(decisions).action, only(decisions).into) == ("folded-forward", ["fc"])
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


class ClsConcat(nn.Module):
    """A class token concatenated after the norm: the naive fold would scale and shift it too."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.cls_token = nn.Parameter(torch.randn(1, 1, C))
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), self.norm(x)], dim=1)
        return self.fc(y)


def test_concat_with_unnormalized():
    check_refusal(randomize(ClsConcat()), tokens(), reasons.CONCAT_WITH_UNNORMALIZED)


class NarrowingCast(nn.Module):
    """A float32 norm whose output is cast to float16 before a float16 Linear (a mixed-precision head)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).to(self.fc.weight.dtype)).float()


def test_narrowing_cast_after_norm():
    """The original rounds ``s x + t`` to float16 (about 100 here); the naive fold rounds ``x`` (1e5: inf)."""
    model = randomize(NarrowingCast())
    with torch.no_grad():
        model.norm.bn.running_var.fill_(1e6)
        model.norm.alpha.fill_(1e-4)
    x = tokens() * 3e4
    reference = model.eval()(x)
    assert not torch.isfinite(naive_fold(model, "norm", "fc")(x)).all()
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason, d.into) == ("kept-affine", reasons.NARROWING_CAST, [])
    assert rel_err(gm(x), reference) <= TOL[torch.float16]  # the affine is kept before the float16 cast
    widening = copy.deepcopy(model).float()  # the same model with a float32 head: the cast holds every value
    assert only(fuse(widening, x)[1]).action == "folded-forward"


class WideningCastBeforeNorm(nn.Module):
    """A float16 Linear whose output is cast to float32 for a float32 norm (a mixed-precision block; a float16
    ONNX conv between ``Cast`` nodes), the norm's output read through a ReLU (no forward fold)."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C).to(dtype)
        self.norm = RepBN(C)
        self.head = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.fc(x.to(self.fc.weight.dtype)).float())))


def test_no_backward_fold_into_a_narrower_producer():
    """The original computes ``s y + t`` in float32 (up to 1e7 here); a backward fold into the float16 Linear would
    compute it in float16 (inf). The norm is kept, the backward walk saying why; the same model in float32 folds
    backward."""
    model = randomize(WideningCastBeforeNorm()).eval()
    with torch.no_grad():
        model.norm.bn.running_var.fill_(1e-6)
        model.norm.bn.weight.copy_(model.norm.bn.weight.sign() * 100)  # every |s| > 3e4, whatever fc's init drew
    x = tokens() * 100
    reference = model(x)
    assert torch.isfinite(reference).all()
    naive = copy.deepcopy(model)
    scale, shift = affine_of(model.norm)
    naive.norm = nn.Identity()
    with torch.no_grad():
        w, b = fold.fold_into_producer(naive.fc.weight, naive.fc.bias, scale, shift)
        naive.fc.weight.copy_(w)
        naive.fc.bias.copy_(b)
    assert not torch.isfinite(naive(x)).all()
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason, d.into) == ("kept-affine", reasons.NONLINEAR, [])
    assert d.no_backward is not None and "compute the norm's affine in float16" in d.no_backward
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    wide = WideningCastBeforeNorm(torch.float32)  # the same weights in float32: the casts hold every value
    wide.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert only(fuse(wide.eval(), x)[1]).action == "folded-backward"


class ConcatWithNonlinearBranch(nn.Module):
    """``cat([y, relu(y)])``: both pieces come from the norm, but one is no longer an affine of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.fc(torch.cat([y, torch.relu(y)], dim=1))


def test_concat_with_a_nonlinear_branch_of_the_same_norm():
    """Regression: any cat whose inputs were all reachable from the norm used to pass, folding the affine into
    ``fc`` a second time for the ``relu`` half."""
    gm, d = check_refusal(randomize(ConcatWithNonlinearBranch()), tokens(), reasons.NONLINEAR)
    assert {p["reason"] for p in d.paths} == {reasons.NONLINEAR, reasons.CONCAT_WITH_UNNORMALIZED}


class ConcatSumAndMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.fc(torch.cat([y.sum(1, keepdim=True), y.mean(1, keepdim=True)], dim=1))


def test_concat_of_pieces_with_different_shift_multipliers():
    """Regression: ``cat([sum(y), mean(y)])`` carries shifts ``N t`` and ``t``; no single fold is exact."""
    # one affine after the sum (shift N t) and one after the mean (shift t)
    check_refusal(randomize(ConcatSumAndMean()), tokens(), reasons.UNSUPPORTED_PREFIX + "aten.cat", kept=2)


class FeedsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.norm(x)
        return self.fc(y), y


def test_feeds_model_output():
    gm, d = check_refusal(randomize(FeedsOutput()), tokens(), reasons.FEEDS_OUTPUT, into=["fc"])
    assert d.kept_on == ["<output>"]


class TiedConsumer(nn.Module):
    """One weight read by two Linears, only one of which reads the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, C)
        self.other = nn.Linear(C, C)
        self.other.weight = self.fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)) + self.other(x)


def test_shared_consumer_weight():
    check_refusal(randomize(TiedConsumer()), tokens(), reasons.SHARED_WEIGHT)


class CumsumAfterNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cumsum(self.norm(x), dim=1))


def test_unsupported_op_names_the_aten_op():
    check_refusal(randomize(CumsumAfterNorm()), tokens(), reasons.UNSUPPORTED_PREFIX + "aten.cumsum")


class LinearOverTime(nn.Module):
    """BatchNorm1d over ``(B, C, L)`` feeding a Linear over L (time), not over the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 5)  # L == C here, so the naive fold even has the right shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def test_consumer_not_on_channel_axis():
    check_refusal(randomize(LinearOverTime()), torch.randn(B, C, C) + 0.5, reasons.CONSUMER_OFF_CHANNEL)


# --------------------------------------------------------------------------------------------- dtype overflow


def _huge_scale(model: Plain, gamma: float) -> Plain:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.norm.alpha.fill_(0.0)
        model.norm.bn.weight.fill_(gamma)
        model.norm.bn.running_var.fill_(1e-4)
        model.norm.bn.running_mean.copy_(torch.randn(C, generator=gen) * 1e-3)
        model.norm.bn.bias.copy_(torch.randn(C, generator=gen))
        model.fc.weight.copy_(torch.randn(5, C, generator=gen) * 20)
    return model


def _tiny_tokens() -> torch.Tensor:
    return (torch.randn(B, N, C, generator=torch.Generator().manual_seed(2)) * 1e-3).half()


def test_dtype_overflow_in_a_consumer_keeps_the_affine_before_it():
    """fp16: s ~ 3e4 fits, but 20 * s does not: folding into ``fc`` would give inf weights."""
    model = _huge_scale(randomize(Plain()), 300.0).eval().half()
    x = _tiny_tokens()
    assert rel_err(naive_fold(model, "norm", "fc")(x), exact(model, x)) > NAIVE_MIN_ERR  # inf weights
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason, d.into) == ("kept-affine", reasons.DTYPE_OVERFLOW, [])
    assert_half_close(gm(x), model, x, torch.float16)
    assert all(p.dtype == torch.float16 for p in gm.parameters())


def test_dtype_overflow_of_the_affine_itself_leaves_the_norm():
    """fp16: s ~ 9.5e4 is not representable at all; the BN (which computes in float32 inside) stays."""
    model = _huge_scale(randomize(Plain()), 1000.0).eval().half()
    x = _tiny_tokens()
    assert rel_err(naive_fold(model, "norm", "fc")(x), exact(model, x)) > NAIVE_MIN_ERR
    gm, decisions = fuse(model, x)
    d = only(decisions)
    assert (d.action, d.reason) == ("kept", reasons.DTYPE_OVERFLOW)
    assert len(bn_nodes(gm)) == 1
    assert torch.equal(gm(x), model(x))  # the original ops, untouched


def test_every_reason_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "reasons.md").read_text()
    for reason in reasons.ALL:
        assert f"`{reason}`" in doc, reason
