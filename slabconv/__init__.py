"""slabconv: fold SLAB's RepBN / BatchNorm norms into the layers around them, exactly, and prove it.

The Python API is ``slabconv.api`` (``fuse``, ``inspect``, ``export``, ``verify``, ``bench``); the fused model of
a folder ``fuse`` wrote is ``slabconv.load_fused(folder)``.
"""

from __future__ import annotations

from typing import Any

from slabconv.version import __version__

__all__ = ["__version__", "load_fused"]


def load_fused(out_dir: Any) -> Any:
    """The fused model of a folder ``fuse`` wrote, as an ``nn.Module`` (see ``slabconv.api.load_fused``)."""
    from slabconv.api import load_fused as load

    return load(out_dir)
