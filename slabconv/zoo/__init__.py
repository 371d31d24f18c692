"""Architectures with the official SLAB key layouts.

Their names are data (``slabconv.zoo.names``, read without torch); the family modules (``deit``, ``swin``, ...) that
build them are imported by the first look-up that needs a builder (``get_arch``, ``list_archs``, ``detect_arch``).
"""

from slabconv.zoo.registry import ArchSpec, detect_arch, get_arch, list_archs, register_arch

__all__ = ["ArchSpec", "detect_arch", "get_arch", "list_archs", "register_arch"]
