"""One plan for a stack of identical blocks, from a capture of three of them (the streamed mode's planner).

Tracing grows with depth (about half a second per decoder layer with symbolic batch and sequence axes), so a
streamed fold of a deep decoder spent most of its time tracing the same layer again and again. Here the model is
captured with three blocks, which stand for the first block, any middle block and the last one (slots 0, 1, 2:
the first follows the embedding, a middle one follows and precedes a block, the last precedes the final norm),
and every block of the real stack is planned on that graph from its own values:

- slot 0 is real block 0 and slot 2 is real block ``depth - 1``, planned as they are;
- slot 1 is planned once for every middle block ``1 .. depth - 2``: that block's vectors (norm statistics and
  affines, counters; ``Repeat.values``) are put in slot 1's place and the whole graph is planned again
  (``plan_folds``: a norm's decision reads its values, e.g. the sign of its scale and whether it shifts).

A block's plan is taken over to its real block by renaming (``Repeat.prefix`` with the block's index) only where
that is sound: every tensor a norm's plan reads or writes lies in the norm's own block (no fold crosses from one
block to the next) and each middle block's plan has the same structure as slot 1's (the same actions, layers,
directions and created biases; only the scales and shifts differ). Otherwise ``fold_repeated`` returns None and
the caller traces the model at full depth. The values in the renamed recipes are each block's own, so the program
is the one a full-depth plan makes, tensor for tensor (``tests/test_repeat.py`` compares both).

The graph is slot 1's: a block whose code branched on its own tensors' values would run the branch slot 1's values
took. The blocks this is used for do not (the zoo's decoder layers in eval mode: a progressive norm always runs
its RepBN branch, whatever its counters hold).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from slabconv.engine.capture import stored
from slabconv.engine.norm_affine import split_norm_affines
from slabconv.engine.norms import find_norms
from slabconv.engine.planner import Decision, NormPlan, plan_folds
from slabconv.engine.program import FoldProgram, LayerRecipe, TensorRecipe, layer_recipes
from slabconv.engine.rewriter import FoldProgress, fold_program, set_tensor
from slabconv.util import block_pattern

SLOTS = 3
"""Blocks in the captured model: the first, one middle block, the last."""


@dataclass(frozen=True)
class Repeat:
    """A stack of ``depth`` identical blocks whose names start with ``prefix`` (``model.layers.{i}.``), captured
    with ``SLOTS`` of them.

    Attributes:
        prefix: the names of block ``i``'s tensors and modules start with ``prefix.format(i=i)``.
        depth: the real number of blocks (more than ``SLOTS``).
        values: ``values(i)``: real block ``i``'s tensors that the plan reads (every tensor the planning instance
            holds for real: vectors), keyed by slot 1's names, in the planning instance's dtypes.
    """

    prefix: str
    depth: int
    values: Callable[[int], dict[str, torch.Tensor]]
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", block_pattern(self.prefix))

    def slot(self, name: str) -> int | None:
        """The block a tensor or module name lies in (its index in the captured model), None outside the stack."""
        m = self._pattern.match(name)
        return int(m.group(1)) if m else None

    def rename(self, text: str, slot: int, real: int) -> str:
        """``text`` with slot ``slot``'s names made block ``real``'s (names, op sites, warnings)."""
        return text.replace(self.prefix.format(i=slot), self.prefix.format(i=real))


def _touched(p: NormPlan) -> list[str]:
    """Every stored tensor and module a norm's plan reads or writes."""
    names = [nb.target for nb in p.new_biases] + [f.weight for f in p.folds] + [f.bias for f in p.folds if f.bias]
    return names + list(p.decision.into)


def _local(plans: list[NormPlan], repeat: Repeat) -> bool:
    """Every plan touches only its own block (or, for a norm outside the stack, only names outside it)."""
    return all(repeat.slot(n) == repeat.slot(p.site.name) for p in plans for n in _touched(p))


def _shape(plans: list[NormPlan], repeat: Repeat) -> list[Any]:
    """Slot 1's plans with their values left out: what must be equal for one block's plan to stand for another's."""

    def rel(name: str) -> str:
        return repeat.rename(name, 1, -1)

    out: list[Any] = []
    for p in plans:
        if repeat.slot(p.site.name) != 1:
            continue
        d = p.decision
        out.append(
            (
                rel(d.norm),
                d.action,
                d.reason,
                tuple(map(rel, d.into)),
                tuple((rel(f.weight), f.forward, f.kind.name) for f in p.folds),
                tuple(rel(nb.target) for nb in p.new_biases),
                tuple(rel(f.bias) for f in p.folds if f.bias),
                p.remove,
                len(p.kept),
            )
        )
    return out


def _renamed_decision(d: Decision, repeat: Repeat, slot: int, real: int) -> Decision:
    def r(text: str) -> str:
        return repeat.rename(text, slot, real)

    return replace(
        d,
        norm=r(d.norm),
        into=[r(x) for x in d.into],
        kept_on=[r(x) for x in d.kept_on],
        paths=[{k: r(v) for k, v in path.items()} for path in d.paths],
        warnings=[r(w) for w in d.warnings],
        no_backward=r(d.no_backward) if d.no_backward else d.no_backward,
        direction=r(d.direction) if d.direction else d.direction,
    )


def _renamed_layer(la: LayerRecipe, repeat: Repeat, slot: int, real: int) -> LayerRecipe:
    def r(name: str | None) -> str | None:
        return repeat.rename(name, slot, real) if name is not None else None

    def name(text: str) -> str:
        return repeat.rename(text, slot, real)

    folds = [replace(f, weight=name(f.weight), norm=name(f.norm), bias=r(f.bias)) for f in la.folds]
    return replace(la, weight=name(la.weight), bias=r(la.bias), bias_out=r(la.bias_out), folds=folds)


