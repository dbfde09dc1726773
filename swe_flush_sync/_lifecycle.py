"""Abort hooks: ``abort`` every rollout step, ``abort_async``, on a signal and at exit.

All of them resolve the ids from trainer ``args`` and the servers and secret from the
environment at the moment they run, and share one cached ``Flusher`` per configuration.
The signal and exit paths run their workers on plain daemon threads: the executor refuses
work at interpreter shutdown, and its locks may be held by the very code a signal interrupted.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any, Final

from ._errors import ConfigError, FlushError
from ._flusher import DEFAULT_DEADLINE, Flusher, check_seconds
from ._report import FlushReport
from ._resolve import resolve_admin_secret, resolve_instance_ids, resolve_server_urls

log = logging.getLogger(__name__)

_CACHE_SIZE: Final = 8
_cache_lock = threading.RLock()  # re-entrant: a signal may land while abort() holds it
_cache: dict[tuple[Any, ...], Flusher] = {}


class _Flags:
    flushed_on_signal = False


def _cached_flusher(urls: tuple[str, ...], secret: str | None, options: dict[str, Any]) -> Flusher:
    key = (urls, secret, tuple(sorted(options.items())))
    with _cache_lock:
        flusher = _cache.get(key)
        if flusher is None or flusher.closed:
            flusher = _cache[key] = _new_flusher(urls, secret, options)
            while len(_cache) > _CACHE_SIZE:
                _cache.pop(next(iter(_cache))).close()
        return flusher


def _new_flusher(urls: tuple[str, ...] | str, secret: str | None, options: Mapping[str, Any]) -> Flusher:
    try:
        return Flusher(urls, admin_secret=secret, **options)
    except TypeError as exc:  # an unknown option name
        raise ConfigError(f"unknown option: {exc}") from None


@atexit.register  # registered at import, so it runs after every exit hook registered later
def _close_cached_flushers() -> None:
    with _cache_lock:
        flushers = list(_cache.values())
        _cache.clear()
    for flusher in flushers:
        flusher.close()


def _run_abort(args: Any, environ: Mapping[str, str] | None, options: Mapping[str, Any],
               *, use_executor: bool) -> FlushReport:
    started = time.monotonic()
    try:
        env = os.environ if environ is None else environ
        urls = resolve_server_urls(env)
        if not urls:
            return FlushReport(elapsed=time.monotonic() - started)
        ids = resolve_instance_ids(args)
        if not ids:
            return FlushReport(elapsed=time.monotonic() - started)
        flusher_options = dict(options)
        secret = flusher_options.pop("admin_secret", None) or resolve_admin_secret(env)
        budget = check_seconds(flusher_options.pop("deadline", DEFAULT_DEADLINE), "deadline")
        flusher = _cached_flusher(urls, secret, flusher_options)
        return flusher._flush_ids(ids, budget, use_executor=use_executor)
    except FlushError as exc:
        error = str(exc)
    except Exception as exc:  # never crash the trainer; the message could hold anything
        error = f"unexpected {type(exc).__name__} while flushing"
    try:
        log.warning("abort did not flush: %s", error)
    except Exception:
        pass
    return FlushReport(elapsed=time.monotonic() - started, error=error)


def abort(args: Any, *, environ: Mapping[str, str] | None = None, **options: Any) -> FlushReport:
    """Flush every session-server instance of ``args`` on every agent server; never raises.

    The synchronous twin of the async abort hook: ids from ``args`` (see
    ``resolve_instance_ids``), servers from ``AGENT_SERVER_URL``/``SWE_AGENT_URL`` and the
    secret from ``HARBOR_ADMIN_SECRET``/``MILES_HARBOR_AUTH_TOKEN``, all read at each call.
    Every (url, id) pair is flushed in parallel within ``deadline`` (10 s by default).

    Unlike ``flush``, it keeps one ``Flusher`` per (urls, secret, options) in a module cache
    (a lock guards it; at most 8 are kept) so per-step aborts reuse warm connections and
    threads; the cache is closed at interpreter exit.

    Args:
        args: trainer args (attributes) or a Mapping.
        environ: the environment to read instead of ``os.environ``.
        **options: ``Flusher`` options; ``admin_secret`` overrides the environment.

    Returns:
        The ``FlushReport``. No URL or no ids: an empty ok report, nothing sent. A
        configuration problem is logged as a warning and returned in ``report.error``.

    Example:
        >>> report = abort(args)  # doctest: +SKIP
    """
    return _run_abort(args, environ, options, use_executor=True)


async def abort_async(args: Any, *, environ: Mapping[str, str] | None = None, **options: Any) -> FlushReport:
    """``abort`` as a coroutine, run off the event-loop thread so the loop keeps serving.

    A drop-in async abort hook. Cancelling the awaiting task does not stop the flush, which
    still ends by its deadline.

    Example:
        >>> report = await abort_async(args, deadline=5)  # doctest: +SKIP
    """
    import asyncio  # already imported wherever a coroutine can run

    return await asyncio.to_thread(_run_abort, args, environ, options, use_executor=True)


def _prepare_hook(options: Mapping[str, Any]) -> None:
    """Validate hook options now (a bad one raises at install). Building the Flusher also
    prepares a request once, so nothing is imported lazily when the hook runs."""
    _new_flusher("http://127.0.0.1", options.get("admin_secret"),
                 {k: v for k, v in options.items() if k != "admin_secret"}).close()


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


class SignalHook:
    """Installed by ``flush_on_signal``; ``uninstall()`` restores the previous handlers.

    Attributes:
        report: the ``FlushReport`` of the flush the first signal ran, else None.
    """

    def __init__(self, args: Any, signals: tuple[int, ...], environ: Mapping[str, str] | None,
                 options: Mapping[str, Any]) -> None:
        self.report: FlushReport | None = None
        self._args = args
        self._environ = environ
        self._options = dict(options)
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
                self.report = _run_abort(self._args, self._environ, self._options, use_executor=False)
                _Flags.flushed_on_signal = True
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
        _flush_stdio()
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


def flush_on_signal(args: Any, *, signals: Iterable[int] = (signal.SIGTERM,),
                    environ: Mapping[str, str] | None = None, **options: Any) -> SignalHook:
    """On the first of ``signals``, flush every instance of ``args``, then hand over.

    Install it at start-up: ids, URLs and secret are read when the signal arrives. The
    flush is bounded by ``deadline`` (keep it shorter than the scheduler's grace period).
    Then the handler that was there before takes over: a Python callable is called with
    ``(signum, frame)``; ``SIG_DFL`` is restored and the signal raised again, so the process
    dies of it (exit status -15 / 143 for SIGTERM); ``SIG_IGN`` does nothing more. A signal
    arriving during the flush starts no second flush; later signals only hand over.

    Args:
        args: trainer args (attributes) or a Mapping, read when the signal arrives.
        signals: the signals to hook.
        environ: the environment to read instead of ``os.environ``.
        **options: ``Flusher`` options, validated now.

    Returns:
        A ``SignalHook``; ``.uninstall()`` restores the previous handlers.

    Raises:
        ConfigError: not called from the main thread, or a bad option.

    Example:
        >>> hook = flush_on_signal(args, deadline=20)  # doctest: +SKIP
    """
    _require_main_thread("flush_on_signal")
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

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: Mapping[str, Any]) -> None:
        self.report: FlushReport | None = None
        self._args = args
        self._environ = environ
        self._options = dict(options)
        self._done = False
        atexit.register(self._run)

    def _run(self) -> None:
        if self._done or _Flags.flushed_on_signal:
            return
        self._done = True
        self.report = _run_abort(self._args, self._environ, self._options, use_executor=False)

    def uninstall(self) -> None:
        """Unregister the exit flush."""
        atexit.unregister(self._run)


def flush_at_exit(args: Any, *, environ: Mapping[str, str] | None = None, **options: Any) -> ExitHook:
    """Flush every instance of ``args`` once at interpreter exit (also after an unhandled error).

    Runs as an ``atexit`` callback. The executor refuses work then, so the pairs run in
    parallel on plain daemon threads (one by one in the calling thread where even those
    cannot start), within ``deadline``. Skipped when a ``flush_on_signal`` hook already
    flushed. Not run when the process dies of a signal nobody handles, or ``os._exit``.

    Args:
        args: trainer args (attributes) or a Mapping, read at exit.
        environ: the environment to read instead of ``os.environ``.
        **options: ``Flusher`` options, validated now.

    Returns:
        An ``ExitHook``; ``.uninstall()`` unregisters it.

    Raises:
        ConfigError: a bad option.

    Example:
        >>> flush_at_exit(args, deadline=10)  # doctest: +SKIP
    """
    _prepare_hook(options)
    return ExitHook(args, environ, options)
