"""Greedy generation, checked end to end: the original model, the fused transformers folder and the decoder ONNX.

The runners produce greedy continuations of the same prompts and time them side by side:

- ``greedy_fused``: a transformers model, ``generate`` with the key/value cache: the fused folder, or the original
  as transformers' LLaMA with its own norm modules (``original_twin``);
- ``greedy_onnx``: the decoder ONNX (``slabconv.write.decoder_onnx``) in onnxruntime, the presents fed back as the
  next step's past; ``greedy_genai``: the folder in onnxruntime-genai;
- ``greedy_original``: a ``torch.nn.Module`` mapping int64 ids ``(B, T)`` to logits ``(B, T, V)`` (the zoo's
  ``LlamaForCausalLM``), with no cache: each step recomputes the whole prefix, as the official eval forward does.

The check (``check_generation``) costs about two generations with the cache and one pass of the original in
float64: the fused folder generates in ``compute_dtype`` (float32, or the checkpoint's half precision where the
CPU computes it natively); the original in float64 runs once over the prompts and the tokens the folder generated
(``exact_path``), which gives its own greedy token and its exact next-token margin at every step of that path;
``compare_greedy`` (``slabconv.verify.greedy``) then requires every candidate to produce the original's tokens,
except where the original's margin is a near-tie by the policy. The original as transformers' LLaMA in the same
dtype generates too, as the baseline (reported, not deciding). The streamed mode runs the same check one decoder
layer at a time (``slabconv.verify.generate_streamed``), its float64 pass being question 2's.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.text import count
from slabconv.verify.greedy import (  # noqa: F401 (the comparison is part of this module's face)
    ENDED,
    ArrayLike,
    GenerationCheck,
    GreedyRun,
    _as_ids,
    compare_greedy,
    not_loaded_check,
)
from slabconv.verify.policy import dtype_name, tol_dtype

PROMPTS = 16
"""Prompts the check continues at most: the first rows of the verification inputs, their first half."""


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
    keep_logits: bool = True,
    threads: int | None = None,
) -> GreedyRun:
    """Greedy tokens of the original model, without a cache: each step runs the whole prefix.

    Args:
        model: ids int64 ``(B, T)`` -> logits ``(B, T, V)`` (a tensor, or an output with ``.logits``), in eval mode;
            e.g. ``slabconv.zoo.llama.LlamaForCausalLM``. It has no padding mask, so the prompts are unpadded.
        prompts: int64 ``(B, T)`` token ids, all of length T.
        steps: N, tokens to generate.
        keep_logits: keep the float64 next-token logits ``(B, N, V)`` (for a reference run).
        threads: torch intra-op threads for the run (restored after); None keeps torch's setting.

    Returns:
        A ``GreedyRun`` named ``original <dtype> (pytorch, no cache)``, with tokens ``(B, N)`` (argmax, first index
        on exact ties).

    Raises:
        UsageError: prompts not 2-D integer ids, or ``steps`` < 1.
    """
    _check_steps(steps)
    ids = _as_ids(prompts)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    label = f"original {dtype_name(param.dtype) if param is not None else ''} (pytorch, no cache)"
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
    name: str | None = None,
    threads: int | None = None,
    warm_up: bool = True,
) -> GreedyRun:
    """Greedy tokens of the fused folder in transformers: ``generate(do_sample=False, use_cache=True)``.

    Args:
        model: a fused LLaMA folder (loaded with ``slabconv.write.hf_llama.load_fused_llama`` in its ``torch_dtype``),
            or a model already
            loaded (e.g. ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``).
        prompts: int64 ``(B, T)``; left-padded when ``attention_mask`` is given.
        steps: N, tokens to generate; exactly N. Plain greedy (the argmax of the logits at each step, as
            ``greedy_original``): the folder's generation_config (eos, penalties, forced tokens) is not applied.
        attention_mask: int64 ``(B, T)``, 0 on left padding; default all ones.
        name: the run's name; default ``fused <dtype> (transformers <version>, KV cache)``.
        threads: torch intra-op threads for the run (restored after); None keeps torch's setting.
        warm_up: generate one token of one prompt first, untimed (off where a pass reads every weight from disk).

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
        model = load_fused_llama(model)
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
            if warm_up:
                warm = copy.deepcopy(gen)
                warm.max_new_tokens = 1
                model.generate(ids[:1], attention_mask=mask[:1], generation_config=warm)  # untimed
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
    threads: int | None = None,
) -> GreedyRun:
    """Greedy tokens of the decoder ONNX in onnxruntime's CPU provider, the presents fed back as the next step's past.

    Step 1 feeds the prompts as ``decoder_session`` has them (empty pasts); each later step feeds the last token
    ``(B, 1)``, the mask grown by one column of ones and ``position_ids`` one past the last.

    Args:
        path: the decoder ONNX (``export_decoder_onnx``).
        prompts: int64 ``(B, T)``, unpadded.
        steps: N, tokens to generate.
        threads: onnxruntime intra-op threads; None keeps its default (one per core).

    Returns:
        A ``GreedyRun`` named ``fused <dtype> (onnxruntime <version>, KV cache)``, with tokens ``(B, N)``.

    Raises:
        UsageError: bad prompts or steps; as ``decoder_session`` (no such file, not a decoder with past key/values).
    """
    import onnxruntime as ort

    _check_steps(steps)
    ids = _as_ids(prompts).numpy()
    session, dtype, prompt_feeds = decoder_session(path, threads)
    outputs = [o.name for o in session.get_outputs()]
    label = f"fused {dtype} (onnxruntime {ort.__version__}, KV cache)"

    def run(count: int, tokens: np.ndarray) -> tuple[np.ndarray, float]:
        b, feeds = tokens.shape[0], prompt_feeds(tokens)
        new = np.empty((b, count), np.int64)
        start = time.perf_counter()
        for s in range(count):
            values = dict(zip(outputs, session.run(outputs, feeds), strict=True))
            new[:, s] = values["logits"][:, -1].argmax(-1)
            feeds = {
                "input_ids": new[:, s : s + 1],
                "attention_mask": np.ones((b, feeds["attention_mask"].shape[1] + 1), np.int64),
                "position_ids": feeds["position_ids"][:, -1:] + 1,
                **{k: values[k.replace("past_key_values.", "present.")] for k in feeds if k.startswith("past_")},
            }
        return new, time.perf_counter() - start

    run(1, ids[:1])  # warm-up, untimed
    tokens, seconds = run(steps, ids)
    return GreedyRun(label, tokens, seconds)


