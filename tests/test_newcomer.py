"""A newcomer's first day (issue 39): a CI job that demands a norm-free model, tables at 60 columns, shell
completion for the shell asked, the dtype spellings other converters take, and warnings a program needs."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from slabconv import api
from slabconv.cli import app
from slabconv.cli.output import Output
from slabconv.engine import Decision
from slabconv.options import WriteOptions
from slabconv.report.data import Report
from slabconv.report.render import summary_lines
from tests import errordoc
from tests.conftest import randomize_norms
from tests.test_pt2_e2e import Tagger
from tests.tinyckpt import save_ckpt, tiny_state_dict

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

runner = CliRunner()


@pytest.fixture(scope="module")
def tagger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program whose plan folds one norm (``norm_in`` into ``ff``) and keeps the other (``norm_post``)."""
    torch.manual_seed(0)
    model = randomize_norms(Tagger(), seed=3).eval()
    path = tmp_path_factory.mktemp("tagger") / "tagger.pt2"
    program = torch.export.export(model, (torch.randn(2, 10, 12),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, path)
    return path


# --------------------------------------------------------------------------------------------- --require-folded


def _cases(junit: Path) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in ET.parse(junit).getroot().iter("testcase")}


def test_require_folded_fails_the_fuse_naming_each_kept_norm_with_one_junit_case_per_norm(tagger, tmp_path):
    out, junit = tmp_path / "out", tmp_path / "folds.xml"
    result = runner.invoke(app, ["fuse", str(tagger), "--require-folded", "--junit", str(junit), "--out", str(out)])
    assert result.exit_code == 2, result.output  # the model cannot be made norm-free: unsupported, not unequal
    assert result.stderr.strip().splitlines() == [
        "error: --require-folded: 1 norm of 2 would be kept: norm_post (nonlinear-before-consumer); nothing was "
        "written (each reason: docs/reasons.md; slabconv inspect shows the plan)"
    ]
    assert errordoc.documented(result.stderr.strip())
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["folds.xml"]
    cases = _cases(junit)
    assert sorted(cases) == ["fold: norm_in", "fold: norm_post"]
    assert cases["fold: norm_in"].find("failure") is None
    failure = cases["fold: norm_post"].find("failure")
    assert failure is not None and failure.get("type") == "NotFolded"
    assert "norm_post is kept (nonlinear-before-consumer)" in failure.get("message", "")
    assert ET.parse(junit).getroot().get("failures") == "1"


