"""The reports, as typed objects: what ``report.json`` and ``--json`` hold (``docs/report.md``), made in one place.

Every command returns one of these; ``to_dict`` gives the JSON that ``docs/report.schema.json`` describes (the
tests check every report they produce against it), the Rich rendering and JUnit read the same objects.
Non-finite numbers (an original that overflows its dtype) become ``null`` in JSON: JSON has no Infinity.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slabconv.load.source import Source
from slabconv.verify.results import Verification
from slabconv.version import __version__

if TYPE_CHECKING:  # only an annotation here: the report is read without importing the engine (and torch)
    from slabconv.engine import Decision


def finite_json(value: Any) -> Any:
    """``value`` with every NaN / Infinity float replaced by None, recursively (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


@dataclass
class Outputs:
    """The files an output folder holds.

    Attributes:
        files: every file written, by name (``report.json`` aside): what ``--force`` may later replace.
        safetensors: the weights: ``model.safetensors``, or the index ``model.safetensors.index.json`` of shards.
        onnx: ``model.onnx`` or None (``--no-onnx``).
        pt2: ``model.pt2`` or None (``--no-pt2``).
        hf_folder: True when the folder is also a Hugging Face model folder (a fused language model).
        onnx_info: how the ONNX was exported (``dynamic_batch``, ``opset``, ``external_data``).
        sha256: hex sha256 of each file in ``files``.
    """

    files: list[str]
    safetensors: str
    onnx: str | None = None
    pt2: str | None = None
    hf_folder: bool = False
    onnx_info: dict[str, Any] | None = None
    decoder_onnx: str | None = None
    sha256: dict[str, str] = field(default_factory=dict)


@dataclass
class Summary:
    """Counts over ``folds``: norms found, folded away, kept (as an affine or as they were)."""

    norms: int
    folded: int
    kept: int

    @classmethod
    def of(cls, folds: list[Decision]) -> Summary:
        folded = sum(d.action.startswith("folded") for d in folds)
        return cls(len(folds), folded, len(folds) - folded)


@dataclass
class Report:
    """What a command did. Which blocks are set depends on the command:

    - ``inspect``: ``source``, ``folds``, ``summary``, ``ranges``.
    - ``fuse``: also ``outputs``, ``out_dir``, ``verification`` (None with ``--no-verify``), ``mode``
      (``in-memory`` or ``streamed``) and for a streamed fold ``plan`` (how it was planned).
    - ``export``: ``source``, ``folds``, ``summary``, ``ranges``, ``outputs`` (the one ONNX file).

    ``ranges``: each folded layer's weight ranges before and after its folds (``engine.ranges.LayerRange``, its
    ``to_dict`` the JSON), None where they were not measured (an ONNX original).
    - ``verify``: ``reference``, ``candidate``, ``verification``.
    - ``bench``: ``source``, ``bench``.
    """

    command: str
    source: Source | None = None
    folds: list[Decision] | None = None
    outputs: Outputs | None = None
    out_dir: str | None = None
    verification: Verification | None = None
    reference: Source | None = None
    candidate: Source | None = None
    mode: str | None = None
    plan: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    ranges: list[Any] | None = None
    slabconv_version: str = __version__

    @property
    def summary(self) -> Summary | None:
        return Summary.of(self.folds) if self.folds is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``docs/report.md`` (only the blocks this command sets)."""
        out: dict[str, Any] = {"slabconv_version": self.slabconv_version, "command": self.command}
        if self.mode is not None:
            out["mode"] = self.mode
        for name in ("source", "reference", "candidate"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value.to_dict()
        if self.folds is not None:
            out["folds"] = [d.to_dict() for d in self.folds]
            out["summary"] = asdict(self.summary) if self.summary else None
        if self.ranges is not None:
            out["ranges"] = [r.to_dict() for r in self.ranges]
        if self.plan is not None:
            out["plan"] = self.plan
        if self.outputs is not None:
            out["outputs"] = asdict(self.outputs)
        elif self.command == "fuse":
            out["outputs"] = None  # a fuse that failed wrote nothing and names no file
        if self.out_dir is not None:
            out["out_dir"] = self.out_dir
        if self.command in ("fuse", "verify"):
            out["verification"] = self.verification.to_dict() if self.verification is not None else None
        if self.bench is not None:
            out.update(self.bench)
        return finite_json(out)

    def rename(self, old: Path, new: Path) -> None:
        """Replace the path ``old`` by ``new`` in every text of the report (check names, notes, details): what was
        measured in a staging folder is reported under the folder the user asked for."""
        _rename(self, str(old), str(new))
        _rename(self, old.name, new.name)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, path: Path) -> None:
        """Write ``to_json`` to ``path``."""
        Path(path).write_text(self.to_json(), encoding="utf-8")


def _rename(obj: Any, old: str, new: str) -> Any:
    """``obj`` with ``old`` replaced by ``new`` in every string, in place where ``obj`` is mutable."""
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        obj[:] = [_rename(v, old, new) for v in obj]
    elif isinstance(obj, dict):
        for key in list(obj):
            obj[key] = _rename(obj[key], old, new)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for name in vars(obj):
            setattr(obj, name, _rename(getattr(obj, name), old, new))
    return obj
