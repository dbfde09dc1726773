"""The guard's socket path: one guard per path, the socket file 0600, and the path kept while it lives.

One guard per path is decided by ``flock`` on ``PATH.lock``, held for the guard's life: the second
guard exits, however busy the first. A stale socket (a guard that died, or another uid's) is
replaced; a path removed or replaced while the guard lives (a tmp cleaner, another container on
a shared folder) is taken back within ``PATH_CHECK`` seconds. Accepting pauses at EMFILE.

A draining guard lets the path's lock go but keeps listening, so that the path always answers:
a successor takes the lock, replaces the draining guard's socket (one answering "draining" is
not a guard serving the path) and binds; the draining guard then stops listening.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from typing import Final

from .._core.text import shown
from .._process.liveness import UNSUPPORTED
from .._process.trust import ownership_problem
from .._process.watch_loop import WatchLoop
from .._process.wire import MAX_SOCKET_PATH
from .._watchdog.guard_client import ImpostorError

PATH_CHECK: Final = 2.0  # seconds between two checks that the socket path is still the guard's
PAUSE: Final = 0.1  # seconds accepting pauses at EMFILE or when every peer holds a trainer
ACCEPT_BATCH: Final = 64  # connections accepted in one turn of the loop, then the others get theirs


class GuardError(Exception):
    """The guard cannot start (its socket path is taken or unusable, a bad ledger); the message says why."""


class SocketPath:
    """The listening socket at ``path``, watched by ``loop`` (``on_readable`` is called when it is).

    Args:
        say: writes one line (a warning the guard's operator should see).
        say_once: ``(kind, line)``: a line said at most once a minute per kind.
        served_by_guard: is a guard of this uid, not draining, answering at a path? (raises
            ``ImpostorError`` for another uid's socket).
    """

    def __init__(self, path: str, loop: WatchLoop, on_readable: Callable[[], None], say: Callable[[str], None],
                 say_once: Callable[[str, str], None], served_by_guard: Callable[[str], bool]) -> None:
        self.path = path
        self._loop = loop
        self._on_readable = on_readable
        self._say = say
        self._say_once = say_once
        self._served_by_guard = served_by_guard
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we bound
        self._lock_fd: int | None = None
        self.handed_over = False  # draining: the lock is let go, the socket answers until a successor binds
        self._lost = False  # the path was removed or replaced and is not taken back yet
        self.paused_until: float | None = None
        self._checked_at = time.monotonic()

    def check(self) -> None:
        """Check the path's length and its folder (made 0700 if missing).

        Raises:
            GuardError: the path is too long, or its folder unusable or another user's.
        """
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise GuardError(f"{shown(self.path)}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes")
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise GuardError(f"cannot create {shown(folder)}: {exc.strerror or exc}") from None
        self._check_folder(folder)

    def take(self) -> None:
        """Take the path (one guard per path, decided by a lock), replace a stale socket, listen (0600).

        Raises:
            GuardError: another guard serves the path, or it cannot be taken.
        """
        self._take_lock()
        self._take_path()
        self._listen()

    def accepted(self) -> Iterator[socket.socket]:
        """The connections waiting (a batch); at EMFILE and the like, accepting pauses for ``PAUSE``."""
        for _ in range(ACCEPT_BATCH):
            if self._listener is None:
                return
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.pause()  # no spinning on a listener that stays readable
                return
            yield conn

    def pause(self) -> None:
        """Accept nothing for ``PAUSE`` seconds (``resume`` ends it)."""
        if self._listener is not None and self.paused_until is None:
            self._loop.unwatch(self._listener.fileno())
            self.paused_until = time.monotonic() + PAUSE

    def resume(self) -> None:
        """Accept again once the pause is over."""
        if self.paused_until is not None and time.monotonic() >= self.paused_until:
            self.paused_until = None
            if self._listener is not None:
                self._loop.watch(self._listener.fileno(), self._on_readable)

    def keep(self) -> None:
        """Every ``PATH_CHECK`` seconds: the path must still be our socket; removed or replaced, it is
        taken back and listened on again, tried every ``PATH_CHECK`` seconds for as long as it fails."""
        now = time.monotonic()
        if now < self._checked_at + PATH_CHECK or self.paused_until is not None:
            return
        if self._listener is None and not self._lost:  # not listening yet, or given up
            return
        self._checked_at = now
        if self._listener is not None:
            with contextlib.suppress(OSError):
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._identity:
                    return
            self._loop.unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if self.handed_over:  # a successor took the path (or it went): the draining guard takes it no more
                self._say(f"the socket at {shown(self.path)} is no longer this draining guard's: new trainers "
                          "arm with the guard that took it")
                return
            self._lost = True
        try:
            self._take_path()
            self._listen()
        except (GuardError, OSError) as exc:
            self._say_once("path", f"the socket at {shown(self.path)} was removed or replaced and cannot be taken "
                                   f"back yet: {exc}; trying again every {PATH_CHECK:g} s")
            return
        self._lost = False
        self._say_once("path back", f"the socket at {shown(self.path)} was removed or replaced; listening there "
                                    "again")

    def hand_over(self) -> None:
        """Draining: let the path's lock go, so that a successor may take the path, and keep answering
        at it until one does (checked every ``PATH_CHECK`` seconds)."""
        self.handed_over = True
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def give_up(self) -> None:
        """Stop listening; remove the socket file only while it is still ours; release the path's lock."""
        self._lost = False
        if self._listener is not None:
            self._loop.unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._identity:
                    os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _listen(self) -> None:
        """Bind the path (the socket file made 0600) and listen on it."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)  # the socket file is made 0600: connecting needs write permission on it
        try:
            listener.bind(self.path)
            info = os.lstat(self.path)
        except OSError as exc:
            listener.close()
            raise GuardError(f"cannot listen on {shown(self.path)}: {exc.strerror or exc}") from None
        finally:
            os.umask(umask)
        self._identity = (info.st_dev, info.st_ino)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._loop.watch(listener.fileno(), self._on_readable)

    def _check_folder(self, folder: str) -> None:
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
                self._say(f"warning: others may write {shown(folder)} (mode {mode:04o}, no sticky bit) and this "
                          f"guard cannot set it ({exc.strerror or exc}): they could replace the socket (trainers "
                          f"check who listens before they send anything); run `chmod +t {shown(folder)}` as its "
                          "owner, or give the guard a folder only its user may write")
            else:
                self._say(f"set the sticky bit on {shown(folder)} (mode {mode | stat.S_ISVTX:04o} now): others "
                          "may write it, but no longer remove or rename what is not theirs")
        finally:
            os.close(fd)

    def _take_lock(self) -> None:
        """``flock`` on ``PATH.lock`` for the guard's life: the second guard on a path exits, however busy the first."""
        lock_path = self.path + ".lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise GuardError(f"cannot open the lock {shown(lock_path)}: {exc.strerror or exc}") from None
        problem = ownership_problem(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            raise GuardError(f"the lock {shown(lock_path)} {problem}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GuardError(f"a guard is already serving {shown(self.path)}") from None
        except OSError as exc:
            if exc.errno not in UNSUPPORTED:
                os.close(fd)
                raise GuardError(f"cannot lock {shown(lock_path)}: {exc.strerror or exc}") from None
            self._say(f"warning: {shown(lock_path)} cannot be locked here ({exc.strerror or exc}: no flock on this "
                      "file system): one guard per path is not enforced, and trainers are judged by a grace and "
                      "their heartbeat; put the socket on a local file system")
        self._lock_fd = fd

    def _take_path(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise GuardError(f"{shown(self.path)} exists and is not a socket")
        served_by = ""
        try:
            if self._served_by_guard(self.path):  # a guard of this uid, of a version that took no lock
                raise GuardError(f"a guard is already serving {shown(self.path)}")
            # (a draining guard's socket, or none that answers: replaced)
        except ImpostorError as exc:  # the lock is ours, so the path is: another uid's socket is replaced
            served_by = f", served by uid {exc.uid}"
        try:
            os.unlink(self.path)  # a stale socket left by a guard that died, or another uid's
        except OSError as exc:
            raise GuardError(f"cannot remove the socket {shown(self.path)} (owned by uid {info.st_uid}"
                             f"{served_by}): {exc.strerror or exc}; remove it as that user, or run the guard as "
                             "that user") from None
        if served_by:
            self._say_once("path squatted", f"replaced the socket at {shown(self.path)}{served_by}: this guard holds "
                                            "the path's lock")
