"""``Flusher``: owns the HTTP pool and the worker threads, and keeps the deadline.

The calling thread owns the deadline: it waits on a Condition until every pair is done or the
deadline passes, then shuts down the sockets of the pairs still in flight and reports them as
failed. It never blocks on a worker. Workers come from a ``ThreadPoolExecutor``; where it
refuses work (interpreter shutdown) or must not be touched (a signal handler), plain daemon
threads run the same loop, and where even those cannot start, the calling thread does.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from ._errors import ConfigError, FlushError
from ._report import FlushReport, FlushResult
from ._resolve import normalize_instance_ids, normalize_server_urls
from ._transport import ConnectionGate, PairCall, Transport

log = logging.getLogger(__name__)

DEFAULT_DEADLINE: Final = 10.0
DEFAULT_RETRIES: Final = 3
DEFAULT_MAX_WORKERS: Final = 256
DEFAULT_CONNECT_TIMEOUT: Final = 3.0
DEFAULT_BACKOFF_FACTOR: Final = 0.2
MAX_DEADLINE: Final = 3600.0
MAX_RETRIES: Final = 100
MAX_WORKERS: Final = 4096
_GATE_PATIENCE: Final = 0.5  # seconds first connections stay aside for workers that do not start


def check_seconds(value: Any, name: str, maximum: float = MAX_DEADLINE) -> float:
    """``value`` as a float in (0, maximum], else ``ConfigError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0 or value > maximum:
        raise ConfigError(f"{name} must be > 0 and <= {maximum:g} seconds, got {value!r}")
    return float(value)


