"""The environment CI runs in (issue 37): FORCE_COLOR and TTY_COMPATIBLE on a pipe, TERM=dumb, closed standard
streams, paths over PATH_MAX, a umask of 0777, folder names that are not UTF-8, library log lines.

Each runs the small hand-built ONNX model of ``tests/onnxcases.py`` (a fold and its verification take well under
a second); the three that need a real process (a closed descriptor, logging's last resort) start one.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from onnx import helper
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.cli.output import Output
from slabconv.load.checkpoint import load_safetensors
from slabconv.write.pt2 import save_pt2
from tests import onnxcases as oc
from tests.conftest import ROOT
from tests.tinyckpt import snapshot

runner = CliRunner()
PROGRESS = re.compile(r"\[ *\d+\.\ds\] \S.*")


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return oc.save(oc.base_model(), tmp_path / "m")


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    "tty, env",
    [(False, {"FORCE_COLOR": "1"}), (False, {"TTY_COMPATIBLE": "1"}), (True, {"TERM": "dumb"})],
    ids=["pipe-FORCE_COLOR", "pipe-TTY_COMPATIBLE", "terminal-TERM=dumb"],
)
def test_the_live_display_only_on_a_terminal_that_can_redraw(tty, env, monkeypatch) -> None:
    """FORCE_COLOR=1 (set by many CI systems) made Rich treat a pipe as a terminal: the live display wrote 9 MB of
    escape sequences into the log. Off a terminal, and on a dumb one, progress is one plain line per stage."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "stdout", _Stream(tty))
    monkeypatch.setattr(sys, "stderr", _Stream(tty))
    output = Output()
    with output.progress() as progress:
        progress("loading model.onnx")
        for done in range(5):
            progress("folding norms", done, 4)
    output.out.print("[green]ok[/green]")
    err, out = sys.stderr.getvalue(), sys.stdout.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in err and (tty or "\x1b" not in out), (err, out)
    lines = err.splitlines()
    assert [PROGRESS.fullmatch(line) is not None for line in lines] == [True, True], lines


def test_a_closed_descriptor_is_not_taken_by_a_file_opened_later() -> None:
    """Fd 1 closed: the next file opened would get it, and what a library prints to stdout would land in it."""
    script = (
        "import os, sys; from slabconv.cli.app import open_missing_streams; names = open_missing_streams(); "
        "fd = os.open(os.devnull, os.O_RDONLY); print('ignored'); "
        "sys.exit(0 if names == ['stdout', 'stderr'] and fd > 2 and os.isatty(1) is False else 3)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["sh", "-c", 'exec "$@" >&- 2>&-', "sh", sys.executable, "-c", script]
    assert subprocess.run(argv, env=env, timeout=120).returncode == 0


def _custom_op_model(folder: Path) -> Path:
    """The base model with an extra node of a custom domain whose string attribute is not UTF-8."""
    m = oc.base_model()
    node = helper.make_node("Foo", ["x"], ["unused"], domain="custom", name="foo")
    node.attribute.add(name="tag", type=3, s=b"\xff\xfe")
    m.graph.node.append(node)
    m.opset_import.append(helper.make_opsetid("custom", 1))
    return oc.save(m, folder)


def test_inspect_writes_nothing_into_the_current_folder(tmp_path: Path, monkeypatch) -> None:
    """onnxruntime's SymbolicShapeInference, which the lowering runs, saves ``sym_shape_infer_temp.onnx`` (and its
    data) into the current folder when it cannot infer every shape (here: the custom op's output), replacing any
    file of that name there."""
    path = _custom_op_model(tmp_path / "m")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert runner.invoke(app, ["inspect", str(path), "--quiet"]).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "cwd").iterdir()) == []


def test_a_closed_stdout_is_not_an_error_and_no_library_warning_reaches_stderr(tmp_path: Path) -> None:
    """`slabconv inspect m.onnx >&-` crashed with exit 1 and a traceback ('NoneType' object has no attribute
    'isatty'): exit 1 is "not equivalent"; a missing stream is the null device (a closed stderr too: the test
    above). And onnx-ir logs a warning for a string attribute that is not UTF-8 (a custom op's), which logging's
    last resort printed as a second stderr line. One real process for both: pytest's own log handlers would
    swallow the warning in this one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "slabconv", "inspect", str(_custom_op_model(tmp_path / "m")), "--quiet"]
    argv = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
    result = subprocess.run(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


@pytest.mark.parametrize("where", ["input", "out"])
def test_a_path_over_path_max_is_one_line(where: str, model: Path, tmp_path: Path) -> None:
    """`Path.exists` raises ENAMETOOLONG over PATH_MAX: it was `internal error: OSError [Errno 36]`."""
    long = tmp_path.joinpath(*["d" * 200] * 25, "model.onnx" if where == "input" else "fused")
    args = ["inspect", str(long)] if where == "input" else ["fuse", str(model), "--out", str(long)]
    result = runner.invoke(app, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "the path is too long for this file system (" in lines[0], lines[0]
    assert len(lines[0]) < 400, "the path is shown cut"


def test_a_umask_of_0777_is_refused_before_anything_is_made(model: Path, tmp_path: Path) -> None:
    """The staging folder was made with mode 000 and left behind; the files would be unreadable to the
    verification. Refused before any work, naming the output (as root too: the check is the umask's)."""
    before = snapshot(tmp_path)
    old = os.umask(0o777)
    try:
        result = runner.invoke(app, ["fuse", str(model), "--out", str(tmp_path / "out")])
    finally:
        os.umask(old)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0] == (
        f"error: cannot write {tmp_path / 'out'}: the umask 0777 takes your own read or write permission from what "
        "slabconv writes; run it with a umask that leaves them (e.g. umask 022)"
    )
    assert snapshot(tmp_path) == before


def test_a_folder_whose_name_is_not_utf8_folds_and_verifies(tmp_path: Path) -> None:
    """onnxruntime, onnx.checker and safetensors take UTF-8 paths only, torch's zip writer aborted on one: an ONNX
    original folded, then its verification failed with a message blaming the model; a checkpoint's model.pt2 ended
    the process. The inputs and the outputs all live in such a folder here."""
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9-\xff"))
    path = oc.save(oc.base_model(), folder)
    result = runner.invoke(app, ["fuse", str(path), "--out", str(folder / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "verification PASSED" in result.stdout
    assert sorted(p.name for p in (folder / "out").iterdir()) == ["model.onnx", "report.json"]
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))  # what a checkpoint's fuse writes
    save_pt2(program, {}, folder / "model.pt2")
    with open(folder / "model.pt2", "rb") as f:  # as slabconv's loader reads it (torch's own path reader aborts)
        assert torch.export.load(f).module()(torch.ones(1, 2)).shape == (1, 2)
    save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
    assert torch.equal(load_safetensors(folder / "model.safetensors").state_dict["w"], torch.ones(2))
