"""``slabconv list``: the registered architectures."""

from __future__ import annotations

import json

from rich import box
from rich.table import Table

from slabconv.cli import options as o
from slabconv.cli.output import Output


def list_archs(as_json: o.Json = False) -> None:
    """List the registered architectures, their aliases and what each is.

    A name or alias is what --arch takes; without --arch the architecture is detected from the checkpoint.

    Examples:

    \b
      slabconv list
      slabconv list --json
    """
    from slabconv.zoo import list_archs as archs

    output = Output(json=as_json)
    rows: list[dict[str, str | list[str]]] = [
        {"name": s.name, "aliases": list(s.aliases), "family": s.family, "description": s.description} for s in archs()
    ]
    if as_json:
        output.data(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="architectures", box=box.SIMPLE_HEAD, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("name", "aliases", "family", "description"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(str(row["name"]), ", ".join(row["aliases"]), str(row["family"]), str(row["description"]))
    output.table(table)
