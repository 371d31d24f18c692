"""Streaming fold of a big sharded LLaMA-PRepBN Hugging Face folder in bounded memory (safetensors only).

Plan on a small graph, apply to big weights:

1. PLAN. A tiny instance of the same architecture (the folder's config.json with hidden 16, intermediate 32,
   vocab 64, 2 heads, 2 layers; same norm layout, eps, rope) is built with the zoo builder, traced
   (``graph.capture``) and folded (``plan.fold_all``). Each ``Decision`` says which consumers a norm folds into,
   found from the traced data flow; ``find_norms`` on the unfolded graph says which tensors hold the norm's BN
   statistics and alpha; ``fused_state_dict`` says which tensors the fused model still reads. Names are mapped to
   every layer of the big model by the layer pattern ``model.layers.{i}.``. Every norm must fold forward, or
   the folder is refused.
2. APPLY. Shards are read lazily with ``safetensors.safe_open``. For each norm only its BN tensors and alpha are
   read, ``fold.repbn_affine`` gives ``(s, t)`` in float64, and each consumer weight is folded with
   ``fold.fold_into_linear`` one block of output rows at a time (the fold is row-wise; a block is about 4M
   elements, read through its own short-lived ``safe_open`` handle with ``get_slice``), cast back to the
   checkpoint dtype. Output shards mirror the input shard boundaries (a created ``<consumer>.bias`` goes right
   after its weight) and are written block by block (header first, then the bytes in order), so neither a whole
   shard nor a whole large tensor is ever held: peak memory is the fixed overhead (torch, the tiny trace) plus a
   few blocks. Norm tensors and tensors the fused graph does not read (counters, ``rotary_emb.inv_freq``) are
   dropped.
3. VERIFY. ``layerwise.verify_folders`` runs the original and the written folder one decoder layer at a time
   (float32 compute, weights streamed in row blocks) on seeded random token sequences: every decoder layer's
   output on the same input, and the logits end to end with next-token top-1 at every position; max relative
   error ``max|c - r| / max|r|`` must be within the dtype tolerance of DESIGN.md section 5 (float16: 1e-3).

Everything is written to a staging folder beside the output and renamed into place only when verification passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slabconv import __version__, engine, fold
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError
from slabconv.load import hf
from slabconv.util import quiet, sha256_file
from slabconv.verify import layerwise
from slabconv.verify.results import failure_line
from slabconv.write.shards import ShardWriter, numel
from slabconv.write.staging import check_output_folder, staging_dir

Progress = Callable[[str], None]

ARCH = "llama_prepbn"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_TEMPLATE = "model.layers.{i}."
_TINY = {"hidden_size": 16, "intermediate_size": 32, "vocab_size": 64, "num_attention_heads": 2, "layers": 2}
# Elements per row block: fold_into_linear's float64 temporaries, copies and checks (rows are independent).
_FOLD_BLOCK = 1 << 22
_ROLES = ("weight", "bias", "running_mean", "running_var", "alpha")


def _no_progress(message: str) -> None:
    return None


def template(name: str) -> str:
    """``model.layers.7.mlp.up_proj`` -> ``model.layers.{i}.mlp.up_proj``; other names unchanged."""
    return _LAYER.sub(_TEMPLATE, name)


def instances(name: str, layers: int) -> list[str]:
    """A template's names in a model with ``layers`` decoder layers (itself when it has no layer index)."""
    if _TEMPLATE not in name:
        return [name]
    return [name.replace(_TEMPLATE, f"model.layers.{i}.") for i in range(layers)]


# --------------------------------------------------------------------------------------------- plan


@dataclass
class NormPlan:
    """One norm of the tiny plan as templates: its BN tensors by role, eps, and the consumers it folds into."""

    norm: str
    kind: str
    roles: dict[str, str | None]
    eps: float
    into: list[str]
    decision: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamPlan:
    """The tiny plan: norms (templates, in graph order), the tensor templates the fused model reads, and every
    tensor template of the original model."""

    norms: list[NormPlan]
    keep: set[str]
    known: set[str]


