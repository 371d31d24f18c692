"""What a LLaMA config.json says, read as transformers reads it: ``rope_theta`` where transformers 5 writes it
(``rope_parameters``), settings the forward does not compute refused naming the config (not as a config that
does not fit the weights), and the generation check's transformers twin of an original with its own biases
(``attention_bias`` / ``mlp_bias``)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from slabconv.errors import UnsupportedModelError
from slabconv.load.model import load_model
from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM, llama_config, llama_norm_factory
from slabconv.zoo.llama_std import std_config
from tests.conftest import randomize_norms
from tests.hfwrite import write_hf_folder

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

_STD_NORMS = ("input_layernorm", "post_attention_layernorm")

BASE = LlamaConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
)
CONFIG = {"model_type": "llama", "num_attention_heads": 4, "max_position_embeddings": 32, "rms_norm_eps": 1e-6}


@pytest.fixture(scope="module")
def prepbn() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return randomize_norms(LlamaForCausalLM(BASE, llama_norm_factory("linearnorm", BASE.rms_norm_eps))).eval()


def test_rope_theta_is_read_where_transformers_5_writes_it(prepbn):
    """transformers 5 saves ``rope_parameters: {rope_type, rope_theta}`` and no top-level ``rope_theta``: a model
    built with the default 10000 would compute other positions than the written folder (500000)."""
    sd = prepbn.state_dict()
    config = CONFIG | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert llama_config(sd, config).rope_theta == 500000.0
    assert llama_config(sd, CONFIG | {"rope_theta": 20000.0}).rope_theta == 20000.0  # transformers 4, official
    assert std_config(sd, config).rope_theta == 500000.0  # the standard decoders read it the same way


@pytest.mark.parametrize(
    ("setting", "phrase"),
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope 'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}}, "rope 'yarn'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5: slabconv's LLaMA forward rotates the whole head"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"tie_word_embeddings": True}, "no lm_head.weight: tied word embeddings (tie_word_embeddings)"),
    ],
)
def test_a_setting_the_forward_does_not_compute_is_refused_naming_the_config(prepbn, tmp_path, setting, phrase):
    """A scaled rope other than llama3 / linear, another activation, tied embeddings (was: 'could not detect the
    architecture'): refused at load, naming config.json, without asking to fix a config that is right."""
    sd = dict(prepbn.state_dict())
    if setting.get("tie_word_embeddings"):  # transformers saves the one table once
        del sd["lm_head.weight"]
    write_hf_folder(tmp_path, sd, CONFIG | setting)
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path)
    message = str(err.value)
    assert f"{tmp_path / 'config.json'}: {phrase}" in message and "fix config.json" not in message, message


def test_a_head_dim_the_weights_do_not_have_is_a_config_to_fix(prepbn, tmp_path):
    write_hf_folder(tmp_path, prepbn.state_dict(), CONFIG | {"head_dim": 16})
    with pytest.raises(UnsupportedModelError, match=r"q_proj.weight has 32 rows; the config does not fit"):
        load_model(tmp_path)


def test_the_generation_twin_of_an_original_with_its_own_biases_computes_the_original():
    """``attention_bias`` / ``mlp_bias`` LLaMA-PRepBN: the twin the generation check runs as the original's
    baseline keeps the original's biases (q/k/v/o, gate/up/down), and computes the original's logits."""
    pytest.importorskip("transformers")
    from slabconv.verify.generate import original_twin
    from slabconv.write.templates.modeling_slabconv_llama import SlabconvLlamaConfig

    torch.manual_seed(1)
    cfg = replace(BASE, num_key_value_heads=2)
    original = LlamaForCausalLM(cfg, llama_norm_factory("linearnorm", cfg.rms_norm_eps))
    for name, module in original.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.bias = torch.nn.Parameter(0.1 * torch.randn(module.out_features))
    original = randomize_norms(original).eval()
    config = SlabconvLlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=2,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        projection_bias={name: True for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")}
        | {"down_proj": True, "lm_head": True},  # the fused folder's: the fold's biases and the original's
    )
    twin = original_twin(original, config, torch.float64)
    assert twin.lm_head.bias is None and twin.model.layers[0].self_attn.o_proj.bias is not None
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = original.double()(ids), twin(input_ids=ids).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-6  # rotary angles computed in float32 on both


