"""Atomic checkpoint directories: hidden scratch directories, safe replacement, clean-up of interrupted saves.

A save of ``root/X`` writes into ``root/.X.tmp-<id>`` and renames it to ``root/X``
when complete. While it runs, the saving process (the group's first rank) holds
an exclusive ``flock`` on ``root/.X.tmp-<id>.lock``, a file holding its host and
process id, written after the lock was taken. A lock that can be taken while the
file is non-empty therefore belongs to a save whose process died (locks are
released by the kernel at exit, SIGKILL included): its scratch directory is
certainly stale and the next save into ``root`` removes it. Scratch directories
without a lock file (older versions) or whose lock cannot be tested are only
reported.

Replacing an existing ``X`` swaps the two directories in one ``renameat2
(RENAME_EXCHANGE)`` call where the system offers it (Linux), so ``X`` names a
complete checkpoint at every instant. Elsewhere ``X`` is first renamed to
``.X.old-<id>`` and the new one renamed into place; a crash between the two leaves
no ``X``, and ``resolve_committed`` then finds the old copy (loads fall back to it
with a warning, and the clean-up keeps it until ``X`` exists again).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
import sys
import uuid
import warnings

TMP_MARKER = ".tmp-"
OLD_MARKER = ".old-"
LOCK_SUFFIX = ".lock"
_ID = r"[0-9a-f]{12}"
_LOCK_RE = re.compile(rf"^\.(?P<name>.+)\.tmp-(?P<id>{_ID})\.lock$")
_LEGACY_RE = re.compile(rf"^\.(?P<name>.+)\.tmp-(old-)?{_ID}$")  # scratch of versions without locks

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no POSIX locks, so nothing is ever certainly stale
    fcntl = None  # type: ignore[assignment]


class ScratchDir:
    """A hidden directory beside ``final`` (same filesystem: the rename is atomic), locked while alive.

    The lock is ``flock``'s: tied to this open file, so even another check in the
    same process sees it held.
    """

    def __init__(self, final: str) -> None:
        self.final = os.path.abspath(final)
        parent, name = os.path.split(self.final)
        os.makedirs(parent, exist_ok=True)
        self.id = uuid.uuid4().hex[:12]
        self.path = os.path.join(parent, f".{name}{TMP_MARKER}{self.id}")
        self.lock_path = self.path + LOCK_SUFFIX
        self.old_path = os.path.join(parent, f".{name}{OLD_MARKER}{self.id}")
        self._lock_fd: int | None = None
        if fcntl is not None:
            self._lock_fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            except OSError:  # a filesystem without locks: the file stays empty, so never taken for stale
                pass
            else:
                os.write(self._lock_fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        try:
            os.makedirs(self.path)
        except BaseException:
            self.close(remove=False)
            raise

    def commit(self) -> None:
        """Rename the complete scratch directory to ``final`` (replacing an older one safely), fsync the parent."""
        parent, name = os.path.split(self.final)
        if not os.path.exists(self.final):
            _rename(self.path, self.final)
        elif exchange(self.path, self.final):
            fsync_dir(parent)
            shutil.rmtree(self.path, ignore_errors=True)  # now the old checkpoint
        else:
            _rename(self.final, self.old_path)
            _rename(self.path, self.final)
            fsync_dir(parent)
            shutil.rmtree(self.old_path, ignore_errors=True)
        fsync_dir(parent)

    def close(self, *, remove: bool) -> None:
        """Release the lock (and remove the scratch directory if ``remove``); the lock file goes last."""
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            if not os.path.exists(self.path) and not os.path.exists(self.old_path):
                _remove(self.lock_path)  # else the next save's clean-up finds it (see clean_stale)
            os.close(self._lock_fd)
            self._lock_fd = None


_rename = os.rename  # module-level so that tests can interrupt a replacement between its two renames


def exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot exchange
        return False
    raise OSError(errno, f"renameat2(RENAME_EXCHANGE) of {a!r} and {b!r} failed: {os.strerror(errno)}")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _dead_owner(lock_path: str) -> int | None:
    """An fd holding ``lock_path``'s lock if its save is certainly dead (lock free, owner written), else None."""
    if fcntl is None:
        return None
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live save, or locks unsupported here: not certain
        os.close(fd)
        return None
    if os.fstat(fd).st_size == 0:  # its creator has not finished taking the lock
        os.close(fd)
        return None
    return fd


def clean_stale(parent: str) -> list[str]:
    """Remove the scratch of interrupted saves in ``parent`` (see the module docstring); return what was removed.

    Scratch that is not certainly stale (no lock file: written by an older version)
    is reported in a warning with its size, and left alone.
    """
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    present = set(names)
    for entry in sorted(names):
        match = _LOCK_RE.match(entry)
        if match is None:
            continue
        fd = _dead_owner(os.path.join(parent, entry))
        if fd is None:
            continue
        try:
            name, ident = match["name"], match["id"]
            tmp = os.path.join(parent, f".{name}{TMP_MARKER}{ident}")
            old = os.path.join(parent, f".{name}{OLD_MARKER}{ident}")
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
                removed.append(tmp)
            # .X.old-<id> is the only copy of X while X is missing: keep it (loads fall back to it)
            if os.path.exists(old) and name in present:
                shutil.rmtree(old)
                removed.append(old)
            if not os.path.exists(old):
                _remove(os.path.join(parent, entry))
        finally:
            os.close(fd)
    legacy = [e for e in names if _LEGACY_RE.match(e) and not os.path.exists(os.path.join(parent, e + LOCK_SUFFIX))]
    if legacy:
        sizes = {e: _tree_size(os.path.join(parent, e)) for e in legacy}
        warnings.warn(
            f"{parent} holds scratch directories of interrupted saves written by an older version: "
            + ", ".join(f"{e} ({sizes[e] / 2**20:.1f} MiB)" for e in legacy)
            + ". They are not checkpoints; delete them if no other job is saving into this directory",
            stacklevel=3,
        )
    return removed


def _tree_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def resolve_committed(path: str) -> str:
    """``path``, or, if it is missing after a replacement was interrupted, the old copy kept beside it."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    parent, name = os.path.split(path)
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return path
    prefix = f".{name}{OLD_MARKER}"
    olds = [os.path.join(parent, e) for e in entries if e.startswith(prefix)]
    olds = [o for o in olds if os.path.isfile(os.path.join(o, ".metadata"))]
    if not olds:
        return path
    old = max(olds, key=os.path.getmtime)
    warnings.warn(
        f"{path} is missing: a save replacing it was interrupted between its two renames. Loading the previous "
        f"copy kept at {old}; the next save of {name} replaces it",
        stacklevel=3,
    )
    return old
