"""Where outputs go: checked before the work starts, staged beside the target, published atomically.

Rules (``docs/security.md``):

- **Nothing the user owns is replaced.** An existing output folder is replaced only with ``--force``, and only when
  slabconv wrote it (its ``report.json`` lists every file in it) or it is empty. Never the current folder or one
  of its ancestors, the home folder, ``/``, an input or a folder holding one, a regular file, a symbolic link.
  An existing output file (``export --onnx``) is replaced only with ``--force`` and only when slabconv wrote it.
- **Bad targets fail first**: ``check_output_folder`` / ``check_output_file`` run before anything is loaded, and
  check links, name lengths and write permission, so a run never fails after the work for a reason known before.
- **No partial output is ever visible.** Files are written into ``.<final>.tmp-<pid>-<random>`` beside the target
  and moved into place with one ``rename``: without ``--force`` a rename that fails if the target appeared
  meanwhile (``renameat2(RENAME_NOREPLACE)``; two runs to one new ``--out``: exactly one wins, the other is told
  it already exists), with ``--force`` an atomic exchange (``RENAME_EXCHANGE``), then the old output is removed.
- **Errors name the user's path**, never the staging folder; a full disk says so.

A run killed with SIGKILL cannot remove its staging folder; the next run writing the same output does
(``clean_stale``), and puts back an old output whose swap was cut short (the fallback path without renameat2).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from slabconv.errors import SlabconvError, UsageError

REPORT = "report.json"
"""The file that marks a folder as slabconv's own: it lists every other file slabconv wrote there."""

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[^/]*)?$")
_STAGING_EXTRA = len(".") + len(".tmp-") + 10 + len("-") + 12  # prefix/suffix mkdtemp adds to the name
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


# --------------------------------------------------------------------------------------------- checks


def owned_files(folder: Path) -> set[str] | None:
    """The names slabconv wrote into ``folder`` according to its ``report.json`` (the report itself included),
    or None when the folder has no readable slabconv report."""
    report = folder / REPORT
    if not report.is_file() or report.is_symlink() or report.stat().st_size > 64 << 20:
        return None
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or "slabconv_version" not in data or not isinstance(data.get("outputs"), dict):
        return None
    outputs = data["outputs"]
    names = {REPORT}
    for key in ("sha256", "files"):
        listed = outputs.get(key)
        if isinstance(listed, (dict, list)):
            names |= {str(n) for n in listed}
    return names


def _forbidden(target: Path, inputs: Sequence[Path]) -> str | None:
    """Why ``target`` (absolute, resolved) may never be replaced, or None."""
    cwd = Path.cwd().resolve()
    if target == Path(target.anchor):
        return "the root folder"
    if target == cwd or cwd.is_relative_to(target):
        return "the current folder" if target == cwd else "a folder that holds the current folder"
    home = Path.home().resolve()
    if target == home or home.is_relative_to(target):
        return "the home folder" if target == home else "a folder that holds the home folder"
    for item in inputs:
        src = Path(item).resolve()
        if target == src or src.is_relative_to(target):
            return f"the input {item}" if target == src else f"a folder that holds the input {item}"
        if src.is_dir() and target.is_relative_to(src):
            return f"inside the input folder {item}"
    return None