def _check_count(value: Any, name: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, not {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def _check_secret(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"admin_secret must be a str, not {type(value).__name__}")
    if not all(" " <= ch <= "~" for ch in value):
        raise ConfigError("admin_secret must be printable ASCII (it is sent in an HTTP header)")
    return value


class _Batch:
    """The pairs of one flush call, their results, and the signal that they are done."""

    def __init__(self, pairs: Sequence[tuple[str, str]], deadline: float) -> None:
        self.pairs = pairs
        self.deadline = deadline
        self.results: list[FlushResult | None] = [None] * len(pairs)
        self._calls: list[PairCall | None] = [None] * len(pairs)
        self._next = 0
        self._done = 0
        self._stop_reason: str | None = None
        self._cond = threading.Condition(threading.Lock())
        self._gate = ConnectionGate(deadline, _GATE_PATIENCE)

    def expect_workers(self, started: int) -> None:
        """Say how many workers were started (their first connections are held until all have one)."""
        self._gate.expect(started)

    def run(self, transport: Transport) -> None:
        """Worker loop: flush pairs until none is left or the batch is given up.

        A worker claims its first pair as it starts, so every pair (up to the worker count)
        is in flight at once; the gate keeps first connections aside until every worker has
        one, so the pool grows to the pairs in flight and the next call opens none.
        """
        with self._cond:
            index = self._claim()
        if index is None:
            self._gate.arrive()  # nothing left to claim: do not keep the others' connections aside
            return
        first = self._calls[index]
        assert first is not None
        first.gate = self._gate
        while index is not None:
            call = self._calls[index]
            assert call is not None
            url, instance_id = self.pairs[index]
            result = transport.post(url, instance_id, call)
            with self._cond:
                if self._stop_reason is None:
                    self.results[index] = result
                    self._done += 1
                    if self._done == len(self.pairs):
                        self._cond.notify_all()
                more = self._stop_reason is None and self._next < len(self.pairs)
            if call is first:
                if not more:
                    return
                self._gate.wait()  # first pairs go to distinct workers: later ones reuse the pool
            with self._cond:
                index = self._claim()

    def _claim(self) -> int | None:
        """The next unclaimed pair (its PairCall created), or None; call with the lock held."""
        if self._stop_reason is not None or self._next >= len(self.pairs):
            return None
        index = self._next
        self._next += 1
        self._calls[index] = PairCall(self.deadline)
        return index

    def stop(self, reason: str) -> None:
        """Give the batch up now (its waiting caller returns at once)."""
        with self._cond:
            if self._stop_reason is None:
                self._stop_reason = reason
            self._cond.notify_all()
        self._gate.open()

    def wait(self, started: float) -> tuple[FlushResult, ...]:
        """Block until all pairs are done or the deadline passes; fail what is unfinished."""
        with self._cond:
            while self._done < len(self.pairs) and self._stop_reason is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stop_reason is None and self._done < len(self.pairs):
                self._stop_reason = "deadline passed"
            reason = self._stop_reason
            unfinished = [i for i, result in enumerate(self.results) if result is None]
            calls = list(self._calls)
        self._gate.open()
        now = time.monotonic()
        for index in unfinished:
            call = calls[index]
            url, instance_id = self.pairs[index]
            if call is None:
                error, attempts = f"{reason} before it was sent", 0
            else:
                call.interrupt()
                error, attempts = f"{reason} while in flight", call.attempts
            self.results[index] = FlushResult(url, instance_id, ok=False, attempts=attempts,
                                              elapsed=now - started, error=error)
        return tuple(result for result in self.results if result is not None)


class Flusher:
    """Flushes instance ids on agent servers in parallel, within a deadline; reusable.

    Keeps one ``requests.Session`` (pool sized to ``max_workers``, so no connection is ever
    discarded) and one ``ThreadPoolExecutor`` warm across calls: build it once and call
    ``flush`` every rollout step. Thread-safe; a context manager.

    Args:
        server_urls: an agent server URL, a comma-separated list, or a sequence of URLs.
        admin_secret: sent as ``Authorization: Bearer <secret>``; None or "" sends none.
        max_workers: pairs in flight at once; default one per pair, up to 256.
        retries: retries after the first attempt on connection errors and 429/5xx (so at
            most ``retries + 1`` attempts); 0 disables retrying.
        deadline: default seconds a ``flush`` may take (10 s); at most 3600.
        connect_timeout: seconds one TCP connect may take (also clamped to the deadline).
        backoff_factor: exponential backoff base in seconds (with as much random jitter);
            the first retry is immediate.

    Raises:
        ConfigError: an option is invalid; the message names it.

    Example:
        >>> with Flusher("http://agent:8000", admin_secret=secret) as flusher:  # doctest: +SKIP
        ...     report = flusher.flush(["inst-1", "inst-2"], deadline=5)

    Not guaranteed: a worker blocked in a DNS lookup can outlive the deadline by the
    resolver's own timeout; its result is already reported as failed.
    """

    def __init__(
        self,
        server_urls: str | Sequence[str],
        *,
        admin_secret: str | None = None,
        max_workers: int | None = None,
        retries: int = DEFAULT_RETRIES,
        deadline: float = DEFAULT_DEADLINE,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
    ) -> None:
        self._urls = normalize_server_urls(server_urls)
        self._secret = _check_secret(admin_secret)
        self._max_workers = DEFAULT_MAX_WORKERS if max_workers is None else _check_count(
            max_workers, "max_workers", 1, MAX_WORKERS)
        self._retries = _check_count(retries, "retries", 0, MAX_RETRIES)
        self._deadline = check_seconds(deadline, "deadline")
        self._connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        if isinstance(backoff_factor, bool) or not isinstance(backoff_factor, (int, float)) \
                or not 0 <= backoff_factor <= 60:
            raise ConfigError(f"backoff_factor must be a number from 0 to 60, got {backoff_factor!r}")
        self._transport = Transport(self._urls, admin_secret=self._secret, pool_maxsize=self._max_workers,
                                    retries=self._retries, backoff_factor=float(backoff_factor),
                                    connect_timeout=self._connect_timeout)
        self._executor = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="swe-flush")
        self._lock = threading.RLock()  # re-entrant: a signal handler may run while it is held
        self._active: set[_Batch] = set()
        # Workers never take self._lock: a signal may interrupt the main thread holding it, and
        # the handler's own flush then waits for its workers.
        self._busy_lock = threading.Lock()
        self._busy = 0  # workers inside a batch
        self._closed = False

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The agent servers this Flusher posts to."""
        return self._urls

    @property
    def deadline(self) -> float:
        """The default deadline of ``flush``, in seconds."""
        return self._deadline

    def flush(self, instance_ids: str | Iterable[str] | Mapping[Any, str], *,
              deadline: float | None = None) -> FlushReport:
        """POST ``/flush`` for every (server, id) pair in parallel; return within the deadline.

        Args:
            instance_ids: one id, an iterable of ids, or a Mapping whose values are ids;
                duplicates, None and "" are dropped.
            deadline: seconds for this call; the Flusher's default when None.

        Returns:
            A ``FlushReport`` with one result per pair, URL-major. Pairs unfinished at the
            deadline are failed with an error saying so. Nothing to flush: an empty ok report.

        Raises:
            ConfigError: a bad id or deadline.
            FlushError: the Flusher is closed.

        The call returns within ``deadline`` plus a few milliseconds whatever the servers do.
        """
        ids = normalize_instance_ids(instance_ids)
        budget = self._deadline if deadline is None else check_seconds(deadline, "deadline")
        return self._flush_ids(ids, budget, use_executor=True)

    def _flush_ids(self, ids: tuple[str, ...], budget: float, *, use_executor: bool) -> FlushReport:
        """``flush`` of validated ids; ``use_executor=False`` runs plain daemon threads instead."""
        started = time.monotonic()
        pairs = [(url, instance_id) for url in self._urls for instance_id in ids]
        if not pairs:
            return FlushReport(results=(), elapsed=time.monotonic() - started)
        batch = _Batch(pairs, started + budget)
        with self._lock:
            if self._closed:
                raise FlushError("this Flusher is closed")
            self._active.add(batch)
        try:
            try:
                self._start_workers(batch, min(len(pairs), self._max_workers), use_executor)
            except BaseException:
                batch.expect_workers(0)  # never leave started workers waiting
                raise
            results = batch.wait(started)
        finally:
            with self._lock:
                self._active.discard(batch)
        report = FlushReport(results=results, elapsed=time.monotonic() - started)
        _log_report(report)
        return report

    def _start_workers(self, batch: _Batch, count: int, use_executor: bool) -> None:
        started = 0
        if use_executor:
            try:
                for _ in range(count):
                    self._executor.submit(self._work, batch)
                    started += 1
                batch.expect_workers(started)
                return
            except RuntimeError:  # interpreter shutdown: the executor refuses new work
                pass
        for _ in range(count - started):
            thread = threading.Thread(target=self._work, args=(batch,), name="swe-flush", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown" (3.12)
                break
            started += 1
        batch.expect_workers(started)
        if started == 0:
            self._work(batch)  # one by one in the calling thread, each bounded by the deadline

    def _work(self, batch: _Batch) -> None:
        with self._busy_lock:
            self._busy += 1
        try:
            batch.run(self._transport)
        finally:
            with self._busy_lock:
                self._busy -= 1

    def close(self) -> None:
        """Release the pool and the workers; a flush still running returns at once.

        Never waits for a worker still blocked past its deadline.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            batches = list(self._active)
        with self._busy_lock:
            idle = self._busy == 0 and not batches
        for batch in batches:
            batch.stop("the Flusher was closed")
        # Joining idle workers is immediate; a straggler past its deadline is never waited for.
        self._executor.shutdown(wait=idle, cancel_futures=True)
        self._transport.close()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def __enter__(self) -> Flusher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        secret = "'***'" if self._secret else "None"
        return (f"Flusher(server_urls={self._urls!r}, admin_secret={secret}, "
                f"max_workers={self._max_workers}, retries={self._retries}, deadline={self._deadline:g})")


def _log_report(report: FlushReport) -> None:
    """One INFO summary and one WARNING per failed pair, from the calling thread only."""
    try:
        for result in report.failed:
            log.warning("flush of %s at %s failed: %s", result.instance_id, result.server_url, result.error)
        log.info("%s", report.summary())
    except Exception:  # a logging failure (say, a re-entered stream in a signal handler) is not ours to raise
        pass


def flush(server_urls: str | Sequence[str], instance_ids: str | Iterable[str] | Mapping[Any, str],
          **options: Any) -> FlushReport:
    """One-shot flush: build a ``Flusher`` with ``options``, flush ``instance_ids``, close it.

    Args:
        server_urls: as for ``Flusher``.
        instance_ids: as for ``Flusher.flush``.
        **options: ``Flusher`` options (``admin_secret``, ``deadline``, ``retries``, ...).

    Returns:
        The ``FlushReport``.

    Raises:
        ConfigError: bad URLs, ids or options.

    Example:
        >>> flush("http://agent:8000", ["inst-1"], deadline=5).raise_for_failures()  # doctest: +SKIP
    """
    with Flusher(server_urls, **options) as flusher:
        return flusher.flush(instance_ids)
