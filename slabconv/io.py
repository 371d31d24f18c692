"""Checkpoint formats in; safetensors and ONNX out, atomically.

Loading never executes code unless asked: ``torch.load(weights_only=True)``, with a named allowlist that
reads the official SLAB training config (a yacs ``CfgNode``) as plain data. Checkpoint hygiene follows the
official training layout (github xinghaochen/SLAB ``classification/utils.py`` ``save_checkpoint``):
``{'model', 'optimizer', 'lr_scheduler', 'max_accuracy', 'epoch', 'config'}``, plus ``state_dict_ema`` in EMA
runs; ``module.`` (DataParallel) and ``_orig_mod.`` (torch.compile) prefixes are stripped.
"""

from __future__ import annotations

import collections
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


class ConfigNode:
    """Stand-in for ``yacs.config.CfgNode`` when reading a checkpoint: plain data, nothing imported or run.

    yacs pickles a ``CfgNode`` (a dict subclass) as ``NEWOBJ(CfgNode)``, its items (``SETITEMS``) and a
    ``BUILD`` with yacs' own flags (``__immutable__``, ...). torch's weights-only unpickler fills only exact
    ``dict``/``OrderedDict`` objects and builds only allowlisted types, so ``__new__`` hands it an
    ``OrderedDict``: the items land in it, the flags land in its ``__dict__`` and are dropped by ``_plain``.
    The name ``yacs.config.CfgNode`` is matched as a string; yacs itself is never imported.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - see the class docstring
        return collections.OrderedDict()


# ``module.Class`` names read as data: the official SLAB training config (yacs) and nothing else.
SAFE_CONFIG_GLOBALS = {"yacs.config.CfgNode": ConfigNode}


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        state_dict: parameter name -> tensor, prefixes stripped.
        config: the saved training config as plain nested dicts (empty when the file has none).
        format: ``training-checkpoint``, ``release``, ``state_dict``, ``safetensors``, ``torch.export`` or
            ``pickled-module`` (a whole ``nn.Module`` saved with ``torch.save(model)``, read with trust_pickle).
        path: the file.
        sha256: hex digest of the file.
        extra: ``epoch``, ``max_accuracy`` and which weights were taken (``model`` / ``state_dict_ema``).
        metadata: safetensors string metadata (fused outputs carry ``arch``).
        program: the ``torch.export.ExportedProgram`` for a ``.pt2``.
        module: the ``nn.Module`` of a ``pickled-module``.
    """

    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]
    format: str
    path: Path
    sha256: str
    extra: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    program: Any = None
    module: Any = None


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


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


