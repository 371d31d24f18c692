"""Tiny zoo checkpoints written to temporary folders, and helpers to check that a command wrote nothing.

The model is ``conftest.small_vit`` (8x8 input, 1 channel, 10 classes, 32 channels, one block: milliseconds to
load), saved in the official training layout ``{'model', 'epoch', 'config'}`` with a registered config name.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import small_vit

CONFIG = {"MODEL": {"NAME": "deit_prepbn", "VIT": {"NUM_HEADS": 4}}}
INPUT_SHAPE = (1, 8, 8)


def tiny_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    return small_vit(depth=1, seed=seed).state_dict()


def save_ckpt(path: Path, state_dict: dict[str, torch.Tensor] | None = None, **extra: Any) -> Path:
    """Write a training-layout checkpoint of the tiny model (or of ``state_dict``) to ``path``."""
    payload = {"model": tiny_state_dict() if state_dict is None else state_dict, "epoch": 3, "config": CONFIG}
    payload.update(extra)
    torch.save(payload, path)
    return path


def rewrite_pickle(src: Path, dst: Path, change: Callable[[bytes], bytes]) -> Path:
    """Copy the torch zip checkpoint ``src`` to ``dst`` with its ``data.pkl`` passed through ``change``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info.filename, change(data) if info.filename.endswith("data.pkl") else data)
    return dst


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` (hidden ones included), files with their sha256."""
    out = {}
    for item in sorted(folder.rglob("*")):
        rel = str(item.relative_to(folder))
        out[rel] = hashlib.sha256(item.read_bytes()).hexdigest() if item.is_file() else "<dir>"
    return out


def error_lines(stderr: str) -> list[str]:
    """The error lines of stderr; every other line must be a progress line (``[   1.2s] stage``): a failure found
    after the long work started follows the progress lines printed so far."""
    lines = stderr.strip().splitlines()
    assert all(line.startswith("[") or line.startswith("error: ") for line in lines), lines
    return [line for line in lines if line.startswith("error: ")]


class MarkerPayload:
    """Unpickling this runs ``exec``, which creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


def hostile_program(tmp_path: Path, marker: Path) -> Path:
    """A valid .pt2 whose sample inputs are a pickle that runs code: ``torch.export.load`` falls back to
    ``torch.load(weights_only=False)`` for them when the weights-only reader refuses."""
    model = small_vit(depth=1).eval()
    batch = {0: torch.export.Dim("batch")}
    torch.export.save(
        torch.export.export(model, (torch.randn(2, 1, 8, 8),), dynamic_shapes=(batch,)), tmp_path / "ok.pt2"
    )
    payload = io.BytesIO()
    torch.save((MarkerPayload(marker),), payload)
    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(tmp_path / "ok.pt2") as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info.filename, payload.getvalue() if "sample_inputs" in info.filename else data)
    return evil


_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``ckpt.pth`` and ``ckpt-fused/`` (model.safetensors, model.onnx, report.json) made by
    ``slabconv.api.fuse``, built once per test session (each module that imports the fixture shares it).
    Read-only by convention: tests copy what they change."""
    from slabconv import api
    from slabconv.options import VerifyOptions

    if "tiny" not in _BUILT:
        folder = tmp_path_factory.mktemp("tiny")
        ckpt = save_ckpt(folder / "ckpt.pth")
        api.fuse(ckpt, folder / "ckpt-fused", verify=VerifyOptions(samples=16))
        _BUILT["tiny"] = folder
    return _BUILT["tiny"]
