"""ONNX originals: ``fuse`` and ``inspect`` of an ``.onnx`` file (``docs/onnx.md``).

The same pipeline as for a checkpoint, on the ONNX graph instead of a traced one::

    load (slabconv.load.onnx_file)  ->  lower, plan, apply (slabconv.engine.onnx_fold)  ->  write model.onnx
        ->  verify (slabconv.verify.onnx_original: question 1 in float64, question 2 in the file's dtype)  ->  report

The fused ``model.onnx`` is the input graph minus its norms: the same input and output names, dynamic axes,
opset and domains, the node names of the nodes that stay; external data stays external (``model.onnx.data``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slabconv.engine import Decision
from slabconv.errors import UsageError
from slabconv.load.onnx_file import OnnxFile, load_ir, read_onnx
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, frozen_heap, no_progress
from slabconv.verify.onnx_original import verify_fold
from slabconv.version import __version__
from slabconv.write.onnx import MARK, ONNX_EXTERNAL_DATA_BYTES, SOURCE_KEY, save_onnx, simplify_model

FUSED_NAME = "model.onnx"


def check_options(path: Path, load: LoadOptions | None, write: WriteOptions | None = None) -> None:
    """Refuse, before anything is read, the options an ONNX original cannot honour.

    Raises:
        UsageError: ``--arch``/``--ema``/``--trust-pickle``/``--image-size`` (a checkpoint's options), ``--stream``
            or ``--no-onnx`` with an ``.onnx`` original.
    """
    load = load or LoadOptions()
    given = [
        flag
        for flag, on in (
            ("--arch", load.arch),
            ("--ema", load.ema),
            ("--trust-pickle", load.trust_pickle),
            ("--image-size", load.image_size),
            ("--stream", write is not None and write.stream),
            ("--no-onnx", write is not None and not write.onnx),
        )
        if on
    ]
    if given:
        raise UsageError(
            f"{path}: {given[0]} does not apply to an ONNX original (its graph is the model, and the fused model is "
            "written as model.onnx); drop it"
        )


def source_of(info: OnnxFile) -> Source:
    """The report's ``source`` block for an ONNX original (format, opset, producer)."""
    return Source(
        path=str(info.path),
        sha256=info.sha256,
        format="onnx",
        dtype=info.dtype,
        input_shape=list(info.input_shape) if info.input_shape else None,
        batch=info.batch,
        extra={
            "opset": info.opset,
            "producer": info.producer,
            "domains": info.domains,
            "external_data": info.external,
            "files_sha256": info.files_sha256,
        },
    )


def fold_onnx(path: Path, progress: Progress = no_progress, as_float64: bool = False) -> tuple[Any, list[Decision]]:
    """Load ``path`` and fold its norms (``slabconv.engine.onnx_fold.fold_file``: the engine's own rules).

    Args:
        as_float64: cast the graph to float64 first (the float64 fold of question 1).

    Returns:
        ``(model, decisions)``: the fused ``onnx_ir.Model`` and one decision per norm.
    """
    from slabconv.engine import onnx_fold

    done: list[str] = []

    def folded(name: str) -> None:
        done.append(name)
        progress("folding norms", len(done), None, f"decided {name}")

    return onnx_fold.fold_file(load_ir(path), str(path), folded, as_float64)


def inspect(path: Path, load: LoadOptions | None = None, progress: Progress = no_progress) -> Report:
    """The fold plan of an ONNX original; nothing is written.

    Raises:
        InputError: as ``read_onnx``; UsageError: as ``check_options``.
    """
    check_options(path, load)
    info = read_onnx(path)
    _, decisions = fold_onnx(path, progress)
    return Report("inspect", source=source_of(info), folds=decisions)


@frozen_heap()
def fuse(
    path: Path,
    out_dir: Path,
    *,
    load: LoadOptions | None,
    verify: VerifyOptions | None,
    write: WriteOptions,
    progress: Progress = no_progress,
) -> Report:
    """Fold every norm of an ONNX original, write ``out_dir/model.onnx`` (+ ``model.onnx.data`` when the original
    kept its weights outside, or they exceed ``ONNX_EXTERNAL_DATA_BYTES``) and ``report.json``, and verify.

    Raises:
        InputError, UsageError: bad input or options (nothing written).
        VerificationError: a check failed (nothing written; the report is ``err.report``).
    """
    from slabconv.pipeline import finish
    from slabconv.write.staging import staging_dir

    check_options(path, load, write)
    progress(f"loading {path}")
    info = read_onnx(path)
    model, decisions = fold_onnx(path, progress)
    simplified = simplify_model(model) if write.simplify else None
    model.metadata_props[MARK] = __version__
    model.metadata_props[SOURCE_KEY] = info.sha256
    report = Report("fuse", source=source_of(info), folds=decisions, out_dir=str(out_dir), mode="in-memory")
    with staging_dir(out_dir, write.force) as tmp:
        target = tmp / FUSED_NAME
        progress(f"writing {FUSED_NAME}")
        size = sum(f.stat().st_size for f in info.files)
        external = save_onnx(model, target, info.external or size > ONNX_EXTERNAL_DATA_BYTES)
        files = [FUSED_NAME, *([external] if external else [])]
        outputs = Outputs(
            files=files,
            safetensors="",
            onnx=FUSED_NAME,
            pt2=None,
            onnx_info={
                "opset": info.opset,
                "external_data": external is not None,
                "dynamic_batch": info.batch is None,
                **({"simplified": simplified} if simplified is not None else {}),
            },  # fmt: skip
        )
        if verify is not None:
            started = time.monotonic()
            report.verification = verify_fold(info, target, verify, progress)
            report.verification.seconds = time.monotonic() - started
        finish(report, tmp, out_dir, outputs)
    return report


__all__ = ["check_options", "fold_onnx", "fuse", "inspect"]