def _check_path(target: Path) -> None:
    """Links, name lengths and write permission of a path that may not exist yet.

    Raises:
        UsageError: a link (dangling or not) as the target or on the way to it, a name or path too long for the
            file system, or a folder that cannot be written.
    """
    for part in (target, *target.parents):  # before any system call: a name over NAME_MAX makes them raise
        if len(part.name.encode()) + (_STAGING_EXTRA if part == target else 0) > 255:
            raise UsageError(
                f"{target}: the name {part.name[:40]!r}... has {len(part.name)} characters; file systems allow 255 "
                "or fewer (less the suffix slabconv adds while writing); choose a shorter name"
            )
    if target.is_symlink():
        where = os.readlink(target)
        raise UsageError(f"{target} is a symbolic link (to {where}); give the real path you want written")
    missing: list[Path] = [] if target.exists() else [target]
    existing = target.parent  # where the staging folder is made
    while not existing.exists():
        if existing.is_symlink():
            raise UsageError(f"{existing} is a symbolic link to {os.readlink(existing)}, which does not exist")
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"cannot write {target}: {existing} is a file, not a folder")
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    for part in {*missing, target}:
        extra = _STAGING_EXTRA if part == target else 0  # the staging folder's name is the target's plus a suffix
        if len(part.name.encode()) + extra > name_max:
            raise UsageError(
                f"{target}: the name {part.name[:40]!r}... has {len(part.name)} characters; this file system allows "
                f"{name_max - extra} here; choose a shorter name"
            )
    if len(str(target).encode()) + _STAGING_EXTRA + 64 > path_max:
        raise UsageError(f"{target}: the path is too long for this file system ({len(str(target))} characters)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {existing}: permission denied; choose a writable output location")


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(path, name))
    except (OSError, ValueError):
        return default


def check_output_folder(out: Path | str, *, force: bool, inputs: Sequence[Path] = ()) -> Path:
    """Check that ``out`` may receive a fused output folder; run before any work.

    Args:
        out: the ``--out`` folder (an empty string means the current folder, which is refused).
        force: ``--force``: replace an existing folder slabconv wrote (or an empty one).
        inputs: the files and folders the run reads (never replaced, nor any folder holding them).

    Returns:
        The absolute target path.

    Raises:
        UsageError: the target is protected, exists (without ``--force``), exists but holds files slabconv did
            not write, is a file or a link, or cannot be written (each message says what is there).
    """
    target = Path(os.path.abspath(out)) if str(out) else Path.cwd()
    why = _forbidden(target.resolve(), inputs)
    if why:
        raise UsageError(f"--out {out or '.'} is {why}; slabconv never replaces it: choose a new folder")
    _check_path(target)
    if not target.exists():
        return target
    if not target.is_dir():
        raise UsageError(f"--out {out} is an existing file, not a folder; slabconv will not replace it")
    if not force:
        raise UsageError(f"{out} already exists; pass --force to replace it (only a folder slabconv wrote)")
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return target
    owned = owned_files(target)
    if owned is None:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise UsageError(
            f"--out {out} holds {shown}, and no report.json of slabconv: it is not a folder slabconv wrote, so "
            "--force will not replace it; choose a new folder"
        )
    foreign = [e for e in entries if e not in owned]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(
            f"--out {out} holds {shown}, which slabconv did not write; --force replaces only slabconv's own output: "
            "move those files or choose a new folder"
        )
    return target


def check_output_file(
    target: Path | str, *, force: bool, inputs: Sequence[Path] = (), owned: Callable[[Path], bool] | None = None
) -> Path:
    """Check that a single output file (``export --onnx PATH``, ``--junit PATH``) may be written.

    Args:
        target: the file to write.
        force: replace an existing file that ``owned`` recognises as slabconv's.
        inputs: files the run reads (never written).
        owned: says whether an existing file was written by slabconv; None: existing files are never replaced.

    Returns:
        The absolute path.

    Raises:
        UsageError: an input, a folder, a link, a file slabconv did not write (or any existing file without
            ``--force``), or an unwritable location.
    """
    path = Path(os.path.abspath(target))
    for item in inputs:
        if path.resolve() == Path(item).resolve():
            raise UsageError(f"{target} is an input of this run; choose another path")
    _check_path(path)
    if path.exists():
        if path.is_dir():
            raise UsageError(f"{target} is a folder; give a file path such as {Path(target) / 'model.onnx'}")
        if owned is None or not owned(path):
            raise UsageError(f"{target} already exists and slabconv did not write it; choose another path")
        if not force:
            raise UsageError(f"{target} already exists; pass --force to replace it")
    return path


