"""ONNX originals: ``fuse``, ``inspect`` and ``verify`` of an ``.onnx`` file (``docs/onnx.md``).

The same pipeline as for a checkpoint, on the ONNX graph instead of a traced one::

    load (slabconv.load.onnx_file)  ->  fold (slabconv.engine.onnx_graph, onnx-ir)  ->  write model.onnx
        ->  verify (question 1 in float64, question 2 in the file's dtype, both with onnxruntime)  ->  report

The fused ``model.onnx`` is the input graph minus its norms: the same input and output names, dynamic axes,
opset and domains, the node names of the nodes that stay; external data stays external (``model.onnx.data``).

Verification (``slabconv.verify.policy``):

1. Question 1, *is the fold exact?*: the original graph with every floating tensor and type cast to float64, and
   the same fold made on that float64 graph, both run by onnxruntime (onnx's reference evaluator where
   onnxruntime has no float64 kernel) on the same inputs: relative error ``<= EXACT_RTOL``. Every tensor of the
   written ``model.onnx`` must equal that float64 fold rounded to its dtype (0 units in the last place).
2. Question 2: the written ``model.onnx`` under onnxruntime (optimisations off and on) in the file's dtype, and
   the original in its dtype, against the float64 original: ``e_fused <= max(tol_dtype, 2 * e_orig)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv import __version__
from slabconv.engine import Decision
from slabconv.errors import InputError, UsageError, VerificationError, first_line
from slabconv.load import safety
from slabconv.load.onnx_file import OnnxFile, load_ir, read_onnx
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report, Source
from slabconv.util import Progress, no_progress, sha256_file
from slabconv.verify import judge
from slabconv.verify.inputs import check_token_ids, read_inputs
from slabconv.verify.integrity import check_onnx_file
from slabconv.verify.results import IntegrityCheck, Verification
from slabconv.verify.run import Reference, check_reference, output_names, question_2, runtime_summary
from slabconv.verify.runtimes import Runtime, RuntimeUnavailable, onnx_runtimes, run_batched
from slabconv.write.onnx import MARK, ONNX_EXTERNAL_DATA_BYTES

FUSED_NAME = "model.onnx"

SOURCE_KEY = "slabconv_source_sha256"
"""The fused ``model.onnx``'s ``metadata_props`` key naming the sha256 of the ``.onnx`` it was folded from (so
``verify ORIGINAL.onnx FUSED`` knows question 1 applies)."""

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}


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
    """Load ``path`` and fold its norms (``slabconv.engine.onnx_graph.fold_graph``).

    Args:
        as_float64: cast the graph to float64 first (the float64 fold of question 1).

    Returns:
        ``(model, decisions)``: the fused ``onnx_ir.Model`` and one decision per norm.
    """
    from slabconv.engine import onnx_graph

    model: Any = load_ir(path)
    if as_float64:
        to_float64(model)
    shapes = onnx_graph.infer_shapes(str(path))
    done: list[str] = []

    def folded(name: str) -> None:
        done.append(name)
        progress("folding norms", len(done), None, f"decided {name}")

    return model, onnx_graph.fold_graph(model, shapes, folded)


def inspect(path: Path, load: LoadOptions | None = None, progress: Progress = no_progress) -> Report:
    """The fold plan of an ONNX original; nothing is written.

    Raises:
        InputError: as ``read_onnx``; UsageError: as ``check_options``.
    """
    check_options(path, load)
    info = read_onnx(path)
    _, decisions = fold_onnx(path, progress)
    return Report("inspect", source=source_of(info), folds=decisions)


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
    import onnx_ir as ir

    from slabconv.write.staging import staging_dir

    check_options(path, load, write)
    progress(f"loading {path}")
    info = read_onnx(path)
    model, decisions = fold_onnx(path, progress)
    model.metadata_props[MARK] = __version__
    model.metadata_props[SOURCE_KEY] = info.sha256
    report = Report("fuse", source=source_of(info), folds=decisions, out_dir=str(out_dir), mode="in-memory")
    with staging_dir(out_dir, write.force) as tmp:
        target = tmp / FUSED_NAME
        progress(f"writing {FUSED_NAME}")
        size = sum(f.stat().st_size for f in info.files)
        external = f"{FUSED_NAME}.data" if info.external or size > ONNX_EXTERNAL_DATA_BYTES else None
        ir.save(model, str(target), external_data=external)
        files = [FUSED_NAME, *([external] if external else [])]
        outputs = Outputs(
            files=files,
            safetensors="",
            onnx=FUSED_NAME,
            pt2=None,
            onnx_info={"opset": info.opset, "external_data": external is not None, "dynamic_batch": info.batch is None},
        )
        if verify is not None:
            started = time.monotonic()
            report.verification = verify_fold(info, target, verify, progress)
            report.verification.seconds = time.monotonic() - started
        outputs.sha256 = {name: sha256_file(tmp / name) for name in outputs.files}
        report.outputs = outputs
        report.rename(tmp, out_dir)
        report.write(tmp / "report.json")
        if report.verification is not None and not report.verification.passed:
            raise VerificationError(
                "the fused model is not equivalent: " + report.verification.failure_line() + "; nothing was written",
                report,
            )
    return report


# --------------------------------------------------------------------------------------------- verification


def to_float64(model: Any) -> None:
    """Cast every floating tensor, value type and ``Cast``/``Constant`` target of an ``onnx_ir.Model`` to float64,
    in place (the float64 evaluation of question 1). Integer tensors (ids, shapes) stay as they are."""
    import onnx_ir as ir

    floats = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    graph = model.graph

    def cast_tensor(tensor: Any) -> Any:
        if tensor is None or tensor.dtype not in floats:
            return None
        return ir.tensor(np.asarray(tensor.numpy(), dtype=np.float64), name=tensor.name)

    values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
    for node in graph.all_nodes():
        values += list(node.outputs)
        for name, attribute in list(node.attributes.items()):
            if attribute.type == ir.AttributeType.TENSOR:
                new = cast_tensor(attribute.value)
                if new is not None:
                    node.attributes[name] = ir.AttrTensor(name, new)
        if node.op_type == "Cast" and node.attributes.get("to") is not None:
            if ir.DataType(node.attributes["to"].value) in floats:
                node.attributes["to"] = ir.AttrInt64("to", ir.DataType.DOUBLE.value)
    for value in values:
        if value.const_value is not None:
            new = cast_tensor(value.const_value)
            if new is not None:
                value.const_value = new
        if value.dtype in floats:
            value.dtype = ir.DataType.DOUBLE


def _float64_runner(model: Any, round_to: Any) -> tuple[Callable[[np.ndarray], list[np.ndarray]], str]:
    """Run a float64 ``onnx_ir.Model``: onnxruntime, else onnx's reference evaluator (every op, in numpy).

    Returns:
        ``(run, which)``: ``which`` names the evaluator (``onnxruntime`` or ``onnx.reference``).
    """
    import onnx_ir as ir

    proto = ir.to_proto(model)
    name = proto.graph.input[0].name
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])

        def run(x: np.ndarray) -> list[np.ndarray]:
            return [np.asarray(o, dtype=np.float64) for o in session.run(None, {name: _round(x, round_to)})]

        return run, "onnxruntime"
    except Exception:  # noqa: BLE001 - onnxruntime lacks some float64 kernels: the reference evaluator has all
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(proto)

        def run(x: np.ndarray) -> list[np.ndarray]:
            return [np.asarray(o, dtype=np.float64) for o in evaluator.run(None, {name: _round(x, round_to)})]

        return run, "onnx.reference: onnxruntime lacks a float64 kernel for one of its ops"


def _round(x: np.ndarray, dtype: Any) -> np.ndarray:
    """Float inputs rounded to the file's dtype, then float64 (integer ids as they are)."""
    if not np.issubdtype(x.dtype, np.floating):
        return x
    return np.asarray(x, dtype=dtype).astype(np.float64) if dtype is not None else x.astype(np.float64)


