"""A fused LLaMA folder as one ONNX decoder with past key/values, for token-by-token generation in onnxruntime.

The input and output names are the layout optimum and onnxruntime-genai use for decoder-only models
(``i`` = 0 .. L-1; B batch, T new tokens, P past tokens, K key/value heads, d head size, V vocabulary size):

- inputs: ``input_ids`` int64 (B, T); ``attention_mask`` int64 (B, P + T), 1 for a real token, 0 for left padding;
  ``position_ids`` int64 (B, T); ``past_key_values.{i}.key`` / ``.value`` (B, K, P, d) in the model dtype
  (P = 0 on the first step: empty tensors).
- outputs: ``logits`` (B, T, V); ``present.{i}.key`` / ``.value`` (B, K, P + T, d): the next step's past.

B, T and P are dynamic. The graph is the folder's ``SlabconvLlamaForCausalLM`` (``modeling_slabconv_llama.py``)
traced with its transformers ``DynamicCache`` filled from the past inputs, so it computes what ``generate`` does.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch

from slabconv.errors import UnsupportedModelError, UsageError, first_line, root_cause
from slabconv.util import quiet
from slabconv.version import __version__
from slabconv.write.hf_llama import STANDARD_TYPES, load_fused_llama, transformers_config
from slabconv.write.onnx import MARK, ONNX_EXTERNAL_DATA_BYTES, opset_for, save_onnx, weight_bytes

DEFAULT_DECODER_ONNX = "decoder.onnx"
MIN_OPSET = 17


def past_names(num_layers: int) -> list[str]:
    """``past_key_values.{i}.key``, ``past_key_values.{i}.value`` for each layer, in input order."""
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """``present.{i}.key``, ``present.{i}.value`` for each layer, in output order."""
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


class DecoderWithPast(torch.nn.Module):
    """One decoding step of a fused LLaMA with explicit past tensors (the ONNX signature as a module).

    ``forward(input_ids, attention_mask, position_ids, past)`` with ``past`` a list of ``(key, value)`` pairs of
    shape ``(B, K, P, d)``, one per layer; returns ``(logits, key_0, value_0, key_1, ...)`` with the presents of shape
    ``(B, K, P + T, d)``.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name is deprecated): pass
        # the cache under the name the installed release declares.
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(past))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self.cache_argument: cache},
        )
        presents: list[Any] = []
        for key, value, *_ in cache:  # each layer's past followed by the new tokens' keys/values
            presents += [key, value]
        return (out.logits, *presents)


def head_size(cfg: Any) -> int:
    """The attention head size of a transformers config: ``head_dim`` where the config has one (LLaMA, Mistral),
    else ``hidden_size / num_attention_heads`` (Qwen2's config has none)."""
    found = getattr(cfg, "head_dim", None)
    return int(found) if found else int(cfg.hidden_size) // int(cfg.num_attention_heads)


