"""Greedy generation, checked end to end: the original model, the fused transformers folder and the decoder ONNX.

Three runners produce greedy continuations of the same prompts and time them side by side:

- ``greedy_original``: a ``torch.nn.Module`` mapping int64 ids ``(B, T)`` to logits ``(B, T, V)`` (the zoo's
  ``LlamaForCausalLM``), with no cache: each step recomputes the whole prefix, as the official eval forward does;
- ``greedy_fused``: the fused folder in transformers, ``generate`` with the key/value cache;
- ``greedy_onnx``: the decoder ONNX (``slabconv.write.decoder_onnx``) in onnxruntime, the presents fed back as the
  next step's past.

``compare_greedy`` (``slabconv.verify.greedy``) then requires every candidate to produce the reference's tokens,
except where the reference's own next-token margin is a near-tie by the policy.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slabconv.errors import InputError, UsageError
from slabconv.verify.greedy import (  # noqa: F401 (the comparison is part of this module's face)
    ENDED,
    ArrayLike,
    GenerationCheck,
    GreedyRun,
    RuntimeComparison,
    _as_ids,
    compare_greedy,
    decisive_steps,
)
from slabconv.verify.policy import dtype_name


def _as_mask(attention_mask: ArrayLike | None, ids: torch.Tensor) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(ids)
    mask = _as_ids(attention_mask, "attention_mask")
    if mask.shape != ids.shape:
        raise UsageError(f"attention_mask has shape {tuple(mask.shape)}, the prompts {tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()) or not bool((mask[:, -1] == 1).all()):
        raise UsageError("attention_mask must be 0/1 with left padding (every prompt's last position a real token)")
    return mask


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (restored after); None leaves torch's setting."""
    if threads is None:
        yield
        return
    if threads < 1:
        raise UsageError(f"threads must be at least 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise UsageError(f"steps must be at least 1, got {steps}")


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def greedy_original(
    model: torch.nn.Module,
    prompts: ArrayLike,
    steps: int,
    *,
    name: str | None = None,
    keep_logits: bool = True,
    threads: int | None = None,
) -> GreedyRun:
    """Greedy tokens of the original model, without a cache: each step runs the whole prefix.

    Args:
        model: ids int64 ``(B, T)`` -> logits ``(B, T, V)`` (a tensor, or an output with ``.logits``), in eval mode;
            e.g. ``slabconv.zoo.llama.LlamaForCausalLM``. It has no padding mask, so the prompts are unpadded.
        prompts: int64 ``(B, T)`` token ids, all of length T.
        steps: N, tokens to generate.
        name: the run's name; default ``original <dtype> (pytorch, no cache)``.
        keep_logits: keep the float64 next-token logits ``(B, N, V)`` (for a reference run).
        threads: torch intra-op threads for the run (restored after); None keeps torch's setting.

    Returns:
        A ``GreedyRun`` with tokens ``(B, N)`` (argmax, first index on exact ties).

    Raises:
        UsageError: prompts not 2-D integer ids, or ``steps`` < 1.
    """
    _check_steps(steps)
    ids = _as_ids(prompts)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    label = name or f"original {dtype_name(param.dtype) if param is not None else ''} (pytorch, no cache)"
    ids = ids.to(device)
    rows: list[torch.Tensor] = []
    with torch_threads(threads), torch.inference_mode():
        _logits(model(ids[:1]))  # warm-up, untimed
        start = time.perf_counter()
        for _ in range(steps):
            last = _logits(model(ids))[:, -1]
            if keep_logits:
                rows.append(last.to(torch.float64).cpu())
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
        seconds = time.perf_counter() - start
    logits64 = torch.stack(rows, dim=1).numpy() if keep_logits else None
    return GreedyRun(label, ids[:, -steps:].cpu().numpy(), seconds, logits64)


def greedy_fused(
    model: Any,
    prompts: ArrayLike,
    steps: int,
    *,
    attention_mask: ArrayLike | None = None,
    dtype: torch.dtype | None = None,
    name: str | None = None,
    threads: int | None = None,
) -> GreedyRun:
    """Greedy tokens of the fused folder in transformers: ``generate(do_sample=False, use_cache=True)``.

    Args:
        model: a fused LLaMA folder (loaded with ``slabconv.write.hf_llama.load_fused_llama``), or a model already
            loaded (e.g. ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``).
        prompts: int64 ``(B, T)``; left-padded when ``attention_mask`` is given.
        steps: N, tokens to generate; exactly N. Plain greedy (the argmax of the logits at each step, as
            ``greedy_original``): the folder's generation_config (eos, penalties, forced tokens) is not applied.
        attention_mask: int64 ``(B, T)``, 0 on left padding; default all ones.
        dtype: load a folder in this dtype (default its ``torch_dtype``).
        name: the run's name; default ``fused <dtype> (transformers <version>, KV cache)``.
        threads: torch intra-op threads for the run (restored after); None keeps torch's setting.

    Returns:
        A ``GreedyRun`` with tokens ``(B, N)``.

    Raises:
        UsageError: transformers is not installed (``pip install slabconv[hf]``); bad prompts, mask or steps.
    """
    from slabconv.write.hf_llama import load_fused_llama, require_transformers

    transformers = require_transformers()
    _check_steps(steps)
    ids = _as_ids(prompts)
    mask = _as_mask(attention_mask, ids)
    if isinstance(model, (str, Path)):
        model = load_fused_llama(model, dtype)
    # Plain greedy: a fresh GenerationConfig, so no setting of the folder's own (repetition penalty, forced or
    # suppressed tokens, eos) changes the argmax that the original runner takes.
    gen = transformers.GenerationConfig(
        do_sample=False,
        num_beams=1,
        use_cache=True,
        max_new_tokens=steps,
        pad_token_id=model.generation_config.pad_token_id,
    )
    label = name or f"fused {dtype_name(model.dtype)} (transformers {transformers.__version__}, KV cache)"
    ids, mask = ids.to(model.device), mask.to(model.device)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    # generate() fills every setting left unset from the model's own generation_config (an eos_token_id there
    # would end sequences early), so the model's copy is swapped for this one during the run.
    saved = model.generation_config
    model.generation_config = copy.deepcopy(gen)
    try:
        with torch_threads(threads), torch.inference_mode():
            warm = copy.deepcopy(gen)
            warm.max_new_tokens = 1
            model.generate(ids[:1], attention_mask=mask[:1], generation_config=warm)  # warm-up, untimed
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=gen)
            seconds = time.perf_counter() - start
    finally:
        model.generation_config = saved
        transformers.logging.set_verbosity(verbosity)
    tokens = out[:, ids.shape[1] :].cpu().numpy()
    if tokens.shape != (ids.shape[0], steps):
        raise RuntimeError(f"generate returned {tokens.shape[1]} new tokens, expected {steps}")
    return GreedyRun(label, tokens, seconds)


