"""Staging: every output is written beside its final place and moved there only when complete.

Folders are staged as ``.<final>.tmp-<pid>-<random>`` beside the target and renamed into place; a run killed
with SIGKILL leaves its staging behind, and the next run writing the same output removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slabconv.errors import UsageError

# Staging folders are named ``.<final>.tmp-<pid>-<random>``; a swap's backup ``.<final>.old-<pid>``. A run that
# is killed (SIGKILL) cannot remove its own; the next run writing the same output removes those whose process
# is gone, and puts back a backup whose swap was cut short.
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[^/]*)?$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stale(final: Path) -> list[Path]:
    """Remove staging leftovers of ``final`` from killed runs; restore a backup whose swap was interrupted.

    Only siblings named ``.<final name>.tmp-<pid>-*`` / ``.<final name>.old-<pid>`` whose process no longer
    runs are touched. Returns the paths removed.
    """
    removed: list[Path] = []
    parent = final.parent
    if not parent.is_dir():
        return removed
    leftovers = []
    for item in parent.iterdir():
        m = _STAGING.match(item.name)
        if m and m["name"] == final.name and not _alive(int(m["pid"])):
            leftovers.append((m["kind"], item))
    for kind, item in sorted(leftovers, key=lambda pair: pair[0] != "old"):
        if kind == "old" and not final.exists():
            with contextlib.suppress(OSError):
                item.rename(final)
                continue
        _remove(item)
        removed.append(item)
    return removed


@contextlib.contextmanager
def staging_dir(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` (same filesystem) that replaces it only when the block finishes.

    Nothing is left behind on failure or interruption (KeyboardInterrupt included); an existing ``final``
    stays intact until the swap, and is refused without ``force``. Leftovers of killed runs are cleaned first
    (``clean_stale``).

    Raises:
        UsageError: ``final`` exists and ``force`` is False, or its parent folder is not writable.
    """
    final = final.absolute()
    parent = final.parent
    tmp = _make_staging(final, force)
    try:
        yield tmp
        _publish_modes(tmp)
        backup = None
        if final.exists():
            backup = parent / f".{final.name}.old-{os.getpid()}"
            _remove(backup)
            final.rename(backup)
        tmp.rename(final)
        if backup is not None:
            _remove(backup)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _make_staging(final: Path, force: bool) -> Path:
    """Check ``final`` may be written, clean stale leftovers, and create the staging folder beside it."""
    if final.exists() and not force:
        raise UsageError(f"{final} already exists; pass --force to replace it")
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(final)
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as err:
        raise UsageError(
            f"cannot write to {parent}: {err.strerror or err}; choose a writable output location"
        ) from None


@contextlib.contextmanager
def staging_file(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` in which to write the file ``final.name`` and its side files (an
    ONNX ``.data``); when the block finishes each is moved into place with ``os.replace`` (atomic on one
    filesystem), ``final`` last. On failure nothing is moved and the folder is removed.

    Raises:
        UsageError: ``final`` exists and ``force`` is False, or its folder is not writable.
    """
    final = final.absolute()
    tmp = _make_staging(final, force)
    try:
        yield tmp
        if not (tmp / final.name).is_file():
            raise RuntimeError(f"nothing was staged for {final}")
        _publish_modes(tmp)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == final.name):
            os.replace(item, final.parent / item.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish_modes(folder: Path) -> None:
    """Give the staged folder and its files the modes the user's umask asks for (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)