def _float64_path_error(model: LlamaForCausalLM, seed: int, steps: int) -> float:
    """The largest difference between the generation check's float64 pass (``exact_path``, one decoder layer at a
    time) over 2 random 6-token prompts and a random ``steps``-token path, and the whole model in float64."""
    from slabconv.verify.generate import ModuleLayers, exact_path

    gen = torch.Generator().manual_seed(seed)
    prompts, path = torch.randint(0, 61, (2, 6), generator=gen), torch.randint(0, 61, (2, steps), generator=gen)
    run = exact_path(ModuleLayers(model), prompts, path, "reference")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(torch.cat([prompts, path[:, :-1]], dim=1))[:, 5:]
    assert run.logits64 is not None
    return float(abs(torch.from_numpy(run.logits64) - want).max())


def test_the_float64_reference_of_a_model_with_tied_embeddings_runs_its_head_in_float64():
    """The generation check's float64 pass copies the final norm and the head alone into float64; a tied head reads
    the embedding table, which such a copy does not move (was: a dtype error, exit 2 'internal error', in memory and
    streamed). Its logits are the whole model's in float64."""
    from slabconv.zoo.llama_std import norm_factory

    torch.manual_seed(3)
    cfg = replace(BASE, tie_word_embeddings=True, pad_token_id=None)
    model = LlamaForCausalLM(cfg, norm_factory("rmsnorm", cfg.rms_norm_eps)).eval()
    assert "lm_head.weight" not in model.state_dict()
    assert _float64_path_error(model, seed=4, steps=3) == 0.0


@pytest.mark.parametrize(
    ("arch", "phrase"),
    [
        ("mistral", "config.json's model_type is 'llama', not 'mistral'"),
        ("llama_350m_prepbn", "widths and depths are those of llama_prepbn"),
    ],
)
def test_an_arch_of_another_llama_names_the_one_that_fits_without_blaming_the_config(prepbn, tmp_path, arch, phrase):
    """``--arch`` of another registered architecture on a Hugging Face folder: the name that fits, not 'the config
    does not fit the weights: fix config.json' after it (the config is right; the name is not)."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    sd = dict(prepbn.state_dict())
    if arch == "mistral":  # a standard LLaMA folder: plain RMSNorm weights
        sd = {k: v for k, v in sd.items() if "layernorm" not in k and not k.startswith("model.norm")}
        sd |= {f"model.layers.{i}.{n}.weight": torch.ones(32) for i in range(2) for n in _STD_NORMS}
        sd["model.norm.weight"] = torch.ones(32)
        sd = {k: v for k, v in sd.items() if "inv_freq" not in k}
    write_hf_folder(tmp_path, sd, CONFIG)
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "--arch", arch])
    assert result.exit_code == 2, result.output
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: --arch {arch} does not fit these weights: ") and phrase in message, message
    assert "fix config.json" not in message, message


def test_a_prepbn_arch_on_a_mistral_folder_names_arch_values_and_the_model_type_once(prepbn, tmp_path):
    """``fuse MISTRAL_FOLDER --arch llama_prepbn``: the message names ``--arch`` values the user can pass (the one
    given and the one that fits) and the folder's ``model_type`` once, not the zoo's family names."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    sd = {k: v for k, v in prepbn.state_dict().items() if "layernorm" not in k and not k.startswith("model.norm")}
    sd |= {f"model.layers.{i}.{n}.weight": torch.ones(32) for i in range(2) for n in _STD_NORMS}
    sd = {k: v for k, v in sd.items() if "inv_freq" not in k} | {"model.norm.weight": torch.ones(32)}
    write_hf_folder(tmp_path / "mistral", sd, CONFIG | {"model_type": "mistral"})
    result = CliRunner().invoke(
        app, ["fuse", str(tmp_path / "mistral"), "--arch", "llama_prepbn", "-o", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --arch llama_prepbn does not fit these weights: they are mistral weights, not llama_prepbn weights "
        "(config.json's model_type is 'mistral'); pass --arch mistral, or leave --arch out to detect it"
    ), result.stderr
    assert "llama_std" not in result.stderr


def test_the_float64_reference_of_a_sliding_window_model_masks_each_layer_by_its_window():
    """Mistral's ``sliding_window`` (and Qwen2's ``layer_types``): the generation check's float64 pass runs the
    prompts and the generated tokens, longer than the window, one decoder layer at a time. Each layer must see its
    own window (was: the plain causal mask in every layer, so a correct Mistral fold failed 'greedy generation' on
    every prompt whose tokens passed the window, exit 1). Its logits are the whole model's in float64."""
    from slabconv.zoo.llama_std import norm_factory

    torch.manual_seed(5)
    cfg = replace(BASE, sliding_windows=(3, None), pad_token_id=None)  # one windowed layer, one full
    model = randomize_norms(LlamaForCausalLM(cfg, norm_factory("rmsnorm", cfg.rms_norm_eps))).eval()
    assert _float64_path_error(model, seed=6, steps=5) == 0.0


def test_a_qwen2_config_without_layer_types_windows_the_layers_transformers_windows():
    """A Qwen2 ``config.json`` saved before transformers wrote ``layer_types``: with ``use_sliding_window``, only the
    layers from ``max_window_layers`` on attend through the window (transformers' ``Qwen2Config``); the others are
    full causal attention (was: every layer windowed, another model than the one transformers runs)."""
    transformers = pytest.importorskip("transformers")
    from slabconv.zoo.llama_std import _windows

    saved = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2
    ).to_dict()
    want = tuple(8 if t == "sliding_attention" else None for t in saved.pop("layer_types"))
    assert want == (None, None, 8, 8) and _windows(saved, 4) == want
    assert _windows({**saved, "max_window_layers": 4}, 4) is None  # no layer reaches the window


