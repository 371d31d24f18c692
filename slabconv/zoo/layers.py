"""Pieces every zoo family shares: the MLP, the norm factories and key-layout test, simplified linear attention
(SLA), and reading the official yacs config.

Facts from github xinghaochen/SLAB ``classification/models`` (written here from them; no code copied):

- Every family's MLP is ``fc1 -> GELU -> fc2`` (keys ``mlp.fc1``, ``mlp.fc2``); dropout is 0 in eval.
- A norm is either a bare ``RepBN`` (``bn.*``, ``alpha``) or ``LinearNorm(norm1=LayerNorm, norm2=RepBN)``
  (``norm1.weight``/``norm1.bias`` of the LayerNorm, ``norm2.bn.*``, ``norm2.alpha``, buffers ``warm``, ``iter``,
  ``total_step``). The LayerNorm eps is 1e-6 in ``deit.py``, ``slab_deit.py`` and ``slab_pvt.py``
  (``partial(nn.LayerNorm, eps=1e-6)``) and PyTorch's default 1e-5 in ``swin_transformer.py``,
  ``slab_swin.py`` and ``slab_cswin.py``; in eval only the RepBN branch runs, so it does not change outputs.
  The BatchNorm eps is ``BatchNorm1d``'s default 1e-5 everywhere.
- Simplified linear attention (``SimplifiedLinearAttention`` in ``slab_deit.py``, ``slab_swin.py``,
  ``slab_pvt.py``, ``slab_cswin.py``; SLAB paper Sec. 5): ReLU kernel on q and on ``k + positional_encoding``,
  per head ``out_i = q_i (Σ_j k_j^T v_j) / (q_i · Σ_j k_j + 1e-6)``, plus a depthwise ``kernel_size``-square
  conv (``dwc``, ``head_dim`` channels, zero padding ``k // 2``) over the head's values laid out as an image.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.norms import LinearNorm, RepBN

NormFactory = Callable[[int], nn.Module]
StateDictLike = Mapping[str, torch.Tensor]


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` on the last axis; keys ``fc1``, ``fc2``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block on tokens ``(B, N, C)``: ``x + attn(norm1(x), *sizes)``, then
    ``x + mlp(norm2(x))``; keys ``norm1``, ``attn``, ``norm2``, ``mlp.{fc1,fc2}`` (the official DeiT, SLAB-DeiT and
    PVT blocks, which differ only in ``attn``). ``sizes``: what ``attn`` reads beside the tokens (PVT's map height
    and width)."""

    def __init__(self, dim: int, attn: nn.Module, mlp_hidden: int, norm_layer: NormFactory):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, *sizes: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), *sizes)
        return x + self.mlp(self.norm2(x))