def _renamed_tensor(
    t: TensorRecipe, repeat: Repeat, slot: int, real: int, layers: dict[str, LayerRecipe]
) -> TensorRecipe:
    """A slot's tensor recipe in block ``real``: names renamed, a weight or bias recipe pointing at ``layers``
    (block ``real``'s layer recipes, by weight name)."""
    target = repeat.rename(t.target, slot, real)
    source = repeat.rename(t.source, slot, real) if t.source is not None else None
    layer = None
    if t.layer is not None:
        layer = layers[repeat.rename(t.layer.weight, slot, real)]
    return TensorRecipe(target, t.op, source, layer, t.value)


def fold_repeated(
    gm: fx.GraphModule,
    repeat: Repeat,
    progress: FoldProgress | None = None,
    unknown: Collection[str] = (),
    on_block: Callable[[int, int], None] | None = None,
    norm_affine: bool = False,
) -> tuple[list[Decision], FoldProgram] | None:
    """``fold_program`` of the real ``repeat.depth``-block model, from ``gm``, its capture with ``SLOTS`` blocks
    whose stand-in weights are ``unknown`` (see the module docstring). ``gm`` is left as ``fold_program`` leaves
    it (the fused three-block graph, slot 1 holding real block 1's values); ``on_block(done, total)`` is called
    as each middle block is planned. ``norm_affine``: split the affine of every LayerNorm / RMSNorm / GroupNorm
    first, as ``fold_program`` does.

    Returns:
        The decisions of every real block's norms, in graph order, and the fold program of every tensor the real
        fused model stores; None when one plan cannot stand for another (a fold that crosses blocks, a middle
        block planned differently from slot 1, a constant the rewrite makes in the stack): plan at full depth.

    Raises:
        InputError: as ``plan_folds`` (a block's norm statistics are NaN/Inf, or running_var + eps <= 0).
    """
    if norm_affine:
        split_norm_affines(gm)
    first = plan_folds(gm, unknown=unknown)
    if not _local(first, repeat):
        return None
    shape = _shape(first, repeat)
    own = {key: value for key in repeat.values(1) if (value := _stored_or_none(gm, key)) is not None}
    middle: dict[int, tuple[list[Decision], dict[str, LayerRecipe]]] = {}
    try:
        for real in range(2, repeat.depth - 1):
            for key, value in repeat.values(real).items():
                if key in own:  # a tensor the graph does not hold is not read by the plan
                    set_tensor(gm, key, value)
            sites = find_norms(gm)
            slots = [repeat.slot(site.name) for site in sites]
            until = max((i + 1 for i, s in enumerate(slots) if s == 1), default=0)
            plans = plan_folds(gm, sites, unknown, until)  # the norms up to slot 1's last: what slot 1's plans read
            if not _local(plans, repeat) or _shape(plans, repeat) != shape:
                return None
            mine = [p for p in plans if repeat.slot(p.site.name) == 1]
            recipes = {
                repeat.rename(w, 1, real): _renamed_layer(la, repeat, 1, real)
                for w, la in layer_recipes(gm, mine).items()
            }
            middle[real] = ([_renamed_decision(p.decision, repeat, 1, real) for p in mine], recipes)
            if on_block is not None:
                on_block(real - 1, repeat.depth - 3)
    finally:
        for key, value in own.items():
            set_tensor(gm, key, value)
    decisions, program = fold_program(gm, progress, unknown, plans=first)  # slot 1 holds real block 1's again
    if any(t.op == "const" and repeat.slot(k) is not None for k, t in program.tensors.items()):
        return None
    return _expand(decisions, program, middle, repeat)


def _stored_or_none(gm: fx.GraphModule, key: str) -> torch.Tensor | None:
    try:
        value = stored(gm, key)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _expand(
    decisions: list[Decision],
    program: FoldProgram,
    middle: dict[int, tuple[list[Decision], dict[str, LayerRecipe]]],
    repeat: Repeat,
) -> tuple[list[Decision], FoldProgram]:
    """The three-block decisions and program with the middle blocks inserted after slot 1 and slot 2 renamed to
    the last block."""
    last = repeat.depth - 1
    out_decisions: list[Decision] = []
    for i, d in enumerate(decisions):
        slot = repeat.slot(d.norm)
        out_decisions.append(_renamed_decision(d, repeat, slot, last) if slot == SLOTS - 1 else d)
        after = repeat.slot(decisions[i + 1].norm) if i + 1 < len(decisions) else None
        if slot == 1 and after != 1:
            for real in sorted(middle):
                out_decisions += middle[real][0]
    layers: dict[str, LayerRecipe] = {}
    for w, la in program.layers.items():
        slot = repeat.slot(w)
        la = _renamed_layer(la, repeat, slot, last) if slot == SLOTS - 1 else la
        layers[la.weight] = la
    for real in sorted(middle):
        layers.update(middle[real][1])
    tensors: dict[str, TensorRecipe] = {}
    ones = [t for k, t in program.tensors.items() if repeat.slot(k) == 1]
    for k, t in program.tensors.items():
        slot = repeat.slot(k)
        if slot == SLOTS - 1:
            t = _renamed_tensor(t, repeat, slot, last, layers)
        elif slot == 1:
            if t is not ones[0]:
                continue
            for real in range(1, last):
                for one in ones:
                    r = _renamed_tensor(one, repeat, 1, real, layers) if real > 1 else one
                    tensors[r.target] = r
            continue
        tensors[t.target] = t
    return out_decisions, FoldProgram(tensors, layers)
