"""The affine of a LayerNorm, RMSNorm or GroupNorm folded on request (``fold_norm_affine``,
``slabconv.engine.norm_affine``): every form ``torch.export`` writes for ``nn.LayerNorm``, ``nn.RMSNorm``,
transformers' ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` and ``nn.GroupNorm``, in float32, float16 and bfloat16, before and
after ``run_decompositions()``, is found with its kind and folded into the layer that reads the norm; the norm op
keeps a unit weight. Without the option nothing changes. A norm whose affine cannot fold away entirely is kept whole
(its op as it was, bit for bit), and each such refusal shows the naive fold would be wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from slabconv.engine import find_norms, fold_all, fused_state_dict, reasons, split_norm_affines
from slabconv.engine.norm_affine import join_norm_affines
from tests.foldcheck import NAIVE_MIN_ERR, TOL, assert_half_close, rel_err

C, N, B = 8, 5, 3
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randomize(norm: nn.Module, seed: int = 0) -> nn.Module:
    """Non-unit weights in [0.25, 1.75] and a bias of order 1 (where the norm has one): a fold that forgets either
    is wrong by far more than any tolerance."""
    with torch.no_grad():
        for name, p in norm.named_parameters():
            if name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen(seed)) * 1.5 + 0.25)
            else:
                p.copy_(torch.randn(p.shape, generator=gen(seed + 1)))
    return norm


class Head(nn.Module):
    """``fc(norm(x))`` on tokens ``(B, N, C)``, or ``fc`` a 1x1 conv on an image ``(B, C, H, W)``."""

    def __init__(self, norm: nn.Module, conv: bool = False, bias: bool = True):
        super().__init__()
        self.norm = norm
        self.fc = nn.Conv2d(C, 4, 1, bias=bias) if conv else nn.Linear(C, 4, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


FORMS = {
    "LayerNorm": (lambda: nn.LayerNorm(C), "LayerNorm-affine"),
    "RMSNorm": (lambda: nn.RMSNorm(C), "RMSNorm-affine"),
    "LlamaRMSNorm": (lambda: LlamaRMSNorm(C), "RMSNorm-affine"),
    "Qwen2RMSNorm": (lambda: Qwen2RMSNorm(C), "RMSNorm-affine"),
    "GroupNorm": (lambda: nn.GroupNorm(2, C), "GroupNorm-affine"),
}


def head(form: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    make, _ = FORMS[form]
    conv = form == "GroupNorm"
    model = Head(randomize(make(), seed), conv=conv).to(dtype).eval()
    shape = (B, C, 3, 3) if conv else (B, N, C)
    x = (torch.randn(shape, generator=gen(7)) * 2 + 0.5).to(dtype)
    return model, x


def graph(model: nn.Module, x: torch.Tensor, core: bool) -> torch.fx.GraphModule:
    """The unlifted graph ``torch.export`` writes (``core``: after ``run_decompositions()``)."""
    program = torch.export.export(model, (x,))
    return (program.run_decompositions() if core else program).module()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_written_form_folds_its_affine_and_keeps_a_unit_weight(form, dtype):
    """The export graph (``aten.layer_norm`` ...) and its core-ATen decomposition (``native_layer_norm``, a
    written-out RMSNorm, ...) of one program."""
    model, x = head(form, dtype)
    program = torch.export.export(model, (x,))
    for core, gm in ((False, program.module()), (True, program.run_decompositions().module())):
        decisions = fold_all(gm, norm_affine=True)
        expected = [("norm", FORMS[form][1], "folded-forward", ["fc"])]
        assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == expected, core
        out = gm(x)
        if dtype == torch.float32:
            assert rel_err(out, model(x).double()) <= TOL[dtype]
        else:
            assert_half_close(out, model, x, dtype)
        state = fused_state_dict(gm)
        assert "norm.bias" not in state
        if "norm.weight" in state:  # the op of the norm keeps its weight as ones; a written-out RMSNorm has no op
            assert state["norm.weight"].dtype == dtype and bool((state["norm.weight"] == 1).all())
        else:
            assert form in ("LlamaRMSNorm", "Qwen2RMSNorm") or (core and form == "RMSNorm")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_without_the_option_nothing_changes(form):
    """The ops stay as torch wrote them; a written-out RMSNorm's weight is a LayerScale, as before the option."""
    model, x = head(form)
    gm = graph(model, x, core=False)
    before = gm.code
    decisions = fold_all(gm)
    if form in ("LlamaRMSNorm", "Qwen2RMSNorm"):
        assert [(d.kind, d.action) for d in decisions] == [("LayerScale", "folded-forward")]
    else:
        assert decisions == [] and gm.code == before
        assert torch.equal(gm(x), model(x))