def test_a_folder_whose_config_lacks_the_head_count_is_told_to_add_it(prepbn, tmp_path):
    """A folder whose config.json has no ``num_attention_heads`` (the weights do not show it) is told to add it, in
    memory and streamed (was: 'read the model from its folder with config.json', which it was)."""
    from slabconv import api
    from slabconv.options import WriteOptions

    write_hf_folder(
        tmp_path / "src", prepbn.state_dict(), {k: v for k, v in CONFIG.items() if k != "num_attention_heads"}
    )
    wanted = (
        "config.json has no num_attention_heads, and the LLaMA weights do not show the attention head count: add it"
    )
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path / "src")
    assert wanted in str(err.value) and "read the model from its folder" not in str(err.value), str(err.value)
    with pytest.raises(UnsupportedModelError) as err:
        api.fuse(tmp_path / "src", tmp_path / "out", write=WriteOptions(stream=True, onnx=False))
    assert wanted in str(err.value) and not (tmp_path / "out").exists(), str(err.value)
    with pytest.raises(UnsupportedModelError, match="read the model from its folder with config.json"):
        llama_config(prepbn.state_dict(), {})  # weights alone (no folder): the head count is what is missing


@pytest.mark.parametrize("std", [False, True])
def test_dtype_on_a_language_model_is_refused_before_the_trace(prepbn, tmp_path, monkeypatch, std):
    """``fuse --dtype bfloat16`` of a float32 LLaMA-PRepBN or standard LLaMA folder (written as a Hugging Face folder
    in the checkpoint's dtype) is refused once the model is loaded, before the trace and the plan: it was refused
    after them, a minute of a small model's tracing (much longer for a big one) spent on a command that writes
    nothing."""
    from slabconv import api, pipeline
    from slabconv.errors import UsageError
    from slabconv.options import WriteOptions

    sd = dict(prepbn.state_dict())
    if std:  # a standard LLaMA folder: plain RMSNorm weights
        sd = {k: v for k, v in sd.items() if "layernorm" not in k and not k.startswith("model.norm")}
        sd |= {f"model.layers.{i}.{n}.weight": torch.ones(32) for i in range(2) for n in _STD_NORMS}
        sd = {k: v for k, v in sd.items() if "inv_freq" not in k} | {"model.norm.weight": torch.ones(32)}
    write_hf_folder(tmp_path / "src", sd, CONFIG)
    monkeypatch.setattr(pipeline, "plan", lambda *a, **k: pytest.fail("traced and planned before refusing --dtype"))
    with pytest.raises(UsageError, match="a language model's Hugging Face folder keeps the checkpoint's dtype"):
        api.fuse(tmp_path / "src", tmp_path / "out", write=WriteOptions(dtype="bfloat16", onnx=False, pt2=False))
    assert not (tmp_path / "out").exists()


