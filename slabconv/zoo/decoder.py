"""What the streamed mode needs to know of a decoder-only language model, as one interface per family.

A streamed fold (``fuse --stream``) never holds a whole checkpoint: it plans on the full-size architecture with
stand-in weights (``slabconv.load.lazy``, any zoo family), folds the big weights shard by shard, and for a decoder
family verifies one decoder layer at a time. Everything that is family-specific in that verification — key names,
the decoder layer and the inputs it takes — comes from a ``DecoderFamily``. LLaMA-PRepBN implements it
(``LLAMA``), and so do the standard LLaMA / Mistral / Qwen2 decoders (``STANDARD``, ``slabconv.zoo.llama_std``:
plain RMSNorms, which keep a weight of ones where ``--fold-norm-affine`` folded it); another decoder family (a
GPT-style model with RepBN norms, say) would add one more instance here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo import llama, llama_std
from slabconv.zoo.layers import NormFactory, norm_layout


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
        config: ``config(meta_state_dict, config_json) -> cfg``: the hyperparameters (sizes from the shapes).
        build_layer: ``build_layer(cfg) -> nn.Module`` on the meta device, norms as identities (the streamed
            verifier replaces its Linears and norms).
        build_norm: ``build_norm(layout, cfg) -> nn.Module`` for one norm (identity once folded).
        layer_inputs: ``layer_inputs(cfg, i, seq_len, dtype) -> tuple``: what decoder layer ``i`` takes besides
            the hidden states ``(B, T, C)`` (``layer(h, *inputs)``); layers differ where their attention does
            (a sliding window in some layers only).
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
    config: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], Any]
    build_layer: Callable[[Any], nn.Module]
    build_norm: Callable[[str, Any], nn.Module]
    layer_inputs: Callable[[Any, int, int, torch.dtype], tuple[torch.Tensor, ...]]
    vocab_size: Callable[[Any], int]
    num_layers: Callable[[Any], int]
    max_positions: Callable[[Any], int]

    def head_key(self, keys: Mapping[str, Any]) -> str:
        """The prefix of the head's weight in a folder: ``head``, or the embedding's where the head is tied to it
        (no ``<head>.weight``: transformers' ``tie_word_embeddings``)."""
        return self.head if f"{self.head}.weight" in keys else self.embed.removesuffix(".weight")

    def template(self, name: str) -> str:
        """``model.layers.7.mlp.up_proj`` -> ``model.layers.{i}.mlp.up_proj``; other names unchanged."""
        return self.layer_key.sub(self.layer_prefix, name)

    def instance(self, template: str, i: int) -> str:
        """A template's name in layer ``i``."""
        return template.replace(self.layer_prefix, self.layer_prefix.format(i=i))


# --------------------------------------------------------------------------------------------- LLaMA-PRepBN


def _llama_layer(cfg: Any) -> nn.Module:
    with torch.device("meta"):
        return llama.LlamaDecoderLayer(cfg, llama.llama_norm_factory("identity"), persistent_rope=False)


def _norm(factory: Callable[[str, float], NormFactory]) -> Callable[[str, Any], nn.Module]:
    """``build_norm`` from a family's norm factory ``factory(layout, eps)``: one norm of ``cfg.hidden_size``."""
    return lambda layout, cfg: factory(layout, cfg.rms_norm_eps)(cfg.hidden_size)


def _llama_inputs(cfg: Any, i: int, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rotary ``cos``, ``sin`` ``(T, d)`` and the additive mask ``(T, T)`` of decoder layer ``i`` in ``dtype``, as
    the zoo's forward makes them: causal, or causal over the layer's sliding window (``cfg.sliding_windows``)."""
    cos, sin = llama.rope_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta, dtype, cfg.rope)
    windows = cfg.sliding_windows or ()
    window = windows[i] if i < len(windows) else None
    if window is not None:
        return cos, sin, llama.sliding_mask(seq_len, int(window), dtype)
    mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return cos, sin, mask


LLAMA = DecoderFamily(
    name="llama_prepbn",
    layer_key=re.compile(r"^model\.layers\.(\d+)\."),
    layer_prefix="model.layers.{i}.",
    embed="model.embed_tokens.weight",
    head="lm_head",
    final_norm="model.norm",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    norm_layout=norm_layout,
    config=llama.llama_config,
    build_layer=_llama_layer,
    build_norm=_norm(llama.llama_norm_factory),
    layer_inputs=_llama_inputs,
    vocab_size=lambda cfg: int(cfg.vocab_size),
    num_layers=lambda cfg: int(cfg.num_hidden_layers),
    max_positions=lambda cfg: int(cfg.max_position_embeddings),
)

# --------------------------------------------------------------------------------------------- standard decoders


STANDARD = replace(
    LLAMA,  # the same key layout and layers; plain RMSNorms, and the config of transformers' own classes
    name="llama_std",
    norm_layout=llama_std.norm_layout,
    config=llama_std.std_config,
    build_norm=_norm(llama_std.norm_factory),
)

FAMILIES = (STANDARD, LLAMA)


def decoder_layout(keys: Mapping[str, Any]) -> bool:
    """Whether ``keys`` hold a family's token embedding and decoder layers: a decoder language model, also where
    ``family_of`` matches none (a LLaMA-PRepBN with tied embeddings has no head of its own, which loading names)."""
    return any(f.embed in keys and any(f.layer_key.match(k) for k in keys) for f in FAMILIES)


def family_of(keys: Mapping[str, Any]) -> DecoderFamily:
    """The decoder family of a folder: the standard decoders by their plain RMSNorm weights, LLaMA-PRepBN (its
    norms, or none once folded) by its embedding and head keys.

    Raises:
        UnsupportedModelError: none matches.
    """
    first = "model.layers.0.input_layernorm"
    if STANDARD.embed in keys and STANDARD.norm_layout(keys, first) is not None:
        return STANDARD
    for family in FAMILIES:
        if family is not STANDARD and family.embed in keys and f"{family.head}.weight" in keys:
            return family
    if decoder_layout(keys):  # LLaMA-PRepBN's layers without a head of its own
        raise UnsupportedModelError(llama.TIED_HEAD)
    raise UnsupportedModelError(
        "the streamed mode handles decoder-only language models of a known family (LLaMA layout: "
        "model.embed_tokens, model.layers.N, lm_head); fold this model in memory without --stream"
    )
