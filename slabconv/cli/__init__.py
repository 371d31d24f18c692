"""The ``slabconv`` command line: parse, call the Python API, render."""

from slabconv.cli.app import app, run

__all__ = ["app", "run"]
