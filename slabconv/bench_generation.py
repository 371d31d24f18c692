"""``slabconv bench`` of a language model: greedy generation timed like for like, original against fused.

Both models run as transformers' own ``LlamaForCausalLM`` (the class of the fused folder's modeling file), in the
same process, dtype, thread count and ``generate`` call with the key/value cache:

- **fused**: the fused folder as written (norms are ``nn.Identity``, projections carry the fold's biases);
- **original**: the same class with the original's weights and its norm modules (the SLAB ``LinearNorm`` /
  RepBN of ``slabconv.zoo.llama``, in eval mode) put back where the fused model has identities.

So the only difference timed is the norms the fold removed. The original's tokens are also compared with the
zoo model's own greedy tokens (no cache): the transformers twin (``slabconv.verify.generate.original_twin``, the
generation check's baseline too) is only timed when it computes the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv.load.model import LoadedModel
from slabconv.options import LoadOptions, WriteOptions
from slabconv.util import Progress
from slabconv.verify.generate import greedy_fused, greedy_original, original_twin

PROMPTS = 8
"""Prompts per timed ``generate`` call."""


def time_generation(loaded: LoadedModel, fused_folder: Path, token_ids: np.ndarray, steps: int = 32) -> dict[str, Any]:
    """Greedy tokens/s of the original and the fused model in transformers with the key/value cache, one thread.

    Args:
        loaded: the original language model.
        fused_folder: its fused folder.
        token_ids: int64 ``(S, T)`` inputs; the prompts are the first ``PROMPTS`` rows, their first half.
        steps: tokens generated per prompt.

    Returns:
        ``{"runtime", "prompts", "prompt_length", "steps", "original_tokens_per_second",
        "fused_tokens_per_second", "fused_over_original", "same_tokens"}``; ``same_tokens``: the twin's tokens
        equal the zoo original's own (no cache) and the fused folder's.
    """
    import transformers

    ids = np.asarray(token_ids)[:PROMPTS]
    prompts = ids[:, : max(1, ids.shape[1] // 2)]
    from slabconv.write.hf_llama import load_fused_llama

    reference = greedy_original(loaded.model, prompts, steps, keep_logits=False, threads=1)
    model = load_fused_llama(fused_folder)
    twin = greedy_fused(original_twin(loaded.model, model.config, loaded.dtype), prompts, steps, threads=1)
    fused = greedy_fused(model, prompts, steps, threads=1)
    same = bool(np.array_equal(twin.tokens, reference.tokens) and np.array_equal(fused.tokens, reference.tokens))
    return {
        "runtime": f"transformers {transformers.__version__} generate (KV cache), torch {torch.__version__}, 1 thread",
        "prompts": int(prompts.shape[0]),
        "prompt_length": int(prompts.shape[1]),
        "steps": int(steps),
        "original_tokens_per_second": twin.tokens_per_second,
        "fused_tokens_per_second": fused.tokens_per_second,
        "fused_over_original": fused.tokens_per_second / twin.tokens_per_second,
        "same_tokens": same,
    }


def is_language_model(loaded: LoadedModel) -> bool:
    """A zoo language model (its fused folder is a Hugging Face folder that generates)."""
    from slabconv.zoo import get_arch

    return loaded.arch is not None and loaded.token_input and get_arch(loaded.arch).family == "llama"


def bench_generation(source: Path, load: LoadOptions, loaded: LoadedModel, progress: Progress) -> dict[str, Any]:
    """Greedy generation of the original and the fused model timed like for like (``time_generation``), the fused
    folder made in a temporary folder by the fuse driver (``slabconv.pipeline``, no verification: ``bench`` times,
    ``fuse`` verifies); a note instead when transformers is not installed."""
    import tempfile

    from slabconv.errors import UsageError
    from slabconv.pipeline import run_fuse
    from slabconv.verify.inputs import choose_inputs
    from slabconv.write.hf_llama import require_transformers

    try:
        require_transformers()
    except UsageError as err:
        return {"note": f"greedy generation not timed: {err}"}
    progress("timing greedy generation: original and fused, transformers with the KV cache")
    with tempfile.TemporaryDirectory(prefix="slabconv-bench-") as tmp:
        folder = Path(tmp) / "fused"
        run_fuse(source, folder, load=load, verify=None, write=WriteOptions(onnx=False, pt2=False))
        x = choose_inputs(loaded, None, PROMPTS, 1)[0]
        return time_generation(loaded, folder, x)
