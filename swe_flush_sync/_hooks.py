"""Abort hooks: ``abort`` every rollout step, ``abort_async``, on a signal and at exit.

All of them resolve the ids from trainer ``args`` and the servers and bearer from the
environment at the moment they run, and share one cached ``Flusher`` per configuration (so
a per-step abort joins a request an earlier step left in flight instead of sending it again).
The signal and exit paths give up every lingering request, flush on standby daemon threads
started when the hook was installed, with urllib3's loggers disabled, and log from one of them
within a bounded wait, so neither a logging lock nor a stalled stderr can keep the process from
dying, and Python 3.12 (which starts no thread once the main thread has ended) flushes in parallel.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from ._core.errors import ConfigError, FlushError
from ._core.flusher import Flusher
from ._core.live import abandon_all_in_flight
from ._core.logs import WORKER_THREAD_PREFIX, log_report, logging_set_up, urllib3_silenced
from ._core.options import DEFAULT_DEADLINE, FlushOptions
from ._core.outcome import Outcome
from ._core.report import FlushReport, FlushResult
from ._core.resolve import URL_ENV_VARS, resolve_bearer, resolve_server_list, split_instance_ids
from ._core.threads import Workers, start_daemon_thread
from ._watchdog.api import SEND_TIMEOUT, disarm_flushed, hand_over_to_watchdogs, warn_lost_watchdogs

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._core.options import HookOptionKwargs, OptionKwargs

log = logging.getLogger(__name__)

_CACHE_SIZE: Final = 8
_HOOK_LOG_TIMEOUT: Final = 0.5  # seconds a signal or exit hook waits for its own logging
STANDBY_THREADS: Final = 32  # idle daemon threads kept while a signal or exit hook is installed
# No lock: a signal handler's abort() may run while the interrupted abort() is here. Each step is
# one dict operation; two calls at once may both build a Flusher, and the one not kept is closed.
_cache: dict[tuple[tuple[str, ...], FlushOptions], Flusher] = {}


def register_at_thread_exit(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the main thread ends, before non-daemon threads are joined.

    That is ``threading``'s own exit stage (``threading._register_atexit``, what
    ``concurrent.futures`` uses): it runs before ``atexit`` and before ``concurrent.futures``
    shuts its executors down; later registrations run first. (Python 3.12 starts no thread
    there either: the hooks flush on standby threads.) False where this Python has no such
    stage, or it has begun.
    """
    register: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    try:
        register(callback)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True


# Giving every request up when the main thread ends lets concurrent.futures (imported by
# _core.flusher, so its exit hook runs after this one) join its workers at once.
register_at_thread_exit(abandon_all_in_flight)


class _State:
    flushed_on_signal = False
    said_no_server = False  # warned (``warnings``) once per process
    logged_no_server = False  # logged once per process (each report still says it)


def _cached_flusher(urls: tuple[str, ...], options: FlushOptions) -> Flusher:
    # The deadline and until_idle are per call: one Flusher (and single flight) serves every call.
    key = (urls, dataclasses.replace(options, deadline=DEFAULT_DEADLINE, until_idle=False, ledger=None))
    flusher = _cache.get(key)
    while flusher is None or flusher.closed:
        if flusher is not None and _cache.pop(key, None) not in (flusher, None):
            continue  # (another call put a new one there meanwhile: it is taken below)
        made = Flusher.from_options(urls, key[1])
        flusher = _cache.setdefault(key, made)
        if flusher is not made:
            made.close()  # nothing of it started
    while len(_cache) > _CACHE_SIZE:
        with contextlib.suppress(StopIteration, RuntimeError, KeyError):
            _cache.pop(next(iter(_cache))).close()
    return flusher


@atexit.register  # registered at import, so it runs after every exit hook registered later
def _close_cached_flushers() -> None:
    flushers = list(_cache.values())
    _cache.clear()
    for flusher in flushers:
        flusher.close()


