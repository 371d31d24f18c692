"""The SLAB model zoo: every official model family, by its official names, in its official key layout, folds
completely and exactly.

The official code (github xinghaochen/SLAB ``classification/models``) needs timm and cannot run here, so:

- Names: every release file stem, README name, config ``MODEL.NAME`` and registered function name resolves.
- Layout at full size: ``official_layout`` below restates, independently of ``slabconv.zoo``, the key names and
  shapes each official constructor creates (written from the official files). Each preset built on the meta
  device must equal it key for key and shape for shape, and detection must pick the preset from those shapes
  and from the saved config's ``MODEL.NAME``.
- Small instances of every family (the same classes with small sizes), in both key layouts: the registry
  rebuilds them from their state_dict with identical outputs; every norm folds (forward or backward, none
  kept); float32 relative error <= 1e-5; half precision is at least as accurate as the unfused half model; the
  fused ONNX of one instance per family has no BatchNormalization and the op histogram of the norm-free bound.
- The SLA kernel against the official einsum formula (both branches of its shape test); Swin's windows and
  shifted-window mask against a restatement of the official construction.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from slabconv import engine
from slabconv.engine.norms import BN_OPS
from slabconv.errors import UnsupportedModelError
from slabconv.load.formats import load_checkpoint
from slabconv.write.onnx import export_onnx
from slabconv.write.pt2 import export_program
from slabconv.zoo import detect_arch, get_arch, list_archs
from slabconv.zoo.cswin import CSWinTransformer
from slabconv.zoo.deit import VisionTransformer
from slabconv.zoo.layers import NormFactory, SimplifiedLinearAttention, linear_attention, norm_factory
from slabconv.zoo.pvt import LinearAttention as PvtLinearAttention
from slabconv.zoo.pvt import PyramidVisionTransformer
from slabconv.zoo.registry import with_image_size
from slabconv.zoo.slab_deit import SlabVisionTransformer
from slabconv.zoo.swin import SwinTransformer, shifted_window_mask, window_partition, window_reverse
from tests.conftest import ROOT, op_histogram, randomize_norms

# --------------------------------------------------------------------------------------------- official names

# release file stem -> the other official names: README table name, config MODEL.NAME, registered function.
OFFICIAL_NAMES = {
    "deit_tiny_prepbn": ("deit_t_prepbn", "deit_tiny_patch16_224_repbn"),
    "deit_small_prepbn": ("deit_s_prepbn", "deit_small_patch16_224_repbn"),
    "slab_deit_tiny": ("slab_deit_t", "deit_tiny_patch16_224_linear_repbn"),
    "slab_deit_small": ("slab_deit_s", "deit_small_patch16_224_linear_repbn"),
    "swin_tiny_prepbn": ("swin_t_prepbn", "swin_tiny_repbn"),
    "slab_swin_tiny": ("slab_swin_t", "slab_swin_tiny_patch4_224"),
    "slab_swin_small": ("slab_swin_s", "slab_swin_small_patch4_224"),
    "slab_swin_base": ("slab_swin_b", "slab_swin_base_patch4_224"),
    "pvt_tiny_prepbn": ("pvt_t_prepbn",),
    "pvt_small_prepbn": ("pvt_s_prepbn",),
    "pvt_medium_prepbn": ("pvt_m_prepbn",),
    "slab_pvt_tiny": ("slab_pvt_t",),
    "slab_pvt_small": ("slab_pvt_s",),
    "slab_pvt_medium": ("slab_pvt_m",),
    "slab_cswin_tiny": ("slab_cswin_t", "SLAB_CSWin_tiny", "SLAB_CSWin_64_24181_tiny_224"),
    "slab_cswin_small": ("slab_cswin_s", "SLAB_CSWin_small", "SLAB_CSWin_64_24322_small_224"),
}
# the MODEL.NAME of each official config (cfgs/*.yaml)
CONFIG_NAME = {
    "deit_tiny_prepbn": "deit_tiny_patch16_224_repbn",
    "deit_small_prepbn": "deit_small_patch16_224_repbn",
    "slab_deit_tiny": "deit_tiny_patch16_224_linear_repbn",
    "slab_deit_small": "deit_small_patch16_224_linear_repbn",
    "swin_tiny_prepbn": "swin_tiny_repbn",
    "slab_swin_tiny": "slab_swin_tiny_patch4_224",
    "slab_swin_small": "slab_swin_small_patch4_224",
    "slab_swin_base": "slab_swin_base_patch4_224",
    "pvt_tiny_prepbn": "pvt_tiny_prepbn",
    "pvt_small_prepbn": "pvt_small_prepbn",
    "pvt_medium_prepbn": "pvt_medium_prepbn",
    "slab_pvt_tiny": "slab_pvt_tiny",
    "slab_pvt_small": "slab_pvt_small",
    "slab_pvt_medium": "slab_pvt_medium",
    "slab_cswin_tiny": "SLAB_CSWin_tiny",
    "slab_cswin_small": "SLAB_CSWin_small",
}


@pytest.mark.parametrize("stem", sorted(OFFICIAL_NAMES))
def test_every_official_name_resolves_to_its_release_stem(stem):
    assert get_arch(stem).name == stem
    for alias in OFFICIAL_NAMES[stem]:
        assert get_arch(alias).name == stem


def test_list_command_prints_every_name():
    from typer.testing import CliRunner

    from slabconv.cli import app

    result = CliRunner().invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    listed = {r["name"] for r in rows} | {a for r in rows for a in r["aliases"]}
    assert set(OFFICIAL_NAMES) | {a for names in OFFICIAL_NAMES.values() for a in names} <= listed
    assert {r["name"] for r in rows} == {s.name for s in list_archs()}


# --------------------------------------------------------------------------------------------- official layouts
# Written from the official constructors, loop for loop; independent of slabconv.zoo.

Layout = dict[str, tuple[int, ...]]


def _norm(keys: Layout, prefix: str, c: int, layout: str) -> None:
    bn = "bn" if layout == "repbn" else "norm2.bn"
    alpha = "alpha" if layout == "repbn" else "norm2.alpha"
    keys.update({f"{prefix}.{alpha}": (1,), f"{prefix}.{bn}.num_batches_tracked": ()})
    keys.update({f"{prefix}.{bn}.{p}": (c,) for p in ("weight", "bias", "running_mean", "running_var")})
    if layout == "linearnorm":
        keys.update({f"{prefix}.{b}": () for b in ("warm", "iter", "total_step")})
        keys.update({f"{prefix}.norm1.weight": (c,), f"{prefix}.norm1.bias": (c,)})


def _linear(keys: Layout, prefix: str, n_in: int, n_out: int, bias: bool = True) -> None:
    keys[f"{prefix}.weight"] = (n_out, n_in)
    if bias:
        keys[f"{prefix}.bias"] = (n_out,)


def _conv(keys: Layout, prefix: str, n_in: int, n_out: int, k: int, groups: int = 1) -> None:
    keys[f"{prefix}.weight"] = (n_out, n_in // groups, k, k)
    keys[f"{prefix}.bias"] = (n_out,)


def _mlp(keys: Layout, prefix: str, c: int, ratio: float) -> None:
    _linear(keys, f"{prefix}.fc1", c, int(c * ratio))
    _linear(keys, f"{prefix}.fc2", int(c * ratio), c)


def deit_layout(dim: int, depth: int, heads: int, layout: str, sla: bool) -> Layout:
    """deit.py / slab_deit.py VisionTransformer, patch 16, 224, 1000 classes."""
    keys: Layout = {"cls_token": (1, 1, dim), "pos_embed": (1, 196 if sla else 197, dim)}
    _conv(keys, "patch_embed.proj", 3, dim, 16)
    for i in range(depth):
        p = f"blocks.{i}"
        _norm(keys, f"{p}.norm1", dim, layout)
        _linear(keys, f"{p}.attn.qkv", dim, 3 * dim)
        _linear(keys, f"{p}.attn.proj", dim, dim)
        if sla:
            _conv(keys, f"{p}.attn.dwc", dim // heads, dim // heads, 5, groups=dim // heads)
            keys[f"{p}.attn.positional_encoding"] = (1, 14 * 14, dim)
        _norm(keys, f"{p}.norm2", dim, layout)
        _mlp(keys, f"{p}.mlp", dim, 4)
    _norm(keys, "norm", dim, layout)
    _linear(keys, "head", dim, 1000)
    return keys


def swin_layout(
    dim: int, depths: tuple[int, ...], heads: tuple[int, ...], window: int, attn: str, layout: str
) -> Layout:
    """swin_transformer.py SwinTransformer (attn SSSS) / slab_swin.py SlabSwinTransformer, patch 4, 224."""
    keys: Layout = {}
    _conv(keys, "patch_embed.proj", 3, dim, 4)
    _norm(keys, "patch_embed.norm", dim, layout)
    for i, depth in enumerate(depths):
        c, res = dim * 2**i, 56 // 2**i
        for j in range(depth):
            p = f"layers.{i}.blocks.{j}"
            w = window if (attn == "SSSS" or attn[i] == "L") else (7 if window <= 56 else 12)
            shift = 0 if j % 2 == 0 else w // 2
            if res <= w:
                w, shift = res, 0
            _norm(keys, f"{p}.norm1", c, layout)
            if attn[i] == "S":
                keys[f"{p}.attn.relative_position_bias_table"] = ((2 * w - 1) ** 2, heads[i])
                keys[f"{p}.attn.relative_position_index"] = (w * w, w * w)
            else:
                _conv(keys, f"{p}.attn.dwc", c // heads[i], c // heads[i], 5, groups=c // heads[i])
                keys[f"{p}.attn.positional_encoding"] = (1, w * w, c)
            _linear(keys, f"{p}.attn.qkv", c, 3 * c)
            _linear(keys, f"{p}.attn.proj", c, c)
            _norm(keys, f"{p}.norm2", c, layout)
            _mlp(keys, f"{p}.mlp", c, 4)
            if shift:
                keys[f"{p}.attn_mask"] = ((res // w) ** 2, w * w, w * w)
        if i < len(depths) - 1:
            _linear(keys, f"layers.{i}.downsample.reduction", 4 * c, 2 * c, bias=False)
            _norm(keys, f"layers.{i}.downsample.norm", 4 * c, layout)
    _norm(keys, "norm", dim * 8, layout)
    _linear(keys, "head", dim * 8, 1000)
    return keys


def pvt_layout(depths: tuple[int, ...], attn: str) -> Layout:
    """slab_pvt.py PyramidVisionTransformer (slab_pvt_*): dims 64/128/320/512, heads 1/2/5/8, LinearNorm."""
    dims, heads, ratios, srs = (64, 128, 320, 512), (1, 2, 5, 8), (8, 8, 4, 4), (8, 4, 2, 1)
    keys: Layout = {}
    for i in range(4):
        side = 224 // 4 if i == 0 else 224 // 2 ** (i + 1) // 2
        _conv(keys, f"patch_embed{i + 1}.proj", 3 if i == 0 else dims[i - 1], dims[i], 4 if i == 0 else 2)
        _norm(keys, f"patch_embed{i + 1}.norm", dims[i], "linearnorm")
        keys[f"pos_embed{i + 1}"] = (1, side * side, dims[i])
        c = dims[i]
        sr = srs[i] if attn[i] == "S" else 1  # LA.PVT_LA_SR_RATIOS default 1111
        for j in range(depths[i]):
            p = f"block{i + 1}.{j}"
            _norm(keys, f"{p}.norm1", c, "linearnorm")
            _linear(keys, f"{p}.attn.q", c, c)
            _linear(keys, f"{p}.attn.kv", c, 2 * c)
            _linear(keys, f"{p}.attn.proj", c, c)
            if sr > 1:
                _conv(keys, f"{p}.attn.sr", c, c, sr)
                _norm(keys, f"{p}.attn.norm", c, "linearnorm")
            if attn[i] == "L":
                _conv(keys, f"{p}.attn.dwc", c // heads[i], c // heads[i], 5, groups=c // heads[i])
                keys[f"{p}.attn.positional_encoding"] = (1, side * side // sr**2, c)
            _norm(keys, f"{p}.norm2", c, "linearnorm")
            _mlp(keys, f"{p}.mlp", c, ratios[i])
    _linear(keys, "head", 512, 1000)
    return keys


def cswin_layout(depths: tuple[int, ...]) -> Layout:
    """slab_cswin.py CSWinTransformer: embed 64, heads 2/4/8/16, split 1/2/7/7, LA split 56-28-14-7, LLSS."""
    heads, split, la_split, attn = (2, 4, 8, 16), (1, 2, 7, 7), (56, 28, 14, 7), "LLSS"
    keys: Layout = {}
    _conv(keys, "stage1_conv_embed.0", 3, 64, 7)
    _norm(keys, "stage1_conv_embed.2", 64, "linearnorm")
    for i in range(4):
        c, reso = 64 * 2**i, 224 // 2 ** (i + 2)
        if i > 0:
            _conv(keys, f"merge{i}.conv", c // 2, c, 3)
            _norm(keys, f"merge{i}.norm", c, "linearnorm")
        sp = la_split[i] if attn[i] == "L" else split[i]
        last = i == 3 or reso == sp
        for j in range(depths[i]):
            p = f"stage{i + 1}.{j}"
            _linear(keys, f"{p}.qkv", c, 3 * c)
            _norm(keys, f"{p}.norm1", c, "linearnorm")
            _linear(keys, f"{p}.proj", c, c)
            for b in range(1 if last else 2):
                bc, bh = (c, heads[i]) if last else (c // 2, heads[i] // 2)
                h_sp, w_sp = (reso, reso) if last else ((reso, sp) if b == 0 else (sp, reso))
                _conv(keys, f"{p}.attns.{b}.get_v", bc, bc, 3, groups=bc)
                if attn[i] == "L":
                    _conv(keys, f"{p}.attns.{b}.dwc", bc // bh, bc // bh, 5, groups=bc // bh)
                    keys[f"{p}.attns.{b}.scale"] = (1, 1, bc)
                    keys[f"{p}.attns.{b}.positional_encoding"] = (1, h_sp * w_sp, bc)
            _norm(keys, f"{p}.norm2", c, "linearnorm")
            _mlp(keys, f"{p}.mlp", c, 4)
    _norm(keys, "norm", 512, "linearnorm")
    _linear(keys, "head", 512, 1000)
    return keys


OFFICIAL_LAYOUT: dict[str, Callable[[], Layout]] = {
    "deit_tiny_prepbn": lambda: deit_layout(192, 12, 3, "repbn", sla=False),
    "deit_small_prepbn": lambda: deit_layout(384, 12, 6, "linearnorm", sla=False),
    "slab_deit_tiny": lambda: deit_layout(192, 12, 3, "linearnorm", sla=True),
    "slab_deit_small": lambda: deit_layout(384, 12, 6, "linearnorm", sla=True),
    "swin_tiny_prepbn": lambda: swin_layout(96, (2, 2, 6, 2), (3, 6, 12, 24), 7, "SSSS", "repbn"),
    "slab_swin_tiny": lambda: swin_layout(96, (2, 2, 6, 2), (3, 6, 12, 24), 56, "LLSS", "linearnorm"),
    "slab_swin_small": lambda: swin_layout(96, (2, 2, 18, 2), (3, 6, 12, 24), 56, "LLSS", "linearnorm"),
    "slab_swin_base": lambda: swin_layout(128, (2, 2, 18, 2), (4, 8, 16, 32), 56, "LLSS", "linearnorm"),
    "pvt_tiny_prepbn": lambda: pvt_layout((2, 2, 2, 2), "SSSS"),
    "pvt_small_prepbn": lambda: pvt_layout((3, 4, 6, 3), "SSSS"),
    "pvt_medium_prepbn": lambda: pvt_layout((3, 4, 18, 3), "SSSS"),
    "slab_pvt_tiny": lambda: pvt_layout((2, 2, 2, 2), "LLLL"),
    "slab_pvt_small": lambda: pvt_layout((3, 4, 6, 3), "LLLL"),
    "slab_pvt_medium": lambda: pvt_layout((3, 4, 18, 3), "LLLL"),
    "slab_cswin_tiny": lambda: cswin_layout((2, 4, 18, 1)),
    "slab_cswin_small": lambda: cswin_layout((2, 4, 32, 2)),
}


def test_every_fixed_size_preset_has_an_official_layout():
    fixed = {s.name for s in list_archs() if s.image_size is not None}
    assert fixed == set(OFFICIAL_LAYOUT)


@pytest.mark.parametrize("stem", sorted(OFFICIAL_LAYOUT))
def test_official_layout_builds_strictly_and_is_detected(stem):
    expected = OFFICIAL_LAYOUT[stem]()
    with torch.device("meta"):
        sd = {k: torch.empty(shape) for k, shape in expected.items()}
        spec = detect_arch(sd, {})
        built = spec.build(sd, {}, "checkpoint").state_dict()
        by_config = detect_arch(sd, {"MODEL": {"NAME": CONFIG_NAME[stem]}})
    assert spec.name == stem and by_config.name == stem
    assert sorted(built) == sorted(expected)
    mismatched = [k for k in expected if tuple(built[k].shape) != expected[k]]
    assert not mismatched, mismatched[:5]
    assert spec.input_shape(sd, {}) == (3, 224, 224)


# --------------------------------------------------------------------------------------------- small instances


@dataclass(frozen=True)
class Tiny:
    """A small instance of a family: the same class as the preset ``arch``, small sizes.

    ``make(norm_layer)`` builds it; ``config`` carries what the weights do not show (as a saved config would);
    ``layout`` is the official key layout of ``arch``; ``backward`` the norms that must fold backward;
    ``half`` the half dtype to test (bfloat16 where the official SLA has no float32 cast: in float16 its
    ``1 / (q·Σk + 1e-6)`` overflows for a query row that ReLU zeroes, in the official code too).
    """

    arch: str
    make: Callable[[NormFactory], nn.Module]
    side: int
    layout: str
    ln_eps: float
    backward: frozenset[str]
    config: dict[str, Any] = field(default_factory=dict)
    half: torch.dtype = torch.float16

    def model(self, layout: str, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return randomize_norms(self.make(norm_factory(layout, ln_eps=self.ln_eps)), seed).eval()

    def other_layout(self) -> str:
        return "repbn" if self.layout == "linearnorm" else "linearnorm"


_SWIN_CFG = {"DATA": {"IMG_SIZE": 16}, "MODEL": {"SWIN": {"WINDOW_SIZE": 4}}}

TINY = {
    "deit": Tiny(
        "deit_tiny_prepbn",
        lambda n: VisionTransformer(16, 4, 3, 10, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2, norm_layer=n),
        side=16,
        layout="repbn",
        ln_eps=1e-6,
        backward=frozenset(),
        config={"MODEL": {"VIT": {"NUM_HEADS": 2}}},
    ),
    "slab_deit": Tiny(
        "slab_deit_tiny",
        lambda n: SlabVisionTransformer(
            16, 4, 3, 10, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2, kernel_size=3, norm_layer=n
        ),
        side=16,
        layout="linearnorm",
        ln_eps=1e-6,
        backward=frozenset(),
    ),
    "swin": Tiny(
        "swin_tiny_prepbn",
        lambda n: SwinTransformer(
            16, 2, 3, 10, embed_dim=16, depths=(2, 1), num_heads=(2, 4), window_size=4, mlp_ratio=2, norm_layer=n
        ),
        side=16,
        layout="repbn",
        ln_eps=1e-5,
        backward=frozenset({"patch_embed.norm"}),
        config=_SWIN_CFG,
    ),
    "slab_swin": Tiny(
        "slab_swin_tiny",
        lambda n: SwinTransformer(
            16,
            2,
            3,
            10,
            embed_dim=16,
            depths=(2, 1),
            num_heads=(2, 4),
            window_size=4,
            mlp_ratio=2,
            attn_type="LS",
            window_rule="slab",
            kernel_size=3,
            norm_layer=n,
        ),
        side=16,
        layout="linearnorm",
        ln_eps=1e-5,
        backward=frozenset({"patch_embed.norm"}),
        config=_SWIN_CFG,
    ),
    "pvt": Tiny(
        "pvt_tiny_prepbn",
        lambda n: PyramidVisionTransformer(
            16,
            4,
            3,
            10,
            embed_dims=(8, 16),
            num_heads=(1, 2),
            mlp_ratios=(2, 2),
            depths=(1, 1),
            sr_ratios=(2, 1),
            norm_layer=n,
        ),
        side=16,
        layout="linearnorm",
        ln_eps=1e-6,
        # the spatial-reduction norm folds backward into sr: forward, its random scale spread would make kv's int8
        # step 42.6x coarser (above engine.STEP_GROWTH_LIMIT), and both directions are exact
        backward=frozenset({"patch_embed1.norm", "patch_embed2.norm", "block1.0.attn.norm"}),
        config={"MODEL": {"PVT": {"NUM_HEADS": [1, 2]}}},
    ),
    "slab_pvt": Tiny(
        "slab_pvt_tiny",
        lambda n: PyramidVisionTransformer(
            16,
            4,
            3,
            10,
            embed_dims=(8, 16),
            num_heads=(1, 2),
            mlp_ratios=(2, 2),
            depths=(1, 1),
            attn_type="LL",
            kernel_size=3,
            norm_layer=n,
        ),
        side=16,
        layout="linearnorm",
        ln_eps=1e-6,
        backward=frozenset({"patch_embed1.norm", "patch_embed2.norm"}),
        half=torch.bfloat16,
    ),
    "slab_cswin": Tiny(
        "slab_cswin_tiny",
        lambda n: CSWinTransformer(
            32,
            3,
            10,
            embed_dim=8,
            depth=(1, 1, 1),
            split_size=(1, 2, 1),
            la_split_size=(8, 4, 2),
            num_heads=(2, 2, 4),
            attn_type="LSS",
            mlp_ratio=2,
            kernel_size=3,
            norm_layer=n,
        ),
        side=32,
        layout="linearnorm",
        ln_eps=1e-5,
        backward=frozenset({"stage1_conv_embed.2", "merge1.norm", "merge2.norm"}),
        config={"DATA": {"IMG_SIZE": 32}, "MODEL": {"CSWIN": {"NUM_HEADS": [2, 2, 4], "SPLIT_SIZE": [1, 2, 1]}}},
        half=torch.bfloat16,
    ),
}
FAMILIES = {"deit", "slab_deit", "swin", "pvt", "cswin"}
HALF_TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def test_every_family_has_a_small_instance():
    vision = {s.family for s in list_archs() if s.input_dtype is None}  # image models (not LLaMA)
    assert {get_arch(t.arch).family for t in TINY.values()} == FAMILIES == vision


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _input(tiny: Tiny, batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, tiny.side, tiny.side, generator=torch.Generator().manual_seed(seed))


def _norm_count(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("layout", ["official", "other"])
@pytest.mark.parametrize("key", sorted(TINY))
def test_registry_rebuilds_small_instances_from_their_weights(key, layout):
    tiny = TINY[key]
    model = tiny.model(tiny.layout if layout == "official" else tiny.other_layout())
    sd = model.state_dict()
    spec = get_arch(tiny.arch)
    assert detect_arch(sd, tiny.config).family == spec.family  # the family's any-size entry
    rebuilt = spec.build(sd, tiny.config, "checkpoint")
    rebuilt.load_state_dict(sd, strict=True)
    x = _input(tiny)
    assert torch.equal(rebuilt.eval()(x), model(x))
    assert spec.input_shape(sd, tiny.config) == (3, tiny.side, tiny.side)


_FOLDED: dict[str, tuple[nn.Module, torch.fx.GraphModule, list[engine.Decision], torch.Tensor]] = {}
_CAPTURED: dict[str, torch.export.ExportedProgram] = {}  # the program each folded graph was unlifted from


def folded(key: str) -> tuple[nn.Module, torch.fx.GraphModule, list[engine.Decision], torch.Tensor]:
    """The small instance in its official layout, captured with a dynamic batch and folded (cached)."""
    if key not in _FOLDED:
        tiny = TINY[key]
        model = tiny.model(tiny.layout)
        x = _input(tiny)
        _CAPTURED[key] = engine.capture_program(model, x)
        gm = engine.unlifted(_CAPTURED[key])
        _FOLDED[key] = (model, gm, engine.fold_all(gm), x)
    return _FOLDED[key]


@pytest.mark.parametrize("key", sorted(set(TINY) - {"deit"}))  # DeiT: tests/test_plan.py
def test_small_instance_folds_completely_and_exactly(key):
    tiny = TINY[key]
    model, gm, decisions, x = folded(key)
    assert len(decisions) == _norm_count(model)
    assert all(d.action in ("folded-forward", "folded-backward") and d.reason is None for d in decisions)
    assert {d.norm for d in decisions if d.action == "folded-backward"} == tiny.backward
    assert not [n for n in gm.graph.nodes if n.target in BN_OPS]
    assert _rel_err(gm(x), model(x)) <= 1e-5
    assert _rel_err(gm(x[:1]), model(x[:1])) <= 1e-5  # the batch axis stays dynamic
    # the fused weights are exactly the norm-free bound's
    fused = engine.fused_state_dict(gm)
    bound = get_arch(tiny.arch).build(fused, tiny.config, "identity")
    bound.load_state_dict(fused, strict=True)
    assert _rel_err(bound.eval()(x), model(x)) <= 1e-5


@pytest.mark.parametrize("key", sorted(set(TINY) - {"deit"}))
def test_small_instance_folds_in_half_precision(key):
    """In the other key layout and half precision: every norm folds, the fused model is within the dtype's
    tolerance of the unfused one, and no less accurate than it against the float64 model."""
    tiny = TINY[key]
    layout = tiny.other_layout()
    exact = tiny.model(layout).double()
    model = tiny.model(layout).to(tiny.half)
    x = _input(tiny, batch=2)
    reference = model(x.to(tiny.half))
    gm = engine.capture(model, x.to(tiny.half), dynamic_batch=False)
    decisions = engine.fold_all(gm)
    assert all(d.action in ("folded-forward", "folded-backward") for d in decisions)
    assert len(decisions) == _norm_count(model)
    out = gm(x.to(tiny.half))
    assert out.dtype == tiny.half
    truth = exact(x.double())
    assert _rel_err(out, reference) <= HALF_TOLERANCE[tiny.half]
    assert _rel_err(out, truth) <= max(HALF_TOLERANCE[tiny.half], 1.5 * _rel_err(reference, truth))
    assert torch.equal(out.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("key", ["slab_deit", "swin", "pvt", "slab_cswin"])  # one export per family (DeiT: test_plan)
def test_fused_onnx_reaches_the_norm_free_bound(key, tmp_path):
    import onnxruntime as ort

    tiny = TINY[key]
    model, gm, _, x = folded(key)
    bound = get_arch(tiny.arch).build(engine.fused_state_dict(gm), tiny.config, "identity")
    bound.load_state_dict(engine.fused_state_dict(gm), strict=True)
    # as fuse writes model.onnx: the fused graph lifted back into the captured program (no second trace), translated
    info = export_onnx(gm, x, tmp_path / "fused.onnx", program=export_program(gm, x, _CAPTURED[key]))
    export_onnx(bound.eval(), x, tmp_path / "bound.onnx")
    fused, free = op_histogram(tmp_path / "fused.onnx"), op_histogram(tmp_path / "bound.onnx")
    assert fused["BatchNormalization"] == 0
    assert fused == free
    assert info["dynamic_batch"]
    session = ort.InferenceSession(str(tmp_path / "fused.onnx"), providers=["CPUExecutionProvider"])
    for batch in (x, x[:1]):
        (out,) = session.run(None, {"input": batch.numpy()})
        assert _rel_err(torch.from_numpy(out), model(batch)) <= 1e-5


# --------------------------------------------------------------------------------------------- resolution


def test_swin_at_a_size_that_needs_padding_keeps_only_the_norms_before_the_pad():
    tiny = TINY["swin"]
    model = tiny.model(tiny.layout)
    config = with_image_size(tiny.config, 12)  # stage sides 6 and 3 with window 4: both padded
    spec = get_arch(tiny.arch)
    padded = spec.build(model.state_dict(), config, "checkpoint")
    padded.load_state_dict(model.state_dict(), strict=True)
    assert spec.input_shape(model.state_dict(), config) == (3, 12, 12)
    x = torch.randn(2, 3, 12, 12)
    reference = padded.eval()(x)
    gm = engine.capture(padded, x, dynamic_batch=False)
    decisions = {d.norm: d for d in engine.fold_all(gm)}
    kept = {n for n, d in decisions.items() if d.action == "kept-affine"}
    assert kept == {"layers.0.blocks.0.norm1", "layers.0.blocks.1.norm1", "layers.1.blocks.0.norm1"}
    assert all(decisions[n].reason == "zero-padding-after-norm" for n in kept)
    assert all(d.action.startswith("folded") for n, d in decisions.items() if n not in kept)
    assert not [n for n in gm.graph.nodes if n.target in BN_OPS]
    assert _rel_err(gm(x), reference) <= 1e-5


def test_pvt_runs_at_another_size_with_resampled_position_embeddings():
    tiny = TINY["pvt"]
    model = tiny.model(tiny.layout)
    spec = get_arch(tiny.arch)
    config = with_image_size(tiny.config, 48)
    bigger = spec.build(model.state_dict(), config, "checkpoint")
    bigger.load_state_dict(model.state_dict(), strict=True)
    assert bigger.eval()(torch.randn(2, 3, 48, 48)).shape == (2, 10)
    assert spec.input_shape(model.state_dict(), config) == (3, 48, 48)


@pytest.mark.parametrize("key", ["deit", "slab_deit", "slab_pvt", "slab_cswin"])
def test_models_whose_weights_fix_the_resolution_refuse_another_image_size(key):
    tiny = TINY[key]
    sd = tiny.model(tiny.layout).state_dict()
    spec = get_arch(tiny.arch)
    assert spec.input_shape(sd, with_image_size(tiny.config, tiny.side)) == (3, tiny.side, tiny.side)
    assert not spec.resizable or spec.name == "pvt_tiny_prepbn"
    with pytest.raises(UnsupportedModelError, match="fix the input"):
        spec.build(sd, with_image_size(tiny.config, 2 * tiny.side), "checkpoint")


def test_slab_swin_at_another_size_keeps_its_trained_sla_windows():
    tiny = TINY["slab_swin"]
    model = tiny.model(tiny.layout)
    spec = get_arch(tiny.arch)
    config = with_image_size(tiny.config, 24)  # stage sides 12 and 6; SLA window 4 and window 4: padded to 12, 8
    resized = spec.build(model.state_dict(), config, "checkpoint")
    resized.load_state_dict(model.state_dict(), strict=True)
    assert resized.eval()(torch.randn(2, 3, 24, 24)).shape == (2, 10)


# --------------------------------------------------------------------------------------------- pieces


def _official_sla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branch: str) -> torch.Tensor:
    """The official SLA kernel, einsum for einsum (slab_deit.py Attention.forward)."""
    z = 1 / (torch.einsum("b i c, b c -> b i", q, k.sum(dim=1)) + 1e-6)
    if branch == "kv":
        kv = torch.einsum("b j c, b j d -> b c d", k, v)
        return torch.einsum("b i c, b c d, b i -> b i d", q, kv, z)
    qk = torch.einsum("b i c, b j c -> b i j", q, k)
    return torch.einsum("b i j, b j d, b i -> b i d", qk, v, z)


@pytest.mark.parametrize(("tokens", "dim"), [(196, 64), (4, 64)])  # i*j*(c+d) > c*d*(i+j): kv-first; else qk-first
def test_sla_kernel_equals_the_official_einsums_in_both_branches(tokens, dim):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.relu(torch.randn(6, tokens, dim, generator=gen, dtype=torch.float64)) for _ in range(3))
    branch = "kv" if tokens * tokens * 2 * dim > dim * dim * 2 * tokens else "qk"
    assert branch == ("kv" if tokens > dim else "qk")
    ours = linear_attention(q, k, v)
    torch.testing.assert_close(ours, _official_sla(q, k, v, branch), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, _official_sla(q, k, v, "qk" if branch == "kv" else "kv"), rtol=1e-9, atol=1e-9)


def _official_sla_module(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """The official SLA module's forward step for step (slab_deit.py / slab_pvt.py SimplifiedLinearAttention):
    ReLU kernel on q and on k + positional_encoding, heads split (einops ``b n (h c) -> (b h) n c``), the kernel,
    plus dwc over each head's values as a sqrt(N)-square map (``b (w h) c -> b c w h``), heads merged, proj."""
    b, n, c = x.shape
    h, d, side = attn.num_heads, c // attn.num_heads, math.isqrt(n)
    if hasattr(attn, "qkv"):  # SLAB-DeiT / SLAB-Swin: one qkv Linear
        q, k, v = attn.qkv(x).reshape(b, n, 3, c).permute(2, 0, 1, 3).unbind(0)
    else:  # SLAB-PVT: q and kv Linears
        q, (k, v) = attn.q(x), attn.kv(x).reshape(b, n, 2, c).permute(2, 0, 1, 3).unbind(0)
    q, k = torch.relu(q), torch.relu(k + attn.positional_encoding)
    q, k, v = (t.reshape(b, n, h, d).permute(0, 2, 1, 3).reshape(b * h, n, d) for t in (q, k, v))
    out = _official_sla(q, k, v, "kv") + attn.dwc(v.transpose(1, 2).reshape(b * h, d, side, side)).flatten(2).mT
    return attn.proj(out.reshape(b, h, n, d).permute(0, 2, 1, 3).reshape(b, n, c))


