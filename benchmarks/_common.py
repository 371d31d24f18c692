"""Helpers shared by the benchmark scripts: random-statistics zoo checkpoints and child-process measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import randomize_norms


def zoo_checkpoint(arch: str, path: Path, image_size: int = 224) -> Path:
    """Save a release-style ``{'model': state_dict}`` checkpoint of a registered architecture at its real size,
    with random norm statistics (the timings do not depend on the values)."""
    from slabconv.zoo.deit import VisionTransformer, norm_factory

    presets = {"deit_tiny_prepbn": (192, 3, "repbn"), "deit_small_prepbn": (384, 6, "linearnorm")}
    dim, heads, layout = presets[arch]
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=image_size, embed_dim=dim, depth=12, num_heads=heads, norm_layer=norm_factory(layout)
    )
    randomize_norms(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict()}, path)
    return path


def measure(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` in a fresh child and return its wall time (s) and peak RSS (MiB), measured by a wrapper
    process so that nothing else is counted."""
    wrapper = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
        "print(json.dumps({'rc': rc, 'wall_s': time.perf_counter() - t,\n"
        "                  'peak_rss_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result['rc']}: {out.stderr[-2000:]}")
    return result
