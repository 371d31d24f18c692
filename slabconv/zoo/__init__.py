"""Architectures with the official SLAB key layouts, and the standard decoders of the LLaMA family; importing this
package registers them all."""

from slabconv.zoo import cswin as cswin  # noqa: F401  (registers the SLAB-CSWin presets)
from slabconv.zoo import deit as deit  # noqa: F401  (registers the DeiT presets)
from slabconv.zoo import llama as llama  # noqa: F401  (registers the LLaMA-PRepBN presets)
from slabconv.zoo import llama_std as llama_std  # noqa: F401  (registers the standard LLaMA / Mistral / Qwen2)
from slabconv.zoo import pvt as pvt  # noqa: F401  (registers the PVT-PRepBN / SLAB-PVT presets)
from slabconv.zoo import slab_deit as slab_deit  # noqa: F401  (registers the SLAB-DeiT presets)
from slabconv.zoo import swin as swin  # noqa: F401  (registers the Swin-PRepBN / SLAB-Swin presets)
from slabconv.zoo.registry import ArchSpec, detect_arch, get_arch, list_archs, register_arch

__all__ = ["ArchSpec", "detect_arch", "get_arch", "list_archs", "register_arch"]
