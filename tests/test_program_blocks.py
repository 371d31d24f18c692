"""The streamed fold's block helpers (``slabconv.engine.program``): the overflow check on rounded blocks and the
reused buffers give exactly what rounding each block into a new tensor gives."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slabconv.engine import program
from slabconv.engine.layers import LAYERS
from slabconv.engine.program import LayerRecipe, Scratch, TensorStore
from slabconv.engine.ranges import RangeTally
from slabconv.errors import UnsupportedModelError
from slabconv.fold import rounded


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_fold_is_refused_exactly_where_a_value_rounds_to_an_infinity(dtype: torch.dtype) -> None:
    """The overflow check (on the rounded values, ``program.stored_finite``) refuses a block exactly when one of its
    float64 values rounds to an infinity, in memory and streamed: at the limit (half a unit above the largest
    finite value: a tie, to the even neighbour, the infinity) and above, never below. ``below`` is the largest
    float64 under the limit: float32 rounds it onto the limit (65520 for float16), where a check on torch's cast or
    on the float32 step of the rounding refuses a fold that stores 65504."""
    top = torch.finfo(dtype).max
    ulp = top - float(torch.nextafter(torch.tensor(top, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
    limit = top + ulp / 2
    below = float(torch.nextafter(torch.tensor(limit, dtype=torch.float64), torch.tensor(0.0).double()))
    edges = [top, top + ulp / 4, below, limit, top + ulp, float("inf"), float("nan")]
    if dtype == torch.float16:
        edges += [65519.99, 65520.0]
    if dtype != torch.float32:  # float32's own step of the rounding lands on the limit: the tie ``rounded`` breaks
        assert float(torch.tensor(below, dtype=torch.float64).float()) == limit
    assert program.overflows_from(dtype) == limit
    kind = next(k for k in LAYERS if k.name == "linear")
    for edge in edges:
        for sign in (1.0, -1.0):
            weight = torch.tensor([[0.5, sign * edge], [1.0, -2.0]], dtype=torch.float64)
            recipe = LayerRecipe(kind, "w", None, None, dtype, dtype, 1, [])  # no folds: the values as given
            # the streamed writer (a scratch and a tally) checks the rows' largest magnitudes, which the ranges take
            for scratch, tally in ((None, None), (Scratch(), None), (Scratch(), RangeTally(recipe))):
                fits = abs(edge) < limit  # NaN: False
                if fits:
                    (stored, _), *_ = recipe.blocks(TensorStore({"w": weight}), scratch=scratch, tally=tally)
                    assert float(stored[0, 1]) == sign * (top if edge > top else edge), (edge, sign, scratch, tally)
                else:
                    with pytest.raises(UnsupportedModelError, match="overflows"):
                        list(recipe.blocks(TensorStore({"w": weight}), scratch=scratch, tally=tally))


def test_scratch_buffers_are_reused_and_rounding_into_them_equals_to() -> None:
    scratch = Scratch()
    values = torch.randn(64, 33, dtype=torch.float64) * 1e3
    into = scratch.take("stored", values.shape, torch.float16).copy_(values)
    assert torch.equal(into, values.to(torch.float16))
    again = scratch.take("stored", (8, 33), torch.float16)
    assert again.data_ptr() == into.data_ptr()  # the same buffer, not a new mapping
    assert scratch.take("rows", (8, 33), torch.float16).data_ptr() != into.data_ptr()


def _fold(forward: bool, scale: torch.Tensor, shift: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(forward=forward, scale=scale, shift=shift, norm="norm")


def _recipe(kind_name: str, weight: torch.Tensor, groups: int = 1) -> tuple[LayerRecipe, TensorStore]:
    """A float16 layer that takes a backward fold then a forward fold (a tensor with two folds, composed in
    float64), with a stored bias; a transposed conv (its bias not split by rows) two backward folds, or with a 1x1
    kernel a backward then a forward fold (its rows are its input channels, its bias takes the shift through all)."""
    kind = next(k for k in LAYERS if k.name == kind_name)
    gen = torch.Generator().manual_seed(1)
    pointwise = all(k == 1 for k in weight.shape[2:])
    out, into = kind.bias_size(weight.shape, groups), weight.shape[1] * groups
    if not kind.bias_by_rows and pointwise:
        into = weight.shape[0]  # the forward fold's input channels: the rows
    folds = [
        _fold(
            False, torch.rand(out, generator=gen, dtype=torch.float64) + 0.5, torch.randn(out, generator=gen).double()
        ),
        _fold(
            True, torch.rand(into, generator=gen, dtype=torch.float64) + 0.5, torch.randn(into, generator=gen).double()
        ),
    ]
    if not kind.bias_by_rows and not pointwise:
        folds[1] = _fold(False, folds[1].scale.flip(0), folds[1].shift)
    store = TensorStore({"w": weight.half(), "b": torch.randn(out, generator=gen).half()})
    return LayerRecipe(kind, "w", "b", "b", torch.float16, torch.float16, groups, folds), store


def _whole(recipe: LayerRecipe, store: TensorStore) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold functions on the whole tensor at once, rounded once: what every block path must equal."""
    w, b = store.get("w").double(), store.get("b").double()
    for f in recipe.folds:
        w, b = recipe.kind.fold_values(f.forward, w, b, f.scale, f.shift, recipe.groups, 0, w.shape[0])
    return rounded(w, torch.float16), rounded(b, torch.float16)


