"""``watchdog``: a process that flushes the trainer's ids when the trainer dies, however it dies.

The trainer's side: a ``Watchdog`` hands the servers, ids and bearers to a watchdog process
(``_process.watchdog_process``) or a ``swe-flush guard``, and again when they change (``refresh``, ``abort``).
It is a facade over a ``Link`` (the line protocol; ``link`` has the threading rules) and
an ``End`` (what differs between a process and a guard: ``ends``). The exit and signal
hooks disarm the watchdogs whose pairs they flushed, so each pair is flushed once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from .._core.errors import ConfigError, FlushError
from .._core.options import FlushOptions
from .._core.resolve import URL_ENV_VARS, resolve_bearer, resolve_instance_ids, resolve_server_urls
from .._core.text import shown
from .._core.threads import start_daemon_thread
from .._process.record import DEFAULT_HEARTBEAT
from .._process.trust import directory_problem
from .._process.wire import LEDGER, MAX_IDS, MAX_SOCKET_PATH, MAX_STATE_BYTES, encode_state, shape_problem
from . import link as link_module
from .ends import ARM_TIMEOUT, GUARD_ENV_VAR, SEND_TIMEOUT, End, GuardEnd, ProcessEnd, unsaid
from .link import Link

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._core.options import HookOptionKwargs
    from .._core.report import FlushReport

__all__ = ["ARM_TIMEOUT", "GUARD_ENV_VAR", "LEDGER_ENV_VAR", "SEND_TIMEOUT", "Watchdog", "watchdog"]

log = logging.getLogger(__name__)

LEDGER_ENV_VAR: Final = "SWE_FLUSH_LEDGER"
_watchdogs: list[Watchdog] = []  # every watchdog not disarmed, lost ones included (abort re-arms them)
_arming = threading.RLock()  # held by watchdog() (re-entrant: a signal handler may arm meanwhile)


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a watchdog's state comes from: the trainer's args, the environment and the options."""

    args: Any
    environ: Mapping[str, str] | None
    options: FlushOptions
    ledger: str | None
    token: str  # names this trainer to a guard across reconnects and restarts

    def state(self, *, lock: bool, last: bytes) -> tuple[bytes, frozenset[tuple[str, str]]]:
        """The state to hand over and its pairs (``last``, the state last queued, is not checked again).
        Runs user code: call it with no lock held."""
        env = os.environ if self.environ is None else self.environ
        urls = resolve_server_urls(env)
        ids = resolve_instance_ids(self.args)
        provider = self.options.bearer_provider or resolve_bearer(env)
        tokens = None if provider is None else _tokens(provider, ids)
        options = self.options
        if len(ids) > MAX_IDS:
            raise ConfigError(f"watchdog: {len(ids)} ids; a watchdog holds at most {MAX_IDS}")
        state = {
            "urls": urls, "ids": ids, "tokens": tokens, "ledger": self.ledger, "heartbeat": DEFAULT_HEARTBEAT,
            "trainer": self.token, "pid": os.getpid(), "host": socket.gethostname(), "lock_fd": lock,
            "sys_path": [os.path.abspath(path) for path in sys.path],
            "options": {"deadline": options.deadline, "retries": options.retries, "max_workers": options.max_workers,
                        "connect_timeout": options.connect_timeout, "backoff_factor": options.backoff_factor,
                        "until_idle": options.until_idle, "ca_bundle": _absolute(options.ca_bundle),
                        "client_cert": _absolute(options.client_cert)},  # paths: the watchdog runs in /
        }
        payload = encode_state(state)
        if len(payload) > MAX_STATE_BYTES:
            raise ConfigError(f"watchdog: {len(ids)} ids make a state over {MAX_STATE_BYTES} bytes")
        if payload != last:
            problem = shape_problem(payload)
            if problem is not None:
                raise ConfigError(f"watchdog: the state would be {problem}")
        return payload, frozenset((url, instance_id) for url in urls for instance_id in ids)


