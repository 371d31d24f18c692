"""Hugging Face model folders: read the weights and ``config.json`` as data.

A folder holds ``config.json`` and the weights in one of four layouts (what ``transformers``' ``save_pretrained``
writes), looked for in this order:

1. ``model.safetensors``
2. ``model.safetensors.index.json`` + the shards its ``weight_map`` names
3. ``pytorch_model.bin`` (a pickled state_dict)
4. ``pytorch_model.bin.index.json`` + the shards its ``weight_map`` names

Nothing in the folder is executed: ``config.json`` is parsed as JSON (its ``auto_map`` pointing at
``modeling_*.py`` is ignored, never imported), safetensors files are read with ``safetensors``, and ``.bin`` files
with ``torch.load(weights_only=True)``. ``transformers`` is not imported. Index files are followed only to
plain file names inside the folder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slabconv.errors import InputError
from slabconv.load import safety
from slabconv.load.paths import (  # noqa: F401 (what a Hugging Face folder is: part of this module's face)
    BIN,
    BIN_INDEX,
    CONFIG,
    LAYOUTS,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    hf_weights_file,
    is_hf_folder,
)
from slabconv.load.safetensors_file import read_safetensors
from slabconv.util import files_sha256

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

FOLDER_FORMATS = tuple(fmt for _, fmt in LAYOUTS)
"""What the report records as the format of a folder, one per layout."""


@dataclass
class HFFolder:
    """What a Hugging Face folder holds.

    Attributes:
        state_dict: parameter and buffer name -> tensor, in the stored dtype (keys as saved, e.g.
            ``model.layers.0.self_attn.q_proj.weight``).
        config: ``config.json`` as a plain dict.
        format: ``hf-safetensors``, ``hf-safetensors-sharded``, ``hf-bin`` or ``hf-bin-sharded``.
        path: the folder.
        files: the files read, in order: ``config.json``, the index (when sharded), the weight files.
        metadata: safetensors string metadata of the (first) weight file; empty for ``.bin``.
    """

    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]
    format: str
    path: Path
    files: list[Path] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    digests: dict[Path, str] = field(default_factory=dict)

    def sha256(self) -> str:
        """One digest of the folder's contents: sha256 over ``<name> <sha256 of file>`` lines of ``files``, each
        file's sha256 taken from the bytes that were read from it (``digests``; a file not read here is hashed).
        The same digest as ``folder_sha256``, which a streamed fold records."""
        return files_sha256(self.files, self.digests)


def folder_sha256(folder: Path) -> str:
    """The report's ``source.sha256`` of a model folder, in memory (``HFFolder.sha256``) and ``--stream`` alike:
    sha256 over ``<name> <sha256 of file>`` lines of ``config.json`` (where the folder has one), the index (sharded)
    and the weight files in the index's first-mention order (``util.files_sha256``). Reads every weight file once.

    Raises:
        InputError: no weights in the folder; an index naming a missing shard (``shard_paths``).
    """
    found = hf_weights_file(folder)
    if found is None:
        raise InputError(f"{folder}: no weights found; expected one of {', '.join(name for name, _ in LAYOUTS)}")
    entry, fmt = found
    files = [folder / CONFIG] if (folder / CONFIG).is_file() else []
    return files_sha256([*files, entry, *shard_paths(entry)] if fmt.endswith("-sharded") else [*files, entry])


def hub_blobs(folder: Path) -> Path | None:
    """The ``blobs`` folder of the Hugging Face hub cache entry ``folder`` is a snapshot of, or None.

    huggingface_hub's cache (``hf download``, ``snapshot_download``, ``from_pretrained`` of a hub id) keeps a
    model as ``models--ORG--NAME/snapshots/REVISION/FILE``, each ``FILE`` a symbolic link to
    ``../../blobs/HASH`` (https://huggingface.co/docs/huggingface_hub/guides/manage-cache). The blobs are that
    repository's own files: a link of a snapshot into them is the folder's file, not one outside it. Only a real
    folder counts (``blobs`` itself a link would let the snapshot reach anywhere).
    """
    snapshot = folder.resolve()
    repo = snapshot.parent.parent
    blobs = repo / "blobs"
    if snapshot.parent.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    return blobs if blobs.is_dir() and not blobs.is_symlink() else None


def resolves_inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` (after every link) is in ``folder``, or in the ``blobs`` of the hub cache entry ``folder``
    is a snapshot of (``hub_blobs``)."""
    real = path.resolve()
    if real.is_relative_to(folder.resolve()):
        return True
    blobs = hub_blobs(folder)
    return blobs is not None and real.is_relative_to(blobs)


def inside(folder: Path, path: Path) -> Path:
    """``path`` after checking that it resolves inside ``folder`` (a symlink that leaves the folder is refused
    like an index entry that names a path: the folder's files are the only ones slabconv reads). A snapshot of the
    Hugging Face hub cache links each file to its repository's ``blobs``: those links stay inside (``hub_blobs``).

    Raises:
        InputError: naming the file and where it points.
    """
    if not resolves_inside(folder, path):
        real = path.resolve()
        raise InputError(f"{path}: a link to {real}, outside the folder {folder}; refused (copy the file in instead)")
    return path


def read_hf_config(folder: Path | str, digests: dict[Path, str] | None = None) -> dict[str, Any]:
    """``config.json`` of a folder as a dict (its sha256, of the bytes parsed, put in ``digests`` when given).

    Raises:
        InputError: missing, not a regular file, over the JSON size or depth limits (``safety.read_json``),
            unreadable, or not a JSON object.
    """
    path = Path(folder) / CONFIG
    if path.is_file():
        inside(Path(folder), path)
    if not path.is_file():
        raise InputError(f"{folder}: no {CONFIG} in this folder; a Hugging Face model folder needs one")
    config = safety.read_json(path, digests=digests)
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def read_hf_folder(folder: Path | str) -> HFFolder:
    """Read a Hugging Face model folder's weights and ``config.json`` without running any of its code.

    Args:
        folder: the folder (``config.json`` plus ``model.safetensors``, a sharded ``model.safetensors.index.json``,
            ``pytorch_model.bin`` or a sharded ``pytorch_model.bin.index.json``).

    Returns:
        An ``HFFolder`` with the merged state_dict (shards in index order), the config and the files read.

    Raises:
        InputError: not a folder, no ``config.json``, no weights, a damaged file, an index naming a missing shard
            or a path outside the folder, shards that disagree with their index, a key in two shards, or a ``.bin``
            that ``torch.load(weights_only=True)`` refuses.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder")
    digests: dict[Path, str] = {}
    sharded_alone = (folder / SAFETENSORS_INDEX).is_file() and not (folder / CONFIG).is_file()
    config = {} if sharded_alone else read_hf_config(folder, digests)
    found = hf_weights_file(folder)
    if found is None:
        names = ", ".join(name for name, _ in LAYOUTS)
        raise InputError(f"{folder}: no weights found; expected one of {names}")
    entry, fmt = found
    inside(folder, entry)
    files = [] if sharded_alone else [folder / CONFIG]
    weight_map: dict[str, str] = {}
    if fmt.endswith("-sharded"):
        weight_map = read_index(entry, digests)  # read once: the shards and the check below use this map
        shards = shard_paths(entry, weight_map)
        files += [entry, *shards]
    else:
        shards = [entry]
        files.append(entry)
    state: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for i, shard in enumerate(shards):
        if shard.suffix == ".safetensors":
            part, meta, digests[shard] = read_safetensors(shard, "a weights file")
        else:
            (part, digests[shard]), meta = _read_bin(shard), {}
        if i == 0:
            metadata = meta
        if weight_map:  # a tensor in two shards is in one the index does not put it in
            check_shard_against_index(entry, shard, part, weight_map)
        state.update(part)
    if not state:
        raise InputError(f"{entry}: holds no tensors")
    check_config_fits(config, {k: list(v.shape) for k, v in state.items()}, folder)
    return HFFolder(state, config, fmt, folder, files, metadata, digests)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_config_fits(config: Mapping[str, Any], shapes: Mapping[str, list[int]], folder: Path) -> None:
    """Refuse, when the folder is read, a decoder's ``config.json`` whose sizes are not the weights': the layer
    count (``model.layers.N``), ``hidden_size`` and ``vocab_size`` (``model.embed_tokens.weight`` ``(V, C)``),
    ``intermediate_size`` (``model.layers.0.mlp.gate_proj.weight`` ``(I, C)``). The fused folder's ``config.json``
    must state them (transformers builds from it), so a mismatch would otherwise stop the run after the fold.

    Raises:
        InputError: ``FOLDER/config.json: config KEY = X but the weights have N; the config does not fit the
            weights: fix config.json``.
    """
    layers = {m.group(1) for k in shapes if (m := _LAYER.match(k))}
    embed, gate = shapes.get("model.embed_tokens.weight"), shapes.get("model.layers.0.mlp.gate_proj.weight")
    found = {
        "num_hidden_layers": len(layers) if layers else None,
        "vocab_size": embed[0] if embed and len(embed) == 2 else None,
        "hidden_size": embed[1] if embed and len(embed) == 2 else None,
        "intermediate_size": gate[0] if gate and len(gate) == 2 else None,
    }
    for key, actual in found.items():
        value = config.get(key)
        if actual is None or value is None or (type(value) is int and value == actual):
            continue
        raise InputError(
            f"{folder / CONFIG}: config {key} = {str(value)[:40]} but the weights have {actual}; the config does not "
            "fit the weights: fix config.json"
        )


def read_index(index: Path, digests: dict[Path, str] | None = None) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a ``*.index.json``; shard names must be plain file
    names inside the folder. The sha256 of the bytes parsed goes into ``digests`` when given.

    Raises:
        InputError: unreadable JSON, no weight_map, or a shard name that is a path.
    """
    data = safety.read_json(index, digests=digests)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index}: no 'weight_map' (parameter name -> shard file); the index is damaged")
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            parts = Path(name).parts if isinstance(name, str) else ()
            if len(parts) > 1 and not Path(name).is_absolute() and ".." not in parts:  # transformers reads these
                raise InputError(
                    f"{index}: shard {name!r} for {key!r} is in a subfolder; slabconv reads shards beside their index, "
                    "as save_pretrained writes them: move them there and name them by file name in the weight_map"
                )
            raise InputError(f"{index}: shard {name!r} for {key!r} is not a file name inside the folder; refused")
    return weight_map


