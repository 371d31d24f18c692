"""The ``slabconv`` Typer app: one command per module (fuse, inspect + export, verify, bench, list).

Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance; 2 bad input, unsupported model or usage
error (one line on stderr, no traceback unless ``--debug``, nothing written); 130 interrupted (Ctrl-C, SIGTERM:
nothing written). A closed stdout pipe (``slabconv list | head -1``) ends quietly with 0: it is not a failure.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer
from typer.completion import completion_init
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]

from slabconv.cli.bench import bench
from slabconv.cli.fuse import fuse
from slabconv.cli.inspect import export, inspect
from slabconv.cli.listing import list_command
from slabconv.cli.output import interrupted_line
from slabconv.cli.verify import verify
from slabconv.errors import clear_interrupt, interrupt_requested, interrupts_held, request_interrupt
from slabconv.text import one_line
from slabconv.version import __version__

EXIT_HELP = """Exit codes: 0 done and equivalent; 1 outputs differ beyond tolerance (verification failed, nothing
written); 2 bad input, unsupported model or usage error (one line on stderr, nothing written; --debug shows the
traceback); 130 interrupted (Ctrl-C, nothing written); a reader that closes the pipe early (| head) is not an
error: 0. Loading never runs code from a file unless --trust-pickle is given. Every message: docs/errors.md."""

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C or SIGTERM: 128 + SIGINT, the shells' convention."""


def closed_pipe() -> None:
    """End quietly after the reader of stdout went away (``slabconv list | head -1``): point stdout at the null
    device so the interpreter's final flush cannot fail again, and exit 0, so ``set -o pipefail`` stays green."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor (a test runner)
        pass
    sys.exit(0)


def interrupted() -> None:
    """Ctrl-C outside a command body (while parsing or importing): the same line and code as inside one."""
    sys.stderr.write(interrupted_line() + "\n")
    sys.exit(EXIT_INTERRUPTED)


class OneLineErrors(TyperGroup):
    """Usage errors (an unknown option, a missing argument, a value out of range) as one line on stderr and exit
    code 2, like every other error, instead of click's usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        standalone = kwargs.pop("standalone_mode", True)
        argv = kwargs.get("args") if kwargs.get("args") is not None else (args[0] if args else sys.argv[1:])
        if standalone and argv and argv[0] in COMPLETION_OPTIONS:
            completion(list(argv))
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[misc]
            if standalone:
                sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
        except (ClosedPipe, BrokenPipeError):
            if not standalone:
                raise
            closed_pipe()
        except click_errors.NoArgsIsHelpError as err:
            if not standalone:
                raise
            err.show()
            sys.exit(err.exit_code)
        except click_errors.UsageError as err:
            if not standalone:
                raise
            command = (
                err.ctx.info_name
                if err.ctx and err.ctx.parent
                else next((arg for arg in argv or [] if arg in self.commands), None)
            )
            where = f"slabconv {command} --help" if command else "slabconv --help"
            sys.stderr.write(one_line(f"error: {err.format_message()} (see `{where}`)") + "\n")
            sys.exit(2)
        except (KeyboardInterrupt, typer.Abort):
            if not standalone:
                raise
            interrupted()
        if standalone and isinstance(result, int):
            sys.exit(result)
        return result

    def invoke(self, ctx: Any) -> Any:
        """Run the command. A closed stdout pipe leaves as ``ClosedPipe`` (click would turn it into exit code 1, the
        code for "not equivalent"); Ctrl-C outside a command body prints the interrupted line and exits 130."""
        try:
            return super().invoke(ctx)
        except OSError as err:
            if err.errno == errno.EPIPE:
                raise ClosedPipe from None
            raise
        except KeyboardInterrupt:
            sys.stderr.write(interrupted_line() + "\n")
            raise typer.Exit(EXIT_INTERRUPTED) from None


class ClosedPipe(Exception):
    """stdout's reader went away (``| head``): not an error of this run."""


