"""Output that fits where it goes (issue 16): every command piped (full names, one progress line per stage on
stderr, nothing on stderr with --quiet), the live progress display on a terminal, colours only on a terminal
without NO_COLOR, usage lines, examples and shared options in --help, and shell completion."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.cli.output import Output
from tests.conftest import FIXTURE, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("captures_shared")]  # one trace a model: conftest.py

TEXT = ROOT / "fixtures" / "text-prepbn"
COMMANDS = ("fuse", "inspect", "export", "verify", "bench", "list")
STAGE = re.compile(r"\[ *\d+\.\ds\] (\S.*)")
runner = CliRunner()


def _stages(stderr: str) -> list[str]:
    """The stage names of the plain progress lines; fails on any other line."""
    lines = stderr.splitlines()
    matches = [STAGE.fullmatch(line) for line in lines]
    assert all(matches), lines
    names = [m.group(1) for m in matches if m]
    assert len(names) == len(set(names)), f"a stage printed twice: {names}"
    return names


def _plain(result) -> None:  # noqa: ANN001 - click's Result
    assert "…" not in result.stdout + result.stderr, "a cut name"
    assert "\x1b[" not in result.stdout + result.stderr, "colour or cursor codes off a terminal"
    assert all(line == line.rstrip() for line in result.stdout.splitlines()), "padding to a terminal width"


def test_inspect_of_the_text_model_names_every_norm_and_projection_whole():
    result = runner.invoke(app, ["inspect", str(TEXT)])
    assert result.exit_code == 0, result.output
    _plain(result)
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("model.")}
    assert "model.layers.1.post_attention_layernorm" in rows
    into = rows["model.layers.1.input_layernorm"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}" in into, into
    assert _stages(result.stderr) == [f"loading {TEXT}", "tracing the model with torch.export", "folding norms"]


def test_export_verify_and_list_piped(tmp_path):
    onnx = tmp_path / "fused.onnx"
    result = runner.invoke(app, ["export", str(FIXTURE / "checkpoint.pth"), "--onnx", str(onnx)])
    assert result.exit_code == 0, result.output
    _plain(result)
    assert result.stdout.splitlines()[-1] == f"wrote {onnx} (9 norms: 9 folded away, 0 kept)"
    assert sum(line.startswith("wrote") for line in result.stdout.splitlines()) == 1
    assert "blocks.3.norm2" in result.stdout and _stages(result.stderr)[-1] == "exporting fused.onnx"

    result = runner.invoke(app, ["verify", str(FIXTURE / "checkpoint.pth"), str(onnx)])
    assert result.exit_code == 0, result.output
    _plain(result)
    assert result.stdout.splitlines()[-1] == "verification PASSED"
    assert "output @ onnxruntime[all-optimizations]" in result.stdout
    assert _stages(result.stderr)[0] == "opening the reference and the candidate"

    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0 and result.stderr == ""
    _plain(result)
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[2:]}
    for spec in json.loads(runner.invoke(app, ["list", "--json"]).stdout):
        assert f"   {', '.join(spec['aliases'])}   " in rows[spec["name"]], rows[spec["name"]]  # aliases whole


def test_list_through_a_real_pipe_shows_every_alias_whole():
    proc = subprocess.run(
        f"{sys.executable} -m slabconv list | cat", shell=True, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stderr == ""
    assert "slab_cswin_s, SLAB_CSWin_small, SLAB_CSWin_64_24322_small_224" in proc.stdout
    assert "…" not in proc.stdout


def test_quiet_prints_the_last_line_only_and_nothing_on_stderr(tmp_path):
    result = runner.invoke(app, ["inspect", str(FIXTURE / "checkpoint.pth"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout == "9 norms: 9 would fold away, 0 would be kept\n"
    result = runner.invoke(app, ["inspect", str(FIXTURE / "checkpoint.pth"), "--json"])
    assert json.loads(result.stdout)["summary"]["norms"] == 9  # stdout is the JSON alone
    assert _stages(result.stderr)  # progress still on stderr


def _fake_bench(monkeypatch: pytest.MonkeyPatch, spreads: dict[int, tuple[float, float, float]]) -> None:
    """Replace the timing loop: per batch size, fused p25/median/p75 over a norm-free 1.0/1.0/1.0 ms."""
    from slabconv import bench

    def timings(model, example, batches, runtimes, warmup, repeats, progress):  # noqa: ANN001
        progress("timing pytorch, batch 1")
        out = []
        for batch, (p25, median, p75) in spreads.items():
            for variant, (a, m, b) in {"fused": (p25, median, p75), "norm-free": (1.0, 1.0, 1.0)}.items():
                out.append(bench.Timing(variant, "pytorch", batch, m, a, b, batch * 1000 / m))
        return out

    monkeypatch.setattr(bench, "bench_models", timings)


def test_bench_gives_each_ratio_its_spread_and_flags_the_ones_it_cannot_read(monkeypatch, tmp_path):
    _fake_bench(monkeypatch, {1: (0.99, 1.0, 1.01), 8: (0.95, 1.05, 1.1), 16: (0.68, 0.71, 0.74), 64: (0.8, 1.1, 1.3)})
    result = runner.invoke(app, ["bench", str(FIXTURE / "checkpoint.pth"), "--runtime", "pytorch"])
    assert result.exit_code == 0, result.output
    _plain(result)
    lines = result.stdout.splitlines()
    assert "fused / norm-free (pytorch, batch 1): 1.00 (p25-p75 spread 0.99-1.01)" in lines
    assert (
        "fused / norm-free (pytorch, batch 8): 1.05 (p25-p75 spread 0.95-1.10); the spread includes 1.00: no "
        "difference measurable in this run" in lines
    )
    below = next(line for line in lines if "batch 16" in line)  # fused faster than the bound it equals: noise
    assert below.startswith("fused / norm-free (pytorch, batch 16): 0.71 (p25-p75 spread 0.68-0.74); warning: below")
    noisy = next(line for line in lines if "batch 64" in line)
    assert noisy.startswith("fused / norm-free (pytorch, batch 64): 1.10 (p25-p75 spread 0.80-1.30); warning: too")


def test_bench_says_where_it_wrote_the_plot(monkeypatch, tmp_path):
    from slabconv import bench

    _fake_bench(monkeypatch, {1: (0.99, 1.0, 1.01)})
    drawn: list[Path] = []
    monkeypatch.setattr(bench, "plot", lambda timings, path: drawn.append(path) or path.write_bytes(b"png"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if matplotlib were installed
    args = ["bench", str(FIXTURE / "checkpoint.pth"), "--runtime", "pytorch", "--plot", str(tmp_path / "b.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert drawn == [tmp_path / "b.png"] and result.stdout.splitlines()[-1] == f"wrote {tmp_path / 'b.png'}"


def test_bench_plot_has_error_bars_from_p25_to_p75(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from slabconv import bench

    bars: dict[str, object] = {}
    real_bar = Axes.bar

    def bar(self, x, height, *args, **kwargs):
        bars[kwargs["label"]] = (list(height), kwargs.get("yerr"))
        return real_bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", bar)
    timings = [bench.Timing("fused", "pytorch", 1, 2.0, 1.5, 4.0, 500.0)]
    timings.append(bench.Timing("norm-free", "pytorch", 1, 1.0, 0.9, 1.2, 1000.0))
    bench.plot(timings, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert bars["fused"] == ([2.0], [[0.5], [2.0]])  # median 2.0, down to p25 1.5, up to p75 4.0
    low, high = bars["norm-free"][1]
    assert bars["norm-free"][0] == [1.0] and low == pytest.approx([0.1]) and high == pytest.approx([0.2])


def test_a_real_bench_run_prints_no_library_warning():
    args = ["bench", str(FIXTURE / "checkpoint.pth"), "--runtime", "pytorch", "--batch", "1", "--repeats", "3"]
    result = runner.invoke(app, [*args, "--warmup", "0"])
    assert result.exit_code == 0, result.output
    _plain(result)
    assert _stages(result.stderr) == ["tracing the model (float32)", "timing pytorch, batch 1"]
    assert "fused / norm-free (pytorch, batch 1): " in result.stdout


def test_a_terminal_gets_the_live_progress_display():
    """On a terminal: each stage with a bar, its count and elapsed time, finished stages ticked."""
    err = Console(file=io.StringIO(), force_terminal=True, width=100, color_system="standard")
    output = Output(err=err, out=Console(file=io.StringIO(), force_terminal=True))
    with output.progress() as progress:
        progress("loading checkpoint.pth")
        for done in range(10):
            progress("folding norms", done, 9)
        progress("writing model.safetensors")
    text = err.file.getvalue()  # type: ignore[attr-defined]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    final = plain.splitlines()[-3:]
    assert [line.split()[1] for line in final] == ["loading", "folding", "writing"], final
    assert all(line.split()[0] == "✓" for line in final), final  # each stage finished
    assert "━" in final[1] and "9/9" in final[1] and re.search(r"0:00:0\d", final[1]), final
    assert "\x1b[" in text  # a live display redraws in place


@pytest.mark.parametrize("tty, no_color, coloured", [(True, False, True), (True, True, False), (False, False, False)])
def test_colours_only_on_a_terminal_without_no_color(monkeypatch, tty, no_color, coloured):
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(sys, "stdout", Stream())
    monkeypatch.setattr(sys, "stderr", Stream())
    output = Output()
    assert output.err.is_terminal is tty
    output.out.print("[green]ok[/green]")
    assert ("\x1b[32m" in sys.stdout.getvalue()) is coloured  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_a_plain_usage_line_and_examples(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    usage = result.stdout.splitlines()[0]
    assert usage.startswith(f"Usage: slabconv {command} [OPTIONS]") and not re.search(r"[{}]", usage), usage
    # every value is named for what it is (NPZ, FILE, DIR...), as --inputs and --junit are, never Typer's <path>
    assert not re.search(r"<\w+>", result.stdout), re.findall(r"\S+ <\w+>", result.stdout)
    examples = result.stdout.split("Examples:")[1].split("\n\n")[1].splitlines()
    assert examples and all(line.startswith(f"    slabconv {command}") for line in examples), examples


def test_an_option_means_the_same_on_every_command():
    """Each option is defined once (slabconv/cli/options.py): the same name has the same help everywhere, and
    the loading and sampling options are on every command that loads or samples."""
    from typer.main import get_command

    from slabconv.cli.app import app as typer_app

    group = get_command(typer_app)
    helps: dict[str, set[str]] = {}
    names: dict[str, set[str]] = {}
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        names[name] = {opt for p in command.params for opt in p.opts}
        for param in command.params:
            if param.param_type_name == "option":
                helps.setdefault(param.opts[0], set()).add(param.help or "")
    # These do a different job on each command, and each command's --help says its own (issue 24): fuse's
    # --stream folds, verify's compares; bench's --runtime times, verify's --runtime checks; --plot draws each's.
    command_specific = {"--stream", "--generate", "--runtime", "--plot"}  # bench: timings; verify: --localize
    differing = {opt: h for opt, h in helps.items() if len(h) > 1 and opt not in command_specific}
    assert not differing, differing
    for name in ("fuse", "inspect", "export", "verify", "bench"):
        assert {"--arch", "--trust-pickle", "--input-shape", "--image-size", "--ema"} <= names[name], name
    for name in ("fuse", "verify"):
        assert {"--samples", "--seed", "--inputs", "--rtol", "--atol", "--strict"} <= names[name], name


def test_install_completion_installs_a_script_that_completes(tmp_path):
    script = Path(sys.executable).parent / "slabconv"
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    # Typer finds the user's shell among the process's ancestors (shellingham); a test runner started outside a
    # shell has none ("Shell None is not supported"), so the shell is named, as Typer's own tests do.
    env["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"] = "1"
    proc = subprocess.run([script, "--install-completion", "bash"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    installed = (tmp_path / ".bash_completions" / "slabconv.sh").read_text()
    assert "_SLABCONV_COMPLETE=complete_bash" in installed
    assert "slabconv.sh" in (tmp_path / ".bashrc").read_text()

    def complete(words: str) -> list[str]:
        env_complete = {**env, "_SLABCONV_COMPLETE": "complete_bash", "COMP_WORDS": words}
        env_complete["COMP_CWORD"] = str(len(words.split()) - 1)
        done = subprocess.run([script], env=env_complete, capture_output=True, text=True)
        return done.stdout.split()

    assert complete("slabconv fu") == ["fuse"]
    assert complete("slabconv fuse --trust") == ["--trust-pickle"]
