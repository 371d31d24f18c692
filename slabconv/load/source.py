"""Where a model came from, as the report names it: made by the load stage (and by verification for its two
sides), carried unchanged into ``report.json`` by ``slabconv.report``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Source:
    """Where a model came from (the report's ``source`` / ``reference`` / ``candidate`` blocks).

    Attributes:
        path: the file or folder given.
        sha256: hex sha256 of the file (of its files, in order, for a folder).
        format: what the input format's entry records (``InputFormat.formats`` in
            ``slabconv.load.formats.FORMATS``: ``training-checkpoint``, ``safetensors``, ``hf-bin-sharded``,
            ``onnx``...; all listed in docs/report.md), or ``slabconv-output`` (a folder ``fuse`` wrote).
        arch: the registered architecture, or None (a program, an ONNX file).
        weights: which weights were read (``model``, ``state_dict_ema``...), or None.
        dtype: the weights' floating dtype.
        input_shape: one sample's input shape, without the batch axis (None when not fixed).
        batch: the batch size a static program was recorded with, or None when the batch is dynamic.
        extra: format-specific facts (``num_hidden_layers`` and ``shards`` of a streamed fold, ``runtime`` of a
            verify side, ``files_sha256`` of an ONNX with external data).
    """

    path: str
    sha256: str | None
    format: str
    arch: str | None = None
    weights: str | None = None
    dtype: str | None = None
    input_shape: list[int] | None = None
    batch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(self.extra)
        return out