class PlainUsage(TyperCommand):
    """A command whose usage line reads ``Usage: slabconv fuse [OPTIONS] CKPT``: arguments by their metavar, a
    required one bare and an optional one in brackets (typer >= 0.2x writes a required one as ``{CKPT}``); in its
    help an argument reads ``CKPT`` and an option ``--arch NAME`` (each option's metavar), not ``CKPT <path>``."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append((param.metavar or (param.name or "").upper(), record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces.extend(param.get_usage_pieces(ctx))
                continue
            name = param.metavar or (param.name or "").upper()
            name += "..." if param.nargs != 1 else ""
            pieces.append(name if param.required else f"[{name}]")
        return pieces


completion_init()  # Typer's completion classes, which its own --install-completion option would register

SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
"""The shells Typer writes a completion script for."""

COMPLETION_OPTIONS = ("--install-completion", "--show-completion")


def completion(argv: list[str]) -> NoReturn:
    """``slabconv --install-completion [SHELL]`` / ``--show-completion [SHELL]``: install (or print) the completion
    script of SHELL, by default the shell this runs in (Typer's installer and scripts, for the command name
    ``slabconv`` however slabconv was started); exit 0, or 2 with one line for a shell Typer has no script for."""
    from typer.completion import get_completion_script, install

    option, *rest = argv
    shell = rest[0] if rest else None
    if len(rest) > 1 or (shell is not None and shell not in SHELLS):
        given = " ".join(rest)
        sys.stderr.write(
            one_line(
                f"error: {option} {given}: give one shell, {', '.join(SHELLS[:-1])} or {SHELLS[-1]}, or none for "
                "the shell this runs in (see `slabconv --help`)"
            )
            + "\n"
        )
        sys.exit(2)
    if shell is None and not os.environ.get("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"):
        from typer._completion_shared import _get_shell_name

        shell = _get_shell_name()
    if shell not in SHELLS:
        sys.stderr.write(f"error: {option}: cannot tell which shell this is; name it, e.g. {option} bash\n")
        sys.exit(2)
    if option == "--show-completion":
        typer.echo(get_completion_script(prog_name="slabconv", complete_var="_SLABCONV_COMPLETE", shell=shell))
        sys.exit(0)
    shell, path = install(shell=shell, prog_name="slabconv", complete_var="_SLABCONV_COMPLETE")
    typer.echo(f"{shell} completion installed in {path}; it takes effect in a new terminal")
    sys.exit(0)


app = typer.Typer(
    cls=OneLineErrors,
    add_completion=False,
    name="slabconv",
    help=(
        "Fold SLAB RepBN / BatchNorm norms into the layers around them, exactly; write safetensors, ONNX and a "
        "torch.export program; and prove the result equals the original.\n\n"
        "Examples:\n\n\b\n"
        "  slabconv fuse fixtures/digits-prepbn/checkpoint.pth --out build/demo\n"
        "  slabconv inspect checkpoint.pth --arch deit_tiny_prepbn\n"
        "  slabconv verify checkpoint.pth checkpoint-fused --junit equivalence.xml\n"
        "  slabconv list\n\n" + EXIT_HELP
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slabconv {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    install_completion: Annotated[
        bool,
        typer.Option(
            "--install-completion",
            help="Install shell completion: --install-completion [SHELL], SHELL one of bash, zsh, fish, powershell "
            "(default: the shell this runs in). It completes commands, options and the values of --arch, --runtime "
            "and --dtype.",
        ),
    ] = False,
    show_completion: Annotated[
        bool,
        typer.Option("--show-completion", help="Print the completion script: --show-completion [SHELL]."),
    ] = False,
) -> None:
    """slabconv: fold SLAB RepBN norms exactly."""
    if install_completion or show_completion:  # after another option (``slabconv --version --install-completion``)
        completion(["--install-completion" if install_completion else "--show-completion"])
    if not os.environ.get("SLABCONV_DEBUG"):
        # Library warnings and log lines are not slabconv's messages: stderr carries one line per failure. A handler
        # on the root logger keeps logging's last resort (which prints any library's warning) from running.
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        root = logging.getLogger()
        if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
            root.addHandler(logging.NullHandler())


app.command(cls=PlainUsage)(fuse)
app.command(cls=PlainUsage)(inspect)
app.command(cls=PlainUsage)(export)
app.command(cls=PlainUsage)(verify)
app.command(cls=PlainUsage)(bench)
app.command("list", cls=PlainUsage)(list_command)


def _interrupt(signum: int, frame: object) -> None:
    """End the run like Ctrl-C. Further signals of ``INTERRUPTING_SIGNALS`` are ignored from here on, so a second
    one (a CI runner sends SIGTERM, then SIGHUP as it closes the session) cannot cut the removal of the staging
    folder short; SIGKILL still ends the process, and the next run removes what it left. A second Ctrl-C still
    raises. The interrupt is recorded first (``errors.request_interrupt``): where the ``KeyboardInterrupt`` lands
    in a weakref callback or ``__del__`` and is lost, the next progress step or publication raises it again."""
    request_interrupt()
    if signum != signal.SIGINT:
        for name in INTERRUPTING_SIGNALS:
            other = getattr(signal, name, None)
            if other is not None:
                signal.signal(other, signal.SIG_IGN)
    if interrupts_held():  # an output is being moved into place: the block's end raises it (errors.HeldInterrupts)
        return
    raise KeyboardInterrupt


def _unraisable(hook: Callable[[Any], object]) -> Callable[[Any], object]:
    """``sys.unraisablehook`` that drops a ``KeyboardInterrupt`` lost in a weakref callback or ``__del__`` once the
    interrupt is recorded (it is raised again, so its "Exception ignored" traceback would only split stderr's last
    line from ``interrupted; nothing was written``), and passes everything else to ``hook``."""

    def unraisable(info: Any) -> object:
        if isinstance(info.exc_value, KeyboardInterrupt) and interrupt_requested():
            return None
        return hook(info)

    return unraisable


INTERRUPTING_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")
"""Signals that end a run like Ctrl-C (``interrupted; nothing was written``, staging removed): SIGTERM (a cancelled
CI job), SIGHUP (the terminal closed, an ssh connection dropped), SIGQUIT (Ctrl-\\). Those this system lacks
(Windows has only SIGTERM) are skipped."""


def install_signal_handlers() -> list[str]:
    """Make each of ``INTERRUPTING_SIGNALS`` this system has raise ``KeyboardInterrupt`` in the main thread, so the
    staging folder is removed on the way out as for Ctrl-C, and SIGINT too where Python's own handler has it (not
    where the process was started with SIGINT ignored, as a shell starts a background job); every one of them is
    recorded (``errors.request_interrupt``) so that none is lost. Returns the names installed."""
    clear_interrupt()
    installed = []
    for name in INTERRUPTING_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, _interrupt)
            installed.append(name)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        installed.append("SIGINT")
    if not getattr(sys.unraisablehook, "slabconv", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)
        sys.unraisablehook.slabconv = True  # type: ignore[attr-defined]
    return installed


def open_missing_streams() -> list[str]:
    """Point each standard stream the caller closed (``>&-``, ``2>&-``, a daemon without a terminal) at the null
    device, and give Python a file object for it (it makes ``sys.stdout`` None then): a missing stream is not an
    error, and the descriptor cannot be taken by a file slabconv opens later (which would then receive what a
    library prints to stdout). Returns the names of the streams opened.

    Source: POSIX ``open`` returns the lowest free descriptor, so the null device lands on the closed one.
    """
    opened = []
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:  # pragma: no cover - a lower descriptor was free, which the loop opened first
                os.dup2(got, fd)
                os.close(got)
            opened.append(name)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 - the process's own stream
    return opened


def run() -> None:
    """Console-script entry point: closed standard streams become the null device (``open_missing_streams``), the
    signals of ``INTERRUPTING_SIGNALS`` are handled like Ctrl-C (staged outputs removed, nothing written), then the
    app runs and the process ends with its exit status (``leave``)."""
    open_missing_streams()
    install_signal_handlers()
    try:
        app()
    except SystemExit as done:
        leave(done.code)
    leave(0)


def leave(code: object) -> NoReturn:
    """End the process with ``code`` (``SystemExit``'s: None, a status, or a message for stderr and status 1) once
    the standard streams are flushed and the ``atexit`` hooks have run, without the interpreter's teardown.

    The teardown frees every object of torch and the other imported libraries one by one: more than a second after
    a ``fuse`` of a 350M model (half a second after a bare ``import torch``), which a user waits for and nothing
    needs.
    Every file slabconv writes is closed and moved into place before the command returns. An interrupted run
    (130) needs it too: left to the interpreter, a signal inside ``torch.export.save`` ended the process killed
    by SIGINT (status -2 to a parent) in about half the tries here. Where ``atexit`` cannot be run by hand (it is
    CPython's), the interpreter exits as usual.
    """
    if code is None or isinstance(code, int):
        status = code or 0
    else:
        print(code, file=sys.stderr)
        status = 1
    run_hooks = getattr(atexit, "_run_exitfuncs", None)
    if run_hooks is None:
        raise SystemExit(status)
    with contextlib.suppress(BaseException):  # a second Ctrl-C here still leaves with this status
        run_hooks()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status)
