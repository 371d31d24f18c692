"""Small helpers every stage uses: the progress callback type, file digests and silencing library chatter."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import re
import stat
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol


class Progress(Protocol):
    """The progress callback every long-running API function takes: called at the start of each stage with its
    name, and for work done in steps with the steps done so far, their total and what is being done now."""

    def __call__(
        self, stage: str, done: int | None = None, total: int | None = None, detail: str | None = None, /
    ) -> None: ...


def no_progress(stage: str, done: int | None = None, total: int | None = None, detail: str | None = None, /) -> None:
    """The default ``Progress``: says nothing."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    with open(path, "rb") as f:
        return sha256_open(f)


def sha256_open(f: IO[bytes]) -> str:
    """Hex sha256 of an open binary file from its start, read in 1 MiB blocks (left at its start again)."""
    digest = hashlib.sha256()
    f.seek(0)
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    f.seek(0)
    return digest.hexdigest()


def files_sha256(files: list[Path], digests: Mapping[Path, str] | None = None) -> str:
    """sha256 over one ``<file name> <hex sha256 of its bytes>\\n`` line per file, in the given order (one digest
    for a folder of several files, e.g. a sharded checkpoint). A file's own sha256 is taken from ``digests`` where
    it has one (the digest of the bytes already read from it), else hashed here."""
    known = digests or {}
    outer = hashlib.sha256()
    for path in files:
        outer.update(f"{path.name} {known.get(path) or sha256_file(path)}\n".encode())
    return outer.hexdigest()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence stdout, Python warnings and the log lines of torch and onnxscript (the ONNX exporter's version
    converter logs a warning for every --opset it converts to); stdout may carry ``--json`` output."""
    logs = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


QUIET_LOGGERS = ("torch", "onnxscript")
"""The libraries whose log lines ``quiet`` holds back (errors still pass)."""


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """``quiet`` plus every log record of every library: while an untrusted file is parsed, a library's own
    warnings and tracebacks (torch.export logs one on a damaged .pt2) must not reach the user's terminal; the
    error slabconv raises says what went wrong in one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with quiet():
            yield
    finally:
        logging.disable(previous)


def upper_bound(size: Any) -> int | None:
    """The largest value a symbolic size may take (``ShapeEnv.var_to_range`` of its symbol), None when unbounded
    or unknown; a plain int is its own bound."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    bounds = getattr(getattr(node, "shape_env", None), "var_to_range", {}).get(getattr(node, "expr", None))
    if bounds is None:
        return None
    try:
        upper = int(bounds.upper)
    except (TypeError, ValueError, AttributeError, OverflowError):  # int_oo and other infinities
        return None
    return upper if upper < 1 << 62 else None


SPECIAL_FILES = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
"""The kinds of file that are not regular, by ``stat.S_IFMT`` of their mode, as error messages name them: reading
a FIFO waits for a writer, writing one waits for a reader, a device can be endless."""


def row_ranges(shape: list[int], block_elements: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` blocks of rows of a tensor of ``shape`` with about ``block_elements`` values each (one
    block for a 0/1-D or small tensor): the blocks the fold program folds (``slabconv.engine.program``; the same in
    memory and streamed) and ``slabconv.load.shards.LazyShards.row_blocks`` reads."""
    inner = 1
    for n in shape[1:]:
        inner *= int(n)
    rows = max(1, block_elements // max(1, inner))
    if len(shape) < 2 or shape[0] <= rows:
        yield 0, int(shape[0]) if shape else 1
        return
    for r in range(0, int(shape[0]), rows):
        yield r, min(r + rows, int(shape[0]))


def release_memory(collect: bool = True) -> None:
    """Collect unreachable objects (traced graphs hold reference cycles; ``collect=False`` where only tensors and
    sessions were dropped, which reference counting frees) and hand the memory the allocator keeps free back to
    the OS (glibc's ``malloc_trim``; nothing elsewhere).

    After a stage that allocated and freed a lot (a capture, a batch of activations), glibc keeps the freed blocks
    in its heaps, so resident memory only ever grows from stage to stage; called between stages, each stage's peak
    starts from what is alive, not from every earlier stage's leftovers. Inside ``stage_memory`` the collection only
    walks what was made since it began (a full one walks every object torch's imports made: about 0.2-0.5 s).
    """
    import gc

    if collect:
        gc.collect()
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def libc() -> Any:
    """The C library as a ``ctypes.CDLL`` (errno kept, for ``ctypes.get_errno``), or None where ``ctypes`` cannot
    find one. Looked up once per process: ``ctypes.util.find_library`` runs ``ldconfig -p`` on every call."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave every object alive now out of the garbage collector until the block ends (``gc.freeze``); usable as a
    decorator.

    Python's automatic collections of its oldest generation walk every object alive, most of them made by torch's
    and the other libraries' imports, and a capture or an export allocates enough to trigger many: inside the block
    those walks skip everything alive when it began, which is most of the collector's CPU time in a ``slabconv
    fuse`` (``gc.callbacks`` times it; ``benchmarks/conversion_cost.py`` shows each stage's). Nothing frozen is
    freed before the block ends, so this is for what outlives the block anyway (the libraries, the caller's
    objects); garbage the caller left uncollected when the block began (a model dropped in a loop of ``api.fuse``
    calls) is held until it ends. Only the outermost block unfreezes; objects a caller froze before stay frozen.
    """
    import gc

    outermost = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()


@contextlib.contextmanager
def stage_memory() -> Iterator[None]:
    """A run of stages that call ``release_memory`` between them: one collection first, then everything alive is
    frozen (``frozen_heap``) until the run ends, so that each ``release_memory`` inside only walks the objects made
    since. What was alive at the start stays alive until the end in any case (the caller holds it)."""
    release_memory()
    with frozen_heap():
        yield


def block_pattern(prefix: str) -> re.Pattern[str]:
    """The names of a stack's blocks: ``prefix`` holds ``{i}`` (``model.layers.{i}.``); ``match`` gives the block
    index as group 1 and ends where the name inside the block starts."""
    head, _, tail = prefix.partition("{i}")
    return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))