def init_linears(model: nn.Module) -> None:
    """The official models' Linear initialisation: weights truncated-normal with std 0.02, biases 0."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def norm_factory(layout: str, eps: float = 1e-5, ln_eps: float = 1e-6) -> NormFactory:
    """The norm constructor for a key layout: ``repbn``, ``linearnorm`` or ``identity`` (the norm-free bound).

    Args:
        layout: ``repbn`` (bare ``RepBN``), ``linearnorm`` (``LinearNorm(norm1=LayerNorm, norm2=RepBN)``) or
            ``identity`` (every norm an ``nn.Identity``).
        eps: the BatchNorm eps (1e-5 in every official vision model).
        ln_eps: the LayerNorm eps of the progressive branch (1e-6 DeiT/PVT, 1e-5 Swin/CSWin).
    """
    if layout == "repbn":
        return partial(RepBN, eps=eps)
    if layout == "linearnorm":
        return partial(LinearNorm, norm1=partial(nn.LayerNorm, eps=ln_eps), norm2=partial(RepBN, eps=eps))
    if layout == "identity":
        return lambda dim: nn.Identity()
    raise ValueError(f"unknown norm layout {layout!r}")


def norm_layout(state_dict: Mapping[str, Any], prefix: str) -> str | None:
    """``linearnorm`` / ``repbn`` from the keys under ``prefix`` (e.g. ``blocks.0.norm1``), else None. Reads the
    keys only (a state_dict or a header's key -> spec mapping)."""
    if f"{prefix}.norm2.bn.running_mean" in state_dict:
        return "linearnorm"
    if f"{prefix}.bn.running_mean" in state_dict:
        return "repbn"
    return None


def checkpoint_norm(state_dict: Mapping[str, Any], prefix: str, what: str, ln_eps: float) -> NormFactory:
    """The norm constructor of the layout the keys under ``prefix`` hold (``norm_layout``; ``ln_eps`` for
    LinearNorm's LayerNorm), for the family ``what`` building the checkpoint's own norms.

    Raises:
        UnsupportedModelError: no RepBN / LinearNorm keys under ``prefix`` (a plain LayerNorm model).
    """
    layout = norm_layout(state_dict, prefix)
    if layout is None:
        raise UnsupportedModelError(f"{what}: no RepBN / LinearNorm keys under {prefix}")
    return norm_factory(layout, ln_eps=ln_eps)


def cfg_get(config: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    """``config[path[0]][path[1]]...`` in the saved (yacs) training config, or ``default`` when absent."""
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, N, heads * d) -> (B * heads, N, d)``, batch-major (einops ``b n (h c) -> (b h) n c``)."""
    _, n, c = x.shape
    return x.reshape(-1, n, num_heads, c // num_heads).transpose(1, 2).reshape(-1, n, c // num_heads)


def merge_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B * heads, N, d) -> (B, N, heads * d)``, the inverse of ``split_heads``."""
    _, n, d = x.shape
    return x.reshape(-1, num_heads, n, d).transpose(1, 2).reshape(-1, n, num_heads * d)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The SLA kernel on one head per batch row: ``out = q (k^T v) / (q · Σk + 1e-6)``.

    Args:
        q: ``(B', i, c)``, k: ``(B', j, c)``, v: ``(B', j, d)``; q and k already through the ReLU kernel.

    Returns:
        ``(B', i, d)``.

    The shape branch (the official code's ``if i * j * (c + d) > c * d * (i + j)``): both orders compute the same
    product, ``q (k^T v)`` costs ``c·d·(i + j)`` multiplies a row and ``(q k^T) v`` costs ``i·j·(c + d)``; the
    cheaper one is taken. The test reads only token and head-channel counts, never the batch, so it is decided
    once when the model is traced at a fixed resolution and the exported graph keeps a dynamic batch axis; a
    different resolution needs a new export (``--image-size``).
    """
    i, j, c, d = q.shape[-2], k.shape[-2], k.shape[-1], v.shape[-1]
    z = 1.0 / ((q @ k.sum(dim=1).unsqueeze(-1)).squeeze(-1) + 1e-6)  # (B', i)
    if i * j * (c + d) > c * d * (i + j):
        out = q @ (k.transpose(1, 2) @ v)
    else:
        out = (q @ k.transpose(1, 2)) @ v
    return out * z.unsqueeze(-1)


def sla(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """SLA (the module docstring) on tokens ``(B, N, C)``: ``linear_attention`` per head of ``relu(q)`` and
    ``relu(k + attn.positional_encoding)``, in float32 where ``attn.float32_core``, plus ``attn.dwc`` over each
    head's values as a ``grid = (height, width)`` map. Returns ``(B * attn.num_heads, N, C / attn.num_heads)``."""
    q, k = torch.relu(q), torch.relu(k + attn.positional_encoding)
    q, k, v = (split_heads(t, attn.num_heads) for t in (q, k, v))
    if getattr(attn, "float32_core", False):
        out = linear_attention(q.float(), k.float(), v.float()).to(v.dtype)
    else:
        out = linear_attention(q, k, v)
    return out + map_to_tokens(attn.dwc(tokens_to_map(v, *grid)))


def tokens_to_map(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, height * width, C) -> (B, C, height, width)``, tokens in row-major order."""
    return x.transpose(1, 2).reshape(-1, x.shape[-1], height, width)


def map_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W) -> (B, H * W, C)``."""
    return x.flatten(2).transpose(1, 2)


class PatchEmbed(nn.Module):
    """Image ``(B, in_chans, H, W) -> (B, H/p * W/p, C)`` tokens by a stride-p conv ``proj``, then ``norm`` (DeiT has
    none, Swin as its config says, PVT always); keys ``proj``, ``norm``."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, norm_layer: NormFactory | None = None):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = norm_layer(embed_dim) if norm_layer is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = map_to_tokens(self.proj(x))
        return self.norm(x) if self.norm is not None else x


class SimplifiedLinearAttention(nn.Module):
    """SLA over all ``num_tokens`` tokens of its input, as in SLAB-DeiT and the SLAB-Swin windows.

    Keys: ``qkv`` (``C -> 3C``), ``proj``, ``dwc`` (depthwise ``kernel_size`` conv on ``C / heads`` channels),
    ``positional_encoding`` ``(1, num_tokens, C)``. Input and output ``(B, num_tokens, C)``; the tokens must
    form a square (the ``dwc`` map is ``sqrt(num_tokens)`` on a side, as the official code takes it).

    ``float32_core``: the official DeiT and Swin versions compute the kernel product in float32 with autocast
    off; here q, k, v are cast to float32 for that product and the result is cast back to the input dtype
    (the ``dwc`` branch runs in the model's dtype). For float32 models this is the official computation.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_tokens: int,
        kernel_size: int = 5,
        qkv_bias: bool = True,
        float32_core: bool = True,
    ):
        super().__init__()
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(f"simplified linear attention needs a square token grid, got {num_tokens} tokens")
        self.num_heads = num_heads
        self.side = side
        self.float32_core = float32_core
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.dwc = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        self.positional_encoding = nn.Parameter(torch.zeros(1, num_tokens, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` is accepted and ignored, as in the official SLA (shifted windows need no mask here)."""
        _, n, c = x.shape
        q, k, v = self.qkv(x).reshape(-1, n, 3, c).permute(2, 0, 1, 3).unbind(0)
        return self.proj(merge_heads(sla(self, q, k, v, (self.side, self.side)), self.num_heads))


def key_indices(state_dict: StateDictLike, pattern: str) -> list[tuple[int, ...]]:
    """The sorted integer groups of every key that fully matches ``pattern`` (e.g. ``r"blocks\\.(\\d+)\\.mlp..."``)."""
    regex = re.compile(pattern)
    found = {tuple(int(g) for g in m.groups()) for key in state_dict if (m := regex.fullmatch(key))}
    return sorted(found)


def depths_of(state_dict: StateDictLike, pattern: str) -> tuple[int, ...]:
    """Blocks per stage from a two-group pattern ``(stage, block)``; stages numbered from their smallest index."""
    pairs = key_indices(state_dict, pattern)
    if not pairs:
        return ()
    stages = sorted({s for s, _ in pairs})
    return tuple(1 + max(b for s2, b in pairs if s2 == s) for s in stages)