def shard_paths(index: Path, weight_map: dict[str, str] | None = None) -> list[Path]:
    """The shard files an index names (``weight_map``, read from ``index`` when not given), in first-mention order;
    each must exist beside the index."""
    names = list(dict.fromkeys((weight_map if weight_map is not None else read_index(index)).values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise InputError(f"{index}: shard {missing[0]} is missing from the folder ({len(missing)} of {len(names)})")
    return [inside(index.parent, index.parent / n) for n in names]


def check_shard_against_index(index: Path, shard: Path, keys: Iterable[str], weight_map: Mapping[str, str]) -> None:
    """Hold one shard's tensor names to the index: each tensor the shard holds is one the index puts in that shard,
    and each tensor the index puts there is in it. In memory and ``--stream`` alike, so a folder is one model to
    slabconv whichever way it is read, and the one transformers loads (which reads each tensor where the index says).

    Args:
        index: the ``*.index.json`` file (named in the error).
        shard: the shard file (its name is what the index's ``weight_map`` values say).
        keys: the tensor names the shard holds (its state_dict's keys or its safetensors header's).
        weight_map: the index's tensor name -> shard file name.

    Raises:
        InputError: ``SHARD: holds KEY, which the index puts in NAME; the folder is damaged`` (or ``does not
            list``), or ``INDEX: KEY is in the index but not in shard NAME``.
    """
    held = list(keys)
    present = set(held)
    stray = next((k for k in held if weight_map.get(k) != shard.name), None)
    if stray is not None:
        where = f"puts in {weight_map[stray]}" if stray in weight_map else "does not list"
        raise InputError(f"{shard}: holds {stray!r}, which the index {where}; the folder is damaged")
    absent = next((k for k, v in weight_map.items() if v == shard.name and k not in present), None)
    if absent is not None:
        raise InputError(f"{index}: {absent!r} is in the index but not in shard {shard.name}")


def _read_bin(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """A ``pytorch_model.bin`` state_dict read as a ``.pth`` is (``checkpoint.torch_load``, never trusting its
    pickle): the same allowlist, archive checks, size checks and refusals; with the sha256 of the same open file."""
    from slabconv.load.checkpoint import is_state_dict, torch_load

    with safety.open_regular(path, "a weights file") as f:
        digest = safety.sha256_open(f)
        obj = torch_load(f, str(path))
    if not (is_state_dict(obj) or (isinstance(obj, Mapping) and not obj)):
        raise InputError(f"{path}: expected a state_dict (name -> tensor), found {type(obj).__name__}")
    return dict(obj), digest
