"""Fuzzing the loaders (issue #6 item 8) with hypothesis: mutated checkpoint and safetensors bytes either load
or raise the clear exit-2 error (a ``SlabconvError`` with one line), never anything else, within a time bound
per example (hypothesis' deadline) and a memory bound (the address-space limit is lowered while fuzzing, so a
file that makes a loader allocate without bound fails the test instead of exhausting the machine).

Three targets: the bytes of a torch zip checkpoint, the pickle inside it (re-zipped, so the unpickler sees the
mutation instead of the zip checksum), and a safetensors file (raw bytes, and its JSON header's dtypes, shapes
and offsets). ``SLABCONV_FUZZ_EXAMPLES`` raises the number of examples for a longer local run.
"""

from __future__ import annotations

import contextlib
import io as _io
import json
import os
import resource
import struct
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from slabconv import api
from slabconv.errors import SlabconvError
from tests.tinyckpt import CONFIG, tiny_state_dict

EXAMPLES = int(os.environ.get("SLABCONV_FUZZ_EXAMPLES", "200"))
MEMORY_HEADROOM = 2 << 30  # bytes of address space the loaders may use on top of what the process has
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _checkpoint_bytes() -> bytes:
    buffer = _io.BytesIO()
    torch.save({"model": tiny_state_dict(), "epoch": 3, "config": CONFIG}, buffer)
    return buffer.getvalue()


CKPT = _checkpoint_bytes()
with zipfile.ZipFile(_io.BytesIO(CKPT)) as _z:
    _PKL_NAME = next(n for n in _z.namelist() if n.endswith("data.pkl"))
    PKL = _z.read(_PKL_NAME)
SAFETENSORS = save_safetensors({k: v.contiguous() for k, v in tiny_state_dict().items()}, {"arch": "deit_prepbn"})


def _rezip(pickle_bytes: bytes) -> bytes:
    out = _io.BytesIO()
    with zipfile.ZipFile(_io.BytesIO(CKPT)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, pickle_bytes if info.filename == _PKL_NAME else zin.read(info.filename))
    return out.getvalue()


Edit = tuple[str, int, int]


def edits(size: int) -> st.SearchStrategy[list[Edit]]:
    """Byte-level mutations: overwrite a byte, delete or duplicate a range, truncate."""
    pos = st.integers(0, size - 1)
    return st.lists(
        st.one_of(
            st.tuples(st.just("set"), pos, st.integers(0, 255)),
            st.tuples(st.just("delete"), pos, st.integers(1, 64)),
            st.tuples(st.just("duplicate"), pos, st.integers(1, 64)),
            st.tuples(st.just("truncate"), pos, st.just(0)),
        ),
        min_size=1,
        max_size=6,
    )


def mutate(data: bytes, changes: list[Edit]) -> bytes:
    buf = bytearray(data)
    for kind, at, arg in changes:
        if not buf:
            break
        at %= len(buf)
        if kind == "set":
            buf[at] = arg
        elif kind == "delete":
            del buf[at : at + arg]
        elif kind == "duplicate":
            buf[at:at] = buf[at : at + arg]
        else:
            del buf[at:]
    return bytes(buf)


@contextlib.contextmanager
def bounded_memory(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Lower the soft address-space limit to what the process maps now plus ``headroom``; restore it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + headroom if hard == resource.RLIM_INFINITY else min(hard, mapped + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_or_clear_error(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and load it; only success or a one-line exit-2 ``SlabconvError`` may happen."""
    path.write_bytes(data)
    try:
        with bounded_memory():
            api.load_model(path)
    except SlabconvError as err:
        message = str(err)
        assert err.exit_code == 2, message
        assert message and "\n" not in message, repr(message)
        assert str(path) in message or "architecture" in message, message


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_the_unmutated_files_load(workdir: Path) -> None:
    """The control: every target loads when nothing is changed (so a mutation is what makes it fail)."""
    for name, data in (("ckpt.pth", CKPT), ("rezipped.pth", _rezip(PKL)), ("model.safetensors", SAFETENSORS)):
        (workdir / name).write_bytes(data)
        assert api.load_model(workdir / name, arch="deit_prepbn").arch == "deit_prepbn"


def test_an_allocation_over_the_bound_is_refused_not_fatal() -> None:
    """The control for the memory bound: inside it a huge allocation fails with an exception."""
    with pytest.raises((MemoryError, RuntimeError)), bounded_memory(64 << 20):
        torch.empty(1 << 31, dtype=torch.uint8).fill_(1)


@FUZZ
@given(changes=edits(len(CKPT)))
def test_mutated_checkpoint_bytes(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "mutated.pth", mutate(CKPT, changes))


@FUZZ
@given(changes=edits(len(PKL)))
def test_mutated_checkpoint_pickle(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "pickle.pth", _rezip(mutate(PKL, changes)))


@FUZZ
@given(changes=edits(len(SAFETENSORS)))
def test_mutated_safetensors_bytes(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "mutated.safetensors", mutate(SAFETENSORS, changes))


HEADER_LEN = struct.unpack("<Q", SAFETENSORS[:8])[0]
HEADER = json.loads(SAFETENSORS[8 : 8 + HEADER_LEN])
TENSOR_NAMES = sorted(k for k in HEADER if k != "__metadata__")
huge = st.integers(-(2**63), 2**64)


@FUZZ
@given(
    name=st.sampled_from(TENSOR_NAMES),
    dtype=st.one_of(st.none(), st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""])),
    shape=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 70), huge), max_size=5)),
    offsets=st.one_of(st.none(), st.tuples(huge, huge), st.tuples(st.integers(0, 80000), st.integers(0, 80000))),
    header_len_delta=st.integers(-16, 16),
)
def test_mutated_safetensors_header_fields(
    workdir: Path,
    name: str,
    dtype: str | None,
    shape: list[int] | None,
    offsets: tuple[int, int] | None,
    header_len_delta: int,
) -> None:
    header = json.loads(json.dumps(HEADER))
    entry = header[name]
    if dtype is not None:
        entry["dtype"] = dtype
    if shape is not None:
        entry["shape"] = shape
    if offsets is not None:
        entry["data_offsets"] = list(offsets)
    text = json.dumps(header).encode()
    data = struct.pack("<Q", max(0, len(text) + header_len_delta)) + text + SAFETENSORS[8 + HEADER_LEN :]
    load_or_clear_error(workdir / "header.safetensors", data)
