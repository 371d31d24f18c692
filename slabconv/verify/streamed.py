"""Verification of a streamed fold, in bounded memory: question 1 on every written tensor and question 2 one
decoder layer at a time (``slabconv.verify.layerwise``), and the greedy-generation check of a language model,
refused before any work when it cannot fit this machine's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slabconv.engine import FOLD_BLOCK, Program
from slabconv.errors import UsageError
from slabconv.load.shards import LazyShards
from slabconv.options import VerifyOptions
from slabconv.util import Progress, no_progress
from slabconv.verify import layerwise
from slabconv.verify.results import Verification


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


def generation(source: Path, fused: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any] | None:
    """The same greedy-generation check as an in-memory fold (``verify.generate.check_fused_folder``): the
    original, loaded whole from ``source``, against the fused folder. None with ``--generate 0``.

    Raises:
        UsageError: transformers is not installed.
    """
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


def verify_folders(
    source: Path,
    written: Path,
    program: Program | None,
    opts: VerifyOptions,
    progress: Progress = no_progress,
    block_elements: int = FOLD_BLOCK,
) -> Verification:
    """``layerwise.verify_folders`` with the options of a streamed run of a decoder family: question 2 one decoder
    layer at a time, and question 1 too when ``program`` (the fold program of ``source``) says how ``written`` was
    made."""
    return layerwise.verify_folders(
        source,
        written,
        sequences=opts.sample_count(streamed=True),
        seed=opts.seed,
        rtol=opts.rtol,
        atol=opts.atol,
        strict=opts.strict,
        program=program,
        block_elements=block_elements,
        progress=progress,
    )


def verify_streamed_fold(
    source: Path,
    written: Path,
    program: Program,
    opts: VerifyOptions,
    progress: Progress = no_progress,
    block_elements: int = FOLD_BLOCK,
    language_model: bool = True,
) -> Verification:
    """Everything ``fuse --stream`` checks before it publishes a fold of ``source`` into ``written``: both
    questions (``verify_folders``) and, for a language model, greedy generation (``opts.generate`` steps; 0 skips
    it with a note saying so)."""
    verification = verify_folders(source, written, program, opts, progress, block_elements)
    if language_model:
        verification.generation = generation(source, written, opts, progress)
        if opts.generate == 0:
            verification.notes.append("greedy generation not checked (--generate 0)")
    return verification
