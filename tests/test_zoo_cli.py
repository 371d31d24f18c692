"""Every zoo family through the console app, as users' files come: a release file ``{'model': ...}`` whose
architecture is detected, and a training checkpoint (optimizer, epoch, config) named with ``--arch``; the
small instances of tests/test_zoo.py stand in for the real sizes (same classes, same code paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.zoo.registry import IMAGE_SIZE_KEY
from tests.conftest import op_histogram
from tests.test_zoo import TINY

pytestmark = pytest.mark.slow


def _save(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path


def _fuse(*args: str) -> dict:
    result = CliRunner().invoke(app, ["fuse", *args, "--json", "--samples", "8"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("key", sorted(TINY))
def test_release_file_detected_and_training_checkpoint_by_name(key, tmp_path):
    tiny = TINY[key]
    state = tiny.model(tiny.layout).state_dict()
    config = {**tiny.config, "MODEL": {**tiny.config.get("MODEL", {}), "NAME": tiny.arch}}
    release = _save(tmp_path / "release" / "model.pth", {"model": state})
    training = _save(
        tmp_path / "train" / "ckpt.pth",
        {"model": state, "optimizer": {"state": {}}, "epoch": 3, "max_accuracy": 1.0, "config": config},
    )
    if tiny.config:  # weights alone do not say the heads/windows: a release file then needs the saved config
        release = _save(tmp_path / "release" / "model.pth", {"model": state, "config": tiny.config})
    reports = [
        _fuse(str(release), "--out", str(tmp_path / "a")),
        _fuse(str(training), "--arch", tiny.arch, "--out", str(tmp_path / "b")),
    ]
    for report, out in zip(reports, (tmp_path / "a", tmp_path / "b"), strict=True):
        assert report["verification"]["passed"] and report["verification"]["max_rel_err"] <= 1e-5
        assert all(f["action"].startswith("folded") for f in report["folds"]), report["folds"]
        assert op_histogram(out / "model.onnx")["BatchNormalization"] == 0
    assert reports[1]["source"]["arch"] == tiny.arch and reports[1]["source"]["format"] == "training-checkpoint"
    assert reports[0]["source"]["format"] in {"release", "training-checkpoint"}


def test_swin_image_size_that_needs_padding_keeps_an_affine_on_that_path_only(tmp_path):
    tiny = TINY["swin"]
    ckpt = _save(tmp_path / "swin.pth", {"model": tiny.model(tiny.layout).state_dict(), "config": tiny.config})
    report = _fuse(str(ckpt), "--arch", tiny.arch, "--image-size", "12", "--out", str(tmp_path / "out"))
    kept = {f["norm"]: f for f in report["folds"] if f["action"] == "kept-affine"}
    assert set(kept) == {"layers.0.blocks.0.norm1", "layers.0.blocks.1.norm1", "layers.1.blocks.0.norm1"}
    assert {f["reason"] for f in kept.values()} == {"zero-padding-after-norm"}
    assert report["source"]["input_shape"] == [3, 12, 12]
    assert report["verification"]["passed"] and report["verification"]["max_rel_err"] <= 1e-5
    assert op_histogram(tmp_path / "out" / "model.onnx")["BatchNormalization"] == 0
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["config"])[IMAGE_SIZE_KEY] == 12


def test_a_model_whose_weights_fix_the_resolution_refuses_another_image_size(tmp_path):
    tiny = TINY["slab_deit"]
    ckpt = _save(tmp_path / "sd.pth", {"model": tiny.model(tiny.layout).state_dict(), "config": tiny.config})
    result = CliRunner().invoke(app, ["inspect", str(ckpt), "--arch", tiny.arch, "--image-size", str(tiny.side * 2)])
    assert result.exit_code == 2
    assert "--image-size" in result.output and "Traceback" not in result.output