def _after_fork_in_child() -> None:
    _standby.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Standby(Workers):
    """Daemon threads that exist while a signal or exit hook is installed, idle until it fires.

    Python 3.12 starts no thread once the main thread has ended (not even in ``threading``'s exit
    stage): these exist already. They are ``Workers`` like a Flusher's own (the one way a flush runs),
    with more started when a flush needs them and threads can start. Each hook holds them from its
    install until it is uninstalled or has fired; when the last lets go, they end (a hook installed
    later starts them again).
    """

    def __init__(self) -> None:
        super().__init__(f"{WORKER_THREAD_PREFIX}-standby", STANDBY_THREADS, numbered=False)
        self._holders = 0

    def hold(self, count: int) -> None:
        """A hook is installed: keep ``count`` threads while it holds them."""
        self._holders += 1
        self.keep(count)

    def release(self) -> None:
        """A hook is uninstalled or has fired; the threads end with the last holder."""
        self._holders = max(self._holders - 1, 0)
        if not self._holders:
            self.let_go()

    def run_bounded(self, action: Callable[[], None], timeout: float) -> None:
        """Run ``action`` on a standby thread and wait at most ``timeout`` seconds (skipped with none).

        For the hooks' own logging: a handler lock held by the interrupted code, or for ever by
        another thread (a stalled stderr pipe), must not keep the process from dying.
        """
        if self.threads:
            outcome: Outcome[None] = Outcome()
            self.run(outcome, action)
            with contextlib.suppress(TimeoutError):
                outcome.result(timeout)

    def forget_after_fork(self) -> None:
        """In a forked child the parent's threads are gone, and so are its hooks' holds: the hooks a
        child inherits flush nothing there (a hook the child installs holds threads anew)."""
        super().forget_after_fork()
        self._holders = 0


_standby = _Standby()


def _abort_report(args: Any, environ: Mapping[str, str] | None, options: FlushOptions,
                  *, hook: bool) -> FlushReport:
    """The report of one abort; never raises, never logs. ``hook``: a signal or exit hook (standby threads)."""
    started = time.monotonic()
    # First: a death during this flush leaves the watchdog the ids. Its wait takes at most half the
    # deadline; a watchdog that ended is armed again beside the flush, never before it.
    hand_over_to_watchdogs(args, rearm=not hook, patience=min(SEND_TIMEOUT, options.deadline / 2))
    try:
        env = os.environ if environ is None else environ
        urls, skipped = resolve_server_list(env)  # a bad entry of a list stops only itself
        if not urls and not skipped:  # ids to flush and nowhere to send them: a misconfiguration, never ok
            given = _ids_without_server(args, env)
            if given:
                _warn_no_server_once(given, hook)
            return FlushReport(elapsed=time.monotonic() - started, error=_no_server(given) if given else None)
        ids, bad = split_instance_ids(args)  # an id that is not a str fails alone: the others are flushed
        if not ids and not bad:
            return FlushReport(elapsed=time.monotonic() - started)
        if options.admin_secret is None and options.bearer is None:
            options = dataclasses.replace(options, bearer=resolve_bearer(env))
        budget = max(options.deadline - (time.monotonic() - started), 0.001)  # the deadline counts from the call
        report = _cached_flusher(urls, options)._flush_ids(ids, budget, until_idle=options.until_idle,
                                                           workers=_standby if hook else None) if urls and ids \
            else FlushReport(elapsed=time.monotonic() - started)
        if bad:
            report = dataclasses.replace(report, results=report.results + tuple(
                FlushResult(url, bad_id.value, ok=False, error=bad_id.why()) for url in urls for bad_id in bad))
        if skipped:  # flushed on the good servers; never ok, and saying which entry was skipped
            report = dataclasses.replace(report, error="skipped " + "; ".join(skipped))
        return report
    except FlushError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - the "never raises" boundary; the message could hold anything
        error = f"unexpected {type(exc).__name__} while flushing"
    return FlushReport(elapsed=time.monotonic() - started, error=error)


_NO_SERVER: Final = "but no agent server configured"


def _no_server(ids: int, then: str = "nothing was flushed") -> str:
    return f"{ids} instance id(s) in args {_NO_SERVER} ({' and '.join(URL_ENV_VARS)} unset): {then}"


