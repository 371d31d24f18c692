"""Reports for people: the fold table and the verification lines, from the same ``Report`` objects as the JSON.

The table is a Rich ``Table``; the CLI's output sink decides how wide it may be (a terminal's width, or no limit
when the output goes to a file or a CI log, so names are never cut).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from slabconv.load.source import Source
from slabconv.report.data import Report
from slabconv.text import count, one_line, shown, units_in_last_place
from slabconv.verify.results import (
    QUESTION_1,
    QUESTION_2,
    Verification,
    g3,
    generation_failure,
    int8_failure,
    int8_summary,
    task_metric_failure,
)

_WORD = re.compile(r"\S+\s*|\s+")
_SEAM = re.compile(r"(?<=[,._/(])(?![,._/(])|(?<=-)(?![->])")
"""A cell's text as words (up to and including the spaces after them), and where a word may break: after a run of
``,``, ``.``, ``_``, ``/``, ``(``, or after a ``-`` that does not start an arrow (``LayerNorm->RepBN`` stays)."""


def _pieces(word: str) -> list[str]:
    return [piece for piece in _SEAM.split(word) if piece]


class NameCell:
    """A table cell that wraps at spaces, and inside a word only at a name's seams: after ``.``, ``_``, ``,``,
    ``/``, ``(`` or ``-`` (``model.layers.0.`` / ``input_layernorm``), never inside a word. Its narrowest width
    (what Rich allots a column at least) is its longest piece; only a column narrower than that (a terminal too
    narrow for the table's keywords) folds a piece. Off a terminal (no width limit) it is one line.
    """

    def __init__(self, text: str):
        self.text = text
        self.words = [word for word in _WORD.findall(text) if word]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        pieces = (piece.rstrip() for word in self.words for piece in _pieces(word))
        widest = max((cell_len(piece) for piece in pieces), default=0)
        return Measurement(min(widest, options.max_width), min(cell_len(self.text), options.max_width))

    def lines(self, width: int) -> list[str]:
        """The text in lines of at most ``width`` cells: broken at spaces, a word wider than ``width`` at its seams,
        and a piece wider than that folded."""
        lines: list[str] = []
        line = ""
        for word in self.words:
            if line and cell_len((line + word).rstrip()) > width:
                lines.append(line.rstrip())
                line = ""
            if cell_len(word.rstrip()) <= width:
                line += word
                continue
            for piece in _pieces(word):  # a word wider than the column: break at its seams
                if line and cell_len((line + piece).rstrip()) > width:
                    lines.append(line.rstrip())
                    line = ""
                line += piece
                while cell_len(line.rstrip()) > width:  # a piece wider than the column: folded, as a last resort
                    lines.append(line[:width])
                    line = line[width:]
        if line.strip() or not lines:
            lines.append(line.rstrip())
        return lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(self.lines(max(1, options.max_width))), overflow="fold", no_wrap=True)


def text_table(title: str, columns: dict[str, bool], rows: Iterable[Sequence[str]]) -> Table:
    """A Rich table whose every cell is plain text (a name with ``[...]`` in it is shown as it is, never read as
    Rich markup). ``columns`` maps each header to whether its cells may wrap: wrapping columns wrap at a name's
    seams (``NameCell``: after a space, ``,``, ``.``, ``_``, ...; never mid-word), the others (short keywords such
    as ``folded-forward``, numbers) never break.

    Every cell and the title pass through ``slabconv.text.one_line``: a key from a file with a newline, ``ESC[2J``
    or a right-to-left override is shown escaped, and no cell is longer than ``LINE_LIMIT``."""
    table = Table(
        title=Text(one_line(title)), box=box.SIMPLE_HEAD, title_justify="left", show_edge=False, pad_edge=False
    )
    wraps = list(columns.values())
    for header, wrap in columns.items():
        table.add_column(Text(header), overflow="fold", no_wrap=not wrap)
    for row in rows:
        cells = [one_line(str(cell)) for cell in row]
        table.add_row(*(NameCell(cell) if wrap else Text(cell) for cell, wrap in zip(cells, wraps, strict=True)))
    return table


def int8_steps(report: Report) -> dict[str, tuple[float, bool]]:
    """Per norm, the largest per-channel int8 step growth over the layers it folded into and whether one of them is
    flagged (``engine.ranges``; ``report.ranges``)."""
    worst: dict[str, tuple[float, bool]] = {}
    for r in report.ranges or []:
        for norm in r.norms:
            growth, flagged = worst.get(norm, (0.0, False))
            worst[norm] = (max(growth, r.step_growth), flagged or r.flagged)
    return worst


def folds_table(report: Report, width: int | None = None) -> Table:
    """One row per norm: name, kind, action, the layers it folded into, the coarsest per-channel int8 step growth
    of those layers (when the report measured ranges), and why anything was kept (the reason column only when a
    norm was kept). Narrower than ``COMPACT_BELOW`` columns (``width``, a terminal's), the kind and the int8 step
    are left out and the reason shares the ``into`` column (``kept: REASON ...``), so no name breaks mid-word."""
    source = report.source
    what = shown(source.arch or source.format) if source else ""
    if source is not None and "opset" in source.extra:  # an ONNX original: which opset and exporter
        what += f", opset {source.extra['opset']}, {shown(source.extra.get('producer') or 'unknown producer')}"
    title = f"folds ({what})"
    rows = []
    steps = int8_steps(report)
    for d in report.folds or []:
        reason = d.reason or ""
        if d.kept_on:  # names from the file: each escaped and cut on its own (text.shown)
            reason += f" (before {', '.join(map(shown, d.kept_on))})"
        row = [shown(d.norm), d.kind, d.action, ", ".join(map(shown, d.into)) or "-"]
        if report.ranges is not None:
            growth, flagged = steps.get(d.norm, (0.0, False))
            row.append(f"{growth:.3g}x" + (" FLAGGED" if flagged else "") if growth else "-")
        rows.append([*row, reason])
    columns = {"norm": True, "kind": False, "action": False, "into": True, "int8 step": False, "reason": True}
    if report.ranges is None:
        columns.pop("int8 step")
    if width is not None and width < COMPACT_BELOW:
        columns = {"norm": True, "action": False, "into, or why kept": True}
        return text_table(title, columns, [[row[0], row[2], row[3] if not row[-1] else row[-1]] for row in rows])
    if not any(row[-1] for row in rows):
        columns.pop("reason")
        rows = [row[:-1] for row in rows]
    return text_table(title, columns, rows)


COMPACT_BELOW = 90
"""The terminal width under which ``folds_table`` leaves out the kind column and puts the reason under ``into``."""


def summary_lines(report: Report, verbose: bool = False) -> Iterator[str]:
    """The count of norms, each warning, what was written, and the verification. ``verbose`` adds where the model
    came from (``source_line``), each norm's blocked paths and, for an output folder, each file's sha256."""
    source = report.source
    if verbose:
        for side, name in ((source, "source"), (report.reference, "reference"), (report.candidate, "candidate")):
            if side is not None:
                yield source_line(name, side)
    if source is not None and source.batch is not None and report.command in ("inspect", "fuse", "export"):
        out = report.outputs
        info = out.onnx_info if out is not None else None
        dynamic = [k for k in ("dynamic_batch", "pt2_dynamic_batch") if info and k in info]
        onnx = Path(out.onnx).name if report.command == "export" and out and out.onnx else ""  # export: one file
        static, b = f"warning: {shown(source.path)} was exported with a static batch of {source.batch}", source.batch
        if dynamic and all(info[k] for k in dynamic):  # type: ignore[index]
            yield static + (
                f"; {onnx} takes any batch (the model's code allows it); slabconv verify runs it on batches of {b}, as "
                "the original runs"
                if onnx
                else f"; the fused files take any batch (the model's code allows it); verification runs them on "
                f"batches of {b}, as the original runs"
            )
        else:
            yield (
                f"{static}, so {onnx} runs on batches of exactly {b}"
                if onnx
                else f"{static}, so the fused files run on batches of exactly {b}"
            ) + f"; export it with {dynamic_batch_spelling(source)}"
    if report.folds is not None and report.summary is not None:
        s = report.summary
        if report.command != "inspect":  # inspect's final line gives the count, as a plan
            yield f"{count(s.norms, 'norm')}: {s.folded} folded away, {s.kept} kept"
        for d in report.folds:
            for w in d.warnings:
                yield f"warning: {shown(d.norm)}: {w}"
            if verbose and d.paths:
                for path in d.paths:
                    yield f"  {shown(d.norm)}: blocked before {shown(path['before'])}: {path['reason']}"
            if verbose and d.no_backward and d.action in ("kept-affine", "kept"):
                yield f"  {shown(d.norm)}: no backward fold: {shown(d.no_backward)}"
            if verbose and d.direction:
                yield f"  {shown(d.norm)}: direction: {d.direction}"
    if report.outputs is not None and report.out_dir is not None:
        yield f"wrote {shown(report.out_dir)}/: {', '.join([*report.outputs.files, 'report.json'])}"
        if verbose:
            for name, digest in report.outputs.sha256.items():
                yield f"  {shown(name)}: sha256 {digest}"
    if report.command in ("fuse", "verify"):
        yield from verification_lines(report.verification)


_DIM = "{0: torch.export.Dim('batch')}"
_DYNAMIC_BATCH = {
    "program": f"dynamic_shapes=({_DIM},) for any batch (docs/own-model.md)",
    "dynamo": f"torch.onnx.export(..., dynamo=True, dynamic_shapes=({_DIM},)) for any batch (docs/onnx.md)",
    "torchscript": (
        "torch.onnx.export(..., dynamo=False, input_names=['x'], dynamic_axes={'x': {0: 'batch'}}) for any batch "
        "(docs/onnx.md)"
    ),
    "tf2onnx": (
        "tf2onnx.convert.from_keras(..., input_signature=(tf.TensorSpec((None, ...), tf.float32, name='x'),)) for any "
        "batch (docs/onnx.md)"
    ),
    "jax2onnx": "jax2onnx.to_onnx(..., [('B', ...)]) (a named batch axis) for any batch (docs/onnx.md)",
    None: (
        "a dynamic batch axis (torch.onnx.export: dynamic_shapes with dynamo=True, dynamic_axes with dynamo=False) "
        "for any batch (docs/onnx.md)"
    ),
}
"""How to export a dynamic batch, in the spelling of what wrote the file: ``torch.export`` for a program, the ONNX
exporter ``source.exporter`` names for an ONNX file (``slabconv.load.onnx_file.torch_exporter``), else tf2onnx's or
jax2onnx's where the file's ``producer_name`` is theirs, torch's two spellings when the file does not tell."""


def dynamic_batch_spelling(source: Source) -> str:
    """The advice of the static-batch warning for ``source``: ``dynamic_shapes`` for a ``torch.export`` program
    and a dynamo ONNX export, ``dynamic_axes`` for a TorchScript one (``torch.onnx.export(..., dynamo=False)``),
    tf2onnx's ``input_signature`` and jax2onnx's named axis for their files (``producer_name``), both torch
    spellings for an ONNX file that does not say which exporter wrote it."""
    if source.format != "onnx":
        return _DYNAMIC_BATCH["program"]
    exporter = source.extra.get("exporter") or str(source.extra.get("producer") or "").split(" ")[0] or None
    return _DYNAMIC_BATCH.get(exporter, _DYNAMIC_BATCH[None])


def source_line(name: str, side: Source) -> str:
    """``source: PATH: FORMAT, ARCH, DTYPE weights, input (C, H, W), any batch; sha256 HEX``: where a model came
    from and what slabconv read it as (``--verbose``)."""
    facts = [side.format, *([side.arch] if side.arch else []), *([f"{side.dtype} weights"] if side.dtype else [])]
    if side.input_shape is not None:
        facts.append(f"input ({', '.join(map(str, side.input_shape))})")
        facts.append("any batch" if side.batch is None else f"batch {side.batch} only")
    return f"{name}: {shown(side.path)}: {', '.join(facts)}; sha256 {side.sha256 or 'n/a'}"


def _ok(passed: bool) -> str:
    return "ok  " if passed else "FAIL"


def task_metric_lines(t: dict) -> Iterator[str]:
    """The task-metrics block: one line per run, the perplexity and the next-token KL from the float64 reference."""
    ref = t["reference"]
    yield (
        f"  {_ok(bool(t.get('passed')))} task metrics: {t['sequences']} sequences, {t['positions']} positions "
        f"teacher-forced; perplexity {ref['perplexity']:.6g} ({ref['name']})"
    )
    for run in t["runs"]:
        role = "" if run.get("decides", True) else " (baseline)"
        yield (
            f"    {run['name']}{role}: perplexity {run['perplexity']:.6g}, next-token KL from the reference mean "
            f"{g3(run['kl_mean'])} max {g3(run['kl_max'])} (allowed {g3(run['bounds']['kl_mean'])} / "
            f"{g3(run['bounds']['kl_max'])}); from the original mean {g3(run['kl_to_original_mean'])}"
        )
        if run.get("decides", True) and not run.get("passed", True):
            yield f"      {task_metric_failure(run, ref['perplexity'])}"
    for note in t.get("notes", []):
        yield f"    note: {note}"


def verification_lines(v: Verification | None) -> Iterator[str]:
    """The verification block as lines: the verdict, question 1, the file checks, question 2, notes."""
    if v is None:
        yield "verification: skipped (--no-verify)"
        return
    samples = v.checks[0].samples if v.checks else 0
    yield f"verification: {v.headline()} on {count(samples, 'sample')} ({v.inputs}); {v.runtime}"
    if v.reference:
        yield f"  reference: {v.reference}"
    if v.exact:
        yield f"  {QUESTION_1}"
    for c in v.exact:
        shown = f"{g3(c.error)} relative error" if c.method == "graph" else units_in_last_place(c.error)
        where = f", the largest at {c.worst!r}" if not c.passed and c.method == "tensors" and c.worst else ""
        if c.missing:
            yield f"    {_ok(c.passed)} {c.name}: {c.worst!r}, which the fold writes, is missing from {c.missing}"
            continue
        yield f"    {_ok(c.passed)} {c.name}: {shown} (allowed {c.bound:g}){where}"
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
        head = f"{count(int(g.get('steps') or 0), 'greedy token')} x {count(int(g.get('sequences') or 0), 'prompt')}"
        if g.get("compute_dtype"):
            head += f", computed in {g['compute_dtype']}, near-ties within {g.get('tolerance', 0):g} ({g['dtype']})"
        yield f"  {_ok(bool(g.get('passed')))} generation: {head}"
        for run in g.get("runs", []):
            yield (
                f"    {run['name']}: {count(run['tokens_compared'], 'token')} compared, "
                f"{count(run['decisive_mismatches'], 'decisive mismatch', 'decisive mismatches')}, "
                f"{count(run['near_ties'], 'near-tie')}"
            )
            if run.get("decides", True) and not run.get("passed", True):
                yield f"      {generation_failure(run)}"
        if speeds:
            yield f"    tokens/s: {speeds}"
        for note in g.get("notes", []):
            yield f"    note: {note}"
    if v.task_metrics is not None:
        yield from task_metric_lines(v.task_metrics)
    for q in v.int8:
        yield f"  {_ok(bool(q['passed']))} {q['name']} (both quantized alike, calibrated on {q['calibration']})"
        yield f"    {int8_summary(q)}"
        if not q["passed"]:
            yield f"      {int8_failure(q)}"
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
        verdict = "ok" if b.passed else "inherited" if b.inherited else "DIVERGES"
        rows.append([shown(b.norm), shown(b.layer), g3(b.error), g3(b.rounding), verdict])
    columns = {"norm": True, "layer": True, "error": False, "rounding": False, "": False}
    return text_table("fold boundaries (candidate vs the correct fold, float64)", columns, rows)
