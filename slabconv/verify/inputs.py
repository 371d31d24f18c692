"""The inputs a verification runs on: an ``.npz`` or ``.npy``, the ``holdout.npz`` beside a checkpoint, or seeded
samples.

An inputs file is sized before it is read (``docs/security.md``): the array's ``.npy`` header (numpy's
``numpy.lib.format``) gives its dtype and shape, which must be real numbers of the model's input shape, whose bytes
must be what the file stores, within ``MAX_INPUT_BYTES``, and a compressed ``.npz`` member may expand at most
``MAX_INFLATION`` times. Only then is the array read, from the same open file.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path
from typing import IO

import numpy as np
import torch

from slabconv.errors import InputError, UsageError
from slabconv.load import safety
from slabconv.load.model import LoadedModel
from slabconv.text import shown

MAX_INPUT_BYTES = 4 << 30
"""The most bytes an inputs array may take (as stored); verification holds it a few times over in float64."""

MAX_INFLATION = 64
"""A compressed ``.npz`` member may expand at most this many times (plus 1 MiB): real inputs compress 1-10x."""

_INFLATION_FLOOR = 1 << 20
_INT64_MAX = int(np.iinfo(np.int64).max)
_MAX_HEADER = 10_000  # numpy's own default limit for an .npy header


def choose_inputs(
    loaded: LoadedModel | None,
    inputs: Path | str | None,
    samples: int,
    seed: int,
    input_shape: tuple[int, ...] | None = None,
    limit: int | None = None,
    token_input: bool = False,
) -> tuple[np.ndarray, str, str | None]:
    """The verification inputs: ``inputs`` (an ``.npz`` or ``.npy``), else ``holdout.npz`` beside the checkpoint,
    else ``samples`` seeded standard-normal samples of the model's input shape.

    ``limit`` (an explicit ``--samples``) takes the first ``limit`` samples of an ``.npz``; its label says so.
    A language model's ids (``LoadedModel.max_sequence``) may have any row length from 2 to its positions
    (``check_sequences``).
    ``token_input``: the model takes token ids, when there is no ``loaded`` model to say so; ids from a file are
    checked against ``loaded``'s ``id_range`` (``check_token_ids``) before anything runs.

    Returns:
        ``(x, label, sha256 of the file or None)``.

    Raises:
        UsageError: no input shape is known (dynamic ONNX axes) and no ``inputs`` were given.
        InputError: an inputs file that is not a regular file, unreadable, of the wrong shape or dtype, too large,
            or token ids outside the model's vocabulary.
    """
    shape = loaded.input_shape if loaded is not None else input_shape
    path = Path(inputs) if inputs else None
    if path is None and loaded is not None:
        path = holdout_beside(loaded.checkpoint.path)
    if path is None:
        if shape is None:
            raise UsageError("the input shape is not fixed by the models; pass --inputs NPZ or --input-shape C,H,W")
        label = f"random(seed={seed}, samples={samples})"
        if loaded is not None:
            if loaded.token_input and loaded.make_input is None:
                raise UsageError("the model takes token ids and their range is unknown; pass --inputs NPZ")
            x = loaded.example(samples, seed)
            # numpy has no bfloat16: float inputs travel as float32 and each runner casts them to its dtype.
            return (x.float() if x.is_floating_point() else x).numpy(), label, None
        return standard_normal(samples, shape, seed), label, None
    integer = loaded.token_input if loaded is not None else token_input
    longest = loaded.max_sequence if loaded is not None else None
    arr, digest = read_inputs_file(
        path, None if longest else shape, integer, loaded.id_range if loaded is not None else None
    )
    if longest:
        check_sequences(arr, path, longest)
    if limit is not None and limit < len(arr):
        return arr[:limit], f"{path} (its first {limit} of {len(arr)} samples: --samples {limit})", digest
    return arr, str(path), digest


def holdout_beside(checkpoint: Path) -> Path | None:
    """The ``holdout.npz`` beside a checkpoint file or in a model folder, the inputs of every mode (in memory and
    ``--stream``) when ``--inputs`` is not given; None where there is none."""
    beside = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "holdout.npz"
    return beside if beside.exists() else None


def read_inputs_file(
    path: Path, input_shape: tuple[int, ...] | None, integer: bool, id_range: int | None
) -> tuple[np.ndarray, str]:
    """An ``--inputs`` file's array (``read_inputs``: float32 ``(N, *input_shape)``, int64 with ``integer``) and
    the sha256 of the file, read through one open (the digest is of the array read); with ``integer`` its token
    ids are checked against ``id_range`` (``check_token_ids``).

    Raises:
        InputError: a missing or non-regular file (``safety.open_regular``); as ``read_inputs`` and
            ``check_token_ids``.
    """
    with safety.open_regular(path, "--inputs") as f:
        arr = read_inputs(f, path, input_shape, integer=integer, id_range=id_range)
        digest = safety.sha256_open(f)
    return arr, digest


def standard_normal(samples: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """``(samples, *shape)`` float32 standard-normal samples drawn as ``LoadedModel.example`` draws them
    (``torch.randn`` from a generator seeded with ``seed``): one model through any door (checkpoint, ``.pt2``,
    ONNX file) is verified on the same ``random(seed=...)`` inputs."""
    return torch.randn((samples, *shape), generator=torch.Generator().manual_seed(seed)).numpy()


def check_token_ids(arr: np.ndarray, path: Path, id_range: int | None) -> None:
    """Refuse token ids from a file that the model cannot look up, before anything runs: a negative id always (an
    embedding has no row -1; ONNX's Gather would even read from the end), an id at or over ``id_range`` (the
    embedding's row count) when it is known, else one above int64's range. ``arr`` is the file's own integer array,
    checked before any cast to int64 (which would wrap a uint64 id above int64's range to a negative one).

    Raises:
        InputError: one line naming the file, the id and the bound.
    """
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        return
    low, high = int(arr.min()), int(arr.max())  # Python ints: a uint64 id above int64's range keeps its value
    if id_range is None and high > _INT64_MAX:
        raise InputError(
            f"{shown(path)}: token id {high} is above int64's largest value ({_INT64_MAX}), which no model takes; give "
            "ids the model knows"
        )
    if id_range is not None and (low < 0 or high >= id_range):
        bad = low if low < 0 else high
        raise InputError(
            f"{shown(path)}: token id {bad} is outside the model's vocabulary (0..{id_range - 1}); give ids the "
            "model knows"
        )
    if low < 0:
        raise InputError(f"{shown(path)}: token id {low} is negative; give ids the model knows (0 or more)")


def check_sequences(arr: np.ndarray, path: Path, longest: int) -> None:
    """Refuse token ids from a file that are not rows ``(N, T)`` with ``2 <= T <= longest``: a language model takes
    any length up to its ``max_position_embeddings`` (``longest``), and its checks need a next token to predict.

    Raises:
        InputError: one line naming the file, its shape and the lengths the model takes.
    """
    if arr.ndim != 2 or not 2 <= arr.shape[1] <= longest:
        raise InputError(
            f"{shown(path)}: inputs have shape {tuple(arr.shape)}, the model takes token ids (N, T) with T from 2 to "
            f"{longest} (its max_position_embeddings); give N rows of 2 to {longest} tokens"
        )


def check_inputs_file(path: Path) -> None:
    """Refuse ``--inputs`` that could not be verification inputs before any work (a fold and its files take seconds
    to minutes): every check ``read_inputs`` makes from the header of the array it reads (``x``, or an ``.npz``'s
    only array), without reading its data. What needs the model (the input shape, integer ids and their range, the
    arrays of a model with several inputs) is checked when the verification reads the file.

    Raises:
        InputError: a missing or non-regular file (``safety.open_regular``); as ``read_inputs`` but for the model's
            shape and dtype.
    """
    with safety.open_regular(path, "--inputs") as f:
        read_inputs(f, path, None, check_only=True)


def _check_not_a_model(archive: zipfile.ZipFile, path: Path) -> None:
    """Refuse a model file (a torch.save checkpoint or a torch.export program: zip archives too) given as inputs."""
    kind = safety.sniff_contents(b"", archive.namelist())
    if kind in ("pickle", "torch.export"):
        what = "a PyTorch checkpoint" if kind == "pickle" else "a torch.export program"
        raise InputError(
            f"{path}: is {what}, not verification inputs; give it as the model argument, and with --inputs an .npz "
            "of the inputs (numpy.savez(path, x=x))"
        )


_NOT_ARRAYS = "{path}: not a readable .npz or .npy file; save the inputs with numpy.savez(path, x=x)"


def read_inputs(
    f: IO[bytes],
    path: Path,
    input_shape: tuple[int, ...] | None,
    integer: bool = False,
    id_range: int | None = None,
    check_only: bool = False,
) -> np.ndarray:
    """The inputs array of an open ``.npz`` (``x``, or its only array) or ``.npy``, checked from its header before
    any of it is read.

    ``x`` is returned as float32 ``(N, *input_shape)``, or as int64 with ``integer`` (token ids of a language
    model: checked against ``id_range`` by ``check_token_ids`` in the file's own dtype before the cast).

    Raises:
        InputError: not an ``.npz`` / ``.npy``, no array ``x``, an object / complex / text dtype, a header whose
            shape does not fit the stored bytes, more than ``MAX_INPUT_BYTES``, a member compressed more than
            ``MAX_INFLATION`` times, a shape that is not ``(N, *input_shape)``, no sample, or with ``integer`` a dtype
            that is not an integer one (token ids saved as floats are refused, not rounded); with ``integer``, ids
            ``check_token_ids`` refuses.

    With ``check_only`` nothing but that array's header is read (``check_inputs_file``) and an empty array is
    returned.
    """
    size = os.fstat(f.fileno()).st_size
    head = f.read(6)
    f.seek(0)
    if head.startswith(b"PK"):
        x = _read_npz(f, path, input_shape, integer=integer, check_only=check_only)
    elif head.startswith(b"\x93NUMPY"):
        shape, dtype, offset = _header(f, path, "the array")
        _check_array(path, "the array", shape, dtype, size - offset, input_shape, integer)
        if check_only:
            return np.empty(0)
        f.seek(0)
        x = _load(lambda: np.load(f, allow_pickle=False), path)
    else:
        raise InputError(_NOT_ARRAYS.format(path=path))
    if integer:
        check_token_ids(x, path, id_range)
    return np.asarray(x, dtype=np.int64 if integer else np.float32)


def _load(read, path: Path) -> np.ndarray:  # type: ignore[no-untyped-def]
    try:
        return np.asarray(read())
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError) as err:
        raise InputError(f"{path}: not a readable .npz file ({str(err).strip()[:200]})") from None


def load_npz_members(path: Path, shapes: dict[str, tuple[int, ...] | None]) -> tuple[dict[str, np.ndarray], str]:
    """One array per name of ``shapes`` from an ``.npz`` (a model with several inputs), each checked as
    ``read_inputs`` checks ``x`` against its shape, all with the same number of samples; and the sha256 of the
    file, read through the same open.

    Raises:
        InputError: a missing or non-regular file; as ``read_inputs``; a name the file lacks; arrays with
            different sample counts.
    """
    out: dict[str, np.ndarray] = {}
    with safety.open_regular(path, "--inputs") as f:
        if not f.read(2).startswith(b"PK"):
            raise InputError(f"{path}: not a readable .npz file; save one array per model input with numpy.savez")
        for name, shape in shapes.items():
            f.seek(0)
            out[name] = _read_npz(f, path, shape, key=name)
        digest = safety.sha256_open(f)
    counts = {name: len(a) for name, a in out.items()}
    if len(set(counts.values())) > 1:
        raise InputError(f"{path}: its arrays hold different numbers of samples ({counts}); give each input N samples")
    return out, digest


def _read_npz(
    f: IO[bytes],
    path: Path,
    input_shape: tuple[int, ...] | None,
    key: str | None = None,
    integer: bool = False,
    check_only: bool = False,
) -> np.ndarray:
    try:
        with zipfile.ZipFile(f) as archive:
            _check_not_a_model(archive, path)
            infos = {i.filename.removesuffix(".npy"): i for i in archive.infolist()}
            if check_only and key is None and "x" not in infos and len(infos) != 1:
                return np.empty(0)  # one array per input of a model with several: the model names which are read
            if key is not None and key not in infos:
                raise InputError(
                    f"{path}: expected an array named {key!r}, one per model input (found {', '.join(list(infos)[:8])})"
                )
            key = key or ("x" if "x" in infos else (next(iter(infos)) if len(infos) == 1 else None))
            if key is None:
                raise InputError(f"{path}: expected an array named 'x' (found {', '.join(list(infos)[:8])})")
            info = infos[key]
            _check_member(archive, info, path, key, input_shape, integer)
            if check_only:
                return np.empty(0)
            with archive.open(info) as member:
                return _load(lambda: np.lib.format.read_array(member, allow_pickle=False), path)
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise InputError(f"{path}: not a readable .npz file ({str(err).strip()[:200]})") from None


def _check_member(
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    path: Path,
    key: str,
    input_shape: tuple[int, ...] | None,
    integer: bool,
) -> None:
    """``_check_array`` on one ``.npz`` member's header, after its compression ratio (``MAX_INFLATION``)."""
    if info.file_size > MAX_INFLATION * info.compress_size + _INFLATION_FLOOR:
        raise InputError(
            f"{path}: array {key!r} expands from {info.compress_size} to {info.file_size} bytes, more than "
            f"{MAX_INFLATION} times (slabconv's limit); refused before reading it"
        )
    with archive.open(info) as member:
        shape, dtype, offset = _header(member, path, f"array {key!r}")
    _check_array(path, f"array {key!r}", shape, dtype, info.file_size - offset, input_shape, integer)


def _header(fp: IO[bytes], path: Path, what: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, header bytes)`` of an ``.npy`` stream, read by numpy's header reader (no data read)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(fp, max_header_size=_MAX_HEADER)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = fmt.read_array_header_2_0(fp, max_header_size=_MAX_HEADER)
        else:
            raise ValueError(f"format version {version}")
    except (ValueError, OSError, EOFError, TypeError, SyntaxError) as err:
        raise InputError(f"{path}: {what} has no readable .npy header ({str(err).strip()[:120]})") from None
    return tuple(int(s) for s in shape), dtype, int(fp.tell())  # the data starts where the header ends


def _check_array(
    path: Path,
    what: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    stored: int,
    input_shape: tuple[int, ...] | None,
    integer: bool = False,
) -> None:
    """The checks on a header before its data is read (see ``read_inputs``); with ``integer`` (token ids) the dtype
    must be an integer one: float ids are refused, whole-valued or not, rather than cast (3.7 would become 3)."""
    if dtype.hasobject or dtype.kind not in "fiub":
        why = "complex: slabconv does not drop an imaginary part" if dtype.kind == "c" else "not numbers"
        raise InputError(f"{path}: {what} has dtype {dtype} ({why}); give real float or integer inputs")
    if integer and dtype.kind not in "iu":
        raise InputError(
            f"{path}: {what} has dtype {dtype}, but the model takes integer token ids; save the ids as int64 "
            "(numpy.savez(path, x=ids.astype(numpy.int64)) once they are whole numbers: slabconv does not round them)"
        )
    needed = math.prod(shape) * dtype.itemsize
    if needed > MAX_INPUT_BYTES:
        raise InputError(
            f"{path}: {what} of shape {shape} would take {needed} bytes, over slabconv's limit of {MAX_INPUT_BYTES}; "
            "give fewer samples"
        )
    if needed != stored:
        raise InputError(
            f"{path}: {what} declares shape {shape} ({needed} bytes) but stores {stored} bytes; the file is damaged"
        )
    if len(shape) < 1 or shape[0] == 0:
        raise InputError(f"{path}: the input array is empty; give at least one sample")
    if input_shape is not None and tuple(shape[1:]) != tuple(input_shape):
        wanted = ", ".join(map(str, input_shape))
        raise InputError(f"{path}: inputs have shape {shape}, the model takes (N, {wanted}); give matching inputs")
