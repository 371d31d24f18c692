"""Safetensors files written tensor by tensor (header first, then the bytes in order), for streamed folds."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from slabconv.load.hf import SAFETENSORS_DTYPES


class ShardWriter:
    """Write one safetensors file tensor by tensor: the header (all names, dtypes, shapes) first, then the bytes in
    the same order; nothing but the tensor being written is held."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self.expected: list[tuple[str, torch.dtype, list[int], int]] = []
        for name, dtype, shape in specs:
            nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }
            self.expected.append((name, dtype, shape, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.index, self.done = 0, 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``, the whole entry ``name`` or its next block of rows (blocks in order)."""
        want, dtype, shape, nbytes = self.expected[self.index]
        if name != want or tensor.dtype != dtype or list(tensor.shape[1:]) != shape[1:]:
            raise RuntimeError(f"shard writer: got {name} {tensor.dtype} {list(tensor.shape)}, expected {want} {shape}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))  # type: ignore[arg-type]  # a contiguous ndarray is a buffer
        self.done += data.nbytes
        if self.done > nbytes:
            raise RuntimeError(f"shard writer: {name} got more bytes than its shape {shape} holds")
        if self.done == nbytes:
            self.index, self.done = self.index + 1, 0

    def finish(self) -> None:
        self.file.close()
        if self.index != len(self.expected):
            raise RuntimeError(f"shard writer: wrote {self.index} of {len(self.expected)} tensors")


def numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
