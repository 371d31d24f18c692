"""Stage 1, load: a checkpoint file or folder in, a runnable model out (``load_model`` -> ``LoadedModel``).

Every file is parsed as data first (``safety``): pickles through a weights-only loader with an allowlist,
archives and headers checked before anything is allocated, ``.pt2`` programs read without their code.

- ``formats``: the input formats, one table (``FORMATS``: how each is recognised, read, and which engine takes it).
- ``checkpoint``: the readers of the file formats (``.pth``/``.pt``/``.bin``, safetensors, ``.pt2``) into a
  ``Checkpoint``.
- ``hf``: Hugging Face folders (single file or sharded), read without importing ``transformers``.
- ``shards``: lazy block-wise reads of a sharded folder, for the streamed mode.
- ``model``: checkpoint -> ``LoadedModel`` (zoo lookup and strict load, or a program's module), its input shape,
  dtype and example inputs.
- ``fused``: the folders slabconv wrote, read back (their metadata contract).
- ``safety``: the readers that cannot run code or allocate what a hostile file asks for.
"""
