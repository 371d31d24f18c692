"""What slabconv writes, read back: the fused safetensors metadata contract and output folders.

The metadata contract (written by ``fused_metadata``, read by ``FusedMetadata.read``; nothing else builds or
parses it): ``format`` ``pt``, ``slabconv_version``, ``arch`` (the registered architecture, empty for a
program), ``source_sha256`` (of the checkpoint), ``complete`` (``true`` when every norm folded away, so the
weights load into the norm-free model of the architecture) and ``config`` (the JSON build config); with
``--fold-norm-affine`` also ``norm_affine`` ``true``: the fold took the affine of the LayerNorms / RMSNorms /
GroupNorms and their normalisations stay (``complete`` then means every norm folded or was kept whole in its op,
and the weights load into the architecture with its norms, each weight 1 where it folded).

A fused Hugging Face model folder records the same provenance in its ``config.json`` too (``config_provenance``:
the ``slabconv`` object's ``provenance`` object, ``fused_metadata`` without ``format`` and ``config``), which
transformers keeps when it loads the folder and saves it again (``save_pretrained`` writes safetensors whose
metadata is only ``format``, and keeps a config's keys it does not know); ``FusedMetadata.from_config`` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slabconv.load.paths import REPORT, is_output_folder  # noqa: F401 (what an output folder is)
from slabconv.util import upper_bound
from slabconv.version import __version__


def fused_metadata(
    arch: str | None,
    source_sha256: str,
    complete: bool,
    config: Mapping[str, Any],
    norm_affine: bool = False,
    source_weights: str | None = None,
) -> dict[str, str]:
    """The string metadata of a fused safetensors file (see the module docstring); ``source_weights``: which weights
    of a training checkpoint were folded (``model``, ``state_dict_ema`` with ``--ema``...)."""
    out = {
        "format": "pt",
        "slabconv_version": __version__,
        "arch": arch or "",
        "source_sha256": source_sha256,
        "complete": "true" if complete else "false",
        "config": json.dumps(dict(config)),
    }
    if norm_affine:
        out["norm_affine"] = "true"
    if source_weights:
        out["source_weights"] = source_weights
    return out


CONFIG_KEY = "slabconv"
"""The object of a fused folder's ``config.json`` that says what slabconv did (``slabconv.write.hf_llama``)."""

PROVENANCE_KEY = "provenance"
"""The object under ``CONFIG_KEY`` holding the fused metadata's provenance (``config_provenance``)."""


def config_provenance(metadata: Mapping[str, str]) -> dict[str, str]:
    """What a fused folder's ``config.json`` records under ``CONFIG_KEY`` / ``PROVENANCE_KEY``: the fused metadata
    (``fused_metadata``) without ``format`` and ``config`` (the config is the file itself)."""
    return {k: v for k, v in metadata.items() if k not in ("format", "config")}


FUSED_LLAMA_TYPE = "slabconv_llama"
"""``model_type`` in the ``config.json`` of a fused LLaMA-PRepBN folder (``slabconv.write.hf_llama`` writes it): the
norm-free LLaMA (architecture ``llama_prepbn`` without norms). ``load_model`` builds that model from such a folder
whose weights lost slabconv's metadata (saved again by transformers' ``save_pretrained``)."""

FUSED_LLAMA_ARCH = "llama_prepbn"
"""The registered architecture whose norm-free model a ``FUSED_LLAMA_TYPE`` folder holds."""


PROGRAM_INFO = "slabconv.json"
"""The extra file (``torch.export.save(..., extra_files=)``) of a ``.pt2`` slabconv wrote: a JSON object with
``slabconv_version``, the program's dynamic axes and the provenance keys of ``fused_metadata`` (``arch``,
``source_sha256``, ``norm_affine``), read back by ``slabconv.load.checkpoint.load_program`` as the program's
``metadata`` (its string values)."""


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``an array``, ``a number``, ``null``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), f"a {type(value).__name__}")


