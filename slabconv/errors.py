"""Exception types and their exit codes (docs/errors.md: 0 done, 1 outputs differ, 2 bad input/usage).

Every error a user can cause is a ``SlabconvError`` with a one-line message that says what is wrong, where,
and what to do; the CLI prints that line and exits with ``exit_code``. Anything else is an internal error.
"""

from __future__ import annotations

import errno
import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from slabconv.text import one_line, shown


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


class KeptNormsError(UnsupportedModelError):
    """``--require-folded`` and the plan keeps some norms (exit code 2: the model cannot be made norm-free; nothing
    is written). ``report`` holds the plan (``folds``, ``source``) for the caller to show, e.g. as JUnit."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


class VerificationError(SlabconvError):
    """The candidate's outputs differ from the reference beyond tolerance (exit code 1).

    ``report`` holds the full report (a ``slabconv.report.Report``, with the per-check numbers) for the caller
    to show.
    """

    exit_code = 1

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENAMETOOLONG", "ELOOP", "EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG", "EIO", "ENXIO")
    if hasattr(errno, name)
)
"""``OSError``s the system raises for what is around a run, not for a bug in it: a path over PATH_MAX, a loop of
links, permissions, a read-only or full file system, a failing disk."""


_interrupt = {"requested": False, "held": 0}
_written: list[str] = []


def request_interrupt() -> None:
    """Record that a signal asked the run to end (the CLI's handler calls it before raising ``KeyboardInterrupt``).

    Python runs a signal handler between two bytecodes of the main thread, which may be inside a weakref callback
    or a ``__del__`` (the garbage collector's): a ``KeyboardInterrupt`` raised there is printed as "Exception ignored"
    and lost, and the run would go on and publish its output. ``raise_if_interrupted`` raises it again at the next
    point that checks (each progress step, and just before an output is moved into place)."""
    _interrupt["requested"] = True


def clear_interrupt() -> None:
    """Forget a recorded interrupt (a process that handled it and goes on: a test, an embedding program)."""
    _interrupt["requested"] = False


def interrupt_requested() -> bool:
    """Whether ``request_interrupt`` was called since the last ``clear_interrupt``."""
    return bool(_interrupt["requested"])


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when a signal asked the run to end (``request_interrupt``).

    Raises:
        KeyboardInterrupt: an interrupt was recorded, whether or not its first ``KeyboardInterrupt`` was lost.
    """
    if _interrupt["requested"]:
        raise KeyboardInterrupt


def interrupts_held() -> bool:
    """Whether a ``HeldInterrupts`` block is running: a signal is then only recorded, and raised when it ends."""
    return _interrupt["held"] > 0


class HeldInterrupts:
    """A block that a signal does not cut in two: the moves that publish an output and the record of what they
    published (``record_written``). The CLI's handler only records a signal that lands inside
    (``request_interrupt``); the block's end raises it (``raise_if_interrupted``), so an interrupted run stops with
    its output either not moved at all or moved whole, and says which.

    A class, not a generator: a signal landing in ``__enter__`` after the count went up is only recorded too."""

    def __enter__(self) -> None:
        _interrupt["held"] += 1

    def __exit__(self, *exc: object) -> None:
        _interrupt["held"] -= 1
        if exc[0] is None and not _interrupt["held"]:
            raise_if_interrupted()


def record_written(path: str) -> None:
    """Record that ``path`` was moved into place, whole (``write.staging``, inside ``HeldInterrupts``)."""
    _written.append(path)


def written() -> list[str]:
    """The outputs moved into place since the last ``clear_written``, in order."""
    return list(_written)


def clear_written() -> None:
    """Forget the outputs recorded (a command starts)."""
    _written.clear()


# torch's CPU allocator when the system (or the user's ``ulimit -v`` / cgroup limit) refuses an allocation.
_ALLOCATION_FAILED = re.compile(r"(?:DefaultCPUAllocator: )?can't allocate memory: you tried to allocate (\d+) bytes")


def out_of_memory(asked: int | None = None) -> InputError:
    """The error of an allocation the system refused, ``asked`` the bytes asked for where known."""
    size = f" (an allocation of {asked / 2**30:.2f} GiB failed)" if asked else ""
    return InputError(
        f"out of memory{size}: this machine (or its memory limit: ulimit -v, a container's or cgroup's limit) has "
        "less than the run needs; nothing was written: run with more memory, fold a LLaMA-layout folder with --stream "
        "(bounded memory) where this run did not, or check less (--generate 0, --samples N, --no-verify)"
    )


def environment_error(err: BaseException) -> InputError | None:
    """An ``OSError`` of ``ENVIRONMENT_ERRNOS`` as the one-line error it is (exit 2), naming the path; a failed
    allocation (``MemoryError``, torch's ``RuntimeError`` "can't allocate memory") as ``out_of_memory``; None for
    any other exception (a bug: the caller says so).

    Whatever call meets it (a ``Path.exists`` on a 5,000-character path raises ``ENAMETOOLONG``), the user gets
    the path and the system's reason, not ``internal error: OSError``.
    """
    if isinstance(err, MemoryError):
        return out_of_memory()
    if isinstance(err, RuntimeError) and (m := _ALLOCATION_FAILED.search(str(err))):
        return out_of_memory(int(m.group(1)))
    if not isinstance(err, OSError) or err.errno not in ENVIRONMENT_ERRNOS:
        return None
    path = str(err.filename) if err.filename is not None else "a file"
    if err.errno == errno.ENAMETOOLONG:
        return InputError(f"{shown(path)}: the path is too long for this file system ({len(path)} characters)")
    reason = err.strerror or type(err).__name__
    return InputError(f"cannot read or write {shown(path)}: {reason}; nothing was written")


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
"""A terminal colour code (the ONNX exporter colours its messages)."""
# The end of a sentence: a full stop, question or exclamation mark before a space, not in "e.g." or "i.e.".
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)[.!?](?=\s)")


def root_cause(err: BaseException) -> str:
    """``Type: first line`` of the innermost exception (torch.onnx wraps torch.export's reason in its own)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {first_line(err)}"


def first_line(err: BaseException | None, limit: int = 200) -> str:
    """The first line of an exception's text (its type name when it has none), for one-line messages.

    A first line longer than ``limit`` characters ends at its last sentence end within the limit, or, when no
    sentence ends there, is kept whole: a library's message is never cut mid-sentence.
    """
    if err is None:
        return "unknown error"
    text = _COLOUR.sub("", str(err)).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[0].strip()
    if len(line) <= limit:
        return line
    ends = [m.end() for m in _SENTENCE_END.finditer(line, 0, limit)]
    return line[: ends[-1]] if ends else line


# --------------------------------------------------------------------------------------------- advice, two spellings

_CLI: ContextVar[bool] = ContextVar("slabconv_cli_spelling", default=False)

PYTHON_SPELLING: dict[str, tuple[str, str]] = {
    "--force": ("WriteOptions", "force"),
    "--no-onnx": ("WriteOptions", "onnx"),
    "--no-pt2": ("WriteOptions", "pt2"),
    "--stream": ("WriteOptions", "stream"),
    "--require-folded": ("WriteOptions", "require_folded"),
    "--dtype": ("WriteOptions", "dtype"),
    "--opset": ("WriteOptions", "opset"),
    "--trust-pickle": ("LoadOptions", "trust_pickle"),
    "--ema": ("LoadOptions", "ema"),
    "--arch": ("LoadOptions", "arch"),
    "--input-shape": ("LoadOptions", "input_shape"),
    "--image-size": ("LoadOptions", "image_size"),
    "--inputs": ("VerifyOptions", "inputs"),
    "--samples": ("VerifyOptions", "samples"),
    "--rtol": ("VerifyOptions", "rtol"),
    "--strict": ("VerifyOptions", "strict"),
    "--generate": ("VerifyOptions", "generate"),
    "--runtime": ("VerifyOptions", "runtimes"),
}
"""Each command-line flag that messages advise, as the option object and field the Python API takes instead."""

_FLAG = re.compile(
    r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: ([A-Z][A-Z_]*\b|(?:[\w./-]|,(?=\d))*[\d_./](?:[\w./-]|,(?=\d))*))?"
)
"""A flag, and its value when one follows (a placeholder in capitals, or a word with a digit, ``_``, ``.`` or ``/``,
so that the English after a flag is not taken for its value)."""

_BOOLEAN = {"--force": "True", "--trust-pickle": "True", "--ema": "True", "--stream": "True", "--strict": "True"}
_BOOLEAN |= {"--require-folded": "True"}
_BOOLEAN |= {"--no-onnx": "False", "--no-pt2": "False"}
_QUOTED = {"--arch", "--inputs", "--dtype", "--runtime"}


def _python_flag(match: re.Match[str], overrides: dict[str, str]) -> str:
    flag, value = match.group(1), match.group(2)
    if flag in overrides:
        return overrides[flag] + (f" {value}" if value else "")
    if flag not in PYTHON_SPELLING:
        return match.group(0)
    cls, field = PYTHON_SPELLING[flag]
    if flag in _BOOLEAN:
        return f"{cls}({field}={_BOOLEAN[flag]})" + (f" {value}" if value else "")
    if value is None or value.isupper():  # no value, or a placeholder such as NAME
        return f"{cls}({field}=...)"
    if flag in _QUOTED:
        shown = repr((value,)) if flag == "--runtime" else repr(value)
    else:
        shown = f"({value})" if flag == "--input-shape" else value
    return f"{cls}({field}={shown})"


def in_python(text: str, overrides: dict[str, str] | None = None) -> str:
    """A message's advice in the Python API's spelling: ``pass --force`` -> ``pass WriteOptions(force=True)``,
    ``--arch deit_tiny_prepbn`` -> ``LoadOptions(arch='deit_tiny_prepbn')``, `` `slabconv list` `` ->
    ``slabconv.api.architectures()``. ``overrides`` spells a flag another way (``api.export`` takes ``force=True``).
    """
    text = text.replace("`slabconv list`", "`slabconv.api.architectures()`")
    return _FLAG.sub(lambda m: _python_flag(m, overrides or {}), text)


@contextmanager
def cli_spelling() -> Iterator[None]:
    """While active (a command-line run), messages keep their advice in flags."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


F = TypeVar("F", bound=Callable[..., Any])


def python_advice(overrides: dict[str, str] | None = None) -> Callable[[F], F]:
    """Decorate a Python API function: outside the command line, the advice of a ``SlabconvError`` it raises is
    spelled for Python (``in_python``); the exception keeps its type, exit code and attributes."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except SlabconvError as err:
                if not _CLI.get() and err.args and isinstance(err.args[0], str):
                    err.args = (in_python(err.args[0], overrides), *err.args[1:])
                raise

        return wrapper  # type: ignore[return-value]

    return decorate
