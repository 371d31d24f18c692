"""Checkpoint files in: every format slabconv reads, parsed without running code from the file.

Loading never executes code unless asked: ``torch.load(weights_only=True)``, with a named allowlist that
reads the official SLAB training config (a yacs ``CfgNode``) as plain data. Checkpoint hygiene follows the
official training layout (github xinghaochen/SLAB ``classification/utils.py`` ``save_checkpoint``):
``{'model', 'optimizer', 'lr_scheduler', 'max_accuracy', 'epoch', 'config'}``, plus ``state_dict_ema`` in EMA
runs (``model_ema`` in DeiT's ``main.py``); ``module.`` (DataParallel) and ``_orig_mod.`` (torch.compile)
prefixes are stripped.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from slabconv.errors import InputError, first_line
from slabconv.load import fused, program_checks, safety
from slabconv.load.paths import check_input  # noqa: F401 (callers take it from here too)
from slabconv.util import silenced

_PREFIXES = ("module.", "_orig_mod.")
_WRAPPER_KEYS = ("model", "state_dict", "model_state", "module")
_EMA_KEYS = ("state_dict_ema", "model_ema")
"""Where training scripts keep EMA weights: the official SLAB / Swin and timm ``train.py`` (``state_dict_ema``),
facebookresearch/deit ``main.py`` (``model_ema``)."""


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
        extra: ``epoch``, ``max_accuracy`` and which weights were taken (``model``, ``state_dict_ema``,
            ``model_ema``...).
        metadata: safetensors string metadata (fused outputs carry ``arch``).
        program: the ``torch.export.ExportedProgram`` for a ``.pt2``.
        module: the ``nn.Module`` of a ``pickled-module``, or the ``GraphModule`` of a ``.pt2`` program.
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


def is_state_dict(obj: Any) -> bool:
    """True for a bare state_dict: a non-empty mapping of ``str`` names to tensors."""
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def strip_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` / ``_orig_mod.`` where every key has it: DataParallel / DDP and ``torch.compile`` wrap the
    whole model, so each of their keys has the prefix; a model whose own submodule is named ``module`` beside others
    keeps its names (stripping them would rename its tensors, or make ``module.x`` and ``x`` one). Prefixes nest
    (``module._orig_mod.``)."""
    keys = list(state_dict)
    cut = 0
    while keys:
        prefix = next((p for p in _PREFIXES if all(k.startswith(p, cut) for k in keys)), None)
        if prefix is None:
            break
        cut += len(prefix)
    return {key[cut:]: value for key, value in state_dict.items()}


def torch_load(f: IO[bytes], label: str, trust_pickle: bool = False) -> Any:
    """A ``.pth`` through the one weights-only reader (``safety.weights_only_load``); with ``trust_pickle`` a file
    that reader refuses is loaded in full (this runs code from the file). Both read ``f``, the one open file.

    Raises:
        InputError: as ``safety.weights_only_load`` and ``safety.refusal`` (a refused pickle, without
            ``trust_pickle``); ``not a readable PyTorch checkpoint`` for a file torch cannot read; a trusted pickle
            whose loading failed.
    """
    try:
        return safety.weights_only_load(f, label)
    except InputError as err:
        if not trust_pickle or isinstance(err, safety.WrongKind):
            raise
    except pickle.UnpicklingError as err:
        if not trust_pickle:
            raise safety.refusal(label, err, f) from None
    except Exception as err:  # noqa: BLE001 - a damaged file can make torch.load raise almost anything
        raise InputError(
            f"{label}: not a readable PyTorch checkpoint ({first_line(err)}); the file is damaged, truncated "
            "or not a checkpoint"
        ) from None
    try:
        f.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - arbitrary code ran; report whatever it raised
        raise InputError(
            f"{label}: loading the trusted pickle failed ({type(err).__name__}: {first_line(err)})"
            + _trusted_pickle_advice(err)
        ) from None


def _trusted_pickle_advice(err: Exception) -> str:
    """What to do when unpickling a trusted module failed because its code cannot be found: a module Python cannot
    import from here (``PYTHONPATH``), or a class defined in the script that saved it (``__main__``), which no
    other program can import; either way a program (``.pt2``) needs no code."""
    text = str(err)
    if isinstance(err, ModuleNotFoundError) and err.name:
        top = err.name.split(".")[0]
        return (
            f"; the pickle imports the module {err.name!r}, which Python cannot find from here: run slabconv where "
            f"it can be imported (PYTHONPATH=DIR, DIR the folder that holds {top}/ or {top}.py), or save a program "
            f"instead: {safety.SAVE_PROGRAM}"
        )
    if isinstance(err, AttributeError) and "__main__" in text:
        return (
            "; the model's class was defined in the script that saved it (module __main__), which no other program "
            f"can import: save a program instead: {safety.SAVE_PROGRAM}"
        )
    return ""


