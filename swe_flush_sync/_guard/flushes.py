"""What the guard flushes: the trainers whose connection ended, and the ledger's gone owners.

Once a dead trainer's liveness lock is free, its flush becomes one job per server on a fixed
number of flush workers (``WorkPool``), each retried with backoff (retries wait on one heap of due
times, not on threads) until its pairs are flushed, the record is no longer the guard's own (a
``recover`` claimed it) or ``RETRY_GIVE_UP`` passes; the last server's success settles the death.
Every request goes out on the guard's shared HTTP workers, at most ``HTTP_WORKERS`` at once, with
a short connect. Both are fair by server (``pool``): a server that did not answer its last flush
runs one job at a time, all such servers at most half of the workers, and the deaths and requests
of the others go around them. With a ledger, a thread recovers the records whose owners are gone,
judged by their locks, and a predecessor's lockless ones after a grace.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from .._core.errors import ConfigError
from .._core.failures import unreachable
from .._core.options import FlushOptions
from .._core.report import FlushReport, FlushResult
from .._core.resolve import URL_ENV_VARS, resolve_server_urls
from .._process.liveness import LockFile, LockFolder, LockState, is_held
from .._process.ownership import Verdict, judge
from .._process.proc import Place, command_name, holders, process_start_time
from .._process.record import Record
from .._process.watch_loop import Channel, flush_state
from .._recover import recover_with
from .pool import CONNECT_TIMEOUT, KeyedWorkers, ServerHealth, WorkPool

if TYPE_CHECKING:
    from .metrics import GuardMetrics

RECOVER_INTERVAL: Final = 2.0  # seconds between two recovers of the ledger's gone owners
MAX_WATCHED_PIDS: Final = 64  # live trainers of records (not connected here) whose exit starts a recover at once
STOP_CHECK: Final = 0.25  # seconds between two looks at ``stop`` while waiting for the next recover
TAKEOVER_GRACE: Final = 5.0  # seconds a restarted guard waits for a predecessor's lockless trainers to reconnect
LOCK_RECHECK_MAX: Final = 1.0  # seconds between two looks at the lock of a trainer whose connection ended
RETRY_FIRST: Final = 1.0  # seconds before the first retry of a failed flush; doubled up to RETRY_MAX
RETRY_UNREACHABLE: Final = 0.5  # ... but while every failure is a server that refuses connections (its
# return is met within a second, a request's time included)
RETRY_MAX: Final = 60.0
RETRY_REFUSED: Final = 600.0  # seconds between two retries the servers refused with 401/403 (a wrong secret)
RETRY_GIVE_UP: Final = 24 * 3600.0  # seconds after a death when the guard stops retrying (recover can still)
HTTP_WORKERS: Final = 36  # requests in flight at once over all the guard's flushes (its shared HTTP threads)


class _Retrying(NamedTuple):
    """A dead trainer's flush to one server: its ids left, the attempt and the next delay."""

    server: str
    ids: tuple[str, ...]
    attempt: int
    delay: float


class _Death:
    """A dead trainer's flush, one job per server: the servers left, and what the others flushed."""

    def __init__(self, channel: Channel, died: float, servers: dict[str, tuple[str, ...]]) -> None:
        self.channel, self.died = channel, died
        self.left = set(servers)  # servers not flushed yet
        self.results: list[FlushResult] = []  # what the servers flushed
        self.attempts = 1
        self.failed = False  # a server's flush failed once: the record says the trainer is gone
        self.ended = False  # done (flushed, given up, or claimed by a recover)
        self.lock = threading.Lock()


