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
import functools
import hashlib
import logging
import os
import queue
import re
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Generic, NamedTuple, TypeVar

from .._core.options import FlushOptions, RecoverOptionKwargs
from .._core.resolve import normalize_instance_ids, normalize_server_urls
from .._core.text import shown
from .._process.liveness import DISARMED_MARK, LockFile, LockFolder, lock_folder_path
from .._process.proc import process_start_time
from .._process.record import DEFAULT_HEARTBEAT
from .._process.trust import directory_problem
from .._process.watch_loop import Channel, WatchLoop, io_error, trainer_name
from .._process.wire import LOCK_WORD, MAX_IDS, RECORDED, STATUS, BadLine, send_with_fd, write_all
from .._watchdog.guard_client import PEERCRED, connect_to_guard
from .flushes import TAKEOVER_GRACE, DeathFlushes, LedgerRecovery
from .metrics import GuardMetrics
from .parser import ParserProcess
from .path_lock import GuardError
from .pool import DEFAULT_FLUSH_WORKERS
from .socket_path import ACCEPT_BATCH, PATH_CHECK, PAUSE, SocketPath

__all__ = ["DEFAULT_DRAIN", "DEFAULT_MAX_HELD", "TAKEOVER_GRACE", "Guard", "GuardError", "guard_status", "run_guard"]

T = TypeVar("T")

log = logging.getLogger(__name__)

DEFAULT_DRAIN: Final = 30.0  # seconds: a pod's default termination grace period
SWITCH_INTERVAL: Final = 0.0005  # seconds a thread holds the GIL before another may take it (Python's: 0.005)
DEFAULT_MAX_HELD: Final = 256 << 20  # bytes all held states may take (--max-held), counted as HELD_COST x their lines
HELD_COST: Final = 2  # what a held state costs in memory, in bytes of its line: its parsed ids and bearers
STATUS_TIMEOUT: Final = 2.0  # seconds ``--status`` waits for an answer
FD_RESERVE: Final = 256  # descriptors never given to peers: flushes, the ledger, stderr
MAX_HOST: Final = 255  # characters of the host name a trainer sends (shown in lines, cut to 64)
STATUS_SLOTS: Final = 8  # connections past the peer limit that may ask for the status (or the listener) only
SAY_EVERY: Final = 60.0  # seconds between two lines of the same kind (retries, drops, refusals)
CLOSE_DRAIN: Final = 5.0  # seconds a closing guard waits for its record writes before its own lock goes,
# and, at the end of its drain, for the deaths' flushes that run (a successor would flush them again)
HANDOVER_WAIT: Final = 1.0  # seconds a draining guard that holds nothing stays: a successor still starting, or
# one that dies a moment after it took the listening socket, finds it answering
ACCEPT_ROUNDS: Final = 16  # batches accepted at most when a recovery pass asks for the listen backlog to be emptied
ACCEPT_WAIT: Final = 1.0  # seconds a recovery pass waits for that (else it leaves the record to the next pass)
MAX_QUEUED_LINES: Final = 1000  # stderr lines waiting for a stalled stderr; later ones are dropped
# The options a trainer hands over: FlushOptions' fields but the bearer (sent as per-id tokens).
_OPTION_KEYS: Final = frozenset(RecoverOptionKwargs.__optional_keys__) - {"admin_secret", "bearer"}
_TOKEN: Final = re.compile(r"[0-9a-f]{32}")


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


