"""The one place the CLI writes to: reports on stdout, progress and errors on stderr, in three modes.

- **human** (default): on a terminal, Rich tables and a Rich progress display (a line per stage with a bar over
  norms or verification runs and the elapsed time); anywhere else (a file, a pipe, a CI log), tables that never
  cut a name and one plain progress line per stage, with the seconds since the start.
- **json** (``--json``): the report as JSON on stdout, nothing else there; progress still on stderr.
- **quiet** (``--quiet``): errors and the command's final line only.

``--verbose`` adds each norm's blocked paths and a progress line for every step. Colours are off with
``NO_COLOR`` and whenever the stream is not a terminal, even with ``FORCE_COLOR`` set (see ``_console``); the live
display needs a terminal that can redraw (not ``TERM=dumb``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from slabconv.errors import raise_if_interrupted, written
from slabconv.report.data import Report
from slabconv.report.render import folds_table, summary_lines
from slabconv.text import one_line

ProgressFn = Callable[..., None]

INTERRUPTED = "interrupted; nothing was written"
"""The last line on stderr of a run that Ctrl-C or a signal ended (exit code 130) before it moved an output into
place; ``interrupted_line`` names what it had moved otherwise."""


def interrupted_line() -> str:
    """The interrupted run's last line: ``INTERRUPTED``, or the outputs it had already moved into place whole
    (``errors.written``: an interrupt that lands while an output is being moved takes effect once it is in place)."""
    done = written()
    if not done:
        return INTERRUPTED
    return one_line(f"interrupted; written in full before it: {', '.join(done)}; nothing else was written")


class PipeConsole(Console):
    """A Rich console whose closed pipe (``slabconv list | head -1``) is a ``BrokenPipeError`` for the app to end
    quietly with 0 (Rich itself exits 1, which is this tool's code for "not equivalent")."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no such method, or a closed file
        return False


def _console(stream: IO[str] | None, stderr: bool) -> Console:
    """The console for one standard stream.

    On a real terminal, Rich's own rules (colours unless ``NO_COLOR``; ``TERM=dumb`` has no cursor movement, so
    ``Output.progress`` prints plain lines there). Anywhere else, whatever the environment says (``FORCE_COLOR``,
    ``TTY_COMPATIBLE``, set by many CI systems, make Rich treat a pipe as a terminal): plain text, no colours, no
    cursor movement, no width limit (a table never cuts a name). A stream the caller closed (``>&-``: Python
    makes it None) is the null device: not an error.
    """
    if stream is None:
        stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the console
    if _isatty(stream):
        return PipeConsole(file=stream, stderr=stderr, soft_wrap=False)
    return PipeConsole(
        file=stream,
        stderr=stderr,
        width=100_000,
        force_terminal=False,
        force_interactive=False,
        color_system=None,
        no_color=True,
        highlight=False,
        soft_wrap=True,
    )


class Output:
    """The output sink of one command run.

    Args:
        json: print reports as JSON.
        quiet: print errors and the final line only.
        verbose: print per-norm detail and every progress step.
        out, err: the consoles for stdout and stderr (default: made for ``sys.stdout`` / ``sys.stderr``, as a
            terminal or not; tests pass their own).
    """

    def __init__(
        self,
        *,
        json: bool = False,
        quiet: bool = False,
        verbose: bool = False,
        out: Console | None = None,
        err: Console | None = None,
    ):
        self.json, self.quiet, self.verbose = json, quiet, verbose
        self.out = out or _console(sys.stdout, stderr=False)
        self.err = err or _console(sys.stderr, stderr=True)

    def table(self, table: Table) -> None:
        """A Rich table on stdout (not with ``--json`` or ``--quiet``). Off a terminal it has the width of its
        longest cell, so no name is cut, and no trailing blanks."""
        if self.json or self.quiet:
            return
        if self.out.is_terminal:
            self.out.print(table)
            return
        with self.out.capture() as captured:
            self.out.print(table)
        for text in captured.get().splitlines():
            self.out.print(text.rstrip(), markup=False, highlight=False, crop=False, overflow="ignore")

    def line(self, text: str) -> None:
        """A line of the human output (not with ``--json`` or ``--quiet``), through ``one_line``: whatever names
        from a file it holds, it is one printable line of bounded length."""
        if not (self.json or self.quiet):
            self.out.print(one_line(text), markup=False, highlight=False, crop=False, overflow="ignore")

    def final(self, text: str) -> None:
        """The command's last line: printed in human and quiet modes (JSON carries the same facts)."""
        if not self.json:
            self.out.print(one_line(text), markup=False, highlight=False, crop=False, overflow="ignore")

    def report(self, report: Report, final: str | None = None) -> None:
        """A report: JSON, or the fold table (when it has folds) and its lines, then ``final``."""
        if self.json:
            sys.stdout.write(report.to_json())
            sys.stdout.flush()
            return
        if not self.quiet:
            if report.folds:
                self.table(folds_table(report, self.out.width if self.out.is_terminal else None))
            for text in summary_lines(report, self.verbose):
                self.line(text)
        if final:
            self.final(final)

    def data(self, payload: str) -> None:
        """Raw JSON (``list --json``)."""
        sys.stdout.write(payload)

    def error(self, text: str) -> None:
        """One line on stderr (always, whatever the mode), through ``one_line``."""
        self.err.print(one_line(text), markup=False, highlight=False, soft_wrap=True)

    def interrupted(self) -> None:
        """``interrupted_line()`` on stderr, written to the stream itself rather than through Rich: a signal's
        ``KeyboardInterrupt`` can land inside ``Console.print`` after Rich opened its buffer and before the ``with``
        block that closes it took hold, and every later line through that console then stays in the buffer."""
        stream = self.err.file
        stream.write(interrupted_line() + "\n")
        stream.flush()

    @contextmanager
    def progress(self) -> Iterator[ProgressFn]:
        """A progress callback ``progress(stage, done=None, total=None, detail=None)`` for the API.

        A new ``stage`` text starts a new line; ``done``/``total`` move its bar; ``detail`` is shown with
        ``--verbose`` only. Every call first raises ``KeyboardInterrupt`` when a signal asked the run to end and its
        first one was lost (``errors.raise_if_interrupted``), so the run stops at its next step.
        """
        progress: contextlib.AbstractContextManager[ProgressFn]
        if self.quiet:
            progress = contextlib.nullcontext(_silent)
        else:  # the live display only where it can redraw in place: a terminal that is not TERM=dumb (``_console``)
            progress = self._rich_progress() if self.err.is_interactive else self._plain_progress()
        with progress as fn:

            def checked(*args: Any, **kwargs: Any) -> None:
                raise_if_interrupted()
                fn(*args, **kwargs)

            yield checked

    @contextmanager
    def _rich_progress(self) -> Iterator[ProgressFn]:
        """The live display: a row per stage with its status, its text (never read as Rich markup: a stage such as
        ``onnxruntime[all-optimizations]`` keeps its brackets), a bar and the elapsed time. On a narrow terminal the
        text wraps at spaces and the bar shrinks, so the status and the time stay. When the command fails, the
        unfinished row is removed before the display stops, so no frozen spinner sits above the error line."""
        columns = (
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description}", markup=False, table_column=Column(ratio=3, no_wrap=False)),
            BarColumn(bar_width=None, table_column=Column(ratio=1, max_width=24)),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
        )
        with Progress(*columns, console=self.err, transient=False, expand=True) as bar:
            tasks: dict[str, Any] = {}
            current: list[str] = []

            def update(
                stage: str, done: int | None = None, total: int | None = None, detail: str | None = None
            ) -> None:
                if stage not in tasks:
                    if current:
                        task = tasks[current[-1]]
                        bar.update(task, total=bar.tasks[task].total or 1, completed=bar.tasks[task].total or 1)
                    tasks[stage] = bar.add_task(one_line(stage), total=total)
                    current.append(stage)
                bar.update(tasks[stage], total=total, completed=done or 0)
                if detail and self.verbose:
                    bar.console.print(f"  {one_line(detail)}", markup=False, highlight=False)

            try:
                yield update
            except BaseException:
                for task in bar.tasks:
                    if not task.finished:
                        bar.remove_task(task.id)
                raise
            if current:
                task = tasks[current[-1]]
                bar.update(task, total=bar.tasks[task].total or 1, completed=bar.tasks[task].total or 1)

    @contextmanager
    def _plain_progress(self) -> Iterator[ProgressFn]:
        """One line per stage on stderr, ``[ seconds] stage``. The lines of the checking stages (loading,
        tracing, planning) are held until the long work starts (or the command ends well): a bad input fails in
        those stages, and then its one error line is all that is printed."""
        start = time.monotonic()
        seen: set[str] = set()
        held: list[str] = []
        releasing = [False]

        def emit(text: str) -> None:
            if releasing[0]:
                self.error(text)
            else:
                held.append(text)

        def update(stage: str, done: int | None = None, total: int | None = None, detail: str | None = None) -> None:
            elapsed = time.monotonic() - start
            if stage not in seen:
                seen.add(stage)
                if not releasing[0] and not stage.startswith(HELD_STAGES):
                    releasing[0] = True
                    for text in held:
                        self.error(text)
                    held.clear()
                emit(f"[{elapsed:7.1f}s] {stage}")
            elif self.verbose and detail:
                count = f" ({done}/{total})" if total and f"/{total})" not in detail else ""
                emit(f"[{elapsed:7.1f}s]   {detail}{count}")

        yield update
        for text in held:  # the command ended well: the held lines are progress after all
            self.error(text)


HELD_STAGES = ("loading", "tracing", "folding norms", "opening", "planning", "verifying: the reference")
"""Stages in which bad input is found (their lines wait, see ``Output._plain_progress``)."""


def _silent(*args: Any, **kwargs: Any) -> None:
    return None
