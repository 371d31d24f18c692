"""docs/ci.md works as written (issue #6 item 4 and its acceptance): the Makefile recipe's commands run on the
real fixture give a green JUnit report; one perturbed weight turns it red with exit 1; the GitHub Actions
workflow is well-formed and runs the same slabconv commands as the recipe; the pre-commit hook calls it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest
import yaml
from markdown_it import MarkdownIt
from onnx import numpy_helper

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

DOC = (ROOT / "docs" / "ci.md").read_text()
SLABCONV = str(Path(sys.executable).with_name("slabconv"))


def _fences(info: str) -> list[str]:
    return [t.content for t in MarkdownIt().parse(DOC) if t.type == "fence" and t.info.strip() == info]


def _makefile() -> str:
    (block,) = _fences("makefile")
    return block


def _workflow() -> dict:
    (block,) = [b for b in _fences("yaml") if "jobs:" in b]
    return yaml.safe_load(block)


def _make(makefile: Path, target: str, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    variables = [f"SLABCONV={SLABCONV}", f"FUSED={tmp / 'fused'}", f"REPORTS={tmp / 'reports'}"]
    return subprocess.run(
        ["make", *flags, "--no-print-directory", "-f", str(makefile), target, *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _junit(path: Path) -> tuple[int, int]:
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    return int(suite.get("tests", "0")), int(suite.get("failures", "0"))


def _perturb_one_onnx_weight(path: Path) -> None:
    model = onnx.load(str(path))
    init = next(t for t in model.graph.initializer if "head" in t.name and "weight" in t.name)
    values = numpy_helper.to_array(init).copy()
    values.reshape(-1)[0] += 0.25
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save_model(model, str(path))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_recipe_is_green_on_the_fixture_and_red_after_a_one_weight_change(
    tmp_path: Path, fixture_ckpt: Path
) -> None:
    makefile = tmp_path / "Makefile"
    makefile.write_text(_makefile())
    ckpt_hash = _sha(fixture_ckpt)

    green = _make(makefile, "equivalence", tmp_path)
    assert green.returncode == 0, green.stdout + green.stderr
    assert "verification: PASSED" in green.stdout
    assert _junit(tmp_path / "reports" / "onnx.xml") == (5, 0)  # question 1 x 2, onnx.checker, question 2 x 2
    assert _junit(tmp_path / "reports" / "safetensors.xml") == (3, 0)  # question 1 x 2, question 2 in pytorch
    assert _sha(fixture_ckpt) == ckpt_hash

    _perturb_one_onnx_weight(tmp_path / "fused" / "model.onnx")
    commands = _make(makefile, "slabconv-verify", tmp_path, "-n").stdout.strip().splitlines()
    assert len(commands) == 2 and all(c.startswith(f"{SLABCONV} verify ") for c in commands)
    red = subprocess.run(commands[0], shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert red.returncode == 1, red.stderr
    assert red.stderr.strip().splitlines()[-1].startswith("error: not equivalent: question 1 (is the fold exact?)")
    assert _junit(tmp_path / "reports" / "onnx.xml") == (5, 3)  # the changed weight: question 1 and both runtimes
    assert _junit(tmp_path / "reports" / "safetensors.xml") == (3, 0)  # untouched by the ONNX verdict


def test_the_workflow_runs_the_recipe_commands(tmp_path: Path) -> None:
    workflow = _workflow()
    assert {"push", "pull_request"} <= set(workflow[True] if True in workflow else workflow["on"])
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] and all(("uses" in s) != ("run" in s) for s in job["steps"])
    env = job["env"]
    assert Path(ROOT / env["CKPT"]).exists()
    slabconv_steps = [s["run"].strip() for s in job["steps"] if s.get("run", "").startswith("slabconv ")]
    workflow_commands = [_normalise(c, env) for c in slabconv_steps]
    make = subprocess.run(
        ["make", "-n", "--no-print-directory", "-f", "-", "equivalence", "SLABCONV=slabconv"]
        + [f"{k}={v}" for k, v in env.items()],
        input=_makefile(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert make.returncode == 0, make.stderr
    assert workflow_commands == make.stdout.strip().splitlines()
    uses = [s["uses"] for s in job["steps"] if "uses" in s]
    assert any(u.startswith("actions/checkout@") for u in uses) and any("junit" in u for u in uses)
    publish = next(s for s in job["steps"] if "junit" in s.get("uses", ""))
    assert publish["with"]["report_paths"] == f"{env['REPORTS']}/*.xml"
    install = next(s["run"] for s in job["steps"] if "pip install" in s.get("run", ""))
    assert "torch==2.13.0" in install


def test_the_pre_commit_hook_calls_the_recipe() -> None:
    (hook_block,) = [b for b in _fences("yaml") if "repos:" in b]
    (hook,) = yaml.safe_load(hook_block)["repos"][0]["hooks"]
    assert hook["entry"] == "make equivalence" and hook["language"] == "system" and hook["pass_filenames"] is False
    assert re.search(hook["files"], "runs/best.pth") and not re.search(hook["files"], "README.md")


def _normalise(command: str, env: dict[str, str]) -> str:
    """``slabconv fuse $CKPT ...`` with the workflow's env substituted, as ``make -n`` prints the recipe."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), command)


def _sha(path: Path) -> str:
    from slabconv.util import sha256_file

    return sha256_file(path)


def test_the_recipe_uses_the_console_script_of_this_environment() -> None:
    assert os.access(SLABCONV, os.X_OK), "the slabconv console script is not installed beside this Python"
