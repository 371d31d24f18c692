"""Every zoo family through the console app, as users' files come: a release file ``{'model': ...}`` whose
architecture is detected, and a training checkpoint (optimizer, epoch, config) named with ``--arch``; the
small instances of tests/test_zoo.py stand in for the real sizes (same classes, same code paths). Their sizes
are no preset's, so ``--arch`` names the family's any-size entry, and naming the preset is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.zoo import get_arch, list_archs
from slabconv.zoo.registry import IMAGE_SIZE_KEY
from tests.conftest import op_histogram
from tests.test_zoo import TINY

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("captures_shared")]  # one trace a model: conftest.py


def _save(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path


def _any_size(arch: str) -> str:
    """The entry of ``arch``'s family that reads every size from the weights."""
    family = get_arch(arch).family
    return next(s.name for s in list_archs() if s.family == family and s.image_size is None)


def _fuse(*args: str) -> dict:
    samples = [] if "--no-verify" in args else ["--samples", "8"]  # (--no-verify refuses verification options)
    result = CliRunner().invoke(app, ["fuse", *args, "--json", *samples])
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
    # the first run's model.pt2 is verified (each family's BatchNorm-free ONNX: test_zoo); the second run is about
    # naming the architecture, its plan is checked and nothing verified, nor exported
    b = tmp_path / "b"
    reports = [
        _fuse(str(release), "--out", str(tmp_path / "a"), "--no-onnx"),
        _fuse(str(training), "--arch", _any_size(tiny.arch), "--out", str(b), "--no-onnx", "--no-pt2", "--no-verify"),
    ]
    assert reports[0]["verification"]["passed"] and reports[0]["verification"]["max_rel_err"] <= 1e-5
    assert reports[1]["verification"] is None
    for report in reports:
        assert all(f["action"].startswith("folded") for f in report["folds"]), report["folds"]
    assert [f["norm"] for f in reports[0]["folds"]] == [f["norm"] for f in reports[1]["folds"]]
    assert reports[1]["source"]["arch"] == _any_size(tiny.arch)
    assert reports[0]["source"]["arch"] == _any_size(tiny.arch)  # detected, though MODEL.NAME names the preset
    assert reports[1]["source"]["format"] == "training-checkpoint"
    assert reports[0]["source"]["format"] in {"release", "training-checkpoint"}


def test_swin_image_size_that_needs_padding_keeps_an_affine_on_that_path_only(tmp_path):
    tiny = TINY["swin"]
    ckpt = _save(tmp_path / "swin.pth", {"model": tiny.model(tiny.layout).state_dict(), "config": tiny.config})
    report = _fuse(str(ckpt), "--arch", _any_size(tiny.arch), "--image-size", "12", "--out", str(tmp_path / "out"))
    kept = {f["norm"]: f for f in report["folds"] if f["action"] == "kept-affine"}
    assert set(kept) == {"layers.0.blocks.0.norm1", "layers.0.blocks.1.norm1", "layers.1.blocks.0.norm1"}
    assert {f["reason"] for f in kept.values()} == {"zero-padding-after-norm"}
    assert report["source"]["input_shape"] == [3, 12, 12]
    assert report["verification"]["passed"] and report["verification"]["max_rel_err"] <= 1e-5
    assert op_histogram(tmp_path / "out" / "model.onnx")["BatchNormalization"] == 0
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["config"])[IMAGE_SIZE_KEY] == 12
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    # a folded weight changed: not equivalent, localised to its fold (the localisation crashed on the backward
    # fold's boundary, the patch norm's output reshaped by a view, and on the relative-position index buffer)
    right = tensors["layers.1.blocks.0.mlp.fc1.weight"].clone()
    tensors["layers.1.blocks.0.mlp.fc1.weight"].view(-1)[0] *= 1.01
    save_file(tensors, str(tmp_path / "out" / "model.safetensors"), metadata)
    result = CliRunner().invoke(app, ["verify", str(ckpt), str(tmp_path / "out"), "--arch", _any_size(tiny.arch),
                                      "--image-size", "12", "--samples", "4", "--json"])  # fmt: skip
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["verification"]["localization"]["first"]
    assert (first["norm"], first["layer"]) == ("layers.1.blocks.0.norm2", "layers.1.blocks.0.mlp.fc1")
    # a kept norm's shift changed instead: the fold boundaries after it diverge with their own tensors right, and
    # the verdict names the shift (it said "first diverging fold: layers.1.blocks.0.norm2 -> ...mlp.fc1")
    tensors["layers.1.blocks.0.mlp.fc1.weight"] = right
    tensors["layers.1.blocks.0.norm1.shift"].view(-1)[0] += 0.5
    save_file(tensors, str(tmp_path / "out" / "model.safetensors"), metadata)
    result = CliRunner().invoke(app, ["verify", str(ckpt), str(tmp_path / "out"), "--arch", _any_size(tiny.arch),
                                      "--image-size", "12", "--samples", "4", "--json"])  # fmt: skip
    assert result.exit_code == 1, result.output
    loc = json.loads(result.stdout)["verification"]["localization"]
    assert loc["first"] is None and loc["first_tensor"] == "layers.1.blocks.0.norm1.shift"
    assert any(b["inherited"] for b in loc["boundaries"])
    assert loc["detail"].startswith("first differing tensor: 'layers.1.blocks.0.norm1.shift'")


def test_a_model_whose_weights_fix_the_resolution_refuses_another_image_size(tmp_path):
    tiny = TINY["slab_deit"]
    ckpt = _save(tmp_path / "sd.pth", {"model": tiny.model(tiny.layout).state_dict(), "config": tiny.config})
    args = ["inspect", str(ckpt), "--arch", _any_size(tiny.arch), "--image-size", str(tiny.side * 2)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--image-size" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("key", sorted(TINY))
def test_a_preset_named_for_weights_of_another_size_is_refused_with_the_name_that_fits(key, tmp_path):
    tiny = TINY[key]
    ckpt = _save(tmp_path / "m.pth", {"model": tiny.model(tiny.layout).state_dict(), "config": tiny.config})
    result = CliRunner().invoke(app, ["fuse", str(ckpt), "--arch", tiny.arch, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: --arch {tiny.arch} does not fit these weights: their widths and depths are those of "
        f"{_any_size(tiny.arch)}, not {tiny.arch}; pass --arch {_any_size(tiny.arch)}, or leave --arch out to detect it"
    ]
    assert not (tmp_path / "out").exists()