def decoder_session(path: Path | str, threads: int | None = None) -> tuple[Any, str, Callable[[np.ndarray], Any]]:
    """The decoder ONNX (``slabconv.write.decoder_onnx``) in an onnxruntime CPU session (``threads`` intra-op
    threads; None: one per core), the dtype of its past key/values, and the feeds of unpadded ids int64 ``(B, T)``
    with nothing before them (``greedy_onnx``'s first step, ``task_metrics.onnx_logits``'s one call): a mask of ones,
    positions ``0 .. T - 1`` (``cumsum(attention_mask) - 1``, as transformers has them), every past empty.

    Raises:
        UsageError: no such file; threads < 1; no past key/values, or of a type other than float and float16.
    """
    import onnxruntime as ort

    if not Path(path).is_file():
        raise UsageError(f"{path}: no such ONNX file")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads is not None:
        if threads < 1:
            raise UsageError(f"threads must be at least 1, got {threads}")
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    if not pasts:
        raise UsageError(f"{path}: no past_key_values.* inputs; not a decoder with past key/values")
    if pasts[0].type not in ("tensor(float16)", "tensor(float)"):
        raise UsageError(f"{path}: past key/values of {pasts[0].type}; onnxruntime runs float and float16 here")
    float_type = np.float16 if pasts[0].type == "tensor(float16)" else np.float32

    def feeds(ids: np.ndarray) -> dict[str, Any]:
        b, t = ids.shape
        empty = {p.name: np.zeros((b, int(p.shape[1]), 0, int(p.shape[3])), float_type) for p in pasts}
        positions = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": positions, **empty}

    return session, np.dtype(float_type).name, feeds


