"""The streamed mode of the pipeline, for sharded checkpoints too big to load whole.

The same stages as an in-memory fold, each in bounded memory; what is family-specific (key names, the planning
instance, the decoder layer) comes from the zoo's ``DecoderFamily``:

1. **load**: the folder's index, shard headers and config only (``LazyShards``).
2. **plan**: the engine folds a tiny instance of the same architecture (``DecoderFamily.tiny_model``); its
   decisions, named by layer templates (``model.layers.{i}.``), hold for every layer of the big model, and the
   tensors the fused tiny graph reads say which big tensors to keep. Every norm must fold forward.
3. **apply + write**: ``write.shards.write_folded_shards`` folds each consumer weight one block of rows at a time
   with ``slabconv.fold`` and writes the shards with the input's boundaries; the folder gets the same Hugging Face
   files as an in-memory fold of a language model.
4. **verify**: ``verify.layerwise``: question 1 on the planning instance (float64 graphs) and on every written
   tensor (float64 fold, block by block); question 2 one decoder layer at a time.
5. **report**: the same ``Report`` as an in-memory fold, ``mode: streamed``.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from slabconv import engine, fold
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError
from slabconv.load import hf
from slabconv.load.fused import fused_metadata
from slabconv.load.shards import LazyShards, return_freed_blocks_to_the_os
from slabconv.load.source import Source
from slabconv.options import VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, no_progress, quiet, sha256_file
from slabconv.verify import judge, layerwise
from slabconv.verify.reference import float64_fold
from slabconv.verify.results import ExactCheck, Verification
from slabconv.write.shards import write_folded_shards
from slabconv.write.staging import staging_dir
from slabconv.zoo.decoder import DecoderFamily, family_of

FOLD_BLOCK = 1 << 22
"""Elements per row block: ``fold_into_linear``'s float64 temporaries, copies and checks (rows are independent)."""


# --------------------------------------------------------------------------------------------- plan


@dataclass
class NormTemplate:
    """One norm of the tiny plan, named by templates: its tensors by role, eps, the Linears it folds into."""

    decision: engine.Decision
    roles: dict[str, str | None]
    eps: float


@dataclass
class StreamPlan:
    """The tiny plan: norms (templates, graph order), the tensor templates the fused model reads, every tensor
    template of the original, and question 1 answered on the tiny instance."""

    family: DecoderFamily
    norms: list[NormTemplate]
    keep: set[str]
    known: set[str]
    exact: ExactCheck | None = None


def make_plan(family: DecoderFamily, config: dict[str, Any], keys: dict[str, Any]) -> StreamPlan:
    """Trace and fold the tiny instance (and its float64 twin, for question 1); return its decisions as layer
    templates.

    Raises:
        UnsupportedModelError: some norm of the tiny plan does not fold forward, or its two layers disagree.
    """
    model = family.tiny_model(config, keys)
    example = family.tiny_example()
    with quiet():
        original = engine.capture(model, example)
    fused = copy.deepcopy(original)
    sites = {site.name: (dict(site.param_names), site.eps) for site in engine.find_norms(fused)}
    decisions = engine.fold_all(fused)
    refused = [d for d in decisions if d.action != engine.FOLDED_FORWARD]
    if refused:
        d = refused[0]
        raise UnsupportedModelError(
            f"a streamed fold needs every norm to fold forward; the plan for {d.norm} is {d.action} ({d.reason}); "
            "fold this model in memory without --stream"
        )
    plan = StreamPlan(family, [], {family.template(k) for k in engine.fused_state_dict(fused)}, set())
    plan.known = {family.template(k) for k in model.state_dict()}
    by_template: dict[str, NormTemplate] = {}
    for d in decisions:
        roles, eps = sites[d.norm]
        entry = NormTemplate(
            replace(d, norm=family.template(d.norm), into=[family.template(x) for x in d.into]),
            {r: family.template(v) if v else None for r, v in roles.items()},
            eps,
        )
        prev = by_template.get(entry.decision.norm)
        if prev is not None and (prev.roles, prev.decision.into, prev.eps) != (entry.roles, entry.decision.into, eps):
            raise UnsupportedModelError(f"the tiny plan folds {d.norm} differently from layer 0; not a uniform stack")
        by_template.setdefault(entry.decision.norm, entry)
    plan.norms = list(by_template.values())
    plan.exact = _tiny_exact(original, example)
    return plan


def _tiny_exact(original: Any, example: torch.Tensor) -> ExactCheck:
    """Question 1 on the planning instance: its fused float64 graph against its original float64 graph."""
    original64, fused64, _ = float64_fold(original, example)
    with torch.no_grad():
        got, want = fused64(example).numpy(), original64(example).numpy()
    check = judge.exact_graphs(["logits"], [got], [want])
    check.name = "fused graph vs original of the planning instance, both in float64"
    return check


