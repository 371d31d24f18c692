"""LLaMA-PRepBN: the official key layout, the official eval forward, complete folds (q/k/v, gate/up, lm_head gain
biases), the norm-free ONNX bound, the real text fixture through onnxruntime, and the Hugging Face folder reader."""

from __future__ import annotations

import collections
import copy
import io
import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from slabconv import engine
from slabconv.engine.norms import BN_OPS
from slabconv.errors import InputError, UnsupportedModelError
from slabconv.load import hf
from slabconv.load.source import Source
from slabconv.verify import sides
from slabconv.write.onnx import export_onnx
from slabconv.zoo import detect_arch, get_arch
from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM, LlamaLinearNorm, llama_norm_factory
from slabconv.zoo.norms import RepBN, RMSNorm
from tests import hfwrite
from tests.conftest import ROOT, op_histogram, randomize_norms

TEXT_FIXTURE = ROOT / "fixtures" / "text-prepbn"
TINY = LlamaConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
)
TINY_CONFIG = {"model_type": "llama", "num_attention_heads": 4, "max_position_embeddings": 16, "rms_norm_eps": 1e-6}


def tiny_model(layout: str = "linearnorm", seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY, llama_norm_factory(layout, TINY.rms_norm_eps))
    return randomize_norms(model, seed).to(dtype).eval()


def tokens(batch: int = 3, seq: int = 16, seed: int = 1, vocab: int = TINY.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# --------------------------------------------------------------------------------------------- official layout
# Written from github xinghaochen/SLAB llama/modeling/llama-350M/modeling_llama.py, constructor by constructor;
# independent of slabconv.zoo.


def official_layout(c: int, layers: int, heads: int, inter: int, vocab: int) -> dict[str, tuple[int, ...]]:
    def linear_norm(prefix: str) -> dict[str, tuple[int, ...]]:
        # LinearNorm: buffers num_step, warm, iter, total_step; norm1 = LlamaRMSNorm; norm2 = RepBN(alpha, bn)
        keys = {f"{prefix}.{b}": () for b in ("num_step", "warm", "iter", "total_step")}
        keys[f"{prefix}.norm1.weight"] = (c,)
        keys[f"{prefix}.norm2.alpha"] = (1,)
        for name in ("weight", "bias", "running_mean", "running_var"):
            keys[f"{prefix}.norm2.bn.{name}"] = (c,)
        keys[f"{prefix}.norm2.bn.num_batches_tracked"] = ()
        return keys

    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, c)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in "qkvo":
            out[f"{p}.self_attn.{proj}_proj.weight"] = (c, c)
        out[f"{p}.self_attn.rotary_emb.inv_freq"] = (c // heads // 2,)  # registered without persistent=False
        out[f"{p}.mlp.gate_proj.weight"] = (inter, c)
        out[f"{p}.mlp.down_proj.weight"] = (c, inter)
        out[f"{p}.mlp.up_proj.weight"] = (inter, c)
        out |= linear_norm(f"{p}.input_layernorm") | linear_norm(f"{p}.post_attention_layernorm")
    out |= linear_norm("model.norm")
    out["lm_head.weight"] = (vocab, c)
    return out


# llama/modeling/llama-350M/config.json
CONFIG_350M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 8,
    "num_hidden_layers": 18,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}


