"""Nothing lost (issue #6 item 7): outputs are staged beside the target and renamed into place only after
verification passed (with --no-verify, once written); a killed, interrupted or failed run leaves the previous
output intact and no partial output; the input is never modified; report.json records every input's and
output's sha256. A SIGKILLed run cannot remove its staging folder: the next run writing the same output does."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from slabconv import api, pipeline
from slabconv.cli import app
from slabconv.errors import clear_interrupt, raise_if_interrupted
from slabconv.options import VerifyOptions, WriteOptions
from slabconv.util import sha256_file
from slabconv.write import staging
from tests import tinyckpt
from tests.conftest import ROOT
from tests.tinyckpt import INPUT_SHAPE, error_lines, snapshot

tiny_fused = tinyckpt.tiny_fused
runner = CliRunner()


@pytest.fixture
def previous(tiny_fused: Path, tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A checkpoint and a previous output folder beside it (from an earlier fuse), with its snapshot."""
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    out = Path(shutil.copytree(tiny_fused / "ckpt-fused", tmp_path / "ckpt-fused"))
    return ckpt, out, snapshot(out)


def _staging(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _start_fuse(ckpt: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "slabconv", "fuse", str(ckpt), "--out", str(out), "--force", "--samples", "8"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_staged_file(proc: subprocess.Popen[str], out: Path, timeout: float = 240) -> Path:
    """Poll until the run has begun writing the model into its staging folder; return that folder.

    The staging marker is the folder's first file and is not waited for: a run killed while writing it leaves a
    folder whose marker is incomplete, which by design no later run removes (it cannot tell it is slabconv's)."""
    from slabconv.write.staging import MARKER

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for folder in _staging(out):
            if any(p.name != MARKER for p in folder.iterdir()):
                return folder
        if proc.poll() is not None:
            pytest.fail(f"fuse ended before it was caught writing: {proc.returncode} {proc.stderr.read()}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("fuse never started writing")


@pytest.mark.slow
def test_sigkill_mid_write_keeps_the_previous_output_and_the_next_run_cleans_up(previous) -> None:
    ckpt, out, before = previous
    ckpt_hash = sha256_file(ckpt)
    proc = _start_fuse(ckpt, out)
    staged = _wait_for_staged_file(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert snapshot(out) == before, "the previous output changed"
    assert staged.exists() and staged.name.startswith(f".{out.name}.tmp-{proc.pid}-")  # a hidden, named leftover
    assert sha256_file(ckpt) == ckpt_hash
    # The next run writing the same output removes the dead run's staging folder and publishes a full result.
    report = api.fuse(ckpt, out, verify=VerifyOptions(samples=8), write=WriteOptions(force=True))
    assert not staged.exists() and _staging(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt2", "model.safetensors", "report.json"]
    assert report.verification is not None and report.verification.passed


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_a_signal_mid_write_is_an_interruption_that_leaves_nothing(previous, signame: str) -> None:
    """A cancelled CI job (SIGTERM), a closed terminal or dropped ssh connection (SIGHUP), Ctrl-\\ (SIGQUIT)."""
    ckpt, out, before = previous
    proc = _start_fuse(ckpt, out)
    _wait_for_staged_file(proc, out)
    proc.send_signal(getattr(signal, signame))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert snapshot(out) == before and _staging(out) == []


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="a system without SIGHUP and SIGQUIT")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_the_entry_point_turns_hangup_and_quit_into_an_interruption(signame: str) -> None:
    cli_app = importlib.import_module("slabconv.cli.app")  # the module (``slabconv.cli.app`` is the Typer app)
    signum = getattr(signal, signame)
    names = (*cli_app.INTERRUPTING_SIGNALS, "SIGINT")
    saved = {getattr(signal, name): signal.getsignal(getattr(signal, name)) for name in names}
    hook = sys.unraisablehook
    try:
        assert signame in cli_app.install_signal_handlers()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signum)
        for name in cli_app.INTERRUPTING_SIGNALS:  # a second signal cannot cut the cleanup short
            signal.raise_signal(getattr(signal, name))
        with pytest.raises(KeyboardInterrupt):  # recorded: a later check raises it again
            raise_if_interrupted()
    finally:
        for num, handler in saved.items():
            signal.signal(num, handler)
        sys.unraisablehook = hook
        clear_interrupt()


@pytest.fixture
def handlers() -> Iterator[None]:
    """The console script's signal handlers in this process (``install_signal_handlers``), restored after."""
    cli_app = importlib.import_module("slabconv.cli.app")
    names = [n for n in (*cli_app.INTERRUPTING_SIGNALS, "SIGINT") if hasattr(signal, n)]
    saved = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in names}
    hook = sys.unraisablehook
    cli_app.install_signal_handlers()
    try:
        yield
    finally:
        for num, handler in saved.items():
            signal.signal(num, handler)
        sys.unraisablehook = hook
        clear_interrupt()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "swap-with-backup"])
