"""Issue 38, item 4: the checks of a language model compare its logits ``(B, T, V)`` a block of rows at a time
(``slabconv.verify.blocks``): question 2's errors and near-ties (``judge.rel_err``, ``policy.decisive``) and the
task metrics (``task_metrics.Scorer``) give the same numbers, bit for bit, for every block size, and hold no
float64 copy of a whole logits array (numpy's allocations, as ``tracemalloc`` counts them)."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from slabconv.verify import judge, policy
from slabconv.verify.task_metrics import Scorer, kl, log_softmax, nll, score

B, T, V = 5, 7, 33
ROW = 8 * V
"""One row of float64 logits: a block of this many bytes holds one row."""


@pytest.fixture(scope="module")
def logits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gen = np.random.default_rng(0)
    reference = gen.normal(scale=3.0, size=(B, T, V))
    reference[3, 2] *= 5  # the largest logit in one row of sample 3: the scale every block is judged at
    reference[1, -1] *= 8  # larger still at a last position, which predicts no token: the task metrics' scale
    original = (reference + gen.normal(scale=1e-3, size=reference.shape)).astype(np.float32)
    candidate = (reference + gen.normal(scale=2e-3, size=reference.shape)).astype(np.float32)
    return reference, original, candidate


def _peak(call: Callable[[], object]) -> int:
    """The most bytes numpy (and Python) held at once during ``call``, above what was held before."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("chunk", [ROW, 3 * ROW, 10**9])
def test_rel_err_is_the_whole_arrays_in_every_block_size(logits, chunk) -> None:
    reference, _, candidate = logits
    diff = np.abs(candidate.astype(np.float64) - reference)
    per_sample = diff.reshape(B, -1).max(axis=1)
    got = judge.rel_err(candidate, reference, chunk_bytes=chunk)
    assert got[0] == diff.max() / np.abs(reference).max() and got[1] == diff.max()
    assert got[3] == int(per_sample.argmax())
    assert got[2] == pytest.approx(diff.mean(), rel=1e-13)  # a sum of row sums: the same in every block size
    assert got == judge.rel_err(candidate, reference, chunk_bytes=10**9)
    for at in [(0, 0, 0), (slice(None), 0, 0), (slice(None), 0)]:  # outputs of rank 0, 1 and 2 too
        a, c = np.asarray(reference[at]), np.asarray(candidate[at])
        assert judge.rel_err(c, a, chunk_bytes=chunk) == judge.rel_err(c, a, chunk_bytes=10**9)
        assert judge.rel_err(c, a, chunk_bytes=chunk)[1] == np.abs(c.astype(np.float64) - a).max()


@pytest.mark.parametrize("chunk", [ROW, 2 * ROW])
def test_a_non_finite_candidate_names_the_first_sample_it_is_in_whatever_the_blocks(logits, chunk) -> None:
    reference, _, candidate = logits
    bad = candidate.copy()
    bad[4, 6, 0] = np.nan
    bad[2, 5, 3] = np.inf
    assert judge.rel_err(bad, reference, chunk_bytes=chunk) == (math.inf, math.inf, math.inf, 2)


@pytest.mark.parametrize("chunk", [ROW, 4 * ROW, 10**9])
def test_near_ties_are_judged_at_the_whole_arrays_scale_in_every_block_size(logits, chunk) -> None:
    """The scale of a near-tie is the largest logit of the whole array: a block without it is judged at it too."""
    reference = logits[0]
    top2 = np.sort(reference, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]
    bound = float(np.quantile(margin, 0.5)) / np.abs(reference).max()  # half the positions are near-ties
    want = margin > bound * np.abs(reference).max()
    assert 0 < want.sum() < want.size
    got = policy.decisive(reference, "float32", bound=bound, chunk_bytes=chunk)
    assert got.shape == (B, T) and np.array_equal(got, want)
    assert policy.decisive(reference[0, 0], "float32", bound=bound, chunk_bytes=chunk).shape == ()
    broken = reference.copy()
    broken[4, 6, 0] = np.nan  # a NaN anywhere makes the whole array's scale NaN: no position is decisive
    assert not policy.decisive(broken, "float32", bound=bound, chunk_bytes=chunk).any()


