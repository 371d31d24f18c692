"""Checkpoint formats in; safetensors and ONNX out, atomically.

Loading never executes code unless asked: ``torch.load(weights_only=True)``, with a named allowlist that
reads the official SLAB training config (a yacs ``CfgNode``) as plain data. Checkpoint hygiene follows the
official training layout (github xinghaochen/SLAB ``classification/utils.py`` ``save_checkpoint``):
``{'model', 'optimizer', 'lr_scheduler', 'max_accuracy', 'epoch', 'config'}``, plus ``state_dict_ema`` in EMA
runs; ``module.`` (DataParallel) and ``_orig_mod.`` (torch.compile) prefixes are stripped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import re
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slabconv.errors import InputError, UsageError

_PREFIXES = ("module.", "_orig_mod.")
_WRAPPER_KEYS = ("model", "state_dict", "model_state", "module")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ConfigNode(dict):  # type: ignore[type-arg]
    """Stand-in for ``yacs.config.CfgNode`` when reading a checkpoint: a plain dict, nothing imported or run.

    yacs pickles a ``CfgNode`` (a dict subclass) as the class, its items, and an instance ``__dict__`` with
    yacs' own flags; the items are kept, the flags ignored.
    """

    def __setstate__(self, state: Any) -> None:  # the instance __dict__ of the real CfgNode
        return None


# ``module.Class`` names read as data: the official SLAB training config (yacs) and nothing else.
SAFE_CONFIG_GLOBALS = {"yacs.config.CfgNode": ConfigNode}


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        state_dict: parameter name -> tensor, prefixes stripped.
        config: the saved training config as plain nested dicts (empty when the file has none).
        format: ``training-checkpoint``, ``release``, ``state_dict``, ``safetensors`` or ``torch.export``.
        path: the file.
        sha256: hex digest of the file.
        extra: ``epoch``, ``max_accuracy`` and which weights were taken (``model`` / ``state_dict_ema``).
        metadata: safetensors string metadata (fused outputs carry ``arch``).
        program: the ``torch.export.ExportedProgram`` for a ``.pt2``.
    """

    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]
    format: str
    path: Path
    sha256: str
    extra: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    program: Any = None


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, torch.Tensor) for v in obj.values())


