"""``slabconv list``: the registered architectures."""

from __future__ import annotations

import json

from slabconv.cli import options as o
from slabconv.cli.output import Output
from slabconv.report.render import text_table


def list_command(as_json: o.Json = False) -> None:
    """List the registered architectures, their aliases and what each is.

    A name or alias is what --arch takes; without --arch the architecture is detected from the checkpoint.

    Examples:

    \b
      slabconv list
      slabconv list --json
    """
    from slabconv.api import architectures

    output = Output(json=as_json)
    rows = architectures()
    if as_json:
        output.data(json.dumps(rows, indent=2) + "\n")
        return
    columns = {"name": False, "aliases": True, "family": False, "description": True}
    cells = [[str(r["name"]), ", ".join(r["aliases"]), str(r["family"]), str(r["description"])] for r in rows]
    narrow = output.out.is_terminal and output.out.width < WIDE_ENOUGH
    if narrow:  # the descriptions would wrap every row into a paragraph: the names come first
        columns.pop("description")
        cells = [row[:-1] for row in cells]
    output.table(text_table("architectures", columns, cells))
    if narrow:
        output.line(f"(descriptions: slabconv list --json, or {WIDE_ENOUGH}+ columns)")


WIDE_ENOUGH = 100
"""The terminal width from which ``slabconv list`` shows the description column."""
