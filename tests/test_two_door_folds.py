"""Exact folds through parts of the channel axis and back through constants, each through both doors: the model
planned as a ``torch.export`` program (what ``slabconv fuse model.pt2`` plans) and as its ONNX exports by both
exporters (TorchScript and dynamo), with the same decisions, the fused graph and the fused ONNX file each computing
the original, and a refusal where the naive fold is wrong.

- Channel slices and splits (``y[:, a:b]``, ``narrow``, ``split`` / ``chunk``, ONNX ``Slice`` / ``Split``): each
  part holds its part of the channels, so a layer reading it folds the norm's scale and shift of those channels;
  parts put back together (``cat``, in order or permuted) are a layout of the norm's channels again; a strided
  slice (``y[:, ::2]``) and a constant index (``index_select``) hold the channels they pick.
- Back through a constant: ``norm(conv(x) + c)`` folds into the conv with the shift ``t + (s - 1) c`` (the add
  stays); a product with a per-channel constant is one affine with the norm; a sum of two convs gives ``t`` to one.
- A constant added after a norm (``bn(y^T)^T + c``): a number or a per-channel constant joins the norm's shift;
  one along the token axis, or a sum a residual also reads, keeps the affine.
- An affine read by a BatchNorm alone: ``bn(w x + b)`` with stored statistics is one affine of ``x`` and folds
  whole; before a BatchNorm of batch statistics the affine is kept.
- A norm read by a BatchNorm alone (BN -> BN, RepBN -> BN, over tokens through the transposes between them) is one
  affine composed in float64; a residual that also reads the first norm, a BatchNorm of batch statistics or in
  train mode, or a transpose that puts the channels on another axis keep each norm apart.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from slabconv import engine, fold
from slabconv.engine import onnx_fold, reasons
from slabconv.engine.capture import stored
from tests.foldcheck import (
    NAIVE_MIN_ERR,
    TOL,
    RepBN_NLP,
    affine_of,
    bn_nodes,
    kept_affines,
    patchtst_norm,
    randomize,
    rel_err,
)

C, B = 8, 2


def image(c: int = C, hw: int = 5) -> torch.Tensor:
    return torch.randn(B, c, hw, hw, generator=torch.Generator().manual_seed(0)) * 2 + 0.5


Summary = list[tuple[str, str, str, str | None, tuple[str, ...]]]


def both_doors(model: nn.Module, x: torch.Tensor, tmp_path: Path) -> Summary:
    """The program door's decisions, held equal to each ONNX export's; the fused graph and each fused ONNX file
    compute the original within the float32 tolerance."""
    from tests.test_doors import _export, _summary  # (tests/test_doors.py imports the exact-fold suites)

    reference = model(x)
    gm = engine.capture(model, x)
    program = _summary(engine.fold_all(gm))
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    for dynamo in (False, True):
        path = _export(model, x, tmp_path / f"model-{dynamo}.onnx", dynamo)
        fused, decisions = onnx_fold.fold_file(ir.load(str(path)), str(path))
        assert _summary(decisions) == program, f"dynamo={dynamo}"
        ir.save(fused, str(tmp_path / f"fused-{dynamo}.onnx"))
        session = ort.InferenceSession(str(tmp_path / f"fused-{dynamo}.onnx"), providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert rel_err(torch.from_numpy(out), reference) <= TOL[torch.float32], f"dynamo={dynamo}"
    return program


# --------------------------------------------------------------------------------------------- channel parts


class ChannelParts(nn.Module):
    """A BatchNorm after a ReLU (no layer before it to fold into) whose output is read in parts of its channel
    axis, each part by its own 1x1 conv: ``y[:, :3]``, ``y[:, 3:]``, ``narrow(1, 2, 5)``, ``split([3, 5])``,
    ``chunk(2)``, and a split put back together in order and permuted (``cat([b, a])``): every layer folds the
    norm's scale and shift of the channels it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(C)
        self.head, self.tail, self.mid = nn.Conv2d(3, 4, 1), nn.Conv2d(5, 4, 1), nn.Conv2d(5, 4, 1)
        self.first, self.second = nn.Conv2d(3, 4, 1), nn.Conv2d(5, 4, 1)
        self.half0, self.half1 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.inorder, self.permuted = nn.Conv2d(C, 4, 1), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.relu(x))
        a, b = torch.split(y, [3, 5], 1)
        h0, h1 = y.chunk(2, 1)
        out = self.head(y[:, :3]) + self.tail(y[:, 3:]) + self.mid(y.narrow(1, 2, 5))
        out = out + self.first(a) + self.second(b) + self.half0(h0) + self.half1(h1)
        return out + self.inorder(torch.cat([a, b], 1)) + self.permuted(torch.cat([b, a], 1))