class DeathFlushes:
    """The flushes of trainers whose connection ended without a disarm.

    Args:
        workers: flush workers (trainers flushed at once).
        connected: the tokens of the trainers connected now (the guard keeps it): one that connected
            again is guarded by its new connection.
        lock_folder: the guard's lock folder, where each trainer's lock is (``channel.lock``).
        release: called when a channel's flush has ended (its held state and lock file go).
        say, say_once: a line, and a line said at most once a minute per kind.
    """

    def __init__(self, workers: int, *, connected: collections.Counter[str],
                 lock_folder: LockFolder, release: Callable[[Channel], None],
                 say: Callable[[str], None], say_once: Callable[[str, str], None],
                 metrics: GuardMetrics | None) -> None:
        self._health = ServerHealth()  # which servers did not answer their last flush: both pools ask it
        self.pool = WorkPool("swe-flush-guard-flush", workers, say, self._health)
        self.http = KeyedWorkers("swe-flush-guard-http", HTTP_WORKERS, say, self._health)  # every flush's requests
        self._connected = connected
        self._lock_folder = lock_folder
        self._release = release
        self._say, self._say_once, self._metrics = say, say_once, metrics
        self._flushing: set[Channel] = set()  # dead trainers whose flush runs, waits or waits to be retried
        self._owned: collections.Counter[str] = collections.Counter()  # ... their tokens: their records are ours
        self._lock = threading.Lock()  # the loop's thread and the flush workers change _flushing
        self.retrying: set[Channel] = set()  # flushes that failed and wait to be retried

    def count(self) -> int:
        """Dead trainers whose flush runs, waits for a worker or waits to be retried."""
        return len(self._flushing)

    def running(self) -> int:
        """Dead trainers whose flush runs or waits for a worker (not those waiting to be retried: their
        records say they are gone, and a successor takes them)."""
        return len(self._flushing) - len(self.retrying)

    def take(self, channel: Channel) -> None:
        """Make the flush of ``channel``'s trainer this guard's, before its connection stops counting:
        the recovery pass never finds its record neither connected nor owned. ``gone`` then flushes it."""
        with self._lock:
            self._flushing.add(channel)
            if channel.token is not None:
                self._owned[channel.token] += 1

    def gone(self, channel: Channel) -> None:
        """``channel`` (taken) ended without a disarm: flush its trainer's last state (once its lock is free)."""
        self.pool.submit(functools.partial(self._flush_once_gone, channel, time.monotonic(), 0.01))

    def owns(self, token: str) -> bool:
        """Is the flush of the trainer with ``token`` this guard's now (run, queued or to be retried)?
        Its record is then left to it: one owner at a time, never the recovery pass too."""
        return token in self._owned

    def _flush_once_gone(self, channel: Channel, ended: float, recheck: float) -> None:
        """Flush once the trainer's lock is free (a held lock is a live trainer: at a death the kernel
        may close the socket a moment before the lock). A trainer that connected again meanwhile is
        guarded by its new connection; no lock, or one that cannot be examined: the end of the
        connection is the death."""
        lock = channel.lock
        if lock is not None and channel.token in self._connected:
            self._done(channel)
            return
        state = self._lock_folder.state(lock) if lock is not None else LockState.UNKNOWN
        verdict = judge(state, channel.trainer_alive())
        if verdict in (Verdict.HANDED, Verdict.DISARMED):  # it let the lock go for a newer guard's, or disarmed
            if channel.keeper is not None:  # the record is the newer guard's (or gone): never written by us again
                channel.keeper.retired = True
            self._done(channel)
            return
        if state is LockState.HELD and verdict is Verdict.DEAD and lock is not None:
            self._say(f"trainer {channel.who} is gone, and its lock is still held{_held_by(lock)}: flushed")
        if verdict is Verdict.ALIVE or (state is LockState.FREE and verdict is Verdict.UNKNOWN):
            if state is LockState.FREE:  # its pid lives: watched until it is gone (pid and start time)
                self._say_once("let go", f"trainer {channel.who} let its lock go unmarked and lives on (its lock's "
                                         "descriptor closed by other code?): it is flushed once its pid is gone")
            self.pool.submit(functools.partial(self._flush_once_gone, channel, ended,
                                               min(recheck * 2, LOCK_RECHECK_MAX)), recheck)
            return
        pairs = _pairs(channel.state)
        if not pairs:  # nothing to flush: settled at once
            channel.settle(None, now=True)
            self._done(channel)
            return
        death = _Death(channel, ended, pairs)
        for server, ids in pairs.items():  # each server its own job: one that fails never holds another's
            self.pool.submit(functools.partial(self._flush, death, _Retrying(server, ids, 1, RETRY_FIRST)),
                             key=server)

    def _flush(self, death: _Death, retry: _Retrying) -> None:
        """One attempt at a dead trainer's flush to one server, on a flush worker. A failed one is put
        back on the heap with backoff (``/flush`` is idempotent; 401/403 slowly) until it is flushed,
        the record is no longer the guard's, or ``RETRY_GIVE_UP`` has passed since the death."""
        channel = death.channel
        who = f"trainer {channel.who}"
        keeper = channel.keeper
        if death.ended:
            return
        if retry.attempt > 1 and keeper is not None and keeper.written and not os.path.exists(keeper.path):
            self._end(death)  # a recover claimed the record (and flushed it), or it was removed
            self._say_once("claimed", f"{who}: its record was taken by a recover or removed; retries end")
            return
        try:
            report = flush_state(channel.state, {retry.server: retry.ids}, max_workers=HTTP_WORKERS, retries=0,
                                 connect_timeout=CONNECT_TIMEOUT, workers=self.http)  # it retries itself
        except Exception as exc:  # noqa: BLE001 - one trainer's failure must not stop the guard
            report, why, refused, away = None, f"the flush failed: {type(exc).__name__}", False, False
            self._health.heard(retry.server, False)
            if self._metrics is not None:
                self._metrics.flushed(None)
        else:
            if report is not None:
                self._health.heard(retry.server, any(result.status_code is not None for result in report.results))
            if self._metrics is not None and report is not None:
                self._metrics.flushed(report)
            if report is None or report.ok:
                self._flushed(death, retry, report)
                return
            failed = [result for result in report.results if not result.ok]
            refused = all(result.status_code in (401, 403) for result in failed)
            away = all(unreachable(result.error) for result in failed)
            why = report.summary()
            with death.lock:
                death.results += [result for result in report.results if result.ok]
            retry = retry._replace(ids=tuple(result.instance_id for result in failed))
        with death.lock:
            first_failure, death.failed = not death.failed, True
            death.attempts = max(death.attempts, retry.attempt + 1)
        if first_failure:
            channel.mark_gone()
            self.retrying.add(channel)
        delay = RETRY_REFUSED if refused else RETRY_UNREACHABLE if away else retry.delay
        if time.monotonic() + delay - death.died > RETRY_GIVE_UP:
            self._end(death)
            self._say(f"{who} gone; {why}; gave up retrying after {RETRY_GIVE_UP / 3600:g} h: its record stays "
                      "for recover")
            return
        self._say_once("retrying", f"{who} gone; {why}; retrying in {delay:g} s (every {RETRY_FIRST:g}-"
                                   f"{RETRY_MAX:g} s, {RETRY_UNREACHABLE:g} s while refused, {RETRY_REFUSED:g} s "
                                   "after 401/403) until it is flushed")
        self.pool.submit(functools.partial(self._flush, death, retry._replace(
            attempt=retry.attempt + 1, delay=retry.delay if away else min(retry.delay * 2, RETRY_MAX))), delay,
            retry.server)

    def _flushed(self, death: _Death, retry: _Retrying, report: FlushReport | None) -> None:
        """One server flushed; the last one settles the death: its line, its metric, its record removed."""
        with death.lock:
            death.left.discard(retry.server)
            if report is not None:
                death.results += report.results
            if death.left or death.ended:
                return
            death.ended = True
        channel = death.channel
        whole = FlushReport(results=tuple(death.results), elapsed=time.monotonic() - death.died)
        if self._metrics is not None:
            self._metrics.death_to_flush.observe(time.monotonic() - death.died)
        if whole.results:  # queued before its record goes (the stderr thread writes it)
            again = f" (attempt {death.attempts})" if death.attempts > 1 else ""
            self._say(f"trainer {channel.who} gone; {whole.summary()}{again}")
        channel.settle(whole, now=True)
        self._done(channel)

    def _end(self, death: _Death) -> None:
        """The death is done without a flush of every server (claimed, given up): its other jobs end."""
        with death.lock:
            if death.ended:
                return
            death.ended = True
        self._done(death.channel)

    def _done(self, channel: Channel) -> None:
        self.retrying.discard(channel)
        with self._lock:
            if channel in self._flushing:
                self._flushing.discard(channel)
                if channel.token is not None:
                    self._owned[channel.token] -= 1
                    if self._owned[channel.token] <= 0:
                        del self._owned[channel.token]
        self._release(channel)


