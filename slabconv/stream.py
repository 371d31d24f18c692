"""``verify --stream``: the two sides of a layer-by-layer comparison of decoder folders, in bounded memory
(``slabconv.verify.layerwise``, run by the one verifier ``slabconv.verify.verifier``).

``fuse --stream`` is not here: it is the one fuse driver (``slabconv.pipeline``) with streamed stages.
"""

from __future__ import annotations

from pathlib import Path

from slabconv.errors import UsageError
from slabconv.load import hf
from slabconv.options import VerifyOptions
from slabconv.pipeline import plan_sharded
from slabconv.util import Progress, sha256_file
from slabconv.verify import sides
from slabconv.verify.generate_streamed import check_generation_fits


def streamed_sides(
    reference: Path, candidate: Path, opts: VerifyOptions, progress: Progress, norm_affine: bool = False
) -> tuple[sides.Side, sides.Side]:
    """The two sides of ``verify --stream``; when the candidate is a fold of the reference, the reference carries
    its fold program (a fresh streamed plan, ``pipeline.plan_sharded``; with the norms' affines folded too when
    ``norm_affine`` or the candidate records a fold made so) for question 1.

    Raises:
        UsageError: ``--inputs`` (the streamed mode draws seeded token sequences), a side that is a file, a
            generation check that cannot fit in memory.
        UnsupportedModelError: a side is not a decoder folder of a family slabconv streams.
    """
    if opts.inputs is not None:
        raise UsageError("--stream draws seeded random token sequences (--samples, --seed); --inputs is not supported")
    ref, cand = sides.streamed_side(reference), sides.streamed_side(candidate)
    if opts.generate:
        check_generation_fits(reference, opts.generate, opts.sample_count(streamed=True), opts.seed)
    if sides.folded_from(ref, cand):
        progress("planning the reference's fold, for question 1")
        found = hf.hf_weights_file(reference)
        sha = sha256_file(found[0]) if found else ""
        from slabconv.load.shards import LazyShards

        affine = norm_affine or (cand.provenance is not None and cand.provenance.norm_affine)
        shards, config = LazyShards.open(reference), hf.read_hf_config(reference)
        ref.program = plan_sharded(shards, config, None, sha, norm_affine=affine)[1].program
    return ref, cand
