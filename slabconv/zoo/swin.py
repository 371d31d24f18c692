"""Swin-PRepBN and SLAB-Swin: Swin Transformer with PRepBN norms, shifted-window or simplified linear attention.

Papers: SLAB (Guo et al., ICML 2024), Swin-PRepBN / SLAB-Swin rows of Tables 2-3; Swin: Liu et al., ICCV 2021.
Layout source: github xinghaochen/SLAB @ f58db00:

- ``classification/models/swin_transformer.py`` ``SwinTransformer`` (``norm_layer=RepBN``: bare RepBN keys),
  config ``cfgs/swin_t_prepbn.yaml`` (``MODEL.NAME: swin_tiny_repbn``, window 7), release ``swin_tiny_prepbn.pth``.
- ``classification/models/slab_swin.py`` ``SlabSwinTransformer`` (``LinearNorm(norm1=nn.LayerNorm,
  norm2=RepBN, step=60000)``; ``MODEL.LA.ATTN_TYPE`` ``LLSS``: SLA in stages 1-2, window attention in 3-4;
  ``WINDOW_SIZE: 56``; window-attention stages use 7 when the window size is <= 56, else 12), configs
  ``cfgs/slab_swin_{t,s,b}.yaml`` (``MODEL.NAME: slab_swin_{tiny,small,base}_patch4_224``), releases
  ``slab_swin_tiny.pth``, ``slab_swin_small.pth``.
- Zero padding to a multiple of the window (and of 2 before patch merging) follows the official detection
  backbones ``detection/mmdet_custom/swin_transformer_{prepbn,slab}.py``.

Written here from those facts; no code copied.

Keys: ``patch_embed.proj``, ``patch_embed.norm``, (``absolute_pos_embed`` when ``ape``),
``layers.{i}.blocks.{j}.{norm1, norm2, mlp.fc1, mlp.fc2, attn.qkv, attn.proj}``; window attention adds
``attn.relative_position_bias_table ((2w-1)^2, heads)`` and the buffer ``attn.relative_position_index (w^2, w^2)``;
SLA adds ``attn.dwc`` and ``attn.positional_encoding (1, w^2, C)``; a shifted block holds the buffer
``attn_mask (nW, w^2, w^2)``; ``layers.{i}.downsample.{norm (4C), reduction (4C -> 2C, no bias)}``; ``norm``;
``head``. A block whose stage resolution is <= its window gets window = resolution and no shift (as official).

Where each norm feeds:
- ``norm1`` -> view (B, H, W, C) -> [zero pad] -> roll -> window partition -> ``attn.qkv``. Folds forward into
  qkv, except when the stage needs padding: then it stays a per-channel affine in front of the pad
  (``zero-padding-after-norm``).
- ``norm2`` -> ``mlp.fc1``; ``downsample.norm`` (after the 2x2 gather) -> ``downsample.reduction``, which gains a
  bias.
- ``patch_embed.norm`` follows the patch conv and feeds the residual stream: folded backward into
  ``patch_embed.proj`` (weight rows scaled by s, bias ``s * b + t``; the official merge code drops the
  ``alpha * conv_bias`` term; slabconv keeps it, so the fold is exact).
- the final ``norm`` -> mean over tokens -> ``head``.

Resolution: the checkpoint fixes the window sizes (bias tables / positional encodings) and the attention masks it
stores are for the training size (``DATA.IMG_SIZE``, 224). ``--image-size`` builds the same blocks for another
input side: each stage is zero-padded up to a multiple of its window (masks are computed for the padded map),
as the detection backbones do. At the training size nothing is padded and the outputs are the classification
model's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.layers import (
    Mlp,
    NormFactory,
    PatchEmbed,
    SimplifiedLinearAttention,
    cfg_get,
    checkpoint_norm,
    depths_of,
    init_linears,
    key_indices,
    norm_factory,
    norm_layout,
)
from slabconv.zoo.registry import LayoutError, Preset, StateDict, register_family, resolve_image_size

# --------------------------------------------------------------------------------------------- windows


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """``(B, H, W, C) -> (B * H/w * W/w, w, w, C)``, windows in row-major order; H and W multiples of w."""
    _, h, w, c = x.shape
    x = x.view(-1, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window, window, c)


def window_reverse(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """The inverse of ``window_partition``: ``(B * nW, w, w, C) -> (B, height, width, C)``."""
    c = windows.shape[-1]
    x = windows.view(-1, height // window, width // window, window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, height, width, c)


def shifted_window_mask(height: int, width: int, window: int, shift: int) -> torch.Tensor:
    """The additive attention mask of shifted windows, ``(nW, w^2, w^2)``: 0 where two tokens of a window came
    from the same region of the (padded) map before the cyclic shift, -100 elsewhere (the Swin convention)."""
    labels = torch.zeros(1, height, width, 1)
    bands = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    region = 0
    for rows in bands:
        for cols in bands:
            labels[:, rows, cols, :] = region
            region += 1
    flat = window_partition(labels, window).reshape(-1, window * window)
    diff = flat.unsqueeze(1) - flat.unsqueeze(2)
    return torch.where(diff != 0, torch.tensor(-100.0), torch.tensor(0.0))


def relative_position_index(window: int) -> torch.Tensor:
    """``(w^2, w^2)`` int64: the row of ``relative_position_bias_table`` for each (query, key) pair of a window."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