def test_the_folder_dtype_is_the_weights_one_float_dtype_and_only_a_dtype_the_model_runs(tmp_path):
    """``config.json``'s ``torch_dtype`` names the weights' dtype (norm statistics and ``inv_freq`` aside); a
    float dtype the model does not run (float8) is refused, not written as a name transformers would misread."""
    from slabconv.errors import UsageError
    from slabconv.write.hf_llama import weights_dtype

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        specs = {"w": (dtype, [2, 2]), "rotary.inv_freq": (torch.float32, [1]), "ids": (torch.int64, [2])}
        assert weights_dtype(tmp_path, specs) == str(dtype).removeprefix("torch.")
    with pytest.raises(UsageError, match="float8_e4m3fn is not a float dtype the model can run"):
        weights_dtype(tmp_path, {"w": (torch.float8_e4m3fn, [2, 2])})
    with pytest.raises(UsageError, match="the weights mix dtypes"):
        weights_dtype(tmp_path, {"w": (torch.float16, [2]), "v": (torch.float32, [2])})


def _standard_llama(persistent_rope: bool) -> LlamaForCausalLM:
    """A standard LLaMA of ``BASE``'s sizes (seed 7; its RMSNorm weights drawn from 0.5 to 1.5), with its
    ``rotary_emb.inv_freq`` buffers in the state_dict where ``persistent_rope``."""
    from slabconv.zoo.llama_std import norm_factory

    torch.manual_seed(7)
    model = LlamaForCausalLM(BASE, norm_factory("rmsnorm", BASE.rms_norm_eps), persistent_rope=persistent_rope)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_standard_decoder_whose_config_leaves_out_its_sizes_gets_them_in_the_fused_config(tmp_path, stream):
    """A LLaMA folder whose ``config.json`` gives only the heads (the sizes are read from the weights) folds; the
    fused folder's ``config.json`` gets the weights' sizes, as transformers must read them: without them transformers
    takes its defaults (LLaMA-7B's hidden size 4096 and 32 layers), builds that model (tens of GB) for the generation
    check and fails to load the folder into it. Checked on the written config before anything loads it."""
    import transformers

    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions, WriteOptions

    model = _standard_llama(persistent_rope=False)
    write_hf_folder(tmp_path / "src", model.state_dict(), CONFIG)
    assert "hidden_size" not in CONFIG and "num_hidden_layers" not in CONFIG
    load, write = LoadOptions(fold_norm_affine=True), WriteOptions(onnx=False, pt2=False, stream=stream)
    api.fuse(tmp_path / "src", tmp_path / "out", load=load, verify=None, write=write)
    read = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    sizes = {k: getattr(BASE, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    sizes["num_key_value_heads"] = BASE.num_attention_heads  # k_proj's rows over the head size
    assert {k: getattr(read, k) for k in sizes} == sizes
    verify = VerifyOptions(samples=2, generate=2)  # in memory too the streamed default of 2 sequences
    report = api.verify(tmp_path / "src", tmp_path / "out", verify=verify, stream=stream)
    assert report.verification is not None and report.verification.passed
    assert report.verification.generation is not None and report.verification.generation["passed"]


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_standard_llama_saved_with_its_rotary_buffers_folds_as_transformers_loads_it(tmp_path, stream):
    """transformers before 4.31 saved each layer's ``rotary_emb.inv_freq`` buffer in LLaMA checkpoints; it still
    loads such folders (it recomputes the buffer from ``rope_theta``), as slabconv reads LLaMA-PRepBN's. A standard
    LLaMA with them was refused ('does not fit architecture llama: unexpected keys'); it folds, in memory and
    streamed from shards, and the fused folder is transformers' layout, without them."""
    from safetensors.torch import load_file

    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions, WriteOptions

    model = _standard_llama(persistent_rope=True)
    assert sum(k.endswith("rotary_emb.inv_freq") for k in model.state_dict()) == 2
    write_hf_folder(tmp_path / "src", model.state_dict(), CONFIG, max_shard_bytes=16384)
    load, write = LoadOptions(fold_norm_affine=True), WriteOptions(onnx=False, pt2=False, stream=stream)
    verify = VerifyOptions(samples=2, generate=2)  # 2 sequences, as a streamed fold checks by default
    report = api.fuse(tmp_path / "src", tmp_path / "out", load=load, verify=verify, write=write)
    assert report.mode == ("streamed" if stream else "in-memory")
    assert report.verification is not None and report.verification.passed
    assert report.verification.generation is not None and report.verification.generation["passed"]
    written = {k for shard in (tmp_path / "out").glob("*.safetensors") for k in load_file(str(shard))}
    assert written and not [k for k in written if "inv_freq" in k]
