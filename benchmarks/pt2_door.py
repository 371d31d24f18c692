"""The `.pt2` door does each piece of work once: `slabconv fuse MODEL.pt2` now and as it was, alternated.

Saves a `.pt2` of a zoo model (``--arch``, default DeiT-Tiny-sized PRepBN, random norm statistics; or ``--pt2`` a
program of your own) and runs `slabconv.api.fuse` on it with its defaults (ONNX + `.pt2`, both questions), each run
in a fresh child process, the two paths alternated ``--repeats`` times (which runs first swaps each round):

  before:  the loaded program traced again with `torch.export.export` (``engine.capture_program`` of the module
           it loaded into), and each folded layer folded twice per fold (the planner's overflow check, then
           ``program.evaluate`` again), in the model's dtype and again in float64 for question 1;
  after:   the loaded program is the capture, and ``program.evaluate`` takes the values the planner's overflow
           check made (one fold per layer in each dtype: the model's, and question 1's independent float64 one).

Each child prints the wall and CPU time (all threads) of the fuse call alone (imports excluded) and counts the
calls of `torch.export.export`, `torch.export.load`, `ExportedProgram.run_decompositions` and
``LayerRecipe._fold`` (one fold of a layer's rows, all its folds); the "before" path is the code of today with
those two steps put back by patching. The script checks both paths pass and write the same `model.safetensors`
and `model.onnx`, byte for byte. First, the plan stage alone (``pipeline.plan``) both ways, in this process.

Run: .venv/bin/python benchmarks/pt2_door.py [--arch deit_tiny_prepbn | --pt2 FILE] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys, time
from dataclasses import replace
import torch
from slabconv import api, pipeline
from slabconv.engine import program, rewriter
from slabconv.options import WriteOptions

mode, src, out = sys.argv[1:4]
counts = dict.fromkeys(("torch.export.export", "torch.export.load", "run_decompositions", "layer folds"), 0)

def counted(name, fn):
    def call(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return call

torch.export.export = counted("torch.export.export", torch.export.export)
torch.export.load = counted("torch.export.load", torch.export.load)
torch.export.ExportedProgram.run_decompositions = counted(
    "run_decompositions", torch.export.ExportedProgram.run_decompositions)
program.LayerRecipe._fold = counted("layer folds", program.LayerRecipe._fold)
if mode == "before":
    plan, evaluate = pipeline.plan, rewriter.evaluate
    def traced_again(loaded, *args, **kwargs):
        return plan(replace(loaded, checkpoint=replace(loaded.checkpoint, program=None)), *args, **kwargs)
    pipeline.plan = traced_again
    def evaluate_again(folds, *args, **kwargs):
        folds.folded = {}  # not the values the planner's overflow checks made
        return evaluate(folds, *args, **kwargs)
    rewriter.evaluate = evaluate_again
wall, cpu = time.perf_counter(), time.process_time()
report = api.fuse(src, out, write=WriteOptions(force=True))
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "passed": report.verification.passed, **counts}))
"""

COUNTS = ("torch.export.export", "torch.export.load", "run_decompositions", "layer folds")
SAME = ("model.safetensors", "model.onnx")  # model.pt2 records Python object ids (from_node's graph_id): not compared


def save_program(arch: str, path: Path) -> Path:
    """A dynamic-batch `.pt2` of the zoo model ``arch`` (random norm statistics, ``_common.zoo_checkpoint``)."""
    import torch

    from benchmarks._common import zoo_checkpoint
    from slabconv.api import load_model

    loaded = load_model(zoo_checkpoint(arch, path.with_suffix(".pth")))
    batch = {0: torch.export.Dim("batch")}
    torch.export.save(torch.export.export(loaded.model, (loaded.example(2),), dynamic_shapes=(batch,)), path)
    return path


def run(mode: str, pt2: Path, out: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(pt2), str(out)], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # fmt: skip
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    result["files"] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in SAME}  # type: ignore[assignment]
    return result


def plan_stage(pt2: Path, repeats: int) -> None:
    """CPU and wall seconds of the plan alone (``pipeline.plan``: the capture and the fold), both ways alternated in
    this process: the stage both changes are in, measured without the rest of a fuse's noise."""
    import time
    from dataclasses import replace

    from slabconv import pipeline
    from slabconv.engine import program, rewriter
    from slabconv.load.model import load_model

    loaded = load_model(pt2)
    again = replace(loaded, checkpoint=replace(loaded.checkpoint, program=None))
    evaluate = rewriter.evaluate

    def evaluate_again(folds: program.FoldProgram, *args, **kwargs):  # type: ignore[no-untyped-def]
        folds.folded = {}
        return evaluate(folds, *args, **kwargs)

    for i in range(repeats):
        for mode in ("before", "after") if i % 2 == 0 else ("after", "before"):
            rewriter.evaluate = evaluate_again if mode == "before" else evaluate  # type: ignore[assignment]
            cpu, wall = time.process_time(), time.perf_counter()
            pipeline.plan(again if mode == "before" else loaded)
            print(f"plan {mode:>6}: {time.process_time() - cpu:.2f} CPU-s, {time.perf_counter() - wall:.2f} s")
    rewriter.evaluate = evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deit_tiny_prepbn")
    parser.add_argument("--pt2", type=Path, help="a program of your own instead of the zoo model's")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pt2 = args.pt2 or save_program(args.arch, Path(tmp) / f"{args.arch}.pt2")
        plan_stage(pt2, args.repeats)
        results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        print(f"{'round':>5} {'path':>6} {'wall s':>7} {'CPU s':>7} " + " ".join(f"{c:>20}" for c in COUNTS))
        for i in range(args.repeats):
            for mode in ("before", "after") if i % 2 == 0 else ("after", "before"):
                r = run(mode, pt2, Path(tmp) / mode)
                results[mode].append(r)
                line = " ".join(f"{r[c]:>20}" for c in COUNTS)
                print(f"{i + 1:>5} {mode:>6} {r['wall_s']:7.2f} {r['cpu_s']:7.2f} {line}", flush=True)
        for mode, rs in results.items():
            wall, cpu = (statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s"))
            print(f"median {mode:>6} {wall:7.2f} {cpu:7.2f}")
        every = [r for rs in results.values() for r in rs]
        assert all(r["passed"] for r in every), "a fuse did not pass"
        assert len({json.dumps(r["files"], sort_keys=True) for r in every}) == 1, "the paths wrote different files"
        print(f"every run passed; {' and '.join(SAME)} the same bytes on both paths")


if __name__ == "__main__":
    main()
