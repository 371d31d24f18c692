"""Language models with the rope and head settings of today's checkpoints: a llama3-scaled rope (every Llama 3.1 /
3.2), a linear-scaled rope, and a ``head_dim`` other than ``hidden_size / num_attention_heads``. The zoo's forward
must compute the model transformers computes from the same folder (its own ``LlamaForCausalLM`` /
``Qwen2ForCausalLM``), and a fold keeps the settings in every artifact, in memory and streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slabconv.errors import UnsupportedModelError, VerificationError
from slabconv.load.model import load_model
from slabconv.write.hf_llama import load_fused_llama
from slabconv.zoo import llama
from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM, llama_norm_factory
from tests.conftest import randomize_norms
from tests.hfwrite import write_hf_folder

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

# theta 100 and head size 8 give wavelengths 6.3, 20, 63 and 200 positions: with a pretraining context of 32,
# high_freq_factor 4 and low_freq_factor 1, llama3 keeps the first (< 32 / 4), interpolates the second (< 32 / 1)
# and divides the last two by factor.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SETTINGS: dict[str, dict[str, Any]] = {
    "llama3": {"rope_parameters": LLAMA3},  # transformers 5's layout
    "linear": {"rope_scaling": {"type": "linear", "factor": 3.0}, "rope_theta": 100.0},  # transformers 4's
    "head_dim": {"head_dim": 16, "rope_theta": 100.0},  # q_proj (4 x 16, 32), o_proj (32, 4 x 16)
}
SIZES = {
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
SEQ = 40  # positions up to 39: every scaled frequency turns far enough to matter


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """q/k weights N(0, 0.5) (attention that looks at positions: at the default 0.02 every softmax is nearly
    uniform and the rope hardly moves the logits) and norm weights from 0.5 to 1.5."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.copy_(0.5 * torch.randn(weight.shape, generator=gen))
            elif "norm" in name and weight.dim() == 1 and not name.endswith(".bias"):
                weight.copy_(0.5 + torch.rand(weight.shape, generator=gen))


def standard_folder(folder: Path, setting: str, model_type: str = "llama") -> Path:
    """A standard LLaMA / Qwen2 of ``SIZES`` with ``setting``, made and saved by transformers itself."""
    config = SIZES | SETTINGS[setting] | {"model_type": model_type, "tie_word_embeddings": False}
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _sharpen(model, seed=1)
    model.save_pretrained(folder)
    return folder


def prepbn_folder(folder: Path, setting: str) -> Path:
    """A LLaMA-PRepBN of ``SIZES`` with ``setting`` (the zoo's model, random RepBN statistics)."""
    config = SIZES | SETTINGS[setting] | {"model_type": "llama"}
    cfg = LlamaConfig(
        **{k: v for k, v in SIZES.items() if k in LlamaConfig.__dataclass_fields__},
        rope_theta=llama.rope_theta(config),
        rope=llama.rope_scaling(config),
        head_size=config.get("head_dim"),
    )
    torch.manual_seed(0)
    model = randomize_norms(LlamaForCausalLM(cfg, llama_norm_factory("linearnorm", cfg.rms_norm_eps)))
    _sharpen(model, seed=1)
    write_hf_folder(folder, model.state_dict(), config, max_shard_bytes=16384)
    return folder


def ids() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def transformers_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(x).logits


def zoo_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_model(folder).model(x)


def test_the_llama3_frequencies_are_kept_interpolated_and_divided():
    """Meta's Llama 3.1 rule on the three bands, restated: the high frequency kept, the low one divided by factor,
    those between interpolated by the smooth factor; linear divides all."""
    rope = llama.rope_scaling({"rope_parameters": LLAMA3})
    assert rope == llama.RopeScaling("llama3", 4.0, 1.0, 4.0, 32)
    plain = llama.rope_inv_freq(8, 100.0)
    scaled = llama.rope_inv_freq(8, 100.0, rope)
    smooth = (32 / (2 * torch.pi / plain[1]) - 1.0) / (4.0 - 1.0)
    assert scaled[0] == plain[0] and torch.allclose(scaled[2:], plain[2:] / 4)
    assert 0 < smooth < 1 and torch.allclose(scaled[1], (1 - smooth) * plain[1] / 4 + smooth * plain[1])
    linear = llama.rope_scaling({"rope_scaling": {"type": "linear", "factor": 3.0}})
    assert torch.equal(llama.rope_inv_freq(8, 100.0, linear), plain / 3.0)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_zoo_forward_computes_the_model_transformers_computes(tmp_path, setting, model_type):
    """A folder transformers saved (was: refused, 'rope ...' / 'head_dim ... is not hidden_size'): slabconv's model
    of it gives transformers' logits at float32 precision."""
    folder = standard_folder(tmp_path, setting, model_type)
    x = ids()
    assert rel_err(zoo_logits(folder, x), transformers_logits(folder, x)) <= 1e-5


