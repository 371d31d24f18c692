"""Output targets checked before any work (``check_output_folder``, ``check_output_file``): what ``--force`` may
replace (only what slabconv wrote, every file still with the sha256 its ``report.json`` records), which paths are
never an output (the current folder and its ancestors, the home folder, ``/``, an input or a folder holding one, a
symbolic link, a mount point, a FIFO or device), names too long for the file system, write permission. The rules
are ``docs/security.md``'s; ``slabconv.write.staging`` writes and publishes the checked target.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from slabconv.errors import UsageError
from slabconv.text import shown
from slabconv.util import SPECIAL_FILES, sha256_file

REPORT = "report.json"
"""The report every output folder holds; it lists the files slabconv wrote."""
STAGING_EXTRA = len(".") + len(".tmp-") + 10 + len("-") + 16
"""What a staging folder's name adds to the target's (``.<name>.tmp-<pid>-<token>``, pid up to 10 digits, token
16 hex digits): a target whose name would make the staging name too long is refused first."""


# --------------------------------------------------------------------------------------------- checks


def _recorded(folder: Path) -> tuple[set[str], dict[str, str]] | None:
    """The names slabconv wrote into ``folder`` (``report.json`` included) and the sha256 it recorded for each
    (``outputs.sha256``), or None when the folder has no readable slabconv report."""
    from slabconv.load.fused import WrittenReport  # torch stays unloaded until a folder is checked

    report = WrittenReport.read(folder)
    return None if report is None else (set(report.files), report.sha256)


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
    hashes = _check_foreign(target, out, entries)
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


def _check_foreign(target: Path, out: object, entries: list[str]) -> dict[str, str]:
    """Refuse a non-empty ``target`` (its ``entries``) without slabconv's ``report.json``, or holding a file that
    report does not list: ``--force`` would not replace it either. Returns the sha256 the report records per file.

    Raises:
        UsageError: naming the first files that are not slabconv's.
    """
    recorded = _recorded(target)
    owned, hashes = recorded if recorded is not None else (set(), {})
    foreign = entries if recorded is None else [e for e in entries if e not in owned]
    listed = ", ".join(shown(e, 60) for e in foreign[:3]) + (
        f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    )
    if recorded is None:
        raise UsageError(
            f"--out {shown(out)} holds {listed}, and no report.json of slabconv: it is not a folder slabconv wrote, so "
            "--force will not replace it; choose a new folder"
        )
    if foreign:
        raise UsageError(
            f"--out {shown(out)} holds {listed}, which slabconv did not write; --force replaces only slabconv's own "
            "output: move those files or choose a new folder"
        )
    return hashes


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
        if len(os.fsencode(part.name)) + (STAGING_EXTRA if part == target else 0) > 255:
            raise UsageError(
                f"{shown(target)}: the name {shown(part.name[:40])!r}... has {len(part.name)} characters; file systems "
                "allow 255 or fewer (less the suffix slabconv adds while writing); choose a shorter name"
            )
    _check_path_length(target, 4096)  # PATH_MAX on Linux, before any system call (they raise over it too)
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
        extra = STAGING_EXTRA if part == target else 0  # the staging folder's name is the target's plus a suffix
        if len(os.fsencode(part.name)) + extra > name_max:
            raise UsageError(
                f"{shown(target)}: the name {shown(part.name[:40])!r}... has {len(part.name)} characters; this file "
                f"system allows {name_max - extra} here; choose a shorter name"
            )
    _check_path_length(target, path_max)
    _probe(existing)
    umask = os.umask(0)
    os.umask(umask)
    if umask & 0o700:  # the files would be written, then unreadable to the verification (and to you)
        raise UsageError(
            f"cannot write {shown(target)}: the umask {umask:04o} takes your own read or write permission from what "
            "slabconv writes; run it with a umask that leaves them (e.g. umask 022)"
        )


def _probe(folder: Path) -> None:
    """Create a file in ``folder`` and remove it again: the one test of "can be written" that every file system
    answers truly (``os.access`` says yes to root on sysfs or a folder an ACL or a read-only mount closes).

    Raises:
        UsageError: ``cannot write to DIR: permission denied; choose a writable output location`` (or the
            system's reason).
    """
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {shown(folder)}: permission denied; choose a writable output location")
    try:
        fd, name = tempfile.mkstemp(prefix=".slabconv-probe-", dir=folder)
    except OSError as err:
        reason = "permission denied" if err.errno in (errno.EACCES, errno.EPERM) else (err.strerror or str(err))
        raise UsageError(f"cannot write to {shown(folder)}: {reason}; choose a writable output location") from None
    os.close(fd)
    os.unlink(name)


def _check_path_length(target: Path, path_max: int) -> None:
    """Refuse a target whose staged files' paths (``<staging folder>/<name>``, with room for the names inside)
    would be over ``path_max`` bytes."""
    staged = len(os.fsencode(str(target))) + STAGING_EXTRA + 1 + len(os.fsencode(target.name))
    if staged + 64 > path_max:
        raise UsageError(f"{shown(target)}: the path is too long for this file system ({len(str(target))} characters)")


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
        if any(target.iterdir()):  # a folder --force would not replace either is said so now, not after a retry
            _check_foreign(target, out, sorted(p.name for p in target.iterdir()))
        raise UsageError(f"{shown(out)} already exists; pass --force to replace it (only a folder slabconv wrote)")
    _check_replaceable(target, f"--out {out}")
    if any(target.iterdir()):
        _check_owned(target, out)
    if not os.access(target, os.W_OK | os.X_OK):  # the swap moves it aside and removes what it holds
        raise UsageError(
            f"--out {shown(out)} is read-only, and --force moves the old output aside and removes it; make it "
            "writable (chmod -R u+w) or choose a new folder"
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


def holds_mark(path: Path, mark: bytes, head: int) -> bool:
    """True when ``path`` is a regular file whose first ``head`` bytes hold ``mark`` (how an output file slabconv
    wrote is known: ``--junit``, ``--plot``); a FIFO or device is never read (opening a FIFO waits for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(fd).st_mode) and mark in f.read(head)


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
    kind = SPECIAL_FILES.get(stat.S_IFMT(mode))
    if kind is not None:
        raise UsageError(f"{shown(target)}: not a regular file ({kind}); give a file path")
