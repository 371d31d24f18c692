"""Exception types and their exit codes (docs/errors.md: 0 done, 1 outputs differ, 2 bad input/usage).

Every error a user can cause is a ``SlabconvError`` with a one-line message that says what is wrong, where,
and what to do; the CLI prints that line and exits with ``exit_code``. Anything else is an internal error.
"""

from __future__ import annotations

import re
from typing import Any

from slabconv.text import one_line


class SlabconvError(Exception):
    """Base of all user-facing errors; ``exit_code`` is 2 unless a subclass says otherwise.

    ``str(err)`` is always one printable line of bounded length (``slabconv.text.one_line``): a path, key or value
    from a file that holds a newline, an escape sequence or megabytes of text cannot split or flood it, wherever the
    message is shown (terminal, ``report.json``, JUnit). ``err.args[0]`` keeps the text as raised.
    """

    exit_code = 2

    def __str__(self) -> str:
        return one_line(super().__str__())


class InputError(SlabconvError):
    """The input file cannot be read as a checkpoint (missing, empty, corrupt, unsafe pickle, bad keys)."""


class UnsupportedModelError(SlabconvError):
    """The model is not one slabconv can build or trace (unknown architecture, untraceable code)."""


class UsageError(SlabconvError):
    """A command-line or API argument is wrong (existing output without --force, bad path, bad option)."""


class NumericError(SlabconvError):
    """The fused model's output is not finite in its dtype (an extreme norm); the message names the norm."""


class VerificationError(SlabconvError):
    """The candidate's outputs differ from the reference beyond tolerance (exit code 1).

    ``report`` holds the full report (a ``slabconv.report.Report``, with the per-check numbers) for the caller
    to show.
    """

    exit_code = 1

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


# The end of a sentence: a full stop, question or exclamation mark before a space, not in "e.g." or "i.e.".
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)[.!?](?=\s)")


def first_line(err: BaseException | None, limit: int = 200) -> str:
    """The first line of an exception's text (its type name when it has none), for one-line messages.

    A first line longer than ``limit`` characters ends at its last sentence end within the limit, or, when no
    sentence ends there, is kept whole: a library's message is never cut mid-sentence.
    """
    if err is None:
        return "unknown error"
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[0].strip()
    if len(line) <= limit:
        return line
    ends = [m.end() for m in _SENTENCE_END.finditer(line, 0, limit)]
    return line[: ends[-1]] if ends else line
