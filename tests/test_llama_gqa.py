"""Grouped-query attention in the LLaMA-PRepBN zoo entry: ``num_key_value_heads < num_attention_heads`` builds
(k/v projections ``(K d, C)``, each k/v head repeated for its group of query heads as Hugging Face LLaMA's
``repeat_kv`` does), reads its head count from the weights or config.json, and folds completely and exactly (the
norms fold into the smaller k/v projections the same way)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from slabconv.engine import capture, fold_all, fused_state_dict
from slabconv.errors import UnsupportedModelError
from slabconv.zoo import get_arch
from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM, llama_config, llama_norm_factory
from tests.conftest import randomize_norms

BASE = LlamaConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
)
CONFIG = {"model_type": "llama", "num_attention_heads": 4, "max_position_embeddings": 16, "rms_norm_eps": 1e-6}


def gqa_model(kv: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = replace(BASE, num_key_value_heads=kv)
    return randomize_norms(LlamaForCausalLM(cfg, llama_norm_factory("linearnorm", cfg.rms_norm_eps))).to(dtype).eval()


def ids(batch: int = 3, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, BASE.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


@pytest.mark.parametrize("kv", [2, 1])
def test_gqa_equals_multi_head_attention_with_each_kv_head_repeated(kv):
    """An independent restatement of repeat_kv: the GQA model equals the multi-head model whose k/v weight rows
    for query head h are those of k/v head h // (heads / kv)."""
    model = gqa_model(kv)
    d, rep = BASE.head_dim, BASE.num_attention_heads // kv
    mha = LlamaForCausalLM(BASE, llama_norm_factory("linearnorm", BASE.rms_norm_eps)).eval()
    state = copy.deepcopy(model.state_dict())
    for key, value in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            assert value.shape == (kv * d, BASE.hidden_size)
            state[key] = value.view(kv, d, -1).repeat_interleave(rep, dim=0).reshape(BASE.hidden_size, -1)
    mha.load_state_dict(state, strict=True)
    x = ids()
    with torch.no_grad():
        assert rel_err(model(x), mha(x)) <= 1e-6


@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gqa_model_folds_completely_and_exactly(kv, dtype):
    model = gqa_model(kv, dtype)
    x = ids()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert len(decisions) == 2 * BASE.num_hidden_layers + 1
    assert all(d.action == "folded-forward" and d.kind == "RepBN" for d in decisions)
    assert decisions[0].into == [f"model.layers.0.self_attn.{p}_proj" for p in "kqv"]
    assert rel_err(gm(x), reference) <= (1e-5 if dtype == torch.float32 else 1e-12)
    fused = fused_state_dict(gm)
    assert fused["model.layers.0.self_attn.k_proj.bias"].shape == (kv * BASE.head_dim,)
    # the fused weights are the norm-free bound's, built by the registry with the same head counts
    spec = get_arch("llama_prepbn")
    bound = spec.build(fused, {**CONFIG, "num_key_value_heads": kv}, "identity").to(dtype).eval()
    bound.load_state_dict(fused, strict=True)
    assert rel_err(bound(x), reference) <= (1e-5 if dtype == torch.float32 else 1e-12)


def test_the_kv_head_count_comes_from_the_weights_or_config_json():
    sd = gqa_model(2).state_dict()
    assert llama_config(sd, CONFIG).kv_heads == 2  # from k_proj.weight (32 / 4 = 8 per head, 16 rows)
    assert llama_config(sd, {**CONFIG, "num_key_value_heads": 2}).num_key_value_heads == 2
    built = get_arch("llama_prepbn").build(sd, CONFIG, "checkpoint")
    built.load_state_dict(sd, strict=True)
    with pytest.raises(UnsupportedModelError, match="grouped-query"):
        llama_config(sd, {**CONFIG, "num_key_value_heads": 1})  # 1 head of 8 is not 16 rows
    mha = gqa_model(4).state_dict()
    assert llama_config(mha, CONFIG).num_key_value_heads is None  # multi-head: as before
    with pytest.raises(UnsupportedModelError, match="multiple"):
        LlamaForCausalLM(replace(BASE, num_key_value_heads=3))
