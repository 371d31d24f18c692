"""Only what slabconv made is ever removed or replaced (issue 21 item 2), and staging works without POSIX-only
calls (issue 24 item 8).

- Entries beside ``--out`` that merely look like slabconv's staging or backup entries (a user's
  ``.res.tmp-4999999-mine``, ``.res.old-4999999``, ``.model.onnx.old-4999999``, a look-alike without slabconv's
  marker or with a forged one that does not match) are never removed or renamed, with or without ``--force``.
- ``--force`` replaces an output folder only while each file still has the sha256 its ``report.json`` records,
  checked before the work and again just before the swap.
- A mount point as the target is refused before anything is read.
- Without ``os.pathconf``, without a safe liveness probe (Windows, where ``os.kill(pid, 0)`` sends CTRL_C_EVENT)
  and without ``renameat2``, staging still works, and errs on the side of leaving things alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slabconv import pipeline
from slabconv.cli import app
from slabconv.errors import UsageError
from slabconv.write import staging
from tests import tinyckpt
from tests.tinyckpt import error_lines, snapshot

tiny_fused = tinyckpt.tiny_fused
runner = CliRunner()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _made_by(out: Path, pid: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A staging folder of ``out`` exactly as the run with ``pid`` makes it, marker included."""
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: pid)
        return staging._make_staging(out)


def _lookalikes(parent: Path, name: str) -> list[Path]:
    """User entries named like slabconv's staging and backup entries of ``parent / name``, none made by slabconv."""
    dead = _dead_pid()
    made = []
    for entry in (f".{name}.tmp-4999999-mine", f".{name}.old-4999999", f".{name}.tmp-{dead}-0123456789abcdef"):
        (parent / entry).mkdir()
        (parent / entry / "thesis.tex").write_text("the user's work")
        made.append(parent / entry)
    (parent / f".{name}.old-{dead}").write_text("a user's file")
    made.append(parent / f".{name}.old-{dead}")
    # A forged marker that does not match the folder's name (another token), and a marker that is a link.
    forged = parent / f".{name}.tmp-{dead}-fedcba9876543210"
    forged.mkdir()
    marker = {"slabconv": "staging", "for": name, "pid": dead, "token": "0000000000000000"}
    (forged / staging.MARKER).write_text(json.dumps(marker))
    linked = parent / f".{name}.tmp-{dead}-abcdefabcdefabcd"
    linked.mkdir()
    (parent / "elsewhere.json").write_text(json.dumps({**marker, "token": "abcdefabcdefabcd"}))
    os.symlink(parent / "elsewhere.json", linked / staging.MARKER)
    # A link named like a staging folder, to a folder whose marker would match the link's name: links are not
    # followed (removing "through" it would delete the user's folder it points to).
    token = "1234512345123451"
    target = parent / f"linked-target-{name}"
    target.mkdir()
    (target / staging.MARKER).write_text(json.dumps({**marker, "token": token}))
    (target / "thesis.tex").write_text("the user's work")
    os.symlink(target, parent / f".{name}.tmp-{dead}-{token}")
    return [*made, forged, linked, parent / f".{name}.tmp-{dead}-{token}"]


def test_clean_stale_touches_no_lookalike_and_restores_nothing_it_did_not_move(tmp_path: Path) -> None:
    for name in ("res", "model.onnx"):
        _lookalikes(tmp_path, name)
    before = snapshot(tmp_path)
    assert staging.clean_stale(tmp_path / "res") == []
    assert staging.clean_stale(tmp_path / "model.onnx") == []
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "res").exists() and not (tmp_path / "model.onnx").exists()  # no user entry renamed


def test_clean_stale_removes_a_dead_runs_marked_staging_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "res"
    dead = _made_by(out, _dead_pid(), monkeypatch)
    (dead / "res").mkdir()
    (dead / "res" / "model.safetensors").write_bytes(b"half written")
    _lookalikes(tmp_path, "res")
    before = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(dead.name)}
    assert staging.clean_stale(out) == [dead]
    assert snapshot(tmp_path) == before