@pytest.mark.parametrize("chunk", [ROW, 3 * ROW])
def test_task_metrics_are_the_whole_arrays_in_every_block_and_batch_size(logits, chunk) -> None:
    reference, original, candidate = logits
    ids = np.random.default_rng(1).integers(0, V, size=(B, T))
    whole = score(reference, ("original", original), [("fused", candidate)], ids, "float32", chunk_bytes=10**9)
    assert score(reference, ("original", original), [("fused", candidate)], ids, "float32", chunk).to_dict() == (
        whole.to_dict()
    )
    scorer = Scorer(ids, "float32", chunk)  # batches of 2 sequences, as the runtimes give them
    scorer.reference(reference[i : i + 2] for i in range(0, B, 2))
    scorer.run("original", (original[i : i + 2] for i in range(0, B, 2)), decides=False)
    scorer.run("fused", (candidate[i : i + 2] for i in range(0, B, 2)))
    assert scorer.metrics().to_dict() == whole.to_dict()
    # the numbers of the whole arrays computed at once (log_softmax, nll and kl on (B, T - 1, V))
    ref, base, fused = (log_softmax(x[:, :-1]) for x in (reference, original, candidate))
    run = whole.runs[1]
    assert whole.reference["perplexity"] == float(np.exp(nll(ref, ids[:, 1:]).mean()))
    assert run.perplexity == float(np.exp(nll(fused, ids[:, 1:]).mean()))
    assert (run.kl_mean, run.kl_max) == (float(kl(ref, fused).mean()), float(kl(ref, fused).max()))
    assert run.kl_to_original_max == float(kl(base, fused).max())
    # the floors' scale is the largest logit of every position, the last one's too (an exact original leaves them)
    exact = Scorer(ids, "float32", chunk)
    exact.reference([reference])
    exact.run("exact", [reference], decides=False)
    delta = 1e-5 * np.abs(reference).max()
    assert exact.metrics().runs[0].bounds == {
        "log_perplexity": 2 * delta,
        "kl_mean": 2 * delta**2,
        "kl_max": 2 * delta**2,
    }


def test_a_run_of_another_shape_is_refused_naming_it(logits) -> None:
    reference, original, _ = logits
    ids = np.zeros((B, T), dtype=np.int64)
    scorer = Scorer(ids, "float32")
    scorer.reference([reference])
    with pytest.raises(ValueError, match="fused: logits of shape"):
        scorer.run("fused", [original[:, :, :-1]])
    with pytest.raises(ValueError, match="fused: logits of 4 sequences, expected 5"):
        scorer.run("fused", [original[:4]])


def test_the_comparisons_hold_blocks_not_float64_copies_of_the_logits() -> None:
    """Question 2's comparisons and the task metrics on float32 logits of 8 MiB (16 MiB in float64), in blocks of
    64 KiB: what they hold at once beyond their inputs is a few blocks and the per-position numbers, where one
    float64 copy of the logits would be 16 MiB (the unblocked comparisons held several)."""
    gen = np.random.default_rng(2)
    n, t, v = 8, 32, 8192
    reference = gen.normal(size=(n, t, v))
    candidate = (reference + gen.normal(scale=1e-3, size=reference.shape)).astype(np.float32)
    ids = gen.integers(0, v, size=(n, t))
    chunk = 64 << 10
    assert _peak(lambda: judge.rel_err(candidate, reference, chunk_bytes=chunk)) < 1 << 20
    assert _peak(lambda: policy.decisive(reference, "float32", chunk_bytes=chunk)) < 1 << 20
    held = 8 * n * (t - 1) * v + 4 * n * (t - 1) * v  # the reference's log-probabilities, the baseline's logits
    peak = _peak(lambda: score(reference, ("original", candidate), [("fused", candidate)], ids, "float32", chunk))
    assert peak < held + (1 << 20)


def test_outputs_are_stacked_in_place_and_the_reference_keeps_its_own_dtype() -> None:
    """``run_batched`` writes each chunk's outputs into one array per output (no second copy of the logits), the
    same as stacking them, and a chunk unlike the first is stacked as given; ``torch_runner(narrow=True)`` gives a
    float32 model's outputs as float32 (exact), a float64 one's and integer outputs as float64."""
    import torch

    from slabconv.verify.runtimes import run_batched, torch_runner

    x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    calls = []

    def run(chunk: np.ndarray) -> list[np.ndarray]:
        calls.append(len(chunk))
        return [chunk * 2.0, chunk.sum(axis=1).astype(np.int64)]

    out = run_batched(run, x, batch=4)
    assert calls == [4, 4, 2] and [o.dtype for o in out] == [np.float32, np.int64]
    assert np.array_equal(out[0], x * 2.0) and np.array_equal(out[1], x.sum(axis=1))
    widths = iter([3, 5, 3])  # a second chunk of another width: stacked as given, which numpy refuses
    with pytest.raises(ValueError):
        run_batched(lambda c: [np.zeros((len(c), next(widths)))], x, batch=4)

    class Model(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return t * 3, t.argmax(-1)

    for dtype, want in [(torch.float32, np.float32), (torch.bfloat16, np.float32), (torch.float64, np.float64)]:
        got = torch_runner(Model(), dtype, narrow=True)(x)
        assert [g.dtype for g in got] == [want, np.float64], dtype
        assert np.array_equal(got[0], torch_runner(Model(), dtype)(x)[0]), dtype  # the same values