def test_the_float64_fold_is_exact():
    """Question 1's view: the fold of a float64 graph computes the original to float64 rounding, for every form."""
    for form in sorted(FORMS):
        model, x = head(form, torch.float64)
        gm = graph(model, x, core=False)
        fold_all(gm, norm_affine=True)
        assert rel_err(gm(x), model(x)) <= 1e-12, form


# --------------------------------------------------------------------------------------------- kept whole


class ResidualReadsNorm(nn.Module):
    """Post-norm: ``y = norm(x)`` feeds ``fc`` and the residual ``y + fc(y)`` (BERT's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = randomize(nn.LayerNorm(C))
        self.fc = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y + self.fc(y)


def _naive(model: nn.Module, layer: str) -> nn.Module:
    """The fold done anyway: the affine into ``layer``'s input columns and bias, the norm left without it."""
    naive = copy.deepcopy(model)
    norm, fc = naive.norm, getattr(naive, layer)
    with torch.no_grad():
        w = fc.weight.double()
        per_column = (1, -1, *([1] * (w.dim() - 2)))
        shift = norm.bias.double() if getattr(norm, "bias", None) is not None else torch.zeros(C, dtype=torch.float64)
        fc.bias.copy_(fc.bias.double() + (w * shift.reshape(per_column)).sum(tuple(range(1, w.dim()))))
        fc.weight.copy_(w * norm.weight.double().reshape(per_column))
        norm.weight.fill_(1)
        if getattr(norm, "bias", None) is not None:
            norm.bias.zero_()
    return naive


def test_a_norm_read_by_a_residual_is_kept_whole_bit_for_bit():
    model = ResidualReadsNorm().eval()
    x = torch.randn(B, N, C, generator=gen(3))
    gm = graph(model, x, core=False)
    before = gm.code
    decisions = fold_all(gm, norm_affine=True)
    assert [(d.kind, d.action, d.reason, d.into) for d in decisions] == [
        ("LayerNorm-affine", "kept", reasons.RESIDUAL_READS_NORM, [])
    ]
    assert gm.code == before and torch.equal(gm(x), model(x))  # the op holds its weight and bias again
    assert rel_err(_naive(model, "fc")(x), model(x)) > NAIVE_MIN_ERR  # the residual would lose the affine


class PaddedConv(nn.Module):
    """A GroupNorm (or an InstanceNorm with an affine) before a 3x3 conv with zero padding: a padded zero would have
    to become the shift."""

    def __init__(self, instance: bool = False) -> None:
        super().__init__()
        self.norm = randomize(nn.InstanceNorm2d(C, affine=True) if instance else nn.GroupNorm(2, C))
        self.fc = nn.Conv2d(C, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


@pytest.mark.parametrize("instance", [False, True])
def test_a_group_norm_before_a_padded_conv_is_kept_whole(instance):
    """An InstanceNorm only in its export graph: after ``run_decompositions()`` it is a batch norm over a view,
    not split (``slabconv.engine.norm_affine``)."""
    model = PaddedConv(instance).eval()
    x = torch.randn(B, C, 5, 5, generator=gen(4))
    kind = "InstanceNorm-affine" if instance else "GroupNorm-affine"
    for core in (False,) if instance else (False, True):
        gm = graph(model, x, core)
        decisions = fold_all(gm, norm_affine=True)
        assert [(d.kind, d.action, d.reason) for d in decisions] == [(kind, "kept", reasons.PADDED_CONV_CONSUMER)]
        assert torch.equal(gm(x), model(x))
    assert rel_err(_naive(model, "fc")(x), model(x)) > NAIVE_MIN_ERR


# --------------------------------------------------------------------------------------------- details


class Twice(nn.Module):
    """One LayerNorm module called twice: its weight is read by two norm ops, each decided on its own."""

    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.norm = randomize(nn.LayerNorm(C))
        self.fc, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.norm(x))
        return y + (self.norm(y) if self.residual else self.fc2(self.norm(y)))