def test_an_old_output_that_cannot_be_put_back_is_never_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap cut short between its two renames, and meanwhile something else appeared at the output's path."""
    out = tmp_path / "res"
    cut = _made_by(out, _dead_pid(), monkeypatch)
    for sub in ("old", "res"):
        (cut / sub).mkdir()
        (cut / sub / "model.safetensors").write_bytes(sub.encode())
    out.mkdir()
    (out / "notes.txt").write_text("made meanwhile")
    before = snapshot(tmp_path)
    assert staging.clean_stale(out) == []
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_fuse_leaves_lookalikes_beside_out_alone(tmp_path: Path, tiny_fused: Path) -> None:
    """On the path a real run takes: a new ``--out``, then ``--force`` over slabconv's own output, then export."""
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    (tmp_path / "user").mkdir()
    _lookalikes(tmp_path, "res")
    _lookalikes(tmp_path, "model.onnx")
    before = snapshot(tmp_path)
    out = tmp_path / "res"
    for extra in ([], ["--force"]):
        result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--no-onnx", "--samples", "2", *extra])
        assert result.exit_code == 0, result.stderr
    result = runner.invoke(app, ["export", str(ckpt), "--onnx", str(tmp_path / "model.onnx")])
    assert result.exit_code == 0, result.stderr
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    new = sorted(k for k in after if k not in before and "/" not in k)
    assert new == ["model.onnx", "res"], new


def _edited(tmp: Path, fused: Path, name: str) -> Path:
    out = Path(shutil.copytree(fused / "ckpt-fused", tmp / "ckpt-fused"))
    data = bytearray((out / name).read_bytes())
    data[-1] ^= 1
    (out / name).write_bytes(bytes(data))
    return out


def test_force_refuses_an_output_file_edited_since_slabconv_wrote_it(tmp_path: Path, tiny_fused: Path) -> None:
    (tmp_path / "broken.pth").write_bytes(b"not a checkpoint")  # refused before the checkpoint is read
    out = _edited(tmp_path, tiny_fused, "model.safetensors")
    before = snapshot(out)
    result = runner.invoke(app, ["fuse", str(tmp_path / "broken.pth"), "--out", str(out), "--force"])
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --out {out}: model.safetensors changed since slabconv wrote it"), line
    assert snapshot(out) == before


def test_force_refuses_an_output_edited_while_the_run_worked(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check before the work passes; the user edits a file meanwhile; the swap is refused, the edit kept."""
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    out = Path(shutil.copytree(tiny_fused / "ckpt-fused", tmp_path / "ckpt-fused"))
    real = pipeline.save_safetensors

    def save_while_the_user_edits(*args: object, **kwargs: object) -> object:
        (out / "model.onnx").write_bytes(b"the user's edit")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "save_safetensors", save_while_the_user_edits)
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--force", "--no-onnx", "--samples", "2"])
    assert result.exit_code == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert "model.onnx changed since slabconv wrote it" in line, line
    assert (out / "model.onnx").read_bytes() == b"the user's edit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-fused", "ckpt.pth"]  # no staging left


def test_force_refuses_an_output_turned_into_a_link_while_the_run_worked(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    out = Path(shutil.copytree(tiny_fused / "ckpt-fused", tmp_path / "ckpt-fused"))
    mine = Path(shutil.copytree(out, tmp_path / "mine"))  # looks like slabconv's, and is the user's
    real = pipeline.save_safetensors

    def save_while_the_user_swaps(*args: object, **kwargs: object) -> object:
        shutil.rmtree(out)
        os.symlink(mine, out)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "save_safetensors", save_while_the_user_swaps)
    before = snapshot(mine)
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--force", "--no-onnx", "--samples", "2"])
    assert result.exit_code == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert line == f"error: {out} became a symbolic link while slabconv worked; nothing was written", line
    assert out.is_symlink() and snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-fused", "ckpt.pth", "mine"]


def test_export_force_refuses_a_file_replaced_while_the_run_worked(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    target = Path(shutil.copy(tiny_fused / "ckpt-fused" / "model.onnx", tmp_path / "model.onnx"))  # slabconv's
    from slabconv.write import onnx as onnx_writer

    real = onnx_writer.export_onnx

    def export_while_the_user_saves(*args: object, **kwargs: object) -> object:
        target.write_bytes(b"the user's own model, saved meanwhile")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx_writer, "export_onnx", export_while_the_user_saves)  # api.export imports it when run
    result = runner.invoke(app, ["export", str(ckpt), "--onnx", str(target), "--force"])
    assert result.exit_code == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert line == f"error: {target} was replaced by a file slabconv did not write while it worked; nothing was written"
    assert target.read_bytes() == b"the user's own model, saved meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth", "model.onnx"]


@pytest.mark.parametrize("existing", ["empty", "slabconv's"])
def test_a_mount_point_is_refused_before_the_work(
    existing: str, tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount point cannot be renamed over: refused at once, not after the whole fuse (``os.path.ismount`` is
    made to say so, as tests cannot mount)."""
    (tmp_path / "broken.pth").write_bytes(b"not a checkpoint")
    out = tmp_path / "mnt"
    if existing == "empty":
        out.mkdir()
    else:
        shutil.copytree(tiny_fused / "ckpt-fused", out)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real(p))
    result = runner.invoke(app, ["fuse", str(tmp_path / "broken.pth"), "--out", str(out), "--force"])
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --out {out} is a mount point"), line