def embedding_rows(path: Path, input_name: str) -> int | None:
    """The row count of the embedding table the integer input indexes (``Gather(table, ids)``), or None."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    tables = {t.name: list(t.dims) for t in proto.graph.initializer}
    names = {input_name}
    for node in proto.graph.node:
        if node.op_type == "Cast" and node.input and node.input[0] in names:
            names.add(node.output[0])
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in names and node.input[0] in tables:
            dims = tables[node.input[0]]
            return int(dims[0]) if dims else None
    return None


def choose_onnx_inputs(info: OnnxFile, opts: VerifyOptions) -> tuple[np.ndarray, str, str | None]:
    """The verification inputs: ``--inputs`` (an ``.npz``), else seeded samples drawn from the graph's input type
    and shape: standard normal floats, or token ids below the embedding's row count.

    Raises:
        UsageError: a dynamic axis other than the batch, or integer inputs whose range no embedding gives.
        InputError: an unreadable ``.npz`` or one of the wrong shape.
    """
    if opts.inputs:
        path = Path(opts.inputs)
        if not path.exists():
            raise InputError(f"{path}: no such file (--inputs)")
        with safety.open_regular(path, "--inputs") as f:  # one open: the digest is of the array read
            x = read_inputs(f, path, info.input_shape, integer=info.token_input)
            digest = safety.sha256_open(f)
        if info.token_input:
            check_token_ids(x, path, embedding_rows(info.path, info.input_name))
        return x, str(path), digest
    if info.input_shape is None:
        raise UsageError(
            f"{info.path}: the input {info.input_name!r} has dynamic axes besides the batch; pass --inputs NPZ"
        )
    samples, seed = opts.sample_count(), opts.seed
    if samples < 1:
        raise UsageError(f"--samples must be at least 1 (got {samples})")
    rng = np.random.default_rng(seed)
    label = f"random(seed={seed}, samples={samples})"
    if info.token_input:
        rows = embedding_rows(info.path, info.input_name)
        if rows is None:
            raise UsageError(
                f"{info.path}: the model takes integer ids whose range it does not show; pass --inputs NPZ"
            )
        return rng.integers(0, rows, (samples, *info.input_shape), dtype=np.int64), label, None
    return rng.standard_normal((samples, *info.input_shape)).astype(np.float32), label, None


def verify_fold(info: OnnxFile, fused_path: Path, opts: VerifyOptions, progress: Progress) -> Verification:
    """Both questions for a fused ONNX file against its ONNX original (see the module docstring).

    Raises:
        InputError, UsageError: unusable inputs; an original onnxruntime cannot run.
    """
    x, label, digest = choose_onnx_inputs(info, opts)
    np_dtype = _NP_DTYPES.get(info.dtype)
    progress("verifying: the original in its dtype and in float64")
    try:
        original_rt = onnx_runtimes(info.path)[0]
    except RuntimeUnavailable as err:
        raise InputError(f"{info.path}: {err}; slabconv verifies what onnxruntime runs") from None
    batch = original_rt.fixed_batch
    original = run_batched(original_rt.run, x, fixed_batch=batch)
    original64 = load_ir(info.path)
    to_float64(original64)
    run64, which = _float64_runner(original64, np_dtype)
    exact = run_batched(run64, x, fixed_batch=batch)
    names = output_names(len(original), original_rt.output_names)
    reference = Reference(x, label, digest, info.dtype, original, exact, names)
    check_reference(reference)
    verification = Verification(
        inputs=label,
        inputs_sha256=digest,
        reference=f"the original ONNX graph in float64 ({which})",
        notes=list(reference.notes),
    )
    progress("verifying: question 1, is the fold exact?")
    fused64, _ = fold_onnx(info.path, as_float64=True)
    outputs64 = run_batched(_float64_runner(fused64, np_dtype)[0], x, fixed_batch=batch)
    verification.exact.append(judge.exact_graphs(names, outputs64, exact))
    verification.exact.append(
        judge.exact_tensors(f"{fused_path.name} vs the float64 fold", _float_tensors(fused_path), _ir_tensors(fused64))
    )
    passed, detail = check_onnx_file(fused_path)
    verification.integrity.append(IntegrityCheck(f"onnx.checker[full_check] {fused_path.name}", passed, detail))
    runtimes: list[Runtime] = []
    try:
        runtimes = onnx_runtimes(fused_path)
    except RuntimeUnavailable as err:
        raise InputError(f"{fused_path.name}: {first_line(err)}") from None
    for runtime in runtimes:
        progress(f"verifying: question 2, {runtime.label}")
        verification.checks += question_2(
            reference, runtime, rtol=opts.rtol, atol=opts.atol, strict=opts.strict, token_logits=info.token_input
        )
    verification.runtime = runtime_summary(runtimes)
    return verification


def float64_reference(path: Path, x: np.ndarray, dtype: str, batch: int | None) -> tuple[list[np.ndarray], str]:
    """The outputs of the ONNX graph at ``path`` evaluated in float64 on ``x`` (rounded to ``dtype`` first), and
    which evaluator ran it (the float64 reference of ``verify`` when the reference is an ``.onnx`` file)."""
    model: Any = load_ir(path)
    to_float64(model)
    run, which = _float64_runner(model, _NP_DTYPES.get(dtype))
    return run_batched(run, x, fixed_batch=batch), which


def folded_from(candidate: Path) -> str | None:
    """The sha256 of the ``.onnx`` a fused ``model.onnx`` was folded from (its ``SOURCE_KEY``), else None."""
    import onnx

    try:
        proto = onnx.load(str(candidate), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a file fuse wrote from an ONNX original
        return None
    return next((p.value for p in proto.metadata_props if p.key == SOURCE_KEY), None)


def question_1(
    reference: Path, candidate: Path, x: np.ndarray, dtype: str, batch: int | None, exact: list[np.ndarray]
) -> list[Any]:
    """Question 1 for a fused ``model.onnx`` against the ``.onnx`` it was folded from: a fresh float64 fold of the
    reference against the reference in float64 (``exact``), and every tensor of the candidate against that fold."""
    fused64, _ = fold_onnx(reference, as_float64=True)
    outputs = run_batched(_float64_runner(fused64, _NP_DTYPES.get(dtype))[0], x, fixed_batch=batch)
    names = output_names(len(exact), [v.name for v in fused64.graph.outputs])
    return [
        judge.exact_graphs(names, outputs, exact),
        judge.exact_tensors(f"{candidate.name} vs a float64 fold of the reference", _float_tensors(candidate),
                            _ir_tensors(fused64)),
    ]  # fmt: skip


def _float_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every floating initializer of an ONNX file, by name."""
    import onnx_ir as ir

    from slabconv.engine.onnx_graph import to_torch

    model = ir.load(str(path))
    out = {}
    for name, value in model.graph.initializers.items():
        if value.const_value is not None and value.dtype is not None and value.dtype.is_floating_point():
            out[name] = to_torch(np.asarray(value.const_value.numpy()))
    return out


def _ir_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every floating initializer of an in-memory ``onnx_ir.Model``, by name."""
    out = {}
    for name, value in model.graph.initializers.items():
        if value.const_value is not None and value.dtype is not None and value.dtype.is_floating_point():
            out[name] = torch.from_numpy(np.asarray(value.const_value.numpy(), dtype=np.float64))
    return out


__all__ = ["check_options", "fuse", "inspect", "verify_fold"]
