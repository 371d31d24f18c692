"""SLAB-DeiT: DeiT with simplified linear attention (SLA), PRepBN norms and a mean-pooled head.

Paper: SLAB (Guo et al., ICML 2024), SLAB-DeiT rows of Table 2 / Sec. 5; DeiT: Touvron et al., ICML 2021.
Layout source: github xinghaochen/SLAB @ f58db00 ``classification/models/slab_deit.py`` (``VisionTransformer``,
``Attention`` = SLA, registered ``deit_tiny_patch16_224_linear_repbn`` / ``deit_small_patch16_224_linear_repbn``
with ``LinearNorm(norm1=LayerNorm(eps=1e-6), norm2=RepBN, step=60000)``); configs ``cfgs/slab_deit_{t,s}.yaml``
(``MODEL.TYPE: deits``); release files ``slab_deit_tiny.pth`` / ``slab_deit_small.pth``. Written here from
those facts; no code copied.

Keys: ``patch_embed.proj``, ``cls_token (1, 1, C)`` (created but never read by the forward pass),
``pos_embed (1, N, C)`` (no cls slot), ``blocks.{i}.norm1``, ``blocks.{i}.attn.{qkv, proj, dwc,
positional_encoding (1, N, C)}``, ``blocks.{i}.norm2``, ``blocks.{i}.mlp.{fc1, fc2}``, ``norm``, ``head``.
The official ``positional_encoding`` is ``14 * 14`` tokens (224 / 16); here it is the patch grid's token count,
which is the same at 224 and lets small instances use the same code.

Where each norm feeds: norm1 -> attn.qkv; norm2 -> mlp.fc1; the final norm -> mean over tokens
(``AdaptiveAvgPool1d`` on ``x.transpose(1, 2)``) -> head. All three fold forward.

The resolution is fixed by ``pos_embed`` and ``positional_encoding``; the SLA shape branch
(``slabconv.zoo.layers.linear_attention``) is decided at trace time and does not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slabconv.zoo.deit import vit_hparams
from slabconv.zoo.layers import (
    Block,
    NormFactory,
    PatchEmbed,
    SimplifiedLinearAttention,
    checkpoint_norm,
    init_linears,
    key_indices,
    norm_factory,
    norm_layout,
)
from slabconv.zoo.registry import (
    LayoutError,
    Preset,
    StateDict,
    register_family,
    resolve_image_size,
    square_input,
)


class SlabVisionTransformer(nn.Module):
    """SLAB-DeiT. Input ``(B, in_chans, img_size, img_size)``; output logits ``(B, num_classes)``.

    ``keep_cls_token``: the official model holds a ``cls_token`` parameter its forward pass never reads; the
    norm-free bound built from fused weights (which keep only what the graph reads) leaves it out.
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
        kernel_size: int = 5,
        norm_layer: NormFactory | None = None,
        keep_cls_token: bool = True,
    ):
        super().__init__()
        norm_layer = norm_layer or norm_factory("linearnorm", ln_eps=1e-6)
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        num_tokens = (img_size // patch_size) ** 2
        if keep_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        hidden = int(embed_dim * mlp_ratio)
        sla = (embed_dim, num_heads, num_tokens, kernel_size, qkv_bias)  # float32_core, as the official code
        self.blocks = nn.Sequential(
            *[Block(embed_dim, SimplifiedLinearAttention(*sla), hidden, norm_layer) for _ in range(depth)]
        )
        self.norm = norm_layer(embed_dim)
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed
        x = self.norm(self.blocks(x))
        x = self.avgpool(x.transpose(1, 2)).flatten(1)
        return self.head(x)


def hparams(sd: StateDict) -> dict[str, Any]:
    """The SLAB-DeiT hyperparameters the weights determine (``deit.vit_hparams``; heads from the ``dwc`` channel
    count)."""
    hp = vit_hparams(sd, "SLAB-DeiT", cls_slot=False)
    dwc = "blocks.0.attn.dwc.weight"
    if dwc not in sd:
        raise LayoutError(f"not a SLAB-DeiT-layout checkpoint: key {dwc!r} is missing")
    head_dim, _, kernel, _ = sd[dwc].shape
    return {**hp, "num_heads": hp["embed_dim"] // head_dim, "kernel_size": kernel}


def signature(sd: StateDict) -> tuple[int, int] | None:
    """``(embed_dim, depth)`` of SLAB-DeiT weights (SLA ``dwc`` in the blocks, no cls slot), else None."""
    needed = ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.dwc.weight", "blocks.0.attn.qkv.weight")
    if any(k not in sd for k in needed) or norm_layout(sd, "blocks.0.norm1") is None:
        return None
    return int(sd["patch_embed.proj.weight"].shape[0]), len(key_indices(sd, r"blocks\.(\d+)\.attn\.qkv\.weight"))


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    hp = hparams(sd)
    resolve_image_size(hp["img_size"], config, resizable=False, what=preset.name)
    if norm == "checkpoint":
        return SlabVisionTransformer(**hp, norm_layer=checkpoint_norm(sd, "blocks.0.norm1", preset.name, 1e-6))
    return SlabVisionTransformer(**hp, norm_layer=norm_factory(norm), keep_cls_token="cls_token" in sd)


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    return square_input(hparams(sd), config, preset.name)


_SOURCE = "xinghaochen/SLAB classification/models/slab_deit.py"

PRESETS = [
    Preset(
        "slab_deit_tiny",
        signature=(192, 12),
        source=f"{_SOURCE} deit_tiny_patch16_224_linear_repbn",
        image_size=224,
    ),
    Preset(
        "slab_deit_small",
        signature=(384, 12),
        source=f"{_SOURCE} deit_small_patch16_224_linear_repbn",
        image_size=224,
    ),
    Preset(
        "slab_deit",
        signature=None,
        source=f"{_SOURCE} VisionTransformer (any size; heads from the dwc channel count)",
    ),
]

register_family("slab_deit", PRESETS, signature=signature, build=build, input_shape=input_shape)
