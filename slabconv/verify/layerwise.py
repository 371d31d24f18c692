"""Verification one decoder layer at a time, in bounded memory, for models too big to load whole.

For streamed folds (``fuse --stream``, ``verify --stream``). Both folders are read lazily (``LazyShards``).
A decoder layer comes from the zoo's ``DecoderFamily`` on the meta device; its norms are real modules loaded from
their (small) tensors, and each Linear is a ``StreamedLinear`` that reads its weight one block of output rows at a
time while it computes, so no weight is ever held whole.

The same two questions as an in-memory verification (``docs/verification.md``), layer by layer:

- **question 1** (``exact_streamed``): every written tensor equals its recipe in the fold program
  (``slabconv.engine.program``) run afresh in float64 over the source, block by block (at most ``policy.ULPS``
  units in the last place); a tensor the fold does not reach must be the source's, bit for bit. ``fuse`` and
  ``verify`` run it in a thread beside question 2 and the greedy generation (``ExactBeside``);
- **question 2**: on seeded random token sequences, three chains run side by side:

      exact     h64[i+1] = layer_i(h64[i])  the original layer in float64     (the reference)
      original  h[i+1]   = layer_i(h[i])    the original layer in its dtype
      fused     g[i+1]   = fused_i(g[i])    the fused layer in its dtype

  Check ``model.layers.i`` runs the original layer in float64 and in its dtype and the fused layer, all on the
  original chain's ``h[i]``: the same input, so it measures that layer's own fold. Check ``logits`` compares the
  three chains end to end, with next-token top-1 at every position (near-ties counted).

Memory: one block of one weight (``block_elements`` values) plus the activations of the three chains.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from slabconv.engine import FoldProgram, LayerRecipe, Scratch, cast_into, row_ranges
from slabconv.errors import InputError, UsageError
from slabconv.fold import rounded
from slabconv.load import hf
from slabconv.load.shards import LazyShards, return_freed_blocks_to_the_os
from slabconv.text import count
from slabconv.util import Progress, no_progress
from slabconv.verify import judge, policy
from slabconv.verify.generate import torch_threads
from slabconv.verify.results import ExactCheck, IntegrityCheck, Verification
from slabconv.verify.runtimes import as_numpy
from slabconv.write.shards import FOLD_LANES
from slabconv.zoo.decoder import DecoderFamily, family_of

DEFAULT_SEQUENCES = 2
DEFAULT_SEQ_LEN = 32


class StreamedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` read from the shards one block of output rows at a time, in ``x``'s dtype.

    Args:
        shards: the folder's reader.
        name: the Linear's state_dict prefix (``model.layers.3.mlp.up_proj``); ``<name>.bias`` is used when the
            folder has it (a fold created it).
        scratch: where a block cast to ``x``'s dtype is made (``engine.cast_into``: no fresh block-sized tensor per
            block; half precision widened to float64 through float32); None: a new tensor each block.
        keep_bias: read the bias (a vector) once and keep it, for a Linear run once per generated token (each read
            opens the shard); False: read it at each call.
    """

    def __init__(self, shards: LazyShards, name: str, scratch: Scratch | None = None, keep_bias: bool = False):
        super().__init__()
        self.shards, self.name, self.scratch = shards, name, scratch
        self.has_bias = f"{name}.bias" in shards.weight_map
        self.kept = shards.get(f"{name}.bias") if keep_bias and self.has_bias else None

    def _cast(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if block.dtype == dtype or self.scratch is None:
            return block.to(dtype)
        return cast_into(self.scratch, "linear", block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., in_features) -> (..., out_features), both in ``x``'s dtype."""
        key = f"{self.name}.weight"
        shape = self.shards.shape(key)
        y: torch.Tensor | None = None
        start = 0
        for block in self.shards.row_blocks(key, shape, reuse=True):
            part = F.linear(x, self._cast(block, x.dtype))
            if start == 0 and part.shape[-1] == shape[0]:
                y = part  # one block: the whole output
            else:  # each block's columns written into one output (no second copy of it, as a concatenation makes)
                y = x.new_empty((*x.shape[:-1], shape[0])) if y is None else y
                y[..., start : start + part.shape[-1]] = part
            start += part.shape[-1]
        assert y is not None
        if self.has_bias:
            bias = self.kept if self.kept is not None else self.shards.get(f"{self.name}.bias")
            y = y + bias.to(x.dtype)
        return y


class StreamedEmbedding(nn.Module):
    """``nn.Embedding`` whose table stays in the shards: each call reads the rows of the ids it is given.

    Args:
        shards: the folder's reader.
        key: the embedding weight ``(V, C)``.
        dtype: the dtype of the hidden states it returns.
    """

    def __init__(self, shards: LazyShards, key: str, dtype: torch.dtype):
        super().__init__()
        self.shards, self.key, self.dtype = shards, key, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ids ``(B, T)`` -> ``(B, T, C)`` in ``dtype``."""
        used = torch.unique(ids)
        rows = torch.cat([self.shards.rows(self.key, int(t), int(t) + 1) for t in used]).to(self.dtype)
        return rows[torch.searchsorted(used, ids)]


def stream_linears(module: nn.Module, streamed: Callable[[str], nn.Module]) -> None:
    """Replace every ``nn.Linear`` of ``module`` by ``streamed(its state_dict prefix within module)``, in place."""
    for owner_name, owner in list(module.named_modules()):
        for child_name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear):
                setattr(owner, child_name, streamed(f"{owner_name}.{child_name}" if owner_name else child_name))


@dataclass
class Folder:
    """One folder: its reader, every tensor's (dtype, shape), its norm layout (``identity`` once folded), the
    dtype of its weights, and its family and hyperparameters."""

    path: Path
    shards: LazyShards
    specs: dict[str, tuple[torch.dtype, list[int]]]
    family: DecoderFamily
    layout: str
    dtype: torch.dtype
    cfg: Any
    scratch: Scratch = field(default_factory=Scratch)

    @classmethod
    def open(cls, folder: Path, block_elements: int) -> Folder:
        """Read a folder's headers and config (no tensor data).

        Raises:
            InputError: not a folder, a damaged index or header.
            UnsupportedModelError: not a decoder family the streamed mode knows.
        """
        if not folder.is_dir():
            raise InputError(f"{folder}: not a folder; layer-by-layer verification reads Hugging Face style folders")
        shards = LazyShards.open(folder, block_elements)
        family = family_of(shards.weight_map)
        layout = family.norm_layout(shards.weight_map, family.layer_prefix.format(i=0) + family.layer_norms[0])
        specs = shards.specs()
        meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in specs.items()}
        cfg = family.config(meta, hf.read_hf_config(folder))
        dtype = specs[family.embed][0]
        return cls(folder, shards, specs, family, layout or "identity", dtype, cfg)

    def norm(self, prefix: str, dtype: torch.dtype) -> nn.Module:
        """The norm at ``prefix`` loaded strictly from its tensors, in ``dtype``, eval mode."""
        module = self.family.build_norm(self.layout, self.cfg)
        if self.layout == "identity":
            return module
        state = {k[len(prefix) + 1 :]: self.shards.get(k) for k in self.shards.weight_map if k.startswith(prefix + ".")}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise InputError(f"{self.path}: the norm {prefix} does not fit the {self.layout} layout ({err})") from None
        return module.to(dtype).eval()

    def layer(self, i: int, dtype: torch.dtype) -> nn.Module:
        """Decoder layer ``i`` in ``dtype``: built on the meta device, Linears streamed, norms real."""
        prefix = self.family.layer_prefix.format(i=i)
        layer = self.family.build_layer(self.cfg)
        stream_linears(layer, lambda name: StreamedLinear(self.shards, prefix + name, self.scratch))
        for name in self.family.layer_norms:
            setattr(layer, name, self.norm(prefix + name, dtype))
        return layer.eval()

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows of ``ids`` ``(B, T)`` -> ``(B, T, C)`` in ``dtype``, reading only the rows used."""
        return StreamedEmbedding(self.shards, self.family.embed, dtype)(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the head on hidden states ``h``, in ``h``'s dtype."""
        head = StreamedLinear(self.shards, self.family.head_key(self.shards.weight_map), self.scratch)
        return head(self.norm(self.family.final_norm, h.dtype)(h))


def exact_streamed(
    source: LazyShards,
    written: LazyShards,
    program: FoldProgram,
    *,
    lanes: int = FOLD_LANES,
    stop: threading.Event | None = None,
) -> ExactCheck:
    """Question 1 for a streamed output: every tensor of ``written`` against its recipe in the fold ``program``
    evaluated afresh in float64 over ``source``, block by block (``LayerRecipe.rows``): a folded weight or bias
    within ``policy.ULPS`` units in the last place of it, a copy bit for bit; a tensor with no recipe fails, and
    so does one the program writes that ``written`` lacks (``ExactCheck.missing``: the folder's weights).

    Args:
        lanes, stop: as ``tensor_distances``.

    Returns:
        An ``ExactCheck`` (method ``tensors``) over every tensor of ``written``.

    Raises:
        InputError: a shard changed or ends early.
        RuntimeError: ``stop`` was set.
    """
    worst, worst_name = 0.0, ""
    for key, distance in tensor_distances(source, written, program, lanes=lanes, stop=stop):
        worst, worst_name = max((worst, worst_name), (distance, key))
    label = f"{written.folder.name} vs a float64 run of the fold program over {source.folder.name}, block by block"
    missing = "" if not worst_name or worst_name in written.weight_map else f"{written.folder.name}'s weights"
    return judge.tensors_check(label, len(written.weight_map), worst, worst_name, missing=missing)


class ExactBeside:
    """Question 1 of a streamed fold (``exact_streamed``, on one lane) in a thread of its own while the caller runs
    the other checks (``verify.verifier``): they leave a core idle at times (importing transformers' model code
    before the greedy generation takes one; with ``--generate 0`` question 2 starts at once), and question 1 needs
    nothing from them. The thread reads the folders through readers of its own (``LazyShards`` opens a shard per
    read).

    ``result`` waits for the check and raises its error; ``close`` (also after ``result``; use ``with``) stops it
    after the block in hand and waits for the thread.

    Args:
        source, written: the original and the fused folder.
        program: the fold program of ``written``.
        block_elements: elements per block of rows read.
    """

    def __init__(self, source: Path, written: Path, program: FoldProgram, block_elements: int):
        src, out = LazyShards.open(source, block_elements), LazyShards.open(written, block_elements)
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="slabconv-question-1")
        self.future = self.pool.submit(exact_streamed, src, out, program, lanes=1, stop=self.stop)

    def done(self) -> bool:
        """Whether the check has ended."""
        return self.future.done()

    def result(self) -> ExactCheck:
        """The check, once it has ended.

        Raises:
            InputError: a shard changed or ends early (``exact_streamed``).
        """
        return self.future.result()

    def close(self) -> None:
        """Stop the check after the block in hand (when it still runs) and wait for its thread."""
        self.stop.set()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> ExactBeside:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_distances(
    source: LazyShards,
    written: LazyShards,
    program: FoldProgram,
    *,
    lanes: int = FOLD_LANES,
    stop: threading.Event | None = None,
) -> Iterator[tuple[str, float]]:
    """``(key, distance)`` of every tensor of ``written`` from its recipe in the fold ``program`` over ``source``
    (``exact_streamed``'s rule: units in the last place from a folded weight's or bias's float64 rows rounded
    once, a copy's units in the last place from its source (``_copy_distance``: 0 bit for bit), ``inf`` for a
    tensor with no recipe and for a tensor the fold writes that ``written`` lacks, a folded layer's bias included),
    in ``written``'s order (the lacking ones last), one block at a time: a key may come several times (its blocks),
    its distance the largest.

    Args:
        lanes: threads each block's cache-sized pieces are spread over (the writer's, ``write.shards.FOLD_LANES``,
            each on one torch thread); 1 beside other work (``ExactBeside``).
        stop: when set, the next block raises ``RuntimeError`` (``ExactBeside.close``).
    """
    layer_biases = {la.bias_out for la in program.layers.values() if la.bias_out}
    scratch = Scratch(lanes=lanes)

    def block_rows(shards: LazyShards, key: str, start: int, end: int, name: str) -> torch.Tensor:
        if stop is not None and stop.is_set():
            raise RuntimeError("question 1 was stopped")
        return _rows(shards, key, start, end, scratch, name)

    def distance(la: LayerRecipe, got: torch.Tensor, start: int, end: int) -> tuple[float, torch.Tensor | None]:
        """The written block's units in the last place from the float64 rows rounded once, and the block's part
        of the float64 bias. The common case first: the rounded rows made as the writer makes them, over the
        lanes (``LayerRecipe.rounded_block``), equal to the written block bit for bit (0 units); only a block that
        is not is measured in units (``judge.ulps``, from the float64 rows)."""
        want, b = la.rounded_block(scratch, source, start, end)
        if want.dtype == got.dtype and want.dtype.is_floating_point and judge.same_bits(got, want):
            return 0.0, b
        w, b = la.rows(source, start, end, scratch)
        return judge.ulps(got, w), b

    with closing(scratch), torch_threads(1):
        for key in written.weight_map:
            recipe = program.tensors.get(key)
            if key in program.layers:
                la = program.layers[key]
                parts = []
                for start, end in row_ranges(source.shape(key), written.block_elements):
                    d, b = distance(la, block_rows(written, key, start, end, "written"), start, end)
                    yield key, d
                    parts.append(b)
                if la.bias_out is not None:
                    bias = la.whole_bias(parts)
                    present = la.bias_out in written.weight_map
                    yield la.bias_out, judge.ulps(written.get(la.bias_out), bias) if present else math.inf
            elif key in layer_biases:
                continue  # checked with its weight
            elif recipe is not None and recipe.op == "unit" and recipe.source in source.weight_map:
                value = written.get(key)  # a norm weight whose affine folded: ones of the source's dtype
                same = value.dtype == source.dtype(recipe.source) and bool((value == 1).all())
                yield key, 0.0 if same and list(value.shape) == source.shape(recipe.source) else math.inf
            elif recipe is not None and recipe.op == "copy" and recipe.source in source.weight_map:
                src = recipe.source
                for start, end in row_ranges(source.shape(src), written.block_elements):
                    got = block_rows(written, key, start, end, "written")
                    yield key, _copy_distance(got, _rows(source, src, start, end, scratch, "source"))
            else:
                yield key, math.inf  # a tensor neither copied nor made by a fold
        for key in program.tensors:
            if key not in written.weight_map:
                yield key, math.inf  # a tensor the fold writes that ``written`` lacks


def _rows(shards: LazyShards, key: str, start: int, stop: int, scratch: Scratch, name: str) -> torch.Tensor:
    """Rows ``start:stop`` of ``key`` (whole when it has fewer than two dimensions), read into ``scratch``'s buffer
    ``name`` (valid until its next use): question 1 reads every written tensor once, and a block read into fresh
    memory costs the kernel's page faults on top of the read (``LazyShards.row_blocks``)."""
    shape = shards.shape(key)
    if len(shape) < 2:
        return shards.get(key)
    block = [max(0, min(stop, shape[0]) - start), *shape[1:]]
    return shards.get(key, slice(start, stop), out=scratch.take(name, block, shards.dtype(key)))


def _copy_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far a copied block is from its source block: 0 bit for bit; else, in the same floating dtype and shape,
    its units in the last place from the source (``judge.ulps``, the distance question 1 gives every other
    tensor, so a changed copy reads as how far it moved, not as "not finite"); 0 for the same values in another
    dtype (``torch.equal``); ``inf`` otherwise."""
    if judge.same_bits(got, want):
        return 0.0
    if got.shape == want.shape and got.dtype == want.dtype and got.dtype.is_floating_point:
        return judge.ulps(got, want.double())
    return 0.0 if torch.equal(got, want) else math.inf


def _keys_check(ref: Folder, cand: Folder) -> IntegrityCheck:
    """Every candidate tensor is a reference tensor, or a bias beside a reference weight (created by a fold), and
    every decoder layer of the candidate holds the same tensors (a fold gives every layer the same biases: a layer
    that lacks one its siblings have is a damaged folder, whose missing tensor the layers' outputs may not show)."""
    name = f"tensor names {cand.path.name} within {ref.path.name}"
    extra = [
        k
        for k in cand.shards.weight_map
        if k not in ref.shards.weight_map
        and not (k.endswith(".bias") and k.removesuffix(".bias") + ".weight" in ref.shards.weight_map)
    ]
    if extra:
        return IntegrityCheck(name, False, f"{count(len(extra), 'tensor')} the reference lacks, first {extra[0]!r}")
    family, layers = cand.family, range(cand.family.num_layers(cand.cfg))
    templates = {family.template(k) for k in cand.shards.weight_map if family.template(k) != k}
    missing = [family.instance(t, i) for t in sorted(templates) for i in layers]
    missing = [k for k in missing if k not in cand.shards.weight_map]
    if missing:
        return IntegrityCheck(
            name, False, f"{count(len(missing), 'tensor')} that other decoder layers have missing, first {missing[0]!r}"
        )
    return IntegrityCheck(name, True, f"{len(cand.shards.weight_map)} tensors, all known to the reference")


def _forward_config(cfg: Any) -> Any:
    """A decoder config less what does not change its forward: ``pad_token_id`` (the embedding's padding row is
    read as any other; it only keeps that row's gradient at zero). transformers' ``save_pretrained`` writes
    ``pad_token_id: null`` where a config had none, which the zoo reads as no padding row, where the original's
    default is 0: the same model."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) and hasattr(cfg, "pad_token_id"):
        return dataclasses.replace(cfg, pad_token_id=None)
    return cfg


def _config_difference(ref: Any, cand: Any) -> str:
    """What differs between two decoder configs (dataclasses), for the message: ``differ in rope_theta (10000.0 vs
    500000.0)``; ``have different sizes`` for configs of no dataclass."""
    if not (dataclasses.is_dataclass(ref) and dataclasses.is_dataclass(cand)):
        return "have different sizes"
    ref, cand = _forward_config(ref), _forward_config(cand)
    names = [f.name for f in dataclasses.fields(ref) if getattr(ref, f.name) != getattr(cand, f.name, None)]
    if not names:
        return "have different sizes"
    first = names[0]
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"differ in {first} ({getattr(ref, first)} vs {getattr(cand, first, None)}){more}"


def verify_folders(
    reference: Path | str,
    candidate: Path | str,
    *,
    sequences: int = DEFAULT_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    strict: bool = False,
    block_elements: int = 1 << 22,
    ids: torch.Tensor | None = None,
    inputs: str = "",
    inputs_sha256: str | None = None,
    on_exact_logits: Callable[[torch.Tensor, float], None] | None = None,
    progress: Progress = no_progress,
) -> Verification:
    """Question 2 for two decoder folders (sharded or single safetensors), one decoder layer at a time (question 1:
    ``exact_streamed``, or ``ExactBeside`` beside this).

    Args:
        reference: the original folder (RepBN norms).
        candidate: the fused folder (or any folder of the same model; each side runs with its own norms). Both
            run in the reference's dtype, or in the candidate's where that is narrower (a float16 folder of a
            float32 original: the original's own error is then that of the original cast to float16, as in memory).
        sequences, seq_len, seed: the inputs: seeded random token ids ``(sequences, seq_len <= positions)``.
        rtol, atol, strict: as ``judge.judge_output``.
        block_elements: elements per weight block read (the memory bound).
        ids: int64 ``(B, T <= positions)``: the inputs instead of random ones (the streamed generation check's
            prompts and the fused folder's tokens: ``generate_streamed.FusedRun.sequences``), described in the
            report by ``inputs``; ``inputs_sha256``: the sha256 of the file they came from (``--inputs``,
            ``holdout.npz``), None for seeded ones, as in memory.
        on_exact_logits: called with the float64 chain's logits, float64 ``(B, T, V)``, and question 2's seconds (the
            streamed generation check's reference).
        progress: called once per layer.

    Returns:
        A ``Verification``: the folders' tensor names compared, a check per decoder layer, the logits.

    Raises:
        InputError, UnsupportedModelError: not decoder folders of a known family, different sizes.
        UsageError: fewer than one sequence or token.
    """
    if sequences < 1 or seq_len < 1:
        raise UsageError(f"--samples must be at least 1 (got {sequences}); seq_len too (got {seq_len})")
    ref, cand = Folder.open(Path(reference), block_elements), Folder.open(Path(candidate), block_elements)
    return_freed_blocks_to_the_os()
    if _forward_config(cand.cfg) != _forward_config(ref.cfg):
        raise InputError(
            f"{reference} and {candidate} {_config_difference(ref.cfg, cand.cfg)}; they are not the same model"
        )
    family, cfg, dtype = ref.family, ref.cfg, ref.dtype
    if cand.dtype.itemsize < dtype.itemsize:  # held to the reference cast to the candidate's dtype (as in memory)
        dtype = cand.dtype
    name = policy.dtype_name(dtype)
    if ids is None:
        t = max(1, min(seq_len, family.max_positions(cfg)))
        ids = torch.randint(0, family.vocab_size(cfg), (sequences, t), generator=torch.Generator().manual_seed(seed))
        inputs = f"{sequences} random token sequences of length {t}, seed {seed}"
    sequences, t = ids.shape
    verification = Verification(
        inputs=inputs,
        inputs_sha256=inputs_sha256,
        reference="the original model in float64 (pytorch), one decoder layer at a time",
        runtime=f"pytorch {torch.__version__} {name}, one decoder layer at a time",
    )
    if dtype != ref.dtype:
        verification.notes.append(
            f"the candidate is stored in {name}, the reference in {policy.dtype_name(ref.dtype)}: the original's own "
            f"error is that of the reference cast to {name}"
        )
    verification.integrity.append(_keys_check(ref, cand))
    layers = family.num_layers(cfg)
    started = time.perf_counter()
    # the float64 chain in a thread of its own, on a reader of its own (a reader's reused buffer serves one thread),
    # while this one runs the half-precision chains: each layer's runs need only the last layer's outputs
    ref64 = Folder.open(Path(reference), block_elements)
    with torch.no_grad(), ThreadPoolExecutor(1, thread_name_prefix="slabconv-float64-chain") as chain64:
        h64, h, g = ref.embed(ids, torch.float64), ref.embed(ids, dtype), cand.embed(ids, dtype)
        for i in range(layers):
            progress("verifying: question 2, one decoder layer at a time", i, layers, f"decoder layer {i}")
            extra64, extra = family.layer_inputs(cfg, i, t, torch.float64), family.layer_inputs(cfg, i, t, dtype)
            running = chain64.submit(_no_grad, ref64.layer(i, torch.float64), torch.cat([h.double(), h64]), *extra64)
            original = ref.layer(i, dtype)(h, *extra)
            both = cand.layer(i, dtype)(torch.cat([h, g]), *extra)
            fused, g = both[:sequences], both[sequences:]
            both64 = running.result()
            exact, h64 = both64[:sequences], both64[sequences:]
            verification.checks.append(
                judge.judge_output(
                    f"model.layers.{i} @ pytorch {name}",
                    fused.double().numpy(),
                    dtype=name,
                    original=original.double().numpy(),
                    reference64=exact.numpy(),
                    rtol=rtol,
                    atol=atol,
                    strict=strict,
                )
            )
            h = original
        progress("verifying: question 2, one decoder layer at a time", layers, layers, "final norm and head")
        running = chain64.submit(_no_grad, ref64.logits, h64)
        fused_logits, original_logits = as_numpy(cand.logits(g), narrow=True), as_numpy(ref.logits(h), narrow=True)
        logits64 = running.result()
        verification.checks.append(
            judge.judge_output(f"logits @ pytorch {name}", fused_logits, dtype=name, original=original_logits,
                               reference64=logits64.numpy(), rtol=rtol, atol=atol, strict=strict, token_logits=True)
        )  # fmt: skip
    if on_exact_logits is not None:
        on_exact_logits(logits64, time.perf_counter() - started)
    return verification


def _no_grad(run: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``run(*args)`` under ``no_grad``, which is per thread: what question 2's float64 thread runs."""
    with torch.no_grad():
        return run(*args)


class _FoldShards:
    """The correct fold of a streamed output as a reader: each folded Linear's rows from the fold ``program`` run
    in float64 over ``source`` and rounded once to ``dtype`` (what question 1 requires), every other tensor read
    from ``written``; what ``StreamedLinear`` and ``Folder.norm`` read, block by block."""

    def __init__(self, source: LazyShards, written: LazyShards, program: FoldProgram, dtype: torch.dtype):
        self.source, self.written, self.program, self.dtype = source, written, program, dtype
        self.block_elements = written.block_elements
        self.biases = {la.bias_out: la for la in program.layers.values() if la.bias_out}
        # every bias the fold makes, also one ``written`` lacks: the correct fold's Linear has it
        self.weight_map = {
            **written.weight_map,
            **{b: written.weight_map.get(la.weight, "") for b, la in self.biases.items()},
        }

    def shape(self, key: str) -> list[int]:
        return self.written.shape(key)

    def row_blocks(self, key: str, shape: list[int], reuse: bool = False) -> Any:
        la = self.program.layers.get(key)
        if la is None:
            yield from self.written.row_blocks(key, shape, reuse)
            return
        for start, stop in row_ranges(self.source.shape(key), self.block_elements):
            yield rounded(la.rows(self.source, start, stop)[0], self.dtype)

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        la = self.biases.get(key)
        if la is None:
            return self.written.get(key, rows)
        parts = [
            la.rows(self.source, a, b)[1] for a, b in row_ranges(self.source.shape(la.weight), self.block_elements)
        ]
        bias = torch.cat([b for b in parts if b is not None])
        return rounded(bias, self.dtype)[rows if rows is not None else slice(None)]


def localize_folders(reference: Path, candidate: Path, program: FoldProgram, seed: int = 0) -> Any:
    """The fold boundaries of a streamed fold, in data-flow order (``slabconv.verify.localize``): for each decoder
    layer, on the reference's float64 hidden states of one seeded token sequence, the candidate layer and the
    correct fold's layer (``_FoldShards``) run in float64, and each folded Linear's output is compared; then, where
    the final norm folded into the head, the logits of both on the reference's last hidden states.

    Yields:
        A ``Boundary`` per folded Linear: the norms folded into it, its name, the relative error between the two.
    """
    from slabconv.verify.results import Boundary

    ref, cand = Folder.open(Path(reference), 1 << 22), Folder.open(Path(candidate), 1 << 22)
    fold = Folder(cand.path, _FoldShards(ref.shards, cand.shards, program, cand.dtype), cand.specs,  # type: ignore[arg-type]
                  cand.family, cand.layout, cand.dtype, cand.cfg)  # fmt: skip
    family, cfg = ref.family, ref.cfg
    t = max(1, min(DEFAULT_SEQ_LEN, family.max_positions(cfg)))
    ids = torch.randint(0, family.vocab_size(cfg), (1, t), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        h64 = ref.embed(ids, torch.float64)
        for i in range(family.num_layers(cfg)):
            extra64 = family.layer_inputs(cfg, i, t, torch.float64)
            got, want = (
                _linear_outputs(cand.layer(i, torch.float64), h64, extra64),
                _linear_outputs(fold.layer(i, torch.float64), h64, extra64),
            )
            for name, value in got.items():
                la = program.layers.get(name + ".weight")
                if la is not None and name in want:
                    error = judge.rel_err(value.numpy(), want[name].numpy())[0]
                    yield Boundary(", ".join(dict.fromkeys(la.norms)), name, error, policy.EXACT_RTOL)
            h64 = ref.layer(i, torch.float64)(h64, *extra64)
        head = family.head_key(cand.shards.weight_map)
        la = program.layers.get(head + ".weight")
        if la is not None:  # the final norm folded into the head: its boundary is the logits
            error = judge.rel_err(cand.logits(h64).numpy(), fold.logits(h64).numpy())[0]
            yield Boundary(", ".join(dict.fromkeys(la.norms)), head, error, policy.EXACT_RTOL)


def _linear_outputs(layer: nn.Module, h: torch.Tensor, extra: Any) -> dict[str, torch.Tensor]:
    """The output of every ``StreamedLinear`` of ``layer`` on ``h``, by its state_dict prefix, in call order."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out: outputs.__setitem__(mod.name, out.detach().double()))
        for m in layer.modules()
        if isinstance(m, StreamedLinear)
    ]
    try:
        layer(h, *extra)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs
