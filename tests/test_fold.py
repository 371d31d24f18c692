"""The fold algebra (slabconv.fold) against PyTorch's own BatchNorm, Linear and Conv, for random parameters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from slabconv import fold

CASES = [
    # (dtype, eps, affine, alpha, bias)
    (torch.float32, 1e-5, True, 0.7, True),
    (torch.float32, 1e-6, True, -1.3, False),
    (torch.float32, 1e-5, False, 0.0, True),
    (torch.float64, 1e-6, False, 2.0, False),
    (torch.float64, 1e-5, True, 1.0, True),
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def _bn(c: int, eps: float, affine: bool, dtype: torch.dtype, seed: int) -> nn.BatchNorm1d:
    gen = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm1d(c, eps=eps, affine=affine).to(dtype).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=gen) * 3)
        bn.running_var.copy_(torch.rand(c, generator=gen) * 4 + 1e-3)
        if affine:
            bn.weight.copy_(torch.randn(c, generator=gen))
            bn.bias.copy_(torch.randn(c, generator=gen))
    return bn


def _affine(bn: nn.BatchNorm1d, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    return fold.repbn_affine(
        bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, torch.tensor([alpha], dtype=torch.float64)
    )


@pytest.mark.parametrize("dtype,eps,affine,alpha,bias", CASES)
def test_repbn_affine_matches_batchnorm_plus_alpha(dtype, eps, affine, alpha, bias):
    bn = _bn(12, eps, affine, dtype, seed=1)
    x = torch.randn(5, 12, dtype=dtype) * 4
    scale, shift = _affine(bn, alpha)
    expected = bn(x) + alpha * x
    torch.testing.assert_close((x.double() * scale + shift).to(dtype), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype,eps,affine,alpha,bias", CASES)
def test_forward_fold_into_linear(dtype, eps, affine, alpha, bias):
    bn = _bn(16, eps, affine, dtype, seed=2)
    lin = nn.Linear(16, 7, bias=bias).to(dtype)
    x = torch.randn(3, 9, 16, dtype=dtype)
    expected = lin((bn(x.transpose(1, 2)) + alpha * x.transpose(1, 2)).transpose(1, 2))
    w, b = fold.fold_into_linear(lin.weight, lin.bias, *_affine(bn, alpha))
    assert w.dtype == dtype and b.dtype == dtype
    torch.testing.assert_close(nn.functional.linear(x, w, b), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype,eps,affine,alpha,bias", CASES)
def test_backward_fold_into_linear_producer(dtype, eps, affine, alpha, bias):
    bn = _bn(16, eps, affine, dtype, seed=3)
    lin = nn.Linear(10, 16, bias=bias).to(dtype)
    x = torch.randn(4, 10, dtype=dtype)
    h = lin(x)
    expected = bn(h) + alpha * h
    w, b = fold.fold_into_producer(lin.weight, lin.bias, *_affine(bn, alpha))
    torch.testing.assert_close(nn.functional.linear(x, w, b), expected, **TOL[dtype])


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_forward_fold_into_unpadded_conv(groups):
    bn = _bn(8, 1e-5, True, torch.float64, seed=4)
    conv = nn.Conv2d(8, 16, kernel_size=3, stride=2, groups=groups).double()
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    alpha = 0.4
    normed = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    expected = conv(normed + alpha * x)
    w, b = fold.fold_into_conv(conv.weight, conv.bias, *_affine(bn, alpha), groups=groups)
    got = nn.functional.conv2d(x, w, b, stride=2, groups=groups)
    torch.testing.assert_close(got, expected, **TOL[torch.float64])


def test_forward_fold_into_padded_conv_is_wrong():
    """The reason padded convs are refused: the padded zeros are not shifted, so the folded conv differs."""
    bn = _bn(4, 1e-5, True, torch.float64, seed=5)
    conv = nn.Conv2d(4, 4, kernel_size=3, padding=1).double()
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    normed = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    w, b = fold.fold_into_conv(conv.weight, conv.bias, *_affine(bn, 0.0))
    error = (nn.functional.conv2d(x, w, b, padding=1) - conv(normed)).abs().max()
    assert error > 1e-3


def test_backward_fold_into_conv_producer():
    bn = _bn(6, 1e-5, True, torch.float64, seed=6)
    conv = nn.Conv2d(3, 6, kernel_size=4, stride=4).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    h = conv(x)
    alpha = -0.5
    expected = torch.nn.functional.batch_norm(
        h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps
    )
    expected = expected + alpha * h
    w, b = fold.fold_into_producer(conv.weight, conv.bias, *_affine(bn, alpha))
    torch.testing.assert_close(nn.functional.conv2d(x, w, b, stride=4), expected, **TOL[torch.float64])


def test_dropping_alpha_gives_a_different_fold():
    """A fold that forgets RepBN's alpha (the bug the verify test catches) is measurably wrong."""
    bn = _bn(16, 1e-5, True, torch.float32, seed=7)
    lin = nn.Linear(16, 4)
    x = torch.randn(8, 16)
    right = nn.functional.linear(x, *fold.fold_into_linear(lin.weight, lin.bias, *_affine(bn, 1.0)))
    wrong = nn.functional.linear(x, *fold.fold_into_linear(lin.weight, lin.bias, *_affine(bn, 0.0)))
    assert (right - wrong).abs().max() / right.abs().max() > 1e-2


