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
import os
import secrets
import select
import socket
import stat
import time
from collections.abc import Callable, Iterator
from typing import Final

from .._core.text import shown
from .._process.watch_loop import WatchLoop
from .._process.wire import LISTENER, MAX_SOCKET_PATH, receive_with_fds, send_with_fd
from .._watchdog.guard_client import ImpostorError, connect_to_guard
from .path_lock import GuardError, PathLock, check_folder, lock_taken_by_another

PATH_CHECK: Final = 2.0  # seconds between two checks that the socket path is still the guard's
PAUSE: Final = 0.1  # seconds accepting pauses at EMFILE or when every peer holds a trainer
ACCEPT_BATCH: Final = 64  # connections accepted in one turn of the loop, then the others get theirs
INHERIT_TIMEOUT: Final = 2.0  # seconds a successor waits for a draining guard to pass its listening socket


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
        self.lock = PathLock(path)  # one guard per path
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
        check_folder(folder, self._say)

    def take(self) -> None:
        """Take the path (one guard per path, decided by a lock), replace a stale socket, listen (0600).

        Raises:
            GuardError: another guard serves the path, or it cannot be taken.
        """
        self.lock.take(self._say, self._say_once)
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
        self.lock.release()

    def pass_listener(self, reply_fd: int) -> bool:
        """Draining: pass the listening socket over ``reply_fd`` to the successor that asked, once it
        holds the path's lock (no other process may have it), and accept no more here; True if passed."""
        if self._listener is None or self.passed or not self.handed_over or not lock_taken_by_another(self.path):
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

    def _inherit(self) -> bool:
        """Take a draining guard's listening socket (see ``_receive_listener``); True when it was passed."""
        if (received := _receive_listener(self.path)) is None:
            return False
        self._listener, self._predecessor, self._identity = received
        self.inherited = True
        self._loop.watch(self._listener.fileno(), self._on_readable)
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
                        and not (self.handed_over and lock_taken_by_another(self.path)):  # (else: a successor's)
                    os.unlink(self.path)
        if self._predecessor is not None:
            self._predecessor.close()
            self._predecessor = None
        self.lock.release()

    def _listen(self) -> None:
        """Listen on a fresh socket (its file made 0600) at the path: bound beside it and renamed over
        it, so that the path is never missing; bound at the path itself where the name beside it is
        too long or cannot be used."""
        beside = f"{self.path}.{secrets.token_hex(4)}"
        listener = None
        if len(os.fsencode(beside)) <= MAX_SOCKET_PATH:
            with contextlib.suppress(OSError):
                listener = _bound(beside)
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
                listener = _bound(self.path)
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


def _receive_listener(path: str) -> tuple[socket.socket, socket.socket, tuple[int, int]] | None:
    """Ask a draining guard of this uid (or root) at ``path`` for its listening socket: the socket, the
    connection to that guard (held open for life: its end tells the predecessor its successor is gone)
    and the identity of the socket file; None when none was passed."""
    try:
        sock = connect_to_guard(path, INHERIT_TIMEOUT)
    except (OSError, ImpostorError):
        return None  # nobody answers (a stale socket, or none), or another uid's: bound afresh
    data, fds = b"", list[int]()
    try:
        sock.sendall(b'{"listener": true}\n')
        while not data.endswith(b"\n") and not fds and select.select([sock], [], [], INHERIT_TIMEOUT)[0]:
            chunk, passed, _ = receive_with_fds(sock.fileno(), 256)
            fds += passed
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    if not fds:
        sock.close()
        return None
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
        info = os.lstat(path)
    except OSError:
        if listener is not None:
            listener.close()
        sock.close()
        return None
    listener.setblocking(False)
    return listener, sock, (info.st_dev, info.st_ino)