def load_pickle(path: Path, ema: bool = False, trust_pickle: bool = False) -> Checkpoint:
    """A ``.pth``/``.pt``/``.bin`` pickle read weights-only (see ``load_checkpoint``): a training checkpoint, a
    release ``{'model': ...}``, a bare state_dict, or (``trust_pickle``) a whole module."""
    # one open file: the sha256 the report records is of the file the reader then loads, not of a later open
    with safety.open_regular(path, "the checkpoint") as f:
        digest = safety.sha256_open(f)
        obj = torch_load(f, str(path), trust_pickle)
    extra: dict[str, Any] = {}
    config: dict[str, Any] = {}
    if isinstance(obj, torch.nn.Module):
        state = strip_prefixes(obj.state_dict())
        return Checkpoint(state, {}, "pickled-module", path, digest, {"weights": "module"}, module=obj)
    if is_state_dict(obj):
        return Checkpoint(strip_prefixes(obj), {}, "state_dict", path, digest, {"weights": "state_dict"})
    if not isinstance(obj, Mapping):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict or state_dict")
    if isinstance(obj.get("config"), Mapping):
        config = safety.plain(obj["config"], str(path))
    for key in ("epoch", "max_accuracy"):
        if isinstance(obj.get(key), (int, float)):
            extra[key] = obj[key]
    ema_key = next((k for k in _EMA_KEYS if is_state_dict(obj.get(k))), "")
    if ema:
        if not ema_key:
            raise InputError(
                f"{path}: --ema was given but the checkpoint has no EMA weights ({' or '.join(_EMA_KEYS)}); "
                "leave out --ema"
            )
        weights_key = ema_key
    else:
        weights_key = next((k for k in _WRAPPER_KEYS if is_state_dict(obj.get(k))), "")
        if not weights_key and ema_key:
            raise InputError(
                f"{path}: the only weights in the checkpoint are the EMA weights under {ema_key!r}; pass --ema to "
                "fold them"
            )
        if not weights_key:
            keys = ", ".join(sorted(map(str, obj))[:8])
            raise InputError(
                f"{path}: no state_dict found (top-level keys: {keys}); expected the weights under one of "
                f"{', '.join(_WRAPPER_KEYS)} (EMA weights: {', '.join(_EMA_KEYS)} with --ema) or a bare "
                "name -> tensor dict"
            )
    extra["weights"] = weights_key
    fmt = "training-checkpoint" if ("optimizer" in obj or "epoch" in obj or config) else "release"
    return Checkpoint(strip_prefixes(obj[weights_key]), config, fmt, path, digest, extra)


def load_safetensors(path: Path) -> Checkpoint:
    """A ``.safetensors`` file read once (``read_safetensors``): the sha256 is of the bytes the tensors came from.
    ``module.`` / ``_orig_mod.`` prefixes are stripped as from a pickle (``save_file(model.state_dict())`` of a
    DataParallel / DDP or ``torch.compile`` model writes them)."""
    from slabconv.load.safetensors_file import read_safetensors

    tensors, metadata, digest = read_safetensors(path)
    if not tensors:
        raise InputError(f"{path}: the safetensors file holds no tensors")
    return Checkpoint(strip_prefixes(tensors), {}, "safetensors", path, digest, metadata=metadata)


def load_program(path: Path, trust_pickle: bool = False) -> Checkpoint:
    """A ``.pt2`` read by ``torch.export.load`` after ``program_checks.check_program_archive``, with ``sympy.sympify``
    guarded and every pickle inside weights-only (unless ``trust_pickle``); torch's log lines silenced.

    The file is opened once: the checks, the sha256 and ``torch.export.load`` read the same open file, so a file
    swapped in at the path meanwhile is never the one loaded. The module is built without torch's guard function
    (``check_guards=False``): the guards were checked to be shape checks, and slabconv checks input shapes itself.
    """
    label = str(path)
    with safety.open_regular(path, "the program") as f:
        size = os.fstat(f.fileno()).st_size
        program_checks.check_program_archive(f, trust_pickle, label, size)
        digest = safety.sha256_open(f)
        guards = contextlib.ExitStack()
        guards.enter_context(silenced())
        guards.enter_context(program_checks.guarded_sympify(label))
        if not trust_pickle:
            guards.enter_context(safety.no_code_from_pickles(label, size))
        try:
            with guards:
                extra = {fused.PROGRAM_INFO: ""}
                program = torch.export.load(f, extra_files=extra)
                # builds and compiles the graph: a damaged program can fail here too
                # check_guards where this torch has it: the guards were checked above and slabconv checks shapes itself
                takes = inspect.signature(program.module).parameters
                module = program.module(check_guards=False) if "check_guards" in takes else program.module()
        except InputError:
            raise
        except RecursionError:
            raise InputError(f"{path}: the program nests too deeply to read; refused") from None
        except Exception as err:  # noqa: BLE001 - torch.export.load raises many types on bad files
            chain = [err, err.__cause__, err.__context__]
            if any(isinstance(e, safety.PickleRefused) for e in chain) or "Weights only load failed" in str(err):
                raise InputError(
                    f"{path}: the program holds pickled Python objects, which slabconv will not load (loading them "
                    "could run code); re-export it with tensor weights only, or pass --trust-pickle if you trust "
                    "this file"
                ) from None
            raise InputError(
                f"{path}: not a readable torch.export program ({first_line(err)}); re-save it with torch.export.save"
            ) from None
    state = dict(program.state_dict)
    safety.check_extents({"state_dict": state, "constants": dict(program.constants)}, size, label)
    metadata = _program_info(extra[fused.PROGRAM_INFO], f"{label}: extra file {fused.PROGRAM_INFO}")
    return Checkpoint(state, {}, "torch.export", path, digest, metadata=metadata, program=program, module=module)


def _program_info(text: str | bytes, label: str) -> dict[str, str]:
    """The string entries of the ``slabconv.load.fused.PROGRAM_INFO`` extra file of a ``.pt2`` slabconv wrote
    (its provenance: ``source_sha256``, ``arch``, ``slabconv_version``...); empty for any other program.

    Raises:
        InputError: the entry is over the JSON size or depth limits (``safety.parse_json``).
    """
    if not text:
        return {}
    try:
        info = safety.parse_json(text, label)
    except safety.InvalidJSON:
        return {}
    return {str(k): v for k, v in info.items() if isinstance(v, str)} if isinstance(info, dict) else {}
