"""Safetensors files written tensor by tensor (header first, then the bytes in order), for streamed folds: the
fold program (``slabconv.engine.program``) run over the checkpoint's shards, one block of rows at a time."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import torch

from slabconv.engine import FOLD_BLOCK, FoldProgram, RangeTally, row_ranges
from slabconv.engine.program import WRITES_IN_FLIGHT, Scratch
from slabconv.errors import UnsupportedModelError
from slabconv.load.hf import SAFETENSORS_DTYPES
from slabconv.load.shards import LazyShards
from slabconv.util import Progress

FOLD_LANES = 2
"""Threads a folded layer's blocks are made in (``engine.program.Scratch.spread``: each block's sub-blocks, claimed
in turn) where the process may run on more than two cores (``fold_lanes``), beside the writer's two."""


def fold_lanes() -> int:
    """The lanes the stage makes the folded blocks in: ``FOLD_LANES``, or 1 where this process may run on two
    cores or fewer (``os.sched_getaffinity``; ``os.cpu_count`` where it is missing). There a second lane beside
    the writer's two threads gains no wall time and costs CPU time: two lanes at once each take longer per
    sub-block (the caches and memory bandwidth the cores share, the GIL between their calls); on the 350M float16
    folder the stage took 7% less time and 11% less CPU time with one (``docs/performance.md``, "Streamed fold
    throughput")."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return FOLD_LANES if cores > 2 else 1


class ShardWriter:
    """Write one safetensors file tensor by tensor: the header (all names, dtypes, shapes) first, then the bytes in
    the same order; nothing but the tensor being written is held. The file's sha256 is taken from the bytes as
    they are written (``finish`` returns it), so the report's digest needs no second read of the file. Each block
    is written and hashed by two worker threads (one writes, one hashes, each in order) while the caller makes the
    next ones (all three release the GIL: ``hashlib`` for large buffers, the file's ``write`` in the system call,
    torch in its kernels): up to ``WRITES_IN_FLIGHT`` blocks behind the caller, so that a block the hash is slow on
    (a copied tensor, read but not computed) does not stop the fold of the next layer.

    A block's bytes must stay as they are until ``WRITES_IN_FLIGHT`` more ``write`` calls have returned (or
    ``finish`` / ``close``): its write and hash may still be running. A caller that reuses buffers turns through
    ``WRITES_IN_FLIGHT + 1`` of them (``Scratch.alternate``).
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}  # the same bytes every run
        offset = 0
        self.expected: list[tuple[str, torch.dtype, list[int], int]] = []
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }
            self.expected.append((name, dtype, shape, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        head = struct.pack("<Q", len(raw)) + raw
        self.file.write(head)
        self.digest = hashlib.sha256(head)
        self.writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slabconv-write")
        self.hashes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slabconv-sha256")
        self.pending: deque[tuple[Future[Any], Future[Any]]] = deque()  # blocks in flight: write, hash (hold bytes)
        self.index, self.done = 0, 0

    def _settled(self, behind: int = 0) -> None:
        """Wait until at most ``behind`` blocks are still being written or hashed (the oldest first, raising what
        they raised); the others' bytes may be reused from then on."""
        while len(self.pending) > behind:
            for job in self.pending.popleft():
                job.result()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``, the whole entry ``name`` or its next block of rows (blocks in order)."""
        want, dtype, shape, nbytes = self.expected[self.index]
        if name != want or tensor.dtype != dtype or list(tensor.shape[1:]) != shape[1:]:
            raise RuntimeError(f"shard writer: got {name} {tensor.dtype} {list(tensor.shape)}, expected {want} {shape}")
        data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        self._settled(WRITES_IN_FLIGHT - 1)  # in order (one thread each), WRITES_IN_FLIGHT behind the caller at most
        self.pending.append((self.writes.submit(self.file.write, data), self.hashes.submit(self.digest.update, data)))
        self.done += data.nbytes
        if self.done > nbytes:
            raise RuntimeError(f"shard writer: {name} got more bytes than its shape {shape} holds")
        if self.done == nbytes:
            self.index, self.done = self.index + 1, 0

    def close(self) -> None:
        """Wait for the last block, close the file and stop the worker threads (also after a failed write).

        Raises:
            OSError: the last block's write failed (a full disk, ...).
        """
        try:
            self._settled()
        finally:
            self.writes.shutdown()
            self.hashes.shutdown()
            self.file.close()

    def finish(self) -> str:
        """Close the file; returns the hex sha256 of every byte written.

        Raises:
            RuntimeError: fewer tensors were written than the header lists.
        """
        self.close()
        if self.index != len(self.expected):
            raise RuntimeError(f"shard writer: wrote {self.index} of {len(self.expected)} tensors")
        return self.digest.hexdigest()


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch's arithmetic on one thread per lane (``fold_lanes``; the lanes' threads are made inside, so they start
    with one) while the writer's threads write and hash: the fold works on cache-sized pieces, where torch's own
    threads gain little, and more busy threads than cores slowed the fold-and-write stage (701 MB folder, 2 cores,
    five interleaved rounds in one process, with the hash alone beside the fold: median 1.49 s and 2.3 CPU-s on one
    torch thread, 1.86 s and 3.4-4.1 CPU-s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_torch_thread()
def write_program_shards(
    folder: Path,
    reader: LazyShards,
    shard_names: list[str],
    program: FoldProgram,
    metadata: dict[str, str],
    progress: Progress,
    block_elements: int = FOLD_BLOCK,
) -> tuple[dict[str, str], int, dict[str, str]]:
    """Write the fused model the fold ``program`` describes, shard by shard with the input's shard boundaries,
    holding one block of rows at a time.

    Each output shard holds, in the input shard's order, its tensors the program keeps: a copy block by block, a
    folded layer's weight block by block (``LayerRecipe.blocks``: every fold composed in float64, rounded once, in
    ``fold_lanes()`` threads; its ranges before and after go into ``program.ranges``, ``slabconv.engine.ranges``)
    followed by the bias the layer stores (its stored bias, moved beside the weight, or a created one). Each input
    tensor is read once, into reused buffers (``engine.program.Scratch``). Tensors the fused model does not read
    (the folded norms') are dropped.

    Returns:
        ``(weight_map, total_bytes, sha256)`` of the written shards (``sha256``: shard file name -> hex digest of
        the bytes written).

    Raises:
        InputError: a shard changed or was truncated while it was read (``LazyShards``).
        UnsupportedModelError: a fold overflows the weights' dtype; the program needs a tensor the checkpoint lacks.
    """
    biases = {la.bias for la in program.layers.values() if la.bias is not None}
    beside = {la.bias_out for la in program.layers.values() if la.bias_out is not None}  # written with the weight
    new_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    total = 0
    with closing(Scratch(lanes=fold_lanes())) as scratch:  # its lanes' threads stop on the way out
        for n, shard in enumerate(shard_names):
            progress("folding and writing shards", n, len(shard_names), shard)
            order, specs = reader.header(shard)
            plan: list[tuple[str, torch.dtype, list[int]]] = []
            for key in order:
                recipe = program.tensors.get(key)
                if key in program.layers:
                    la = program.layers[key]
                    plan.append((key, la.dtype, specs[key][1]))
                    if la.bias_out is not None:
                        plan.append(
                            (
                                la.bias_out,
                                la.bias_dtype,
                                list(la.bias_shape or [la.kind.bias_size(specs[key][1], la.groups)]),
                            )
                        )
                elif recipe is not None and recipe.op in ("copy", "unit") and key not in biases:
                    plan.append((key, *specs[key]))
            writer = ShardWriter(folder / shard, plan, metadata)
            try:
                for key, _, shape in plan:
                    new_map[key] = shard
                    if key in program.layers:
                        la = program.layers[key]
                        parts = []
                        tally = RangeTally(la)
                        for w, b in la.blocks(reader, block_elements, scratch, tally):  # w: written before the next
                            writer.write(key, w)
                            parts.append(b)
                        program.ranges[key] = tally.result()
                        if la.bias_out is not None:
                            writer.write(la.bias_out, la.whole_bias(parts))
                    elif (made := program.tensors.get(key)) is not None and made.op == "unit":
                        writer.write(key, torch.ones(shape, dtype=specs[key][0]))  # a norm weight whose affine folded
                    elif key not in beside:  # read into the buffers the stored blocks alternate between
                        for start, stop in row_ranges(shape, block_elements):
                            rows = [stop - start, *shape[1:]] if len(shape) > 1 else shape
                            into = scratch.take(scratch.alternate("stored"), rows, specs[key][0])
                            writer.write(key, reader.get(key, slice(start, stop) if len(shape) > 1 else None, out=into))
            finally:
                writer.close()
            digests[shard] = writer.finish()
            total += sum(math.prod(s) * d.itemsize for _, d, s in plan)
    missing = sorted(set(program.tensors) - set(new_map))
    if missing:
        raise UnsupportedModelError(
            f"the fused model stores {missing[0]!r}, which the checkpoint does not hold ({len(missing)} such); fold "
            "this model in memory without --stream"
        )
    progress("folding and writing shards", len(shard_names), len(shard_names))
    return {k: new_map[k] for k in sorted(new_map)}, total, digests
