"""Start-up cost of the small things: how long `slabconv` takes to answer what needs no model.

Runs the installed console script (`slabconv`, as a shell runs it) in fresh child processes, each command
``--repeats`` times interleaved, and prints the median wall time of each and its ratio to `slabconv --help`:

  --help; list; a missing checkpoint (`fuse no-such.pth`); an unknown --arch; an existing file as --out;
  a mistyped --dtype; the shell completion of `--arch DEIT_T`; and `python -c "import torch"` for scale.

Target (issue 39): every row but `import torch` under one second, within about 2x `--help` (none imports torch).
With `--compare DIR` each command also runs with another checkout's slabconv first on the path (``PYTHONPATH=DIR``,
e.g. a clone of an older commit), interleaved in the same run, and a second column gives its times.

Run: .venv/bin/python benchmarks/startup.py [--repeats 5] [--compare DIR]
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
    parser.add_argument("--compare", type=Path, help="another checkout whose slabconv runs the same commands")
    args = parser.parse_args()
    paths = {"this": str(ROOT), **({"compare": str(args.compare.resolve())} if args.compare else {})}
    times: dict[tuple[str, str], list[float]] = {(name, which): [] for name, _, _ in CASES for which in paths}
    for _ in range(args.repeats):
        for name, cmd, env in CASES:
            for which, path in paths.items():
                child = {**os.environ, **env, "PYTHONPATH": path}
                start = time.perf_counter()
                subprocess.run(cmd, cwd=ROOT, env=child, capture_output=True, check=False)
                times[(name, which)].append(time.perf_counter() - start)
    print(f"load: {os.getloadavg()[0]:.2f} (1-minute average), {os.cpu_count()} CPUs; {args.repeats} runs each")
    header = f"{'command':32} {'median s':>9} {'/ --help':>9}"
    print(header + (f" {'compare s':>10} {'/ --help':>9}" if args.compare else ""))
    for name, _, _ in CASES:
        row = f"{name:32}"
        for which in paths:
            median = statistics.median(times[(name, which)])
            base = statistics.median(times[("slabconv --help", which)])
            row += (
                f" {median:9.2f} {median / base:9.2f}" if which == "this" else f" {median:10.2f} {median / base:9.2f}"
            )
        print(row)


if __name__ == "__main__":
    main()
