"""The side-by-side table of docs/onnx.md: what onnxruntime's optimizer and slabconv leave of the norms of the same
ONNX exports, and the latency of each file, measured in one run. Not part of the test suite.

    python -m benchmarks.onnx_in                 # print the markdown table
    python -m benchmarks.onnx_in --repeats 200   # more timing repeats

Files (exported here, into a temporary folder, with ``torch.onnx.export``): the digits fixture (TorchScript
exporter at opset 17, dynamo exporter at opset 18), the text fixture's LLaMA-PRepBN (TorchScript, opset 18) and
transformers' PatchTST with ``norm_type="batchnorm"`` (dynamo, opset 18; random BatchNorm statistics). For each:

- the export as it is;
- the graph onnxruntime runs after its optimizer at ``ORT_ENABLE_ALL`` (saved with ``optimized_model_filepath``;
  its fused contrib ops count as nodes), and its latency: what a user of the export gets;
- onnxslim (``onnxslim.slim``) and onnx-simplifier (``onnxsim.simplify``) of the export, with the latency of what
  they write (run with ``ORT_ENABLE_ALL``); "not installed" or the tool's one-line failure where they give none;
- ``slabconv fuse`` of the export (verified), and that file after onnxruntime's optimizer, with its latency.

Latency: onnxruntime on the CPU with ``ORT_ENABLE_ALL`` and one thread, median milliseconds over ``--repeats``
runs at batch 8 (the digits, PatchTST) or 1 (LLaMA, 64 tokens), after 10 warm-up runs, all in one process.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from slabconv import api
from slabconv.load.model import load_model
from slabconv.options import VerifyOptions

ROOT = Path(__file__).resolve().parents[1]


def _export(model: nn.Module, x: torch.Tensor, path: Path, opset: int, dynamo: bool) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs: dict = {"dynamo": dynamo, "opset_version": opset, "input_names": ["x"], "output_names": ["y"]}
        if not dynamo:
            kwargs["dynamic_axes"] = {"x": {0: "batch"}, "y": {0: "batch"}}
        torch.onnx.export(model.eval(), (x,), str(path), **kwargs)
    return path


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return out.logits if hasattr(out, "logits") else out


class _Prediction(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(past_values=x).prediction_outputs


def exports(folder: Path) -> list[tuple[str, Path, np.ndarray]]:
    """``(name, path, timing input)`` for every file of the table."""
    out = []
    digits = load_model(ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth")
    x8 = digits.example(8, 0)
    out.append(("digits, TorchScript, opset 17", _export(digits.model, x8, folder / "d17.onnx", 17, False), x8))
    out.append(("digits, dynamo, opset 18", _export(digits.model, x8, folder / "d18.onnx", 18, True), x8))
    text = load_model(ROOT / "fixtures" / "text-prepbn")
    ids = text.example(1, 0)
    path = _export(_Logits(text.model), ids, folder / "llama.onnx", 18, False)
    out.append(("LLaMA-PRepBN (text fixture), TorchScript, opset 18", path, ids))
    try:
        from transformers.models import patchtst
    except ImportError:
        return [(n, p, x.numpy()) for n, p, x in out]
    config = patchtst.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=2, ffn_dim=32, norm_type="batchnorm", scaling=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = patchtst.PatchTSTForPrediction(config).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm1d) and mod.running_mean is not None and mod.running_var is not None:
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
    xp = torch.randn(8, 32, 3)
    path = _export(_Prediction(model), xp, folder / "patchtst.onnx", 18, True)
    out.append(("PatchTST (transformers, BatchNorm), dynamo, opset 18", path, xp))
    return [(n, p, x.numpy()) for n, p, x in out]


def _session(path: Path, optimized: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _latency(session: ort.InferenceSession, x: np.ndarray, repeats: int) -> float:
    feed = {session.get_inputs()[0].name: x}
    for _ in range(10):
        session.run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _counts(path: Path) -> tuple[int, int]:
    model = onnx.load(str(path), load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return sum(ops.values()), ops["BatchNormalization"]


def _third_party(path: Path, folder: Path) -> list[tuple[str, Path | str]]:
    """``(tool, written file or why none)`` for onnxslim and onnx-simplifier on ``path``."""
    out: list[tuple[str, Path | str]] = []
    try:
        import onnxslim
    except ImportError:
        out.append(("onnxslim", "not installed"))
    else:
        target = folder / f"{path.stem}.onnxslim.onnx"
        try:
            onnx.save(onnxslim.slim(onnx.load(str(path))), str(target))
            out.append((f"onnxslim {onnxslim.__version__}", target))
        except Exception as err:  # noqa: BLE001 - report the tool's failure as its row
            out.append(("onnxslim", f"failed: {str(err).splitlines()[0][:80]}"))
    try:
        import onnxsim
    except ImportError:
        out.append(("onnx-simplifier", "not installed"))
    else:
        target = folder / f"{path.stem}.onnxsim.onnx"
        try:
            simplified, ok = onnxsim.simplify(onnx.load(str(path)))
            if not ok:
                raise RuntimeError("its check failed")
            onnx.save(simplified, str(target))
            out.append((f"onnx-simplifier {onnxsim.__version__}", target))
        except Exception as err:  # noqa: BLE001 - report the tool's failure as its row
            out.append(("onnx-simplifier", f"failed: {str(err).splitlines()[0][:80]}"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    print("| file | tool | nodes | BatchNorm | latency (ms) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, path, x in exports(folder):
            optimized = path.with_suffix(".ort.onnx")
            original = _session(path, optimized)  # what a user of the export runs: onnxruntime's optimizer on
            out = path.with_suffix("")
            api.fuse(path, out, verify=VerifyOptions(samples=8))
            fused_optimized = path.with_suffix(".fused.ort.onnx")
            fused = _session(out / "model.onnx", fused_optimized)
            rows: list[tuple[str, Path | str, ort.InferenceSession | None]] = [
                ("the export", path, None),
                ("onnxruntime ORT_ENABLE_ALL", optimized, original),
            ]
            for tool, written in _third_party(path, folder):
                rows.append((tool, written, _session(written) if isinstance(written, Path) else None))
            rows += [
                ("slabconv fuse", out / "model.onnx", None),
                ("slabconv fuse, then onnxruntime ORT_ENABLE_ALL", fused_optimized, fused),
            ]
            for tool, file, session in rows:
                if isinstance(file, str):
                    print(f"| {name} | {tool}: {file} | - | - | - |")
                    continue
                nodes, bn = _counts(file)
                latency = f"{_latency(session, x, args.repeats):.3f}" if session is not None else "-"
                print(f"| {name} | {tool} | {nodes} | {bn} | {latency} |")


if __name__ == "__main__":
    main()
