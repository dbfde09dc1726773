"""``Flusher``: one future per (server, id) pair, a deadline kept by the calling thread, single flight.

A flush submits one task per pair to a ``ThreadPoolExecutor`` (servers interleaved, so a
deadline cuts every server's share alike) and waits with ``concurrent.futures.wait``. At the
deadline it reports what is unfinished; a request still unanswered stays in flight for up to
``linger`` seconds, and a later flush of the same pair joins it instead of sending again,
so the server's teardown is never cut short by a second cancel.

Nothing holds the process: an exception in the waiting thread (Ctrl-C) gives up the pairs in
flight and re-raises; at interpreter shutdown, before ``concurrent.futures`` joins its
workers, every request in flight is given up (sockets shut down); after ``os.fork()`` the
child forgets the parent's pools and workers. Signal handlers and exit hooks run the same
flush on plain daemon threads (``on_daemon_threads``): the executor refuses work at shutdown,
and its locks may be held by the very code a signal interrupted.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # imported now: its exit hook must be registered before ours
import dataclasses
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ._auth import BearerProvider, check_token
from ._errors import ConfigError, FlushError
from ._logs import WORKER_THREAD_PREFIX, log_report
from ._options import (
    DEFAULT_BACKOFF_FACTOR,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DEADLINE,
    DEFAULT_LINGER,
    DEFAULT_RETRIES,
    FlushOptions,
    check_seconds,
)
from ._report import FlushReport, FlushResult
from ._resolve import normalize_instance_ids, normalize_server_urls
from ._transport import Request, Transport

Pair = tuple[str, str]  # (server url, instance id)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A request some flush sent for a pair, and the future of its result."""

    future: Future[FlushResult]
    request: Request


@dataclass(frozen=True, slots=True)
class _Engine:
    """The HTTP pool and the executor; built on first use, and again in a forked child."""

    transport: Transport
    executor: ThreadPoolExecutor


