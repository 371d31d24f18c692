"""Models users bring: the seed ``RepBN_NLP`` in a small text transformer, a PatchTST-style post-norm encoder,
Swin window attention, PVT spatial reduction, Informer's ConvLayer, a LLaMA-style flattened RepBN; and the
channel-axis rules one by one (gather / index / roll / flip / cat over tokens, sum vs mean, fan-out, backward
folds, affine=False, float16 / bfloat16). Every model is folded and compared with the original."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv import engine, fold
from slabconv.engine import reasons
from slabconv.zoo.norms import LinearNorm, RepBN
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
    naive_fold,
    norm_free,
    patchtst_norm,
    randomize,
    rel_err,
)

C, N, B = 8, 6, 4


def tokens(n: int = N, c: int = C, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(B, n, c, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5).to(dtype)


def by_norm(decisions: list[engine.Decision]) -> dict[str, engine.Decision]:
    return {d.norm: d for d in decisions}


def assert_exact(model: nn.Module, x: torch.Tensor, norms: list[str], kept: int = 0) -> list[engine.Decision]:
    """Fold ``model``; the output equals the original within the dtype's tolerance and the graph is the norm-free
    graph plus ``kept`` affines."""
    model = model.eval()
    reference = model(x)
    bare_ops = aten_ops(norm_free(model, norms), x)
    gm, decisions = fuse(model, x)
    assert rel_err(gm(x), reference) <= TOL[x.dtype if x.is_floating_point() else torch.float32]
    assert_affine_only(gm, bare_ops, kept)
    return decisions


# --------------------------------------------------------------------------------------------- seed RepBN_NLP


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class TextBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = RepBN_NLP(dim)
        self.attn = Attention(dim)
        self.norm2 = RepBN_NLP(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TextTransformer(nn.Module):
    """Token ids -> embedding -> 2 pre-norm blocks with the seed RepBN_NLP -> norm -> mean over tokens -> head."""

    def __init__(self, vocab: int = 50, dim: int = 16, seq: int = 7, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.1)
        self.blocks = nn.ModuleList([TextBlock(dim) for _ in range(2)])
        self.norm = RepBN_NLP(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def test_seed_repbn_nlp_text_transformer_folds_completely():
    torch.manual_seed(0)
    model = randomize(TextTransformer())
    ids = torch.randint(0, 50, (B, 7), generator=torch.Generator().manual_seed(1))
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    decisions = assert_exact(model, ids, norms)
    assert [(d.norm, d.kind, d.action, d.into) for d in decisions] == [
        ("blocks.0.norm1", "RepBN", "folded-forward", ["blocks.0.attn.qkv"]),
        ("blocks.0.norm2", "RepBN", "folded-forward", ["blocks.0.fc1"]),
        ("blocks.1.norm1", "RepBN", "folded-forward", ["blocks.1.attn.qkv"]),
        ("blocks.1.norm2", "RepBN", "folded-forward", ["blocks.1.fc1"]),
        ("norm", "RepBN", "folded-forward", ["head"]),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_keep_their_dtype(dtype):
    torch.manual_seed(0)
    model = randomize(TextTransformer()).eval().to(dtype)
    ids = torch.randint(0, 50, (B, 7), generator=torch.Generator().manual_seed(1))
    gm, decisions = fuse(model, ids)
    assert all(d.action == "folded-forward" for d in decisions)
    assert_half_close(gm(ids), model, ids, dtype)
    assert gm(ids).dtype == dtype
    assert {p.dtype for p in gm.parameters()} == {dtype}
    assert not bn_nodes(gm)


# --------------------------------------------------------------------------------------------- PatchTST


class PatchTSTLayer(nn.Module):
    """PatchTST's post-norm encoder layer: BatchNorm (through transposes) after each residual add."""

    def __init__(self, d: int):
        super().__init__()
        self.attn = Attention(d)
        self.norm_attn = patchtst_norm(d)
        self.ff1 = nn.Linear(d, 2 * d)
        self.ff2 = nn.Linear(2 * d, d)
        self.norm_ffn = patchtst_norm(d)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        src = self.norm_attn(src + self.attn(src))
        return self.norm_ffn(src + self.ff2(F.gelu(self.ff1(src))))


