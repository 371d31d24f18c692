"""A new user's first hour (issue 24): exit codes a shell can trust, text that is never read as markup, narrow
terminals, options that are checked before the work, and the Python API's own spelling of advice."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from slabconv import api
from slabconv.cli import app
from slabconv.cli.output import Output
from slabconv.engine import Decision
from slabconv.errors import InputError, UsageError, in_python
from slabconv.load.source import Source
from slabconv.report.data import Report
from slabconv.report.render import folds_table
from slabconv.zoo import get_arch
from tests.conftest import FIXTURE, ROOT

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

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


def as_at_a_terminal() -> None:
    """``preexec_fn`` of a child that must take Ctrl-C as a terminal gives it: a shell starts background jobs (and
    whatever runs under them, the test suite included) with SIGINT ignored, and Python keeps that, so the child's
    SIGINT would be dropped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_exits_130_and_writes_nothing(tmp_path, sig):
    out, log = tmp_path / "fused", tmp_path.parent / f"{tmp_path.name}-stderr.txt"
    with open(log, "w") as stderr:
        proc = _slabconv(
            "fuse", str(CKPT), "--out", str(out), stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=as_at_a_terminal
        )
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


LOST_INTERRUPT = """
import signal, sys
from slabconv import pipeline
from slabconv.cli.app import run

class Collected:  # what the garbage collector frees mid-run; its __del__ is where the signal's handler runs
    def __del__(self):
        signal.raise_signal(signal.{sig})

save = pipeline.save_safetensors

def save_while_a_signal_lands_in_a_finalizer(*args, **kwargs):
    Collected()  # dropped at once: the handler's KeyboardInterrupt is raised inside __del__, where Python loses it
    return save(*args, **kwargs)

pipeline.save_safetensors = save_while_a_signal_lands_in_a_finalizer
sys.argv = ["slabconv", "fuse", sys.argv[1], "--out", sys.argv[2]]
run()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_lost_in_a_finalizer_still_exits_130_and_writes_nothing(tmp_path, sig):
    """Python runs a signal handler between two bytecodes, which may be inside a ``__del__`` or a weakref callback
    that the garbage collector runs; a KeyboardInterrupt raised there is printed as "Exception ignored" and lost.
    The run must still end at its next step with 130 and publish nothing (a lost SIGTERM once let a run end 0)."""
    out = tmp_path / "fused"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", LOST_INTERRUPT.format(sig=sig), str(CKPT), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=as_at_a_terminal,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines()[-1] == "interrupted; nothing was written"
    assert "Exception ignored" not in done.stderr
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "a staging folder was left behind"


@pytest.mark.parametrize("terminal", [False, True])
def test_an_interrupt_inside_a_printed_line_still_prints_the_interrupted_line(monkeypatch, terminal):
    """A signal lands between two bytecodes, which may be inside Rich's ``Console.print`` just after it opened its
    buffer and before its ``with`` block took hold: the block never closes, and every later line through that
    console stays in the buffer. The interrupted line must still reach stderr, last (a SIGHUP in CI once ended a
    run with 130 whose stderr stopped at the progress line it landed in)."""
    from slabconv.cli.errors import errors

    buf = io.StringIO()
    err = Console(file=buf, width=100, force_terminal=terminal, no_color=True)
    output = Output(err=err, out=Console(file=io.StringIO()))
    opened = Console._enter_buffer
    calls = []

    def signal_lands_here(console: Console) -> None:
        opened(console)
        calls.append(1)
        if len(calls) == 2:  # the second line: the first is already out
            raise KeyboardInterrupt

    monkeypatch.setattr(Console, "_enter_buffer", signal_lands_here)
    with pytest.raises(typer.Exit) as exit_, errors(output, debug=False):
        output.error("[    3.2s] loading a.pth")
        output.error("[    3.3s] tracing the model with torch.export")
    assert exit_.value.exit_code == 130
    assert buf.getvalue().splitlines() == ["[    3.2s] loading a.pth", "interrupted; nothing was written"]


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


# --------------------------------------------------------------------------------------------- inputs before outputs

runner = CliRunner()


def test_a_mistyped_checkpoint_is_named_before_an_existing_output(tmp_path):
    out = tmp_path / "checkpoint-fused"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = runner.invoke(app, ["fuse", str(tmp_path / "checkpoint.pt"), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'checkpoint.pt'}: no such file"


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("", "is a folder without config.json and weights"),
        (
            str(FIXTURE / "holdout.npz"),
            "is a numpy .npz archive (verification inputs), not a checkpoint; give it with --inputs",
        ),
        ("xinghaochen/SLAB", "hf download xinghaochen/SLAB --local-dir SLAB"),
    ],
)
@pytest.mark.parametrize("command", ["fuse", "inspect"])
def test_a_wrong_input_gets_one_line_saying_what_to_give(command, arg, expected):
    result = runner.invoke(app, [command, arg])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert "internal error" not in lines[0] and "enforce fail" not in lines[0]


def test_the_api_checks_option_types():
    with pytest.raises(TypeError, match=r"load must be a LoadOptions .* load=LoadOptions\(arch="):
        api.inspect(CKPT, load={"arch": "deit_prepbn"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="write must be a WriteOptions"):
        api.fuse(CKPT, write={"force": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify must be a VerifyOptions"):
        api.verify(CKPT, CKPT, verify={"samples": 5})  # type: ignore[arg-type]


def test_the_api_gives_its_advice_in_python_and_the_cli_in_flags(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")  # not slabconv's report: force would not replace the folder either
    with pytest.raises(UsageError) as err:
        api.fuse(CKPT, out)
    assert "so WriteOptions(force=True) will not replace it" in str(err.value) and "--force" not in str(err.value)
    with pytest.raises(InputError) as err:
        api.fuse(FIXTURE / "holdout.npz")
    assert "give it with VerifyOptions(inputs=...)" in str(err.value)
    result = runner.invoke(app, ["fuse", str(CKPT), "--out", str(out)])
    assert result.exit_code == 2 and "so --force will not replace it" in result.stderr


def test_advice_in_python_spelling():
    assert in_python("pass --trust-pickle --input-shape 3,224,224 if you trust it") == (
        "pass LoadOptions(trust_pickle=True) LoadOptions(input_shape=(3,224,224)) if you trust it"
    )
    assert in_python("pass --arch deit_tiny_prepbn, or leave --arch out (see `slabconv list`)") == (
        "pass LoadOptions(arch='deit_tiny_prepbn'), or leave LoadOptions(arch=...) out "
        "(see `slabconv.api.architectures()`)"
    )
    assert in_python("already exists; pass --force", {"--force": "force=True"}) == "already exists; pass force=True"


def test_the_architecture_list_is_in_the_api_and_names_are_case_blind():
    archs = api.architectures()
    result = runner.invoke(app, ["list", "--json"])
    assert json.loads(result.stdout) == archs
    name = archs[0]["name"]
    assert get_arch(name.upper()).name == name and get_arch(archs[0]["aliases"][0].swapcase()).name == name


def _complete(words: str) -> list[str]:
    env = {"_SLABCONV_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
    result = runner.invoke(app, [], env=env, prog_name="slabconv")
    return result.stdout.split()


def test_arch_and_runtime_values_complete():
    names = _complete("slabconv fuse x.pth --arch deit_t")
    assert "deit_tiny_prepbn" in names and all(n.startswith("deit_t") for n in names)
    assert "slab_deit_tiny" in _complete("slabconv inspect x.pth --arch slab_d")
    # verify --runtime: see test_verify_runtime_values_complete
    assert "pytorch,onnxruntime" in _complete("slabconv bench x.pth --runtime pytorch,onnx")


# --------------------------------------------------------------------------------------------- outputs before work


@pytest.fixture
def no_work(monkeypatch):
    """Any work (loading, timing) fails the test: every output must be refused before it."""

    def work(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(api, "bench", work)
    monkeypatch.setattr(api, "load_model", work)
    monkeypatch.setattr("slabconv.verify.verifier.verify", work)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("plot.jpg", "--plot PLOT: slabconv cannot write '.jpg' files; give a name ending in .png, .svg or .pdf"),
        ("plot", "--plot PLOT: slabconv cannot write a name without an extension; give a name ending in .png"),
        ("mine.png", "--plot PLOT already exists and slabconv did not write it; choose another path"),
        ("sub", "--plot PLOT is a folder; give a file path such as PLOT/bench.png"),
    ],
)
def test_bench_plot_is_checked_before_any_timing(tmp_path, no_work, name, expected):
    (tmp_path / "mine.png").write_bytes(b"\x89PNG not ours")
    (tmp_path / "sub").mkdir()
    plot = tmp_path / name
    result = runner.invoke(app, ["bench", str(CKPT), "--runtime", "pytorch", "--plot", str(plot), "-f"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: " + expected.replace("PLOT", str(plot)))


def test_bench_plot_replaces_its_own_chart_only_with_force(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from slabconv import bench
    from slabconv.bench import Timing

    plot = tmp_path / "new" / "folder" / "b.png"
    bench.plot([Timing("fused", "pytorch", 1, 1.0, 0.9, 1.1, 1000.0)], plot)  # missing folders are made
    assert bench.plot_written_by_slabconv(plot)
    with pytest.raises(UsageError, match="already exists; pass --force to replace it"):
        bench.check_plot_path(plot, force=False, inputs=[CKPT])
    bench.check_plot_path(plot, force=True, inputs=[CKPT])


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["verify", str(CKPT), str(CKPT), "--junit", "DIR"],
            "--junit DIR is a folder; give a file path such as DIR/equivalence.xml",
        ),
        (
            ["verify", str(CKPT), str(CKPT), "--junit", "DIR/j.txt"],
            "--junit DIR/j.txt: a JUnit report is XML; give a file name ending in .xml",
        ),
        (
            ["export", str(CKPT), "--onnx", "DIR/model.txt"],
            "--onnx DIR/model.txt: give a file name ending in .onnx, e.g. model.onnx",
        ),
    ],
)
def test_report_and_model_files_are_checked_before_the_work(tmp_path, no_work, args, expected):
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: " + expected.replace("DIR", str(tmp_path)))


# --------------------------------------------------------------------------------------------- what converters offer


@pytest.mark.parametrize(
    "args, expected",
    [
        (["fuse", str(CKPT), "--dtype", "float8"], "--dtype float8: choose float16 (fp16, half), bfloat16 (bf16)"),
        (
            ["fuse", str(CKPT), "--opset", "18", "--no-onnx"],
            "--opset 18 sets the opset of the ONNX file, and --no-onnx",
        ),
        (["fuse", "x", "--stream", "--opset", "18"], "--opset 18 sets the opset of the ONNX file, and a streamed fold"),
        (["fuse", str(CKPT), "--opset", "12"], "--opset 12: slabconv writes ONNX opsets 17 to 25; choose one of them"),
        (["fuse", str(CKPT), "--dtype", "bfloat16", "--opset", "18"], "--opset 18: a bfloat16 model needs opset 22"),
        (["export", str(CKPT), "--onnx", "x.onnx", "--opset", "99"], "--opset 99: slabconv writes ONNX opsets 17"),
        (
            ["verify", str(CKPT), str(CKPT), "--runtime", "tensorrt"],
            "--runtime tensorrt: choose from onnxruntime, pytorch, openvino",
        ),
        (["fuse", "x", "--stream", "--no-onnx", "--dtype", "float16"], "--dtype does not stream"),
        # an empty --runtime is no request for the default: the run would check other runtimes than the ones asked
        (["verify", str(CKPT), str(CKPT), "--runtime", ","], "--runtime ',' names no runtime: choose from onnx"),
        (["bench", str(CKPT), "--runtime", ""], "--runtime '' names no runtime: choose from pytorch,"),
    ],
)
def test_converter_options_are_refused_before_the_work(no_work, args, expected):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith("error: " + expected), result.stderr


def test_verify_runtime_values_complete():
    assert _complete("slabconv verify a b --runtime onnx") == ["onnxruntime", "onnxruntime-int8"]
    assert _complete("slabconv verify a b --runtime open") == ["openvino"]
    assert _complete("slabconv verify a b --runtime pytorch,onnxruntime-") == ["pytorch,onnxruntime-int8"]
    assert _complete("slabconv fuse a --dtype b") == ["bfloat16"]
    assert _complete("slabconv fuse a --dtype f") == ["float16", "float32"]  # --dtype float32 is taken, and helped
    assert "or float32 (fp32" in " ".join(runner.invoke(app, ["fuse", "--help"]).stdout.split())


def test_openvino_is_refused_with_the_install_line_when_absent(no_work, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    result = runner.invoke(app, ["verify", str(CKPT), str(CKPT), "--runtime", "openvino"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --runtime openvino: OpenVINO is not installed; pip install openvino"


def test_a_runtime_that_cannot_run_the_candidate_is_refused_before_the_reference(tmp_path, monkeypatch):
    from slabconv.verify import verifier

    monkeypatch.setattr(verifier.ModelReference, "run", lambda *a, **k: pytest.fail("the reference ran first"))
    result = runner.invoke(app, ["verify", str(CKPT), str(CKPT), "--runtime", "onnxruntime"])
    assert result.exit_code == 2
    assert "--runtime onnxruntime cannot run" in result.stderr and "(runtimes that can: pytorch)" in result.stderr


@pytest.mark.slow
def test_fuse_dtype_float16_writes_a_float16_model_that_passes_verification_and_verify_agrees(tmp_path):
    import onnx
    from safetensors import safe_open

    out = tmp_path / "f16"
    result = runner.invoke(
        app,
        ["fuse", str(CKPT), "-o", str(out), "--dtype", "FP16", "--opset", "17", "--samples", "24"],  # optimum's
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].endswith(f"into {out} (float16): verification PASSED")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {__import__("torch").float16}
    model = onnx.load(str(out / "model.onnx"))
    assert model.opset_import[0].version == 17
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    report = json.loads((out / "report.json").read_text())
    v = report["verification"]
    assert v["passed"] and "first 24 of 360 samples" in v["inputs"]
    assert all(c["dtype"] == "float16" for c in v["checks"]), v["checks"]
    assert any(
        e["name"].startswith("model.safetensors vs a float64 fold of the reference") and e["error"] == 0
        for e in v["exact"]
    )
    # the written files, verified on their own, pass under the same policy; pytorch only, as asked
    again = runner.invoke(app, ["verify", str(CKPT), str(out), "--runtime", "pytorch", "--samples", "24", "--json"])
    assert again.exit_code == 0, again.output
    checks = json.loads(again.stdout)["verification"]["checks"]
    assert checks and all(c["name"].endswith("(model.pt2)") and c["dtype"] == "float16" for c in checks)


# ------------------------------------------------------------------------------------- options that do what they say


def test_help_of_fuse_describes_fuse_and_of_verify_describes_verify():
    fuse_help = runner.invoke(app, ["fuse", "--help"], env={"COLUMNS": "200"}).stdout
    verify_help = runner.invoke(app, ["verify", "--help"], env={"COLUMNS": "200"}).stdout
    assert "verify compares" not in fuse_help and "verify: off" not in fuse_help
    assert "fuse folds" not in verify_help and "fuse: default" not in verify_help
    assert "-o, --out" in fuse_help.replace("--out, -o", "-o, --out") and "-f" in fuse_help


def test_verbose_says_each_decision(monkeypatch):
    seen: list[str] = []
    api.inspect(CKPT, progress=lambda stage, done=None, total=None, detail=None: detail and seen.append(detail))
    assert len(seen) == 9 and all(": folded-" in line and " into " in line for line in seen), seen


@pytest.mark.slow
def test_export_says_once_what_it_wrote_and_no_fuse_is_not_zero_norms(tmp_path):
    onnx = tmp_path / "orig.onnx"
    result = runner.invoke(app, ["export", str(CKPT), "--onnx", str(onnx), "--no-fuse"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines == [f"wrote {onnx} (the original model, not fused)"], lines


def test_samples_with_an_npz_takes_its_first_samples_and_says_so():
    from slabconv.load.model import load_model
    from slabconv.verify.inputs import choose_inputs

    loaded = load_model(CKPT)
    x, label, _ = choose_inputs(loaded, None, 5, 0, limit=5)
    assert len(x) == 5 and label.endswith("(its first 5 of 360 samples: --samples 5)")


@pytest.mark.parametrize(
    "fmt, how", [("x", "unchanged into {out}"), ("onnx", "into {out} with its computed constants folded")]
)
def test_nothing_to_fold_is_said_plainly(monkeypatch, tmp_path, fmt, how):
    """A model without norms is written as it is; an ONNX original as prepared (a TorchScript export's computed
    weights and shape arithmetic folded: 1,054 nodes to 152 for transformers' MobileNetV2), never called unchanged."""

    def fuse(path, out, **kwargs):  # noqa: ANN001, ANN003, ANN202 - the API's signature
        return Report("fuse", source=Source(path=str(path), sha256="0", format=fmt), folds=[], out_dir=str(out))

    monkeypatch.setattr(api, "fuse", fuse)
    result = runner.invoke(app, ["fuse", str(CKPT), "-o", str(tmp_path / "again"), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        f"nothing to fold: {CKPT} has no norms (already fused?); wrote it {how.format(out=tmp_path / 'again')}: "
        "not verified (--no-verify)"
    )
