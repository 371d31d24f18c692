"""Lazy, block-wise reads from a safetensors model folder, for the streamed mode (``fuse --stream``,
``verify --stream``): nothing but the block being folded or compared is ever resident.

``LazyShards`` reads tensors, row ranges and headers through short-lived ``safe_open`` handles;
``return_freed_blocks_to_the_os`` keeps glibc from holding on to the freed blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slabconv.errors import InputError, first_line
from slabconv.load.hf import SAFETENSORS, SAFETENSORS_DTYPES, SAFETENSORS_INDEX, inside, read_index, shard_paths

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
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, _MMAP_THRESHOLD))  # M_MMAP_THRESHOLD = -3 in glibc's malloc.h
    except (OSError, AttributeError):
        return False


class LazyShards:
    """Lazy reads from a sharded safetensors folder, each through its own short-lived ``safe_open`` handle (closing
    a handle unmaps its pages, so nothing read stays resident beyond the tensor returned).

    Args:
        folder: the folder holding the shards.
        weight_map: tensor name -> shard file name (``read_index``).
        block_elements: ``row_blocks`` yields blocks of about this many elements.
    """

    def __init__(self, folder: Path, weight_map: dict[str, str], block_elements: int = 1 << 22):
        self.folder, self.weight_map, self.block_elements = folder, weight_map, block_elements
        self._specs: dict[str, tuple[torch.dtype, list[int]]] = {}  # from each shard's header, read once

    @classmethod
    def open(cls, folder: Path | str, block_elements: int = 1 << 22) -> LazyShards:
        """The reader of a folder with ``model.safetensors.index.json`` + shards (the index read and checked) or
        one ``model.safetensors`` (only its header is read).

        Raises:
            InputError: neither file, a damaged index, a missing shard.
        """
        folder = Path(folder)
        index, single = folder / SAFETENSORS_INDEX, folder / SAFETENSORS
        for item in (index, single):
            if item.is_file():
                inside(folder, item)
        if index.is_file():
            shard_paths(index)
            return cls(folder, read_index(index), block_elements)
        if single.is_file():
            keys, _ = cls(folder, {}, block_elements).header(SAFETENSORS)
            return cls(folder, dict.fromkeys(keys, SAFETENSORS), block_elements)
        raise InputError(f"{folder}: neither {SAFETENSORS_INDEX} nor {SAFETENSORS}; not a safetensors model folder")

    def _open(self, key: str) -> Any:
        from safetensors import safe_open

        if key not in self.weight_map:
            raise InputError(f"{self.folder}: tensor {key!r} is missing (not in the index or the file)")
        path = self.folder / self.weight_map[key]
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ...
            raise InputError(f"{path}: not a readable safetensors file ({err})") from None

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """One whole tensor, or rows ``rows`` of it (reading only their pages); ``slabconv.engine.WeightStore``."""
        with self._open(key) as f:
            return f.get_tensor(key) if rows is None else f.get_slice(key)[rows.start : rows.stop]

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors, read through one handle per shard (``get`` opens one per tensor: a few ms each, which
        adds up over the hundreds of small vectors a deep model holds)."""
        by_shard: dict[str, list[str]] = {}
        for key in keys:
            if key not in self.weight_map:
                raise InputError(f"{self.folder}: tensor {key!r} is missing (not in the index or the file)")
            by_shard.setdefault(self.weight_map[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for shard, names in by_shard.items():
            with self._open(names[0]) as f:
                try:
                    out.update((k, f.get_tensor(k)) for k in names)
                except Exception as err:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ...
                    raise InputError(
                        f"{self.folder / shard}: not a readable safetensors file ({first_line(err)})"
                    ) from None
        return {k: out[k] for k in keys}

    def _spec(self, key: str) -> tuple[torch.dtype, list[int]]:
        """``(dtype, shape)`` of a tensor from its shard's header, read once per shard (a fold asks per block)."""
        spec = self._specs.get(key)
        if spec is None:
            if key not in self.weight_map:
                raise InputError(f"{self.folder}: tensor {key!r} is missing (not in the index or the file)")
            self.header(self.weight_map[key])  # fills the cache
            spec = self._specs.get(key)
            if spec is None:
                raise InputError(f"{self.folder / self.weight_map[key]}: tensor {key!r} is missing from the file")
        return spec

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype, from its shard's header."""
        return self._spec(key)[0]

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor, reading only their pages."""
        with self._open(key) as f:
            return f.get_slice(key)[start:stop]

    def row_blocks(self, key: str, shape: list[int]) -> Iterator[torch.Tensor]:
        """The tensor in blocks of rows (whole when it is small or 0/1-D), each read through its own handle with
        ``get_slice``: only the pages of one block are ever mapped."""
        rows = max(1, self.block_elements // max(1, _numel(shape[1:])))
        if len(shape) < 2 or shape[0] <= rows:
            yield self.get(key)
            return
        for r in range(0, shape[0], rows):
            with self._open(key) as f:
                block = f.get_slice(key)[r : r + rows]
            yield block

    def shape(self, key: str) -> list[int]:
        """The tensor's shape, from its shard's header."""
        return list(self._spec(key)[1])

    def header(self, shard: str) -> tuple[list[str], dict[str, tuple[torch.dtype, list[int]]]]:
        """The keys of a shard in file order and their (dtype, shape), from its header only (no tensor data); they
        also answer ``shape`` and ``dtype`` from then on.

        Raises:
            InputError: not a safetensors file, or a dtype torch has no name for here.
        """
        from safetensors import safe_open

        path = self.folder / shard
        rev = {v: k for k, v in SAFETENSORS_DTYPES.items()}
        try:
            with safe_open(str(path), framework="pt") as f:
                # file order (safetensors' offset_keys); releases before it have only keys(), sorted by name
                order = list(f.offset_keys()) if hasattr(f, "offset_keys") else list(f.keys())
                specs = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in order}
        except Exception as err:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ...
            raise InputError(f"{path}: not a readable safetensors file ({first_line(err)})") from None
        unknown = [k for k, (dtype, _) in specs.items() if dtype not in rev]
        if unknown:
            raise InputError(f"{path}: {unknown[0]!r} has dtype {specs[unknown[0]][0]}, which slabconv does not read")
        typed = {k: (rev[dtype], shape) for k, (dtype, shape) in specs.items()}
        # the fold's per-block shape and dtype questions need no second read; only for the tensors the index puts
        # in this shard (a damaged folder may list a tensor in another shard's header too)
        self._specs.update((k, v) for k, v in typed.items() if self.weight_map.get(k) == shard)
        return order, typed

    def specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """Every tensor's (dtype, shape), from the shard headers (no tensor data is read)."""
        out: dict[str, tuple[torch.dtype, list[int]]] = {}
        for shard in dict.fromkeys(self.weight_map.values()):
            out.update(self.header(shard)[1])
        return {k: out[k] for k in self.weight_map if k in out}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
