"""Write Hugging Face style model folders for tests (config.json + single or sharded safetensors / .bin).

A test helper, not part of slabconv: the layout is what ``transformers``' ``save_pretrained`` writes, so the
loaders are tested against folders of every layout without needing ``transformers`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slabconv.load.hf import BIN_INDEX, CONFIG, SAFETENSORS_INDEX


def write_hf_folder(
    folder: Path | str,
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    weights: str = "safetensors",
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``config.json`` and the weights in a layout ``read_hf_folder`` (and ``transformers``) reads.

    Args:
        folder: created if needed; existing files of the same names are replaced.
        state_dict: name -> tensor (written as contiguous CPU copies in their dtype).
        config: written as ``config.json`` (sorted keys, 2-space indent).
        weights: ``safetensors`` (``model.safetensors``) or ``bin`` (``pytorch_model.bin``, ``torch.save``).
        max_shard_bytes: shard when the tensors exceed this many bytes: ``model-00001-of-0000N.safetensors`` (or
            ``pytorch_model-...bin``) plus the ``*.index.json`` with ``metadata.total_size`` and ``weight_map``.
        metadata: safetensors string metadata (``{"format": "pt"}`` when None, as ``transformers`` writes).

    Returns:
        The files written: ``config.json``, then the index (when sharded), then the weight files.
    """
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    config_path = folder / CONFIG
    config_path.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shards = _split(tensors, max_shard_bytes)
    stem, suffix = ("model", ".safetensors") if weights == "safetensors" else ("pytorch_model", ".bin")
    if len(shards) == 1:
        names = [f"{stem}{suffix}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards, strict=True):
        path = folder / name
        if weights == "safetensors":
            from safetensors.torch import save_file

            save_file(shard, str(path), dict(metadata) if metadata is not None else {"format": "pt"})
        else:
            torch.save(shard, path)
        written.append(path)
    if len(shards) == 1:
        return [config_path, *written]
    index = folder / (SAFETENSORS_INDEX if weights == "safetensors" else BIN_INDEX)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return [config_path, index, *written]


def _split(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a larger tensor gets a shard of its own)."""
    if max_bytes is None:
        return [tensors]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    return shards