@pytest.mark.parametrize("residual", [False, True])
def test_a_norm_module_called_twice_folds_each_call(residual):
    """Each call folds (or is kept) on its own; the shared weight is never replaced by ones (the other call may
    still read it): a folded call's op has no weight."""
    model = Twice(residual).eval()
    x = torch.randn(B, N, C, generator=gen(5))
    gm = graph(model, x, core=False)
    decisions = fold_all(gm, norm_affine=True)
    second = ("kept", reasons.RESIDUAL_READS_NORM) if residual else ("folded-forward", None)
    assert [(d.action, d.reason) for d in decisions] == [("folded-forward", None), second]
    assert rel_err(gm(x), model(x).double()) <= TOL[torch.float32]
    state = fused_state_dict(gm)
    assert ("norm.weight" in state) == residual
    if residual:
        assert torch.equal(state["norm.weight"], model.norm.weight.detach())


@pytest.mark.parametrize(
    "norm, bias_made",
    [(lambda: nn.LayerNorm(C), True), (lambda: nn.LayerNorm(C, bias=False), False), (lambda: nn.RMSNorm(C), False)],
    ids=["layernorm", "layernorm-no-bias", "rmsnorm"],
)
def test_a_bias_is_created_only_for_a_norm_with_a_shift(norm, bias_made):
    model = Head(randomize(norm()), bias=False).eval()
    x = torch.randn(B, N, C, generator=gen(6))
    gm = graph(model, x, core=False)
    assert [d.action for d in fold_all(gm, norm_affine=True)] == ["folded-forward"]
    assert ("fc.bias" in fused_state_dict(gm)) == bias_made
    assert rel_err(gm(x), model(x).double()) <= TOL[torch.float32]


class TwoAxes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = randomize(nn.LayerNorm((N, C)))
        self.fc = nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def test_a_layer_norm_over_two_axes_is_left_as_it_is():
    """Its affine varies over tokens and channels: not one per-channel map."""
    model = TwoAxes().eval()
    x = torch.randn(B, N, C, generator=gen(8))
    gm = graph(model, x, core=False)
    before = gm.code
    assert fold_all(gm, norm_affine=True) == [] and gm.code == before


def test_split_then_join_gives_back_the_graph():
    """The split graph computes the same function; joining it (every norm kept) gives back the original ops."""
    model, x = head("GroupNorm")
    gm = graph(model, x, core=True)
    before = gm.code
    assert split_norm_affines(gm) == 1
    assert [s.kind for s in find_norms(gm)] == ["GroupNorm-affine"]
    assert rel_err(gm(x), model(x).double()) <= TOL[torch.float32]
    assert join_norm_affines(gm) == 1
    assert gm.code == before and torch.equal(gm(x), model(x))


def test_a_decomposed_rms_norm_in_half_precision_moves_its_weight_after_the_cast():
    """``nn.RMSNorm`` in bfloat16 after ``run_decompositions()`` multiplies by its weight in float32 and then casts:
    the multiply moves after the cast, where the consumers read it (without the move the narrowing cast blocks)."""
    model, x = head("RMSNorm", torch.bfloat16)
    gm = graph(model, x, core=True)
    plain = copy.deepcopy(gm)
    assert fold_all(plain) == []  # as before: the float32 multiply sits before a narrowing cast
    assert [d.action for d in fold_all(gm, norm_affine=True)] == ["folded-forward"]
    assert_half_close(gm(x), model, x, torch.bfloat16)


def test_conv_and_linear_consumers_of_one_norm():
    """A ViT-style token norm read by a Linear through a slice (the class token) folds through the view."""

    class ClassToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = randomize(nn.LayerNorm(C))
            self.head = nn.Linear(C, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(x)[:, 0])

    model = ClassToken().eval()
    x = torch.randn(B, N, C, generator=gen(9))
    gm = graph(model, x, core=False)
    assert [(d.action, d.into) for d in fold_all(gm, norm_affine=True)] == [("folded-forward", ["head"])]
    assert rel_err(gm(x), model(x).double()) <= TOL[torch.float32]
