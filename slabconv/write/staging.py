"""Where outputs go: checked before the work starts, staged beside the target, published atomically.

Rules (``docs/security.md``):

- **Nothing the user owns is replaced.** An existing output folder is replaced only with ``--force``, and only when
  slabconv wrote it (its ``report.json`` lists every file in it) or it is empty. Never the current folder or one
  of its ancestors, the home folder, ``/``, an input or a folder holding one, a regular file, a symbolic link.
  An existing output file (``export --onnx``) is replaced only with ``--force`` and only when slabconv wrote it
  (checked again just before the rename, ``staging_file(owned=...)``).
- **Bad targets fail first**: ``check_output_folder`` / ``check_output_file`` run before anything is loaded, and
  check links, name lengths and write permission, so a run never fails after the work for a reason known before.
- **No partial output is ever visible.** Files are written into ``.<final>.tmp-<pid>-<token>/<final name>`` beside
  the target and moved into place with one ``rename``: without ``--force`` a rename that fails if the target appeared
  meanwhile (``renameat2(RENAME_NOREPLACE)``; two runs to one new ``--out``: exactly one wins, the other is told
  it already exists), with ``--force`` an atomic exchange (``RENAME_EXCHANGE``), then the old output is removed.
- **Errors name the user's path**, never the staging folder; a full disk says so. Every path in a message goes
  through ``slabconv.text.shown`` (escaped, cut).
- **Only what slabconv made is ever removed.** A staging folder is ``.<final>.tmp-<pid>-<token>`` with a random
  ``token``, and holds a marker file (``.slabconv-staging``) that repeats the token, the pid and the final name; the
  output is written into a subfolder of it. Cleanup and restore act only on such marked folders: a user's folder
  or file that merely looks like one (``.res.tmp-4999999-mine``) is never touched. ``--force`` replaces an output
  folder only while every file in it still has the sha256 its ``report.json`` records (checked before the work and
  again just before the swap).
- **A target that cannot be replaced atomically is refused first**: a mount point (another file system than its
  folder) cannot be renamed over, so it is refused before anything is loaded.
- **Portable**: every POSIX-only call has a fallback (``os.pathconf``: the usual limits; a liveness probe without
  ``os.kill`` semantics, as on Windows where ``os.kill(pid, 0)`` would send CTRL_C_EVENT: the owner counts as
  alive and its staging is left alone; no ``renameat2``: a rename that refuses an existing target).

A run killed with SIGKILL cannot remove its staging folder; the next run writing the same output does
(``clean_stale``), and puts back an old output whose swap was cut short (the fallback path without renameat2, which
moves the old output into the marked staging folder first).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from slabconv.errors import HeldInterrupts, SlabconvError, UsageError, raise_if_interrupted, record_written
from slabconv.text import shown
from slabconv.util import libc
from slabconv.write.output_checks import (  # noqa: F401 (the checks are part of this module's face)
    REPORT,
    STAGING_EXTRA,
    _check_owned,
    _check_replaceable,
    check_output_file,
    check_output_folder,
)

"""The file that marks a folder as slabconv's own: it lists every other file slabconv wrote there."""

MARKER = ".slabconv-staging"
"""The file in every staging folder slabconv makes: JSON with the folder's token, pid and final name."""

_TOKEN_HEX = 16
_STAGING = re.compile(rf"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]{{{_TOKEN_HEX}}})$")
assert STAGING_EXTRA == len(".") + len(".tmp-") + 10 + len("-") + _TOKEN_HEX  # the name output_checks allows for
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


# --------------------------------------------------------------------------------------------- renames

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False when this system lacks it (then the caller falls back)."""
    fn = getattr(libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # an old kernel or a file system without the flag
        return False
    raise OSError(err, os.strerror(err), str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, failing with ``FileExistsError`` if ``dst`` exists (atomically where the system
    has ``renameat2``; a non-empty folder or a hard link otherwise)."""
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
    except OSError as err:
        if err.errno == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "already exists", str(dst)) from None
        raise
    if src.is_dir():
        if dst.exists():
            raise FileExistsError(errno.EEXIST, "already exists", str(dst))
        try:
            os.rename(src, dst)  # replaces only an empty folder, never a non-empty one
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(errno.EEXIST, "already exists", str(dst)) from None
            raise
    elif os.name == "nt":
        os.rename(src, dst)  # Windows' rename refuses an existing target (FileExistsError)
    else:
        os.link(src, dst)  # fails with EEXIST atomically
        os.unlink(src)


# --------------------------------------------------------------------------------------------- staging