def test_a_folded_float16_layer_is_the_float64_fold_correctly_rounded() -> None:
    """numpy rounds float64 to float16 directly (correctly); torch's ``to`` goes through float32 and puts about one
    weight in 18,000 of a float16 layer one unit off. Every path that stores a fold goes through ``fold.rounded``:
    the streamed blocks, the whole tensor, and the bias."""
    recipe, store = _recipe("linear", torch.randn(2048, 512, generator=torch.Generator().manual_seed(5)))
    w, b = _whole(recipe, store)
    exact_w, exact_b = store.get("w").double(), store.get("b").double()
    for f in recipe.folds:
        exact_w, exact_b = recipe.kind.fold_values(f.forward, exact_w, exact_b, f.scale, f.shift, 1, 0, 2048)
    by_numpy = torch.from_numpy(exact_w.numpy().astype(np.float16))
    assert int((exact_w.half() != by_numpy).sum()) > 0  # torch's own cast would write some weights one unit off
    blocks = recipe.blocks(store, block_elements=1 << 16, scratch=Scratch())
    streamed = torch.cat([blk.clone() for blk, _ in blocks])  # each block copied before its buffer is reused
    for got in (w, streamed, recipe.stored(*recipe.rows(store, 0, 2048))[0]):
        assert torch.equal(got.view(torch.int16), by_numpy.view(torch.int16))
    assert torch.equal(b.view(torch.int16), torch.from_numpy(exact_b.numpy().astype(np.float16)).view(torch.int16))


class TwoLanes(Scratch):
    """A streamed fold's scratch with two lanes, lane 0 slowed so that the helper lane folds some sub-blocks of
    every block with more than one (``by_lane`` counts them)."""

    def __init__(self) -> None:
        super().__init__(lanes=2)
        self.by_lane: Counter[int] = Counter()

    def spread(self, count, work) -> None:
        def slowed(i: int, lane: int) -> None:
            self.by_lane[lane] += 1
            if lane == 0:
                time.sleep(0.002)
            work(i, lane)

        super().spread(count, slowed)


