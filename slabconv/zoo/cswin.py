"""SLAB-CSWin: CSWin Transformer with simplified linear attention in the early stages and PRepBN norms.

Papers: SLAB (Guo et al., ICML 2024), SLAB-CSWin rows of Table 2; CSWin: Dong et al., CVPR 2022.
Layout source: github xinghaochen/SLAB @ f58db00 ``classification/models/slab_cswin.py`` (``CSWinTransformer``,
``SLAB_CSWin_64_24181_tiny_224`` / ``SLAB_CSWin_64_24322_small_224``: embed 64, depths 2-4-18-1 / 2-4-32-2,
heads 2/4/8/16, split sizes 1/2/7/7, ``LinearNorm(norm1=nn.LayerNorm, norm2=RepBN, step=120000)``); configs
``cfgs/slab_cswin_{t,s}.yaml`` (``MODEL.TYPE`` the function names, ``MODEL.NAME: SLAB_CSWin_{tiny,small}``,
``LA.ATTN_TYPE: LLSS``, ``LA.CSWIN_LA_SPLIT_SIZE`` default ``56-28-14-7``); release ``slab_cswin_tiny.pth``.
Written here from those facts; no code copied.

Keys: ``stage1_conv_embed.0`` (7x7 conv, stride 4, padding 2), ``stage1_conv_embed.2`` (norm; index 1 is the
parameter-free tokens rearrange), ``stage{s}.{j}.{qkv, norm1, proj, norm2, mlp.fc1, mlp.fc2}``,
``stage{s}.{j}.attns.{b}.get_v`` (3x3 depthwise conv, LePE), SLA branches add ``attns.{b}.dwc``,
``attns.{b}.scale (1, 1, C)`` (a parameter the forward pass never reads) and ``attns.{b}.positional_encoding
(1, H_sp * W_sp, C)``; ``merge{s}.{conv (3x3, stride 2, padding 1), norm}``; ``norm``; ``head``. A block
has one branch over the whole map when its split size equals the stage side (and always in the last stage),
else two half-channel branches over horizontal and vertical stripes.

Where each norm feeds:
- ``norm1`` -> ``qkv`` (a block-level Linear); ``norm2`` -> ``mlp.fc1``; the final ``norm`` -> mean -> ``head``:
  forward folds.
- ``stage1_conv_embed.2`` and ``merge{s}.norm`` follow a conv and feed the residual stream: folded backward into
  that conv (its zero padding is on the conv's input side, so the row scaling stays exact).

Resolution: fixed (the tokens rearrange and every block are built for ``img_size``; SLA positional encodings).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slabconv.zoo.layers import (
    Mlp,
    NormFactory,
    cfg_get,
    checkpoint_norm,
    depths_of,
    init_linears,
    map_to_tokens,
    merge_heads,
    norm_factory,
    norm_layout,
    sla,
    tokens_to_map,
)
from slabconv.zoo.registry import (
    LayoutError,
    Preset,
    StateDict,
    register_family,
    resolve_image_size,
    square_input,
)


def img2windows(x: torch.Tensor, h_sp: int, w_sp: int) -> torch.Tensor:
    """``(B, C, H, W) -> (B * H/h_sp * W/w_sp, h_sp * w_sp, C)``: stripes in row-major order."""
    _, c, h, w = x.shape
    x = x.view(-1, c, h // h_sp, h_sp, w // w_sp, w_sp)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(-1, h_sp * w_sp, c)


def windows2img(x: torch.Tensor, h_sp: int, w_sp: int, h: int, w: int) -> torch.Tensor:
    """The inverse of ``img2windows`` to tokens: ``(B', h_sp * w_sp, C) -> (B, H * W, C)``."""
    c = x.shape[-1]
    x = x.view(-1, h // h_sp, w // w_sp, h_sp, w_sp, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h * w, c)


def stripes(resolution: int, split: int, branch: int) -> tuple[int, int]:
    """``(H_sp, W_sp)``: the whole map (``branch`` -1), vertical stripes (0) or horizontal stripes (1)."""
    if branch == -1:
        return resolution, resolution
    return (resolution, split) if branch == 0 else (split, resolution)


class LePEAttention(nn.Module):
    """Softmax attention inside stripes plus the locally-enhanced positional encoding ``get_v(v)``.

    ``forward(qkv)`` takes ``(3, B, H*W, C)`` and returns ``(B, H*W, C)``. Key: ``get_v``.
    """

    def __init__(self, dim: int, resolution: int, branch: int, split: int, num_heads: int):
        super().__init__()
        self.resolution = resolution
        self.num_heads = num_heads
        self.h_sp, self.w_sp = stripes(resolution, split, branch)
        self.scale = (dim // num_heads) ** -0.5
        self.get_v = nn.Conv2d(dim, dim, kernel_size=3, stride=1, padding=1, groups=dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B', N, C) -> (B', heads, N, C/heads)``."""
        n, c = x.shape[1], x.shape[2]
        return x.reshape(-1, n, self.num_heads, c // self.num_heads).permute(0, 2, 1, 3)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(0)
        r, h_sp, w_sp = self.resolution, self.h_sp, self.w_sp
        c = q.shape[-1]
        q = self._heads(img2windows(tokens_to_map(q, r, r), h_sp, w_sp))
        k = self._heads(img2windows(tokens_to_map(k, r, r), h_sp, w_sp))
        v_map = tokens_to_map(v, r, r).view(-1, c, r // h_sp, h_sp, r // w_sp, w_sp)
        v_map = v_map.permute(0, 2, 4, 1, 3, 5).reshape(-1, c, h_sp, w_sp)
        d, n = c // self.num_heads, h_sp * w_sp
        lepe = self.get_v(v_map).reshape(-1, self.num_heads, d, n).permute(0, 1, 3, 2)
        v = v_map.reshape(-1, self.num_heads, d, n).permute(0, 1, 3, 2)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (attn @ v + lepe).transpose(1, 2).reshape(-1, n, c)
        return windows2img(x, h_sp, w_sp, r, r)


class LinearAttention(nn.Module):
    """SLA inside stripes (``slab_cswin.py`` ``SimplifiedLinearAttention``), with the LePE term added.

    Keys ``get_v``, ``dwc``, ``positional_encoding (1, H_sp * W_sp, C)`` and ``scale (1, 1, C)`` (unused by the
    forward pass, kept for the official layout; ``keep_scale=False`` drops it for the norm-free bound).
    """

    def __init__(
        self,
        dim: int,
        resolution: int,
        branch: int,
        split: int,
        num_heads: int,
        kernel_size: int,
        keep_scale: bool = True,
    ):
        super().__init__()
        self.resolution = resolution
        self.num_heads = num_heads
        self.h_sp, self.w_sp = stripes(resolution, split, branch)
        head_dim = dim // num_heads
        self.get_v = nn.Conv2d(dim, dim, kernel_size=3, stride=1, padding=1, groups=dim)
        self.dwc = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        if keep_scale:
            self.scale = nn.Parameter(torch.zeros(1, 1, dim))
        self.positional_encoding = nn.Parameter(torch.zeros(1, self.h_sp * self.w_sp, dim))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(0)
        r, h_sp, w_sp = self.resolution, self.h_sp, self.w_sp
        c = q.shape[-1]
        q = img2windows(tokens_to_map(q, r, r), h_sp, w_sp)
        k = img2windows(tokens_to_map(k, r, r), h_sp, w_sp)
        v_map = tokens_to_map(v, r, r).view(-1, c, r // h_sp, h_sp, r // w_sp, w_sp)
        v_map = v_map.permute(0, 2, 4, 1, 3, 5).reshape(-1, c, h_sp, w_sp)
        n = h_sp * w_sp
        lepe = self.get_v(v_map).reshape(-1, c // self.num_heads, n).transpose(1, 2)  # (B' * heads, N, C/heads)
        v = v_map.reshape(-1, c, n).transpose(1, 2)
        x = sla(self, q, k, v, (h_sp, w_sp)) + lepe
        return windows2img(merge_heads(x, self.num_heads), h_sp, w_sp, r, r)


class CSWinBlock(nn.Module):
    """``x + proj(attn(qkv(norm1(x))))``, then ``x + mlp(norm2(x))``; tokens ``(B, R*R, C)``."""

    def __init__(
        self,
        dim: int,
        resolution: int,
        num_heads: int,
        split: int,
        mlp_ratio: float,
        qkv_bias: bool,
        norm_layer: NormFactory,
        last_stage: bool,
        attn_kind: str,
        kernel_size: int,
        keep_scale: bool,
    ):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm1 = norm_layer(dim)
        self.branches = 1 if (last_stage or resolution == split) else 2
        self.proj = nn.Linear(dim, dim)
        if attn_kind not in ("L", "S"):
            raise ValueError(f"attention kind must be 'S' or 'L', got {attn_kind!r}")

        def branch(b: int) -> nn.Module:
            bdim, bheads = (dim, num_heads) if self.branches == 1 else (dim // 2, num_heads // 2)
            index = -1 if self.branches == 1 else b
            if attn_kind == "L":
                return LinearAttention(bdim, resolution, index, split, bheads, kernel_size, keep_scale)
            return LePEAttention(bdim, resolution, index, split, bheads)

        self.attns = nn.ModuleList([branch(b) for b in range(self.branches)])
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.norm2 = norm_layer(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[1], x.shape[2]
        qkv = self.qkv(self.norm1(x)).reshape(-1, n, 3, c).permute(2, 0, 1, 3)
        if self.branches == 2:
            out = torch.cat([self.attns[0](qkv[..., : c // 2]), self.attns[1](qkv[..., c // 2 :])], dim=2)
        else:
            out = self.attns[0](qkv)
        x = x + self.proj(out)
        return x + self.mlp(self.norm2(x))


class TokensFromMap(nn.Module):
    """``(B, C, H, W) -> (B, H*W, C)`` (the official einops ``Rearrange('b c h w -> b (h w) c')``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return map_to_tokens(x)


class MergeBlock(nn.Module):
    """Tokens ``(B, R*R, C)`` -> 3x3 stride-2 conv -> tokens ``(B, (R/2)^2, C')`` -> ``norm``."""

    def __init__(self, dim: int, dim_out: int, resolution: int, norm_layer: NormFactory):
        super().__init__()
        self.resolution = resolution
        self.conv = nn.Conv2d(dim, dim_out, 3, 2, 1)
        self.norm = norm_layer(dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(map_to_tokens(self.conv(tokens_to_map(x, self.resolution, self.resolution))))


class CSWinTransformer(nn.Module):
    """CSWin with the official constructor arguments (``slab_cswin.py``).

    Args:
        split_size: stripe width of each stage's window-attention (``S``) blocks.
        la_split_size: stripe width of each stage's SLA (``L``) blocks (config ``LA.CSWIN_LA_SPLIT_SIZE``).
        attn_type: one letter a stage (``LLSS`` released).
        keep_scale: keep the unused SLA ``scale`` parameters (official layout).

    Input ``(B, in_chans, img_size, img_size)``; output logits ``(B, num_classes)``.
    """

    def __init__(
        self,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 64,
        depth: tuple[int, ...] = (2, 4, 18, 1),
        split_size: tuple[int, ...] = (1, 2, 7, 7),
        la_split_size: tuple[int, ...] = (56, 28, 14, 7),
        num_heads: tuple[int, ...] = (2, 4, 8, 16),
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        norm_layer: NormFactory | None = None,
        attn_type: str = "LLSS",
        kernel_size: int = 5,
        keep_scale: bool = True,
    ):
        super().__init__()
        norm_layer = norm_layer or norm_factory("linearnorm", ln_eps=1e-5)
        self.stage1_conv_embed = nn.Sequential(
            nn.Conv2d(in_chans, embed_dim, 7, 4, 2), TokensFromMap(), norm_layer(embed_dim)
        )
        stages = len(depth)
        dim = embed_dim
        for i in range(stages):
            resolution = img_size // 2 ** (i + 2)
            if i > 0:
                setattr(self, f"merge{i}", MergeBlock(dim, dim * 2, resolution * 2, norm_layer))
                dim *= 2
            kind = attn_type[i]
            split = la_split_size[i] if kind == "L" else split_size[i]
            blocks = [
                CSWinBlock(
                    dim,
                    resolution,
                    num_heads[i],
                    split,
                    mlp_ratio,
                    qkv_bias,
                    norm_layer,
                    i == stages - 1,
                    kind,
                    kernel_size,
                    keep_scale,
                )
                for _ in range(depth[i])
            ]
            setattr(self, f"stage{i + 1}", nn.ModuleList(blocks))
        self.num_stages = stages
        self.norm = norm_layer(dim)
        self.head = nn.Linear(dim, num_classes)
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage1_conv_embed(x)
        for i in range(self.num_stages):
            if i > 0:
                x = getattr(self, f"merge{i}")(x)
            for block in getattr(self, f"stage{i + 1}"):
                x = block(x)
        return self.head(torch.mean(self.norm(x), dim=1))


# --------------------------------------------------------------------------------------------- registry


_BLOCKS = r"stage(\d+)\.(\d+)\.qkv\.weight"


def _blocks(sd: StateDict, depths: tuple[int, ...]) -> list[list[tuple[str, int]]]:
    """``(kind, branches)`` of every block."""
    out = []
    for i, depth in enumerate(depths):
        stage = []
        for j in range(depth):
            prefix = f"stage{i + 1}.{j}.attns"
            kind = "L" if f"{prefix}.0.positional_encoding" in sd else "S"
            stage.append((kind, 2 if f"{prefix}.1.get_v.weight" in sd else 1))
        out.append(stage)
    return out


def signature(sd: StateDict) -> tuple[int, tuple[int, ...], str] | None:
    """``(embed_dim, depths, attention kinds)`` of CSWin-layout weights with PRepBN norms, else None."""
    return _structure(sd) if norm_layout(sd, "stage1.0.norm1") is not None else None


def _structure(sd: StateDict) -> tuple[int, tuple[int, ...], str] | None:
    if "stage1_conv_embed.0.weight" not in sd or "stage1.0.qkv.weight" not in sd:
        return None
    depths = depths_of(sd, _BLOCKS)
    kinds = ""
    for stage in _blocks(sd, depths):
        found = {kind for kind, _ in stage}
        if len(found) != 1:
            return None
        kinds += found.pop()
    return int(sd["stage1_conv_embed.0.weight"].shape[0]), depths, kinds


def hparams(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments of ``CSWinTransformer`` from the weights, the config and the preset."""
    found = _structure(sd)
    if found is None or "head.weight" not in sd:
        raise LayoutError(f"{preset.name}: not a CSWin-layout checkpoint (stage1_conv_embed / stage1 / head)")
    embed_dim, depths, kinds = found
    blocks = _blocks(sd, depths)
    img_size = cfg_get(config, "DATA", "IMG_SIZE", default=None)
    first = "stage1.0.attns.0.positional_encoding"
    if img_size is None and kinds[0] == "L" and blocks[0][0][1] == 1:
        img_size = 4 * math.isqrt(int(sd[first].shape[1]))
    img_size = int(img_size or preset.image_size or 224)
    default_heads = cfg_get(config, "MODEL", "CSWIN", "NUM_HEADS", default=preset.defaults.get("num_heads"))
    split_cfg = cfg_get(config, "MODEL", "CSWIN", "SPLIT_SIZE", default=preset.defaults.get("split_size", (1, 2, 7, 7)))
    heads, splits, la_splits = [], [], []
    for i, stage in enumerate(blocks):
        dim, resolution = embed_dim * 2**i, img_size // 2 ** (i + 2)
        kind, branches = stage[0]
        prefix = f"stage{i + 1}.0.attns.0"
        if kind == "L":
            head_dim = int(sd[f"{prefix}.dwc.weight"].shape[0])
            heads.append(branches * (dim // branches) // head_dim)
            tokens = int(sd[f"{prefix}.positional_encoding"].shape[1])
            la_splits.append(resolution if branches == 1 else tokens // resolution)
            splits.append(int(split_cfg[i]))
        else:
            heads.append(int(default_heads[i]) if default_heads is not None else max(1, dim // 32))
            splits.append(resolution if branches == 1 else int(split_cfg[i]))
            la_splits.append(resolution)
    sla = [i for i, k in enumerate(kinds) if k == "L"]
    return {
        "img_size": img_size,
        "in_chans": int(sd["stage1_conv_embed.0.weight"].shape[1]),
        "num_classes": int(sd["head.weight"].shape[0]),
        "embed_dim": embed_dim,
        "depth": depths,
        "split_size": tuple(splits),
        "la_split_size": tuple(la_splits),
        "num_heads": tuple(heads),
        "mlp_ratio": sd["stage1.0.mlp.fc1.weight"].shape[0] / embed_dim,
        "qkv_bias": "stage1.0.qkv.bias" in sd,
        "attn_type": kinds,
        "kernel_size": int(sd[f"stage{sla[0] + 1}.0.attns.0.dwc.weight"].shape[-1]) if sla else 5,
    }


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    hp = hparams(preset, sd, config)
    resolve_image_size(hp["img_size"], config, resizable=False, what=preset.name)
    if norm == "checkpoint":
        return CSWinTransformer(**hp, norm_layer=checkpoint_norm(sd, "stage1.0.norm1", preset.name, 1e-5))
    keep_scale = any(k.endswith(".scale") and ".attns." in k for k in sd)
    return CSWinTransformer(**hp, norm_layer=norm_factory(norm), keep_scale=keep_scale)


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    return square_input(hparams(preset, sd, config), config, preset.name)


_SOURCE = "xinghaochen/SLAB classification/models/slab_cswin.py"
_DEFAULTS = {"num_heads": (2, 4, 8, 16), "split_size": (1, 2, 7, 7)}

PRESETS = [
    Preset(
        "slab_cswin_tiny",
        signature=(64, (2, 4, 18, 1), "LLSS"),
        defaults=_DEFAULTS,
        source=f"{_SOURCE} SLAB_CSWin_64_24181_tiny_224 (cfgs/slab_cswin_t.yaml)",
        image_size=224,
    ),
    Preset(
        "slab_cswin_small",
        signature=(64, (2, 4, 32, 2), "LLSS"),
        defaults=_DEFAULTS,
        source=f"{_SOURCE} SLAB_CSWin_64_24322_small_224 (cfgs/slab_cswin_s.yaml; no release file in the README)",
        image_size=224,
    ),
    Preset(
        "slab_cswin",
        signature=None,
        source=f"{_SOURCE} CSWinTransformer (any size; heads from the dwc channel count, else config "
        "MODEL.CSWIN.NUM_HEADS, else dim / 32; window-attention split sizes from MODEL.CSWIN.SPLIT_SIZE)",
    ),
]

register_family("cswin", PRESETS, signature=signature, build=build, input_shape=input_shape)
