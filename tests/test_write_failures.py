"""Failures while writing or reading, and outputs that fail late (issue 37).

- A full disk while ``model.pt2`` is written ended the process with SIGABRT (torch's C++ zip writer); the limit on
  file size (``RLIMIT_FSIZE``: ``EFBIG`` past it, as ``ENOSPC`` on a full disk) stands for the disk here, in a
  child process, since the old failure killed its process.
- A shard truncated while ``--stream`` read it through a memory map killed the process with SIGBUS.
- ``bench --plot`` into a folder that cannot be written failed after the whole benchmark; ``--force`` onto a
  read-only previous output failed after the whole fuse. Both are refused before any work.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from tests import onnxcases as oc
from tests.conftest import FIXTURE, ROOT
from tests.tinyckpt import save_ckpt, snapshot, tiny_state_dict

runner = CliRunner()
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_full_disk_while_model_pt2_is_written_is_one_line_and_keeps_the_previous_output(tmp_path: Path) -> None:
    ckpt = save_ckpt(tmp_path / "tiny.pth")
    out = tmp_path / "out"
    model = oc.save(oc.base_model(), tmp_path / "m")
    assert runner.invoke(app, ["fuse", str(model), "--out", str(out), "--quiet"]).exit_code == 0  # a previous output
    weights = sum(t.numel() * t.element_size() for t in tiny_state_dict().values())
    limit = weights + (16 << 10)  # model.safetensors (the weights and a header) fits; model.pt2 (+ its program) not
    before = snapshot(tmp_path)

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    args = ["fuse", str(ckpt), "--no-onnx", "--no-verify", "--force", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "slabconv", *args], capture_output=True, text=True, env=ENV, preexec_fn=small_files
    )
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert errors == [
        f"error: cannot write {out}: File too large; nothing was written (free space or choose another location)"
    ]
    assert snapshot(tmp_path) == before, "the previous output changed, or the staging folder was left"


SHARD_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import safetensors
    from slabconv.errors import InputError
    from slabconv.load import safety, shards

    folder = Path(sys.argv[1])
    path = folder / "model.safetensors"
    reader = shards.LazyShards.open(folder)
    reader.specs()  # the header is read here, from the whole file

    def truncating(opener):
        def opened(*args, **kwargs):
            handle = opener(*args, **kwargs)  # a memory map, or a file
            os.truncate(path, 4096)
            return handle
        return opened

    safety.open_regular = truncating(safety.open_regular)
    safetensors.safe_open = truncating(safetensors.safe_open)
    try:
        print("read", float(reader.get("w").sum()))  # the values used: a mapped page past the end faults here
    except InputError as err:
        print(err)
    """
)


def test_a_shard_truncated_while_it_is_read_is_named_not_a_sigbus(tmp_path: Path) -> None:
    """The shard shrinks right after whatever the reader opens it with (both openers are wrapped): a read past the
    new end of a mapped file is SIGBUS; a read() is short, and named."""
    save_file({"w": torch.ones(1 << 18)}, str(tmp_path / "model.safetensors"))  # 1 MiB of data
    result = subprocess.run(
        [sys.executable, "-c", SHARD_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith(f"{tmp_path / 'model.safetensors'}: the file changed while slabconv read it ("), (
        result.stdout
    )


def test_a_shard_that_ends_inside_a_tensor_is_a_short_read(tmp_path: Path) -> None:
    """The read itself (the identity check passed, the file shrank during the read): the bytes that are missing are
    named, never read as zeros."""
    from slabconv.errors import InputError
    from slabconv.load import shards

    save_file({"w": torch.ones(1 << 18)}, str(tmp_path / "model.safetensors"))
    reader = shards.LazyShards.open(tmp_path)
    layout = reader._layout("model.safetensors")
    with open(tmp_path / "model.safetensors", "rb") as f:
        os.truncate(tmp_path / "model.safetensors", 4096)
        with pytest.raises(InputError, match=r"changed while slabconv read it \(it ends inside tensor 'w'\)"):
            reader._read(f, layout, "w", None, tmp_path / "model.safetensors")


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder no file can be created in: a read-only one for a normal user; for root (whom permissions do not
    stop), sysfs, which refuses new files to root too."""
    if os.geteuid() != 0:
        folder = tmp_path / "locked"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    sysfs = Path("/sys/kernel")
    if not sysfs.is_dir():
        pytest.skip("running as root without /sys/kernel: no folder here refuses root a new file")
    return sysfs


def test_bench_plot_into_an_unwritable_folder_is_refused_before_any_timing(tmp_path: Path) -> None:
    folder = _unwritable_folder(tmp_path)
    plot = folder / "bench.png"
    args = ["bench", str(FIXTURE / "checkpoint.pth"), "--runtime", "pytorch", "--batch", "1", "--repeats", "1"]
    result = runner.invoke(app, [*args, "--warmup", "0", "--plot", str(plot)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --plot cannot write to {folder}: permission denied; choose a writable output location"
    ], "refused after the timing started"
    assert not plot.exists()


def test_force_onto_a_read_only_previous_output_is_refused_before_the_work(tmp_path: Path, monkeypatch) -> None:
    """The atomic swap moves the old output into the staging folder and removes it, which a read-only folder
    refuses: after the whole fuse. Root is not stopped by permissions, so for root ``os.access`` answers as the
    folder's mode does for its owner (what the check asks)."""
    model = oc.save(oc.base_model(), tmp_path / "m")
    out = tmp_path / "out"
    assert runner.invoke(app, ["fuse", str(model), "--out", str(out), "--quiet"]).exit_code == 0
    out.chmod(0o555)
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode, **kw: access(p, mode, **kw) and (Path(p) != out or not mode & os.W_OK)
        )
    before = snapshot(tmp_path)
    try:
        result = runner.invoke(app, ["fuse", str(model), "--out", str(out), "--force"])
    finally:
        out.chmod(0o755)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --out {out} is read-only, and --force moves the old output aside and removes it; make it writable "
        "(chmod -R u+w) or choose a new folder"
    ], "refused after the fuse"
    assert snapshot(tmp_path) == before
