"""Standard Hugging Face decoders of the LLaMA family (LLaMA, Mistral, Qwen2), in their own key layout.

These models have no SLAB norms: their norms are RMSNorms with a learned weight. slabconv folds those weights
when asked to (``LoadOptions.fold_norm_affine``, ``--fold-norm-affine``: ``slabconv.engine.norm_affine``) and
writes the result as the same standard architecture with every norm weight 1 (``slabconv.write.hf_llama``);
without it, the model has no norm slabconv folds.

Layout source: transformers' ``modeling_llama.py``, ``modeling_mistral.py`` and ``modeling_qwen2.py`` (5.x) and
their ``config.json`` keys; written here from those facts, no code copied. The forward is the zoo's LLaMA
(``slabconv.zoo.llama``: the same rotary positions, grouped-query attention, float32 softmax, SiLU-gated MLP) with:

- the norms ``RMSNorm(x) = γ ⊙ x / sqrt(mean(x²) + rms_norm_eps)`` written as ``F.rms_norm`` (``aten.rms_norm``,
  which ``split_norm_affines`` splits): the same value as transformers' ``LlamaRMSNorm`` in float32; in float16 /
  bfloat16 transformers rounds ``x̂`` before multiplying by ``γ`` and ``F.rms_norm`` after, one unit in the last
  place apart on some values (the verification's float64 reference is the same function for both);
- biases where the weights have them: Qwen2's ``q/k/v_proj.bias`` (``o_proj`` has none), LLaMA's
  ``attention_bias`` (all four) and ``mlp_bias``;
- ``tie_word_embeddings``: ``lm_head`` reads ``model.embed_tokens.weight`` (then absent from the weights);
- sliding-window attention (Mistral's ``sliding_window``; Qwen2's ``layer_types`` ``sliding_attention``, or where
  a config has no ``layer_types`` and ``use_sliding_window``, the layers from ``max_window_layers`` on, as
  transformers' ``Qwen2Config`` reads it): query ``i`` sees keys ``i - W < j <= i``.

- the rope of ``rope_parameters`` / ``rope_scaling`` (``slabconv.zoo.llama.rope_scaling``): the plain one,
  ``llama3`` (Llama 3.1 / 3.2: each inverse frequency rescaled from ``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``) or ``linear`` (divided by ``factor``), as
  transformers' ``modeling_rope_utils.py`` computes them;
- an explicit ``head_dim`` (q_proj ``(heads * head_dim, C)``, o_proj ``(C, heads * head_dim)``).

Refused (``UnsupportedModelError``): another rope (``rope_type`` dynamic, yarn, longrope, ...), an activation
other than SiLU, ``pretraining_tp`` above 1.

Detection: a ``config.json`` with ``model_type`` ``llama`` / ``mistral`` / ``qwen2`` and weights with the plain
RMSNorm key ``model.layers.0.input_layernorm.weight`` (LLaMA-PRepBN's norms are ``LinearNorm``s:
``slabconv.zoo.llama``).
Input: int64 token ids ``(B, T)``; output: logits ``(B, T, V)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    _add_biases,
    _kv_heads,
    check_head_dim,
    decoder_depth,
    rope_scaling,
    rope_theta,
    seq_len,
)
from slabconv.zoo.names import BY_NAME
from slabconv.zoo.registry import ArchSpec, StateDict, UnsupportedSetting, register_arch

MODEL_TYPES = ("llama", "mistral", "qwen2")
"""The ``model_type`` values of the standard decoders this module builds (one registered architecture each)."""

FAMILY = "llama_std"
NORM_KEY = "model.layers.0.input_layernorm.weight"


class RMSNorm(nn.Module):
    """``γ ⊙ x / sqrt(mean(x², -1) + eps)`` over the last axis, as ``F.rms_norm`` (``aten.rms_norm``); key
    ``weight`` ``(C,)`` as transformers' ``LlamaRMSNorm``."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def norm_factory(layout: str, eps: float) -> Any:
    """``rmsnorm`` (the standard norm) or ``identity`` (the norm-free bound)."""
    if layout == "rmsnorm":
        return partial(RMSNorm, eps=eps)
    if layout == "identity":
        return lambda dim: nn.Identity()
    raise ValueError(f"unknown norm layout {layout!r}")


def norm_layout(keys: Mapping[str, Any], prefix: str) -> str | None:
    """``rmsnorm`` when ``<prefix>.weight`` is a plain RMSNorm weight (no LinearNorm / RepBN keys), else None."""
    if f"{prefix}.weight" in keys and f"{prefix}.norm2.bn.running_mean" not in keys:
        return "rmsnorm"
    return None


