"""Does the fold survive int8? Each side quantized statically with onnxruntime's own tools, run, and compared
(issue 40; ``docs/verification.md``, "int8").

A fold moves a norm's per-channel scale into the next layer's weight columns (``W diag(s)``); per-output-channel
int8 cannot absorb a column scale, so a fused model can quantize worse than its original
(``slabconv.engine.ranges`` says by how much its weights may). This module answers it by measurement:

- ``quantize_int8``: an ``.onnx`` quantized as a deployment would (``onnxruntime.quantization.quantize_static``:
  QDQ format, int8 weights per output channel (symmetric), int8 activations per tensor (asymmetric), MinMax
  calibration on the inputs given), the layers a fold changes (``QUANTIZED_OPS``) quantized, as the W8A8 recipes
  do (SLAB's appendix, SmoothQuant), the rest left in float;
- ``compare_int8``: the int8 original and the int8 fused model against the float original: the share of samples
  (a classifier's ``(B, K)``) or positions (a language model's ``(B, T, V)``) whose top-1 each keeps, and a
  one-sided exact sign test (McNemar's) on the paired disagreements: the fused model passes unless it keeps the
  float original's top-1 on fewer units than the int8 original does, beyond sampling noise (p < ``ALPHA``). The
  unit is a sample, or for a language model a sequence (its positions are not independent of one another).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slabconv.errors import InputError, first_line
from slabconv.verify.judge import rel_err
from slabconv.verify.runtimes import Inputs, RuntimeUnavailable, chunks, run_batched, samples_of

QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")
"""The op types quantized: the layers a fold writes into (a Linear is ``MatMul`` or ``Gemm`` in ONNX, a convolution
``Conv``); everything else (norms, softmax, residual adds) stays in float, in both sides alike."""

ALPHA = 0.01
"""The one-sided significance level of the sign test: the fused model fails when its int8 version keeps fewer
top-1 decisions than the original's with p below this."""

