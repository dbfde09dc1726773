"""Liveness a lock proves: a trainer armed through a guard, and a guard itself, hold an exclusive
``flock`` on a file in the guard's own lock folder for as long as they live.

The kernel releases a ``flock`` exactly when the last descriptor of its open file closes: at the
holder's death, however it dies, in whatever PID namespace it runs, and never while it is merely
stopped or frozen (a Slurm suspend, a debugger, a C call holding the GIL). So a held lock proves
its holder alive, and a free one proves it gone; no timer or pid is consulted.

Only the guard names these files. Its folder (``PATH.locks``, mode 0700, its uid) is checked at
every open (``O_NOFOLLOW``, ``fstat``); for each trainer it creates a file of a random name
(``O_EXCL``), locks it, passes the open descriptor to the trainer over the socket
(``SCM_RIGHTS``) and closes its own: the trainer's copy then holds the lock alone. A record names
the file and its inode; a file that is gone, or is not that inode, or sits in a folder others may
write, proves nothing (None): its trainer is judged as a lockless one is. Where ``flock`` is
unsupported (some NFS and FUSE mounts), nothing is proven either. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import tempfile
from enum import Enum
from typing import Final, NamedTuple

from .trust import ownership_problem

LOCKS_SUFFIX: Final = ".locks"
UNSUPPORTED: Final = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})


DISARMED_MARK: Final = b"disarmed\n"  # written by a trainer into its lock files as it disarms (see ``ownership``)
HANDED_MARK: Final = b"handed\n"  # ... into an older lock it lets go once a newer guard's is on record


class LockState(Enum):
    """What a lock file says of its holder."""

    HELD = "held"  # a live process holds it
    FREE = "free"  # nobody holds it: its holder let it go or died
    DISARMED = "disarmed"  # nobody holds it, and its holder wrote that it disarmed first
    HANDED = "handed"  # nobody holds it, and its holder wrote that a newer guard's lock replaced it
    UNKNOWN = "unknown"  # the folder may not be believed, the file is gone or another inode, or no flock here


class LockFile(NamedTuple):
    """A lock file as a record names it: its path and its inode (``DEV:INO``)."""

    path: str
    inode: str


def lock_folder_path(socket_path: str) -> str:
    """The lock folder of the guard at ``socket_path``."""
    return socket_path + LOCKS_SUFFIX


def folder_problem(info: os.stat_result) -> str | None:
    """What makes a lock folder untrustworthy (another user could rename a file in it), or None."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"is open to its group or others (mode {stat.S_IMODE(info.st_mode):04o}, not 0700)"
    return ownership_problem(info)


def _inode(info: os.stat_result) -> str:
    return f"{info.st_dev}:{info.st_ino}"


