"""What the streamed mode needs to know of a decoder-only language model, as one interface per family.

A streamed fold (``fuse --stream``) never holds a whole checkpoint: it plans on a tiny instance of the same
architecture, folds the big weights shard by shard, and verifies one decoder layer at a time. Everything that is
family-specific in that — key names, the planning instance, the decoder layer and the inputs it takes — comes
from a ``DecoderFamily``. LLaMA-PRepBN implements it (``LLAMA``); another decoder family (a GPT-style model with
RepBN norms, say) would add one more instance here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.layers import norm_layout


@dataclass(frozen=True)
class DecoderFamily:
    """A decoder-only language model family, as the streamed mode sees it.

    Attributes:
        name: the architecture name the streamed report records.
        layer_key: matches a key of decoder layer ``i`` (group 1 is ``i``).
        layer_prefix: the prefix of layer ``i``'s keys, with ``{i}``.
        embed: the token embedding weight ``(V, C)``.
        head: the output projection (a Linear prefix; its weight ``(V, C)``).
        final_norm: the norm before ``head``.
        layer_norms: the norms inside a decoder layer, relative to its prefix.
        norm_layout: ``norm_layout(keys, prefix) -> layout`` (None: not a norm of this family).
        tiny_model: ``tiny_model(config, keys) -> nn.Module``: a small instance with the same norm layout and
            data flow (ids ``(B, T)`` -> logits), whose fold decisions hold for every layer of the big model.
        tiny_example: ``tiny_example() -> Tensor``: an input for it.
        config: ``config(meta_state_dict, config_json) -> cfg``: the hyperparameters (sizes from the shapes).
        build_layer: ``build_layer(cfg) -> nn.Module`` on the meta device, norms as identities (the streamed
            verifier replaces its Linears and norms).
        build_norm: ``build_norm(layout, cfg) -> nn.Module`` for one norm (identity once folded).
        layer_inputs: ``layer_inputs(cfg, seq_len, dtype) -> tuple``: what ``layer(h, *inputs)`` takes besides
            the hidden states ``(B, T, C)``.
        vocab_size, num_layers, eps: of a ``cfg``.
    """

    name: str
    layer_key: re.Pattern[str]
    layer_prefix: str
    embed: str
    head: str
    final_norm: str
    layer_norms: tuple[str, ...]
    norm_layout: Callable[[Mapping[str, Any], str], str | None]
    tiny_model: Callable[[Mapping[str, Any], Mapping[str, Any]], nn.Module]
    tiny_example: Callable[[], torch.Tensor]
    config: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], Any]
    build_layer: Callable[[Any], nn.Module]
    build_norm: Callable[[str, Any], nn.Module]
    layer_inputs: Callable[[Any, int, torch.dtype], tuple[torch.Tensor, ...]]
    vocab_size: Callable[[Any], int]
    num_layers: Callable[[Any], int]
    max_positions: Callable[[Any], int]

    def template(self, name: str) -> str:
        """``model.layers.7.mlp.up_proj`` -> ``model.layers.{i}.mlp.up_proj``; other names unchanged."""
        return self.layer_key.sub(self.layer_prefix, name)

    def instance(self, template: str, i: int) -> str:
        """A template's name in layer ``i``."""
        return template.replace(self.layer_prefix, self.layer_prefix.format(i=i))


# --------------------------------------------------------------------------------------------- LLaMA-PRepBN

_TINY = {"hidden_size": 16, "intermediate_size": 32, "vocab_size": 64, "num_attention_heads": 2, "layers": 2}