@contextlib.contextmanager
def text_path(path: Path | str) -> Iterator[str]:
    """``path`` as text a library that takes UTF-8 paths can open (onnxruntime, ``onnx.checker``: C++ under
    pybind11; safetensors: Rust), which cannot take a name that is not UTF-8, as Python holds it with
    ``surrogateescape``.

    A path that is UTF-8 is itself. Otherwise, on Linux, its folder is opened and the file reached as
    ``/proc/self/fd/N/NAME`` while the block runs, so files beside it (external data) are found the same way.

    Raises:
        UsageError: the file's own name is not UTF-8, or the system has no ``/proc/self/fd`` (naming the path).
    """
    import os

    from slabconv.errors import UsageError

    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        yield text
        return
    folder, name = os.path.split(text)
    try:
        name.encode("utf-8")
        fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (UnicodeEncodeError, OSError):
        fd = -1
    if fd < 0 or not os.path.isdir(f"/proc/self/fd/{fd}"):
        if fd >= 0:
            os.close(fd)
        raise UsageError(
            f"{path}: a path that is not valid UTF-8, which onnxruntime, onnx and safetensors cannot open here; rename "
            "it (or the folder) with UTF-8 characters"
        )
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def output_names_of(spec: Any) -> list[str] | None:
    """The names of a model's flattened outputs from their pytree spec (``ExportedProgram.call_spec.out_spec``, a
    program module's ``_out_spec``): a dict's keys and a sequence's indices joined by ``.`` (``{"cls": a, "aux":
    [b, c]}``: ``cls``, ``aux.0``, ``aux.1``; a tuple: ``output.0``, ``output.1``), so ``model.onnx``'s outputs and
    every check line carry the names the user's code gave them. None for one output, a spec this cannot read, or
    names that would not be unique."""
    from torch.utils import _pytree as pytree

    try:
        count = spec.num_leaves
        if count <= 1:
            return None
        leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(count)), spec))[0]
    except Exception:  # noqa: BLE001 - any other spec: the runtime's own names
        return None
    names = []
    for path, _ in leaves:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", "")))) for k in path]
        name = ".".join(parts)
        names.append(f"output.{name}" if path and not isinstance(path[0], pytree.MappingKey) else name)
    return names if len(set(names)) == len(names) and all(names) else None