@pytest.mark.parametrize("config", [CONFIG_350M, {}], ids=["with-config", "weights-only"])
def test_llama_350m_layout_builds_strictly_and_is_detected(config):
    expected = official_layout(1024, 18, 8, 4096, 32000)
    with torch.device("meta"):
        sd = {
            k: torch.empty(shape, dtype=torch.int64 if shape == () else torch.float16) for k, shape in expected.items()
        }
        spec = detect_arch(sd, config)
        built = spec.build(sd, config, "checkpoint")
    assert spec.name == "llama_350m_prepbn" and get_arch("llama-350M") is spec
    state = built.state_dict()
    assert sorted(state) == sorted(expected)
    assert not [k for k in expected if tuple(state[k].shape) != expected[k]]
    assert {k for k, v in state.items() if v.dtype == torch.int64} == {k for k, s in expected.items() if s == ()}
    norm = built.model.layers[0].input_layernorm
    assert isinstance(norm, LlamaLinearNorm) and isinstance(norm.norm1, RMSNorm) and isinstance(norm.norm2, RepBN)
    assert norm.norm1.eps == 1e-6 and norm.norm2.bn.eps == 1e-6 and norm.norm2.flatten_tokens
    assert built.model.layers[0].self_attn.num_heads == 8
    assert all(m.bias is None for m in built.modules() if isinstance(m, nn.Linear))
    assert spec.input_dtype == torch.int64 and spec.input_shape(sd, config) == (128,)


def test_tiny_model_has_the_official_layout_and_the_any_size_entry_takes_it():
    model = tiny_model()
    sd = model.state_dict()
    expected = official_layout(32, 2, 4, 48, 61)
    assert sorted(sd) == sorted(expected)
    assert all(tuple(sd[k].shape) == s for k, s in expected.items())
    spec = detect_arch(sd, TINY_CONFIG)
    assert spec.name == "llama_prepbn"
    rebuilt = spec.build(sd, TINY_CONFIG, "checkpoint")
    rebuilt.load_state_dict(sd, strict=True)
    x = tokens()
    assert torch.equal(rebuilt.eval()(x), model(x))
    ids = spec.example(sd, TINY_CONFIG, batch=5, seed=3)
    assert ids.dtype == torch.int64 and ids.shape == (5, 16) and 0 <= int(ids.min()) and int(ids.max()) < 61
    assert torch.equal(ids, spec.example(sd, TINY_CONFIG, batch=5, seed=3))


def test_a_checkpoint_without_inv_freq_loads_strictly_and_weights_alone_need_the_head_count():
    sd = {k: v for k, v in tiny_model().state_dict().items() if not k.endswith("inv_freq")}  # newer transformers
    model = get_arch("llama_prepbn").build(sd, TINY_CONFIG, "checkpoint")
    model.load_state_dict(sd, strict=True)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads"):
        get_arch("llama_prepbn").build(sd, {}, "checkpoint")
    with pytest.raises(UnsupportedModelError, match="grouped-query"):
        get_arch("llama_prepbn").build(sd, {**TINY_CONFIG, "num_key_value_heads": 2}, "checkpoint")


# --------------------------------------------------------------------------------------------- official forward