def _llama_tiny(config: Mapping[str, Any], keys: Mapping[str, Any]) -> nn.Module:
    """LLaMA-PRepBN at hidden 16, intermediate 32, vocab 64, 2 heads (1 key/value head when the model has
    grouped-query attention), 2 layers; the folder's norm layout, eps and rope; fixed positive statistics (the
    plan depends on the data flow, not on these values)."""
    from slabconv.zoo.llama import LlamaForCausalLM, llama_config, llama_norm_factory

    if "model.embed_tokens.weight" not in keys or "lm_head.weight" not in keys:
        raise UnsupportedModelError("the streamed mode supports LLaMA-layout folders (model.embed_tokens, lm_head)")
    layout = norm_layout(keys, "model.layers.0.input_layernorm")
    if layout is None:
        raise UnsupportedModelError(
            "the streamed mode folds LLaMA-PRepBN: model.layers.0.input_layernorm has no RepBN statistics"
        )
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    grouped = kv is not None and heads is not None and int(kv) < int(heads)
    c, inter, vocab, n = (_TINY[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "layers"))
    tiny_heads, tiny_kv = _TINY["num_attention_heads"], 1 if grouped else _TINY["num_attention_heads"]
    head_dim = c // tiny_heads
    shapes = {"model.embed_tokens.weight": (vocab, c), "lm_head.weight": (vocab, c)}
    for i in range(n):
        shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (c, c)
        shapes[f"model.layers.{i}.self_attn.k_proj.weight"] = (tiny_kv * head_dim, c)
        shapes[f"model.layers.{i}.mlp.gate_proj.weight"] = (inter, c)
    fake = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    tiny_config = dict(config)
    tiny_config.update(
        num_attention_heads=tiny_heads, num_key_value_heads=tiny_kv, max_position_embeddings=16, pad_token_id=0
    )
    cfg = llama_config(fake, tiny_config)
    persistent = any(k.endswith("rotary_emb.inv_freq") for k in keys)
    model = LlamaForCausalLM(cfg, llama_norm_factory(layout, cfg.rms_norm_eps), persistent_rope=persistent)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                assert mod.running_mean is not None and mod.running_var is not None
                mod.running_mean.fill_(0.5)
                mod.running_var.fill_(2.0)
                mod.weight.fill_(1.0)
                mod.bias.fill_(0.25)
            alpha = getattr(mod, "alpha", None)
            if isinstance(alpha, nn.Parameter):
                alpha.fill_(0.5)
            for counter in ("warm", "iter"):
                if isinstance(getattr(mod, counter, None), torch.Tensor):
                    getattr(mod, counter).zero_()
    return model.eval()


def _llama_example() -> torch.Tensor:
    return torch.randint(0, _TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))


def _llama_layer(cfg: Any) -> nn.Module:
    from slabconv.zoo.llama import LlamaDecoderLayer, llama_norm_factory

    with torch.device("meta"):
        return LlamaDecoderLayer(cfg, llama_norm_factory("identity"), persistent_rope=False)


def _llama_norm(layout: str, cfg: Any) -> nn.Module:
    from slabconv.zoo.llama import llama_norm_factory

    return llama_norm_factory(layout, cfg.rms_norm_eps)(cfg.hidden_size)


def _llama_inputs(cfg: Any, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rotary ``cos``, ``sin`` ``(T, d)`` and the causal mask ``(T, T)`` in ``dtype``, as the zoo's forward makes
    them."""
    from slabconv.zoo.llama import rope_cos_sin

    cos, sin = rope_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta, dtype)
    mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return cos, sin, mask


def _llama_config(meta: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Any:
    from slabconv.zoo.llama import llama_config

    return llama_config(meta, config)


LLAMA = DecoderFamily(
    name="llama_prepbn",
    layer_key=re.compile(r"^model\.layers\.(\d+)\."),
    layer_prefix="model.layers.{i}.",
    embed="model.embed_tokens.weight",
    head="lm_head",
    final_norm="model.norm",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    norm_layout=norm_layout,
    tiny_model=_llama_tiny,
    tiny_example=_llama_example,
    config=_llama_config,
    build_layer=_llama_layer,
    build_norm=_llama_norm,
    layer_inputs=_llama_inputs,
    vocab_size=lambda cfg: int(cfg.vocab_size),
    num_layers=lambda cfg: int(cfg.num_hidden_layers),
    max_positions=lambda cfg: int(cfg.max_position_embeddings),
)

FAMILIES = (LLAMA,)


def family_of(keys: Mapping[str, Any]) -> DecoderFamily:
    """The decoder family whose embedding and head keys a folder holds.

    Raises:
        UnsupportedModelError: none matches.
    """
    for family in FAMILIES:
        if family.embed in keys and f"{family.head}.weight" in keys:
            return family
    raise UnsupportedModelError(
        "the streamed mode handles decoder-only language models of a known family (LLaMA layout: "
        "model.embed_tokens, model.layers.N, lm_head); fold this model in memory without --stream"
    )
