"""Norm-free LLaMA for Hugging Face transformers: a fused LLaMA-PRepBN written by slabconv.

This file is self-contained: it imports only torch and transformers, so a folder holding it, ``config.json`` and
the weights loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` without slabconv.

The model is the LLaMA-PRepBN of github xinghaochen/SLAB ``llama/modeling/llama-350M/modeling_llama.py`` (the Hugging
Face LLaMA key layout) after every norm was folded into the Linear layers it fed: ``input_layernorm`` into
q/k/v_proj, ``post_attention_layernorm`` into gate/up_proj, the final ``model.norm`` into ``lm_head``. What remains:

- decoder layer: ``x = x + attn(x)``, then ``x = x + mlp(x)`` (no norm, the residual stream is unchanged);
- no final norm: ``logits = lm_head(x)``;
- biases where the weights have them (``config.projection_bias`` names which projections carry one).

Numerics follow the official eval forward: rotary cos/sin computed in float32 from the positions and cast to the
model dtype; scores ``q k^T / sqrt(d)`` plus an additive mask of ``finfo(dtype).min``, clamped at ``finfo.min`` as
the official code does (this also keeps a fully masked row, a left-padding position, finite in float16); softmax in
float32, cast back; SiLU-gated MLP. Grouped-query attention: ``k_proj``/``v_proj`` have ``num_key_value_heads *
head_dim`` rows and each key/value head serves ``num_attention_heads / num_key_value_heads`` consecutive query
heads. The key/value cache is a transformers ``Cache`` (``DynamicCache`` by default), so ``generate`` works as for
any causal LM, with an ``attention_mask`` for left-padded batches.
"""

import math

import torch
import transformers
from torch import nn

# The mask and config conventions used below are those of transformers 5.4 and later (create_causal_mask without
# cache_position, dataclass configs); an older transformers would fail later with a less clear error, so the
# version is checked before importing from it.
MIN_TRANSFORMERS = (5, 4)


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


if _major_minor(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(
        f"modeling_slabconv_llama needs transformers>={MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]} "
        f"(found {transformers.__version__}): pip install -U transformers"
    )

from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel  # noqa: E402
from transformers.cache_utils import Cache, DynamicCache  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class SlabconvLlamaConfig(PreTrainedConfig):
    """The LLaMA hyperparameters (Hugging Face names) plus the norm-free layout.

    ``projection_bias`` maps each projection name (``q_proj`` ... ``down_proj``, ``lm_head``) to whether it has a
    bias; ``rope_parameters`` must be the plain rotary embedding (``rope_type`` ``default``).
    """

    model_type = "slabconv_llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 18
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    projection_bias: dict | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.projection_bias is None:
            self.projection_bias = {name: False for name in PROJECTIONS}
        super().__post_init__(**kwargs)
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"slabconv_llama uses the plain rotary embedding; rope_type {rope_type!r} is not supported"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"slabconv_llama uses a SiLU-gated MLP; hidden_act {self.hidden_act!r} is not supported")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}, and head_dim {self.head_dim} even"
            )


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``cos``, ``sin`` of shape ``(B, 1, T, head_dim)`` in ``dtype`` for int64 ``position_ids`` ``(B, T)``.

    ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` and ``positions * inv_freq`` in float32, duplicated to ``d``
    columns, cos/sin in float32, then cast to ``dtype``.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = position_ids[..., None].to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlabconvLlamaAttention(nn.Module):
    """Causal self-attention with rotary positions on ``(B, T, C)``, grouped-query when kv heads < heads."""

    def __init__(self, config: SlabconvLlamaConfig, layer_idx: int):
        super().__init__()
        bias = config.projection_bias or {}
        c, heads = config.hidden_size, config.num_attention_heads
        d = config.head_dim or c // heads
        self.layer_idx = layer_idx
        self.head_dim = d
        self.num_heads = heads
        self.num_kv_heads = config.num_key_value_heads or heads
        self.q_proj = nn.Linear(c, self.num_heads * d, bias=bias.get("q_proj", False))
        self.k_proj = nn.Linear(c, self.num_kv_heads * d, bias=bias.get("k_proj", False))
        self.v_proj = nn.Linear(c, self.num_kv_heads * d, bias=bias.get("v_proj", False))
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=bias.get("o_proj", False))

    def _expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, kv_heads, L, d)`` -> ``(B, heads, L, d)``: kv head ``j`` serves query heads ``j*g .. j*g+g-1``."""
        groups = self.num_heads // self.num_kv_heads
        if groups == 1:
            return x
        b, h, n, d = x.shape
        return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past_key_values: Cache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        k, v = self._expand_kv(k), self._expand_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = torch.clamp_min(scores, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class SlabconvLlamaMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: SlabconvLlamaConfig):
        super().__init__()
        bias, c, i = config.projection_bias or {}, config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(c, i, bias=bias.get("gate_proj", False))
        self.up_proj = nn.Linear(c, i, bias=bias.get("up_proj", False))
        self.down_proj = nn.Linear(i, c, bias=bias.get("down_proj", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class SlabconvLlamaDecoderLayer(nn.Module):
    """``x + attn(x)``, then ``x + mlp(x)``: the pre-norm LLaMA block with its norms folded away."""

    def __init__(self, config: SlabconvLlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SlabconvLlamaAttention(config, layer_idx)
        self.mlp = SlabconvLlamaMLP(config)

    def forward(self, x, cos, sin, mask, past_key_values):
        x = x + self.self_attn(x, cos, sin, mask, past_key_values)
        return x + self.mlp(x)


class SlabconvLlamaPreTrainedModel(PreTrainedModel):
    """The transformers base of the norm-free LLaMA: its config class and loading rules."""

    config_class = SlabconvLlamaConfig
    config: SlabconvLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["SlabconvLlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    # The official rotary module stores inv_freq; this model recomputes it in float32 (as the official eval does).
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]


class SlabconvLlamaModel(SlabconvLlamaPreTrainedModel):
    """Token embedding and the norm-free decoder layers: ids ``(B, T)`` -> hidden states ``(B, T, C)``."""

    def __init__(self, config: SlabconvLlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([SlabconvLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            positions = (torch.arange(x.shape[1], device=x.device) + seen)[None].expand(x.shape[0], -1)
        else:
            positions = position_ids
        # Additive mask of 0 / finfo(dtype).min over (B, 1, T, past + T): causal and, with attention_mask, padding
        # (the eager attention implementation always gets a materialised mask).
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=positions,
        )
        theta = float((self.config.rope_parameters or {})["rope_theta"])
        head_dim = self.config.head_dim or self.config.hidden_size // self.config.num_attention_heads
        cos, sin = rotary_cos_sin(positions, head_dim, theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=x, past_key_values=past_key_values if use_cache else None)


class SlabconvLlamaForCausalLM(SlabconvLlamaPreTrainedModel, GenerationMixin):
    """Norm-free LLaMA causal LM: int64 ids ``(B, T)`` -> logits ``(B, T, vocab_size)`` (``lm_head`` may carry a
    bias: the final norm folded into it)."""

    def __init__(self, config: SlabconvLlamaConfig):
        super().__init__(config)
        self.model = SlabconvLlamaModel(config)
        bias = (config.projection_bias or {}).get("lm_head", False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=bias)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=out.past_key_values)


__all__ = ["SlabconvLlamaConfig", "SlabconvLlamaForCausalLM", "SlabconvLlamaModel", "SlabconvLlamaPreTrainedModel"]
