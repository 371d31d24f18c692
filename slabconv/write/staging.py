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
import ctypes.util
import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from slabconv.errors import SlabconvError, UsageError
from slabconv.text import shown
from slabconv.util import sha256_file

REPORT = "report.json"
"""The file that marks a folder as slabconv's own: it lists every other file slabconv wrote there."""

MARKER = ".slabconv-staging"
"""The file in every staging folder slabconv makes: JSON with the folder's token, pid and final name."""

_TOKEN_HEX = 16
_STAGING = re.compile(rf"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-(?P<token>[0-9a-f]{{{_TOKEN_HEX}}})$")
_STAGING_EXTRA = len(".") + len(".tmp-") + 10 + len("-") + _TOKEN_HEX  # what the staging folder's name adds
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


# --------------------------------------------------------------------------------------------- checks


def _recorded(folder: Path) -> tuple[set[str], dict[str, str]] | None:
    """The names slabconv wrote into ``folder`` (``report.json`` included) and the sha256 it recorded for each
    (``outputs.sha256``), or None when the folder has no readable slabconv report."""
    from slabconv.load.fused import WrittenReport  # torch stays unloaded until a folder is checked

    report = WrittenReport.read(folder)
    return None if report is None else (set(report.files), report.sha256)


def owned_files(folder: Path) -> set[str] | None:
    """The names slabconv wrote into ``folder`` according to its ``report.json`` (the report itself included),
    or None when the folder has no readable slabconv report."""
    recorded = _recorded(folder)
    return None if recorded is None else recorded[0]


_unchanged: dict[Path, dict[str, tuple[int, int, int]]] = {}
"""Per output folder checked by ``_check_owned``: each file's (size, mtime_ns, inode) when its sha256 matched, so
the check just before the swap need not hash again (a file touched since is hashed again)."""


def _check_owned(target: Path, out: object) -> None:
    """Refuse to replace ``target`` (an existing, non-empty folder) unless slabconv wrote every file in it and each
    still has the sha256 its ``report.json`` records.

    Raises:
        UsageError: no slabconv report, a file slabconv did not write, or a file changed since (named).
    """
    entries = sorted(p.name for p in target.iterdir())
    recorded = _recorded(target)
    if recorded is None:
        listed = ", ".join(shown(e, 60) for e in entries[:3]) + (
            f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        )
        raise UsageError(
            f"--out {shown(out)} holds {listed}, and no report.json of slabconv: it is not a folder slabconv wrote, so "
            "--force will not replace it; choose a new folder"
        )
    owned, hashes = recorded
    foreign = [e for e in entries if e not in owned]
    if foreign:
        listed = ", ".join(shown(e, 60) for e in foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise UsageError(
            f"--out {shown(out)} holds {listed}, which slabconv did not write; --force replaces only slabconv's own "
            "output: move those files or choose a new folder"
        )
    seen = _unchanged.setdefault(target, {})
    for name in entries:
        if name == REPORT:
            continue
        path = target / name
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or name not in hashes:
            raise UsageError(
                f"--out {shown(out)}: {shown(name)} is not a file whose sha256 slabconv's report.json records; --force "
                "replaces only slabconv's own output: move it or choose a new folder"
            )
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        if seen.get(name) == key:
            continue
        if sha256_file(path) != hashes[name]:
            raise UsageError(
                f"--out {shown(out)}: {shown(name)} changed since slabconv wrote it (its sha256 is not the one "
                "report.json records); --force will not replace an edited file: move it or choose a new folder"
            )
        seen[name] = key


def _check_replaceable(target: Path, out: object) -> None:
    """Refuse an existing target that one rename cannot replace: a mount point (another file system than the
    folder holding it, ``os.path.ismount``), where the swap would fail with EBUSY/EXDEV after all the work."""
    if os.path.ismount(target):
        raise UsageError(
            f"{shown(out)} is a mount point (another file system than its folder): slabconv replaces an output with "
            "one atomic rename, which cannot replace it; choose a new path inside it or elsewhere"
        )


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
                f"{shown(target)}: the name {shown(part.name[:40])!r}... has {len(part.name)} characters; file systems "
                "allow 255 or fewer (less the suffix slabconv adds while writing); choose a shorter name"
            )
    if target.is_symlink():
        where = os.readlink(target)
        raise UsageError(f"{shown(target)} is a symbolic link (to {shown(where)}); give the real path you want written")
    missing: list[Path] = [] if target.exists() else [target]
    existing = target.parent  # where the staging folder is made
    while not existing.exists():
        if existing.is_symlink():
            raise UsageError(
                f"{shown(existing)} is a symbolic link to {shown(os.readlink(existing))}, which does not exist"
            )
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"cannot write {shown(target)}: {shown(existing)} is a file, not a folder")
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    for part in {*missing, target}:
        extra = _STAGING_EXTRA if part == target else 0  # the staging folder's name is the target's plus a suffix
        if len(part.name.encode()) + extra > name_max:
            raise UsageError(
                f"{shown(target)}: the name {shown(part.name[:40])!r}... has {len(part.name)} characters; this file "
                f"system allows {name_max - extra} here; choose a shorter name"
            )
    staged = len(str(target).encode()) + _STAGING_EXTRA + 1 + len(target.name.encode())  # <staging>/<name>
    if staged + 64 > path_max:
        raise UsageError(f"{shown(target)}: the path is too long for this file system ({len(str(target))} characters)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {shown(existing)}: permission denied; choose a writable output location")


