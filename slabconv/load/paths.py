"""Input paths, checked before anything heavy is imported: whether a path is given, exists, is a model folder.

This module imports neither torch nor numpy: the command line checks its inputs with it before it loads them, so a
mistyped path is answered in a fraction of a second. It also names the files a Hugging Face folder and a folder
``slabconv fuse`` wrote are recognised by (``slabconv.load.hf`` and ``slabconv.load.fused`` read them).
"""

from __future__ import annotations

import re
from pathlib import Path

from slabconv.errors import InputError

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
REPORT = "report.json"
"""The file that makes a folder one ``slabconv fuse`` wrote."""

LAYOUTS = (
    (SAFETENSORS, "hf-safetensors"),
    (SAFETENSORS_INDEX, "hf-safetensors-sharded"),
    (BIN, "hf-bin"),
    (BIN_INDEX, "hf-bin-sharded"),
)
"""A Hugging Face folder's weights: (file looked for, format name), in the order ``transformers`` prefers them."""

MODEL_SUFFIXES = (".pth", ".pt", ".pt2", ".safetensors", ".onnx", ".bin", ".ckpt")
"""File names a model comes in: what a folder's message offers, and what ``fuse --out`` (a folder) refuses."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``owner/name``: how a Hugging Face Hub model id looks (``xinghaochen/SLAB``)."""


def hf_weights_file(folder: Path | str) -> tuple[Path, str] | None:
    """The weights entry file of a folder and its format name (``LAYOUTS``), or None."""
    folder = Path(folder)
    for name, fmt in LAYOUTS:
        if (folder / name).is_file():
            return folder / name, fmt
    return None


def is_hf_folder(path: Path | str) -> bool:
    """True when ``path`` is a folder with ``config.json`` and weights in one of the four layouts, or with sharded
    safetensors alone (``model.safetensors.index.json`` + shards; the architecture then comes from ``--arch``)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return hf_weights_file(path) is not None and ((path / CONFIG).is_file() or (path / SAFETENSORS_INDEX).is_file())


def is_output_folder(path: Path) -> bool:
    """True for a folder ``fuse`` wrote (it holds slabconv's ``report.json``)."""
    return path.is_dir() and (path / REPORT).is_file()


_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")
"""A shard's name as ``save_pretrained`` writes it: ``model-00001-of-00004.safetensors``."""


def not_a_model_folder(path: Path) -> InputError:
    """The error for a folder that is neither a Hugging Face style folder nor one ``fuse`` wrote: shards without
    the index that maps each tensor to its shard are named as such (one shard is a part of the model, never a
    checkpoint to give instead); otherwise the model files inside it are offered."""
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    shards = [name for name in files if _SHARD.fullmatch(name)]
    if shards:
        index = SAFETENSORS_INDEX if shards[0].endswith(".safetensors") else BIN_INDEX
        return InputError(
            f"{path}: holds {len(shards)} weight shards ({shards[0]}, ...) but not {index}, the index that says "
            "which shard holds each tensor; copy the folder again with its index"
        )
    inside = [name for name in files if Path(name).suffix in MODEL_SUFFIXES][:3]
    example = f" ({', '.join(str(path / name) for name in inside)})" if inside else ""
    return InputError(
        f"{path}: is a folder without config.json and weights; give the checkpoint file inside it{example}, or "
        "a Hugging Face style folder (config.json + model.safetensors / pytorch_model.bin, sharded or not)"
    )


def check_input(path: Path | str, folders: bool = True) -> Path:
    """Cheap checks of an input path, before anything is read or any output checked: it is given, it exists (a
    Hub id gets the download line), it is not an empty file, and not a numpy ``.npz`` (the verification inputs).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        InputError: an empty path, a missing file, an empty file or an ``.npz`` archive, naming what to give instead.
    """
    if str(path).strip() == "":
        raise InputError("the checkpoint path is empty; give a checkpoint file or folder, e.g. checkpoint.pth")
    path = Path(path)
    if not path.exists():
        if _HUB_ID.fullmatch(str(path)) and not path.suffix:
            raise InputError(
                f"{path}: no such file; it looks like a Hugging Face Hub id, and slabconv reads local files only: "
                f"download it first (hf download {path} --local-dir {path.name}) and give the folder"
            )
        raise InputError(f"{path}: no such file")
    if folders and path.is_dir() and not (is_hf_folder(path) or is_output_folder(path)):
        raise not_a_model_folder(path)
    if path.is_file() and path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty (an interrupted download or save?); use a complete checkpoint")
    if path.is_file() and is_npz(path):
        raise InputError(
            f"{path}: is a numpy .npz archive (verification inputs), not a checkpoint; give it with --inputs and the "
            "checkpoint as the first argument"
        )
    return path


def is_npz(path: Path) -> bool:
    """A zip archive whose first member is a ``.npy`` array (what ``numpy.savez`` writes; a torch archive starts
    with ``<name>/data.pkl`` or ``<name>/version``). Only the first local header is read: parsing the whole
    directory of a hostile archive of 100,000 entries would take seconds."""
    if path.suffix == ".npz":
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(30 + 4096)
    except OSError:
        return False
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return False
    length = int.from_bytes(head[26:28], "little")
    return head[30 : 30 + length].endswith(b".npy")