def test_without_require_folded_a_kept_norm_is_a_passing_case_and_the_fuse_succeeds(tagger, tmp_path):
    junit = tmp_path / "folds.xml"
    args = ["fuse", str(tagger), "--junit", str(junit), "--out", str(tmp_path / "out"), "--no-verify", "--no-onnx"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cases = _cases(junit)
    assert sorted(cases) == ["fold: norm_in", "fold: norm_post"]  # --no-verify: no verification cases
    assert all(case.find("failure") is None for case in cases.values())
    assert "kept-affine: nonlinear-before-consumer" in (cases["fold: norm_post"].findtext("system-out") or "")


def test_require_folded_in_the_python_api(tagger, tmp_path):
    from slabconv.errors import KeptNormsError

    with pytest.raises(
        KeptNormsError, match=r"^WriteOptions\(require_folded=True\): 1 norm of 2 would be kept: "
    ) as caught:
        api.fuse(tagger, tmp_path / "out", verify=None, write=WriteOptions(require_folded=True, onnx=False))
    assert caught.value.exit_code == 2 and [d.norm for d in caught.value.report.folds] == ["norm_in", "norm_post"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- 60 columns


def _narrow(width: int) -> tuple[Output, io.StringIO]:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=True, color_system=None)
    return Output(out=console, err=console), buffer


LONG = [
    Decision(
        "model.layers.0.input_layernorm",
        "RepBN",
        "folded-forward",
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"],
    ),
    Decision("model.layers.0.post_attention_layernorm", "LinearNorm", "kept-affine", [], "residual-reads-norm"),
]


def _pieces(name: str) -> list[str]:
    """A name's pieces between the seams a table may wrap at (after . _ , / ( and spaces)."""
    return [p.strip() for p in re.findall(r"[^._,/( ]*[._,/( ]*", name) if p.strip()]


@pytest.mark.parametrize("width", [60, 95])  # the compact table, and the full one with its reason column
def test_the_fold_table_keeps_names_whole_between_seams_on_a_narrow_terminal(width):
    output, buffer = _narrow(width)
    output.report(Report("inspect", folds=LONG))  # the fold table, at the terminal's width
    lines = buffer.getvalue().splitlines()
    assert lines and max(len(line) for line in lines) <= width
    assert ("kind" in lines[1]) == (width >= 90)
    text = buffer.getvalue()
    for d in LONG:
        for name in (d.norm, *d.into):
            for piece in _pieces(name):  # e.g. "input_" and "layernorm" whole, never "i" / "nput_layernorm"
                assert piece in text, (piece, text)
    assert "folded-forward" in text and "kept-affine" in text and "residual-reads-norm" in text


def test_list_at_60_columns_keeps_every_alias_whole_between_seams_and_says_where_the_descriptions_are(monkeypatch):
    from slabconv.cli import output as output_module

    def narrow(stream, stderr):  # noqa: ANN001, ANN202 - the console _console would make on a 60-column terminal
        return output_module.PipeConsole(file=stream, stderr=stderr, width=60, force_terminal=True, color_system=None)

    monkeypatch.setattr(output_module, "_console", narrow)
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 60 and "description" not in lines[1]
    assert lines[-1] == "(descriptions: slabconv list --json, or 100+ columns)"
    for spec in api.architectures():
        assert any(line.startswith(spec["name"] + " ") for line in lines), spec["name"]
        for alias in spec["aliases"]:
            for piece in _pieces(alias):
                assert piece in result.stdout, (alias, piece)


# --------------------------------------------------------------------------------------------- completion


def test_install_completion_installs_the_shell_asked_for(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    script = str(Path(sys.executable).parent / "slabconv")
    done = subprocess.run([script, "--install-completion", "zsh"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "_SLABCONV_COMPLETE=complete_zsh" in (tmp_path / ".zfunc" / "_slabconv").read_text()
    assert not (tmp_path / ".bash_completions").exists()  # it installed bash's whatever was asked
    wrong = subprocess.run([script, "--install-completion", "tcsh"], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: --install-completion tcsh: give one shell")


# --------------------------------------------------------------------------------------------- dtype, batch


def test_float32_spelt_as_other_converters_spell_it_is_the_checkpoints_own_dtype(tmp_path):
    ckpt = save_ckpt(tmp_path / "ckpt.pth")
    plain = WriteOptions(onnx=False, pt2=False)
    api.fuse(ckpt, tmp_path / "default", verify=None, write=plain)
    expected = load_file(tmp_path / "default" / "model.safetensors")
    for spelling in ("fp32", "FLOAT32"):
        write = WriteOptions(onnx=False, pt2=False, dtype=spelling)
        assert write.dtype == "float32"
        with warnings.catch_warnings(record=True) as caught:  # nothing from the libraries underneath either
            warnings.simplefilter("always")
            api.fuse(ckpt, tmp_path / spelling, verify=None, write=write)
        assert not [w for w in caught if "LeafSpec" in str(w.message)], [str(w.message) for w in caught]
        written = load_file(tmp_path / spelling / "model.safetensors")
        assert sorted(written) == sorted(expected) and all(torch.equal(written[k], v) for k, v in expected.items())
        with safe_open(str(tmp_path / spelling / "model.safetensors"), "pt") as f:
            assert f.metadata() == safe_open(str(tmp_path / "default" / "model.safetensors"), "pt").metadata()
    assert WriteOptions(dtype="bf16").dtype == "bfloat16" and WriteOptions(dtype="half").dtype == "float16"
    sd = {k: v.half() if v.is_floating_point() else v for k, v in tiny_state_dict().items()}
    write = WriteOptions(dtype="fp32", onnx=False, pt2=False)
    api.fuse(save_ckpt(tmp_path / "f16.pth", sd), tmp_path / "up", verify=None, write=write)
    written = load_file(tmp_path / "up" / "model.safetensors")  # of a float16 checkpoint: the fold in float32
    assert {t.dtype for t in written.values() if t.is_floating_point()} == {torch.float32}


def test_a_program_with_a_static_batch_is_warned_about(tmp_path):
    torch.manual_seed(0)
    model = randomize_norms(Tagger(), seed=3).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 10, 12),)), tmp_path / "static.pt2")
    report = api.inspect(tmp_path / "static.pt2")
    assert report.source is not None and report.source.batch == 2
    lines = list(summary_lines(report))
    assert lines[0] == (
        f"warning: {tmp_path / 'static.pt2'} was exported with a static batch of 2, so the fused files run on "
        "batches of exactly 2; export it with dynamic_shapes=({0: torch.export.Dim('batch')},) for any batch "
        "(docs/own-model.md)"
    )
    assert "dynamic_shapes=({0: torch.export.Dim('batch')},) for any batch (docs/own-model.md)" in (
        errordoc.documented(lines[0]) or ""
    )  # docs/errors.md lists it
    assert json.loads(report.to_json())["source"]["batch"] == 2


def _no_fuse_export_warning(model: nn.Module, x: torch.Tensor, tmp_path: Path) -> str:
    """``model`` (its norms drawn, seed 5) saved as a ``torch.export`` program of the static input ``x``
    (``static.pt2``), then ``export --no-fuse`` to ``orig.onnx``: the summary's warning line."""
    model = randomize_norms(model, seed=5).eval()
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "static.pt2")
    report = api.export(tmp_path / "static.pt2", tmp_path / "orig.onnx", fuse=False)
    return next(line for line in summary_lines(report) if line.startswith("warning:"))


