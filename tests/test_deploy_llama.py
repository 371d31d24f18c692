"""Fused LLaMA-PRepBN models people can deploy as they are: the Hugging Face folder (transformers, remote code,
KV cache), the decoder ONNX with past key/values (onnxruntime), greedy generation checked end to end against the
original zoo model, and docs/deploy.md run as written."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from markdown_it import MarkdownIt
from safetensors.torch import load_file, save_file
from torch import nn

from slabconv import api
from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.load.model import load_model
from slabconv.options import VerifyOptions, WriteOptions
from slabconv.verify.generate import (
    ENDED,
    GreedyRun,
    check_fused_folder,
    check_generation,
    compare_greedy,
    genai_available,
    greedy_fused,
    greedy_original,
)
from slabconv.verify.policy import fused_bound
from slabconv.write.decoder_onnx import export_decoder_onnx, special_tokens, write_genai_config
from slabconv.write.hf_llama import MODELING_FILE, load_fused_llama, write_hf_llama_metadata
from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM, llama_norm_factory
from tests import onnxcases
from tests.conftest import ROOT, randomize_norms
from tests.hfwrite import write_hf_folder

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

TEXT = ROOT / "fixtures" / "text-prepbn"
DOC = ROOT / "docs" / "deploy.md"
STEPS = 32


def _llama_blocks() -> list[str]:
    """The python code blocks of the LLaMA section of docs/deploy.md, in order."""
    tokens = MarkdownIt().parse(DOC.read_text())
    blocks, inside = [], False
    for previous, token in itertools.pairwise(tokens):
        if previous.type == "heading_open" and previous.tag == "h2":
            inside = token.content.startswith("LLaMA")
        if inside and token.type == "fence" and token.info.strip() == "python":
            blocks.append(token.content)
    return blocks


def _holdout_prompts(n: int = 6, length: int = 24) -> np.ndarray:
    """``n`` holdout rows 40 apart (neighbouring rows overlap), their first ``length`` bytes."""
    return np.load(TEXT / "holdout.npz")["x"][::40][:n, :length]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def _logit_errors(original: nn.Module, folder: Path, ids: torch.Tensor) -> tuple[float, float]:
    """Relative errors against the original in float64 of the fused folder (transformers, its dtype) and of the
    original in its own dtype, on the same ids: the policy's e_fused and e_orig."""
    import copy

    with torch.no_grad():
        exact = copy.deepcopy(original).double()(ids)
        fused = load_fused_llama(folder)(input_ids=ids).logits
        return _rel_err(fused, exact), _rel_err(original(ids), exact)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The machine is shared: torch's OpenMP threads slow down many times over when the cores are busy, so
    these tests run torch on one thread (restored after the module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """docs/deploy.md's LLaMA blocks run in order in one namespace, in a scratch folder that sees the fixtures:
    the fused text folder, its decoder ONNX, the transformers and onnxruntime generations and the check."""
    work = tmp_path_factory.mktemp("doc")
    (work / "fixtures").symlink_to(ROOT / "fixtures")
    namespace: dict = {"__name__": "deploy_doc"}
    cwd = Path.cwd()
    os.chdir(work)
    try:
        for block in _llama_blocks():
            if "import onnxruntime_genai" in block and not genai_available():  # absent at the declared floors
                continue
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        os.chdir(cwd)
    namespace["out"] = work / namespace["out"]
    return namespace


@pytest.fixture(scope="module")
def original() -> nn.Module:
    return load_model(TEXT).model.eval()


def test_the_doc_has_the_five_llama_blocks():
    blocks = _llama_blocks()
    assert len(blocks) == 5
    assert "from_pretrained(out, trust_remote_code=True)" in blocks[1] and "InferenceSession" in blocks[2]
    assert "og.Generator(genai_model, params)" in blocks[3]


def test_doc_transformers_and_onnx_generate_each_prompts_original_tokens(doc, original):
    """Left-padded batch: every prompt's 32 greedy tokens equal the original's on that prompt alone."""
    rows = [list(text.encode()) for text in doc["texts"]]
    assert len({len(r) for r in rows}) > 1  # the batch really is left-padded
    for i, row in enumerate(rows):
        expected = greedy_original(original, np.array([row]), STEPS, keep_logits=False).tokens[0]
        np.testing.assert_array_equal(doc["new_tokens"][i].numpy(), expected)
        np.testing.assert_array_equal(doc["onnx_tokens"][i], expected)
        if genai_available():  # onnxruntime-genai, as its documentation runs it
            assert doc["genai_tokens"][i] == expected.tolist()


def test_doc_check_passes_and_reports_speeds(doc):
    check = doc["check"]
    n = len(doc["prompts"])
    assert check.passed and check.steps == STEPS and check.sequences == n == 19 and check.dtype == "float32"
    assert [r.decides for r in check.runs] == [True, True, False]
    for run in check.runs:
        assert run.tokens_compared == n * STEPS and run.decisive_mismatches == 0 and run.first_divergence == [None] * n
    assert all(v > 0 for v in check.tokens_per_second.values()) and len(check.tokens_per_second) == 4
    print("\ntext fixture float32 tokens/s:", json.dumps(check.tokens_per_second, indent=1))


def test_the_docs_fuse_reads_the_folder_and_folds_every_norm(doc):
    report = json.loads(doc["report"].to_json())  # what `slabconv fuse --json` prints
    assert report["source"]["arch"] == "llama_prepbn" and report["source"]["format"].startswith("hf-")
    assert [f["action"] for f in report["folds"]] == ["folded-forward"] * 7
    assert report["folds"][0]["into"] == [
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert report["folds"][-1]["into"] == ["lm_head"]


def test_verification_used_the_token_holdout_and_every_position(doc):
    report = json.loads(doc["report"].to_json())  # what `slabconv fuse --json` prints
    holdout = np.load(TEXT / "holdout.npz")
    v = report["verification"]
    assert v["passed"] and v["inputs"].endswith("holdout.npz")
    assert v["samples"] == len(holdout["x"])
    assert v["top1_agreement"] == 1.0 and v["max_rel_err"] <= 1e-5


def test_task_metrics_for_the_original_and_every_runtime_that_generates(doc):
    """Issue 40, item 4, on docs/deploy.md's fuse (every default check): teacher-forced perplexity and next-token
    KL of the original (float64 reference, its own dtype) and of the fused model in transformers, in onnxruntime
    (decoder.onnx) and in onnxruntime-genai."""
    from slabconv.verify.task_metrics import TASK_SEQUENCES

    report = json.loads(doc["report"].to_json())  # what `slabconv fuse --json` prints
    t = report["verification"]["task_metrics"]
    assert t["passed"] and t["sequences"] == TASK_SEQUENCES and t["positions"] == TASK_SEQUENCES * 63
    names = [r["name"] for r in t["runs"]]
    assert names[0].startswith("original float32") and not t["runs"][0]["decides"]
    assert any("transformers" in n for n in names) and any("decoder.onnx" in n for n in names)
    from slabconv.verify.generate import genai_available

    if genai_available():
        assert any("onnxruntime-genai" in n for n in names)
    else:
        assert any("onnxruntime-genai is not installed" in n for n in t["notes"])
    ppl = t["reference"]["perplexity"]
    assert 3 < ppl < 8  # the fixture's held-out text (the unigram perplexity is 25.7)
    for run in t["runs"]:
        assert abs(run["perplexity"] / ppl - 1) < 1e-4 and 0 <= run["kl_mean"] <= run["kl_max"] < 1e-6


def test_verify_the_folder_against_its_fused_onnx(doc):
    """``verify FOLDER model.onnx`` on the first 64 holdout sequences (4096 positions): the door under test is the
    folder against an ONNX file; fuse's own verification above already held this model.onnx to every holdout
    position (test_verification_used_the_token_holdout_and_every_position), and the whole holdout would only
    repeat that float64 reference."""
    out = doc["out"]
    from typer.testing import CliRunner

    from slabconv.cli import app

    result = CliRunner().invoke(app, ["verify", str(TEXT), str(out / "model.onnx"), "--samples", "64", "--json"])
    assert result.exit_code == 0, result.output
    v = json.loads(result.stdout)["verification"]
    assert v["top1_agreement"] == 1.0 and v["samples"] == 64 and "holdout.npz (its first 64 of" in v["inputs"]


def test_folder_logits_equal_the_originals_within_the_policy(doc, original):
    """Tokens hide small errors; the logits on the holdout (fused folder in transformers vs the original, both
    against the original in float64) show them."""
    e_fused, e_orig = _logit_errors(original, doc["out"], torch.from_numpy(np.load(TEXT / "holdout.npz")["x"][:16]))
    assert e_fused <= fused_bound(torch.float32, e_orig)[0], (e_fused, e_orig)


def test_folder_files_and_config(doc):
    out = doc["out"]
    assert {p.name for p in out.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        MODELING_FILE,
        "decoder.onnx",
    }
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "slabconv_llama" and config["architectures"] == ["SlabconvLlamaForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_slabconv_llama.SlabconvLlamaForCausalLM"
    assert config["projection_bias"] == {
        "q_proj": True,
        "k_proj": True,
        "v_proj": True,
        "o_proj": False,
        "gate_proj": True,
        "up_proj": True,
        "down_proj": False,
        "lm_head": True,
    }
    assert config["torch_dtype"] == "float32" and config["num_key_value_heads"] == 3 and config["head_dim"] == 32
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    modeling = (out / MODELING_FILE).read_text()
    imports = {line.split()[1] for line in modeling.splitlines() if line.startswith(("import ", "from "))}
    assert {name.split(".")[0] for name in imports} == {"torch", "transformers"}
    # transformers' own LLaMA, not a copy of its internals: the classes derive from the public LLaMA classes.
    assert "class SlabconvLlamaForCausalLM(LlamaForCausalLM)" in modeling
    assert "class SlabconvLlamaConfig(LlamaConfig)" in modeling


# --------------------------------------------------------------------------------------------- without slabconv

_ISOLATED = r"""
import importlib.util, json, sys, time
args = json.loads(sys.argv[1])
sys.path[:] = [p for p in sys.path if "site-packages" not in p] + args["site"]
assert importlib.util.find_spec("slabconv") is None, "slabconv is importable"
import numpy as np, torch
from transformers import AutoModelForCausalLM
prompts = torch.from_numpy(np.load(args["prompts"]))
result = {}
for folder in args["folders"]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert "slabconv" not in sys.modules and not any(m.startswith("slabconv") for m in sys.modules)
    start = time.perf_counter()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args["steps"],
                         do_sample=False)
    seconds = time.perf_counter() - start
    result[folder] = {"tokens": out[:, prompts.shape[1]:].tolist(), "seconds": seconds,
                      "class": type(model).__module__ + "." + type(model).__name__, "dtype": str(model.dtype)}
print(json.dumps(result))
"""


def _run_isolated(script: str, args: dict, tmp_path: Path) -> dict:
    """Run ``script`` in a fresh interpreter without site processing (no editable-install hook, so slabconv cannot
    be imported), one torch thread, transformers offline; its last stdout line as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env |= {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["OMP_NUM_THREADS"] = "1"  # as one_torch_thread
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script, json.dumps(args)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sharded_copy(fused: Path, dest: Path, config: dict) -> Path:
    """The fused weights as shards, made a fused folder again, recording the fused file's provenance as it does."""
    from safetensors import safe_open

    write_hf_folder(dest, load_file(str(fused / "model.safetensors")), config, max_shard_bytes=200_000)
    assert (dest / "model.safetensors.index.json").is_file() and len(list(dest.glob("model-*.safetensors"))) > 2
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        provenance = f.metadata()
    write_hf_llama_metadata(dest, config, provenance=provenance)
    return dest


def test_folders_load_and_generate_where_slabconv_cannot_be_imported(doc, original, tmp_path):
    """A fresh interpreter without site processing (so no editable-install hook) sees only the site-packages of
    torch and transformers; it loads the single-file and the sharded folder with AutoModelForCausalLM and
    trust_remote_code, and generates the original's tokens."""
    import transformers

    source_config = json.loads((TEXT / "config.json").read_text())
    single = doc["out"]
    sharded = _sharded_copy(single, tmp_path / "sharded", source_config)
    assert json.loads((sharded / "config.json").read_text()) == json.loads((single / "config.json").read_text())
    prompts = _holdout_prompts()
    np.save(tmp_path / "prompts.npy", prompts)
    site = sorted({str(Path(m.__file__).parents[1]) for m in (torch, transformers, np)})
    args = {
        "site": site,
        "prompts": str(tmp_path / "prompts.npy"),
        "folders": [str(single), str(sharded)],
        "steps": STEPS,
    }
    result = _run_isolated(_ISOLATED, args, tmp_path)
    reference = greedy_original(original, prompts, STEPS, keep_logits=False)
    for folder in (single, sharded):
        got = result[str(folder)]
        assert got["class"].startswith("transformers_modules.") and got["class"].endswith(".SlabconvLlamaForCausalLM")
        np.testing.assert_array_equal(np.array(got["tokens"]), reference.tokens)
    print(
        f"\noriginal (no cache) {reference.tokens_per_second:.0f} tokens/s; fused folder in a clean interpreter "
        f"{prompts.shape[0] * STEPS / result[str(single)]['seconds']:.0f} tokens/s (first generate, no warm-up)"
    )


@pytest.fixture(scope="module")
def streamed_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """The text fixture as a sharded folder, and its streamed fold (every check on): ``(source, out, report)``."""
    tmp = tmp_path_factory.mktemp("streamed")
    config = json.loads((TEXT / "config.json").read_text())
    source = tmp / "sharded"
    write_hf_folder(source, load_file(str(TEXT / "model.safetensors")), config, max_shard_bytes=200_000)
    out = tmp / "streamed"
    return source, out, api.fuse(source, out, write=WriteOptions(stream=True, onnx=False))


@pytest.fixture(scope="module")
def streamed_verified(streamed_text, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """``slabconv verify SOURCE STREAMED --stream --generate 8`` of the intact streamed fold, with JUnit:
    ``(result, junit path)``; the streamed-fold test reads its verdict, the dropped-bias test its passing side."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    source, out, _ = streamed_text
    junit = tmp_path_factory.mktemp("streamed-verified") / "0.xml"
    args = ["verify", str(source), str(out), "--stream", "--generate", "8", "--junit", str(junit)]
    return CliRunner().invoke(app, args), junit


def test_a_streamed_fold_of_a_sharded_folder_loads_in_transformers_and_generates(
    original, streamed_text, streamed_verified, tmp_path
):
    """``fuse --stream`` writes shards, an index and the Hugging Face files: AutoModelForCausalLM loads that folder
    (trust_remote_code) and it generates the original's tokens; ``verify --stream --generate 8`` of it passes,
    generating 8 tokens (``streamed_verified``)."""
    from transformers import AutoModelForCausalLM

    source, out, report = streamed_text
    out = tmp_path / "streamed"
    shutil.copytree(streamed_text[1], out)  # decoder.onnx is written into it below
    assert report.verification is not None and report.verification.passed
    # The streamed fold checks greedy generation as the in-memory fold does: the same report field.
    generation = report.verification.generation
    assert generation is not None and generation["passed"] and generation["steps"] == 32
    assert [r["name"].split(" (")[1].split()[0] for r in generation["runs"] if r["decides"]] == ["transformers"]
    streamed, junit = streamed_verified
    assert streamed.exit_code == 0, streamed.output
    assert "generation: 8 greedy tokens x 2 prompts" in streamed.output, streamed.output
    assert re.findall(r'<testcase [^>]*name="generation: [^"]*"', junit.read_text()), junit.read_text()
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    assert (out / MODELING_FILE).is_file() and (out / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "SlabconvLlamaForCausalLM"
    check = check_generation(original, out, _holdout_prompts(), STEPS, threads=1)
    assert check.passed, check.to_dict()
    # The streamed folder's decoder ONNX (written afterwards, as docs/deploy.md says; its weights as external data,
    # as a model past ONNX's 2 GiB has them) generates the same tokens in onnxruntime and, through its
    # genai_config.json, in onnxruntime-genai.
    info = export_decoder_onnx(out, out / "decoder.onnx", external_data=True)
    assert info["external_data"] == "decoder.onnx.data" and (out / "decoder.onnx.data").stat().st_size > 0
    proto = onnx.load(str(out / "decoder.onnx"), load_external_data=False)
    assert not any(t.raw_data for t in proto.graph.initializer if t.dims and math.prod(t.dims) > 64)
    write_genai_config(out, info, json.loads((out / "config.json").read_text()))
    both = check_fused_folder(original, out, np.load(TEXT / "holdout.npz")["x"][::40][:6, :48], STEPS)
    names = [r["name"] for r in both["runs"] if r["decides"]]
    genai = genai_available()  # onnxruntime-genai needs onnxruntime 1.31 or later: absent at the floor
    assert both["passed"] and len(names) == 2 + genai and any("onnxruntime-genai" in n for n in names) == genai, both


def test_a_dropped_bias_fails_the_streamed_generation_check_naming_prompt_step_and_tokens(
    streamed_text, streamed_verified, tmp_path
):
    """A streamed fold's folder with one folded bias dropped (zeroed: the gate projection's of the last decoder
    layer): ``verify --stream --generate`` runs the folder in transformers one block of weights at a time and exits
    1, its error line naming the prompt, the first differing step and the two tokens; the intact folder passes
    (``streamed_verified``: the same command on it)."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    source, out, _ = streamed_text
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    key = "model.layers.2.mlp.gate_proj.bias"
    shard = broken / json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(shard))
    assert tensors[key].abs().max() > 0
    tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, str(shard))
    failed_junit = tmp_path / "1.xml"
    failed = CliRunner().invoke(
        app, ["verify", str(source), str(broken), "--stream", "--generate", "8", "--junit", str(failed_junit)]
    )
    for (result, junit), code in ((streamed_verified, 0), ((failed, failed_junit), 1)):
        assert result.exit_code == code, result.output
        assert "generation: 8 greedy tokens x 2 prompts, computed in float32, near-ties within 1e-05" in result.output
        generation_cases = re.findall(
            r'<testcase [^>]*name="generation: ([^"]*)"[^>]*>(.*?)</testcase>', junit.read_text(), re.S
        )
        assert len(generation_cases) == 1 and ("<failure" in generation_cases[0][1]) == (code == 1), generation_cases
    named = r"greedy generation failed for fused float32 \(transformers [^)]*streamed\): prompt \d+ \(ids [\d, .]+\) "
    assert re.search(named + r"differs at step \d+: expected token \d+, got \d+", result.output), result.output


# --------------------------------------------------------------------------------------------- float16, GQA


def test_a_float16_copy_generates_the_originals_tokens(tmp_path):
    config = json.loads((TEXT / "config.json").read_text()) | {"torch_dtype": "float16"}
    state = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(TEXT / "model.safetensors")).items()}
    source = tmp_path / "src16"
    write_hf_folder(source, state, config)
    out = tmp_path / "fused16"
    api.fuse(source, out, verify=None, write=WriteOptions(onnx=False, pt2=False))
    write_hf_llama_metadata(out, config)
    info = export_decoder_onnx(out)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_info()  # a caller's own settings: loading quiets transformers, then gives them back
    try:
        assert info["dtype"] == "float16" and load_fused_llama(out).dtype == torch.float16
        assert hf_logging.get_verbosity() == hf_logging.INFO and hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity_warning()
    original = load_model(source).model.eval()
    assert next(original.parameters()).dtype == torch.float16
    e_fused, e_orig = _logit_errors(original, out, torch.from_numpy(np.load(TEXT / "holdout.npz")["x"][:16]))
    assert e_fused <= fused_bound(torch.float16, e_orig)[0], (e_fused, e_orig)
    check = check_generation(original, out, _holdout_prompts(), STEPS, onnx_path=info["path"], threads=1)
    assert check.dtype == "float16" and check.passed, check.to_dict()
    print("\ntext fixture float16:", json.dumps(check.to_dict()["tokens_per_second"], indent=1))
    print(f"near-ties met: {[r.near_ties for r in check.runs]}; logits e_fused {e_fused:.2e} e_orig {e_orig:.2e}")


GQA = LlamaConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=None,
)


def gqa_original(seed: int = 0) -> LlamaForCausalLM:
    """The zoo's LLaMA with grouped-query attention (2 key/value heads for 4 query heads), random norm affines and
    alphas, and BatchNorm statistics measured on its own activations, as training leaves them.

    Random statistics far from the activations made this float32 model ill-conditioned (its own error against
    float64 up to 1e-3, the fused files' up to 5 times that on some seeds of the verification inputs): question 2
    then depended on which inputs were drawn."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(GQA, llama_norm_factory("linearnorm", GQA.rms_norm_eps))
    for module in model.modules():  # weights large enough that attention decides the tokens (not 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3)
    model = randomize_norms(model, seed).eval()

    def measured(bn: nn.Module, inputs: tuple[torch.Tensor]) -> None:  # (B, C, T): statistics per channel
        x = inputs[0].double().transpose(0, 1).reshape(bn.num_features, -1)
        bn.running_mean.copy_(x.mean(1))
        bn.running_var.copy_(x.var(1))

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    hooks = [bn.register_forward_pre_hook(measured) for bn in norms]
    with torch.no_grad():
        model(torch.randint(0, GQA.vocab_size, (16, 32), generator=torch.Generator().manual_seed(seed)))
    for hook in hooks:
        hook.remove()
    return model


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path, Any]:
    """A grouped-query Hugging Face folder of ``gqa_original`` fused in opset 19 (every check on, no model.pt2):
    ``(original, fused folder, report)``; the GQA test and the opset test read it."""
    original = gqa_original()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": GQA.hidden_size,
        "intermediate_size": GQA.intermediate_size,
        "num_hidden_layers": GQA.num_hidden_layers,
        "num_attention_heads": GQA.num_attention_heads,
        "num_key_value_heads": GQA.num_key_value_heads,
        "rms_norm_eps": GQA.rms_norm_eps,
        "rope_theta": GQA.rope_theta,
        "max_position_embeddings": GQA.max_position_embeddings,
        "vocab_size": GQA.vocab_size,
        "torch_dtype": "float32",
    }
    tmp = tmp_path_factory.mktemp("gqa")
    source, out = tmp / "src", tmp / "gqa"
    write_hf_folder(source, original.state_dict(), config)
    return original, out, api.fuse(source, out, write=WriteOptions(pt2=False, opset=19))


def test_a_gqa_folder_fuses_and_generates_the_originals_tokens(gqa):
    """A grouped-query Hugging Face folder through the whole pipeline: every norm folds, the written folder keeps
    2 key/value heads, and it (and the decoder ONNX fuse wrote) generate the original's tokens. (A decoder ONNX
    with external data: test_a_streamed_fold_of_a_sharded_folder_loads_in_transformers_and_generates.)"""
    original, out, report = gqa
    prompts = torch.randint(0, GQA.vocab_size, (3, 8), generator=torch.Generator().manual_seed(1))
    assert report.verification is not None and report.verification.passed
    assert report.folds is not None and [d.action for d in report.folds] == ["folded-forward"] * 5
    written = json.loads((out / "config.json").read_text())
    assert written["num_key_value_heads"] == 2 and written["head_dim"] == 8 and written["num_hidden_layers"] == 2
    assert (written["hidden_size"], written["intermediate_size"], written["vocab_size"]) == (32, 48, 61)
    model = load_fused_llama(out)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    e_fused, e_orig = _logit_errors(original, out, prompts)
    assert e_fused <= fused_bound(torch.float32, e_orig)[0], (e_fused, e_orig)
    check = check_generation(original, out, prompts, STEPS, onnx_path=out / "decoder.onnx", threads=1)
    assert check.passed, check.to_dict()
    print(f"\nGQA near-ties met: {[r.near_ties for r in check.runs]}; logits e_fused {e_fused:.2e} e_orig {e_orig:.2e}")


# --------------------------------------------------------------------------------------------- the decoder ONNX


def test_decoder_onnx_layout_dynamic_axes_and_checker(doc):
    path = doc["out"] / "decoder.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset >= 17

    def dims(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    inputs, outputs = dims(model.graph.input), dims(model.graph.output)
    layers = [f"{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{n}" for n in layers)]
    assert list(outputs) == ["logits", *(f"present.{n}" for n in layers)]
    batch, seq = inputs["input_ids"]
    past = inputs["past_key_values.0.key"]
    assert isinstance(batch, str) and isinstance(seq, str) and past[0] == batch and past[1:] == [3, past[2], 32]
    assert isinstance(past[2], str) and past[2] not in (batch, seq)
    assert outputs["logits"] == [batch, seq, 256]
    present = outputs["present.0.key"]
    assert present[:2] == [batch, 3] and present[3] == 32 and isinstance(present[2], str)


def test_decoder_onnx_with_a_past_equals_transformers_on_the_whole_sequence(doc):
    """Prefill 10 tokens, then feed 6 more with the presents as past: the logits of the 6 equal the folder's
    logits on all 16 tokens at every real position (batch 2, a prompt left-padded by 3)."""
    import onnxruntime as ort

    model = load_fused_llama(doc["out"])
    ids = torch.from_numpy(_holdout_prompts(2, 16))  # 16 tokens: 10 + 6
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.numpy()
    session = ort.InferenceSession(str(doc["out"] / "decoder.onnx"))
    names = [o.name for o in session.get_outputs()]
    positions = np.clip(mask.numpy().cumsum(1) - 1, 0, None)
    past = {
        f"past_key_values.{i}.{kv}": np.zeros((2, 3, 0, 32), np.float32) for i in range(3) for kv in ("key", "value")
    }
    first = dict(
        zip(
            names,
            session.run(
                names,
                {
                    "input_ids": ids[:, :10].numpy(),
                    "attention_mask": mask[:, :10].numpy(),
                    "position_ids": positions[:, :10],
                }
                | past,
            ),
            strict=True,
        )
    )
    assert first["present.0.key"].shape == (2, 3, 10, 32)
    past = {k: first[k.replace("past_key_values.", "present.")] for k in past}
    second = dict(
        zip(
            names,
            session.run(
                names,
                {"input_ids": ids[:, 10:].numpy(), "attention_mask": mask.numpy(), "position_ids": positions[:, 10:]}
                | past,
            ),
            strict=True,
        )
    )
    assert second["present.2.value"].shape == (2, 3, 16, 32)
    real = mask.numpy().astype(bool)  # padding positions attend to nothing real: their logits mean nothing
    scale = np.abs(full[real]).max()
    assert np.abs(first["logits"] - full[:, :10])[real[:, :10]].max() / scale < 1e-5
    assert np.abs(second["logits"] - full[:, 10:]).max() / scale < 1e-5


# --------------------------------------------------------------------------------------------- it can fail


def test_the_folders_generation_settings_do_not_change_the_compared_run(doc, tmp_path):
    """generate() takes unset settings from the folder's generation_config.json; an eos_token_id or a repetition
    penalty there must not stop or steer the fused greedy run (the original runs plain argmax for N steps)."""
    prompts = _holdout_prompts()
    plain = greedy_fused(doc["out"], prompts, STEPS)
    folder = tmp_path / "eos"
    shutil.copytree(doc["out"], folder)
    eos = int(plain.tokens[0, 2])  # a token the run produces
    config = json.loads((folder / "generation_config.json").read_text())
    config |= {"eos_token_id": eos, "pad_token_id": 0, "repetition_penalty": 5.0}
    (folder / "generation_config.json").write_text(json.dumps(config))
    model = load_fused_llama(folder)
    assert model.generation_config.eos_token_id == eos
    np.testing.assert_array_equal(greedy_fused(model, prompts, STEPS).tokens, plain.tokens)
    assert model.generation_config.eos_token_id == eos  # restored


def test_one_changed_bias_element_generates_other_tokens_and_the_check_fails(doc, original, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(doc["out"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["lm_head.bias"][ord("~")] += 20.0  # one element: '~' now wins every step
    save_file(weights, str(broken / "model.safetensors"))
    prompts = _holdout_prompts()
    reference = greedy_original(original, prompts, STEPS)
    run = greedy_fused(broken, prompts, STEPS)
    assert not np.array_equal(run.tokens, reference.tokens)
    check = compare_greedy(reference, [run], torch.float32)
    n = len(prompts)
    assert not check.passed and check.runs[0].decisive_mismatches == n and check.runs[0].first_divergence == [0] * n
    full = check_generation(original, broken, prompts, STEPS)
    assert not full.passed


def test_a_near_tie_divergence_is_reported_not_failed():
    logits = np.zeros((2, 3, 4))
    logits[..., 0] = 10.0
    logits[1, 1, 1] = 10.0 - 1e-7  # step 1 of sequence 1: a near-tie for float32 (1e-7 < 1e-5 * 10)
    reference = GreedyRun("ref", np.zeros((2, 3), np.int64), 1.0, logits)
    candidate = GreedyRun("cand", np.array([[0, 0, 0], [0, 1, 2]]), 1.0)
    check = compare_greedy(reference, [candidate], "float32")
    run = check.runs[0]
    assert check.passed and run.near_tie_divergences == 1 and run.first_divergence == [None, 1]
    assert run.tokens_compared == 5 and run.near_ties == 1
    wrong = GreedyRun("cand", np.array([[0, 3, 0], [0, 0, 0]]), 1.0)
    assert not compare_greedy(reference, [wrong], "float32").passed


def test_the_comparison_follows_the_reference_path_and_judges_each_step_by_the_originals_choice():
    """The float64 logits follow one path (the fused folder's tokens): a run is judged at each step by the original's
    argmax there while its prefix is the path's, so a near-tie the path took another way is compared on, and a run
    that takes the original's token where the path did not leaves the path without failing."""
    logits = np.zeros((1, 3, 4))
    logits[..., 0] = 10.0
    logits[0, 1, 1] = 10.0 - 1e-7  # step 1: a near-tie for float32 between tokens 0 and 1
    reference = GreedyRun("ref", np.array([[0, 1, 0]]), 1.0, logits)  # the path took the other near-tied token
    on_path = compare_greedy(reference, [GreedyRun("path", np.array([[0, 1, 0]]), 1.0)], "float32").runs[0]
    assert on_path.passed and on_path.tokens_compared == 3 and on_path.near_tie_divergences == 1
    assert on_path.first_divergence == [1]
    original = compare_greedy(reference, [GreedyRun("orig", np.array([[0, 0, 3]]), 1.0)], "float32").runs[0]
    assert original.passed and original.tokens_compared == 2 and original.near_tie_divergences == 0  # left the path
    wrong = compare_greedy(reference, [GreedyRun("wrong", np.array([[0, 1, 2]]), 1.0)], "float32").runs[0]
    assert not wrong.passed and wrong.first_mismatch["step"] == 2 and wrong.first_mismatch["expected"] == 0
    decisive = np.zeros((1, 3, 4))
    decisive[..., 0] = 10.0  # token 0 at every step, no near-tie
    decisive_path = GreedyRun("ref", np.array([[0, 2, 0]]), 1.0, decisive)  # the path itself wrong at step 1
    check = compare_greedy(decisive_path, [GreedyRun("path", np.array([[0, 2, 0]]), 1.0)], "float32")
    assert not check.passed and check.runs[0].first_mismatch == {
        "prompt": 0, "prompt_ids": [], "prompt_truncated": False, "step": 1, "expected": 0, "got": 2
    }  # fmt: skip
    follows_original = compare_greedy(decisive_path, [GreedyRun("x", np.array([[0, 0, 0]]), 1.0)], "float32")
    assert follows_original.passed and follows_original.runs[0].tokens_compared == 2


def test_prompts_and_steps_are_cut_to_the_models_positions():
    from slabconv.verify.generate import within_positions

    prompts = torch.arange(20).reshape(2, 10)
    assert within_positions(prompts, 32, None)[1:] == (32, []) and within_positions(prompts, 6, 16)[1:] == (6, [])
    cut, steps, notes = within_positions(prompts, 10, 16)  # 10 + 10 > 16: the prompts keep 6 tokens
    assert (
        torch.equal(cut, prompts[:, :6])
        and steps == 10
        and notes == ["prompts cut to 6 tokens: the model has 16 positions"]
    )
    cut, steps, notes = within_positions(prompts, 32, 16)  # one token left, 15 steps
    assert cut.shape == (2, 1) and steps == 15 and len(notes) == 2 and notes[1].startswith("15 tokens generated")


def test_steps_after_a_sequences_end_are_not_compared_but_its_end_is():
    """onnxruntime-genai stops a sequence at its end-of-sequence token: the steps after it are ENDED."""
    logits = np.zeros((2, 4, 5))
    logits[..., 2] = 10.0  # the original's argmax: token 2 at every step (decisive)
    reference = GreedyRun("ref", np.full((2, 4), 2, np.int64), 1.0, logits)
    ended = GreedyRun("genai", np.array([[2, ENDED, ENDED, ENDED], [2, 2, 2, 2]]), 1.0)
    check = compare_greedy(reference, [ended], "float32")
    assert check.passed and check.runs[0].tokens_compared == 5
    stopped_early = GreedyRun("genai", np.array([[3, ENDED, ENDED, ENDED], [2, 2, 2, 2]]), 1.0)
    assert not compare_greedy(reference, [stopped_early], "float32").passed  # an end where the original has none


@pytest.mark.parametrize("model", [{"eos_token_id": None}, {"eos_token_id": [2, "x"]}, {}, "not json"])
def test_a_genai_config_without_end_ids_is_one_line(tmp_path, model):
    from slabconv.verify.generate import _genai_eos

    path = tmp_path / "genai_config.json"
    path.write_text(model if isinstance(model, str) else json.dumps({"model": model}))
    with pytest.raises(InputError, match="no model.eos_token_id"):
        _genai_eos(path)
    path.write_text(json.dumps({"model": {"eos_token_id": [2, 5]}}))
    assert _genai_eos(path) == {2, 5}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, (1, 2, 2)),  # transformers' LlamaConfig defaults; a pad id falls back to the eos id
        ({"bos_token_id": 5, "eos_token_id": [7, 8], "pad_token_id": 0}, (5, [7, 8], 0)),
        ({"eos_token_id": 9}, (1, 9, 9)),
    ],
)
def test_genai_config_takes_the_special_tokens_transformers_reads(given, expected):
    """A config.json without token ids must not make onnxruntime-genai end sequences at token 0 (it used to: the
    missing ids were written as 0, and generation then stopped, or with min_length swerved, where the model put
    token 0)."""
    config = {"vocab_size": 61, "hidden_size": 32, "num_attention_heads": 4, **given}
    assert special_tokens(config) == expected


# --------------------------------------------------------------------------------------------- refusals


def test_bad_runner_arguments_are_usage_errors(doc, original):
    prompts = _holdout_prompts(2, 8)
    with pytest.raises(UsageError, match="threads must be at least 1"):
        greedy_original(original, prompts, 2, threads=0)
    assert torch.get_num_threads() == 1  # restored by each run (the module runs torch on one thread)
    with pytest.raises(UsageError, match="steps must be at least 1"):
        greedy_fused(doc["out"], prompts, 0)
    with pytest.raises(UsageError, match=r"must be integer token ids of shape \(batch, length\)"):
        greedy_original(original, prompts.astype(np.float32), 2)
    with pytest.raises(UsageError, match="left padding"):
        greedy_fused(doc["out"], prompts, 2, attention_mask=np.array([[1] * 7 + [0], [1] * 8]))
    with pytest.raises(UsageError, match="kept no logits"):
        compare_greedy(greedy_original(original, prompts, 2, keep_logits=False), [], "float32")


def _fused_weights(doc) -> dict[str, torch.Tensor]:
    return load_file(str(doc["out"] / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ("kept-affine", "model.layers.1.input_layernorm was not folded"),
        ("kept-final-norm", "model.norm was not folded"),
        ("unknown", "is not part of the norm-free LLaMA layout"),
        ("partial-bias", "o_proj has a bias in layers [0] only"),
    ],
)
def test_weights_that_are_not_norm_free_are_refused_in_one_line(doc, tmp_path, change, phrase):
    weights = _fused_weights(doc)
    if change == "kept-affine":  # what the engine writes for a norm it keeps as a per-channel affine
        weights["model.layers.1.input_layernorm.scale"] = torch.ones(96)
        weights["model.layers.1.input_layernorm.shift"] = torch.zeros(96)
    elif change == "kept-final-norm":
        weights["model.norm.norm2.bn.running_mean"] = torch.zeros(96)
    elif change == "unknown":
        weights["model.extra.weight"] = torch.zeros(3)
    else:
        weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(96)
    folder = tmp_path / "f"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((TEXT / "config.json").read_text())
    with pytest.raises(UnsupportedModelError) as err:
        write_hf_llama_metadata(folder, config)
    assert phrase in str(err.value) and "\n" not in str(err.value)
    assert not (folder / "config.json").exists()


def test_shapes_that_disagree_with_the_config_and_an_empty_folder_are_refused(doc, tmp_path):
    config = json.loads((TEXT / "config.json").read_text())
    with pytest.raises(UsageError, match="write the fused weights there first"):
        write_hf_llama_metadata(tmp_path, config)
    shutil.copy(doc["out"] / "model.safetensors", tmp_path)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads 1 but k_proj has 3 heads"):
        write_hf_llama_metadata(tmp_path, config | {"num_key_value_heads": 1})
    with pytest.raises(UnsupportedModelError, match="rope 'dynamic'"):
        write_hf_llama_metadata(tmp_path, config | {"rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_weights_of_two_dtypes_are_refused_before_anything_is_written(doc, tmp_path):
    """The folder's ``config.json`` records one ``torch_dtype``: weights that mix float dtypes are refused."""
    weights = _fused_weights(doc)
    weights["lm_head.weight"] = weights["lm_head.weight"].half()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UsageError, match=r"the weights mix dtypes \['torch.float16', 'torch.float32'\]"):
        write_hf_llama_metadata(tmp_path, json.loads((TEXT / "config.json").read_text()))
    assert not (tmp_path / "config.json").exists()


def test_without_transformers_every_runner_says_what_to_install(doc, original, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    prompts = _holdout_prompts(1, 8)
    calls = [
        lambda: load_fused_llama(doc["out"]),
        lambda: greedy_fused(doc["out"], prompts, 2),
        lambda: export_decoder_onnx(doc["out"], tmp_path / "x.onnx"),
        lambda: check_generation(original, doc["out"], prompts, 2),
    ]
    for call in calls:
        with pytest.raises(UsageError) as err:
            call()
        assert "pip install slabconv[hf]" in str(err.value) and "\n" not in str(err.value)
    # Writing the folder does not need transformers.
    folder = tmp_path / "w"
    folder.mkdir()
    shutil.copy(doc["out"] / "model.safetensors", folder)
    write_hf_llama_metadata(folder, json.loads((TEXT / "config.json").read_text()))
    assert all((folder / name).is_file() for name in ("config.json", "generation_config.json", MODELING_FILE))


def test_a_generation_check_that_cannot_fit_is_refused_before_any_work_saying_how_much_it_needs(
    doc, original, monkeypatch, tmp_path
):
    """In memory, ``fuse`` and ``verify --generate`` refuse a language model whose checks need more memory than is
    available, before anything is computed or written, naming the memory they need; the generation check's estimate
    holds the fused model in the dtype the check computes in (the text fixture: 4 bytes per weight)."""
    from slabconv.verify import generate

    need = generate.generation_memory(original, 16, 64, 32, onnx=False)
    weights = sum(p.numel() for p in original.parameters())
    assert 4 * weights <= need <= 4 * weights + 64 * 2**20
    monkeypatch.setattr(generate, "available_memory", lambda: 1024)
    message = r"the checks of this language model need about \d+\.\d\d GiB of memory besides the model \(0\.00 GiB"
    with pytest.raises(UsageError, match=message):
        api.fuse(TEXT, tmp_path / "out", write=WriteOptions(pt2=False))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    calls = []
    monkeypatch.setattr(generate, "check_generation", lambda *a, **k: calls.append(a))
    with pytest.raises(UsageError, match=message):
        api.verify(TEXT, doc["out"], verify=VerifyOptions(generate=2))
    assert not calls


def test_checks_that_cannot_fit_are_refused_before_any_work_naming_each_checks_need_and_what_fits(
    doc, monkeypatch, tmp_path
):
    """Issue 38, item 4: the memory estimate counts what each check of a language model holds (question 2's logits
    of every sequence in the original's dtype and in float64, at two lengths, and a runtime's; generation's and the
    task metrics'), so one byte less than the need is refused before any work, even with ``--generate 0`` (question
    2 alone), and the message names each check's need and the most ``--samples`` that fit; the need itself fits."""
    from slabconv.load.model import load_model
    from slabconv.verify import generate, verifier

    loaded = load_model(TEXT)
    opts = VerifyOptions(samples=8)
    count, parts_of = generate.language_checks_memory(loaded, opts, onnx=True)
    parts = parts_of(count)
    vocab, length = 256, 64
    logits = 8 * length * vocab * (4 + 8) * 3 // 2  # question 2's reference: 8 sequences, two lengths, two dtypes
    assert count == 8 and parts["question 2"] >= logits + 8 * 8 * length * vocab  # and one runtime's, in float64
    assert parts_of(4)["question 2"] < parts["question 2"]  # fewer sequences, less memory
    need = max(parts.values())
    monkeypatch.setattr(generate, "available_memory", lambda: need)
    generate.check_language_checks_fit(loaded, opts, onnx=True)  # fits
    ran = []
    monkeypatch.setattr(verifier, "_whole", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(generate, "available_memory", lambda: need - 1)
    with pytest.raises(UsageError) as err:
        api.fuse(TEXT, tmp_path / "out", verify=opts, write=WriteOptions(pt2=False))
    said = str(err.value)
    assert f"need about {need / 2**30:.2f} GiB of memory besides the model" in said
    assert f"question 2 about {parts['question 2'] / 2**30:.2f} GiB" in said
    assert f"greedy generation and the task metrics about {parts['generation'] / 2**30:.2f} GiB" in said
    # the fixture's holdout.npz: the task metrics score all its sequences, whatever --samples says
    assert parts["generation"] > parts["question 2"] and "VerifyOptions(generate=0) skips greedy generation" in said
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")) and not ran
    q2 = parts["question 2"]  # question 2 alone: refused with --generate 0 too, where it does not fit
    monkeypatch.setattr(generate, "available_memory", lambda: q2 - 1)
    alone = VerifyOptions(samples=8, generate=0)
    with pytest.raises(
        UsageError,
        match=r"question 2 about \d+\.\d\d GiB, mostly its logits \(a vocabulary of 256 per token, in float64, on 8 ",
    ):
        api.verify(TEXT, doc["out"] / "model.onnx", verify=alone)
    fits = max(
        n for n in range(1, 8) if max(generate.language_checks_memory(loaded, alone, onnx=False)[1](n).values()) < q2
    )
    assert fits == 7
    with pytest.raises(UsageError, match="--samples 7 checks 7 sequences"):
        generate.check_language_checks_fit(loaded, alone, onnx=False)
    assert not ran


def test_question_2_that_cannot_fit_is_refused_before_the_model_is_traced(monkeypatch, tmp_path):
    """A language model loaded whole whose question 2 alone cannot fit the memory available is refused right after
    loading, before ``torch.export`` traces it and the norms fold (minutes for a deep model); the refusal names
    question 2's need."""
    from slabconv import pipeline
    from slabconv.verify import generate

    planned = []
    monkeypatch.setattr(pipeline, "plan", lambda *a, **k: planned.append(a))
    monkeypatch.setattr(generate, "available_memory", lambda: 1024)
    with pytest.raises(UsageError, match=r"need about \d+\.\d\d GiB of memory besides the model .*question 2 about"):
        api.fuse(TEXT, tmp_path / "out", verify=VerifyOptions(generate=0), write=WriteOptions(pt2=False))
    assert not planned and not (tmp_path / "out").exists()


def test_left_padded_float16_batches_stay_finite_and_match_unpadded_runs(doc):
    """A left-padding position attends to no real token. In float16 a naive ``score + finfo.min`` overflows and a
    softmax over -inf only is NaN, which would reach the real tokens through the padding positions' keys and values.
    The folder is transformers' own LLaMA, so its masks handle this: every real token's logits stay finite and equal
    those of the same prompt run alone."""
    model = load_fused_llama(doc["out"], torch.float16)
    ids = torch.as_tensor(_holdout_prompts(2, 12), dtype=torch.int64)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.int64), ids[:1, :7]], dim=1)
    batch = torch.cat([padded, ids[1:2]], dim=0)
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    with torch.no_grad():
        both = model(input_ids=batch, attention_mask=mask).logits
        alone = model(input_ids=ids[:1, :7]).logits
    assert torch.isfinite(both[0, 5:]).all() and torch.isfinite(both[1]).all()
    assert torch.equal(both[0, 5:].argmax(-1), alone[0].argmax(-1))
    torch.testing.assert_close(both[0, 5:].float(), alone[0].float(), rtol=0, atol=float(alone.abs().max()) * 2e-2)


def test_a_folder_that_lacks_a_weight_or_has_an_extra_one_fails_to_load(doc, tmp_path):
    """transformers would fill a missing weight with random values and drop an unexpected one with a warning; the
    fused folder's model class makes both an error when the folder loads (with slabconv and without it)."""
    from transformers import AutoModelForCausalLM

    tensors = _fused_weights(doc)
    cases = {
        "lacks": {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.q_proj.bias"},
        "no place for": tensors | {"model.layers.0.input_layernorm.weight": torch.ones(96)},
    }
    for phrase, weights in cases.items():
        folder = tmp_path / phrase.replace(" ", "-")
        folder.mkdir()
        for name in ("config.json", "generation_config.json", MODELING_FILE):
            shutil.copy(doc["out"] / name, folder)
        save_file(weights, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=phrase):
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    # The intact folder loads and its bias is the fold's, not an initialised one.
    model = AutoModelForCausalLM.from_pretrained(doc["out"], trust_remote_code=True)
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert torch.equal(bias.detach(), tensors["model.layers.0.self_attn.q_proj.bias"])


def test_an_older_transformers_is_refused_with_the_install_line(monkeypatch):
    import transformers

    from slabconv.write import hf_llama

    monkeypatch.setattr(transformers, "__version__", "5.3.0")
    with pytest.raises(UsageError, match=r"transformers 5\.3\.0 is older than the fused LLaMA model needs \(5\.4\)"):
        hf_llama.require_transformers()
    monkeypatch.setattr(transformers, "__version__", "5.10.0.dev0")
    assert hf_llama.require_transformers() is transformers


@pytest.fixture(scope="module")
def verified(doc, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """``slabconv verify ORIGINAL FUSED`` of docs/deploy.md's intact folder with the command's defaults (greedy
    generation of 32 tokens), as JSON and JUnit: ``(result, junit path)``; the command-line test reads the report,
    the dropped-bias test its passing side."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    junit = tmp_path_factory.mktemp("verified") / "0.xml"
    args = ["verify", str(TEXT), str(doc["out"]), "--samples", "2", "--json", "--junit", str(junit)]
    return CliRunner().invoke(app, args), junit


def test_verify_generate_on_the_command_line(doc, verified, tmp_path):
    """``slabconv verify ORIGINAL FUSED``: both questions plus greedy generation of the folder and its decoder ONNX
    against the original (32 tokens by default, as ``fuse``; ``--generate 0`` turns it off, with a note); a
    candidate that is not a fused language-model folder is refused ``--generate`` with exit 2."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    runner = CliRunner()
    result, _ = verified
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    generation = report["verification"]["generation"]  # a fused folder: checked by default, as fuse does
    assert generation["passed"] and generation["steps"] == 32
    names = " | ".join(run["name"] for run in generation["runs"] if run["decides"])
    assert "(transformers " in names and "(onnxruntime " in names, names
    assert all(run["tokens_compared"] > 0 for run in generation["runs"])
    off = runner.invoke(app, ["verify", str(TEXT), str(doc["out"]), "--samples", "2", "--generate", "0", "--json"])
    verification = json.loads(off.stdout)["verification"]
    assert (
        verification["generation"] is None and "greedy generation not checked (--generate 0)" in verification["notes"]
    )
    onnx_only = runner.invoke(app, ["verify", str(TEXT), str(doc["out"] / "decoder.onnx"), "--generate", "3"])
    assert onnx_only.exit_code == 2
    assert "--generate needs a fused language-model folder as the candidate" in onnx_only.stderr


_PROGRAMS = r"""
import importlib.util, json, sys
args = json.loads(sys.argv[1])
sys.path[:] = [p for p in sys.path if "site-packages" not in p] + args["site"]
assert importlib.util.find_spec("slabconv") is None, "slabconv is importable"
import numpy as np, onnxruntime as ort, torch
ids = np.load(args["ids"])
program = torch.export.load(args["pt2"]).module()
session = ort.InferenceSession(args["onnx"], providers=["CPUExecutionProvider"])
out = {}
for length in args["lengths"]:
    with torch.no_grad():
        pt2 = program(torch.from_numpy(ids[:, :length])).numpy()
    onnx = session.run(None, {"input": ids[:, :length]})[0]
    np.save(f"{args['dir']}/pt2-{length}.npy", pt2)
    np.save(f"{args['dir']}/onnx-{length}.npy", onnx)
    out[length] = [list(pt2.shape), list(onnx.shape)]
print(json.dumps(out))
"""


def test_language_model_programs_take_any_batch_and_length(doc, original, tmp_path):
    """model.pt2 and model.onnx of the text fixture (max_position_embeddings 64) answer 20- and 48-token inputs of
    any batch, loaded without slabconv, with the original's logits; load_fused names what it takes when given
    something else."""
    import onnxruntime

    out = doc["out"]
    info = json.loads((out / "report.json").read_text())["outputs"]["onnx_info"]
    assert info["dynamic_sequence"] and info["pt2_dynamic_sequence"], info
    names = [c["name"] for c in json.loads((out / "report.json").read_text())["verification"]["checks"]]
    assert any("length 32" in n for n in names), names  # verification ran a second length
    ids = np.ascontiguousarray(np.load(TEXT / "holdout.npz")["x"][:3, :48])
    np.save(tmp_path / "ids.npy", ids)
    site = sorted({str(Path(m.__file__).parents[1]) for m in (torch, np, onnxruntime)})
    args = {"site": site, "ids": str(tmp_path / "ids.npy"), "pt2": str(out / "model.pt2"), "dir": str(tmp_path)}
    args |= {"onnx": str(out / "model.onnx"), "lengths": [20, 48]}
    _run_isolated(_PROGRAMS, args, tmp_path)
    model = api.load_fused(out)
    for length in (20, 48):
        x = torch.from_numpy(ids[:, :length])
        with torch.no_grad():
            want = original(x).double()
            got = model(x).double()
        bound = 1e-4 * float(want.abs().max())
        for name in (f"pt2-{length}", f"onnx-{length}"):
            assert float((torch.from_numpy(np.load(tmp_path / f"{name}.npy")).double() - want).abs().max()) < bound
        assert float((got - want).abs().max()) < bound
    with torch.no_grad():
        assert model(torch.from_numpy(ids[:1, :5])).shape == (1, 5, 256)  # batch 1, a short prompt
    for bad, got in (
        (torch.from_numpy(ids[:, :20]).float(), "got float32 of shape (3, 20)"),
        (torch.zeros(2, 65, dtype=torch.int64), "got int64 of shape (2, 65)"),
        (torch.zeros(65, dtype=torch.int64), "got int64 of shape (65,)"),
    ):
        with pytest.raises(UsageError) as err:
            model(bad)
        assert str(err.value) == f"{out / 'model.pt2'} takes int64 ids of shape (batch, sequence 1..64); {got}"


def test_a_dropped_bias_fails_verify_generate_naming_prompt_step_and_tokens(doc, verified, tmp_path):
    """A fused folder whose lm_head bias (the folded final norm) was dropped, i.e. zeroed: ``verify --generate``
    exits 1, its error line names the runtime, the prompt, the first differing step and the two tokens, and the
    JUnit file counts the generation failure; the intact folder passes with failures="0" and a generation case
    (``verified``: the same command on it, with the default 32 tokens)."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    broken = tmp_path / "broken"
    shutil.copytree(doc["out"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["lm_head.bias"] = torch.zeros_like(weights["lm_head.bias"])
    save_file(weights, str(broken / "model.safetensors"))
    failed_junit = tmp_path / "1.xml"
    failed = CliRunner().invoke(
        app, ["verify", str(TEXT), str(broken), "--generate", "8", "--samples", "4", "--junit", str(failed_junit)]
    )
    for (result, junit), code in ((verified, 0), ((failed, failed_junit), 1)):
        assert result.exit_code == code, result.stderr
        text = junit.read_text()
        cases = text.count("<testcase ")
        # transformers, the decoder ONNX in onnxruntime and, where installed, onnxruntime-genai
        assert text.count('name="generation: ') == 2 + genai_available()
        if code == 0:
            assert 'failures="0"' in text and "<failure" not in text
            continue
        failures = text.count("<failure ")
        assert f'failures="{failures}"' in text and 0 < failures <= cases
        assert re.search(
            r'name="generation: fused float32 \(transformers [^"]*"[^>]*>\s*<system-out>[^<]*</system-out>'
            r"\s*<failure",
            text,
        ), text
        named = r"prompt \d+ \(ids [\d, .]+\) differs at step \d+: expected token \d+, got \d+"
        assert re.search(named, result.output), result.output


def test_a_fused_folder_shared_without_its_report_is_still_a_fused_language_model(doc, tmp_path):
    """The Hugging Face files of a fused folder as a user shares them (config.json, the modeling file, the weights;
    no report.json) open as the fused folder they are: ``verify ORIGINAL FOLDER`` checks its generation by default
    (was: 'needs a fused language-model folder as the candidate; ... is not one', exit 2, without --generate)."""
    import shutil

    from slabconv.verify import sides

    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("config.json", "generation_config.json", "modeling_slabconv_llama.py", "model.safetensors"):
        shutil.copy(doc["out"] / name, shared / name)
    side = sides.open_side(shared)
    assert side.kind == "folder" and side.language_model and side.provenance is not None and side.provenance.folded


def test_a_fused_folder_as_the_reference_is_compared_without_generation(doc, tmp_path):
    """``verify FUSED_FOLDER FUSED_FOLDER`` (the first shared without its report.json) compares the two models; the
    greedy-generation check, which runs the original, is not asked for by default (was: '--generate needs a language
    model as the reference', exit 2, with no --generate given). Asked for, the message says what the reference must
    be."""
    import shutil

    from slabconv import api
    from slabconv.errors import UsageError
    from slabconv.options import VerifyOptions

    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("config.json", "generation_config.json", "modeling_slabconv_llama.py", "model.safetensors"):
        shutil.copy(doc["out"] / name, shared / name)
    checked = api.verify(shared, doc["out"], verify=VerifyOptions(samples=4)).verification
    assert checked is not None and checked.passed and checked.generation is None
    with pytest.raises(UsageError, match=r"needs an original language model as the reference .*shared is not one"):
        api.verify(shared, doc["out"], verify=VerifyOptions(samples=4, generate=2))


def test_prompts_ending_with_the_pad_id_are_the_same_prompts_in_onnxruntime_genai(doc, original):
    """onnxruntime-genai takes a prompt's trailing pad ids for padding and generates from the token before them: a
    correct fold failed the check's onnxruntime-genai run whenever a random prompt ended with the pad id (the
    text fixture's: 2). Such a prompt's last token becomes the next id, in every run, and a note says so."""
    if not genai_available():
        pytest.skip("onnxruntime-genai is not installed")
    pad = json.loads((doc["out"] / "genai_config.json").read_text())["model"]["pad_token_id"]
    ids = np.load(TEXT / "holdout.npz")["x"][::40][:6, :24].copy()
    ids[:, 11] = pad  # each prompt (the first half, 12 tokens) ends with the pad id
    check = check_fused_folder(original, doc["out"], ids, 8)
    assert check["passed"], check
    assert f"6 of 6 prompts ended with the pad id {pad}" in " ".join(check["notes"])


def test_the_onnxruntime_genai_run_reads_config_json_as_every_json_input(doc, tmp_path):
    """The onnxruntime-genai run's label takes the dtype from the folder's config.json, read as every JSON input is
    (``load.safety.read_json``): a ``torch_dtype`` that is not a string is not put in the label (float32), and a
    file nested past the depth limit is refused in one line. (It was parsed with plain json.loads, unbounded.)"""
    from slabconv.verify.generate import greedy_genai

    if not genai_available():
        pytest.skip("onnxruntime-genai is not installed")
    folder = tmp_path / "out"
    shutil.copytree(doc["out"], folder)
    config = json.loads((folder / "config.json").read_text())
    prompts = torch.tensor([[5, 6, 7, 8]])
    config["torch_dtype"] = ["float16"]
    (folder / "config.json").write_text(json.dumps(config))
    assert greedy_genai(folder, prompts, 2).name.startswith("fused float32 (onnxruntime-genai ")
    deep: list = []
    for _ in range(200):
        deep = [deep]
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "deep": deep}))
    with pytest.raises(InputError, match="JSON nested deeper than slabconv's limit"):
        greedy_genai(folder, prompts, 2)


def test_a_changed_weight_of_decoder_onnx_fails_question_1_naming_it(doc, tmp_path):
    """decoder.onnx (onnxruntime-genai's file) is deployed on its own: one element of an attention output
    projection's weight (no fold wrote it) one unit in the last place off in it alone, model.safetensors and
    model.onnx intact: question 1 fails on decoder.onnx naming the tensor. Question 1 read model.safetensors and
    model.onnx only; a weight of it changed by 5% of the tensor's largest magnitude failed the task metrics only,
    and the localisation blamed the runtime ("the stored weights are the fold's at every boundary")."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    key = "model.layers.0.self_attn.o_proj.weight"
    broken = tmp_path / "broken"
    shutil.copytree(doc["out"], broken)
    onnxcases.nudge_initializer(broken / "decoder.onnx", load_file(str(broken / "model.safetensors"))[key].numpy().T)
    args = ["verify", str(TEXT), str(broken), "--samples", "2", "--generate", "0", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.stderr
    verification = json.loads(result.stdout)["verification"]
    assert [(c["name"], c["worst"]) for c in verification["exact"] if not c["passed"]] == [
        ("decoder.onnx vs a float64 fold of the reference", key)
    ]
    assert verification["localization"]["first_tensor"] == key


def test_fuse_opset_reaches_decoder_onnx_too(gqa):
    """``fuse --opset N`` of a language model writes ``model.onnx`` and ``decoder.onnx`` in opset N (the decoder
    was written in the exporter's default whatever was asked): the GQA folder's fuse asked for 19."""
    _, out, _ = gqa
    for name in ("model.onnx", "decoder.onnx"):
        model = onnx.load(str(out / name), load_external_data=False)
        assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [19], name
