"""The console entry point (``slabconv.cli.run``) leaves through ``leave``: the exit status of the command, every
line it printed, the ``atexit`` hooks run, and no interpreter teardown. Its help, version, ``list``, shell completion
and the errors about paths, names and options answer without loading torch, numpy or the runtimes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.version import __version__

BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
"""The environment with standard streams buffered as a user's are, so output left unflushed would be lost."""


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=BUFFERED)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", textwrap.dedent(code), *args])


def test_a_piped_command_prints_all_its_output_and_exits_0():
    proc = _run([sys.executable, "-m", "slabconv", "list"])
    in_process = CliRunner().invoke(app, ["list"])
    assert proc.returncode == 0 == in_process.exit_code, proc.stderr
    assert proc.stdout == in_process.stdout and proc.stdout.count("\n") > 10  # nothing left in a buffer


def test_an_error_keeps_its_status_and_message(tmp_path: Path):
    missing = tmp_path / "no-such-model.pth"
    proc = _run([sys.executable, "-m", "slabconv", "fuse", str(missing), "--out", str(tmp_path / "out")])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {missing}: no such file"
    assert not (tmp_path / "out").exists()


def test_atexit_hooks_run_before_the_process_ends(tmp_path: Path):
    mark = tmp_path / "hook-ran"
    proc = _python(
        """
        import atexit, sys
        mark = sys.argv[1]
        atexit.register(lambda: open(mark, "w").write("ran"))
        sys.argv = ["slabconv", "--version"]
        from slabconv.cli import run
        run()
        print("not reached")
        """,
        str(mark),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"slabconv {__version__}\n"
    assert mark.read_text() == "ran"


def test_leave_follows_system_exits_conventions():
    for code, status, stderr in (("None", 0, ""), ("3", 3, ""), ("'went wrong'", 1, "went wrong\n")):
        proc = _python(f"from slabconv.cli.app import leave\nprint('before')\nleave({code})\nprint('after')")
        assert (proc.returncode, proc.stdout, proc.stderr) == (status, "before\n", stderr), code


HEAVY = ("torch", "numpy", "onnx", "onnxruntime", "transformers", "safetensors", "sympy")
"""What a command that only prints its help must not import: these take seconds to load."""


def _light_run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the console script (``slabconv``, as a shell runs it) under ``-X importtime`` and check that it imported
    none of ``HEAVY``."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(Path(sys.executable).parent / "slabconv"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**BUFFERED, **(env or {})},
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "slabconv.cli.app" in imported  # the probe sees the CLI's own imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    return proc


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"], *([command, "--help"] for command in ("fuse", "verify", "bench", "inspect", "export"))],
    ids=" ".join,
)
def test_help_and_version_start_without_the_heavy_libraries(args: list[str]):
    """``--help`` and ``--version`` answer in a fraction of a second: the command modules import torch, numpy and
    the runtimes only inside the commands. ``-X importtime`` names every module the real entry point imported."""
    proc = _light_run(args)
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout or proc.stdout == f"slabconv {__version__}\n"


MISSING = "no-such-model.pth"


@pytest.mark.parametrize(
    "args, message",
    [
        (["list"], None),
        (["list", "--json"], None),
        (["fuse", MISSING], f"error: {MISSING}: no such file"),
        (["inspect", MISSING, "--arch", "deit_prepbn"], f"error: {MISSING}: no such file"),
        (["export", MISSING, "--onnx", "out.onnx"], f"error: {MISSING}: no such file"),
        (["verify", MISSING, "fixtures/digits-prepbn/checkpoint.pth"], f"error: {MISSING}: no such file"),
        (["bench", MISSING], f"error: {MISSING}: no such file"),
        (["fuse", "fixtures/digits-prepbn/checkpoint.pth", "--arch", "deit_tiyn"], "error: unknown architecture"),
        (["fuse", "fixtures/digits-prepbn/checkpoint.pth", "--out", "README.md"], "error: --out README.md is an"),
        (["fuse", "fixtures/digits-prepbn/checkpoint.pth", "--dtype", "fp8"], "error: --dtype fp8: choose"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_path_errors_and_list_start_without_the_heavy_libraries(args: list[str], message: str | None):
    """A mistyped path, architecture, output or dtype is answered, and ``slabconv list`` printed, before torch is
    imported: paths and names are checked first (``slabconv.load.paths``, ``slabconv.zoo.names``), the zoo's table
    is data, and the API imports the stages inside its functions."""
    proc = _light_run(args)
    if message is None:
        assert proc.returncode == 0 and "deit_tiny_prepbn" in proc.stdout
    else:
        assert proc.returncode == 2
        last = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")][-1]
        assert last.startswith(message), last


def test_completion_of_arch_starts_without_the_heavy_libraries_and_keeps_the_typed_case():
    env = {"_SLABCONV_COMPLETE": "complete_bash", "COMP_WORDS": "slabconv fuse x.pth --arch DEIT_T", "COMP_CWORD": "4"}
    proc = _light_run([], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["DEIT_TINY_PREPBN", "DEIT_T_PREPBN"]