def test_the_static_batch_warning_of_export_names_the_file_it_wrote(tmp_path):
    """export --no-fuse writes the original and verifies nothing: the warning said "the fused files take any batch
    ...; verification runs them" of it."""
    warning = _no_fuse_export_warning(_BatchCentred(), torch.randn(2, 8), tmp_path)
    assert warning == (
        f"warning: {tmp_path / 'static.pt2'} was exported with a static batch of 2; orig.onnx takes any batch (the "
        "model's code allows it); slabconv verify runs it on batches of 2, as the original runs"
    )
    assert errordoc.documented(warning) is not None


class _ChannelsFirst(nn.Module):
    """``x (C, N)``: a BatchNorm and a Linear over ``x.t()``, so axis 0 of the input holds the channels (the
    Linear contracts it) and no file of this model takes another size on that axis."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x.t()))


def test_the_static_batch_warning_of_export_reads_the_written_file_s_input(tmp_path):
    """export --no-fuse asks the ONNX exporter for a dynamic axis 0; where the model's code fixes that axis (here
    the channels) the exporter writes it fixed without failing: the warning said "orig.onnx takes any batch" of a
    file whose input is ``(4, 6)``. What the file takes is read from its graph input."""
    warning = _no_fuse_export_warning(_ChannelsFirst(), torch.randn(4, 6), tmp_path)
    import onnx

    dims = onnx.load(str(tmp_path / "orig.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [4, 6]
    assert warning == (
        f"warning: {tmp_path / 'static.pt2'} was exported with a static batch of 4, so orig.onnx runs on batches of "
        "exactly 4; export it with dynamic_shapes=({0: torch.export.Dim('batch')},) for any batch (docs/own-model.md)"
    )
    assert errordoc.documented(warning) is not None


class _BatchCentred(nn.Module):
    """A BatchNorm before a Linear, and an output centred over the whole batch: each sample's output depends on the
    other samples of its batch, so a file run on batches of another size computes other numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.bn, self.fc1 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.bn(self.fc0(x)))
        return h - h.mean()


def test_fused_files_of_a_static_batch_program_are_verified_on_the_originals_batches(tmp_path):
    model = randomize_norms(_BatchCentred(), seed=5).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), tmp_path / "static.pt2")
    report = api.fuse(tmp_path / "static.pt2", tmp_path / "out")  # raises NotEquivalentError on a false FAIL
    assert report.verification is not None and report.verification.passed
    assert len([c for c in report.verification.checks if c.name.startswith("output @ ")]) == 3  # every file ran
    info = report.outputs.onnx_info if report.outputs is not None else None
    assert info is not None and info["dynamic_batch"] and info["pt2_dynamic_batch"]  # the files take any batch
    warning = next(line for line in summary_lines(report) if line.startswith("warning:"))
    assert warning.endswith("the fused files take any batch (the model's code allows it); verification runs them "
                            "on batches of 2, as the original runs")  # fmt: skip
    assert errordoc.documented(warning) is not None


