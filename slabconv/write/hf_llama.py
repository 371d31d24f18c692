"""A fused LLaMA-PRepBN folder as a Hugging Face model folder: ``config.json``, ``generation_config.json`` and the
modeling file beside the weights, so ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads
it with ``transformers`` alone.

Layout source: the Hugging Face LLaMA key layout of github xinghaochen/SLAB
``llama/modeling/llama-350M/modeling_llama.py`` (``slabconv.zoo.llama``). After every norm is folded, what the
weights hold is (``i`` = 0 .. L-1; C hidden size, d head size, H heads, K key/value heads, I intermediate size,
V vocabulary size):

- ``model.embed_tokens.weight`` (V, C);
- ``model.layers.{i}.self_attn.q_proj.weight`` (H*d, C), ``k_proj``/``v_proj.weight`` (K*d, C),
  ``o_proj.weight`` (C, H*d);
- ``model.layers.{i}.mlp.gate_proj``/``up_proj.weight`` (I, C), ``down_proj.weight`` (C, I);
- ``lm_head.weight`` (V, C);
- a ``.bias`` on each projection a norm was folded into (q/k/v, gate/up, lm_head), and on any that had one before;
- possibly ``model.layers.{i}.self_attn.rotary_emb.inv_freq`` (not read: the model recomputes it in float32).

Nothing else: a tensor under a norm's name (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``),
such as the per-channel ``scale``/``shift`` of a kept affine, means a norm was not folded, and the norm-free model
cannot run those weights.

A standard decoder (``slabconv.zoo.llama_std``: LLaMA, Mistral, Qwen2) whose norm weights were folded
(``--fold-norm-affine``) stays its own architecture: ``write_hf_standard_metadata`` writes its ``config.json``
(the original's ``model_type`` and ``architectures``) and ``generation_config.json`` beside the weights, which hold
exactly that architecture's tensors (every RMSNorm weight 1 where it folded, the original where the norm was kept
whole, biases only on the projections the architecture has them on), so ``AutoModelForCausalLM.from_pretrained``
loads it without ``trust_remote_code``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.load import safety
from slabconv.load.fused import CONFIG_KEY, PROVENANCE_KEY, config_provenance
from slabconv.load.hf import CONFIG, SAFETENSORS, SAFETENSORS_INDEX, resolves_inside
from slabconv.load.shards import LazyShards
from slabconv.zoo.llama import LlamaConfig, RopeScaling, rope_parameters, rope_scaling, rope_theta
from slabconv.zoo.llama_std import MODEL_TYPES as STANDARD_TYPES  # the standard decoders, written as themselves

MODEL_TYPE = "slabconv_llama"
"""``model_type`` of a fused LLaMA folder (distinct from ``llama``: the layers have no norms); the loader reads it as
``slabconv.load.fused.FUSED_LLAMA_TYPE`` (the same string: tests/test_stream.py; stated here too so that
docs/errors.md's check reads the message that names it)."""

MODELING_FILE = "modeling_slabconv_llama.py"
"""The modeling file copied into the folder (from ``slabconv/write/templates``)."""

ARCHITECTURE = "SlabconvLlamaForCausalLM"
GENERATION_CONFIG = "generation_config.json"
AUTO_MAP = {
    "AutoConfig": "modeling_slabconv_llama.SlabconvLlamaConfig",
    "AutoModelForCausalLM": "modeling_slabconv_llama.SlabconvLlamaForCausalLM",
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
INSTALL_HINT = "pip install slabconv[hf]"
MIN_TRANSFORMERS = (5, 4)
"""The oldest transformers the modeling file runs with (its own import check says the same)."""

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_NORM = re.compile(r"(model\.norm|model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm))\.")
# Generation settings of the original config.json that go to generation_config.json as well.
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""The tokenizer files of a Hugging Face folder (data ``AutoTokenizer`` reads; no code) that a fused folder carries
over from the original (``copy_tokenizer_files``)."""

_STD_NORMS = ("input_layernorm", "post_attention_layernorm")


def require_transformers(fusing: bool = False) -> Any:
    """The ``transformers`` module, at least ``MIN_TRANSFORMERS``.

    Args:
        fusing: the message is for ``fuse`` of a language model (which can do without, with fewer outputs).

    Raises:
        UsageError: it is not installed, or too old (one line saying what to install).
    """
    try:
        import transformers
    except ImportError:
        if fusing:
            raise UsageError(
                "fusing a language model exports decoder.onnx and checks greedy generation, which need the Hugging "
                f"Face transformers package: {INSTALL_HINT} (or pass --no-onnx --generate 0 to write the folder "
                "without them)"
            ) from None
        raise UsageError(
            f"running a fused LLaMA folder needs the Hugging Face transformers package: {INSTALL_HINT}"
        ) from None
    major, minor = (transformers.__version__.split(".") + ["0"])[:2]
    if (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)) < MIN_TRANSFORMERS:
        raise UsageError(
            f"transformers {transformers.__version__} is older than the fused LLaMA model needs "
            f"({MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]}): {INSTALL_HINT} (or pip install -U transformers)"
        )
    return transformers


def transformers_config(config: Mapping[str, Any]) -> Any:
    """A LLaMA ``config.json`` as transformers reads it: ``from_dict`` of the config class of its ``model_type``
    where that is a standard decoder (``STANDARD_TYPES``), else ``LlamaConfig`` (a LLaMA-PRepBN); a key left out
    takes transformers' default.

    Raises:
        ValueError, TypeError, huggingface_hub.errors.StrictDataclassError: the class refuses an entry.
    """
    import transformers

    model_type = config.get("model_type")
    known = transformers.CONFIG_MAPPING[model_type] if model_type in STANDARD_TYPES else transformers.LlamaConfig
    return known.from_dict(dict(config))


def check_transformers_reads(config: Mapping[str, Any], path: Path) -> None:
    """Refuse an original ``config.json`` (``path``) that transformers' config class for its ``model_type``
    (``LlamaConfig`` for a LLaMA-PRepBN) does not read, such as a ``bos_token_id`` list: the fused folder keeps
    those entries, so its loading would fail after the whole fold (``StrictDataclassError``, or a ``ValueError`` /
    ``TypeError`` of the class's own checks).

    Raises:
        UsageError: transformers is missing or too old.
        InputError: the config class refuses it (the entry and the value named).
    """
    from huggingface_hub.errors import StrictDataclassError

    transformers = require_transformers()
    try:
        transformers_config(config)
    except (StrictDataclassError, ValueError, TypeError) as error:
        reason = " ".join(str(error.__cause__ or error).split()).split(" Errors: ")[0].rstrip(".")
        raise InputError(
            f"{path}: transformers {transformers.__version__} does not read it ({reason}), and the fused folder "
            "would keep it; correct that entry"
        ) from None


def _projection_key(layer: int | None, name: str, what: str) -> str:
    if name == "lm_head":
        return f"lm_head.{what}"
    group = "self_attn" if name in _ATTN else "mlp"
    return f"model.layers.{layer}.{group}.{name}.{what}"


def _check_names(keys: set[str], layers: list[int]) -> None:
    """Every name is one of the norm-free layout's, and every weight it requires is there.

    Raises:
        UnsupportedModelError: a tensor outside the layout, or a missing weight.
    """
    known = {"model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"}
    for i in layers:
        known.add(f"model.layers.{i}.self_attn.rotary_emb.inv_freq")
        for name in _ATTN + _MLP:
            known |= {_projection_key(i, name, "weight"), _projection_key(i, name, "bias")}
    unknown = sorted(keys - known)
    if unknown:
        raise UnsupportedModelError(f"tensor {unknown[0]} is not part of the norm-free LLaMA layout; refused")
    required = {"model.embed_tokens.weight", "lm_head.weight"} | {
        _projection_key(i, name, "weight") for i in layers for name in _ATTN + _MLP
    }
    missing = sorted(required - keys)
    if missing:
        raise UnsupportedModelError(f"the fused LLaMA weights lack {missing[0]} ({len(missing)} missing)")


def _biases(keys: set[str], layers: list[int]) -> dict[str, bool]:
    """Whether each projection (and ``lm_head``) has a bias, the same in every layer.

    Raises:
        UnsupportedModelError: a projection has a bias in some layers only.
    """
    bias: dict[str, bool] = {"lm_head": "lm_head.bias" in keys}
    for name in _ATTN + _MLP:
        has = [_projection_key(i, name, "bias") in keys for i in layers]
        if any(has) and not all(has):
            raise UnsupportedModelError(
                f"{name} has a bias in layers {[i for i, h in zip(layers, has, strict=True) if h][:4]} only; "
                "the model needs the same layout in every layer"
            )
        bias[name] = all(has)
    return bias


def norm_free_layout(
    weight_shapes: Mapping[str, Sequence[int]] | Iterable[str], config: Mapping[str, Any]
) -> dict[str, Any]:
    """Check that fused LLaMA weights are norm-free and read their layout.

    Args:
        weight_shapes: tensor name -> shape (checked against ``config``), or the names alone.
        config: the original ``config.json`` (``num_attention_heads``; ``num_key_value_heads``, ``head_dim``
            when the model has them).

    Returns:
        ``{"num_hidden_layers", "num_key_value_heads", "head_dim", "projection_bias"}``, plus ``vocab_size``,
        ``hidden_size``, ``intermediate_size`` when shapes were given; ``projection_bias`` maps each of ``q_proj``
        .. ``down_proj``, ``lm_head`` to whether it has a bias (the same in every layer);
        ``num_key_value_heads``/``head_dim`` are None when only names were given and the config lacks them.

    Raises:
        UnsupportedModelError: a norm was not folded (a tensor under ``input_layernorm``,
            ``post_attention_layernorm`` or ``model.norm``, e.g. a kept affine's ``scale``/``shift``); a tensor
            that is not part of the layout; a missing weight; a bias in some layers only; shapes that disagree
            with the config.
    """
    shapes = (
        {k: tuple(int(s) for s in v) for k, v in weight_shapes.items()} if isinstance(weight_shapes, Mapping) else None
    )
    keys = set(shapes) if shapes is not None else set(weight_shapes)
    norms = sorted((m.group(1), k) for k in keys if (m := _NORM.match(k)))
    if norms:
        norm = norms[0][0]
        raise UnsupportedModelError(
            f"{norm} was not folded ({len(norms)} tensors under norms remain, e.g. {norms[0][1]}): the norm-free "
            "LLaMA runs only weights with every norm folded (see the fuse report's folds)"
        )
    layers = sorted({int(m.group(1)) for k in keys if (m := _LAYER.match(k))})
    if layers != list(range(len(layers))) or not layers:
        raise UnsupportedModelError(f"the decoder layers are not numbered 0 .. L-1 (found {layers[:8]})")
    _check_names(keys, layers)
    bias = _biases(keys, layers)
    if config.get("num_hidden_layers") is not None and int(config["num_hidden_layers"]) != len(layers):
        raise UnsupportedModelError(
            f"config num_hidden_layers {config['num_hidden_layers']} but the weights have {len(layers)}"
        )
    heads = int(config["num_attention_heads"]) if config.get("num_attention_heads") is not None else None
    kv_heads = int(config["num_key_value_heads"]) if config.get("num_key_value_heads") is not None else None
    head_dim = int(config["head_dim"]) if config.get("head_dim") is not None else None
    sizes: dict[str, int] = {}
    if shapes is not None:
        kv_heads, head_dim = _check_shapes(shapes, config, len(layers), heads, kv_heads, head_dim)
        vocab, hidden = shapes["model.embed_tokens.weight"]
        inter = shapes["model.layers.0.mlp.gate_proj.weight"][0]
        sizes = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter}
    elif head_dim is None and heads and config.get("hidden_size"):
        head_dim = int(config["hidden_size"]) // heads
    return {
        **sizes,
        "num_hidden_layers": len(layers),
        "num_key_value_heads": kv_heads if kv_heads is not None else heads,
        "head_dim": head_dim,
        "projection_bias": {name: bias[name] for name in PROJECTIONS},
    }


def _check_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any],
    depth: int,
    heads: int | None,
    kv_heads: int | None,
    head_dim: int | None,
) -> tuple[int, int]:
    """Head counts from the weights, checked against the config: ``(num_key_value_heads, head_dim)``."""
    if heads is None:
        raise UnsupportedModelError("the config has no num_attention_heads; the LLaMA weights do not show it")
    vocab, hidden = shapes["model.embed_tokens.weight"]
    q_rows = shapes["model.layers.0.self_attn.q_proj.weight"][0]
    if head_dim is None:
        head_dim = q_rows // heads
    if q_rows != heads * head_dim:
        raise UnsupportedModelError(f"q_proj has {q_rows} rows, not num_attention_heads {heads} x head_dim {head_dim}")
    k_rows = shapes["model.layers.0.self_attn.k_proj.weight"][0]
    if k_rows % head_dim or heads % (k_rows // head_dim or 1) or k_rows == 0:
        raise UnsupportedModelError(
            f"k_proj has {k_rows} rows: not a divisor of the {heads} heads x head_dim {head_dim}"
        )
    found = k_rows // head_dim
    if kv_heads is not None and kv_heads != found:
        raise UnsupportedModelError(f"config num_key_value_heads {kv_heads} but k_proj has {found} heads of {head_dim}")
    inter = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "lm_head.bias": (vocab,),
    }
    for i in range(depth):
        rows = {"q_proj": q_rows, "k_proj": k_rows, "v_proj": k_rows, "o_proj": hidden}
        rows |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
        cols = {"o_proj": q_rows, "down_proj": inter}
        for name, r in rows.items():
            expected[_projection_key(i, name, "weight")] = (r, cols.get(name, hidden))
            expected[_projection_key(i, name, "bias")] = (r,)
    for key, want in expected.items():
        if key in shapes and shapes[key] != want:
            raise UnsupportedModelError(
                f"{key} has shape {list(shapes[key])}, expected {list(want)} from the layer sizes"
            )
    for key, value in (("hidden_size", hidden), ("vocab_size", vocab), ("intermediate_size", inter)):
        if config.get(key) is not None and int(config[key]) != value:
            raise UnsupportedModelError(f"config {key} {config[key]} but the weights have {value}")
    return found, head_dim


def weights_dtype(folder: Path | str, specs: Mapping[str, tuple[torch.dtype, list[int]]] | None = None) -> str:
    """The name (``torch_dtype``: ``float16``) of the one float dtype of a folder's weights (``specs``, read by
    ``folder_weight_specs`` where not given), rotary ``inv_freq`` buffers aside (the model recomputes them in
    float32).

    Raises:
        UsageError: the weights mix float dtypes, or theirs is not one the model runs (float32, float16, bfloat16);
            as ``folder_weight_specs``.
    """
    specs = folder_weight_specs(folder) if specs is None else specs
    floats = {d for k, (d, _) in specs.items() if d.is_floating_point and not k.endswith("inv_freq")}
    if len(floats) != 1:
        raise UsageError(f"{folder}: the weights mix dtypes {sorted(map(str, floats))}; the folder has one dtype")
    dtype = floats.pop()
    name = str(dtype).removeprefix("torch.")
    if name not in safety.FOLDABLE_FLOATS:
        raise UsageError(f"dtype {dtype} is not a float dtype the model can run (float32, float16, bfloat16)")
    return name


def folder_weight_specs(folder: Path | str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Every tensor's ``(dtype, shape)`` from the safetensors headers of a folder (``model.safetensors`` or the
    shards of ``model.safetensors.index.json``); no tensor data is read.

    Raises:
        UsageError: the folder holds neither file (write the weights first).
        InputError: a damaged index or header, a missing shard.
    """
    folder = Path(folder)
    if not (folder / SAFETENSORS).is_file() and not (folder / SAFETENSORS_INDEX).is_file():
        raise UsageError(f"{folder}: no {SAFETENSORS} or {SAFETENSORS_INDEX}; write the fused weights there first")
    return LazyShards.open(folder).specs()


def write_hf_llama_metadata(
    folder: Path | str,
    config: Mapping[str, Any],
    *,
    generation: Mapping[str, Any] | None = None,
    provenance: Mapping[str, str] | None = None,
) -> list[Path]:
    """Make a folder of fused LLaMA-PRepBN weights a Hugging Face model folder.

    Writes, beside the weights the caller already wrote (``model.safetensors``, or shards plus
    ``model.safetensors.index.json``): ``config.json`` (the original config plus ``model_type``
    ``slabconv_llama``, ``architectures``, ``auto_map`` to the modeling file, ``num_key_value_heads``,
    ``head_dim``, ``projection_bias``, ``rope_parameters``, ``torch_dtype``), ``generation_config.json`` and
    ``modeling_slabconv_llama.py`` (imports only torch and transformers). transformers is not needed to write them.

    Args:
        folder: the folder holding the fused weights.
        config: the original ``config.json`` (``model_type`` ``llama``; sizes, heads, ``rope_theta``, token ids).
        generation: ``generation_config.json``'s entries beyond the config's bos/eos/pad token ids (the
            original's, ``original_generation``); without ``do_sample`` there, ``do_sample`` false (greedy).
        provenance: the weights' fused metadata (``load.fused.fused_metadata``), recorded in ``config.json`` as
            ``slabconv.provenance`` (``load.fused.config_provenance``): transformers' ``save_pretrained`` keeps it
            there when it drops the safetensors metadata, so ``verify`` still knows what the folder is a fold of.

    Returns:
        The files written: ``config.json``, ``generation_config.json``, the modeling file.

    Raises:
        UnsupportedModelError: a norm was not folded (e.g. a kept affine), the weights are not the LLaMA layout,
            or the config asks for what the model does not implement (a scaled rope other than llama3 / linear,
            another activation).
        UsageError: no weights in the folder, weights of mixed or non-float dtypes.
        InputError: a damaged safetensors header or index.
    """
    folder = Path(folder)
    specs = folder_weight_specs(folder)
    layout = norm_free_layout({k: shape for k, (_, shape) in specs.items()}, config)
    dtype_name = weights_dtype(folder, specs)
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r}: the LLaMA-PRepBN MLP uses silu")
    _rope(config)  # a rope the forward computes, else refused
    written = [
        _write_config(folder, config, layout, dtype_name, provenance),
        _write_generation_config(folder, config, generation),
        folder / MODELING_FILE,
    ]
    template = resources.files("slabconv.write.templates").joinpath(MODELING_FILE)
    with resources.as_file(template) as src:
        shutil.copyfile(src, folder / MODELING_FILE)
    return written


def original_generation(source: Path | str) -> dict[str, Any]:
    """The settings of the original folder's ``generation_config.json`` (which transformers' ``generate`` reads
    before ``config.json``), for the fused folder's: its sampling settings (``do_sample``, ``temperature``,
    ``top_p``, ...) as they are, so the fused folder generates as the original does; the bos / eos / pad token ids
    each kept where it is an int or a list of ints (the ids of ``config.json`` then stand); ``transformers_version``
    left to the writer. A file that is not a JSON object or is over ``load.safety``'s JSON limits gives nothing.

    Args:
        source: the original Hugging Face folder (a file: its folder).

    Returns:
        ``{"eos_token_id": 2, "do_sample": True, "temperature": 0.6, ...}``: the settings found (none where the
        folder has no such file).
    """
    source = Path(source)
    found = (source if source.is_dir() else source.parent) / GENERATION_CONFIG
    try:  # read as every JSON input is (a regular file, size and depth bounded before parsing)
        data = safety.read_json(found) if found.is_file() and resolves_inside(found.parent, found) else {}
    except InputError:  # damaged, over the limits: the ids of config.json stand
        return {}
    if not isinstance(data, dict):
        return {}

    def token_id(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def kept(key: str, v: Any) -> bool:
        if key in _GENERATION_KEYS:
            return token_id(v) or (isinstance(v, list) and bool(v) and all(token_id(n) for n in v))
        return key != "transformers_version"

    return {k: v for k, v in data.items() if kept(k, v)}


def copy_tokenizer_files(source: Path | str, folder: Path | str) -> list[Path]:
    """Copy the original folder's tokenizer files (``TOKENIZER_FILES``: regular files, or links that stay inside the
    folder or its hub cache entry: ``load.hf.resolves_inside``) into the fused ``folder``, byte for byte, so that
    ``AutoTokenizer.from_pretrained(folder)`` reads the original's tokenizer. The fold does not change the
    vocabulary, so the original's token ids are the fused model's. No file is run or parsed.

    Args:
        source: the original Hugging Face folder (a file: its folder).
        folder: the fused folder.

    Returns:
        The files written (none where the original has no tokenizer).
    """
    source, folder = Path(source), Path(folder)
    source = source if source.is_dir() else source.parent
    written = []
    for name in tokenizer_files(source):
        shutil.copyfile(source / name, folder / name)
        written.append(folder / name)
    return written


def tokenizer_files(folder: Path) -> list[str]:
    """The names of ``TOKENIZER_FILES`` that ``folder`` holds as a fused folder carries them: regular files, or
    links that stay inside the folder or its hub cache entry (``load.hf.resolves_inside``)."""
    return [n for n in TOKENIZER_FILES if (folder / n).is_file() and resolves_inside(folder, folder / n)]


def standard_biases(config: Mapping[str, Any]) -> dict[str, bool]:
    """Which projections carry a bias in the standard architecture ``config`` describes (transformers 5):
    LLaMA q/k/v/o with ``attention_bias`` and gate/up/down with ``mlp_bias``; Qwen2 q/k/v; Mistral none;
    ``lm_head`` never."""
    model_type = config.get("model_type")
    bias = dict.fromkeys(PROJECTIONS, False)
    if model_type == "llama":
        bias.update(dict.fromkeys(_ATTN, bool(config.get("attention_bias", False))))
        bias.update(dict.fromkeys(_MLP, bool(config.get("mlp_bias", False))))
    elif model_type == "qwen2":
        bias.update(dict.fromkeys(("q_proj", "k_proj", "v_proj"), True))
    return bias


def standard_layout(weight_shapes: Mapping[str, Sequence[int]], config: Mapping[str, Any]) -> None:
    """Check that folded weights are exactly the standard architecture ``config`` describes: every norm weight and
    projection weight, a bias where the architecture has one and nowhere else, ``lm_head.weight`` unless the
    embeddings are tied.

    Raises:
        UnsupportedModelError: a projection holds a bias the architecture has no place for (a fold needed one:
            the model cannot be written as this architecture), a tensor outside the layout, a missing tensor.
    """
    keys = set(weight_shapes)
    layers = sorted({int(m.group(1)) for k in keys if (m := _LAYER.match(k))})
    if layers != list(range(len(layers))) or not layers:
        raise UnsupportedModelError(f"the decoder layers are not numbered 0 .. L-1 (found {layers[:8]})")
    bias = standard_biases(config)
    model_type = config.get("model_type")
    for key in sorted(keys):
        m = re.match(r"(?:model\.layers\.\d+\.(?:self_attn|mlp)\.)?(\w+)\.bias$", key)
        if m and m.group(1) in bias and not bias[m.group(1)]:
            raise UnsupportedModelError(
                f"{key}: the fold gave {m.group(1)} a bias, which {model_type} has no place for; this model cannot be "
                "written as its own architecture (a norm with a shift folded into a bias-free projection)"
            )
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in keys
    required = {"model.embed_tokens.weight", "model.norm.weight", *([] if tied else ["lm_head.weight"])}
    for i in layers:
        required |= {f"model.layers.{i}.{n}.weight" for n in _STD_NORMS}
        required |= {_projection_key(i, name, "weight") for name in _ATTN + _MLP}
        required |= {_projection_key(i, name, "bias") for name in _ATTN + _MLP if bias[name]}
    known = required | {"lm_head.weight"}
    unknown, missing = sorted(keys - known), sorted(required - keys)
    if unknown:
        raise UnsupportedModelError(f"tensor {unknown[0]} is not part of the {model_type} layout; refused")
    if missing:
        raise UnsupportedModelError(f"the folded {model_type} weights lack {missing[0]} ({len(missing)} missing)")


def write_hf_standard_metadata(
    folder: Path | str,
    config: Mapping[str, Any],
    *,
    folded: bool = True,
    generation: Mapping[str, Any] | None = None,
    provenance: Mapping[str, str] | None = None,
) -> list[Path]:
    """Make a folder of folded standard-decoder weights (LLaMA, Mistral, Qwen2) a Hugging Face model folder of the
    same architecture: ``config.json`` (the original's, ``auto_map`` dropped, ``torch_dtype`` / ``dtype`` set,
    plus a ``slabconv`` entry saying what was folded) and ``generation_config.json``; no modeling file.

    Args:
        folder: the folder holding the weights (``model.safetensors``, or shards plus their index).
        config: the original ``config.json`` (``model_type`` in ``STANDARD_TYPES``).
        folded: the weights hold folded norms (``--fold-norm-affine``); False: the norms are as in the original,
            which the ``slabconv`` entry then says.
        generation: extra ``generation_config.json`` entries, as ``write_hf_llama_metadata``'s.
        provenance: the weights' fused metadata, recorded in the ``slabconv`` entry as ``write_hf_llama_metadata``
            records it.

    Returns:
        The files written: ``config.json``, ``generation_config.json``.

    Raises:
        UnsupportedModelError: another ``model_type``; weights that are not that architecture (``standard_layout``).
        UsageError: no weights in the folder, weights of mixed or non-float dtypes.
        InputError: a damaged safetensors header or index.
    """
    folder = Path(folder)
    if config.get("model_type") not in STANDARD_TYPES:
        raise UnsupportedModelError(
            f"model_type {config.get('model_type')!r} is not a standard decoder slabconv writes as itself "
            f"({', '.join(STANDARD_TYPES)})"
        )
    specs = folder_weight_specs(folder)
    shapes = {k: shape for k, (_, shape) in specs.items()}
    standard_layout(shapes, config)
    name = weights_dtype(folder, specs)
    out: dict[str, Any] = {k: v for k, v in config.items() if k != "auto_map"}
    # the sizes slabconv read from the weights where config.json leaves them out: transformers would take its
    # defaults (LLaMA-7B's 4096 x 32 layers), build that model and fail to load these weights into it
    out.update({k: v for k, v in _standard_sizes(shapes, config).items() if config.get(k) is None})
    ours: dict[str, Any] = {
        "norm_affine": "folded: each RMSNorm weight that is 1 went into the projections that read its norm "
        "(input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj, model.norm -> lm_head); "
        "report.json lists every norm"
        if folded
        else "not folded: every norm weight is the original's (fold with --fold-norm-affine)",
    }
    if provenance is not None:
        ours[PROVENANCE_KEY] = config_provenance(provenance)
    out.update(torch_dtype=name, dtype=name, **{CONFIG_KEY: ours})
    return [_write_json(folder / CONFIG, out), _write_generation_config(folder, config, generation)]


def _standard_sizes(shapes: Mapping[str, Sequence[int]], config: Mapping[str, Any]) -> dict[str, int]:
    """A standard decoder's sizes as its weights ``shapes`` hold them (checked by ``standard_layout``):
    ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` and, where the config gives the
    heads, ``num_key_value_heads`` (``k_proj``'s rows over the head size: ``head_dim``, else ``hidden_size`` over
    ``num_attention_heads``)."""
    vocab, hidden = (int(d) for d in shapes["model.embed_tokens.weight"])
    sizes = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(shapes[_projection_key(0, "gate_proj", "weight")][0]),
        "num_hidden_layers": len({int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}),
    }
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // int(heads) if heads else None)
    if head_dim:
        sizes["num_key_value_heads"] = int(shapes[_projection_key(0, "k_proj", "weight")][0]) // int(head_dim)
    return sizes


def _write_json(path: Path, out: dict[str, Any]) -> Path:
    """Write a transformers JSON file (``config.json``, ``generation_config.json``) with the installed
    transformers version in ``transformers_version``, as transformers writes it (left out when not installed)."""
    try:
        from importlib.metadata import version

        out["transformers_version"] = version("transformers")
    except Exception:  # noqa: BLE001 - not installed: the field is optional
        pass
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _write_config(
    folder: Path,
    config: Mapping[str, Any],
    layout: dict[str, Any],
    dtype: str,
    provenance: Mapping[str, str] | None = None,
) -> Path:
    out: dict[str, Any] = {k: v for k, v in config.items() if k not in ("auto_map", "rope_scaling")}
    theta = rope_theta(config)
    rope = _rope(config)
    out.update(
        architectures=[ARCHITECTURE],
        auto_map=dict(AUTO_MAP),
        model_type=MODEL_TYPE,
        **{k: layout[k] for k in ("vocab_size", "hidden_size", "intermediate_size") if k in layout},
        num_hidden_layers=layout["num_hidden_layers"],
        num_key_value_heads=layout["num_key_value_heads"],
        head_dim=layout["head_dim"],
        projection_bias=layout["projection_bias"],
        rope_theta=theta,
        rope_parameters=rope_parameters(theta, rope),  # the rope the zoo's forward computed, scaled or not
        tie_word_embeddings=False,  # lm_head absorbed the final norm: it is no longer the embedding
        use_cache=True,  # deployment generates with the key/value cache (training configs often turn it off)
        torch_dtype=dtype,
        dtype=dtype,  # the transformers 5 name of torch_dtype
    )
    ours: dict[str, Any] = {
        "source_model_type": config.get("model_type", "llama"),
        "norms": "none: input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj, "
        "model.norm -> lm_head (folded)",
        "layer": "x + attn(x); x + mlp(x)",
    }
    if provenance is not None:
        ours[PROVENANCE_KEY] = config_provenance(provenance)
    out[CONFIG_KEY] = ours
    return _write_json(folder / CONFIG, out)


def _rope(config: Mapping[str, Any]) -> RopeScaling | None:
    """The scaled rope of the original ``config.json`` as the zoo read it (``max_position_embeddings`` where the
    config leaves it out: the zoo's and transformers' default)."""
    return rope_scaling(config, int(config.get("max_position_embeddings") or LlamaConfig.max_position_embeddings))


def _write_generation_config(folder: Path, config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> Path:
    out: dict[str, Any] = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
    out["do_sample"] = False  # unless the original's settings say otherwise
    out.update(generation or {})
    return _write_json(folder / GENERATION_CONFIG, out)


def load_fused_llama(folder: Path | str, dtype: torch.dtype | None = None) -> Any:
    """Load a fused LLaMA folder with transformers, in eval mode, using slabconv's own copy of the modeling file
    (the folder's ``modeling_slabconv_llama.py`` is not executed; ``from_pretrained(..., trust_remote_code=True)``
    runs that one, with the same code).

    Args:
        folder: written by ``write_hf_llama_metadata``.
        dtype: load in this dtype; default the folder's ``torch_dtype``.

    Returns:
        A ``SlabconvLlamaForCausalLM``: ``input_ids`` int64 ``(B, T)`` -> ``.logits`` ``(B, T, V)``; ``generate``.

    Raises:
        UsageError: transformers is not installed or older than 5.4 (``pip install slabconv[hf]``); the folder is
            not a fused LLaMA (no ``config.json`` with ``model_type`` ``slabconv_llama``, no safetensors weights).
        UnsupportedModelError: its weights are not norm-free (``norm_free_layout``).
        InputError: a damaged safetensors header or index.
    """
    require_transformers()
    from slabconv.write.templates.modeling_slabconv_llama import SlabconvLlamaForCausalLM

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        model_type = config.get("model_type")
    except (OSError, ValueError) as err:
        raise UsageError(f"{folder}: no readable {CONFIG} ({err})") from None
    if model_type not in (MODEL_TYPE, *STANDARD_TYPES):
        raise UsageError(f"{folder}: model_type {model_type!r}, not {MODEL_TYPE!r}; run write_hf_llama_metadata on it")
    shapes = {k: shape for k, (_, shape) in folder_weight_specs(folder).items()}
    if model_type in STANDARD_TYPES:
        standard_layout(shapes, config)
        return _load_standard(folder, dtype)
    fused_layout(folder, shapes, config)
    return _from_pretrained(SlabconvLlamaForCausalLM, folder, dtype).eval()


def fused_layout(folder: Path, shapes: Mapping[str, Sequence[int]], config: Mapping[str, Any]) -> dict[str, Any]:
    """``norm_free_layout`` of a fused folder's weight ``shapes`` against its ``config.json``, and its projections'
    biases against the config's ``projection_bias``, which says which Linears of the model transformers builds have
    one: a bias the weights hold but the config disowns would be dropped, one it declares that the weights lack left
    unset. Checked before the model is built, in memory and streamed alike.

    Raises:
        UnsupportedModelError: as ``norm_free_layout``; a projection's bias that the config does not declare as the
            weights hold it (``FOLDER: the weights lack a lm_head bias, unlike config.json's projection_bias``).
    """
    layout = norm_free_layout(shapes, config)
    declared = dict.fromkeys(PROJECTIONS, False) | dict(config.get("projection_bias") or {})
    wrong = next((name for name in PROJECTIONS if layout["projection_bias"][name] != declared[name]), None)
    if wrong is not None:
        held = "hold" if layout["projection_bias"][wrong] else "lack"
        raise UnsupportedModelError(
            f"{folder}: the weights {held} a {wrong} bias, unlike config.json's projection_bias"
        )
    return layout


def _from_pretrained(model_class: Any, folder: Path, dtype: torch.dtype | None, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(folder, **kwargs)`` in ``dtype`` (None: the folder's own, ``"auto"``), with
    transformers' log below errors and its progress bars off while it runs, both as they were after."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return model_class.from_pretrained(folder, dtype=dtype if dtype is not None else "auto", **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_standard(folder: Path, dtype: torch.dtype | None) -> Any:
    """A standard decoder folder (its weights checked by ``standard_layout``) in transformers
    (``AutoModelForCausalLM``, no remote code), refusing weights that do not fill the model exactly (a missing tensor
    would be left initialised)."""
    import transformers

    model, info = _from_pretrained(transformers.AutoModelForCausalLM, folder, dtype, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(what) or ())
        if keys:
            raise UnsupportedModelError(
                f"{folder}: transformers reports {what.replace('_', ' ')}: {keys[0]} ({len(keys)})"
            )
    return model.eval()
