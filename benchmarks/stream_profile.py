"""Where the streamed fold-and-write stage spends its CPU time, in one process.

    python -m benchmarks.stream_profile DIR     # DIR: a sharded folder (e.g. the one benchmarks.stream_throughput
                                                # builds: python -c "from benchmarks.memory_streaming import ...")
    python -m benchmarks.stream_profile         # builds the LLaMA-350M-shaped float16 folder first (minutes)
    python -m benchmarks.stream_profile DIR --lanes 1   # the blocks made in one thread (how the lanes scale)
    python -m benchmarks.stream_profile DIR --kernels   # also: the lane's kernels alone, on one sub-block in cache

Plans the folder as ``fuse --stream`` does, then runs ``write.shards.write_program_shards`` once (torch on one
thread per lane, as in the stage), timing its parts with ``time.thread_time`` in the thread that runs them: reading
a block out of the shard, widening it to float64, the folds, the overflow check, rounding once to the stored
dtype, the weight ranges, waiting for the writer threads (each part summed over the fold's lanes,
``write.shards.fold_lanes``), and in the writer's threads ``write()`` and the sha256 of every written byte. Prints
CPU seconds per part and its share of the fold's (the lanes') CPU time. CPU time, not wall time: on a loaded
machine the wall time of a run moves by a factor of two, its CPU time by a few percent.

``--kernels`` also times, on one ``CACHE_BLOCK`` sub-block of float16 rows 1024 wide (one torch thread, each call
repeated on the same buffers, so its data stay in the core's cache and its code hot), each torch / numpy call the
lane makes on a sub-block of a forward-folded linear layer (every layer the LLaMA folders fold), scaled to the
stage's folded weights: the lane's arithmetic with no Python between the calls and nothing evicted, the least any
lane built of these calls can cost.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPENT: dict[str, float] = defaultdict(float)
_LOCK = threading.Lock()

LANE_PARTS = (
    "round once to the stored dtype",
    "the weight ranges",
    "the folds in float64",
    "widen half precision to float32",
    "the overflow check",
)
MAIN_PARTS = (
    "read the blocks (safetensors, copies too)",
    "hand over to the writer (waits)",
    "each layer's ranges from its rows' (result)",
    "each layer's bias (rounded, checked)",
)


def _timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - start
            with _LOCK:  # parts run in several threads at once
                SPENT[part] += spent

    return call


class _TimedSha256:
    """``hashlib.sha256`` whose ``update`` (run in a writer thread) is timed."""

    def __init__(self, data: bytes = b"") -> None:
        import hashlib

        self.inner = hashlib.sha256(data)
        self.update = _timed("sha256 (writer thread)", self.inner.update)
        self.hexdigest = self.inner.hexdigest


class _TimedFile:
    """A shard file whose ``write`` (run in a writer thread) is timed."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.write = _timed("write() (writer thread)", file.write)
        self.close = file.close


def profile(src: Path, out: Path) -> dict[str, float]:
    """CPU seconds of the stage's parts on ``src`` (written to ``out``): by part (summed over the threads that ran
    it), ``fold lane N`` (lane 0 runs on the main thread), ``main thread``, ``process`` and ``stage wall``."""
    from types import SimpleNamespace

    import torch

    from slabconv.engine import program
    from slabconv.engine.ranges import RangeTally
    from slabconv.load import shards as load_shards
    from slabconv.pipeline import open_sharded, plan_sharded
    from slabconv.util import no_progress
    from slabconv.write import shards as ws

    load_shards.return_freed_blocks_to_the_os()
    sharded = open_sharded(src, program.FOLD_BLOCK)
    planned = plan_sharded(sharded.shards, sharded.config, None, sharded.sha256)[1]
    parts: list[tuple[object, str, str]] = [
        (program, "rounded", "round once to the stored dtype"),
        (program, "_widening", "widen half precision to float32"),
        (program.LayerRecipe, "_fold", "the folds in float64"),
        (load_shards.LazyShards, "get", "read the blocks (safetensors, copies too)"),
        (program.LayerRecipe, "_check_fits", "the overflow check"),
        (RangeTally, "measure", "the weight ranges"),
        (program.LayerRecipe, "_check_largest", "the overflow check"),
        (RangeTally, "result", "each layer's ranges from its rows' (result)"),
        (program.LayerRecipe, "_stored_bias", "each layer's bias (rounded, checked)"),
        (ws.ShardWriter, "write", "hand over to the writer (waits)"),
        (ws.ShardWriter, "close", "hand over to the writer (waits)"),
    ]
    for owner, name, part in parts:  # this process only: it exits after the one run
        setattr(owner, name, _timed(part, getattr(owner, name)))
    spread, init = program.Scratch.spread, ws.ShardWriter.__init__

    def timed_spread(self: Any, count: int, work: Callable[[int, int], None]) -> None:
        lanes = [_timed(f"fold lane {lane}", work) for lane in range(self.lanes)]
        spread(self, count, lambda i, lane: lanes[lane](i, lane))

    def timed_init(self: Any, *args: Any) -> None:
        init(self, *args)
        self.file = _TimedFile(self.file)

    program.Scratch.spread = timed_spread  # type: ignore[method-assign]
    ws.ShardWriter.__init__ = timed_init  # type: ignore[method-assign,assignment]
    ws.hashlib = SimpleNamespace(sha256=_TimedSha256)  # type: ignore[assignment]
    assert planned.program is not None
    SPENT.clear()
    threads = torch.get_num_threads()
    wall, main, process = time.perf_counter(), time.thread_time(), time.process_time()
    ws.write_program_shards(out, sharded.shards, sharded.shard_names, planned.program, {}, no_progress)
    result = dict(SPENT)
    result["main thread"] = time.thread_time() - main
    result["process"] = time.process_time() - process
    result["stage wall"] = time.perf_counter() - wall
    result["folded weights"] = float(sum(math.prod(sharded.shards.shape(k)) for k in planned.program.layers))
    assert torch.get_num_threads() == threads
    return result


