"""slabconv's version, in a module of its own so every stage can stamp it without importing the package face."""

__version__ = "0.1.0"
