"""Does the fold survive int8? The original and the fused model of each case quantized alike
(``slabconv.verify.int8``: onnxruntime ``quantize_static``, QDQ, int8 weights per output channel, int8
activations per tensor, MinMax calibration), run, and compared with the float original: the "int8" tables of
docs/verification.md come from one run of this script.

    python -m benchmarks.int8_agreement              # every case
    python -m benchmarks.int8_agreement digits text  # some (names as in the table)
    python -m benchmarks.int8_agreement --json out.json

Cases:

- ``digits``: the digits fixture (``fixtures/digits-prepbn``), its 360 holdout images;
- ``text``: the text fixture (``fixtures/text-prepbn``), 256 holdout sequences of 64 tokens, top-1 at every
  position;
- ``deit_tiny``: the official DeiT-T-PRepBN (``deit_tiny_prepbn``, 224x224) with random weights and calibrated
  statistics (``benchmarks.third_party.learned_looking``), 128 random images;
- ``levit``: transformers' ``LevitForImageClassification`` (LeViT-128S, BatchNorm after every Linear and before the
  classifier's Linear), random weights, calibrated statistics, 128 random images;
- ``tabular``: a BatchNorm1d normalising 64 raw input features (standard deviations within a factor 4) before
  Linear layers (tabular models): the norm folds forward only;
- ``tabular-outlier``: the same with one feature given in units 1000 times larger (one tiny channel scale): the
  fold is flagged;
- ``bottleneck`` / ``bottleneck-forward``: a Linear -> BatchNorm -> Linear model with the same outlier channel: the
  norm can fold either way; slabconv folds it backward (``bottleneck``), and ``bottleneck-forward`` forces the
  forward fold (``STEP_GROWTH_LIMIT`` raised for this case) to show what that would cost.

Calibration is on the evaluation inputs themselves (what ``verify --runtime onnxruntime-int8`` does by default).
Each case prints the int8 step growth the fold report gives (``engine.ranges``; flagged above the limit) beside the
measured agreement, and the verdict of the paired test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from slabconv import api  # noqa: E402
from slabconv.util import quiet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    """A model to quantize: a path slabconv reads, the evaluation inputs and how to run the float original."""

    name: str
    note: str
    make: Callable[[Path], tuple[Path, np.ndarray, nn.Module]]
    force_forward: bool = False


def _fixture(name: str, count: int | None) -> Callable[[Path], tuple[Path, np.ndarray, nn.Module]]:
    def make(folder: Path) -> tuple[Path, np.ndarray, nn.Module]:
        from slabconv.load.model import load_model

        path = ROOT / "fixtures" / name
        path = path / "checkpoint.pth" if (path / "checkpoint.pth").is_file() else path
        x = np.load(ROOT / "fixtures" / name / "holdout.npz")["x"]
        return path, x[:count], load_model(path).model

    return make


def _program(model: nn.Module, x: torch.Tensor, folder: Path, name: str) -> Path:
    """``model`` saved as a ``torch.export`` program with a dynamic batch (what slabconv reads for any model)."""
    with quiet():
        program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = folder / f"{name}.pt2"
    torch.export.save(program, path)
    return path


def _images(count: int, side: int, seed: int) -> np.ndarray:
    return torch.randn(count, 3, side, side, generator=torch.Generator().manual_seed(seed)).numpy()


def _deit_tiny(folder: Path) -> tuple[Path, np.ndarray, nn.Module]:
    from benchmarks.third_party import Entry, learned_looking
    from slabconv.zoo import get_arch
    from tests.test_zoo import OFFICIAL_LAYOUT

    with torch.device("meta"):
        meta = {k: torch.empty(shape) for k, shape in OFFICIAL_LAYOUT["deit_tiny_prepbn"]().items()}
    torch.manual_seed(0)
    model = get_arch("deit_tiny_prepbn").build(meta, {}, "checkpoint")
    for mod in model.modules():  # the progressive norms at the end of their schedule: RepBN alone
        for counter in ("warm", "iter"):
            if isinstance(getattr(mod, counter, None), torch.Tensor):
                getattr(mod, counter).zero_()
    entry = Entry("deit_tiny", "slabconv", lambda: model, lambda b, g: torch.randn(b, 3, 224, 224, generator=g))
    model = learned_looking(model.eval(), entry)
    x = _images(128, 224, 1)
    return _program(model, torch.from_numpy(x[:2]), folder, "deit_tiny"), x, model


def _levit(folder: Path) -> tuple[Path, np.ndarray, nn.Module]:
    import transformers as tf

    from benchmarks.third_party import Entry, Logits, default_init, learned_looking

    torch.manual_seed(0)
    model = default_init(Logits(tf.LevitForImageClassification(tf.LevitConfig()), "pixel_values", "logits"))
    entry = Entry("levit", "transformers", lambda: model, lambda b, g: torch.randn(b, 3, 224, 224, generator=g))
    model = learned_looking(model.eval(), entry)
    x = _images(128, 224, 1)
    return _program(model, torch.from_numpy(x[:2]), folder, "levit"), x, model


C = 64


class Tabular(nn.Module):
    """``fc2(relu(fc1(bn(x))))``: a BatchNorm1d normalising the raw input features, then Linear layers (the
    continuous-feature branch of tabular models such as fastai's ``TabularModel``); the digits images' 64 pixels as
    features, 10 classes."""

    def __init__(self, width: int = C) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(64)
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.bn(x))))


class Bottleneck(nn.Module):
    """``fc3(relu(fc2(bn(fc1(relu(stem(x)))))))`` on flattened 8x8 images: a BatchNorm1d between two Linear layers
    (it folds either way)."""

    def __init__(self, width: int = C) -> None:
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.fc1 = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(self.bn(self.fc1(torch.relu(self.stem(x)))))))


def _calibrated(model: Any, batches: list[torch.Tensor]) -> Any:
    """Running statistics measured on the model's own activations (train mode, cumulative average)."""
    with torch.no_grad():
        model.bn.reset_running_stats()
        model.bn.momentum = None
        model.train()
        for b in batches:
            model(b)
    return model.eval()


def _outlier(model: Any, producer: Any, channel: int = 0, k: float = 1e3) -> Any:
    """The same function with one input channel of the norm ``k`` times larger: its producer's output row scaled
    (ReLU, a mean and a Linear commute with a positive scale) and the norm's statistics with it."""
    with torch.no_grad():
        producer.weight[channel] *= k
        producer.bias[channel] *= k
        model.bn.running_mean[channel] *= k
        model.bn.running_var[channel] *= k * k
    return model


def _features(count: int = 512) -> np.ndarray:
    """64 input features whose standard deviations lie within a factor 4 of one another (means of a few units)."""
    gen = np.random.default_rng(0)
    x = gen.normal(size=(count, 64)) * gen.uniform(0.5, 2, size=64) + gen.normal(size=64)
    return x.astype(np.float32)


def _tabular(outlier: bool) -> Callable[[Path], tuple[Path, np.ndarray, nn.Module]]:
    """With ``outlier``, one feature given in units 1000 times larger (the statistics measured on it): the
    norm's scale for it is 1000 times smaller than the others' (one tiny channel scale)."""

    def make(folder: Path) -> tuple[Path, np.ndarray, nn.Module]:
        torch.manual_seed(0)
        x = _features()
        if outlier:
            x[:, 36] *= 1e3
        model = _calibrated(Tabular(), [torch.from_numpy(x)])
        return _program(model, torch.from_numpy(x[:2]), folder, "tabular"), x, model

    return make


def _bottleneck(folder: Path) -> tuple[Path, np.ndarray, nn.Module]:
    torch.manual_seed(0)
    x = np.load(ROOT / "fixtures" / "digits-prepbn" / "holdout.npz")["x"].reshape(-1, 64)
    model = _calibrated(Bottleneck(), [torch.from_numpy(x)])
    model = _outlier(model, model.fc1)
    return _program(model, torch.from_numpy(x[:2]), folder, "bottleneck"), x, model


CASES = {
    c.name: c
    for c in (
        Case("digits", "digits fixture (DeiT-style, RepBN), 360 holdout images", _fixture("digits-prepbn", None)),
        Case("text", "text fixture (LLaMA-PRepBN), 256 sequences x 64 positions", _fixture("text-prepbn", 256)),
        Case("deit_tiny", "DeiT-T-PRepBN 224x224, random weights, calibrated statistics, 128 images", _deit_tiny),
        Case("levit", "transformers LeViT-128S, random weights, calibrated statistics, 128 images", _levit),
        Case("tabular", "input features -> BatchNorm -> Linear (forward only), 512 samples", _tabular(False)),
        Case("tabular-outlier", "the same, one feature in 1000x units (one tiny channel scale)", _tabular(True)),
        Case("bottleneck", "Linear -> BatchNorm -> Linear, one channel 1000x: slabconv's choice", _bottleneck),
        Case(
            "bottleneck-forward",
            "the same, the forward fold forced",
            _bottleneck,
            force_forward=True,
        ),
    )
}


def run(case: Case, folder: Path) -> dict[str, Any]:
    """One case: the fold report's ranges, both ONNX files, both quantized and compared."""
    from slabconv.engine import planner
    from slabconv.verify.int8 import check_int8
    from slabconv.verify.runtimes import run_batched, torch_runner

    started = time.perf_counter()
    path, x, model = case.make(folder)
    saved = planner.STEP_GROWTH_LIMIT
    if case.force_forward:
        planner.STEP_GROWTH_LIMIT = math.inf
    try:
        report = api.inspect(path)
        original, fused = folder / f"{case.name}.original.onnx", folder / f"{case.name}.fused.onnx"
        api.export(path, original, fuse=False, force=True)
        api.export(path, fused, force=True)
    finally:
        planner.STEP_GROWTH_LIMIT = saved
    float_original = run_batched(torch_runner(model, torch.float32), x)
    check = check_int8(f"int8 @ {case.name}", original, fused, x, float_original, None)
    ranges = report.ranges or []
    worst = max(ranges, key=lambda r: r.step_growth) if ranges else None
    return {
        "name": case.name,
        "note": case.note,
        "actions": sorted({d.action for d in report.folds or []}),
        "step_growth": worst.step_growth if worst else None,
        "worst_layer": worst.layer if worst else None,
        "flagged": [r.layer for r in ranges if r.flagged],
        "check": check.to_dict(),
        "seconds": time.perf_counter() - started,
    }


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/verification.md ("int8")."""
    lines = [
        "| case | folds | largest int8 step growth | int8 original keeps | int8 fused keeps | worse / better "
        "| p (one-sided) | int8 check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["check"]
        growth = f"{r['step_growth']:.3g}x" + (" (flagged)" if r["flagged"] else "") if r["step_growth"] else "-"
        unit = "samples" if c["units"] == "samples" else f"sequences x {c['positions']}"
        lines.append(
            f"| {r['name']} | {', '.join(r['actions'])} | {growth} | {c['original']['agreement']:.2%} "
            f"| {c['fused']['agreement']:.2%} | {c['worse']} / {c['better']} of {c['count']} {unit} "
            f"| {c['p_value']:.2g} | {'passes' if c['passed'] else 'fails'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default all): {', '.join(CASES)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]}; choose from {', '.join(CASES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="slabconv-int8-bench-") as tmp:
        for name in args.cases or list(CASES):
            folder = Path(tmp) / name
            folder.mkdir()
            result = run(CASES[name], folder)
            results.append(result)
            print(
                f"{name}: {result['check']['fused']['agreement']:.2%} fused vs "
                f"{result['check']['original']['agreement']:.2%} original, {result['seconds']:.0f} s",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
