"""One guard per socket path: ``flock`` on ``PATH.lock``, held for the guard's life (the second guard
exits, however busy the first), and the socket's folder checked before anything is bound in it.

A lock file another uid planted is replaced by one of the guard's own. A draining guard lets the lock
go (its successor takes it) and may look whether another process holds it: a shared lock for a
moment, which a successor waits out (``LOCK_TRIES``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import Final

from .._core.text import shown
from .._process.liveness import UNSUPPORTED
from .._process.trust import ownership_problem

LOCK_TRIES: Final = 100  # tries at the path's lock, 10 ms apart, before another guard is said to serve it


class GuardError(Exception):
    """The guard cannot start (its socket path is taken or unusable, a bad ledger); the message says why."""


def check_folder(folder: str, say: Callable[[str], None]) -> None:
    """Refuse a folder another (non-root) user owns. One that others may write without the sticky bit
    (an emptyDir, mode 0777) is made sticky where this guard may (it owns it, or is root), so no
    other uid can remove or rename what is not theirs; else the operator is told what to change."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid not in (os.geteuid(), 0):
            raise GuardError(f"the socket's folder {shown(folder)} is owned by uid {info.st_uid}: that user "
                             "could replace the socket; use a folder owned by this user or root")
        mode = stat.S_IMODE(info.st_mode)
        if not mode & (stat.S_IWGRP | stat.S_IWOTH) or mode & stat.S_ISVTX:
            return
        try:
            os.fchmod(fd, mode | stat.S_ISVTX)
        except OSError as exc:
            say(f"warning: others may write {shown(folder)} (mode {mode:04o}, no sticky bit) and this guard "
                f"cannot set it ({exc.strerror or exc}): they could replace the socket (trainers check who "
                f"listens before they send anything); run `chmod +t {shown(folder)}` as its owner, or give the "
                "guard a folder only its user may write")
        else:
            say(f"set the sticky bit on {shown(folder)} (mode {mode | stat.S_ISVTX:04o} now): others may write "
                "it, but no longer remove or rename what is not theirs")
    finally:
        os.close(fd)


class PathLock:
    """The path's lock (``flock`` on ``PATH.lock``): taken for the guard's life, kept fresh every
    heartbeat (an age-based tmp cleaner never removes it, and lets a second guard take the path while
    this one is stopped), let go when the guard drains or closes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def take(self, say: Callable[[str], None], say_once: Callable[[str, str], None]) -> None:
        """Take it, waiting out a draining guard's look at it for up to ``LOCK_TRIES`` x 10 ms.

        Raises:
            GuardError: another guard serves the path (it holds the lock), or the lock cannot be made.
        """
        self._fd = _take_lock(self.path, say, say_once)

    def touch(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _take_lock(path: str, say: Callable[[str], None], say_once: Callable[[str, str], None]) -> int:
    """``flock`` on ``path.lock``; its descriptor (see ``PathLock.take``)."""
    lock_path = path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise GuardError(f"cannot open the lock {shown(lock_path)}: {exc.strerror or exc}") from None
    problem = ownership_problem(os.fstat(fd))
    if problem is not None:  # planted by another uid: a fresh lock file of ours is renamed over it
        os.close(fd)
        fd = _replace_lock(lock_path, problem)
        say_once("lock replaced", f"the lock {shown(lock_path)} {problem}: replaced by this guard's own")
    try:
        _lock_soon(fd)
    except BlockingIOError:
        os.close(fd)
        raise GuardError(f"a guard is already serving {shown(path)}") from None
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            os.close(fd)
            raise GuardError(f"cannot lock {shown(lock_path)}: {exc.strerror or exc}") from None
        say(f"warning: {shown(lock_path)} cannot be locked here ({exc.strerror or exc}: no flock on this file "
            "system): one guard per path is not enforced, and trainers are judged by a grace and their "
            "heartbeat; put the socket on a local file system")
    return fd


def lock_taken_by_another(path: str) -> bool:
    """Does another process hold ``path.lock`` now (the successor, once a draining guard let it go)?"""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if ownership_problem(os.fstat(fd)) is not None:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _lock_soon(fd: int) -> None:
    """``flock(LOCK_EX)`` on ``fd``, tried for up to ``LOCK_TRIES`` x 10 ms: the guard told to drain lets it
    go as its loop wakes, and its look at whether its successor lives holds a shared lock for a moment
    (``BlockingIOError`` after that)."""
    for _ in range(LOCK_TRIES - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.01)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _replace_lock(lock_path: str, problem: str) -> int:
    """A fresh lock file of this guard's, renamed over one another uid planted at ``lock_path``; its
    descriptor. ``GuardError`` when it cannot be (a sticky folder that file's owner shares)."""
    beside = f"{lock_path}.{secrets.token_hex(4)}"
    try:
        fd = os.open(beside, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise GuardError(f"the lock {shown(lock_path)} {problem}, and no lock can be made beside it: "
                         f"{exc.strerror or exc}") from None
    try:
        os.rename(beside, lock_path)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(beside)
        raise GuardError(f"the lock {shown(lock_path)} {problem}, and it cannot be replaced: "
                         f"{exc.strerror or exc}") from None
    return fd
