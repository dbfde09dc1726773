"""The guard's bounded, fair work: a fixed number of worker threads over queues kept per key (an
agent server), and one heap of due times.

A dead trainer's flush to each of its servers, and each of its requests, is a job keyed by that
server. Fresh jobs go first, taken from the keys in turn, then retries as they fall due, in turn
too: a crowd of retrying flushes never delays the flush of a trainer that has just died, and the
deaths of one server never queue ahead of another's. A key's first job runs on any idle worker,
and its others only while ``share`` (a quarter) of the workers stay idle for the keys that run
none. A server whose last flush got no answer (``ServerHealth``: black-holed, refusing, too slow)
runs one job at a time, and all such servers together on at most half the workers, however many
fail. Connects are short (``CONNECT_TIMEOUT``), so a black-holed server's first flushes hold their
workers for about a second, then wait in the heap. The thread count is fixed at start-up whatever
number of trainers die, retry or misbehave; a waiting retry costs a heap entry, not a sleeping
thread. A worker that cannot be started (a pids limit) is tried again when work comes, at most
once a second; until one runs, the work waits. ``KeyedWorkers`` puts a Flusher's requests on such
a pool (a ``Runner``, keyed by their server).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Final, TypeVar

from .._core.outcome import Outcome
from .._core.threads import start_daemon_thread

T = TypeVar("T")

DEFAULT_FLUSH_WORKERS: Final = 16  # trainers flushed at once by a guard (their requests share its HTTP workers)
SHARE_OF_WORKERS: Final = 4  # 1/4 of a pool's workers stay idle for keys that run nothing (a key's second job waits)
START_RETRY: Final = 1.0  # seconds between two attempts to start a worker that failed to start
MAX_SERVERS: Final = 4096  # servers kept as not answering (more are taken at their word)
CONNECT_TIMEOUT: Final = 1.0  # seconds a guard's flush request may take to connect (a trainer's own is longer)

Job = Callable[[], None]


class ServerHealth:
    """Which servers did not answer their last flush (no HTTP status: black-holed, refusing, too slow),
    shared by a guard's pools and set by its flushes; a server is taken at its word until it fails."""

    def __init__(self) -> None:
        self._silent: set[Hashable] = set()

    def heard(self, server: Hashable, answered: bool) -> None:
        if answered:
            self._silent.discard(server)
        elif len(self._silent) < MAX_SERVERS:
            self._silent.add(server)

    def answers(self, key: Hashable) -> bool:
        """Does ``key`` (a server, or a key of other work) answer, as far as its last flush says?"""
        return key not in self._silent


class _Queues:
    """Jobs waiting, a queue per key, taken from the keys in turn."""

    def __init__(self) -> None:
        self.jobs: dict[Hashable, collections.deque[Job]] = {}  # only keys with jobs; in turn order

    def __len__(self) -> int:
        return sum(map(len, self.jobs.values()))

    def put(self, key: Hashable, job: Job) -> None:
        self.jobs.setdefault(key, collections.deque()).append(job)

    def take(self, may_run: Callable[[Hashable], bool]) -> tuple[Hashable, Job] | None:
        """The next job of the first key in turn that ``may_run``; that key's turn then goes last."""
        for key, jobs in self.jobs.items():
            if may_run(key):
                job = jobs.popleft()
                del self.jobs[key]
                if jobs:
                    self.jobs[key] = jobs  # (a dict keeps insertion order: back of the turn)
                return key, job
        return None


