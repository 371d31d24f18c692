"""The engine: capture a model as an export graph, find every norm, decide each fold, and apply it.

What goes in: an ``nn.Module`` in eval mode and one example input. What comes out: the fused ``GraphModule``
(every norm folded or kept as one per-channel affine) and one ``Decision`` per norm, in graph order.

One module per job, in the order the data goes through them:

- ``capture``: ``torch.export`` of the model, and helpers that read the graph (shapes, stored tensors).
- ``lift``: the fused graph back as an ``ExportedProgram`` of the same capture (no second trace).
- ``rules``: the op tables: how each ATen op treats a per-channel affine (``RULES``) and the layers a norm folds
  into (``slabconv.engine.layers``: Linear, addmm / mm, conv; embedding as a producer).
- ``flow``: the forward walk from a norm's output and the backward walk from its input to a producer.
- ``norm_affine``: the affine of a LayerNorm / RMSNorm / GroupNorm split from its normalisation so it folds like
  any other norm (``split_norm_affines``, on request), and put back where it does not fold away.
- ``norms``: norm discovery (``find_norms``): every constant per-channel affine, recognised by its value.
- ``planner``: one ``Decision`` per norm and the folds that carry it out, as records (``plan_folds``).
- ``program``: the plan as a program, one recipe per tensor of the fused model (the only place folded values are
  made), run over a ``WeightStore``
  (in memory, or one block of rows at a time in the streamed mode).
- ``ranges``: what each fold does to the weight ranges int8 quantization works with (``LayerRange``, measured
  block by block as the program runs), and the scale spread that decides a norm's direction where both exist.
- ``rewriter``: applies the plans to the graph (``apply_folds``); ``fold_all`` / ``fold_program`` run the whole
  engine.
- ``repeat``: the plan of a stack of identical blocks from a capture of three of them (``fold_repeated``: each
  block planned from its own values; the streamed mode's planner of a deep decoder).
- ``cleanup``: cancels views left by removed norms, drops unused tensors; ``fused_state_dict``, ``norm_free``.

The names below are the engine's public surface; the other stages import nothing else from it.
"""

from slabconv.engine import reasons
from slabconv.engine.capture import capture, capture_program, copy_sharing, state_kept, unlifted, written_tensors
from slabconv.engine.cleanup import fused_state_dict, norm_free
from slabconv.engine.lift import lift_program
from slabconv.engine.norm_affine import KINDS as NORM_AFFINE_KINDS
from slabconv.engine.norm_affine import folds_norm_affine, split_norm_affines
from slabconv.engine.norms import find_norms
from slabconv.engine.planner import (
    FOLDED_BACKWARD,
    FOLDED_FORWARD,
    KEPT,
    KEPT_AFFINE,
    Decision,
    plan_folds,
)
from slabconv.engine.program import (
    FOLD_BLOCK,
    FoldProgram,
    LayerRecipe,
    Scratch,
    WeightStore,
    cast_into,
    row_ranges,
)
from slabconv.engine.ranges import STEP_GROWTH_LIMIT, LayerRange, RangeTally, flag_warnings
from slabconv.engine.repeat import SLOTS, Repeat, fold_repeated
from slabconv.engine.rewriter import apply_folds, fold_all, fold_program

__all__ = [
    "FOLDED_BACKWARD",
    "FOLD_BLOCK",
    "FOLDED_FORWARD",
    "KEPT",
    "KEPT_AFFINE",
    "Decision",
    "LayerRange",
    "LayerRecipe",
    "NORM_AFFINE_KINDS",
    "FoldProgram",
    "RangeTally",
    "Repeat",
    "SLOTS",
    "STEP_GROWTH_LIMIT",
    "Scratch",
    "WeightStore",
    "apply_folds",
    "capture",
    "capture_program",
    "cast_into",
    "copy_sharing",
    "find_norms",
    "flag_warnings",
    "fold_all",
    "fold_program",
    "fold_repeated",
    "folds_norm_affine",
    "fused_state_dict",
    "lift_program",
    "norm_free",
    "plan_folds",
    "reasons",
    "row_ranges",
    "split_norm_affines",
    "state_kept",
    "unlifted",
    "written_tensors",
]