class WindowAttention(nn.Module):
    """Multi-head self attention inside each window with a learned relative position bias.

    Input ``(B * nW, w^2, C)``; ``mask`` ``(nW, w^2, w^2)`` (additive) or None. Keys: ``qkv``, ``proj``,
    ``relative_position_bias_table``, buffer ``relative_position_index``.
    """

    def __init__(self, dim: int, window: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.window = window
        self.scale = (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        index = self.get_buffer("relative_position_index")
        bias = self.relative_position_bias_table[index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(-1, nw, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


# --------------------------------------------------------------------------------------------- blocks


class SwinBlock(nn.Module):
    """``x + attn(windows(norm1(x)))``, then ``x + mlp(norm2(x))``, on tokens ``(B, H * W, C)``.

    Args:
        resolution: ``(H, W)`` of the tokens this block runs on.
        window, shift: the window side and cyclic shift (0: regular windows).
        attn_kind: ``S`` window attention, ``L`` simplified linear attention.
        mask_resolution: ``(H, W)`` the checkpoint's ``attn_mask`` buffer was made for (the training size), or
            None when the block keeps no such buffer (not shifted, or a norm-free bound whose weights lack it).
        persist_run_mask: keep the mask for ``resolution`` (when it differs from the stored one) in the
            state_dict as ``run_mask`` (the norm-free bound rebuilt from fused weights reads it from there).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        resolution: tuple[int, int],
        window: int,
        shift: int,
        mlp_ratio: float,
        qkv_bias: bool,
        norm_layer: NormFactory,
        attn_kind: str = "S",
        kernel_size: int = 5,
        mask_resolution: tuple[int, int] | None = None,
        persist_run_mask: bool = False,
    ):
        super().__init__()
        self.resolution = resolution
        self.window = window
        self.shift = shift
        self.norm1 = norm_layer(dim)
        self.attn: nn.Module
        if attn_kind == "L":
            self.attn = SimplifiedLinearAttention(dim, num_heads, window * window, kernel_size, qkv_bias)
        elif attn_kind == "S":
            self.attn = WindowAttention(dim, window, num_heads, qkv_bias)
        else:
            raise ValueError(f"attention kind must be 'S' or 'L', got {attn_kind!r}")
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        h, w = resolution
        self.padded = (h + (-h) % window, w + (-w) % window)
        self.mask_name: str | None = None
        if shift and mask_resolution is not None:
            mh, mw = mask_resolution
            stored = shifted_window_mask(mh + (-mh) % window, mw + (-mw) % window, window, shift)
            self.register_buffer("attn_mask", stored)
            self.mask_name = "attn_mask"
        if shift and attn_kind == "S" and (mask_resolution != resolution or self.mask_name is None):
            self.register_buffer("run_mask", shifted_window_mask(*self.padded, window, shift), persist_run_mask)
            self.mask_name = "run_mask"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h, w), (hp, wp), win, shift = self.resolution, self.padded, self.window, self.shift
        c = x.shape[-1]
        y = self.norm1(x).view(-1, h, w, c)
        if (hp, wp) != (h, w):
            y = F.pad(y, (0, 0, 0, wp - w, 0, hp - h))
        if shift:
            y = torch.roll(y, shifts=(-shift, -shift), dims=(1, 2))
        mask = getattr(self, self.mask_name) if self.mask_name else None
        windows = self.attn(window_partition(y, win).view(-1, win * win, c), mask)
        y = window_reverse(windows.view(-1, win, win, c), win, hp, wp)
        if shift:
            y = torch.roll(y, shifts=(shift, shift), dims=(1, 2))
        if (hp, wp) != (h, w):
            y = y[:, :h, :w, :]
        x = x + y.reshape(-1, h * w, c)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbourhood gather ``(B, H*W, C) -> (B, ceil(H/2)*ceil(W/2), 4C)``, ``norm``, ``reduction`` to 2C.

    Odd sides are zero-padded by one row/column first (detection backbone); the norm comes after the padding.
    ``reduction_bias``: the official layer has none; the norm-free bound of fused weights has the folded one.
    """

    def __init__(self, dim: int, resolution: tuple[int, int], norm_layer: NormFactory, reduction_bias: bool = False):
        super().__init__()
        self.resolution = resolution
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=reduction_bias)
        self.norm = norm_layer(4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.resolution
        c = x.shape[-1]
        x = x.view(-1, h, w, c)
        if h % 2 or w % 2:
            x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        x = x.reshape(-1, ((h + 1) // 2) * ((w + 1) // 2), 4 * c)
        return self.reduction(self.norm(x))


class BasicLayer(nn.Module):
    """One stage: ``blocks`` then the optional ``downsample``."""

    def __init__(self, blocks: list[SwinBlock], downsample: PatchMerging | None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.downsample(x) if self.downsample is not None else x


def stage_resolutions(side: int, stages: int) -> list[int]:
    """Token-grid side of each stage for a ``side`` x ``side`` patch grid: halved (rounded up) per stage."""
    out = [side]
    for _ in range(stages - 1):
        out.append((out[-1] + 1) // 2)
    return out


class SwinTransformer(nn.Module):
    """Swin (``swin_transformer.py``) and SLAB-Swin (``slab_swin.py``) with the official constructor arguments.

    Args:
        img_size: the training input side (fixes which blocks shift and the stored masks).
        run_img_size: the input side to run at (default ``img_size``); stages are zero-padded to their windows.
        attn_type: one letter a stage, ``S`` window attention, ``L`` SLA (``SSSS`` for Swin-PRepBN).
        window_rule: ``swin``: every block uses ``window_size``; ``slab``: ``S`` stages use 7 when
            ``window_size <= 56``, else 12 (``slab_swin.py`` ``BasicLayer``).
        mask_blocks: the ``(stage, block)`` pairs that keep the official ``attn_mask`` buffer; None: every
            shifted block (the official layout). A norm-free bound rebuilt from fused weights keeps those the
            fused weights hold. ``persist_run_masks``: see ``SwinBlock``.
        reduction_bias: give ``downsample.reduction`` a bias (the norm-free bound of fused weights).

    Input ``(B, in_chans, run_img_size, run_img_size)``; output logits ``(B, num_classes)``.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        norm_layer: NormFactory | None = None,
        ape: bool = False,
        patch_norm: bool = True,
        attn_type: str = "SSSS",
        kernel_size: int = 5,
        window_rule: str = "swin",
        run_img_size: int | None = None,
        mask_blocks: Collection[tuple[int, int]] | None = None,
        persist_run_masks: bool = False,
        reduction_bias: bool = False,
    ):
        super().__init__()
        norm_layer = norm_layer or norm_factory("repbn")
        run_img_size = run_img_size or img_size
        if img_size % patch_size or run_img_size % patch_size:
            raise ValueError(f"input sides {img_size}, {run_img_size} must be multiples of the patch {patch_size}")
        stages = len(depths)
        train_res = stage_resolutions(img_size // patch_size, stages)
        run_res = stage_resolutions(run_img_size // patch_size, stages)
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim, norm_layer if patch_norm else None)
        if ape:
            if run_img_size != img_size:
                raise ValueError("an absolute position embedding fixes the input size")
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, train_res[0] ** 2, embed_dim))
        self.layers = nn.ModuleList()
        for i in range(stages):
            dim = embed_dim * 2**i
            kind = attn_type[i]
            nominal = window_size
            if window_rule == "slab" and kind == "S":
                nominal = 7 if window_size <= 56 else 12
            blocks = []
            for j in range(depths[i]):
                window, shift = nominal, (0 if j % 2 == 0 else nominal // 2)
                if train_res[i] <= nominal:  # the official rule: the window covers the whole map, no shift
                    window, shift = train_res[i], 0
                blocks.append(
                    SwinBlock(
                        dim,
                        num_heads[i],
                        (run_res[i], run_res[i]),
                        window,
                        shift,
                        mlp_ratio,
                        qkv_bias,
                        norm_layer,
                        kind,
                        kernel_size,
                        mask_resolution=(
                            (train_res[i], train_res[i]) if mask_blocks is None or (i, j) in mask_blocks else None
                        ),
                        persist_run_mask=persist_run_masks,
                    )
                )
            down = None
            if i < stages - 1:
                down = PatchMerging(dim, (run_res[i], run_res[i]), norm_layer, reduction_bias)
            self.layers.append(BasicLayer(blocks, down))
        self.num_features = embed_dim * 2 ** (stages - 1)
        self.norm = norm_layer(self.num_features)
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(self.num_features, num_classes)
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        if hasattr(self, "absolute_pos_embed"):
            x = x + self.absolute_pos_embed
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(self.avgpool(x.transpose(1, 2)).flatten(1))


# --------------------------------------------------------------------------------------------- registry


_BLOCKS = r"layers\.(\d+)\.blocks\.(\d+)\.attn\.qkv\.weight"


def _attn_kinds(sd: StateDict, depths: tuple[int, ...]) -> str:
    kinds = ""
    for i, depth in enumerate(depths):
        found = {"L" if f"layers.{i}.blocks.{j}.attn.positional_encoding" in sd else "S" for j in range(depth)}
        if len(found) != 1:
            raise UnsupportedModelError(f"stage {i} mixes window and linear attention ('M' attention types)")
        kinds += found.pop()
    return kinds


def signature(sd: StateDict) -> tuple[int, tuple[int, ...], str] | None:
    """``(embed_dim, depths, attention kinds)`` of Swin-layout weights, else None."""
    if "patch_embed.proj.weight" not in sd or "layers.0.blocks.0.attn.qkv.weight" not in sd:
        return None
    if norm_layout(sd, "layers.0.blocks.0.norm1") is None:
        return None  # no PRepBN norms (e.g. a LayerNorm Swin): nothing to fold
    depths = depths_of(sd, _BLOCKS)
    try:
        kinds = _attn_kinds(sd, depths)
    except UnsupportedModelError:
        return None
    return int(sd["patch_embed.proj.weight"].shape[0]), depths, kinds


def hparams(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments of ``SwinTransformer`` from the weights, the saved config and the preset."""
    if "patch_embed.proj.weight" not in sd or "head.weight" not in sd:
        raise LayoutError(f"{preset.name}: not a Swin-layout checkpoint (patch_embed.proj / head missing)")
    embed_dim, in_chans, patch, _ = sd["patch_embed.proj.weight"].shape
    depths = depths_of(sd, _BLOCKS)
    kinds = _attn_kinds(sd, depths)
    heads = []
    for i in range(len(depths)):
        prefix = f"layers.{i}.blocks.0.attn"
        if f"{prefix}.relative_position_bias_table" in sd:
            heads.append(int(sd[f"{prefix}.relative_position_bias_table"].shape[1]))
        elif f"{prefix}.dwc.weight" in sd:
            heads.append(embed_dim * 2**i // int(sd[f"{prefix}.dwc.weight"].shape[0]))
        else:
            raise UnsupportedModelError(f"{preset.name}: no attention weights under {prefix}")
    sla = [i for i, k in enumerate(kinds) if k == "L"]
    default_window = preset.defaults.get("window_size")
    if default_window is None and sla:  # the first SLA window; any window >= that stage's side builds the same
        default_window = round(sd[f"layers.{sla[0]}.blocks.0.attn.positional_encoding"].shape[1] ** 0.5)
    elif default_window is None:
        default_window = round((sd["layers.0.blocks.0.attn.relative_position_bias_table"].shape[0] ** 0.5 + 1) / 2)
    slab = bool(sla) or cfg_get(config, "MODEL", "TYPE") == "SlabSwinTransformer" or preset.defaults.get("slab")
    return {
        "img_size": int(cfg_get(config, "DATA", "IMG_SIZE", default=preset.image_size or 224)),
        "patch_size": int(patch),
        "in_chans": int(in_chans),
        "num_classes": int(sd["head.weight"].shape[0]),
        "embed_dim": int(embed_dim),
        "depths": depths,
        "num_heads": tuple(heads),
        "window_size": int(cfg_get(config, "MODEL", "SWIN", "WINDOW_SIZE", default=default_window)),
        "mlp_ratio": sd["layers.0.blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        "qkv_bias": "layers.0.blocks.0.attn.qkv.bias" in sd,
        "ape": "absolute_pos_embed" in sd,
        "attn_type": kinds,
        "kernel_size": int(sd[f"layers.{sla[0]}.blocks.0.attn.dwc.weight"].shape[-1]) if sla else 5,
        "window_rule": "slab" if slab else "swin",
    }


def _run_size(preset: Preset, hp: dict[str, Any], config: Mapping[str, Any]) -> int:
    side = resolve_image_size(hp["img_size"], config, resizable=not hp["ape"], what=preset.name)
    if side % hp["patch_size"]:
        raise UnsupportedModelError(
            f"{preset.name}: --image-size {side} is not a multiple of the patch {hp['patch_size']}"
        )
    return side


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    hp = hparams(preset, sd, config)
    run = _run_size(preset, hp, config)
    if norm == "checkpoint":
        return SwinTransformer(
            **hp,
            norm_layer=checkpoint_norm(sd, "layers.0.blocks.0.norm1", preset.name, 1e-5),
            patch_norm=norm_layout(sd, "patch_embed.norm") is not None,
            run_img_size=run,
        )
    return SwinTransformer(
        **hp,
        norm_layer=norm_factory(norm),
        run_img_size=run,
        mask_blocks=[(s, b) for s, b in key_indices(sd, r"layers\.(\d+)\.blocks\.(\d+)\.attn_mask")],
        persist_run_masks=True,
        reduction_bias="layers.0.downsample.reduction.bias" in sd,
    )


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    hp = hparams(preset, sd, config)
    side = _run_size(preset, hp, config)
    return (hp["in_chans"], side, side)


_SWIN = "xinghaochen/SLAB classification/models/swin_transformer.py SwinTransformer"
_SLAB = "xinghaochen/SLAB classification/models/slab_swin.py SlabSwinTransformer"

_SLAB_SIZES = [("tiny", 96, (2, 2, 6, 2)), ("small", 96, (2, 2, 18, 2)), ("base", 128, (2, 2, 18, 2))]
"""The released SLAB-Swin sizes: name, embed_dim, depths (cfgs/slab_swin_{t,s,b}.yaml)."""


def _slab_preset(size: str, embed: int, depths: tuple[int, ...]) -> Preset:
    """One released SLAB-Swin: LinearNorm norms, SLA (window 56) in stages 1-2, window 7 in stages 3-4, 224x224."""
    letter = size[0]
    return Preset(
        f"slab_swin_{size}",
        signature=(embed, depths, "LLSS"),
        defaults={"window_size": 56, "slab": True},
        source=f"{_SLAB} (cfgs/slab_swin_{letter}.yaml)",
        image_size=224,
    )


PRESETS = [
    Preset(
        "swin_tiny_prepbn",
        signature=(96, (2, 2, 6, 2), "SSSS"),
        defaults={"window_size": 7},
        source=f"{_SWIN} (cfgs/swin_t_prepbn.yaml)",
        image_size=224,
    ),
    *(_slab_preset(size, embed, depths) for size, embed, depths in _SLAB_SIZES),
    Preset(
        "swin_prepbn",
        signature=None,
        source=f"{_SWIN} / {_SLAB} (any size; sizes, heads, attention kinds from the weights, "
        "window and image size from config MODEL.SWIN.WINDOW_SIZE / DATA.IMG_SIZE)",
    ),
]

register_family(
    "swin",
    PRESETS,
    signature=signature,
    build=build,
    input_shape=input_shape,
    resizable=lambda preset: True,
)
