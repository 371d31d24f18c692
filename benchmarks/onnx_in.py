"""The side-by-side table of docs/onnx.md: what onnxruntime's optimizer, onnxslim, onnx-simplifier and slabconv
leave of the norms of the same ONNX exports, measured in one run. Not part of the test suite.

    python -m benchmarks.onnx_in                   # every file below; prints the markdown table
    python -m benchmarks.onnx_in --only committed  # the committed exports of fixtures/onnx-exports/ only

Files:

- the committed exports of ``fixtures/onnx-exports/`` (``fixtures/make_onnx_exports.py``): a conv net and a
  transformer block from torch (dynamo with and without its optimizer, TorchScript with and without constant
  folding), Keras via tf2onnx, PaddlePaddle via paddle2onnx and Flax via jax2onnx, each beside its norm-free twin;
- exported here with ``torch.onnx.export`` (opset 18) under the same four torch settings: the digits fixture
  (DeiT-PRepBN, 9 RepBN) and the text fixture (LLaMA-PRepBN, 7 RepBN);
- exported here with the dynamo exporter and the TorchScript exporter: transformers' PP-LCNetV3 backbone (its
  default config, random init, BatchNorm statistics calibrated on random 64 x 64 images and perturbed, each learned
  scalar affine ``scale * x + bias`` drawn away from its init; its last feature map), whose RepVGG blocks keep an
  identity-branch BatchNorm a residual reads;
- exported here with the dynamo exporter and the TorchScript exporter: the official DeiT-T-PRepBN and
  SLAB-DeiT-Tiny at full size (the zoo's ``deit_tiny_prepbn`` and ``slab_deit_tiny``: their own initialisation,
  BatchNorm statistics calibrated on random images and perturbed, ``benchmarks.zoo_fullsize.calibrate``).

Each network is also exported with every RepBN / BatchNorm replaced by an identity (its norm-free twin: the same
exporter and setting). For each file, one row per tool:

- the export as it is: nodes, ``BatchNormalization`` nodes, and the norms slabconv finds in it;
- onnxruntime's optimizer at ``ORT_ENABLE_ALL`` (the graph it runs, saved with ``optimized_model_filepath``; its
  fused contrib ops count as nodes), onnxslim (``onnxslim.slim``) and onnx-simplifier (``onnxsim.simplify``) of the
  export: nodes, ``BatchNormalization`` nodes, and the norms left: a norm of the export is left when any of its
  per-channel constants (its BatchNorm's statistics, its scale vector) is still a constant of the tool's graph;
  one whose constants are all gone was folded into a layer (or rewritten into another op, as onnxruntime's NCHWc
  layout turns a BatchNorm into a depthwise ``Conv``);
- ``slabconv fuse`` (verified) and ``slabconv fuse --simplify`` (verified): nodes, ``BatchNormalization`` nodes, the
  norms left (kept, or kept as an affine), and the op histogram against the norm-free twin after the same
  preparation (``slabconv.engine.onnx_lower.prepare``; for ``--simplify`` then ``simplify_graph`` as ``--simplify``
  runs it: onnxscript's optimizer, then onnxslim, kept when it has fewer nodes): ``=`` when equal, else the ops in
  excess (``+``) or missing (``-``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import io
import operator
import platform
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from slabconv import api
from slabconv.errors import VerificationError
from slabconv.options import VerifyOptions, WriteOptions

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "fixtures" / "onnx-exports"

TORCH_SETTINGS: dict[str, dict[str, Any]] = {
    "dynamo": {"dynamo": True},
    "dynamo optimize=False": {"dynamo": True, "optimize": False},
    "TorchScript": {"dynamo": False},
    "TorchScript do_constant_folding=False": {"dynamo": False, "do_constant_folding": False},
}
"""The torch exporter settings (``torch.onnx.export`` keyword arguments beside ``opset_version=18``)."""


# --------------------------------------------------------------------------------------------- the tools


def ort_optimized(path: Path, out: Path) -> Path:
    """The graph onnxruntime runs for ``path`` after its optimizer at ``ORT_ENABLE_ALL`` (CPU), saved at ``out``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(out)
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return out