def _alive_posix(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists (POSIX)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _alive_windows(pid: int) -> bool:
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:  # ERROR_ACCESS_DENIED (5): it runs, as another user; ERROR_INVALID_PARAMETER: no such process
        return ctypes.get_last_error() == 5  # type: ignore[attr-defined]
    try:
        code = ctypes.c_ulong()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def _liveness_probe() -> Callable[[int], bool] | None:
    """How to ask whether a process runs on this system, or None when there is no safe way. ``os.kill(pid, 0)``
    is a probe only on POSIX: on Windows it sends CTRL_C_EVENT to the process group, so Windows asks
    ``OpenProcess`` / ``GetExitCodeProcess`` instead."""
    if os.name == "posix" and hasattr(os, "kill"):
        return _alive_posix
    if os.name == "nt" and hasattr(ctypes, "WinDLL"):
        return _alive_windows
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` may still be running; True (leave its staging alone) when this system cannot tell."""
    if pid == os.getpid():
        return True
    probe = _liveness_probe()
    if probe is None:
        return True
    try:
        return probe(pid)
    except (OSError, ValueError, OverflowError, AttributeError):
        return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _make_staging(final: Path) -> Path:
    """Make ``.<final name>.tmp-<pid>-<token>`` beside ``final`` (mode 0700) and write its marker; return it.

    The marker is written with ``O_EXCL`` into the folder just made, before anything else: a folder without it was
    not made by slabconv (or by a run killed within these two calls, and then holds nothing) and is never removed.
    """
    while True:
        token = secrets.token_hex(_TOKEN_HEX // 2)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{token}"
        try:
            os.mkdir(tmp, 0o700)
            break
        except FileExistsError:
            continue
    try:
        os.chmod(tmp, 0o700)  # whatever the umask: a folder without the owner's rwx could not even be removed again
        marker = {"slabconv": "staging", "for": final.name, "pid": os.getpid(), "token": token}
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(tmp / MARKER, flags, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(marker, f)
    except BaseException:  # an interrupt (SIGTERM) between the two calls: the folder just made goes too
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _marked(entry: Path, final: Path) -> int | None:
    """The pid of the run that made ``entry`` when it is a staging folder of ``final`` that slabconv made (a real
    folder, named ``.<final name>.tmp-<pid>-<token>``, holding a regular marker file that repeats the name, pid
    and token); None for anything else, which is never touched."""
    m = _STAGING.match(entry.name)
    if not m or m["name"] != final.name:
        return None
    try:
        if not stat.S_ISDIR(entry.lstat().st_mode):
            return None
        info = (entry / MARKER).lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > 4096:
            return None
        marker = json.loads((entry / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    expected = {"slabconv": "staging", "for": final.name, "pid": int(m["pid"]), "token": m["token"]}
    return int(m["pid"]) if marker == expected else None


def clean_stale(final: Path) -> list[Path]:
    """Remove staging folders of ``final`` left by killed runs; restore an old output whose swap was cut short.

    Only marked staging folders (``_marked``) of ``final`` whose process no longer runs are touched; a user's
    file or folder that only looks like one is left alone. An old output moved into a staging folder by the
    swap without ``renameat2`` (``<staging>/old``) is put back when ``final`` is missing; when it cannot be put
    back and the swap did not finish, the staging folder is left alone. Returns the paths removed.
    """
    removed: list[Path] = []
    parent = final.parent
    if not parent.is_dir():
        return removed
    for item in sorted(parent.iterdir()):
        pid = _marked(item, final)
        if pid is None or _alive(pid):
            continue
        old = item / "old"
        if old.is_dir() and not old.is_symlink():  # a swap without renameat2 was cut short
            if not os.path.lexists(final):
                try:
                    rename_noreplace(old, final)  # never over something that appeared meanwhile
                except OSError:
                    continue  # cannot be put back: left for the user, never deleted
            elif (item / final.name).exists():
                continue  # the new output never moved in, yet something is at ``final``: keep the old one too
        _remove(item)
        removed.append(item)
    return removed


def _make_parents(final: Path) -> list[Path]:
    """Create the missing folders above ``final``; return those created (to remove again on failure)."""
    created = []
    parent = final.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    for folder in reversed(created):
        folder.mkdir()
    return created


def _cannot_write(final: Path, err: BaseException) -> UsageError:
    detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return UsageError(
        f"cannot write {shown(final)}: {detail}; nothing was written (free space or choose another location)"
    )


def _is_disk_error(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in _DISK_ERRORS:
        return True
    return any(text in str(err) for text in ("No space left", "Disk quota", "Read-only file system"))


@contextlib.contextmanager
def _staged(final: Path, force: bool) -> Iterator[tuple[Path, Path]]:
    """The shared part of ``staging_dir`` / ``staging_file``: make the staging folder, map errors raised while
    writing to the user's path, remove everything on failure (including parent folders this run created). Yields
    the folder to write in and ``final`` made absolute."""
    final = Path(os.path.abspath(final))
    if final.exists() and not force:
        raise UsageError(f"{shown(final)} already exists; pass --force to replace it")
    staging: Path | None = None
    created: list[Path] = []
    published = False
    try:
        # Inside the try: an interrupt that lands right after the staging folder exists still removes it.
        try:
            created = _make_parents(final)
            clean_stale(final)
            staging = _make_staging(final)
            tmp = staging / final.name  # what is written; its name is the output's, so messages need no renaming
            os.mkdir(tmp, 0o700)
        except OSError as err:
            raise UsageError(
                f"cannot write to {shown(final.parent)}: {err.strerror or err}; choose a writable location"
            ) from None
        try:
            yield tmp, final
            published = True
        except SlabconvError as err:
            raw = err.args[0] if err.args and isinstance(err.args[0], str) else None
            if raw is not None:
                message = raw
                for staged in (tmp / final.name, tmp, staging):  # the longest first: a file staged for ``final``
                    message = message.replace(str(staged), str(final))
                if message != raw:
                    err.args = (message, *err.args[1:])
            raise
        except Exception as err:
            if _is_disk_error(err):
                raise _cannot_write(final, err) from None
            raise
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if not published:
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()


@contextlib.contextmanager
def staging_dir(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` (same file system) that becomes ``final`` when the block finishes.

    Nothing is left behind on failure or interruption (KeyboardInterrupt included). Without ``force`` the
    folder is moved into place with a rename that refuses an existing target, so of two runs writing one new
    folder exactly one wins. With ``force`` the new folder and the old one swap atomically and the old one is
    removed. Call ``check_output_folder`` first: this only stages and publishes.

    Raises:
        UsageError: ``final`` exists (without ``force``, also when another run created it meanwhile), or its
            folder cannot be written, or the disk is full (naming ``final``).
    """
    with _staged(final, force) as (tmp, final):
        yield tmp
        raise_if_interrupted()  # a signal whose KeyboardInterrupt was lost (errors.request_interrupt) publishes nothing
        _publish_modes(tmp)
        try:
            with HeldInterrupts():  # a signal here takes effect once the folder is in place and recorded
                if not force or not final.exists():
                    rename_noreplace(tmp, final)
                else:
                    if final.is_symlink():  # a link put in its place while the run worked
                        raise UsageError(
                            f"{shown(final)} became a symbolic link while slabconv worked; nothing was written"
                        )
                    _check_replaceable(final, final)  # checked before the work; again, as the folder may have changed
                    if any(final.iterdir()):
                        _check_owned(final, final)
                    if not _renameat2(tmp, final, _RENAME_EXCHANGE):
                        _swap_with_backup(tmp, final)
                    # after the exchange ``tmp`` holds the old output; the staging folder around it is removed on exit
                record_written(shown(final))
        except FileExistsError:
            raise UsageError(
                f"{shown(final)} already exists (another run wrote it meanwhile); nothing was written"
            ) from None
        except OSError as err:
            raise _cannot_write(final, err) from None


def _swap_with_backup(tmp: Path, final: Path) -> None:
    """Without ``renameat2``: move the old output into the marked staging folder (``<staging>/old``), the new one
    in, then remove the old one with the staging folder. If the process dies in between, ``clean_stale`` finds the
    old output in a marked folder and puts it back."""
    backup = tmp.parent / "old"
    final.rename(backup)
    try:
        tmp.rename(final)
    except BaseException:
        backup.rename(final)
        raise


@contextlib.contextmanager
def staging_file(final: Path, force: bool, owned: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """A temporary folder beside ``final`` in which to write the file ``final.name`` and its side files (an ONNX
    ``.data``); when the block finishes each is moved into place, ``final`` last: with ``force`` by
    ``os.replace``, without it by a rename that refuses an existing file. On failure nothing is moved.

    ``owned`` (as for ``check_output_file``): checked again just before anything is moved, so a file that became
    someone else's while the run worked (or a link, or a mount point) is not replaced.

    Raises:
        UsageError: as ``staging_dir``; or ``final`` is no longer a file slabconv wrote.
    """
    with _staged(final, force) as (tmp, final):
        yield tmp
        raise_if_interrupted()
        if not (tmp / final.name).is_file():
            raise RuntimeError(f"nothing was staged for {final}")
        if force and os.path.lexists(final):
            if final.is_symlink() or (owned is not None and not owned(final)):
                raise UsageError(
                    f"{shown(final)} was replaced by a file slabconv did not write while it worked; nothing was written"
                )
            _check_replaceable(final, final)
        _publish_modes(tmp)
        placed: list[Path] = []
        try:
            with HeldInterrupts():  # a signal here takes effect once every file is in place and recorded
                for item in sorted(tmp.iterdir(), key=lambda p: p.name == final.name):
                    dst = final.parent / item.name
                    if force:
                        os.replace(item, dst)
                    else:
                        rename_noreplace(item, dst)
                    placed.append(dst)
                record_written(shown(final))
        except FileExistsError as err:
            for dst in placed:
                _remove(dst)
            raise UsageError(
                f"{shown(err.filename)} already exists (another run wrote it meanwhile); nothing was written"
            ) from None
        except OSError as err:
            raise _cannot_write(final, err) from None


def _publish_modes(folder: Path) -> None:
    """Give the staged folder and its files the modes the user's umask asks for (the staging folder is made
    private, mode 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)
