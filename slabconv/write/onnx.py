"""ONNX export of a (fused) model with the dynamo exporter, external data above protobuf's limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slabconv.engine.capture import axis_attempts
from slabconv.errors import UnsupportedModelError, UsageError, root_cause
from slabconv.load.onnx_file import PROTOBUF_LIMIT_BYTES
from slabconv.options import BFLOAT16_OPSET, OPSET_RANGE, check_opset  # noqa: F401 (the opset rules, stated once)
from slabconv.util import output_names_of, quiet
from slabconv.version import __version__

# stay under that. Above this many bytes of weights (the threshold torch's exporter uses), the weights go to
# ``<name>.onnx.data`` beside the ``.onnx`` (ONNX external data), which onnx and onnxruntime read from a path.
ONNX_EXTERNAL_DATA_BYTES = 1536 * 1024 * 1024
MARK = "slabconv_version"
"""The ONNX ``metadata_props`` key every file slabconv writes carries (so ``--force`` replaces only those)."""
SOURCE_KEY = "slabconv_source_sha256"
"""The ``metadata_props`` key naming the sha256 of the file an ``.onnx`` slabconv wrote was made from: the ONNX
original of a fused ``model.onnx``, the checkpoint of ``export`` (so ``verify SOURCE FILE`` knows whether
question 1 applies: ``slabconv.verify.sides.fold_relation``)."""
FOLDED_KEY = "slabconv_folded"
"""``true`` when the file is a fold of its source, ``false`` for ``export --no-fuse`` (absent: a fold)."""
ARCH_KEY = "slabconv_arch"
"""The architecture of the source, when it has a registered one."""
WEIGHTS_KEY = "slabconv_source_weights"
"""Which weights of a training checkpoint were folded (``model``, ``state_dict_ema`` with ``--ema``...)."""

NORM_AFFINE_KEY = "slabconv_norm_affine"
"""``true`` when the fold took the affine of the LayerNorms / RMSNorms / GroupNorms too (``--fold-norm-affine``):
``verify`` folds the reference's norm affines too before it compares the tensors (``slabconv.engine.norm_affine``)."""