def _windows(config: Mapping[str, Any], depth: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: full causal attention); None when no layer has one."""
    window = config.get("sliding_window")
    if window is None or int(window) <= 0:
        return None
    types = config.get("layer_types")
    if isinstance(types, (list, tuple)) and len(types) == depth:
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif config.get("model_type") == "qwen2":  # transformers' Qwen2Config: the layers from max_window_layers on
        first = int(config.get("max_window_layers", 28)) if config.get("use_sliding_window") else depth
        windows = tuple(int(window) if i >= first else None for i in range(depth))
    else:  # Mistral: every layer
        windows = (int(window),) * depth
    return windows if any(w is not None for w in windows) else None


def std_config(state_dict: StateDict, config: Mapping[str, Any]) -> LlamaConfig:
    """The hyperparameters: sizes from the weights, the rest from ``config.json``.

    Raises:
        UnsupportedModelError: weights that are not this layout, no head count, a ``head_dim`` the q_proj weight
            does not have, a rope other than the plain, llama3 and linear ones, another activation,
            ``pretraining_tp`` > 1.
    """
    try:
        embed = state_dict["model.embed_tokens.weight"]  # (V, C)
        gate = state_dict["model.layers.0.mlp.gate_proj.weight"]  # (I, C)
    except KeyError:
        raise UnsupportedModelError(
            "not a LLaMA-layout checkpoint: model.embed_tokens / mlp.gate_proj missing"
        ) from None
    depth = decoder_depth(state_dict)
    vocab, hidden = int(embed.shape[0]), int(embed.shape[1])
    heads = config.get("num_attention_heads")
    if heads is None:
        raise UnsupportedModelError("the config has no num_attention_heads; the weights do not show it")
    heads = int(heads)
    q_proj = state_dict.get("model.layers.0.self_attn.q_proj.weight")
    head_size = check_head_dim(config, hidden, heads, None if q_proj is None else int(q_proj.shape[0]))
    act = str(config.get("hidden_act", "silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedSetting(f"hidden_act {act!r}: the LLaMA MLP uses silu")
    if int(config.get("pretraining_tp") or 1) > 1:
        raise UnsupportedSetting("pretraining_tp > 1: the sliced projections are not implemented; set it to 1")
    tied = "lm_head.weight" not in state_dict and bool(config.get("tie_word_embeddings", False))
    values: dict[str, Any] = {
        "num_attention_heads": heads,
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta(config),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "hidden_act": act,
        "pad_token_id": int(config["pad_token_id"]) if isinstance(config.get("pad_token_id"), int) else None,
        "num_key_value_heads": config.get("num_key_value_heads"),
        "head_size": head_size,
    }
    values["rope"] = rope_scaling(config, values["max_position_embeddings"])
    values["num_key_value_heads"] = _kv_heads(state_dict, hidden, values)
    return replace(
        LlamaConfig(),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(gate.shape[0]),
        num_hidden_layers=depth,
        tie_word_embeddings=tied,
        sliding_windows=_windows(config, depth),
        **values,
    )


def build_std(state_dict: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    """``ArchSpec.build``: ``norm`` ``checkpoint`` (RMSNorms with their weights) or ``identity`` (the norm-free
    bound). Linears get the biases the weights hold; the embedding has no padding row (transformers' LLaMA zeroes
    none at load); each layer's ``rotary_emb.inv_freq`` where the weights hold it (never read: recomputed from
    ``rope_theta`` and the rope's scaling, as transformers does)."""
    cfg = replace(std_config(state_dict, config), pad_token_id=None)
    layout = "identity" if norm == "identity" else "rmsnorm"
    persistent = any(k.endswith("rotary_emb.inv_freq") for k in state_dict)  # transformers before 4.31 saved them
    model = LlamaForCausalLM(cfg, norm_factory(layout, cfg.rms_norm_eps), persistent_rope=persistent)
    _add_biases(model, state_dict)
    return model


def matches(model_type: str, state_dict: StateDict, config: Mapping[str, Any]) -> bool:
    """The weights are a standard decoder of ``model_type``: its config says so and its norms are plain RMSNorms."""
    if not isinstance(config, Mapping) or config.get("model_type") != model_type:
        return False
    return (
        "model.embed_tokens.weight" in state_dict and norm_layout(state_dict, NORM_KEY[: -len(".weight")]) is not None
    )


def input_shape(state_dict: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    return (seq_len(config, std_config(state_dict, config)),)


def example_input(state_dict: StateDict, config: Mapping[str, Any], batch: int, seed: int) -> torch.Tensor:
    """Seeded uniform token ids ``(batch, T)`` in ``[0, vocab_size)``, int64."""
    cfg = std_config(state_dict, config)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len(config, cfg)), generator=gen, dtype=torch.int64)


_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

for _type in MODEL_TYPES:
    register_arch(
        ArchSpec(
            name=_type,
            family=FAMILY,
            build=build_std,
            input_shape=input_shape,
            matches=partial(matches, _type),
            aliases=(_CLASSES[_type],),
            source=f"transformers models/{_type}/modeling_{_type}.py {_CLASSES[_type]} (any size; config.json)",
            description=BY_NAME[_type].description,
            input_dtype=torch.int64,
            example_input=example_input,
        )
    )
