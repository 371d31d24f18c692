"""A deep decoder's streamed plan from a capture of three layers (``engine.repeat``): the same decisions and fold
program as tracing every layer, the same written tensors as the in-memory fold, and a full-depth trace wherever
one layer's plan cannot stand for another's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from slabconv import api, pipeline
from slabconv.engine import repeat as engine_repeat
from slabconv.errors import UnsupportedModelError
from slabconv.load.lazy import BlockSlots, planning_model, stack_depth
from slabconv.load.shards import LazyShards
from slabconv.options import WriteOptions
from slabconv.zoo.llama import LlamaForCausalLM, llama_norm_factory
from tests import hfwrite
from tests.conftest import randomize_norms
from tests.test_llama import TINY, TINY_CONFIG

DEPTH = 5
CONFIG = {**TINY_CONFIG, "torch_dtype": "float16"}


def deep_model(seed: int = 0) -> LlamaForCausalLM:
    """The tests' tiny LLaMA-PRepBN with five decoder layers, every norm with its own random statistics."""
    cfg = replace(TINY, num_hidden_layers=DEPTH)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, llama_norm_factory("linearnorm", cfg.rms_norm_eps))
    return randomize_norms(model, seed).half().eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("repeat")
    hfwrite.write_hf_folder(root / "src", deep_model().state_dict(), CONFIG, max_shard_bytes=8192)
    return root


def full_depth(shards: LazyShards) -> pipeline.Planned:
    planning = planning_model(shards, dict(CONFIG), None, "")
    return pipeline.plan(planning.loaded, pipeline.no_progress, frozenset(planning.unknown))


def program_rows(planned: pipeline.Planned) -> dict[str, tuple]:
    """Every tensor the program stores, with everything its recipe holds (fold values as bytes)."""
    assert planned.program is not None
    rows = {}
    for key, t in planned.program.tensors.items():
        la = t.layer
        layer = None
        if la is not None:
            folds = tuple(
                (f.weight, f.forward, f.norm, f.kind.name, f.scale.numpy().tobytes(), f.shift.numpy().tobytes())
                for f in la.folds
            )
            layer = (la.weight, la.bias, la.bias_out, la.dtype, la.bias_dtype, la.groups, folds)
        rows[key] = (t.op, t.source, layer)
    return rows


def test_three_layer_plan_equals_the_full_depth_plan(folder):
    shards = LazyShards.open(folder / "src")
    _, repeated = pipeline.plan_sharded(shards, dict(CONFIG), None, "")
    full = full_depth(shards)
    assert repeated.traced_blocks == (3, DEPTH) and full.traced_blocks is None
    assert [d.to_dict() for d in repeated.decisions] == [d.to_dict() for d in full.decisions]
    assert len(repeated.decisions) == 2 * DEPTH + 1
    rows, expected = program_rows(repeated), program_rows(full)
    assert rows.keys() == expected.keys()
    assert rows == expected


def test_streamed_deep_decoder_writes_the_in_memory_tensors_and_verifies(folder):
    report = api.fuse(folder / "src", folder / "out", write=WriteOptions(stream=True, onnx=False))
    assert report.verification is not None and report.verification.passed
    assert "3 of its 5 decoder layers" in report.plan["planning"]
    api.fuse(folder / "src", folder / "mem", verify=None, write=WriteOptions(onnx=False, pt2=False))
    memory = load_file(folder / "mem" / "model.safetensors")
    streamed = {}
    for shard in sorted((folder / "out").glob("model-*.safetensors")):
        streamed.update(load_file(shard))
    assert streamed.keys() == memory.keys()
    assert all(torch.equal(streamed[k], memory[k]) for k in memory)
    assert [f["norm"] for f in report.to_dict()["folds"]] == [
        *(f"model.layers.{i}.{n}" for i in range(DEPTH) for n in ("input_layernorm", "post_attention_layernorm")),
        "model.norm",
    ]


