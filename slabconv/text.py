"""The one formatter for text that comes from a file or from the user (paths, keys, metadata, config values).

Such text may hold anything: a newline that would split a one-line error, NUL, ``ESC[2J`` (clear the screen), a
right-to-left override (U+202E) that reorders what the terminal shows, a lone surrogate from an undecodable file
name (which would make writing to stderr raise), or twenty megabytes. Two functions make it safe to show:

- ``shown(value)`` for one value placed in a message: every character that ``str.isprintable`` rejects (Unicode
  categories Cc, Cf, Cs, Co, Cn, Zl, Zp and every space but U+0020; this includes the bidi controls U+202A-U+202E
  and U+2066-U+2069) written as a Python-style escape (``\\n``, ``\\x1b``, ``\\u202e``), and a value longer than
  ``limit`` cut, with a note saying how long it was.
- ``one_line(text)`` for a whole message where it is rendered (``SlabconvError.__str__``, the CLI's error
  printer): the same escapes, and a message over ``limit`` keeps its start and its end (where the advice is)
  around a note. Whatever the message holds, it is then one line of bounded length: the rule holds by
  construction, not by every call site remembering it.

Backslashes are left as they are (Windows paths), so escaping twice changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

VALUE_LIMIT = 200
"""Characters of one value shown in a message before it is cut."""

LINE_LIMIT = 2000
"""Characters of one rendered message before its middle is cut."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}


def _escape(text: str) -> str:
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def shown(value: Any, limit: int = VALUE_LIMIT) -> str:
    """``value`` (a string, a path, or anything ``str`` accepts) as it may appear inside a one-line message.

    Args:
        value: the text from a file or the user; an ``os.PathLike`` is shown by its path.
        limit: the most characters kept (at least 16); a longer value is cut there and followed by
            ``... (N characters)``.

    Returns:
        A string of printable characters only, at most about ``limit`` + 30 characters long.
    """
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    limit = max(limit, 16)
    if len(text) <= limit:
        escaped = _escape(text)
        if len(escaped) <= limit:
            return escaped
    return f"{_escape(text[:limit])[:limit]}... ({len(text):,} characters)"


def one_line(text: str, limit: int = LINE_LIMIT) -> str:
    """A whole message as one printable line of at most about ``limit`` characters.

    Non-printable characters are escaped as in ``shown``; a longer message keeps its first two thirds and its last
    third of ``limit`` around ``...[N characters cut]...``, so both what went wrong and what to do stay visible.
    """
    limit = max(limit, 48)
    head_n, tail_n = limit * 2 // 3, limit // 3
    if len(text) > limit:
        head, tail = _escape(text[:head_n])[:head_n], _escape(text[-tail_n:])[-tail_n:]
        return f"{head} ...[{len(text) - head_n - tail_n:,} characters cut]... {tail}"
    escaped = _escape(text)
    return escaped if len(escaped) <= limit else one_line(escaped, limit)


def units_in_last_place(value: float) -> str:
    """A distance in units in the last place, as the report's lines show a number (three significant digits), in
    the number that agrees with it: ``0 units in the last place``, ``1 unit in the last place``, ``2.5 units in the
    last place``, ``inf units in the last place``."""
    shown = f"{value:.3g}"
    return f"{shown} {'unit' if shown == '1' else 'units'} in the last place"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the number that agrees with it: ``1 norm``, ``2 norms``, ``0 near-ties``
    (``plural``, default ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