class WorkPool:
    """``workers`` daemon threads running fresh jobs first, then delayed ones as they fall due; each
    taken from the keys in turn. A key runs one job on any idle worker, and more only while
    ``share`` (``workers // SHARE_OF_WORKERS``, at least 1) workers stay idle for the other keys; a
    key of a server that did not answer (``health``) runs one, and all such keys at most half."""

    def __init__(self, name: str, workers: int, on_start_failure: Callable[[str], None],
                 health: ServerHealth | None = None) -> None:
        self._name = name
        self._wanted = workers
        self.share = max(workers // SHARE_OF_WORKERS, 1)
        self._health = health
        self._silent_at_most = max(workers // 2, 1)  # jobs of servers that do not answer, running at once
        self._silent = 0  # ... running now
        self._running = 0
        self._fresh = _Queues()
        self._due = _Queues()  # retries fallen due
        self._later: list[tuple[float, int, Hashable, Job]] = []
        self._order = itertools.count()  # equal due times run in submission order; jobs are never compared
        self._busy: collections.Counter[Hashable] = collections.Counter()  # jobs running, per key
        self._active = 0  # jobs running
        self._changed = threading.Condition()
        self._on_start_failure = on_start_failure
        self._start_failed_at: float | None = None
        self._said_start_failure = False
        with self._changed:
            self._start_workers()

    @property
    def threads(self) -> int:
        """Workers running now."""
        return self._running

    def __len__(self) -> int:
        """Jobs waiting, due or not."""
        with self._changed:
            return len(self._fresh) + len(self._due) + len(self._later)

    def submit(self, job: Job, delay: float = 0.0, key: Hashable = None) -> None:
        """Run ``job`` on a worker: now (after the fresh jobs of ``key`` before it), or ``delay`` seconds
        from now. Never raises, never starts more than ``workers`` threads."""
        with self._changed:
            if delay > 0:
                heapq.heappush(self._later, (time.monotonic() + delay, next(self._order), key, job))
            else:
                self._fresh.put(key, job)
            self._changed.notify()
            if self._running < self._wanted:
                self._start_workers()

    def _start_workers(self) -> None:
        """Start the workers missing (with the condition's lock held)."""
        now = time.monotonic()
        if self._start_failed_at is not None and now - self._start_failed_at < START_RETRY:
            return
        while self._running < self._wanted:
            try:
                start_daemon_thread(self._serve, name=self._name)
            except RuntimeError as exc:  # "can't start new thread": the work waits for a worker
                self._start_failed_at = now
                if not self._said_start_failure:
                    self._said_start_failure = True
                    self._on_start_failure(f"cannot start a {self._name} thread ({exc}); {self._running} of "
                                           f"{self._wanted} run, the rest of the work waits for them")
                return
            self._running += 1
        self._start_failed_at = None

    def _answers(self, key: Hashable) -> bool:
        return self._health is None or self._health.answers(key)

    def _may_run(self, key: Hashable) -> bool:
        if not self._answers(key):
            return not self._busy[key] and self._silent < self._silent_at_most
        return not self._busy[key] or self._running - self._active - 1 >= self.share

    def _next(self) -> tuple[Hashable, Job, bool]:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, _, key, job = heapq.heappop(self._later)
                    self._due.put(key, job)
                taken = self._fresh.take(self._may_run) or self._due.take(self._may_run)
                if taken is not None:
                    silent = not self._answers(taken[0])
                    self._busy[taken[0]] += 1
                    self._active += 1
                    self._silent += silent
                    return (*taken, silent)
                self._changed.wait(self._later[0][0] - now if self._later else None)  # or a key's job ends

    def _serve(self) -> None:
        while True:
            key, job, silent = self._next()
            with contextlib.suppress(Exception):  # a job says its own failures; the worker must go on
                job()
            del job
            with self._changed:
                self._active -= 1
                self._silent -= silent
                self._busy[key] -= 1
                if not self._busy[key]:
                    del self._busy[key]
                self._changed.notify()


class KeyedWorkers:
    """A ``Runner`` (see ``_core.threads``) over a ``WorkPool``: a Flusher's requests, queued by their server."""

    def __init__(self, name: str, workers: int, on_start_failure: Callable[[str], None],
                 health: ServerHealth | None = None) -> None:
        self.pool = WorkPool(name, workers, on_start_failure, health)

    def run(self, future: Outcome[T], call: Callable[[], T], key: Hashable = None) -> bool:
        """Queue ``call`` under ``key``; where no thread could start at all (a pids limit), run it here."""
        self.pool.submit(functools.partial(future.run, call), key=key)
        if not self.pool.threads:  # (bounded by the call's own deadline; a worker taking it meanwhile: skipped)
            future.run(call)
        return True
