"""Reproduce the inference tables of docs/performance.md: `slabconv bench` on the real fixture and on a
DeiT-Tiny-sized zoo model, on this machine's CPU.

For each model it prints the median latency of the original (RepBN as trained), fused, norm-free (every norm
replaced by identity: the bound a fold can reach) and LayerNorm-branch variants, PyTorch and onnxruntime, at
each batch size, and the headline ratio fused / norm-free, all measured in this one run (interleaved), plus a
plot. The numbers depend on the machine and its load: rerun, don't copy.

Run: .venv/bin/python benchmarks/inference.py [--batch 1,8,64] [--repeats 30] [--plot docs/bench.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import zoo_checkpoint  # noqa: E402
from slabconv import api  # noqa: E402
from slabconv.bench import Timing, plot  # noqa: E402


def table(name: str, report: dict) -> None:
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
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batch.split(","))
    reports = {}
    reports["digits fixture (deit_prepbn, 8x8)"] = api.bench(
        ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth", batches=batches, repeats=args.repeats
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = zoo_checkpoint("deit_small_prepbn", Path(tmp) / "deit_small.pth")
        reports["DeiT-Small-sized, LinearNorm (deit_small_prepbn, 224x224)"] = api.bench(
            ckpt, batches=tuple(b for b in batches if b <= 8), repeats=max(5, args.repeats // 3)
        )
    for name, report in reports.items():
        table(name, report)
    if args.plot is not None:
        plot([Timing(**t) for t in next(iter(reports.values()))["timings"]], args.plot)
        print(f"\nplot: {args.plot}")
    print("\n" + json.dumps({k: v["fused_over_norm_free"] for k, v in reports.items()}))


if __name__ == "__main__":
    main()
