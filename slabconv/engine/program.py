"""The fold plan as a program: for every tensor the fused model stores, the recipe that makes it.

The planner (``slabconv.engine.planner``) decides each norm and records every fold a layer receives
(``LayerFold``). ``build_program`` turns those records into one ``LayerRecipe`` per folded layer (its stored
weight and bias, and its folds in plan order) and one ``TensorRecipe`` per tensor of the fused model: a copy of
a stored tensor, the weight or bias of a layer recipe, or a constant the rewrite made (a kept affine).

Both modes run the same recipes through ``LayerKind.fold_values`` (``slabconv.engine.layers``):

- in memory, ``rewriter.fold_program`` evaluates them over the original graph's tensors and stores the results
  in the fused graph (a layer's values are those the planner's overflow check made, ``LayerRecipe.folded``);
- streamed, ``slabconv.write.shards`` evaluates them one block of rows at a time over the checkpoint's shards,
  and question 1 (``slabconv.verify.layerwise.exact_streamed``) evaluates them again in float64.

Recipes read tensors through a ``WeightStore`` (``get(key, rows)``, ``shape(key)``, ``dtype(key)``), so the
engine never imports the loaders. Every fold a tensor receives is composed in float64 and rounded once
(``LayerRecipe.rows`` returns float64; ``stored`` rounds), and rows are independent, so a block is folded exactly
as the whole tensor would be: the blocks are the same in both modes (``row_ranges``), so are the tensors written.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import fx

from slabconv.engine.capture import stored
from slabconv.engine.layers import LayerKind
from slabconv.engine.ranges import LayerRange, RangeTally
from slabconv.errors import UnsupportedModelError
from slabconv.fold import rounded
from slabconv.util import row_ranges

if TYPE_CHECKING:
    from slabconv.engine.flow import BlockedEdge
    from slabconv.engine.planner import NormPlan

FOLD_BLOCK = 1 << 22
"""Elements per block of rows: the float64 temporaries of one block bound a streamed fold's memory."""

CACHE_BLOCK = 1 << 17
"""Elements per sub-block of rows on which a block's float64 arithmetic runs (widen, fold, measure, round): 1 MiB
of float64, which with the sub-block's float32, stored and read values (2 MiB in all) stays in one core's L2
cache, where whole-block passes stream 32 MiB through memory four times. Measured on two LLaMA-350M float16
decoder layers (one thread, in memory, the three sizes interleaved twice): 1.18-1.20 CPU-s per 240 M weights at
2**17, 1.22-1.45 at 2**18 (4 MiB: the float64 passes spill the cache), 1.32-1.33 at 2**16 (the Python and dispatch
of each sub-block, about 100 us, then weigh more than the cache gains). Rows are independent, so the values are
the whole block's."""


