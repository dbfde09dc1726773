"""The guard's bounded work: a fixed number of worker threads over a queue of fresh jobs and one
heap of due times.

A dead trainer's flush is a fresh job; its retry is the same kind of job, due later. Fresh jobs go
first, in order, then retries as they fall due: a crowd of retrying flushes never delays the
flush of a trainer that has just died. The guard's thread count is fixed at start-up whatever
number of trainers die, retry or misbehave, and a waiting retry costs a heap entry, not a
sleeping thread. A worker that cannot be started (a pids limit) is tried again when work comes,
at most once a second; until one runs, the work waits.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Final

from ._threads import start_daemon_thread

DEFAULT_FLUSH_WORKERS: Final = 16  # trainers flushed at once by a guard (their requests share its HTTP workers)
START_RETRY: Final = 1.0  # seconds between two attempts to start a worker that failed to start


class WorkPool:
    """``workers`` daemon threads running fresh jobs first, then delayed ones as they fall due."""

    def __init__(self, name: str, workers: int, on_start_failure: Callable[[str], None]) -> None:
        self._name = name
        self._wanted = workers
        self._running = 0
        self._fresh: collections.deque[Callable[[], None]] = collections.deque()
        self._later: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # equal due times run in submission order; jobs are never compared
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
            return len(self._fresh) + len(self._later)

    def submit(self, job: Callable[[], None], delay: float = 0.0) -> None:
        """Run ``job`` on a worker: now (after the fresh jobs before it), or ``delay`` seconds from now.
        Never raises, never starts more than ``workers`` threads."""
        with self._changed:
            if delay > 0:
                heapq.heappush(self._later, (time.monotonic() + delay, next(self._order), job))
            else:
                self._fresh.append(job)
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

    def _next(self) -> Callable[[], None]:
        with self._changed:
            while True:
                if self._fresh:
                    return self._fresh.popleft()
                wait = None if not self._later else self._later[0][0] - time.monotonic()
                if wait is not None and wait <= 0:
                    return heapq.heappop(self._later)[2]
                self._changed.wait(wait)

    def _serve(self) -> None:
        while True:
            job = self._next()
            with contextlib.suppress(Exception):  # a job says its own failures; the worker must go on
                job()