class Watchdog:
    """A watchdog process armed by ``watchdog()`` for one trainer ``args``.

    Attributes:
        ledger: the ledger directory its record is kept in, or None.
        guard: the guard's socket path when the watchdog is a ``swe-flush guard``, else None.
    """

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: FlushOptions,
                 ledger: str | None, guard: str | None = None) -> None:
        self.guard = guard
        self.ledger = ledger
        self._ledger_error: str | None = None
        self._starting = False  # _start runs (a signal handler's abort meanwhile must not start another)
        self._rearming = False  # a thread re-arms it beside the flushes (see rearm_beside)
        self._source = _Source(args, environ, options, ledger, secrets.token_hex(16))
        self._link = Link(self._hear)
        self._end: End = ProcessEnd(self._link) if guard is None else GuardEnd(self._link, guard, self._source.token)

    @property
    def args(self) -> Any:
        """The trainer args whose ids it holds."""
        return self._source.args

    @property
    def pid(self) -> int:
        """The watchdog process's id (a re-armed watchdog has a new one); through a guard, the guard's."""
        return self._link.pid

    @property
    def ledger_error(self) -> str | None:
        """Why the watchdog last failed to write its ledger record (a full volume, the directory
        removed), None while it writes it; it keeps retrying every heartbeat."""
        return self._ledger_error

    @property
    def pairs(self) -> frozenset[tuple[str, str]]:
        """The (server, id) pairs of the state last handed over."""
        return self._link.pairs

    @property
    def linked(self) -> bool:
        """True while the watchdog process lives (or the guard's connection is open), armed or not."""
        with link_module.LOCK:
            return self._link.talk()

    @property
    def lock_held(self) -> bool:
        """True while this trainer holds the liveness lock its guard passed it: its death is then
        proven by the kernel at once, also across a restart of the guard. False for a local watchdog
        process, or when that lock did not arrive (no free descriptor) or other code closed it: the
        guard then judges the trainer by its pid and heartbeat (``watchdog`` warns)."""
        with link_module.LOCK:
            newest = self._link.locks.newest
            return self._end.wants_lock and newest is not None and newest.ours()

    @property
    def armed(self) -> bool:
        """True while the watchdog process lives and has said it holds the newest state whole."""
        with link_module.LOCK:
            return self._link.talk() and self._link.caught_up

    def refresh(self) -> bool:
        """Read the ids (and servers and bearers) again and hand them over if they changed, or if the
        last state could not be handed over whole (a stopped watchdog). Waits up to half a second for
        room in the pipe and the watchdog's word, but only while the watchdog reads its pipe.

        Returns:
            True when a new state was handed over and the watchdog said it holds it whole; False
            when nothing changed, it could not be confirmed yet (the next call goes on), or the
            watchdog is no longer armed.

        Raises:
            ConfigError: ``args`` or the environment holds a bad value.
            FlushError: the guard refused this state (the message says why), or handing it over
                failed in an unexpected way (the message names the exception).
        """
        try:
            return self._refresh(SEND_TIMEOUT)
        except (ConfigError, FlushError):
            raise
        except Exception as exc:  # the documented contract: nothing else reaches the caller
            raise FlushError(f"the watchdog could not be handed the state: unexpected {type(exc).__name__}") from exc

    def _refresh(self, patience: float) -> bool:
        """``refresh``, waiting at most ``patience`` seconds for the watchdog (or to reach the guard again)."""
        link = self._link
        payload, pairs = self._source.state(lock=self._end.wants_lock, last=link.payload)  # user code
        written, held = link.written, link.held
        if not link.retired:
            self._end.before_refresh(payload, patience)
        with link_module.LOCK:
            if not link.talk():
                return False
            caught_up = link.caught_up
            if payload != link.payload:
                link.queue(payload, pairs)
            elif caught_up:
                return link.held > held  # confirmed just now, else nothing new
            # Wait only for a watchdog that reads (it confirmed its last state, or one since the last
            # call, or took more of a long one) and is not stopped: a stopped one costs each step
            # nothing (its pipe buffer taking a write is not a sign that it reads).
            reading = (caught_up or link.written > written or link.held > held) and not self._end.stopped()
        confirmed = link.confirm(patience if reading else 0.0)
        self._end.after_refresh(payload)
        return confirmed

    def rearm(self) -> None:
        """Arm again a watchdog that ended (``abort`` calls it): a new process, at most once a minute
        after a failure, or one more try to reach the guard (a thread retries every 0.1 s meanwhile).
        Nothing while it is linked or being armed (by another thread, or by this one under a signal
        handler). Never raises: what happened is said at the next ``abort``."""
        if not _arming.acquire(blocking=False):
            return
        try:
            if not self._starting and not self.linked:
                self._end.rearm(self._start)
        finally:
            _arming.release()

    def rearm_beside(self) -> None:
        """``rearm`` on a thread of its own, so that no flush waits for a new watchdog to start; what
        happened is said at the next ``abort``. Nothing while a thread of it still runs."""
        if self._rearming:
            return
        self._rearming = True

        def rearming() -> None:
            try:
                self.rearm()
            finally:
                self._rearming = False

        try:
            start_daemon_thread(rearming, name="swe-flush-rearm")
        except RuntimeError:  # no thread can start (interpreter shutdown, a pids limit): a later abort tries
            self._rearming = False

    def disarm(self) -> None:
        """Let the watchdog exit without flushing (within a second); its ledger record is removed.

        Idempotent. Call it when the trainer has flushed everything itself. A watchdog that does
        not read its pipe (stopped, hung) is killed instead, and its ledger record stays (a guard is
        never killed: it gets half a second to read the disarm).
        """
        link = self._link
        with link_module.LOCK:
            link.retired = True
            self._end.retire()
            if self in _watchdogs:
                _watchdogs.remove(self)
            if not link.open:  # no guard answers: the locks say the disarm (a successor flushes nothing)
                link.release_lock()
                return
            link.queue_disarm()
            busy = link.talk() and link.unwritten
        if busy:
            self._end.settle_disarm()  # no lock held: a busy guard gets a moment
        with link_module.LOCK:
            link.close()
        self._end.release()

    def _hear(self, word: bytes, rest: bytes) -> None:
        """Take a word the watchdog said besides ``held`` and ``refused`` (``LOCK`` held)."""
        if word == LEDGER:
            error = None if rest == b"ok" else rest.decode("utf-8", "replace")
            if error is not None and error != self._ledger_error:
                unsaid.append(f"the watchdog (pid {self.pid}) cannot write its ledger record in "
                              f"{shown(self.ledger or '')}: {shown(error)}; recover() elsewhere may take this "
                              "trainer for gone (it keeps trying every heartbeat)")
            self._ledger_error = error

    def _start(self, patience: float | None = None) -> None:
        """Open the link, hand over the state and wait up to ``patience`` until it is held; or raise."""
        patience = ARM_TIMEOUT if patience is None else patience
        started = time.monotonic()
        self._starting = True
        try:
            self._end.prepare()
            payload, pairs = self._source.state(lock=self._end.wants_lock, last=self._link.payload)
            while True:
                process = self._end.open(max(started + patience - time.monotonic(), 0.0))
                with link_module.LOCK:
                    if not self._link.retired:
                        self._link.queue(payload, pairs)
                held = not self._link.retired and self._link.confirm(max(started + patience - time.monotonic(), 0.0))
                with link_module.LOCK:  # a guard that went away before it held the state (mid-hand-over)
                    again = (not held and not self._link.retired and not self._link.open and self._end.reconnects
                             and self._link.refused is None and time.monotonic() < started + patience)
                if not again:
                    break
            self._end.opened(held, process, payload, time.monotonic() - started,
                             max(started + patience - time.monotonic(), 0.0))
            if self._link.lock_missing:  # the guard's lock did not arrive: the state says it holds none
                self._refresh(max(started + patience - time.monotonic(), SEND_TIMEOUT))
        except BaseException:
            self._end.release()
            raise
        finally:
            self._starting = False
        if self._link.retired:  # disarmed meanwhile (a hook, another thread): nothing of it stays
            with link_module.LOCK:
                self._link.close()
            self._end.release()

    def __repr__(self) -> str:
        held = f", lock_held={self.lock_held}" if self.guard is not None else ""
        return f"Watchdog(pid={self.pid}, armed={self.armed}{held}, ledger={self.ledger!r})"


