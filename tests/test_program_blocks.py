"""The streamed fold's block helpers (``slabconv.engine.program``): the overflow check on float64 blocks and the
reused buffers give exactly what rounding each block into a new tensor gives."""

from __future__ import annotations

import pytest
import torch

from slabconv.engine.program import Scratch, rounds_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rounds_finite_agrees_with_rounding_the_whole_block(dtype: torch.dtype) -> None:
    top = torch.finfo(dtype).max
    ulp = top - float(torch.nextafter(torch.tensor(top, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
    edges = [top, top + ulp / 4, top + ulp / 2, top + ulp, float("inf"), float("nan")]  # top + ulp/2: a tie, to inf
    for edge in edges:
        for sign in (1.0, -1.0):
            block = torch.tensor([[0.5, sign * edge], [1.0, -2.0]], dtype=torch.float64)
            assert rounds_finite(block, dtype) == bool(torch.isfinite(block.to(dtype)).all()), (edge, sign)
    assert rounds_finite(torch.empty(0, 3, dtype=torch.float64), dtype)


def test_scratch_buffers_are_reused_and_rounding_into_them_equals_to() -> None:
    scratch = Scratch()
    values = torch.randn(64, 33, dtype=torch.float64) * 1e3
    into = scratch.take("stored", values.shape, torch.float16).copy_(values)
    assert torch.equal(into, values.to(torch.float16))
    again = scratch.take("stored", (8, 33), torch.float16)
    assert again.data_ptr() == into.data_ptr()  # the same buffer, not a new mapping
    assert scratch.take("rows", (8, 33), torch.float16).data_ptr() != into.data_ptr()