@pytest.mark.parametrize(
    "kind,shape,groups",
    [
        ("linear", (37, 24), 1),
        ("conv", (12, 3, 2, 2), 2),
        ("conv_transpose", (12, 3, 2, 2), 2),
        ("conv_transpose", (12, 3, 1, 1), 2),
    ],
)
def test_cache_sized_sub_blocks_give_the_whole_tensors_fold(monkeypatch, kind, shape, groups) -> None:
    """Blocks of rows, folded ``CACHE_BLOCK`` elements at a time (in memory and into a streamed writer's buffers,
    in one lane or two, with the weight ranges measured or not), give the bits of one fold over the whole tensor:
    the sub-blocks' row offsets reach the backward fold's scale and the conv's groups, each lane's sub-blocks
    land in their own rows, and a transposed conv's bias (per output channel, not per row) comes once, a pointwise
    one's forward fold taking the shift through every row. The ranges are the whole tensor's too."""
    monkeypatch.setattr(program, "CACHE_BLOCK", 2 * shape[1] * (shape[2] * shape[3] if len(shape) == 4 else 1))
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    recipe, store = _recipe(kind, weight, groups)
    want_w, want_b = _whole(recipe, store)
    whole = RangeTally(recipe)
    whole.add(store.get("w"), recipe.rows(store, 0, shape[0])[0], 0, shape[0])
    block = 5 * weight[0].numel()  # blocks of 5 rows, sub-blocks of 2: neither divides the row count

    def slow_rounded(*args, **kwargs):  # each lane's float64 rows wait in their buffer while the other lane works
        time.sleep(0.001)
        return rounded(*args, **kwargs)

    monkeypatch.setattr(program, "rounded", slow_rounded)
    scratches = [Scratch(), TwoLanes()]
    try:
        for scratch, tally in [(None, None)] + [(s, t) for s in scratches for t in (None, RangeTally(recipe))]:
            parts = [(w.clone(), b) for w, b in recipe.blocks(store, block, scratch, tally)]
            assert len(parts) > 1
            assert torch.equal(torch.cat([w for w, _ in parts]), want_w), (scratch, tally)
            assert torch.equal(recipe.whole_bias([b for _, b in parts]), want_b), (scratch, tally)
            if tally is not None:
                assert tally.result().to_dict() == whole.result().to_dict()
        assert scratches[1].by_lane[1] > 0, scratches[1].by_lane
    finally:
        for scratch in scratches:
            scratch.close()


def test_the_lanes_claim_each_sub_block_once_and_stop_at_the_first_error() -> None:
    """``Scratch.spread``: every index once, over both lanes (two threads); an error in one lane stops the claims
    and is raised once both lanes have stopped."""
    scratch = Scratch(lanes=2)
    seen: list[tuple[int, int, int]] = []
    both = threading.Barrier(2, timeout=5)

    def work(i: int, lane: int) -> None:
        if lane not in {seen_lane for _, seen_lane, _ in seen}:
            seen.append((i, lane, threading.get_ident()))
            both.wait()  # each lane's first claim waits for the other's: both lanes work
        else:
            seen.append((i, lane, threading.get_ident()))

    try:
        scratch.spread(50, work)
        assert sorted(i for i, _, _ in seen) == list(range(50))
        assert {lane for _, lane, _ in seen} == {0, 1}
        assert len({ident for _, _, ident in seen}) == 2
        done: list[int] = []

        def failing(i: int, lane: int) -> None:
            time.sleep(0.001)
            if i == 5:
                raise UnsupportedModelError("the folded w overflows float16")
            done.append(i)

        with pytest.raises(UnsupportedModelError, match="overflows"):
            scratch.spread(1000, failing)
        assert len(done) < 20  # the claims stopped
    finally:
        scratch.close()


def test_an_overflow_in_a_later_sub_block_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(program, "CACHE_BLOCK", 24)
    weight = torch.randn(9, 24)
    weight[7, 3] = 6e4  # float16's largest is 65504: the backward fold's scale above 1.1 takes it past
    recipe, store = _recipe("linear", weight)
    recipe.folds[0].scale[7] = 4.0
    for scratch in (None, Scratch(), TwoLanes()):
        for tally in (None, RangeTally(recipe)):
            with pytest.raises(UnsupportedModelError, match="overflows float16"):
                list(recipe.blocks(store, weight.numel(), scratch, tally))
        if scratch is not None:
            scratch.close()


