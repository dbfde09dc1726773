"""``swe-flush guard``: the watchdog's loop outside the container, for many trainers at once.

A trainer whose container dies whole (PID 1 dying takes every process of its PID namespace; a
group OOM kill takes the cgroup) takes a local watchdog along. The guard runs where the
container's death does not reach (a sidecar container, a node daemon) and listens on a Unix
socket; each trainer connects (``watchdog(args, guard=PATH)``) and hands over its state like it
would over the watchdog's pipe. One connection is one trainer: when it ends without a disarm,
the guard flushes that trainer's last state on one of a fixed number of flush workers, retrying
with backoff (retries wait on one heap of due times, not on threads) until every pair is flushed,
the record is no longer its own (a ``recover`` claimed it) or ``RETRY_GIVE_UP`` passes, and goes
on serving everyone else. It holds no secret of its own (each
trainer hands over its bearers, kept in memory only).

The walls around it: exactly one guard per path (``flock`` on ``PATH.lock``, held for life);
only this uid and root may connect (``SO_PEERCRED``); what one peer sends can end that peer's
connection and nothing else (states are checked whole before ``held``, input is bounded per
line and over all peers); descriptors are bounded (idle peers are dropped first, accepting
pauses at EMFILE, some are kept for flushes); threads are bounded (fixed at start-up, a failed
start never ends the guard); repeated lines are said at most once a minute per kind, with a
count; and nothing that can block (ledger files, stderr, flushes) runs on the loop's thread.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import logging
import os
import queue
import re
import resource
import secrets
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, NamedTuple

from ._errors import ConfigError
from ._flusher import Call
from ._guard_client import PEERCRED, ImpostorError, connect_to_guard
from ._guard_metrics import GuardMetrics
from ._guard_parser import ParserProcess
from ._guard_pool import DEFAULT_FLUSH_WORKERS, WorkPool
from ._ledger import Place, Record, recover_with
from ._liveness import UNSUPPORTED, guard_lock_path, hold, is_held, release, trainer_lock_path
from ._options import FlushOptions, RecoverOptionKwargs
from ._report import FlushReport, FlushResult
from ._resolve import URL_ENV_VARS, normalize_instance_ids, normalize_server_urls, resolve_server_urls
from ._text import shown
from ._threads import block_signals
from ._trust import directory_problem, ownership_problem
from ._watchdog import MAX_SOCKET_PATH
from ._watchdog_process import (
    DEFAULT_HEARTBEAT,
    MAX_IDS,
    STATUS,
    BadLine,
    Channel,
    WatchLoop,
    io_error,
    process_start_time,
    write_all,
)

log = logging.getLogger(__name__)

DEFAULT_DRAIN: Final = 30.0  # seconds: a pod's default termination grace period
RECOVER_INTERVAL: Final = 2.0  # seconds between two recovers of the ledger's gone owners
TAKEOVER_GRACE: Final = 5.0  # seconds a restarted guard waits for a predecessor's lockless trainers to reconnect
SWITCH_INTERVAL: Final = 0.0005  # seconds a thread holds the GIL before another may take it (Python's: 0.005)
DEFAULT_MAX_HELD: Final = 256 << 20  # bytes all held states may take (--max-held), counted as HELD_COST x their lines
HELD_COST: Final = 2  # what a held state costs in memory, in bytes of its line: its parsed ids and bearers
LOCK_RECHECK_MAX: Final = 1.0  # seconds between two looks at the lock of a trainer whose connection ended
STATUS_TIMEOUT: Final = 2.0  # seconds ``--status`` waits for an answer
FD_RESERVE: Final = 256  # descriptors never given to peers: flushes, the ledger, stderr
PAUSE: Final = 0.1  # seconds accepting pauses at EMFILE or when every peer holds a trainer
RETRY_FIRST: Final = 1.0  # seconds before the first retry of a failed flush; doubled up to RETRY_MAX
RETRY_MAX: Final = 60.0
RETRY_REFUSED: Final = 600.0  # seconds between two retries the servers refused with 401/403 (a wrong secret)
RETRY_GIVE_UP: Final = 24 * 3600.0  # seconds after a death when the guard stops retrying (recover can still)
HTTP_WORKERS: Final = 36  # requests in flight at once over all the guard's flushes (its shared HTTP threads)
SAY_EVERY: Final = 60.0  # seconds between two lines of the same kind (retries, drops, refusals)
PATH_CHECK: Final = 2.0  # seconds between two checks that the socket path is still the guard's
MAX_QUEUED_LINES: Final = 1000  # stderr lines waiting for a stalled stderr; later ones are dropped
# The options a trainer hands over: FlushOptions' fields but the bearer (sent as per-id tokens).
_OPTION_KEYS: Final = frozenset(RecoverOptionKwargs.__optional_keys__) - {"admin_secret", "bearer"}
_TOKEN: Final = re.compile(r"[0-9a-f]{32}")


class GuardError(Exception):
    """The guard cannot start (its socket path is taken or unusable, a bad ledger); the message says why."""


class _Lines:
    """Lines of one kind said at most once every ``SAY_EVERY`` seconds; the next one counts those held back."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._said_at: dict[str, float] = {}
        self._held_back: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # the loop's thread and the flush workers say lines

    def say(self, kind: str, line: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._said_at.get(kind, -SAY_EVERY) < SAY_EVERY:
                self._held_back[kind] += 1
                return
            self._said_at[kind] = now
            held_back = self._held_back.pop(kind, 0)
        self._say(line + (f" (and {held_back} more like it since the last such line)" if held_back else ""))

    def say_held_back(self) -> None:
        """Say how many lines of each kind were held back since the last one (at the guard's end)."""
        with self._lock:
            held_back, self._held_back = self._held_back, collections.Counter()
        for kind, count in sorted(held_back.items()):
            self._say(f"{count} more '{kind}' line(s) held back (at most one a minute is said)")


class _Peer:
    """What the guard counts for one connection: its held state's cost, and what was said of it."""

    __slots__ = ("held", "said_options")

    def __init__(self) -> None:
        self.held = 0  # bytes of the budget its held state takes
        self.said_options = False


class _Retrying(NamedTuple):
    """A dead trainer's flush that failed: what is left, since when, and the next delay."""

    pairs: dict[str, tuple[str, ...]] | None  # server -> ids; None: all of them
    died: float
    attempt: int
    delay: float


class GuardStatus(NamedTuple):
    """What a guard answers to ``--status``."""

    pid: int
    trainers: int
    draining: bool


class _SerialWorker:
    """Runs jobs one at a time, in order, on a daemon thread of its own, so that what can block (a
    stalled stderr, an fsync on a slow volume) never stops the loop. A job submitted under a
    ``key`` that is still waiting is not queued again (a record write that waits writes the
    latest state when it runs); past ``limit`` waiting jobs, new ones are dropped and counted."""

    def __init__(self, name: str, limit: int | None = None) -> None:
        self._jobs: collections.deque[tuple[object, Callable[[], None]]] = collections.deque()
        self._keys: set[object] = set()
        self._running = False
        self._ready = threading.Condition()
        self._limit = limit
        self.dropped = 0
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None], key: object = None) -> None:
        with self._ready:
            if key is not None and key in self._keys:
                return
            if self._limit is not None and len(self._jobs) >= self._limit:
                self.dropped += 1
                return
            self._jobs.append((key, job))
            if key is not None:
                self._keys.add(key)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                key, job = self._jobs.popleft()
                self._keys.discard(key)
                self._running = True
            job()
            with self._ready:
                self._running = False
                self._ready.notify_all()

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the jobs submitted so far to be done."""
        give_up_at = time.monotonic() + timeout
        with self._ready:
            while (self._jobs or self._running) and time.monotonic() < give_up_at:
                self._ready.wait(give_up_at - time.monotonic())


def checked_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A trainer's state, checked whole as a flush will use it, and the option keys dropped as unknown.

    Raises:
        ValueError: what is wrong (a ``ConfigError`` from the same checks a flush makes).
    """
    urls, ids, tokens, options = state.get("urls"), state.get("ids"), state.get("tokens"), state.get("options")
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        raise ValueError("urls must be a list of str")
    if not isinstance(ids, list) or not all(isinstance(instance_id, str) for instance_id in ids):
        raise ValueError("ids must be a list of str")
    if len(ids) > MAX_IDS:
        raise ValueError(f"more than {MAX_IDS} ids")
    if tokens is not None and (not isinstance(tokens, dict)
                               or not all(isinstance(token, str) for token in tokens.values())):
        raise ValueError("tokens must be a map of str")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ValueError("options must be an object")
    trainer = state.get("trainer")
    if trainer is not None and (not isinstance(trainer, str) or not _TOKEN.fullmatch(trainer)):
        raise ValueError("trainer must be 32 lowercase hex digits")
    if not isinstance(state.get("lock", False), bool):
        raise ValueError("lock must be true or false")
    known = {key: value for key, value in options.items() if key in _OPTION_KEYS}
    if isinstance(known.get("client_cert"), list):
        known["client_cert"] = tuple(known["client_cert"])
    FlushOptions(**known, linger=0.0)  # ConfigError (a ValueError) names the bad option
    return ({"urls": list(normalize_server_urls(urls, "urls")) if urls else [],
             "ids": list(normalize_instance_ids(ids)), "tokens": tokens, "options": known, "trainer": trainer,
             "lock": state.get("lock") is True and trainer is not None},
            sorted(str(key) for key in options if key not in _OPTION_KEYS))


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (as systemd tells daemons to); the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return soft