CALIBRATION_BATCH = 16
"""Samples per calibration call of onnxruntime's calibrator."""


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """onnxruntime's quantizer logs advice at WARNING on the root logger ("consider pre-processing"); the check's
    own lines say what was done."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


class _Reader:
    """onnxruntime's ``CalibrationDataReader`` protocol over ``Inputs``: ``get_next`` returns one batch of feeds,
    then None."""

    def __init__(self, names: list[str], inputs: Inputs, batch: int, fixed_batch: int | None):
        self.feeds: list[dict[str, np.ndarray]] = []
        for _, part, n in chunks(inputs, batch, fixed_batch):
            if n < samples_of(part):
                break  # a static batch takes full batches only
            self.feeds.append(part if isinstance(part, dict) else {names[0]: part})
        self.feeds.reverse()

    def get_next(self) -> dict[str, np.ndarray] | None:
        return self.feeds.pop() if self.feeds else None


def quantize_int8(
    path: Path,
    out: Path,
    calibration: Inputs,
    *,
    op_types: Sequence[str] = QUANTIZED_OPS,
    batch: int = CALIBRATION_BATCH,
    fixed_batch: int | None = None,
) -> Path:
    """Quantize the ``.onnx`` at ``path`` statically into ``out`` with ``onnxruntime.quantization.quantize_static``.

    QDQ format (``QuantizeLinear`` / ``DequantizeLinear`` pairs around each quantized op, what onnxruntime,
    TensorRT and OpenVINO take), ``per_channel=True`` (int8 weights with one symmetric scale per output channel),
    int8 activations with one asymmetric scale per tensor, calibrated by MinMax over ``calibration``. Only
    ``op_types`` are quantized. Without onnxruntime's pre-processing (``quant_pre_process`` would fold some of an
    original's BatchNorms into their convolutions itself, which is the question asked of slabconv here). Then every
    op that is not quantized reads the float tensor, not its dequantized copy (``_float_elsewhere``).

    Args:
        path: a float ``.onnx`` (any opset onnxruntime runs; external data beside it is read).
        out: where to write the quantized model (its weights in ``<out>.data`` when the input has external data);
            the quantizer's own output is left beside it (``<stem>.qdq.onnx``).
        calibration: inputs ``(N, ...)`` as the model takes them (float32 images, int64 token ids), or a dict by
            input name; all ``N`` are used, ``batch`` at a time (or the model's static batch).
        op_types: the ONNX op types to quantize.
        batch: samples per calibration call.
        fixed_batch: the batch the original runs in when its batch is fixed (``Reference.batch``): calibrated in
            batches of exactly that many, as the file's own static batch would (an activation may depend on the
            other samples of its batch).

    Returns:
        ``out``.

    Raises:
        RuntimeUnavailable: onnxruntime cannot quantize the model (an op or dtype its quantizer does not take; a
            float16 model: the quantizer takes float32).
        InputError: no calibration samples.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if samples_of(calibration) == 0:
        raise InputError("int8 calibration needs at least one input sample")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ports = session.get_inputs()
    shape = ports[0].shape
    fixed = shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else fixed_batch
    if fixed and samples_of(calibration) < fixed:
        raise InputError(
            f"{path.name} runs in batches of exactly {fixed} (a static batch, its own or the original's): int8 "
            f"calibration needs at least {fixed} samples"
        )
    del session
    external = any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(str(path), load_external_data=False).graph.initializer
    )
    reader = _Reader([p.name for p in ports], calibration, batch, fixed)
    raw = out.with_name(f"{out.stem}.qdq.onnx")
    try:
        with _quiet_quantizer():
            quantize_static(
                str(path),
                str(raw),
                reader,  # type: ignore[arg-type]
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(op_types),
                per_channel=True,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
                use_external_data_format=external,
                extra_options={
                    "ActivationSymmetric": False,
                    "WeightSymmetric": True,
                    "OpTypesToExcludeOutputQuantization": list(op_types),
                },
            )
    except Exception as err:  # noqa: BLE001 - the quantizer raises whatever its steps raise
        raise RuntimeUnavailable(f"onnxruntime cannot quantize {path.name} to int8: {first_line(err, 160)}") from None
    _float_elsewhere(raw, out, op_types, external)
    return out


def _float_elsewhere(raw: Path, out: Path, op_types: Sequence[str], external: bool) -> int:
    """``raw`` written to ``out`` with every op that is not quantized reading the float tensor a quantized layer's
    input was made from (weights in ``<out>.data`` when ``external``); returns how many inputs were rewired.

    onnxruntime's quantizer puts one ``QuantizeLinear -> DequantizeLinear`` pair on a tensor and lets every reader
    take the dequantized copy, so a tensor read by a quantized layer *and* by a float op is rounded for both. In a
    fused model that tensor is often the residual stream (the norm that read it is gone and its consumer reads it
    directly), which the float residual additions would then carry rounded through every block: a cost of where
    the quantizer put its pair, not of the fold (measured on DeiT-T-PRepBN: 89% of top-1 decisions kept by the
    original, 55% by the fused model, before this). After it, both sides quantize exactly the inputs and weights of
    ``op_types``."""
    import onnx_ir as ir

    model = ir.load(str(raw))
    quantized = set(op_types) | {"QuantizeLinear", "DequantizeLinear"}
    rewired = 0
    for node in list(model.graph):
        if node.op_type != "DequantizeLinear":
            continue
        q = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        if q is None or q.op_type != "QuantizeLinear" or q.inputs[0] is None:
            continue  # a weight's pair (its int8 initializer), not an activation's
        source, copy = q.inputs[0], node.outputs[0]
        for user, index in list(copy.uses()):
            if user.op_type not in quantized:
                user.replace_input_with(index, source)
                rewired += 1
    ir.save(model, str(out), external_data=f"{out.name}.data" if external else None)
    return rewired


