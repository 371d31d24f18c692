"""Fused weights as safetensors (the metadata contract is ``slabconv.load.fused``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from slabconv.load.fused import FusedMetadata, fused_metadata

__all__ = ["FusedMetadata", "fused_metadata", "save_safetensors"]


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> str:
    """Write ``tensors`` with string ``metadata`` as one safetensors file, byte for byte the same for the same
    tensors and metadata: the tensors in name order, the metadata in key order (``ShardWriter``, the streamed
    writer; ``safetensors.torch.save_file`` orders the metadata as a Rust ``HashMap`` iterates, differently from run
    to run, so the same fold gave another sha256 each time).

    Returns:
        The hex sha256 of the file's bytes.

    Raises:
        OSError: the write failed (a full disk, ...); the partial file is the caller's to remove.
    """
    from slabconv.write.shards import ShardWriter

    items = sorted(tensors.items())
    writer = ShardWriter(path, [(k, v.dtype, list(v.shape)) for k, v in items], dict(metadata))
    try:
        for key, value in items:
            writer.write(key, value.detach().cpu().contiguous())
    finally:
        writer.close()
    return writer.finish()
