"""``slabconv list``: the registered architectures."""

from __future__ import annotations

import json

from slabconv.cli import options as o
from slabconv.cli.output import Output
from slabconv.report.render import text_table


def list_archs(as_json: o.Json = False) -> None:
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
    output.table(text_table("architectures", columns, cells))
