"""The one map from exception to message and exit code (0 done, 1 not equivalent, 2 bad input or usage,
130 interrupted).

Every failure a user can cause is a ``SlabconvError`` and prints exactly one line on stderr (every message goes
through ``slabconv.text.one_line``: text from a file or the user cannot split it, flood it or reach the terminal
as control characters); a failed
verification prints its report (the human table, or JSON) and then its one line; anything else is a bug, also
one line, with the traceback only with ``--debug`` (or ``SLABCONV_DEBUG=1``).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from slabconv.cli.output import Output
from slabconv.errors import (
    SlabconvError,
    UsageError,
    VerificationError,
    clear_written,
    cli_spelling,
    environment_error,
)
from slabconv.text import one_line


@contextmanager
def errors(output: Output, debug: bool) -> Iterator[None]:
    """Run a command body, turning every exception into one line on stderr and the exit code it stands for.

    Inside it, an ``--arch`` name is checked against the weights it is given (``registry.checking_names``): a
    preset of another size is refused with the name that fits, not built and recorded under the wrong name.
    """
    from slabconv.zoo.registry import checking_names

    debug = debug or bool(os.environ.get("SLABCONV_DEBUG"))
    clear_written()  # the interrupted line names what this command moved into place (errors.record_written)
    try:
        if output.quiet and output.verbose:
            raise UsageError("--quiet prints only errors and the final line, --verbose adds detail: give one of them")
        with checking_names(), cli_spelling():
            yield
    except typer.Exit:
        raise
    except VerificationError as err:
        if err.report is not None:
            output.report(err.report)
        output.error(one_line(f"error: {err}"))
        raise typer.Exit(1) from None
    except SlabconvError as err:
        if debug:
            traceback.print_exc()
        output.error(one_line(f"error: {err}"))
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        output.interrupted()
        raise typer.Exit(130) from None
    except BrokenPipeError:
        raise  # stdout's reader went away: the app ends quietly with 0 (``OneLineErrors``)
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line, traceback with --debug
        if debug:
            traceback.print_exc()
        known = environment_error(err)  # a path too long, permissions, a full disk: the system's, not a bug
        if known is not None:
            output.error(one_line(f"error: {known}"))
            raise typer.Exit(known.exit_code) from None
        text = str(err).strip()
        first = text.splitlines()[0] if text else ""
        output.error(
            one_line(
                f"internal error: {type(err).__name__}: {first} (a bug in slabconv; rerun with --debug and report it)"
            )
        )
        raise typer.Exit(2) from None
