"""PVT-PRepBN and SLAB-PVT: Pyramid Vision Transformer with PRepBN norms, spatial-reduction or linear attention.

Papers: SLAB (Guo et al., ICML 2024), PVT-PRepBN / SLAB-PVT rows of Table 2; PVT: Wang et al., ICCV 2021.
Layout source: github xinghaochen/SLAB @ f58db00 ``classification/models/slab_pvt.py``
(``PyramidVisionTransformer``; ``slab_pvt_{tiny,small,medium}`` with ``LinearNorm(norm1=LayerNorm(eps=1e-6),
norm2=RepBN)``, embed dims 64/128/320/512, heads 1/2/5/8, MLP ratios 8/8/4/4, sr ratios 8/4/2/1, patch 4).
Configs ``cfgs/pvt_{t,s,m}_prepbn.yaml`` (``MODEL.TYPE: slab_pvt_*``, ``MODEL.NAME: pvt_*_prepbn``,
``LA.ATTN_TYPE: SSSS``: spatial-reduction attention) and ``cfgs/slab_pvt_{t,s,m}.yaml`` (``ATTN_TYPE: LLLL``:
SLA, ``LA.PVT_LA_SR_RATIOS`` default ``1111``: no reduction); releases ``pvt_{tiny,small,medium}_prepbn.pth``,
``slab_pvt_tiny.pth``. Written here from those facts; no code copied.

Keys, per stage ``s`` = 1..4: ``patch_embed{s}.proj`` (stride-p conv; p = 4, then 2), ``patch_embed{s}.norm``,
``pos_embed{s} (1, N_s, C_s)``, ``block{s}.{j}.{norm1, norm2, mlp.fc1, mlp.fc2, attn.q, attn.kv, attn.proj}``;
with a reduction ratio r > 1 ``attn.sr`` (r x r conv, stride r) and ``attn.norm``; SLA adds ``attn.dwc`` and
``attn.positional_encoding (1, N_s / r^2, C_s)``; ``head``. There is no final norm: the last stage's tokens
are averaged into the head.

Where each norm feeds:
- ``norm1`` -> ``attn.q`` and -> (B, C, H, W) -> the unpadded strided conv ``attn.sr`` (or -> ``attn.kv`` when
  r = 1). Folds forward into all of them (the conv bias gains ``Σ W t``, exact as the conv has no padding).
- ``attn.norm`` (after ``sr``) -> ``attn.kv``; ``norm2`` -> ``mlp.fc1``.
- ``patch_embed{s}.norm`` follows the patch conv and feeds ``x + pos_embed`` (the residual stream): folded
  backward into ``patch_embed{s}.proj``.

Resolution: the official ``_get_pos_embed`` resamples ``pos_embed`` bilinearly when the token grid differs from
the one it was trained for; at the trained grid it is used as stored (the official code's resampling at the same
size is the identity). Window-free spatial-reduction attention runs at any size (``--image-size``); SLA's
``positional_encoding`` fixes the resolution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slabconv.errors import UnsupportedModelError
from slabconv.zoo.layers import (
    Block,
    NormFactory,
    PatchEmbed,
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
from slabconv.zoo.registry import LayoutError, Preset, StateDict, register_family, resolve_image_size


class Attention(nn.Module):
    """Spatial-reduction attention: queries from every token, keys/values from the map reduced by ``sr``.

    Input ``(B, H*W, C)`` with ``(H, W)`` given; keys ``q``, ``kv``, ``proj``, and ``sr`` + ``norm`` when
    ``sr_ratio > 1``.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, sr_ratio: int, norm_layer: NormFactory):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = norm_layer(dim)

    def reduced(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The tokens keys and values are computed from: ``x``, or ``norm(sr(x as a map))``."""
        if self.sr_ratio == 1:
            return x
        return self.norm(map_to_tokens(self.sr(tokens_to_map(x, h, w))))

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        _, n, c = x.shape
        d = c // self.num_heads
        q = self.q(x).reshape(-1, n, self.num_heads, d).permute(0, 2, 1, 3)
        kv = self.kv(self.reduced(x, h, w))
        k, v = kv.reshape(-1, kv.shape[1], 2, self.num_heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(-1, n, c))


class LinearAttention(nn.Module):
    """SLA for PVT (``slab_pvt.py`` ``SimplifiedLinearAttention``) with reduction ratio 1, the released setting.

    Keys ``q``, ``kv``, ``proj``, ``dwc``, ``positional_encoding (1, N, C)``. No float32 cast (as official).
    """

    def __init__(self, dim: int, num_heads: int, num_tokens: int, qkv_bias: bool, kernel_size: int):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.dwc = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        self.positional_encoding = nn.Parameter(torch.zeros(1, num_tokens, dim))

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        _, n, c = x.shape
        k, v = self.kv(x).reshape(-1, n, 2, c).permute(2, 0, 1, 3).unbind(0)
        side = math.isqrt(n)  # the official dwc map: sqrt(N) on a side
        return self.proj(merge_heads(sla(self, self.q(x), k, v, (side, side)), self.num_heads))


class PyramidVisionTransformer(nn.Module):
    """PVT with the official constructor arguments (``slab_pvt.py``).

    Args:
        img_size: the training input side (fixes ``pos_embed{s}``); ``run_img_size`` the side to run at
            (``pos_embed`` resampled bilinearly, as official; not with SLA).
        attn_type: one letter a stage: ``S`` spatial-reduction attention with ``sr_ratios``, ``L`` SLA.

    Input ``(B, in_chans, run_img_size, run_img_size)``; output logits ``(B, num_classes)``.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: tuple[int, ...] = (64, 128, 320, 512),
        num_heads: tuple[int, ...] = (1, 2, 5, 8),
        mlp_ratios: tuple[float, ...] = (8, 8, 4, 4),
        qkv_bias: bool = True,
        norm_layer: NormFactory | None = None,
        depths: tuple[int, ...] = (2, 2, 2, 2),
        sr_ratios: tuple[int, ...] = (8, 4, 2, 1),
        attn_type: str = "SSSS",
        kernel_size: int = 5,
        run_img_size: int | None = None,
    ):
        super().__init__()
        norm_layer = norm_layer or norm_factory("linearnorm", ln_eps=1e-6)
        self.num_stages = len(depths)
        run_img_size = run_img_size or img_size
        self.grids: list[tuple[int, int]] = []  # (trained side, run side) of each stage's token grid
        train_side, run_side = img_size, run_img_size
        for i in range(self.num_stages):
            patch = patch_size if i == 0 else 2
            # the official patch_embed{s} of stage s > 1 is declared for img_size // 2**(s) // 2 tokens a side
            train_side = img_size // patch_size if i == 0 else img_size // 2 ** (i + 1) // 2
            run_side = run_side // patch
            in_dim = in_chans if i == 0 else embed_dims[i - 1]
            setattr(self, f"patch_embed{i + 1}", PatchEmbed(patch, in_dim, embed_dims[i], norm_layer))
            setattr(self, f"pos_embed{i + 1}", nn.Parameter(torch.zeros(1, train_side * train_side, embed_dims[i])))
            blocks = []
            for _ in range(depths[i]):
                attn: nn.Module
                if attn_type[i] == "L":
                    if run_side != train_side:
                        raise ValueError("simplified linear attention fixes the resolution")
                    attn = LinearAttention(embed_dims[i], num_heads[i], train_side * train_side, qkv_bias, kernel_size)
                else:
                    attn = Attention(embed_dims[i], num_heads[i], qkv_bias, sr_ratios[i], norm_layer)
                blocks.append(Block(embed_dims[i], attn, int(embed_dims[i] * mlp_ratios[i]), norm_layer))
            setattr(self, f"block{i + 1}", nn.ModuleList(blocks))
            self.grids.append((train_side, run_side))
        self.head = nn.Linear(embed_dims[-1], num_classes)
        for i in range(self.num_stages):
            nn.init.trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=0.02)
        init_linears(self)

    def _pos_embed(self, i: int) -> torch.Tensor:
        pos = getattr(self, f"pos_embed{i + 1}")
        trained, run = self.grids[i]
        if trained == run:
            return pos
        grid = pos.reshape(1, trained, trained, -1).permute(0, 3, 1, 2)
        return map_to_tokens(F.interpolate(grid, size=(run, run), mode="bilinear"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.num_stages):
            x = getattr(self, f"patch_embed{i + 1}")(x) + self._pos_embed(i)
            side = self.grids[i][1]
            for block in getattr(self, f"block{i + 1}"):
                x = block(x, side, side)
            if i != self.num_stages - 1:
                x = tokens_to_map(x, side, side)
        return self.head(x.mean(dim=1))


# --------------------------------------------------------------------------------------------- registry


_BLOCKS = r"block(\d+)\.(\d+)\.attn\.proj\.weight"


def _kinds(sd: StateDict, depths: tuple[int, ...]) -> str:
    kinds = ""
    for i, depth in enumerate(depths):
        found = {"L" if f"block{i + 1}.{j}.attn.positional_encoding" in sd else "S" for j in range(depth)}
        if len(found) != 1:
            raise UnsupportedModelError(f"PVT stage {i + 1} mixes attention kinds")
        kinds += found.pop()
    return kinds


def signature(sd: StateDict) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    """``(embed dims, depths, attention kinds)`` of PVT-layout weights with PRepBN norms, else None."""
    return _structure(sd) if norm_layout(sd, "block1.0.norm1") is not None else None


def _structure(sd: StateDict) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    if "patch_embed1.proj.weight" not in sd or "block1.0.attn.q.weight" not in sd:
        return None
    depths = depths_of(sd, _BLOCKS)
    try:
        kinds = _kinds(sd, depths)
    except UnsupportedModelError:
        return None
    dims = tuple(int(sd[f"patch_embed{i + 1}.proj.weight"].shape[0]) for i in range(len(depths)))
    return dims, depths, kinds


def hparams(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments of ``PyramidVisionTransformer`` from the weights, the config and the preset."""
    found = _structure(sd)
    if found is None or "head.weight" not in sd:
        raise LayoutError(f"{preset.name}: not a PVT-layout checkpoint (patch_embed1 / block1 / head)")
    dims, depths, kinds = found
    stages = len(depths)
    default_heads = cfg_get(config, "MODEL", "PVT", "NUM_HEADS", default=preset.defaults.get("num_heads"))
    heads, srs, ratios = [], [], []
    for i in range(stages):
        prefix = f"block{i + 1}.0"
        ratios.append(sd[f"{prefix}.mlp.fc1.weight"].shape[0] / dims[i])
        sr = sd.get(f"{prefix}.attn.sr.weight")
        srs.append(int(sr.shape[-1]) if sr is not None else 1)
        if kinds[i] == "L":
            if srs[-1] != 1:
                raise UnsupportedModelError(
                    f"{preset.name}: SLA with a spatial reduction (LA.PVT_LA_SR_RATIOS) is not supported"
                )
            heads.append(dims[i] // int(sd[f"{prefix}.attn.dwc.weight"].shape[0]))
        elif default_heads is not None:
            heads.append(int(default_heads[i]))
        else:
            heads.append(max(1, dims[i] // 64))  # the official convention: 64 channels a head
    _, in_chans, patch, _ = sd["patch_embed1.proj.weight"].shape
    side = math.isqrt(int(sd["pos_embed1"].shape[1])) * int(patch) if "pos_embed1" in sd else 224
    sla = kinds.find("L")
    return {
        "img_size": side,
        "patch_size": int(patch),
        "in_chans": int(in_chans),
        "num_classes": int(sd["head.weight"].shape[0]),
        "embed_dims": dims,
        "num_heads": tuple(heads),
        "mlp_ratios": tuple(ratios),
        "qkv_bias": "block1.0.attn.q.bias" in sd,
        "depths": depths,
        "sr_ratios": tuple(srs),
        "attn_type": kinds,
        "kernel_size": int(sd[f"block{sla + 1}.0.attn.dwc.weight"].shape[-1]) if sla >= 0 else 5,
    }


def _run_size(preset: Preset, hp: dict[str, Any], config: Mapping[str, Any]) -> int:
    return resolve_image_size(hp["img_size"], config, resizable="L" not in hp["attn_type"], what=preset.name)


def build(preset: Preset, sd: StateDict, config: Mapping[str, Any], norm: str) -> nn.Module:
    hp = hparams(preset, sd, config)
    run = _run_size(preset, hp, config)
    if norm == "checkpoint":
        norm_layer = checkpoint_norm(sd, "block1.0.norm1", preset.name, 1e-6)
    else:
        norm_layer = norm_factory(norm)
    return PyramidVisionTransformer(**hp, norm_layer=norm_layer, run_img_size=run)


def input_shape(preset: Preset, sd: StateDict, config: Mapping[str, Any]) -> tuple[int, ...]:
    hp = hparams(preset, sd, config)
    side = _run_size(preset, hp, config)
    return (hp["in_chans"], side, side)


_SOURCE = "xinghaochen/SLAB classification/models/slab_pvt.py"
_DIMS = (64, 128, 320, 512)
_HEADS = {"num_heads": (1, 2, 5, 8)}


_SIZES = [("tiny", (2, 2, 2, 2)), ("small", (3, 4, 6, 3)), ("medium", (3, 4, 18, 3))]
"""The PVT sizes the official configs name: size, depths."""


def _sized_preset(size: str, depths: tuple[int, ...], attention: str) -> Preset:
    """One official PVT size: ``attention`` ``SSSS`` (PVT-PRepBN, spatial reduction) or ``LLLL`` (SLAB-PVT)."""
    letter = size[0]
    if attention == "SSSS":
        name, cfg = f"pvt_{size}_prepbn", f"pvt_{letter}_prepbn.yaml"
    else:
        name, cfg = f"slab_pvt_{size}", f"slab_pvt_{letter}.yaml"
        cfg += "" if size == "tiny" else "; no release file"
    return Preset(
        name,
        signature=(_DIMS, depths, attention),
        defaults=_HEADS,
        source=f"{_SOURCE} slab_pvt_{size}, ATTN_TYPE {attention} (cfgs/{cfg})",
        image_size=224,
    )


PRESETS = [
    *(_sized_preset(size, depths, "SSSS") for size, depths in _SIZES),
    *(_sized_preset(size, depths, "LLLL") for size, depths in _SIZES),
    Preset(
        "pvt_prepbn",
        signature=None,
        source=f"{_SOURCE} PyramidVisionTransformer (any size; heads from the dwc channel count, else config "
        "MODEL.PVT.NUM_HEADS, else embed_dim / 64)",
    ),
]

register_family(
    "pvt",
    PRESETS,
    signature=signature,
    build=build,
    input_shape=input_shape,
    resizable=lambda preset: preset.signature is None or preset.signature[2] == "SSSS",
)