class _Wav2Vec2Logits(nn.Module):
    """A tiny random transformers Wav2Vec2 classifier, its logits alone."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

        torch.manual_seed(0)
        config = Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            num_labels=4, feat_extract_norm="layer", do_stable_layer_norm=True, classifier_proj_size=16,
        )  # fmt: skip
        self.model = Wav2Vec2ForSequenceClassification(config).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


def test_a_failed_verification_of_a_static_batch_program_is_localised_on_the_originals_batches(tmp_path):
    """The localisation ran the graphs on its 4 samples in one call, which this program, recorded with a static
    batch of 2, refuses (torch's "Guard failed: x.size()[0] == 2": an internal error where a verdict was due): it
    runs them 2 at a time, as question 1 does, and finds every boundary of the correct fold in agreement."""
    from slabconv.errors import VerificationError
    from slabconv.options import LoadOptions, VerifyOptions

    program = torch.export.export(_Wav2Vec2Logits(), (torch.randn(2, 400),))
    torch.export.save(program, tmp_path / "static.pt2")
    verify = VerifyOptions(samples=4, rtol=1e-15)  # a bound no float32 file meets: question 2 fails
    with pytest.raises(VerificationError) as caught:
        api.fuse(tmp_path / "static.pt2", tmp_path / "out", load=LoadOptions(fold_norm_affine=True), verify=verify,
                 write=WriteOptions(onnx=False))  # fmt: skip
    v = caught.value.report.verification
    assert v is not None and all(c.passed for c in v.exact) and v.localization is not None
    loc = v.localization
    assert loc.first is None and loc.boundaries and all(b.error <= b.bound for b in loc.boundaries), loc
    assert loc.method.endswith("on the first 4 samples"), loc.method


def test_every_side_of_a_verification_runs_in_the_same_batches(tmp_path):
    """The float64 reference ran 4 samples a call and the original 16: on a batch-centred output the original's own
    "error" was 0.15, and question 2 allowed twice that: a check that passes anything close."""
    model = randomize_norms(_BatchCentred(), seed=5).eval()
    dynamic = ({0: torch.export.Dim("batch")},)
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),), dynamic_shapes=dynamic), tmp_path / "d.pt2")
    report = api.fuse(tmp_path / "d.pt2", tmp_path / "out")
    assert report.verification is not None
    checks = [c for c in report.verification.checks if c.name.startswith("output @ ")]
    assert len(checks) == 3 and all(c.e_orig < 1e-6 and c.tolerance == 1e-5 for c in checks), checks


# --------------------------------------------------------------------------------------------- --verbose


def test_verbose_adds_where_the_model_came_from_and_each_files_sha256():
    from slabconv.load.source import Source
    from slabconv.report.data import Outputs

    source = Source("m.pt2", "ab" * 32, "torch.export", dtype="float32", input_shape=[1, 8, 8])
    outputs = Outputs(files=["model.onnx"], safetensors="", sha256={"model.onnx": "cd" * 32})
    report = Report("fuse", source=source, folds=[], out_dir="out", outputs=outputs)
    plain, verbose = list(summary_lines(report)), list(summary_lines(report, verbose=True))
    line = f"source: m.pt2: torch.export, float32 weights, input (1, 8, 8), any batch; sha256 {'ab' * 32}"
    assert line in verbose and line not in plain
    assert f"  model.onnx: sha256 {'cd' * 32}" in verbose and not any("sha256" in x for x in plain)


def test_verbose_progress_lines_say_what_their_count_counts():
    buffer = io.StringIO()
    output = Output(verbose=True, out=Console(file=io.StringIO()), err=Console(file=buffer, width=200))
    with output.progress() as progress:
        progress("folding norms")
        progress("folding norms", 1, 9, "blocks.0.norm1 (1/9): folded-forward into blocks.0.attn.qkv")
        progress("verifying: question 2, one decoder layer at a time", 0, 18)
        progress("verifying: question 2, one decoder layer at a time", 3, 18, "decoder layer 3")
    lines = [line.split("]", 1)[1] for line in buffer.getvalue().splitlines()]
    assert "   blocks.0.norm1 (1/9): folded-forward into blocks.0.attn.qkv" in lines  # no second, stale count
    assert "   decoder layer 3 (3/18)" in lines


def test_the_exporters_log_lines_are_held_back():
    """The ONNX exporter's version converter logs a warning for an --opset it converts to (onnxscript's logger);
    under ``util.quiet`` it does not reach stderr, and outside it logging is as the user set it."""
    import logging

    from slabconv.util import quiet

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("onnxscript.version_converter")
    log.addHandler(handler)
    try:
        with quiet():
            log.warning("The model version conversion is not supported by the onnxscript version converter")
        assert seen == []
        log.warning("outside")
        assert seen == ["outside"]
    finally:
        log.removeHandler(handler)