def _tiny_model(config: dict[str, Any], weight_map: dict[str, str]) -> torch.nn.Module:
    from slabconv.zoo.llama import LlamaForCausalLM, llama_config, norm_factory, norm_layout

    if "model.embed_tokens.weight" not in weight_map or "lm_head.weight" not in weight_map:
        raise UnsupportedModelError("streaming fold supports LLaMA-PRepBN folders only (model.embed_tokens, lm_head)")
    layout = norm_layout(weight_map, "model.layers.0.input_layernorm")  # type: ignore[arg-type]  # keys only
    if layout is None:
        raise UnsupportedModelError(
            "streaming fold supports LLaMA-PRepBN only: model.layers.0.input_layernorm has no RepBN statistics"
        )
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv is not None and heads is not None and int(kv) != int(heads):
        raise UnsupportedModelError(
            "grouped-query attention (num_key_value_heads != num_attention_heads) is not supported"
        )
    c, inter, vocab, n = (_TINY[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "layers"))
    shapes = {"model.embed_tokens.weight": (vocab, c), "lm_head.weight": (vocab, c)}
    for i in range(n):
        shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (c, c)
        shapes[f"model.layers.{i}.mlp.gate_proj.weight"] = (inter, c)
    fake = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    tiny_config = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    tiny_config.update(num_attention_heads=_TINY["num_attention_heads"], max_position_embeddings=16, pad_token_id=0)
    cfg = llama_config(fake, tiny_config)
    persistent = any(k.endswith("rotary_emb.inv_freq") for k in weight_map)
    model = LlamaForCausalLM(cfg, norm_factory(layout, cfg.rms_norm_eps), persistent_rope=persistent)
    with torch.no_grad():  # fixed, positive statistics: the plan depends on the data flow, not on these values
        for mod in model.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                assert mod.running_mean is not None and mod.running_var is not None
                mod.running_mean.fill_(0.5)
                mod.running_var.fill_(2.0)
                mod.weight.fill_(1.0)
                mod.bias.fill_(0.25)
            alpha = getattr(mod, "alpha", None)
            if isinstance(alpha, torch.nn.Parameter):
                alpha.fill_(0.5)
            for counter in ("warm", "iter"):
                if isinstance(getattr(mod, counter, None), torch.Tensor):
                    getattr(mod, counter).zero_()
    return model.eval()