class TokenParts(nn.Module):
    """A RepBN-style BatchNorm over the channels of ``(B, N, C)`` tokens (between two transposes) read in two
    parts of the last axis, ``y[..., :3]`` and ``y.split([3, 5], -1)[1]``, each by a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)
        self.fa, self.fb = nn.Linear(3, 4), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(torch.relu(x).transpose(1, 2)).transpose(1, 2)
        return self.fa(y[..., :3]) + self.fb(y.split([3, 5], -1)[1])


def test_a_norm_read_in_parts_of_its_channels_folds_into_each_parts_layer(tmp_path):
    model = randomize(ChannelParts(), seed=3).eval()
    x = image()
    program = both_doors(model, x, tmp_path)
    layers = ("first", "half0", "half1", "head", "inorder", "mid", "permuted", "second", "tail")
    assert program == [("norm", "BatchNorm", "folded-forward", None, layers)]
    gm = engine.capture(model, x)
    engine.fold_all(gm)
    assert not bn_nodes(gm) and not kept_affines(gm)


def test_a_norm_over_tokens_read_in_parts_of_its_channels_folds_into_each_parts_layer(tmp_path):
    model = randomize(TokenParts(), seed=3).eval()
    x = torch.randn(B, 6, C, generator=torch.Generator().manual_seed(0))
    assert both_doors(model, x, tmp_path) == [("bn", "BatchNorm", "folded-forward", None, ("fa", "fb"))]


class OnePart(nn.Module):
    """``conv(norm(relu(x))[part])`` for one part of the channel axis: ``tail`` ``y[:, 3:]``, ``strided``
    ``y[:, ::2]`` (every other channel), ``padded`` ``y[:, 2:5]`` read by a padded 3x3 conv."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.norm = nn.BatchNorm2d(C)
        width = {"tail": C - 3, "strided": 4, "padded": 3}[part]
        self.conv = nn.Conv2d(width, 4, 3, padding=1) if part == "padded" else nn.Conv2d(width, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.relu(x))
        if self.part == "tail":
            return self.conv(y[:, 3:])
        return self.conv(y[:, ::2] if self.part == "strided" else y[:, 2:5])


def _by_hand(model: OnePart, rows: slice | torch.Tensor) -> nn.Module:
    """``model`` without its norm, the norm's scale and shift of channels ``rows`` folded into ``conv``."""
    s, t = affine_of(model.norm)
    naive = copy.deepcopy(model)
    naive.norm = nn.Identity()
    with torch.no_grad():
        w, b = fold.fold_into_conv(model.conv.weight.double(), model.conv.bias.double(), s[rows], t[rows])
        naive.conv.weight.copy_(w)
        naive.conv.bias.copy_(b)
    return naive


