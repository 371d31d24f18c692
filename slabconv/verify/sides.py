"""The two sides of a verification: what each one is, what it can run on, and whether one is a fold of the other.

A side is one of (``Side.kind``):

- ``model``: a model slabconv builds and traces (a checkpoint, a Hugging Face folder, a ``.pt2``, a fused
  ``model.safetensors``): PyTorch runs it, and as the reference it gives the float64 graph;
- ``onnx``: an ``.onnx`` file, run by the ONNX runtimes of ``BACKENDS``; as the reference (an ONNX original) its
  graph is evaluated in float64 (``slabconv.verify.onnx_original``);
- ``folder``: a folder ``fuse`` wrote (or is writing: ``fuse`` verifies its staging folder as this side):
  ``model.onnx`` in the ONNX runtimes, ``model.pt2`` in PyTorch, the fused weights for question 1;
- ``streamed``: a Hugging Face style decoder folder compared one decoder layer at a time (``verify --stream``,
  ``fuse --stream``).

Whether question 1 applies follows from what the two sides are (``fold_relation``): the candidate records that it
was folded (``Provenance.folded``) from a file whose sha256 is the reference's, for the same architecture. An
unfused export of the reference is not a fold of it; a reference that is a fold of the candidate is a swap of the
arguments, refused with the command that was meant.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slabconv.errors import InputError, SlabconvError, UnsupportedModelError, UsageError, first_line
from slabconv.load.fused import FusedMetadata, is_output_folder
from slabconv.load.source import Source
from slabconv.options import LoadOptions
from slabconv.util import sha256_file
from slabconv.write.hf_llama import MODELING_FILE


@dataclass(frozen=True)
class Provenance:
    """What a file slabconv wrote records about where it came from.

    Attributes:
        source_sha256: the sha256 of the file (or folder: ``hf.folder_sha256``) it was made from.
        arch: the architecture, when it records one.
        folded: it is a fold of that source (``fuse``, ``export``); False for ``export --no-fuse``.
        norm_affine: the fold took the affine of the LayerNorms / RMSNorms / GroupNorms too (``--fold-norm-affine``):
            question 1's float64 fold of the reference does the same.
        weights: which weights of a training checkpoint were folded (``model``, ``state_dict_ema``...), when it
            records them.
    """

    source_sha256: str
    arch: str | None
    folded: bool
    norm_affine: bool = False
    weights: str | None = None


@dataclass
class Side:
    """One side of a verification (see the module docstring).

    Attributes:
        path: the file or folder (for ``fuse``, the staging folder).
        source: the report's ``reference`` / ``candidate`` block.
        kind: ``model``, ``onnx``, ``folder`` or ``streamed``.
        loaded: the model slabconv built (``model``; a ``folder``'s, loaded when first needed), else None.
        graph, example: the traced original and the input it was traced with (``fuse`` gives them; otherwise
            the reference traces ``loaded`` when it needs its float64 graph).
        decisions: the fold's decisions (``fuse``), compared with the float64 fold's.
        fold64: the float64 fold of ``graph`` made already (``verify.reference.Float64Fold``: ``fuse --dtype`` cast
            the written tensors from it; question 1 hands its own to the localisation), taken where it is the fold
            the taker would make (``take_fold64``); else None.
        onnx: the ``.onnx`` of this side (its own file, or a folder's ``model.onnx``).
        pt2: a folder's ``model.pt2``.
        weights: a folder's fused weights (``model.safetensors`` or the shards' index).
        module: the side in PyTorch when no written program runs (``fuse``: the fused graph in memory).
        provenance: what the side records about its source (``Provenance``), else None.
        dtype: the dtype its weights are stored in.
        dynamic_sequence: its programs take any sequence length (question 2 then runs a shorter one too).
        program: the fold program of a ``streamed`` reference (question 1 of a streamed fold), made by the caller.
        language_model: a fused language-model folder (greedy generation is checked on it).
        notes: what the verdict should say about how this side was read (``why_not_a_fold`` adds them).
        unfused: of a candidate whose provenance records a fold of the reference: the tensors of the norms that
            fold removes which it holds all the same (``kept_norm_tensors``): it is no fold (``folded_from``).
        missing, changed: of a folder ``fuse`` wrote: the files its ``report.json`` lists that are not in it (named
            in the verdict, never covered by it), and those whose sha256 is not the one it records (a note).
    """

    path: Path
    source: Source
    kind: str
    loaded: Any = None
    graph: Any = None
    example: Any = None
    decisions: list[Any] | None = None
    fold64: Any = None
    onnx: Any = None
    pt2: Path | None = None
    weights: Path | None = None
    module: Any = None
    provenance: Provenance | None = None
    dtype: str = "float32"
    dynamic_sequence: bool = False
    program: Any = None
    language_model: bool = False
    notes: list[str] = field(default_factory=list)
    unfused: tuple[str, ...] = ()
    missing: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    @property
    def arch(self) -> str | None:
        return self.source.arch

    def traced(self) -> tuple[Any, Any]:
        """``(graph, example)`` of a ``model`` side: the traced original ``fuse`` gave, else the graph of a ``.pt2``
        of a dynamic batch (``LoadedModel.own_program``, as ``fuse`` plans it), else traced now with
        ``engine.capture`` (once: question 1 and the localisation share it)."""
        from slabconv import engine
        from slabconv.util import quiet

        if self.example is None:
            self.example = self.loaded.trace_example()
        if self.graph is None and self.loaded.own_program is not None:
            self.graph = engine.unlifted(self.loaded.own_program)
        if self.graph is None:
            with quiet():
                self.graph = engine.capture(self.loaded.model, self.example, sequence=self.loaded.max_sequence)
        return self.graph, self.example

    def take_fold64(self, norm_affine: bool) -> Any:
        """``fold64`` where it was made of ``traced()``'s very graph with ``norm_affine``, so of the same norms, plans
        and fold records a fresh ``float64_fold`` would make (``fold64`` is deterministic), else None; the side lets
        go of it either way (the caller holds it only as long as it needs it)."""
        made, self.fold64 = self.fold64, None
        same = made is not None and made.graph is self.traced()[0] and made.norm_affine == norm_affine
        return made if same else None

    def digests(self, whole: bool = False) -> set[str]:
        """Every sha256 that names this side as a source: its own, its files', and for a Hugging Face folder its
        weights entry file (the index); with ``whole``, also the folder digest every fold records
        (``slabconv.load.hf.folder_sha256``: every file hashed, so asked for only when the others do not match)."""
        found = {self.source.sha256 or ""} | set((self.source.extra.get("files_sha256") or {}).values())
        if self.path.is_dir():
            from slabconv.load import hf

            weights = hf.hf_weights_file(self.path)
            if weights is not None:
                found.add(sha256_file(weights[0]))
                if whole:
                    found.add(hf.folder_sha256(self.path))
        return found - {""}

    def built(self, load: LoadOptions | None = None) -> Any:
        """``loaded``, building it from ``path`` on first use (a folder's fused model).

        Raises:
            InputError, UnsupportedModelError: as ``load_model``.
        """
        if self.loaded is None:
            from slabconv.load.model import load_model

            self.loaded = load_model(self.path, load)
        return self.loaded


def onnx_provenance(proto: Any) -> Provenance | None:
    """The provenance an ``.onnx`` slabconv wrote records in its ``metadata_props`` (``SOURCE_KEY``,
    ``FOLDED_KEY``, ``ARCH_KEY``), else None. A file with a source and no ``FOLDED_KEY`` is a fold (what ``fuse``
    of an ONNX original writes)."""
    from slabconv.write.onnx import ARCH_KEY, FOLDED_KEY, NORM_AFFINE_KEY, SOURCE_KEY, WEIGHTS_KEY

    props = {p.key: p.value for p in proto.metadata_props}
    if not props.get(SOURCE_KEY):
        return None
    folded = props.get(FOLDED_KEY, "true") == "true"
    affine = props.get(NORM_AFFINE_KEY) == "true"
    return Provenance(props[SOURCE_KEY], props.get(ARCH_KEY) or None, folded, affine, props.get(WEIGHTS_KEY) or None)


def _fused_provenance(metadata: dict[str, str], label: str, folder: Path | None = None) -> Provenance | None:
    """The provenance a fused safetensors file's ``metadata`` records, else (``folder`` given) the one its folder's
    ``config.json`` records (``FusedMetadata.from_config``; a fused folder transformers loaded and saved again has
    safetensors without slabconv's metadata and keeps it there; a ``config.json`` that is a link is not read), else
    None.

    Raises:
        InputError: as ``FusedMetadata.read``; ``config.json`` is over the JSON limits or not JSON
            (``load.safety.read_json``), or its ``slabconv.provenance`` is not an object of strings.
    """
    from slabconv.load.safety import read_json

    fused = FusedMetadata.read(metadata, label) if metadata else None
    config = folder / "config.json" if folder is not None else None
    if fused is None and config is not None and config.is_file() and not config.is_symlink():
        fused = FusedMetadata.from_config(read_json(config), str(config))
    if fused is None or not fused.source_sha256:
        return None
    return Provenance(fused.source_sha256, fused.arch, True, fused.norm_affine, fused.source_weights)


def onnx_side(path: Path) -> Side:
    """An ``.onnx`` file as a side.

    Raises:
        InputError: as ``slabconv.load.onnx_file.read_onnx``.
    """
    from slabconv.load.onnx_file import read_onnx

    info = read_onnx(path)
    return Side(path, info.source(), "onnx", onnx=info, provenance=onnx_provenance(info.proto), dtype=info.dtype,
                dynamic_sequence=info.dynamic_sequence)  # fmt: skip


def output_side(folder: Path, source: Source | None = None) -> Side:
    """A folder ``fuse`` wrote, or the staging folder it is writing (``source`` given: the report's block is
    made by the caller), as a candidate: its ``model.onnx``, ``model.pt2`` and fused weights.

    Raises:
        InputError: an unreadable file in it (an ONNX file, a ``model.pt2`` whose zip directory cannot be read, a
            safetensors header), before any work.
    """
    from slabconv.load.hf import SAFETENSORS_INDEX
    from slabconv.load.onnx_file import read_onnx
    from slabconv.load.safety import check_zip

    onnx_path, pt2 = folder / "model.onnx", folder / "model.pt2"
    weights = next((folder / n for n in ("model.safetensors", SAFETENSORS_INDEX) if (folder / n).is_file()), None)
    info = read_onnx(onnx_path) if onnx_path.is_file() else None
    if pt2.is_file():  # its archive's directory, so a damaged or truncated one is refused before any work
        check_zip(pt2, str(pt2))
    side = Side(folder, source or Source(str(folder), None, "slabconv-output"), "folder", onnx=info,
                pt2=pt2 if pt2.is_file() else None, weights=weights)  # fmt: skip
    dtype, metadata = _weights_header(weights) if weights is not None else (None, {})
    side.provenance = _fused_provenance(metadata, str(weights), folder) if weights is not None else None
    side.language_model = fused_language_model(folder, side.provenance)
    if info is not None:  # the model read_onnx read and checked, not the file loaded again
        side.provenance = side.provenance or onnx_provenance(info.proto)
        side.dynamic_sequence = info.dynamic_sequence
    side.dtype = dtype or (info.dtype if info is not None else "float32")
    if source is None:
        side.source = _folder_source(side)
        side.missing, side.changed = _unlike_report(folder, side.source.extra["files_sha256"])
    return side


def _unlike_report(folder: Path, digests: dict[str, str]) -> tuple[list[str], list[str]]:
    """Of a folder ``fuse`` wrote: the files its ``report.json`` lists (``outputs.files``) that are not in it, and
    those whose sha256 (``digests``, by name) is not the one it records (``outputs.sha256``)."""
    from slabconv.load.paths import REPORT
    from slabconv.load.safety import read_json

    if not (folder / REPORT).is_file():  # a folder shared or saved again without it: nothing listed to hold it to
        return [], []
    report = read_json(folder / REPORT)
    outputs = report.get("outputs") if isinstance(report, dict) else None
    files, recorded = (outputs.get("files"), outputs.get("sha256")) if isinstance(outputs, dict) else (None, None)
    missing = [n for n in files if not (folder / str(n)).is_file()] if isinstance(files, list) else []
    changed = [n for n, d in recorded.items() if digests.get(n, d) != d] if isinstance(recorded, dict) else []
    return missing, changed


def _weights_header(path: Path) -> tuple[str | None, dict[str, str]]:
    """The floating dtype and the metadata of a safetensors file (of the first shard, for an index), read from
    its header only, and checked (``load.safetensors_file.read_header``: the tensors tile the data exactly), so a
    damaged or truncated file is refused when the folder is opened, before any work.

    Raises:
        InputError: the header is damaged, or the file is shorter than its tensors.
    """
    from slabconv.load.hf import SAFETENSORS_INDEX
    from slabconv.load.safetensors_file import read_header
    from slabconv.load.safety import read_json

    if path.name == SAFETENSORS_INDEX:
        index = read_json(path)
        shards = sorted(set((index.get("weight_map") or {}).values())) if isinstance(index, dict) else []
        if not shards:
            return None, {}
        path = path.parent / str(shards[0])
    with open(path, "rb") as f:
        metadata, entries, _ = read_header(f, str(path))
    floating = (str(dtype).removeprefix("torch.") for _, dtype, *_ in entries if dtype.is_floating_point)
    return next(floating, None), metadata


def _folder_source(side: Side) -> Source:
    """The report block of an output folder: its weights' (or ONNX file's) sha256, format ``slabconv-output``."""
    main = side.weights or (side.onnx.path if side.onnx is not None else None)
    files = {p.name: sha256_file(p) for p in (side.weights, side.pt2) if p is not None}
    if side.onnx is not None:
        files.update(side.onnx.files_sha256)
    shape = side.onnx.input_shape if side.onnx is not None else None  # what its model.onnx takes, batch aside
    return Source(str(side.path), sha256_file(main) if main is not None else None, "slabconv-output",
                  arch=side.provenance.arch if side.provenance else None, dtype=side.dtype,
                  input_shape=list(shape) if shape else None, extra={"files_sha256": files})  # fmt: skip


def model_side(loaded: Any, path: Path | None = None, **given: Any) -> Side:
    """A model slabconv built (``LoadedModel``) as a side; ``given``: ``graph``, ``example``, ``decisions``,
    ``fold64`` (``fuse`` hands over what it traced, planned and folded in float64)."""
    checkpoint = loaded.checkpoint
    source = loaded.source(path)
    provenance = None
    folder = Path(checkpoint.path) if checkpoint.format.startswith("hf-") else None  # its config.json
    if checkpoint.metadata or folder is not None:  # a fused model.safetensors, a model.pt2 (its extra file:
        # load.fused.PROGRAM_INFO), or a Hugging Face folder (a fused one records its source in config.json too)
        provenance = _fused_provenance(dict(checkpoint.metadata), str(checkpoint.path), folder)
    dtype = str(loaded.dtype).removeprefix("torch.")
    return Side(Path(path or checkpoint.path), source, "model", loaded=loaded, provenance=provenance, dtype=dtype,
                **given)  # fmt: skip


def open_side(path: Path, load: LoadOptions | None = None, reference: Side | None = None) -> Side:
    """The side at ``path``: an ``.onnx`` file, a folder ``fuse`` wrote (its ``report.json``, or a fused language
    model's Hugging Face files without it), else a model slabconv builds.

    Args:
        reference: given for a candidate: a ``.safetensors`` file slabconv cannot build on its own (a fused
            ``model.safetensors`` whose metadata was stripped, so nothing names its architecture) is read as the
            fused weights of the reference's architecture and config (``load_model``'s ``fused_like``); it records
            no source, so question 1 is not asked (the report's note says so).

    Raises:
        InputError, UnsupportedModelError, UsageError: as ``read_onnx`` / ``load_model``; for such a candidate,
            naming both readings that failed.
    """
    from slabconv.load.formats import engine_of
    from slabconv.load.model import load_model

    if engine_of(path) == "onnx":
        return onnx_side(path)
    if is_output_folder(path) or (path.is_dir() and is_fused_language_model(path)):  # report.json, or a fused LM's
        return output_side(path)  # Hugging Face folder as shared without it (config.json, modeling file, weights)
    try:
        return model_side(load_model(path, load), path)
    except (InputError, UnsupportedModelError) as err:
        like = reference.loaded if reference is not None and reference.kind == "model" else None
        if like is None or like.arch is None or path.suffix != ".safetensors" or not path.is_file():
            raise
        if FusedMetadata.read(_weights_header(path)[1], str(path)) is not None:
            # slabconv's metadata names a fused model these weights do not fill: the unfused weights with a fold's
            # metadata copied onto them are read as plain weights (the verifier then finds the norms it holds)
            try:
                return model_side(load_model(path, load, fused_like=(like.arch, like.config)), path)
            except (InputError, UnsupportedModelError):
                raise err from None
        try:
            side = model_side(load_model(path, load, fused_like=(like.arch, like.config)), path)
        except (InputError, UnsupportedModelError) as fused_err:
            raise InputError(
                f"{err}; nor is it the fused weights of the reference's architecture {like.arch!r} "
                f"({first_line(fused_err, 200)}): verify a folder fuse wrote, or a model.safetensors with its "
                "slabconv metadata"
            ) from None
        side.notes.append(
            f"{path.name} has no slabconv metadata, so it was read as the fused weights of the reference's "
            f"architecture {like.arch!r}"
        )
        return side


def streamed_side(folder: Path, program: Any = None) -> Side:
    """A Hugging Face style decoder folder compared one layer at a time; ``program``: the fold program of this
    folder when it is the reference of a fold (question 1).

    Raises:
        InputError, UnsupportedModelError: not a folder of a decoder family slabconv streams.
    """
    from slabconv.load import hf
    from slabconv.load.shards import LazyShards
    from slabconv.zoo.decoder import STANDARD, family_of

    if not folder.is_dir():
        raise UsageError(f"{folder}: --stream compares Hugging Face style folders; give the folder, not a file")
    shards = LazyShards.open(folder)
    family = family_of(shards.weight_map)
    found = hf.hf_weights_file(folder)
    assert found is not None
    arch = family.name
    if family is STANDARD:  # a standard decoder's architecture is its config's model_type (llama, mistral, qwen2)
        config = hf.read_hf_config(folder) if (folder / hf.CONFIG).is_file() else {}
        arch = str(config.get("model_type") or arch)
    source = Source(
        str(folder), hf.folder_sha256(folder), found[1], arch, extra={"index_sha256": sha256_file(found[0])}
    )
    dtype, metadata = _weights_header(found[0])
    provenance = _fused_provenance(metadata, str(found[0]), folder)
    return Side(folder, source, "streamed", provenance=provenance, dtype=dtype or "float32", program=program,
                language_model=fused_language_model(folder, provenance))  # fmt: skip


def is_fused_language_model(folder: Path) -> bool:
    """``fused_language_model`` of a folder, its provenance read from its weights' header only."""
    from slabconv.load.hf import SAFETENSORS_INDEX

    weights = next((folder / n for n in ("model.safetensors", SAFETENSORS_INDEX) if (folder / n).is_file()), None)
    if weights is None:
        return fused_language_model(folder, None)
    return fused_language_model(folder, _fused_provenance(_weights_header(weights)[1], str(weights), folder))


def fused_language_model(folder: Path, provenance: Provenance | None) -> bool:
    """A folder holding a fused language model that transformers generates with: slabconv's norm-free LLaMA (its
    modeling file), or a standard decoder (``config.json``'s ``model_type`` LLaMA / Mistral / Qwen2) that records
    being a fold (``fuse --fold-norm-affine`` writes it as its own architecture)."""
    from slabconv.load.safety import read_json
    from slabconv.write.hf_llama import STANDARD_TYPES

    if (folder / MODELING_FILE).is_file():
        return True
    if provenance is None or not provenance.folded or not (folder / "config.json").is_file():
        return False
    try:
        config = read_json(folder / "config.json")
    except SlabconvError:
        return False
    return isinstance(config, dict) and config.get("model_type") in STANDARD_TYPES


def folded_from(reference: Side, candidate: Side) -> bool:
    """``candidate`` records that it is a fold of ``reference``: its source's sha256 is one of the reference's
    (``Side.digests``), for the same architecture where both name one."""
    p = candidate.provenance
    if p is None or not p.folded or candidate.unfused:
        return False
    if p.source_sha256 not in reference.digests() and p.source_sha256 not in reference.digests(whole=True):
        return False
    if p.weights and reference.source.weights and p.weights != reference.source.weights:
        return False  # the same file, its other weights (--ema on one side only)
    return p.arch is None or reference.arch is None or same_architecture(p.arch, reference.arch)


def kept_norm_tensors(
    written: dict[str, Any], removed: list[dict[str, Any]], fold: dict[str, Any], by_value: bool = False
) -> tuple[str, ...]:
    """The tensors of the norms a fold removes that a file holds, when it holds some of every such norm's (else
    ``()``): a file whose metadata records a fold of the reference and that holds them is the unfused model
    (metadata copied by hand onto an export), not a fold. A fold never writes a tensor under a removed norm's name,
    and each of its tensors is a fold value rounded to its dtype, so a fold holds none of them; an export of the
    unfused model holds each norm's live parameters (an exporter may drop the dead ones, such as a progressive
    norm's finished LayerNorm branch, or merge some, hence some of every norm's rather than all).

    Args:
        written: the file's stored tensors by name (each in its stored dtype).
        removed: one entry per norm the fold removes: its parameters and statistics (``NormSite.param_names``)
            that the fold does not keep, by name.
        fold: the fold's tensors by name (float64).
        by_value: names may differ (an ``.onnx`` from another exporter): a removed tensor not held by name is
            also found as a stored tensor of its shape equal to it rounded to that tensor's dtype, where it holds
            two different values (a constant such as a fresh norm's weight of ones matches too much) and that
            stored tensor is no fold value of its shape rounded alike.

    Returns:
        the removed tensors the file holds, in ``removed``'s order, or ``()``.
    """
    import torch

    from slabconv.fold import rounded

    def held(name: str, tensor: Any) -> bool:
        got = written.get(name)
        if got is not None and tuple(got.shape) == tuple(tensor.shape):
            return True
        if not by_value or tensor.numel() < 2 or bool((tensor == tensor.flatten()[0]).all()):
            return False
        shape = tuple(tensor.shape)
        alike = [f for f in fold.values() if tuple(f.shape) == shape]
        return any(
            torch.equal(got, rounded(tensor, got.dtype))
            and not any(torch.equal(got, rounded(f, got.dtype)) for f in alike)
            for got in written.values()
            if tuple(got.shape) == shape and got.is_floating_point()
        )

    groups = [g for g in removed if g]
    found = [[name for name, tensor in g.items() if held(name, tensor)] for g in groups]
    if not groups or not all(found):
        return ()
    return tuple(name for names in found for name in names)


def same_architecture(a: str, b: str) -> bool:
    """Whether two architecture names read a file as the same model: the same name, an alias of it, or entries of
    one zoo family (``ArchSpec.family``: ``llama_350m_prepbn`` and ``llama_prepbn`` read the same decoder folder,
    its sizes from its config.json). A streamed decoder folder is named by its family's any-size entry
    (``streamed_side``), whichever ``--arch`` folded it. A family's entries that would fold one file differently
    (another default a file does not override) make question 1 fail, never skip it."""
    if a == b:
        return True
    from slabconv.zoo.registry import get_arch

    try:
        return get_arch(a).family == get_arch(b).family
    except UnsupportedModelError:  # a name this version does not know (another version's output): not the same
        return False


def fold_relation(reference: Side, candidate: Side, load: LoadOptions | None = None) -> bool:
    """Whether question 1 applies: the candidate is a fold of the reference (``folded_from``).

    Args:
        load: how the sides were read (``--arch``, ``--ema``...): the command meant keeps these options, and
            ``--stream`` for streamed sides, since without them the sides read are others (or do not fit in memory).

    Raises:
        UsageError: the reference is a fold of the candidate (the arguments are swapped), naming both and the
            command meant (its paths quoted for a POSIX shell, so it runs as pasted).
    """
    if folded_from(reference, candidate):
        return True
    if folded_from(candidate, reference):
        words = ["slabconv", "verify", str(candidate.path), str(reference.path)]
        words += ["--stream"] if reference.kind == "streamed" else []
        words += _load_options(load) if load is not None else []
        raise UsageError(
            f"the arguments are swapped: {reference.path} is a fold of {candidate.path}; the original comes first: "
            + shlex.join(words)
        )
    return False


def _load_options(load: LoadOptions) -> list[str]:
    """The command-line options that give ``load``."""
    words = ["--arch", load.arch] if load.arch else []
    words += ["--ema"] if load.ema else []
    words += ["--fold-norm-affine"] if load.fold_norm_affine else []
    words += ["--trust-pickle"] if load.trust_pickle else []
    words += ["--input-shape", ",".join(map(str, load.input_shape))] if load.input_shape else []
    words += ["--image-size", str(load.image_size)] if load.image_size else []
    return words


def why_not_a_fold(reference: Side, candidate: Side) -> str:
    """Why question 1 does not apply to this pair, in words (for the report's note)."""
    p, r = candidate.provenance, reference.provenance
    if candidate.unfused:
        shown = ", ".join(repr(k) for k in candidate.unfused[:3]) + (", ..." if len(candidate.unfused) > 3 else "")
        return (
            "the candidate records that it is a fold of the reference, but it holds the tensors of every norm that "
            f"fold removes ({len(candidate.unfused)}: {shown}): it is the unfused model, whatever its metadata says"
        )
    if candidate.source.sha256 and candidate.source.sha256 == reference.source.sha256:
        if candidate.path.resolve() == reference.path.resolve():
            return "the candidate is the reference itself (the same bytes); nothing was folded"
        ours, theirs = (dict((side.source.extra or {}).get("files_sha256") or {}) for side in (candidate, reference))
        differ = sorted(n for n, digest in ours.items() if theirs.get(n) not in (None, digest))
        if differ:  # one fold written twice with other options (--simplify, --opset): its weights alike
            return (
                f"the candidate's weights hold the same bytes as the reference's (sha256 {candidate.source.sha256[:12]}"
                f"...) and its {', '.join(differ)} differ{'s' if len(differ) == 1 else ''}: the same fold, written "
                "again with other options (--simplify, --opset); nothing was folded between them"
            )
        return (
            f"the candidate holds the same bytes as the reference (sha256 {candidate.source.sha256[:12]}..., a copy "
            "or the same fold written twice); nothing was folded between them"
        )
    if p is not None and p.folded and r is not None and p.source_sha256 == r.source_sha256:
        what = "a fused file, folded" if r.folded else "an unfused export (export --no-fuse)"
        return (
            f"the reference is {what} from the same source as the candidate; give that source first to ask whether "
            "the fold is exact"
        )
    if p is not None and p.folded and r is not None and r.folded:
        why = (
            f"the reference is a fused file too, and the two record different sources (sha256 "
            f"{r.source_sha256[:12]}... and {p.source_sha256[:12]}...)"
        )
        if all((side.path / "config.json").is_file() for side in (reference, candidate)):
            why += (
                ": other files, or one Hugging Face folder fused both in memory, which records the digest of its "
                "files, and with --stream, which records that of its weights file or index"
            )
        return why + "; give the original first to ask whether the fold is exact"
    if p is None and r is not None and not r.folded and r.source_sha256 in candidate.digests(whole=True):
        return "the reference is an unfused export (export --no-fuse) of the candidate; nothing was folded"
    if p is None and (candidate.path / "config.json").is_file():  # a Hugging Face folder: both places looked in
        return (
            "the candidate records no source it was folded from (neither its safetensors metadata nor the "
            "slabconv.provenance entry of its config.json names one)"
        )
    if p is None:
        return "the candidate records no source it was folded from" + "".join(f" ({n})" for n in candidate.notes)
    if not p.folded:
        return "the candidate is an unfused export of its source (export --no-fuse)"
    if p.source_sha256 not in reference.digests(whole=True):
        return "the candidate was folded from another file (its recorded source sha256 is not the reference's)"
    if p.weights and reference.source.weights and p.weights != reference.source.weights:
        return (
            f"the candidate was folded from the {p.weights!r} weights of this file, the reference is its "
            f"{reference.source.weights!r} weights: give --ema to both fuse and verify, or to neither"
        )
    return f"the candidate was folded for architecture {p.arch!r}, the reference is {reference.arch!r}"
