"""Issue 40, item 4: the task metrics of a language model (``slabconv.verify.task_metrics``): perplexity and
next-token KL computed as defined, and judged by question 2's rule (twice the original's own, or the dtype's
floor). The fixture end to end, in every runtime that generates, is in ``tests/test_deploy_llama.py``
(docs/deploy.md's fuse)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from slabconv.report.data import Report
from slabconv.report.junit import junit_tree
from slabconv.verify.results import Verification
from slabconv.verify.task_metrics import kl, log_softmax, score
from tests import llm_helpers

V, N, T = 50, 8, 12
TEXT = llm_helpers.TEXT
text_fused_plain = llm_helpers.text_fused_plain


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gen = np.random.default_rng(0)
    ids = gen.integers(0, V, size=(N, T))
    reference = gen.normal(scale=3.0, size=(N, T, V))
    original = reference + gen.normal(scale=1e-3, size=reference.shape)  # the original's own rounding
    return ids, reference, original


def test_perplexity_and_kl_are_the_definitions(case) -> None:
    ids, reference, original = case
    metrics = score(reference, ("original", original), [("fused", original)], ids, "float32")
    p = np.exp(reference[:, :-1]) / np.exp(reference[:, :-1]).sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, ids[:, 1:, None], -1)).mean()
    assert metrics.reference["perplexity"] == pytest.approx(math.exp(nll), rel=1e-12)
    q = np.exp(original[:, :-1]) / np.exp(original[:, :-1]).sum(-1, keepdims=True)
    by_hand = (p * np.log(p / q)).sum(-1)
    fused = metrics.runs[1]
    assert fused.kl_mean == pytest.approx(by_hand.mean(), rel=1e-9)
    assert fused.kl_max == pytest.approx(by_hand.max(), rel=1e-9)
    assert fused.kl_to_original_max == 0 and metrics.positions == N * (T - 1)
    assert np.all(kl(log_softmax(reference), log_softmax(reference)) == 0)


def test_a_fused_model_as_close_as_the_original_passes_and_a_drifted_one_fails(case) -> None:
    ids, reference, original = case
    gen = np.random.default_rng(1)
    close = reference + gen.normal(scale=1e-3, size=reference.shape)
    drifted = reference + gen.normal(scale=0.1, size=reference.shape)  # what a wrong bias does to the logits
    metrics = score(reference, ("original float32", original), [("close", close), ("drifted", drifted)], ids, "float32")
    baseline, ok, bad = metrics.runs
    assert not baseline.decides and ok.passed and not bad.passed and not metrics.passed
    assert bad.kl_mean > 2 * baseline.kl_mean
    v = Verification(task_metrics=metrics.to_dict())
    failures = [c for c in v.cases() if c.name.startswith("task metrics") and not c.passed]
    assert [c.name for c in failures] == ["task metrics: drifted"]
    assert "the float64 reference" in failures[0].message and "twice the original's own" in failures[0].message
    tree = junit_tree(Report("verify", verification=v))
    failed = [c.get("name") for c in tree.iter("testcase") if c.find("failure") is not None]
    assert failed == ["task metrics: drifted", "no check ran"] or failed == ["no check ran", "task metrics: drifted"]


def test_the_floor_is_question_2s_tolerance(case) -> None:
    """An original that is exact (float64 itself) leaves only the floor: a run whose logits are within float32's
    tolerance of the reference passes, one 100 times further does not."""
    ids, reference, _ = case
    delta = 1e-5 * np.abs(reference).max()
    gen = np.random.default_rng(2)
    within = reference + gen.uniform(-delta, delta, size=reference.shape)
    beyond = reference + gen.uniform(-100 * delta, 100 * delta, size=reference.shape)
    metrics = score(reference, ("exact", reference), [("within", within), ("beyond", beyond)], ids, "float32")
    assert [r.passed for r in metrics.runs[1:]] == [True, False]
    assert metrics.runs[1].bounds["kl_max"] == pytest.approx(2 * delta**2)


class _StaticBatch(torch.nn.Module):
    """A language model that takes exactly ``batch`` sequences, as the module of a ``torch.export`` program recorded
    with a static batch does (``Expected input at *args[0].shape[0] to be equal to 2``)."""

    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        super().__init__()
        self.model, self.batch = model, batch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] != self.batch:
            raise RuntimeError(f"Expected input at *args[0].shape[0] to be equal to {self.batch}, got {ids.shape[0]}")
        return self.model(ids)


def test_a_static_batch_original_is_scored_in_its_recorded_batch(text_fused_plain: Path) -> None:
    """An original that runs in a recorded static batch of 2 (``LoadedModel.batch``): the task metrics run it, and
    every other run, in batches of 2 (the last one padded, its copies dropped), as question 2 runs such an original,
    and give the numbers of the same model in any batch; in batches of 16 it refuses the input."""
    from slabconv.load.model import load_model
    from slabconv.verify.task_metrics import check_task_metrics

    model = load_model(TEXT).model.eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(5, 16)))
    t = check_task_metrics(_StaticBatch(model, 2), text_fused_plain, ids, onnx=False, batch=2)
    assert t["passed"] and t["sequences"] == 5 and len(t["runs"]) == 2
    whole = check_task_metrics(model, text_fused_plain, ids, onnx=False)
    assert [r["perplexity"] for r in t["runs"]] == pytest.approx([r["perplexity"] for r in whole["runs"]], rel=1e-9)


def test_a_fused_folder_in_a_narrower_dtype_is_held_to_the_original_cast_to_it(tmp_path):
    """A float16 fused folder of a float32 original: question 2 holds it to the original cast to float16 (a note
    says so), and the task metrics held it to the float32 original's own error, so a fold question 2 passed failed
    its task metrics. Both now judge it by the same rule; the baseline run is named in float16."""
    from safetensors.torch import load_file, save_file

    from slabconv import api
    from slabconv.options import VerifyOptions, WriteOptions
    from tests.hfwrite import write_hf_folder
    from tests.test_llama import TINY_CONFIG, tiny_model

    write_hf_folder(tmp_path / "src", tiny_model().state_dict(), {**TINY_CONFIG, "torch_dtype": "float32"})
    api.fuse(tmp_path / "src", tmp_path / "fused", verify=None, write=WriteOptions(onnx=False, pt2=False))
    weights = tmp_path / "fused" / "model.safetensors"
    with open(weights, "rb") as f:
        metadata = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    metadata["source_sha256"] = "0" * 64  # cast by hand, not a fold of src: question 2 alone
    save_file({k: v.half() for k, v in load_file(str(weights)).items()}, str(weights), metadata=metadata)
    config = json.loads((tmp_path / "fused" / "config.json").read_text()) | {"torch_dtype": "float16"}
    (tmp_path / "fused" / "config.json").write_text(json.dumps(config | {"dtype": "float16"}))
    report = api.verify(tmp_path / "src", tmp_path / "fused", verify=VerifyOptions(generate=2))
    checked = report.verification
    assert checked is not None and checked.task_metrics is not None, checked
    assert checked.task_metrics["passed"] and checked.passed, checked.task_metrics
    assert [run["name"] for run in checked.task_metrics["runs"]][0] == "original float16 (pytorch)"
    # streamed, layer by layer: the same rule (it held the float16 folder to float32's tolerance and failed it)
    streamed = api.verify(tmp_path / "src", tmp_path / "fused", verify=VerifyOptions(generate=0), stream=True)
    checked = streamed.verification
    assert checked is not None and checked.passed, [c for c in checked.checks if not c.passed] if checked else None
    assert any("cast to float16" in note for note in checked.notes) and "float16" in checked.runtime