def genai_available() -> bool:
    """True when onnxruntime-genai can be imported (``pip install slabconv[genai]``)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def _genai_model(path: Path) -> dict[str, Any]:
    """The ``model`` object of a ``genai_config.json``, read as every JSON input is (``load.safety.read_json``: a
    regular file, size and depth bounded before parsing); empty where the file is not such JSON or has none."""
    from slabconv.load.safety import read_json

    try:
        model = read_json(path).get("model")
    except (InputError, OSError, AttributeError):
        return {}
    return model if isinstance(model, dict) else {}


def _genai_eos(path: Path) -> set[int]:
    """The end-of-sequence ids of a ``genai_config.json`` (``model.eos_token_id``: an id or a list of them).

    Raises:
        InputError: the file is not JSON or has no such ids.
    """
    eos = _genai_model(path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(
            f"{path}: no model.eos_token_id (a token id or a list of them); fuse the model again to write it"
        )
    return set(ids)


def _not_ending_in_padding(prompts: torch.Tensor, config: Path, notes: list[str]) -> tuple[torch.Tensor, list[str]]:
    """Prompts int64 ``(B, T)`` none of which ends with the ``model.pad_token_id`` of ``config`` (a
    ``genai_config.json``): onnxruntime-genai takes a prompt's trailing pad ids for padding and generates from the
    token before them, so such a prompt is not the same prompt there as in transformers. Each such last token becomes
    the next id (``(pad + 1) mod V``, ``V`` the vocabulary size of ``config``), for every run of the check; ``notes``
    gains a line saying how many prompts changed. A config without an int pad id or vocabulary size changes nothing."""
    model = _genai_model(config)
    pad, vocab = model.get("pad_token_id"), model.get("vocab_size")
    if not isinstance(pad, int) or not isinstance(vocab, int) or vocab < 2:
        return prompts, notes
    ends = prompts[:, -1] == pad
    if not bool(ends.any()):
        return prompts, notes
    prompts = prompts.clone()
    prompts[ends, -1] = (pad + 1) % vocab
    count = int(ends.sum())
    note = f"{count} of {len(prompts)} prompts ended with the pad id {pad}, which onnxruntime-genai takes for padding: "
    return prompts, [*notes, note + f"their last token is {(pad + 1) % vocab} instead, in every run"]


def greedy_genai(folder: Path | str, prompts: ArrayLike, steps: int) -> GreedyRun:
    """Greedy tokens of the fused folder in onnxruntime-genai: ``decoder.onnx`` as ``genai_config.json`` describes
    it, the key/value cache managed by onnxruntime-genai itself.

    Args:
        folder: a fused folder with ``decoder.onnx`` and ``genai_config.json`` (``write_genai_config``).
        prompts: int64 ``(B, T)``, unpadded.
        steps: N, tokens to generate. A sequence ends at an end-of-sequence id of ``genai_config.json`` (as it would
            deployed; forcing N tokens with ``min_length`` would instead take another token than the argmax there):
            its steps after that token are ``ENDED``, and not compared.

    Returns:
        A ``GreedyRun`` named ``fused <dtype> (onnxruntime-genai <version>, KV cache)``, with tokens ``(B, N)``.

    Raises:
        UsageError: onnxruntime-genai is not installed (``pip install slabconv[genai]``), no ``genai_config.json``,
            bad prompts or steps.
        InputError: ``genai_config.json`` names no end-of-sequence id; ``config.json`` is over the JSON limits or
            not JSON (``load.safety.read_json``).
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
    from slabconv.load.safety import read_json

    # read as every JSON input is (size and depth bounded); the dtype names the run: a string, else float32
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    dtype = config.get("torch_dtype") if isinstance(config, dict) else None
    dtype = dtype if isinstance(dtype, str) else "float32"
    label = f"fused {dtype} (onnxruntime-genai {og.__version__}, KV cache)"

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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the generation check computes in for a checkpoint in ``dtype``: the checkpoint's own where the CPU
    computes it natively (float32; float16 and bfloat16 where oneDNN finds the instructions for them: AVX512-FP16 /
    AMX-FP16, AVX512-BF16 / AMX-BF16), else float32, which holds every half-precision weight exactly. Half
    precision without those instructions is emulated, several times slower than float32; float64 is float32 here
    too (the float64 reference is the original's own pass, ``exact_path``)."""
    if dtype == torch.float16 and _onednn("_is_mkldnn_fp16_supported"):
        return torch.float16
    if dtype == torch.bfloat16 and _onednn("_is_mkldnn_bf16_supported"):
        return torch.bfloat16
    return torch.float32


def _onednn(probe: str) -> bool:
    """torch's own answer to whether this CPU has oneDNN's kernels for a half precision (``torch.ops.mkldnn``; a
    torch without the probe: no)."""
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


def judged_dtype(dtype: object, computed: object) -> str:
    """The dtype whose tolerance judges near-ties: of the checkpoint's and the one the runs computed in, the one with
    the larger ``tol_dtype``."""
    return dtype_name(max((dtype, computed), key=tol_dtype))


_GROUP = {name: "self_attn" for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    name: "mlp" for name in ("gate_proj", "up_proj", "down_proj")
}


def original_twin(original: torch.nn.Module, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The original language model as transformers' LLaMA with the original's norm modules, in ``dtype``.

    Args:
        original: the zoo's ``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.{i}`` with
            ``input_layernorm`` / ``post_attention_layernorm``, ``model.norm``, ``lm_head``).
        config: the fused folder's ``SlabconvLlamaConfig`` (its sizes, heads, rotary settings).
        dtype: the dtype to compute in (the weights are copied into it).

    Returns:
        A ``SlabconvLlamaForCausalLM`` in eval mode computing the original model: the fused model's class with the
        original's own biases (``attention_bias`` / ``mlp_bias``) and none the fold created, the original's weights
        and its norm modules (SLAB's ``LinearNorm`` / RepBN, eval mode) where the fused model has identities.
        ``generate`` works as for the fused folder.

    Raises:
        UnsupportedModelError: the original does not have the LLaMA layout (a weight has no place in the twin).
    """
    from slabconv.write.templates.modeling_slabconv_llama import SlabconvLlamaForCausalLM

    config = copy.deepcopy(config)
    source: Any = original
    keys = set(source.state_dict())
    # The original's own biases (attention_bias / mlp_bias), none of the ones the fold created.
    config.projection_bias = {
        name: (f"{name}.bias" if name == "lm_head" else f"model.layers.0.{_GROUP[name]}.{name}.bias") in keys
        for name in config.projection_bias or {}
    }
    with torch.device("meta"):
        twin = SlabconvLlamaForCausalLM(config)
    weights = {k: v for k, v in source.state_dict().items() if "layernorm" not in k and not k.startswith("model.norm")}
    weights = {k: v.to(dtype) for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    try:
        missing, unexpected = twin.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as err:
        raise UnsupportedModelError(
            f"the original does not have the LLaMA layout the twin needs ({_load_error(err)})"
        ) from None
    if missing or unexpected:
        raise UnsupportedModelError(
            f"the original does not have the LLaMA layout the twin needs ({(missing or unexpected)[0]})"
        )
    try:
        for i, layer in enumerate(twin.model.layers):
            layer.input_layernorm = copy.deepcopy(source.model.layers[i].input_layernorm).to(dtype).eval()
            layer.post_attention_layernorm = copy.deepcopy(source.model.layers[i].post_attention_layernorm)
            layer.post_attention_layernorm.to(dtype).eval()
        twin.model.norm = copy.deepcopy(source.model.norm).to(dtype).eval()
    except AttributeError as err:
        raise UnsupportedModelError(f"the original does not have the LLaMA layout the twin needs ({err})") from None
    twin.model.rotary_emb = type(twin.model.rotary_emb)(config)  # real, not meta: inv_freq computed from config
    return twin.eval()


def _load_error(err: RuntimeError) -> str:
    """torch's ``load_state_dict`` report (a heading, then one line per weight, its line breaks sometimes written
    as the two characters ``\\n``) as one line: the first weight's line, and how many more there are."""
    lines = [line.strip() for line in str(err).replace("\\n", "\n").replace("\\t", "").splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else type(err).__name__
    more = f" and {len(lines) - 2} more" if len(lines) > 2 else ""
    return f"{lines[1].rstrip('.')}{more}"


class Layers(Protocol):
    """A decoder language model one part at a time, each in the dtype asked for: how ``exact_path`` runs the original
    in float64 without a float64 copy of the whole model. ``slabconv.verify.layerwise.Folder`` (a folder read one
    block of rows at a time) and ``ModuleLayers`` (a model in memory) are two."""

    family: Any
    cfg: Any

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Token ids ``(B, T)`` -> hidden states ``(B, T, C)`` in ``dtype``."""
        ...

    def layer(self, i: int, dtype: torch.dtype) -> torch.nn.Module:
        """Decoder layer ``i`` in ``dtype``: ``layer(h, *family.layer_inputs(cfg, i, T, dtype))``."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the head on hidden states ``h`` ``(B, T, C)``, in ``h``'s dtype: ``(B, T, V)``."""
        ...


class ModuleLayers:
    """``Layers`` of a zoo decoder model in memory (the ``DecoderFamily`` of its keys): each part copied into the
    dtype asked for when it is used, so at most one decoder layer is held in float64.

    Raises:
        UnsupportedModelError: the model is not a zoo decoder language model (no ``cfg``, or keys of no family).
    """

    def __init__(self, model: torch.nn.Module):
        from slabconv.zoo.decoder import family_of

        self.model = model
        self.family = family_of(dict(model.state_dict()))
        self.cfg = getattr(model, "cfg", None)
        if self.cfg is None:
            raise UnsupportedModelError("the original is not a zoo decoder language model (it has no cfg)")

    def _part(self, name: str, dtype: torch.dtype) -> torch.nn.Module:
        return copy.deepcopy(self.model.get_submodule(name)).to(dtype).eval()

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        weight = self.model.get_parameter(self.family.embed)
        return weight[ids].to(dtype)

    def layer(self, i: int, dtype: torch.dtype) -> torch.nn.Module:
        return self._part(self.family.layer_prefix.format(i=i).rstrip("."), dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._part(self.family.head, h.dtype)(self._part(self.family.final_norm, h.dtype)(h))


def exact_path(layers: Layers, prompts: ArrayLike, path: ArrayLike, name: str) -> GreedyRun:
    """The original in float64 along a path: one pass over the prompts and the path's tokens (no cache; causal
    attention makes each position's output depend on its prefix only), one decoder layer at a time.

    Args:
        layers: the original (``ModuleLayers`` in memory, ``layerwise.Folder`` streamed).
        prompts: int64 ``(B, T)``, unpadded.
        path: int64 ``(B, N)``: the tokens a run generated after the prompts.
        name: the run's name.

    Returns:
        A ``GreedyRun`` with tokens ``path`` and ``logits64`` float64 ``(B, N, V)``: at step ``s`` the original's
        next-token logits after the prompt and ``path[:, :s]``, i.e. what the original generating by itself would
        have computed at that step while its tokens are the path's.

    Raises:
        UsageError: prompts or path not 2-D integer ids, or of different batch sizes.
    """
    ids, tokens = _as_ids(prompts), _as_ids(path, "path")
    if ids.shape[0] != tokens.shape[0]:
        raise UsageError(f"{ids.shape[0]} prompts but a path of {tokens.shape[0]} sequences")
    t = ids.shape[1]
    sequence = torch.cat([ids, tokens[:, :-1]], dim=1)
    start = time.perf_counter()
    with torch.no_grad():
        h = layers.embed(sequence, torch.float64)
        for i in range(layers.family.num_layers(layers.cfg)):
            extra = layers.family.layer_inputs(layers.cfg, i, sequence.shape[1], torch.float64)
            h = layers.layer(i, torch.float64)(h, *extra)
        logits = layers.logits(h[:, t - 1 :])
    return GreedyRun(name, tokens.numpy(), time.perf_counter() - start, logits.numpy())


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
    """Greedy generation of the fused folder (transformers, KV cache) and, when given, the decoder ONNX
    (onnxruntime, and with ``genai`` onnxruntime-genai too), judged by the original's own greedy choice.

    The fused folder generates in ``compute_dtype`` of the original's dtype; the original in float64 then runs once
    over the prompts and those tokens (``exact_path``): its greedy token and exact margin at every step. The
    original as transformers' LLaMA (``original_twin``) generates in the same dtype as the baseline. Near-ties are
    judged with the looser of the checkpoint's and the compute dtype's tolerances (``judged_dtype``).

    Args:
        original: the zoo's ``LlamaForCausalLM`` in eval mode: ids int64 ``(B, T)`` -> logits ``(B, T, V)``.
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
        UsageError: transformers is not installed (``pip install slabconv[hf]``); bad prompts or steps; the folder
            is not a fused LLaMA folder.
        UnsupportedModelError: the original is not a zoo LLaMA language model. A fused folder whose weights do
            not fill the norm-free layout is not refused: the check fails (``greedy.not_loaded_check``).
    """
    from slabconv.write.hf_llama import MODEL_TYPE, load_fused_llama, require_transformers

    transformers = require_transformers()
    dtype = next(original.parameters()).dtype
    computed = compute_dtype(dtype)
    version = transformers.__version__
    try:
        model = load_fused_llama(folder, computed)
    except UnsupportedModelError as err:  # a tensor missing, one too many, a shape: a difference, not bad input
        name = f"fused {dtype_name(computed)} (transformers {version}, KV cache)"
        count = int(_as_ids(prompts).shape[0])
        return not_loaded_check(name, str(err), judged_dtype(dtype, computed), steps, count, computed)
    config = model.config
    fused = greedy_fused(model, prompts, steps, threads=threads)
    del model
    baselines = []
    if getattr(config, "model_type", None) == MODEL_TYPE:  # a standard decoder's folder: no twin (its own class)
        twin = original_twin(original, config, computed)
        label = f"original {dtype_name(computed)} (transformers {version}, KV cache)"
        baselines.append(greedy_fused(twin, prompts, steps, name=label, threads=threads))
        del twin
    reference = exact_path(ModuleLayers(original), prompts, fused.tokens, REFERENCE)
    candidates = [fused]
    if onnx_path is not None:
        candidates.append(greedy_onnx(onnx_path, prompts, steps, threads=threads))
    if genai:
        candidates.append(greedy_genai(folder, prompts, steps))
    return compare_greedy(
        reference,
        candidates,
        judged_dtype(dtype, computed),
        baselines=baselines,
        prompts=prompts,
        compute_dtype=computed,
    )


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the machine's ``MemAvailable`` (``/proc/meminfo``), what
    the user's address-space limit leaves (``ulimit -v``: ``RLIMIT_AS`` less this process's ``VmSize``) and what its
    cgroup's limit leaves (a container's ``--memory``, ``systemd-run -p MemoryMax=``: cgroup v2 ``memory.max`` less
    ``memory.current``, v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``). None where none is known
    (not Linux)."""
    known = [n for n in (_meminfo("MemAvailable"), _rlimit_left(), _cgroup_left()) if n is not None]
    return max(0, min(known)) if known else None


def _meminfo(field: str, path: str = "/proc/meminfo") -> int | None:
    """A ``kB`` field of ``/proc/meminfo`` (or ``/proc/self/status``) in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rlimit_left() -> int | None:
    """``RLIMIT_AS`` (soft) less this process's virtual size; None without a limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    used = _meminfo("VmSize", "/proc/self/status")
    return soft - (used or 0)


def _cgroup_left(proc: Path = Path("/proc/self/cgroup"), mounts: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the memory limit of this process's cgroup leaves (v2 or v1); None without a limit. The cgroup's usage
    counts the page cache of files read, which the kernel reclaims under the limit: its inactive part
    (``memory.stat``'s ``inactive_file``, v1 ``total_inactive_file``) counts as free, as ``MemAvailable`` counts it
    and as ``docker stats`` and the kubelet do. ``proc``, ``mounts``: where the process's cgroups and the cgroup
    file systems are."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: memory.max / memory.current
            root, names = mounts, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            root, names = mounts / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        # The cgroup's own folder; in a container the mount shows it as the root (the path is the host's).
        for folder in (root / rel.lstrip("/"), root):
            try:
                limit, used = ((folder / name).read_text().strip() for name in names)
            except OSError:
                continue
            if limit.isdigit() and used.isdigit() and int(limit) < 2**60:  # "max" or v1's "no limit" (about 2**63)
                cache = _cgroup_stat(
                    folder / "memory.stat", "inactive_file" if controllers == "" else "total_inactive_file"
                )
                return int(limit) - max(0, int(used) - cache)
            break
    return None


def _cgroup_stat(path: Path, field: str) -> int:
    """A field of a cgroup's ``memory.stat`` in bytes; 0 where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def generation_memory(original: torch.nn.Module, prompts: int, prompt_len: int, steps: int, onnx: bool) -> int:
    """Bytes the in-memory check (``check_generation``) holds at once besides the original, which is loaded already.

    One transformers model at a time (the fused folder, then the twin) with every weight in ``compute_dtype``, its
    key/value cache and the logits of one step; the float64 pass's largest part (a decoder layer, or the head) in
    float64 beside its copy, its activations and its logits ``(B, N, V)``; with ``onnx``, ``decoder.onnx`` in
    onnxruntime (its weights in the checkpoint's dtype, and as much again for the session's arena) beside those
    float64 logits, and its float32 logits of the prompts ``(B, T, V)``.
    """
    total, vocab, _ = _sizes(original)
    dtype = next(original.parameters(), torch.empty(0)).dtype
    computed = compute_dtype(dtype).itemsize
    cfg = getattr(original, "cfg", None)
    layers = int(getattr(cfg, "num_hidden_layers", 1))
    length = prompt_len + steps
    hidden, _, kv, widest = decoder_sizes(cfg, prompts, length)
    model = total * computed + 2 * layers * prompts * length * kv * computed + 2 * prompts * vocab * computed
    part = max((total - 2 * vocab * hidden) // max(1, layers), vocab * hidden)
    exact = part * (8 + dtype.itemsize) + 8 * (widest + 2 * prompts * length * hidden + prompts * steps * vocab)
    # decoder.onnx runs after the float64 pass, whose logits (B, N, V) are held, and returns the prompts' logits
    session = 2 * total * dtype.itemsize + 8 * prompts * steps * vocab + 4 * prompts * prompt_len * vocab if onnx else 0
    return max(model, exact, session)


def decoder_sizes(cfg: Any, batch: int, length: int) -> tuple[int, int, int, int]:
    """``(hidden size, intermediate size, key/value width, widest activations)`` of a decoder config on ``batch``
    sequences of ``length`` tokens: the key/value width ``K d`` of one layer's cache per token, and the values of
    one layer's widest activations (the MLP's intermediate size, the attention scores ``B H T^2``)."""
    hidden = int(getattr(cfg, "hidden_size", 0))
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
    heads = int(getattr(cfg, "num_attention_heads", 1))
    kv = int(getattr(cfg, "kv_heads", heads)) * (hidden // max(1, heads))
    return hidden, inter, kv, max(3 * inter, 4 * hidden) * batch * length + heads * batch * length * length


def _sizes(original: torch.nn.Module) -> tuple[int, int, int]:
    """``(weights, vocabulary, bytes a logit of the original's own run is held in)`` of a zoo language model: 4
    for a float32, float16 or bfloat16 model (``runtimes.torch_runner``'s ``narrow``), 8 for a float64 one."""
    params = list(original.parameters())
    dtype = params[0].dtype if params else torch.float32
    vocab = int(getattr(getattr(original, "cfg", None), "vocab_size", 0))
    return sum(p.numel() for p in params), vocab, 4 if dtype.itemsize <= 4 else 8


def question_2_memory(original: torch.nn.Module, samples: int, length: int) -> int:
    """Bytes question 2 holds at once on a language model's ``samples`` token sequences of ``length`` tokens,
    besides the original (``verify.verifier``): the reference's logits ``(S, T, V)`` in the original's dtype (float32
    for float32 or narrower: ``_sizes``) and in float64, the same at half the length (the programs are checked at a
    second length), one runtime's logits in float64 and the float32 logits of its last batch (16 sequences) twice
    (in the runtime's memory arena, and as it returns them), the float64 graph's weights, and the blocks the
    comparisons convert (``blocks.CHUNK_BYTES``, four at once)."""
    from slabconv.verify.blocks import CHUNK_BYTES

    weights, vocab, own = _sizes(original)
    half = length // 2
    reference = samples * (length + half) * vocab * (own + 8)
    runtime = samples * length * vocab * 8 + min(samples, 16) * length * vocab * 8  # its last batch, twice
    return reference + runtime + 8 * weights + 4 * CHUNK_BYTES


def task_metrics_memory(
    original: torch.nn.Module, sequences: int, length: int, stored: torch.dtype | None = None
) -> int:
    """Bytes the task metrics (``verify.task_metrics.check_task_metrics``) hold at once on ``sequences`` token
    sequences of ``length`` tokens (at most ``TASK_SEQUENCES``), besides the original: the float64 reference's
    log-probabilities ``(N, T - 1, V)`` and the original's logits in its dtype, one batch's logits in float64
    (``task_metrics.BATCH`` sequences), the original's float64 copy (the largest model a pass loads beside the
    original), the blocks the scoring converts (``blocks.CHUNK_BYTES``, four at once), and where the fused folder
    is stored in ``stored`` narrower than the original (``write.hf_llama.weights_dtype``), the original cast to it,
    made while the float64 copy is held."""
    from slabconv.verify.blocks import CHUNK_BYTES
    from slabconv.verify.task_metrics import BATCH, TASK_SEQUENCES

    weights, vocab, own = _sizes(original)
    n = min(sequences, TASK_SEQUENCES)
    held = n * (length - 1) * vocab * (8 + own)
    dtype = next(original.parameters(), torch.empty(0)).dtype
    cast = weights * stored.itemsize if stored is not None and stored.itemsize < dtype.itemsize else 0
    return held + min(n, BATCH) * length * vocab * 8 + 8 * weights + cast + 4 * CHUNK_BYTES


def generation_checks_memory(
    model: torch.nn.Module, sequences: int, length: int, steps: int, onnx: bool, stored: torch.dtype | None = None
) -> int:
    """Bytes the greedy check (``generation_memory``, with ``decoder.onnx`` when ``onnx``, on the prompts
    ``prompts_of`` takes from ``sequences`` token sequences of ``length`` tokens, cut by ``within_positions``) or the
    task metrics (``task_metrics_memory``, of a fused folder stored in ``stored``) of the zoo language model
    ``model`` hold at once, the larger."""
    prompts, steps, _ = within_positions(
        torch.zeros(min(sequences, PROMPTS), max(1, length // 2), dtype=torch.int64), steps, _positions_of(model)
    )
    generation = generation_memory(model, int(prompts.shape[0]), int(prompts.shape[1]), steps, onnx)
    return max(generation, task_metrics_memory(model, sequences, length, stored))


def language_checks_memory(
    loaded: Any, opts: Any, *, onnx: bool, stored: torch.dtype | None = None
) -> tuple[int, Callable[[int], dict[str, int]]]:
    """The in-memory checks of the language model ``loaded`` (a ``LoadedModel`` taking token ids) on the inputs
    ``opts`` (``VerifyOptions``) chooses, as the verification will: how many sequences question 2 checks, and the
    bytes the checks hold at once besides the model, by check, were it that many (``--samples N``):
    ``question 2`` (``question_2_memory``) and, unless ``opts.generate`` is 0, ``generation``
    (``generation_checks_memory``, of a fused folder stored in ``stored``: None for the original's dtype). The
    checks run one after another, so the need is the largest part.

    Raises:
        UsageError, InputError: as ``verify.inputs.choose_inputs`` (an inputs file that cannot be used).
    """
    from slabconv.verify.inputs import choose_inputs

    x, label, _ = choose_inputs(loaded, opts.inputs, opts.sample_count(), opts.seed)
    x = np.asarray(x)
    drawn = label.startswith("random(")  # seeded samples, as many as --samples; else a file's sequences
    length = int(x.shape[1]) if x.ndim == 2 else 1

    def parts(count: int) -> dict[str, int]:
        out = {"question 2": question_2_memory(loaded.model, count, length)}
        if opts.generate != 0:
            every = count if drawn else len(x)  # the task metrics and the prompts take a file's sequences unlimited
            out["generation"] = generation_checks_memory(loaded.model, every, length, opts.fuse_steps(), onnx, stored)
        return out

    return (len(x) if opts.samples is None else min(opts.samples, len(x))), parts


def check_language_checks_fit(loaded: Any, opts: Any, *, onnx: bool, stored: torch.dtype | None = None) -> None:
    """Refuse, before any work, an in-memory verification of the language model ``loaded`` against a fused folder
    stored in ``stored`` (None: the original's dtype) whose checks need more memory than this machine has available
    (``language_checks_memory``, ``available_memory``). Nothing for a model that does not take token ids.

    Raises:
        UsageError: it would not fit: the message says how much each check needs and how to check less
            (``--generate 0``, ``--samples N`` with the most sequences that fit, or ``--no-verify``).
    """
    if not getattr(loaded, "token_input", False):
        return
    samples, parts_of = language_checks_memory(loaded, opts, onnx=onnx, stored=stored)
    parts = parts_of(samples)
    need, have = max(parts.values()), available_memory()
    if have is None or need <= have:
        return

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    generation = ""
    ways = []
    if "generation" in parts:
        generation = f", greedy generation and the task metrics about {gib(parts['generation'])}"
        if parts["question 2"] <= have:
            ways.append("--generate 0 skips greedy generation and the task metrics (the report then says so)")
    fewer = next((n for n in range(samples - 1, 0, -1) if max(parts_of(n).values()) <= have), None)
    if fewer is not None:
        ways.append(f"--samples {fewer} checks {count(fewer, 'sequence')}")
    ways.append("--no-verify writes without checking (then run slabconv verify where there is more memory)")
    raise UsageError(
        f"the checks of this language model need about {gib(need)} of memory besides the model ({gib(have)} "
        f"available): question 2 about {gib(parts['question 2'])}{generation}, mostly its logits (a vocabulary of "
        f"{_sizes(loaded.model)[1]} per token, in float64, on {count(samples, 'sequence')}); {'; '.join(ways)}"
    )


REFERENCE = "original float64 (pytorch, one pass over the prompts and the fused folder's tokens)"
"""The reference run's name in the report."""


def prompts_of(token_ids: ArrayLike) -> torch.Tensor:
    """The check's prompts from verification inputs int64 ``(S, T)``: the first ``PROMPTS`` rows, their first half
    (at least one token)."""
    ids = _as_ids(token_ids)[:PROMPTS]
    return ids[:, : max(1, ids.shape[1] // 2)]


def _positions_of(model: Any) -> int | None:
    """The ``max_position_embeddings`` of a slabconv language model's config (``model.cfg``), or None."""
    return getattr(getattr(model, "cfg", None), "max_position_embeddings", None)


def within_positions(prompts: torch.Tensor, steps: int, positions: int | None) -> tuple[torch.Tensor, int, list[str]]:
    """Prompts ``(B, T)`` and ``steps`` that fit a model of ``positions`` positions (``max_position_embeddings``):
    the prompts cut to leave room for the steps (at least one token kept), then the steps cut to what is left.

    Returns:
        ``(prompts, steps, notes)``: a note for each cut (the report's ``generation.notes``).
    """
    notes: list[str] = []
    if positions is None or prompts.shape[1] + steps <= positions:
        return prompts, steps, notes
    keep = max(1, min(prompts.shape[1], positions - steps))
    if keep < prompts.shape[1]:
        notes.append(f"prompts cut to {count(keep, 'token')}: the model has {positions} positions")
        prompts = prompts[:, :keep]
    if keep + steps > positions:
        notes.append(
            f"{count(positions - keep, 'token')} generated per prompt, not {steps}: the model has {positions} positions"
        )
        steps = positions - keep
    return prompts, steps, notes


def settings_not_applied(folder: Path | str, steps: int) -> list[str]:
    """A note naming what the folder's ``generation_config.json`` asks of ``generate`` that the check does not do (it
    compares plain greedy tokens, ``steps`` per prompt: ``greedy_fused``): sampling, beams, penalties, a length.
    Empty where it asks for none of them, or the file is missing, unreadable (``safety.read_json``: over its size or
    depth limits too) or not a JSON object."""
    from slabconv.load.safety import read_json

    try:
        asked = read_json(Path(folder) / "generation_config.json")
    except InputError:
        return []
    plain = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
    lengths = ("max_new_tokens", "max_length")
    named = [f"{k} {json.dumps(v)}" for k, v in (asked.items() if isinstance(asked, dict) else ())
             if (k in plain and v not in (None, plain[k])) or (k in lengths and v is not None)]  # fmt: skip
    if not named:
        return []
    return [
        f"generation_config.json asks for {', '.join(named)}: not applied, the check compares plain greedy tokens, "
        f"{count(steps, 'token')} per prompt (--generate), with the original's own greedy choice"
    ]


def check_fused_folder(
    original: torch.nn.Module, folder: Path | str, token_ids: ArrayLike, steps: int, *, onnx: bool = True
) -> dict[str, Any]:
    """The greedy-generation check of ``fuse`` and ``verify --generate`` in memory (``check_generation``): the
    original against the fused folder in transformers and, when ``onnx`` and the folder has one, its
    ``decoder.onnx`` in onnxruntime and, with onnxruntime-genai installed and a ``genai_config.json`` beside it, in
    onnxruntime-genai (not for bfloat16: onnxruntime's CPU provider has no bfloat16 kernels). Where the folder
    has a ``genai_config.json`` but onnxruntime-genai is not installed, the returned block's ``notes`` says so.
    The streamed mode's is ``slabconv.verify.generate_streamed.generate_fused``, judged on question 2's float64
    chain (``FusedRun.judged``).

    Args:
        original: the zoo's ``LlamaForCausalLM``, eval mode.
        folder: the fused Hugging Face folder.
        token_ids: int64 ``(S, T)`` verification inputs; the prompts are ``prompts_of`` them.
        steps: tokens to generate per prompt.
        onnx: also run ``folder/decoder.onnx`` when it exists.

    Returns:
        ``GenerationCheck.to_dict()``: the report's ``verification.generation`` block.

    Raises:
        UsageError: transformers is not installed; bad ids or steps.
        UnsupportedModelError: the original is not a zoo LLaMA language model.
    """
    positions = _positions_of(original)
    prompts, steps, notes = within_positions(prompts_of(token_ids), steps, positions)
    decoder = Path(folder) / "decoder.onnx"
    dtype = next(original.parameters()).dtype
    onnx_path = decoder if onnx and decoder.is_file() and dtype != torch.bfloat16 else None
    has_genai_config = onnx_path is not None and (Path(folder) / "genai_config.json").is_file()
    genai = has_genai_config and genai_available()
    if genai:
        prompts, notes = _not_ending_in_padding(prompts, Path(folder) / "genai_config.json", notes)
    check = check_generation(original, folder, prompts, steps, onnx_path=onnx_path, genai=genai, threads=1)
    check.notes += notes + settings_not_applied(folder, steps)
    if has_genai_config and not genai:
        check.notes.append(
            "onnxruntime-genai is not installed: genai_config.json not run (pip install slabconv[genai])"
        )
    return check.to_dict()