def test_a_part_takes_the_affine_of_its_own_channels(tmp_path):
    """``y[:, 3:]`` folds into the conv with channels 3 to 7's scale and shift, exactly; with the first five
    channels' (a fold blind to where the part starts) it would be wrong."""
    model = randomize(OnePart("tail"), seed=3).eval()
    x = image()
    reference = model(x)
    assert rel_err(_by_hand(model, slice(3, 8))(x.double().float()), reference) <= TOL[torch.float32]
    assert rel_err(_by_hand(model, slice(0, 5))(x), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-forward", None, ("conv",))]


def test_a_strided_slice_takes_the_affine_of_the_channels_it_picks(tmp_path):
    """``y[:, ::2]`` holds channels 0, 2, 4, 6: it folds into the conv with their scale and shift, exactly; with the
    first four channels' (a contiguous part's) the fold would be wrong."""
    model = randomize(OnePart("strided"), seed=3).eval()
    x = image()
    reference = model(x)
    assert rel_err(_by_hand(model, slice(0, 8, 2))(x), reference) <= TOL[torch.float32]
    assert rel_err(_by_hand(model, slice(0, 4))(x), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-forward", None, ("conv",))]


class Picked(OnePart):
    """``conv(norm(relu(x)).index_select(1, idx))`` with a constant ``idx`` that reorders and repeats channels."""

    def __init__(self) -> None:
        super().__init__("strided")
        self.register_buffer("idx", torch.tensor([5, 0, 7, 0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(torch.relu(x)).index_select(1, self.idx))


def test_channels_picked_by_a_constant_index_take_their_own_affine(tmp_path):
    """Channels 5, 0, 7, 0: the conv folds their scale and shift, in that order, exactly; the first four channels'
    (a fold blind to the index) would be wrong."""
    model = randomize(Picked(), seed=3).eval()
    x = image()
    reference = model(x)
    assert rel_err(_by_hand(model, model.idx)(x), reference) <= TOL[torch.float32]
    assert rel_err(_by_hand(model, slice(0, 4))(x), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-forward", None, ("conv",))]


def test_an_affine_kept_after_a_slice_holds_the_slices_channels(tmp_path):
    """``y[:, 2:5]`` before a padded conv (``padded-conv-consumer``): the affine kept in front of the conv is that
    of channels 2 to 4, not of the first three."""
    model = randomize(OnePart("padded"), seed=3).eval()
    x = image()
    program = both_doors(model, x, tmp_path)
    assert program == [("norm", "BatchNorm", "kept-affine", reasons.PADDED_CONV_CONSUMER, ())]
    gm = engine.capture(model, x)
    engine.fold_all(gm)
    (mul,) = kept_affines(gm)
    kept_scale = stored(gm, mul.args[1].target).flatten().double()
    s, _ = affine_of(model.norm)
    assert torch.allclose(kept_scale, s[2:5]) and not torch.allclose(kept_scale, s[:3])


# --------------------------------------------------------------------------------------------- back through constants


class ConstantBeforeNorm(nn.Module):
    """``relu(norm(z))`` (no layer after the norm: only a backward fold removes it) with ``z`` made by a conv (with
    its own bias) and a constant or a second conv:

    - ``plus``: ``conv(x) + c``, ``c`` a stored ``(1, C, 1, 1)`` buffer; ``minus``: ``conv(x) - 0.7``;
    - ``times``: ``conv(x) * k``, ``k`` a stored per-channel buffer (a LayerScale of its own, folded first);
    - ``two``: ``conv(x) + conv2(x)``: both take ``s``, one of them ``t``;
    - ``shared``: ``conv(x) + c`` where ``conv(x)`` is also read by ``side`` (refused).
    """

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv, self.conv2, self.side = nn.Conv2d(4, C, 3), nn.Conv2d(4, C, 3), nn.Conv2d(C, 3, 1)
        self.norm = nn.BatchNorm2d(C)
        gen = torch.Generator().manual_seed(5)
        self.register_buffer("c", torch.randn(1, C, 1, 1, generator=gen) * 2)
        self.register_buffer("k", torch.rand(1, C, 1, 1, generator=gen) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        z = {"plus": lambda: h + self.c, "minus": lambda: h - 0.7, "times": lambda: h * self.k}.get(
            self.how, lambda: h + (self.conv2(x) if self.how == "two" else self.c)
        )()
        out = torch.relu(self.norm(z))
        return out + self.side(h).mean(1, keepdim=True) if self.how == "shared" else out


def _constant_model(how: str) -> tuple[ConstantBeforeNorm, torch.Tensor]:
    return randomize(ConstantBeforeNorm(how), seed=3).eval(), image(4, 6)


def _into_rows(model: ConstantBeforeNorm, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    """``model`` without its norm, each named conv's rows scaled by ``s`` and its bias made ``s b + shift``."""
    naive = copy.deepcopy(model).double()
    naive.norm = nn.Identity()
    with torch.no_grad():
        for name, (s, shift) in layers.items():
            conv = getattr(naive, name)
            w, b = fold.fold_into_producer(conv.weight, conv.bias, s, shift)
            conv.weight.copy_(w)
            conv.bias.copy_(b)
    return naive


@pytest.mark.parametrize(("how", "value"), [("plus", None), ("minus", -0.7)])
def test_a_norm_after_a_constant_add_folds_back_into_the_conv(how, value, tmp_path):
    """``s (conv(x) + c) + t``: the conv takes ``s`` and the shift ``t + (s - 1) c``, and the add of ``c`` stays.
    Done by hand in float64 it is exact; the plain backward fold (shift ``t``, as if ``c`` were not there) is
    wrong."""
    model, x = _constant_model(how)
    s, t = affine_of(model.norm)
    c = model.c.flatten().double() if value is None else torch.full((C,), value, dtype=torch.float64)
    reference = model.double()(x.double())
    assert rel_err(_into_rows(model, {"conv": (s, t + (s - 1) * c)})(x.double()), reference) < 1e-12
    assert rel_err(_into_rows(model, {"conv": (s, t)})(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-backward", None, ("conv",))]


def test_a_norm_after_a_per_channel_product_folds_back_through_the_product(tmp_path):
    """``s (conv(x) k) + t``: the product, read by the norm alone, is one affine with it (scale ``s k``), folded into
    the conv."""
    model, x = _constant_model("times")
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-backward", None, ("conv",))]


def test_a_norm_after_a_sum_of_two_convs_gives_its_shift_to_one(tmp_path):
    """``s (a + b) + t = (s a + t) + s b``: both convs take ``s``, one of them ``t``; ``t`` in both (each addend
    folded as if it were the norm's only input) is wrong."""
    model, x = _constant_model("two")
    s, t = affine_of(model.norm)
    reference = model.double()(x.double())
    assert rel_err(_into_rows(model, {"conv": (s, t), "conv2": (s, 0 * t)})(x.double()), reference) < 1e-12
    assert rel_err(_into_rows(model, {"conv": (s, t), "conv2": (s, t)})(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-backward", None, ("conv", "conv2"))]


def test_no_backward_fold_through_a_constant_add_when_another_layer_reads_the_conv(tmp_path):
    """``conv(x)`` also feeds ``side``: a backward fold must give ``side`` the inverse of what ``conv``'s output
    becomes, which depends on which side of the constant's add the shared tensor lies; refused (the norm stays an
    affine before the ReLU), and the fold that forgets the constant (``side`` taking ``(1 / s, -t / s)``) is wrong."""
    model, x = _constant_model("shared")
    s, t = affine_of(model.norm)
    reference = model.double()(x.double())
    naive = _into_rows(model, {"conv": (s, t)})
    with torch.no_grad():
        w, b = fold.fold_into_conv(naive.side.weight, naive.side.bias, 1 / s, -t / s)
        naive.side.weight.copy_(w)
        naive.side.bias.copy_(b)
    assert rel_err(naive(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "kept-affine", reasons.NONLINEAR, ())]
    gm = engine.capture(model, x)
    (d,) = engine.fold_all(gm)
    assert d.no_backward == "a constant is added on the way and another layer reads a tensor there"


class ConstantAfterNorm(nn.Module):
    """``fc(bn(relu(x)) + c)`` over tokens (the BN between two transposes; the ReLU: no layer before the norm to fold
    into), ``c`` added to the norm's output before the layer that reads it: ``number`` 0.5, ``stored`` a stored
    per-channel constant, ``tokens`` a stored constant that varies along the token axis, ``residual`` the stored
    per-channel one with ``bn(...) + c`` also added to ``fc``'s output."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm, self.fc = nn.BatchNorm1d(C), nn.Linear(C, C)
        gen = torch.Generator().manual_seed(7)
        self.register_buffer("c", torch.randn(C, generator=gen) * 2)
        self.register_buffer("per_token", torch.randn(6, 1, generator=gen) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.relu(x).transpose(1, 2)).transpose(1, 2)
        c = {"number": 0.5, "tokens": self.per_token}.get(self.how, self.c)
        z = y + c
        return self.fc(z) + z if self.how == "residual" else self.fc(z)


def _folded_by_hand(
    model: nn.Module, norms: tuple[str, ...], layer: str, s: torch.Tensor, t: torch.Tensor
) -> nn.Module:
    """``model`` in float64 with its modules ``norms`` replaced by identities and ``(s, t)`` folded into its Linear or
    conv ``layer`` (``fold.fold_into_linear`` / ``fold_into_conv``): a fold done by hand, right or naive."""
    naive = copy.deepcopy(model).double()
    for name in norms:
        setattr(naive, name, nn.Identity())
    into = getattr(naive, layer)
    fold_into = fold.fold_into_linear if isinstance(into, nn.Linear) else fold.fold_into_conv
    with torch.no_grad():
        w, b = fold_into(into.weight, into.bias, s, t)
        into.weight.copy_(w)
        into.bias.copy_(b)
    return naive


def _constant_after(how: str) -> tuple[ConstantAfterNorm, torch.Tensor, torch.Tensor, nn.Module]:
    """The model, its input, its output in float64 and the naive forward fold (``fc`` taking ``(s, t)``, the add
    left in place), in float64."""
    model = randomize(ConstantAfterNorm(how), seed=4).eval()
    x = torch.randn(B, 6, C, generator=torch.Generator().manual_seed(1))
    s, t = affine_of(model.norm)
    reference = model.double()(x.double())
    naive = _folded_by_hand(model, ("norm",), "fc", s, t)
    model.float()
    return model, x, reference, naive


@pytest.mark.parametrize("how", ["number", "stored"])
def test_a_constant_added_after_the_norm_joins_it(how, tmp_path):
    """``bn(y^T)^T + c`` with ``c`` a number or a per-channel constant is one affine of ``y`` (shift ``t + c``): the
    add is part of the norm and ``fc`` takes ``(s, t + c)``; the naive forward fold (``fc`` taking ``(s, t)``, the
    add left in place) is wrong. It was kept with ``constant-added-after-norm``."""
    model, x, reference, naive = _constant_after(how)
    assert rel_err(naive(x.double()), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-forward", None, ("fc",))]
    gm = engine.capture(model, x)
    engine.fold_all(gm)
    assert not bn_nodes(gm) and not kept_affines(gm)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]


@pytest.mark.parametrize(("how", "reason", "into"), [("tokens", reasons.CONSTANT_ADDED_AFTER_NORM, ()),
                                                     ("residual", reasons.RESIDUAL_READS_NORM, ("fc",))])  # fmt: skip
def test_a_constant_added_after_the_norm_along_tokens_or_before_a_residual_keeps_it(how, reason, into, tmp_path):
    """A constant that varies along the token axis is no per-channel shift, and ``bn(...) + c`` read by ``fc`` and
    by the residual sum has no layer for the residual's share: both keep the affine (the residual's share, ``fc``
    folding its own; the naive forward fold is wrong), and the fused graph and files compute the original."""
    model, x, reference, naive = _constant_after(how)
    assert rel_err(naive(x.double()), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "kept-affine", reason, into)]


# --------------------------------------------------------------------------------------------- affine then BN


class AffineThenBN(nn.Module):
    """``conv(bn(lab(relu(pre(x)))))``: an affine after a ReLU (no layer it can fold back into) read by a BatchNorm
    alone, as PP-LCNetV3's ``LearnableAffineBlock`` (a learned scalar scale and bias, ``per_channel`` False) or a
    MobileBERT ``NoNorm`` (``x * w + b`` per channel) before a ``BatchNorm2d``. ``batch_stats``: the BN has no
    running statistics (it normalises by each batch's)."""

    def __init__(self, per_channel: bool, batch_stats: bool = False) -> None:
        super().__init__()
        size = C if per_channel else 1
        self.pre, self.conv = nn.Conv2d(C, C, 1), nn.Conv2d(C, 4, 1)
        gen = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.rand(size, generator=gen).view(-1, 1, 1) + 1.5)
        self.b = nn.Parameter(torch.randn(size, generator=gen).view(-1, 1, 1))
        self.bn = nn.BatchNorm2d(C, track_running_stats=not batch_stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(torch.relu(self.pre(x)) * self.w + self.b))


def _affine_bn_naive(model: AffineThenBN, mean: torch.Tensor, var: torch.Tensor) -> nn.Module:
    """``model`` without its affine, the BN (as one with statistics ``mean`` / ``var``) folded into ``conv``."""
    naive = copy.deepcopy(model)
    bn = naive.bn
    s = bn.weight.double() / torch.sqrt(var.double() + bn.eps)
    t = bn.bias.double() - s * mean.double()
    with torch.no_grad():
        naive.w.fill_(1.0)
        naive.b.zero_()
        naive.bn = nn.Identity()
        w, b = fold.fold_into_conv(model.conv.weight.double(), model.conv.bias.double(), s, t)
        naive.conv.weight.copy_(w)
        naive.conv.bias.copy_(b)
    return naive


@pytest.mark.parametrize("per_channel", [False, True])
def test_an_affine_read_by_a_batchnorm_alone_folds_with_it(per_channel, tmp_path):
    """``bn(w x + b)`` with stored statistics is one affine of ``x`` (``w`` times the BN's scale, the BN's scale
    times ``b`` plus its shift): it folds into ``conv`` and neither the affine nor the BN is left. It said
    ``unsupported-op:aten.batch_norm`` and kept the affine; the BN's fold without the affine is wrong."""
    model = randomize(AffineThenBN(per_channel), seed=3).eval()
    x = image()
    reference = model(x)
    assert rel_err(_affine_bn_naive(model, model.bn.running_mean, model.bn.running_var)(x), reference) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [("bn", "BatchNorm", "folded-forward", None, ("conv",))]
    gm = engine.capture(model, x)
    engine.fold_all(gm)
    assert not bn_nodes(gm) and not kept_affines(gm)
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor)]


def test_an_affine_read_by_a_batchnorm_of_batch_statistics_is_kept():
    """A BN without running statistics is no fixed affine: composing the affine with it (as a BN of mean 0 and
    variance 1) is wrong, so the affine stays before the BN (``unsupported-op:aten.batch_norm``) and the BN is
    kept; the graph computes the original."""
    model = randomize(AffineThenBN(per_channel=True, batch_stats=True), seed=3).eval()
    x = image()
    reference = model(x)
    assert rel_err(_affine_bn_naive(model, torch.zeros(C), torch.ones(C))(x), reference) > NAIVE_MIN_ERR
    gm = engine.capture(model, x)
    summary = [(d.kind, d.action, d.reason) for d in engine.fold_all(gm)]
    assert summary == [
        ("Affine", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.batch_norm"),
        ("BatchNorm", "kept", reasons.BATCH_STATS_IN_EVAL),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


# --------------------------------------------------------------------------------------------- norm then BN


class RepBN2d(nn.Module):
    """SLAB's RepBN on images: ``bn(x) + alpha x``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) + self.alpha * x


class NormThenBN(nn.Module):
    """``layer(second(first(relu(x))))``: a norm after a ReLU (no layer it can fold back into) read by a BatchNorm
    alone. ``first``: ``bn`` a BatchNorm2d, ``repbn`` a RepBN (``RepBN2d``), ``tokens`` a BatchNorm1d over the
    channels of ``(B, N, C)`` tokens between two transposes (PatchTST's), ``repbn_tokens`` the seed's ``RepBN_NLP``;
    ``second`` is a BatchNorm2d before a 1x1 conv on images, the tokens' BatchNorm1d (between its own two transposes:
    ``y.transpose(1, 2).transpose(1, 2)`` between the two BNs) before a Linear on tokens. ``residual``: ``first``'s
    output is also read by ``side`` (images). ``batch_stats``: ``second`` has no running statistics."""

    def __init__(self, first: str, residual: bool = False, batch_stats: bool = False) -> None:
        super().__init__()
        self.tokens = first in ("tokens", "repbn_tokens")
        self.residual = residual
        make = {"bn": lambda: nn.BatchNorm2d(C), "repbn": lambda: RepBN2d(C), "tokens": lambda: patchtst_norm(C)}
        self.first = make.get(first, lambda: RepBN_NLP(C))()
        self.second = patchtst_norm(C) if self.tokens else nn.BatchNorm2d(C, track_running_stats=not batch_stats)
        self.layer = nn.Linear(C, 4) if self.tokens else nn.Conv2d(C, 4, 1)
        self.side = nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(torch.relu(x))
        out = self.layer(self.second(y))
        return out + self.side(y) if self.residual else out


def _norm_then_bn(first: str, **how: bool) -> tuple[NormThenBN, torch.Tensor]:
    model = randomize(NormThenBN(first, **how), seed=3).eval()
    x = torch.randn(B, 6, C, generator=torch.Generator().manual_seed(1)) if model.tokens else image()
    return model, x


def _into_layer(model: NormThenBN, s: torch.Tensor, t: torch.Tensor) -> nn.Module:
    """``model`` without its two norms, ``(s, t)`` folded into ``layer``, in float64."""
    return _folded_by_hand(model, ("first", "second"), "layer", s, t)


@pytest.mark.parametrize("first", ["bn", "repbn", "tokens", "repbn_tokens"])
def test_a_norm_read_by_a_batchnorm_alone_folds_with_it(first, tmp_path):
    """``second(first(y))``, both in eval mode with stored statistics, is one affine of ``y``: scale ``s2 s1``, shift
    ``s2 t1 + t2`` (composed in float64), folded into the layer; no norm and no affine is left (each used to keep
    ``first`` with ``unsupported-op:aten.batch_norm``). Done by hand it is exact; composed in the other order
    (shift ``s1 t2 + t1``) it is wrong."""
    model, x = _norm_then_bn(first)
    (s1, t1), (s2, t2) = affine_of(model.first), affine_of(model.second)
    reference = model.double()(x.double())
    assert rel_err(_into_layer(model, s2 * s1, s2 * t1 + t2)(x.double()), reference) < 1e-12
    assert rel_err(_into_layer(model, s2 * s1, s1 * t2 + t1)(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    assert both_doors(model, x, tmp_path) == [("second", "BatchNorm", "folded-forward", None, ("layer",))]
    gm = engine.capture(model, x)
    (d,) = engine.fold_all(gm)
    assert not bn_nodes(gm) and not kept_affines(gm)
    assert [w for w in d.warnings if w.startswith("composed")][0].startswith("composed with first:")  # names it


def test_a_norm_read_by_a_batchnorm_and_a_residual_is_not_composed(tmp_path):
    """``first``'s output also feeds ``side``: the composed affine is not what ``side`` reads, so composing and
    removing both norms (``side`` then reading the ReLU's output) is wrong; ``first`` keeps its affine in front of
    the BatchNorm (``side`` folds its share) and ``second`` folds into ``layer`` on its own."""
    model, x = _norm_then_bn("bn", residual=True)
    (s1, t1), (s2, t2) = affine_of(model.first), affine_of(model.second)
    reference = model.double()(x.double())
    assert rel_err(_into_layer(model, s2 * s1, s2 * t1 + t2)(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    assert both_doors(model, x, tmp_path) == [
        ("first", "BatchNorm", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.batch_norm", ("side",)),
        ("second", "BatchNorm", "folded-forward", None, ("layer",)),
    ]


@pytest.mark.parametrize("train", [False, True])
def test_a_norm_read_by_a_batchnorm_of_batch_statistics_is_not_composed(train):
    """A second BatchNorm without running statistics (or in train mode) normalises by each batch's own: composing
    it with ``first`` as a fixed affine (mean 0 and variance 1, or its running statistics) is wrong, so ``first``
    keeps its affine in front of it and the BatchNorm is kept; the graph computes the original."""
    model, x = _norm_then_bn("bn", batch_stats=not train)
    (s1, t1), (s2, t2) = affine_of(model.first), affine_of(model.second)
    if train:
        model.second.train()
    reference = copy.deepcopy(model).double()(x.double())
    assert rel_err(_into_layer(model, s2 * s1, s2 * t1 + t2)(x.double()), reference) > NAIVE_MIN_ERR
    model.float()
    gm = engine.capture(copy.deepcopy(model), x)
    summary = [(d.kind, d.action, d.reason) for d in engine.fold_all(gm)]
    assert summary == [
        ("BatchNorm", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.batch_norm"),
        ("BatchNorm", "kept", reasons.TRAIN_MODE if train else reasons.BATCH_STATS_IN_EVAL),
    ]
    assert rel_err(gm(x), copy.deepcopy(model)(x)) <= TOL[torch.float32]


class BNOverRows(nn.Module):
    """``conv(second(first(relu(x)).transpose(1, 2)).transpose(1, 2))`` on square images of ``C`` rows: ``second``
    normalises the rows (the second axis after the transpose), not ``first``'s channels."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.conv = nn.BatchNorm2d(C), nn.BatchNorm2d(C), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.second(self.first(torch.relu(x)).transpose(1, 2)).transpose(1, 2))


def test_a_batchnorm_over_another_axis_of_a_norms_output_is_not_composed(tmp_path):
    """A transpose that does not give back ``first``'s layout puts its channels on another axis than ``second``'s:
    ``second(first(y)^T)`` is no per-channel affine of ``y``, and the product of the two per-channel vectors (the
    same size here) is wrong; each norm is decided on its own."""
    model = randomize(BNOverRows(), seed=3).eval()
    x = image(hw=C)
    (s1, t1), (s2, t2) = affine_of(model.first), affine_of(model.second)
    naive = _folded_by_hand(model, ("first", "second"), "conv", s2 * s1, s2 * t1 + t2)
    assert rel_err(naive(x.double()), model.double()(x.double())) > NAIVE_MIN_ERR
    model.float()
    program = both_doors(model, x, tmp_path)
    assert [(d[0], d[2]) for d in program] == [("first", "kept-affine"), ("second", "kept-affine")]


class ReshapedChain(nn.Module):
    """LeViT's BatchNorm over tokens twice in a row: ``fc(bn2(bn1(h.flatten(0, 1)).reshape_as(h).flatten(0, 1))
    .reshape_as(h))`` with ``h = relu(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.fc = nn.BatchNorm1d(C), nn.BatchNorm1d(C), nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x)
        y = self.first(h.flatten(0, 1)).reshape_as(h)
        return self.fc(self.second(y.flatten(0, 1)).reshape_as(y))


def test_norms_read_through_a_reshape_and_back_are_decided_alike_by_every_door(tmp_path):
    """Between two BatchNorms a reshape and its inverse: the TorchScript exporter reads the reshaped value's shape
    back (``Shape``, as the program's ``reshape_as`` reads its template), so the first norm's ops would stay for a
    shape alone; no door composes them (the first keeps its affine before the second, which folds), and each
    fused graph computes the original."""
    model = randomize(ReshapedChain(), seed=3).eval()
    x = torch.randn(B, 6, C, generator=torch.Generator().manual_seed(1))
    assert both_doors(model, x, tmp_path) == [
        ("first", "BatchNorm", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.batch_norm", ()),
        ("second", "BatchNorm", "folded-forward", None, ("fc",)),
    ]


# --------------------------------------------------------------------------------------------- every norm listed


class PoolMixerStage(nn.Module):
    """PoolFormer's last stage (transformers' ``PoolFormerLayer``): a LayerScale on the pooling mixer's output
    ``pool(y) - y`` of a GroupNorm's output, read by a residual sum that only a GroupNorm and the head read after
    it. No layer downstream contracts the LayerScale's axis without a GroupNorm first, so only the GroupNorm upstream
    says that axis holds channels."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.embed = nn.Conv2d(c, c, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(1, c), nn.GroupNorm(1, c)
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.scale = nn.Parameter(0.5 + torch.rand(c, 1, 1, generator=torch.Generator().manual_seed(1)))
        self.head = nn.Linear(c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        y = self.norm1(x)
        x = x + self.scale * (self.pool(y) - y)
        return self.head(self.norm2(x).mean((2, 3)))


def test_a_layer_scale_after_a_pooling_mixer_of_a_group_norm_is_listed_by_every_door(tmp_path):
    """The LayerScale is a per-channel constant product on the channels a GroupNorm gives its axis (through the
    stride-1 pooling, which keeps the layout): listed, and kept because the residual sum reads its output (it was in
    no list at all, its ``Mul`` silently left in the fused graph). Folding it into ``head`` regardless is wrong."""
    torch.manual_seed(0)
    model = PoolMixerStage().eval()
    x = image()
    naive = copy.deepcopy(model)
    with torch.no_grad():
        naive.head.weight.mul_(model.scale.view(-1))
        naive.scale.fill_(1.0)
    assert rel_err(naive(x), model(x)) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [
        ("scale", "LayerScale", "kept-affine", reasons.RESIDUAL_READS_NORM, ()),
    ]


def test_the_overflow_message_of_a_composed_norm_gives_the_composed_affine(tmp_path):
    """Two BatchNorms of scale 1e20 each compose into one of scale 1e40, past float32: the fold's weights overflow
    and fuse stops before writing; the message names the composed norm and the affine it folded (1e40), not the
    reading BatchNorm's own statistics (1e20)."""
    from slabconv import api
    from slabconv.errors import NumericError

    model, x = _norm_then_bn("bn")
    with torch.no_grad():
        for bn in (model.first, model.second):
            bn.weight.fill_(1e20)
            bn.bias.zero_()
            bn.running_mean.zero_()
            bn.running_var.fill_(1.0)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)), path)
    with pytest.raises(NumericError, match=r"norm second \(its scale or shift reaches 1e\+40\) makes "):
        api.fuse(path, tmp_path / "out")


class Lab(nn.Module):
    """HGNetV2's learnable affine block: a learned scalar ``scale * x + bias`` after an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.tensor([1.3])), nn.Parameter(torch.tensor([0.2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


class EqualAffines(nn.Module):
    """Three learnable affine blocks holding equal values, which each exporter stores once: the dynamo exporter as
    one initializer three ``Mul`` / ``Add`` read, the TorchScript exporter as ``Identity`` copies of it."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.c1, self.c2, self.c3, self.c4 = (nn.Conv2d(3 if i == 0 else c, c, 1) for i in range(4))
        self.lab1, self.lab2, self.lab3 = Lab(), Lab(), Lab()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lab1(torch.relu(self.c1(x)))
        x = self.lab2(torch.relu(self.c2(x)))
        x = self.c3(x) + x
        return self.c4(self.lab3(torch.relu(x)))


def test_affines_whose_equal_parameters_the_exporter_stores_once_are_listed_by_every_door(tmp_path):
    """The TorchScript exporter writes ``lab2.scale = Identity(lab1.scale)``: the copies are the modules' own
    parameters, listed and decided as the program lists them (lab2 and lab3 were in no list through that door, their
    ``Mul`` / ``Add`` silently left in the fused graph), and the affine kept for the residual still reads the values
    the folds left unchanged. Folding lab2 into ``c3`` regardless is wrong: the residual reads it."""
    torch.manual_seed(0)
    model = EqualAffines().eval()
    x = image(3)
    naive = copy.deepcopy(model)
    with torch.no_grad():
        naive.c3.bias.add_(0.2 * naive.c3.weight.sum((1, 2, 3)))
        naive.c3.weight.mul_(1.3)
        naive.lab2.scale.fill_(1.0)
        naive.lab2.bias.zero_()
    assert rel_err(naive(x), model(x)) > NAIVE_MIN_ERR
    assert both_doors(model, x, tmp_path) == [
        ("lab1.scale", "Affine", "folded-forward", None, ("c2",)),
        ("lab2.scale", "Affine", "kept-affine", reasons.RESIDUAL_READS_NORM, ("c3",)),
        ("lab3.scale", "Affine", "folded-forward", None, ("c4",)),
    ]


# --------------------------------------------------------------------------------------------- in-place ops


class InPlaceSums(nn.Module):
    """``+=`` as models write it: a constant added in place to a BatchNorm's output read by a conv (folds forward,
    the constant joining the shift), and RepVGG's identity-branch BatchNorm added in place to the sum of its two
    convs (kept: the residual sum reads it)."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.norm, self.identity = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
        self.conv, self.kxk, self.pointwise = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.relu(x))
        y += 0.5
        y = torch.relu(self.conv(y))
        s = self.kxk(y) + self.pointwise(y)
        s += self.identity(y)
        return torch.relu(s)


def test_in_place_sums_are_decided_as_their_out_of_place_forms_by_every_door(tmp_path):
    """``aten.add_`` on a tensor only it reads is planned as ``aten.add`` (the program door named it
    ``unsupported-op:aten.add_`` and kept both norms, where the ONNX doors, whose ``Add`` is out of place, fold
    the first)."""
    torch.manual_seed(0)
    model = randomize(InPlaceSums()).eval()
    assert both_doors(model, image(), tmp_path) == [
        ("norm", "BatchNorm", "folded-forward", None, ("conv",)),
        ("identity", "BatchNorm", "kept-affine", reasons.RESIDUAL_READS_NORM, ()),
    ]


class InPlaceThroughAView(nn.Module):
    """A constant added in place to a view of a BatchNorm's output: it writes the BatchNorm's output itself, which
    the conv reads after it (and the side conv before it)."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.norm, self.conv, self.side = nn.BatchNorm2d(c), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)

    def unwritten(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor written in place, before the write: what the conv reads once the write is lost."""
        return self.norm(torch.relu(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.unwritten(x)
        z = self.side(y)
        v = y.view(y.shape)
        v += 0.5
        return self.conv(y) + z


class InPlaceAfterAStep(InPlaceThroughAView):
    """A constant added in place to a tensor one step after a BatchNorm (``z = y.flip(3)``, a copy the affine
    passes), which the conv reads under another name after the write: the write is on the norm's path, not on its
    output."""

    def unwritten(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(x)).flip(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.unwritten(x)
        read = z
        out = self.side(z)
        z += 0.5
        return self.conv(read) + out


@pytest.mark.parametrize("model_class", [InPlaceThroughAView, InPlaceAfterAStep])
def test_a_norm_whose_output_or_path_is_written_in_place_is_kept_whole(model_class):
    """The op stays ``aten.add_`` (written as an add, its sum would be read by nothing) and the BatchNorm is kept
    whole: folded into both convs, with its affine kept before the ``add_`` alone, the conv would read the written
    tensor without the constant the write put into it (through a view of the norm's output, or into a tensor on
    its path); the fused graph computes the original."""
    torch.manual_seed(0)
    model = randomize(model_class()).eval()
    x = image()
    with torch.no_grad():
        reference = model(x)
        y = model.unwritten(x)
        assert rel_err(model.conv(y) + model.side(y), reference) > NAIVE_MIN_ERR  # the write lost
    gm = engine.capture(model, x)
    assert any(str(n.target) == "aten.add_.Tensor" for n in gm.graph.nodes)
    decisions = engine.fold_all(gm)
    assert [(d.norm, d.action, d.reason) for d in decisions] == [("norm", "kept", "unsupported-op:aten.add_")]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


# --------------------------------------------------------------------------------------------- zeros after a norm


class ZerosAfterNorm(nn.Module):
    """``conv(op(bn(x)))`` with an unpadded 3x3 conv, ``op`` adding zeros the norm did not make: ``pad`` an explicit
    ``F.pad`` (ONNX ``Pad``) of ``value``; ``avg`` a 3x3 average pool counting its padded zeros
    (``count_include_pad=True``); ``grid`` a bilinear ``grid_sample`` reading zeros outside the input. With
    ``shift=False`` the BatchNorm's bias and mean are 0 (a scale of mixed signs alone)."""

    def __init__(self, how: str, shift: bool, value: float = 0.0) -> None:
        super().__init__()
        self.how, self.value = how, value
        self.norm, self.conv = nn.BatchNorm2d(C), nn.Conv2d(C, 4, 3)
        self.register_buffer("grid", torch.rand(B, 6, 6, 2, generator=torch.Generator().manual_seed(1)) * 2.6 - 1.3)
        randomize(self, seed=3, positive=False)
        if not shift:
            with torch.no_grad():
                self.norm.bias.zero_(), self.norm.running_mean.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        if self.how == "pad":
            y = nn.functional.pad(y, (1, 1, 1, 1), value=self.value)
        elif self.how == "avg":
            y = nn.functional.avg_pool2d(y, 3, 1, 1)
        else:
            y = nn.functional.grid_sample(y, self.grid, padding_mode="zeros", align_corners=False)
        return self.conv(y)


def _naive_into_conv(model: ZerosAfterNorm) -> nn.Module:
    """``model`` with its norm's ``(s, t)`` folded into the conv anyway, in float64."""
    return _folded_by_hand(model, ("norm",), "conv", *affine_of(model.norm))


@pytest.mark.parametrize("how", ["pad", "avg", "grid"])
def test_a_shift_free_norm_folds_through_added_zeros(how, tmp_path):
    """A norm whose every shift is 0 (a LayerScale, a BatchNorm of bias and mean 0) before an explicit zero pad, an
    average pool counting padded zeros or a grid sample reading zeros: ``pad(s x, 0) = s pad(x, 0)`` and a weighted
    sum of ``s x`` and zeros is ``s`` times that of ``x`` and zeros, so the scale folds into the conv after it, by
    hand exactly, and through every door (a dynamo export merges the pad into the conv, already a padded conv that
    a shift-free norm folds into)."""
    model = ZerosAfterNorm(how, shift=False).eval()
    x = image(hw=6)
    assert not affine_of(model.norm)[1].any()
    assert rel_err(_naive_into_conv(model)(x.double()), model.double()(x.double())) < 1e-12
    model.float()
    assert both_doors(model, x, tmp_path) == [("norm", "BatchNorm", "folded-forward", None, ("conv",))]


@pytest.mark.parametrize(("how", "shift", "value"), [("pad", True, 0.0), ("avg", True, 0.0), ("pad", False, 0.5)])
def test_added_zeros_after_a_norm_with_a_shift_or_a_non_zero_pad_keep_the_affine(how, shift, value, tmp_path):
    """The same models with a shift (a padded zero would have to become ``t``), or shift-free before a pad of 0.5
    (it would have to become ``0.5 / s``): the affine is kept with ``zero-padding-after-norm``, and the naive fold
    is wrong. A dynamo export merges a zero pad into the conv, which then keeps it as ``padded-conv-consumer``."""
    model = ZerosAfterNorm(how, shift, value).eval()
    x = image(hw=6)
    assert rel_err(_naive_into_conv(model)(x.double()), model.double()(x.double())) > NAIVE_MIN_ERR
    model.float()
    kept = [("norm", "BatchNorm", "kept-affine", reasons.ZERO_PADDING_AFTER_NORM, ())]
    if how != "pad" or value:
        assert both_doors(model, x, tmp_path) == kept
        return
    gm = engine.capture(model, x)
    decisions = engine.fold_all(gm)
    assert [(d.action, d.reason) for d in decisions] == [("kept-affine", reasons.ZERO_PADDING_AFTER_NORM)]
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


@pytest.mark.parametrize("dynamo", [False, True])
def test_a_backward_blocker_is_named_by_the_onnx_node_a_user_finds_in_the_file(dynamo, tmp_path):
    """The concatenation whose piece ``a`` also feeds a tanh (tests/test_exact_folds.py: no backward fold, the
    blocker named): through the ONNX door the tensor read elsewhere is named by its ONNX node's name, one that is in
    the file, not by the fx node the engine made of it."""
    from tests.test_doors import _export
    from tests.test_exact_folds import ConcatThenNorm, concat_input

    model, x = randomize(ConcatThenNorm("conv", shared="tanh")).eval(), concat_input("conv")
    path = _export(model, x, tmp_path / "model.onnx", dynamo)
    graph = ir.load(str(path))
    names = {node.name for node in graph.graph.all_nodes()}
    _, (d,) = onnx_fold.fold_file(graph, str(path))
    assert d.action == "kept-affine" and " is also read by " in (d.no_backward or ""), d.no_backward
    assert d.no_backward.split(" is also read by ")[0] in names, (d.no_backward, sorted(names))


# --------------------------------------------------------------------------------------------- one module, two calls


class CalledTwice(nn.Module):
    """One BatchNorm module called on two branches (after a ReLU each, so no exporter folds it into a conv)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(C, C, 3, padding=1), nn.Conv2d(C, C, 3, padding=1)
        self.bn, self.h1, self.h2 = nn.BatchNorm2d(C), nn.Conv2d(C, 4, 1), nn.Conv2d(C, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h1(self.bn(torch.relu(self.c1(x)))) + self.h2(self.bn(torch.relu(self.c2(x))))


def test_a_norm_module_called_twice_makes_two_norms_of_their_own_names(tmp_path):
    """Each call of one norm module is a norm of its own, with its own fold, named apart (``bn``, then ``bn_1`` as
    the TorchScript exporter names the second call's scope) through every door: the report, ``inspect`` and what
    is looked up by a norm's name (its int8 step) cannot mix the two up."""
    program = both_doors(randomize(CalledTwice(), seed=5).eval(), image(), tmp_path)
    assert program == [
        ("bn", "BatchNorm", "folded-forward", None, ("h1",)),
        ("bn_1", "BatchNorm", "folded-forward", None, ("h2",)),
    ]