def greedy_onnx(
    path: Path | str,
    prompts: ArrayLike,
    steps: int,
    *,
    attention_mask: ArrayLike | None = None,
    name: str | None = None,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int | None = None,
) -> GreedyRun:
    """Greedy tokens of the decoder ONNX in onnxruntime, the presents fed back as the next step's past.

    Step 1 feeds the prompts with empty pasts ``(B, K, 0, d)``; each later step feeds the last token ``(B, 1)``, the
    mask grown by one column of ones and ``position_ids`` one past the last (positions are
    ``cumsum(attention_mask) - 1``, 0 on padding, as transformers computes them).

    Args:
        path: the decoder ONNX (``export_decoder_onnx``).
        prompts: int64 ``(B, T)``; left-padded when ``attention_mask`` is given.
        steps: N, tokens to generate.
        attention_mask: int64 ``(B, T)``, 0 on left padding; default all ones.
        name: the run's name; default ``fused <dtype> (onnxruntime <version>, KV cache)``.
        providers: onnxruntime execution providers.
        threads: onnxruntime intra-op threads; None keeps its default (one per core).

    Returns:
        A ``GreedyRun`` with tokens ``(B, N)``.

    Raises:
        UsageError: no such file, or bad prompts, mask or steps.
    """
    import onnxruntime as ort

    _check_steps(steps)
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such ONNX file")
    ids = _as_ids(prompts).numpy()
    mask = _as_mask(attention_mask, torch.from_numpy(ids)).numpy()
    options = ort.SessionOptions()
    if threads is not None:
        if threads < 1:
            raise UsageError(f"threads must be at least 1, got {threads}")
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=list(providers))
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    if not pasts:
        raise UsageError(f"{path}: no past_key_values.* inputs; not a decoder with past key/values")
    float_type = np.float16 if pasts[0].type == "tensor(float16)" else np.float32
    if pasts[0].type not in ("tensor(float16)", "tensor(float)"):
        raise UsageError(f"{path}: past key/values of {pasts[0].type}; onnxruntime runs float and float16 here")
    kv_heads, head_dim = int(pasts[0].shape[1]), int(pasts[0].shape[3])
    outputs = [o.name for o in session.get_outputs()]
    label = name or f"fused {np.dtype(float_type).name} (onnxruntime {ort.__version__}, KV cache)"

    def run(count: int, tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, float]:
        b = tokens.shape[0]
        past = {i.name: np.zeros((b, kv_heads, 0, head_dim), float_type) for i in pasts}
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        new = np.empty((b, count), np.int64)
        start = time.perf_counter()
        for s in range(count):
            feeds = {"input_ids": tokens, "attention_mask": mask, "position_ids": positions, **past}
            values = dict(zip(outputs, session.run(outputs, feeds), strict=True))
            new[:, s] = values["logits"][:, -1].argmax(-1)
            past = {k: values[k.replace("past_key_values.", "present.")] for k in past}
            tokens = new[:, s : s + 1]
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
        return new, time.perf_counter() - start

    run(1, ids[:1], mask[:1])  # warm-up, untimed
    tokens, seconds = run(steps, ids, mask)
    return GreedyRun(label, tokens, seconds)


