"""Helpers shared by the benchmark scripts: random-statistics zoo checkpoints and child-process measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.conftest import randomize_norms


def zoo_checkpoint(arch: str, path: Path) -> Path:
    """Save a release-style ``{'model': state_dict}`` checkpoint of a fixed-size zoo preset at its real size (its
    official layout from ``tests/test_zoo.py``, its own initialisation, random norm statistics: the timings do not
    depend on the values)."""
    from slabconv.zoo import get_arch
    from tests.test_zoo import OFFICIAL_LAYOUT

    with torch.device("meta"):
        meta = {k: torch.empty(shape) for k, shape in OFFICIAL_LAYOUT[arch]().items()}
    torch.manual_seed(0)
    model = get_arch(arch).build(meta, {}, "checkpoint")
    randomize_norms(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict()}, path)
    return path


def measure(cmd: list[str], stderr: bool = False) -> dict[str, Any]:
    """Run ``cmd`` in a fresh child and return its wall time (s), CPU time (s: user + system, every thread; what a
    shared machine's other jobs change least) and peak RSS (MiB), measured by a wrapper process so that nothing
    else is counted. With ``stderr``, the child's standard error comes back too (under ``stderr``: slabconv's
    timestamped progress lines)."""
    wrapper = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': rc, 'wall_s': time.perf_counter() - t, 'cpu_s': u.ru_utime + u.ru_stime,\n"
        "                  'peak_rss_mib': u.ru_maxrss / 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result['rc']}: {out.stderr[-2000:]}")
    if stderr:
        result["stderr"] = out.stderr
    return result
