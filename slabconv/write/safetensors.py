"""Fused weights as safetensors (the metadata contract is ``slabconv.load.fused``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from slabconv.load.fused import FusedMetadata, fused_metadata

__all__ = ["FusedMetadata", "fused_metadata", "save_safetensors"]


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (contiguous CPU copies, shared storage split) with string ``metadata``."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path), dict(metadata))
