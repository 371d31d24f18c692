"""What slabconv writes, read back: the fused safetensors metadata contract and output folders.

The metadata contract (written by ``fused_metadata``, read by ``FusedMetadata.read``; nothing else builds or
parses it): ``format`` ``pt``, ``slabconv_version``, ``arch`` (the registered architecture, empty for a
program), ``source_sha256`` (of the checkpoint), ``complete`` (``true`` when every norm folded away, so the
weights load into the norm-free model of the architecture) and ``config`` (the JSON build config).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slabconv import __version__


def fused_metadata(arch: str | None, source_sha256: str, complete: bool, config: Mapping[str, Any]) -> dict[str, str]:
    """The string metadata of a fused safetensors file (see the module docstring)."""
    return {
        "format": "pt",
        "slabconv_version": __version__,
        "arch": arch or "",
        "source_sha256": source_sha256,
        "complete": "true" if complete else "false",
        "config": json.dumps(dict(config)),
    }


@dataclass(frozen=True)
class FusedMetadata:
    """The metadata of a safetensors file slabconv wrote (``read`` gives None for any other file)."""

    version: str
    arch: str | None
    source_sha256: str
    complete: bool
    config: dict[str, Any]

    @classmethod
    def read(cls, metadata: Mapping[str, str], label: str = "the safetensors file") -> FusedMetadata | None:
        """The fused metadata, or None when slabconv did not write the file.

        Raises:
            InputError: the ``config`` entry is over the JSON size or depth limits (``safety.parse_json``), naming
                ``label``.
        """
        from slabconv.errors import InputError
        from slabconv.load.safety import parse_json

        if "slabconv_version" not in metadata:
            return None
        try:
            config = parse_json(metadata.get("config") or "{}", f"{label}: metadata 'config'")
        except InputError as err:
            if "is not valid JSON" not in str(err):
                raise
            config = {}
        return cls(
            version=metadata["slabconv_version"],
            arch=metadata.get("arch") or None,
            source_sha256=metadata.get("source_sha256", ""),
            complete=metadata.get("complete") == "true",
            config=config if isinstance(config, dict) else {},
        )


REPORT = "report.json"


def is_output_folder(path: Path) -> bool:
    """True for a folder ``fuse`` wrote (it holds slabconv's ``report.json``)."""
    return path.is_dir() and (path / REPORT).is_file()
