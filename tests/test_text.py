"""One formatter for text from files and users (issue 21 item 5): every rendered failure is one printable line
of bounded length, whatever a path, key or value holds; links on the way to ``--out`` are followed as
docs/security.md says."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from slabconv import pipeline
from slabconv.cli import app
from slabconv.errors import InputError, UsageError
from slabconv.text import LINE_LIMIT, VALUE_LIMIT, one_line, shown
from tests import tinyckpt
from tests.conftest import ROOT

tiny_fused = tinyckpt.tiny_fused
runner = CliRunner()

HOSTILE = "a\nb\r\tc\0d\x1b[2Je\u202ef\u2066g\x85h\u2028i\udcffj"
"""Newline, CR, tab, NUL, ESC[2J (clear screen), the right-to-left override, a bidi isolate, NEL, the line
separator and a lone surrogate (an undecodable byte in a file name under surrogateescape)."""


def _printable_line(text: str) -> bool:
    return text.isprintable() and "\n" not in text


def test_shown_escapes_every_control_and_format_character() -> None:
    assert shown(HOSTILE) == "a\\nb\\r\\tc\\0d\\x1b[2Je\\u202ef\\u2066g\\x85h\\u2028i\\udcffj"
    assert shown(Path("/data/model.pth")) == "/data/model.pth"
    assert shown("naïve 模型 C:\\models") == "naïve 模型 C:\\models"  # printable text and backslashes kept
    assert shown(shown(HOSTILE)) == shown(HOSTILE)  # escaping twice changes nothing


def test_shown_cuts_a_long_value_with_a_note() -> None:
    text = shown("k" * 20_000_000)
    assert text == "k" * VALUE_LIMIT + "... (20,000,000 characters)"
    cut = shown("\x1b" * 1000, limit=40)  # escapes count towards the limit
    assert _printable_line(cut) and len(cut) <= 40 + 30 and cut.endswith("... (1,000 characters)")


def test_one_line_keeps_the_start_and_the_advice_of_a_long_message() -> None:
    message = "cannot read model.pth: the key '" + "x\n" * 10_000_000 + "' is not a tensor; re-save the checkpoint"
    line = one_line(message)
    assert _printable_line(line) and len(line) <= LINE_LIMIT + 40
    assert line.startswith("cannot read model.pth: the key 'x\\nx\\n")
    assert line.endswith("' is not a tensor; re-save the checkpoint")
    assert "characters cut]" in line


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000), st.integers(min_value=0, max_value=300))
def test_any_text_becomes_one_printable_bounded_line(text: str, limit: int) -> None:
    line = one_line(text, limit=max(limit, 48))
    assert _printable_line(line) and len(line) <= max(limit, 48) + 40
    value = shown(text, limit)
    assert _printable_line(value) and len(value) <= max(limit, 16) + 30
    if _printable_line(text) and len(text) <= max(limit, 16):
        assert value == text  # what needs no escaping is shown as it is


def test_every_slabconv_error_renders_as_one_bounded_line() -> None:
    err = InputError(f"{'k' * 20_000_000}{HOSTILE}: not a tensor; re-save it")
    assert _printable_line(str(err)) and len(str(err)) <= LINE_LIMIT + 40
    assert str(err).endswith("i\\udcffj: not a tensor; re-save it")
    assert err.args[0].endswith(f"{HOSTILE}: not a tensor; re-save it")  # what was raised is kept


def test_a_hostile_out_path_is_one_escaped_line_on_the_terminal(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("keep")
    (tmp_path / "broken.pth").write_bytes(b"not a checkpoint")
    out = tmp_path / "a_file" / "out\n\x1b[2J\u202eerror: fake second line"
    result = runner.invoke(app, ["fuse", str(tmp_path / "broken.pth"), "--out", str(out)])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert _printable_line(line), repr(line)
    assert line.startswith("error: cannot write ") and "out\\n\\x1b[2J\\u202eerror: fake second line" in line


def test_a_library_message_with_control_characters_is_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bad\x1b]0;pwned\x07 \u202eelif\x00")

    monkeypatch.setattr(pipeline, "load_model", explode)  # what the in-memory door loads with
    (tmp_path / "ckpt.pth").write_bytes(b"x")
    result = runner.invoke(app, ["inspect", str(tmp_path / "ckpt.pth")])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert _printable_line(line), repr(line)
    assert "bad\\x1b]0;pwned\\x07 \\u202eelif\\0" in line


def test_a_message_raised_with_a_newline_key_stays_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise UsageError("unexpected key 'blocks.0\nerror: all good' in ckpt.pth; re-save the checkpoint")

    monkeypatch.setattr(pipeline, "load_model", refuse)
    (tmp_path / "ckpt.pth").write_bytes(b"x")
    result = runner.invoke(app, ["inspect", str(tmp_path / "ckpt.pth")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: unexpected key 'blocks.0\\nerror: all good' in ckpt.pth; re-save the checkpoint"
    ]


def test_a_link_on_the_way_to_out_is_followed_as_security_md_says(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Path(shutil.copy(tiny_fused / "ckpt.pth", tmp_path / "ckpt.pth"))
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    result = runner.invoke(
        app, ["fuse", str(ckpt), "--out", str(tmp_path / "link" / "out"), "--no-onnx", "--no-verify"]
    )
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["out"]
    assert (tmp_path / "real" / "out" / "report.json").is_file()
    # The rules apply to the resolved path: a link whose ``..`` is the current folder is still refused.
    monkeypatch.chdir(tmp_path / "real")
    result = runner.invoke(app, ["fuse", str(ckpt), "--out", str(tmp_path / "link" / "out" / ".."), "--force"])
    assert result.exit_code == 2 and "is the current folder" in result.stderr
    doc = (ROOT / "docs" / "security.md").read_text()
    assert "**Links on the way are followed, not refused.** `--out link/out`" in doc
