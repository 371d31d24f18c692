"""The full-size model of a sharded checkpoint, built without reading its big tensors: the streamed mode's
planning instance (``slabconv.pipeline``).

Every tensor with at most one axis longer than 1 (norm statistics and affines, biases, LayerScale gammas,
counters, 1-D buffers) is read for real: these are what the engine recognises norms by and derives their affines
from. Every other tensor (the weights) is a stand-in of the right shape and dtype that holds no memory (a zero
expanded to the shape); the engine plans their folds without their values (``plan_folds(unknown=...)``) and the
fold program reads them later, one block of rows at a time. The model is the zoo's, built as ``load_model``
builds it (same architecture, same dtype), with weight initialisation switched off so that nothing big is
written while it is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slabconv.errors import InputError, UnsupportedModelError
from slabconv.load.checkpoint import Checkpoint
from slabconv.load.model import LoadedModel, check_config_sizes, load_strict
from slabconv.load.shards import LazyShards
from slabconv.load.source import Source
from slabconv.util import block_pattern
from slabconv.zoo import detect_arch, get_arch


@dataclass
class PlanningModel:
    """The planning instance: the loaded model (stand-in weights), and the names of the stand-ins."""

    loaded: LoadedModel
    unknown: set[str]

    def block_values(self, shards: LazyShards, prefix: str, i: int) -> dict[str, torch.Tensor]:
        """Block ``i``'s tensors that the instance holds for real (vectors), read from ``shards`` and keyed by the
        instance's block-1 names (``prefix``: ``model.layers.{i}.``), in the instance's dtypes: what
        ``engine.Repeat.values`` gives the planner of a stack built with fewer blocks (``BlockSlots``)."""
        state, one = self.loaded.checkpoint.state_dict, prefix.format(i=1)
        keys = [k for k in state if k.startswith(one) and k not in self.unknown]
        read = shards.get_many([k.replace(one, prefix.format(i=i), 1) for k in keys])
        return {k: v.to(state[k].dtype) for k, v in zip(keys, read.values(), strict=True)}


def stack_depth(specs: dict[str, tuple[torch.dtype, list[int]]], prefix: str) -> int | None:
    """The number of blocks in a stack whose block ``i`` names start with ``prefix.format(i=i)``, when every block
    holds the same names with the same dtypes and shapes (None otherwise, or when there is no such stack)."""
    pattern = block_pattern(prefix)
    blocks: dict[int, dict[str, tuple[torch.dtype, list[int]]]] = {}
    for key, spec in specs.items():
        m = pattern.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), {})[key[m.end() :]] = spec
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        return None
    return len(blocks) if all(b == blocks[0] for b in blocks.values()) else None


class BlockSlots:
    """A sharded folder seen as if its stack held only blocks ``blocks`` of it, renumbered ``0, 1, ...`` (names
    outside the stack unchanged): what the planning instance of a deep decoder is built from (``planning_model``,
    ``engine.repeat``). Reads go to the real blocks' tensors.

    Args:
        shards: the folder.
        prefix: block ``i``'s names start with ``prefix.format(i=i)``.
        blocks: the real blocks kept, in order.
    """

    def __init__(self, shards: LazyShards, prefix: str, blocks: tuple[int, ...]):
        self.shards, self.prefix, self.blocks = shards, prefix, blocks
        self.folder = shards.folder
        self._pattern = block_pattern(prefix)

    def real(self, key: str) -> str:
        """The folder's name of a key of the view."""
        m = self._pattern.match(key)
        return key if m is None else self.prefix.format(i=self.blocks[int(m.group(1))]) + key[m.end() :]

    def specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """The view's tensors' (dtype, shape): the kept blocks renumbered, everything outside the stack."""
        slot = {b: s for s, b in enumerate(self.blocks)}
        out: dict[str, tuple[torch.dtype, list[int]]] = {}
        for key, spec in self.shards.specs().items():
            m = self._pattern.match(key)
            if m is None:
                out[key] = spec
            elif int(m.group(1)) in slot:
                out[self.prefix.format(i=slot[int(m.group(1))]) + key[m.end() :]] = spec
        return out

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors by the view's names."""
        read = self.shards.get_many([self.real(k) for k in keys])
        return dict(zip(keys, read.values(), strict=True))


def stand_in(shape: list[int]) -> bool:
    """True for a tensor the planning instance does not read (more than one axis longer than 1)."""
    return sum(1 for n in shape if int(n) > 1) > 1


@contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers do nothing while a model is built (its weights are replaced)."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def planning_model(
    shards: LazyShards | BlockSlots, config: dict[str, Any], arch: str | None, sha256: str
) -> PlanningModel:
    """Build the full-size model of ``shards`` with stand-in weights (see the module docstring); of a
    ``BlockSlots`` view, the model with only the view's blocks (the config's other entries as they are).

    Raises:
        UnsupportedModelError: the architecture cannot be detected (name it with ``--arch``) or built.
        InputError: the weights do not fit it.
    """
    specs = shards.specs()
    dtype = next((d for d, _ in specs.values() if d.is_floating_point), torch.float32)
    state: dict[str, torch.Tensor] = {}
    unknown: set[str] = set()
    read = shards.get_many([k for k, (_, shape) in specs.items() if not stand_in(shape)])
    for key, (d, shape) in specs.items():
        d = dtype if d.is_floating_point else d
        if stand_in(shape):
            state[key] = torch.zeros((), dtype=d).expand(shape)
            unknown.add(key)
        else:
            state[key] = read[key].to(d)
    label = str(shards.folder)
    check_config_sizes(config, label)
    try:
        spec = get_arch(arch) if arch else detect_arch(state, config)
        with _no_init():
            model = spec.build(state, config, "checkpoint")
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{label}: {err}") from None
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise InputError(f"{label}: cannot build {arch or 'the architecture'} from these weights ({err})") from None
    load_strict(model, state, spec.name, label, assign=True)
    model.to(dtype).eval()  # the buffers the checkpoint does not hold, as load_model makes them
    ckpt = Checkpoint(state, dict(config), "hf-safetensors-sharded", shards.folder, sha256)

    def make_input(batch: int, seed: int) -> torch.Tensor:
        return spec.example(state, config, batch, seed, dtype)

    input_shape = tuple(spec.input_shape(state, config))
    loaded = LoadedModel(model, ckpt, spec.name, input_shape, dtype, spec.input_dtype, make_input, dict(config))
    return PlanningModel(loaded, unknown)


@dataclass
class ShardedFolder:
    """A safetensors folder opened for a streamed fold: nothing but the index, the shard headers, the config and
    the vectors the planning instance reads is in memory. One ``model.safetensors`` is a folder of one shard.

    Attributes:
        shards: the lazy reader (a ``WeightStore``: ``get(key, rows)``, ``shape``, ``dtype``).
        shard_names: the shard files, in index order (``["model.safetensors"]`` for a single file).
        index: ``model.safetensors.index.json``, or the single ``model.safetensors``.
        config: ``config.json`` (empty when the folder has none: the architecture is then detected or ``--arch``).
    """

    shards: LazyShards
    shard_names: list[str]
    index: Path
    config: dict[str, Any]

    @cached_property
    def sha256(self) -> str:
        """The folder's digest, as an in-memory fold records it (``hf.folder_sha256``: every file read once)."""
        from slabconv.load.hf import folder_sha256

        return folder_sha256(self.shards.folder)

    def source(self, arch: str | None) -> Source:
        """The report's ``source`` block: format ``hf-safetensors-sharded`` (the shards and the index's sha256
        beside the folder's) or ``hf-safetensors`` (one file)."""
        from slabconv.util import sha256_file

        dtypes = sorted({str(d).removeprefix("torch.") for d, _ in self.shards.specs().values() if d.is_floating_point})
        sharded = self.sharded
        extra: dict[str, Any] = {"shards": self.shard_names, "index_sha256": sha256_file(self.index)} if sharded else {}
        if "num_hidden_layers" in self.config:
            extra["num_hidden_layers"] = self.config["num_hidden_layers"]
        dtype = dtypes[0] if len(dtypes) == 1 else ",".join(dtypes)
        fmt = "hf-safetensors-sharded" if sharded else "hf-safetensors"
        return Source(str(self.shards.folder), self.sha256, fmt, arch, dtype=dtype, extra=extra)

    @property
    def sharded(self) -> bool:
        """True for an index and its shards, False for one ``model.safetensors``."""
        return self.index.name != self.shard_names[0]


def open_sharded(folder: Path, block_elements: int) -> ShardedFolder:
    """Open a Hugging Face style safetensors folder for a streamed fold: ``model.safetensors.index.json`` + shards,
    or one ``model.safetensors`` (a folder of one shard).

    Raises:
        InputError: not a folder; a damaged index or config.
        UsageError: the folder's weights are not safetensors (``.bin``).
    """
    from slabconv.load import hf

    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder")
    shards = LazyShards.open(folder, block_elements)  # UsageError for .bin weights
    entry = folder / (hf.SAFETENSORS if (folder / hf.SAFETENSORS).is_file() else hf.SAFETENSORS_INDEX)  # as it opened
    config = hf.read_hf_config(folder) if (folder / hf.CONFIG).is_file() else {}
    names = list(dict.fromkeys(shards.weight_map.values()))
    hf.check_config_fits(config, {k: shape for k, (_, shape) in shards.specs().items()}, folder)  # headers only
    return ShardedFolder(shards, names, entry, config)
