"""The greedy-generation check of a streamed fold, in bounded memory: the same check as in memory
(``slabconv.verify.generate.check_generation``), with no model ever held whole.

- The fused folder generates through transformers' own ``generate`` with the key/value cache, as
  ``SlabconvLlamaForCausalLM`` (the class of the folder's modeling file) built on the meta device, each Linear a
  ``layerwise.StreamedLinear`` that reads its weight from the shards one block of rows at a time whenever it runs,
  the embedding reading only the rows of the tokens it is given (``streamed_fused_llama``). Each generated token
  reads every weight once, in the checkpoint's dtype where the CPU computes it natively (``compute_dtype``): no
  copy of a weight in another dtype is made. Every token asks for the weight blocks in the same order, so a thread
  reads the next block while torch computes on the last one (``LazyShards.read_ahead``), torch keeping the other
  cores.
- Question 2 (``layerwise.verify_folders``) then runs on the prompts followed by the folder's tokens
  (``FusedRun.sequences``), one decoder layer at a time: its float64 chain's logits give the original's greedy
  token and exact margin at every step (``FusedRun.judged``), so the original runs in float64 once for both checks.
- Unlike in memory, the original as transformers' LLaMA does not generate as a baseline here: it would read every
  weight once more per token, doubling the cost of the check, and it decides nothing.

Memory: one block of one weight in two dtypes, the key/value cache of the prompts, and question 2's activations
and logits on those sequences (``streamed_generation_memory``), checked before any work (``check_generation_fits``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slabconv.engine import FOLD_BLOCK
from slabconv.engine.program import CACHE_BLOCK
from slabconv.errors import UnsupportedModelError, UsageError
from slabconv.load.shards import LazyShards, return_freed_blocks_to_the_os
from slabconv.text import count
from slabconv.util import Progress, no_progress
from slabconv.verify.generate import (
    compute_dtype,
    decoder_sizes,
    greedy_fused,
    judged_dtype,
    prompts_of,
    settings_not_applied,
    torch_threads,
    within_positions,
)
from slabconv.verify.greedy import GreedyRun, compare_greedy, not_loaded_check
from slabconv.verify.layerwise import DEFAULT_SEQ_LEN, Folder, StreamedEmbedding, StreamedLinear, stream_linears
from slabconv.verify.policy import dtype_name

PROMPT_LEN = DEFAULT_SEQ_LEN // 2
"""Tokens per prompt of a streamed check: the first half of a question-2 length sequence (``layerwise``)."""


def _streamed(model: Any, dtype: torch.dtype) -> Any:
    """``model`` (built on the meta device, its weights replaced by streamed modules) as an instance of a subclass
    that answers ``device`` (the CPU) and ``dtype`` itself: transformers asks its first parameter, which a streamed
    model does not have."""
    base = type(model)
    streamed = type(
        f"Streamed{base.__name__}",
        (base,),
        {"device": property(lambda self: torch.device("cpu")), "dtype": property(lambda self: dtype)},
    )
    model.__class__ = streamed
    return model


def streamed_fused_llama(folder: Path | str, dtype: torch.dtype, block_elements: int = 1 << 22) -> Any:
    """The fused folder in transformers with its weights left in the shards (module docstring).

    Args:
        folder: a fused LLaMA folder (``write_hf_llama_metadata``), sharded or not.
        dtype: the dtype it computes in (each block of weights is read in its stored dtype and cast to it).
        block_elements: elements per block of weight rows read at a time.

    Returns:
        A ``SlabconvLlamaForCausalLM`` (a subclass answering ``device`` and ``dtype``) in eval mode:
        ``input_ids`` int64 ``(B, T)`` -> ``.logits`` ``(B, T, V)``; ``generate``.

    Raises:
        UsageError: transformers is not installed or too old; the folder is not a fused LLaMA folder.
        UnsupportedModelError: its weights are not norm-free, or do not fill the model ``config.json`` describes
            exactly (``hf_llama.fused_layout``: every name and shape; a projection's bias as its
            ``projection_bias`` says).
        InputError: a damaged index or header.
    """
    from slabconv.write.hf_llama import MODEL_TYPE, fused_layout, require_transformers

    require_transformers()
    from slabconv.write.templates.modeling_slabconv_llama import SlabconvLlamaConfig, SlabconvLlamaForCausalLM

    folder = Path(folder)
    config = SlabconvLlamaConfig.from_pretrained(folder)
    if config.model_type != MODEL_TYPE:
        raise UsageError(f"{folder}: model_type {config.model_type!r}, not {MODEL_TYPE!r}")
    shards = LazyShards.open(folder, block_elements)
    fused_layout(folder, {k: shape for k, (_, shape) in shards.specs().items()}, config.to_dict())
    with torch.device("meta"):
        model = SlabconvLlamaForCausalLM(config)
    stream_linears(model, lambda name: StreamedLinear(shards, name, keep_bias=True))
    model.model.embed_tokens = StreamedEmbedding(shards, "model.embed_tokens.weight", dtype)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return _streamed(model, dtype).eval()


def streamed_prompts(source: Folder, sequences: int, seed: int, given: torch.Tensor | None = None) -> torch.Tensor:
    """The prompts of a streamed check: ``sequences`` (at least one) seeded random token sequences of ``PROMPT_LEN``
    tokens, int64 ``(B, T)`` (``generate.within_positions`` fits them to the model's positions). One per sequence
    question 2 runs (``--samples``), since question 2 runs on them and the tokens generated after them; a token
    step reads every weight once whatever the batch, so more prompts cost little more. With ``given`` rows
    (``given_sequences``: ``--inputs``), their prompts as in memory (``generate.prompts_of``)."""
    if given is not None:
        return prompts_of(given)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, source.family.vocab_size(source.cfg), (max(1, sequences), PROMPT_LEN), generator=generator)


def given_sequences(
    source: Folder, inputs: Path | str | None, limit: int | None
) -> tuple[torch.Tensor, str, str] | None:
    """The token rows of ``--inputs``, else of the ``holdout.npz`` in the original's folder (as in memory:
    ``inputs.holdout_beside``), for a streamed check of the original ``source``: int64 ``(N, T)``, any ``T`` from 2
    to the model's positions, ids below its vocabulary; the first ``limit`` rows (an explicit ``--samples``); the
    report's name for them; and the sha256 of the file (the report's ``inputs_sha256``, as in memory). None where
    there is neither.

    Raises:
        InputError: as ``inputs.read_inputs_file`` and ``inputs.check_sequences``.
    """
    from slabconv.verify.inputs import check_sequences, holdout_beside, read_inputs_file

    path = Path(inputs) if inputs is not None else holdout_beside(source.path)
    if path is None:
        return None
    rows, digest = read_inputs_file(path, None, True, source.family.vocab_size(source.cfg))
    check_sequences(rows, path, source.family.max_positions(source.cfg))
    label = str(path) if limit is None or limit >= len(rows) else f"{path}, its first {limit} of {len(rows)} rows"
    return torch.from_numpy(rows[:limit]), label, digest


def streamed_generation_memory(source: Folder, prompts: int, prompt_len: int, steps: int, block_elements: int) -> int:
    """Bytes the streamed check holds at once, besides the interpreter: the largest of its stages.

    - generation: two blocks of weight rows in their stored dtype (the one computed on, the next one read ahead:
      ``LazyShards.read_ahead``) and one in the compute dtype (and its outputs), the key/value cache of every layer
      (``2 L B (T + N) K d`` values) and the logits of one step;
    - question 2 on the prompts and the generated tokens (its float64 chain is the generation's reference): a
      block of rows in float64 (and float32, on its way from half precision) and, read beside it for the
      half-precision chains, one in the stored dtype; the hidden states of its chains;
      the widest activations of one layer (the MLP's intermediate size, the attention scores ``B H (T+N)^2``) in
      float64 for twice the prompts (the float64 chain and the original's input beside it); the logits
      ``(B, T+N, V)`` of the three chains (the float64 chain's in float64, the half-precision chains' in float32,
      which holds them exactly) and the blocks the comparisons convert (``blocks.CHUNK_BYTES``, four at once);
    - besides either, question 1 in its thread (``layerwise.ExactBeside``): a block of the original's rows, of the
      written ones and of the rows rounded once, in the stored dtype, one cache-sized piece in float64 and float32,
      and the float64 rows (and their float32 widening) of a block that differs from the fold.
    """
    from slabconv.verify.blocks import CHUNK_BYTES

    cfg, fam = source.cfg, source.family
    layers, vocab = fam.num_layers(cfg), fam.vocab_size(cfg)
    length = prompt_len + steps
    hidden, inter, kv, widest = decoder_sizes(cfg, prompts, length)
    stored = source.dtype.itemsize
    computed = compute_dtype(source.dtype).itemsize
    block = block_elements * (2 * stored + computed)
    cache = 2 * layers * prompts * length * kv * computed
    generating = block + cache + 2 * prompts * length * max(inter, vocab // 8) * computed
    logits = 2 * prompts * length * vocab + 4 * CHUNK_BYTES // 8
    exact = block_elements * (2 * stored + 4 + 8) + 8 * (2 * widest + 4 * prompts * length * hidden + logits)
    question_1 = block_elements * (3 * stored + 8 + 4) + CACHE_BLOCK * (8 + 4 + stored)
    return max(generating, exact) + question_1


def streams(source: Folder) -> bool:
    """Whether the streamed check runs on a fold of ``source``: a LLaMA-PRepBN folder, whose fused folder is
    ``SlabconvLlamaForCausalLM``. A standard decoder (LLaMA, Mistral, Qwen2: ``zoo.decoder.STANDARD``) fused into
    its own architecture is checked as in memory (``verify.generate.check_fused_folder``), both models loaded."""
    from slabconv.zoo.decoder import STANDARD

    return source.family is not STANDARD


def check_generation_fits(
    folder: Path,
    steps: int | None,
    sequences: int,
    seed: int = 0,
    block_elements: int = FOLD_BLOCK,
    inputs: Path | str | None = None,
    limit: int | None = None,
) -> None:
    """Refuse, before any work, a streamed check of ``steps`` tokens (None or 0: no check) on ``sequences`` prompts
    (``streamed_prompts``; those of ``inputs``' or the folder's ``holdout.npz``'s first ``limit`` rows where there
    are some: ``given_sequences``) of the original
    ``folder`` that cannot fit this machine's available memory
    (``streamed_generation_memory``; ``generate.available_memory``). The prompts and steps are those the check
    runs, cut to the model's ``max_position_embeddings`` (``generate.within_positions``).

    Raises:
        UsageError: the check would need more than the available memory (the message says how much, and how to skip
            it).
        InputError: ``inputs`` that the model cannot take (``given_sequences``).
    """
    original = Folder.open(Path(folder), block_elements)
    given = given_sequences(original, inputs, limit)  # refused before any work, with or without generation
    if not steps:
        return
    from slabconv.verify.generate import available_memory

    if streams(original):  # the prompts and steps the check will run: cut to the model's positions as it cuts them
        positions = original.family.max_positions(original.cfg)
        drawn = streamed_prompts(original, sequences, seed, given[0] if given else None)
        prompts, steps, _ = within_positions(drawn, steps, positions)
        batch, length = prompts.shape
        need = streamed_generation_memory(original, batch, length, steps, block_elements)
    else:  # checked in memory (``streams``): what ``generate.check_fused_folder`` holds on the streamed sequences
        need = _in_memory_check_memory(original, steps, sequences)
    have = available_memory()
    if have is not None and need > have:
        raise UsageError(
            f"{folder}: the greedy-generation check needs about {need / 2**30:.2f} GiB of memory "
            f"({have / 2**30:.2f} GiB available): pass --generate 0 to skip it (the report then says generation was "
            "not checked)"
        )


def _in_memory_check_memory(original: Folder, steps: int, sequences: int) -> int:
    """Bytes the greedy-generation check and the task metrics of a standard decoder's streamed fold hold at once,
    checked as in memory (``streams``) on ``sequences`` seeded sequences of the model's length (``zoo.llama.seq_len``,
    as ``verify.inputs.choose_inputs`` draws them): the original loaded in its dtype and
    ``generate.generation_checks_memory`` on its shapes (meta device)."""
    from slabconv.verify.generate import generation_checks_memory
    from slabconv.zoo.llama import LlamaForCausalLM, seq_len
    from slabconv.zoo.llama_std import norm_factory

    cfg = original.cfg
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, norm_factory("rmsnorm", cfg.rms_norm_eps)).to(original.dtype)
    loaded = sum(math.prod(shape) * dtype.itemsize for dtype, shape in original.specs.values())
    return loaded + generation_checks_memory(model, max(1, sequences), seq_len(None, cfg), steps, onnx=False)


REFERENCE_STREAMED = "original float64 (question 2's float64 chain over the prompts and the fused folder's tokens)"
"""The reference run's name in a streamed report: question 2's float64 chain (``layerwise.verify_folders``) runs on
the sequences the fused folder generated, so its logits are the generation check's reference; its tokens/second
count question 2's three chains (the original and the fused folder in their dtype ran beside it; question 1 not
counted)."""


@dataclass
class FusedRun:
    """The fused folder's greedy run in a streamed check (``generate_fused``), judged once question 2's float64
    chain has run over ``sequences()`` (``judged``).

    Attributes:
        prompts: int64 ``(B, T)``: the prompts it continued (``streamed_prompts`` cut by ``within_positions``).
        steps: N, tokens generated per prompt (cut to the model's positions).
        run: its greedy tokens ``(B, N)``; None where the folder did not load as the norm-free model.
        failed: the failed check of a folder that did not load (``greedy.not_loaded_check``), else None.
        notes: the report's notes (the cuts to the model's positions; ``decoder.onnx`` not run).
        dtype: the original's dtype.
        computed: the dtype the run computed in (``compute_dtype``).
        given: the name of ``--inputs`` where the prompts are the first half of its rows; None: seeded random.
    """

    prompts: torch.Tensor
    steps: int
    run: GreedyRun | None
    failed: dict[str, Any] | None
    notes: list[str]
    dtype: torch.dtype
    computed: torch.dtype
    given: str | None = None

    def sequences(self) -> torch.Tensor | None:
        """The sequences whose float64 logits judge the run: the prompts followed by every generated token but the
        last, int64 ``(B, T + N - 1)`` (the logits at position ``T - 1 + s`` are the next-token logits of step
        ``s``); None where the folder did not load."""
        if self.run is None:
            return None
        return torch.cat([self.prompts, torch.as_tensor(self.run.tokens)[:, :-1]], dim=1)

    def inputs(self) -> str:
        """How question 2's inputs are described in the report when they are ``sequences()``."""
        b, t = self.prompts.shape
        prompts = f"seeded random prompts of {count(t, 'token')}"
        if self.given is not None:
            prompts = f"prompts of {count(t, 'token')}, the first half of the rows of {self.given},"
        return (
            f"{b} sequence{'s' if b != 1 else ''} of length {t + self.steps - 1}: {prompts} and the fused folder's "
            "greedy tokens after them"
        )

    def reference(self, logits64: torch.Tensor, seconds: float) -> GreedyRun:
        """The original's float64 run along the fused folder's path, from its logits over ``sequences()``
        (float64 ``(B, T + N - 1, V)``): ``logits64`` ``(B, N, V)``, step ``s`` at position ``T - 1 + s``."""
        assert self.run is not None
        t = self.prompts.shape[1]
        return GreedyRun(REFERENCE_STREAMED, self.run.tokens, seconds, logits64[:, t - 1 :].numpy())

    def judged(self, logits64: torch.Tensor | None, seconds: float) -> dict[str, Any]:
        """The report's ``verification.generation`` block (``GenerationCheck.to_dict()``, as in memory).

        Args:
            logits64: float64 ``(B, T + N - 1, V)``: the original's logits over ``sequences()`` (question 2's float64
                chain); None only where the folder did not load.
            seconds: the time of the pass that computed them (the reference's tokens/second).

        Raises:
            UsageError: ``logits64`` does not follow ``sequences()``.
        """
        if self.failed is not None:
            return self.failed
        assert self.run is not None and logits64 is not None
        check = compare_greedy(
            self.reference(logits64, seconds),
            [self.run],
            judged_dtype(self.dtype, self.computed),
            prompts=self.prompts,
            compute_dtype=self.computed,
        )
        check.notes += self.notes
        return check.to_dict()


def generate_fused(
    source: Path,
    folder: Path,
    steps: int,
    *,
    sequences: int,
    seed: int,
    block_elements: int = 1 << 22,
    given: tuple[torch.Tensor, str, str] | None = None,
    progress: Progress = no_progress,
) -> FusedRun:
    """The fused folder's greedy generation of ``fuse --stream`` and ``verify --stream`` (module docstring): judged
    by ``FusedRun.judged`` on question 2's float64 logits over ``FusedRun.sequences()``.

    Args:
        source: the original folder.
        folder: the fused folder (transformers' files beside the shards).
        steps: N, tokens generated per prompt.
        sequences, seed: the prompts (``streamed_prompts``).
        block_elements: elements per block of weight rows read at a time.
        given: ``--inputs``' rows and their name (``given_sequences``): the prompts are their first half instead.
        progress: told when the run starts.

    Raises:
        UsageError: transformers is not installed; bad steps; the fused folder is not a fused LLaMA folder.
        UnsupportedModelError: the original is not a LLaMA-layout folder the check can run. A fused folder whose
            tensors do not fill the norm-free layout is not refused: the check fails (``greedy.not_loaded_check``).
    """
    import transformers

    original = Folder.open(source, block_elements)
    return_freed_blocks_to_the_os()
    positions = original.family.max_positions(original.cfg)
    drawn = streamed_prompts(original, sequences, seed, given[0] if given else None)
    prompts, steps, notes = within_positions(drawn, steps, positions)
    notes += settings_not_applied(folder, steps)
    named = given[1] if given else None
    computed = compute_dtype(original.dtype)
    if (Path(folder) / "decoder.onnx").is_file():
        notes.append(
            "decoder.onnx not run: the streamed check runs the folder in transformers one block of weights at a "
            "time (slabconv verify without --stream runs decoder.onnx too)"
        )
    progress("verifying: greedy generation, the fused folder in transformers (weights read as it runs)")
    label = f"fused {dtype_name(computed)} (transformers {transformers.__version__}, KV cache, streamed)"
    try:
        model = streamed_fused_llama(folder, computed, block_elements)
    except UnsupportedModelError as err:  # a tensor missing, one too many, a shape: a difference, not bad input
        judged = judged_dtype(original.dtype, computed)
        failed = not_loaded_check(label, str(err), judged, steps, int(prompts.shape[0]), computed).to_dict()
        return FusedRun(prompts, steps, None, failed, notes, original.dtype, computed, named)
    # every token asks for every weight block in the same order: one core reads the next block
    # (``LazyShards.read_ahead``) while torch computes on the others
    shards = model.lm_head.shards  # the reader every StreamedLinear shares
    shards.read_ahead()
    try:
        with torch_threads(max(1, torch.get_num_threads() - 1)):
            fused = greedy_fused(model, prompts, steps, name=label, warm_up=False)
    finally:
        shards.close()
    return FusedRun(prompts, steps, fused, None, notes, original.dtype, computed, named)
