"""Verify a folded LLaMA-PRepBN folder against its original one decoder layer at a time, in bounded memory.

For models too big to load whole (``fuse --stream``, ``verify --stream``). Both folders are read lazily
(``hf.LazyShards``). A decoder layer is built on the meta device from the zoo's ``LlamaDecoderLayer``; its norms
are real modules loaded from their (small) tensors, and each Linear is a ``StreamedLinear`` that reads its weight
one block of output rows at a time while it computes, so no weight is ever held whole. Compute is float32 from the
stored weights (what the official LLaMA-PRepBN evaluation runs).

Inputs: ``sequences`` seeded random sequences of ``seq_len`` token ids, embedded with each side's own
``embed_tokens`` rows (read row by row). Two chains run side by side::

    reference  h[i+1] = layer_i(h[i])          original layer: RepBN norms in eval, unfolded projections
    candidate  g[i+1] = fused_i(g[i])          fused layer: norms gone, folded projections with their biases

Check ``model.layers.i`` compares ``fused_i(h[i])`` with ``layer_i(h[i])``: the same input, so it measures that
layer's own fold, not the error carried from earlier layers. Check ``logits`` compares ``lm_head(norm(h[L]))``
with the fused ``lm_head(g[L])``: the whole model end to end, with next-token top-1 agreement at every position.
Tolerances are DESIGN.md section 5's for the checkpoint dtype (float16 1e-3).

Memory: one block of one weight (``block_elements`` float32 values, 16 MiB by default) plus the activations
``(sequences, seq_len, intermediate_size)`` in float32, besides torch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from slabconv.errors import InputError, UnsupportedModelError, UsageError
from slabconv.load import hf
from slabconv.verify.policy import default_rtol
from slabconv.verify.results import Comparison, IntegrityCheck, Verification, compare

Progress = Callable[[str], None]

DEFAULT_SEQUENCES = 2
DEFAULT_SEQ_LEN = 32


def _no_progress(message: str) -> None:
    return None


class StreamedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` read from the shards one block of output rows at a time, in float32.

    Args:
        shards: the folder's reader.
        name: the Linear's state_dict prefix (``model.layers.3.mlp.up_proj``); ``<name>.bias`` is used when the
            folder has it (a fold created it).
    """

    def __init__(self, shards: hf.LazyShards, name: str):
        super().__init__()
        self.shards, self.name = shards, name
        self.has_bias = f"{name}.bias" in shards.weight_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., in_features) float32 -> (..., out_features) float32."""
        key = f"{self.name}.weight"
        parts = [F.linear(x, block.float()) for block in self.shards.row_blocks(key, self.shards.shape(key))]
        y = torch.cat(parts, dim=-1)
        if self.has_bias:
            y = y + self.shards.get(f"{self.name}.bias").float()
        return y


@dataclass
class _Side:
    """One folder: its reader, every tensor's (dtype, shape) from the headers, its norm layout (``linearnorm``,
    ``repbn`` or ``identity`` once folded), and the dtype name of its weights."""

    path: Path
    shards: hf.LazyShards
    specs: dict[str, tuple[torch.dtype, list[int]]]
    layout: str
    dtype: str


def _open_side(folder: Path, block_elements: int) -> _Side:
    from slabconv.zoo.llama import norm_layout

    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder; layer-by-layer verification reads Hugging Face style folders")
    shards = hf.LazyShards.open(folder, block_elements)
    if "model.embed_tokens.weight" not in shards.weight_map or "lm_head.weight" not in shards.weight_map:
        raise UnsupportedModelError(
            f"{folder}: layer-by-layer verification supports LLaMA-layout folders only (model.embed_tokens, lm_head)"
        )
    layout = norm_layout(shards.weight_map, "model.layers.0.input_layernorm") or "identity"  # type: ignore[arg-type]
    specs = shards.specs()
    return _Side(folder, shards, specs, layout, str(specs["lm_head.weight"][0]).removeprefix("torch."))


def _norm(side: _Side, prefix: str, eps: float, hidden: int) -> nn.Module:
    """The norm at ``prefix`` (``model.layers.0.input_layernorm``), loaded strictly from its tensors, float32."""
    from slabconv.zoo.llama import norm_factory

    module = norm_factory(side.layout, eps)(hidden)
    if side.layout == "identity":
        return module
    state = {k[len(prefix) + 1 :]: side.shards.get(k) for k in side.shards.weight_map if k.startswith(prefix + ".")}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise InputError(f"{side.path}: the norm {prefix} does not fit the {side.layout} layout ({err})") from None
    return module.float().eval()


def _layer(side: _Side, cfg: Any, i: int) -> nn.Module:
    """Decoder layer ``i`` of one side: built on the meta device, Linears streamed, norms real."""
    from slabconv.zoo.llama import LlamaDecoderLayer, norm_factory

    prefix = f"model.layers.{i}."
    with torch.device("meta"):
        layer = LlamaDecoderLayer(cfg, norm_factory("identity"), persistent_rope=False)
    for owner_name, owner in list(layer.named_modules()):
        for child_name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{owner_name}.{child_name}" if owner_name else child_name
                setattr(owner, child_name, StreamedLinear(side.shards, prefix + full))
    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(layer, name, _norm(side, prefix + name, cfg.rms_norm_eps, cfg.hidden_size))
    return layer.eval()


def _embed(side: _Side, ids: torch.Tensor) -> torch.Tensor:
    """``embed_tokens`` rows of ``ids`` (B, T) -> (B, T, C) float32, reading only the rows used."""
    key = "model.embed_tokens.weight"
    used = sorted({int(t) for t in ids.reshape(-1)})
    table = torch.cat([side.shards.rows(key, t, t + 1).float() for t in used])
    lookup = {t: j for j, t in enumerate(used)}
    return table[torch.tensor([[lookup[int(t)] for t in row] for row in ids])]


def _config(side: _Side, config: dict[str, Any]) -> Any:
    from slabconv.zoo.llama import llama_config

    meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in side.specs.items()}
    return llama_config(meta, config)  # type: ignore[arg-type]  # shapes are all it reads


def verify_folders(
    reference: Path | str,
    candidate: Path | str,
    *,
    sequences: int = DEFAULT_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    block_elements: int = 1 << 22,
    progress: Progress = _no_progress,
) -> Verification:
    """Compare two LLaMA-PRepBN folders (sharded or single safetensors) decoder layer by decoder layer.

    Args:
        reference: the original folder (RepBN norms).
        candidate: the folded folder (or any folder of the same model; each side runs with its own norms).
        sequences, seq_len: the inputs: seeded random token ids ``(sequences, seq_len)`` (seq_len capped by
            ``max_position_embeddings``).
        seed: seed of the token ids.
        rtol: relative tolerance (default by the reference's dtype, DESIGN.md section 5); atol also accepted.
        block_elements: elements per weight block read (memory bound).
        progress: called once per layer.

    Returns:
        A ``Verification``: one ``Comparison`` per decoder layer (``model.layers.<i>``, shape ``(sequences,
        seq_len, hidden_size)``) and one for the logits (``(sequences, seq_len, vocab_size)``, top-1 at every
        position); integrity: both folders' tensor lists agree (the candidate has no tensor the reference lacks,
        besides biases created by folds).

    Raises:
        InputError, UnsupportedModelError: not LLaMA-layout folders, different shapes or layer counts.
        UsageError: fewer than one sequence or token.
    """
    if sequences < 1 or seq_len < 1:
        raise UsageError(f"--samples must be at least 1 (got {sequences}); seq_len too (got {seq_len})")
    ref, cand = _open_side(Path(reference), block_elements), _open_side(Path(candidate), block_elements)
    hf.return_freed_blocks_to_the_os()
    config = hf.read_hf_config(ref.path)
    cfg = _config(ref, config)
    if _config(cand, config) != cfg:
        raise InputError(f"{reference} and {candidate} have different sizes; they are not the same model")
    tol = default_rtol(ref.dtype, rtol)
    t = max(1, min(seq_len, cfg.max_position_embeddings))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (sequences, t), generator=gen)
    from slabconv.zoo.llama import rope_cos_sin

    cos, sin = rope_cos_sin(t, cfg.head_dim, cfg.rope_theta, torch.float32)
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    checks: list[Comparison] = []
    with torch.no_grad():
        h, g = _embed(ref, ids), _embed(cand, ids)
        for i in range(cfg.num_hidden_layers):
            progress(f"decoder layer {i + 1}/{cfg.num_hidden_layers}")
            h_next = _layer(ref, cfg, i)(h, cos, sin, mask)
            both = _layer(cand, cfg, i)(torch.cat([h, g]), cos, sin, mask)
            own, g = both[:sequences], both[sequences:]
            checks.append(compare(f"model.layers.{i} @ pytorch float32", h_next.numpy(), own.numpy(), tol, atol))
            h = h_next
        progress("final norm and lm_head")
        ref_logits = StreamedLinear(ref.shards, "lm_head")(
            _norm(ref, "model.norm", cfg.rms_norm_eps, cfg.hidden_size)(h)
        )
        cand_logits = StreamedLinear(cand.shards, "lm_head")(
            _norm(cand, "model.norm", cfg.rms_norm_eps, cfg.hidden_size)(g)
        )
        checks.append(
            compare("logits @ pytorch float32", ref_logits.numpy(), cand_logits.numpy(), tol, atol, token_logits=True)
        )
    return Verification(
        checks,
        [_keys_check(ref, cand)],
        runtime=f"pytorch {torch.__version__} float32, one decoder layer at a time",
        inputs=f"{sequences} random token sequences of length {t}, seed {seed}",
        inputs_sha256=_sha256(ids.numpy()),
    )


def _keys_check(ref: _Side, cand: _Side) -> IntegrityCheck:
    """Every candidate tensor is a reference tensor, or a bias beside a reference weight (created by a fold)."""
    extra = [
        k
        for k in cand.shards.weight_map
        if k not in ref.shards.weight_map
        and not (k.endswith(".bias") and k.removesuffix(".bias") + ".weight" in ref.shards.weight_map)
    ]
    name = f"tensor names {cand.path.name} within {ref.path.name}"
    if extra:
        return IntegrityCheck(name, False, f"{len(extra)} tensors the reference lacks, first {extra[0]!r}")
    return IntegrityCheck(name, True, f"{len(cand.shards.weight_map)} tensors, all known to the reference")


def _sha256(array: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
