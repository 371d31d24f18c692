"""The streamed fold's compiled pass (``slabconv.engine.compiled``, numba: the dev extras install it) makes the
portable path's values bit for bit: the stored weights, the biases, the ranges and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slabconv.engine import compiled
from slabconv.engine.layers import LAYERS
from slabconv.engine.program import LayerRecipe, Scratch, TensorStore, overflows_from
from slabconv.engine.ranges import RangeTally
from slabconv.errors import UnsupportedModelError
from slabconv.fold import rounded

HALF = [torch.float16, torch.bfloat16]


def _every_rounding_case(dtype: torch.dtype) -> torch.Tensor:
    """Every finite ``dtype`` value, every midpoint of two neighbours, the float64 values either side of each
    midpoint, and random magnitudes over float64's range, all below the overflow limit (float64)."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).double()
    values = torch.sort(values[torch.isfinite(values)]).values
    mids = (values[1:] + values[:-1]) / 2
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.exp(
        torch.randn(20000, generator=gen, dtype=torch.float64) * 30
    )
    tiny = torch.tensor([0.0, -0.0, 5e-324, -5e-324, 1e-310, 2.0**-300], dtype=torch.float64)
    cases = torch.cat([values, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), spread, tiny])
    return cases[cases.abs() < overflows_from(dtype)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_compiled_rounding_is_fold_rounded_on_every_value_and_midpoint(dtype: torch.dtype) -> None:
    """Where ``Tensor.to`` rounds twice (through float32) the compiled rounding must still round once: every
    midpoint and its float64 neighbours, subnormals, signed zeros; and the ranges it takes are torch's."""
    cases = _every_rounding_case(dtype)
    cols = 1024
    rows = -(-cases.numel() // cols)
    w = torch.zeros(rows * cols, dtype=torch.float64)
    w[: cases.numel()] = cases
    w = w.reshape(rows, cols)
    want = rounded(w, dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    high, low = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float64)
    compiled.scale_and_round(w.clone(), None, None, out, high, low)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(high, w.amax(1) + 0.0) and torch.equal(low, w.amin(1) + 0.0)
    assert (w.view(torch.int64) != torch.tensor(0.0).double().view(torch.int64)).any()  # not all +0.0


def test_the_compiled_ranges_are_torchs_with_nan_infinities_and_signed_zeros() -> None:
    """NaN of either sign makes a row's largest and smallest value NaN (as ``torch.amax`` / ``amin``), infinities
    are kept, and a zero extreme is ``+0.0``, before (float32) and after (float64) the fold."""
    nan = float("nan")
    rows = [[1.0, nan, -3.0], [-nan, 2.0, 0.5], [float("inf"), -1.0, 0.0], [-0.0, -0.0, -0.0], [0.0, -0.0, 1.0]]
    wide = torch.tensor(rows, dtype=torch.float32)
    wide[1, 0] = -wide[1, 0].abs()  # a NaN with its sign bit set
    assert torch.signbit(wide[1, 0])
    w64 = torch.empty(wide.shape, dtype=torch.float64)
    high, low = torch.empty(5), torch.empty(5)
    compiled.widen(wide, w64, high, low)
    high64, low64 = torch.empty(5, dtype=torch.float64), torch.empty(5, dtype=torch.float64)
    compiled.scale_and_round(w64, None, None, torch.empty(wide.shape, dtype=torch.float16), high64, low64)
    for got, want in (
        (high, wide.amax(1)),
        (low, wide.amin(1)),
        (high64, wide.double().amax(1)),
        (low64, wide.double().amin(1)),
    ):
        want = want + 0.0
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert not torch.signbit(high[3]) and not torch.signbit(low[4]) and not torch.signbit(high64[3])


def _recipe(dtype: torch.dtype, forward: bool, bias: bool, rows: int, cols: int) -> tuple[LayerRecipe, TensorStore]:
    """A Linear with one fold whose weight holds the cases the rounding and the ranges must agree on: a scale
    that puts products near midpoints, zero rows of either sign, subnormal weights."""
    gen = torch.Generator().manual_seed(rows + cols + forward)
    weight = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    weight[1] = 0.0
    weight[2] = -0.0
    weight[3, ::2] = -0.0
    weight[4] = torch.finfo(dtype).tiny / 4  # subnormal
    size = cols if forward else rows
    scale = torch.exp(torch.randn(size, generator=gen, dtype=torch.float64))
    scale[:3] = torch.tensor([1 + 2**-11 + 2**-40, -1.0, 0.0], dtype=torch.float64)
    shift = torch.randn(size, generator=gen, dtype=torch.float64)
    f = SimpleNamespace(forward=forward, scale=scale, shift=shift, norm="norm")
    kind = next(k for k in LAYERS if k.name == "linear")
    tensors = {"w": weight} | ({"b": torch.randn(rows, generator=gen).to(dtype)} if bias else {})
    recipe = LayerRecipe(kind, "w", "b" if bias else None, "b" if bias else "b.new", dtype, dtype, 1, [f])  # type: ignore[list-item]
    return recipe, TensorStore(tensors)


def _streamed(recipe: LayerRecipe, store: TensorStore) -> tuple[list[torch.Tensor], list[torch.Tensor], RangeTally]:
    scratch, tally = Scratch(lanes=2), RangeTally(recipe)
    weights, biases = [], []
    try:
        for w, b in recipe.blocks(store, block_elements=1 << 18, scratch=scratch, tally=tally):
            weights.append(w.clone())
            biases.append(b)
    finally:
        scratch.close()
    return weights, biases, tally


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_compiled_pass_writes_the_portable_paths_blocks_biases_and_ranges(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, forward: bool, bias: bool
) -> None:
    recipe, store = _recipe(dtype, forward, bias, rows=300, cols=1000)  # blocks of 262 rows: two sub-blocks, two lanes
    calls = []
    real = compiled.scale_and_round
    monkeypatch.setattr(compiled, "scale_and_round", lambda *a: calls.append(1) or real(*a))
    fast = _streamed(recipe, store)
    assert calls  # the compiled pass made these blocks
    monkeypatch.setattr(compiled, "available", lambda: False)
    calls.clear()
    portable = _streamed(recipe, store)
    assert not calls
    bits = torch.int16 if dtype in HALF else torch.int32
    for got, want in zip(fast[0], portable[0], strict=True):
        assert torch.equal(got.view(bits), want.view(bits))
    for got, want in zip(fast[1], portable[1], strict=True):
        assert got is not None and want is not None and torch.equal(got, want)
    for which in ("before", "after"):
        for got, want in zip(fast[2].extremes[which], portable[2].extremes[which], strict=True):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.int8), want.view(torch.int8)), which
    assert fast[2].result().to_dict() == portable[2].result().to_dict()


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
def test_the_compiled_pass_refuses_exactly_the_folds_that_overflow(dtype: torch.dtype) -> None:
    """A folded value at the overflow limit (a tie: to the even neighbour, the infinity) or above, or NaN, is
    refused; the largest float64 below the limit stores the largest finite value."""
    limit = overflows_from(dtype)
    below = float(torch.nextafter(torch.tensor(limit, dtype=torch.float64), torch.tensor(0.0).double()))
    top = torch.finfo(dtype).max
    kind = next(k for k in LAYERS if k.name == "linear")
    for value, refused in ((below, False), (limit, True), (float("nan"), True)):
        weight = torch.tensor([[1.0, 1.0], [0.5, -2.0]], dtype=dtype)
        scale = torch.tensor([value / 1.0, 1.0], dtype=torch.float64)  # row 0, column 0: 1.0 * value
        f = SimpleNamespace(forward=True, scale=scale, shift=torch.zeros(2, dtype=torch.float64), norm="norm")
        recipe = LayerRecipe(kind, "w", None, None, dtype, dtype, 1, [f])  # type: ignore[list-item]
        scratch = Scratch()
        blocks = recipe.blocks(TensorStore({"w": weight}), scratch=scratch, tally=RangeTally(recipe))
        if refused:
            with pytest.raises(UnsupportedModelError, match="overflows"):
                list(blocks)
        else:
            ((stored, _),) = list(blocks)
            assert float(stored[0, 0]) == top
