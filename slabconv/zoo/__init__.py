"""Architectures with the official SLAB key layouts; importing this package registers them all."""

from slabconv.zoo import deit as deit  # noqa: F401  (registers the DeiT presets)
from slabconv.zoo.registry import ArchSpec, detect_arch, get_arch, list_archs, register_arch

__all__ = ["ArchSpec", "detect_arch", "get_arch", "list_archs", "register_arch"]