@pytest.mark.parametrize("slow", ["hash", "write"])
@pytest.mark.parametrize("buffers", ["in turn", "one fewer", "one"])
def test_the_shard_is_written_and_hashed_while_the_next_block_is_made(tmp_path, monkeypatch, buffers, slow):
    """The writer's threads write and hash blocks while the caller makes the next ones (``WRITES_IN_FLIGHT`` of
    them): with the buffers in turn (``Scratch.alternate``: one more) the file holds every block and the digest is
    the file's; one buffer reused at once, or one buffer fewer in turn (the controls), are overwritten under a slow
    hash or a slow write and the digest or the file is wrong, so the test can see the race it guards against."""
    import hashlib
    import time

    from slabconv.write import shards as ws

    def late(update):
        def call(data):
            time.sleep(0.02)  # the caller has made the next block by now
            return update(data)

        return call

    class SlowSha256:
        def __init__(self, data: bytes = b"") -> None:
            self.inner = hashlib.sha256(data)
            self.update = late(self.inner.update) if slow == "hash" else self.inner.update
            self.hexdigest = self.inner.hexdigest

    monkeypatch.setattr(ws, "hashlib", SimpleNamespace(sha256=SlowSha256))
    blocks = [torch.full((4, 8), float(i), dtype=torch.float16) for i in range(6)]
    path = tmp_path / "x.safetensors"
    writer = ws.ShardWriter(path, [("w", torch.float16, [24, 8])], {})
    if slow == "write":
        writer.file = SimpleNamespace(write=late(writer.file.write), close=writer.file.close)
    scratch = Scratch()
    turns = {"in turn": 0, "one fewer": program.WRITES_IN_FLIGHT, "one": 1}[buffers]
    for n, block in enumerate(blocks):
        name = scratch.alternate("stored") if buffers == "in turn" else f"stored{n % turns}"
        writer.write("w", scratch.take(name, block.shape, torch.float16).copy_(block))
    digest = writer.finish()
    written = hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors.torch import load_file

    intact = torch.equal(load_file(path)["w"], torch.cat(blocks)) and digest == written
    assert intact is (buffers == "in turn")


def test_each_layer_is_folded_once_the_planners_values_taken_only_for_the_same_folds(monkeypatch) -> None:
    """``fold_program`` folds each layer once: the planner's overflow check keeps the values it made
    (``LayerRecipe.folded``) and ``evaluate`` takes them for the recipe of the very same folds, with the same fused
    tensors and ranges as folding again. Values made for other folds (a candidate the plan dropped) are not
    taken: copies of the same records are other folds."""
    from dataclasses import replace

    from slabconv import engine
    from slabconv.engine import rewriter
    from tests.conftest import small_vit

    graph = engine.capture(small_vit(layout="repbn", depth=2), torch.randn(2, 1, 8, 8))
    calls: Counter[str] = Counter()
    fold = LayerRecipe._fold

    def counted(self: LayerRecipe, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[self.weight] += 1
        return fold(self, *args, **kwargs)

    monkeypatch.setattr(LayerRecipe, "_fold", counted)
    once = engine.copy_sharing(graph)
    _, made = engine.fold_program(once)
    checks = dict(calls)  # the planner's overflow checks: one per fold planned into the layer
    calls.clear()

    def evaluate_again(folds: program.FoldProgram, *args, **kwargs):  # type: ignore[no-untyped-def]
        folds.folded = {}  # not the values the planner's overflow checks made
        return program.evaluate(folds, *args, **kwargs)

    monkeypatch.setattr(rewriter, "evaluate", evaluate_again)
    twice = engine.copy_sharing(graph)
    _, again = engine.fold_program(twice)
    assert made.layers and calls == Counter({w: n + 1 for w, n in checks.items()})  # the checks, then evaluate
    ours, theirs = engine.fused_state_dict(once), engine.fused_state_dict(twice)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert made.ranges == again.ranges

    store = TensorStore(dict(graph.named_parameters()) | dict(graph.named_buffers()))
    recipe = next(la for la in made.layers.values() if la.bias_out is not None)
    other = replace(recipe, folds=[replace(f) for f in recipe.folds])  # the same folds, other records
    stale = other.folded(store)
    stale = replace(stale, weight=torch.zeros_like(stale.weight), bias=torch.zeros_like(stale.bias))
    values = program.evaluate(program.FoldProgram({}, {recipe.weight: recipe}, folded={recipe.weight: stale}), store)
    assert torch.equal(values[recipe.weight], ours[recipe.weight]) and values[recipe.weight].abs().max() > 0
    assert recipe.bias_out is not None and torch.equal(values[recipe.bias_out], ours[recipe.bias_out])