def test_a_signal_while_the_output_moves_into_place_ends_after_it_and_says_so(
    previous, handlers, monkeypatch, exchange: bool
) -> None:
    """SIGTERM lands while ``fuse --force`` moves its verified folder into place: the move finishes (the folder is
    never half old, half new), then the run ends with 130 and a last line that names the folder as written in full,
    not "nothing was written". The old output is gone, replaced."""
    ckpt, out, before = previous
    real = staging._renameat2

    def signalled_rename(src: Path, dst: Path, flags: int) -> bool:
        done = real(src, dst, flags) if exchange else False
        signal.raise_signal(signal.SIGTERM)  # Python runs the handler here, between this call and the next
        return done

    monkeypatch.setattr(staging, "_renameat2", signalled_rename)
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--force", "--no-onnx", "--samples", "8"])
    assert result.exit_code == 130, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"interrupted; written in full before it: {out}; nothing else was written"
    )
    assert snapshot(out) != before and sorted(p.name for p in out.iterdir()) == [
        "model.pt2",
        "model.safetensors",
        "report.json",
    ]
    assert _staging(out) == []


def test_a_signal_between_an_onnx_file_and_its_data_moves_both(tmp_path: Path, handlers, monkeypatch) -> None:
    """``staging_file`` moves the side files first (``model.onnx.data``), the file last: a signal between the two
    (with ``--force``, over an older pair) moves both, then ends the run; an ``.onnx`` beside another run's
    ``.data`` would load wrong weights or none."""
    final = tmp_path / "model.onnx"
    final.write_bytes(b"old graph")
    (tmp_path / "model.onnx.data").write_bytes(b"old weights")
    real = os.replace
    moved: list[str] = []

    def signalled_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real(src, dst)
        moved.append(Path(dst).name)
        if len(moved) == 1:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(staging.os, "replace", signalled_replace)
    with pytest.raises(KeyboardInterrupt), staging.staging_file(final, True) as tmp:
        (tmp / "model.onnx").write_bytes(b"new graph")
        (tmp / "model.onnx.data").write_bytes(b"new weights")
    assert moved == ["model.onnx.data", "model.onnx"]
    assert final.read_bytes() == b"new graph" and (tmp_path / "model.onnx.data").read_bytes() == b"new weights"