class PatchTST(nn.Module):
    def __init__(self, n_vars: int = 2, seq_len: int = 16, patch_len: int = 4, d: int = 16, pred: int = 5):
        super().__init__()
        self.patch_len, self.patch_num = patch_len, seq_len // patch_len
        self.W_P = nn.Linear(patch_len, d)
        self.W_pos = nn.Parameter(torch.randn(1, self.patch_num, d) * 0.1)
        self.layers = nn.ModuleList([PatchTSTLayer(d) for _ in range(2)])
        self.head = nn.Linear(d * self.patch_num, pred)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, v, _ = x.shape
        z = self.W_P(x.reshape(b, v, self.patch_num, self.patch_len))
        z = z.reshape(b * v, self.patch_num, -1) + self.W_pos
        for layer in self.layers:
            z = layer(z)
        z = z.reshape(b, v, self.patch_num, -1).permute(0, 1, 3, 2)  # (B, V, d, P)
        return self.head(z.flatten(start_dim=-2))  # Flatten_Head: Linear over d * P


def test_patchtst_post_norm_encoder():
    """A BatchNorm after the residual add feeds both the next Linear and the next residual: it folds into the
    Linear, and one per-channel affine stays on the residual path, reported as ``residual-reads-norm``. The
    last norm reaches the head through ``flatten(d, P)``: it folds there with the scale tiled over P."""
    torch.manual_seed(0)
    model = randomize(PatchTST())
    x = torch.randn(B, 2, 16) + 0.3
    norms = [f"layers.{i}.{n}" for i in range(2) for n in ("norm_attn", "norm_ffn")]
    decisions = by_norm(assert_exact(model, x, norms, kept=3))
    expected = {
        "layers.0.norm_attn": ("kept-affine", ["layers.0.ff1"], reasons.RESIDUAL_READS_NORM),
        "layers.0.norm_ffn": ("kept-affine", ["layers.1.attn.qkv"], reasons.RESIDUAL_READS_NORM),
        "layers.1.norm_attn": ("kept-affine", ["layers.1.ff1"], reasons.RESIDUAL_READS_NORM),
        "layers.1.norm_ffn": ("folded-forward", ["head"], None),
    }
    assert {k: (d.action, d.into, d.reason) for k, d in decisions.items()} == expected
    assert decisions["layers.0.norm_attn"].kept_on == ["layers.0:aten.add"]


def test_flatten_head_needs_the_tiled_scale():
    """Folding the last norm into the head with the scale tiled the wrong way (``repeat`` instead of
    ``repeat_interleave`` over the P patches) is wrong: the channel layout of the flattened axis matters."""
    torch.manual_seed(0)
    model = randomize(PatchTST()).eval()
    x = torch.randn(B, 2, 16)
    s, t = affine_of(model.layers[1].norm_ffn)
    wrong = norm_free(model, ["layers.1.norm_ffn"])
    w, b = fold.fold_into_linear(model.head.weight, model.head.bias, s.repeat(4), t.repeat(4))
    with torch.no_grad():
        wrong.head.weight.copy_(w)
        wrong.head.bias.copy_(b)
    assert rel_err(wrong(x), model(x)) > NAIVE_MIN_ERR
    right = norm_free(model, ["layers.1.norm_ffn"])
    w, b = fold.fold_into_linear(model.head.weight, model.head.bias, s.repeat_interleave(4), t.repeat_interleave(4))
    with torch.no_grad():
        right.head.weight.copy_(w)
        right.head.bias.copy_(b)
    assert rel_err(right(x), model(x)) <= TOL[torch.float32]


# --------------------------------------------------------------------------------------------- Swin


