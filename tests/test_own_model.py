"""docs/own-model.md, run as a newcomer runs it: every code block of the page, in the page's order, in a fresh
folder that holds the repository's fixtures. A ``python`` block whose first line is ``# NAME.py`` is saved as that
file; every line of a ``sh`` block is run: ``python NAME.py`` as Python runs a script (``runpy``, the folder first
on the path), ``slabconv ...`` through the console app with the same arguments, in this process (a fresh
interpreter for each would import torch three more times)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slabconv.cli import app
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


def _run(command: str, folder: Path) -> str:
    """Run one line of a ``sh`` block in ``folder`` and return what it printed on stdout."""
    words = shlex.split(command)
    if words[0] == "slabconv":
        result = CliRunner().invoke(app, words[1:])
        assert result.exit_code == 0, (command, result.output)
        return result.stdout
    assert words[:1] == ["python"] and len(words) == 2, command
    out = io.StringIO()
    sys.path.insert(0, str(folder))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(folder / words[1]), run_name="__main__")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("model", None)  # the page's model.py, imported by its scripts
    return out.getvalue()


def test_every_block_of_the_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    monkeypatch.chdir(tmp_path)
    for lang, code in blocks(PAGE.read_text()):
        if lang == "python":
            (tmp_path / code.splitlines()[0].removeprefix("# ")).write_text(code)
            continue
        for command in code.splitlines():
            printed = _run(command, tmp_path)
            if command.startswith("slabconv fuse"):
                assert "warning" not in printed, printed  # a dynamic batch: no static-batch warning
    report = json.loads((tmp_path / "build" / "own" / "fused" / "report.json").read_text())
    folds = {f["norm"]: f for f in report["folds"]}
    assert folds["blocks.0.norm1"]["into"] == ["blocks.0.attn.qkv"] and folds["norm"]["into"] == ["head"]
    assert all(f["action"] == "folded-forward" for f in folds.values()) and len(folds) == 5  # what the page says
    assert report["verification"]["passed"] and "inputs.npz" in report["verification"]["inputs"]
    assert report["source"]["batch"] is None  # the program's batch axis is dynamic
    assert printed.strip().endswith("TinyViT compute what the original computes")