@dataclass(frozen=True)
class FusedMetadata:
    """The metadata of a safetensors file slabconv wrote (``read`` gives None for any other file)."""

    version: str
    arch: str | None
    source_sha256: str
    complete: bool
    config: dict[str, Any]
    norm_affine: bool = False
    source_weights: str | None = None

    @classmethod
    def from_config(cls, config: Any, label: str) -> FusedMetadata | None:
        """The provenance a fused folder's ``config.json`` (parsed: ``config``) records (``config_provenance``),
        with the config itself as ``config``; None when it records none (no ``slabconv`` object, or one without
        ``provenance``: a folder slabconv did not write, or wrote before it recorded this).

        Raises:
            InputError: ``slabconv.provenance`` is there but is not an object of strings, naming ``label`` (the
                file) and the first wrong entry.
        """
        from slabconv.errors import InputError

        ours = config.get(CONFIG_KEY) if isinstance(config, dict) else None
        if not isinstance(ours, dict) or PROVENANCE_KEY not in ours:
            return None
        recorded = ours[PROVENANCE_KEY]
        if not isinstance(recorded, dict):
            kind = _json_kind(recorded)
            raise InputError(
                f"{label}: {CONFIG_KEY}.{PROVENANCE_KEY} is {kind}, not an object; the file is damaged: fix or "
                "remove that entry"
            )
        for key, value in recorded.items():
            if not isinstance(value, str):
                kind = _json_kind(value)
                raise InputError(
                    f"{label}: {CONFIG_KEY}.{PROVENANCE_KEY}.{key} is {kind}, not a string; the file is damaged: "
                    "fix or remove that entry"
                )
        fields = {**recorded, "config": "{}"}
        found = cls.read(fields, label)
        if found is None:
            return None
        body = {k: v for k, v in config.items() if k != CONFIG_KEY}
        return cls(found.version, found.arch, found.source_sha256, found.complete, body, found.norm_affine,
                   found.source_weights)  # fmt: skip

    @classmethod
    def read(cls, metadata: Mapping[str, str], label: str = "the safetensors file") -> FusedMetadata | None:
        """The fused metadata, or None when slabconv did not write the file.

        Raises:
            InputError: the ``config`` entry is over the JSON size or depth limits (``safety.parse_json``), naming
                ``label``.
        """
        from slabconv.load.safety import InvalidJSON, parse_json

        if "slabconv_version" not in metadata:
            return None
        try:
            config = parse_json(metadata.get("config") or "{}", f"{label}: metadata 'config'")
        except InvalidJSON:
            config = {}
        return cls(
            version=metadata["slabconv_version"],
            arch=metadata.get("arch") or None,
            source_sha256=metadata.get("source_sha256", ""),
            complete=metadata.get("complete") == "true",
            config=config if isinstance(config, dict) else {},
            norm_affine=metadata.get("norm_affine") == "true",
            source_weights=metadata.get("source_weights") or None,
        )


@dataclass(frozen=True)
class WrittenReport:
    """What an output folder's ``report.json`` records about that folder: the one reader of it (the writer is
    ``slabconv.report.data.Report.write``; the fields are documented in docs/report.md).

    Attributes:
        files: every name slabconv wrote into the folder (``outputs.files`` and ``outputs.sha256``), ``report.json``
            included: what ``--force`` may replace.
        sha256: hex sha256 per written file (``outputs.sha256``), as recorded when it was written.
        source: the report's ``source`` block (``path``, ``sha256``, ``format``, ``arch``...), or None.
        norm_affine: a fold of the affine of a LayerNorm / RMSNorm / GroupNorm is among ``folds`` (a kind ending in
            ``-affine``): the fold was made with ``fold_norm_affine``.
    """

    files: frozenset[str]
    sha256: dict[str, str]
    source: dict[str, Any] | None
    norm_affine: bool = False

    @classmethod
    def read(cls, folder: Path) -> WrittenReport | None:
        """The folder's report, or None when it has no report.json that slabconv wrote: missing, a link, not a
        regular file, over ``MAX_JSON_BYTES``, not JSON, too deep, or without ``slabconv_version`` and ``outputs``.
        Reads through ``slabconv.load.safety.read_json`` (size and depth bounded before parsing)."""
        from slabconv.errors import InputError
        from slabconv.load.safety import read_json

        report = folder / REPORT
        if report.is_symlink():
            return None
        try:
            data = read_json(report)
        except (InputError, OSError):
            return None
        if not isinstance(data, dict) or "slabconv_version" not in data or not isinstance(data.get("outputs"), dict):
            return None
        outputs = data["outputs"]
        names = {REPORT}
        for key in ("sha256", "files"):
            listed = outputs.get(key)
            if isinstance(listed, (dict, list)):
                names |= {str(n) for n in listed}
        recorded = outputs.get("sha256")
        hashes = {str(k): v for k, v in recorded.items() if isinstance(v, str)} if isinstance(recorded, dict) else {}
        source = data.get("source")
        folds = data.get("folds")
        folds = folds if isinstance(folds, list) else []
        norm_affine = any(isinstance(f, dict) and str(f.get("kind", "")).endswith("-affine") for f in folds)
        return cls(frozenset(names), hashes, source if isinstance(source, dict) else None, norm_affine)


