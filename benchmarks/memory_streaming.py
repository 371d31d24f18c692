"""Peak RSS of ``slabconv fuse --stream`` (``slabconv.pipeline``) on a sharded LLaMA-PRepBN checkpoint with random
float16 weights.

    python -m benchmarks.memory_streaming                      # LLaMA-350M shape (hidden 1024, 18 layers)
    python -m benchmarks.memory_streaming --shape 7b --layers 2

Builds the checkpoint layer by layer (official LinearNorm keys incl. ``num_step``) with ``write_hf_folder``
(``--shard-mb`` shards) in a temporary folder, then measures the fold in a fresh child (``_common.measure``), and the
fixed overhead: a child that only imports torch and slabconv.stream (``import_overhead``), and one that also
imports the CLI and plans on the full-size architecture with stand-in weights (``fixed_overhead``: what every
fold pays before touching a weight).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import measure  # noqa: E402

SHAPES = {
    "350m": {"hidden": 1024, "layers": 18, "intermediate": 4096, "vocab": 32000, "heads": 8},
    "7b": {"hidden": 4096, "layers": 2, "intermediate": 11008, "vocab": 32000, "heads": 32},
}


def _linear_norm(prefix: str, c: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Official LinearNorm keys with a finished schedule; RepBN statistics are set by ``_calibrate``."""
    out = {f"{prefix}.{k}": torch.tensor(0) for k in ("num_step", "warm", "iter", "total_step")}
    out[f"{prefix}.norm1.weight"] = torch.ones(c, dtype=torch.float16)
    out[f"{prefix}.norm2.alpha"] = (0.1 * torch.randn(1, generator=gen)).half()
    out[f"{prefix}.norm2.bn.weight"] = (1 + 0.1 * torch.randn(c, generator=gen)).half()
    out[f"{prefix}.norm2.bn.bias"] = (0.1 * torch.randn(c, generator=gen)).half()
    out[f"{prefix}.norm2.bn.running_mean"] = torch.zeros(c, dtype=torch.float16)
    out[f"{prefix}.norm2.bn.running_var"] = torch.ones(c, dtype=torch.float16)
    out[f"{prefix}.norm2.bn.num_batches_tracked"] = torch.tensor(1000)
    return out


