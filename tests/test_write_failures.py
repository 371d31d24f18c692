"""Failures while writing or reading, and outputs that fail late (issue 37).

- A full disk while ``model.pt2`` is written ended the process with SIGABRT (torch's C++ zip writer); the limit on
  file size (``RLIMIT_FSIZE``: ``EFBIG`` past it, as ``ENOSPC`` on a full disk) stands for the disk here.
- A shard truncated while ``--stream`` read it through a memory map killed the process with SIGBUS.
- ``bench --plot`` into a folder that cannot be written failed after the whole benchmark; ``--force`` onto a
  read-only previous output failed after the whole fuse. Both are refused before any work.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from tests import onnxcases as oc
from tests.conftest import FIXTURE
from tests.tinyckpt import error_lines, save_ckpt, snapshot, tiny_state_dict

runner = CliRunner()


def test_a_full_disk_while_model_pt2_is_written_is_one_line_and_keeps_the_previous_output(tmp_path: Path) -> None:
    """In this process (on main it ended the process with SIGABRT: torch's zip writer called std::terminate)."""
    ckpt = save_ckpt(tmp_path / "tiny.pth")
    out = tmp_path / "out"
    model = oc.save(oc.base_model(), tmp_path / "m")
    assert runner.invoke(app, ["fuse", str(model), "--out", str(out), "--quiet"]).exit_code == 0  # a previous output
    weights = sum(t.numel() * t.element_size() for t in tiny_state_dict().values())
    limit = weights + (16 << 10)  # model.safetensors (the weights and a header) fits; model.pt2 (+ its program) not
    before = snapshot(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # CPython ignores SIGXFSZ: a write past it is EFBIG
    try:
        result = runner.invoke(app, ["fuse", str(ckpt), "--no-onnx", "--no-verify", "--force", "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert result.exit_code == 2, result.output
    assert error_lines(result.stderr) == [
        f"error: cannot write {out}: File too large; nothing was written (free space or choose another location)"
    ]
    assert snapshot(tmp_path) == before, "the previous output changed, or the staging folder was left"


def test_a_shard_truncated_while_it_is_read_is_named_not_a_sigbus(tmp_path: Path, monkeypatch) -> None:
    """The shard shrinks right after whatever the reader opens it with (both openers are wrapped): a read past the
    new end of a mapped file is SIGBUS (on main this test ends the process); a read() is short, and named."""
    import safetensors

    from slabconv.errors import InputError
    from slabconv.load import safety, shards

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(1 << 18)}, str(path))  # 1 MiB of data
    reader = shards.LazyShards.open(tmp_path)
    reader.specs()  # the header is read here, from the whole file

    def truncating(opener):  # noqa: ANN001, ANN202
        def opened(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            handle = opener(*args, **kwargs)  # a memory map, or a file
            os.truncate(path, 4096)
            return handle

        return opened

    monkeypatch.setattr(safety, "open_regular", truncating(safety.open_regular))
    monkeypatch.setattr(safetensors, "safe_open", truncating(safetensors.safe_open))
    with pytest.raises(InputError) as caught:
        float(reader.get("w").sum())  # the values used: a mapped page past the end faults here
    assert str(caught.value).startswith(f"{path}: the file changed while slabconv read it ("), caught.value


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


def test_a_memory_limit_the_user_set_is_the_memory_available(monkeypatch) -> None:
    """``ulimit -v`` (``RLIMIT_AS``) bounds what the process may still allocate: the generation check's refusal
    compares its need with what the limit leaves, not with the machine's free memory."""
    from slabconv.verify import generate

    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("no /proc/self/status")
    used = next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))
    try:
        have = generate.available_memory()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert have is not None and 0 <= have <= 256 << 20, have
    monkeypatch.setattr(generate, "_rlimit_left", lambda: None)
    monkeypatch.setattr(generate, "_cgroup_left", lambda: 100 << 20)  # a container's limit: what it leaves
    assert generate.available_memory() == min(100 << 20, generate._meminfo("MemAvailable") or 100 << 20)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cgroup_limit_leaves_its_limit_less_what_is_used_its_inactive_page_cache_aside(tmp_path: Path, version):
    """A container's memory limit: what is left is the limit less the usage, where the usage's inactive page cache
    (files read, which the kernel reclaims under the limit) counts as free, as MemAvailable counts it."""
    from slabconv.verify import generate

    mib = 1 << 20
    mounts = tmp_path / "cgroup"
    if version == "v2":
        proc, folder = "0::/job\n", mounts / "job"
        files = {"memory.max": 1000 * mib, "memory.current": 800 * mib}
        stat = f"anon 100\ninactive_file {300 * mib}\nactive_file {50 * mib}\n"
    else:
        proc, folder = "4:memory:/job\n3:cpu:/\n", mounts / "memory" / "job"
        files = {"memory.limit_in_bytes": 1000 * mib, "memory.usage_in_bytes": 800 * mib}
        stat = f"cache {350 * mib}\ntotal_inactive_file {300 * mib}\n"
    folder.mkdir(parents=True)
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    (folder / "memory.stat").write_text(stat)
    (tmp_path / "cgroup.txt").write_text(proc)
    assert generate._cgroup_left(tmp_path / "cgroup.txt", mounts) == 500 * mib
    (folder / "memory.stat").unlink()  # no stat: the usage as it is
    assert generate._cgroup_left(tmp_path / "cgroup.txt", mounts) == 200 * mib


def test_an_allocation_the_system_refuses_is_one_line_exit_2_and_nothing_is_written(tmp_path: Path, monkeypatch):
    """A failed allocation (torch's "can't allocate memory" under a memory limit, or a MemoryError) names memory and
    the ways forward, not 'internal error ... a bug in slabconv'."""
    from slabconv import pipeline

    ckpt = save_ckpt(tmp_path / "tiny.pth")
    torch_text = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 524288000 bytes. Error code 12 (Cannot allocate memory)"
    )
    for error, asked in ((RuntimeError(torch_text), " (an allocation of 0.49 GiB failed)"), (MemoryError(), "")):
        monkeypatch.setattr(pipeline, "save_safetensors", lambda *a, e=error, **k: (_ for _ in ()).throw(e))
        before = snapshot(tmp_path)
        result = runner.invoke(app, ["fuse", str(ckpt), "--no-onnx", "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        [line] = error_lines(result.stderr)
        assert line.startswith(f"error: out of memory{asked}: this machine (or its memory limit: ulimit -v"), line
        assert "--stream" in line and "internal error" not in line
        assert snapshot(tmp_path) == before


SIGNAL_WHILE_TORCH_WRITES = """
import os, signal, sys
from pathlib import Path
import torch
from slabconv.cli.app import install_signal_handlers
from slabconv.write import pt2
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a test runner may ignore SIGINT)
install_signal_handlers()
program = torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),))
real, sent = pt2._Guarded.write, []
def write(self, data):  # Ctrl-C while torch's zip writer is writing the file
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
    return real(self, data)
pt2._Guarded.write = write
try:
    pt2.save_pt2(program, {}, Path(sys.argv[1]))
except KeyboardInterrupt:
    torch.export.load(sys.argv[1])
    print("interrupted after the file was written whole")
    sys.exit(130)
"""


def test_a_signal_while_torch_writes_model_pt2_ends_the_run_once_the_file_is_whole(tmp_path):
    """A ``KeyboardInterrupt`` unwinding through torch's zip writer leaves a broken file or aborts the process (its
    destructor throws "unexpected pos": SIGABRT, the staging folder left behind). The interrupt is held while
    torch writes (``errors.HeldInterrupts``) and raised once the file is whole, so the run ends as any interrupted
    run does."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_WHILE_TORCH_WRITES, str(tmp_path / "model.pt2")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stdout.strip() == "interrupted after the file was written whole"
