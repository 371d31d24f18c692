"""docs/own-model.md, run as a newcomer runs it: every code block of the page, in the page's order, in a fresh
folder that holds the repository's fixtures. A ``python`` block whose first line is ``# NAME.py`` is saved as that
file; every line of a ``sh`` block is run by the shell with slabconv's environment on the PATH."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "own-model.md"
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, str]]:
    """The page's ``python`` and ``sh`` blocks, in order, as (language, code)."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def test_the_page_has_the_steps_it_promises():
    found = blocks(PAGE.read_text())
    files = [code.splitlines()[0] for lang, code in found if lang == "python"]
    commands = [line for lang, code in found if lang == "sh" for line in code.splitlines()]
    assert files == ["# model.py", "# export.py", "# use.py"]
    assert commands == [
        "python export.py",
        "slabconv fuse build/own/model.pt2 --inputs build/own/inputs.npz --out build/own/fused",
        "python use.py",
    ]


def test_every_block_of_the_page_runs(tmp_path: Path):
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's slabconv, as for every test
    for lang, code in blocks(PAGE.read_text()):
        if lang == "python":
            (tmp_path / code.splitlines()[0].removeprefix("# ")).write_text(code)
            continue
        for command in code.splitlines():
            done = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            if command.startswith("slabconv fuse"):
                assert "warning" not in done.stdout, done.stdout  # a dynamic batch: no static-batch warning
    report = json.loads((tmp_path / "build" / "own" / "fused" / "report.json").read_text())
    folds = {f["norm"]: f for f in report["folds"]}
    assert folds["blocks.0.norm1"]["into"] == ["blocks.0.attn.qkv"] and folds["norm"]["into"] == ["head"]
    assert all(f["action"] == "folded-forward" for f in folds.values()) and len(folds) == 5  # what the page says
    assert report["verification"]["passed"] and "inputs.npz" in report["verification"]["inputs"]
    assert report["source"]["batch"] is None  # the program's batch axis is dynamic
    assert done.stdout.strip().endswith("TinyViT compute what the original computes")
