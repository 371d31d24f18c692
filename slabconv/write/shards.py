"""Safetensors files written tensor by tensor (header first, then the bytes in order), for streamed folds."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from slabconv import fold
from slabconv.errors import InputError, UnsupportedModelError
from slabconv.load.hf import SAFETENSORS_DTYPES
from slabconv.load.shards import LazyShards
from slabconv.util import Progress


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


Affine = Callable[[str], tuple[torch.Tensor, torch.Tensor]]
"""``affine(weight_key) -> (scale, shift)``: the float64 affine folded into the Linear whose weight is that key."""


def fold_block(
    block: torch.Tensor, bias: torch.Tensor | None, affine: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward fold of one block of output rows of a Linear (``slabconv.fold.fold_into_linear``: rows are
    independent, so a block folds exactly as the whole weight would).

    Raises:
        UnsupportedModelError: the folded block does not fit the weight's dtype (it overflows).
    """
    scale, shift = affine
    weight, new_bias = fold.fold_into_linear(block, bias, scale, shift)
    if not fold.fits_dtype(weight, new_bias):
        raise UnsupportedModelError(
            f"a folded weight overflows {str(block.dtype).removeprefix('torch.')}; fold this model in memory without "
            "--stream (it keeps such norms as affines)"
        )
    return weight, new_bias


def write_folded_shards(
    folder: Path,
    reader: LazyShards,
    shard_names: list[str],
    keep: Callable[[str], bool],
    folded: Collection[str],
    affine: Affine,
    metadata: dict[str, str],
    progress: Progress,
) -> tuple[dict[str, str], int]:
    """Write the folded model shard by shard, with the input's shard boundaries, holding one block at a time.

    Each output shard holds the kept tensors of the input shard in file order; a Linear the fold reaches
    (``folded``) gets ``W' = W diag(s)`` one block of rows at a time and its bias ``b + W t`` (created right after
    the weight when it had none). Norm tensors and buffers the fused model does not read (``keep`` False) are
    dropped.

    Args:
        folder: where the shards go (a staging folder).
        reader: the input shards.
        shard_names: the input shard files, in order.
        keep: whether a tensor of the input stays in the output.
        folded: the weight keys of the Linears a norm folds into.
        affine: the float64 ``(scale, shift)`` of the norm folded into a weight key.
        metadata: safetensors metadata of every shard.
        progress: called once per shard.

    Returns:
        ``(weight_map, total_bytes)`` of the written shards.

    Raises:
        InputError: a shard's header disagrees with the index.
        UnsupportedModelError: a fold overflows the weights' dtype.
    """
    weight_map = reader.weight_map
    new_map: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(shard_names):
        progress("folding and writing shards", n, len(shard_names), shard)
        order, specs = reader.header(shard)
        if sorted(order) != sorted(k for k, v in weight_map.items() if v == shard):
            raise InputError(f"{reader.folder / shard}: its tensors disagree with the index")
        plan: list[tuple[str, torch.dtype, list[int]]] = []
        created: set[str] = set()
        for key in order:
            if not keep(key):
                continue
            dtype, shape = specs[key]
            plan.append((key, dtype, shape))
            bias_key = key.removesuffix(".weight") + ".bias"
            if key in folded and bias_key not in weight_map:
                plan.append((bias_key, dtype, [shape[0]]))  # created by the fold, beside its weight
                created.add(bias_key)
        writer = ShardWriter(folder / shard, plan, metadata)
        try:
            for key, _, shape in plan:
                new_map[key] = shard
                weight_key = key.removesuffix(".bias") + ".weight"
                if key in created:
                    continue  # written right after its weight
                if key in folded:  # W' = W diag(s), b' = b + W t, one block of output rows at a time
                    bias_key = key.removesuffix(".weight") + ".bias"
                    old = reader.get(bias_key) if bias_key in weight_map else None
                    biases, start = [], 0
                    for block in reader.row_blocks(key, shape):
                        part = None if old is None else old[start : start + len(block)]
                        w, b = fold_block(block, part, affine(key))
                        writer.write(key, w)
                        biases.append(b)
                        start += len(block)
                    if bias_key in created:
                        writer.write(bias_key, torch.cat(biases))
                elif key.endswith(".bias") and weight_key in folded:  # an existing bias: b + W t
                    old, start = reader.get(key), 0
                    for block in reader.row_blocks(weight_key, reader.shape(weight_key)):
                        _, b = fold_block(block, old[start : start + len(block)], affine(weight_key))
                        writer.write(key, b)
                        start += len(block)
                else:
                    for block in reader.row_blocks(key, shape):
                        writer.write(key, block)
        finally:
            writer.file.close()
        writer.finish()
        total += sum(numel(s) * torch.empty((), dtype=d).element_size() for _, d, s in plan)
    progress("folding and writing shards", len(shard_names), len(shard_names))
    return {k: new_map[k] for k in sorted(new_map)}, total
