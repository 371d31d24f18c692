"""The inputs a verification runs on: an ``.npz``, the ``holdout.npz`` beside a checkpoint, or seeded samples."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from slabconv.errors import InputError, UsageError
from slabconv.load.model import LoadedModel
from slabconv.util import sha256_file


def choose_inputs(
    loaded: LoadedModel | None,
    inputs: Path | str | None,
    samples: int,
    seed: int,
    input_shape: tuple[int, ...] | None = None,
    limit: int | None = None,
) -> tuple[np.ndarray, str, str | None]:
    """The verification inputs: ``inputs`` (an ``.npz``), else ``holdout.npz`` beside the checkpoint, else
    ``samples`` seeded standard-normal samples of the model's input shape.

    ``limit`` (an explicit ``--samples``) takes the first ``limit`` samples of an ``.npz``; its label says so.

    Returns:
        ``(x, label, sha256 of the .npz or None)``.

    Raises:
        UsageError: no input shape is known (dynamic ONNX axes) and no ``inputs`` were given.
        InputError: an unreadable ``.npz`` or one of the wrong shape.
    """
    shape = loaded.input_shape if loaded is not None else input_shape
    path = Path(inputs) if inputs else None
    if path is None and loaded is not None:
        ckpt_path = loaded.checkpoint.path
        beside = (ckpt_path if ckpt_path.is_dir() else ckpt_path.parent) / "holdout.npz"
        path = beside if beside.exists() else None
    if path is None:
        if shape is None:
            raise UsageError("the input shape is not fixed by the models; pass --inputs NPZ or --input-shape C,H,W")
        if samples < 1:
            raise UsageError(f"--samples must be at least 1 (got {samples})")
        label = f"random(seed={seed}, samples={samples})"
        if loaded is not None:
            if loaded.token_input and loaded.make_input is None:
                raise UsageError("the model takes token ids and their range is unknown; pass --inputs NPZ")
            x = loaded.example(samples, seed)
            # numpy has no bfloat16: float inputs travel as float32 and each runner casts them to its dtype.
            return (x.float() if x.is_floating_point() else x).numpy(), label, None
        rng = np.random.default_rng(seed)
        return rng.standard_normal((samples, *shape)).astype(np.float32), label, None
    if not path.is_file():
        raise InputError(f"{path}: no such file (--inputs)")
    integer = loaded is not None and loaded.token_input
    arrays = load_npz_inputs(path, shape, integer=integer)
    if limit is not None and limit < len(arrays):
        return (
            arrays[:limit],
            f"{path} (its first {limit} of {len(arrays)} samples: --samples {limit})",
            sha256_file(path),
        )
    return arrays, str(path), sha256_file(path)


def load_npz_inputs(path: Path, input_shape: tuple[int, ...] | None, integer: bool = False) -> np.ndarray:
    """The ``x`` array of an ``.npz`` (or its only array), checked against the model's input shape.

    ``x`` is read as float32, or as int64 with ``integer`` (token ids of a language model).

    Raises:
        InputError: unreadable file, no array, or a shape that is not ``(N, *input_shape)``.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            key = "x" if "x" in data.files else (data.files[0] if len(data.files) == 1 else None)
            if key is None:
                raise InputError(f"{path}: expected an array named 'x' (found {', '.join(data.files)})")
            x = np.asarray(data[key], dtype=np.int64 if integer else np.float32)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"{path}: not a readable .npz file ({str(err).strip()[:200]})") from None
    if x.ndim < 1 or len(x) == 0:
        raise InputError(f"{path}: the input array is empty; give at least one sample")
    if input_shape is not None and tuple(x.shape[1:]) != tuple(input_shape):
        wanted = ", ".join(map(str, input_shape))
        raise InputError(f"{path}: inputs have shape {x.shape}, the model takes (N, {wanted}); give matching inputs")
    return x