@dataclass
class Int8Side:
    """One side (the original or the fused model) quantized and run.

    Attributes:
        name: ``original`` or ``fused``.
        error: ``max |int8 - reference| / max |reference|`` against the float64 reference (the float original's
            own output where there is none), every output.
        agreement: the share of units' decisions (top-1 of a sample, or of every position of a sequence) the int8
            model keeps from the float original.
        kept, decisions: how many of the float original's top-1 decisions it kept, out of how many.
    """

    name: str
    error: float
    agreement: float
    kept: int
    decisions: int


@dataclass
class Int8Check:
    """The int8 check: both sides quantized alike, each against the float original, and the paired test.

    Attributes:
        name: ``int8 @ <runtime>``.
        passed: the fused side's agreement is not lower than the original side's beyond sampling noise.
        units: ``samples`` (a classifier) or ``sequences`` (a language model: ``positions`` each).
        count: how many units.
        positions: positions per sequence (None for a classifier).
        original, fused: the two sides (``Int8Side``).
        worse, better: units on which the fused side keeps fewer (more) of the float original's decisions than
            the original side: for a sample, it alone loses (keeps) the top-1.
        p_value: ``P(X >= worse)`` for ``X ~ Binomial(worse + better, 1/2)``: how likely so many units go against
            the fused side if both sides quantize equally well (1 when no unit differs).
        alpha: the level it is held to (``ALPHA``).
        calibration: what the quantizer was calibrated on.
        quantization: how the sides were quantized, in words.
    """

    name: str
    passed: bool
    units: str
    count: int
    positions: int | None
    original: Int8Side
    fused: Int8Side
    worse: int
    better: int
    p_value: float
    alpha: float
    calibration: str
    quantization: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sign_test(worse: int, better: int) -> float:
    """One-sided exact sign test: ``P(X >= worse)`` for ``X ~ Binomial(worse + better, 1/2)`` (McNemar's exact
    test on the discordant pairs; ties, units where both sides do the same, carry no information). 1 when
    ``worse + better == 0``."""
    n = worse + better
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(worse, n + 1))
    return tail / 2**n  # exact integers: Python's true division rounds the ratio once


def _kept(int8: np.ndarray, original: np.ndarray) -> np.ndarray:
    """Per unit (axis 0) and decision (the rest but the last axis): does the int8 output keep the float
    original's top-1?"""
    return int8.argmax(axis=-1) == original.argmax(axis=-1)


def compare_int8(
    name: str,
    original_int8: Sequence[np.ndarray],
    fused_int8: Sequence[np.ndarray],
    float_original: Sequence[np.ndarray],
    reference64: Sequence[np.ndarray] | None,
    *,
    calibration: str,
    alpha: float = ALPHA,
) -> Int8Check:
    """The int8 check of one runtime: both quantized sides against the float original.

    Args:
        name: ``int8 @ <runtime>``.
        original_int8, fused_int8: every output of the int8 original and the int8 fused model ``(N, ...)``.
        float_original: the original model's outputs in its own (float) dtype: whose top-1 decisions count.
        reference64: the float64 reference outputs for the errors (None: measured against ``float_original``).
        calibration: what the quantizer was calibrated on, in words.
        alpha: the level of the one-sided test.

    Returns:
        An ``Int8Check`` judged on the first output with a class axis (``(N, K)``, or ``(N, T, V)`` per position;
        the other outputs only enter the errors).

    Raises:
        InputError: the sides' outputs differ in number or shape, or no output has a class axis to judge.
    """
    if not (len(original_int8) == len(fused_int8) == len(float_original)):
        raise InputError(f"{name}: the two sides give different numbers of outputs")
    judged = next((i for i, o in enumerate(float_original) if o.ndim >= 2 and o.shape[-1] > 1), None)
    if judged is None:
        raise InputError(f"{name}: no output has a class axis (N, K) or (N, T, V): top-1 agreement cannot be judged")
    reference = reference64 if reference64 is not None else float_original
    sides = []
    kept = []
    for side, outputs in (("original", original_int8), ("fused", fused_int8)):
        for out, ref in zip(outputs, float_original, strict=True):
            if out.shape != ref.shape:
                raise InputError(
                    f"{name}: the {side} side gives shape {out.shape} where the original gives {ref.shape}"
                )
        error = max(rel_err(out, ref)[0] for out, ref in zip(outputs, reference, strict=True))
        hits = _kept(outputs[judged], float_original[judged]).reshape(len(outputs[judged]), -1)
        kept.append(hits)
        sides.append(Int8Side(side, error, float(hits.mean()), int(hits.sum()), int(hits.size)))
    per_unit = kept[1].sum(axis=1).astype(np.int64) - kept[0].sum(axis=1)  # > 0: the fused side keeps more
    worse, better = int((per_unit < 0).sum()), int((per_unit > 0).sum())
    p = sign_test(worse, better)
    positions = kept[0].shape[1] if float_original[judged].ndim > 2 else None
    return Int8Check(
        name=name,
        passed=bool(p >= alpha),
        units="sequences" if positions is not None else "samples",
        count=int(kept[0].shape[0]),
        positions=positions,
        original=sides[0],
        fused=sides[1],
        worse=worse,
        better=better,
        p_value=p,
        alpha=alpha,
        calibration=calibration,
        quantization=QUANTIZATION,
    )