def _set_stats(sd: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> None:
    """Set the RepBN running statistics at ``prefix`` to those of ``x`` (B, T, C), as training would have."""
    flat = x.reshape(-1, x.shape[-1]).double()
    sd[f"{prefix}.norm2.bn.running_mean"] = flat.mean(0).half()
    sd[f"{prefix}.norm2.bn.running_var"] = flat.var(0).clamp_min(1e-4).half()


def _calibrate(sd: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> None:
    """Give every RepBN the statistics of its real input on ``ids``, one decoder layer at a time.

    Random weights with arbitrary statistics make activations grow without bound (the MLP is quadratic in its
    input and a RepBN in eval does not renormalise), so a deep random model overflows float32. Statistics measured
    on the model's own activations keep every norm's output near unit scale, as in a trained model.
    """
    from slabconv.zoo.llama import LlamaDecoderLayer, llama_norm_factory, rope_cos_sin

    t = ids.shape[1]
    cos, sin = rope_cos_sin(t, cfg.head_dim, cfg.rope_theta, torch.float32)
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    h = sd["model.embed_tokens.weight"][ids].float()
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            layer = LlamaDecoderLayer(cfg, llama_norm_factory("linearnorm", cfg.rms_norm_eps), persistent_rope=False)
            _set_stats(sd, f"{p}.input_layernorm", h)
            state = {k[len(p) + 1 :]: v for k, v in sd.items() if k.startswith(p + ".") and "inv_freq" not in k}
            layer.load_state_dict(state, strict=True)
            layer.float().eval()
            x = h + layer.self_attn(layer.input_layernorm(h), cos, sin, mask)
            _set_stats(sd, f"{p}.post_attention_layernorm", x)
            layer.post_attention_layernorm.load_state_dict(
                {
                    k[len(p) + len(".post_attention_layernorm") + 1 :]: v
                    for k, v in sd.items()
                    if k.startswith(f"{p}.post_attention_layernorm.")
                }
            )
            h = x + layer.mlp(layer.post_attention_layernorm(x))
            del layer
        _set_stats(sd, "model.norm", h)


def build_checkpoint(folder: Path, shape: dict[str, int], shard_bytes: int) -> int:
    """Write the folder; return the weight bytes. Weights are random float16 (values do not change the cost); the
    RepBN statistics are calibrated on 8 x 64 random tokens so that the model's activations stay finite."""
    from slabconv.zoo.llama import LlamaConfig
    from tests import hfwrite

    c, inter, vocab, heads = shape["hidden"], shape["intermediate"], shape["vocab"], shape["heads"]
    gen = torch.Generator().manual_seed(0)

    def w(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).half()

    out_std = 0.02 / (2 * shape["layers"]) ** 0.5  # residual-branch outputs scaled by depth, as GPT-2 initialises

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(vocab, c, std=1.0)}  # hidden states O(1)
    for i in range(shape["layers"]):
        p = f"model.layers.{i}"
        for proj in "qkv":
            sd[f"{p}.self_attn.{proj}_proj.weight"] = w(c, c)
        sd[f"{p}.self_attn.o_proj.weight"] = w(c, c, std=out_std)
        sd[f"{p}.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, c // heads, 2) / (c // heads)))
        sd[f"{p}.mlp.gate_proj.weight"] = w(inter, c)
        sd[f"{p}.mlp.down_proj.weight"] = w(c, inter, std=out_std)
        sd[f"{p}.mlp.up_proj.weight"] = w(inter, c)
        sd |= _linear_norm(f"{p}.input_layernorm", c, gen) | _linear_norm(f"{p}.post_attention_layernorm", c, gen)
    sd |= _linear_norm("model.norm", c, gen)
    sd["lm_head.weight"] = w(vocab, c)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=c,
        intermediate_size=inter,
        num_hidden_layers=shape["layers"],
        num_attention_heads=heads,
    )
    _calibrate(sd, cfg, torch.randint(0, vocab, (8, 64), generator=gen))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c,
        "intermediate_size": inter,
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
    }
    hfwrite.write_hf_folder(folder, sd, config, max_shard_bytes=shard_bytes)
    return sum(v.numel() * v.element_size() for v in sd.values())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="350m")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 18 for 350m, 2 for 7b)")
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["layers"] = args.layers
    with tempfile.TemporaryDirectory(prefix="slabconv-stream-bench-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        t = time.perf_counter()
        weight_bytes = build_checkpoint(src, shape, args.shard_mb * 10**6)
        build_s = time.perf_counter() - t
        shards = sorted(src.glob("model-*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
        ckpt = sum(p.stat().st_size for p in shards)
        base = measure([sys.executable, "-c", "import torch, slabconv.pipeline, safetensors"])
        plan_only = (
            "import json, sys; from pathlib import Path; import slabconv.cli; from slabconv import pipeline; "
            "from slabconv.load.shards import LazyShards; d = Path(sys.argv[1]); "
            "pipeline.plan_sharded(LazyShards.open(d), json.load(open(d / 'config.json')), None, '')[1]"
        )
        fixed = measure([sys.executable, "-c", plan_only, str(src)])
        run = measure(  # --generate 0: the fold and its two questions; benchmarks.streamed_checks measures the rest
            [
                sys.executable,
                "-m",
                "slabconv",
                "fuse",
                str(src),
                "--stream",
                "--no-onnx",
                "--generate",
                "0",
                "--out",
                str(out),
            ]
        )
        report = json.loads((out / "report.json").read_text())
        mib = 2**20
        result = {
            "shape": args.shape,
            "config": shape,
            "shards": len(shards),
            "checkpoint_mib": ckpt / mib,
            "weight_mib": weight_bytes / mib,
            "largest_shard_mib": largest / mib,
            "build_s": build_s,
            "fold_wall_s": run["wall_s"],
            "peak_rss_mib": run["peak_rss_mib"],
            "import_overhead_rss_mib": base["peak_rss_mib"],
            "fixed_overhead_rss_mib": fixed["peak_rss_mib"],
            "peak_rss_over_checkpoint": run["peak_rss_mib"] * mib / ckpt,
            "peak_rss_over_largest_shard": run["peak_rss_mib"] * mib / largest,
            "peak_minus_overhead_over_largest_shard_plus_10pct": (run["peak_rss_mib"] - fixed["peak_rss_mib"])
            * mib
            / (1.1 * largest),
            "verification_max_rel_err": report["verification"]["max_rel_err"],
            "verification_passed": report["verification"]["passed"],
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
        if args.shape == "350m":
            met = result["peak_rss_over_checkpoint"] <= 1.3
            print(f"target peak RSS / checkpoint <= 1.3: {'met' if met else 'MISSED'}")
        else:
            ok = result["peak_minus_overhead_over_largest_shard_plus_10pct"] <= 1.0
            print(f"target (peak - import overhead) <= largest shard + 10%: {'met' if ok else 'MISSED'}")
    return result


if __name__ == "__main__":
    main()
