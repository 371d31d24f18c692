"""`slabconv verify` for CI (issue #6 items 1-3): any two of checkpoint / .pt2 / .onnx / fused safetensors,
per-output statistics, tolerances, onnxruntime with optimisations off and on, onnx.checker and safetensors
integrity checks, --json and --junit, exit codes 0/1/2. Also ONNX external data for models over the protobuf
limit (threshold monkeypatched: no 2 GB file is made)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from slabconv import api
from slabconv.cli import app
from slabconv.util import sha256_file
from slabconv.verify import integrity, results
from slabconv.write import onnx as onnx_writer
from tests import tinyckpt
from tests.conftest import small_vit
from tests.tinyckpt import INPUT_SHAPE, save_ckpt, tiny_state_dict

tiny_fused = tinyckpt.tiny_fused
runner = CliRunner()
ORT = ["output @ onnxruntime[no-optimizations]", "output @ onnxruntime[all-optimizations]"]


def _verify(*args: object) -> tuple[int, dict, str]:
    result = runner.invoke(app, ["verify", *map(str, args), "--json"])
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.exit_code, report, result.stderr


def _perturbed_onnx(src: Path, dst: Path, initializer: str, delta: float) -> Path:
    """Copy of ``src`` with ``delta`` added to the first element of one initializer (a one-weight change)."""
    model = onnx.load(str(src))
    init = next(t for t in model.graph.initializer if t.name == initializer)
    values = numpy_helper.to_array(init).copy()
    values.reshape(-1)[0] += delta
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save_model(model, str(dst))
    return dst


def _head_bias(onnx_path: Path) -> str:
    names = [t.name for t in onnx.load(str(onnx_path), load_external_data=False).graph.initializer]
    return next(n for n in names if "head" in n and "bias" in n)


# --------------------------------------------------------------------------------------------- pairs


def test_checkpoint_against_its_fused_onnx_passes_under_both_onnxruntime_settings(tiny_fused: Path) -> None:
    code, report, err = _verify(tiny_fused / "ckpt.pth", tiny_fused / "ckpt-fused" / "model.onnx", "--samples", "24")
    assert code == 0, err
    v = report["verification"]
    assert v["passed"] is True and v["samples"] == 24 and v["inputs"] == "random(seed=0, samples=24)"
    assert [c["name"] for c in v["checks"]] == ORT
    assert [i["name"] for i in v["integrity"]] == ["onnx.checker[full_check] model.onnx"]
    assert all(i["passed"] for i in v["integrity"])
    assert v["runtime"].startswith("onnxruntime 1.") and v["tolerance"] == 1e-5
    assert report["reference"]["sha256"] == sha256_file(tiny_fused / "ckpt.pth")
    assert report["candidate"]["sha256"] == sha256_file(tiny_fused / "ckpt-fused" / "model.onnx")
    for c in v["checks"]:
        assert set(c) == {
            "name", "passed", "samples", "max_abs_err", "max_rel_err", "mean_abs_err", "top1_agreement",
            "worst_sample", "tolerance", "atol",
        }  # fmt: skip
        assert 0 <= c["mean_abs_err"] <= c["max_abs_err"] and c["max_rel_err"] <= 1e-5
        assert c["top1_agreement"] == 1.0 and 0 <= c["worst_sample"] < 24


def test_checkpoint_against_the_fused_safetensors_uses_the_arch_in_its_metadata(tiny_fused: Path) -> None:
    code, report, err = _verify(tiny_fused / "ckpt.pth", tiny_fused / "ckpt-fused" / "model.safetensors")
    assert code == 0, err
    assert report["candidate"]["arch"] == "deit_prepbn" and report["candidate"]["format"] == "safetensors"
    v = report["verification"]
    assert [c["name"] for c in v["checks"]] == [f"output @ pytorch {torch.__version__}"]
    assert [i["name"] for i in v["integrity"]] == ["safetensors reload model.safetensors"]


def test_onnx_against_onnx_takes_the_input_shape_from_the_model(tiny_fused: Path, tmp_path: Path) -> None:
    onnx_path = tiny_fused / "ckpt-fused" / "model.onnx"
    code, report, err = _verify(onnx_path, onnx_path, "--samples", "5", "--seed", "3")
    assert code == 0, err
    v = report["verification"]
    assert v["samples"] == 5 and v["inputs"] == "random(seed=3, samples=5)"
    assert v["max_abs_err"] < 1e-5  # the same file under the two settings


def test_pt2_against_fused_onnx(tiny_fused: Path, tmp_path: Path) -> None:
    model = small_vit(depth=1).eval()
    batch = {0: torch.export.Dim("batch")}
    program = torch.export.export(model, (torch.randn(2, *INPUT_SHAPE),), dynamic_shapes=(batch,))
    torch.export.save(program, tmp_path / "model.pt2")
    code, report, err = _verify(tmp_path / "model.pt2", tiny_fused / "ckpt-fused" / "model.onnx", "--samples", "9")
    assert code == 0, err
    assert report["reference"]["format"] == "torch.export" and report["verification"]["samples"] == 9


def test_inputs_npz_is_used_and_its_hash_recorded(tiny_fused: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((7, *INPUT_SHAPE)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", x=x)
    code, report, err = _verify(
        tiny_fused / "ckpt.pth", tiny_fused / "ckpt-fused" / "model.onnx", "--inputs", tmp_path / "inputs.npz"
    )
    assert code == 0, err
    v = report["verification"]
    assert v["samples"] == 7 and v["inputs"] == str(tmp_path / "inputs.npz")
    assert v["inputs_sha256"] == sha256_file(tmp_path / "inputs.npz")


def test_seeds_give_different_inputs_and_the_same_seed_the_same_numbers(tiny_fused: Path) -> None:
    ref, cand = tiny_fused / "ckpt.pth", tiny_fused / "ckpt-fused" / "model.safetensors"
    a = api.verify(ref, cand, samples=6, seed=1)["verification"]["checks"][0]
    b = api.verify(ref, cand, samples=6, seed=1)["verification"]["checks"][0]
    c = api.verify(ref, cand, samples=6, seed=2)["verification"]["checks"][0]
    assert a == b and a["mean_abs_err"] != c["mean_abs_err"]


# --------------------------------------------------------------------------------------------- failing


def test_a_one_weight_perturbation_exits_1_with_a_red_junit(tiny_fused: Path, tmp_path: Path) -> None:
    src = tiny_fused / "ckpt-fused" / "model.onnx"
    bad = _perturbed_onnx(src, tmp_path / "bad.onnx", _head_bias(src), 0.5)
    result = runner.invoke(
        app, ["verify", str(tiny_fused / "ckpt.pth"), str(bad), "--junit", str(tmp_path / "r.xml"), "--samples", "16"]
    )
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: not equivalent: output @ onnxruntime")
    assert "it would have needed rtol >=" in lines[0]
    assert "FAIL output @ onnxruntime[no-optimizations]" in result.stdout
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "3" and suite.get("failures") == "2"
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failed == ORT


def test_tolerance_overrides_decide_the_verdict(tiny_fused: Path, tmp_path: Path) -> None:
    src = tiny_fused / "ckpt-fused" / "model.onnx"
    bad = _perturbed_onnx(src, tmp_path / "slightly.onnx", _head_bias(src), 1e-3)
    ref = tiny_fused / "ckpt.pth"
    code, report, _ = _verify(ref, bad, "--samples", "16")
    assert code == 1
    needed = max(c["max_rel_err"] for c in report["verification"]["checks"])
    assert 1e-5 < needed < 1e-2
    assert _verify(ref, bad, "--samples", "16", "--rtol", str(needed * 1.01))[0] == 0
    assert _verify(ref, bad, "--samples", "16", "--rtol", str(needed * 0.99))[0] == 1
    worst_abs = max(c["max_abs_err"] for c in report["verification"]["checks"])
    assert _verify(ref, bad, "--samples", "16", "--atol", str(worst_abs * 1.01))[0] == 0


def test_a_failing_onnx_checker_fails_verification(tiny_fused: Path, tmp_path: Path, monkeypatch) -> None:
    def reject(*args: object, **kwargs: object) -> None:
        raise onnx.checker.ValidationError("Field 'type' of 'value_info' is required but missing.")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    result = runner.invoke(
        app,
        ["verify", str(tiny_fused / "ckpt.pth"), str(tiny_fused / "ckpt-fused" / "model.onnx"), "--samples", "4",
         "--junit", str(tmp_path / "r.xml")],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "onnx.checker[full_check] model.onnx failed: Field 'type'" in result.stderr
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1"


# --------------------------------------------------------------------------------------------- reports


def test_junit_has_one_case_per_output_and_runtime_setting(tiny_fused: Path, tmp_path: Path) -> None:
    junit = tmp_path / "reports" / "equivalence.xml"
    result = runner.invoke(
        app,
        ["verify", str(tiny_fused / "ckpt.pth"), str(tiny_fused / "ckpt-fused" / "model.onnx"), "--junit", str(junit)],
    )
    assert result.exit_code == 0, result.stderr
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "0"
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name") == "slabconv.verify"
    cases = list(suite.iter("testcase"))
    assert [c.get("name") for c in cases] == [*ORT, "onnx.checker[full_check] model.onnx"]
    assert all(c.get("classname") == "slabconv.verify.model_onnx" and c.find("failure") is None for c in cases)
    assert "max_rel_err=" in (cases[0].findtext("system-out") or "")
    assert [p.name for p in junit.parent.iterdir()] == ["equivalence.xml"]  # written atomically, no temp left


def test_multi_output_models_get_one_check_per_output(tmp_path: Path) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = small_vit(depth=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.body(x)
            return logits, logits.softmax(-1)

    batch = {0: torch.export.Dim("batch")}
    program = torch.export.export(TwoHeads().eval(), (torch.randn(2, *INPUT_SHAPE),), dynamic_shapes=(batch,))
    torch.export.save(program, tmp_path / "two.pt2")
    report = api.verify(tmp_path / "two.pt2", tmp_path / "two.pt2", samples=3)
    names = [c["name"] for c in report["verification"]["checks"]]
    assert names == [f"output.0 @ pytorch {torch.__version__}", f"output.1 @ pytorch {torch.__version__}"]
    assert report["verification"]["passed"] is True


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_the_default_tolerance_follows_the_checkpoint_dtype(tmp_path: Path, dtype: torch.dtype, rtol: float) -> None:
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tiny_state_dict().items()}
    ckpt = save_ckpt(tmp_path / "ckpt.pth", state)
    v = api.verify(ckpt, ckpt, samples=2)["verification"]
    assert v["tolerance"] == rtol and v["checks"][0]["tolerance"] == rtol and v["passed"] is True


def test_exit_codes_are_documented_in_help() -> None:
    top = " ".join(runner.invoke(app, ["--help"]).stdout.split())
    assert "Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance" in top and "2 bad input" in top
    sub = " ".join(runner.invoke(app, ["verify", "--help"]).stdout.split())
    assert "exit 0 when equivalent, 1 when not, 2 on bad input" in sub


# --------------------------------------------------------------------------------------------- comparison


def test_compare_statistics_follow_design_section_5() -> None:
    ref = np.array([[1.0, 4.0, -2.0], [0.5, 0.0, 3.0]])
    cand = ref + np.array([[0.0, 0.0, 0.0], [0.0, 0.02, 0.0]])
    c = results.compare("out", ref, cand, rtol=1e-2)
    assert c.max_abs_err == pytest.approx(0.02) and c.max_rel_err == pytest.approx(0.02 / 4.0)
    assert c.mean_abs_err == pytest.approx(0.02 / 6) and c.worst_sample == 1 and c.top1_agreement == 1.0
    assert c.passed
    assert not results.compare("out", ref, cand, rtol=1e-3).passed
    assert results.compare("out", ref, cand, rtol=1e-3, atol=0.03).passed
    flipped = ref.copy()
    flipped[0, 0] = 5.0  # argmax of sample 0 changes
    assert results.compare("out", ref, flipped, rtol=1.0).top1_agreement == 0.5
    assert not results.compare("out", ref, flipped, rtol=1.0).passed
    with_nan = cand.copy()
    with_nan[0, 0] = np.nan
    assert not results.compare("out", ref, with_nan, rtol=1.0, atol=1e9).passed


def test_safetensors_reload_check_catches_a_changed_tensor_and_metadata(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    save_file(tensors, str(tmp_path / "m.safetensors"), {"arch": "x"})
    assert integrity.check_safetensors_reload(tmp_path / "m.safetensors", tensors, {"arch": "x"}).passed
    changed = {**tensors, "a": torch.tensor([0.0, 1.0, 2.0, 3.0000002])}
    assert not integrity.check_safetensors_reload(tmp_path / "m.safetensors", changed, {"arch": "x"}).passed
    assert not integrity.check_safetensors_reload(tmp_path / "m.safetensors", tensors, {"arch": "y"}).passed
    assert load_file(str(tmp_path / "m.safetensors")).keys() == tensors.keys()


# --------------------------------------------------------------------------------------------- external data


def test_large_models_are_written_with_external_data_and_verify_loads_them(
    tiny_fused: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(onnx_writer, "ONNX_EXTERNAL_DATA_BYTES", 1024)  # the tiny model counts as "over the limit"
    ckpt = shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth")
    report = api.fuse(ckpt, tmp_path / "out", samples=8)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "model.onnx",
        "model.onnx.data",
        "model.safetensors",
        "report.json",
    ]
    assert report["outputs"]["onnx_info"]["external_data"] == "model.onnx.data"
    assert report["outputs"]["sha256"]["model.onnx.data"] == sha256_file(out / "model.onnx.data")
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    largest = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    assert onnx.external_data_helper.uses_external_data(largest) and not largest.raw_data
    assert report["verification"]["passed"] is True
    code, verdict, err = _verify(ckpt, out / "model.onnx", "--samples", "4")
    assert code == 0, err
    assert set(verdict["candidate"]["files_sha256"]) == {"model.onnx", "model.onnx.data"}
    exported = api.export(ckpt, tmp_path / "single" / "fused.onnx")
    assert exported["outputs"]["onnx_info"]["external_data"] == "fused.onnx.data"
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["fused.onnx", "fused.onnx.data"]
