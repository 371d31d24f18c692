"""DeiT with PRepBN norms, in the official SLAB key layout.

Paper: SLAB (Guo et al., ICML 2024), DeiT-PRepBN rows of Table 2; DeiT: Touvron et al., ICML 2021.
Layout source: github xinghaochen/SLAB ``classification/models/deit.py`` (``VisionTransformer``,
``deit_tiny_patch16_224_repbn`` with bare ``RepBN`` norms, ``deit_small_patch16_224_repbn`` with
``LinearNorm(norm1=LayerNorm(eps=1e-6), norm2=RepBN)``). Written here from those facts; no code copied.

Keys: ``patch_embed.proj.{weight,bias}``, ``cls_token (1, 1, C)``, ``pos_embed (1, 1 + N, C)``,
``blocks.{i}.norm1``, ``blocks.{i}.attn.{qkv,proj}``, ``blocks.{i}.norm2``, ``blocks.{i}.mlp.{fc1,fc2}``,
``norm``, ``head``. Each norm is ``RepBN`` (``norm1.bn.*``, ``norm1.alpha``) or ``LinearNorm``
(``norm1.norm1.*`` LayerNorm, ``norm1.norm2.bn.*``, ``norm1.norm2.alpha``, ``norm1.{warm,iter,total_step}``).
Where each norm feeds: norm1 -> attn.qkv, norm2 -> mlp.fc1, the final norm -> ``x[:, 0]`` -> head.

Official names: release files ``deit_tiny_prepbn.pth`` / ``deit_small_prepbn.pth``, README ``deit_t_prepbn`` /
``deit_s_prepbn``, configs ``cfgs/deit_{t,s}_prepbn.yaml`` with ``MODEL.NAME`` the registered timm names above.
The ``*_patch16_224_linear_repbn`` functions are SLAB-DeiT (``slabconv.zoo.slab_deit``), not these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slabconv.zoo.layers import (
    Block,
    Mlp,
    NormFactory,
    PatchEmbed,
    cfg_get,
    init_linears,
    key_indices,
    norm_factory,
    norm_layout,
)
from slabconv.zoo.norms import RepBN
from slabconv.zoo.registry import (
    LayoutError,
    Preset,
    StateDict,
    register_family,
    resolve_image_size,
    square_input,
)

__all__ = ["Attention", "Block", "Mlp", "PatchEmbed", "VisionTransformer", "norm_factory", "norm_layout", "vit_hparams"]


class Attention(nn.Module):
    """Multi-head self-attention on ``(B, N, C)``; ``qkv`` is one Linear ``C -> 3C``."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class VisionTransformer(nn.Module):
    """DeiT-style ViT: patch embedding, cls token, ``depth`` pre-norm blocks, final norm, linear head.

    Input: float ``(B, in_chans, img_size, img_size)``. Output: logits ``(B, num_classes)``.
    ``global_pool='token'`` reads the cls token (DeiT); ``'avg'`` averages all tokens.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        norm_layer: NormFactory = RepBN,
        global_pool: str = "token",
    ):
        super().__init__()
        self.global_pool = global_pool
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // patch_size) ** 2 + 1, embed_dim))
        hidden = int(embed_dim * mlp_ratio)
        self.blocks = nn.Sequential(
            *[Block(embed_dim, Attention(embed_dim, num_heads, qkv_bias), hidden, norm_layer) for _ in range(depth)]
        )
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        x = self.blocks(x)
        x = self.norm(x)
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        return self.head(x)


def vit_hparams(state_dict: StateDict, what: str = "DeiT", cls_slot: bool = True) -> dict[str, Any]:
    """Read the ViT hyperparameters that the weights determine: embed_dim, depth, patch, image size, ...

    Args:
        what: the family named in the error (``SLAB-DeiT`` reads its weights here too).
        cls_slot: ``pos_embed`` has a slot for the cls token (DeiT; not SLAB-DeiT).

    Raises:
        UnsupportedModelError: a key the DeiT layout needs is missing.
    """
    try:
        proj = state_dict["patch_embed.proj.weight"]  # (C, in_chans, p, p)
        pos = state_dict["pos_embed"]  # (1, cls_slot + N, C)
        head = state_dict["head.weight"]  # (num_classes, C)
        fc1 = state_dict["blocks.0.mlp.fc1.weight"]  # (hidden, C)
    except KeyError as err:
        raise LayoutError(f"not a {what}-layout checkpoint: key {err.args[0]!r} is missing") from None
    embed_dim, in_chans, patch = proj.shape[0], proj.shape[1], proj.shape[2]
    return {
        "embed_dim": embed_dim,
        "depth": len(key_indices(state_dict, r"blocks\.(\d+)\.attn\.qkv\.weight")),
        "patch_size": patch,
        "in_chans": in_chans,
        "img_size": math.isqrt(pos.shape[1] - cls_slot) * patch,
        "num_classes": head.shape[0],
        "mlp_ratio": fc1.shape[0] / embed_dim,
        "qkv_bias": "blocks.0.attn.qkv.bias" in state_dict,
    }


def signature(sd: StateDict) -> tuple[int, int] | None:
    """``(embed_dim, depth)`` of DeiT-layout weights with PRepBN norms; None for anything else (SLAB-DeiT's
    simplified linear attention, ``blocks.0.attn.dwc``, belongs to ``slabconv.zoo.slab_deit``)."""
    if "cls_token" not in sd or "blocks.0.attn.qkv.weight" not in sd or "patch_embed.proj.weight" not in sd:
        return None
    if norm_layout(sd, "blocks.0.norm1") is None or "blocks.0.attn.dwc.weight" in sd:
        return None
    hp = vit_hparams(sd)
    return (hp["embed_dim"], hp["depth"])


def _num_heads(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> int:
    """Config ``MODEL.VIT.NUM_HEADS``, else the preset's, else DeiT's convention of 64 channels a head."""
    heads = cfg_get(config, "MODEL", "VIT", "NUM_HEADS")
    if heads is not None:
        return int(heads)
    if "num_heads" in preset.defaults:
        return int(preset.defaults["num_heads"])
    return max(1, vit_hparams(sd)["embed_dim"] // 64)


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    hp = vit_hparams(sd)
    resolve_image_size(hp["img_size"], config, resizable=False, what=preset.name)
    found = norm_layout(sd, "blocks.0.norm1") or preset.defaults["layout"]
    return VisionTransformer(
        **hp, num_heads=_num_heads(preset, sd, config), norm_layer=norm_factory(found if norm == "checkpoint" else norm)
    )


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    return square_input(vit_hparams(sd), config, preset.name)


_SOURCE = "xinghaochen/SLAB classification/models/deit.py"

PRESETS = [
    Preset(
        "deit_tiny_prepbn",
        signature=(192, 12),
        defaults={"num_heads": 3, "layout": "repbn"},
        source=f"{_SOURCE} deit_tiny_patch16_224_repbn",
        image_size=224,
    ),
    Preset(
        "deit_small_prepbn",
        signature=(384, 12),
        defaults={"num_heads": 6, "layout": "linearnorm"},
        source=f"{_SOURCE} deit_small_patch16_224_repbn",
        image_size=224,
    ),
    Preset(
        "deit_prepbn",
        signature=None,
        defaults={"layout": "linearnorm"},
        source=f"{_SOURCE} VisionTransformer (any size; heads from config MODEL.VIT.NUM_HEADS or embed_dim / 64)",
    ),
]

register_family("deit", PRESETS, signature=signature, build=build, input_shape=input_shape)
