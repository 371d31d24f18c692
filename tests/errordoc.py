"""docs/errors.md as data: the messages its tables quote, as patterns a real message must match, and as the
literal fragments the source must still contain.

A message in the doc is written as the user sees it, with placeholders for what varies: FILE, DIR, PATH, KEY,
NAME, ... (capitals, listed in ``PLACEHOLDERS``), ``...`` for a library's own text, single letters for numbers.
``tests/test_errors.py`` checks that every message of its catalogue of bad inputs matches a documented
pattern; ``tests/test_docs.py`` that every documented message is still in the code.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ERRORS_MD = ROOT / "docs" / "errors.md"

PLACEHOLDERS = (
    "FILE DIR PATH KEY NAME NORM OUT REF CAND RUNTIME FOLDER PREFIX LAYOUT LAYER ACTION REASON TARGET WHAT DTYPE Class "
    "VERSION E T N M X I P n a b c d"
).split()
_PLACEHOLDER = re.compile(r"'\.\.\.'|\.\.\.|\b(?:" + "|".join(PLACEHOLDERS) + r")\b")


PARSER_SECTION = "## The command line parser"
"""The section of docs/errors.md whose messages are click's and Typer's, not the package's own strings."""


def own_messages() -> list[str]:
    """``messages()`` less the command line parser's: the messages the package's source must still hold."""
    text = ERRORS_MD.read_text()
    start = text.index(PARSER_SECTION)
    end = text.index("\n## ", start + len(PARSER_SECTION))
    return messages(text[:start] + text[end:])


def messages(text: str | None = None) -> list[str]:
    """Every message quoted in the first column of docs/errors.md's tables (`...` or ``...`` spans), without the
    ``error: `` that the command line puts in front."""
    text = ERRORS_MD.read_text() if text is None else text
    found = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| message", "|---")):
            continue
        cell = line.split(" | ")[0][2:]
        for m in re.finditer(r"``\s(.+?)\s``|`([^`]+)`", cell):
            found.append((m.group(1) or m.group(2)).removeprefix("error: "))
    return found


def pattern(message: str) -> re.Pattern[str]:
    """A regex for a documented message: each placeholder matches any text, the rest itself."""
    parts = _PLACEHOLDER.split(message)
    return re.compile(".+?".join(re.escape(part) for part in parts), re.S)


@cache
def patterns() -> list[tuple[str, re.Pattern[str]]]:
    return [(m, pattern(m)) for m in messages()]


def documented(line: str) -> str | None:
    """The documented message that ``line`` (one stderr line) is an instance of, or None."""
    text = line.removeprefix("error: ")
    return next((m for m, p in patterns() if p.fullmatch(text) or p.search(text)), None)


def fragments(message: str) -> list[str]:
    """The fixed parts of a documented message (between placeholders) that are long enough to be telling."""
    out = []
    for frag in _PLACEHOLDER.split(message):
        frag = frag.strip(" '\"()`:;,.")
        if len(re.sub(r"\W", "", frag)) >= 4:
            out.append(frag)
    return out


@cache
def source_strings() -> tuple[str, ...]:
    """Every string literal of the package; an f-string with each value it formats as NUL, except a module-level
    string constant (``QUESTION_2 = "..."``), which is put in place: a message reads as the user will see it."""
    trees = [ast.parse(f.read_text()) for f in sorted((ROOT / "slabconv").rglob("*.py"))]
    constants = {
        node.targets[0].id: node.value.value
        for tree in trees
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    strings = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                strings.append("".join(_piece(v, constants) for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
    return tuple(strings)


def _piece(value: ast.expr, constants: dict[str, str]) -> str:
    if isinstance(value, ast.Constant):
        return str(value.value)
    if isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) and value.format_spec is None:
        return constants.get(value.value.id, "\0")
    return "\0"


@cache
def _corpus() -> str:
    return "\n".join(source_strings())


def in_source(fragment: str) -> bool:
    """True when the source holds ``fragment``: as part of one literal, or as literals that the code joins around
    formatted values or ``+`` (``f"error: not equivalent: {failure}"`` with the failure's own f-string reads as
    one sentence in the doc). Each such piece must end where a literal or a formatted value does and the next
    start where one does, so a misspelt word is never covered by two pieces of other strings."""
    corpus = _corpus()
    return _covered(fragment, ("",), corpus)


def _covered(rest: str, starts: tuple[str, ...], corpus: str) -> bool:
    if any(start + rest in corpus for start in starts):
        return True
    for cut in range(len(rest) - 1, 3, -1):
        piece = rest[:cut]
        if len(re.sub(r"\W", "", piece)) < 4:
            break
        ends = (start + piece + end for start in starts for end in ("\0", "\n"))  # a value or "+" follows
        if any(text in corpus for text in ends) and _covered(rest[cut:].lstrip(), ("\0", "\n"), corpus):
            return True
    return False


ERROR_CLASSES = frozenset(
    {"SlabconvError", "InputError", "UsageError", "UnsupportedModelError", "NumericError", "VerificationError"}
    | {"KeptNormsError", "LayoutError", "WrongKind"}
)
"""The exception classes whose message a user reads (``slabconv.errors`` and the zoo's ``LayoutError``)."""


def raised_messages() -> list[tuple[str, int, str]]:
    """Every message the package raises, as ``(file, line, template)``: the first argument of each call of an
    ``ERROR_CLASSES`` class, an f-string's values as NUL, a module-level string constant put in place (as in
    ``source_strings``). A template with fewer than 12 letters of its own (``f"{path}: {err}"``, which wraps another
    message) is left out: the message it wraps is checked where that one is raised."""
    found = []
    for path in sorted((ROOT / "slabconv").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            node.targets[0].id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            if node.func.id not in ERROR_CLASSES:
                continue
            text = _template(node.args[0], constants)
            if text is not None and len(re.sub(r"[^A-Za-z]", "", text)) >= 12:
                found.append((str(path.relative_to(ROOT)), node.lineno, text))
    return found


def _template(node: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_piece(v, constants) for v in node.values)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, constants), _template(node.right, constants)
        return (left if left is not None else "\0") + (right if right is not None else "\0")
    return None


def template_documented(template: str) -> str | None:
    """The documented message that quotes ``template`` (a ``raised_messages`` template): one whose text holds each
    fixed piece of the template (between its values, ends trimmed as ``fragments`` trims them), in order; None
    when no message of the doc does."""
    pieces = [p.strip(" '\"()`:;,.") for p in template.split("\0")]
    pieces = [p for p in pieces if len(re.sub(r"\W", "", p)) >= 4]
    for message in messages():
        at = 0
        for piece in pieces:
            at = message.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return message
    return None