def test_a_middle_layer_planned_differently_traces_every_layer(folder, monkeypatch):
    """When one middle layer's plan differs in structure from the second layer's, the three-layer plan is not
    used: the model is traced at full depth, and the plan is the full-depth one."""
    real = engine_repeat.plan_folds
    calls = []

    def plan_folds(gm, *args, **kwargs):
        plans = real(gm, *args, **kwargs)
        calls.append(len(plans))
        if len(calls) == 3:  # the third middle-layer plan (real layer 3) pretends a different action
            plans[2].decision.action = "folded-backward"
        return plans

    monkeypatch.setattr(engine_repeat, "plan_folds", plan_folds)
    shards = LazyShards.open(folder / "src")
    seen = []
    _, planned = pipeline.plan_sharded(shards, dict(CONFIG), None, "", lambda msg, *a: seen.append(msg))
    assert len(calls) == 3 and "the decoder layers fold differently: tracing every layer" in seen
    assert planned.traced_blocks is None
    monkeypatch.undo()
    assert program_rows(planned) == program_rows(full_depth(shards))


def test_a_fold_that_crosses_layers_is_not_repeated(folder, monkeypatch):
    """A plan that touches another layer's tensor (here: made to claim one) cannot be renamed layer by layer."""
    real = engine_repeat.plan_folds

    def plan_folds(gm, *args, **kwargs):
        plans = real(gm, *args, **kwargs)
        plans[2].decision.into.append("model.layers.0.mlp.down_proj")
        return plans

    monkeypatch.setattr(engine_repeat, "plan_folds", plan_folds)
    repeat = engine_repeat.Repeat("model.layers.{i}.", DEPTH, lambda i: {})
    planning = planning_model(
        BlockSlots(LazyShards.open(folder / "src"), repeat.prefix, (0, 1, 4)), {**CONFIG}, None, ""
    )
    from slabconv import engine

    gm = engine.capture(planning.loaded.model, planning.loaded.trace_example())
    assert engine_repeat.fold_repeated(gm, repeat, unknown=planning.unknown) is None


def test_stack_depth_and_block_slots(folder):
    shards = LazyShards.open(folder / "src")
    specs = shards.specs()
    assert stack_depth(specs, "model.layers.{i}.") == DEPTH
    assert stack_depth(specs, "model.blocks.{i}.") is None
    uneven = dict(specs)
    uneven["model.layers.3.extra.weight"] = (torch.float16, [4])
    assert stack_depth(uneven, "model.layers.{i}.") is None
    gap = {k: v for k, v in specs.items() if not k.startswith("model.layers.2.")}
    assert stack_depth(gap, "model.layers.{i}.") is None
    view = BlockSlots(shards, "model.layers.{i}.", (0, 3, 4))
    keys = view.specs()
    assert "model.layers.2.mlp.up_proj.weight" in keys and "model.layers.3.mlp.up_proj.weight" not in keys
    assert view.real("model.layers.1.input_layernorm.norm2.alpha") == "model.layers.3.input_layernorm.norm2.alpha"
    got = view.get_many(["model.layers.1.input_layernorm.norm2.alpha", "lm_head.weight"])
    assert torch.equal(
        got["model.layers.1.input_layernorm.norm2.alpha"], shards.get("model.layers.3.input_layernorm.norm2.alpha")
    )
    assert torch.equal(got["lm_head.weight"], shards.get("lm_head.weight"))


def test_a_preset_named_with_arch_is_planned_from_three_layers_and_checked_on_the_whole_depth(folder, monkeypatch):
    """``--arch`` naming a fixed-size preset (``llama_350m_prepbn``, the documented command for that layout) is
    checked against the whole folder, not the three layers planned: the check refused the three-layer model (3
    layers are not the preset's depth) and every layer was traced instead (10 s of 16 for the 350M folder). A
    name that does not fit the folder is still refused."""
    from slabconv.zoo import llama, registry

    shards = LazyShards.open(folder / "src")
    whole = {k: torch.zeros((), dtype=d).expand(shape) for k, (d, shape) in shards.specs().items()}
    sized = registry.get_arch("llama_350m_prepbn")
    here = llama.signature(whole)  # the preset's widths and depths made this folder's
    monkeypatch.setitem(
        registry._REGISTRY, sized.name, replace(sized, matches=lambda sd, cfg: llama.signature(sd) == here)
    )
    with registry.checking_names():
        _, planned = pipeline.plan_sharded(shards, dict(CONFIG), "llama_350m_prepbn", "")
        assert planned.traced_blocks == (3, DEPTH)
        with pytest.raises(UnsupportedModelError, match="(?i)deit"):
            pipeline.plan_sharded(shards, dict(CONFIG), "deit_prepbn", "")