def _example(cfg: Any, dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs (batch 2, 3 new tokens, 4 past tokens; ids, mask, positions, past key/values per layer) and
    their dynamic shapes: batch, new-token and past lengths symbolic, past length from 0."""
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, head_size(cfg)
    batch, new, past_len = 2, 3, 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, new), generator=gen)
    mask = torch.ones(batch, past_len + new, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + new)[None].expand(batch, -1).contiguous()
    past = [
        (
            torch.randn(batch, kv_heads, past_len, head_dim, generator=gen).to(dtype),
            torch.randn(batch, kv_heads, past_len, head_dim, generator=gen).to(dtype),
        )
        for _ in range(layers)
    ]
    b = torch.export.Dim("batch_size")
    t = torch.export.Dim("sequence_length")
    p = torch.export.Dim("past_sequence_length", min=0)
    # The mask spans past + new tokens, P + T at run time as in optimum's layout; torch.export cannot name a sum
    # of two free dims, so it gets a dim of its own (the graph indexes its columns 0 .. P + T - 1).
    total = torch.export.Dim("total_sequence_length")
    shapes = {
        "input_ids": {0: b, 1: t},
        "attention_mask": {0: b, 1: total},
        "position_ids": {0: b, 1: t},
        "past": [({0: b, 2: p}, {0: b, 2: p}) for _ in range(layers)],
    }
    return (ids, mask, positions, past), shapes


def _export(model: Any, inputs: list[str], outputs: list[str], opset: int | None) -> Any:
    """``torch.onnx.export(dynamo=True)`` of ``DecoderWithPast(model)`` with symbolic batch, new-token and past
    lengths, stamped with slabconv's version; returns the ``ONNXProgram``.

    Raises:
        UnsupportedModelError: the exporter fails (its root cause, one line).
    """
    example, shapes = _example(model.config, next(model.parameters()).dtype)
    try:
        with quiet(), torch.no_grad():
            program = torch.onnx.export(
                DecoderWithPast(model).eval(),
                example,
                dynamo=True,
                dynamic_shapes=shapes,
                input_names=inputs,
                output_names=outputs,
                opset_version=opset,
                verbose=False,
            )
        assert program is not None
        program.model.metadata_props[MARK] = __version__
    except Exception as err:  # noqa: BLE001 - the exporter raises many types
        raise UnsupportedModelError(f"decoder ONNX export failed: {root_cause(err)}") from None
    return program


def export_decoder_onnx(
    folder: Path | str,
    path: Path | str | None = None,
    *,
    dtype: torch.dtype | None = None,
    external_data: bool | None = None,
    opset: int | None = None,
) -> dict[str, Any]:
    """Export a fused LLaMA folder as an ONNX decoder with past key/values (names and shapes: module docstring).

    Exported with ``torch.onnx.export(dynamo=True)`` from example tensors of batch 2, 3 new tokens and 4 past
    tokens; batch, new-token and past lengths are symbolic, so P = 0 (the first step) and T = 1 (the later steps)
    run too. The file is checked with ``onnx.checker.check_model(full_check=True)``.

    Args:
        folder: a fused LLaMA folder (``write_hf_llama_metadata``).
        path: the ``.onnx`` to write; default ``<folder>/decoder.onnx``.
        dtype: the graph's float dtype; default the folder's ``torch_dtype``.
        external_data: weights in ``<name>.onnx.data`` beside the file; default when they exceed 1.5 GiB (ONNX's
            protobuf limit is 2 GiB).
        opset: the ONNX opset; default the exporter's (at least 17).

    Returns:
        ``{"path", "opset", "external_data" (file name or None), "inputs", "outputs", "num_layers",
        "num_key_value_heads", "head_dim", "dtype"}``.

    Raises:
        UsageError: transformers is missing (``pip install slabconv[hf]``), the folder is not a fused LLaMA, the
            file cannot be written, or an opset below 17.
        UnsupportedModelError: the exporter or the checker fails (one line).
    """
    import onnx

    folder = Path(folder)
    out = Path(path) if path is not None else folder / DEFAULT_DECODER_ONNX
    if opset is not None and opset < MIN_OPSET:
        raise UsageError(f"opset {opset}: the decoder needs opset {MIN_OPSET} or later")
    model = load_fused_llama(folder, dtype)
    cfg = model.config
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, head_size(cfg)
    weight_dtype = next(model.parameters()).dtype
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(layers)]
    outputs = ["logits", *present_names(layers)]
    program = _export(model, inputs, outputs, opset if opset is not None else opset_for(model))
    external = weight_bytes(model) > ONNX_EXTERNAL_DATA_BYTES if external_data is None else external_data
    try:
        with quiet():
            save_onnx(program.model, out, external)
    except OSError as err:
        raise UsageError(f"cannot write {out}: {err.strerror or err}") from None
    try:
        onnx.checker.check_model(str(out), full_check=True)
    except Exception as err:  # noqa: BLE001 - ValidationError, InferenceError
        raise UnsupportedModelError(f"{out}: the exported decoder fails the ONNX checker: {first_line(err)}") from None
    opset_found = next((o.version for o in program.model_proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return {
        "path": str(out),
        "opset": int(opset_found),
        "external_data": f"{out.name}.data" if external else None,
        "inputs": inputs,
        "outputs": outputs,
        "num_layers": int(layers),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "dtype": str(weight_dtype).removeprefix("torch."),
    }


GENAI_CONFIG = "genai_config.json"


def special_tokens(config: dict[str, Any]) -> tuple[int, int | list[int], int]:
    """``(bos_token_id, eos_token_id, pad_token_id)`` of a LLaMA ``config.json`` as transformers reads it
    (``hf_llama.transformers_config``: a key left out takes transformers' default, LLaMA's bos 1 and eos 2), for
    ``genai_config.json``: onnxruntime-genai ends a sequence at an end-of-sequence id, so writing another id than
    transformers uses would make it stop where transformers does not. A missing pad id is the (first) eos id, as
    onnxruntime-genai's own model builder writes it; an id transformers leaves unset is 0 (onnxruntime-genai
    needs an id inside the vocabulary)."""
    read = transformers_config(config)

    def ids(value: Any) -> list[int]:
        values = value if isinstance(value, (list, tuple)) else [value]
        return [int(v) for v in values if isinstance(v, int)]

    eos = ids(read.eos_token_id) or [0]
    bos = (ids(read.bos_token_id) or [0])[0]
    pad = (ids(read.pad_token_id) or eos)[0]
    return bos, eos if len(eos) > 1 else eos[0], pad


def write_genai_config(folder: Path | str, info: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write ``genai_config.json`` beside ``decoder.onnx`` so onnxruntime-genai runs the folder
    (``onnxruntime_genai.Model(folder)``).

    The decoder section names the inputs and outputs of ``export_decoder_onnx`` (``past_key_values.%d.key`` in,
    ``present.%d.key`` out: the layout onnxruntime-genai's decoder-only models use); the search section is plain
    greedy. onnxruntime-genai needs a valid ``eos_token_id``: the config's, else 0 (a caller that wants exactly N
    new tokens sets ``min_length``, as ``slabconv.verify.generate.greedy_genai`` does).

    Args:
        folder: the fused folder holding the decoder.
        info: what ``export_decoder_onnx`` returned (file name, layers, key/value heads, head size).
        config: the folder's ``config.json`` (sizes, heads, ``max_position_embeddings``, token ids).

    Returns:
        The path written.
    """
    folder = Path(folder)

    bos, eos, pad = special_tokens(config)
    genai = {
        "model": {
            "type": config.get("model_type") if config.get("model_type") in STANDARD_TYPES else "llama",
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "context_length": int(config["max_position_embeddings"]),
            "vocab_size": int(config["vocab_size"]),
            "decoder": {
                "filename": Path(info["path"]).name,
                "head_size": int(info["head_dim"]),
                "hidden_size": int(config["hidden_size"]),
                "num_attention_heads": int(config["num_attention_heads"]),
                "num_hidden_layers": int(info["num_layers"]),
                "num_key_value_heads": int(info["num_key_value_heads"]),
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": int(config["max_position_embeddings"]),
            "min_length": 0,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }
    path = folder / GENAI_CONFIG
    path.write_text(json.dumps(genai, indent=2) + "\n", encoding="utf-8")
    return path