def _unsafe_globals(path: Path) -> list[str]:
    """The ``module.name`` globals a pickle names outside torch's and slabconv's allowlists (read, not run)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a damaged file: the caller reports the load error instead
        return []
    return [n for n in names if n not in SAFE_CONFIG_GLOBALS]


def _refusal(path: Path, err: BaseException) -> InputError:
    """The one-line error for a checkpoint that ``torch.load(weights_only=True)`` rejects."""
    text = str(err)
    first = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    unsafe = _unsafe_globals(path)
    if first or unsafe:
        named = first.group(1) if first else unsafe[0]
        named = named if (named in unsafe or not unsafe) else unsafe[0]
        if any(n.startswith("torch.nn.modules.") for n in unsafe) or named.startswith("torch.nn.modules."):
            return InputError(
                f"{path}: holds a whole pickled nn.Module ({named}), and loading one runs code from the file; "
                "pass --trust-pickle --input-shape C,H,W if you trust it, or save a program instead: "
                "torch.export.save(torch.export.export(model.eval(), (example,)), 'model.pt2')"
            )
        others = [n for n in unsafe if n != named][:3]
        also = f" (also: {', '.join(others)})" if others else ""
        return InputError(
            f"{path}: the pickle names the Python global {named!r}{also}, which slabconv will not import "
            "(loading it could run code); re-save the weights as a plain state_dict, or pass --trust-pickle "
            "if you trust this file"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    reason = detail.group(1).strip()[:200] if detail else _first_line(err)
    return InputError(f"{path}: not a readable PyTorch checkpoint ({reason}); the file is damaged or not a checkpoint")


def _torch_load(path: Path, trust_pickle: bool = False) -> Any:
    """``torch.load`` on CPU: weights-only with the config allowlist; with ``trust_pickle`` a file the
    weights-only reader refuses is loaded in full (this runs code from the file)."""
    allowed: list[Any] = [(cls, name) for name, cls in SAFE_CONFIG_GLOBALS.items()]
    with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol N": the error, if any, says enough
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            refusal = _refusal(path, err)
            if not trust_pickle:
                raise refusal from None
        except Exception as err:  # noqa: BLE001 - a damaged file can make torch.load raise almost anything
            raise InputError(
                f"{path}: not a readable PyTorch checkpoint ({_first_line(err)}); the file is damaged, truncated "
                "or not a checkpoint"
            ) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - arbitrary code ran; report whatever it raised
        raise InputError(
            f"{path}: loading the trusted pickle failed ({type(err).__name__}: {_first_line(err)})"
        ) from None


def _first_line(err: BaseException | None) -> str:
    if err is None:
        return "unknown error"
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def load_checkpoint(path: Path | str, ema: bool = False, trust_pickle: bool = False) -> Checkpoint:
    """Read a checkpoint file without executing code (unless ``trust_pickle``).

    Args:
        path: a ``.pth``/``.pt`` checkpoint (training layout, release ``{'model': ...}`` or a bare state_dict),
            a ``.safetensors`` file, or a ``.pt2`` program saved by ``torch.export.save``.
        ema: take ``state_dict_ema`` instead of ``model`` from a training checkpoint.
        trust_pickle: allow a pickle that names globals outside the allowlist, such as a whole ``nn.Module``
            saved with ``torch.save(model)``; this runs code from the file. Tried only after the weights-only
            reader refused the file.

    Raises:
        InputError: missing, empty or corrupt file; a pickle naming a global outside the allowlist (without
            ``trust_pickle``); no state_dict inside; ``--ema`` asked of a file without EMA weights.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        from slabconv import hf

        if not hf.is_hf_folder(path):
            raise InputError(
                f"{path}: is a folder without config.json and weights; give the checkpoint file inside it, or a "
                "Hugging Face style folder (config.json + model.safetensors / pytorch_model.bin, sharded or not)"
            )
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
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty (an interrupted download or save?); use a complete checkpoint")
    digest = sha256_file(path)
    if path.suffix == ".safetensors":
        return _load_safetensors(path, digest)
    if path.suffix == ".pt2":
        return _load_program(path, digest, trust_pickle)
    obj = _torch_load(path, trust_pickle)
    extra: dict[str, Any] = {}
    config: dict[str, Any] = {}
    if isinstance(obj, torch.nn.Module):
        state = strip_prefixes(obj.state_dict())
        return Checkpoint(state, {}, "pickled-module", path, digest, {"weights": "module"}, module=obj)
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
            raise InputError(f"{path}: --ema was given but the checkpoint has no 'state_dict_ema'; leave out --ema")
        weights_key = "state_dict_ema"
    else:
        weights_key = next((k for k in _WRAPPER_KEYS if _is_state_dict(obj.get(k))), "")
        if not weights_key:
            keys = ", ".join(sorted(map(str, obj))[:8])
            raise InputError(
                f"{path}: no state_dict found (top-level keys: {keys}); expected the weights under one of "
                f"{', '.join(_WRAPPER_KEYS)} or a bare name -> tensor dict"
            )
    extra["weights"] = weights_key
    fmt = "training-checkpoint" if ("optimizer" in obj or "epoch" in obj or config) else "release"
    return Checkpoint(strip_prefixes(obj[weights_key]), config, fmt, path, digest, extra)


def _load_safetensors(path: Path, digest: str) -> Checkpoint:
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ValueError, ...
        raise InputError(
            f"{path}: not a readable safetensors file ({_first_line(err)}); the header or data is damaged"
        ) from None
    if not tensors:
        raise InputError(f"{path}: the safetensors file holds no tensors")
    return Checkpoint(dict(tensors), {}, "safetensors", path, digest, metadata=metadata)


class _PickleRefused(pickle.UnpicklingError):
    """Raised instead of unpickling a Python object inside a ``.pt2`` (see ``_no_code_from_pickles``)."""


