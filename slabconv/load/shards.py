"""Lazy, block-wise reads from a safetensors model folder, for the streamed mode (``fuse --stream``,
``verify --stream``): nothing but the block being folded or compared is ever resident.

``LazyShards`` reads tensors, row ranges and headers with short-lived open files (``read``, never a memory map: a
shard truncated under it is one line, not a SIGBUS); ``return_freed_blocks_to_the_os`` keeps glibc from holding on to
the freed blocks.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from slabconv.errors import InputError, UsageError
from slabconv.load import safety
from slabconv.load.hf import (
    SAFETENSORS,
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    check_shard_against_index,
    hf_weights_file,
    inside,
    read_index,
    shard_paths,
)
from slabconv.load.safetensors_file import read_header
from slabconv.util import libc, row_ranges

_MMAP_THRESHOLD = 1 << 20


def return_freed_blocks_to_the_os() -> bool:
    """Make glibc serve every allocation of 1 MiB or more with its own ``mmap`` (``mallopt(M_MMAP_THRESHOLD)``),
    so that a freed weight block goes back to the OS at once.

    Streaming allocates and frees blocks of several MiB thousands of times. glibc's default threshold adapts
    upwards after such frees and then keeps freed blocks in its heaps: on a 7B-shaped fold the peak RSS of identical
    runs then differs by up to twice; with the fixed threshold it stays within a few MiB
    (``benchmarks/memory_streaming.py --shape 7b`` measures it).
    Process-wide and harmless for other work (large allocations only). Returns False where it does not apply
    (not glibc).
    """
    mallopt = getattr(libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(-3, _MMAP_THRESHOLD))  # M_MMAP_THRESHOLD = -3 in glibc's malloc.h


@dataclass
class _Layout:
    """One shard's header: its tensors in file order, each one's ``(dtype, shape)`` and the byte offset of its data
    in the file, and the identity the file had when the header was read (``os.stat``: device, inode, size and
    modification time), which every later read checks."""

    order: list[str]
    specs: dict[str, tuple[torch.dtype, list[int]]]
    offsets: dict[str, int]
    identity: tuple[int, int, int, int]


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class LazyShards:
    """Lazy reads from a sharded safetensors folder: each read opens the shard, reads the bytes of the tensor (or of
    its rows) into the tensor's own memory and closes it, so nothing read stays resident beyond the tensor returned.

    The shards are read with ``read`` calls, not mapped: a shard truncated while it is read (a copy still running, a
    full disk) is a short read, named in one line, where a mapped page past the end would be a SIGBUS that ends the
    process. Each read also checks that the shard is the file whose header was read (``_Layout.identity``).

    Args:
        folder: the folder holding the shards.
        weight_map: tensor name -> shard file name (``read_index``).
        block_elements: ``row_blocks`` yields blocks of about this many elements.
    """

    def __init__(self, folder: Path, weight_map: dict[str, str], block_elements: int = 1 << 22):
        self.folder, self.weight_map, self.block_elements = folder, weight_map, block_elements
        self._specs: dict[str, tuple[torch.dtype, list[int]]] = {}  # from each shard's header, read once
        self._layouts: dict[str, _Layout] = {}
        self._reused = torch.empty(0, dtype=torch.uint8)  # ``row_blocks(reuse=True)``'s one buffer
        self._ahead: _ReadAhead | None = None  # ``read_ahead()``

    @classmethod
    def open(cls, folder: Path | str, block_elements: int = 1 << 22) -> LazyShards:
        """The reader of a folder with one ``model.safetensors`` (only its header is read) or
        ``model.safetensors.index.json`` + shards (the index read and checked). A folder with both is read from
        ``model.safetensors``, as transformers' ``from_pretrained`` and ``read_hf_folder`` read it
        (``paths.LAYOUTS``): the streamed and the in-memory fold of a folder fold the same weights.

        Raises:
            InputError: a damaged index, a missing shard.
            UsageError: neither file (``.bin`` weights, or none).
        """
        folder = Path(folder)
        index, single = folder / SAFETENSORS_INDEX, folder / SAFETENSORS
        for item in (index, single):
            if item.is_file():
                inside(folder, item)
        if single.is_file():
            keys, _ = cls(folder, {}, block_elements).header(SAFETENSORS)
            return cls(folder, dict.fromkeys(keys, SAFETENSORS), block_elements)
        if index.is_file():
            shard_paths(index)
            return cls(folder, read_index(index), block_elements)
        found = hf_weights_file(folder)
        raise UsageError(
            f"{folder}: --stream reads safetensors ({SAFETENSORS}, or {SAFETENSORS_INDEX} + shards), found "
            f"{found[0].name if found else 'no weights'}; run it in memory without --stream"
        )

    def _shard(self, key: str) -> str:
        if key not in self.weight_map:
            raise InputError(f"{self.folder}: tensor {key!r} is missing (not in the index or the file)")
        return self.weight_map[key]

    @contextlib.contextmanager
    def _open(self, shard: str) -> Iterator[tuple[IO[bytes], _Layout]]:
        """The shard open for reading, and its layout; the open file must be the one whose header was read."""
        layout = self._layout(shard)
        path = self.folder / shard
        with safety.open_regular(path, "a safetensors shard") as f:
            if _identity(os.fstat(f.fileno())) != layout.identity:
                raise _changed(path)
            yield f, layout

    def _read(
        self,
        f: IO[bytes],
        layout: _Layout,
        key: str,
        rows: slice | None,
        path: Path,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tensor ``key`` (or rows ``rows`` of it, as ``tensor[rows]``) read from the open shard ``f``: into memory
        of its own, or into ``out`` (``get``)."""
        if key not in layout.specs:
            raise InputError(f"{path}: tensor {key!r} is missing from the file")
        dtype, shape = layout.specs[key]
        row = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        count = shape[0] if shape else 1
        start, stop, _ = (rows or slice(None)).indices(count)
        stop = max(start, stop)
        out_shape = ([stop - start, *shape[1:]] if rows is not None else shape) if shape else []
        if out is not None:
            if (
                out.dtype != dtype
                or list(out.shape) != out_shape
                or not out.is_contiguous()
                or out.device.type != "cpu"
            ):
                raise ValueError(
                    f"read {key!r}: out is {out.dtype} {list(out.shape)}, the rows are {dtype} {out_shape}"
                )
            flat = out.reshape(-1).view(torch.uint8)
        else:
            flat = torch.empty((stop - start) * row, dtype=torch.uint8)
        buffer = flat.numpy().data  # the tensor's own memory
        f.seek(layout.offsets[key] + start * row)
        done = 0
        while done < len(buffer):
            got = f.readinto(buffer[done:])  # type: ignore[attr-defined]
            if not got:
                raise _changed(path, f"it ends inside tensor {key!r}")
            done += got
        tensor = flat.view(dtype)
        if sys.byteorder == "big" and dtype.itemsize > 1:  # pragma: no cover - safetensors is little-endian
            tensor = torch.from_numpy(tensor.numpy().byteswap())
        return tensor.reshape(out_shape)

    def get(self, key: str, rows: slice | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """One whole tensor, or rows ``rows`` of it (reading only their bytes); ``slabconv.engine.WeightStore``.

        ``out``: a contiguous CPU tensor of the tensor's dtype and the rows' shape to
        read into (returned; a streamed fold's reused buffers, which, unlike the reader's one, several threads and
        the writer's pending blocks can each have their own of).

        Raises:
            InputError: the tensor is missing, the shard changed or ends early.
            ValueError: ``out`` has another dtype or shape than the rows.
        """
        shard = self._shard(key)
        with self._open(shard) as (f, layout):
            return self._read(f, layout, key, rows, self.folder / shard, out)

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors, read through one open file per shard (``get`` opens one per tensor, which adds up over
        the hundreds of small vectors a deep model holds)."""
        by_shard: dict[str, list[str]] = {}
        for key in keys:
            by_shard.setdefault(self._shard(key), []).append(key)
        out: dict[str, torch.Tensor] = {}
        for shard, names in by_shard.items():
            with self._open(shard) as (f, layout):
                out.update((k, self._read(f, layout, k, None, self.folder / shard)) for k in names)
        return {k: out[k] for k in keys}

    def _spec(self, key: str) -> tuple[torch.dtype, list[int]]:
        """``(dtype, shape)`` of a tensor from its shard's header, read once per shard (a fold asks per block)."""
        spec = self._specs.get(key)
        if spec is None:
            shard = self._shard(key)
            self.header(shard)  # fills the cache
            spec = self._specs.get(key)
            if spec is None:
                raise InputError(f"{self.folder / shard}: tensor {key!r} is missing from the file")
        return spec

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype, from its shard's header."""
        return self._spec(key)[0]

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor, reading only their bytes."""
        return self.get(key, slice(start, stop))

    def row_blocks(self, key: str, shape: list[int], reuse: bool = False) -> Iterator[torch.Tensor]:
        """The tensor in blocks of rows (whole when it is small or 0/1-D), each read on its own: only one block is
        ever in memory.

        ``reuse``: every block is read into the same buffer of this reader, so a block is valid only until the
        next ``reuse`` read (the caller uses each block before asking for the next, from one thread). A generation
        reads every weight once per token: into fresh memory, each block is a new ``mmap`` whose pages the kernel
        faults in and zeroes before the read fills them (``return_freed_blocks_to_the_os``), which took longer than
        the reads and the products together (``docs/performance.md``, "Checks of a streamed fold")."""
        ranges = list(row_ranges(shape, self.block_elements))
        for start, stop in ranges:
            rows = slice(start, stop) if len(ranges) > 1 else None  # None: the whole tensor
            block = [stop - start, *shape[1:]] if rows is not None else list(shape)
            yield self._reused_read(key, rows, block) if reuse else self.get(key, rows)

    def read_ahead(self) -> None:
        """From now on, ``row_blocks(reuse=True)`` reads the block it will be asked for next in a thread of its own
        while the caller computes on the last one (``_ReadAhead``), for a caller that asks for the same blocks in the
        same order again and again (a generation: every weight, once per token). Its blocks then live in two buffers
        in turn, each valid until the next ``reuse`` read, as without it. ``close`` ends it."""
        if self._ahead is None:
            self._ahead = _ReadAhead(self)

    def close(self) -> None:
        """End ``read_ahead`` (waits for the read in flight; its error, if any, is dropped: nobody asked for it)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def _reused_read(self, key: str, rows: slice | None, shape: list[int]) -> torch.Tensor:
        if self._ahead is not None:
            return self._ahead.block(key, rows, shape)
        return self.get(key, rows, out=self._reused_block(key, shape))

    def _reused_block(self, key: str, shape: list[int]) -> torch.Tensor:
        """A tensor of ``shape`` and ``key``'s dtype in the reader's one buffer (``row_blocks(reuse=True)``), grown
        as needed."""
        self._reused, block = _in_buffer(self._reused, self.dtype(key), shape)
        return block

    def shape(self, key: str) -> list[int]:
        """The tensor's shape, from its shard's header."""
        return list(self._spec(key)[1])

    def _layout(self, shard: str) -> _Layout:
        layout = self._layouts.get(shard)
        if layout is None:
            self.header(shard)
            layout = self._layouts[shard]
        return layout

    def header(self, shard: str) -> tuple[list[str], dict[str, tuple[torch.dtype, list[int]]]]:
        """The keys of a shard in file order and their (dtype, shape), from its header only (no tensor data); they
        also answer ``shape`` and ``dtype`` from then on (``safetensors_file.read_header``: checked as a whole
        safetensors file is).

        Raises:
            InputError: not a readable safetensors file, or a dtype the streamed mode does not read.
        """
        path = self.folder / shard
        with safety.open_regular(path, "a safetensors shard") as f:
            identity = _identity(os.fstat(f.fileno()))
            _, entries, data_start = read_header(f, str(path))
        unknown = [(name, dtype) for name, dtype, *_ in entries if dtype not in SAFETENSORS_DTYPES]
        if unknown:
            raise InputError(f"{path}: {unknown[0][0]!r} has dtype {unknown[0][1]}, which slabconv does not read")
        order = [name for name, *_ in entries]
        typed = {name: (dtype, list(shape)) for name, dtype, shape, _, _ in entries}
        offsets = {name: data_start + begin for name, _, _, begin, _ in entries}
        self._layouts[shard] = _Layout(order, typed, offsets, identity)
        # the fold's per-block shape and dtype questions need no second read; only for the tensors the index puts
        # in this shard (a damaged folder may list a tensor in another shard's header too)
        self._specs.update((k, v) for k, v in typed.items() if self.weight_map.get(k) == shard)
        return order, typed

    def specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """Every tensor's (dtype, shape), from the shard headers (no tensor data is read), each held to the index.

        Raises:
            InputError: a shard holds a tensor the index puts elsewhere (or nowhere), or lacks one it puts there.
        """
        out: dict[str, tuple[torch.dtype, list[int]]] = {}
        for shard in dict.fromkeys(self.weight_map.values()):
            typed = self.header(shard)[1]
            check_shard_against_index(self.folder / SAFETENSORS_INDEX, self.folder / shard, typed, self.weight_map)
            out.update(typed)
        return {k: out[k] for k in self.weight_map if k in out}


def _in_buffer(buffer: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, block)``: a uint8 ``buffer`` grown to hold ``shape`` of ``dtype`` where it is too small, and the
    block of that shape and dtype at its start (a view: valid until the buffer is written again)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer, buffer[:nbytes].view(dtype).view(shape)


_Request = tuple[str, int | None, int | None]  # a block: the tensor, and its rows (None, None: whole)


class _ReadAhead:
    """``LazyShards.read_ahead``: the next block read in a worker thread while the caller computes on the last.

    The order of the blocks is learned, not told: the requests are recorded until one repeats the first recorded,
    and from then on the block after the one just served is read ahead into the other of two buffers (a generation
    asks for every weight block in the same order at every token, so its first token teaches the cycle). A request
    that is not the expected one is read at once, and the order is learned again from it. The read in flight is
    always waited for before its buffer is used again, and its error (a shard changed) is raised to the caller that
    asks for its block, as a direct read would raise it.
    """

    def __init__(self, shards: LazyShards):
        from concurrent.futures import ThreadPoolExecutor

        self.shards = shards
        self.order: list[_Request] = []
        self.learning, self.next = True, 0  # the cycle is known once learning is False; next: its next position
        self.buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.served = 0  # the buffer of the block the caller holds
        self.pending: tuple[_Request, Any] | None = None  # (request, Future) read into buffers[1 - served]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="slabconv-read-ahead")

    def _into(self, index: int, key: str, shape: list[int]) -> torch.Tensor:
        self.buffers[index], block = _in_buffer(self.buffers[index], self.shards.dtype(key), shape)
        return block

    def _read(self, index: int, request: _Request, shape: list[int]) -> torch.Tensor:
        key, start, stop = request
        rows = None if start is None else slice(start, stop)
        return self.shards.get(key, rows, out=self._into(index, key, shape))

    def _drain(self) -> None:
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending[1].result()
            self.pending = None

    def block(self, key: str, rows: slice | None, shape: list[int]) -> torch.Tensor:
        """The block ``rows`` of ``key`` (``shape``), read ahead when it was the one expected."""
        request: _Request = (key, None, None) if rows is None else (key, rows.start, rows.stop)
        other = 1 - self.served
        if self.pending is not None and self.pending[0] == request:
            future, self.pending = self.pending[1], None
            tensor = future.result()
        else:
            self._drain()
            tensor = self._read(other, request, shape)
        self.served = other
        self._learn(request)
        if not self.learning:
            ahead = self.order[self.next]
            full = self.shards.shape(ahead[0])
            start, stop = ahead[1], ahead[2]
            shape = full if start is None or stop is None else [min(stop, full[0]) - start, *full[1:]]
            self.pending = (ahead, self.pool.submit(self._read, 1 - self.served, ahead, shape))
        return tensor

    def _learn(self, request: _Request) -> None:
        """Record ``request`` while the cycle is being learned; once known, advance ``next`` past it, or learn the
        order again from it when it is not the one expected."""
        if self.learning:
            if self.order and request == self.order[0]:
                self.learning, self.next = False, 1 % len(self.order)
            else:
                self.order.append(request)
        elif request == self.order[self.next]:
            self.next = (self.next + 1) % len(self.order)
        else:
            self.learning, self.order = True, [request]

    def close(self) -> None:
        self._drain()
        self.pool.shutdown(wait=True)


def _changed(path: Path, detail: str = "it is not the file whose header was read") -> InputError:
    return InputError(
        f"{path}: the file changed while slabconv read it ({detail}); nothing was written: rerun once nothing is "
        "writing it"
    )
