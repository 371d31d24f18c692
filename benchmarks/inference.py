"""Reproduce the inference tables of docs/performance.md: `slabconv bench` on the real fixture and on a
DeiT-Tiny-sized zoo model, on this machine's CPU.

For each model it prints the median latency of the original (RepBN as trained), fused, norm-free (every norm
replaced by identity: the bound a fold can reach) and LayerNorm-branch variants, PyTorch and onnxruntime, at
each batch size, and the headline ratio fused / norm-free, all measured in this one run (interleaved), plus a
plot. The numbers depend on the machine and its load: rerun, don't copy.

Run: .venv/bin/python benchmarks/inference.py [--batch 1,8,64] [--repeats 30] [--plot docs/bench.png]
     .venv/bin/python benchmarks/inference.py --gpu     # on a CUDA machine: the fp16 GPU table

``--gpu`` times DeiT-Tiny- and SLAB-DeiT-Tiny-sized zoo models (224x224) at batch 1 and 256 on the CUDA fp16
runtimes this machine has (``pytorch-cuda-fp16``, ``pytorch-cuda-graphs-fp16``, ``onnxruntime-cuda-fp16`` with
onnxruntime-gpu). ``--runtime`` picks runtimes by name (``slabconv.bench.RUNTIMES``); default: all this machine
has.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import zoo_checkpoint  # noqa: E402
from slabconv import api  # noqa: E402
from slabconv.bench import Timing, plot  # noqa: E402


def bench(path: Path, **kwargs: Any) -> dict[str, Any]:
    """``slabconv.api.bench``'s timings and ratios (the report's ``bench`` section)."""
    result = api.bench(path, **kwargs).bench
    assert result is not None
    return result


def table(name: str, report: dict[str, Any]) -> None:
    print(f"\n## {name}\n")
    print("| runtime | batch | variant | median ms | p25-p75 ms | samples/s |")
    print("|---|---|---|---|---|---|")
    for t in report["timings"]:
        print(
            f"| {t['runtime']} | {t['batch']} | {t['variant']} | {t['median_ms']:.3f} | "
            f"{t['p25_ms']:.3f}-{t['p75_ms']:.3f} | {t['throughput']:.0f} |"
        )
    for r in report["fused_over_norm_free"]:
        print(f"\nfused / norm-free, {r['runtime']}, batch {r['batch']}: **{r['ratio']:.2f}**", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--runtime", default=None, help="comma-separated runtime names (default: all available)")
    parser.add_argument("--gpu", action="store_true", help="the fp16 GPU table: CUDA fp16 runtimes, batch 1,256")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batch.split(","))
    runtimes = tuple(args.runtime.split(",")) if args.runtime else None
    reports = {}
    if args.gpu:
        from slabconv.bench import default_runtimes

        gpu = tuple(r for r in default_runtimes() if "cuda" in r and "fp16" in r)
        if not gpu:
            raise SystemExit("--gpu: no CUDA fp16 runtime on this machine (torch.cuda.is_available() is False)")
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("deit_tiny_prepbn", "slab_deit_tiny"):
                ckpt = zoo_checkpoint(name, Path(tmp) / f"{name}.pth")
                reports[f"{name} (224x224), GPU fp16"] = bench(
                    ckpt, batches=(1, 256), runtimes=runtimes or gpu, repeats=args.repeats
                )
        for name, report in reports.items():
            print(f"GPU: {report['settings']['cuda']}")
            table(name, report)
        print("\n" + json.dumps({k: v["fused_over_norm_free"] for k, v in reports.items()}))
        return
    reports["digits fixture (deit_prepbn, 8x8)"] = bench(
        ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth", batches=batches, runtimes=runtimes, repeats=args.repeats
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = zoo_checkpoint("deit_small_prepbn", Path(tmp) / "deit_small.pth")
        reports["DeiT-Small-sized, LinearNorm (deit_small_prepbn, 224x224)"] = bench(
            ckpt, batches=tuple(b for b in batches if b <= 8), runtimes=runtimes, repeats=max(5, args.repeats // 3)
        )
    for name, report in reports.items():
        table(name, report)
    if args.plot is not None:
        plot([Timing(**t) for t in next(iter(reports.values()))["timings"]], args.plot)
        print(f"\nplot: {args.plot}")
    print("\n" + json.dumps({k: v["fused_over_norm_free"] for k, v in reports.items()}))


if __name__ == "__main__":
    main()