class _HeldBudget:
    """What all live trainers' held states may take (``--max-held``), each counted as ``HELD_COST`` x its
    line. The loop's thread and the flush workers change it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self._peers: dict[Channel, _Peer] = {}

    def admit(self, channel: Channel, peer: _Peer) -> None:
        self._peers[channel] = peer

    def over(self, channel: Channel, size: int) -> str | None:
        """Why a line of ``size`` bytes from ``channel`` cannot be held now, or None."""
        peer = self._peers.get(channel)
        return None if peer is None else self._over(HELD_COST * size, peer)

    def _over(self, cost: int, peer: _Peer) -> str | None:
        if cost > peer.held and self._used + cost - peer.held > self.limit:
            return (f"the guard's budget for held states ({self.limit >> 20} MiB, --max-held) is spent: this "
                    f"state needs {_in_units(cost)}, {_in_units(self.limit - self._used + peer.held)} is left; "
                    "a smaller state is held, or another guard")
        return None

    def take(self, peer: _Peer, size: int) -> None:
        """Count a state of ``size`` bytes as ``peer``'s, in place of its last one.

        Raises:
            ValueError: it is over the budget (the last one stays counted).
        """
        cost = HELD_COST * size
        with self._lock:
            over = self._over(cost, peer)
            if over is not None:
                raise ValueError(over)
            self._used += cost - peer.held
            peer.held = cost

    def release(self, channel: Channel) -> None:
        """The channel's state is no longer held (its flush ended, or it needs none)."""
        peer = self._peers.pop(channel, None)
        if peer is not None:
            with self._lock:
                self._used -= peer.held