@dataclass
class Norm:
    """One norm of the big model: its decision, its tensors by role, and its (lazily read) affine."""

    decision: engine.Decision
    keys: dict[str, str | None]
    eps: float
    affine: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


def instantiate(plan: StreamPlan, layers: int, weight_map: dict[str, str], index: Path) -> list[Norm]:
    """The tiny plan's norms for every layer of the big model, in graph order (layers, then the final norm).

    Raises:
        InputError: a tensor the plan needs is missing.
        UnsupportedModelError: a Linear reads two norms.
    """
    family = plan.family
    per_layer = [p for p in plan.norms if family.layer_prefix in p.decision.norm]
    ordered = [(p, i) for i in range(layers) for p in per_layer]
    ordered += [(p, -1) for p in plan.norms if family.layer_prefix not in p.decision.norm]
    norms: list[Norm] = []
    seen: set[str] = set()
    for template, i in ordered:

        def name(t: str, i: int = i) -> str:
            return family.instance(t, i) if i >= 0 else t

        d = template.decision
        keys = {r: name(v) if v else None for r, v in template.roles.items()}
        decision = replace(d, norm=name(d.norm), into=[name(c) for c in d.into], warnings=[])
        missing = [k for k in [*keys.values(), *(f"{c}.weight" for c in decision.into)] if k and k not in weight_map]
        if missing:
            raise InputError(f"{index}: {missing[0]!r} is missing (norm {decision.norm})")
        for consumer in decision.into:
            if consumer in seen:
                raise UnsupportedModelError(f"{consumer} reads two norms; a streamed fold refuses")
            seen.add(consumer)
        norms.append(Norm(decision, keys, template.eps))
    return norms


def _layers(family: DecoderFamily, weight_map: dict[str, str]) -> int:
    found = {int(m.group(1)) for k in weight_map if (m := family.layer_key.match(k))}
    if found != set(range(len(found))):
        raise InputError(f"decoder layer indices are not 0..{len(found) - 1}: {sorted(found)[:8]}...")
    return len(found)


# --------------------------------------------------------------------------------------------- the affines