def _ids_without_server(args: Any, env: Mapping[str, str]) -> int:
    """How many ids ``args`` holds when no agent server is configured (0 when one is, or none is held)."""
    with contextlib.suppress(FlushError):
        urls, skipped = resolve_server_list(env)
        if not urls and not skipped:
            return sum(map(len, split_instance_ids(args)))
    return 0


def _says_no_server(report: FlushReport) -> bool:
    return not report.results and _NO_SERVER in (report.error or "")


def _log_report_once_if_no_server(report: FlushReport) -> None:
    """Log the report; one that says no server is configured, once per process (50 steps: one line)."""
    if _says_no_server(report):
        if _State.logged_no_server:
            return
        _State.logged_no_server = True
    log_report(report)


def _warn_if_no_server(args: Any, environ: Mapping[str, str] | None, hook: str) -> None:
    """A hook installed with ids and no server: said once on stderr now (as ``abort`` says it)."""
    given = _ids_without_server(args, os.environ if environ is None else environ)
    if given:
        with contextlib.suppress(Warning):  # "-W error": installing still never raises for it
            warnings.warn(f"{hook}: {_no_server(given, 'unless one is set by then, the hook will flush nothing')}",
                          UserWarning, stacklevel=3)


def _warn_no_server_once(ids: int, hook: bool) -> None:
    """Ids to flush but nowhere to send them (the report's error says it too): also said once per
    process with ``warnings.warn``, which reaches stderr with no logging set up. Never from a hook."""
    if _State.said_no_server or hook:
        return
    _State.said_no_server = True
    with contextlib.suppress(Warning):  # "-W error" makes it an exception: abort still never raises
        warnings.warn(f"abort: {_no_server(ids)}", UserWarning, stacklevel=4)