def test_half_precision_fold_keeps_dtype_and_flags_overflow():
    bn = _bn(4, 1e-5, True, torch.float16, seed=8)
    lin = nn.Linear(4, 2).half()
    w, b = fold.fold_into_linear(lin.weight, lin.bias, *_affine(bn, 1.0))
    assert w.dtype == torch.float16 and fold.fits_dtype(w, b)
    huge = torch.full((4,), 1e6, dtype=torch.float64)
    w, b = fold.fold_into_linear(lin.weight * 100, lin.bias, huge, torch.zeros(4, dtype=torch.float64))
    assert not fold.fits_dtype(w, b)


def test_fold_functions_do_not_mutate_their_inputs():
    lin = nn.Linear(4, 3)
    before = lin.weight.detach().clone(), lin.bias.detach().clone()
    fold.fold_into_linear(lin.weight, lin.bias, torch.full((4,), 2.0, dtype=torch.float64), torch.ones(4).double())
    fold.fold_into_producer(lin.weight, lin.bias, torch.full((3,), 2.0, dtype=torch.float64), torch.ones(3).double())
    assert torch.equal(lin.weight, before[0]) and torch.equal(lin.bias, before[1])


def _inplace_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor, object]]:
    """(name, float64 weight, fold taking (weight, inplace)) for every fold function."""
    s, t = torch.rand(6, generator=gen, dtype=torch.float64) + 0.5, torch.randn(6, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    return [
        ("linear", torch.randn(5, 6, generator=gen, dtype=torch.float64),
         lambda w, i: fold.fold_into_linear(w, bias[:5], s, t, inplace=i)),
        ("producer", torch.randn(6, 4, generator=gen, dtype=torch.float64),
         lambda w, i: fold.fold_into_producer(w, bias, s, t, inplace=i)),
        ("conv", torch.randn(4, 3, 2, 2, generator=gen, dtype=torch.float64),
         lambda w, i: fold.fold_into_conv(w, bias[:4], s, t, groups=2, first=2, total=8, inplace=i)),
        ("embedding", torch.randn(7, 6, generator=gen, dtype=torch.float64),
         lambda w, i: (fold.fold_into_embedding(w, s, t, inplace=i),)),
    ]  # fmt: skip


def test_inplace_folds_give_the_same_bits_in_the_callers_buffer():
    """The streamed writer folds each block in its own float64 buffer (``inplace``): the values must be the pure
    fold's, bit for bit (question 1 checks 0 units in the last place), and the result must be that buffer."""
    for name, weight, run in _inplace_cases(torch.Generator().manual_seed(3)):
        pure = run(weight, False)
        buffer = weight.clone()
        done = run(buffer, True)
        assert done[0].data_ptr() == buffer.data_ptr(), name
        for a, b in zip(pure, done, strict=True):
            assert torch.equal(a, b), name
        assert not torch.equal(buffer, weight), name  # the buffer was overwritten


@pytest.mark.parametrize("groups", [1, 3, 12])
def test_grouped_folds_by_blocks_of_rows_equal_the_whole_fold_bit_for_bit(groups):
    """A streamed fold hands the conv folds one block of rows at a time (``first``, ``total``), blocks that start
    and end inside a group: each row must read the scale and shift of its own group's channels, so the blocks
    joined are the whole fold, bit for bit (a row given another group's channels, or the first group's, differs)."""
    gen = torch.Generator().manual_seed(11)
    rows, width = 24, 5  # 24 rows in `groups` groups; blocks of 7 cut every group of 2 or 8
    s = torch.rand(groups * width, generator=gen, dtype=torch.float64) + 0.5
    t = torch.randn(groups * width, generator=gen, dtype=torch.float64)
    conv_bias = torch.randn(rows, generator=gen, dtype=torch.float64)  # a conv's: per row (output channel)
    transposed_bias = torch.randn(groups * width, generator=gen, dtype=torch.float64)  # per output channel
    folds = [  # (weight, bias, fold of the rows from `first` on: its weight rows and its part of the bias)
        (torch.randn(rows, width, 3, 3, generator=gen, dtype=torch.float64), conv_bias,
         lambda w, b, first: fold.fold_into_conv(w, b[first : first + len(w)], s, t, groups, first=first, total=rows)),
        (torch.randn(rows, width, 2, 2, generator=gen, dtype=torch.float64), transposed_bias,
         lambda w, b, first: (fold.fold_into_conv_transpose(w, b, s, t, groups, first=first, total=rows)[0], None)),
    ]  # fmt: skip
    for weight, bias, run in folds:
        whole_w, whole_b = run(weight, bias, 0)
        parts = [run(weight[i : i + 7], bias, i) for i in range(0, rows, 7)]
        assert torch.equal(torch.cat([w for w, _ in parts]), whole_w)
        if whole_b is not None:
            assert torch.equal(torch.cat([b for _, b in parts]), whole_b)


def test_inplace_fold_refuses_a_weight_that_is_not_float64():
    with pytest.raises(ValueError, match="float64"):
        fold.fold_into_linear(torch.ones(2, 3), None, torch.ones(3).double(), torch.zeros(3).double(), inplace=True)


def _bfloat16_nearest(v: float) -> float:
    """The bfloat16 value nearest to ``v`` (ties to the even one), by exact rational arithmetic over the
    neighbours of ``v``'s float32 rounding: the reference ``fold.rounded`` must equal."""
    import struct
    from fractions import Fraction

    if v != v or abs(v) == float("inf"):
        return v
    top = struct.unpack("<I", struct.pack("<f", v))[0] >> 16  # bfloat16 is float32's upper 16 bits
    near = []
    for bits in range(max(0, top - 2), min(0xFFFF, top + 2) + 1):
        value = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
        if value == value and abs(value) != float("inf"):
            near.append((abs(Fraction(value) - Fraction(v)), bits & 1, value))
    return min(near)[2]


def _numpy_float16(t: torch.Tensor) -> object:
    """numpy's float64 -> float16 conversion (direct, one rounding); values beyond float16 become infinities."""
    import numpy as np

    with np.errstate(over="ignore"):
        return t.numpy().astype(np.float16)


def test_rounded_rounds_once_to_the_nearest_where_torch_rounds_twice() -> None:
    """float64 to float16 / bfloat16: ``fold.rounded`` gives the nearest value (numpy's direct conversion for
    float16, exact rational arithmetic for bfloat16) on values placed just off midpoints, where torch's ``to``
    (through float32) goes to the even neighbour instead; special values keep their meaning."""

    gen = torch.Generator().manual_seed(0)
    grid = torch.randint(0, 1 << 10, (4000,), generator=gen).double()
    nudge = torch.randn(4000, generator=gen, dtype=torch.float64)
    specials = [0.0, -0.0, float("inf"), -float("inf"), 1e-50, -1e-50, 3e-8, 65519.99, -65520.0, 1e300]
    for dtype, bits, nearest, special in (
        (torch.float16, 10, lambda t: torch.from_numpy(_numpy_float16(t)), specials),
        (torch.bfloat16, 7, lambda t: torch.tensor([_bfloat16_nearest(v) for v in t.tolist()]), specials[:6]),
    ):
        mids = (1 + (grid + 0.5) * 2.0**-bits) * (1 + nudge * 2.0**-40) * torch.where(nudge > 0, 1.0, -3.0)
        tiny = (grid[:500] + 0.5) * 2.0**-24 * (1 + nudge[:500] * 2.0**-40)  # float16's subnormal midpoints
        values = torch.cat([mids, tiny, torch.tensor(special, dtype=torch.float64)])
        want = nearest(values).to(dtype).view(torch.int16)  # (bfloat16: representable, so this cast is exact)
        got = fold.rounded(values, dtype)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16), want), dtype
        assert int((values.to(dtype).view(torch.int16) != want).sum()) > 100  # torch's double rounding
    assert torch.isnan(fold.rounded(torch.tensor([float("nan")], dtype=torch.float64), torch.float16)).all()
    x = torch.randn(5, dtype=torch.float32)
    assert torch.equal(fold.rounded(x, torch.float16), x.half())  # from float32 torch rounds once already