class _RecordWriter:
    """Record writes and removals, on the ledger's own thread (a slow volume never stops the loop); a
    write that waits writes the latest state when it runs. Failures are said once per kind. A record
    whose write or removal waits here is this guard's (``busy``): never the recovery pass's."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._worker = _SerialWorker("swe-flush-guard-ledger")
        self._say = say
        self._said: str | None = None
        self._waiting: collections.Counter[str] = collections.Counter()  # trainer token -> its jobs not yet done
        self._lock = threading.Lock()

    def submit(self, channel: Channel, job: Callable[[], None]) -> None:
        token = channel.token
        with self._lock:  # counted before its job can end
            if self._worker.submit(functools.partial(self._run, job, token), key=(channel, job)) and token:
                self._waiting[token] += 1

    def busy(self, token: str) -> bool:
        """Is a write or removal of the record of the trainer with ``token`` waiting or running?"""
        return token in self._waiting

    def _run(self, job: Callable[[], None], token: str | None) -> None:
        try:
            self._report(io_error(job))
        finally:
            if token:
                with self._lock:
                    self._waiting[token] -= 1
                    if self._waiting[token] <= 0:
                        del self._waiting[token]

    def _report(self, error: str | None) -> None:
        if error != self._said:  # once per kind of failure, and once when it works again
            self._said = error
            self._say(f"cannot write ledger records: {error}" if error else "ledger records are written again")

    def drain(self, timeout: float) -> None:
        self._worker.drain(timeout)


class _ToLoop(Generic[T]):
    """Items for the loop's thread from other threads: queued, and the loop woken (``wake``, the write
    end of its pipe: a full pipe wakes it already, so a write never waits)."""

    def __init__(self, wake: int) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._wake = wake

    def put(self, item: T) -> None:
        self._items.put(item)
        with contextlib.suppress(OSError):
            os.write(self._wake, b"w")

    def ready(self) -> Iterator[T]:
        """The items the loop has yet to take."""
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return


class _LongLines:
    """Lines over ``OFFLOAD_BYTES``, parsed in the parser process on a thread of their own; each result
    goes to the loop (``ready``), which is woken."""

    def __init__(self, wake: int, loop: WatchLoop, budget: _HeldBudget) -> None:
        self.process = ParserProcess()
        self._thread = _SerialWorker("swe-flush-guard-parse")
        self._parsed: _ToLoop[tuple[Channel, dict[str, Any] | BadLine, int]] = _ToLoop(wake)
        self._loop, self._budget = loop, budget

    def offload(self, channel: Channel, line: bytearray) -> None:
        """(The loop's) Parse a long line on the parse thread (one past the budget is refused unparsed);
        the loop reads that peer no more until it is back."""
        self._loop.pause(channel)
        over = self._budget.over(channel, len(line))
        if over is not None:
            self._parsed.put((channel, BadLine(over), len(line)))
        else:
            self._thread.submit(functools.partial(self._parse, channel, line))

    def ready(self) -> Iterator[tuple[Channel, dict[str, Any] | BadLine, int]]:
        return self._parsed.ready()

    def _parse(self, channel: Channel, line: bytearray) -> None:
        """On the parse thread: parse in the parser process and check the state."""
        self._parsed.put((channel, _CheckedState.parse(self.process, line), len(line)))


class _Backlog:
    """A recovery pass asks, before it judges a trainer gone, that every connection waiting in the listen
    backlog be accepted (a trainer that connected before it died is then a peer): ``ask`` on the
    recovery thread, ``answer`` on the loop's."""

    def __init__(self, wake: int, listening: SocketPath, admit: Callable[[socket.socket], None]) -> None:
        self._questions: _ToLoop[tuple[threading.Event, list[bool]]] = _ToLoop(wake)
        self._listening, self._admit = listening, admit

    def ask(self) -> bool:
        """Wait (up to ``ACCEPT_WAIT``) until the loop accepted every waiting connection; False when it
        could not (accepting paused or passed on, a flood) or did not answer."""
        answered, emptied = threading.Event(), [False]
        self._questions.put((answered, emptied))
        return answered.wait(ACCEPT_WAIT) and emptied[0]

    def answer(self) -> None:
        for answered, emptied in self._questions.ready():
            emptied[0] = self._empty()
            answered.set()

    def _empty(self) -> bool:
        """Accept until the listen backlog is empty; False when it may not be."""
        for _ in range(ACCEPT_ROUNDS):
            if self._listening.paused_until is not None or self._listening.passed:
                return False
            taken = 0
            for conn in self._listening.accepted():
                taken += 1
                self._admit(conn)
            if taken < ACCEPT_BATCH:
                return self._listening.paused_until is None and not self._listening.passed
        return False


class _GuardLocks:
    """The guard's lock folder: its own lock for life, each trainer's made and passed over the socket,
    removed when the trainer settles (on a thread of its own), all touched every heartbeat."""

    def __init__(self, path: str, say: Callable[[str], None], say_once: Callable[[str, str], None],
                 ledger: bool) -> None:
        self.folder = LockFolder(lock_folder_path(path))
        self._ledger = ledger  # with no ledger, no record names a lock: ``recorded`` comes with it
        self._say, self._say_once = say, say_once
        self._life: tuple[int, LockFile] | None = None  # this guard's own lock while it lives (records name it)
        self._io = _SerialWorker("swe-flush-guard-locks")

    def open(self) -> None:
        try:
            if (untrusted := self.folder.open()) is not None:
                self._say(f"the lock folder {untrusted} (planted while no guard ran?)")
            self._life = self.folder.create("guard-")
        except OSError as exc:  # without locks, trainers are judged by their connections and heartbeats
            self.folder.close()
            self._say(f"cannot keep lock files in {shown(self.folder.path)} ({exc.strerror or exc}): a trainer's "
                      "death is the end of its connection, and a successor judges records by their pids and "
                      "heartbeats")

    def settle(self, channel: Channel, records: _RecordWriter | None) -> bool:
        """A trainer settled without a death (disarmed, dropped): a disarm said in its lock at once (a guard
        killed before the record goes leaves no death to flush), then, on the ledger thread, its record
        removed before its lock file (a record whose lock file is gone is judged by pids, and this
        trainer's are dead). False when it keeps no record: the caller settles it."""
        if channel.disarmed and channel.lock is not None:
            self.folder.mark(channel.lock, DISARMED_MARK)
        if channel.keeper is None or records is None:
            return False
        records.submit(channel, functools.partial(self._remove_record_then_lock, channel))
        return True

    def _remove_record_then_lock(self, channel: Channel) -> None:
        assert channel.keeper is not None
        try:
            channel.keeper.remove()
        finally:
            self.release(channel)

    def give(self, channel: Channel) -> None:
        """A trainer's first state, held: make its lock file, pass it over the socket with ``lock`` and
        close this guard's copy, so that the trainer's copy alone holds the lock (see _process.liveness)."""
        if not (channel.state or {}).get("lock_fd") or self._life is None:
            return
        try:
            try:
                fd, lock = self.folder.create("trainer-")
            except FileNotFoundError:  # the folder was removed (a cleaner, an operator): made again
                self._reopen()
                fd, lock = self.folder.create("trainer-")
        except OSError as exc:
            self._say_once("lock", f"cannot make a trainer's lock file in {shown(self.folder.path)} "
                                   f"({exc.strerror or exc}): its death is the end of its connection")
            return
        words = LOCK_WORD + b"\n" + (b"" if self._ledger else RECORDED + b"\n")
        try:
            send_with_fd(channel.reply_fd, words, fd)
        except OSError:  # the trainer reads nothing: it holds no lock, and is judged by its connection
            self.folder.remove(lock)
            return
        finally:
            os.close(fd)
        channel.lock = lock

    def let_go(self, channel: Channel) -> None:
        """The trainer holds no lock of ours (its descriptor did not arrive, or other code closed it):
        its record names none from now on, its lock file goes, and it is judged by pid and heartbeat."""
        lock, channel.lock = channel.lock, None
        if channel.keeper is not None:
            channel.keeper.name_locks(self.named(channel))
        if lock is not None:
            self._io.submit(functools.partial(self.folder.remove, lock))
        self._say_once("no lock", f"trainer {channel.who} holds no lock of this guard's (its descriptor did not "
                                  "arrive, or other code closed it): judged by its pid and heartbeat")

    def _reopen(self) -> None:
        """Make the lock folder again, with this guard's own lock (the old one proves nothing now)."""
        self.folder.close()
        self.folder.open()
        fd, lock = self.folder.create("guard-")
        old, self._life = self._life, (fd, lock)
        if old is not None:
            os.close(old[0])
        self._say_once("lock folder", f"the lock folder {shown(self.folder.path)} was removed; made again")

    def named(self, channel: Channel) -> dict[str, LockFile | None]:
        """What a record names to prove life: the trainer's lock and this guard's."""
        return {"trainer_lock": channel.lock, "guard_lock": self._life[1] if self._life is not None else None}

    def release(self, channel: Channel) -> None:
        """The trainer settled: its lock file removed."""
        lock, channel.lock = channel.lock, None
        if lock is not None:
            self._io.submit(functools.partial(self.folder.remove, lock))

    def touch(self) -> None:
        self._io.submit(self.folder.touch, key="touch")

    def close(self) -> None:
        """Release this guard's own lock; remove what is queued."""
        if self._life is not None:
            fd, lock = self._life
            self._life = None
            self.folder.remove(lock)
            os.close(fd)
        self._io.drain(1.0)
        self.folder.close()


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

    def submit(self, job: Callable[[], None], key: object = None) -> bool:
        """Queue ``job``; False when it was not (its ``key`` waits already, or past ``limit``)."""
        with self._ready:
            if key is not None and key in self._keys:
                return False
            if self._limit is not None and len(self._jobs) >= self._limit:
                self.dropped += 1
                return False
            self._jobs.append((key, job))
            if key is not None:
                self._keys.add(key)
            self._ready.notify()
            return True

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
    if not isinstance(state.get("lock_fd", False), bool):
        raise ValueError("lock_fd must be true or false")
    pid = state.get("pid")
    if pid is not None and (type(pid) is not int or pid <= 0):
        raise ValueError("pid must be a positive integer")
    host = state.get("host")
    if host is not None and (not isinstance(host, str) or len(host) > MAX_HOST):
        raise ValueError(f"host must be a str of at most {MAX_HOST} characters")
    known = {key: value for key, value in options.items() if key in _OPTION_KEYS}
    if isinstance(known.get("client_cert"), list):
        known["client_cert"] = tuple(known["client_cert"])
    FlushOptions(**known, linger=0.0)  # ConfigError (a ValueError) names the bad option
    if trainer is not None:  # kept, and written in records, only as its digest: a peer that reads them
        trainer = hashlib.sha256(trainer.encode()).hexdigest()  # learns nothing it could reconnect with
    return ({"urls": list(normalize_server_urls(urls, "urls")) if urls else [],
             "ids": list(normalize_instance_ids(ids)), "tokens": tokens, "options": known, "trainer": trainer,
             "pid": pid, "host": host, "lock_fd": state.get("lock_fd") is True and trainer is not None},
            sorted(str(key) for key in options if key not in _OPTION_KEYS))


class _CheckedState(dict[str, Any]):
    """A long line's state, checked on the parse thread (``checked_state``'s work on 100,000 ids keeps
    the loop from a death for 30-120 ms); the loop only takes its share of the budget. JSON never
    makes this type, so a peer cannot claim a state was checked."""

    __slots__ = ("dropped", "error")

    def __init__(self, state: dict[str, Any]) -> None:
        try:
            checked, self.dropped = checked_state(state)
            self.error: str | None = None
        except ValueError as exc:
            checked, self.dropped, self.error = {}, [], str(exc)
        super().__init__(checked)

    @staticmethod
    def parse(parser: ParserProcess, line: bytearray) -> dict[str, Any] | BadLine:
        """A long line parsed in the parser process, its state checked here (on the parse thread)."""
        parsed = parser.parse(line)
        if isinstance(parsed, dict) and isinstance(parsed.get("state"), dict):
            parsed["state"] = _CheckedState(parsed["state"])
        return parsed

    @staticmethod
    def result(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``checked_state(state)``: for a long line's state, what it gave on the parse thread."""
        if not isinstance(state, _CheckedState):
            return checked_state(state)
        if state.error is not None:
            raise ValueError(state.error)
        return dict(state), state.dropped


def _in_units(size: int) -> str:
    """``size`` bytes as an operator reads them: 412 bytes, 3.2 KiB, 28.0 MiB."""
    if size < 1024:
        return f"{max(size, 0)} bytes"
    return f"{size / 1024:.1f} KiB" if size < 1 << 20 else f"{size / (1 << 20):.1f} MiB"


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


def _say(stderr: _SerialWorker, line: str) -> None:
    """One line on stderr, written by the stderr thread (a stalled stderr holds only that thread)."""
    dropped, stderr.dropped = stderr.dropped, 0
    if dropped:
        line = f"({dropped} earlier lines dropped: stderr was not read) {line}"
    stderr.submit(functools.partial(write_all, 2, f"swe-flush guard: {line}\n".encode("utf-8", "replace")))


class _Connected:
    """Who is connected now: the tokens of the trainers whose state is held, and the pids of the open
    connections' peers, from the accept until the connection's end is handled (a death's flush then
    owned): a state still being parsed has no token yet, and its record is this guard's."""

    def __init__(self) -> None:
        self.tokens: collections.Counter[str] = collections.Counter()
        self.pids: collections.Counter[int] = collections.Counter()

    def ended(self, channel: Channel) -> None:
        if channel.token is not None:
            _uncount(self.tokens, channel.token)
        _uncount(self.pids, channel.trainer_pid)


def _uncount(counter: collections.Counter[Any], key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def _ready_ledger(ledger: str) -> None:
    """The ledger directory made (0700) if missing, and checked. ``GuardError`` when unusable."""
    with contextlib.suppress(OSError):
        os.makedirs(ledger, mode=0o700, exist_ok=True)
    problem = directory_problem(ledger)
    if problem is not None:
        raise GuardError(f"--ledger: the directory {shown(ledger)} {problem}")


def _handed_over_line(held: list[Channel], drain: float, flushing: bool) -> str:
    """What a guard says when its drain time is up and it hands the ``held`` trainers over."""
    lockless = sum(channel.lock is None for channel in held)
    return (f"drain time ({drain:g} s) is up; handed over trainers {', '.join(c.who for c in held) or 'none'} "
            "(they arm with the next guard)"
            + (f"; {lockless} of them hold no lock: a successor judges them by pid and heartbeat" if lockless else "")
            + ("; flushes still running" if flushing else ""))


class Guard:
    """The listening socket, the trainers' channels, their records and their flushes."""

    def __init__(self, path: str, ledger: str | None = None, drain: float = DEFAULT_DRAIN,
                 heartbeat: float = DEFAULT_HEARTBEAT, metrics: bool = False,
                 flush_workers: int = DEFAULT_FLUSH_WORKERS, max_held: int = DEFAULT_MAX_HELD,
                 takeover_grace: float = TAKEOVER_GRACE) -> None:
        self.path = path
        self.ledger = ledger
        self.drain = drain
        self.heartbeat = heartbeat
        self.loop = WatchLoop(self._ended)
        self._stderr = _SerialWorker("swe-flush-guard-stderr", limit=MAX_QUEUED_LINES)
        self.say = functools.partial(_say, self._stderr)  # one line on stderr, written by the stderr thread
        self._records = _RecordWriter(self.say) if ledger is not None else None
        self.connected = _Connected()
        self._handed_over: set[Channel] = set()  # closed by this guard at the end of its drain: not dead
        self._successor: Channel | None = None  # the connection of the successor this guard's listener went to
        self.budget = _HeldBudget(max_held)
        self._lines = _Lines(self.say)
        self.locks = _GuardLocks(path, self.say, self._lines.say, ledger is not None)
        self._stopping_since: float | None = None
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full pipe wakes the loop already: a write never waits
        self._long = _LongLines(self._wake_write, self.loop, self.budget)
        self._recorded: _ToLoop[Channel] = _ToLoop(self._wake_write)  # (the ledger thread's) a record names a lock
        self.max_peers = 0
        self.socket = SocketPath(path, self.loop, self._accept, self.say, self._lines.say,
                                 _serving)
        self._backlog = _Backlog(self._wake_write, self.socket, self._admit)
        self.metrics = GuardMetrics(self.trainers, lambda: len(self.deaths.retrying)) if metrics else None
        self.deaths = DeathFlushes(flush_workers, connected=self.connected.tokens, lock_folder=self.locks.folder,
                                   release=self._settled, say=self.say, say_once=self._lines.say,
                                   metrics=self.metrics)
        records = self._records  # a record is this guard's while its flush runs or waits, then while its
        # removal waits (queued before the flush lets it go: asked in this order)
        self._recovery = None if ledger is None or records is None else LedgerRecovery(
            ledger, grace=takeover_grace, connected=self.connected.tokens, peer_pids=self.connected.pids,
            owns=lambda token: self.deaths.owns(token) or records.busy(token), stop=self._stop,
            accept_waiting=self._backlog.ask,
            http=self.deaths.http, say=self.say, say_once=self._lines.say, metrics=self.metrics)

    def bind(self) -> None:
        """Take the path (one guard per path, decided by a lock), replace a stale socket, listen (0600)."""
        sys.setswitchinterval(SWITCH_INTERVAL)  # a parse or a flush never keeps the loop off the GIL for long
        self.socket.check()
        if self.ledger is not None:
            _ready_ledger(self.ledger)
        self.socket.take()
        try:
            self._long.process.start()
        except OSError as exc:  # tried again with the first long line
            self.say(f"cannot start the parser process ({exc.strerror or exc}); tried again when a long line comes")
        self.locks.open()
        self.max_peers = max(raise_nofile_limit() - FD_RESERVE, 16)
        self.loop.watch(self._wake_read, self._woken)

    # -- serving -------------------------------------------------------------------------
    def _accept(self) -> None:
        for conn in self.socket.accepted():
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
            self._lines.say(f"other uid {uid}", f"refused a connection from uid {uid} (pid {pid}): only uid "
                                                f"{os.geteuid()} and root may connect")
            conn.close()
            return
        status_only = len(self.loop.channels) >= self.max_peers and not self._drop_idle()
        if status_only and len(self.loop.channels) >= self.max_peers + STATUS_SLOTS:
            conn.close()  # every peer holds a trainer, and the status slots are taken: none more until one ends
            self.socket.pause()
            return
        fd = conn.detach()
        os.set_blocking(fd, False)
        peer = _Peer()
        channel = Channel(fd, fd, pid, trainer_uid=uid, strict=True, ledger=self.ledger, heartbeat=self.heartbeat,
                          check=functools.partial(self._checked, pid=pid, uid=uid, peer=peer), status=self._status,
                          ledger_io=self._records.submit if self._records is not None else None,
                          locks=self.locks.named, armed=self.locks.give, offload=self._long.offload,
                          recorded=self._recorded.put, listener=self._pass_listener, unlocked=self.locks.let_go)
        channel.trainer_start = process_start_time(pid) if pid > 0 else None
        channel.status_only = status_only  # past the peer limit: a liveness probe (or a successor) is still served
        self.budget.admit(channel, peer)
        self.connected.pids[pid] += 1
        self.loop.add(channel)

    def _pass_listener(self, channel: Channel) -> None:
        """A successor asks for the listening socket: passed once this guard is draining and the
        asker holds the path's lock (see ``SocketPath.pass_listener``)."""
        if self._stopping_since is not None and self.socket.pass_listener(channel.reply_fd):
            self._successor = channel

    def _settled(self, channel: Channel) -> None:
        """A trainer settled (disarmed, flushed, dropped): its budget freed, its lock file removed."""
        self.budget.release(channel)
        self.locks.release(channel)

    def _drop_idle(self) -> bool:
        """End the oldest connection that has handed no state over; False when every peer holds a trainer."""
        idle = next((channel for channel in self.loop.channels if channel.state is None), None)
        if idle is None:
            return False
        self.loop.end(idle)
        if self.metrics is not None:
            self.metrics.dropped.labels("peer_limit").inc()
        self._lines.say("peer limit", f"an idle connection dropped: the peer limit ({self.max_peers}) was reached")
        return True

    def _checked(self, state: dict[str, Any], first: bool, size: int, pid: int, uid: int,
                 peer: _Peer) -> dict[str, Any]:
        """A state as the guard holds it; past the budget a new or grown state is refused (the last one
        held stays held). A draining guard arms new trainers too (until a successor takes the path, the
        path is its): at the drain's end they are handed over with the others."""
        state, dropped = _CheckedState.result(state)
        self.budget.take(peer, size)
        if first and isinstance(state.get("trainer"), str):
            self.connected.tokens[state["trainer"]] += 1
        if dropped and not peer.said_options:  # once per connection, and once a minute over all of them
            peer.said_options = True
            who = trainer_name(state, pid, uid, record=True)
            self._lines.say("unknown options", f"trainer {who} sent options this guard does not know, dropped: "
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
        if channel is self._successor:  # the successor is gone: this draining guard answers again
            self._successor = None
            self.socket.successor_gone()
        handed_over = channel in self._handed_over  # alive (its lock is held): its record stays for the successor
        death = not handed_over and channel.error is None and not channel.disarmed and channel.state is not None
        if death:
            self.deaths.take(channel)  # owned before it stops counting as connected (see ``take``)
        self.connected.ended(channel)
        if self._recovery is not None:
            self._recovery.connection_ended(channel.trainer_pid)
        if handed_over or death:  # a death's pairs wait for their flush outside the budget (live trainers')
            self._handed_over.discard(channel)
            self.budget.release(channel)
            if death:
                self.deaths.gone(channel)
            return
        if channel.error is not None:
            self._lines.say("dropped connection",
                            f"dropped the connection of {channel.who}: it sent {channel.error}")
            if self.metrics is not None:
                self.metrics.dropped.labels("bad_message").inc()
        if self.locks.settle(channel, self._records):
            self.budget.release(channel)
            return
        channel.settle(None)
        self._settled(channel)

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_read, 512)
        for channel, parsed, size in self._long.ready():
            self.loop.take_parsed(channel, parsed, size)
        for channel in self._recorded.ready():
            if channel in self.loop.channels:
                channel.tell(RECORDED)
        self._backlog.answer()
        if self._stop.is_set() and self._stopping_since is None:
            self._stopping_since = time.monotonic()
            self.socket.hand_over()  # a successor binds at once; until then new trainers arm here, and all
            # that are held here stay held until the drain ends

    def stop(self) -> None:
        """Stop taking trainers (from a signal handler too); the connected ones are watched for ``drain`` s."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def close(self) -> None:
        """Give up the path; release this guard's own lock; write what is queued."""
        self.socket.give_up()
        if self._records is not None:  # before this guard's own lock goes: the records it names are written
            self._records.drain(CLOSE_DRAIN)
        self.locks.close()
        self._long.process.close()
        self._lines.say_held_back()
        self._stderr.drain(1.0)

    def serve(self) -> int:
        """Serve until ``stop()``; then drain. 0 when it ended on its own terms."""
        if self._recovery is not None:
            self._recovery.start()
        touched_at = time.monotonic()
        try:
            while True:
                timeout = PATH_CHECK if self.socket.paused_until is None else PAUSE
                if self._stopping_since is not None:
                    held = [channel for channel in self.loop.channels if channel.state is not None]
                    stayed = time.monotonic() - self._stopping_since >= min(HANDOVER_WAIT, self.drain)
                    if not held and not self.deaths.count() and stayed:
                        return 0
                    left = self._stopping_since + self.drain - time.monotonic()
                    if left <= 0:
                        self._hand_over(held)
                        self._wait_for_running_flushes()
                        return 0
                    timeout = min(left, 0.1)  # also notice flushes that end
                self.loop.run_once(timeout)
                self.socket.resume()
                self.socket.keep()
                if time.monotonic() >= touched_at + self.heartbeat:
                    touched_at = time.monotonic()
                    self.locks.touch()
                    self.socket.lock.touch()
        finally:
            self.close()

    def _wait_for_running_flushes(self) -> None:
        """Up to ``CLOSE_DRAIN`` seconds, until no death's flush runs here (its record is then removed)."""
        give_up_at = time.monotonic() + CLOSE_DRAIN
        while self.deaths.running() and time.monotonic() < give_up_at:
            self.loop.run_once(0.05)

    def _hand_over(self, held: list[Channel]) -> None:
        """The drain is over: close the held trainers' connections without flushing them. Their locks
        prove them alive, so no guard flushes them, and their follower threads arm with the successor."""
        for channel in held:
            self._handed_over.add(channel)
            if channel.keeper is not None:  # the record is the successor's now: no write of ours after this
                channel.keeper.retired = True
            self.loop.end(channel)
        self.say(_handed_over_line(held, self.drain, bool(self.deaths.count())))


def _serving(path: str) -> bool:
    """Is a guard serving ``path``, and not draining? (``ImpostorError`` for another uid's socket)."""
    status = guard_status(path)
    return status is not None and not status.draining


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
              metrics: tuple[str, int] | None = None, max_held: int = DEFAULT_MAX_HELD,
              takeover_grace: float = TAKEOVER_GRACE) -> int:
    """``swe-flush guard``: bind, say ``guarding PATH``, serve until SIGTERM or SIGINT, drain; the exit code.

    Raises:
        ConfigError: ``metrics`` asked for without the ``metrics`` extra.
    """
    guard = Guard(path, ledger, drain, heartbeat, metrics=metrics is not None, max_held=max_held,
                  takeover_grace=takeover_grace)
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
