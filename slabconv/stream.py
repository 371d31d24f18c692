"""``verify --stream``: two Hugging Face style decoder folders compared one decoder layer at a time, in bounded
memory (``slabconv.verify.layerwise``).

``fuse --stream`` is not here: it is the one fuse driver (``slabconv.pipeline``) with streamed stages.
"""

from __future__ import annotations

from pathlib import Path

from slabconv import engine
from slabconv.errors import UsageError
from slabconv.load import hf
from slabconv.load.shards import LazyShards
from slabconv.load.source import Source
from slabconv.options import VerifyOptions
from slabconv.pipeline import FOLD_BLOCK, plan_sharded
from slabconv.report.data import Report
from slabconv.util import Progress, sha256_file
from slabconv.verify.streamed import check_generation_fits, generation, verify_folders
from slabconv.zoo.decoder import family_of


def verify_streamed(
    reference: Path, candidate: Path, opts: VerifyOptions, progress: Progress, norm_affine: bool = False
) -> Report:
    """``verify --stream``: two decoder folders compared one layer at a time; question 1 when the candidate is a
    streamed or in-memory fold of the reference (a fresh streamed plan of the reference says how each tensor is
    made; ``norm_affine``: the candidate is a fold with ``fold_norm_affine``, whose norms stay with unit weights).

    Raises:
        UsageError: ``--inputs`` (the streamed mode draws seeded token sequences), or a side that is a file.
        UnsupportedModelError: a side is not a decoder folder of a family slabconv streams.
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
    program: engine.Program | None = None
    first = family.layer_prefix.format(i=0) + family.layer_norms[0]
    folded = norm_affine or (
        family.norm_layout(src.weight_map, first) is not None and family.norm_layout(cand.weight_map, first) is None
    )
    if folded:
        found = hf.hf_weights_file(reference)
        sha = sha256_file(found[0]) if found else ""
        config = hf.read_hf_config(reference)
        program = plan_sharded(src, config, None, sha, norm_affine=norm_affine)[1].program
    verification = verify_folders(reference, candidate, program, opts, progress, FOLD_BLOCK)
    if opts.generate:
        verification.generation = generation(reference, candidate, opts, progress)
    if not folded:
        verification.notes.append(
            "question 1 (is the fold exact?) not answered: the candidate is not a fold of the reference (its norms are "
            "still there, or the reference has none); question 2 only"
        )

    def side(path: Path) -> Source:
        found = hf.hf_weights_file(path)
        assert found is not None
        digest = sha256_file(found[0])
        return Source(str(path), digest, found[1], family.name, extra={"index_sha256": digest})

    return Report("verify", reference=side(reference), candidate=side(candidate), verification=verification)