def _absolute(paths: str | tuple[str, str] | None) -> str | list[str] | None:
    if paths is None:
        return None
    return os.path.abspath(paths) if isinstance(paths, str) else [os.path.abspath(path) for path in paths]


def _tokens(provider: Any, ids: tuple[str, ...]) -> dict[str, str]:
    """Each id's bearer token; an id whose provider refuses it gets none (that pair fails at the flush)."""
    tokens: dict[str, str] = {}
    for instance_id in ids:
        try:
            tokens[instance_id] = provider(instance_id)
        except Exception:  # noqa: BLE001 - a user's provider; the flush reports the pair as failed
            continue
    return tokens


def _ledger_folder(ledger: str | None, environ: Mapping[str, str]) -> str | None:
    """The ledger directory (argument, else ``SWE_FLUSH_LEDGER``), made 0700 if missing; or None."""
    folder = ledger if ledger is not None else (environ.get(LEDGER_ENV_VAR) or "").strip() or None
    if folder is None:
        return None
    source = "ledger" if ledger is not None else LEDGER_ENV_VAR
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot create the directory: {exc.strerror or exc}") from None
    problem = directory_problem(folder)
    if problem is not None:
        raise ConfigError(f"{source}: the directory {problem}; recover() would not trust its records "
                          "(make it owned by this user and writable by no one else)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{source}: the directory is not writable")
    return os.path.abspath(folder)


