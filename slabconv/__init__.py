"""slabconv: fold SLAB's RepBN / BatchNorm norms into the layers around them, exactly, and prove it."""

__version__ = "0.1.0"