def _open_folder(path: str) -> int:
    """The folder at ``path`` opened (not through a symbolic link), checked; ``OSError`` when it may not be believed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    problem = folder_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} {problem}")
    return fd


class LockFolder:
    """The guard's lock folder: made 0700 if missing, held open and share-locked (``systemd-tmpfiles``
    skips a folder that is locked) for the guard's life."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def open(self) -> str | None:
        """Make (0700) or open the folder and check it. One that may not be believed (another uid's, a
        link, open to others: planted while no guard ran) is moved aside and made afresh, or, where
        it cannot be moved (a sticky folder), a fresh folder with a random name beside it is used:
        what moved aside, or the fresh folder's name, is returned for the guard to say. ``OSError``
        (its message says why) when no folder can be used."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path, 0o700)
        said = None
        try:
            fd = _open_folder(self.path)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EACCES, errno.ELOOP, errno.ENOTDIR):
                raise
            original, aside = self.path, f"{self.path}.untrusted-{secrets.token_hex(4)}"
            why = exc.strerror if exc.errno == errno.EPERM else f"{original} cannot be opened ({exc.strerror})"
            try:
                os.rename(original, aside)
                os.mkdir(original, 0o700)
                said = f"{why}: moved aside to {aside}, and made afresh"
            except OSError:
                self.path = tempfile.mkdtemp(prefix=os.path.basename(original) + ".",
                                             dir=os.path.dirname(original) or ".")
                said = f"{why}, and cannot be moved aside: this guard's lock files are in {self.path}"
            fd = _open_folder(self.path)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self._fd = fd
        return said

    def create(self, prefix: str) -> tuple[int, LockFile]:
        """A new lock file (a random name after ``prefix``, 0600), exclusively locked: its descriptor
        and how a record names it. ``OSError`` when it cannot be made or locked."""
        if self._fd is None:
            raise OSError(errno.EBADF, "the lock folder is not open")
        name = prefix + secrets.token_hex(16)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, LockFile(os.path.join(self.path, name), _inode(os.fstat(fd)))
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)
            raise

    def state(self, lock: LockFile) -> LockState:
        """``lock_state`` of a lock file of this folder, through the folder this guard opened and checked."""
        folder, name = os.path.split(lock.path)
        if self._fd is None or folder != self.path:
            return LockState.UNKNOWN
        return _state_in(self._fd, name, lock.inode)

    def mark(self, lock: LockFile, mark: bytes) -> None:
        """Write ``mark`` into a lock file of this folder, if it is still the one ``lock`` names (a trainer
        that disarmed before it read the lock's descriptor could not mark it itself); never raises."""
        folder, name = os.path.split(lock.path)
        if self._fd is None or folder != self.path:
            return
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
            try:
                if _inode(os.fstat(fd)) == lock.inode:
                    os.pwrite(fd, mark, 0)
            finally:
                os.close(fd)

    def remove(self, lock: LockFile) -> None:
        """Remove a lock file of this folder, if it is still the one ``lock`` names; never raises."""
        folder, name = os.path.split(lock.path)
        if self._fd is None or folder != self.path:
            return
        with contextlib.suppress(OSError):
            if _inode(os.stat(name, dir_fd=self._fd, follow_symlinks=False)) == lock.inode:
                os.unlink(name, dir_fd=self._fd)

    def touch(self) -> None:
        """Set the folder's and its files' times to now, so that an age-based cleaner leaves them; never raises."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.utime(self._fd)
            for name in os.listdir(self._fd):
                with contextlib.suppress(OSError):
                    os.utime(name, dir_fd=self._fd, follow_symlinks=False)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def lock_state(lock: LockFile) -> LockState:
    """What ``lock`` says of its holder (``LockState``): its folder and file are checked first."""
    folder, name = os.path.split(lock.path)
    try:
        folder_fd = _open_folder(folder)
    except OSError:
        return LockState.UNKNOWN
    try:
        return _state_in(folder_fd, name, lock.inode)
    finally:
        os.close(folder_fd)


def is_held(lock: LockFile) -> bool | None:
    """True when a live process holds ``lock``, False when none does, None when that cannot be told."""
    state = lock_state(lock)
    return None if state is LockState.UNKNOWN else state is LockState.HELD


def _state_in(folder_fd: int, name: str, inode: str) -> LockState:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError:
        return LockState.UNKNOWN
    try:
        info = os.fstat(fd)
        if _inode(info) != inode or ownership_problem(info) is not None:
            return LockState.UNKNOWN
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once by the close below
        except BlockingIOError:
            return LockState.HELD
        except OSError:
            return LockState.UNKNOWN
        return _MARKS.get(os.pread(fd, 16, 0), LockState.FREE)
    finally:
        os.close(fd)


_MARKS: Final = {DISARMED_MARK: LockState.DISARMED, HANDED_MARK: LockState.HANDED}


def remove_if_free(lock: LockFile) -> None:
    """Remove a lock file whose holder is gone (a recovered record's): only the inode the record
    names, in a folder that may be believed, and only while nobody holds its lock; never raises."""
    folder, name = os.path.split(lock.path)
    with contextlib.suppress(OSError):
        folder_fd = _open_folder(folder)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
            try:
                if _inode(os.fstat(fd)) == lock.inode:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: held, left alone
                    os.unlink(name, dir_fd=folder_fd)
            finally:
                os.close(fd)
        finally:
            os.close(folder_fd)


def record_lock(path: object, inode: object) -> LockFile | None:
    """The lock a record names, when it names one whole."""
    return LockFile(path, inode) if isinstance(path, str) and isinstance(inode, str) else None