def _held_by(lock: LockFile) -> str:
    """Who holds a dead trainer's lock, where ``/proc`` shows it (for the operator's line)."""
    pids = holders(lock.inode)
    named = [f"pid {pid} ({command_name(pid) or '?'})" for pid in pids[:4]]
    return f" by {', '.join(named)}{' and others' if len(pids) > 4 else ''}" if named else ""


def _pairs(state: dict[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """Server -> the ids a dead trainer's state names (none without ids or servers)."""
    ids = tuple((state or {}).get("ids") or ())
    return {url: ids for url in (state or {}).get("urls") or ()} if ids else {}


class LedgerRecovery:
    """Recovers the ledger's records whose owners are gone, on a daemon thread, until ``stop`` is set:
    at once (a dead trainer's free lock says so), then every ``RECOVER_INTERVAL``, and at once when a
    live trainer of a record that no connection watches exits (up to ``MAX_WATCHED_PIDS`` of them,
    each held by a pidfd: the kernel's word, never a pid that could be reused), and at once when the
    last connection of a pid whose record it left to that connection ends; a predecessor's
    lockless records only after ``grace`` seconds (its trainers may reconnect meanwhile)."""

    def __init__(self, ledger: str, *, grace: float, connected: collections.Counter[str],
                 peer_pids: collections.Counter[int], owns: Callable[[str], bool], stop: threading.Event,
                 accept_waiting: Callable[[], bool], http: KeyedWorkers, say: Callable[[str], None],
                 say_once: Callable[[str, str], None], metrics: GuardMetrics | None) -> None:
        self._ledger, self._grace, self._connected, self._stop, self._http = ledger, grace, connected, stop, http
        self._owns, self._peer_pids, self._accept_waiting = owns, peer_pids, accept_waiting
        self._say, self._say_once, self._metrics = say, say_once, metrics
        self._started = time.monotonic()
        self._watched: dict[tuple[int, int], int] = {}  # (pid, start time) -> a pidfd of a record's live trainer
        self._unproven: set[str] = set()  # lock files said to prove nothing (once each)
        self._left: set[int] = set()  # pids whose record was left to their open connection (peers: bounded)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def start(self) -> None:
        threading.Thread(target=self._run, name="swe-flush-guard-recover", daemon=True).start()

    def _run(self) -> None:
        said_no_server = not resolve_server_urls(os.environ)
        if said_no_server:  # said at once, not after the grace
            self._say(f"cannot recover the ledger: no agent server named ({' and '.join(URL_ENV_VARS)} unset); "
                      "guarding goes on")
        options = FlushOptions(until_idle=True, linger=0.0)
        while not self._stop.is_set():
            claimed: list[Record] = []
            started = time.monotonic()
            try:
                report = recover_with(self._ledger, None, os.environ, options, judge=self._judge,
                                      on_claimed=claimed.extend, quiet=True, workers=self._http)
                if claimed:
                    self._said_recovered(claimed, report, started)
                elif report.error:
                    self._say_once("recover", f"recovering the ledger: {report.error}")
            except ConfigError as exc:
                if not said_no_server:
                    said_no_server = True
                    self._say(f"cannot recover the ledger: {exc}; guarding goes on")
            except Exception as exc:  # noqa: BLE001 - a recover that fails must not stop the guard
                self._say_once("recover failed", f"recovering the ledger failed: {type(exc).__name__}")
            self._wait_for_an_exit()

    def _wait_for_an_exit(self) -> None:
        """Until the next pass is due, a watched trainer exits, or ``stop``; the pidfds are closed after."""
        poller = select.poll()
        for fd in (self._wake, *self._watched.values()):
            poller.register(fd, select.POLLIN)
        due = time.monotonic() + RECOVER_INTERVAL
        try:
            while not self._stop.is_set() and (left := due - time.monotonic()) > 0:
                if poller.poll(1000 * min(left, STOP_CHECK)):
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                    return
        finally:
            for fd in self._watched.values():
                os.close(fd)
            self._watched.clear()

    def connection_ended(self, pid: int) -> None:
        """On the loop, once a connection's end is handled: a pass at once if it was the last one of a
        pid whose record a pass left to it (a trainer that died before its state was parsed)."""
        if pid not in self._peer_pids and pid in self._left:
            self._left.discard(pid)
            os.eventfd_write(self._wake, 1)

    def _watch(self, record: Record) -> bool:
        """Hold a pidfd of the record's trainer while it is the live process the record names, here.
        False when that process has ended since the record was judged (its exit watched by nobody)."""
        key = (record.pid, record.start_time or 0)
        if (key in self._watched or len(self._watched) >= MAX_WATCHED_PIDS or record.start_time is None
                or record.place != Place.here()):
            return True
        try:
            fd = os.pidfd_open(record.pid)
        except ProcessLookupError:  # reaped already
            return False
        except (OSError, AttributeError):  # no pidfd (Linux < 5.3), no descriptor left: the next pass
            return True
        if process_start_time(record.pid) != record.start_time:  # checked once the pidfd holds it: a zombie, reused
            os.close(fd)
            return False
        self._watched[key] = fd
        return True

    def _said_recovered(self, records: list[Record], report: FlushReport, started: float) -> None:
        """A recover pass that claimed records: a line like a trainer's death (naming up to 4 of them),
        and the flush metrics (each record's death flushed ``started``, when the pass began: a watched
        trainer's exit starts it)."""
        if self._metrics is not None:
            self._metrics.recovered.inc(len(records))
            self._metrics.flushed(report)
            if report.ok:
                for _ in records:
                    self._metrics.death_to_flush.observe(time.monotonic() - started)
        named = ", ".join(f"pid {record.pid}" + (f" (record {record.trainer[:8]})" if record.trainer else "")
                          for record in records[:4]) + (" and others" if len(records) > 4 else "")
        self._say(f"recovered {len(records)} record(s) of trainers gone ({named}); {report.summary()}")

    def _judge(self, record: Record, gone: bool) -> bool:
        """Is the record's trainer gone, and its flush this pass's? Never while a connection to this
        guard guards it (``_guarded_here``); and a trainer judged gone may have connected just before it
        died, its connection still waiting in the listen backlog (a trainer killed as it re-arms with a
        successor): every waiting connection is accepted first, then the record is looked at again."""
        if self._guarded_here(record) or not self._gone(record, gone):
            return False
        return self._accept_waiting() and not self._guarded_here(record)

    def _guarded_here(self, record: Record) -> bool:
        """A trainer connected to this guard, or whose flush or record file I/O is this guard's own, is
        guarded here; so is one whose pid here has a connection open (its state may wait for the parser,
        and the connection's end is this guard's to judge)."""
        if record.trainer is not None and (record.trainer in self._connected or self._owns(record.trainer)):
            return True
        if record.pid > 0 and record.pid in self._peer_pids and record.place == Place.here():
            self._left.add(record.pid)  # then looked at again: a connection that ended meanwhile saw no mark
            if record.pid in self._peer_pids:
                return True
            self._left.discard(record.pid)
        return False

    def _gone(self, record: Record, gone: bool) -> bool:
        """A record that names a trainer's lock is as the lock says, else (the file gone or replaced) as
        its pids and heartbeat say (``gone``); a lockless predecessor's record (its guard gone, here)
        whose trainer has not reconnected within the grace is gone, whatever its heartbeat says."""
        if gone:
            return True
        if not self._watch(record) and record.owner_gone(Place.here(), time.time()):
            return True  # its trainer ended since it was judged: judged again (else a pass later)
        guard_lock, trainer_lock = record.locks()
        if trainer_lock is not None:  # held (alive), or proving nothing: its pids and heartbeat decided ``gone``
            if trainer_lock.path not in self._unproven and is_held(trainer_lock) is None:
                if len(self._unproven) >= MAX_WATCHED_PIDS * 64:  # (bounded: an old one may be said again)
                    self._unproven.clear()
                self._unproven.add(trainer_lock.path)
                self._say_once("unproven lock", f"a trainer's lock file {trainer_lock.path} is gone or replaced: it "
                                                "proves nothing, and the trainer is judged by its pids and heartbeat")
            return False
        if guard_lock is not None and is_held(guard_lock):
            return False  # a live guard keeps it
        predecessor = (record.trainer is not None and record.watchdog_pid != os.getpid()
                       and record.place == Place.here()
                       and process_start_time(record.watchdog_pid or 0) != record.watchdog_start_time)
        return predecessor and time.monotonic() - self._started >= self._grace
