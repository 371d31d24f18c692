"""Fold third-party models (Hugging Face transformers, timm) with random weights and print what happened: the
"Third-party models" table of docs/zoo.md; with ``--fuse``, its "End to end" table (each model exported to a
``.pt2`` and run through ``slabconv fuse``). Not part of the test suite: it needs ``transformers`` and/or ``timm``.

    python -m benchmarks.third_party                  # every model whose library imports
    python -m benchmarks.third_party levit_128s       # some (names as in the table)
    python -m benchmarks.third_party --json out.json  # also write the results

Each model is built from its library's own default configuration (sizes given below where smaller), random
initialisation (timm's own; PyTorch's default ``reset_parameters`` for the transformers models, see
``default_init``), eval mode, with norm parameters and statistics that look learned: every BatchNorm gets
``weight ~ U(0.5, 1.5)``, ``bias ~ N(0, 0.2)`` (MobileBERT's NoNorm and timm's LayerScale the same for their
``weight`` / ``gamma`` and ``bias``), then collects the running statistics of its real input over 4 random batches
(train mode, ``momentum=None``), which are then perturbed a little (``running_mean += N(0, 0.1) * std``,
``running_var *= U(0.8, 1.25)``). (Perturbing every layer's statistics by more, all at once, makes deep
convolutional stacks without residuals overflow float32: each layer's statistics then no longer describe its
input.) Then
``slabconv.engine.capture`` (dynamic batch), ``fold_all``, and the fused graph against the original on the example
input, in float32 and again with the model and input in float64: ``max |fused - original| / max |original|``;
for scale, the float32 original's own error against the float64 model.

timm needs torchvision, whose PyPI wheel is a CUDA build: its compiled ops cannot load beside the CPU torch, and
its import then fails registering fake kernels for ``torchvision::nms`` / ``qnms``. With ``--torchvision-shim``
(on by default) this script declares those two op schemas first, so that torchvision's Python parts import; the
ops themselves are never run (no model here uses them). Say ``--no-torchvision-shim`` to see the plain failure.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from slabconv.engine import capture, fold_all  # noqa: E402
from slabconv.engine.norms import is_batch_norm  # noqa: E402
from slabconv.util import quiet  # noqa: E402


@dataclass
class Entry:
    """A third-party model: its library, how to build it (random weights) and an example input maker."""

    name: str
    library: str
    build: Callable[[], nn.Module]
    example: Callable[[int, torch.Generator], torch.Tensor]
    note: str = ""


class Logits(nn.Module):
    """Call a Hugging Face model with one keyword input and return one tensor of its output."""

    def __init__(self, model: nn.Module, key: str, out: str) -> None:
        super().__init__()
        self.model, self.key, self.out = model, key, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**{self.key: x}), self.out)


def default_init(model: nn.Module) -> nn.Module:
    """PyTorch's default initialisation of every Linear / conv / embedding (``reset_parameters``): the
    transformers defaults of these small configs leave activations near 0 (a MobileViT's logits ~1e-40), which
    calibrated statistics would then blow up."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)):
            m.reset_parameters()
    return model


def _images(side: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, gen: torch.randn(batch, 3, side, side, generator=gen)


def _hf_entries() -> list[Entry]:
    import transformers as tf

    def patchtst() -> nn.Module:
        cfg = tf.PatchTSTConfig(num_input_channels=7, context_length=96, patch_length=12, patch_stride=12)
        return default_init(Logits(tf.PatchTSTForPrediction(cfg), "past_values", "prediction_outputs"))

    def mobilebert() -> nn.Module:
        cfg = tf.MobileBertConfig(num_hidden_layers=4)
        return default_init(Logits(tf.MobileBertForSequenceClassification(cfg), "input_ids", "logits"))

    return [
        Entry(
            "hf_patchtst",
            "transformers",
            patchtst,
            lambda b, g: torch.randn(b, 96, 7, generator=g),
            "PatchTSTForPrediction, 7 channels, context 96, patch 12",
        ),
        Entry(
            "hf_levit",
            "transformers",
            lambda: default_init(Logits(tf.LevitForImageClassification(tf.LevitConfig()), "pixel_values", "logits")),
            _images(224),
            "LevitForImageClassification, default config (LeViT-128S)",
        ),
        Entry(
            "hf_mobilebert",
            "transformers",
            mobilebert,
            lambda b, g: torch.randint(0, 30522, (b, 32), generator=g),
            "MobileBertForSequenceClassification, 4 layers (default 24), 32 tokens",
        ),
        Entry(
            "hf_mobilevit",
            "transformers",
            lambda: default_init(
                Logits(tf.MobileViTForImageClassification(tf.MobileViTConfig()), "pixel_values", "logits")
            ),
            _images(256),
            "MobileViTForImageClassification, default config",
        ),
        Entry(
            "hf_mobilevitv2",
            "transformers",
            lambda: default_init(
                Logits(tf.MobileViTV2ForImageClassification(tf.MobileViTV2Config()), "pixel_values", "logits")
            ),
            _images(256),
            "MobileViTV2ForImageClassification, default config",
        ),
    ]


def _timm_entries() -> list[Entry]:
    import timm

    return [
        Entry(name, "timm", partial(timm.create_model, name, pretrained=False), _images(224))
        for name in ("levit_128s", "efficientformerv2_s0", "repvit_m0_9")
    ]


def _torchvision_entries() -> list[Entry]:
    import torchvision

    return [Entry("mobilenet_v3_small", "torchvision", torchvision.models.mobilenet_v3_small, _images(224))]


def torchvision_shim() -> None:
    """Declare the two torchvision op schemas its Python import registers fake kernels for (never run)."""
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


_KEEP: list[Any] = []


def entries(shim: bool) -> tuple[list[Entry], dict[str, str]]:
    """The models whose library imports, and why the others are missing."""
    out: list[Entry] = []
    missing: dict[str, str] = {}
    try:
        out += _hf_entries()
    except Exception as err:  # noqa: BLE001 - report why the library is missing
        missing["transformers"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    try:
        if shim:
            torchvision_shim()
        out += _timm_entries()
    except Exception as err:  # noqa: BLE001
        missing["timm"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    try:
        out += _torchvision_entries()
    except Exception as err:  # noqa: BLE001
        missing["torchvision"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return out, missing


# --------------------------------------------------------------------------------------------- statistics


def _affines(model: nn.Module) -> list[nn.Module]:
    names = ("NoNorm", "LayerScale", "LayerScale2d")
    return [m for m in model.modules() if type(m).__name__ in names]


def learned_looking(model: nn.Module, entry: Entry, seed: int = 0) -> nn.Module:
    """Norm parameters and statistics that look learned (see the module docstring): random affine parameters
    first, then running statistics measured on the model's own activations, then a mild perturbation."""
    gen = torch.Generator().manual_seed(seed)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    with torch.no_grad():
        for bn in bns:
            if bn.affine:
                bn.weight.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
                bn.bias.copy_(torch.randn(bn.num_features, generator=gen) * 0.2)
            bn.reset_running_stats()
            bn.momentum = None  # a cumulative average over the calibration batches
        for mod in _affines(model):
            for name, p in mod.named_parameters(recurse=False):
                if name in ("weight", "gamma"):
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                elif name == "bias":
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        model.eval()
        for bn in bns:
            bn.train()
        for _ in range(4):
            model(entry.example(8, gen))
        model.eval()
        for bn in bns:
            c = bn.num_features
            assert bn.running_mean is not None and bn.running_var is not None
            std = (bn.running_var + float(bn.eps)).sqrt()
            bn.running_mean.add_(torch.randn(c, generator=gen) * 0.1 * std)
            bn.running_var.mul_(torch.rand(c, generator=gen) * 0.45 + 0.8)
    return model


# --------------------------------------------------------------------------------------------- folding


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def fold_one(model: nn.Module, x: torch.Tensor, exact: torch.Tensor | None = None) -> dict[str, Any]:
    """Capture and fold ``model``; decisions counted by action and kind, error on ``x`` and on a batch of one;
    with ``exact`` (the float64 model's output) also both models' error against it."""
    reference = model(x)
    start = time.perf_counter()
    with quiet():
        gm = capture(model, x)
    decisions = fold_all(gm)
    seconds = time.perf_counter() - start
    by = collections.Counter(f"{d.action} {d.kind}" for d in decisions)
    reasons = collections.Counter(d.reason for d in decisions if d.reason)
    return {
        "norms": len(decisions),
        "by_action_kind": dict(sorted(by.items())),
        "reasons": dict(reasons.most_common()),
        "bn_ops_left": sum(is_batch_norm(n) for n in gm.graph.nodes),
        "rel_err": _rel(gm(x), reference),
        "rel_err_batch1": _rel(gm(x[:1]), model(x[:1])),
        "seconds": round(seconds, 1),
        **(
            {"fused_vs_float64": _rel(gm(x), exact), "original_vs_float64": _rel(reference, exact)}
            if exact is not None
            else {}
        ),
    }


def run(entry: Entry) -> dict[str, Any]:
    torch.manual_seed(0)
    model = learned_looking(entry.build().eval(), entry)
    x = entry.example(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        wide = copy.deepcopy(model).double()
        x64 = x.double() if x.is_floating_point() else x
        exact = wide(x64)
        f32 = fold_one(copy.deepcopy(model), x, exact)
        f64 = fold_one(wide, x64)
    return {"name": entry.name, "library": entry.library, "note": entry.note, "float32": f32, "float64": f64}


def fuse_end_to_end(entry: Entry, folder: Path, samples: int | None) -> dict[str, Any]:
    """The model as users hand it over: ``torch.export`` (dynamic batch where it exports so, else the example's
    batch) saved as a ``.pt2``, then ``slabconv fuse`` on it in a child process with its default verification
    (or ``--samples``). Returns the exit code, the wall time and the report's verification numbers."""
    import subprocess

    torch.manual_seed(0)
    model = learned_looking(entry.build().eval(), entry)
    x = entry.example(2, torch.Generator().manual_seed(1))
    with quiet():
        try:
            program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        except Exception:  # noqa: BLE001 - a model whose code fixes the batch exports as it is
            program = torch.export.export(model, (x,))
    pt2 = folder / f"{entry.name}.pt2"
    torch.export.save(program, pt2)
    command = [sys.executable, "-m", "slabconv", "fuse", str(pt2), "--out", str(folder / entry.name), "--json"]
    command += ["--force"] + (["--samples", str(samples)] if samples else [])
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    v = report.get("verification") or {}
    exact = {e["method"]: e for e in v.get("exact", [])}
    return {
        "name": entry.name,
        "library": entry.library,
        "exit": done.returncode,
        "seconds": seconds,
        "error_line": done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else "",
        "summary": report.get("summary"),
        "q1_graph": exact.get("graph", {}).get("error"),
        "q1_tensors": exact.get("tensors", {}).get("detail"),
        "max_rel_err": v.get("max_rel_err"),
        "tolerance": v.get("tolerance"),
    }


def fuse_table(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/zoo.md ("End to end").

    Columns: exit code; norms folded of found; question 1 (fused graph vs original in float64, relative error;
    written tensors vs the float64 fold, in units in the last place); question 2's largest relative error over the
    written files and runtimes against the float64 reference, and its tolerance; wall seconds."""
    lines = [
        "| model | exit | folded / norms | q1: graph, float64 | q1: written tensors "
        "| q2: max rel err (tolerance) | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"] or {}
        graph = f"{r['q1_graph']:.2g}" if r["q1_graph"] is not None else "-"
        q2 = f"{r['max_rel_err']:.2g} ({r['tolerance']:.0e})" if r["max_rel_err"] is not None else "-"
        lines.append(
            f"| {r['library']} `{r['name']}` | {r['exit']} | {s.get('folded', '-')} / {s.get('norms', '-')} | "
            f"{graph} | {r['q1_tensors'] or r['error_line'] or '-'} | {q2} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/zoo.md ("Third-party models")."""
    lines = [
        "| model | norms | folded forward | folded backward | kept-affine (reasons) | kept "
        "| float32: fused vs original | float32 vs float64 model: fused / original | float64: fused vs original |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f32, f64 = r["float32"], r["float64"]

        def cell(action: str, f32: dict[str, Any] = f32) -> str:
            parts = [
                f"{n} {k.split(' ', 1)[1]}" for k, n in f32["by_action_kind"].items() if k.startswith(action + " ")
            ]
            return ", ".join(parts) or "0"

        kept = cell("kept-affine")
        if f32["reasons"]:
            kept += " (" + ", ".join(f"`{k}` {v}" for k, v in f32["reasons"].items()) + ")"
        lines.append(
            f"| {r['library']} `{r['name']}` | {f32['norms']} | {cell('folded-forward')} | {cell('folded-backward')} | "
            f"{kept} | {cell('kept')} | {f32['rel_err']:.2g} | {f32['fused_vs_float64']:.2g} / "
            f"{f32['original_vs_float64']:.2g} | {f64['rel_err']:.2g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models to run (default: all that import)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-torchvision-shim", dest="shim", action="store_false")
    parser.add_argument("--fuse", action="store_true", help="export each model to .pt2 and run slabconv fuse on it")
    parser.add_argument("--samples", type=int, help="with --fuse: verification samples (default: fuse's own)")
    args = parser.parse_args(argv)
    models, missing = entries(args.shim)
    for library, why in missing.items():
        print(f"skipped {library}: {why}")
    chosen = [m for m in models if not args.names or m.name in args.names]
    if args.fuse:
        return _main_fuse(chosen, args.samples)
    results = []
    for entry in chosen:
        print(f"== {entry.library} {entry.name}", flush=True)
        try:
            result = run(entry)
        except Exception as err:  # noqa: BLE001 - one model's failure does not stop the others
            print(f"   failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
            continue
        print(json.dumps(result), flush=True)
        results.append(result)
    versions: dict[str, str] = {"torch": str(torch.__version__)}
    for lib in ("transformers", "timm", "torchvision"):
        mod = sys.modules.get(lib)
        if mod is not None:
            versions[lib] = str(getattr(mod, "__version__", "?"))
    print(json.dumps(versions))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "missing": missing, "results": results}, indent=1))
    return 0


def _main_fuse(chosen: list[Entry], samples: int | None) -> int:
    import tempfile

    results = []
    with tempfile.TemporaryDirectory(prefix="slabconv-third-party-") as tmp:
        for entry in chosen:
            print(f"== {entry.library} {entry.name}", flush=True)
            result = fuse_end_to_end(entry, Path(tmp), samples)
            print(json.dumps(result), flush=True)
            results.append(result)
    print(fuse_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
