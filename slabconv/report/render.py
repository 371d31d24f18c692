"""Reports for people: the fold table and the verification lines, from the same ``Report`` objects as the JSON.

The table is a Rich ``Table``; the CLI's output sink decides how wide it may be (a terminal's width, or no limit
when the output goes to a file or a CI log, so names are never cut).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from slabconv.report.data import Report
from slabconv.text import one_line, shown
from slabconv.verify.results import QUESTION_1, QUESTION_2, Verification, generation_failure


def text_table(title: str, columns: dict[str, bool], rows: Iterable[Sequence[str]]) -> Table:
    """A Rich table whose every cell is plain text (a name with ``[...]`` in it is shown as it is, never read as
    Rich markup). ``columns`` maps each header to whether its cells may wrap: wrapping columns wrap at spaces (a
    word longer than the column folds), the others (short keywords such as ``folded-forward``) never break.

    Every cell and the title pass through ``slabconv.text.one_line``: a key from a file with a newline, ``ESC[2J``
    or a right-to-left override is shown escaped, and no cell is longer than ``LINE_LIMIT``."""
    table = Table(
        title=Text(one_line(title)), box=box.SIMPLE_HEAD, title_justify="left", show_edge=False, pad_edge=False
    )
    for header, wraps in columns.items():
        table.add_column(Text(header), overflow="fold", no_wrap=not wraps)
    for row in rows:
        table.add_row(*(Text(one_line(str(cell))) for cell in row))
    return table


def folds_table(report: Report) -> Table:
    """One row per norm: name, kind, action, the layers it folded into, and why anything was kept (the reason
    column only when a norm was kept)."""
    source = report.source
    what = shown(source.arch or source.format) if source else ""
    if source is not None and "opset" in source.extra:  # an ONNX original: which opset and exporter
        what += f", opset {source.extra['opset']}, {shown(source.extra.get('producer') or 'unknown producer')}"
    title = f"folds ({what})"
    rows = []
    for d in report.folds or []:
        reason = d.reason or ""
        if d.kept_on:  # names from the file: each escaped and cut on its own (text.shown)
            reason += f" (before {', '.join(map(shown, d.kept_on))})"
        rows.append([shown(d.norm), d.kind, d.action, ", ".join(map(shown, d.into)) or "-", reason])
    columns = {"norm": True, "kind": False, "action": False, "into": True, "reason": True}
    if not any(row[-1] for row in rows):
        columns.pop("reason")
        rows = [row[:-1] for row in rows]
    return text_table(title, columns, rows)


def summary_lines(report: Report, verbose: bool = False) -> Iterator[str]:
    """The count of norms, each warning, what was written, and the verification."""
    if report.folds is not None and report.summary is not None:
        s = report.summary
        if report.command != "inspect":  # inspect's final line gives the count, as a plan
            yield f"{s.norms} norms: {s.folded} folded away, {s.kept} kept"
        for d in report.folds:
            for w in d.warnings:
                yield f"warning: {shown(d.norm)}: {w}"
            if verbose and d.paths:
                for path in d.paths:
                    yield f"  {shown(d.norm)}: blocked before {shown(path['before'])}: {path['reason']}"
    if report.outputs is not None and report.out_dir is not None:
        yield f"wrote {shown(report.out_dir)}/: {', '.join([*report.outputs.files, 'report.json'])}"
    if report.command in ("fuse", "verify"):
        yield from verification_lines(report.verification)


def _ok(passed: bool) -> str:
    return "ok  " if passed else "FAIL"


def _g(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3g}" if math.isfinite(x) else "not finite"


def verification_lines(v: Verification | None) -> Iterator[str]:
    """The verification block as lines: the verdict, question 1, the file checks, question 2, notes."""
    if v is None:
        yield "verification: skipped (--no-verify)"
        return
    samples = v.checks[0].samples if v.checks else 0
    yield f"verification: {v.headline()} on {samples} samples ({v.inputs}); {v.runtime}"
    if v.reference:
        yield f"  reference: {v.reference}"
    if v.exact:
        yield f"  {QUESTION_1}"
    for c in v.exact:
        unit = "relative error" if c.method == "graph" else "units in the last place"
        yield f"    {_ok(c.passed)} {c.name}: {_g(c.error)} {unit} (allowed {c.bound:g})"
    if v.checks:
        yield f"  {QUESTION_2}"
    for i in v.integrity:
        yield f"    {_ok(i.passed)} {i.name}: {i.detail}"
    for check in v.checks:
        yield f"    {_ok(check.passed)} {check.summary()}"
    for skipped in v.not_run:
        yield f"    skip {skipped.line()}"
    if v.generation is not None:
        g = v.generation
        speeds = ", ".join(f"{name} {tps:,.0f}" for name, tps in g.get("tokens_per_second", {}).items())
        head = f"{g.get('steps')} greedy tokens x {g.get('sequences')} prompts"
        yield f"  {_ok(bool(g.get('passed')))} generation: {head}"
        for run in g.get("runs", []):
            yield (
                f"    {run['name']}: {run['tokens_compared']} tokens compared, {run['decisive_mismatches']} decisive "
                f"mismatches, {run['near_ties']} near-ties"
            )
            if run.get("decides", True) and not run.get("passed", True):
                yield f"      {generation_failure(run)}"
        if speeds:
            yield f"    tokens/s: {speeds}"
    if v.localization is not None:
        yield f"  localisation: {v.localization.detail}"
    for note in v.notes:
        yield f"  note: {note}"


def localization_table(v: Verification) -> Table | None:
    """``verify --localize``'s table: one row per fold boundary (norm, layer, error against the correct fold,
    the rounding's own error there, verdict); None without a localisation."""
    if v.localization is None or not v.localization.boundaries:
        return None
    rows = []
    for b in v.localization.boundaries:
        rounding = "n/a" if b.rounding is None else _g(b.rounding)
        rows.append([shown(b.norm), shown(b.layer), _g(b.error), rounding, "ok" if b.passed else "DIVERGES"])
    columns = {"norm": True, "layer": True, "error": False, "rounding": False, "": False}
    return text_table("fold boundaries (candidate vs the correct fold, float64)", columns, rows)