def genai_available() -> bool:
    """True when onnxruntime-genai can be imported (``pip install slabconv[genai]``)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def _genai_eos(path: Path) -> set[int]:
    """The end-of-sequence ids of a ``genai_config.json`` (``model.eos_token_id``: an id or a list of them).

    Raises:
        InputError: the file is not JSON or has no such ids.
    """
    try:
        eos = json.loads(path.read_text(encoding="utf-8"))["model"]["eos_token_id"]
    except (ValueError, KeyError, TypeError):
        eos = None
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(
            f"{path}: no model.eos_token_id (a token id or a list of them); fuse the model again to write it"
        )
    return set(ids)


def greedy_genai(folder: Path | str, prompts: ArrayLike, steps: int, *, name: str | None = None) -> GreedyRun:
    """Greedy tokens of the fused folder in onnxruntime-genai: ``decoder.onnx`` as ``genai_config.json`` describes
    it, the key/value cache managed by onnxruntime-genai itself.

    Args:
        folder: a fused folder with ``decoder.onnx`` and ``genai_config.json`` (``write_genai_config``).
        prompts: int64 ``(B, T)``, unpadded.
        steps: N, tokens to generate. A sequence ends at an end-of-sequence id of ``genai_config.json`` (as it would
            deployed; forcing N tokens with ``min_length`` would instead take another token than the argmax there):
            its steps after that token are ``ENDED``, and not compared.
        name: the run's name; default ``fused <dtype> (onnxruntime-genai <version>, KV cache)``.

    Returns:
        A ``GreedyRun`` with tokens ``(B, N)``.

    Raises:
        UsageError: onnxruntime-genai is not installed (``pip install slabconv[genai]``), no ``genai_config.json``,
            bad prompts or steps.
        InputError: ``genai_config.json`` names no end-of-sequence id.
    """
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise UsageError("running the folder in onnxruntime-genai needs it: pip install slabconv[genai]") from None
    _check_steps(steps)
    folder = Path(folder)
    if not (folder / "genai_config.json").is_file():
        raise UsageError(f"{folder}: no genai_config.json; fuse the model again to write it")
    ids = _as_ids(prompts).numpy().astype(np.int32)
    model = og.Model(str(folder))
    dtype = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("torch_dtype", "float32")
    label = name or f"fused {dtype} (onnxruntime-genai {og.__version__}, KV cache)"

    ends = _genai_eos(folder / "genai_config.json")

    def run(tokens: np.ndarray, count: int) -> tuple[np.ndarray, float]:
        total = tokens.shape[1] + count
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, do_sample=False, batch_size=tokens.shape[0])
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(tokens)
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - start
        out = np.full((tokens.shape[0], count), ENDED, dtype=np.int64)
        for i in range(tokens.shape[0]):
            row = np.asarray(generator.get_sequence(i))[tokens.shape[1] :][:count]
            end = next((s for s, t in enumerate(row) if int(t) in ends), None)
            kept = row if end is None else row[: end + 1]  # after its end-of-sequence token: padding, not compared
            if end is None and len(row) < count:
                raise RuntimeError(f"onnxruntime-genai returned {len(row)} new tokens, expected {count}")
            out[i, : len(kept)] = kept
        return out, seconds

    run(ids[:1], 1)  # warm-up, untimed
    tokens, seconds = run(ids, steps)
    return GreedyRun(label, tokens, seconds)


def check_generation(
    original: torch.nn.Module,
    folder: Path | str,
    prompts: ArrayLike,
    steps: int = 32,
    *,
    onnx_path: Path | str | None = None,
    genai: bool = False,
    threads: int | None = None,
) -> GenerationCheck:
    """Greedy generation of the original vs the fused folder (transformers) and, when given, the decoder ONNX
    (onnxruntime, and with ``genai`` onnxruntime-genai too).

    The reference is the original run in float64 (a copy; its tokens and its exact margins); the original in its
    own dtype is timed and compared as the baseline; the fused runs load the folder in its ``torch_dtype``. Near-ties
    are judged with the original's dtype.

    Args:
        original: ids int64 ``(B, T)`` -> logits ``(B, T, V)`` in eval mode (the zoo's ``LlamaForCausalLM``).
        folder: the fused folder (``write_hf_llama_metadata``).
        prompts: int64 ``(B, T)``, unpadded.
        steps: N, tokens per prompt.
        onnx_path: the decoder ONNX (``export_decoder_onnx``), or None.
        genai: also run the folder in onnxruntime-genai (its ``genai_config.json`` and ``config.json``;
            ``greedy_genai``).
        threads: intra-op threads of every runtime (torch and onnxruntime alike, for a like-for-like timing);
            None keeps each library's default.

    Returns:
        A ``GenerationCheck``: tokens/s of each run, tokens compared, decisive mismatches, near-ties, ``passed``.

    Raises:
        UsageError: transformers is not installed (``pip install slabconv[hf]``); bad prompts or steps.
    """
    from slabconv.write.hf_llama import require_transformers

    require_transformers()
    param = next(original.parameters())
    exact = copy.deepcopy(original).to(torch.float64)
    reference = greedy_original(exact, prompts, steps, name="original float64 (pytorch, reference)", threads=threads)
    baselines = []
    if param.dtype != torch.float64:
        baselines.append(greedy_original(original, prompts, steps, keep_logits=False, threads=threads))
    candidates = [greedy_fused(folder, prompts, steps, threads=threads)]
    if onnx_path is not None:
        candidates.append(greedy_onnx(onnx_path, prompts, steps, threads=threads))
    if genai:
        candidates.append(greedy_genai(folder, prompts, steps))
    return compare_greedy(reference, candidates, param.dtype, baselines=baselines, prompts=prompts)


def check_fused_folder(
    original: torch.nn.Module, folder: Path | str, token_ids: ArrayLike, steps: int, *, onnx: bool = True
) -> dict[str, Any]:
    """The greedy-generation check of ``fuse`` and ``verify --generate``, in memory or streamed alike: the
    original against the fused folder in transformers and, when ``onnx`` and the folder has one, its
    ``decoder.onnx`` in onnxruntime and, with onnxruntime-genai installed and a ``genai_config.json`` beside it, in
    onnxruntime-genai (not for bfloat16: onnxruntime's CPU provider has no bfloat16 kernels). Where the folder
    has a ``genai_config.json`` but onnxruntime-genai is not installed, the returned block's ``notes`` says so.

    Args:
        original: ids int64 ``(B, T)`` -> logits ``(B, T, V)``, eval mode.
        folder: the fused Hugging Face folder.
        token_ids: int64 ``(S, T)`` verification inputs; the prompts are the first 16 rows, their first half
            (at least one token).
        steps: tokens to generate per prompt.
        onnx: also run ``folder/decoder.onnx`` when it exists.

    Returns:
        ``GenerationCheck.to_dict()``: the report's ``verification.generation`` block.

    Raises:
        UsageError: transformers is not installed; bad ids or steps.
    """
    ids = _as_ids(token_ids)[:16]
    prompts = ids[:, : max(1, ids.shape[1] // 2)]
    decoder = Path(folder) / "decoder.onnx"
    dtype = next(original.parameters()).dtype
    onnx_path = decoder if onnx and decoder.is_file() and dtype != torch.bfloat16 else None
    has_genai_config = onnx_path is not None and (Path(folder) / "genai_config.json").is_file()
    genai = has_genai_config and genai_available()
    check = check_generation(original, folder, prompts, steps, onnx_path=onnx_path, genai=genai, threads=1)
    if has_genai_config and not genai:
        check.notes.append(
            "onnxruntime-genai is not installed: genai_config.json not run (pip install slabconv[genai])"
        )
    return check.to_dict()