class WeightStore(Protocol):
    """Where recipes read the original tensors: a graph's tensors in memory, a checkpoint's shards streamed."""

    def get(self, key: str, rows: slice | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``key`` (rows ``rows`` of its first axis when given). ``out``: a buffer of the rows' dtype and
        shape the store may read them into (a store in memory returns its own tensor instead)."""
        ...

    def shape(self, key: str) -> list[int]: ...

    def dtype(self, key: str) -> torch.dtype: ...


class TensorStore:
    """A ``WeightStore`` over tensors in memory (name -> tensor)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)

    def get(self, key: str, rows: slice | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensors[key].detach()  # its own tensor, not a copy into ``out``
        return t if rows is None else t[rows]

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype


def stored_finite(stored: torch.Tensor) -> bool:
    """True when every value of ``stored`` (a floating tensor already rounded to its stored dtype) is finite.

    Checked on the rounded values, not on the float64 ones before rounding: ``fold.rounded`` rounds correctly (once,
    to nearest, ties to even), so a stored value is infinite exactly when its float64 value is infinite or rounds
    to an infinity, and NaN exactly when its float64 value is NaN. That is the question, asked on a quarter of the
    bytes (float16 / bfloat16) and with no threshold to get right. A threshold on the float32 step of the rounding
    would need a correction: float64 values just below float16's overflow limit 65520 (65519.99999999999, the
    largest below it) round to 65520.0 in float32, a tie that ``rounded`` breaks by rounding to odd, toward the
    finite 65504 (``tests/test_program_blocks.py`` holds these values). Rounding is monotonic, so the smallest and
    the largest value decide; ``torch.aminmax`` returns NaN for both when a NaN is present, and every comparison
    with NaN is False.
    """
    if not stored.numel():
        return True
    low, high = torch.aminmax(stored)
    return -math.inf < float(low) and float(high) < math.inf


def overflows_from(dtype: torch.dtype) -> float:
    """The least float64 magnitude that rounds to an infinity in the floating ``dtype``: its largest finite value
    plus half a unit in its last place (exact in float64). Rounding to nearest, ties to even, takes that midpoint to
    the infinity (the largest finite value's significand is odd) and everything below it to a finite value; the
    conversions a fold is stored with round so (``fold.rounded``: correctly, for float16 and bfloat16; torch's cast
    for float32; float64 is not converted: only an infinite value is one). So a folded block is finite when stored
    exactly when ``max |x| < overflows_from(dtype)`` and no value is NaN (``tests/test_program_blocks.py``: the
    same refusals as ``stored_finite`` on the rounded values)."""
    if dtype == torch.float64:
        return math.inf
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    below = torch.nextafter(top, torch.zeros((), dtype=dtype))
    return float(top.double()) + (float(top.double()) - float(below.double())) / 2


WRITES_IN_FLIGHT = 2
"""Blocks a streamed writer may still be writing and hashing while the caller makes the next one
(``write.shards.ShardWriter``); ``Scratch.alternate`` turns through one buffer more."""


class Scratch:
    """Buffers reused block after block by a streamed fold, one per use (``take``'s ``name``), grown as needed,
    and the lanes (threads) a block's sub-blocks are folded in (``spread``).

    Each fresh block-sized tensor costs the kernel's mapping and zeroing of its pages, several times the fold's
    own arithmetic on a block: a streamed fold reads, widens and rounds every block into the same buffers instead.
    They hold one block as read and ``WRITES_IN_FLIGHT + 1`` blocks of stored values (``FOLD_BLOCK``; the writer
    writes and hashes up to ``WRITES_IN_FLIGHT`` while the next is made), and per lane one ``CACHE_BLOCK`` of
    float64 values, which the fold's memory bound counts anyway.

    Args:
        lanes: threads a block's sub-blocks are spread over (``spread``); the caller's thread is lane 0, the others
            are started at the first block that has more than one sub-block and stopped by ``close``.
    """

    def __init__(self, lanes: int = 1) -> None:
        self.flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.views: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self.turn = 0
        self.lanes = max(1, lanes)
        self._helpers: ThreadPoolExecutor | None = None

    def spread(self, count: int, work: Callable[[int, int], None]) -> None:
        """``work(i, lane)`` for every ``i`` in ``range(count)``, each once, over the lanes at once: each lane claims
        the next ``i`` when it is free (so a lane the scheduler sets aside does less), and uses its own buffers
        (``lane`` in their names). Returns when every lane has returned. The first error stops further claims and is
        raised once every lane has stopped (no lane is still writing into a buffer then). An interrupt while this
        thread waits for the others stops the claims too; ``close`` waits for the sub-block a lane is folding.

        The lanes' work is torch kernels and numpy loops, which release the GIL: two lanes fold on two cores."""
        if self.lanes == 1 or count < 2:
            for i in range(count):
                work(i, 0)
            return
        claims = itertools.count()  # next() on it is one C call: two lanes never claim the same i
        failed: list[BaseException] = []
        stop = threading.Event()  # no more claims: an error, or this thread left (an interrupt while it waited)

        def lane(k: int) -> None:
            try:
                while not stop.is_set() and (i := next(claims)) < count:
                    work(i, k)
            except BaseException as error:
                failed.append(error)
                stop.set()

        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="slabconv-fold")
        helpers = [self._helpers.submit(lane, k) for k in range(1, self.lanes)]
        try:
            lane(0)
            for helper in helpers:
                helper.result()
        finally:
            stop.set()
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Stop the lanes' threads (after ``spread`` has returned)."""
        if self._helpers is not None:
            self._helpers.shutdown()
            self._helpers = None

    def alternate(self, name: str) -> str:
        """``name`` with a suffix that turns call by call through ``WRITES_IN_FLIGHT + 1`` buffers, for blocks that
        must stay as they are while the next ones are made (a writer still writing or hashing them)."""
        self.turn = (self.turn + 1) % (WRITES_IN_FLIGHT + 1)
        return f"{name}{self.turn}"

    def take(self, name: str, shape: torch.Size | list[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in buffer ``name`` (its values are left over: write it whole)."""
        dims = tuple(int(size) for size in shape)
        made = self.views.get((name, dtype, dims))  # a block's sub-blocks ask for the same few shapes
        if made is not None:
            return made
        n = math.prod(dims)
        flat = self.flat.get((name, dtype))
        if flat is None or flat.numel() < n:
            flat = self.flat[name, dtype] = torch.empty(n, dtype=dtype)
            # views of the old buffer go; list() copies the items in one call, so another lane adding its own view
            # meanwhile cannot change the dict during the iteration
            self.views = {k: v for k, v in list(self.views.items()) if k[:2] != (name, dtype)}
        made = self.views[name, dtype, dims] = flat[:n].view(dims)
        return made


@dataclass(frozen=True)
class LayerFold:
    """One fold a layer receives, as the planner records it and the program replays it: the layer, its kind and
    stored weight, the direction, the float64 ``(scale, shift)`` exactly as ``LayerKind.fold_values`` takes them
    (forward: laid out along the layer's input axis, the shift multiplied; backward: along its output channels),
    the norm it carries, and the target of the bias the layer read when this fold was planned (its stored bias, a
    separate bias (``slabconv.engine.layers.separate_bias``), a bias an earlier fold created, or None)."""

    layer: fx.Node
    kind: LayerKind
    weight: str
    forward: bool
    scale: torch.Tensor
    shift: torch.Tensor
    norm: str
    bias: str | None = None


@dataclass
class LayerRecipe:
    """A layer the plan folds into: its stored weight, the bias it starts from and the bias it stores (the same,
    a created one, or None), its dtypes and its folds in plan order (``LayerFold``: direction, float64 scale and
    shift, the norm)."""

    kind: LayerKind
    weight: str
    bias: str | None
    bias_out: str | None
    dtype: torch.dtype
    bias_dtype: torch.dtype
    groups: int = 1
    folds: list[LayerFold] = field(default_factory=list)
    bias_shape: tuple[int, ...] | None = None  # a stored bias's shape when it is not ``(C,)`` (a separate bias)

    @property
    def norms(self) -> list[str]:
        return [f.norm for f in self.folds]

    @property
    def needs_all_rows(self) -> bool:
        """The folded bias depends on every row of the weight: a forward fold into a kind whose rows are not its
        output channels (``LayerKind.bias_by_rows`` False: a pointwise transposed convolution, whose bias takes
        ``sum_c W[c, j] t[c]`` over its input rows ``c``). ``_read`` then folds the bias over the whole weight, and
        each block of rows folds only its rows of the weight."""
        return not self.kind.bias_by_rows and any(f.forward for f in self.folds)

    def _all_rows_bias(self, store: WeightStore) -> torch.Tensor | None:
        """The folded bias of a ``needs_all_rows`` layer, float64: every fold over the whole weight, in float64
        (a transposed convolution's weight is ``C_in * C_out / groups`` values: what a block of it would hold)."""
        w = store.get(self.weight).to(torch.float64, copy=True)
        b = None if self.bias is None else store.get(self.bias).reshape(-1).to(torch.float64)
        return self._fold(w, b, 0, int(w.shape[0]) if w.dim() else 1)[1]

    def _read(
        self, store: WeightStore, start: int, stop: int, scratch: Scratch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The stored rows ``start:stop`` of the weight (a 0/1-D weight whole; into ``scratch``'s buffer ``read``
        when given), of the bias in float64, and the weight's row count."""
        shape = store.shape(self.weight)
        rows = None if len(shape) < 2 else slice(start, stop)
        into = None
        if scratch is not None:
            into = scratch.take("read", shape if rows is None else [stop - start, *shape[1:]], store.dtype(self.weight))
        read = store.get(self.weight, rows, out=into)
        b = None
        if self.needs_all_rows:  # already folded, over every row (``_piece``)
            b = self._all_rows_bias(store)
        elif self.bias is not None and not self.kind.bias_by_rows:  # the whole bias with every block (``_piece``)
            b = store.get(self.bias).reshape(-1).to(torch.float64)
        elif self.bias is not None and self.bias_shape is None:
            b = store.get(self.bias, slice(start, stop)).to(torch.float64)
        elif self.bias is not None:  # a separate bias, e.g. (1, C, 1, 1): C values in channel order
            b = store.get(self.bias).reshape(-1)[start:stop].to(torch.float64)
        return read, b, int(shape[0]) if shape else 1

    def _piece(
        self, w: torch.Tensor, b: torch.Tensor | None, s0: int, s1: int, start: int, total: int
    ) -> torch.Tensor | None:
        """Fold the float64 rows ``w`` (in place), rows ``s0:s1`` of the block that starts at row ``start`` of the
        weight's ``total``, with their part of the block's bias ``b``; return that part of the folded bias. A kind
        whose bias is not split by rows (``LayerKind.bias_by_rows`` False) folds the whole bias with every piece:
        the piece holding row 0 of the weight returns it, every other one None (the pieces joined hold it once); a
        ``needs_all_rows`` layer's ``b`` is already the folded bias (``_read``), which that piece returns as it is."""
        if self.needs_all_rows:
            self._fold(w, None, start + s0, total)
            return b if start + s0 == 0 else None
        by_rows = self.kind.bias_by_rows
        folded = self._fold(w, b[s0:s1] if b is not None and by_rows else b, start + s0, total)[1]
        return folded if by_rows or start + s0 == 0 else None

    def whole_bias(self, parts: list[torch.Tensor | None]) -> torch.Tensor:
        """The stored bias from the pieces ``blocks`` / ``rows`` give one block of rows at a time: joined, in the
        shape the bias is stored in."""
        whole = torch.cat([b for b in parts if b is not None])
        return whole.reshape(self.bias_shape) if self.bias_shape is not None else whole

    def _fold(
        self, w: torch.Tensor, b: torch.Tensor | None, first: int, total: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every fold on float64 rows ``w`` (ours to overwrite: folded in place) starting at row ``first``."""
        for f in self.folds:
            done, b = self.kind.fold_values(f.forward, w, b, f.scale, f.shift, self.groups, first, total, inplace=True)
            if done.data_ptr() != w.data_ptr():  # a layer kind that made a new tensor: same values, our buffer
                w.copy_(done)
        return w, b

    def _check_fits(self, name: str | None, t: torch.Tensor) -> None:
        """Refuse a folded tensor ``t`` (rounded to its stored dtype) with a value that overflows it."""
        if t.dtype.is_floating_point and not stored_finite(t):
            raise self._overflow(name, t.dtype)

    def _check_largest(self, largest: torch.Tensor) -> None:
        """Refuse the fold when a float64 value whose magnitude is in ``largest`` (each row's ``max |x|``, NaN for a
        row holding one) rounds to an infinity in the weight's dtype (``overflows_from``)."""
        if largest.numel() and not bool((largest < overflows_from(self.dtype)).all()):  # NaN: False
            raise self._overflow(self.weight, self.dtype)

    def _overflow(self, name: str | None, dtype: torch.dtype) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"the folded {name} overflows {str(dtype).removeprefix('torch.')} (norms {', '.join(self.norms)}); "
            "fold this model in memory without --stream (it keeps such norms as affines)"
        )

    def rows(
        self,
        store: WeightStore,
        start: int,
        stop: int,
        scratch: Scratch | None = None,
        tally: RangeTally | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``start:stop`` of the folded weight and bias, in float64 (every fold composed, nothing rounded).
        A 0/1-D weight is read whole. The folds run ``CACHE_BLOCK`` elements of rows at a time, as in ``blocks``
        (the same values). With ``scratch`` the weight rows live in its buffer ``exact`` (overwritten by the next
        call), where a fresh block-sized tensor each call costs more than its arithmetic (``Scratch``). ``tally``:
        the rows' ranges before and after are added to it (``slabconv.engine.ranges``)."""
        read, b, total = self._read(store, start, stop)
        if scratch is None:
            w = read.to(torch.float64, copy=True)  # ours: the folds scale it in place
        else:
            w = cast_into(scratch, "exact", read, torch.float64)
        kept = read if tally is not None else None  # the stored rows, for their ranges
        del read
        biases = []
        for s0, s1 in row_ranges(list(w.shape), CACHE_BLOCK):
            biases.append(self._piece(w[s0:s1], b, s0, s1, start, total))
            if tally is not None and kept is not None:
                tally.add(kept[s0:s1], w[s0:s1], start + s0, total)
        return w, _joined(biases)

    def stored(self, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float64 rows rounded once to the stored dtypes (the bias None when the layer stores none).

        Raises:
            UnsupportedModelError: a folded value does not fit the dtype (it overflows).
        """
        weight = rounded(w, self.dtype).contiguous()
        self._check_fits(self.weight, weight)
        return weight, self._stored_bias(b)

    def folded(self, store: WeightStore) -> Folded:
        """``evaluate``'s values of this recipe, made in one block of rows (rows are independent: the same values):
        what the planner's overflow check makes (an ``UnsupportedModelError`` refuses the fold, ``dtype-overflow``)
        and ``evaluate`` then takes."""
        tally = RangeTally(self)
        w, b = self.stored(*self.rows(store, 0, (store.shape(self.weight) or [1])[0], tally=tally))
        return Folded(tuple(self.folds), w, None if b is None else self.whole_bias([b]), tally.result())

    def _stored_bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        """The float64 bias rounded once to its stored dtype; None when the layer stores none."""
        if b is None or self.bias_out is None:
            return None
        bias = rounded(b, self.bias_dtype).contiguous()
        self._check_fits(self.bias_out, bias)
        return bias

    def rounded_block(
        self, scratch: Scratch, store: WeightStore, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``start:stop`` of the folded weight rounded once to its dtype, made as the streamed writer makes
        them (``blocks`` with ``scratch``: in its buffers, over its lanes; the same values as ``rows`` rounded by
        ``slabconv.fold.rounded``), and their part of the folded bias in float64, not rounded (None where the
        block holds none; ``whole_bias`` joins the parts). Nothing is checked: a value that overflows is the
        infinity the rounding gives. Question 1 of a streamed fold compares each written block with it
        (``slabconv.verify.layerwise.tensor_distances``)."""
        return self._stored_into(scratch, store, start, stop, exact_bias=True)

    def _stored_into(
        self,
        scratch: Scratch,
        store: WeightStore,
        start: int,
        stop: int,
        tally: RangeTally | None = None,
        exact_bias: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``stored(*rows(...))`` made in ``scratch``'s buffers: each ``CACHE_BLOCK`` of rows is widened, folded,
        checked and rounded while its float64 values are still in the processor's cache (the same values), and
        its ranges added to ``tally``; the sub-blocks are spread over ``scratch``'s lanes (``Scratch.spread``:
        rows are independent, so the values do not depend on which lane folds which). ``exact_bias``
        (``rounded_block``): no overflow check, and the bias part in float64."""
        read, b, total = self._read(store, start, stop, scratch)
        out = scratch.take(scratch.alternate("stored"), read.shape, self.dtype)  # the writer may hold the last ones
        pieces = list(row_ranges(list(read.shape), CACHE_BLOCK))
        biases: list[torch.Tensor | None] = [None] * len(pieces)
        if tally is not None:
            tally.prepare(read.shape, total)

        by_ranges = tally is not None and self.dtype in _ROUNDED_ONCE  # the overflow check from the ranges
        half = read.dtype in _HALF
        names = [(f"wide{lane}", f"rows{lane}") for lane in range(scratch.lanes)]

        def fold_piece(i: int, lane: int) -> None:
            s0, s1 = pieces[i]
            wide_name, rows_name = names[lane]
            wide = _widening(scratch, read[s0:s1], wide_name)  # the stored rows, exactly (half precision: float32)
            if tally is not None:  # their ranges, reduced in float32 for half precision: the same values
                tally.measure("before", wide, start + s0, total)
            w = scratch.take(rows_name, wide.shape, torch.float64).copy_(wide)
            biases[i] = self._piece(w, b, s0, s1, start, total)
            if tally is not None:
                tally.measure("after", w, start + s0, total)
            stored = out[s0:s1]
            rounded(w, self.dtype, out=stored, near=wide if half else None)  # float32 buffer, free again: the rounding
            if not by_ranges and not exact_bias:
                self._check_fits(self.weight, stored)

        scratch.spread(len(pieces), fold_piece)
        if exact_bias:
            return out, _joined(biases)
        if tally is not None and by_ranges:  # the rows' largest magnitudes, which the ranges took: no extra pass
            self._check_largest(tally.largest("after", start, start + (len(read) if read.dim() else 1)))
        return out, self._stored_bias(_joined(biases))

    def blocks(
        self,
        store: WeightStore,
        block_elements: int = FOLD_BLOCK,
        scratch: Scratch | None = None,
        tally: RangeTally | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """The folded weight and bias one block of rows at a time, rounded to their dtypes.

        With ``scratch`` (a streamed writer, which writes each block before asking for the next) the weight
        block lives in ``scratch``'s buffer: it is overwritten by the next block. The biases are always new.
        ``tally``: each block's ranges before and after the folds are added to it (``slabconv.engine.ranges``).

        Raises:
            UnsupportedModelError: a folded value does not fit its dtype (it overflows).
        """
        for start, stop in row_ranges(store.shape(self.weight), block_elements):
            if scratch is None:
                yield self.stored(*self.rows(store, start, stop, tally=tally))
            else:
                yield self._stored_into(scratch, store, start, stop, tally)


def cast_into(scratch: Scratch, name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype``, in ``scratch``'s buffer ``name`` (overwritten by its next use): a block read from a
    checkpoint, cast without a fresh block-sized tensor; half precision is widened through float32
    (``_widening``)."""
    out = scratch.take(name, values.shape, dtype)
    return out.copy_(_widening(scratch, values) if dtype == torch.float64 else values)


def _widening(scratch: Scratch, stored: torch.Tensor, name: str = "wide") -> torch.Tensor:
    """A float16 / bfloat16 sub-block in float32 (exact), the step to float64: torch widens half precision to
    float32 with vector instructions and float32 to float64 too, but half precision to float64 element by element
    (on the 350M float16 folder's 240 M folded weights, about 0.07 s through float32 against 0.16 s direct).
    Other dtypes as they are."""
    if stored.dtype not in _HALF:
        return stored
    return scratch.take(name, stored.shape, torch.float32).copy_(stored)


_HALF = (torch.float16, torch.bfloat16)
_ROUNDED_ONCE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The stored dtypes a fold is rounded to correctly, once (``fold.rounded``; float32: torch's cast of a float64;
float64: none), for which ``overflows_from`` decides exactly which values overflow."""


def _joined(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The pieces of a bias, one per sub-block, as one tensor (None when the folds made none)."""
    kept = [p for p in parts if p is not None]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else torch.cat(kept)


@dataclass(frozen=True)
class TensorRecipe:
    """How the fused model's tensor ``target`` is made: ``copy`` of the stored ``source``, the ``weight`` or
    ``bias`` of ``layer``, ``unit``: ones of the stored ``source``'s shape and dtype (the weight a LayerNorm /
    RMSNorm / GroupNorm keeps once its affine is folded, ``slabconv.engine.norm_affine``), or a ``const`` the
    rewrite made (``value``: a kept affine's scale or shift)."""

    target: str
    op: str
    source: str | None = None
    layer: LayerRecipe | None = None
    value: torch.Tensor | None = None


@dataclass
class FoldProgram:
    """Every tensor of the fused model (``tensors``, in the fused graph's order), every folded layer (``layers``,
    by weight name) and, once the program has run (``evaluate``, or a streamed writer), each folded layer's
    weight ranges before and after (``ranges``, by weight name; ``slabconv.engine.ranges``)."""

    tensors: dict[str, TensorRecipe]
    layers: dict[str, LayerRecipe]
    ranges: dict[str, LayerRange] = field(default_factory=dict)
    folded: dict[str, Folded] = field(default_factory=dict)  # for ``evaluate``: the planner's values, by weight


@dataclass(frozen=True)
class Folded:
    """A layer's stored weight and bias, and its ranges, as ``LayerRecipe.folded`` made them for these ``folds``."""

    folds: tuple[LayerFold, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None
    ranges: LayerRange


def _not_flat(shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return shape if shape is not None and len(shape) != 1 else None


def layer_recipe(original: fx.GraphModule, folds: list[LayerFold], created: str | None) -> LayerRecipe:
    """The recipe of one layer from its folds in plan order (``folds[0].bias``: the bias it had before the first,
    a stored one (maybe a separate one) or None) and ``created``, the target of the bias a plan creates for it."""
    first, bias = folds[0], folds[0].bias
    w, b = stored(original, first.weight), stored(original, bias) if bias else None
    b_dtype, b_shape = (w.dtype, None) if b is None else (b.dtype, _not_flat(tuple(b.shape)))
    groups = first.kind.groups(first.layer)
    return LayerRecipe(first.kind, first.weight, bias, bias or created, w.dtype, b_dtype, groups, folds, b_shape)


def layer_recipes(original: fx.GraphModule, plans: list[NormPlan]) -> dict[str, LayerRecipe]:
    """One recipe per layer the plans fold into (before the rewrite: the layers' bias arguments as stored)."""
    created = {nb.layer: nb.target for p in plans if p.remove for nb in p.new_biases}
    folds: dict[str, list[LayerFold]] = {}
    for p in plans:
        if p.remove:
            for f in p.folds:
                folds.setdefault(f.weight, []).append(f)
    return {w: layer_recipe(original, fs, created.get(fs[0].layer)) for w, fs in folds.items()}


def kept_affine(p: NormPlan, edge: BlockedEdge, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 ``(scale, shift)`` of the affine a plan keeps on a blocked ``edge``, both ``(size,)`` along the
    edge's channel axis: the norm's own ``(s, t * mult)``, identity outside a concatenation's norm part. What both
    rewrites store (as ``const`` recipes, ``build_program``), rounded once to the tensor's dtype."""
    assert p.scale is not None and p.shift is not None
    return edge.chan.lay_out(p.scale, size, 1.0), edge.chan.lay_out(p.shift * edge.mult, size, 0.0)


def build_program(
    layers: dict[str, LayerRecipe],
    stored_keys: set[str],
    fused: Mapping[str, torch.Tensor],
    units: set[str] | frozenset[str] = frozenset(),
) -> FoldProgram:
    """The program of a fused graph: ``layers`` (``layer_recipes``), the original graph's stored tensor names,
    the fused graph's tensors (``cleanup.fused_state_dict``) and the stored norm weights it holds as ones
    (``units``)."""
    weights = {la.weight: la for la in layers.values()}
    biases = {la.bias_out: la for la in layers.values() if la.bias_out}
    tensors: dict[str, TensorRecipe] = {}
    for target, value in fused.items():
        if target in weights:
            tensors[target] = TensorRecipe(target, "weight", target, weights[target])
        elif target in biases:
            tensors[target] = TensorRecipe(target, "bias", biases[target].bias, biases[target])
        elif target in units:
            tensors[target] = TensorRecipe(target, "unit", target)
        elif target in stored_keys:
            tensors[target] = TensorRecipe(target, "copy", target)
        else:
            tensors[target] = TensorRecipe(target, "const", value=value)
    return FoldProgram(tensors, layers)


def evaluate(
    program: FoldProgram, store: WeightStore, block_elements: int = FOLD_BLOCK, exact: bool = False
) -> dict[str, torch.Tensor]:
    """Every folded layer's weight and bias (the ``weight`` / ``bias`` recipes), block by block, as whole
    tensors: what the in-memory fold stores, rounded to their dtypes, or with ``exact`` in float64, every fold
    composed and nothing rounded (what the ONNX rewrite rounds to each initializer's dtype, or writes as it is for
    question 1's float64 fold). Each layer's weight ranges go into ``program.ranges``. A layer with values in
    ``program.folded`` made for its very folds (the same records) takes them instead (not with ``exact``).

    Raises:
        UnsupportedModelError: a folded value does not fit its dtype (not with ``exact``).
    """
    out: dict[str, torch.Tensor] = {}
    for la in program.layers.values():
        done = None if exact else program.folded.get(la.weight)
        same = done is not None and list(map(id, done.folds)) == list(map(id, la.folds))  # the planner's records
        if done is not None and same and (done.bias is None) == (la.bias_out is None):
            out[la.weight], program.ranges[la.weight] = done.weight, done.ranges
            if la.bias_out is not None and done.bias is not None:
                out[la.bias_out] = done.bias
            continue
        tally = RangeTally(la)
        if exact:
            ranges = row_ranges(store.shape(la.weight), block_elements)
            parts = [la.rows(store, start, stop, tally=tally) for start, stop in ranges]
        else:
            parts = list(la.blocks(store, block_elements, tally=tally))
        program.ranges[la.weight] = tally.result()
        out[la.weight] = torch.cat([w for w, _ in parts]) if len(parts) > 1 else parts[0][0]
        if la.bias_out is not None:
            out[la.bias_out] = la.whole_bias([b for _, b in parts])
    return out
