"""Every fused model is deployable as it is: model.pt2 runs where slabconv cannot be imported and equals model.onnx
on the holdout; docs/deploy.md's examples for every model run as written (load_fused and torch.compile included)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from markdown_it import MarkdownIt

from slabconv.errors import InputError
from tests.conftest import ROOT

DOC = ROOT / "docs" / "deploy.md"


def _blocks(section: str) -> list[str]:
    """The python code blocks of one ``##`` section of docs/deploy.md, in order."""
    blocks, inside = [], False
    for previous, token in itertools.pairwise(MarkdownIt().parse(DOC.read_text())):
        if previous.type == "heading_open" and previous.tag == "h2":
            inside = token.content.startswith(section)
        if inside and token.type == "fence" and token.info.strip() == "python":
            blocks.append(token.content)
    return blocks


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The section for every model, run in order in one namespace, in a scratch folder that sees the fixtures."""
    work = tmp_path_factory.mktemp("deploy")
    (work / "fixtures").symlink_to(ROOT / "fixtures")
    namespace: dict = {"__name__": "deploy_doc"}
    cwd = Path.cwd()
    os.chdir(work)
    try:
        for block in _blocks("Every model"):
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        os.chdir(cwd)
    namespace["out"] = work / namespace["out"]
    return namespace


def test_the_doc_has_the_four_blocks() -> None:
    assert len(_blocks("Every model")) == 4


def test_the_program_the_onnx_file_and_the_compiled_model_agree(doc: dict) -> None:
    logits, onnx_logits, fast = doc["logits"].numpy(), doc["onnx_logits"], doc["fast_logits"].numpy()
    scale = np.abs(logits).max()
    assert np.abs(onnx_logits - logits).max() / scale <= 1e-5
    assert np.abs(fast - logits).max() / scale <= 1e-5
    holdout = np.load(ROOT / "fixtures" / "digits-prepbn" / "holdout.npz")
    assert (logits.argmax(1) == holdout["y"]).mean() > 0.95  # the fixture's 98% holdout accuracy, kept


def test_model_pt2_runs_where_slabconv_cannot_be_imported(doc: dict, tmp_path: Path) -> None:
    """A fresh interpreter (-I -S) whose path holds only the installed packages: slabconv is not importable
    there (its editable install is a .pth hook that -S skips), torch and numpy are."""
    script = f"""
import importlib.util, sys
sys.path[:0] = [{sysconfig.get_paths()["purelib"]!r}, {sysconfig.get_paths()["platlib"]!r}]
assert importlib.util.find_spec("slabconv") is None, "slabconv is importable"
import numpy as np, torch
model = torch.export.load({str(doc["out"] / "model.pt2")!r}).module()
x = torch.from_numpy(np.load({str(ROOT / "fixtures" / "digits-prepbn" / "holdout.npz")!r})["x"])
with torch.no_grad():
    np.save({str(tmp_path / "logits.npy")!r}, model(x).numpy())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("slabconv", "onnx", "transformers")))
"""
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # nothing but torch and numpy was imported
    outside = np.load(tmp_path / "logits.npy")
    assert np.abs(outside - doc["onnx_logits"]).max() / np.abs(doc["onnx_logits"]).max() <= 1e-5


def test_load_fused_refuses_folders_it_cannot_read(doc: dict, tmp_path: Path) -> None:
    import slabconv

    assert isinstance(slabconv.load_fused(doc["out"]), torch.nn.Module)
    with pytest.raises(InputError, match="not a folder slabconv fuse wrote"):
        slabconv.load_fused(tmp_path)
    partial = tmp_path / "no-pt2"
    partial.mkdir()
    (partial / "report.json").write_text((doc["out"] / "report.json").read_text())
    with pytest.raises(InputError, match=r"WriteOptions\(pt2=False\)"):
        slabconv.load_fused(partial)
