"""Conversion cost: `slabconv fuse` (fold + ONNX export + verification) against one bare `torch.onnx.export`.

Builds a DeiT-Tiny-sized PRepBN checkpoint (224x224, 12 blocks, dim 192) with random norm statistics, then in
fresh child processes measures wall time, CPU time (user + system, all threads) and peak RSS of

  (a) bare:  load the checkpoint into the model, `torch.onnx.export(..., dynamo=True)` once;
  (b) fuse:  `slabconv fuse CKPT` with its defaults (verification on 16 seeded random samples, two
             onnxruntime settings) and with --no-verify;

and prints the ratios fuse / bare in CPU time (on a shared machine wall time depends on the other jobs; CPU time
much less) and peak RSS. Then one in-process `slabconv.api.fuse` run with a progress hook shows where the CPU
time goes, stage by stage. Targets (issue 22): fuse <= 1.5x bare, fuse --no-verify <= 1.1x bare.

Run: .venv/bin/python benchmarks/conversion_cost.py [--arch deit_tiny_prepbn] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import measure, zoo_checkpoint  # noqa: E402

BARE = """
import sys, torch
from slabconv.api import load_model
loaded = load_model(sys.argv[1])
x = torch.randn(2, *loaded.input_shape)
torch.onnx.export(loaded.model, (x,), sys.argv[2], dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},))
import atexit, os
atexit._run_exitfuncs()  # then no interpreter teardown, as slabconv's commands end (cli.app.leave): both sides
sys.stdout.flush()  # count the same work
os._exit(0)
"""


def stages(ckpt: Path, out: Path) -> list[tuple[str, float]]:
    """CPU seconds (all threads) spent in each stage of one in-process fuse, from the progress messages."""
    from slabconv import api
    from slabconv.options import WriteOptions

    marks: list[tuple[str, float]] = []
    api.fuse(
        ckpt,
        out,
        write=WriteOptions(force=True),
        progress=lambda message, *_: marks.append((message, time.process_time())),
    )
    end = time.process_time()
    totals: dict[str, float] = {}  # a stage reports progress many times (one call per norm): one row per stage
    for i, (message, start) in enumerate(marks):
        totals[message] = totals.get(message, 0.0) + (marks[i + 1][1] if i + 1 < len(marks) else end) - start
    return list(totals.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deit_tiny_prepbn")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of the three commands, interleaved; each ratio is the median "
        "over rounds of that round's command / bare (the machine's speed drifts between rounds)"
    )  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = zoo_checkpoint(args.arch, Path(tmp) / "ckpt.pth")
        commands = {
            "bare torch.onnx.export": [sys.executable, "-c", BARE, str(ckpt), str(Path(tmp) / "bare.onnx")],
            "slabconv fuse": [sys.executable, "-m", "slabconv", "fuse", str(ckpt), "--out", str(Path(tmp) / "f1")],
            "slabconv fuse --no-verify": [
                sys.executable, "-m", "slabconv", "fuse", str(ckpt), "--out", str(Path(tmp) / "f2"), "--no-verify"
            ],
        }  # fmt: skip
        rounds = []
        for _ in range(args.repeats):
            rounds.append({name: measure(cmd) for name, cmd in commands.items()})
            for out in ("f1", "f2"):
                shutil.rmtree(Path(tmp) / out, ignore_errors=True)
        print(f"{'run':28s} {'wall s':>7s} {'CPU s':>6s} {'peak RSS MiB':>13s} {'CPU x':>6s} {'RSS x':>6s}  (medians)")
        rows = {}
        for name in commands:
            runs = [r[name] for r in rounds]
            cpu_x = statistics.median(r[name]["cpu_s"] / r["bare torch.onnx.export"]["cpu_s"] for r in rounds)
            rss_x = statistics.median(
                r[name]["peak_rss_mib"] / r["bare torch.onnx.export"]["peak_rss_mib"] for r in rounds
            )
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "peak_rss_mib")}
            rows[name] = {**med, "cpu_x": cpu_x, "rss_x": rss_x, "rounds": runs}
            print(
                f"{name:28s} {med['wall_s']:7.1f} {med['cpu_s']:6.1f} {med['peak_rss_mib']:13.0f} "
                f"{cpu_x:6.2f} {rss_x:6.2f}"
            )
        if args.repeats > 1:
            for name in commands:
                cpu = ", ".join(f"{r[name]['cpu_s'] / r['bare torch.onnx.export']['cpu_s']:.2f}" for r in rounds)
                print(f"  CPU x per round, {name}: {cpu}")
        print("targets: fuse <= 1.5x bare, fuse --no-verify <= 1.1x bare, in CPU time and in peak RSS")
        print("\nwhere the CPU time goes (one in-process fuse):")
        for message, seconds in stages(ckpt, Path(tmp) / "f3"):
            print(f"  {seconds:7.2f} s  {message}")
        print(json.dumps({"arch": args.arch, "repeats": args.repeats, "runs": rows}))


if __name__ == "__main__":
    main()
