"""A name given with --arch is checked against the weights (slabconv.zoo.registry.check_arch): widths and
depths through each family's signature, and the resolution where the weights fix it. Meta-device weights at
DeiT-Tiny's widths, so no memory is spent."""

from __future__ import annotations

import pytest
import torch

from slabconv.errors import UnsupportedModelError
from slabconv.zoo import detect_arch, get_arch
from slabconv.zoo.deit import VisionTransformer, norm_factory
from slabconv.zoo.registry import check_arch, checking_names, close_names


def _deit_tiny_widths(img_size: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = VisionTransformer(img_size, 16, 3, 1000, 192, 12, 3, 4.0, norm_factory("repbn"))
    return model.state_dict()


def test_a_fixed_resolution_preset_refuses_weights_for_another_resolution():
    sd = _deit_tiny_widths(32)
    assert detect_arch(sd, {}).name == "deit_prepbn"  # widths of DeiT-Tiny, but not its 224x224
    with pytest.raises(UnsupportedModelError) as err:
        check_arch(get_arch("deit_tiny_prepbn"), sd, {})
    assert str(err.value) == (
        "--arch deit_tiny_prepbn does not fit these weights: deit_tiny_prepbn is for 224x224 inputs, these weights "
        "for 32x32; pass --arch deit_prepbn, or leave --arch out to detect it"
    )
    check_arch(get_arch("deit_prepbn"), sd, {})  # the any-size entry takes them


def test_the_official_size_fits_its_preset_and_no_other():
    sd = _deit_tiny_widths(224)
    assert detect_arch(sd, {}).name == "deit_tiny_prepbn"
    check_arch(get_arch("deit_tiny_prepbn"), sd, {})
    with pytest.raises(UnsupportedModelError, match="those of deit_tiny_prepbn, not deit_small_prepbn"):
        check_arch(get_arch("deit_small_prepbn"), sd, {})


def test_only_the_command_line_checks_names_when_building():
    """Inside checking_names (every CLI command) a named preset refuses other weights at build; the library's
    plain get_arch builds a preset's class from any size, as tests and benchmarks do on purpose."""
    sd = _deit_tiny_widths(32)
    get_arch("deit_tiny_prepbn").build(sd, {}, "checkpoint")
    with checking_names(), pytest.raises(UnsupportedModelError, match="pass --arch deit_prepbn"):
        get_arch("deit_tiny_prepbn").build(sd, {}, "checkpoint")
    with checking_names():
        get_arch("deit_tiny_prepbn").build(sd, {}, "identity")  # fused weights: nothing to recognise a preset by


def test_close_names_ignore_case_and_give_the_nearest_first():
    assert close_names("deit_prebn")[0] == "deit_prepbn"
    assert close_names("slab_cswin_TINY")[0] == "slab_cswin_tiny"
    assert close_names("resnet50") == []