def watchdog(args: Any, *, guard: str | None = None, environ: Mapping[str, str] | None = None,
             **options: Unpack[HookOptionKwargs]) -> Watchdog:
    """Arm a watchdog that flushes every instance of ``args`` when this process ends.

    However the trainer ends (SIGKILL, the OOM killer, a segfault, ``os._exit``, an exception, a
    normal exit, Ctrl-C, a Ray actor's death), the watchdog sees the end-of-file of a pipe only
    this process writes, flushes the last ids it was handed (every server in parallel, within
    ``deadline``, until idle by default), writes one summary line to the stderr it inherited and
    exits: at most ``deadline`` plus about a second after the trainer. It runs in its own session
    (a double fork), ignores SIGINT, SIGTERM and SIGHUP, and uses no CPU while it waits.

    With ``guard`` (or ``SWE_FLUSH_GUARD``), the watchdog is a ``swe-flush guard`` outside the
    container, reached over its Unix socket: the end of this connection flushes, so a death that
    takes the whole container (PID 1 dying, a group OOM kill) is covered too. Arming waits up to
    10 s for the socket. Before it sends anything, the trainer checks who listens there
    (``SO_PEERCRED``): only a guard of this uid or root is trusted. If the guard goes away,
    ``armed`` turns False, and a daemon thread reconnects as soon as its socket is back (it
    tries every 0.1 s) and hands the last state over again. A guard asked for never falls back
    to a local process.

    Servers and bearers are read from ``environ`` like ``abort`` does; the ids from ``args``.
    Hand changed ids over with ``Watchdog.refresh()`` or any ``abort(args)`` (the same ``args``
    object). Secrets travel over the pipe or socket, never on a command line.

    Args:
        args: trainer args (attributes) or a Mapping; the same object for ``abort`` and the hooks.
        guard: the socket path of a ``swe-flush guard`` (default ``SWE_FLUSH_GUARD``; unset: a
            local watchdog process).
        environ: the environment to read instead of ``os.environ``.
        **options: as for ``abort`` but ``linger``; ``until_idle`` defaults to True here.
            ``ledger``: a directory (default ``SWE_FLUSH_LEDGER``) where a local watchdog keeps a
            record of the ids for ``recover()`` (a guard keeps records in its own ``--ledger``).

    Returns:
        The armed ``Watchdog``; the same one when called again for the same ``args`` (from any
        thread: one watchdog per ``args``; one that has not confirmed its state yet is handed it;
        from a signal handler while this thread arms it, as it is).

    Raises:
        ConfigError: a bad option, bad ``args``, a bad ``guard`` path, no agent server configured,
            or more than 100,000 ids.
        FlushError: the watchdog process could not be started; no guard answered in 10 s; the
            socket is served by another uid (nothing was sent); the guard refused the state
            (the message says why) or speaks an older protocol.

    Examples:
        ```python
        dog = watchdog(args, deadline=30)
        ```
    """
    options.setdefault("until_idle", True)
    flush_options = FlushOptions(**options, linger=0.0)
    env = os.environ if environ is None else environ
    if not resolve_server_urls(env):
        raise ConfigError(f"watchdog: no agent server configured ({' and '.join(URL_ENV_VARS)} unset)")
    socket_path = _guard_path(guard, env)
    ledger = None if socket_path is not None else _ledger_folder(flush_options.ledger, env)
    with _arming:  # one arming at a time: two threads arming one args never start two watchdogs
        with link_module.LOCK:
            known = [dog for dog in _watchdogs if dog.args is args]
            keeper = known[0] if known else Watchdog(args, environ, flush_options, ledger, socket_path)
            if not known:
                _watchdogs.append(keeper)  # before it starts: a signal hook meanwhile can disarm it
        if known and keeper._starting:  # a signal handler while this thread arms it
            return keeper
        if known and keeper.linked:  # armed, or not confirming now (stopped, busy): never a second one
            if not keeper.armed:
                keeper.refresh()
            return keeper
        try:
            keeper._start()
        except BaseException:
            with link_module.LOCK:
                if keeper in _watchdogs:
                    _watchdogs.remove(keeper)
            raise
        if keeper._link.lock_missing:
            with contextlib.suppress(Warning):  # "-W error": arming still never raises for it
                warnings.warn(f"watchdog: armed with the guard at {shown(socket_path or '')}, but the lock it passed "
                              "did not arrive (no free descriptor: raise RLIMIT_NOFILE): this trainer is judged by "
                              "its pid and heartbeat, and a guard restarted while it is stopped may take it for dead",
                              UserWarning, stacklevel=2)
        return keeper