class SwinBlock(nn.Module):
    """Shifted-window attention on a 4x4 grid, window 2, shift 1 (roll, window partition and reverse)."""

    def __init__(self, dim: int = C, grid: int = 4, window: int = 2, shift: int = 1):
        super().__init__()
        self.grid, self.window, self.shift = grid, window, shift
        self.norm1 = RepBN(dim)
        self.attn = Attention(dim)
        self.norm2 = RepBN(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        g, ws = self.grid, self.window
        h = torch.roll(self.norm1(x).view(b, g, g, c), shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = h.view(b, g // ws, ws, g // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        out = self.attn(win)
        out = out.view(b, g // ws, g // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, g, g, c)
        x = x + torch.roll(out, shifts=(self.shift, self.shift), dims=(1, 2)).reshape(b, n, c)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SwinTiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = SwinBlock()
        self.norm = RepBN(C)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        pooled = F.adaptive_avg_pool1d(self.norm(x).transpose(1, 2), 1).flatten(1)
        return self.head(pooled)


def test_swin_window_partition_roll_and_pooling_fold():
    torch.manual_seed(0)
    model = randomize(SwinTiny())
    decisions = assert_exact(model, tokens(16), ["block.norm1", "block.norm2", "norm"])
    assert [(d.norm, d.action, d.into) for d in decisions] == [
        ("block.norm1", "folded-forward", ["block.attn.qkv"]),
        ("block.norm2", "folded-forward", ["block.fc1"]),
        ("norm", "folded-forward", ["head"]),
    ]


# --------------------------------------------------------------------------------------------- PVT


class PVTAttention(nn.Module):
    """PVT: norm1 feeds q and the strided spatial-reduction conv ``sr`` (kernel = stride, no padding) through a
    ``(B, N, C) -> (B, C, H, W)`` reshape; ``norm`` (a RepBN here) follows ``sr`` and feeds ``kv``."""

    def __init__(self, dim: int = C, grid: int = 4, sr: int = 2):
        super().__init__()
        self.grid = grid
        self.norm1 = RepBN(dim)
        self.q = nn.Linear(dim, dim)
        self.sr = nn.Conv2d(dim, dim, sr, stride=sr)
        self.norm = RepBN(dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        y = self.norm1(x)
        q = self.q(y)
        r = self.sr(y.permute(0, 2, 1).reshape(b, c, self.grid, self.grid)).reshape(b, c, -1).permute(0, 2, 1)
        k, v = self.kv(self.norm(r)).chunk(2, dim=-1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v))


def test_pvt_norm_feeds_q_and_the_strided_conv():
    torch.manual_seed(0)
    model = randomize(PVTAttention())
    decisions = assert_exact(model, tokens(16), ["norm1", "norm"])
    assert [(d.norm, d.action, d.into) for d in decisions] == [
        ("norm1", "folded-forward", ["q", "sr"]),
        ("norm", "folded-forward", ["kv"]),
    ]


# --------------------------------------------------------------------------------------------- Informer


class InformerConvLayer(nn.Module):
    """Informer's distilling ConvLayer: circular conv -> BatchNorm1d -> ELU -> max pool (BN folds backward)."""

    def __init__(self, c: int = C):
        super().__init__()
        self.downConv = nn.Conv1d(c, c, 3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm1d(c)
        self.act = nn.ELU()
        self.maxPool = nn.MaxPool1d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxPool(self.act(self.norm(self.downConv(x.permute(0, 2, 1))))).transpose(1, 2)


def test_informer_conv_layer_folds_backward_into_the_conv():
    model = randomize(InformerConvLayer())
    decisions = assert_exact(model, tokens(8), ["norm"])
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["downConv"])]


# --------------------------------------------------------------------------------------------- fan-out, backward


class TwoHeadsAndResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.head_a = nn.Linear(C, 3)
        self.head_b = nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.norm(x)
        return self.head_a(y), self.head_b(y[:, 0]), (x + y).sum(-1)


def test_shared_norm_folds_into_both_heads_and_keeps_an_affine_on_the_residual_only():
    model = randomize(TwoHeadsAndResidual())
    decisions = assert_exact(model, tokens(), ["norm"], kept=1)
    (d,) = decisions
    assert (d.action, d.into, d.reason, d.kept_on) == (
        "kept-affine",
        ["head_a", "head_b"],
        reasons.RESIDUAL_READS_NORM,
        ["<model>:aten.add"],
    )


class LinearNormResidual(nn.Module):
    """``h = fc0(x); y = norm(h); y + fc(y)``: blocked by the residual forward, exact backward into fc0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(C, C)
        self.norm = RepBN_NLP(C)
        self.fc = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.fc0(x))
        return y + self.fc(y)


def test_norm_after_a_private_linear_folds_backward_despite_the_residual():
    model = randomize(LinearNormResidual())
    assert rel_err(naive_fold(model.eval(), "norm", "fc")(tokens()), model(tokens())) > NAIVE_MIN_ERR
    (d,) = assert_exact(model, tokens(), ["norm"])
    assert (d.action, d.into, d.reason) == ("folded-backward", ["fc0"], None)


class LinearReadTwice(LinearNormResidual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc0(x)
        y = self.norm(h)
        return y + self.fc(y) + h


def test_no_backward_fold_when_the_producer_output_is_read_elsewhere():
    (d,) = assert_exact(randomize(LinearReadTwice()), tokens(), ["norm"], kept=1)
    assert (d.action, d.into, d.reason) == ("kept-affine", ["fc"], reasons.RESIDUAL_READS_NORM)


class PatchEmbed(nn.Module):
    """DeiT/Swin ``patch_embed``: conv -> flatten -> transpose -> norm -> residual stream."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(1, C, 2, stride=2)
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, C)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.proj(img).flatten(2).transpose(1, 2))
        return x + self.fc(x)


def test_patch_embed_norm_folds_backward_into_the_conv():
    (d,) = assert_exact(randomize(PatchEmbed()), torch.randn(B, 1, 8, 8), ["norm"])
    assert (d.action, d.into) == ("folded-backward", ["proj"])


# --------------------------------------------------------------------------------------------- token ops


class TokenOps(nn.Module):
    """One norm, then a token operation, then a Linear: every one of these commutes with the affine."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.norm = RepBN(C)
        self.fc = nn.Linear(C, 5)
        self.register_buffer("idx", torch.tensor([4, 0, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        if self.op == "index":
            y = y[:, self.idx]
        elif self.op == "gather":
            y = torch.gather(y, 1, self.idx.view(1, 3, 1).expand(x.shape[0], 3, C))
        elif self.op == "index_select":
            y = y.index_select(1, self.idx)
        elif self.op == "select":
            y = y[:, 0]
        elif self.op == "roll":
            y = torch.roll(y, 2, dims=1)
        elif self.op == "flip":
            y = y.flip(1)
        elif self.op == "cat":
            y = torch.cat([y[:, 3:], y[:, :3]], dim=1)
        elif self.op == "stack":
            y = torch.stack([y[:, 0], y[:, -1]], dim=1)
        elif self.op == "split":
            a, b = y.split([2, 4], dim=1)
            y = torch.cat([b, a], dim=1)
        elif self.op == "mean":
            y = y.mean(dim=1)
        elif self.op == "scale":
            y = y * 0.5 / 3.0
        elif self.op == "repeat":
            y = y.repeat(2, 2, 1)
        elif self.op == "repeat_interleave":
            y = y.repeat_interleave(2, dim=1)
        elif self.op == "narrow":
            y = y.narrow(1, 1, 3)
        return self.fc(y)


TOKEN_OPS = ["index", "gather", "index_select", "select", "roll", "flip", "cat", "stack", "split", "mean", "scale"]
TOKEN_OPS += ["repeat", "repeat_interleave", "narrow"]


@pytest.mark.parametrize("op", TOKEN_OPS)
def test_token_ops_commute_with_the_affine(op):
    model = randomize(TokenOps(op))
    (d,) = assert_exact(model, tokens(), ["norm"])
    assert (d.action, d.into) == ("folded-forward", ["fc"])


class BNNoAffine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C, affine=False)
        self.fc = nn.Linear(C, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def test_batchnorm_without_affine_and_consumer_without_bias():
    model = randomize(BNNoAffine())
    x = torch.randn(B, C) * 2 + 1
    (d,) = assert_exact(model, x, ["norm"])
    assert (d.kind, d.action, d.into) == ("BatchNorm", "folded-forward", ["fc"])


class LlamaStyle(nn.Module):
    """LLaMA-PRepBN: RepBN over ``x.view(-1, C)`` (eps 1e-6), q/k/v without bias (the fold creates them)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C, eps=1e-6, alpha_init=0.0, flatten_tokens=True)
        self.q, self.k, self.v = (nn.Linear(C, C, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + F.scaled_dot_product_attention(self.q(y), self.k(y), self.v(y))


def test_llama_style_flattened_repbn_creates_biases():
    model = randomize(LlamaStyle()).eval()
    x = tokens()
    gm, decisions = fuse(model, x)
    assert [(d.action, d.into) for d in decisions] == [("folded-forward", ["k", "q", "v"])]
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert {"q.bias", "k.bias", "v.bias"} <= set(engine.fused_state_dict(gm))


def test_unfinished_warmup_is_reported_with_its_numbers():
    class Warm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = LinearNorm(C, nn.LayerNorm, RepBN, warm=7, step=100)
            self.fc = nn.Linear(C, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x))

    model = randomize(Warm()).eval()
    with torch.no_grad():
        model.norm.warm.fill_(7)
    (d,) = fuse(model, tokens())[1]
    assert d.action == "folded-forward"
    assert len(d.warnings) == 1 and "warm=7" in d.warnings[0] and "weight 1 " in d.warnings[0]


def test_a_linearnorm_called_twice_reports_its_unfinished_schedule_on_both_calls():
    """The two calls of one ``LinearNorm`` are two norms (``norm``, ``norm_1``); the warning follows the module
    each norm's ops run in, not the name (``norm_1`` is no attribute of the model)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = LinearNorm(C, nn.LayerNorm, RepBN, warm=7, step=100)
            self.fc, self.fc2 = nn.Linear(C, 3), nn.Linear(C, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x)) + self.fc2(self.norm(x * 2))

    model = randomize(Twice()).eval()
    with torch.no_grad():
        model.norm.warm.fill_(7)
    x = tokens()
    gm, decisions = fuse(model, x)
    assert [d.norm for d in decisions] == ["norm", "norm_1"]
    assert [d.action for d in decisions] == ["folded-forward"] * 2
    assert all(len(d.warnings) == 1 and "warm=7" in d.warnings[0] for d in decisions), decisions
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


class _ForcedDivisor(nn.Module):
    """A BatchNorm, an average pooling with a forced divisor (``divisor_override``: the window's sum over it), a
    1x1 conv."""

    def __init__(self, padding: int = 0, ceil_mode: bool = False) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(C), nn.Conv2d(C, 3, 1)
        self.pool = (padding, ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding, ceil_mode = self.pool
        return self.conv(F.avg_pool2d(self.bn(x), 2, 2, padding, ceil_mode, True, divisor_override=3))


def test_a_forced_pooling_divisor_folds_with_its_shift_scaled_by_the_window_over_the_divisor():
    """``avg_pool2d(s x + t, 2, divisor_override=3)`` is ``s avg_pool2d(x) + 4 t / 3`` where every window is whole:
    the fold is exact with the shift scaled by 4/3 (it was refused as an unsupported op); the fold that keeps the
    shift as it is (a mean's) is wrong."""
    model, x = randomize(_ForcedDivisor()).eval(), torch.randn(B, C, 8, 8) * 2 + 0.5
    gm, (d,) = fuse(model, x)
    assert (d.action, d.into) == ("folded-forward", ["conv"])
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert rel_err(naive_fold(model, "bn", "conv")(x), model(x)) > NAIVE_MIN_ERR
    assert rel_err(naive_fold(model, "bn", "conv", shift_mult=4 / 3)(x), model(x)) <= TOL[torch.float32]


@pytest.mark.parametrize(("padding", "ceil_mode"), [(1, False), (0, True)], ids=["padded", "ceil_mode"])
def test_a_forced_pooling_divisor_over_partial_windows_keeps_a_shifted_norm(padding, ceil_mode):
    """Where windows at the border hold fewer elements (padding, ``ceil_mode`` on an odd size), they hold less of the
    shift: no one factor scales it, so the norm stays (``zero-padding-after-norm``); the fold with the whole-window
    factor is wrong there. With every shift 0 the fold is exact and made."""
    x = torch.randn(B, C, 7, 7) * 2 + 0.5
    model = randomize(_ForcedDivisor(padding, ceil_mode)).eval()
    gm, (d,) = fuse(model, x)
    assert (d.action, d.reason) == ("kept-affine", reasons.ZERO_PADDING_AFTER_NORM)
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert rel_err(naive_fold(model, "bn", "conv", shift_mult=4 / 3)(x), model(x)) > NAIVE_MIN_ERR
    with torch.no_grad():  # no shift: mean 0, bias 0
        model.bn.running_mean.zero_()
        model.bn.bias.zero_()
    assert not affine_of(model.bn)[1].any()
    gm, (d,) = fuse(model, x)
    assert (d.action, d.into) == ("folded-forward", ["conv"])
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


# --------------------------------------------------------------------------------------------- core ATen programs


def _decomposed(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """A program as a user's ``.pt2`` may hold it: exported with a dynamic batch and decomposed to core ATen
    (``addmm`` / ``permute`` / ``_native_batch_norm_legit*`` instead of ``linear`` / ``transpose`` /
    ``batch_norm``)."""
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return ep.run_decompositions().module()


@pytest.mark.parametrize("name", ["swin", "patchtst", "text"])
def test_core_aten_programs_fold_the_same_way(name):
    torch.manual_seed(0)
    if name == "swin":
        model, x = randomize(SwinTiny()).eval(), tokens(16)
    elif name == "patchtst":
        model, x = randomize(PatchTST()).eval(), torch.randn(B, 2, 16)
    else:
        model = randomize(TextTransformer()).eval()
        x = torch.randint(0, 50, (B, 7), generator=torch.Generator().manual_seed(1))
    reference = model(x)
    expected = [(d.norm, d.action, d.reason) for d in fuse(model, x)[1]]
    gm = _decomposed(model, x)
    decisions = engine.fold_all(gm)
    assert [(d.norm, d.action, d.reason) for d in decisions] == expected
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm)


def test_core_aten_batch_statistics_are_found_and_kept():
    class Stats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(C, track_running_stats=False)
            self.fc = nn.Linear(C, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x))

    model = randomize(Stats()).eval()
    x = torch.randn(B, C) * 2 + 1
    gm = _decomposed(model, x)
    (d,) = engine.fold_all(gm)
    assert (d.action, d.reason) == ("kept", reasons.BATCH_STATS_IN_EVAL)
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]


class FixedEta(nn.Module):
    """``bn(x) + 0.5 * x``: a RepBN whose eta is a constant, not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        return self.fc((self.bn(x) + 0.5 * x).transpose(1, 2))


def test_repbn_with_a_constant_eta():
    model = randomize(FixedEta()).eval()
    x = tokens()
    gm, (d,) = fuse(model, x)
    assert (d.kind, d.action, d.into) == ("RepBN", "folded-forward", ["fc"])
    assert rel_err(gm(x), model(x)) <= TOL[torch.float32]
    assert aten_ops(gm) == {"linear.default": 1}


class ChannelTiling(nn.Module):
    """Channel-axis layouts that keep each channel on one axis: ``cat([y, y], -1)``, ``repeat_interleave`` over the
    channels, and a transpose + flatten (PatchTST's head), each read by a Linear over the merged axis."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm = RepBN(C)
        self.fc = nn.Linear(2 * C if how != "flatten" else C * N, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        if self.how == "cat":
            return self.fc(torch.cat([y, y.flip(1)], dim=-1))
        if self.how == "repeat_interleave":
            return self.fc(y.repeat_interleave(2, dim=-1))
        return self.fc(y.transpose(1, 2).flatten(1))


@pytest.mark.parametrize("how", ["cat", "repeat_interleave", "flatten"])
def test_channel_axis_tiling_folds_with_the_tiled_scale(how):
    (d,) = assert_exact(randomize(ChannelTiling(how)), tokens(), ["norm"])
    assert (d.action, d.into) == ("folded-forward", ["fc"])


class ReflectPadConv(nn.Module):
    """``Conv1d(padding_mode="reflect")`` after a BatchNorm1d: reflection copies values, so the fold is exact
    (a zero-padded conv would be refused)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C)
        self.conv = nn.Conv1d(C, 4, 3, padding=1, padding_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_copy_padding_commutes_with_the_affine(mode):
    (d,) = assert_exact(randomize(ReflectPadConv(mode)), torch.randn(B, C, 7) + 0.5, ["norm"])
    assert (d.action, d.into) == ("folded-forward", ["conv"])


class FarFromZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(32)
        self.fc = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 10.0])
def test_half_precision_fold_warns_when_channel_means_amplify_rounding(dtype, offset):
    """In half precision the fold computes ``s x`` where the BN computed ``s (x - mu)``: with channel means many
    standard deviations from 0, rounding grows by that factor. The fold is still exact in exact arithmetic, so
    slabconv folds and warns with the numbers; the error it predicts is really there."""
    torch.manual_seed(0)
    model = randomize(FarFromZero())
    with torch.no_grad():
        model.norm.alpha.zero_()
        model.norm.bn.running_var.fill_(1.0)
        model.norm.bn.running_mean.copy_(torch.randn(32).sign() * offset)
    x = (model.norm.bn.running_mean + torch.randn(8, 16, 32)).to(dtype)
    model = model.eval().to(dtype)
    gm, (d,) = fuse(model, x)
    assert d.action == "folded-forward"
    error = rel_err(gm(x), exact(model, x))
    precision = [w for w in d.warnings if "precision:" in w]  # (random BN weights near 0 also flag it for int8)
    if offset:
        assert len(precision) == 1 and "|mean| / std = 10" in precision[0]
        assert error > TOL[dtype]  # the warning is not a false alarm
    else:
        assert not precision
        assert_half_close(gm(x), model, x, dtype)


class TwoBNs(nn.Module):
    """``fc(bn2(bn1(x)))``: the two BatchNorms are composed into one affine of ``x`` (no layer before ``bn1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm1d(32), nn.BatchNorm1d(32)
        self.fc = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn2(self.bn1(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 20.0])
def test_half_precision_warning_of_composed_norms_reads_the_first_norms_input(dtype, offset):
    """Two BNs composed into one fold: ``x`` sits ``offset`` standard deviations from 0, ``bn1`` centres it and
    ``bn2``'s statistics are those of a centred tensor. The fold computes ``s x`` on the uncentred input, so the
    rounding grows by about ``offset``: the warning gives ``x``'s ratio (taken back through ``bn1``), not
    ``bn2``'s (0: no warning), and the error it predicts is really there."""
    torch.manual_seed(0)
    model = randomize(TwoBNs())
    with torch.no_grad():
        model.bn1.weight.fill_(1.0), model.bn1.bias.zero_(), model.bn1.running_var.fill_(1.0)
        model.bn1.running_mean.copy_(torch.randn(32).sign() * offset)
        model.bn2.running_mean.zero_(), model.bn2.running_var.fill_(1.0)
    x = (model.bn1.running_mean + torch.randn(64, 32)).to(dtype)
    model = model.eval().to(dtype)
    gm, (d,) = fuse(model, x)
    assert (d.action, d.into) == ("folded-forward", ["fc"])
    precision = [w for w in d.warnings if "precision:" in w]
    if offset:
        assert len(precision) == 1 and "|mean| / std = 20" in precision[0]
        assert rel_err(gm(x), exact(model, x)) > TOL[dtype]  # the warning is not a false alarm
    else:
        assert not precision
        assert_half_close(gm(x), model, x, dtype)
