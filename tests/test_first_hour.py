"""A new user's first hour (issue 24): exit codes a shell can trust, text that is never read as markup, narrow
terminals, options that are checked before the work, and the Python API's own spelling of advice."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from slabconv.cli.output import Output
from slabconv.engine import Decision
from slabconv.report.data import Report, Source
from slabconv.report.render import folds_table
from tests.conftest import FIXTURE, ROOT

CKPT = FIXTURE / "checkpoint.pth"


def _slabconv(*args: str, **kwargs) -> subprocess.Popen:  # noqa: ANN003 - Popen's own keywords
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "slabconv", *args], cwd=ROOT, env=env, text=True, **kwargs)


@pytest.mark.parametrize("args", [("list",), ("list", "--json")])
def test_a_closed_pipe_ends_quietly_with_0(args):
    """`slabconv list | head -1` under `set -o pipefail`: the reader is gone before the table is written."""
    read, write = os.pipe()
    os.close(read)
    proc = _slabconv(*args, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, "")


def test_a_pipe_closed_by_head_keeps_pipefail_green():
    shell = f"set -o pipefail; {sys.executable} -m slabconv list | head -1"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", shell], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "architectures"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_exits_130_and_writes_nothing(tmp_path, sig):
    out, log = tmp_path / "fused", tmp_path.parent / f"{tmp_path.name}-stderr.txt"
    with open(log, "w") as stderr:
        proc = _slabconv("fuse", str(CKPT), "--out", str(out), stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 120
        while "tracing" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    err = log.read_text()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "interrupted; nothing was written"
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir()], "a staging folder was left behind"


def _terminal(width: int) -> tuple[Output, io.StringIO]:
    buf = io.StringIO()
    err = Console(file=buf, width=width, force_terminal=True, no_color=True)
    return Output(err=err, out=Console(file=io.StringIO())), buf


def _final_screen(raw: str) -> list[str]:
    """The rows the live display left on the screen: the text after its last clear, escape codes dropped."""
    import re

    last = raw.split("\x1b[2K")[-1]
    rows = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip() for line in last.splitlines()]
    return [row for row in rows if row.strip()]


@pytest.mark.parametrize("width", [60, 200])
def test_progress_rows_keep_brackets_status_and_time(width):
    output, buf = _terminal(width)
    with output.progress() as progress:
        progress("verifying: question 2, onnxruntime[no-optimizations]", 1, 2)
        progress("verifying: question 2, onnxruntime[all-optimizations]", 2, 2)
    screen = " ".join(_final_screen(buf.getvalue()))
    assert "onnxruntime[no-optimizations]" in screen and "onnxruntime[all-optimizations]" in screen
    rows = [r for r in _final_screen(buf.getvalue()) if r.startswith("✓")]
    assert len(rows) == 2 and all(r.endswith("0:00:00") for r in rows), rows


def test_an_error_leaves_no_frozen_spinner():
    output, buf = _terminal(80)
    with pytest.raises(RuntimeError), output.progress() as progress:
        progress("loading a.pth")
        progress("tracing the model with torch.export")
        raise RuntimeError("boom")
    screen = _final_screen(buf.getvalue())
    assert screen and all(row.startswith(("✓", " ")) for row in screen), screen
    assert not any("tracing" in row for row in screen)


def _report(norm: str = "blocks.0.norm1[odd]") -> Report:
    folds = [
        Decision(norm, "RepBN", "folded-forward", ["blocks.0.attn.qkv"]),
        Decision("model.layers.0.post_attention_layernorm", "RepBN", "folded-backward", ["model.layers.0.mlp.up"]),
    ]
    return Report("inspect", source=Source(path="a.pth", sha256="0", format="pth", arch="x"), folds=folds)


@pytest.mark.parametrize("width", [60, 200])
def test_the_fold_table_never_breaks_a_keyword_nor_reads_markup(width):
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False).print(folds_table(_report("blocks.0.norm1[bold]")))
    text = buf.getvalue()
    assert "folded-forward" in text and "folded-backward" in text
    assert "norm1[" in text and "bold]" in text  # the name's brackets were not read as a style (folded at 60)