@contextlib.contextmanager
def _no_code_from_pickles() -> Iterator[None]:
    """While ``torch.export.load`` runs: every ``torch.load`` is weights-only (with the config allowlist), and
    ``pickle.loads`` / ``torch._C._pickle_load_obj`` are refused.

    A ``.pt2`` normally stores raw tensors and JSON, but torch's reader unpickles some entries with
    ``weights_only=False`` (weights or constants marked ``use_pickle``, the sample inputs when the weights-only
    reader refuses them) and opaque constants with ``pickle.loads``: a hostile file could run code there.
    Patched process-wide for the duration of the call (slabconv loads one file at a time).
    """
    from unittest import mock

    real_load = torch.load
    allowed: list[Any] = [(cls, name) for name, cls in SAFE_CONFIG_GLOBALS.items()]

    def weights_only_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        kwargs.pop("pickle_module", None)
        with torch.serialization.safe_globals(allowed):
            return real_load(*args, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _PickleRefused("the program holds a pickled Python object")

    with (
        mock.patch.object(torch, "load", weights_only_load),
        mock.patch.object(pickle, "loads", refuse),
        mock.patch.object(torch._C, "_pickle_load_obj", refuse),
    ):
        yield


def _load_program(path: Path, digest: str, trust_pickle: bool = False) -> Checkpoint:
    guard = contextlib.nullcontext() if trust_pickle else _no_code_from_pickles()
    try:
        with warnings.catch_warnings(), guard:
            warnings.simplefilter("ignore")
            program = torch.export.load(path)
    except Exception as err:  # noqa: BLE001 - torch.export.load raises many types on bad files
        chain = [err, err.__cause__, err.__context__]
        if any(isinstance(e, _PickleRefused) for e in chain) or "Weights only load failed" in str(err):
            raise InputError(
                f"{path}: the program holds pickled Python objects, which slabconv will not load (loading them "
                "could run code); re-export it with tensor weights only, or pass --trust-pickle if you trust this file"
            ) from None
        raise InputError(
            f"{path}: not a readable torch.export program ({_first_line(err)}); re-save it with torch.export.save"
        ) from None
    return Checkpoint(dict(program.state_dict), {}, "torch.export", path, digest, program=program)


# --------------------------------------------------------------------------------------------- writing

# Staging folders are named ``.<final>.tmp-<pid>-<random>``; a swap's backup ``.<final>.old-<pid>``. A run that
# is killed (SIGKILL) cannot remove its own; the next run writing the same output removes those whose process
# is gone, and puts back a backup whose swap was cut short.
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[^/]*)?$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stale(final: Path) -> list[Path]:
    """Remove staging leftovers of ``final`` from killed runs; restore a backup whose swap was interrupted.

    Only siblings named ``.<final name>.tmp-<pid>-*`` / ``.<final name>.old-<pid>`` whose process no longer
    runs are touched. Returns the paths removed.
    """
    removed: list[Path] = []
    parent = final.parent
    if not parent.is_dir():
        return removed
    leftovers = []
    for item in parent.iterdir():
        m = _STAGING.match(item.name)
        if m and m["name"] == final.name and not _alive(int(m["pid"])):
            leftovers.append((m["kind"], item))
    for kind, item in sorted(leftovers, key=lambda pair: pair[0] != "old"):
        if kind == "old" and not final.exists():
            with contextlib.suppress(OSError):
                item.rename(final)
                continue
        _remove(item)
        removed.append(item)
    return removed