def make_plan(config: dict[str, Any], weight_map: dict[str, str]) -> StreamPlan:
    """Trace and fold the tiny instance; return its decisions as layer templates.

    Raises:
        UnsupportedModelError: not LLaMA-PRepBN, or some norm of the tiny plan does not fold forward, or the two
            tiny layers disagree.
    """
    model = _tiny_model(config, weight_map)
    known = {template(k) for k in model.state_dict()}
    example = torch.randint(0, _TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with quiet():
        gm = engine.capture(model, example)
    sites = {site.name: (dict(site.param_names), site.eps) for site in engine.find_norms(gm)}
    decisions = engine.fold_all(gm)
    keep = {template(k) for k in engine.fused_state_dict(gm)}
    refused = [d for d in decisions if d.action != engine.FOLDED_FORWARD]
    if refused:
        d = refused[0]
        raise UnsupportedModelError(
            f"streaming fold needs every norm to fold forward; the plan for {d.norm} is {d.action} ({d.reason}); "
            "fold this model in memory with `slabconv fuse` without --stream"
        )
    by_template: dict[str, NormPlan] = {}
    for d in decisions:
        roles, eps = sites[d.norm]
        entry = NormPlan(
            norm=template(d.norm),
            kind=d.kind,
            roles={r: template(v) if v else None for r, v in roles.items()},
            eps=eps,
            into=[template(x) for x in d.into],
            decision=d.to_dict(),
        )
        prev = by_template.get(entry.norm)
        if prev is not None and (prev.roles, prev.into, prev.eps) != (entry.roles, entry.into, entry.eps):
            raise UnsupportedModelError(f"the tiny plan folds {d.norm} differently from layer 0; not a uniform stack")
        by_template.setdefault(entry.norm, entry)
    return StreamPlan(list(by_template.values()), keep, known)


# --------------------------------------------------------------------------------------------- safetensors I/O


# --------------------------------------------------------------------------------------------- apply


def _check_stats(name: str, stats: dict[str, torch.Tensor | None], eps: float) -> None:
    for role, t in stats.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            raise InputError(f"norm {name}: {role} holds NaN or Inf; the checkpoint is damaged")
    var = stats["running_var"]
    if var is not None and bool((var.double() + eps <= 0).any()):
        raise InputError(f"norm {name}: running_var + eps <= 0 for some channel; the checkpoint is damaged")


def _counter_warnings(shards: hf.LazyShards, norm: str) -> list[str]:
    """``plan.schedule_warnings`` for the counters stored under ``norm``."""
    keys = {k: f"{norm}.{k}" for k in ("warm", "iter", "total_step")}
    if not all(k in shards.weight_map for k in keys.values()):
        return []
    warm, it, total = (int(shards.get(keys[k])) for k in ("warm", "iter", "total_step"))
    return engine.schedule_warnings(warm, it, total)


@dataclass
class _Norm:
    name: str
    plan: NormPlan
    keys: dict[str, str | None]
    consumers: list[str]


def _layers(weight_map: dict[str, str]) -> int:
    found = {int(m.group(1)) for k in weight_map if (m := _LAYER.match(k))}
    if found != set(range(len(found))):
        raise InputError(f"decoder layer indices are not 0..{len(found) - 1}: {sorted(found)[:8]}...")
    return len(found)


def _instantiate(
    splan: StreamPlan, layers: int, weight_map: dict[str, str], index: Path
) -> tuple[list[_Norm], dict[str, _Norm]]:
    """The tiny plan's norms for every layer of the big model, in graph order (layers, then ``model.norm``), and
    consumer weight key -> its norm."""
    per_layer = [p for p in splan.norms if _TEMPLATE in p.norm]
    ordered = [(p, f"model.layers.{i}.") for i in range(layers) for p in per_layer]
    ordered += [(p, "") for p in splan.norms if _TEMPLATE not in p.norm]
    norms: list[_Norm] = []
    fold_of: dict[str, _Norm] = {}
    for np_, prefix in ordered:

        def sub(name: str, prefix: str = prefix) -> str:
            return name.replace(_TEMPLATE, prefix)

        keys = {r: sub(v) if v else None for r, v in np_.roles.items()}
        consumers = [sub(c) for c in np_.into]
        missing = [k for k in [*keys.values(), *(f"{c}.weight" for c in consumers)] if k and k not in weight_map]
        if missing:
            raise InputError(f"{index}: {missing[0]!r} is missing (norm {sub(np_.norm)})")
        n = _Norm(sub(np_.norm), np_, keys, consumers)
        norms.append(n)
        for c in consumers:
            if f"{c}.weight" in fold_of:
                raise UnsupportedModelError(f"{c} reads two norms; streaming fold refuses")
            fold_of[f"{c}.weight"] = n
    return norms, fold_of


def _read_source(folder: Path) -> tuple[dict[str, Any], Path, dict[str, str], list[str]]:
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder")
    config = hf.read_hf_config(folder)
    found = hf.hf_weights_file(folder)
    if found is None or found[1] != "hf-safetensors-sharded":
        have = found[0].name if found else "no weights"
        raise UsageError(
            f"{folder}: --stream needs sharded safetensors (model.safetensors.index.json + shards), found {have}; "
            "fold it in memory without --stream"
        )
    index = found[0]
    weight_map = hf.read_index(index)
    shards = hf.shard_paths(index)
    return config, index, weight_map, [s.name for s in shards]


def fuse_streaming(
    folder: Path | str,
    out_dir: Path | str,
    *,
    force: bool = False,
    verify: bool = True,
    samples: int = layerwise.DEFAULT_SEQUENCES,
    seq_len: int = layerwise.DEFAULT_SEQ_LEN,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Fold every norm of a sharded LLaMA-PRepBN safetensors folder into ``out_dir`` without loading it whole.

    Args:
        folder: config.json + model.safetensors.index.json + shards.
        out_dir: output folder: config.json, model.safetensors.index.json, shards (same names and boundaries as
            the input), report.json.
        force: replace an existing ``out_dir``.
        verify: run ``layerwise.verify_folders`` on the written folder before it is moved into place.
        samples, seq_len, seed: verification inputs: ``samples`` seeded random token sequences of ``seq_len``.
        rtol, atol: verification tolerances (default rtol by dtype, DESIGN.md section 5).
        progress: called with a short message per stage.

    Returns:
        The report: ``folds`` (one entry per norm, as ``fuse``), ``source``, ``outputs`` (files and sha256),
        ``verification`` (one check per decoder layer and one for the logits, as ``verify``).

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input (exit 2); nothing is written.
        VerificationError: a checked pair differs beyond tolerance (exit 1); nothing is written.
    """
    folder, out_dir = Path(folder), Path(out_dir)
    check_output_folder(out_dir, force=force, inputs=[folder])
    config, index, weight_map, shard_names = _read_source(folder)
    layers = _layers(weight_map)
    hf.return_freed_blocks_to_the_os()
    progress("planning on a tiny instance of the architecture")
    splan = make_plan(config, weight_map)

    unknown = sorted(k for k in weight_map if template(k) not in splan.known)
    if unknown:
        raise UnsupportedModelError(f"{index}: {unknown[0]!r} is not a tensor of LLaMA-PRepBN ({len(unknown)} such)")
    norms, fold_of = _instantiate(splan, layers, weight_map, index)

    source_sha = sha256_file(index)
    metadata = {
        "format": "pt",
        "slabconv_version": __version__,
        "arch": ARCH,
        "complete": "true",
        "source_sha256": source_sha,
        "config": json.dumps(config),
    }
    shards = hf.LazyShards(folder, weight_map, _FOLD_BLOCK)
    affines: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    warnings: dict[str, list[str]] = {}
    dtypes: set[str] = set()

    def affine(n: _Norm) -> tuple[torch.Tensor, torch.Tensor]:
        if n.name not in affines:
            stats = {r: (shards.get(k) if k else None) for r, k in n.keys.items()}
            _check_stats(n.name, stats, n.plan.eps)
            assert stats["running_mean"] is not None and stats["running_var"] is not None
            affines[n.name] = fold.repbn_affine(
                stats["running_mean"],
                stats["running_var"],
                n.plan.eps,
                stats["weight"],
                stats["bias"],
                stats["alpha"],
            )
            warnings[n.name] = _counter_warnings(shards, n.name)
        return affines[n.name]

    new_map: dict[str, str] = {}
    total = 0
    with staging_dir(out_dir, force) as tmp:
        for shard in shard_names:
            progress(f"folding {shard}")
            order, specs = shards.header(shard)
            if sorted(order) != sorted(k for k, v in weight_map.items() if v == shard):
                raise InputError(f"{folder / shard}: its tensors disagree with {index.name}")
            plan_out: list[tuple[str, torch.dtype, list[int]]] = []
            created: set[str] = set()
            for key in order:
                if template(key) not in splan.keep:
                    continue  # a norm tensor, a counter, or a buffer the fused model never reads
                dtype, shape = specs[key]
                plan_out.append((key, dtype, shape))
                bias_key = key.removesuffix(".weight") + ".bias"
                if key in fold_of and bias_key not in weight_map:
                    plan_out.append((bias_key, dtype, [shape[0]]))  # created by the fold, beside its weight
                    created.add(bias_key)
            writer = ShardWriter(tmp / shard, plan_out, metadata)
            try:
                for key, dtype, _ in plan_out:
                    new_map[key] = shard
                    if key in created:
                        continue  # written right after its weight
                    weight_key = key.removesuffix(".bias") + ".weight"
                    if key in fold_of:  # W' = W diag(s), b' = b + W t, one block of output rows at a time
                        bias_key = key.removesuffix(".weight") + ".bias"
                        old_bias = shards.get(bias_key) if bias_key in weight_map else None
                        scale, shift = affine(fold_of[key])
                        biases, start = [], 0
                        for block in shards.row_blocks(key, specs[key][1]):
                            part = None if old_bias is None else old_bias[start : start + len(block)]
                            w, b = fold.fold_into_linear(block, part, scale, shift)
                            if not fold.fits_dtype(w, b):
                                raise UnsupportedModelError(
                                    f"folding {fold_of[key].name} into {key} overflows {dtype}; fold it in memory "
                                    "without --stream (it keeps such norms as affines)"
                                )
                            writer.write(key, w)
                            biases.append(b)
                            start += len(block)
                        if bias_key in created:
                            writer.write(bias_key, torch.cat(biases))
                        dtypes.add(str(dtype).removeprefix("torch."))
                    elif key.endswith(".bias") and weight_key in fold_of:  # an existing bias: b + W t
                        scale, shift = affine(fold_of[weight_key])
                        old_bias, start = shards.get(key), 0
                        for block in shards.row_blocks(weight_key, shards.shape(weight_key)):
                            _, b = fold.fold_into_linear(block, old_bias[start : start + len(block)], scale, shift)
                            writer.write(key, b)
                            start += len(block)
                    else:
                        for block in shards.row_blocks(key, specs[key][1]):
                            writer.write(key, block)
            finally:
                writer.file.close()
            writer.finish()
            total += sum(numel(s) * torch.empty((), dtype=d).element_size() for _, d, s in plan_out)
        new_map = {k: new_map[k] for k in sorted(new_map)}
        (tmp / hf.SAFETENSORS_INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": new_map}, indent=2) + "\n"
        )
        (tmp / hf.CONFIG).write_text((folder / hf.CONFIG).read_text(encoding="utf-8"), encoding="utf-8")
        verification: dict[str, Any] | None = None
        if verify:
            progress("verifying one decoder layer at a time")
            verification = layerwise.verify_folders(
                folder,
                tmp,
                sequences=samples,
                seq_len=seq_len,
                seed=seed,
                rtol=rtol,
                atol=atol,
                block_elements=_FOLD_BLOCK,
                progress=progress,
            ).to_dict()
        written = [tmp / hf.CONFIG, tmp / hf.SAFETENSORS_INDEX, *(tmp / s for s in shard_names)]
        folds = []
        for n in norms:
            d = dict(n.plan.decision)
            d.update(norm=n.name, into=n.consumers, warnings=warnings.get(n.name, []))
            folds.append(d)
        report: dict[str, Any] = {
            "slabconv_version": __version__,
            "mode": "streaming",
            "source": {
                "path": str(folder),
                "format": "hf-safetensors-sharded",
                "arch": ARCH,
                "index_sha256": source_sha,
                "shards": shard_names,
                "num_hidden_layers": layers,
                "dtypes": sorted(dtypes),
            },
            "plan": {"tiny": dict(_TINY), "method": "graph.capture + plan.fold_all on a tiny instance"},
            "folds": folds,
            "summary": {"norms": len(folds), "folded": len(folds), "kept": 0},
            "verification": verification,
            "outputs": {
                "safetensors": shard_names,
                "index": hf.SAFETENSORS_INDEX,
                "onnx": None,
                "sha256": {f.name: sha256_file(f) for f in written},
            },
            "out_dir": str(out_dir),
        }
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if verification is not None and not verification["passed"]:
            raise VerificationError(
                f"the fused weights are not equivalent: {failure_line(verification)}; nothing was written", report
            )
    return report
