"""The docs stand alone and stay true: no reference to a file a user does not have, every console example
generated, docs/errors.md's messages still in the code, docs/zoo.md's table the same as `slabconv list`, and
README's promises about `make demo` / `make test`. (README's example itself is checked against a fresh run in
tests/test_cli_e2e.py, which already runs the demo command.)"""

from __future__ import annotations

import re

import pytest

from scripts import readme_example
from slabconv.zoo import list_archs
from tests import errordoc
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("slabconv/", "tests/", "fixtures/", "benchmarks/", "scripts/", "docs/")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_a_doc_names_only_files_in_the_repository(doc):
    text = doc.read_text()
    for outside in ("DESIGN.md", "STYLE.md", "shared/", "../shared"):
        assert outside not in text, f"{doc.name} refers to {outside}, which users do not have"
    for target in re.findall(r"\]\(([^)#\s]+)", text):  # markdown links
        if not target.startswith(("http://", "https://")):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
    for path in re.findall(r"`([\w./-]+\.(?:py|md|json|npz|pth|png|yml|yaml))`", text):
        if path.startswith(REPO_DIRS):
            assert (ROOT / path).exists(), f"{doc.name} names {path}, which is not in the repository"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_console_example_is_generated(doc):
    """A console block is output pasted from a run: each one must sit between a generator's markers, so it is
    rewritten by scripts/readme_example.py and compared with a fresh run by a test."""
    text = doc.read_text()
    for match in re.finditer(r"^```console$", text, re.M):
        before = text[: match.start()].rstrip().splitlines()[-1]
        assert before == readme_example.BEGIN, f"{doc.name}: a console block that nothing regenerates"
    assert text.count(readme_example.BEGIN) == text.count(readme_example.END)


def test_readme_shows_the_two_commands_and_how_long_they_take():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert re.search(r"`make test`\s+\S*\s*(about )?\d+(\.\d+)? (to \d+ )?minutes? on 2 CPU cores", text), (
        "README must say how long `make test` takes on 2 cores"
    )
    assert readme_example.demo_command().startswith(".venv/bin/slabconv fuse fixtures/digits-prepbn/checkpoint.pth")


def test_every_message_in_errors_md_is_still_in_the_code():
    """Each quoted message's fixed text (between its placeholders) is a string of the package: a message reworded
    in the code and not in the doc fails here."""
    messages = errordoc.own_messages()
    assert len(messages) > 80
    stale = {m: [f for f in errordoc.fragments(m) if not errordoc.in_source(f)] for m in messages}
    stale = {m: f for m, f in stale.items() if f}
    assert not stale, f"docs/errors.md quotes text the code no longer has: {stale}"


def test_every_message_in_errors_md_has_fixed_text():
    """A quote of placeholders alone (`...`, `NAME`) in the message column would match every line the CLI prints,
    and ``errordoc.documented`` would call any message documented by it."""
    empty = [m for m in errordoc.messages() if not errordoc.fragments(m)]
    assert not empty, f"docs/errors.md quotes messages with no fixed text: {empty}"


def test_the_drift_check_catches_a_reworded_message():
    assert errordoc.in_source("not a readable PyTorch checkpoint")
    assert not errordoc.in_source("not a readible PyTorch checkpoint")
    assert errordoc.pattern("FILE: no such file").fullmatch("/tmp/x.pth: no such file")
    assert not errordoc.pattern("FILE: no such file").fullmatch("/tmp/x.pth: is a folder")


def _zoo_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "zoo.md").read_text()
    section = text.split("## Names", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_the_zoo_table_is_what_slabconv_list_lists():
    table = _zoo_table()
    specs = {s.name: s for s in list_archs()}
    assert set(table) == set(specs)
    for name, (_, aliases, family, _, _, size) in table.items():
        spec = specs[name]
        assert re.findall(r"`([^`]+)`", aliases) == list(spec.aliases), name
        assert family == spec.family, name
        if spec.input_dtype is not None:
            assert size == "int64 token ids", name
        elif spec.image_size is None:
            assert size in {"from weights", "config `DATA.IMG_SIZE`"}, name
        else:
            assert size == f"{spec.image_size}, {'resizable' if spec.resizable else 'fixed'}", name


def test_every_message_the_code_raises_is_in_errors_md():
    """The other direction: each message a ``slabconv`` error class is raised with (``errordoc.raised_messages``,
    read from the source) is an instance of a message docs/errors.md quotes. A new message without its row fails
    here, naming the file and line."""
    raised = errordoc.raised_messages()
    assert len(raised) > 250
    missing = [f"{f}:{line}: {t!r}" for f, line, t in raised if not errordoc.template_documented(t)]
    assert not missing, "docs/errors.md lacks:\n" + "\n".join(missing)


def test_the_completeness_check_catches_an_undocumented_message():
    assert errordoc.template_documented("\0: no such file") == "FILE: no such file"
    assert not errordoc.template_documented("\0: the flux capacitor is not charged; charge it")
    assert not errordoc.template_documented("\0: no such file; charge the flux capacitor")  # a piece the doc lacks


PARSER_MISTAKES = [
    ["fuse", "x.pth", "--no-onx"],
    ["fuse", "x.pth", "--frobnicate"],
    ["fuse"],
    ["export", "x.pth"],
    ["fuse", "x.pth", "--samples", "0"],
    ["fuse", "x.pth", "--samples", "abc"],
    ["fuse", "x.pth", "--out"],
    ["fuse", "x.pth", "--no-onnx=3"],
    ["fuse", "x.pth", "y.pth"],
    ["fusee", "x.pth"],
    ["--install-completion", "tcsh"],
]


@pytest.mark.parametrize("args", PARSER_MISTAKES, ids=" ".join)
def test_every_mistake_the_command_line_parser_answers_is_in_errors_md(args):
    """The parser's own messages (click's, Typer's) are listed too, collected by making each mistake; each names
    the help of the command it was made on."""
    from typer.testing import CliRunner

    from slabconv.cli import app

    result = CliRunner().invoke(app, args)
    line = result.stderr.strip()
    assert result.exit_code == 2 and len(line.splitlines()) == 1 and line.startswith("error: "), result.output
    assert errordoc.documented(line), f"docs/errors.md does not list: {line}"
    command = args[0] if args[0] in {"fuse", "export"} else None
    if command:
        assert line.endswith(f"(see `slabconv {command} --help`)"), line