@contextlib.contextmanager
def staging_dir(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` (same filesystem) that replaces it only when the block finishes.

    Nothing is left behind on failure or interruption (KeyboardInterrupt included); an existing ``final``
    stays intact until the swap, and is refused without ``force``. Leftovers of killed runs are cleaned first
    (``clean_stale``).

    Raises:
        UsageError: ``final`` exists and ``force`` is False, or its parent folder is not writable.
    """
    final = final.absolute()
    parent = final.parent
    tmp = _make_staging(final, force)
    try:
        yield tmp
        _publish_modes(tmp)
        backup = None
        if final.exists():
            backup = parent / f".{final.name}.old-{os.getpid()}"
            _remove(backup)
            final.rename(backup)
        tmp.rename(final)
        if backup is not None:
            _remove(backup)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _make_staging(final: Path, force: bool) -> Path:
    """Check ``final`` may be written, clean stale leftovers, and create the staging folder beside it."""
    if final.exists() and not force:
        raise UsageError(f"{final} already exists; pass --force to replace it")
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(final)
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as err:
        raise UsageError(
            f"cannot write to {parent}: {err.strerror or err}; choose a writable output location"
        ) from None


@contextlib.contextmanager
def staging_file(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` in which to write the file ``final.name`` and its side files (an
    ONNX ``.data``); when the block finishes each is moved into place with ``os.replace`` (atomic on one
    filesystem), ``final`` last. On failure nothing is moved and the folder is removed.

    Raises:
        UsageError: ``final`` exists and ``force`` is False, or its folder is not writable.
    """
    final = final.absolute()
    tmp = _make_staging(final, force)
    try:
        yield tmp
        if not (tmp / final.name).is_file():
            raise RuntimeError(f"nothing was staged for {final}")
        _publish_modes(tmp)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == final.name):
            os.replace(item, final.parent / item.name)
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


# protobuf cannot serialise or parse one message over 2 GiB, so an ONNX file whose weights are inside it must
# stay under that. Above this many bytes of weights (the threshold torch's exporter uses), the weights go to
# ``<name>.onnx.data`` beside the ``.onnx`` (ONNX external data), which onnx and onnxruntime read from a path.
ONNX_EXTERNAL_DATA_BYTES = 1536 * 1024 * 1024
PROTOBUF_LIMIT_BYTES = 2**31 - 1


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> dict[str, Any]:
    """Export ``model`` to ONNX with the dynamo exporter, input ``input`` and output ``output``.

    Axis 0 (batch) is dynamic when the model allows it; otherwise the batch size of ``example`` is fixed and
    the returned info says so. Weights over ``ONNX_EXTERNAL_DATA_BYTES`` go to external data
    ``<path>.data`` beside ``path``.

    Returns:
        ``{"dynamic_batch": bool, "opset": int, "external_data": "<name>.data" or None}``.

    Raises:
        UnsupportedModelError: the exporter fails both with and without a dynamic batch axis.
        UsageError: the file cannot be written.
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
        except Exception as err:  # noqa: BLE001 - the exporter raises many types
            last = err
            continue
        external = _weight_bytes(model) > ONNX_EXTERNAL_DATA_BYTES
        try:
            with quiet():
                program.save(str(path), external_data=external)
        except OSError as err:
            raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
        opset = next((o.version for o in program.model_proto.opset_import if o.domain in ("", "ai.onnx")), 0)
        return {
            "dynamic_batch": dynamic,
            "opset": int(opset),
            "external_data": f"{path.name}.data" if external else None,
        }
    raise UnsupportedModelError(f"ONNX export failed: {_first_line(last)}")


def onnx_files(path: Path) -> list[Path]:
    """``path`` and the external data files it names (to hash and to move together)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    names = {ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)}
    return [path, *(path.parent / n for n in sorted(names))]


def check_onnx_file(path: Path) -> tuple[bool, str]:
    """Read an ONNX file and run ``onnx.checker`` with ``full_check`` (external data followed).

    Returns:
        ``(passed, one-line detail)``; a model the checker rejects is a failed check, not an error.

    Raises:
        InputError: missing file; one file over protobuf's 2 GiB limit (the case ONNX cannot represent
            without external data); unreadable protobuf; external data files that are not beside it.
    """
    import onnx

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    size = path.stat().st_size
    if size > PROTOBUF_LIMIT_BYTES:
        raise InputError(
            f"{path}: one ONNX file of {size / 2**30:.1f} GiB is over protobuf's 2 GiB limit and cannot be read; "
            "re-save it with its weights as external data: onnx.save_model(model, path, save_as_external_data=True)"
        )
    try:
        files = onnx_files(path)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise InputError(f"{path}: not a readable ONNX file ({_first_line(err)})") from None
    missing = [f.name for f in files[1:] if not f.is_file()]
    if missing:
        raise InputError(
            f"{path}: its weights are in external data file(s) {', '.join(missing)} that are not beside it; "
            "copy them next to the .onnx"
        )
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as err:  # noqa: BLE001 - ValidationError, InferenceError, ...
        return False, _first_line(err)
    return True, "onnx.checker full_check passed"
