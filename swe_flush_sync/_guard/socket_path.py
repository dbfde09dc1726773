"""The guard's socket path: one guard per path, the socket file 0600, and the path kept while it lives.

One guard per path is decided by ``flock`` on ``PATH.lock``, held for the guard's life: the second
guard exits, however busy the first. A stale socket (a guard that died, or another uid's) is
replaced; a path removed or replaced while the guard lives (a tmp cleaner, another container on
a shared folder) is taken back within ``PATH_CHECK`` seconds. Accepting pauses at EMFILE.

A draining guard lets the path's lock go but keeps listening, so that the path always answers: a
successor takes the lock and asks the draining guard for its listening socket (``listener``, passed
with ``SCM_RIGHTS`` as nginx and HAProxy do on a seamless reload), which then accepts no more; the
connections waiting in the socket's queue are the successor's. No client ever finds the path
missing or refused. A successor that finds no draining guard binds a fresh socket beside the path
and renames it over whatever stale socket is there (never a moment with no file at the path).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from typing import Final

from .._core.text import shown
from .._process.liveness import UNSUPPORTED
from .._process.trust import ownership_problem
from .._process.watch_loop import WatchLoop
from .._process.wire import LISTENER, MAX_SOCKET_PATH, send_with_fd
from .._watchdog.guard_client import ImpostorError, connect_to_guard

PATH_CHECK: Final = 2.0  # seconds between two checks that the socket path is still the guard's
PAUSE: Final = 0.1  # seconds accepting pauses at EMFILE or when every peer holds a trainer
ACCEPT_BATCH: Final = 64  # connections accepted in one turn of the loop, then the others get theirs
LOCK_TRIES: Final = 100  # tries at the path's lock, 10 ms apart, before another guard is said to serve it
INHERIT_TIMEOUT: Final = 2.0  # seconds a successor waits for a draining guard to pass its listening socket


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
        self.passed = False  # the listening socket was passed to a successor: the path is its own now
        self.inherited = False  # this guard's listening socket was passed to it by a draining predecessor
        self.handed_over = False  # draining: the lock is let go, the socket answers until a successor binds
        self._lost = False  # the path was removed or replaced and is not taken back yet
        self.paused_until: float | None = None
        self._checked_at = time.monotonic()
        self._stale_owner = ""  # who owned a stale socket found at the path (said if it cannot be replaced)
        self._predecessor: socket.socket | None = None  # the connection to the guard that passed the listener

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
        if self._inherit():
            return
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
        if self._listener is not None and self.paused_until is None and not self.passed:
            self._loop.unwatch(self._listener.fileno())
            self.paused_until = time.monotonic() + PAUSE

    def resume(self) -> None:
        """Accept again once the pause is over."""
        if self.paused_until is not None and time.monotonic() >= self.paused_until:
            self.paused_until = None
            if self._listener is not None and not self.passed:
                self._loop.watch(self._listener.fileno(), self._on_readable)

    def keep(self) -> None:
        """Every ``PATH_CHECK`` seconds: the path must still be our socket; removed or replaced, it is
        taken back and listened on again, tried every ``PATH_CHECK`` seconds for as long as it fails."""
        now = time.monotonic()
        if now < self._checked_at + PATH_CHECK or self.paused_until is not None:
            return
        if (self._listener is None and not self._lost) or self.passed:  # not listening yet, given up, or passed on
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

    def pass_listener(self, reply_fd: int) -> bool:
        """Draining: pass the listening socket over ``reply_fd`` to the successor that asked, once it
        holds the path's lock (no other process may have it), and accept no more here; True if passed."""
        if self._listener is None or self.passed or not self.handed_over or not self._lock_taken_by_another():
            return False
        try:
            send_with_fd(reply_fd, LISTENER + b"\n", self._listener.fileno())
        except OSError:
            return False
        self._loop.unwatch(self._listener.fileno())  # its copy is kept: taken back if the successor dies
        self.passed = True
        self._say(f"passed the listening socket at {shown(self.path)} to the successor; new trainers arm with it")
        return True

    def successor_gone(self) -> None:
        """The successor's connection ended (it died, or exited): this draining guard accepts again on
        its copy, until another successor asks for it."""
        if self.passed and self._listener is not None:
            self.passed = False
            self._loop.watch(self._listener.fileno(), self._on_readable)
            self._say(f"the successor at {shown(self.path)} is gone: this draining guard answers there again")

    def _lock_taken_by_another(self) -> bool:
        """Does another process hold the path's lock now (the successor, after ``hand_over``)?"""
        try:
            fd = os.open(self.path + ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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

    def _inherit(self) -> bool:
        """Ask a draining guard of this uid (or root) at the path for its listening socket; True when it
        was passed and is listened on here."""
        try:
            sock = connect_to_guard(self.path, INHERIT_TIMEOUT)
        except (OSError, ImpostorError):
            return False  # nobody answers (a stale socket, or none), or another uid's: bound afresh
        try:
            try:
                sock.sendall(b'{"listener": true}\n')
                data, fds = b"", list[int]()
                while not data.endswith(b"\n") and not fds:
                    chunk, ancillary, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
                    fds += [int.from_bytes(payload[i:i + 4], "little", signed=True) for level, kind, payload
                            in ancillary if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                            for i in range(0, len(payload) - len(payload) % 4, 4)]
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                return False
        finally:
            if not fds:
                sock.close()
        listener = None
        for fd in fds:
            if listener is None and data.startswith(LISTENER + b"\n"):
                listener = socket.socket(fileno=fd)
            else:
                os.close(fd)
        try:
            if listener is None or listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM \
                    or not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise OSError("not a listening socket")
            info = os.lstat(self.path)
        except OSError:
            if listener is not None:
                listener.close()
            sock.close()
            return False
        listener.setblocking(False)
        self._listener, self._identity, self.inherited = listener, (info.st_dev, info.st_ino), True
        self._predecessor = sock  # held open for life: its end tells the predecessor this guard is gone
        self._loop.watch(listener.fileno(), self._on_readable)
        return True

    def give_up(self) -> None:
        """Stop listening; remove the socket file only while it is still ours; release the path's lock."""
        self._lost = False
        if self._listener is not None:
            self._loop.unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._identity and not self.passed \
                        and not (self.handed_over and self._lock_taken_by_another()):  # (else: a successor's)
                    os.unlink(self.path)
        if self._predecessor is not None:
            self._predecessor.close()
            self._predecessor = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _listen(self) -> None:
        """Listen on a fresh socket (its file made 0600) at the path: bound beside it and renamed over
        it, so that the path is never missing; bound at the path itself where the name beside it is
        too long or cannot be used."""
        beside = f"{self.path}.{secrets.token_hex(4)}"
        listener = None
        if len(os.fsencode(beside)) <= MAX_SOCKET_PATH:
            with contextlib.suppress(OSError):
                listener = self._bound(beside)
                try:
                    os.rename(beside, self.path)
                except OSError:
                    listener.close()
                    listener = None
                    with contextlib.suppress(OSError):
                        os.unlink(beside)
        if listener is None:
            try:
                with contextlib.suppress(FileNotFoundError):  # (removed meanwhile: a draining guard's end)
                    if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                        os.unlink(self.path)
            except OSError as exc:
                raise GuardError(f"cannot remove the socket {shown(self.path)}{self._stale_owner}: "
                                 f"{exc.strerror or exc}; remove it as that user, or run the guard as that user") \
                    from None
            try:
                listener = self._bound(self.path)
            except OSError as exc:
                raise GuardError(f"cannot listen on {shown(self.path)}: {exc.strerror or exc}") from None
        try:
            info = os.lstat(self.path)
        except OSError as exc:
            listener.close()
            raise GuardError(f"cannot listen on {shown(self.path)}: {exc.strerror or exc}") from None
        self._identity = (info.st_dev, info.st_ino)
        listener.setblocking(False)
        self._listener = listener
        self._loop.watch(listener.fileno(), self._on_readable)

    @staticmethod
    def _bound(path: str) -> socket.socket:
        """A socket bound at ``path`` (its file 0600: connecting needs write permission on it), listening."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(umask)
        return listener

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
        if problem is not None:  # planted by another uid: a fresh lock file of ours is renamed over it
            os.close(fd)
            fd = self._replace_lock(lock_path, problem)
        try:
            _lock_soon(fd)
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

    def _replace_lock(self, lock_path: str, problem: str) -> int:
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
        self._say_once("lock replaced", f"the lock {shown(lock_path)} {problem}: replaced by this guard's own")
        return fd

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
        self._stale_owner = f" (owned by uid {info.st_uid}{served_by})"
        # (a stale socket, or another uid's: _listen renames a fresh one over it)
        if served_by:
            self._say_once("path squatted", f"replaced the socket at {shown(self.path)}{served_by}: this guard holds "
                                            "the path's lock")