def test_rounded_gives_torchs_nan_whatever_its_payload() -> None:
    """A float64 NaN whose float32 rounding ends in 13 zero bits (a tie candidate) rounds to the NaN torch's cast
    gives (as every other NaN does): a signalling NaN quieted (0x7E01), where numpy's cast keeps it (0x7C01)."""
    import numpy as np

    nan = torch.from_numpy(np.array([0x7FF0040000000000, 0xFFF0040000000000], dtype=np.uint64).view(np.float64))
    assert bool(nan.isnan().all())
    want = nan.to(torch.float16).view(torch.int16)
    assert not torch.equal(torch.from_numpy(nan.numpy().astype(np.float16)).view(torch.int16), want)
    assert torch.equal(fold.rounded(nan, torch.float16).view(torch.int16), want)
    out = torch.empty(2, dtype=torch.float16)
    assert torch.equal(fold.rounded(nan, torch.float16, out=out, near=torch.empty(2)).view(torch.int16), want)


@settings(max_examples=200, deadline=None)
@given(
    grid=st.lists(st.integers(0, (1 << 10) - 1), min_size=1, max_size=64),
    scale=st.integers(-26, 17),
    nudge=st.floats(-1.0, 1.0),
    extra=st.lists(st.sampled_from([0.0, -0.0, 65504.0, 65519.99999999999, 65520.0, -65536.0, 1e300, float("inf")])),
)
def test_rounded_to_float16_is_numpys_single_rounding(grid: list[int], scale: int, nudge: float, extra: list[float]):
    """``fold.rounded`` to float16, with and without the streamed fold's buffers, equals numpy's direct float64 ->
    float16 cast on values placed on and just off midpoints of float16 neighbours at any exponent (subnormal to
    beyond float16's largest value: those become infinities) and among the largest finite values and infinities."""
    import numpy as np

    mids = [(1 + (g + 0.5) * 2.0**-10) * 2.0**scale * (1 + nudge * 2.0**-40) for g in grid]
    values = torch.tensor(mids + extra, dtype=torch.float64)
    want = torch.from_numpy(_numpy_float16(values)).view(torch.int16)
    assert torch.equal(fold.rounded(values, torch.float16).view(torch.int16), want)
    out, near = torch.empty(len(values), dtype=torch.float16), torch.empty(len(values))
    assert torch.equal(fold.rounded(values, torch.float16, out=out, near=near).view(torch.int16), want)
    with np.errstate(over="raise"):  # a cast that overflows outside ``rounded``'s own np.errstate raises here
        fold.rounded(values, torch.float16)