def _guard_path(guard: str | None, environ: Mapping[str, str]) -> str | None:
    """The guard's socket path (argument, else ``SWE_FLUSH_GUARD``), checked; None for a local watchdog."""
    path = guard if guard is not None else (environ.get(GUARD_ENV_VAR) or "").strip() or None
    if path is None:
        return None
    source = "guard" if guard is not None else GUARD_ENV_VAR
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ConfigError(f"{source} must be a socket path (a non-empty str)")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"{source}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes")
    return path


def hand_over_to_watchdogs(args: Any, *, rearm: bool = True, patience: float = SEND_TIMEOUT) -> None:
    """Hand the ids of ``args`` to its watchdogs, waiting at most ``patience`` seconds for each
    (``rearm``: re-arm ended ones, on a thread beside the caller); never raises."""
    try:
        _refresh_watchdogs(args, rearm, patience)
    except FlushError as exc:  # a watchdog's trouble never costs the flush
        unsaid.append(f"the watchdog was not handed this trainer's ids: {exc}")
    except Exception as exc:  # noqa: BLE001 - as above; the message of an unexpected error could hold anything
        unsaid.append(f"the watchdog was not handed this trainer's ids: unexpected {type(exc).__name__}")


def _refresh_watchdogs(args: Any, rearm: bool, patience: float) -> None:
    with link_module.LOCK:
        mine = [(dog, dog.linked) for dog in _watchdogs if dog.args is args]
    for dog, linked in mine:
        if linked:
            dog._refresh(patience)
        elif rearm:
            dog.rearm_beside()


def warn_lost_watchdogs() -> None:
    """Log what the watchdogs said since the last call: ended, re-armed, ledger records not written
    (each line once, whatever other threads drain at the same time)."""
    while True:
        try:
            line = unsaid.popleft()
        except IndexError:
            return
        log.warning("%s", line)


def disarm_flushed(report: FlushReport) -> None:
    """Disarm every watchdog whose pairs ``report`` flushed, when it flushed every pair."""
    if not report.ok:
        return
    flushed = {(result.server_url, result.instance_id) for result in report.results}
    with link_module.LOCK:  # picked under the lock, disarmed outside it: a disarm may wait for a busy guard
        chosen = [dog for dog in _watchdogs if dog.pairs <= flushed]
    for dog in chosen:
        dog.disarm()


def _after_fork_in_child() -> None:
    global _arming
    _arming = threading.RLock()
    _watchdogs.clear()  # (the links and ends forget themselves: see their modules)


os.register_at_fork(after_in_child=_after_fork_in_child)