class Guard:
    """The listening socket, the trainers' channels, their records and their flushes."""

    def __init__(self, path: str, ledger: str | None = None, drain: float = DEFAULT_DRAIN,
                 heartbeat: float = DEFAULT_HEARTBEAT, metrics: bool = False,
                 flush_workers: int = DEFAULT_FLUSH_WORKERS, max_held: int = DEFAULT_MAX_HELD) -> None:
        self.path = path
        self.ledger = ledger
        self.drain = drain
        self.heartbeat = heartbeat
        self.loop = WatchLoop(self._ended)
        self._stderr = _SerialWorker("swe-flush-guard-stderr", limit=MAX_QUEUED_LINES)
        self._parser = _SerialWorker("swe-flush-guard-parse")  # long lines: sent to the parser process
        self._parser_process = ParserProcess()
        self._parsed: queue.SimpleQueue[tuple[Channel, dict[str, Any] | BadLine, int]] = queue.SimpleQueue()
        self._writer = _SerialWorker("swe-flush-guard-ledger") if ledger is not None else None
        self._ledger_said: str | None = None
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we bound
        self._lock_fd: int | None = None
        self._life_lock: tuple[int, str] | None = None  # this guard's own lock while it lives (records name it)
        self._connected: collections.Counter[str] = collections.Counter()  # tokens of the trainers held now
        self._handed_over: set[Channel] = set()  # closed by this guard at the end of its drain: not dead
        self.max_held = max_held
        self._held_bytes = 0  # of the budget, over all held states (the dead ones' until their flush ends)
        self._peers: dict[Channel, _Peer] = {}
        self._lines = _Lines(self.say)
        self._flushes = WorkPool("swe-flush-guard-flush", flush_workers, self.say)
        self._http = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="swe-flush-guard-http",
                                        initializer=block_signals)
        self._flushing: set[Channel] = set()  # dead trainers whose flush runs, waits or waits to be retried
        self._books = threading.Lock()  # _flushing and the budget: the loop and the flush workers change them
        self._started = time.monotonic()
        self._stopping_since: float | None = None
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full pipe wakes the loop already: a write never waits
        self._paused_until: float | None = None
        self._path_checked_at = time.monotonic()
        self.max_peers = 0
        self._retrying: set[Channel] = set()  # flushes that failed and wait to be retried
        self.metrics = GuardMetrics(self.trainers, lambda: len(self._retrying)) if metrics else None

    # -- starting ------------------------------------------------------------------------
    def bind(self) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL)  # a parse or a flush never keeps the loop off the GIL for long
        """Take the path (one guard per path, decided by a lock), replace a stale socket, listen (0600)."""
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise GuardError(f"{shown(self.path)}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes")
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise GuardError(f"cannot create {shown(folder)}: {exc.strerror or exc}") from None
        self._check_folder(folder)
        if self.ledger is not None:
            with contextlib.suppress(OSError):
                os.makedirs(self.ledger, mode=0o700, exist_ok=True)
            problem = directory_problem(self.ledger)
            if problem is not None:
                raise GuardError(f"--ledger: the directory {shown(self.ledger)} {problem}")
        self._take_lock()
        self._take_path()
        self._listen()
        try:
            self._parser_process.start()
        except OSError as exc:  # tried again with the first long line
            self.say(f"cannot start the parser process ({exc.strerror or exc}); tried again when a long line comes")
        life_lock = guard_lock_path(self.path, secrets.token_hex(8))
        with contextlib.suppress(OSError):  # without it, its records are judged by the older rules
            self._life_lock = (hold(life_lock), life_lock)
        self.max_peers = max(raise_nofile_limit() - FD_RESERVE, 16)
        self.loop.watch(self._wake_read, self._woken)

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
        self.loop.watch(listener.fileno(), self._accept)

    def _keep_path(self) -> None:
        """Every ``PATH_CHECK`` seconds: the path must still be our socket; removed (a tmp cleaner, another
        container on a shared folder) or replaced, it is taken back and listened on again."""
        now = time.monotonic()
        if now < self._path_checked_at + PATH_CHECK or self._listener is None or self._paused_until is not None:
            return
        self._path_checked_at = now
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                return
        except OSError:
            pass
        self.loop.unwatch(self._listener.fileno())
        self._listener.close()
        self._listener = None
        try:
            self._take_path()
            self._listen()
        except (GuardError, OSError) as exc:
            self._lines.say("path", f"the socket at {shown(self.path)} was removed or replaced and cannot be taken "
                                    f"back yet: {exc}; trying again every {PATH_CHECK:g} s")
            return
        self.say(f"the socket at {shown(self.path)} was removed or replaced; listening there again")

    def _check_folder(self, folder: str) -> None:
        """Refuse a folder another (non-root) user owns; warn when others may write it without the sticky bit."""
        info = os.stat(folder)
        if info.st_uid not in (os.geteuid(), 0):
            raise GuardError(f"the socket's folder {shown(folder)} is owned by uid {info.st_uid}: that user could "
                             "replace the socket; use a folder owned by this user or root")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            self.say(f"warning: others may write {shown(folder)} (mode {stat.S_IMODE(info.st_mode):04o}, no "
                     "sticky bit): they could replace the socket; trainers check who listens before they "
                     "send anything")

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
            self.say(f"warning: {shown(lock_path)} cannot be locked here ({exc.strerror or exc}: no flock on this "
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
            if guard_status(self.path) is not None:  # a guard of this uid, of a version that took no lock
                raise GuardError(f"a guard is already serving {shown(self.path)}")
        except ImpostorError as exc:  # the lock is ours, so the path is: another uid's socket is replaced
            served_by = f", served by uid {exc.uid}"
        try:
            os.unlink(self.path)  # a stale socket left by a guard that died, or another uid's
        except OSError as exc:
            raise GuardError(f"cannot remove the socket {shown(self.path)} (owned by uid {info.st_uid}"
                             f"{served_by}): {exc.strerror or exc}; remove it as that user, or run the guard as "
                             "that user") from None
        if served_by:
            self.say(f"replaced the socket at {shown(self.path)}{served_by}: this guard holds the path's lock")

    # -- serving -------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):  # a batch, then the others get their turn
            if self._listener is None:
                return
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause()  # no spinning on a listener that stays readable
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        except OSError:
            conn.close()
            return
        if uid not in (os.geteuid(), 0):
            if self.metrics is not None:
                self.metrics.dropped.labels("other_uid").inc()
            self.say(f"refused a connection from uid {uid} (pid {pid}): only uid {os.geteuid()} and root may "
                     "connect")
            conn.close()
            return
        if len(self.loop.channels) >= self.max_peers and not self._drop_idle():
            conn.close()  # every peer holds a trainer: take no more until one ends
            self._pause()
            return
        fd = conn.detach()
        os.set_blocking(fd, False)
        peer = _Peer()
        channel = Channel(fd, fd, pid, strict=True, ledger=self.ledger, heartbeat=self.heartbeat,
                          check=functools.partial(self._checked, pid=pid, peer=peer), status=self._status,
                          ledger_io=self._ledger_io, locks=self._record_locks, offload=self._offload)
        self._peers[channel] = peer
        self.loop.add(channel)

    def _over_budget(self, cost: int, peer: _Peer) -> str | None:
        """Why a state that costs ``cost`` cannot be held for ``peer`` now, or None."""
        if cost > peer.held and self._held_bytes + cost - peer.held > self.max_held:
            return (f"the guard's budget for held states ({self.max_held >> 20} MiB, --max-held) is spent: this "
                    f"state needs {max(cost >> 20, 1)} MiB; a smaller state is held, or another guard")
        return None

    def _offload(self, channel: Channel, line: bytearray) -> None:
        """Parse a long line on the parse thread (one past the budget is refused unparsed); the loop
        reads that peer no more until it is back."""
        self.loop.pause(channel)
        peer = self._peers.get(channel)
        over = self._over_budget(HELD_COST * len(line), peer) if peer is not None else None
        if over is not None:
            self._parsed.put((channel, BadLine(over), len(line)))
            os.write(self._wake_write, b"p")
            return
        self._parser.submit(functools.partial(self._parse, channel, line))

    def _parse(self, channel: Channel, line: bytearray) -> None:
        """On the parse thread: parse in the parser process, then hand the result to the loop (woken)."""
        self._parsed.put((channel, self._parser_process.parse(line), len(line)))
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"p")

    def _trainer_lock(self, state: dict[str, Any] | None) -> str | None:
        """The lock file of the trainer with ``state``, as this guard sees it (None: it holds none)."""
        token = (state or {}).get("trainer")
        return trainer_lock_path(self.path, token) if (state or {}).get("lock") and isinstance(token, str) else None

    def _record_locks(self, state: dict[str, Any]) -> dict[str, str | None]:
        """What a record names to prove life: the trainer's lock and this guard's."""
        return {"trainer_lock": self._trainer_lock(state),
                "guard_lock": self._life_lock[1] if self._life_lock is not None else None}

    def say(self, line: str) -> None:
        """One line on stderr, written by the stderr thread (a stalled stderr holds only that thread)."""
        dropped, self._stderr.dropped = self._stderr.dropped, 0
        if dropped:
            line = f"({dropped} earlier lines dropped: stderr was not read) {line}"
        self._stderr.submit(functools.partial(write_all, 2, f"swe-flush guard: {line}\n".encode("utf-8", "replace")))

    def _ledger_io(self, channel: Channel, job: Callable[[], None]) -> None:
        """A record write or removal, on the ledger's thread; its failures said once per kind."""
        assert self._writer is not None  # only channels of a guard with a ledger have records
        self._writer.submit(functools.partial(self._record_io, job), key=(channel, job))

    def _record_io(self, job: Callable[[], None]) -> None:
        error = io_error(job)
        if error != self._ledger_said:  # once per kind of failure, and once when it works again
            self._ledger_said = error
            self.say(f"cannot write ledger records: {error}" if error else "ledger records are written again")

    def _drop_idle(self) -> bool:
        """End the oldest connection that has handed no state over; False when every peer holds a trainer."""
        for channel in self.loop.channels:
            if channel.state is None:
                self.loop.end(channel)
                if self.metrics is not None:
                    self.metrics.dropped.labels("peer_limit").inc()
                self._lines.say("peer limit", f"an idle connection dropped: the peer limit ({self.max_peers}) "
                                              "was reached")
                return True
        return False

    def _pause(self) -> None:
        if self._listener is not None and self._paused_until is None:
            self.loop.unwatch(self._listener.fileno())
            self._paused_until = time.monotonic() + PAUSE

    def _resume(self) -> None:
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._paused_until = None
            if self._listener is not None:
                self.loop.watch(self._listener.fileno(), self._accept)

    def _checked(self, state: dict[str, Any], first: bool, size: int, pid: int, peer: _Peer) -> dict[str, Any]:
        """A state as the guard holds it; a draining guard refuses new trainers only (held ones update),
        and past the budget a new or grown state is refused (the last one held stays held)."""
        if self._stopping_since is not None and first:
            raise ValueError("the guard is stopping (draining); arm against the next one")
        state, dropped = checked_state(state)
        cost = HELD_COST * size
        with self._books:
            over = self._over_budget(cost, peer)
            if over is not None:
                raise ValueError(over)
            self._held_bytes += cost - peer.held
            peer.held = cost
        if first and isinstance(state.get("trainer"), str):
            self._connected[state["trainer"]] += 1
        if dropped and not peer.said_options:  # once per connection
            peer.said_options = True
            self.say(f"trainer pid {pid} sent options this guard does not know, dropped: "
                     f"{shown(', '.join(dropped))} (upgrade the guard)")
        return state

    def _status(self) -> bytes:
        return b"%d%s" % (self.trainers(), b" draining" if self._stopping_since is not None else b"")

    def trainers(self) -> int:
        """How many trainers it holds (connections that handed a state over)."""
        return sum(channel.state is not None for channel in self.loop.channels)

    def _ended(self, channel: Channel) -> None:
        with contextlib.suppress(OSError):
            os.close(channel.read_fd)
        if channel.token is not None:
            self._connected[channel.token] -= 1
            if self._connected[channel.token] <= 0:
                del self._connected[channel.token]
        if channel in self._handed_over:  # alive (its lock is held): its record stays for the successor
            self._handed_over.discard(channel)
            self._release(channel)
            return
        if channel.error is not None:
            self._lines.say("dropped connection",
                            f"dropped the connection of pid {channel.trainer_pid}: it sent {channel.error}")
            if self.metrics is not None:
                self.metrics.dropped.labels("bad_message").inc()
            channel.settle(None)
            self._release(channel)
        elif channel.disarmed or channel.state is None:
            channel.settle(None)
            self._release(channel)
        else:
            with self._books:
                self._flushing.add(channel)
            self._flushes.submit(functools.partial(self._flush_once_gone, channel, time.monotonic(), 0.01))

    def _flush_once_gone(self, channel: Channel, ended: float, recheck: float) -> None:
        """A connection ended without a disarm: flush its trainer once its lock is free (a held lock is
        a live trainer: at a death the kernel may close the socket a moment before the lock). A trainer
        that connected again meanwhile is guarded by its new connection; no lock, or one that cannot
        be examined: the end of the connection is the death, as before."""
        lock = self._trainer_lock(channel.state)
        if lock is not None and channel.token in self._connected:
            self._done(channel)
            return
        if lock is not None and is_held(lock):
            self._flushes.submit(functools.partial(self._flush_once_gone, channel, ended,
                                                   min(recheck * 2, LOCK_RECHECK_MAX)), recheck)
            return
        self._flush(channel, _Retrying(None, ended, 1, RETRY_FIRST))

    def flushing(self) -> int:
        """Dead trainers whose flush runs, waits for a worker or waits to be retried."""
        return len(self._flushing)

    def _flush(self, channel: Channel, retry: _Retrying) -> None:
        """One attempt at a dead trainer's flush, on a flush worker. A failed one is put back on the
        heap with backoff (``/flush`` is idempotent; 401/403 slowly) until every pair is flushed, the
        record is no longer the guard's, or ``RETRY_GIVE_UP`` has passed since the death."""
        who = f"trainer pid {channel.trainer_pid}"
        if retry.attempt > 1 and channel.ledger is not None and not os.path.exists(channel.ledger.path):
            self._done(channel)  # a recover claimed the record (and flushed it), or it was removed
            self._lines.say("claimed", f"{who}: its record was taken by a recover or removed; retries end")
            return
        try:
            report = channel.flush(retry.pairs, max_workers=HTTP_WORKERS, retries=0,  # the guard retries itself
                                   runner=self._send)
        except Exception as exc:  # noqa: BLE001 - one trainer's failure must not stop the guard
            report, why, refused = None, f"the flush failed: {type(exc).__name__}", False
            if self.metrics is not None:
                self.metrics.flushed(None)
        else:
            if self.metrics is not None and report is not None:
                self.metrics.flushed(report)
            if report is None or report.ok:
                if self.metrics is not None and report is not None:
                    self.metrics.death_to_flush.observe(time.monotonic() - retry.died)
                channel.settle(report)
                self._done(channel)
                if report is not None:
                    again = f" (attempt {retry.attempt})" if retry.attempt > 1 else ""
                    self.say(f"{who} gone; {report.summary()}{again}")
                return
            refused = all(result.status_code in (401, 403) for result in report.results if not result.ok)
            why = report.summary()
            retry = retry._replace(pairs=_failed_pairs(report))
        if retry.attempt == 1:
            channel.mark_gone()
            self._retrying.add(channel)
        delay = RETRY_REFUSED if refused else retry.delay
        if time.monotonic() + delay - retry.died > RETRY_GIVE_UP:
            self._done(channel)
            self.say(f"{who} gone; {why}; gave up retrying after {RETRY_GIVE_UP / 3600:g} h: its record stays "
                     "for recover")
            return
        self._lines.say("retrying", f"{who} gone; {why}; retrying in {delay:g} s (every {RETRY_FIRST:g}-"
                                    f"{RETRY_MAX:g} s, {RETRY_REFUSED:g} s after 401/403) until it is flushed")
        self._flushes.submit(functools.partial(self._flush, channel, retry._replace(
            attempt=retry.attempt + 1, delay=min(retry.delay * 2, RETRY_MAX))), delay)

    def _send(self, calls: Sequence[Call]) -> list[Future[FlushResult]]:
        """Send a flush's requests on the shared HTTP workers; one that gets no thread (a pids limit)
        is sent by the flush worker itself."""
        futures: list[Future[FlushResult]] = []
        for call in calls:
            try:
                futures.append(self._http.submit(call))
            except RuntimeError:
                future: Future[FlushResult] = Future()
                future.set_running_or_notify_cancel()
                future.set_result(call())
                futures.append(future)
        return futures

    def _done(self, channel: Channel) -> None:
        self._retrying.discard(channel)
        with self._books:
            self._flushing.discard(channel)
        self._release(channel)

    def _release(self, channel: Channel) -> None:
        """The channel's state is no longer held (its flush ended, or it needs none): its budget is free."""
        peer = self._peers.pop(channel, None)
        if peer is not None:
            with self._books:
                self._held_bytes -= peer.held

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_read, 512)
        while True:
            try:
                channel, parsed, size = self._parsed.get_nowait()
            except queue.Empty:
                break
            self.loop.take_parsed(channel, parsed, size)
        if self._stop.is_set() and self._stopping_since is None:
            self._stopping_since = time.monotonic()
            self._give_up_path()  # a successor binds at once; the trainers held here stay held until the drain ends

    def stop(self) -> None:
        """Stop taking trainers (from a signal handler too); the connected ones are watched for ``drain`` s."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def close(self) -> None:
        """Give up the path; release this guard's own lock; write what is queued."""
        self._give_up_path()
        if self._life_lock is not None:
            release(*self._life_lock)
            self._life_lock = None
        self._parser_process.close()
        self._lines.say_held_back()
        if self._writer is not None:
            self._writer.drain(1.0)
        self._stderr.drain(1.0)

    def _give_up_path(self) -> None:
        """Stop listening; remove the socket path only while it is still ours; release the path's lock."""
        if self._listener is not None:
            self.loop.unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._identity:
                    os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def serve(self) -> int:
        """Serve until ``stop()``; then drain. 0 when it ended on its own terms."""
        if self.ledger is not None:
            threading.Thread(target=self._recover_every_interval, name="swe-flush-guard-recover", daemon=True).start()
        try:
            while True:
                timeout = PATH_CHECK if self._paused_until is None else PAUSE
                if self._stopping_since is not None:
                    held = [channel for channel in self.loop.channels if channel.state is not None]
                    if not held and not self._flushing:
                        return 0
                    left = self._stopping_since + self.drain - time.monotonic()
                    if left <= 0:
                        self._hand_over(held)
                        return 0
                    timeout = min(left, 0.1)  # also notice flushes that end
                self.loop.run_once(timeout)
                self._resume()
                self._keep_path()
        finally:
            self.close()

    def _hand_over(self, held: list[Channel]) -> None:
        """The drain is over: close the held trainers' connections without flushing them. Their locks
        prove them alive, so no guard flushes them, and their follower threads arm with the successor."""
        locked = [channel for channel in held if self._trainer_lock(channel.state) is not None]
        for channel in held:
            self._handed_over.add(channel)
            self.loop.end(channel)
        pids = ", ".join(str(channel.trainer_pid) for channel in held) or "none"
        lockless = len(held) - len(locked)
        self.say(f"drain time ({self.drain:g} s) is up; handed over trainers {pids} (they arm with the next guard)"
                 + (f"; {lockless} of them hold no lock: a successor judges them by a grace" if lockless else "")
                 + ("; flushes still running" if self._flushing else ""))

    # -- the ledger ----------------------------------------------------------------------
    def _recover_every_interval(self) -> None:
        """Recover the ledger's records whose owners are gone: at once (a dead trainer's free lock
        says so), then every interval; lockless records of a predecessor only after the takeover grace."""
        said_no_server = not resolve_server_urls(os.environ)
        if said_no_server:  # said at once, not after the grace
            self.say(f"cannot recover the ledger: no agent server named ({' and '.join(URL_ENV_VARS)} unset); "
                     "guarding goes on")
        options = FlushOptions(until_idle=True, linger=0.0)
        while not self._stop.is_set():
            claimed: list[int] = []
            try:
                report = recover_with(self.ledger or "", None, os.environ, options, judge=self._judge,
                                      on_claimed=claimed.append, quiet=True, runner=self._send)
                if claimed:
                    self._say_recovered(claimed[0], report)
                elif report.error:
                    self._lines.say("recover", f"recovering the ledger: {report.error}")
            except ConfigError as exc:
                if not said_no_server:
                    said_no_server = True
                    self.say(f"cannot recover the ledger: {exc}; guarding goes on")
            except Exception as exc:  # noqa: BLE001 - a recover that fails must not stop the guard
                self.say(f"recovering the ledger failed: {type(exc).__name__}")
            self._stop.wait(RECOVER_INTERVAL)

    def _say_recovered(self, records: int, report: FlushReport) -> None:
        """A recover pass that claimed records: a line like a trainer's death, and the flush metrics."""
        if self.metrics is not None:
            self.metrics.recovered.inc(records)
            self.metrics.flushed(report)
        self.say(f"recovered {records} record(s) of trainers gone; {report.summary()}")

    def _judge(self, record: Record, gone: bool) -> bool:
        """A trainer connected to this guard is never gone; a record the locks decide is as they say;
        a lockless predecessor's record (its guard gone, here) whose trainer has not reconnected
        within the grace is gone, whatever its heartbeat says."""
        if record.trainer is not None and record.trainer in self._connected:
            return False
        if gone:
            return True
        if record.trainer_lock is not None and is_held(record.trainer_lock) is not None:
            return False  # held: alive
        if record.guard_lock is not None and is_held(record.guard_lock):
            return False  # a live guard keeps it
        predecessor = (record.trainer is not None and record.watchdog_pid != os.getpid()
                       and record.place == Place.here()
                       and process_start_time(record.watchdog_pid or 0) != record.watchdog_start_time)
        return predecessor and time.monotonic() - self._started >= TAKEOVER_GRACE


