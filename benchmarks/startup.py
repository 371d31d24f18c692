"""Start-up cost of the small things: how long `slabconv` takes to answer what needs no model.

Runs the installed console script (`slabconv`, as a shell runs it) in fresh child processes, each command
``--repeats`` times interleaved, and prints the median wall time of each and its ratio to `slabconv --help`:

  --help; list; a missing checkpoint (`fuse no-such.pth`); an unknown --arch; an existing file as --out;
  a mistyped --dtype; the shell completion of `--arch DEIT_T`; and `python -c "import torch"` for scale.

Target (issue 39): every row but `import torch` under one second, within about 2x `--help` (none imports torch).

Run: .venv/bin/python benchmarks/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CKPT = "fixtures/digits-prepbn/checkpoint.pth"
SCRIPT = str(Path(sys.executable).parent / "slabconv")
COMPLETE = {"_SLABCONV_COMPLETE": "complete_bash", "COMP_WORDS": "slabconv fuse x.pth --arch DEIT_T", "COMP_CWORD": "4"}

CASES: list[tuple[str, list[str], dict[str, str]]] = [
    ("slabconv --help", [SCRIPT, "--help"], {}),
    ("slabconv list", [SCRIPT, "list"], {}),
    ("fuse no-such.pth", [SCRIPT, "fuse", "no-such.pth"], {}),
    ("fuse CKPT --arch deit_tiyn", [SCRIPT, "fuse", CKPT, "--arch", "deit_tiyn"], {}),
    ("fuse CKPT --out README.md", [SCRIPT, "fuse", CKPT, "--out", "README.md"], {}),
    ("fuse CKPT --dtype fp8", [SCRIPT, "fuse", CKPT, "--dtype", "fp8"], {}),
    ("completion of --arch DEIT_T", [SCRIPT], COMPLETE),
    ('python -c "import torch"', [sys.executable, "-c", "import torch"], {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for _ in range(args.repeats):
        for name, cmd, env in CASES:
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, check=False)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["slabconv --help"])
    print(f"load: {os.getloadavg()[0]:.2f} (1-minute average), {os.cpu_count()} CPUs; {args.repeats} runs each")
    print(f"{'command':32} {'median s':>9} {'/ --help':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:32} {median:9.2f} {median / base:9.2f}")


if __name__ == "__main__":
    main()