def abort(args: Any, *, environ: Mapping[str, str] | None = None, **options: Unpack[OptionKwargs]) -> FlushReport:
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
        **options: the keyword options of ``FlushOptions`` (``deadline``, ``until_idle``,
            ``admin_secret``/``bearer`` to override the environment's bearer, ...).

    Returns:
        The ``FlushReport``. No ids: an empty ok report, nothing sent. Ids but no server: nothing
        sent, and ``report.error`` says so (so ``ok`` is False; also said once per process with
        ``warnings.warn``, and logged once). An id that is not a str is a failed result naming
        where it was (``session_server_instance_ids['8002'] is an int``); the others are flushed.
        A bad entry in the servers' list is skipped and named in ``report.error`` (``ok`` False);
        the good servers are flushed. A configuration problem (a bad option or environment value)
        is logged as one warning and returned in ``report.error``.

    Raises:
        TypeError: a misspelt option (at the call, like any misspelt keyword).

    Examples:
        ```python
        report = abort(args)
        ```
    """
    try:
        flush_options = FlushOptions(**options)
    except ConfigError as exc:
        report = FlushReport(error=str(exc))
    else:
        report = _abort_report(args, environ, flush_options, hook=False)
    _State.flushed_on_signal = False  # the trainer goes on after a signal: its exit is not covered by that flush
    _log_report_once_if_no_server(report)
    warn_lost_watchdogs()
    return report


async def abort_async(args: Any, *, environ: Mapping[str, str] | None = None,
                      **options: Unpack[OptionKwargs]) -> FlushReport:
    """``abort`` as a coroutine, run off the event-loop thread so the loop keeps serving.

    A drop-in async abort hook (``from swe_flush_sync import abort_async as abort``). Takes
    exactly the arguments of ``abort`` and returns its ``FlushReport``. Cancelling the awaiting
    task does not stop the flush, which still ends by its deadline. It runs on the library's own
    threads, not the loop's default executor (whose ``submit`` holds a lock a signal handler's
    flush could wait on for ever).

    Examples:
        ```python
        report = await abort_async(args, deadline=5)
        ```
    """
    import asyncio  # loaded already wherever a coroutine runs; not paid by sync trainers

    done: Future[FlushReport] = Future()

    def run() -> None:  # on a thread of its own, which ends with the call
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(abort(args, environ=environ, **options))
            except BaseException as exc:  # noqa: BLE001 - a misspelt option: raised where it is awaited
                done.set_exception(exc)

    try:
        start_daemon_thread(run, name=f"{WORKER_THREAD_PREFIX}-async")
    except RuntimeError:  # no thread can start (interpreter shutdown, a pids limit): here, within the deadline
        run()
    return await asyncio.wrap_future(done)


def _hook_flush(args: Any, environ: Mapping[str, str] | None, options: FlushOptions) -> FlushReport:
    """The flush of a signal or exit hook: nothing lingering, nothing logged from a worker."""
    with urllib3_silenced():
        abandon_all_in_flight("given up by the signal or exit hook")
        report = _abort_report(args, environ, options, hook=True)
    _standby.run_bounded(lambda: _log_and_flush_stdio(report), _HOOK_LOG_TIMEOUT)
    return report


def _log_and_flush_stdio(report: FlushReport) -> None:
    log_report(report)
    if _says_no_server(report) and not logging_set_up():  # the one line a hook says with no logging set up
        with contextlib.suppress(Exception):
            if sys.stderr is not None:
                sys.stderr.write(f"swe_flush_sync: the signal or exit hook flushed nothing: {report.error}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - flushing stdio is best effort
            pass


def _prepare_hook(options: FlushOptions) -> None:
    """Build the request path once, so that nothing is imported lazily when the hook runs, and
    start the standby threads it will flush on (held until the hook is uninstalled or has fired)."""
    with Flusher.from_options("http://127.0.0.1", options) as flusher:
        flusher.warm_up()
    _standby.hold(min(options.workers, STANDBY_THREADS))


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
        self._holding = True  # the standby threads, held since flush_on_signal started them
        self._pid = os.getpid()  # the process it belongs to: a forked child inherits it, and it flushes nothing there
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        if not register_at_thread_exit(self._disarm_at_exit):
            atexit.register(self._disarm_at_exit)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child (a data loader): the parent's ids are not its to flush
            self._hand_over(signum, frame)
            return
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
                self._let_go()
        self._hand_over(signum, frame)

    def _let_go(self) -> None:
        if self._holding and os.getpid() == self._pid:
            self._holding = False
            _standby.release()

    def _hand_over(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
            return
        # SIG_DFL, or a handler not set from Python: die of the signal, as the scheduler expects
        if self.report is not None and os.getpid() == self._pid:
            disarm_flushed(self.report)  # the process ends now: the watchdog must not flush these pairs again
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def _disarm_at_exit(self) -> None:
        """The process survived the signal (a graceful-stop handler, ``SIG_IGN``) and now ends: the
        watchdog, kept armed meanwhile for a SIGKILL at the end of a grace period, need not flush the
        pairs the signal flushed, unless an ``abort`` since says the trainer went on."""
        if self.report is not None and _State.flushed_on_signal and os.getpid() == self._pid:
            disarm_flushed(self.report)

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
        self._let_go()


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(f"{what} must be called from the main thread: Python runs signal handlers only there")


def flush_on_signal(args: Any, *, signals: Iterable[int] = (signal.SIGTERM,), environ: Mapping[str, str] | None = None,
                    **options: Unpack[HookOptionKwargs]) -> SignalHook:
    """On the first of ``signals``, flush every instance of ``args``, then hand over.

    Install it at start-up: ids, servers and bearer are read when the signal arrives. The
    flush gives up requests earlier aborts left in flight, sends every pair again, flushes until
    idle by default (the trainer is ending: runs still waiting for a slot must not start after
    it) and is bounded by ``deadline`` (keep it shorter than the scheduler's grace period). Then the
    handler that was there before takes over: a Python callable is called with ``(signum,
    frame)``; ``SIG_DFL`` is restored and the signal raised again, so the process dies of it
    (exit status -15 / 143 for SIGTERM); ``SIG_IGN`` does nothing more. A signal arriving
    during the flush starts no second flush; later signals only hand over.

    Args:
        args: trainer args (attributes) or a Mapping, read when the signal arrives.
        signals: the signals to hook.
        environ: the environment to read instead of ``os.environ``.
        **options: as for ``abort`` but ``linger`` (nothing lingers past a signal), validated now;
            ``until_idle`` defaults to True here (``until_idle=False``: one pass).

    Returns:
        A ``SignalHook``; ``.uninstall()`` restores the previous handlers.

    Raises:
        ConfigError: not called from the main thread, or a bad option.

    Examples:
        ```python
        hook = flush_on_signal(args, deadline=20)
        ```
    """
    _require_main_thread("flush_on_signal")
    options.setdefault("until_idle", True)  # the trainer is ending: nothing queued may start after it
    flush_options = FlushOptions(**options, linger=0.0)  # nothing lingers past a signal
    signal_tuple = tuple(signals)
    if not signal_tuple:
        raise ConfigError("signals must name at least one signal")
    _prepare_hook(flush_options)
    try:
        hook = SignalHook(args, signal_tuple, environ, flush_options)
    except (ValueError, OSError) as exc:  # not a catchable signal (SIGKILL) or not a signal at all
        _standby.release()
        raise ConfigError(f"signals: cannot install a handler: {exc}") from None
    _warn_if_no_server(args, environ, "flush_on_signal")
    return hook


class ExitHook:
    """Registered by ``flush_at_exit``; ``uninstall()`` turns it off.

    Attributes:
        report: the ``FlushReport`` of the exit flush, else None.
    """

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: FlushOptions) -> None:
        self.report: FlushReport | None = None
        self._args = args
        self._environ = environ
        self._options = options
        self._done = False
        self._pid = os.getpid()  # the process it belongs to: a forked child's exit flushes nothing
        # When the main thread ends, before atexit and before the program's non-daemon threads are joined.
        self._at_thread_exit = register_at_thread_exit(self._run)
        if not self._at_thread_exit:
            atexit.register(self._run)

    def _run(self) -> None:
        if self._done or _State.flushed_on_signal or os.getpid() != self._pid:
            return
        self._done = True
        self.report = _hook_flush(self._args, self._environ, self._options)
        disarm_flushed(self.report)  # the process is ending: the watchdog must not flush these pairs again
        _standby.release()

    def uninstall(self) -> None:
        """Turn the exit flush off (idempotent)."""
        if not self._done:
            self._done = True
            if os.getpid() == self._pid:
                _standby.release()
        if not self._at_thread_exit:
            atexit.unregister(self._run)


def flush_at_exit(args: Any, *, environ: Mapping[str, str] | None = None,
                  **options: Unpack[HookOptionKwargs]) -> ExitHook:
    """Flush every instance of ``args`` once at interpreter exit (also after an unhandled error).

    Runs when the main thread ends (normal return, ``sys.exit``, an unhandled exception), in
    ``threading``'s own exit stage: before ``atexit`` callbacks and before the program's other
    non-daemon threads are joined. Python 3.12 starts no new thread there ("can't create new
    thread at interpreter shutdown"), so the pairs run in parallel within ``deadline`` on
    standby daemon threads started when the hook was installed (one by one in the calling thread
    only where no thread could ever start). Requests earlier aborts left in flight are given
    up first, so every pair is sent again, until idle by default (the trainer is ending: runs
    still waiting for a slot must not start after it). Skipped when a ``flush_on_signal`` hook
    already flushed. Not run when the process dies of a signal nobody handles, or ``os._exit``.

    Args:
        args: trainer args (attributes) or a Mapping, read at exit.
        environ: the environment to read instead of ``os.environ``.
        **options: as for ``abort`` but ``linger``, validated now; ``until_idle`` defaults to True
            here (``until_idle=False``: one pass).

    Returns:
        An ``ExitHook``; ``.uninstall()`` turns it off.

    Raises:
        ConfigError: a bad option.

    Examples:
        ```python
        flush_at_exit(args, deadline=10)
        ```
    """
    options.setdefault("until_idle", True)  # the trainer is ending: nothing queued may start after it
    flush_options = FlushOptions(**options, linger=0.0)  # nothing lingers past the exit
    _prepare_hook(flush_options)
    _warn_if_no_server(args, environ, "flush_at_exit")
    return ExitHook(args, environ, flush_options)