# --------------------------------------------------------------------------------------------- renames

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False when this system lacks it (then the caller falls back)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    fn = getattr(libc, "renameat2", None)
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
    else:
        os.link(src, dst)  # fails with EEXIST atomically
        os.unlink(src)


# --------------------------------------------------------------------------------------------- staging


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
    return UsageError(f"cannot write {final}: {detail}; nothing was written (free space or choose another location)")


def _is_disk_error(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in _DISK_ERRORS:
        return True
    return any(text in str(err) for text in ("No space left", "Disk quota", "Read-only file system"))


@contextlib.contextmanager
def _staged(final: Path, force: bool) -> Iterator[tuple[Path, list[Path]]]:
    """The shared part of ``staging_dir`` / ``staging_file``: make the staging folder, map errors raised while
    writing to the user's path, remove everything on failure (including parent folders this run created)."""
    final = Path(os.path.abspath(final))
    if final.exists() and not force:
        raise UsageError(f"{final} already exists; pass --force to replace it")
    try:
        created = _make_parents(final)
        clean_stale(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    except OSError as err:
        raise UsageError(f"cannot write to {final.parent}: {err.strerror or err}; choose a writable location") from None
    published = False
    try:
        try:
            yield tmp, created
            published = True
        except SlabconvError as err:
            message = str(err).replace(str(tmp / final.name), str(final)).replace(str(tmp), str(final))
            if message != str(err):
                err.args = (message, *err.args[1:])
            raise
        except Exception as err:
            if _is_disk_error(err):
                raise _cannot_write(final, err) from None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
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
    with _staged(final, force) as (tmp, _):
        yield tmp
        _publish_modes(tmp)
        final = Path(os.path.abspath(final))
        try:
            if not force or not final.exists():
                rename_noreplace(tmp, final)
            elif not _renameat2(tmp, final, _RENAME_EXCHANGE):
                _swap_with_backup(tmp, final)
            else:
                _remove(tmp)  # after the exchange, it holds the old output
        except FileExistsError:
            raise UsageError(f"{final} already exists (another run wrote it meanwhile); nothing was written") from None
        except OSError as err:
            raise _cannot_write(final, err) from None


def _swap_with_backup(tmp: Path, final: Path) -> None:
    """Without ``renameat2``: move the old output aside, the new one in, then remove the old one (``clean_stale``
    restores the old one if the process dies in between)."""
    backup = final.parent / f".{final.name}.old-{os.getpid()}"
    _remove(backup)
    final.rename(backup)
    tmp.rename(final)
    _remove(backup)


@contextlib.contextmanager
def staging_file(final: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``final`` in which to write the file ``final.name`` and its side files (an ONNX
    ``.data``); when the block finishes each is moved into place, ``final`` last: with ``force`` by
    ``os.replace``, without it by a rename that refuses an existing file. On failure nothing is moved.

    Raises:
        UsageError: as ``staging_dir``.
    """
    with _staged(final, force) as (tmp, _):
        yield tmp
        final = Path(os.path.abspath(final))
        if not (tmp / final.name).is_file():
            raise RuntimeError(f"nothing was staged for {final}")
        _publish_modes(tmp)
        placed: list[Path] = []
        try:
            for item in sorted(tmp.iterdir(), key=lambda p: p.name == final.name):
                dst = final.parent / item.name
                if force:
                    os.replace(item, dst)
                else:
                    rename_noreplace(item, dst)
                placed.append(dst)
        except FileExistsError as err:
            for dst in placed:
                _remove(dst)
            raise UsageError(
                f"{err.filename} already exists (another run wrote it meanwhile); nothing was written"
            ) from None
        except OSError as err:
            raise _cannot_write(final, err) from None


def _publish_modes(folder: Path) -> None:
    """Give the staged folder and its files the modes the user's umask asks for (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)
