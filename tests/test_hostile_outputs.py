"""Careless or hostile output paths: slabconv never deletes or replaces what it did not write.

Each case points ``--out`` (or ``export --onnx``, ``--junit``) somewhere it must not write, runs the CLI, and
checks: exit 2, exactly one line on stderr, every file the user had byte-identical, nothing left beside the
target (no staging folder). Paths that are wrong before any work starts (links, long names) are refused before
the checkpoint is even read: the cases pass an unreadable checkpoint, and the message must be about the path.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slabconv import pipeline
from slabconv.cli import app
from tests import tinyckpt
from tests.conftest import ROOT
from tests.tinyckpt import error_lines, save_ckpt, snapshot

tiny_fused = tinyckpt.tiny_fused
runner = CliRunner()


def _user_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("the user's own file")
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "table.csv").write_text("a,b\n1,2\n")


def out_dot_in_a_folder_of_user_files(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    work = tmp / "work"
    _user_files(work)
    mp.chdir(work)
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", ".", "--force", "--no-onnx"]


def out_empty_string(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    work = tmp / "work"
    _user_files(work)
    mp.chdir(work)
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", "", "--force", "--no-onnx"]


def out_parent_of_the_current_folder(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "work" / "sub").mkdir(parents=True)
    mp.chdir(tmp / "work" / "sub")
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", "..", "--force", "--no-onnx"]


def out_home(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    home = tmp / "home"
    _user_files(home)
    mp.setenv("HOME", str(home))
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", str(home), "--force", "--no-onnx"]


def out_root(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", "/", "--force", "--no-onnx"]


def out_a_regular_file(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "some_file.txt").write_text("keep me")
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", str(tmp / "some_file.txt"), "--force", "--no-onnx"]


def out_a_folder_of_user_files(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    _user_files(tmp / "results")
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", str(tmp / "results"), "--force", "--no-onnx"]


def out_slabconv_folder_with_a_user_file_added(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    fused = tmp / "ckpt-fused"
    shutil.copytree(mp.fused / "ckpt-fused", fused)  # type: ignore[attr-defined]
    (fused / "my_notes.md").write_text("results of my evaluation")
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", str(fused), "--force", "--no-onnx"]


def out_the_folder_of_the_input(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "models").mkdir()
    return ["fuse", str(save_ckpt(tmp / "models" / "ckpt.pth")), "--out", str(tmp / "models"), "--force"]


def out_inside_an_input_folder(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    from tests.hfwrite import write_hf_folder
    from tests.test_llama import TINY_CONFIG, tiny_model

    write_hf_folder(tmp / "hf", tiny_model().state_dict(), TINY_CONFIG)
    return ["fuse", str(tmp / "hf"), "--out", str(tmp / "hf" / "fused"), "--no-onnx"]


def out_dangling_link(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "broken.pth").write_bytes(b"not a checkpoint")
    os.symlink(tmp / "nowhere", tmp / "out")
    return ["fuse", str(tmp / "broken.pth"), "--out", str(tmp / "out")]


def out_link_to_a_user_folder(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    _user_files(tmp / "mine")
    os.symlink(tmp / "mine", tmp / "out")
    (tmp / "broken.pth").write_bytes(b"not a checkpoint")
    return ["fuse", str(tmp / "broken.pth"), "--out", str(tmp / "out"), "--force"]


def out_name_too_long(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "broken.pth").write_bytes(b"not a checkpoint")
    return ["fuse", str(tmp / "broken.pth"), "--out", str(tmp / ("x" * 300))]


def out_under_a_file(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "a_file").write_text("keep")
    (tmp / "broken.pth").write_bytes(b"not a checkpoint")
    return ["fuse", str(tmp / "broken.pth"), "--out", str(tmp / "a_file" / "out")]


def export_onto_a_user_file(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "model.onnx").write_bytes(b"someone else's model")
    return ["export", str(save_ckpt(tmp / "ckpt.pth")), "--onnx", str(tmp / "model.onnx"), "--force"]


def export_onto_a_folder(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    _user_files(tmp / "models")
    return ["export", str(save_ckpt(tmp / "ckpt.pth")), "--onnx", str(tmp / "models"), "--force"]


def junit_onto_a_user_file(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    (tmp / "results.xml").write_text("<results>mine</results>")
    return ["verify", str(ckpt), str(ckpt), "--junit", str(tmp / "results.xml"), "--samples", "2"]


CASES: list[tuple[Callable[[Path, pytest.MonkeyPatch], list[str]], str]] = [
    (out_dot_in_a_folder_of_user_files, "is the current folder"),
    (out_empty_string, "is the current folder"),
    (out_parent_of_the_current_folder, "holds the current folder"),
    (out_home, "is the home folder"),
    (out_root, "is the root folder"),
    (out_a_regular_file, "is an existing file"),
    (out_a_folder_of_user_files, "no report.json of slabconv"),
    (out_slabconv_folder_with_a_user_file_added, "my_notes.md, which slabconv did not write"),
    (out_the_folder_of_the_input, "is a folder that holds the input"),
    (out_inside_an_input_folder, "is inside the input folder"),
    (out_dangling_link, "is a symbolic link"),
    (out_link_to_a_user_folder, "is a symbolic link"),
    (out_name_too_long, "has 300 characters"),
    (out_under_a_file, "is a file, not a folder"),
    (export_onto_a_user_file, "slabconv did not write it"),
    (export_onto_a_folder, "is a folder"),
    (junit_onto_a_user_file, "slabconv did not write it"),
]


@pytest.mark.parametrize("case, phrase", CASES, ids=[c.__name__ for c, _ in CASES])
def test_outputs_never_replace_what_slabconv_did_not_write(
    case: Callable[[Path, pytest.MonkeyPatch], list[str]],
    phrase: str,
    tmp_path: Path,
    tiny_fused: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.fused = tiny_fused  # type: ignore[attr-defined]
    args = case(tmp_path, monkeypatch)
    before = {p: os.readlink(p) if p.is_symlink() else p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    contents = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    result = runner.invoke(app, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert phrase in lines[0], lines[0]
    after = {p: os.readlink(p) if p.is_symlink() else p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert after.keys() == before.keys(), sorted(map(str, after.keys() ^ before.keys()))
    assert {p: p.read_bytes() for p in contents} == contents


def test_an_empty_folder_is_filled_and_force_replaces_slabconvs_own_output(tmp_path: Path, tiny_fused: Path) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    (tmp_path / "empty").mkdir()
    for force in ([], ["--force"]):  # empty (nothing to lose: no --force needed), then slabconv's own
        args = ["fuse", str(ckpt), "--out", str(tmp_path / "empty"), *force, "--no-onnx", "--samples", "4"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["model.pt2", "model.safetensors", "report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth", "empty"]


def test_export_force_replaces_only_an_onnx_slabconv_wrote(tmp_path: Path, tiny_fused: Path) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    target = tmp_path / "model.onnx"
    assert runner.invoke(app, ["export", str(ckpt), "--onnx", str(target)]).exit_code == 0
    first = target.read_bytes()
    result = runner.invoke(app, ["export", str(ckpt), "--onnx", str(target), "--force", "--no-fuse"])
    assert result.exit_code == 0, result.stderr
    assert target.read_bytes() != first  # replaced: it was slabconv's


def test_a_full_disk_names_the_users_out_not_the_staging_folder(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(args[1]))

    monkeypatch.setattr(pipeline, "save_safetensors", full)
    out = tmp_path / "out"
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(out), "--no-onnx"])
    assert result.exit_code == 2
    [line] = error_lines(result.stderr)
    expected = f"error: cannot write {out}: No space left on device; nothing was written (free space or choose another"
    assert line == expected + " location)", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth"]


def test_a_missing_parent_folder_is_created_and_removed_again_on_failure(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    monkeypatch.setattr(pipeline, "save_safetensors", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(tmp_path / "a" / "b" / "out"), "--no-onnx"])
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth"]


def test_two_runs_to_one_new_out_exactly_one_wins(tmp_path: Path, tiny_fused: Path) -> None:
    """Whatever the timing, one run publishes a complete folder and the other exits 2 saying it exists."""
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "slabconv", "fuse", str(ckpt), "--out", str(out), "--no-onnx", "--samples", "4"]
    runs = [subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = sorted(r.wait(timeout=300) for r in runs)
    errors = [r.stderr.read() for r in runs if r.returncode == 2]  # type: ignore[union-attr]
    assert codes == [0, 2], codes
    [line] = error_lines(errors[0])
    assert "already exists" in line, errors
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "model.safetensors", "report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth", "out"]
    assert snapshot(out)  # complete and readable
