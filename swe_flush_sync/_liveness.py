"""Liveness a lock proves: a trainer armed through a guard, and a guard itself, hold an exclusive
``flock`` on a file of their own next to the guard's socket, for as long as they live.

The kernel releases a ``flock`` exactly when the last descriptor of its open file closes: at the
holder's death, however it dies, in whatever PID namespace it runs, and never while it is merely
stopped or frozen (a Slurm suspend, a debugger, a C call holding the GIL). So a held lock proves
its holder alive, and a free one proves it gone; no timer or pid is consulted. Lock files are
believed only when their owner is this user or root and nobody else may write them. Where
``flock`` is unsupported (some NFS and FUSE mounts) or a file cannot be examined, nothing is
proven (None) and callers fall back to what they did before. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Final

from ._trust import ownership_problem

LOCK_SUFFIX: Final = ".lock"
UNSUPPORTED: Final = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})


def trainer_lock_path(socket_path: str, token: str) -> str:
    """The lock file of the trainer with ``token`` armed through the guard at ``socket_path``."""
    return f"{socket_path}.{token}{LOCK_SUFFIX}"


def guard_lock_path(socket_path: str, token: str) -> str:
    """The lock file one guard process at ``socket_path`` holds for its life (``token`` names it)."""
    return f"{socket_path}.guard-{token}{LOCK_SUFFIX}"


def hold(path: str) -> int:
    """Create ``path`` (mode 0600, close-on-exec) and take an exclusive ``flock`` on it; the descriptor.

    Raises:
        OSError: it cannot be created, or locked (``errno`` in ``UNSUPPORTED``: no ``flock`` here).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def is_held(path: str) -> bool | None:
    """True when a live process holds the lock at ``path``, False when none does (its holder is gone),
    None when that cannot be told: no such file, a file someone else could have made or written,
    or a file system without ``flock``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if ownership_problem(os.fstat(fd)) is not None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once by the close below
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False
    finally:
        os.close(fd)


def release(fd: int, path: str) -> None:
    """Remove the lock file and close its descriptor (the lock ends with it); never raises."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)