class Flusher:
    """Flushes instance ids on agent servers in parallel, within a deadline; reusable.

    Keeps one ``requests.Session`` (pool sized to the workers, so a warm Flusher opens no
    new connection) and one ``ThreadPoolExecutor`` across calls: build it once and call
    ``flush`` every rollout step. Thread-safe, fork-safe; a context manager.

    Args:
        server_urls: an agent server URL, a comma-separated list, or a sequence of URLs.
        admin_secret: a static bearer secret, sent as ``Authorization: Bearer <secret>``.
        bearer: a bearer provider instead (instance id -> token), e.g. ``ScopedBearer``.
        max_workers: pairs in flight at once; default one per pair, up to 256.
        retries: retries after the first attempt on connection errors and 429/5xx.
        deadline: default seconds a ``flush`` may take (10 s); at most 3600.
        connect_timeout: seconds one TCP connect may take (also clamped to the time left).
        backoff_factor: exponential backoff base in seconds (with as much random jitter).
        linger: seconds a request unanswered at the deadline stays in flight (default 120;
            0 cuts it at the deadline). See ``FlushOptions``.

    Raises:
        ConfigError: an option is invalid; the message names it.

    Example:
        >>> with Flusher("http://agent:8000", admin_secret=secret) as flusher:  # doctest: +SKIP
        ...     report = flusher.flush(["inst-1", "inst-2"], deadline=5)

    Not guaranteed: a worker blocked in a DNS lookup or a TCP connect can outlive the
    deadline by the resolver's timeout or ``connect_timeout``; its pair is already reported.
    """

    def __init__(
        self,
        server_urls: str | Sequence[str],
        *,
        admin_secret: str | None = None,
        bearer: BearerProvider | None = None,
        max_workers: int | None = None,
        retries: int = DEFAULT_RETRIES,
        deadline: float = DEFAULT_DEADLINE,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        linger: float = DEFAULT_LINGER,
    ) -> None:
        options = FlushOptions(deadline=deadline, retries=retries, max_workers=max_workers,
                               connect_timeout=connect_timeout, backoff_factor=backoff_factor, linger=linger,
                               admin_secret=admin_secret, bearer=bearer)
        self._setup(normalize_server_urls(server_urls), options)

    @classmethod
    def from_options(cls, server_urls: str | Sequence[str], options: FlushOptions) -> Flusher:
        """A Flusher for ``server_urls`` with ready-made ``options``."""
        flusher = cls.__new__(cls)
        flusher._setup(normalize_server_urls(server_urls), options)
        return flusher

    def _setup(self, urls: tuple[str, ...], options: FlushOptions) -> None:
        self._urls = urls
        self._options = options
        self._bearer = options.bearer_provider
        self._lock = threading.RLock()  # re-entrant: a signal handler may flush while it is held
        self._inflight: dict[Pair, _Pending] = {}
        self._engine: _Engine | None = None
        self._gathered = 0  # the most connections the pool is known to have had at once
        self._closed = False
        _live.add(self)

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The agent servers this Flusher posts to."""
        return self._urls

    @property
    def options(self) -> FlushOptions:
        """The validated options."""
        return self._options

    @property
    def deadline(self) -> float:
        """The default deadline of ``flush``, in seconds."""
        return self._options.deadline

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def flush(self, instance_ids: str | Iterable[str] | Mapping[Any, str], *,
              deadline: float | None = None) -> FlushReport:
        """POST ``/flush`` for every (server, id) pair in parallel; return within the deadline.

        A pair whose earlier request is still in flight (lingering) is not sent again: this
        call waits on that request and reports its answer, with ``joined=True``.

        Args:
            instance_ids: one id, an iterable of ids, or a Mapping whose values are ids;
                duplicates, None and "" are dropped.
            deadline: seconds for this call; the Flusher's default when None.

        Returns:
            A ``FlushReport``, one result per pair, server-major. Pairs unfinished at the
            deadline fail with an error saying so. Nothing to flush: an empty ok report.

        Raises:
            ConfigError: a bad id or deadline.
            FlushError: the Flusher is closed.

        The call returns within ``deadline`` plus a few milliseconds whatever the servers do.
        """
        ids = normalize_instance_ids(instance_ids)
        budget = self._options.deadline if deadline is None else check_seconds(deadline, "deadline")
        report = self.flush_ids(ids, budget)
        log_report(report)
        return report

    def flush_ids(self, ids: tuple[str, ...], budget: float, *, on_daemon_threads: bool = False) -> FlushReport:
        """``flush`` of validated ids, without logging; ``on_daemon_threads`` for signal and exit hooks."""
        started = time.monotonic()
        expires_at = started + budget
        # Dispatch interleaves servers, so that a deadline cuts every server's share alike.
        dispatch = [(url, instance_id) for instance_id in ids for url in self._urls]
        if not dispatch:
            return FlushReport(elapsed=time.monotonic() - started)
        with self._lock:
            if self._closed:
                raise FlushError("this Flusher is closed")
            waiting, ready = self._dispatch(dispatch, expires_at, on_daemon_threads)
        try:
            concurrent.futures.wait([pending.future for pending, _ in waiting.values()],
                                    timeout=max(expires_at - time.monotonic(), 0))
        except BaseException:  # Ctrl-C or any other exception here: give the pairs up, re-raise
            for pending, _ in waiting.values():
                self._give_up(pending, "interrupted")
            raise
        results = tuple(
            ready.get(pair) or self._outcome(pair, *waiting[pair], started)
            for pair in ((url, instance_id) for url in self._urls for instance_id in ids)
        )
        return FlushReport(results=results, elapsed=time.monotonic() - started)

    def _dispatch(self, dispatch: list[Pair], expires_at: float,
                  on_daemon_threads: bool) -> tuple[dict[Pair, tuple[_Pending, bool]], dict[Pair, FlushResult]]:
        """Join or send every pair: (pair -> (pending, joined)), and the pairs failed up front."""
        waiting: dict[Pair, tuple[_Pending, bool]] = {}
        ready: dict[Pair, FlushResult] = {}
        fresh: list[tuple[Pair, str | None, Request]] = []
        self._forget_finished()
        for pair in dispatch:
            pending = self._inflight.get(pair)
            if pending is not None:  # single flight: an earlier request is still out
                waiting[pair] = (pending, True)
                continue
            try:
                authorization = self._authorization(pair[1])
            except ConfigError as exc:
                ready[pair] = FlushResult(*pair, ok=False, error=str(exc))
                continue
            fresh.append((pair, authorization, Request(expires_at, expires_at + self._options.linger)))
        if not on_daemon_threads:
            self._gather_connections([request for _, _, request in fresh], busy=len(self._inflight))
        futures = self._submit(fresh, on_daemon_threads)
        for (pair, _, request), future in zip(fresh, futures, strict=True):
            pending = _Pending(future, request)
            self._inflight[pair] = pending
            waiting[pair] = (pending, False)
        return waiting, ready

    def _gather_connections(self, fresh: list[Request], busy: int) -> None:
        """Let a call that needs more connections than the pool ever had open them all at once.

        When a free worker is there for each of its pairs, each pair keeps its connection until
        all are answered (``Request.hold``): the pool grows to the call's width in one step, and
        later calls up to that width reuse it and open none. A first call opens one per pair.
        (A call wider than the free workers keeps every worker busy: its pool fills anyway.)
        """
        if 1 < len(fresh) <= self._options.workers - busy and busy + len(fresh) > self._gathered:
            barrier = threading.Barrier(len(fresh))
            for request in fresh:
                request.gather = barrier
            self._gathered = busy + len(fresh)

    def _authorization(self, instance_id: str) -> str | None:
        if self._bearer is None:
            return None
        try:
            token = self._bearer(instance_id)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's provider; its message could hold anything
            raise ConfigError(f"the bearer provider raised {type(exc).__name__}") from None
        return "Bearer " + check_token(token, "the bearer provider's token")

    def _submit(self, fresh: list[tuple[Pair, str | None, Request]],
                on_daemon_threads: bool) -> list[Future[FlushResult]]:
        engine = self._engine_now()
        calls = [_bind(engine.transport, pair, authorization, request) for pair, authorization, request in fresh]
        futures: list[Future[FlushResult]] = []
        if not on_daemon_threads:
            try:
                for call in calls:
                    futures.append(engine.executor.submit(call))
            except RuntimeError:  # interpreter shutdown: the executor refuses new work
                if fresh and fresh[0][2].gather is not None:
                    fresh[0][2].gather.abort()  # the ones sent so far must not wait for the rest
        return futures + _run_on_daemon_threads(calls[len(futures):], self._options.workers)

    def _outcome(self, pair: Pair, pending: _Pending, joined: bool, started: float) -> FlushResult:
        future = pending.future
        if future.done() and not future.cancelled():
            result = future.result()
            return dataclasses.replace(result, joined=True) if joined else result
        elapsed = time.monotonic() - started
        request = pending.request
        reason = request.abandon_reason if request.abandoned.is_set() else "deadline passed"
        if future.cancel() or future.cancelled():  # never started
            return FlushResult(*pair, ok=False, elapsed=elapsed, error=f"{reason} before it was sent", joined=joined)
        if request.abandoned.is_set() or self._options.linger == 0:
            self._give_up(pending, reason)
            error = f"{reason} while in flight"
        else:
            error = f"deadline passed while in flight (left in flight for up to {self._options.linger:g}s)"
        return FlushResult(*pair, ok=False, attempts=request.attempts, elapsed=elapsed, error=error, joined=joined)

    @staticmethod
    def _give_up(pending: _Pending, reason: str) -> None:
        pending.future.cancel()
        pending.request.abandon(reason)

    def _forget_finished(self) -> None:
        """Drop finished requests from the in-flight map; give up those past their linger."""
        now = time.monotonic()
        for pair, pending in list(self._inflight.items()):
            if pending.future.done():
                del self._inflight[pair]
            elif pending.request.expires_at <= now:  # a peer that trickles bytes for ever
                self._give_up(pending, "linger ran out")
                del self._inflight[pair]

    def _engine_now(self) -> _Engine:
        if self._engine is None:
            options = self._options
            transport = Transport(self._urls, pool_maxsize=options.workers, retries=options.retries,
                                  backoff_factor=options.backoff_factor, connect_timeout=options.connect_timeout)
            executor = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix=WORKER_THREAD_PREFIX)
            self._engine = _Engine(transport, executor)
        return self._engine

    def warm_up(self) -> None:
        """Build the pool and a request now, so that nothing is imported lazily later."""
        with self._lock:
            engine = self._engine_now()
        for url in self._urls:
            engine.transport.prepare(url, "warm-up", None)

    def abandon_in_flight(self, reason: str) -> None:
        """Give up every request in flight or lingering now (sockets shut down). Lock-free."""
        for pending in self._inflight.copy().values():
            self._give_up(pending, reason)

    def close(self) -> None:
        """Give up every request in flight and release the pool and the workers; never waits.

        A flush running in another thread returns at once with its pairs failed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
            self.abandon_in_flight("the Flusher was closed")
            self._inflight.clear()
        _live.discard(self)
        if engine is not None:
            engine.executor.shutdown(wait=False, cancel_futures=True)
            engine.transport.close()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's pool, workers, sockets and locks are not ours."""
        self._lock = threading.RLock()
        self._inflight = {}
        self._engine = None
        self._gathered = 0

    def __enter__(self) -> Flusher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Flusher(server_urls={self._urls!r}, options={self._options!r})"