def provenance(
    source_sha256: str, arch: str | None, folded: bool, norm_affine: bool = False, source_weights: str | None = None
) -> dict[str, str]:
    """The ``metadata_props`` recording where an ``.onnx`` came from (``SOURCE_KEY``, ``FOLDED_KEY``,
    ``ARCH_KEY``, ``NORM_AFFINE_KEY`` for a fold with ``--fold-norm-affine``, ``WEIGHTS_KEY`` for the weights of a
    training checkpoint): what ``slabconv.verify.sides`` reads to know whether question 1 applies, and how the
    reference is folded for it."""
    made = {SOURCE_KEY: source_sha256, FOLDED_KEY: "true" if folded else "false", ARCH_KEY: arch or ""}
    made.update({NORM_AFFINE_KEY: "true"} if norm_affine else {})
    return {**made, WEIGHTS_KEY: source_weights} if source_weights else made


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, what decides whether its ONNX file stores them outside."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def opset_for(model: torch.nn.Module) -> int | None:
    """The opset to export ``model`` at: ``BFLOAT16_OPSET`` for bfloat16 weights, else the exporter's default."""
    dtypes = {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
    return BFLOAT16_OPSET if torch.bfloat16 in dtypes else None


def _name_axes(model: Any, axes: dict[int, Any]) -> None:
    """Name the dynamic axes of an ONNX model translated from an ``ExportedProgram`` as a direct export names them
    (``batch``, ``sequence``): the program's symbols (``s77``...) become those names on every value, in place.
    Uses onnx-ir's values and ``SymbolicDim``."""
    import re

    import onnx_ir as ir

    names = {0: "batch", 1: "sequence"}
    first = model.graph.inputs[0]
    rename = {
        str(dim.value): names[axis]
        for axis, dim in enumerate(first.shape or ())
        if axis in axes and axis in names and isinstance(dim, ir.SymbolicDim) and dim.value
    }
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")

    def renamed(value: Any) -> None:
        if value.shape is None:
            return
        dims = [
            ir.SymbolicDim(pattern.sub(lambda m: rename[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value
            else d
            for d in value.shape
        ]
        value.shape = ir.Shape(dims)

    for value in [*model.graph.inputs, *model.graph.outputs]:
        renamed(value)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            renamed(value)


def export_onnx(
    model: torch.nn.Module,
    example: torch.Tensor,
    path: Path,
    opset: int | None = None,
    program: tuple[torch.export.ExportedProgram, dict[str, Any]] | None = None,
    simplify: bool = False,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Export ``model`` to ONNX with the dynamo exporter, input ``input`` and output ``output``; with ``simplify``,
    onnxscript's optimizer (and onnxslim where installed) runs on it before it is saved (``simplify_model``; the info
    then has ``simplified``).

    ``metadata``: more ``metadata_props`` (``SOURCE_KEY``, ``FOLDED_KEY``, ``ARCH_KEY``) beside ``MARK``.

    ``program``: the ``(ExportedProgram, info)`` of ``model`` that ``slabconv.write.pt2.export_program`` made
    (``fuse`` exports the fused model once for ``model.pt2`` and ``model.onnx``); the exporter then translates it
    as it is, with its dynamic axes, instead of capturing ``model`` again.

    Axis 0 (batch) is dynamic when the model allows it; otherwise the batch size of ``example`` is fixed and
    the returned info says so. A graph captured with a symbolic sequence axis (a language model) keeps it: the
    input is ``(batch, sequence)``. Weights over ``ONNX_EXTERNAL_DATA_BYTES`` go to external data
    ``<path>.data`` beside ``path``. A bfloat16 model is exported at opset ``BFLOAT16_OPSET`` (a valid model that
    passes ``onnx.checker``; onnxruntime's CPU provider has no bfloat16 kernels for it). ``opset`` asks for
    another opset (``check_opset`` first); the file is checked to have it.

    Returns:
        ``{"dynamic_batch": bool, "dynamic_sequence": bool, "opset": int, "external_data": "<name>.data" or None}``.

    Raises:
        UnsupportedModelError: the exporter fails both with and without a dynamic batch axis.
        UsageError: the file cannot be written, or the exporter wrote another opset than ``opset``.
    """
    last: Exception | None = None
    attempts: list[tuple[Any, Any, dict[int, Any] | None]]  # (what to export, its dynamic_shapes, named axes)
    if program is not None:
        exported, info = program
        named = {0: "batch", **({1: "sequence"} if info["dynamic_sequence"] else {})}
        attempts = [(exported, None, named if info["dynamic_batch"] else None)]
    else:
        attempts = [(model, (axes,) if axes else None, axes) for axes in axis_attempts(model)]
    for source, shapes, axes in attempts:
        try:
            with quiet():
                onnx_program = torch.onnx.export(
                    source,
                    (example,),
                    dynamo=True,
                    dynamic_shapes=shapes,
                    input_names=["input"],
                    output_names=(
                        output_names_of(getattr(source, "call_spec", None) and source.call_spec.out_spec) or ["output"]
                    ),
                    opset_version=opset or opset_for(model),
                    verbose=False,
                )
            assert onnx_program is not None
            if program is not None:
                _name_axes(onnx_program.model, axes or {})
        except Exception as err:  # noqa: BLE001 - the exporter raises many types
            last = err
            continue
        external = weight_bytes(model) > ONNX_EXTERNAL_DATA_BYTES
        simplified = simplify_model(onnx_program.model) if simplify else None
        try:
            with quiet():
                onnx_program.model.metadata_props[MARK] = __version__
                onnx_program.model.metadata_props.update(metadata or {})
                save_onnx(onnx_program.model, path, external)
        except OSError as err:
            raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
        imports = onnx_program.model.opset_imports  # the IR model's: model_proto would serialise a second copy
        written = imports.get("", imports.get("ai.onnx", 0))
        if opset is not None and written != opset:
            raise UsageError(
                f"--opset {opset}: the ONNX exporter cannot write this model at opset {opset} (it wrote {written}); "
                f"leave out --opset, or choose {written}"
            )
        # what the file takes, read from its input: the exporter fixes an axis the program specialised, though asked
        dims = [not isinstance(d, int) for d in onnx_program.model.graph.inputs[0].shape or ()]  # ir.SymbolicDim
        return {
            "dynamic_batch": bool(axes) and dims[:1] == [True],
            "dynamic_sequence": bool(axes and 1 in axes) and dims[1:2] == [True],
            "opset": int(written),
            "external_data": f"{path.name}.data" if external else None,
            **({"simplified": simplified} if simplified is not None else {}),
        }
    raise UnsupportedModelError(
        f"ONNX export failed: {root_cause(last) if last else 'unknown error'}; --no-onnx writes the other files"
    )


SIMPLIFIED_KEY = "slabconv_simplified"
"""Metadata of a ``model.onnx`` that ``--simplify`` simplified: the simplifiers whose output it kept, in order,
``"onnxscript 0.7.2, onnxslim 0.1.98"`` (``verify`` simplifies the fold of the original, rounded to the file's
dtypes, with the same ones before it compares the tensors: ``slabconv.verify.onnx_original.onnx_fold64``)."""


def simplify_model(model: Any) -> dict[str, Any]:
    """``fuse --simplify``: onnxscript's optimizer, then onnxslim where installed, on an onnx-ir ``model``, in place
    (``slabconv.engine.onnx_fold.simplify_graph``), and the ``SIMPLIFIED_KEY`` mark naming the ones kept.

    Returns:
        ``simplify_graph``'s info: ``{"nodes_before", "nodes_after", "simplifiers"}`` (and ``"onnxslim"``, why its
        output was not kept, when it was not; ``"onnxscript"``, why onnxscript's optimizer did not run, when it did
        not).
    """
    from slabconv.engine.onnx_fold import simplify_graph

    info = simplify_graph(model)
    model.metadata_props[SIMPLIFIED_KEY] = ", ".join(info["simplifiers"])
    return info


def _metadata(path: Path) -> dict[str, str]:
    """The ``metadata_props`` of the ``.onnx`` file at ``path`` (its weights not read); empty where onnx cannot
    read it (then it is no file slabconv wrote)."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - anything protobuf cannot parse is not ours
        return {}
    return {p.key: p.value for p in proto.metadata_props}


def simplified(proto: Any) -> list[str] | None:
    """The simplifiers ``--simplify`` ran on an ``.onnx`` file, read from its ``onnx.ModelProto`` (``proto``, its
    ``metadata_props``: ``SIMPLIFIED_KEY``, ``["onnxscript 0.7.2", "onnxslim 0.1.98"]``), or None when it was not
    simplified (or is no file slabconv wrote)."""
    marks = next((p.value for p in proto.metadata_props if p.key == SIMPLIFIED_KEY), None)
    return [s.strip() for s in marks.split(",") if s.strip()] if marks else None


def save_onnx(model: Any, path: Path, external: bool) -> str | None:
    """Write an onnx-ir ``model`` to ``path``: with ``external``, its initializers to ``<path name>.data`` beside it
    (``onnx_ir.save``, one tensor at a time); otherwise one self-contained file, written without holding it whole.

    A single-file save through ``onnx_ir.save`` (as ``ONNXProgram.save`` does) builds the whole ``ModelProto`` and
    then its serialised bytes: twice the weights on top of the model (46 MiB above a DeiT-Tiny, 2.8 GB above a
    1.4 GB model). Here the model is serialised without its initializers' values, then each initializer as a
    ``ModelProto`` holding only that tensor in its graph, appended: protobuf parses concatenated messages as one
    merged message (a singular message field, ``graph``, merged; a repeated one, ``graph.initializer``,
    appended), so ``onnx.load`` reads the same ``ModelProto`` as from ``onnx_ir.save`` (a test compares them),
    while only one tensor is serialised at a time. The model is unchanged afterwards (each initializer's
    ``const_value`` is put back). Initializers of subgraphs (an ``If`` branch) stay in the head.

    Args:
        model: an ``onnx_ir.Model`` (``ONNXProgram.model``, or a folded ONNX input).
        path: the ``.onnx`` file to write.
        external: write the weights as external data.

    Returns:
        The external data file's name, or None for a single file.

    Raises:
        OSError: the file cannot be written.
    """
    import logging

    import onnx
    import onnx_ir as ir

    if external:
        data = f"{path.name}.data"
        ir.save(model, str(path), external_data=data)
        return data
    values = [v for v in model.graph.initializers.values() if v.const_value is not None]
    tensors = [v.const_value for v in values]
    serde_log = logging.getLogger(ir.serde.__name__)  # it warns about each initializer left without a value
    level = serde_log.level
    serde_log.setLevel(logging.ERROR)
    try:
        for value in values:
            value.const_value = None
        head = ir.serde.serialize_model(model)
    finally:
        for value, tensor in zip(values, tensors, strict=True):
            value.const_value = tensor
        serde_log.setLevel(level)
    with open(path, "wb") as f:
        f.write(head.SerializeToString())
        del head
        for value in values:
            piece = onnx.ModelProto()
            proto = piece.graph.initializer.add()
            value.const_value.name = value.name  # as onnx_ir's serialiser names an initializer's tensor
            ir.serde.serialize_tensor_into(proto, value.const_value)
            f.write(piece.SerializeToString())
    return None


def onnx_files(path: Path) -> list[Path]:
    """``path`` and the external data files it names (to hash and to move together)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    names = {ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)}
    return [path, *(path.parent / n for n in sorted(names))]


def written_by_slabconv(path: Path) -> bool:
    """True when ``path`` is an ONNX file whose ``metadata_props`` carry ``MARK`` (slabconv wrote it)."""
    if not path.is_file() or path.is_symlink() or path.stat().st_size > PROTOBUF_LIMIT_BYTES:
        return False
    return MARK in _metadata(path)
