"""ONNX originals (``docs/onnx.md``): the door ``slabconv.pipeline.run_fuse`` and ``run_inspect`` open for an
``.onnx`` file.

The stages of every fuse, on the ONNX graph::

    read (slabconv.load.onnx_file)  ->  prepare, lower, plan, apply (slabconv.engine.onnx_fold: the engine's rules)
        ->  write model.onnx  ->  verify (slabconv.verify.verifier, as ``verify ORIGINAL.onnx FOLDER`` runs it)

The fused ``model.onnx`` is the prepared input graph minus its norms: the same input and output names, dynamic axes,
opset and domains, the node names of the nodes that stay; external data stays external (``model.onnx.data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slabconv.engine import Decision, LayerRange, folds_norm_affine
from slabconv.errors import InputError, UsageError
from slabconv.load.onnx_file import OnnxFile, check_foldable, load_ir, read_onnx
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs
from slabconv.util import Progress, no_progress
from slabconv.verify.results import Verification
from slabconv.version import __version__
from slabconv.write.onnx import (
    FOLDED_KEY,
    MARK,
    NORM_AFFINE_KEY,
    ONNX_EXTERNAL_DATA_BYTES,
    SOURCE_KEY,
    save_onnx,
    simplify_model,
)

FUSED_NAME = "model.onnx"


_NOT_FOR_ONNX = {
    "--dtype": "the fused model.onnx keeps the original's dtype",
    "--opset": "the fused model.onnx keeps the original's opset",
    "--input-shape": "the graph's inputs have their own shapes; pass --inputs NPZ for dynamic axes",
    "--generate": "greedy generation is checked for language-model checkpoints and folders, not ONNX graphs",
}
"""Why an option cannot be honoured for an ONNX original, where the reason is more than that it is a checkpoint's."""


def check_options(
    path: Path, load: LoadOptions | None, write: WriteOptions | None = None, verify: VerifyOptions | None = None
) -> None:
    """Refuse, before anything is read, the options an ONNX original cannot honour: an option is done or refused,
    never ignored (a fuse that took ``--dtype float16`` and wrote float32 would claim what it did not do).

    Raises:
        UsageError: ``--arch``/``--ema``/``--trust-pickle``/``--image-size``/``--input-shape`` (a checkpoint's
            options), ``--stream``, ``--no-onnx``, ``--dtype``, ``--opset`` or ``--generate N`` (N > 0) with an
            ``.onnx`` original, naming the first one given.
    """
    load = load or LoadOptions()
    given = [
        flag
        for flag, on in (
            ("--arch", load.arch),
            ("--ema", load.ema),
            ("--trust-pickle", load.trust_pickle),
            ("--image-size", load.image_size),
            ("--input-shape", load.input_shape),
            ("--stream", write is not None and write.stream),
            ("--no-onnx", write is not None and not write.onnx),
            ("--dtype", write is not None and write.dtype),
            ("--opset", write is not None and write.opset is not None),
            ("--generate", verify is not None and bool(verify.generate)),
        )
        if on
    ]
    if given:
        reason = _NOT_FOR_ONNX.get(given[0], "its graph is the model, and the fused model is written as model.onnx")
        raise UsageError(f"{path}: {given[0]} does not apply to an ONNX original ({reason}); drop it")


def fold_onnx(
    path: Path,
    progress: Progress = no_progress,
    as_float64: bool = False,
    norm_affine: bool = False,
    ranges: list[LayerRange] | None = None,
) -> tuple[Any, list[Decision]]:
    """Load ``path`` and fold its norms (``slabconv.engine.onnx_fold.fold_file``: the engine's own rules).

    Args:
        as_float64: cast the graph to float64 after planning (the float64 fold of question 1).
        norm_affine: also fold the affine of every LayerNormalization / RMSNormalization / GroupNormalization
            (``LoadOptions.fold_norm_affine``).
        ranges: when given, each folded layer's weight ranges are appended to it (``onnx_apply.folded_values``) and
            the flagged ones warned of in the decisions.

    Returns:
        ``(model, decisions)``: the fused ``onnx_ir.Model`` and one decision per norm.
    """
    from slabconv.engine import onnx_fold

    done: list[str] = []

    def folded(name: str) -> None:
        done.append(name)
        progress("folding norms", len(done), None, f"decided {name}")

    model = load_ir(path)
    try:
        return onnx_fold.fold_file(model, str(path), folded, as_float64, norm_affine=norm_affine, ranges=ranges)
    except InputError as err:  # a damaged norm (NaN statistics, running_var + eps <= 0): name the file too
        if str(err).startswith(f"{path}"):
            raise
        raise InputError(f"{path}: {err}".replace("the checkpoint is damaged", "the file is damaged")) from None