def kernel_floor(elements: int, repeats: int = 2000) -> dict[str, float]:
    """CPU seconds of each kernel the lane runs on a sub-block (``engine.program.CACHE_BLOCK`` values, rows 1024
    wide, one forward fold), timed ``repeats`` times on the same buffers and scaled to ``elements`` folded weights."""
    import numpy as np
    import torch

    from slabconv.engine.program import CACHE_BLOCK

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    read = (torch.randn(CACHE_BLOCK // 1024, 1024, generator=gen) * 0.02).half()
    wide, near = torch.empty(read.shape), torch.empty(read.shape)
    w, out = torch.empty(read.shape, dtype=torch.float64), torch.empty(read.shape, dtype=torch.float16)
    scale = torch.rand(1024, generator=gen, dtype=torch.float64) + 0.5
    shift = torch.rand(1024, generator=gen, dtype=torch.float64)
    high32, low32 = torch.empty(len(read)), torch.empty(len(read))
    high, low = torch.empty(len(read), dtype=torch.float64), torch.empty(len(read), dtype=torch.float64)
    wide.copy_(read)
    w0 = wide.double()  # the fold reads these (the lane scales its rows in place: the same passes)
    torch.mul(w0, scale, out=w)
    near.copy_(w)
    bits = near.numpy().reshape(-1).view(np.int32)
    at = ((bits & 0xFFF) == 0).nonzero()[0]
    calls: dict[str, Callable[[], object]] = {
        "widen float16 to float32": lambda: wide.copy_(read),
        "ranges before (amax, amin, float32)": lambda: (
            torch.amax(wide, 1, out=high32),
            torch.amin(wide, 1, out=low32),
        ),
        "float32 to float64": lambda: w.copy_(wide),
        "the fold: bias (W t), scale (W s)": lambda: (w0 @ shift, torch.mul(w0, scale, out=w)),
        "ranges after (amax, amin, float64)": lambda: (torch.amax(w, 1, out=high), torch.amin(w, 1, out=low)),
        "round: float64 to float32": lambda: near.copy_(w),
        "round: float32 to float16": lambda: out.copy_(near),
        "round: the tie candidates (numpy)": lambda: ((bits & 0xFFF) == 0).nonzero(),
        "round: the candidates cast (numpy)": lambda: (
            out.numpy().reshape(-1).__setitem__(at, w.numpy().reshape(-1)[at].astype(np.float16))
        ),
    }
    result = {}
    for name, call in calls.items():
        call()
        start = time.thread_time()
        for _ in range(repeats):
            call()
        result[name] = (time.thread_time() - start) / repeats * elements / read.numel()
    return result


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, help="a sharded folder (default: build the 350M one)")
    parser.add_argument("--lanes", type=int, default=None, help="fold lanes (default: write.shards.fold_lanes())")
    parser.add_argument("--kernels", action="store_true", help="also time the lane's kernels alone (in cache)")
    args = parser.parse_args(argv)
    if args.lanes is not None:
        from slabconv.write import shards as ws

        lanes = args.lanes
        ws.fold_lanes = lambda: lanes
    with tempfile.TemporaryDirectory(prefix="slabconv-profile-") as tmp:
        src = args.folder
        if src is None:
            from benchmarks.memory_streaming import SHAPES, build_checkpoint

            src = Path(tmp) / "src"
            build_checkpoint(src, dict(SHAPES["350m"]), 200 * 10**6)
        (Path(tmp) / "out").mkdir()
        result = profile(src, Path(tmp) / "out")
    lanes = sum(v for k, v in result.items() if k.startswith("fold lane "))
    per_lane = ", ".join(f"{k.removeprefix('fold ')} {v:.2f}" for k, v in sorted(result.items()) if "fold lane" in k)
    outside = result["main thread"] - result.get("fold lane 0", 0.0)
    write, sha = result["write() (writer thread)"], result["sha256 (writer thread)"]
    other = result["process"] - lanes - outside - write - sha
    print(f"stage wall {result['stage wall']:.2f} s; process {result['process']:.2f} CPU-s")
    print(f"  fold lanes {lanes:.2f} CPU-s ({per_lane}; lane 0 is the main thread)")
    for part in LANE_PARTS:
        print(f"    {part:44s} {result.get(part, 0.0):6.2f} CPU-s {result.get(part, 0.0) / lanes:6.1%} of the lanes")
    rest = lanes - sum(result.get(part, 0.0) for part in LANE_PARTS)
    print(f"    {'the rest (float32 to float64, Python)':44s} {rest:6.2f} CPU-s {rest / lanes:6.1%} of the lanes")
    print(f"  main thread outside the lanes {outside:.2f} CPU-s")
    for part in MAIN_PARTS:
        print(f"    {part:44s} {result.get(part, 0.0):6.2f} CPU-s")
    print(f"  writer threads {write + sha:.2f} CPU-s (write() {write:.2f}, sha256 {sha:.2f})")
    print(f"  other threads and start-up {other:.2f} CPU-s")
    if args.kernels:
        floor = kernel_floor(int(result["folded weights"]))
        print(f"the lane's kernels alone, one sub-block in cache, {result['folded weights'] / 1e6:.0f} M weights:")
        for part, spent in floor.items():
            print(f"    {part:44s} {spent:6.2f} CPU-s")
        print(f"    {'all of them':44s} {sum(floor.values()):6.2f} CPU-s (the lanes: {lanes:.2f})")
        result.update({f"kernel: {k}": v for k, v in floor.items()})
    return result


if __name__ == "__main__":
    main()
