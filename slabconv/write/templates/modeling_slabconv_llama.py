"""Norm-free LLaMA for Hugging Face transformers: a fused LLaMA-PRepBN written by slabconv.

The model IS transformers' own LLaMA (``LlamaForCausalLM``), so generation, the key/value cache, masks and the
attention backends (eager, sdpa, ...) are those of the installed transformers release. Only two things differ, both
set up in ``SlabconvLlamaForCausalLM.__init__``:

- the norms are gone: ``input_layernorm``, ``post_attention_layernorm`` and ``model.norm`` are ``nn.Identity``.
  slabconv folded them into the Linear layers they fed (``input_layernorm`` into q/k/v_proj,
  ``post_attention_layernorm`` into gate/up_proj, ``model.norm`` into ``lm_head``);
- those projections carry the biases the fold created: ``config.projection_bias`` names, per projection
  (``q_proj`` .. ``down_proj``, ``lm_head``), whether it has one. LlamaConfig's own ``attention_bias``/``mlp_bias``
  switch all four attention (or all three MLP) projections at once, which is not the fold's layout.

This file imports only torch and transformers, so a folder holding it, ``config.json`` and the weights loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` without slabconv. A weight the folder lacks,
or one the model has no place for, is an error when the folder loads (never a silently initialised tensor).

Source of the layout: the Hugging Face LLaMA key layout of github xinghaochen/SLAB
``llama/modeling/llama-350M/modeling_llama.py``, whose decoder layer is the pre-norm LLaMA block with RepBN norms.
"""

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class SlabconvLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus ``projection_bias``: projection name -> whether it has a bias (the same in every layer)."""

    model_type = "slabconv_llama"

    projection_bias: dict | None = None


def _with_bias(linear: nn.Linear, bias: bool) -> nn.Linear:
    """``linear`` itself when it already has (or must not have) a bias, else a Linear of the same shape, device and
    dtype with one (its values come from the checkpoint)."""
    if bias == (linear.bias is not None):
        return linear
    weight = linear.weight
    return nn.Linear(linear.in_features, linear.out_features, bias=bias, device=weight.device, dtype=weight.dtype)


class SlabconvLlamaForCausalLM(LlamaForCausalLM):
    """transformers' ``LlamaForCausalLM`` with its norms folded away: int64 ids ``(B, T)`` -> logits
    ``(B, T, vocab_size)``; ``generate`` as for any causal LM."""

    config_class = SlabconvLlamaConfig
    # The official rotary module stores inv_freq; transformers recomputes it from rope_theta.
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def __init__(self, config: SlabconvLlamaConfig):
        super().__init__(config)
        bias = dict.fromkeys(PROJECTIONS, False) | dict(config.projection_bias or {})
        unknown = sorted(set(bias) - set(PROJECTIONS))
        if unknown:
            raise ValueError(f"projection_bias names {unknown[0]!r}, not one of {', '.join(PROJECTIONS)}")
        for layer in self.model.layers:
            layer.input_layernorm = nn.Identity()
            layer.post_attention_layernorm = nn.Identity()
            for name in _ATTENTION:
                setattr(layer.self_attn, name, _with_bias(getattr(layer.self_attn, name), bias[name]))
            for name in _MLP:
                setattr(layer.mlp, name, _with_bias(getattr(layer.mlp, name), bias[name]))
        self.model.norm = nn.Identity()
        self.lm_head = _with_bias(self.lm_head, bias["lm_head"])
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing a folder whose weights do not fill the model exactly.

        Raises:
            ValueError: a weight is missing (it would be left randomly initialised), has another shape, or has no
                place in the norm-free model (a norm's weight means a norm was not folded).
        """
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        for what, keys in (
            ("lacks", info.get("missing_keys")),
            ("has a tensor the norm-free LLaMA has no place for:", info.get("unexpected_keys")),
            ("has a tensor of the wrong shape:", info.get("mismatched_keys")),
        ):
            keys = sorted(str(k if isinstance(k, str) else k[0]) for k in keys or ())
            if keys:
                raise ValueError(
                    f"the fused LLaMA folder {what} {keys[0]} ({len(keys)} in all); it was not written by slabconv "
                    "or was changed since"
                )
        return (model, info) if wants_info else model


__all__ = ["SlabconvLlamaConfig", "SlabconvLlamaForCausalLM"]
