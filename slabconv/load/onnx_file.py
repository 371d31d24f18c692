"""An ONNX file as an original to fold (``fuse``, ``inspect``, ``verify``): read as data through onnx-ir.

Safety (``docs/security.md``): an ONNX file cannot run code, but its external data names files; every location
must be a relative path inside the model's folder that exists, or the file is refused before any tensor is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slabconv.errors import InputError, first_line
from slabconv.util import sha256_file

ONNX_SUFFIX = ".onnx"
"""How an ONNX original is named (``slabconv.load.formats`` recognises it by this suffix, in any case)."""

_FLOAT_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}
"""ONNX ``TensorProto`` element types of floats, by name (onnx/onnx.proto)."""


@dataclass
class OnnxFile:
    """What an ``.onnx`` original is.

    Attributes:
        path: the file.
        sha256: of the ``.onnx`` file; ``files_sha256`` of it and its external data files.
        files: the ``.onnx`` and its external data files, in order.
        external: its tensors live (partly) in external data files.
        opset: the default-domain opset; ``domains``: every imported domain and version.
        producer: ``producer_name producer_version``.
        dtype: the floating dtype of its first float input (else of its largest float initializer): ``float32``,
            ``float16``, ``bfloat16`` or ``float64``.
        input_name: its first graph input.
        input_shape: one sample's input shape without the batch axis, when every axis but the batch is static.
        batch: the batch size when the batch axis is static, else None.
        token_input: the first input is integer ids.
        inputs: every graph input (``GraphInput``), in order.
    """

    path: Path
    sha256: str
    files: list[Path]
    external: bool
    opset: int
    domains: dict[str, int]
    producer: str
    dtype: str
    input_name: str
    input_shape: tuple[int, ...] | None
    batch: int | None
    token_input: bool
    files_sha256: dict[str, str] = field(default_factory=dict)
    inputs: list[GraphInput] = field(default_factory=list)


@dataclass
class GraphInput:
    """One graph input: ``name``, its numpy ``dtype`` (``bool``, ``int64``, ``float32``...), ``shape`` (one
    sample's shape without the batch axis, None when an axis besides the batch is dynamic)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] | None

    @property
    def integer(self) -> bool:
        return bool(np.issubdtype(self.dtype, np.integer) or self.dtype == np.bool_)


def _graph_input(info: object) -> GraphInput:
    import onnx

    tensor = info.type.tensor_type  # type: ignore[attr-defined]
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    rest = dims[1:]
    elem = tensor.elem_type
    dtype = np.dtype(np.float32) if elem == 16 else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    shape = tuple(int(d or 0) for d in rest) if all(d is not None and d > 0 for d in rest) else None
    return GraphInput(info.name, dtype, shape if dims else None)  # type: ignore[attr-defined]


def _external_locations(proto: object) -> list[str]:
    """The external data file of every initializer stored outside the ``.onnx`` file."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    return [ExternalDataInfo(t).location for t in proto.graph.initializer if uses_external_data(t)]  # type: ignore[attr-defined]


def read_onnx(path: Path | str) -> OnnxFile:
    """Read an ``.onnx`` file's header facts (its weights stay on disk) and check where its external data lives.

    Raises:
        InputError: no such file; not a readable ONNX model; external data outside the model's folder or missing;
            a model without graph inputs.
    """
    import onnx

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError, onnx raises its own types
        raise InputError(
            f"{path}: not a readable ONNX model ({first_line(err, 120)}); export it again, or point at the .pth / "
            ".safetensors / .pt2 file"
        ) from None
    if not proto.graph.node:
        raise InputError(f"{path}: not a readable ONNX model (its graph has no nodes); export it again")
    folder = path.parent.resolve()
    files = [path]
    for location in dict.fromkeys(_external_locations(proto)):
        target = (folder / location).resolve()
        if os.path.isabs(location) or folder not in target.parents:
            raise InputError(
                f"{path}: its external data {location!r} lies outside the model's folder; keep the data files "
                "beside the .onnx file (slabconv reads no other path)"
            )
        if not target.is_file():
            raise InputError(f"{path}: its external data file {location!r} is missing; copy it beside the .onnx file")
        files.append(target)
    inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    if not inputs:
        raise InputError(f"{path}: the model has no inputs; slabconv verifies a model on inputs, export it with one")
    tensor = inputs[0].type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    rest = dims[1:]
    token_input = bool(np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type), np.integer))
    dtype = _FLOAT_TYPES.get(tensor.elem_type) or _weights_dtype(proto)
    domains = {o.domain or "ai.onnx": int(o.version) for o in proto.opset_import}
    return OnnxFile(
        path=path,
        sha256=sha256_file(path),
        files=files,
        external=len(files) > 1,
        opset=domains.get("ai.onnx", 0),
        domains=domains,
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        dtype=dtype,
        input_name=inputs[0].name,
        input_shape=tuple(int(d or 0) for d in rest) if rest and all(d is not None and d > 0 for d in rest) else None,
        batch=dims[0] if dims and dims[0] else None,
        token_input=token_input,
        files_sha256={f.name: sha256_file(f) for f in files},
        inputs=[_graph_input(i) for i in inputs],
    )


def _weights_dtype(proto: object) -> str:
    """The dtype of the largest floating initializer (``float32`` when there is none)."""
    sizes: dict[str, int] = {}
    for init in proto.graph.initializer:  # type: ignore[attr-defined]
        name = _FLOAT_TYPES.get(init.data_type)
        if name:
            sizes[name] = sizes.get(name, 0) + int(np.prod(init.dims, dtype=np.int64))
    return max(sizes, key=lambda k: sizes[k]) if sizes else "float32"


def load_ir(path: Path) -> object:
    """The model as an ``onnx_ir.Model`` (external tensors are read lazily, from the model's folder).

    Raises:
        InputError: onnx-ir cannot read it.
    """
    import onnx_ir as ir

    try:
        return ir.load(str(path))
    except Exception as err:  # noqa: BLE001 - onnx-ir raises what protobuf and its deserializer raise
        raise InputError(f"{path}: not a readable ONNX model ({first_line(err, 120)}); export it again") from None