def _affine(reader: LazyShards, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm's float64 ``(scale, shift)`` (Lemma 4.1), from its stored statistics (read once).

    Raises:
        InputError: NaN/Inf statistics, or ``running_var + eps <= 0``.
    """
    if norm.affine is None:
        stats = {r: (reader.get(k) if k else None) for r, k in norm.keys.items()}
        for role, t in stats.items():
            if t is not None and not bool(torch.isfinite(t).all()):
                raise InputError(f"norm {norm.decision.norm}: {role} holds NaN or Inf; the checkpoint is damaged")
        mean, var = stats.get("running_mean"), stats.get("running_var")
        if mean is None or var is None:
            raise UnsupportedModelError(f"norm {norm.decision.norm}: no running statistics to fold")
        if bool((var.double() + norm.eps <= 0).any()):
            raise InputError(f"norm {norm.decision.norm}: running_var + eps <= 0 for some channel; damaged")
        norm.affine = fold.repbn_affine(mean, var, norm.eps, stats.get("weight"), stats.get("bias"), stats.get("alpha"))
    return norm.affine


def _warnings(reader: LazyShards, norm: Norm) -> list[str]:
    """``engine.schedule_warnings`` for the progressive counters stored beside the norm."""
    keys = {k: f"{norm.decision.norm}.{k}" for k in ("warm", "iter", "total_step")}
    if not all(k in reader.weight_map for k in keys.values()):
        return []
    warm, it, total = (int(reader.get(keys[k])) for k in ("warm", "iter", "total_step"))
    return engine.schedule_warnings(warm, it, total)


# --------------------------------------------------------------------------------------------- fuse


@dataclass
class _Source:
    folder: Path
    config: dict[str, Any]
    index: Path
    weight_map: dict[str, str]
    shard_names: list[str]


def _read_source(folder: Path) -> _Source:
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
    weight_map = hf.read_index(found[0])
    return _Source(folder, config, found[0], weight_map, [s.name for s in hf.shard_paths(found[0])])


def folded_affines(
    reader: LazyShards, norms: list[Norm]
) -> dict[str, Callable[[str], tuple[torch.Tensor, torch.Tensor]]]:
    """Weight key of every Linear a norm folds into -> a function giving that norm's float64 affine."""
    out: dict[str, Callable[[str], tuple[torch.Tensor, torch.Tensor]]] = {}
    for norm in norms:
        affine = partial(_norm_affine, reader, norm)
        for consumer in norm.decision.into:
            out[f"{consumer}.weight"] = affine
    return out


def _norm_affine(reader: LazyShards, norm: Norm, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _affine(reader, norm)


def fuse_streamed(
    folder: Path,
    out_dir: Path,
    *,
    verify: VerifyOptions | None,
    write: WriteOptions,
    progress: Progress = no_progress,
) -> Report:
    """Fold every norm of a sharded decoder folder into ``out_dir`` without loading it whole (see the module
    docstring); ``out_dir`` was checked by the caller (``api.fuse``).

    Returns:
        The report (``mode: streamed``), also written as ``report.json``.

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input (exit 2); nothing is written.
        VerificationError: a check failed (exit 1); nothing is written.
    """
    if verify is not None and verify.inputs is not None:
        raise UsageError("--stream draws seeded random token sequences (--samples, --seed); --inputs is not supported")
    src = _read_source(folder)
    if verify is not None and verify.generate != 0:
        from slabconv.write.hf_llama import require_transformers

        require_transformers(fusing=True)  # the generation check needs it: say so before any work
        check_generation_fits(folder, verify)
    family = family_of(src.weight_map)
    layers = _layers(family, src.weight_map)
    return_freed_blocks_to_the_os()
    progress("planning on a tiny instance of the architecture")
    plan = make_plan(family, src.config, src.weight_map)
    unknown = sorted(k for k in src.weight_map if family.template(k) not in plan.known)
    if unknown:
        raise UnsupportedModelError(f"{src.index}: {unknown[0]!r} is not a tensor of {family.name} ({len(unknown)})")
    norms = instantiate(plan, layers, src.weight_map, src.index)
    reader = LazyShards(folder, src.weight_map, FOLD_BLOCK)
    affines = folded_affines(reader, norms)
    source_sha = sha256_file(src.index)
    metadata = fused_metadata(family.name, source_sha, True, src.config)
    report = Report("fuse", mode="streamed", out_dir=str(out_dir), folds=[n.decision for n in norms])
    with staging_dir(out_dir, write.force) as tmp:
        weight_map, total = write_folded_shards(
            tmp,
            reader,
            src.shard_names,
            keep=lambda key: family.template(key) in plan.keep,
            folded=affines,
            affine=lambda key: affines[key](key),
            metadata=metadata,
            progress=progress,
        )
        for norm in norms:
            norm.decision.warnings = _warnings(reader, norm)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / hf.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files = [hf.SAFETENSORS_INDEX, *src.shard_names, *_hf_files(tmp, src.config)]
        dtypes = sorted({str(d).removeprefix("torch.") for d, _ in reader.specs().values() if d.is_floating_point})
        report.source = Source(
            str(folder),
            source_sha,
            "hf-safetensors-sharded",
            family.name,
            dtype=dtypes[0] if len(dtypes) == 1 else ",".join(dtypes),
            extra={"num_hidden_layers": layers, "shards": src.shard_names, "index_sha256": source_sha},
        )
        report.plan = {"tiny": "the family's planning instance (zoo.decoder)", "norm_templates": len(plan.norms)}
        if verify is not None:
            started = time.monotonic()
            report.verification = _verify(folder, tmp, plan, affines, verify, progress)
            report.verification.generation = _generation(folder, tmp, verify, progress)
            _note_generation(report.verification, verify)
            report.verification.seconds = time.monotonic() - started
        report.rename(tmp, out_dir)
        if report.verification is not None and not report.verification.passed:
            # Nothing is written: the report names no output file.
            raise VerificationError(
                f"the fused weights are not equivalent: {report.verification.failure_line()}; nothing was written",
                report,
            )
        report.outputs = Outputs(
            files=files,
            safetensors=hf.SAFETENSORS_INDEX,
            hf_folder=True,
            sha256={name: sha256_file(tmp / name) for name in files},
        )
        report.write(tmp / "report.json")
    return report


def generation_memory(specs: Mapping[str, tuple[torch.dtype, list[int]]]) -> int:
    """Bytes the greedy-generation check holds at once for a model whose tensors are ``specs`` (name -> dtype,
    shape): the original in its dtype, its float64 copy (the reference) and the fused folder in its dtype."""
    total = 0
    for dtype, shape in specs.values():
        numel = 1
        for n in shape:
            numel *= int(n)
        total += numel * (2 * dtype.itemsize + 8)
    return total


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, None where there is no such file (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_generation_fits(folder: Path, opts: VerifyOptions | None) -> None:
    """Refuse, before any work, a streamed run whose greedy-generation check (on unless ``--generate 0``) cannot
    hold the original and fused models in this machine's memory.

    Raises:
        UsageError: the check would need more than the available memory (the message says how to skip it).
    """
    if opts is None or opts.generate == 0:
        return
    need, have = generation_memory(LazyShards.open(folder).specs()), available_memory()
    if have is not None and need > have:
        raise UsageError(
            f"{folder}: the greedy-generation check loads the original and the fused model whole (about "
            f"{need / 2**30:.1f} GiB; {have / 2**30:.1f} GiB available): pass --generate 0 to skip it (the report "
            "then says generation was not checked)"
        )


def _generation(source: Path, fused: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any] | None:
    """The same greedy-generation check as an in-memory fold (``verify.generate.check_fused_folder``): the
    original, loaded whole from ``source``, against the fused folder. None with ``--generate 0``."""
    if opts.generate == 0:
        return None
    from slabconv.load.model import load_model
    from slabconv.verify.generate import check_fused_folder
    from slabconv.verify.inputs import choose_inputs
    from slabconv.write.hf_llama import require_transformers

    require_transformers()
    progress("verifying: greedy generation, original vs fused folder")
    loaded = load_model(source)
    x = choose_inputs(loaded, None, opts.sample_count(), opts.seed)[0]
    return check_fused_folder(loaded.model, fused, x, opts.fuse_steps())


def _note_generation(verification: Verification, opts: VerifyOptions) -> None:
    if opts.generate == 0:
        verification.notes.append("greedy generation not checked (--generate 0)")


def _hf_files(folder: Path, config: dict[str, Any]) -> list[str]:
    """The Hugging Face model folder files (the same an in-memory fold of a language model writes)."""
    from slabconv.write.hf_llama import write_hf_llama_metadata

    return [p.name for p in write_hf_llama_metadata(folder, config)]


def _verify(
    source: Path,
    written: Path,
    plan: StreamPlan | None,
    affines: Mapping[str, Any] | None,
    opts: VerifyOptions,
    progress: Progress,
) -> Verification:
    """``layerwise.verify_folders`` with the options of a streamed run; the plan's float64 check (question 1 on
    the tiny model) goes first among the exact checks."""
    verification = layerwise.verify_folders(
        source,
        written,
        sequences=opts.sample_count(streamed=True),
        seed=opts.seed,
        rtol=opts.rtol,
        atol=opts.atol,
        strict=opts.strict,
        folded=affines,
        block_elements=FOLD_BLOCK,
        progress=progress,
    )
    if plan is not None and plan.exact is not None:
        verification.exact.insert(0, plan.exact)
    return verification


def verify_streamed(reference: Path, candidate: Path, opts: VerifyOptions, progress: Progress) -> Report:
    """``verify --stream``: two decoder folders compared one layer at a time; question 1 when the candidate is a
    streamed or in-memory fold of the reference (a fresh plan of the reference says which tensors it folds).

    Raises:
        UsageError: ``--inputs`` (the streamed mode draws seeded token sequences), or a side that is a file.
    """
    if opts.inputs is not None:
        raise UsageError("--stream draws seeded random token sequences (--samples, --seed); --inputs is not supported")
    for path in (reference, candidate):
        if not path.is_dir():
            raise UsageError(f"{path}: --stream compares Hugging Face style folders; give the folder, not a file")
    if opts.generate:
        from slabconv.verify.pair import require_fused_lm_folder

        require_fused_lm_folder(candidate)
        check_generation_fits(reference, opts)
    src, cand = LazyShards.open(reference), LazyShards.open(candidate)
    family = family_of(src.weight_map)
    affines = None
    plan = None
    first = family.layer_prefix.format(i=0) + family.layer_norms[0]
    folded = (
        family.norm_layout(src.weight_map, first) is not None and family.norm_layout(cand.weight_map, first) is None
    )
    if folded:
        plan = make_plan(family, hf.read_hf_config(reference), src.weight_map)
        norms = instantiate(plan, _layers(family, src.weight_map), src.weight_map, reference)
        affines = folded_affines(src, norms)
    verification = _verify(reference, candidate, plan, affines, opts, progress)
    if opts.generate:
        verification.generation = _generation(reference, candidate, opts, progress)
    if not folded:
        verification.notes.append(
            "question 1 (is the fold exact?) not answered: the candidate is not a fold of the reference (its norms are "
            "still there, or the reference has none); question 2 only"
        )

    def side(path: Path) -> Source:
        found = hf.hf_weights_file(path)
        assert found is not None
        return Source(
            str(path), sha256_file(found[0]), found[1], family.name, extra={"index_sha256": sha256_file(found[0])}
        )

    return Report("verify", reference=side(reference), candidate=side(candidate), verification=verification)