def input_spec(program: Any) -> tuple[Any, list[tuple[int | None, int, int | None]]] | None:
    """What a loaded program (``torch.export.load(...).module()``) takes: its first input's dtype and, per axis,
    ``(fixed size or None, lowest, highest or None)``; None when the graph does not record it.

    Source: the placeholder's ``meta["val"]`` (a fake tensor whose symbolic sizes carry the bounds the program was
    exported with, ``ShapeEnv.var_to_range``).
    """
    from torch import fx

    if not isinstance(program, fx.GraphModule):
        return None
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    val = placeholders[0].meta.get("val") if placeholders else None
    if not isinstance(val, torch.Tensor):
        return None
    axes: list[tuple[int | None, int, int | None]] = []
    for size in val.shape:
        if not isinstance(size, torch.SymInt):
            axes.append((int(size), int(size), int(size)))
            continue
        axes.append((None, 1, upper_bound(size)))
    return val.dtype, axes


def describe_input(spec: tuple[Any, list[tuple[int | None, int, int | None]]]) -> str:
    """``int64 ids of shape (batch, sequence 1..64)`` / ``float32 input of shape (batch, 1, 8, 8)``."""
    dtype, axes = spec
    names = []
    for i, (fixed, low, high) in enumerate(axes):
        if fixed is not None:
            names.append(str(fixed))
        elif i == 0:
            names.append("batch")
        else:
            names.append(f"{'sequence' if i == 1 else f'axis {i}'} {low}..{high}" if high else "any")
    kind = "ids" if not dtype.is_floating_point else "input"
    return f"{str(dtype).removeprefix('torch.')} {kind} of shape ({', '.join(names)})"


class CheckedProgram(torch.nn.Module):
    """A fused program that says what it takes: called with an input of another dtype, rank or size, it raises
    one line naming the expected shape and dtype instead of torch's guard assertion.

    Wraps the module of a ``.pt2`` (``torch.export.load(path).module()``), held as ``program``.
    """

    def __init__(self, module: torch.nn.Module, name: str):
        super().__init__()
        self.program = module
        self.name = name
        self.spec = input_spec(module)

    def forward(self, x: torch.Tensor) -> Any:
        self.check(x)
        return self.program(x)

    def check(self, x: Any) -> None:
        """Raises UsageError: ``x`` is not a tensor of the dtype, rank and sizes the program takes."""
        from slabconv.errors import UsageError

        if self.spec is None:
            return
        dtype, axes = self.spec
        wrong = not isinstance(x, torch.Tensor) or x.dtype != dtype or x.ndim != len(axes)
        if not wrong:
            for size, (fixed, low, high) in zip(x.shape, axes, strict=True):
                if (fixed is not None and size != fixed) or size < low or (high is not None and size > high):
                    wrong = True
        if wrong:
            if isinstance(x, torch.Tensor):
                got = f"{str(x.dtype).removeprefix('torch.')} of shape {tuple(x.shape)}"
            else:
                got = f"a {type(x).__name__}"
            raise UsageError(f"{self.name} takes {describe_input(self.spec)}; got {got}")