def open_onnx(
    path: Path,
    load: LoadOptions | None,
    write: WriteOptions,
    progress: Progress = no_progress,
    verify: VerifyOptions | None = None,
) -> OnnxGraph:
    """An ONNX original read and folded (``fold_onnx``): the door ``slabconv.pipeline.run_fuse`` and ``run_inspect``
    take. ``verify``: the verification options, which ``check_options`` holds to what the door honours.

    Raises:
        InputError: as ``read_onnx`` and ``check_foldable``; UsageError: as ``check_options``.
    """
    check_options(path, load, write, verify)
    progress(f"loading {path}")
    info = read_onnx(path)
    check_foldable(path, info.proto)
    ranges: list[LayerRange] = []
    model, decisions = fold_onnx(path, progress, norm_affine=bool(load and load.fold_norm_affine), ranges=ranges)
    return OnnxGraph(info, model, decisions, ranges)


@dataclass
class OnnxGraph:
    """An ONNX original and its fold (a door of ``slabconv.pipeline.run_fuse``): written as ``model.onnx`` (+
    ``model.onnx.data`` when the original kept its weights outside, or they exceed ``ONNX_EXTERNAL_DATA_BYTES``),
    verified with onnxruntime (``slabconv.verify.onnx_original``)."""

    info: OnnxFile
    model: Any
    decisions: list[Decision]
    layer_ranges: list[LayerRange] | None = None
    mode: str = "in-memory"

    def source(self) -> Source:
        return self.info.source()

    def plan_note(self) -> dict[str, str] | None:
        return None

    def ranges(self) -> list[LayerRange] | None:
        """Each folded layer's weight ranges, measured on the initializers before the fold wrote them
        (``onnx_apply.folded_values``)."""
        return self.layer_ranges

    def check(self, verify: VerifyOptions | None, write: WriteOptions) -> None:
        return None

    def write(self, folder: Path, write: WriteOptions, progress: Progress) -> tuple[Outputs, dict[str, str]]:
        info, model = self.info, self.model
        simplified = simplify_model(model) if write.simplify else None
        model.metadata_props[MARK] = __version__
        model.metadata_props[SOURCE_KEY] = info.sha256
        # a fold, whatever the original says of itself (``export --no-fuse`` writes "false": kept, verify would skip
        # question 1); the norm-affine mark is this fold's, never the original's
        model.metadata_props[FOLDED_KEY] = "true"
        model.metadata_props.pop(NORM_AFFINE_KEY, None)
        if folds_norm_affine(self.decisions):  # verify folds the original's norm affines too
            model.metadata_props[NORM_AFFINE_KEY] = "true"
        from slabconv.engine.onnx_apply import list_initializers

        list_initializers(model)  # IR 3: the constants the preparation and the simplifiers made are inputs too
        progress(f"writing {FUSED_NAME}")
        size = sum(f.stat().st_size for f in info.files)
        external = save_onnx(model, folder / FUSED_NAME, info.external or size > ONNX_EXTERNAL_DATA_BYTES)
        outputs = Outputs(
            files=[FUSED_NAME, *([external] if external else [])],
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
        return outputs, {}

    def verify(self, folder: Path, opts: VerifyOptions, write: WriteOptions, progress: Progress) -> Verification:
        from slabconv.verify import sides, verifier

        candidate = sides.output_side(folder, Source(str(folder), None, "slabconv-output"))
        return verifier.verify(sides.onnx_side(self.info.path), candidate, opts, just_folded=True, progress=progress)


__all__ = ["OnnxGraph", "check_options", "fold_onnx", "open_onnx"]