def _failed_pairs(report: FlushReport) -> dict[str, tuple[str, ...]]:
    """Server -> the ids whose flush did not succeed."""
    failed: dict[str, list[str]] = {}
    for result in report.results:
        if not result.ok:
            failed.setdefault(result.server_url, []).append(result.instance_id)
    return {url: tuple(ids) for url, ids in failed.items()}


def guard_status(path: str) -> GuardStatus | None:
    """What the guard serving ``path`` says of itself; None when no guard answers.

    Raises:
        ImpostorError: the socket is served by another uid (not this user or root): not a guard,
            whatever it would answer; nothing was sent to it.
    """
    try:
        with connect_to_guard(path, STATUS_TIMEOUT) as probe:
            probe.sendall(b'{"status": true}\n')
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = probe.recv(256)
                if not chunk:
                    return None
                answer += chunk
    except OSError:
        return None
    word, *rest = answer.split()
    draining = rest[-1:] == [b"draining"]
    numbers = rest[:-1] if draining else rest
    if word != STATUS or len(numbers) != 2 or not all(number.isdigit() for number in numbers):
        return None
    return GuardStatus(int(numbers[0]), int(numbers[1]), draining)


def run_guard(path: str, ledger: str | None, drain: float, heartbeat: float = DEFAULT_HEARTBEAT,
              metrics: tuple[str, int] | None = None, max_held: int = DEFAULT_MAX_HELD) -> int:
    """``swe-flush guard``: bind, say ``guarding PATH``, serve until SIGTERM or SIGINT, drain; the exit code.

    Raises:
        ConfigError: ``metrics`` asked for without the ``metrics`` extra.
    """
    guard = Guard(path, ledger, drain, heartbeat, metrics=metrics is not None, max_held=max_held)
    try:
        guard.bind()
        where = ""
        if metrics is not None and guard.metrics is not None:
            try:
                port = guard.metrics.serve(*metrics)
            except OSError as exc:
                raise GuardError(f"--metrics: cannot listen on {metrics[0]}:{metrics[1]}: {exc.strerror or exc}") \
                    from None
            where = f", metrics on http://{metrics[0]}:{port}/metrics"
    except GuardError as exc:
        print(f"swe-flush guard: error: {exc}", file=sys.stderr)
        guard.close()
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: guard.stop())
    print(f"guarding {path} (pid {os.getpid()}){where}", flush=True)
    return guard.serve()