def _pathconf(path: Path, name: str, default: int) -> int:
    """``os.pathconf(path, name)``, or ``default`` where the system has no ``pathconf`` (Windows), does not know
    the name, or reports no limit."""
    pathconf = getattr(os, "pathconf", None)
    if pathconf is None:
        return default
    try:
        value = pathconf(path, name)
    except (OSError, ValueError):
        return default
    return default if value is None or value < 0 else int(value)


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
            not write or files changed since (their sha256 differs from ``report.json``), is a mount point, is a
            file or a link, or cannot be written (each message says what is there).
    """
    target = Path(os.path.abspath(out)) if str(out) else Path.cwd()
    why = _forbidden(target.resolve(), inputs)
    if why:
        raise UsageError(f"--out {shown(out or '.')} is {why}; slabconv never replaces it: choose a new folder")
    _check_path(target)
    if not target.exists():
        return target
    if not target.is_dir():
        raise UsageError(f"--out {shown(out)} is an existing file, not a folder; slabconv will not replace it")
    if not force:
        raise UsageError(f"{shown(out)} already exists; pass --force to replace it (only a folder slabconv wrote)")
    _check_replaceable(target, f"--out {out}")
    if any(target.iterdir()):
        _check_owned(target, out)
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
            raise UsageError(f"{shown(target)} is an input of this run; choose another path")
    _check_path(path)
    _check_special(path, target)
    if path.exists():
        if path.is_dir():
            raise UsageError(
                f"{shown(target)} is a folder; give a file path such as {shown(Path(target) / 'model.onnx')}"
            )
        if owned is None or not owned(path):
            raise UsageError(f"{shown(target)} already exists and slabconv did not write it; choose another path")
        if not force:
            raise UsageError(f"{shown(target)} already exists; pass --force to replace it")
        _check_replaceable(path, target)
    return path


_SPECIAL_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _check_special(path: Path, target: Path | str) -> None:
    """Refuse, at once, an output file path that names a FIFO, socket or device: checking whether slabconv wrote it
    would open it (a FIFO waits for a writer forever), and writing it would wait for a reader or never end. The one
    check for every single-file output (``--onnx``, ``--junit``, ``--plot``).

    Raises:
        UsageError: ``PATH: not a regular file (a FIFO (named pipe)); give a file path``.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    kind = _SPECIAL_KINDS.get(stat.S_IFMT(mode))
    if kind is not None:
        raise UsageError(f"{shown(target)}: not a regular file ({kind}); give a file path")


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
def _staged(final: Path, force: bool) -> Iterator[tuple[Path, list[Path]]]:
    """The shared part of ``staging_dir`` / ``staging_file``: make the staging folder, map errors raised while
    writing to the user's path, remove everything on failure (including parent folders this run created)."""
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
            yield tmp, created
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
    with _staged(final, force) as (tmp, _):
        yield tmp
        _publish_modes(tmp)
        final = Path(os.path.abspath(final))
        try:
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
    with _staged(final, force) as (tmp, _):
        yield tmp
        final = Path(os.path.abspath(final))
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