def test_an_existing_file_on_a_mount_point_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"slabconv's, say")
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == target)
    with pytest.raises(UsageError, match="is a mount point"):
        staging.check_output_file(target, force=True, owned=lambda p: True)


# --------------------------------------------------------------------------------------------- portability


def test_without_pathconf_the_usual_limits_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "pathconf", raising=False)
    assert staging.check_output_folder(tmp_path / "out", force=False) == tmp_path / "out"
    with pytest.raises(UsageError, match="has 250 characters"):
        staging.check_output_folder(tmp_path / ("x" * 250), force=False)


def test_without_a_process_probe_a_staging_folder_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "res"
    dead = _made_by(out, _dead_pid(), monkeypatch)
    monkeypatch.delattr(os, "kill")
    assert staging.clean_stale(out) == [] and dead.exists()


def test_on_windows_liveness_is_never_asked_with_os_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.kill(pid, 0)`` on Windows sends CTRL_C_EVENT; the Windows probe is OpenProcess, and without it (no
    ``ctypes.WinDLL``, as here) a process counts as alive."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    with monkeypatch.context() as m:
        m.setattr(os, "name", "nt")
        probe = staging._liveness_probe()
        alive = staging._alive(_dead_pid())
    assert probe is None or probe is staging._alive_windows
    assert alive and sent == []


def test_without_renameat2_force_swaps_through_the_marked_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "_renameat2", lambda *args: False)
    out = tmp_path / "res"
    with staging.staging_dir(out, force=False) as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(UsageError, match="already exists"):
        with staging.staging_dir(out, force=False) as tmp:
            (tmp / "a.txt").write_text("never published")
    (out / "a.txt").unlink()  # an empty folder: --force may replace it
    with staging.staging_dir(out, force=True) as tmp:
        (tmp / "b.txt").write_text("second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res"]
    assert [p.name for p in out.iterdir()] == ["b.txt"]


# --------------------------------------------------------------------------------------------- bench --plot


def test_bench_plot_never_replaces_a_users_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "broken.pth").write_bytes(b"not a checkpoint")  # refused before the checkpoint is read
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG\r\n\x1a\n the user's own chart")
    result = runner.invoke(app, ["bench", str(tmp_path / "broken.pth"), "--plot", str(chart)])
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == f"error: --plot {chart} already exists and slabconv did not write it; choose another path"
    assert chart.read_bytes() == b"\x89PNG\r\n\x1a\n the user's own chart"


def test_bench_plot_marks_its_png_so_a_rerun_may_replace_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from slabconv import bench

    timings = [bench.Timing("fused", "pytorch", 1, 2.0, 1.5, 4.0, 500.0)]
    chart = tmp_path / "chart.png"
    bench.plot(timings, chart)
    assert bench.plot_written_by_slabconv(chart)
    bench.check_plot_path(chart, True, [])  # slabconv's own chart: a rerun with --force may replace it
    bench.plot(timings, chart)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png"]  # atomically, no staging left
    import matplotlib.pyplot as plt

    plt.figure().savefig(tmp_path / "theirs.png")  # matplotlib's own mark, not slabconv's
    assert not bench.plot_written_by_slabconv(tmp_path / "theirs.png")
    with pytest.raises(UsageError, match="already exists and slabconv did not write it"):
        bench.check_plot_path(tmp_path / "theirs.png", True, [])