def _bind(transport: Transport, pair: Pair, authorization: str | None, request: Request) -> Callable[[], FlushResult]:
    return lambda: transport.post(pair[0], pair[1], authorization, request)


def _run_on_daemon_threads(calls: list[Callable[[], FlushResult]], workers: int) -> list[Future[FlushResult]]:
    """Run ``calls`` on up to ``workers`` plain daemon threads; in this thread where none can start."""
    if not calls:
        return []
    futures: list[Future[FlushResult]] = [Future() for _ in calls]
    tasks: queue.SimpleQueue[tuple[Future[FlushResult], Callable[[], FlushResult]]] = queue.SimpleQueue()
    for task in zip(futures, calls, strict=True):
        tasks.put(task)

    def drain() -> None:
        while True:
            try:
                future, call = tasks.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_result(call())  # Transport.post never raises

    started = 0
    for _ in range(min(len(calls), workers)):
        thread = threading.Thread(target=drain, name=f"{WORKER_THREAD_PREFIX}-daemon", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown" (3.12)
            break
        started += 1
    if started == 0:
        drain()  # one by one in the calling thread, each bounded by the deadline
    return futures


def flush(
    server_urls: str | Sequence[str],
    instance_ids: str | Iterable[str] | Mapping[Any, str],
    *,
    admin_secret: str | None = None,
    bearer: BearerProvider | None = None,
    max_workers: int | None = None,
    retries: int = DEFAULT_RETRIES,
    deadline: float = DEFAULT_DEADLINE,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
    linger: float = 0.0,
) -> FlushReport:
    """One-shot flush: build a ``Flusher``, flush ``instance_ids``, close it.

    The pool closes with the call, so nothing lingers: ``linger`` defaults to 0 here.

    Args:
        server_urls: as for ``Flusher``.
        instance_ids: as for ``Flusher.flush``.
        admin_secret, bearer, max_workers, retries, deadline, connect_timeout, backoff_factor,
            linger: as for ``Flusher``.

    Returns:
        The ``FlushReport``.

    Raises:
        ConfigError: bad URLs, ids or options.

    Example:
        >>> flush("http://agent:8000", ["inst-1"], deadline=5).raise_for_failures()  # doctest: +SKIP
    """
    with Flusher(server_urls, admin_secret=admin_secret, bearer=bearer, max_workers=max_workers, retries=retries,
                 deadline=deadline, connect_timeout=connect_timeout, backoff_factor=backoff_factor,
                 linger=linger) as flusher:
        flusher._gathered = flusher.options.workers  # one call, then the pool closes: nothing to warm
        return flusher.flush(instance_ids)


_live: weakref.WeakSet[Flusher] = weakref.WeakSet()


def abandon_all_in_flight(reason: str = "given up at interpreter exit") -> None:
    """Give up every request of every live Flusher (interpreter shutdown, signal handlers)."""
    for flusher in list(_live):
        flusher.abandon_in_flight(reason)


def _after_fork_in_child() -> None:
    for flusher in list(_live):
        flusher._forget_after_fork()


# Runs when the main thread ends, before concurrent.futures joins its (non-daemon) workers:
# giving every request up first lets them end at once, so a lingering request never holds
# the process. ``threading._register_atexit`` is what concurrent.futures itself uses.
_register_thread_exit: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
if _register_thread_exit is not None:
    _register_thread_exit(abandon_all_in_flight)
os.register_at_fork(after_in_child=_after_fork_in_child)
