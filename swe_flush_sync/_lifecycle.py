"""Abort hooks: ``abort`` every rollout step, ``abort_async``, on a signal and at exit.

All of them resolve the ids from trainer ``args`` and the servers and bearer from the
environment at the moment they run, and share one cached ``Flusher`` per configuration (so
a per-step abort joins a request an earlier step left in flight instead of sending it again).
The signal and exit paths give up every lingering request, flush on plain daemon threads
with urllib3's loggers disabled, and log from a bounded thread of their own, so neither a
logging lock nor a stalled stderr can keep the process from dying.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import FrameType
from typing import Any, Final, ParamSpec

from ._auth import BearerProvider
from ._errors import ConfigError, FlushError
from ._flusher import Flusher, abandon_all_in_flight
from ._logs import log_report, run_bounded, urllib3_silenced
from ._options import (
    DEFAULT_BACKOFF_FACTOR,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DEADLINE,
    DEFAULT_LINGER,
    DEFAULT_RETRIES,
    FlushOptions,
)
from ._report import FlushReport
from ._resolve import URL_ENV_VARS, resolve_bearer, resolve_instance_ids, resolve_server_urls

log = logging.getLogger(__name__)
P = ParamSpec("P")

_CACHE_SIZE: Final = 8
_HOOK_LOG_TIMEOUT: Final = 0.5  # seconds a signal or exit hook waits for its own logging
_cache_lock = threading.RLock()  # re-entrant: a signal may land while abort() holds it
_cache: dict[tuple[tuple[str, ...], FlushOptions], Flusher] = {}


class _State:
    flushed_on_signal = False
    said_no_server = False


def _cached_flusher(urls: tuple[str, ...], options: FlushOptions) -> Flusher:
    key = (urls, dataclasses.replace(options, deadline=DEFAULT_DEADLINE))  # the deadline is per call
    with _cache_lock:
        flusher = _cache.get(key)
        if flusher is None or flusher.closed:
            flusher = _cache[key] = Flusher.from_options(urls, key[1])
            while len(_cache) > _CACHE_SIZE:
                _cache.pop(next(iter(_cache))).close()
        return flusher


@atexit.register  # registered at import, so it runs after every exit hook registered later
def _close_cached_flushers() -> None:
    with _cache_lock:
        flushers = list(_cache.values())
        _cache.clear()
    for flusher in flushers:
        flusher.close()


def _after_fork_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.RLock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def _abort_report(args: Any, environ: Mapping[str, str] | None, make_options: Callable[[], FlushOptions],
                  *, on_daemon_threads: bool) -> FlushReport:
    """The report of one abort; never raises, never logs."""
    started = time.monotonic()
    try:
        env = os.environ if environ is None else environ
        options = make_options()
        urls = resolve_server_urls(env)
        if not urls:
            _say_no_server_once(on_daemon_threads)
            return FlushReport(elapsed=time.monotonic() - started)
        ids = resolve_instance_ids(args)
        if not ids:
            return FlushReport(elapsed=time.monotonic() - started)
        if options.admin_secret is None and options.bearer is None:
            options = dataclasses.replace(options, bearer=resolve_bearer(env))
        return _cached_flusher(urls, options).flush_ids(ids, options.deadline, on_daemon_threads=on_daemon_threads)
    except FlushError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - never crash the trainer; the message could hold anything
        error = f"unexpected {type(exc).__name__} while flushing"
    return FlushReport(elapsed=time.monotonic() - started, error=error)


def _say_no_server_once(on_daemon_threads: bool) -> None:
    if _State.said_no_server or on_daemon_threads:
        return
    _State.said_no_server = True
    log.info("abort: no agent server configured (%s unset); nothing is flushed", " and ".join(URL_ENV_VARS))


def abort(
    args: Any,
    *,
    environ: Mapping[str, str] | None = None,
    admin_secret: str | None = None,
    bearer: BearerProvider | None = None,
    deadline: float = DEFAULT_DEADLINE,
    retries: int = DEFAULT_RETRIES,
    max_workers: int | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
    linger: float = DEFAULT_LINGER,
) -> FlushReport:
    """Flush every session-server instance of ``args`` on every agent server; never raises.

    The synchronous twin of the async abort hook: ids from ``args`` (see
    ``resolve_instance_ids``), servers from ``AGENT_SERVER_URL``/``SWE_AGENT_URL`` and the
    bearer from the environment (see ``resolve_bearer``), all read at each call. Every
    (server, id) pair is flushed in parallel within ``deadline`` (10 s by default).

    Unlike ``flush``, it keeps one ``Flusher`` per (servers, options) in a module cache (a
    lock guards it; at most 8 are kept, closed at interpreter exit), so per-step aborts reuse
    warm connections and threads, and a pair still in flight from an earlier step (the
    server is still tearing its trials down) is joined, not sent again.

    Args:
        args: trainer args (attributes) or a Mapping.
        environ: the environment to read instead of ``os.environ``.
        admin_secret, bearer: override the environment's bearer (see ``FlushOptions``).
        deadline, retries, max_workers, connect_timeout, backoff_factor, linger: see
            ``FlushOptions``.

    Returns:
        The ``FlushReport``. No server or no ids: an empty ok report, nothing sent (no server
        configured is said once per process at INFO). A configuration problem (a bad option
        or environment value) is logged as one warning and returned in ``report.error``.

    Example:
        >>> report = abort(args)  # doctest: +SKIP
    """
    make_options = functools.partial(
        FlushOptions, admin_secret=admin_secret, bearer=bearer, deadline=deadline, retries=retries,
        max_workers=max_workers, connect_timeout=connect_timeout, backoff_factor=backoff_factor, linger=linger)
    report = _abort_report(args, environ, make_options, on_daemon_threads=False)
    log_report(report)
    return report


def _off_the_event_loop(function: Callable[P, FlushReport]) -> Callable[P, Coroutine[Any, Any, FlushReport]]:
    """``function`` as a coroutine function with the same typed signature, run in a worker thread."""
    @functools.wraps(function)
    async def run(*args: P.args, **kwargs: P.kwargs) -> FlushReport:
        return await asyncio.to_thread(function, *args, **kwargs)

    return run


abort_async = _off_the_event_loop(abort)
abort_async.__name__ = abort_async.__qualname__ = "abort_async"
abort_async.__doc__ = """``abort`` as a coroutine, run off the event-loop thread so the loop keeps serving.