def strip_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` / ``_orig_mod.`` from every key that has them."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        out[key] = value
    return out


def _torch_load(path: Path) -> Any:
    with torch.serialization.safe_globals([(cls, name) for name, cls in SAFE_CONFIG_GLOBALS.items()]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err)) or re.search(r"Unsupported global: ([\w.]+)", str(err))
            if found:
                raise InputError(
                    f"{path}: the pickle names the Python global {found.group(1)!r}, which slabconv will not import "
                    "(loading it could run code); re-save the weights as a plain state_dict, export a .pt2 with "
                    "torch.export.save, or pass --trust-pickle if you trust this file"
                ) from None
            raise InputError(f"{path}: not a readable PyTorch checkpoint ({_first_line(err)})") from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, AttributeError) as err:
            raise InputError(f"{path}: not a readable PyTorch checkpoint ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def load_checkpoint(path: Path | str, ema: bool = False) -> Checkpoint:
    """Read a checkpoint file without executing code.

    Args:
        path: a ``.pth``/``.pt`` checkpoint (training layout, release ``{'model': ...}`` or a bare state_dict),
            a ``.safetensors`` file, or a ``.pt2`` program saved by ``torch.export.save``.
        ema: take ``state_dict_ema`` instead of ``model`` from a training checkpoint.

    Raises:
        InputError: missing, empty or corrupt file; a pickle naming a global outside the allowlist; no
            state_dict inside; ``--ema`` asked of a file without EMA weights.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a folder; give the checkpoint file inside it")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty")
    digest = sha256_file(path)
    if path.suffix == ".safetensors":
        return _load_safetensors(path, digest)
    if path.suffix == ".pt2":
        return _load_program(path, digest)
    obj = _torch_load(path)
    extra: dict[str, Any] = {}
    config: dict[str, Any] = {}
    if _is_state_dict(obj):
        return Checkpoint(strip_prefixes(obj), {}, "state_dict", path, digest, {"weights": "state_dict"})
    if not isinstance(obj, Mapping):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict or state_dict")
    if isinstance(obj.get("config"), Mapping):
        config = _plain(obj["config"])
    for key in ("epoch", "max_accuracy"):
        if isinstance(obj.get(key), (int, float)):
            extra[key] = obj[key]
    if ema:
        if not _is_state_dict(obj.get("state_dict_ema")):
            raise InputError(f"{path}: --ema was given but the checkpoint has no 'state_dict_ema'")
        weights_key = "state_dict_ema"
    else:
        weights_key = next((k for k in _WRAPPER_KEYS if _is_state_dict(obj.get(k))), "")
        if not weights_key:
            keys = ", ".join(sorted(map(str, obj))[:8])
            raise InputError(f"{path}: no state_dict found (top-level keys: {keys})")
    extra["weights"] = weights_key
    fmt = "training-checkpoint" if ("optimizer" in obj or "epoch" in obj or config) else "release"
    return Checkpoint(strip_prefixes(obj[weights_key]), config, fmt, path, digest, extra)


def _load_safetensors(path: Path, digest: str) -> Checkpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise InputError(f"{path}: not a readable safetensors file ({_first_line(err)})") from None
    return Checkpoint(dict(tensors), {}, "safetensors", path, digest, metadata=metadata)


def _load_program(path: Path, digest: str) -> Checkpoint:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.load(path)
    except Exception as err:  # noqa: BLE001 - torch.export.load raises many types on bad files
        raise InputError(f"{path}: not a readable torch.export program ({_first_line(err)})") from None
    return Checkpoint(dict(program.state_dict), {}, "torch.export", path, digest, program=program)


# --------------------------------------------------------------------------------------------- writing


@contextlib.contextmanager
def staging_dir(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` that replaces it only when the block finishes without error.

    Nothing is left behind on failure; an existing ``final`` stays intact until the swap, and is refused
    without ``force``.

    Raises:
        UsageError: ``final`` exists and ``force`` is False, or its parent folder is not writable.
    """
    final = final.resolve()
    if final.exists() and not force:
        raise UsageError(f"{final} already exists; pass --force to replace it")
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    except OSError as err:
        raise UsageError(f"cannot write to {parent}: {err.strerror or err}") from None
    try:
        yield tmp
        _publish_modes(tmp)
        backup = None
        if final.exists():
            backup = parent / f".{final.name}.old-{os.getpid()}"
            final.rename(backup)
        tmp.rename(final)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish_modes(folder: Path) -> None:
    """Give the staged folder and its files the modes the user's umask asks for (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (contiguous CPU copies, shared storage split) with string ``metadata``."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path), dict(metadata))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence stdout, Python warnings and torch's exporter log lines (stdout may carry ``--json`` output)."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_log.setLevel(level)


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> dict[str, Any]:
    """Export ``model`` to ONNX with the dynamo exporter, input ``input`` and output ``output``.

    Axis 0 (batch) is dynamic when the model allows it; otherwise the batch size of ``example`` is fixed and
    the returned info says so.

    Returns:
        ``{"dynamic_batch": bool, "opset": int}``.

    Raises:
        UnsupportedModelError: the exporter fails both with and without a dynamic batch axis.
    """
    from slabconv.errors import UnsupportedModelError

    last: Exception | None = None
    for dynamic in (True, False):
        shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
        try:
            with quiet():
                program = torch.onnx.export(
                    model,
                    (example,),
                    dynamo=True,
                    dynamic_shapes=shapes,
                    input_names=["input"],
                    output_names=["output"],
                    verbose=False,
                )
                assert program is not None
                program.save(str(path))
            opset = next((o.version for o in program.model_proto.opset_import if o.domain in ("", "ai.onnx")), 0)
            return {"dynamic_batch": dynamic, "opset": int(opset)}
        except Exception as err:  # noqa: BLE001 - the exporter raises many types
            last = err
    raise UnsupportedModelError(f"ONNX export failed: {_first_line(last) if last else 'unknown error'}")