def third_party(path: Path, folder: Path) -> dict[str, Path | str]:
    """``tool name -> written file`` (or the tool's one-line failure) for onnxruntime's optimizer, onnxslim and
    onnx-simplifier, each on the export ``path``."""
    import onnxsim
    import onnxslim

    out: dict[str, Path | str] = {}
    out[f"onnxruntime {ort.__version__} ORT_ENABLE_ALL"] = ort_optimized(path, folder / f"{path.stem}.ort.onnx")
    target = folder / f"{path.stem}.onnxslim.onnx"
    try:
        onnx.save(onnxslim.slim(onnx.load(str(path))), str(target))
        out[f"onnxslim {onnxslim.__version__}"] = target
    except Exception as err:  # noqa: BLE001 - report the tool's failure as its row
        out["onnxslim"] = f"failed: {str(err).splitlines()[0][:80]}"
    target = folder / f"{path.stem}.onnxsim.onnx"
    try:
        simplified, ok = onnxsim.simplify(onnx.load(str(path)))
        if not ok:
            raise RuntimeError("its check failed")
        onnx.save(simplified, str(target))
        out[f"onnx-simplifier {onnxsim.__version__}"] = target
    except Exception as err:  # noqa: BLE001 - report the tool's failure as its row
        out["onnx-simplifier"] = f"failed: {str(err).splitlines()[0][:80]}"
    return out


# --------------------------------------------------------------------------------------------- counting


def histogram(path: Path) -> collections.Counter[str]:
    """Op types of the main graph, counted."""
    model = onnx.load(str(path), load_external_data=False)
    return collections.Counter(n.op_type for n in model.graph.node)


def norm_constants(path: Path) -> dict[str, list[np.ndarray]]:
    """``norm name -> its per-channel constants`` (every stored tensor of more than one element its nodes read: a
    BatchNorm's weight, bias and statistics, a decomposed norm's scale and shift, a LayerScale's gamma; for a norm
    that reads none, a learned scalar affine, its one-element tensors), for every norm slabconv finds in ``path``, in
    graph order."""
    from slabconv.engine import onnx_fold
    from slabconv.load.onnx_file import load_ir

    lowered, plans = onnx_fold.plan_file(load_ir(path), str(path))
    out: dict[str, list[np.ndarray]] = {}
    for p in plans:
        arrays = []
        for node in p.site.region:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    value = operator.attrgetter(str(arg.target))(lowered.gm)
                    arrays.append(value.detach().double().reshape(-1).numpy())
        vectors = [a for a in arrays if a.size > 1]
        out[p.decision.norm] = vectors or [a for a in arrays if a.size == 1]
    return out


