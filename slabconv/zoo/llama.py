"""LLaMA causal language model with progressive RepBN norms (LLaMA-PRepBN), in the Hugging Face key layout.

Paper: SLAB (Guo et al., ICML 2024), the LLaMA-350M rows with PRepBN; LLaMA: Touvron et al., 2023.
Layout source: github xinghaochen/SLAB ``llama/modeling/llama-350M/modeling_llama.py`` (``LlamaForCausalLM`` with
``linearnorm = partial(LinearNorm, norm1=LlamaRMSNorm, norm2=RepBN)``) and ``config.json`` beside it. Written here
from those facts; no code copied, and a checkpoint folder's ``modeling_*.py`` is never imported or run.

Keys (``i`` = 0 .. num_hidden_layers - 1; C hidden_size, I intermediate_size, V vocab_size, d = C / heads, or
config.json's ``head_dim`` where it gives one, as transformers' LLaMA allows):

- ``model.embed_tokens.weight`` (V, C), padding row ``pad_token_id``.
- ``model.layers.{i}.self_attn.q_proj.weight`` (H d, C), ``o_proj.weight`` (C, H d) (H = ``num_attention_heads``;
  H d = C in the official model) and ``{k,v}_proj.weight`` (K d, C), no bias; K =
  ``num_key_value_heads`` (= ``num_attention_heads`` in the official model; fewer heads is grouped-query attention,
  as in Hugging Face LLaMA, each k/v head serving ``num_attention_heads / K`` query heads via ``repeat_kv``).
- ``model.layers.{i}.self_attn.rotary_emb.inv_freq`` (d/2,): a persistent buffer in the official code (released
  weights saved with that code carry it). It is loaded but, as in the official code, not read in eval: the
  official rotary cache is computed once at construction from a fresh float32 ``inv_freq``, so this module
  recomputes the same values in its forward (checkpoints without the key load too; see ``build``).
- ``model.layers.{i}.mlp.{gate,up}_proj.weight`` (I, C), ``mlp.down_proj.weight`` (C, I), no bias.
- ``model.layers.{i}.{input_layernorm,post_attention_layernorm}`` and ``model.norm``: the official ``LinearNorm``:
  int64 scalar buffers ``num_step``, ``warm``, ``iter``, ``total_step``; ``norm1.weight`` (C,) (RMSNorm);
  ``norm2.alpha`` (1,) and ``norm2.bn.{weight,bias,running_mean,running_var,num_batches_tracked}`` (RepBN).
- ``lm_head.weight`` (V, C), no bias (``tie_word_embeddings`` false).

Norm facts: both branches get ``eps = rms_norm_eps`` (1e-6 in config.json): the RMSNorm and the BatchNorm1d.
RepBN runs BN over ``x.view(-1, C)`` (every token of every sequence is one BN sample) and adds ``alpha * x``;
``alpha``, ``bn.weight`` and ``bn.bias`` start at 0. In eval ``LinearNorm`` is the RepBN alone. In training the
counters move once every 16 forward calls (``num_step`` counts 0..15): ``warm`` calls of RMSNorm alone, then
``lambda * RMSNorm + (1 - lambda) * RepBN`` with ``lambda = r0 * iter / total_step`` as ``iter`` counts down.

Where each norm feeds: ``input_layernorm`` -> q_proj, k_proj, v_proj (one norm, three consumers; with grouped-query
attention k_proj / v_proj are the smaller ``(K d, C)`` Linears, the fold is the same);
``post_attention_layernorm`` -> gate_proj, up_proj; ``model.norm`` -> lm_head. The residual stream reads the norm's
input, never its output, so every norm folds forward and each of those six bias-free Linears gains a bias
(``5 * num_hidden_layers + 1`` biases). The official ``merge_bn`` folds the decoder layers only; slabconv also folds
``model.norm`` into ``lm_head``.

Eval forward, as the official code computes it (no padding mask, positions ``0 .. T-1``): rotary cos/sin from
``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` in float32 (rescaled where config.json asks for a llama3 or
linear rope, as transformers computes them: ``rope_inv_freq``), cast to the model dtype; ``q k^T / sqrt(d)`` plus a
causal mask of ``finfo(dtype).min``; softmax in float32, cast back (the official clamp of the scores at
``finfo.min`` changes no softmax output: a masked score gives exp(...) = 0 with or without it, and the diagonal is
never masked); SiLU-gated MLP. Input: int64 token ids ``(B, T)``; output: logits ``(B, T, V)``. ``T`` is fixed at
export (the batch axis stays dynamic); the code has no data-dependent branches in eval.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.layers import norm_layout
from slabconv.zoo.norms import LinearNorm, RepBN, RMSNorm
from slabconv.zoo.registry import LayoutError, Preset, StateDict, UnsupportedSetting, register_family

__all__ = [
    "DEFAULT_SEQ_LEN",
    "SEQ_LEN_KEY",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaLinearNorm",
    "llama_config",
    "llama_norm_factory",
    "repeat_kv",
    "check_head_dim",
    "RopeScaling",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "seq_len",
]

NormFactory = Callable[[int], nn.Module]

# The key of the build config that fixes the exported sequence length (the model takes (B, T) token ids with T
# fixed and B dynamic). Without it: min(max_position_embeddings, DEFAULT_SEQ_LEN).
SEQ_LEN_KEY = "slabconv_seq_len"
DEFAULT_SEQ_LEN = 128

_SOURCE = "xinghaochen/SLAB llama/modeling/llama-350M/modeling_llama.py"


# --------------------------------------------------------------------------------------------- norms


class LlamaLinearNorm(LinearNorm):
    """The official LLaMA ``LinearNorm``: ``slabconv.nn.LinearNorm`` plus the int64 buffer ``num_step``.

    In training the counters move once every ``every`` forward calls (16 in the official code, ``num_step``
    cycling through 0 .. every-1): ``warm`` such periods of ``norm1`` alone, then the blend
    ``lambda * norm1(x) + (1 - lambda) * norm2(x)`` with ``lambda = r0 * iter / total_step`` while ``iter`` counts
    down to 0. In eval it is ``norm2(x)`` whatever the counters say (what slabconv folds).

    Args:
        dim: C.
        norm1, norm2: factories called as ``norm(dim)`` (RMSNorm and RepBN, both with ``eps = rms_norm_eps``).
        warm, step, r0: the schedule (official defaults 10000, 18000, 1.0).
        every: forward calls per counter step (official: 16).
    """

    num_step: torch.Tensor
    warm: torch.Tensor
    iter: torch.Tensor
    total_step: torch.Tensor

    def __init__(
        self,
        dim: int,
        norm1: NormFactory,
        norm2: NormFactory,
        warm: int = 10000,
        step: int = 18000,
        r0: float = 1.0,
        every: int = 16,
    ):
        super().__init__(dim, norm1, norm2, warm=warm, step=step, r0=r0)
        self.register_buffer("num_step", torch.tensor(0))
        self.every = every

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.norm2(x)
        tick = int(self.num_step) % self.every == 0
        self.num_step.copy_((self.num_step + 1) % self.every)
        if int(self.warm) > 0:
            if tick:
                self.warm.sub_(1)
            return self.norm1(x)
        lam = self.blend_weight()
        if int(self.iter) > 0 and tick:
            self.iter.sub_(1)
        return lam * self.norm1(x) + (1.0 - lam) * self.norm2(x)


def llama_norm_factory(
    layout: str, eps: float = 1e-6, warm: int = 10000, step: int = 18000, every: int = 16
) -> NormFactory:
    """The norm constructor for a key layout.

    Args:
        layout: ``linearnorm`` (the official ``LinearNorm(RMSNorm -> RepBN)`` with ``num_step``), ``repbn`` (a bare
            RepBN over ``x.view(-1, C)``, the official code's commented-out alternative) or ``identity`` (the
            norm-free bound).
        eps: ``rms_norm_eps``, used by both the RMSNorm and the BatchNorm.
        warm, step, every: the progressive schedule (training only).
    """
    repbn = partial(RepBN, eps=eps, alpha_init=0.0, flatten_tokens=True)
    if layout == "linearnorm":
        return partial(LlamaLinearNorm, norm1=partial(RMSNorm, eps=eps), norm2=repbn, warm=warm, step=step, every=every)
    if layout == "repbn":
        return repbn
    if layout == "identity":
        return lambda dim: nn.Identity()
    raise ValueError(f"unknown norm layout {layout!r}")


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class LlamaConfig:
    """The hyperparameters, named as in a Hugging Face ``config.json`` (``model_type: llama``)."""

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 18
    num_attention_heads: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    pad_token_id: int | None = 0
    hidden_act: str = "silu"
    num_key_value_heads: int | None = None  # None: one k/v head per query head (the official model)
    tie_word_embeddings: bool = False  # lm_head reads the embedding table (standard families; never LLaMA-PRepBN)
    sliding_windows: tuple[int | None, ...] | None = None  # per layer: attend to the last W positions only
    rope: RopeScaling | None = None  # a scaled rope (llama3, linear); None: the plain rope
    head_size: int | None = None  # config.json's head_dim where it is not hidden_size / num_attention_heads

    @property
    def head_dim(self) -> int:
        """``head_size`` where the config gives one, else ``hidden_size / num_attention_heads``."""
        return self.head_size or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """The number of k/v heads (``num_key_value_heads``, default ``num_attention_heads``)."""
        return self.num_key_value_heads or self.num_attention_heads


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rope of a ``config.json`` (``rope_parameters`` / ``rope_scaling``), as ``rope_inv_freq`` applies it.

    Attributes:
        kind: ``linear`` (every inverse frequency divided by ``factor``: positions ``t / factor``) or ``llama3``
            (Meta's Llama 3.1 rescaling, per frequency).
        factor: the scale (> 0).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3's (``L``: the pretraining
            context): a wavelength above ``L / low_freq_factor`` is divided by ``factor``, one below
            ``L / high_freq_factor`` kept, one between interpolated; unused by ``linear``.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __str__(self) -> str:
        """``llama3 (factor 8.0, low_freq_factor 1.0, ...)``, as ``config.json`` names them (for messages)."""
        names = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                              if self.kind == "llama3" else [])  # fmt: skip
        return f"{self.kind} ({', '.join(f'{n} {getattr(self, n)}' for n in names)})"


def rope_inv_freq(head_dim: int, theta: float, rope: RopeScaling | None = None) -> torch.Tensor:
    """The rotary inverse frequencies ``(d/2,)`` float32: ``1 / theta ** (arange(0, d, 2) / d)``, rescaled by a
    scaled ``rope``. ``linear``: divided by ``factor``. ``llama3`` (Meta's Llama 3.1 formula, as transformers'
    ``_compute_llama3_parameters`` computes it; ``L`` = ``original_max_position_embeddings``): with the wavelength
    ``w = 2 pi / f``, ``f / factor`` where ``w > L / low_freq_factor``, ``f`` where ``w < L / high_freq_factor``,
    else ``(1 - s) f / factor + s f`` with ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope is None:
        return inv_freq
    if rope.kind == "linear":
        return inv_freq / rope.factor
    context, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    between = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / rope.factor, between)
    return torch.where(wavelen < context / high, inv_freq, scaled)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, rope: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``cos``, ``sin`` of shape ``(T, d)`` for positions ``0 .. T-1``, as the official cache holds them.

    ``inv_freq`` (``rope_inv_freq``: the plain rope's, rescaled by a scaled ``rope``) and ``freqs = t * inv_freq``
    in float32, duplicated to ``d`` columns (``cat(freqs, freqs)``), cos/sin in float32, then cast to ``dtype``.
    """
    inv_freq = rope_inv_freq(head_dim, theta, rope)
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = t[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(B, K, T, d) -> (B, K * n_rep, T, d)``: k/v head ``j`` serves query heads ``j * n_rep .. (j + 1) * n_rep - 1``
    (Hugging Face LLaMA's ``repeat_kv``)."""
    if n_rep == 1:
        return x
    b, k, t, d = x.shape
    return x[:, :, None].expand(b, k, n_rep, t, d).reshape(b, k * n_rep, t, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    """Holds the official ``inv_freq`` buffer (key layout only; ``rope_cos_sin`` computes what eval uses)."""

    def __init__(self, head_dim: int, theta: float, persistent: bool = True, rope: RopeScaling | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, rope), persistent=persistent)


class LlamaAttention(nn.Module):
    """Causal multi-head self-attention with rotary positions on ``(B, T, C)``; q/k/v/o without bias; q ``(H d, C)``,
    o ``(C, H d)`` (``H d`` = C unless the config gives ``head_dim``); with ``num_key_value_heads <
    num_attention_heads`` grouped-query attention (k/v ``(K d, C)``, heads repeated)."""

    def __init__(self, cfg: LlamaConfig, persistent_rope: bool = True):
        super().__init__()
        c, self.num_heads, self.head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.kv_heads = cfg.kv_heads
        if (cfg.head_size is None and self.head_dim * self.num_heads != c) or self.head_dim % 2:
            raise UnsupportedModelError(
                f"hidden_size {c} must be num_attention_heads {self.num_heads} times an even head size"
            )
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise UnsupportedModelError(
                f"grouped-query attention needs num_attention_heads {self.num_heads} to be a multiple of "
                f"num_key_value_heads {self.kv_heads}"
            )
        self.q_proj = nn.Linear(c, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, cfg.rope_theta, persistent_rope, cfg.rope)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C); ``cos``/``sin`` (T, d) in x's dtype; ``mask`` (T, T) additive (0 or finfo.min)."""
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = repeat_kv(k, self.num_heads // self.kv_heads), repeat_kv(v, self.num_heads // self.kv_heads)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, cfg: LlamaConfig, norm_layer: NormFactory, persistent_rope: bool = True):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, persistent_rope)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = norm_layer(cfg.hidden_size)
        self.post_attention_layernorm = norm_layer(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Token embedding, decoder layers, final norm: ids ``(B, T)`` -> hidden states ``(B, T, C)``."""

    def __init__(self, cfg: LlamaConfig, norm_layer: NormFactory, persistent_rope: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, norm_layer, persistent_rope) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = norm_layer(cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        t = input_ids.shape[1]
        cos, sin = rope_cos_sin(t, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.rope)
        mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        windows = self.cfg.sliding_windows or (None,) * len(self.layers)
        masks = {w: sliding_mask(t, w, x.dtype) for w in set(windows) if w is not None}
        for layer, window in zip(self.layers, windows, strict=True):
            x = layer(x, cos, sin, mask if window is None else masks[window])
        return self.norm(x)


def sliding_mask(t: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``(T, T)`` mask of causal attention over the last ``window`` positions: query ``i`` sees key
    ``j`` when ``i - window < j <= i`` (transformers' ``sliding_window_overlay``), else ``finfo(dtype).min``."""
    i = torch.arange(t)
    blocked = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= window)
    return torch.zeros((t, t), dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


class LlamaForCausalLM(nn.Module):
    """LLaMA-PRepBN: int64 token ids ``(B, T)`` -> next-token logits ``(B, T, vocab_size)``.

    Args:
        cfg: the hyperparameters (``llama_config`` reads them from a checkpoint and its config.json).
        norm_layer: the norm constructor (``llama_norm_factory``); default the official ``LinearNorm`` with
            ``eps = cfg.rms_norm_eps``.
        persistent_rope: keep ``rotary_emb.inv_freq`` in the state_dict, as the official code does.

    Initialisation follows the official code: Linear and embedding weights N(0, 0.02), the padding row 0;
    RepBN ``alpha``, ``bn.weight`` and ``bn.bias`` 0.
    """

    def __init__(self, cfg: LlamaConfig, norm_layer: NormFactory | None = None, persistent_rope: bool = True):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise UnsupportedSetting(f"hidden_act {cfg.hidden_act!r}: the LLaMA-PRepBN MLP uses silu")
        self.cfg = cfg
        self.model = LlamaModel(cfg, norm_layer or llama_norm_factory("linearnorm", cfg.rms_norm_eps), persistent_rope)
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one table, model.embed_tokens.weight, read by the head too
            self.lm_head = TiedHead(self.model.embed_tokens)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
            if isinstance(m, RepBN):
                nn.init.zeros_(m.bn.weight)
                nn.init.zeros_(m.bn.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


class TiedHead(nn.Module):
    """The output head of a model with tied embeddings (``tie_word_embeddings``): ``h @ E^T`` with the embedding's
    own table ``E`` (``model.embed_tokens.weight``), which it reads without holding it, so the state_dict (and an
    export graph) names the one table once, as transformers saves it."""

    embedding: nn.Embedding

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: its weight has one name, the embedding's

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # In ``h``'s dtype: a copy of the head alone moved to another dtype (the float64 reference runs the final
        # norm and the head as one part) does not move the table it reads, which is not its submodule.
        # (No cast in the traced graph, where the dtypes agree: a cast would make the head's weight a computed one.)
        weight = self.embedding.weight
        return nn.functional.linear(h, weight if weight.dtype == h.dtype else weight.to(h.dtype))


# --------------------------------------------------------------------------------------------- reading weights

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
# config.json fields read (the sizes come from the weights), with their types.
_CASTS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("num_attention_heads", int),
    ("rms_norm_eps", float),
    ("max_position_embeddings", int),
    ("hidden_act", str),
    ("pad_token_id", int),
    ("num_key_value_heads", int),
)


TIED_HEAD = (
    "no lm_head.weight: tied word embeddings (tie_word_embeddings), which LLaMA-PRepBN does not use: its final norm "
    "folds into lm_head, and a tied head would rescale the embedding table; save the model with its own "
    "lm_head.weight (a copy of model.embed_tokens.weight) to fold it"
)
"""Why a LLaMA-PRepBN folder without ``lm_head.weight`` is refused, in memory and streamed."""


def decoder_depth(keys: Iterable[str]) -> int:
    """The number of decoder layers: one more than the largest ``i`` of any ``model.layers.{i}.`` key, so that a
    layer lacking a tensor (or a whole layer below the last) is named as missing, not read as a shallower model."""
    return 1 + max((int(m.group(1)) for k in keys if (m := _LAYER_KEY.match(k))), default=-1)


def llama_signature(state_dict: StateDict) -> tuple[int, int, int, int] | None:
    """``(hidden_size, num_hidden_layers, intermediate_size, vocab_size)`` from the weights, None when they are not
    LLaMA-layout. Reads only keys the fused weights keep too."""
    try:
        embed = state_dict["model.embed_tokens.weight"]  # (V, C)
        gate = state_dict["model.layers.0.mlp.gate_proj.weight"]  # (I, C)
    except KeyError:
        return None  # (no lm_head.weight: tied embeddings, which llama_config names)
    return (int(embed.shape[1]), decoder_depth(state_dict), int(gate.shape[0]), int(embed.shape[0]))


def llama_config(state_dict: StateDict, config: Mapping[str, Any], defaults: LlamaConfig | None = None) -> LlamaConfig:
    """The hyperparameters: sizes from the weights, the rest from ``config`` (config.json), else ``defaults``.

    Raises:
        UnsupportedModelError: not LLaMA-layout weights; no head count known (the weights do not show it: give the
            config.json, or add ``num_attention_heads`` to the one given); a ``num_key_value_heads`` that disagrees
            with the k_proj weight, or does not divide the head count.
        UnsupportedSetting: a scaled rope other than llama3 / linear (``rope_scaling``), no ``lm_head.weight``
            (tied embeddings).
    """
    sig = llama_signature(state_dict)
    if sig is None:
        raise LayoutError("not a LLaMA-layout checkpoint: model.embed_tokens / mlp.gate_proj / lm_head missing")
    hidden, depth, inter, vocab = sig
    config = config if isinstance(config, Mapping) else {}
    if "lm_head.weight" not in state_dict:
        raise UnsupportedSetting(TIED_HEAD)
    if config.get("num_attention_heads") is None and defaults is None:
        if config:  # a folder's config.json, without the one field the weights cannot give
            raise UnsupportedModelError(
                "config.json has no num_attention_heads, and the LLaMA weights do not show the attention head "
                "count: add it to config.json"
            )
        raise UnsupportedModelError(
            "the LLaMA weights do not show the attention head count; read the model from its folder with "
            "config.json (num_attention_heads)"
        )
    base = defaults or LlamaConfig()
    values = {key: cast(config[key]) if config.get(key) is not None else getattr(base, key) for key, cast in _CASTS}
    values["rope_theta"] = rope_theta(config, base.rope_theta)
    values["rope"] = rope_scaling(config, values["max_position_embeddings"])
    q_proj = state_dict.get("model.layers.0.self_attn.q_proj.weight")
    values["head_size"] = check_head_dim(
        config, hidden, values["num_attention_heads"], None if q_proj is None else int(q_proj.shape[0])
    )
    if "pad_token_id" in config and config["pad_token_id"] is None:
        values["pad_token_id"] = None  # no padding row (the text fixture: byte 0 is a token like any other)
    values["num_key_value_heads"] = _kv_heads(state_dict, hidden, values)
    return replace(
        base, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=depth, **values
    )


def _kv_heads(state_dict: StateDict, hidden: int, values: dict[str, Any]) -> int | None:
    """``num_key_value_heads``: from the k_proj weight ``(K d, C)`` where the weights have it, checked against the
    config; else the config's (None: one per query head)."""
    heads, given = values["num_attention_heads"], values.get("num_key_value_heads")
    k_proj = state_dict.get("model.layers.0.self_attn.k_proj.weight")
    if k_proj is None or not heads or (hidden % heads and not values.get("head_size")):
        return given
    rows, head_dim = int(k_proj.shape[0]), values.get("head_size") or hidden // heads
    found = rows // head_dim
    if rows % head_dim or (given is not None and int(given) != found):
        raise UnsupportedModelError(
            f"grouped-query attention: k_proj.weight has {rows} rows, which is not num_key_value_heads "
            f"{given if given is not None else '?'} heads of {head_dim}"
        )
    if heads % found:
        raise UnsupportedModelError(
            f"grouped-query attention needs num_attention_heads {heads} to be a multiple of num_key_value_heads {found}"
        )
    return None if found == heads else found


def check_head_dim(config: Mapping[str, Any], hidden: int, heads: int, q_rows: int | None = None) -> int | None:
    """A ``config.json`` ``head_dim`` other than ``hidden_size / num_attention_heads`` (transformers' LLaMA allows
    one: q_proj ``(heads * head_dim, C)``, o_proj ``(C, heads * head_dim)``), checked against the q_proj weight.

    Args:
        config: ``config.json``; hidden, heads: C and the head count; q_rows: q_proj's rows, when the weights are known.

    Returns:
        ``head_dim`` where the config gives one other than ``hidden / heads`` (``LlamaConfig.head_size``), else None.

    Raises:
        UnsupportedModelError: q_proj has other rows than ``heads * head_dim`` (the config does not fit the
            weights), or ``head_dim`` is odd (the rotary halves).
    """
    head_dim = config.get("head_dim")
    if head_dim is None or not heads:
        return None
    head_dim = int(head_dim)
    if q_rows is not None and q_rows != head_dim * int(heads):
        raise UnsupportedModelError(
            f"head_dim {head_dim} x {heads} heads is {head_dim * int(heads)}, but q_proj.weight has {q_rows} rows"
        )
    if head_dim * int(heads) == hidden:
        return None
    if head_dim < 2 or head_dim % 2:
        raise UnsupportedModelError(f"head_dim {head_dim}: the rotary positions need an even head size")
    return head_dim


def _rope_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope if isinstance(rope, Mapping) else {}


SCALED_ROPES = ("linear", "llama3")
"""The ``rope_type`` values besides ``default`` the LLaMA forward computes (``rope_inv_freq``)."""


def rope_scaling(config: Mapping[str, Any], max_positions: int | None = None) -> RopeScaling | None:
    """The scaled rope of a ``config.json``: ``rope_parameters`` (transformers 5), else ``rope_scaling``
    (transformers 4, its kind in ``rope_type`` or ``type``); None for the plain rope (``default``, or none given).
    llama3's ``original_max_position_embeddings``: the rope's, else the config's top-level one, else
    ``max_positions`` (``max_position_embeddings``), as transformers falls back.

    Raises:
        UnsupportedSetting: another ``rope_type`` (dynamic, yarn, longrope, ...), or a ``partial_rotary_factor``
            other than 1: the forward does not compute it.
        UnsupportedModelError: a llama3 / linear rope without its ``factor`` (llama3: ``low_freq_factor``,
            ``high_freq_factor``), a ``factor`` that is not positive, or ``high_freq_factor <= low_freq_factor``.
    """
    rope = _rope_dict(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedSetting(f"partial_rotary_factor {partial}: slabconv's LLaMA forward rotates the whole head")
    if kind == "default":
        return None
    if kind not in SCALED_ROPES:
        raise UnsupportedSetting(
            f"rope {kind!r}: slabconv's LLaMA forward computes the plain, llama3 and linear rotary positions only"
        )
    names = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [name for name in names if not isinstance(rope.get(name), (int, float))]
    if missing:
        raise UnsupportedModelError(f"rope {kind!r} needs a number {missing[0]} in its parameters")
    factor = float(rope["factor"])
    if factor <= 0:
        raise UnsupportedModelError(f"rope {kind!r}: factor {factor} is not positive")
    if kind == "linear":
        return RopeScaling("linear", factor)
    context = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    context = context if context is not None else max_positions
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    if context is None or int(context) < 1 or high <= low:
        raise UnsupportedModelError(
            f"rope 'llama3' needs original_max_position_embeddings and high_freq_factor {high} > low_freq_factor {low}"
        )
    return RopeScaling("llama3", factor, low, high, int(context))


def rope_parameters(theta: float, rope: RopeScaling | None) -> dict[str, Any]:
    """``config.json``'s ``rope_parameters`` (transformers 5's layout) of ``theta`` and a scaled ``rope``: what
    transformers reads to compute the rope ``rope_inv_freq`` computes."""
    out: dict[str, Any] = {"rope_type": "default" if rope is None else rope.kind, "rope_theta": float(theta)}
    if rope is not None:
        out["factor"] = rope.factor
    if rope is not None and rope.kind == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return out


def rope_theta(config: Mapping[str, Any], default: float = 10000.0) -> float:
    """``rope_theta`` of a ``config.json``: from ``rope_parameters`` (transformers 5 writes it there, with no
    top-level key), else ``rope_scaling``, else the top level (transformers 4, the official LLaMA-350M config), else
    ``default``. (The rope's kind: ``rope_scaling``.)"""
    theta = _rope_dict(config).get("rope_theta")
    if theta is None:
        theta = config.get("rope_theta")
    return float(theta) if theta is not None else float(default)


def seq_len(config: Mapping[str, Any] | None, cfg: LlamaConfig) -> int:
    """The fixed sequence length of the exported model: ``config[SEQ_LEN_KEY]``, else
    ``min(max_position_embeddings, DEFAULT_SEQ_LEN)``."""
    wanted = config.get(SEQ_LEN_KEY) if isinstance(config, Mapping) else None
    if wanted is not None:
        if int(wanted) < 1:
            raise UnsupportedModelError(f"the sequence length must be positive, got {wanted}")
        return int(wanted)
    return min(cfg.max_position_embeddings, DEFAULT_SEQ_LEN)


def _add_biases(model: nn.Module, state_dict: StateDict) -> None:
    """Give every bias-free Linear whose ``<name>.bias`` the weights hold a bias (fused weights: the folds created
    them on q/k/v, gate/up and lm_head)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.bias is None and f"{name}.bias" in state_dict:
            mod.bias = nn.Parameter(torch.zeros(mod.out_features, dtype=mod.weight.dtype, device=mod.weight.device))


def build_llama(
    state_dict: StateDict, config: Mapping[str, Any], norm: str, defaults: LlamaConfig | None = None
) -> nn.Module:
    """``ArchSpec.build`` for LLaMA-PRepBN: ``norm`` is ``checkpoint`` (the layout the weights carry) or
    ``identity`` (the norm-free bound; Linears gain the biases the weights hold)."""
    cfg = llama_config(state_dict, config, defaults)
    layout = (
        norm if norm != "checkpoint" else (norm_layout(state_dict, "model.layers.0.input_layernorm") or "linearnorm")
    )
    persistent = any(k.endswith("rotary_emb.inv_freq") for k in state_dict)
    model = LlamaForCausalLM(cfg, llama_norm_factory(layout, cfg.rms_norm_eps), persistent_rope=persistent)
    _add_biases(model, state_dict)
    return model


# --------------------------------------------------------------------------------------------- registry

LLAMA_350M = LlamaConfig()  # config.json of llama/modeling/llama-350M


def signature(sd: StateDict) -> tuple[int, int, int, int] | None:
    """``llama_signature`` of LLaMA-layout weights with PRepBN norms; None for anything else."""
    if norm_layout(sd, "model.layers.0.input_layernorm") is None:
        return None
    return llama_signature(sd)


def _defaults(preset: Preset) -> LlamaConfig | None:
    return preset.defaults.get("config")


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    return build_llama(sd, config, norm, defaults=_defaults(preset))


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    return (seq_len(config, llama_config(sd, config, _defaults(preset))),)


def example_input(preset: Preset, sd: StateDict, config: Mapping[str, Any], batch: int, seed: int) -> torch.Tensor:
    """Seeded uniform token ids ``(batch, T)`` in ``[0, vocab_size)``, int64."""
    cfg = llama_config(sd, config, _defaults(preset))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len(config, cfg)), generator=gen, dtype=torch.int64)


PRESETS = [
    Preset(
        "llama_350m_prepbn",
        signature=(
            LLAMA_350M.hidden_size,
            LLAMA_350M.num_hidden_layers,
            LLAMA_350M.intermediate_size,
            LLAMA_350M.vocab_size,
        ),
        defaults={"config": LLAMA_350M},
        source=f"{_SOURCE} LlamaForCausalLM (hidden 1024, 18 layers, 8 heads, intermediate 4096, vocab 32000)",
    ),
    Preset(
        "llama_prepbn",
        signature=None,
        source=f"{_SOURCE} LlamaForCausalLM (any size; heads, eps, rope_theta from config.json)",
    ),
]

register_family(
    "llama",
    PRESETS,
    signature=signature,
    build=build,
    input_shape=input_shape,
    input_dtype=torch.int64,
    example_input=example_input,
)
