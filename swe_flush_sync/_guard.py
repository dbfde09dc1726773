"""``swe-flush guard``: the watchdog's loop outside the container, for many trainers at once.

A trainer whose container dies whole (PID 1 dying takes every process of its PID namespace; a
group OOM kill takes the cgroup) takes a local watchdog along. The guard runs where the
container's death does not reach (a sidecar container, a node daemon) and listens on a Unix
socket; each trainer connects (``watchdog(args, guard=PATH)``) and hands over its state like it
would over the watchdog's pipe. One connection is one trainer: when it ends without a disarm,
the guard flushes that trainer's last state on a thread of its own and goes on serving everyone
else. It holds no secret of its own (each trainer hands over its bearers, kept in memory only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
from typing import Final

from ._errors import ConfigError
from ._ledger import recover
from ._text import shown
from ._trust import directory_problem
from ._watchdog import MAX_SOCKET_PATH
from ._watchdog_process import STATUS, Channel, WatchLoop, _say

log = logging.getLogger(__name__)

DEFAULT_DRAIN: Final = 30.0  # seconds: a pod's default termination grace period
RECOVER_INTERVAL: Final = 10.0  # seconds between two recovers of the ledger's gone owners
STATUS_TIMEOUT: Final = 2.0  # seconds ``--status`` waits for an answer
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


class GuardError(Exception):
    """The guard cannot start (its socket path is taken or unusable, a bad ledger); the message says why."""


def _say_guard(line: str) -> None:
    _say(f"swe-flush guard: {line}")


class Guard:
    """The listening socket, the trainers' channels and their flushes."""

    def __init__(self, path: str, ledger: str | None = None, drain: float = DEFAULT_DRAIN) -> None:
        self.path = path
        self.ledger = ledger
        self.drain = drain
        self.loop = WatchLoop(self._ended)
        self._listener: socket.socket | None = None
        self._flushes: list[threading.Thread] = []
        self._stopping_since: float | None = None
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()

    # -- starting ------------------------------------------------------------------------
    def bind(self) -> None:
        """Take the socket path (a stale one is replaced, a live guard's never) and listen, mode 0600."""
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise GuardError(f"{shown(self.path)}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes")
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise GuardError(f"cannot create {shown(folder)}: {exc.strerror or exc}") from None
        if self.ledger is not None:
            with contextlib.suppress(OSError):
                os.makedirs(self.ledger, mode=0o700, exist_ok=True)
            problem = directory_problem(self.ledger)
            if problem is not None:
                raise GuardError(f"--ledger: the directory {shown(self.ledger)} {problem}")
        self._take_path()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)  # the socket file is made 0600: connecting needs write permission on it
        try:
            listener.bind(self.path)
        except OSError as exc:
            listener.close()
            raise GuardError(f"cannot listen on {shown(self.path)}: {exc.strerror or exc}") from None
        finally:
            os.umask(umask)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.loop.watch(listener.fileno(), self._accept)
        self.loop.watch(self._wake_read, self._woken)

    def _take_path(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise GuardError(f"{shown(self.path)} exists and is not a socket")
        if guard_status(self.path) is not None:
            raise GuardError(f"a guard is already serving {shown(self.path)}")
        os.unlink(self.path)  # a stale socket, left by a guard that died

    # -- serving -------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid not in (os.geteuid(), 0):
            _say_guard(f"refused a connection from uid {uid} (pid {pid}): only uid {os.geteuid()} and root may connect")
            conn.close()
            return
        fd = conn.detach()
        os.set_blocking(fd, False)
        self.loop.add(Channel(fd, fd, pid, strict=True, ledger=self.ledger, status=self.trainers))

    def trainers(self) -> int:
        """How many trainers it holds (connections that handed a state over)."""
        return sum(channel.state is not None for channel in self.loop.channels)

    def _ended(self, channel: Channel) -> None:
        with contextlib.suppress(OSError):
            os.close(channel.read_fd)
        if channel.error is not None:
            _say_guard(f"dropped the connection of pid {channel.trainer_pid}: it sent {channel.error}")
            channel.settle(None)
        elif channel.disarmed or channel.state is None:
            channel.settle(None)
        else:
            flusher = threading.Thread(target=self._flush, args=(channel,), name="swe-flush-guard", daemon=True)
            flusher.start()
            self._flushes.append(flusher)

    @staticmethod
    def _flush(channel: Channel) -> None:
        """One trainer's flush, on a thread of its own: a slow one never delays another's."""
        try:
            report = channel.flush()
        except ConfigError as exc:  # e.g. a CA bundle path that only exists in the trainer's container
            _say_guard(f"trainer pid {channel.trainer_pid} gone; not flushed: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - one trainer's failure must not stop the guard
            _say_guard(f"trainer pid {channel.trainer_pid} gone; the flush failed: {type(exc).__name__}")
            return
        channel.settle(report)
        if report is not None:
            _say_guard(f"trainer pid {channel.trainer_pid} gone; {report.summary()}")

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_read, 512)
        if self._stop.is_set() and self._stopping_since is None:
            self._stopping_since = time.monotonic()
            self._close_listener()

    def stop(self) -> None:
        """Stop accepting (from a signal handler too); the connected trainers are watched for ``drain`` s."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def _close_listener(self) -> None:
        if self._listener is not None:
            self.loop.unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def serve(self) -> int:
        """Serve until ``stop()``; then drain. 0 when it ended on its own terms."""
        recoverer = None
        if self.ledger is not None:
            recoverer = threading.Thread(target=self._recover_every_interval, name="swe-flush-guard-recover",
                                         daemon=True)
            recoverer.start()
        while True:
            timeout = None
            if self._stopping_since is not None:
                self._flushes = [flusher for flusher in self._flushes if flusher.is_alive()]
                held = [channel for channel in self.loop.channels if channel.state is not None]
                if not held and not self._flushes:
                    return 0
                timeout = self._stopping_since + self.drain - time.monotonic()
                if timeout <= 0:
                    pids = ", ".join(str(channel.trainer_pid) for channel in held) or "none"
                    _say_guard(f"drain time ({self.drain:g} s) is up; left unguarded: trainers {pids}"
                               f"{'; flushes still running' if self._flushes else ''}")
                    return 0
                timeout = min(timeout, 0.1)  # also notice flushes that end
            self.loop.run_once(timeout)

    def _recover_every_interval(self) -> None:
        """Recover the ledger's records whose owners are gone: at start and then every interval."""
        said_no_server = False
        while not self._stop.is_set():
            try:
                recover(self.ledger or "", environ=os.environ)
            except ConfigError as exc:
                if not said_no_server:
                    said_no_server = True
                    _say_guard(f"cannot recover the ledger: {exc}; guarding goes on")
            except Exception as exc:  # noqa: BLE001 - a recover that fails must not stop the guard
                _say_guard(f"recovering the ledger failed: {type(exc).__name__}")
            self._stop.wait(RECOVER_INTERVAL)


def guard_status(path: str) -> tuple[int, int] | None:
    """The (pid, trainers held) of the guard serving ``path``; None when no guard answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(STATUS_TIMEOUT)
            probe.connect(path)
            probe.sendall(b'{"status": true}\n')
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = probe.recv(256)
                if not chunk:
                    return None
                answer += chunk
    except OSError:
        return None
    word, *numbers = answer.split()
    if word != STATUS or len(numbers) != 2 or not all(number.isdigit() for number in numbers):
        return None
    return int(numbers[0]), int(numbers[1])


def run_guard(path: str, ledger: str | None, drain: float) -> int:
    """``swe-flush guard``: bind, say ``guarding PATH``, serve until SIGTERM or SIGINT, drain; the exit code."""
    guard = Guard(path, ledger, drain)
    try:
        guard.bind()
    except GuardError as exc:
        print(f"swe-flush guard: error: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: guard.stop())
    print(f"guarding {path} (pid {os.getpid()})", flush=True)
    return guard.serve()