def test_a_swap_cut_short_is_undone_by_the_next_run(previous) -> None:
    """Killed between moving the old output aside (into its marked staging folder, the path without renameat2)
    and moving the new one in: the next run puts the old one back."""
    _, out, before = previous
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from slabconv.write import staging\n"
        "staging._renameat2 = lambda *a: False\n"
        "def killed(tmp, final):\n"
        "    final.rename(tmp.parent / 'old')\n"
        "    os._exit(9)\n"
        "staging._swap_with_backup = killed\n"
        "with staging.staging_dir(Path(sys.argv[1]), True) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'new, never verified')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=ROOT, env=_env(), timeout=120)
    assert proc.returncode == 9 and not out.exists()
    [staged] = _staging(out)
    assert (staged / "old" / "model.safetensors").is_file()  # the old output waits in the marked staging folder
    staging.clean_stale(out)
    assert snapshot(out) == before
    assert _staging(out) == [] and sorted(p.name for p in out.parent.iterdir()) == ["ckpt-fused", "ckpt.pth"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _staging_of(out: Path, pid: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A staging folder of ``out`` as the run with ``pid`` makes it (marker included), with a file in it."""
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: pid)
        made = staging._make_staging(out)
    (made / out.name).mkdir()
    (made / out.name / "model.safetensors").write_bytes(b"half written")
    return made


def test_staging_of_a_live_run_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ckpt-fused"
    live = _staging_of(out, os.getppid(), monkeypatch)
    other = _staging_of(tmp_path / "other", _dead_pid(), monkeypatch)
    dead = _staging_of(out, _dead_pid(), monkeypatch)
    assert staging.clean_stale(out) == [dead]
    assert live.exists() and other.exists() and not dead.exists()


def test_a_failed_verification_exits_1_and_keeps_the_previous_output(previous, monkeypatch) -> None:
    ckpt, out, before = previous
    ckpt_hash = sha256_file(ckpt)
    real_export = pipeline.export_onnx

    def wrong_export(model: torch.nn.Module, example: torch.Tensor, path: Path, **options: object) -> dict:
        wrong = copy.deepcopy(model)  # a fold that is off in one weight of the exported model only
        with torch.no_grad():
            next(p for n, p in wrong.named_parameters() if n.startswith("head")).view(-1)[0] += 0.5
        options.pop("program", None)  # export the wrong model itself, not the program made from the right one
        return real_export(wrong, example, path, **options)

    monkeypatch.setattr(pipeline, "export_onnx", wrong_export)
    result = runner.invoke(app, ["fuse", str(ckpt), "--force", "--samples", "8"])
    assert result.exit_code == 1
    [line] = error_lines(result.stderr)
    # question 1 reads every written file: the weight model.onnx alone got wrong is named there
    assert line.startswith(
        "error: the fused model is not equivalent: question 1 (is the fold exact?) failed: model.onnx"
    )
    assert line.endswith("nothing was written")
    assert "verification: FAILED" in result.stdout
    assert snapshot(out) == before and _staging(out) == []
    assert sha256_file(ckpt) == ckpt_hash


def test_an_interrupt_while_writing_keeps_the_previous_output(previous, monkeypatch) -> None:
    ckpt, out, before = previous

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "save_safetensors", interrupted)
    result = runner.invoke(app, ["fuse", str(ckpt), "--force", "--no-onnx"])
    assert result.exit_code == 130 and result.stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert snapshot(out) == before and _staging(out) == []


def test_no_verify_publishes_once_written(previous) -> None:
    ckpt, out, before = previous
    result = runner.invoke(app, ["fuse", str(ckpt), "--force", "--no-verify", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verification"] is None
    assert snapshot(out) != before and _staging(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt2", "model.safetensors", "report.json"]


def test_report_records_the_sha256_of_every_input_and_output_and_the_input_is_untouched(
    tiny_fused: Path, tmp_path: Path
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).standard_normal((5, *INPUT_SHAPE)).astype(np.float32))
    inputs_before = {p.name: sha256_file(p) for p in (ckpt, tmp_path / "x.npz")}
    out = tmp_path / "out"
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--inputs", str(tmp_path / "x.npz")])
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["source"]["sha256"] == inputs_before["ckpt.pth"]
    assert report["verification"]["inputs_sha256"] == inputs_before["x.npz"]
    assert report["outputs"]["sha256"] == {
        "model.safetensors": sha256_file(out / "model.safetensors"),
        "model.onnx": sha256_file(out / "model.onnx"),
        "model.pt2": sha256_file(out / "model.pt2"),
    }
    assert {p.name: sha256_file(p) for p in (ckpt, tmp_path / "x.npz")} == inputs_before
