"""Fold every fixed-size zoo preset at full size and print its float32 error: the "Measured error" table of
docs/zoo.md.

    python -m benchmarks.zoo_fullsize                    # every preset (about 5 minutes on 2 cores)
    python -m benchmarks.zoo_fullsize slab_swin_base     # some
    python -m benchmarks.zoo_fullsize --cli              # through `slabconv fuse` with ONNX (much slower)

Released weights are not downloaded here, so each preset gets its official layout (``tests/test_zoo.py``) with
its own initialisation, then norm statistics that look learned:

1. calibrate: every BatchNorm collects the running statistics of its real input over 4 batches of random images
   (train mode on the BatchNorms only, ``momentum=None``: a cumulative average), as training leaves them;
2. perturb, so that no norm is near identity: ``running_mean += N(0, 0.5) * std``, ``running_var *= U(0.5, 2)``,
   ``weight ~ U(0.5, 1.5)``, ``bias ~ N(0, 0.2)``, RepBN ``alpha ~ U(0.2, 1)``.

``--raw`` uses ``tests.conftest.randomize_norms`` instead (statistics unrelated to the activations: badly
conditioned deep models). Then ``engine.capture`` (dynamic batch), ``engine.fold_all``, and the fused graph
against the original on ``randn(2, 3, 224, 224)`` (seed 1), in float32 and, for both, against the float64 model.

``--cli`` instead saves each as a release file ``{'model': state_dict}`` and runs ``slabconv fuse FILE --samples
4 --json`` (architecture detected from the keys and shapes): the verification's max relative error of the fused
ONNX under onnxruntime, and the BatchNormalization nodes left in it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from slabconv import engine
from slabconv.engine.norms import is_batch_norm  # noqa: E402
from slabconv.util import quiet  # noqa: E402
from slabconv.zoo import get_arch  # noqa: E402
from tests.conftest import randomize_norms  # noqa: E402
from tests.test_zoo import OFFICIAL_LAYOUT  # noqa: E402


def calibrate(model: nn.Module, side: int, seed: int) -> None:
    """Running statistics of each BatchNorm's real input (4 batches of 8 random images), then perturbed."""
    gen = torch.Generator().manual_seed(seed)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    model.eval()
    for bn in bns:
        bn.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 3, side, side, generator=gen))
        model.eval()
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                c = mod.num_features
                assert mod.running_mean is not None and mod.running_var is not None
                std = (mod.running_var + float(mod.eps)).sqrt()
                mod.running_mean.add_(torch.randn(c, generator=gen) * 0.5 * std)
                mod.running_var.mul_(torch.rand(c, generator=gen) * 1.5 + 0.5)
                if mod.affine:
                    mod.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                    mod.bias.copy_(torch.randn(c, generator=gen) * 0.2)
            alpha = getattr(mod, "alpha", None)
            if isinstance(alpha, nn.Parameter):
                alpha.copy_(torch.rand(1, generator=gen) * 0.8 + 0.2)
            for counter in ("warm", "iter"):
                if isinstance(getattr(mod, counter, None), torch.Tensor):
                    getattr(mod, counter).zero_()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def run(name: str, raw: bool) -> dict:
    t = time.perf_counter()
    spec = get_arch(name)
    with torch.device("meta"):
        meta = {k: torch.empty(s) for k, s in OFFICIAL_LAYOUT[name]().items()}
    torch.manual_seed(0)
    model = spec.build(meta, {}, "checkpoint").eval()  # real tensors: the official initialisation
    if raw:
        randomize_norms(model, 0)
    else:
        calibrate(model, 224, 0)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        ref, ref64 = model(x), exact(x.double())
    with quiet():
        gm = engine.capture(model, x)
    decisions = engine.fold_all(gm)
    with torch.no_grad():
        got = gm(x)
    bn_left = sum(1 for n in gm.graph.nodes if is_batch_norm(n))
    return {
        "name": name,
        "norms": len(decisions),
        "forward": sum(d.action == engine.FOLDED_FORWARD for d in decisions),
        "backward": sum(d.action == engine.FOLDED_BACKWARD for d in decisions),
        "bn_left": bn_left,
        "fused_vs_original": rel(got, ref),
        "original_vs_float64": rel(ref, ref64),
        "fused_vs_float64": rel(got, ref64),
        "max_abs_logit": ref.abs().max().item(),
        "top1_same": bool((got.argmax(-1) == ref.argmax(-1)).all()),
        "seconds": time.perf_counter() - t,
    }


def run_cli(name: str, raw: bool, tmp: Path) -> dict:
    import subprocess

    import onnx

    t = time.perf_counter()
    spec = get_arch(name)
    with torch.device("meta"):
        meta = {k: torch.empty(s) for k, s in OFFICIAL_LAYOUT[name]().items()}
    torch.manual_seed(0)
    model = spec.build(meta, {}, "checkpoint").eval()
    if raw:
        randomize_norms(model, 0)
    else:
        calibrate(model, 224, 0)
    ckpt = tmp / f"{name}.pth"
    torch.save({"model": model.state_dict()}, ckpt)
    cmd = [sys.executable, "-m", "slabconv", "fuse", str(ckpt), "--samples", "4", "--json", "--force"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"name": name, "exit": done.returncode, "error": done.stderr.strip()[-300:]}
    report = json.loads(done.stdout)
    ops = [n.op_type for n in onnx.load(str(tmp / f"{name}-fused" / "model.onnx"), load_external_data=False).graph.node]
    return {
        "name": name,
        "exit": 0,
        "detected": report["source"]["arch"],
        "folded": report["summary"]["folded"],
        "kept": report["summary"]["kept"],
        "bn_nodes": ops.count("BatchNormalization"),
        "max_rel_err": report["verification"]["max_rel_err"],
        "top1": report["verification"]["top1_agreement"],
        "seconds": time.perf_counter() - t,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="presets (default: every fixed-size preset)")
    parser.add_argument("--raw", action="store_true", help="randomize_norms statistics instead of calibrated ones")
    parser.add_argument("--cli", action="store_true", help="run `slabconv fuse` on a release file of each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = args.names or sorted(OFFICIAL_LAYOUT)
    rows = []
    if args.cli:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                r = run_cli(name, args.raw, Path(tmp))
                rows.append(r)
                print(json.dumps(r), flush=True)
        return rows
    if not args.json:
        print(
            "| name | norms | folded forward / backward | BN left | fused vs original | original / fused vs "
            "float64 | max abs logit | top-1 same |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for name in names:
        r = run(name, args.raw)
        rows.append(r)
        if not args.json:
            print(
                f"| `{r['name']}` | {r['norms']} | {r['forward']} / {r['backward']} | {r['bn_left']} | "
                f"{r['fused_vs_original']:.1e} | {r['original_vs_float64']:.1e} / {r['fused_vs_float64']:.1e} | "
                f"{r['max_abs_logit']:.3g} | {'yes' if r['top1_same'] else 'NO'} |",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