def run_int8(path: Path, calibration: Inputs, inputs: Inputs, fixed_batch: int | None = None) -> list[np.ndarray]:
    """``path`` in the ``onnxruntime-int8`` runtime (``runtimes.open_onnxruntime_int8``: quantized, calibrated on
    ``calibration``, with every graph optimisation, which turns the QDQ pairs into int8 kernels, as deployed) run on
    ``inputs``; every output as float64 ``(N, ...)``. ``fixed_batch``: the batch the original runs in when its
    batch is fixed (``Reference.batch``): calibrated and run in batches of exactly that many, whatever batch the file
    takes.

    Raises:
        RuntimeUnavailable: onnxruntime cannot quantize or run it.
    """
    from slabconv.verify.backends import BACKENDS

    how = {"calibration": calibration, "several": isinstance(inputs, dict), "fixed_batch": fixed_batch}
    runtime = BACKENDS["onnxruntime-int8"].open(path, **how)[0]
    try:
        return run_batched(runtime.run, inputs, fixed_batch=runtime.fixed_batch or fixed_batch)
    finally:
        runtime.close()


def check_int8(
    name: str,
    original: Path,
    fused: Path,
    inputs: Inputs,
    float_original: Sequence[np.ndarray],
    reference64: Sequence[np.ndarray] | None,
    *,
    calibration: Inputs | None = None,
    calibration_label: str = "the verification inputs",
    alpha: float = ALPHA,
    fixed_batch: int | None = None,
) -> Int8Check:
    """The int8 check of two ``.onnx`` files: the original and the fused model, each quantized alike
    (``quantize_int8``; calibrated on ``calibration``, default ``inputs``) and run on ``inputs``, then
    ``compare_int8`` against the float original's outputs. ``fixed_batch``: the batch the original runs in when its
    batch is fixed (``Reference.batch``): both sides are calibrated and run in batches of exactly that many, as
    ``float_original`` was computed (an output may depend on the other samples of its batch).

    Raises:
        RuntimeUnavailable: onnxruntime cannot quantize or run one of them.
        InputError: as ``compare_int8``.
    """
    calibration = inputs if calibration is None else calibration
    sides = [run_int8(path, calibration, inputs, fixed_batch) for path in (original, fused)]
    return compare_int8(
        name, sides[0], sides[1], float_original, reference64, calibration=calibration_label, alpha=alpha
    )


QUANTIZATION = (
    "onnxruntime quantize_static, QDQ: int8 weights per output channel (symmetric), int8 activations per tensor "
    f"(asymmetric, MinMax calibration); ops {', '.join(QUANTIZED_OPS)}"
)
"""How ``quantize_int8`` quantizes, in the words the report uses."""