@pytest.mark.parametrize("setting", ["llama3", "linear"])
def test_a_rope_that_ignores_its_factor_is_caught(tmp_path, monkeypatch, setting):
    """The comparison above can fail: a forward that drops the scaling (the plain rope's frequencies) is far from
    transformers' logits."""
    folder = standard_folder(tmp_path, setting)
    x = ids()
    want = transformers_logits(folder, x)
    plain = llama.rope_inv_freq
    monkeypatch.setattr(llama, "rope_inv_freq", lambda d, theta, rope=None: plain(d, theta))
    assert rel_err(zoo_logits(folder, x), want) > 1e-2


def test_another_rope_type_stays_refused(tmp_path):
    folder = standard_folder(tmp_path, "llama3")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope 'yarn': slabconv's LLaMA forward computes the plain"):
        load_model(folder)


def _fuse(src: Path, out: Path, stream: bool, fold_norm_affine: bool) -> Any:
    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions, WriteOptions

    load = LoadOptions(fold_norm_affine=fold_norm_affine)
    write = WriteOptions(pt2=False, stream=stream, onnx=not stream)
    verify = VerifyOptions(samples=2, generate=4)
    report = api.fuse(src, out, load=load, verify=verify, write=write)
    assert report.mode == ("streamed" if stream else "in-memory")
    assert report.verification is not None and report.verification.passed
    assert report.verification.generation is not None and report.verification.generation["passed"]
    return report


def _same_settings(src: Path, out: Path) -> None:
    """The fused folder's config.json gives transformers the original's rope and head size."""
    want, got = (transformers.AutoConfig.from_pretrained(f) for f in (src, out))
    assert got.rope_parameters == want.rope_parameters and got.head_dim == want.head_dim


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_standard_decoder_folds_with_its_setting(tmp_path, setting, stream):
    """``--fold-norm-affine`` of a standard LLaMA with the setting, with the default checks (greedy generation in
    transformers, and in memory decoder.onnx in onnxruntime and onnxruntime-genai)."""
    src = standard_folder(tmp_path / "src", setting)
    report = _fuse(src, tmp_path / "out", stream, fold_norm_affine=True)
    _same_settings(src, tmp_path / "out")
    if not stream:
        runs = report.verification.generation["runs"]
        assert any("onnxruntime-genai" in run["name"] for run in runs) or not _genai(), runs
    x = ids()
    assert rel_err(transformers_logits(tmp_path / "out", x), transformers_logits(src, x)) <= 1e-5


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_a_prepbn_model_folds_with_its_setting(tmp_path, setting, stream):
    """LLaMA-PRepBN with the setting: the fused folder, loaded by transformers (its own LlamaForCausalLM with the
    norms folded away), computes the zoo's original."""
    src = prepbn_folder(tmp_path / "src", setting)
    _fuse(src, tmp_path / "out", stream, fold_norm_affine=False)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_parameters"] == llama.rope_parameters(
        llama.rope_theta(written), llama.rope_scaling(SIZES | SETTINGS[setting])
    )
    x = ids()
    fused = load_fused_llama(tmp_path / "out", torch.float32)  # transformers' LlamaForCausalLM, norms folded away
    with torch.no_grad():
        assert rel_err(fused(x).logits, zoo_logits(src, x)) <= 1e-5


def _genai() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime_genai") is not None


def test_fuse_refuses_a_fold_whose_forward_drops_the_llama3_scaling(tmp_path, monkeypatch):
    """End to end, the default checks catch a zoo rope that is not the folder's: transformers loads the fused folder
    with its llama3 rope, and its greedy generation is not the zoo original's."""
    from slabconv import api
    from slabconv.options import LoadOptions, VerifyOptions, WriteOptions

    src = standard_folder(tmp_path / "src", "llama3")
    plain = llama.rope_inv_freq
    monkeypatch.setattr(llama, "rope_inv_freq", lambda d, theta, rope=None: plain(d, theta))
    load, write = LoadOptions(fold_norm_affine=True), WriteOptions(pt2=False, onnx=False)
    with pytest.raises(VerificationError, match="greedy generation failed for fused float32 .transformers"):
        api.fuse(src, tmp_path / "out", load=load, verify=VerifyOptions(samples=2), write=write)
    assert not (tmp_path / "out").exists()


def test_two_streamed_folders_of_other_ropes_are_named_by_the_config_keys():
    """``verify --stream`` of two folders whose ropes differ says which, in config.json's names (the rope printed as a
    Python object, ``RopeScaling(kind='llama3', ...)``, before)."""
    from slabconv.verify.layerwise import _config_difference

    scaled = LlamaConfig(rope=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    said = _config_difference(scaled, LlamaConfig())
    assert said == (
        "differ in rope (llama3 (factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
        "original_max_position_embeddings 8192) vs None)"
    )
