"""Forward folds into convolutions: ``slabconv.fold.fold_into_conv`` against the same fold with every weight
element's scale and shift gathered by a ``(rows, in / groups)`` index (``scale[chan]``, the formula the per-row
picking replaced), measured in one run. Not part of the test suite.

    python -m benchmarks.conv_fold [--repeats 5] [--threads 1]

Calls: the forward folds one plan of timm's HGNetV2-B0 makes (its ``.pt2`` at 64 x 64; the planner's overflow
check and the fold each fold every block of rows of the 1 x 1 aggregation convs that read a concatenation of
BatchNorm outputs, 278 calls, ``first`` / ``total`` as they came), and the depthwise and grouped folds of a
MobileNet-like stack (the ``index_select`` path). Each call gets a fresh float64 copy of its rows, folded in place
as ``engine.program`` does. Every result is checked bit for bit (sign of zero included) against the gathered
formula before anything is timed; the timings are CPU seconds of this process (``time.process_time``: every
thread, what the other jobs of a shared machine change least), the median of ``--repeats`` rounds of the whole
list, interleaved. One torch thread by default: these tensors are small enough that a second thread's waiting
for work counts as CPU time of its own, which on a shared machine varies more than the folds' arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slabconv import fold  # noqa: E402

# (out, in / groups, groups, first, total, calls): one HGNetV2-B0 plan's forward folds into convs (all 1 x 1)
HGNETV2_B0 = [
    (32, 64, 1, 0, 32, 18), (256, 448, 1, 0, 256, 18), (186, 704, 1, 0, 256, 18), (70, 704, 1, 186, 256, 18),
    (146, 896, 1, 0, 512, 18), (146, 896, 1, 146, 512, 18), (146, 896, 1, 292, 512, 18), (74, 896, 1, 438, 512, 18),
    (128, 160, 1, 0, 128, 13), (64, 64, 1, 0, 64, 12), (512, 256, 1, 0, 512, 6), (128, 128, 1, 0, 128, 6),
    (16, 16, 1, 0, 16, 3), (64, 32, 1, 0, 64, 3), (256, 128, 1, 0, 256, 3), (64, 256, 1, 0, 64, 3),
    (64, 512, 1, 0, 64, 3), (128, 512, 1, 0, 128, 3),
    *[(256, 512, 1, f, 1024, 3) for f in range(0, 1024, 256)],
    *[(128, 1024, 1, f, 2048, 2) for f in range(0, 2048, 128)],
    *[(1, c, 1, 0, t, 4) for c, t in [(64, 32), (448, 256), (64, 64), (704, 256), (896, 512)]],
    (1, 160, 1, 0, 128, 3), (1, 256, 1, 0, 512, 2), (1, 128, 1, 0, 128, 2),
    *[(1, c, 1, 0, t, 1) for c, t in [(16, 16), (32, 64), (128, 256), (256, 64), (512, 64), (512, 128), (512, 1024)]],
    (1, 1024, 1, 0, 2048, 1),
]  # fmt: skip
# (out, in / groups, groups, first, total, calls), 3 x 3 kernels: depthwise and grouped convs
GROUPED = [
    (32, 1, 32, 0, 32, 4), (96, 1, 96, 0, 96, 4), (144, 1, 144, 0, 144, 4), (192, 1, 192, 0, 192, 4),
    (384, 1, 384, 0, 384, 4), (576, 1, 576, 0, 576, 4), (256, 16, 16, 0, 256, 4), (512, 32, 16, 0, 512, 4),
]  # fmt: skip


def gathered(
    weight: torch.Tensor,
    bias: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    groups: int,
    first: int,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold with each element's scale and shift gathered by a ``(rows, in / groups)`` channel index."""
    out_ch, width = weight.shape[0], weight.shape[1]
    group = torch.arange(first, first + out_ch) // (total // groups)
    chan = group[:, None] * width + torch.arange(width)[None, :]
    s = scale[chan].reshape(out_ch, width, *([1] * (weight.dim() - 2)))
    new_b = bias + (weight.sum(dim=tuple(range(2, weight.dim()))) * shift[chan]).sum(dim=1)
    return weight.mul_(s), new_b


def cases(rows: list[tuple[int, int, int, int, int, int]], kernel: tuple[int, ...]) -> list[tuple]:
    """One ``(weight, bias, scale, shift, groups, first, total)`` per call, seeded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, width, groups, first, total, calls in rows:
        channels = width * groups
        for _ in range(calls):
            w = torch.randn(n, width, *kernel, generator=g, dtype=torch.float64)
            w.view(-1)[::5] = -0.0
            t = torch.randn(channels, generator=g, dtype=torch.float64)
            t[::7] = -0.0
            s = torch.rand(channels, generator=g, dtype=torch.float64) + 0.5
            out.append((w, torch.randn(n, generator=g, dtype=torch.float64), s, t, groups, first, total))
    return out


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b)) and bool((torch.signbit(a) == torch.signbit(b)).all())


def check(calls: list[tuple]) -> None:
    for w, b, s, t, groups, first, total in calls:
        want = gathered(w.clone(), b, s, t, groups, first, total)
        got = fold.fold_into_conv(w.clone(), b, s, t, groups, first=first, total=total, inplace=True)
        if not all(identical(x, y) for x, y in zip(want, got, strict=True)):
            raise SystemExit(f"fold_into_conv differs from the gathered fold on {list(w.shape)}, groups {groups}")


def cpu_seconds(calls: list[tuple], new: bool) -> float:
    copies = [w.clone() for w, *_ in calls]  # made before the clock starts
    start = time.process_time()
    for w, (_, b, s, t, groups, first, total) in zip(copies, calls, strict=True):
        if new:
            fold.fold_into_conv(w, b, s, t, groups, first=first, total=total, inplace=True)
        else:
            gathered(w, b, s, t, groups, first, total)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1: see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU ms, median of {args.repeats} rounds")
    print("| calls | n | gathered (before) | per-row (after) | before / after |")
    print("|---|---|---|---|---|")
    for label, calls in [
        ("HGNetV2-B0 1x1", cases(HGNETV2_B0, (1, 1))),
        ("depthwise/grouped 3x3", cases(GROUPED, (3, 3))),
    ]:
        check(calls)
        before, after = [], []
        for _ in range(args.repeats):
            before.append(cpu_seconds(calls, new=False))
            after.append(cpu_seconds(calls, new=True))
        b, a = statistics.median(before) * 1e3, statistics.median(after) * 1e3
        print(f"| {label} | {len(calls)} | {b:.1f} | {a:.1f} | **{b / a:.2f}** |")


if __name__ == "__main__":
    main()