A drop-in async abort hook (``from swe_flush_sync import abort_async as abort``). Takes
exactly the arguments of ``abort`` (typed: a misspelt one is a ``TypeError``) and returns its
``FlushReport``. Cancelling the awaiting task does not stop the flush, which still ends by its
deadline.

Example:
    >>> report = await abort_async(args, deadline=5)  # doctest: +SKIP
"""


def _hook_flush(args: Any, environ: Mapping[str, str] | None, options: FlushOptions) -> FlushReport:
    """The flush of a signal or exit hook: nothing lingering, nothing logged from a worker."""
    with urllib3_silenced():
        abandon_all_in_flight("given up by the signal or exit hook")
        report = _abort_report(args, environ, lambda: options, on_daemon_threads=True)
    run_bounded(lambda: _log_and_flush_stdio(report), _HOOK_LOG_TIMEOUT)
    return report


def _log_and_flush_stdio(report: FlushReport) -> None:
    log_report(report)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - flushing stdio is best effort
            pass


def _prepare_hook(options: FlushOptions) -> None:
    """Validate the options now (a bad one raises at install), and build the request path
    once, so that nothing is imported lazily when the hook runs."""
    with Flusher.from_options("http://127.0.0.1", options) as flusher:
        flusher.warm_up()


class SignalHook:
    """Installed by ``flush_on_signal``; ``uninstall()`` restores the previous handlers.

    Attributes:
        report: the ``FlushReport`` of the flush the first signal ran, else None.
    """

    def __init__(self, args: Any, signals: tuple[int, ...], environ: Mapping[str, str] | None,
                 options: FlushOptions) -> None:
        self.report: FlushReport | None = None
        self._args = args
        self._environ = environ
        self._options = options
        self._previous: dict[int, Any] = {}
        self._flushing = False
        self._flushed = False
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._flushed:
            if self._flushing:
                return  # a second signal during the flush: the first one hands over
            self._flushing = True
            try:
                self.report = _hook_flush(self._args, self._environ, self._options)
                _State.flushed_on_signal = True
            finally:
                self._flushed = True
                self._flushing = False
        self._hand_over(signum, frame)

    def _hand_over(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
            return
        # SIG_DFL, or a handler not set from Python: die of the signal, as the scheduler expects
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    @property
    def installed(self) -> bool:
        """True while at least one of its handlers is in place."""
        return any(signal.getsignal(signum) == self._handle for signum in self._previous)

    def uninstall(self) -> None:
        """Put back the handlers that were there before (main thread only)."""
        _require_main_thread("SignalHook.uninstall")
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(f"{what} must be called from the main thread: Python runs signal handlers only there")


def flush_on_signal(
    args: Any,
    *,
    signals: Iterable[int] = (signal.SIGTERM,),
    environ: Mapping[str, str] | None = None,
    admin_secret: str | None = None,
    bearer: BearerProvider | None = None,
    deadline: float = DEFAULT_DEADLINE,
    retries: int = DEFAULT_RETRIES,
    max_workers: int | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
) -> SignalHook:
    """On the first of ``signals``, flush every instance of ``args``, then hand over.

    Install it at start-up: ids, servers and bearer are read when the signal arrives. The
    flush gives up requests earlier aborts left in flight, sends every pair again and is
    bounded by ``deadline`` (keep it shorter than the scheduler's grace period). Then the
    handler that was there before takes over: a Python callable is called with ``(signum,
    frame)``; ``SIG_DFL`` is restored and the signal raised again, so the process dies of it
    (exit status -15 / 143 for SIGTERM); ``SIG_IGN`` does nothing more. A signal arriving
    during the flush starts no second flush; later signals only hand over.

    Args:
        args: trainer args (attributes) or a Mapping, read when the signal arrives.
        signals: the signals to hook.
        environ: the environment to read instead of ``os.environ``.
        admin_secret, bearer, deadline, retries, max_workers, connect_timeout,
            backoff_factor: as for ``abort``, validated now.

    Returns:
        A ``SignalHook``; ``.uninstall()`` restores the previous handlers.

    Raises:
        ConfigError: not called from the main thread, or a bad option.

    Example:
        >>> hook = flush_on_signal(args, deadline=20)  # doctest: +SKIP
    """
    _require_main_thread("flush_on_signal")
    options = FlushOptions(admin_secret=admin_secret, bearer=bearer, deadline=deadline, retries=retries,
                           max_workers=max_workers, connect_timeout=connect_timeout, backoff_factor=backoff_factor)
    signal_tuple = tuple(signals)
    if not signal_tuple:
        raise ConfigError("signals must name at least one signal")
    _prepare_hook(options)
    try:
        return SignalHook(args, signal_tuple, environ, options)
    except (ValueError, OSError) as exc:  # not a catchable signal (SIGKILL) or not a signal at all
        raise ConfigError(f"signals: cannot install a handler: {exc}") from None


class ExitHook:
    """Registered by ``flush_at_exit``; ``uninstall()`` unregisters it.

    Attributes:
        report: the ``FlushReport`` of the exit flush, else None.
    """

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: FlushOptions) -> None:
        self.report: FlushReport | None = None
        self._args = args
        self._environ = environ
        self._options = options
        self._done = False
        atexit.register(self._run)

    def _run(self) -> None:
        if self._done or _State.flushed_on_signal:
            return
        self._done = True
        self.report = _hook_flush(self._args, self._environ, self._options)

    def uninstall(self) -> None:
        """Unregister the exit flush."""
        atexit.unregister(self._run)


def flush_at_exit(
    args: Any,
    *,
    environ: Mapping[str, str] | None = None,
    admin_secret: str | None = None,
    bearer: BearerProvider | None = None,
    deadline: float = DEFAULT_DEADLINE,
    retries: int = DEFAULT_RETRIES,
    max_workers: int | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
) -> ExitHook:
    """Flush every instance of ``args`` once at interpreter exit (also after an unhandled error).

    Runs as an ``atexit`` callback. The executor refuses work then, so the pairs run in
    parallel on plain daemon threads (one by one in the calling thread where even those
    cannot start), within ``deadline``. Requests earlier aborts left in flight were given up
    when the main thread ended, so every pair is sent again. Skipped when a
    ``flush_on_signal`` hook already flushed. Not run when the process dies of a signal
    nobody handles, or ``os._exit``.

    Args:
        args: trainer args (attributes) or a Mapping, read at exit.
        environ: the environment to read instead of ``os.environ``.
        admin_secret, bearer, deadline, retries, max_workers, connect_timeout,
            backoff_factor: as for ``abort``, validated now.

    Returns:
        An ``ExitHook``; ``.uninstall()`` unregisters it.

    Raises:
        ConfigError: a bad option.

    Example:
        >>> flush_at_exit(args, deadline=10)  # doctest: +SKIP
    """
    options = FlushOptions(admin_secret=admin_secret, bearer=bearer, deadline=deadline, retries=retries,
                           max_workers=max_workers, connect_timeout=connect_timeout, backoff_factor=backoff_factor)
    _prepare_hook(options)
    return ExitHook(args, environ, options)
