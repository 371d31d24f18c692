"""Every import in ``slabconv/`` runs downhill: a stage imports only stages before it in the pipeline
(load → engine → write → verify → report), never one after it, and no two packages import each other.

The ranks are the ones docs/architecture.md draws; an import at module top or inside a function counts the same
(a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "slabconv"

RANK = {
    # the base: no slabconv imports above it
    "version": 0,
    "text": 0,
    "errors": 1,
    "tolerances": 1,
    "util": 2,
    "options": 2,
    "fold": 2,
    # the stages, in the order data flows
    "zoo": 3,
    "load": 4,
    "engine": 5,
    "write": 6,
    "verify": 7,
    "report": 8,
    # the drivers that string stages together, then the faces
    "pipeline": 9,
    "onnx_in": 9,
    "bench": 9,
    "bench_generation": 9,
    "api": 10,
    "cli": 11,
    "__main__": 12,
    "__init__": 12,
}


def _unit(module: str) -> str:
    """``slabconv.engine.planner`` -> ``engine``; ``slabconv`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported slabconv module) for every import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "slabconv":
                found += [(node.lineno, f"slabconv.{alias.name}") for alias in node.names]
            elif node.module.startswith("slabconv."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("slabconv.")]
    return found


def _edges() -> list[tuple[str, str, str]]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        here = _unit(".".join(rel.with_suffix("").parts))
        for line, module in _imports(path):
            edges.append((here, _unit(module), f"{rel}:{line} imports {module}"))
    return edges


def test_every_unit_has_a_rank():
    units = {_unit(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(RANK), f"give these a rank here and in docs/architecture.md: {sorted(units - set(RANK))}"


def test_imports_run_downhill():
    uphill = [where for here, there, where in _edges() if RANK[there] > RANK[here]]
    assert not uphill, "imports from a later stage:\n" + "\n".join(uphill)


def test_no_two_packages_import_each_other():
    pairs = {(here, there) for here, there, _ in _edges() if here != there}
    cycles = sorted((a, b) for a, b in pairs if (b, a) in pairs and a < b)
    assert not cycles, f"package cycles: {cycles}"


@pytest.mark.parametrize(
    ("here", "there"),
    [("engine", "verify"), ("verify", "report"), ("load", "engine"), ("write", "verify")],
)
def test_the_check_sees_an_uphill_import(tmp_path, here, there):
    # the walker finds a lazy import inside a function, the form an uphill import usually takes
    module = tmp_path / "m.py"
    module.write_text(f"def f():\n    from slabconv.{there}.x import y\n    return y\n", encoding="utf-8")
    ((_, imported),) = _imports(module)
    assert RANK[_unit(imported)] > RANK[here]