def test_rounded_to_float16_rounds_every_float16_midpoint_once_to_the_nearest() -> None:
    """Every midpoint of two neighbouring float16 values (0 to the overflow threshold 65520, both signs) and the
    values 2**-40 of it either side, whose float32 rounding is the midpoint itself: ``fold.rounded`` (alone and with
    the streamed fold's buffers) gives the nearer neighbour, and the even one on the midpoint, bit for bit, as does
    numpy's direct float64 -> float16 cast that it takes for the tie candidates. The expected bits come from the
    neighbours' own bits, no cast: torch's cast through float32 gives the even neighbour on both sides instead."""
    import numpy as np

    low = np.arange(0, 0x7C00, dtype=np.uint16)  # every finite float16 >= 0; its upper neighbour (0x7C00: infinity)
    a, b = low.view(np.float16).astype(np.float64), (low + 1).view(np.float16).astype(np.float64)
    b[-1] = 65536.0  # the overflow threshold's upper "neighbour": 65520 and above round to infinity
    mid = (a + b) / 2  # exact in float64
    even = np.where(low % 2 == 0, low, low + 1)
    values = np.concatenate([mid, mid * (1 - 2.0**-40), mid * (1 + 2.0**-40)])
    want = np.concatenate([even, low, low + 1]).astype(np.uint16)
    values, want = np.concatenate([values, -values]), np.concatenate([want, want | 0x8000])
    assert np.array_equal(values.astype(np.float32).astype(np.float64)[: 3 * len(low)][len(low) :], np.tile(mid, 2))
    x = torch.from_numpy(values)
    assert np.array_equal(fold.rounded(x, torch.float16).view(torch.int16).numpy().view(np.uint16), want)
    out, near = torch.empty(len(x), dtype=torch.float16), torch.empty(len(x))
    got = fold.rounded(x, torch.float16, out=out, near=near)
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), want)
    assert np.array_equal(_numpy_float16(x).view(np.uint16), want)
    assert not np.array_equal(x.to(torch.float16).view(torch.int16).numpy().view(np.uint16), want)