@pytest.mark.parametrize(
    "attn",
    [
        SimplifiedLinearAttention(32, 4, 16, kernel_size=3, float32_core=False),
        PvtLinearAttention(32, 4, 16, qkv_bias=True, kernel_size=3),
    ],
    ids=["deit-swin", "pvt"],
)
def test_sla_module_equals_the_official_forward(attn):
    torch.manual_seed(0)
    attn = attn.double()
    with torch.no_grad():
        attn.positional_encoding.normal_()  # zero-initialised: a kernel that ignored it would pass
    x = torch.randn(3, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        ours = attn(x, 4, 4) if isinstance(attn, PvtLinearAttention) else attn(x)  # PVT takes the map's sides
        torch.testing.assert_close(ours, _official_sla_module(attn, x), rtol=1e-12, atol=1e-12)


def test_swin_windows_and_shift_mask_match_the_official_construction():
    x = torch.randn(2, 8, 12, 5)
    windows = window_partition(x, 4)
    assert windows.shape == (2 * 2 * 3, 4, 4, 5)
    assert torch.equal(windows[1], x[0, 0:4, 4:8])  # row-major windows
    assert torch.equal(window_reverse(windows, 4, 8, 12), x)
    # official: regions of the rolled map labelled 0..8 by (slice(0,-w), slice(-w,-s), slice(-s,None)) bands
    h, w, win, s = 8, 12, 4, 2
    labels = np.zeros((h, w))
    bands = [(0, h - win, 0, w - win), (h - win, h - s, w - win, w - s), (h - s, h, w - s, w)]
    for a, (r0, r1, _, _) in enumerate(bands):
        for b, (_, _, c0, c1) in enumerate(bands):
            labels[r0:r1, c0:c1] = 3 * a + b
    flat = torch.from_numpy(labels).reshape(h // win, win, w // win, win).permute(0, 2, 1, 3).reshape(-1, win * win)
    expected = torch.where(flat[:, None, :] != flat[:, :, None], -100.0, 0.0).float()
    assert torch.equal(shifted_window_mask(h, w, win, s), expected)


def test_a_layernorm_swin_is_not_taken_for_a_prepbn_one():
    model = TINY["swin"].make(lambda c: nn.LayerNorm(c))
    with pytest.raises(UnsupportedModelError, match="could not detect"):
        detect_arch(model.state_dict(), {})


# --------------------------------------------------------------------------------------------- real fixtures

FIXTURES = sorted((ROOT / "fixtures").glob("*/checkpoint.pth"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.parent.name for p in FIXTURES])
def test_real_fixture_is_detected_built_strictly_and_folds(path: Path):
    ckpt = load_checkpoint(path)
    spec = detect_arch(ckpt.state_dict, ckpt.config)
    model = spec.build(ckpt.state_dict, ckpt.config, "checkpoint")
    model.load_state_dict(ckpt.state_dict, strict=True)
    model.eval()
    holdout = path.parent / "holdout.npz"
    shape = spec.input_shape(ckpt.state_dict, ckpt.config)
    x = torch.from_numpy(np.load(holdout)["x"][:8]) if holdout.exists() else torch.randn(8, *shape)
    assert tuple(x.shape[1:]) == shape
    gm = engine.capture(model, x)
    decisions = engine.fold_all(gm)
    assert all(d.action in ("folded-forward", "folded-backward") for d in decisions)
    reference = model(x)
    assert _rel_err(gm(x), reference) <= 1e-5
    assert math.isclose(float((gm(x).argmax(-1) == reference.argmax(-1)).float().mean()), 1.0)


@pytest.mark.parametrize(
    ("key", "prefix"),
    [
        ("slab_deit", "blocks.0.norm1"),
        ("swin", "layers.0.blocks.0.norm1"),
        ("pvt", "block1.0.norm1"),
        ("slab_cswin", "stage1.0.norm1"),
    ],
)
def test_a_family_named_for_weights_without_prepbn_norms_refuses_to_build(key, prefix):
    """``--arch`` names the family, but its first block holds no RepBN / LinearNorm statistics (a plain LayerNorm
    model): nothing to fold, and building it would read norms that are not there."""
    tiny = TINY[key]
    sd = {k: v for k, v in tiny.model(tiny.layout).state_dict().items() if ".bn." not in k}
    with pytest.raises(UnsupportedModelError, match=f"no RepBN / LinearNorm keys under {re.escape(prefix)}$"):
        get_arch(tiny.arch).build(sd, tiny.config, "checkpoint")
