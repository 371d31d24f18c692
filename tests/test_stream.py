"""Streaming fold of a sharded LLaMA-PRepBN folder: same tensors as the in-memory fold, bounded I/O, verified."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slabconv import api, hf, stream
from slabconv.errors import UnsupportedModelError, UsageError
from slabconv.zoo import get_arch
from tests.test_llama import TINY, TINY_CONFIG, rel_err, tiny_model, tokens

CONFIG = {**TINY_CONFIG, "torch_dtype": "float16"}


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    model = tiny_model().half()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    hf.write_hf_folder(root / "src", sd, CONFIG, max_shard_bytes=8192)
    report = stream.fuse_streaming(root / "src", root / "out")
    memory = api.fuse(root / "src", root / "mem", onnx=False, verify=False)
    return root, model, sd, report, memory


def test_streaming_output_equals_the_in_memory_fold(folded):
    root, _, _, report, memory = folded
    out = hf.read_hf_folder(root / "out")
    mem = load_file(str(root / "mem" / "model.safetensors"))
    assert sorted(out.state_dict) == sorted(mem)
    for k, v in mem.items():
        assert out.state_dict[k].dtype == v.dtype == torch.float16, k
        torch.testing.assert_close(out.state_dict[k].float(), v.float(), rtol=1e-3, atol=1e-3)
    assert [(f["norm"], f["into"], f["action"]) for f in report["folds"]] == [
        (f["norm"], f["into"], f["action"]) for f in memory["folds"]
    ]


def test_layout_index_metadata_and_config(folded):
    root, _, sd, report, _ = folded
    src_shards = sorted(p.name for p in (root / "src").glob("model-*.safetensors"))
    assert sorted(p.name for p in (root / "out").glob("model-*.safetensors")) == src_shards
    index = json.loads((root / "out" / hf.SAFETENSORS_INDEX).read_text())
    out = hf.read_hf_folder(root / "out")  # checks the index lists exactly the shards' keys
    assert set(index["weight_map"]) == set(out.state_dict)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in out.state_dict.values())
    assert not [k for k in out.state_dict if "layernorm" in k or k.startswith("model.norm") or "inv_freq" in k]
    biases = {k.removesuffix(".bias") for k in out.state_dict if k.endswith(".bias")}
    per_layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    assert biases == {f"model.layers.{i}.{n}" for i in range(TINY.num_hidden_layers) for n in per_layer} | {"lm_head"}
    for key in biases:  # a created bias sits in its weight's shard
        assert index["weight_map"][f"{key}.bias"] == index["weight_map"][f"{key}.weight"]
    assert out.config == hf.read_hf_config(root / "src") and out.config["torch_dtype"] == "float16"
    assert out.metadata["complete"] == "true" and out.metadata["arch"] == "llama_prepbn"
    assert out.metadata["source_sha256"] == report["source"]["index_sha256"]
    assert report["outputs"]["sha256"].keys() >= set(src_shards) | {hf.SAFETENSORS_INDEX, hf.CONFIG}
    assert not list(root.glob(".out.tmp-*"))


def test_per_layer_verification_passes(folded):
    _, _, _, report, _ = folded
    v = report["verification"]
    assert v["passed"] and v["max_rel_err"] <= 1e-3
    names = {c["name"] for c in v["checks"]}
    assert "model.norm -> lm_head" in names and "model.layers.1.mlp.up_proj" in " ".join(names)
    assert len(v["checks"]) == 2 * (3 + 2) + 1  # 2 tiny layers (first = middle, last) + final norm


def test_folded_folder_builds_the_norm_free_model_with_the_original_outputs(folded):
    root, model, _, _, _ = folded
    out = hf.read_hf_folder(root / "out")
    bound = get_arch("llama_prepbn").build(out.state_dict, out.config, "identity").half()
    bound.load_state_dict(out.state_dict, strict=True)
    x = tokens()
    with torch.no_grad():
        exact = tiny_model(dtype=torch.float64)(x)
        ref, got = model(x), bound.eval()(x)
    assert rel_err(got, ref) <= 1e-3
    assert rel_err(got, exact) <= max(1e-3, 1.5 * rel_err(ref, exact))


def test_refusals(folded, tmp_path):
    root, _, sd, _, _ = folded
    with pytest.raises(UsageError, match="already exists"):
        stream.fuse_streaming(root / "src", root / "out")
    single = tmp_path / "single"
    hf.write_hf_folder(single, sd, CONFIG)
    with pytest.raises(UsageError, match="sharded safetensors"):
        stream.fuse_streaming(single, tmp_path / "o")
    plain = tmp_path / "plain"
    hf.write_hf_folder(plain, {k: v for k, v in sd.items() if "layernorm" not in k}, CONFIG, max_shard_bytes=8192)
    with pytest.raises(UnsupportedModelError, match="LLaMA-PRepBN"):
        stream.fuse_streaming(plain, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cli_requires_no_onnx(folded, tmp_path):
    from typer.testing import CliRunner

    from slabconv.cli import app

    root = folded[0]
    result = CliRunner().invoke(app, ["fuse", str(root / "src"), "--stream", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--no-onnx" in result.output
    result = CliRunner().invoke(
        app, ["fuse", str(root / "src"), "--stream", "--no-onnx", "--out", str(tmp_path / "o"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verification"]["passed"]


def test_row_blocks_give_the_same_tensors(folded, tmp_path, monkeypatch):
    """Tiny blocks force every fold, copy and check through the row-block path (a real model's big tensors)."""
    root = folded[0]
    monkeypatch.setattr(stream, "_FOLD_BLOCK", 256)
    report = stream.fuse_streaming(root / "src", tmp_path / "blocks")
    assert report["verification"]["passed"]
    whole, blocks = hf.read_hf_folder(root / "out").state_dict, hf.read_hf_folder(tmp_path / "blocks").state_dict
    assert sorted(whole) == sorted(blocks)
    for k, v in whole.items():
        torch.testing.assert_close(blocks[k], v, rtol=1e-3, atol=1e-4)


def test_unfinished_schedule_is_reported(folded, tmp_path):
    _, _, sd, _, _ = folded
    sd = {**sd, "model.layers.1.input_layernorm.warm": torch.tensor(3)}
    hf.write_hf_folder(tmp_path / "src", sd, CONFIG, max_shard_bytes=8192)
    report = stream.fuse_streaming(tmp_path / "src", tmp_path / "out")
    warned = {f["norm"]: f["warnings"] for f in report["folds"] if f["warnings"]}
    assert list(warned) == ["model.layers.1.input_layernorm"] and "warm=3" in warned[list(warned)[0]][0]
