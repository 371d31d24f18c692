"""The input formats slabconv reads, one table (``FORMATS``): how each is recognised, read, and which engine takes it.

Every command that takes a model path asks ``input_format`` (or ``engine_of``) which entry it is; nothing else
looks at suffixes. An entry is tried in table order: ``sniff`` looks at the path only (its suffix, or which files a
folder holds), never at a file's contents, and never runs anything from it; only the message for a file its reader
refuses says what its first bytes are (``safety.content_error``: a ``.pt2`` named ``.onnx``, a tar of a
checkpoint). ``read`` returns a ``Checkpoint`` (``slabconv.load.checkpoint``) through the readers of
``slabconv.load.safety``; ``load_model`` builds it (a zoo model, a program's module or a pickled module, by the
``Checkpoint.format`` the read recorded). An entry whose
``engine`` is ``onnx`` is not read into a checkpoint: ``slabconv.onnx_in`` folds its graph (docs/onnx.md).

A new format is one entry here and its reader, plus a case in ``tests/test_formats.py`` (and a hostile file in
``tests/test_hostile_inputs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slabconv.errors import InputError, UsageError
from slabconv.load import hf, safety
from slabconv.load.checkpoint import Checkpoint, load_pickle, load_program, load_safetensors
from slabconv.load.onnx_file import ONNX_SUFFIX, wrong_kind
from slabconv.load.paths import check_input, not_a_model_folder

Read = Callable[[Path, bool, bool], Checkpoint]
"""``read(path, ema, trust_pickle) -> Checkpoint``."""


@dataclass(frozen=True)
class InputFormat:
    """One input format.

    Attributes:
        name: the format's name (``hf-folder``, ``torch.export``, ``safetensors``, ``pickle``, ``onnx``).
        formats: what the report's ``source.format`` records for a file of this format (a pickle is a training
            checkpoint, a release, a bare state_dict or a pickled module, told apart once read).
        sniff: True for a path of this format, from the path alone (suffix, a folder's files).
        read: the reader (``read(path, ema, trust_pickle) -> Checkpoint``).
        description: one line, for messages and docs.
        engine: ``torch`` (read into a ``Checkpoint``, built by ``load_model``) or ``onnx`` (``slabconv.onnx_in``).
    """

    name: str
    formats: tuple[str, ...]
    sniff: Callable[[Path], bool]
    read: Read
    description: str
    engine: str = "torch"


def _is_onnx(path: Path) -> bool:
    return path.suffix.lower() == ONNX_SUFFIX and not path.is_dir()


def _export_not_checkpoint(path: Path, ema: bool = False, trust_pickle: bool = False) -> Checkpoint:
    """An ``.onnx`` is not read into a checkpoint: it is an export, which ``slabconv.onnx_in`` folds as a graph.

    Raises:
        InputError: the file is another format by its bytes (``onnx_file.wrong_kind``: a ``.pt2`` renamed), named
            with the suffix to give it.
        UsageError: an ONNX file (or one whose bytes tell nothing).
    """
    wrong = wrong_kind(path)
    if wrong is not None:
        raise wrong
    raise UsageError(
        f"{path}: an ONNX file is already an export, not a checkpoint to build a model from; fold it with "
        "slabconv fuse (docs/onnx.md), or give the checkpoint it was exported from"
    )


def _read_hf(path: Path, ema: bool = False, trust_pickle: bool = False) -> Checkpoint:
    folder = hf.read_hf_folder(path)
    return Checkpoint(
        folder.state_dict,
        folder.config,
        folder.format,
        folder.path,
        folder.sha256(),
        {"weights": folder.format},
        metadata=folder.metadata,
    )


def _suffix(suffix: str) -> Callable[[Path], bool]:
    return lambda path: path.suffix == suffix and not path.is_dir()


FORMATS: tuple[InputFormat, ...] = (
    InputFormat(
        "onnx",
        ("onnx",),
        _is_onnx,
        _export_not_checkpoint,
        "an ONNX export (.onnx), folded as a graph through onnx-ir",
        engine="onnx",
    ),
    InputFormat(
        "hf-folder",
        hf.FOLDER_FORMATS,
        hf.is_hf_folder,
        _read_hf,
        "a Hugging Face style folder (config.json + model.safetensors / pytorch_model.bin, sharded or not)",
    ),
    InputFormat(
        "torch.export",
        ("torch.export",),
        _suffix(".pt2"),
        lambda path, ema, trust_pickle: load_program(path, trust_pickle),
        "a torch.export program (.pt2), read without running its code",
    ),
    InputFormat(
        "safetensors",
        ("safetensors",),
        _suffix(".safetensors"),
        lambda path, ema, trust_pickle: load_safetensors(path),
        "a safetensors file (.safetensors)",
    ),
    InputFormat(
        "pickle",
        ("training-checkpoint", "release", "state_dict", "pickled-module"),
        lambda path: path.exists() and not path.is_dir(),  # any other file: read as a pickle, weights-only
        load_pickle,
        "a PyTorch pickle (.pth / .pt / .bin): a training checkpoint, a release, a state_dict or a whole module",
    ),
)
"""Every input format, in the order they are tried (the pickle reader takes any other file)."""


def sniff_format(path: Path | str) -> InputFormat | None:
    """The first entry of ``FORMATS`` whose ``sniff`` takes ``path``, or None."""
    return next((f for f in FORMATS if f.sniff(Path(path))), None)


def engine_of(path: Path | str) -> str:
    """``onnx`` for a path ``slabconv.onnx_in`` folds, else ``torch`` (what ``load_model`` reads)."""
    found = sniff_format(path)
    return found.engine if found is not None else "torch"


def input_format(path: Path | str) -> InputFormat:
    """The format of ``path`` (see ``FORMATS``).

    Raises:
        InputError: no such file, or a folder that is no Hugging Face style folder.
    """
    path = Path(path)
    found = sniff_format(path)
    if found is not None:
        return found
    if path.is_dir():
        raise not_a_model_folder(path)
    raise InputError(f"{path}: no such file")


def load_checkpoint(path: Path | str, ema: bool = False, trust_pickle: bool = False) -> Checkpoint:
    """Read a checkpoint file without executing code (unless ``trust_pickle``), by the reader of its entry in
    ``FORMATS``.

    Args:
        path: a ``.pth``/``.pt`` checkpoint (training layout, release ``{'model': ...}`` or a bare state_dict),
            a ``.safetensors`` file, a ``.pt2`` program saved by ``torch.export.save``, or a Hugging Face folder.
        ema: take the EMA weights (``state_dict_ema`` or ``model_ema``) instead of ``model`` from a training checkpoint.
        trust_pickle: allow a pickle that names globals outside the allowlist, such as a whole ``nn.Module``
            saved with ``torch.save(model)``; this runs code from the file. Tried only after the weights-only
            reader refused the file.

    Raises:
        UsageError: an ``.onnx`` file (an export: ``slabconv.onnx_in`` folds it).
        InputError: missing, empty or corrupt file; a pickle naming a global outside the allowlist (without
            ``trust_pickle``); no state_dict inside; ``--ema`` asked of a file without EMA weights.
    """
    path = check_input(path)
    fmt = input_format(path)
    if not path.is_dir():
        safety.regular_file(path, "the checkpoint")  # a FIFO or device is refused before it is opened
    return fmt.read(path, ema, trust_pickle)