def _graph_constants(path: Path) -> list[np.ndarray]:
    """Every floating initializer and ``Constant`` value of ``path``'s main graph, flattened, as float64 (one-element
    ones too: a learned scalar affine's)."""
    model = onnx.load(str(path))
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        tensors += [a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
    out = []
    for t in tensors:
        try:
            array = onnx.numpy_helper.to_array(t)
        except Exception:  # noqa: BLE001 - a type numpy cannot hold is no norm's constant
            continue
        if array.dtype.kind == "f" and array.size >= 1:
            out.append(np.asarray(array, dtype=np.float64).reshape(-1))
    return out


def norms_left(constants: dict[str, list[np.ndarray]], path: Path) -> list[str]:
    """The norms (``norm_constants`` of the export) any of whose constants is still a constant of ``path``, a
    tool's output: the norms the tool did not fold."""
    theirs = _graph_constants(path)
    by_size: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    for array in theirs:
        by_size[array.size].append(array)
    left = []
    for name, arrays in constants.items():
        if any(any(np.array_equal(a, b) for b in by_size.get(a.size, ())) for a in arrays):
            left.append(name)
    return left


def twin_histograms(twin: Path, folder: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """The op histograms of the norm-free ``twin`` prepared as slabconv prepares an original, and then simplified
    as ``fuse --simplify`` simplifies (``simplify_graph``: onnxscript's optimizer, then onnxslim where it has fewer
    nodes): what ``fuse`` and ``fuse --simplify`` reach."""
    import onnx_ir as ir

    from slabconv.engine.onnx_fold import simplify_graph
    from slabconv.engine.onnx_lower import prepare

    model = ir.load(str(twin))
    prepare(model, str(twin))
    ir.save(model, str(folder / "twin.prepared.onnx"))
    prepared = histogram(folder / "twin.prepared.onnx")
    simplify_graph(model)
    ir.save(model, str(folder / "twin.simplified.onnx"))
    return prepared, histogram(folder / "twin.simplified.onnx")


def difference(ours: collections.Counter[str], bound: collections.Counter[str]) -> str:
    """``=`` for equal histograms, else the ops in excess (``+2 Add``) and missing (``-1 Identity``)."""
    diff = {op: ours[op] - bound[op] for op in sorted(set(ours) | set(bound)) if ours[op] != bound[op]}
    return "=" if not diff else ", ".join(f"{n:+d} {op}" for op, n in diff.items())


# --------------------------------------------------------------------------------------------- the files


def _torch_export(model: nn.Module, x: torch.Tensor, path: Path, settings: dict[str, Any]) -> Path:
    kwargs = dict(settings, opset_version=18, input_names=["x"], output_names=["y"])
    if not settings["dynamo"]:
        kwargs["dynamic_axes"] = {"x": {0: "batch"}, "y": {0: "batch"}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the dynamo exporter's progress
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (x,), str(path), **kwargs)
    return path


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return out.logits if hasattr(out, "logits") else out


class _LastFeatureMap(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x).feature_maps[-1]


def _norm_free(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every RepBN and BatchNorm replaced by an identity."""
    from slabconv.zoo.norms import RepBN

    free = copy.deepcopy(model)
    for parent in list(free.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (RepBN, nn.modules.batchnorm._BatchNorm)):
                setattr(parent, name, nn.Identity())
    return free


def _networks() -> Iterator[tuple[str, Callable[[], tuple[nn.Module, torch.Tensor]], list[str]]]:
    """``(name, build, torch settings)``: each network exported here (built lazily: the full-size ones are big)."""
    from slabconv.load.model import load_model

    def digits() -> tuple[nn.Module, torch.Tensor]:
        loaded = load_model(ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth")
        return loaded.model, loaded.example(2, 0)

    def text() -> tuple[nn.Module, torch.Tensor]:
        loaded = load_model(ROOT / "fixtures" / "text-prepbn")
        return _Logits(loaded.model), loaded.example(1, 0)

    def zoo(arch: str) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
        def build() -> tuple[nn.Module, torch.Tensor]:
            from benchmarks.zoo_fullsize import calibrate
            from slabconv.zoo import get_arch
            from tests.test_zoo import OFFICIAL_LAYOUT

            with torch.device("meta"):
                meta = {k: torch.empty(s) for k, s in OFFICIAL_LAYOUT[arch]().items()}
            torch.manual_seed(0)
            model = get_arch(arch).build(meta, {}, "checkpoint").eval()
            calibrate(model, 224, 0)
            return model, torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))

        return build

    def lcnet() -> tuple[nn.Module, torch.Tensor]:
        import transformers

        from benchmarks.zoo_fullsize import calibrate

        torch.manual_seed(0)
        model = _LastFeatureMap(transformers.PPLCNetV3Backbone(transformers.PPLCNetV3Config()).eval())
        calibrate(model, 64, 0)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():  # learned scalar affines away from their init (1, 0), which a simplifier drops
            for mod in model.modules():
                if type(mod).__name__ == "PPLCNetV3LearnableAffineBlock":
                    scale, bias = mod.get_parameter("scale"), mod.get_parameter("bias")
                    scale.copy_(torch.rand(1, generator=gen) + 0.5)
                    bias.copy_(torch.randn(1, generator=gen) * 0.2)
        return model, torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))

    every = list(TORCH_SETTINGS)
    yield "digits fixture (DeiT-PRepBN)", digits, every
    yield "text fixture (LLaMA-PRepBN)", text, every
    yield "PP-LCNetV3 (transformers)", lcnet, ["dynamo", "TorchScript"]
    yield "DeiT-T-PRepBN", zoo("deit_tiny_prepbn"), ["dynamo", "TorchScript"]
    yield "SLAB-DeiT-Tiny", zoo("slab_deit_tiny"), ["dynamo", "TorchScript"]


def committed() -> list[tuple[str, Path, Path]]:
    """``(name, export, norm-free twin)`` for every committed export of ``fixtures/onnx-exports/``."""
    return [
        (p.name, p, p.with_name(p.name.replace(".onnx", ".nonorm.onnx")))
        for p in sorted(EXPORTS.glob("*.onnx"))
        if not p.name.endswith(".nonorm.onnx")
    ]


def exported(folder: Path) -> Iterator[tuple[str, Path, Path]]:
    """``(name, export, norm-free twin)`` for each network of ``_networks`` under each of its torch settings."""
    for i, (name, build, settings) in enumerate(_networks()):
        model, x = build()
        twin = _norm_free(model)
        for j, setting in enumerate(settings):
            path = _torch_export(model, x, folder / f"n{i}-{j}.onnx", TORCH_SETTINGS[setting])
            free = _torch_export(twin, x, folder / f"n{i}-{j}.nonorm.onnx", TORCH_SETTINGS[setting])
            yield f"{name}, {setting}", path, free


# --------------------------------------------------------------------------------------------- the table


def rows(name: str, path: Path, twin: Path, folder: Path) -> Iterator[list[str]]:
    """The table's rows for one export: ``[file, tool, nodes, BatchNorm, norms left, histogram]``."""
    constants = norm_constants(path)
    total = len(constants)
    counts = histogram(path)
    yield [name, "the export", str(sum(counts.values())), str(counts["BatchNormalization"]), f"{total} norms", ""]
    for tool, written in third_party(path, folder).items():
        if isinstance(written, str):
            yield [name, tool, "-", "-", written, ""]
            continue
        counts = histogram(written)
        left = len(norms_left(constants, written))
        yield [name, tool, str(sum(counts.values())), str(counts["BatchNormalization"]), f"{left} of {total}", ""]
    prepared, simplified = twin_histograms(twin, folder)
    for simplify, bound in ((False, prepared), (True, simplified)):
        out = folder / f"{path.stem}.{'simplified' if simplify else 'fused'}"
        tool = "slabconv fuse --simplify" if simplify else "slabconv fuse"
        try:
            report = api.fuse(path, out, verify=VerifyOptions(samples=8), write=WriteOptions(simplify=simplify))
        except VerificationError as err:  # a row of its own: what failed
            yield [name, tool, "-", "-", f"verification failed: {str(err).split(':', 2)[-1][:160].strip()}", ""]
            continue
        counts = histogram(out / "model.onnx")
        left = len([d for d in report.folds or [] if not d.action.startswith("folded")])
        hist = difference(counts, bound)
        yield [name, tool, str(sum(counts.values())), str(counts["BatchNormalization"]), f"{left} of {total}", hist]


def main(argv: list[str] | None = None) -> None:
    import onnxscript
    import onnxsim
    import onnxslim

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["committed", "exported"], default=None)
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, onnxruntime {ort.__version__}, onnxscript {onnxscript.__version__}, onnxslim "
        f"{onnxslim.__version__}, onnx-simplifier {onnxsim.__version__}, {platform.machine()}"
    )
    print()
    print("| file | tool | nodes | BatchNorm | norms left | op histogram against the norm-free twin |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files: list[Iterator[tuple[str, Path, Path]] | list[tuple[str, Path, Path]]] = []
        if args.only in (None, "committed"):
            files.append(committed())
        if args.only in (None, "exported"):
            files.append(exported(folder))
        for group in files:
            for name, path, twin in group:
                for row in rows(name, path, twin, folder):
                    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
