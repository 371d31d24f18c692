"""The streamed mode of the pipeline, for sharded checkpoints too big to load whole.

The same stages as an in-memory fold and the same engine, each in bounded memory:

1. **load**: the folder's index, shard headers and config only (``LazyShards``); the architecture is detected
   or named (``--arch``); a folder without ``config.json`` is read with an empty config.
2. **plan**: the engine traces the full-size architecture with stand-in weights (``slabconv.load.lazy``: norm
   tensors, biases and other vectors read for real, the big weights shapes only) and plans every norm on it
   (``engine.fold_program(unknown=...)``): the same decisions, reasons and fold program as an in-memory fold.
   Every norm must fold (forward or backward): a kept affine needs a graph, which the streamed output has not.
3. **apply + write**: ``write.shards.write_program_shards`` runs the program over the shards, one block of rows
   at a time (every fold composed in float64, rounded once: the tensors an in-memory fold writes, bit for bit),
   with the input's shard boundaries; a language model's folder gets the same Hugging Face files as in memory.
4. **verify**: question 1 on every written tensor (``verify.layerwise.exact_streamed``: the program again, in
   float64) and question 2 one decoder layer at a time (``verify.layerwise``), for a decoder family; another
   family has no streamed question 2, so it streams only with ``--no-verify`` (``slabconv verify`` in memory
   checks the result).
5. **report**: the same ``Report`` as an in-memory fold, ``mode: streamed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slabconv import engine
from slabconv.errors import InputError, UnsupportedModelError, UsageError, VerificationError
from slabconv.load import hf
from slabconv.load.fused import fused_metadata
from slabconv.load.shards import LazyShards, return_freed_blocks_to_the_os
from slabconv.load.source import Source
from slabconv.options import LoadOptions, VerifyOptions, WriteOptions
from slabconv.report.data import Outputs, Report
from slabconv.util import Progress, no_progress, quiet, sha256_file
from slabconv.verify import layerwise
from slabconv.verify.results import Verification
from slabconv.write.shards import write_program_shards
from slabconv.write.staging import staging_dir
from slabconv.zoo.decoder import DecoderFamily, family_of

FOLD_BLOCK = engine.FOLD_BLOCK
"""Elements per row block: the fold program's float64 temporaries, copies and checks (rows are independent)."""


# --------------------------------------------------------------------------------------------- plan


@dataclass
class StreamPlan:
    """The streamed plan: the architecture, one decision per norm and the fold program."""

    arch: str
    decisions: list[engine.Decision]
    program: engine.Program
    family: DecoderFamily | None


def make_plan(reader: LazyShards, config: dict[str, Any], arch: str | None, sha256: str) -> StreamPlan:
    """Plan the fold of a sharded checkpoint on its full-size architecture with stand-in weights.

    Raises:
        UnsupportedModelError: a norm that does not fold away (kept as an affine or as it is): the streamed output
            has no graph to hold it; the architecture cannot be detected or traced.
    """
    from slabconv.load.lazy import planning_model

    planning = planning_model(reader, config, arch, sha256)
    loaded = planning.loaded
    with quiet():
        gm = engine.capture(loaded.model, loaded.trace_example(), sequence=loaded.max_sequence)
    decisions, program = engine.fold_program(gm, unknown=planning.unknown)
    kept = [d for d in decisions if not d.action.startswith("folded")]
    if kept:
        d = kept[0]
        raise UnsupportedModelError(
            f"a streamed fold needs every norm to fold away; the plan for {d.norm} is {d.action} ({d.reason}); "
            "fold this model in memory without --stream"
        )
    made = sorted(k for k, r in program.tensors.items() if r.op == "const")
    if made:
        raise UnsupportedModelError(
            f"the fused model stores {made[0]!r}, which the checkpoint does not hold; "
            "fold it in memory without --stream"
        )
    try:
        family: DecoderFamily | None = family_of(reader.weight_map)
    except UnsupportedModelError:
        family = None
    assert loaded.arch is not None
    return StreamPlan(loaded.arch, decisions, program, family)


def _is_decoder(weight_map: Mapping[str, str]) -> bool:
    try:
        family_of(weight_map)
    except UnsupportedModelError:
        return False
    return True


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
    found = hf.hf_weights_file(folder)
    if found is None or found[1] != "hf-safetensors-sharded":
        have = found[0].name if found else "no weights"
        raise UsageError(
            f"{folder}: --stream needs sharded safetensors (model.safetensors.index.json + shards), found {have}; "
            "fold it in memory without --stream"
        )
    config = hf.read_hf_config(folder) if (folder / hf.CONFIG).is_file() else {}
    weight_map = hf.read_index(found[0])
    return _Source(folder, config, found[0], weight_map, [s.name for s in hf.shard_paths(found[0])])