def official_eval_forward(sd: dict[str, torch.Tensor], cfg: LlamaConfig, ids: torch.Tensor) -> torch.Tensor:
    """The official ``LlamaForCausalLM`` eval forward (no attention_mask, no position_ids, no cache), step by step
    as modeling_llama.py computes it: a rotary cache over ``max_position_embeddings`` built from a fresh float32
    ``inv_freq`` and cast to the default dtype, indexed by ``position_ids``; ``_make_causal_mask`` plus the
    expanded all-ones padding mask, then ``torch.max`` with ``finfo.min``; softmax in float32; RepBN with BN over
    ``x.view(-1, C)`` and ``alpha`` times the 3-D ``x``."""
    b, t = ids.shape
    c, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
    d = c // heads
    dtype = sd["lm_head.weight"].dtype
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    steps = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    emb = torch.cat([torch.einsum("i,j->ij", steps, inv_freq)] * 2, dim=-1)
    cos_cached = emb.cos()[None, None].to(torch.get_default_dtype())
    sin_cached = emb.sin()[None, None].to(torch.get_default_dtype())
    position_ids = torch.arange(0, t, dtype=torch.long).unsqueeze(0).view(-1, t)
    causal = torch.full((t, t), torch.finfo(dtype).min)
    cond = torch.arange(t)
    causal.masked_fill_(cond < (cond + 1).view(t, 1), 0)
    causal = causal.to(dtype)[None, None].expand(b, 1, t, t)
    inverted = 1.0 - torch.ones(b, t, dtype=torch.bool)[:, None, None, :].expand(b, 1, t, t).to(dtype)
    attention_mask = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min) + causal

    def repbn(prefix: str, x: torch.Tensor) -> torch.Tensor:
        bn = f"{prefix}.norm2.bn"
        flat = F.batch_norm(
            x.contiguous().view(-1, c),
            sd[f"{bn}.running_mean"],
            sd[f"{bn}.running_var"],
            sd[f"{bn}.weight"],
            sd[f"{bn}.bias"],
            False,
            0.1,
            eps,
        )
        return flat.view(b, t, c) + sd[f"{prefix}.norm2.alpha"] * x

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    h = F.embedding(ids, sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        residual, x = h, repbn(f"{p}.input_layernorm", h)
        q, k, v = (
            F.linear(x, sd[f"{p}.self_attn.{n}_proj.weight"]).view(b, t, heads, d).transpose(1, 2) for n in "qkv"
        )
        cos = cos_cached[:, :, :t, ...].to(dtype=v.dtype).squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        sin = sin_cached[:, :, :t, ...].to(dtype=v.dtype).squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d) + attention_mask
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
        h = residual + F.linear(out, sd[f"{p}.self_attn.o_proj.weight"])
        residual, x = h, repbn(f"{p}.post_attention_layernorm", h)
        gate, up = F.linear(x, sd[f"{p}.mlp.gate_proj.weight"]), F.linear(x, sd[f"{p}.mlp.up_proj.weight"])
        h = residual + F.linear(F.silu(gate) * up, sd[f"{p}.mlp.down_proj.weight"])
    return F.linear(repbn("model.norm", h), sd["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_eval_outputs_equal_the_official_forward(dtype):
    model = tiny_model(dtype=dtype)
    x = tokens()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ours, official = model(x), official_eval_forward(sd, TINY, x)
    assert ours.dtype == official.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(ours, official)
    else:
        assert rel_err(ours, official) <= 1e-3 and torch.equal(ours.argmax(-1), official.argmax(-1))


def official_schedule(warm: int, step: int, calls: int, every: int = 16) -> list[tuple[float, int, int, int]]:
    """The official LinearNorm training counters, call by call: the weight of norm1 in that call, then
    ``num_step``, ``warm`` and ``iter`` after it (``total_step`` = ``step``, ``r0`` = 1)."""
    num_step, it, out = 0, step, []
    for _ in range(calls):
        if warm > 0:
            if num_step % every == 0:
                warm -= 1
            lam = 1.0
        else:
            lam = it / step
            if it > 0 and num_step % every == 0:
                it -= 1
        num_step = (num_step + 1) % every
        out.append((lam, num_step, warm, it))
    return out


def test_training_schedule_follows_the_official_counters():
    expected = official_schedule(warm=2, step=3, calls=120)
    norm = LlamaLinearNorm(8, norm1=RMSNorm, norm2=lambda c: RepBN(c, 1e-6, 0.0, True), warm=2, step=3).train()
    with torch.no_grad():
        norm.norm2.alpha.fill_(0.5)
        norm.norm2.bn.weight.fill_(1.0)
    gen = torch.Generator().manual_seed(0)
    for lam, num_step, warm, it in expected:
        x = torch.randn(2, 5, 8, generator=gen)
        before = copy.deepcopy(norm)
        assert norm.blend_weight() == lam
        y = norm(x)
        torch.testing.assert_close(y, lam * before.norm1(x) + (1 - lam) * before.norm2(x))
        assert (int(norm.num_step), int(norm.warm), int(norm.iter)) == (num_step, warm, it)
    assert int(norm.warm) == 0 and int(norm.iter) == 0
    assert torch.equal(norm.eval()(x), norm.norm2(x))


# --------------------------------------------------------------------------------------------- folding

_FOLDED: dict[str, tuple[nn.Module, torch.fx.GraphModule, list[engine.Decision], torch.Tensor]] = {}


def folded(layout: str = "linearnorm") -> tuple[nn.Module, torch.fx.GraphModule, list[engine.Decision], torch.Tensor]:
    if layout not in _FOLDED:
        model, x = tiny_model(layout), tokens()
        gm = engine.capture(model, x)
        _FOLDED[layout] = (model, gm, engine.fold_all(gm), x)
    return _FOLDED[layout]


def _biased_consumers(layers: int) -> set[str]:
    per_layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    return {f"model.layers.{i}.{n}" for i in range(layers) for n in per_layer} | {"lm_head"}


@pytest.mark.parametrize("layout", ["linearnorm", "repbn"])
def test_every_norm_folds_forward_into_its_bias_free_consumers(layout):
    model, gm, decisions, x = folded(layout)
    expected = []
    for i in range(TINY.num_hidden_layers):
        p = f"model.layers.{i}"
        expected += [
            (f"{p}.input_layernorm", [f"{p}.self_attn.k_proj", f"{p}.self_attn.q_proj", f"{p}.self_attn.v_proj"]),
            (f"{p}.post_attention_layernorm", [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]),
        ]
    expected.append(("model.norm", ["lm_head"]))
    assert [(d.norm, d.into) for d in decisions] == expected
    assert all(d.action == "folded-forward" and d.reason is None for d in decisions)
    assert not [w for d in decisions for w in d.warnings if not w.startswith("int8:")]  # random norms flag int8
    assert not [n for n in gm.graph.nodes if n.target in BN_OPS]
    fused = engine.fused_state_dict(gm)
    assert {k.removesuffix(".bias") for k in fused if k.endswith(".bias")} == _biased_consumers(TINY.num_hidden_layers)
    assert not [k for k in fused if "layernorm" in k or k.startswith("model.norm") or "inv_freq" in k]
    assert rel_err(gm(x), model(x)) <= 1e-5
    assert rel_err(gm(x[:1]), model(x[:1])) <= 1e-5  # the batch axis stays dynamic
    bound = get_arch("llama_prepbn").build(fused, TINY_CONFIG, "identity")
    bound.load_state_dict(fused, strict=True)
    assert rel_err(bound.eval()(x), model(x)) <= 1e-5


def test_fused_onnx_reaches_the_norm_free_bound_plus_one_bias_add_per_created_bias(tmp_path):
    import onnxruntime as ort

    model, gm, _, x = folded()
    free = get_arch("llama_prepbn").build(model.state_dict(), TINY_CONFIG, "identity").eval()
    free.load_state_dict({k: v for k, v in model.state_dict().items() if k in free.state_dict()}, strict=True)
    info = export_onnx(gm, x, tmp_path / "fused.onnx")
    export_onnx(free, x, tmp_path / "free.onnx")
    fused, bound = op_histogram(tmp_path / "fused.onnx"), op_histogram(tmp_path / "free.onnx")
    assert fused["BatchNormalization"] == 0
    assert fused - bound == collections.Counter({"Add": 5 * TINY.num_hidden_layers + 1}) and not bound - fused
    assert info["dynamic_batch"]
    session = ort.InferenceSession(str(tmp_path / "fused.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(int64)"
    for batch in (x, x[:1]):
        (out,) = session.run(None, {"input": batch.numpy()})
        assert out.shape == (len(batch), 16, TINY.vocab_size)
        assert rel_err(torch.from_numpy(out), model(batch)) <= 1e-5


def test_folds_in_half_precision():
    """float16 (the official release dtype): every norm folds, and the fused model is as accurate as the unfused
    one against the float64 model, within the float16 tolerance."""
    exact = tiny_model(dtype=torch.float64)
    model = tiny_model(dtype=torch.float16)
    x = tokens(batch=2)
    reference = model(x)
    gm = engine.capture(model, x)
    assert all(d.action == "folded-forward" for d in engine.fold_all(gm))
    out = gm(x)
    truth = exact(x)
    assert out.dtype == torch.float16
    assert rel_err(out, truth) <= max(1e-3, 1.5 * rel_err(reference, truth))


# --------------------------------------------------------------------------------------------- the text fixture


@pytest.fixture(scope="module")
def text_fixture() -> hf.HFFolder:
    assert hf.is_hf_folder(TEXT_FIXTURE), "the committed text fixture is missing; run `make fixtures`"
    return hf.read_hf_folder(TEXT_FIXTURE)


def _perplexity(logits: np.ndarray, y: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return math.exp(-np.take_along_axis(logp, y[..., None], -1).mean())


def test_text_fixture_fused_onnx_keeps_every_next_token_and_the_perplexity(text_fixture, tmp_path):
    import onnxruntime as ort

    config, sd = text_fixture.config, text_fixture.state_dict
    assert config["model_type"] == "llama" and config["rms_norm_eps"] == 1e-6 and config["torch_dtype"] == "float32"
    facts = config["slabconv_fixture"]
    assert facts["holdout_perplexity"] < facts["unigram_perplexity"] / 2
    assert sum(f.stat().st_size for f in TEXT_FIXTURE.iterdir()) < 4 * 2**20
    spec = detect_arch(sd, config)
    assert spec.name == "llama_prepbn"
    model = spec.build(sd, config, "checkpoint")
    model.load_state_dict(sd, strict=True)
    model.eval()
    assert {int(v) for k, v in sd.items() if k.endswith((".warm", ".iter"))} == {0}  # the schedule finished
    data = np.load(TEXT_FIXTURE / "holdout.npz")
    x, y = data["x"], data["y"]
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape and x.shape[1:] == spec.input_shape(sd, config)
    gm = engine.capture(model, torch.from_numpy(x[:4]))
    assert all(d.action == "folded-forward" for d in engine.fold_all(gm))
    export_onnx(gm, torch.from_numpy(x[:4]), tmp_path / "fused.onnx")
    session = ort.InferenceSession(str(tmp_path / "fused.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        reference = torch.cat([model(torch.from_numpy(x[i : i + 256])) for i in range(0, len(x), 256)]).numpy()
    fused = np.concatenate([session.run(None, {"input": x[i : i + 256]})[0] for i in range(0, len(x), 256)])
    assert rel_err(torch.from_numpy(fused), torch.from_numpy(reference)) <= 1e-5
    assert np.array_equal(fused.argmax(-1), reference.argmax(-1))
    ppl_ref, ppl_fused = _perplexity(reference, y), _perplexity(fused, y)
    assert f"{ppl_fused:.4g}" == f"{ppl_ref:.4g}" == f"{facts['holdout_perplexity']:.4g}"


# --------------------------------------------------------------------------------------------- the folder reader


def _sample_state() -> dict[str, torch.Tensor]:
    sd = tiny_model().half().state_dict()  # float16 weights and int64 counters, as the official release
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize(
    ("weights", "shard", "fmt", "entry"),
    [
        ("safetensors", None, "hf-safetensors", "model.safetensors"),
        ("safetensors", 8192, "hf-safetensors-sharded", "model.safetensors.index.json"),
        ("bin", None, "hf-bin", "pytorch_model.bin"),
        ("bin", 8192, "hf-bin-sharded", "pytorch_model.bin.index.json"),
    ],
)
def test_hf_folder_round_trips(tmp_path, weights, shard, fmt, entry):
    sd = _sample_state()
    config = {**TINY_CONFIG, "torch_dtype": "float16", "auto_map": {"AutoModelForCausalLM": "modeling_llama.X"}}
    written = hfwrite.write_hf_folder(tmp_path, sd, config, weights=weights, max_shard_bytes=shard)
    loaded = hf.read_hf_folder(tmp_path)
    assert loaded.format == fmt and loaded.files == written and (tmp_path / entry).is_file()
    assert loaded.config == config
    assert sorted(loaded.state_dict) == sorted(sd)
    assert all(torch.equal(loaded.state_dict[k], v) and loaded.state_dict[k].dtype == v.dtype for k, v in sd.items())
    if shard is not None:
        assert len(loaded.files) > 3  # config, index, several shards
    assert len(loaded.sha256()) == 64
    if weights == "safetensors":  # verify finds the folder digest an in-memory fold records as its source
        side = sides.Side(tmp_path, Source(str(tmp_path), None, fmt), "model")
        assert loaded.sha256() not in side.digests() and loaded.sha256() in side.digests(whole=True)
    model = detect_arch(loaded.state_dict, loaded.config).build(loaded.state_dict, loaded.config, "checkpoint")
    model.to(torch.float16).load_state_dict(loaded.state_dict, strict=True)


def test_hf_reader_never_runs_the_folder_code(tmp_path):
    hfwrite.write_hf_folder(tmp_path, _sample_state(), {**TINY_CONFIG, "auto_map": {"AutoModel": "modeling_llama.M"}})
    marker = tmp_path / "ran"
    (tmp_path / "modeling_llama.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    hf.read_hf_folder(tmp_path)
    assert not marker.exists()


def test_hf_reader_refuses_damaged_or_unsafe_folders(tmp_path):
    sd = _sample_state()
    with pytest.raises(InputError, match="config.json"):
        hf.read_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match="no weights"):
        hf.read_hf_folder(tmp_path)

    sharded = tmp_path / "sharded"
    hfwrite.write_hf_folder(sharded, sd, TINY_CONFIG, max_shard_bytes=8192)
    index = sharded / hf.SAFETENSORS_INDEX
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    index.write_text(json.dumps({**data, "weight_map": {**data["weight_map"], first: "../outside.safetensors"}}))
    with pytest.raises(InputError, match="not a file name inside the folder"):
        hf.read_hf_folder(sharded)
    index.write_text(
        json.dumps({**data, "weight_map": {**data["weight_map"], "extra.weight": data["weight_map"][first]}})
    )
    with pytest.raises(InputError, match="extra.weight"):
        hf.read_hf_folder(sharded)
    index.write_text(json.dumps(data))
    sorted(sharded.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(InputError, match="missing"):
        hf.read_hf_folder(sharded)

    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    (unsafe / "config.json").write_text("{}")
    torch.save({"a": collections.Counter()}, unsafe / "pytorch_model.bin")  # a global weights_only refuses
    with pytest.raises(InputError, match=r"pytorch_model\.bin"):
        hf.read_hf_folder(unsafe)
    whole = io.BytesIO()
    torch.save({"w": torch.ones(8)}, whole)
    with zipfile.ZipFile(whole) as src, zipfile.ZipFile(unsafe / "pytorch_model.bin", "w") as dst:
        for info in src.infolist():  # a storage record shorter than its tensor: torch.load raises, as for a .pth
            dst.writestr(info, src.read(info)[: 4 if info.filename.endswith("/data/0") else None])
    with pytest.raises(InputError, match=r"pytorch_model\.bin: not a readable PyTorch checkpoint"):
        hf.read_hf_folder(unsafe)
    torch.save([torch.ones(1)], unsafe / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"pytorch_model\.bin: expected a state_dict \(name -> tensor\), found list"):
        hf.read_hf_folder(unsafe)
    assert not hf.is_hf_folder(tmp_path / "nothing-here") and hf.is_hf_folder(TEXT_FIXTURE) == TEXT_FIXTURE.exists()


def test_registry_defaults_keep_vision_inputs():
    spec = get_arch("deit_tiny_prepbn")
    assert spec.input_dtype is None and spec.example_input is None
    assert get_arch("llama_350m_prepbn").input_dtype == torch.int64
    assert Path(get_arch("llama_prepbn").source.split()[1]).name == "modeling_llama.py"