def fuse_streamed(
    folder: Path,
    out_dir: Path,
    *,
    verify: VerifyOptions | None,
    write: WriteOptions,
    load: LoadOptions | None = None,
    progress: Progress = no_progress,
) -> Report:
    """Fold every norm of a sharded folder into ``out_dir`` without loading it whole (see the module docstring);
    ``out_dir`` was checked by the caller (``api.fuse``).

    Returns:
        The report (``mode: streamed``), also written as ``report.json``.

    Raises:
        InputError, UnsupportedModelError, UsageError: bad input (exit 2); nothing is written.
        VerificationError: a check failed (exit 1); nothing is written.
    """
    if verify is not None and verify.inputs is not None:
        raise UsageError("--stream draws seeded random token sequences (--samples, --seed); --inputs is not supported")
    src = _read_source(folder)
    return_freed_blocks_to_the_os()
    reader = LazyShards(folder, src.weight_map, FOLD_BLOCK)
    source_sha = sha256_file(src.index)
    if verify is not None and not _is_decoder(src.weight_map):
        raise UsageError(
            f"--stream verifies decoder language models one layer at a time; {folder} has no streamed question 2: "
            "fold it in memory, or pass --no-verify and run slabconv verify on the two folders"
        )
    progress("planning on the full-size architecture (stand-in weights)")
    plan = make_plan(reader, src.config, load.arch if load else None, source_sha)
    if verify is not None and verify.generate != 0 and plan.family is not None:
        from slabconv.write.hf_llama import require_transformers

        require_transformers(fusing=True)  # the generation check needs it: say so before any work
        check_generation_fits(folder, verify)
    metadata = fused_metadata(plan.arch, source_sha, True, src.config)
    report = Report("fuse", mode="streamed", out_dir=str(out_dir), folds=plan.decisions)
    with staging_dir(out_dir, write.force) as tmp:
        weight_map, total = write_program_shards(
            tmp, reader, src.shard_names, plan.program, metadata, progress, FOLD_BLOCK
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / hf.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files = [hf.SAFETENSORS_INDEX, *src.shard_names]
        if plan.family is not None:
            files += _hf_files(tmp, src.config)
        report.source = _source(folder, source_sha, plan, reader, src)
        report.plan = {"planning": "the full-size architecture, stand-in weights (slabconv.load.lazy)"}
        if verify is not None:
            started = time.monotonic()
            report.verification = _verify(folder, tmp, plan.program, verify, progress)
            if plan.family is not None:
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
            hf_folder=plan.family is not None,
            sha256={name: sha256_file(tmp / name) for name in files},
        )
        report.write(tmp / "report.json")
    return report


def _source(folder: Path, sha: str, plan: StreamPlan, reader: LazyShards, src: _Source) -> Source:
    """The report's ``source`` block of a streamed fold."""
    dtypes = sorted({str(d).removeprefix("torch.") for d, _ in reader.specs().values() if d.is_floating_point})
    extra: dict[str, Any] = {"shards": src.shard_names, "index_sha256": sha}
    if "num_hidden_layers" in src.config:
        extra["num_hidden_layers"] = src.config["num_hidden_layers"]
    return Source(
        str(folder),
        sha,
        "hf-safetensors-sharded",
        plan.arch,
        dtype=dtypes[0] if len(dtypes) == 1 else ",".join(dtypes),
        extra=extra,
    )


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
    source: Path, written: Path, program: engine.Program | None, opts: VerifyOptions, progress: Progress
) -> Verification:
    """``layerwise.verify_folders`` with the options of a streamed run of a decoder family (question 1 too when
    ``program``, the fold program of ``source``, says how ``written`` was made)."""
    return layerwise.verify_folders(
        source,
        written,
        sequences=opts.sample_count(streamed=True),
        seed=opts.seed,
        rtol=opts.rtol,
        atol=opts.atol,
        strict=opts.strict,
        program=program,
        block_elements=FOLD_BLOCK,
        progress=progress,
    )


def verify_streamed(reference: Path, candidate: Path, opts: VerifyOptions, progress: Progress) -> Report:
    """``verify --stream``: two decoder folders compared one layer at a time; question 1 when the candidate is a
    streamed or in-memory fold of the reference (a fresh plan of the reference says how each tensor is made).

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
    program = None
    first = family.layer_prefix.format(i=0) + family.layer_norms[0]
    folded = (
        family.norm_layout(src.weight_map, first) is not None and family.norm_layout(cand.weight_map, first) is None
    )
    if folded:
        found = hf.hf_weights_file(reference)
        sha = sha256_file(found[0]) if found else ""
        program = make_plan(src, hf.read_hf_config(reference), None, sha).program
    verification = _verify(reference, candidate, program, opts, progress)
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
