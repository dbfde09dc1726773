"""``watchdog``: a process that flushes the trainer's ids when the trainer dies, however it dies.

The trainer side: starts the watchdog process (``_watchdog_process``) as a fresh interpreter,
hands it the servers, ids and bearers over a pipe whose write end only the trainer holds, and
hands them over again when they change (``refresh``; ``abort`` does it too). A forked child
closes its copy of the write end at once, so it never hides the trainer's death. The signal and
exit hooks disarm the watchdogs whose pairs they flushed, so each pair is flushed once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from . import _watchdog_process
from ._errors import ConfigError, FlushError
from ._options import FlushOptions
from ._resolve import URL_ENV_VARS, resolve_bearer, resolve_instance_ids, resolve_server_urls
from ._trust import directory_problem

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._options import HookOptionKwargs
    from ._report import FlushReport

log = logging.getLogger(__name__)

LEDGER_ENV_VAR: Final = "SWE_FLUSH_LEDGER"
DEFAULT_HEARTBEAT: Final = 10.0  # seconds between two heartbeats of a ledger record
ARM_TIMEOUT: Final = 10.0  # seconds arming waits for the watchdog to say it holds the ids
SEND_TIMEOUT: Final = 0.5  # seconds a hand-over may wait for room in the pipe (a stopped watchdog)
_HELPER: Final = _watchdog_process.__file__

_lock = threading.RLock()  # re-entrant: a signal hook may disarm while abort() refreshes
_armed: list[Watchdog] = []
_lost_unsaid: list[Watchdog] = []  # ended before disarm(); abort() says so (the hooks log nothing)


class Watchdog:
    """A watchdog process armed by ``watchdog()`` for one trainer ``args``.

    Attributes:
        pid: the watchdog process's id.
        ledger: the ledger directory its record is kept in, or None.
    """

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: FlushOptions,
                 ledger: str | None) -> None:
        self._args = args
        self._environ = environ
        self._options = options
        self.ledger = ledger
        self.pid = 0
        self._control: int | None = None  # write end of the control pipe: only this process holds it
        self._ready: int | None = None  # read end of the ready pipe: end-of-file when the watchdog ends
        self._sent = b""
        self._unsent = bytearray()
        self._pairs: frozenset[tuple[str, str]] = frozenset()

    @property
    def armed(self) -> bool:
        """True until ``disarm()``, and while the watchdog process lives."""
        with _lock:
            if self._ready is None:
                return False
            readable, _, _ = select.select([self._ready], [], [], 0)
            if readable and not os.read(self._ready, 64):
                self._lost()
                return False
            return True

    def refresh(self) -> bool:
        """Read the ids (and servers and bearers) again and hand them over if they changed.

        Returns:
            True when something new was handed over; False when nothing changed (nothing is
            written) or the watchdog is no longer armed.

        Raises:
            ConfigError: ``args`` or the environment holds a bad value.
        """
        with _lock:
            if self._control is None:
                return False
            message = self._state_message()
            if message == self._sent:
                return False
            self._send(message)
            return True

    def disarm(self) -> None:
        """Let the watchdog exit without flushing (within a second); its ledger record is removed.

        Idempotent. Call it when the trainer has flushed everything itself. A watchdog that does
        not read its pipe (stopped, hung) is killed instead, and its ledger record stays.
        """
        with _lock:
            if self._control is None:
                return
            self._send(b'{"disarm": true}\n')
            if self._unsent:  # a stopped or hung watchdog that the pipe cannot reach must not flush later
                os.kill(self.pid, signal.SIGKILL)  # still ours: its end of the ready pipe is open
            self._close()

    def _state_message(self) -> bytes:
        """The control line with everything the watchdog needs to flush now."""
        env = os.environ if self._environ is None else self._environ
        urls = resolve_server_urls(env)
        ids = resolve_instance_ids(self._args)
        provider = self._options.bearer_provider or resolve_bearer(env)
        tokens = None if provider is None else _tokens(provider, ids)
        options = self._options
        state = {
            "urls": urls, "ids": ids, "tokens": tokens, "ledger": self.ledger, "heartbeat": DEFAULT_HEARTBEAT,
            "sys_path": [os.path.abspath(path) for path in sys.path],
            "options": {"deadline": options.deadline, "retries": options.retries, "max_workers": options.max_workers,
                        "connect_timeout": options.connect_timeout, "backoff_factor": options.backoff_factor,
                        "until_idle": options.until_idle, "ca_bundle": _absolute(options.ca_bundle),
                        "client_cert": _absolute(options.client_cert)},  # paths: the watchdog runs in /
        }
        message = json.dumps({"state": state}).encode() + b"\n"
        if len(message) > _watchdog_process.MAX_STATE_BYTES:
            raise ConfigError(f"watchdog: {len(ids)} ids make a state over {_watchdog_process.MAX_STATE_BYTES} bytes")
        self._pairs = frozenset((url, instance_id) for url in urls for instance_id in ids)
        return message

    def _send(self, message: bytes) -> None:
        """Write ``message`` without blocking the trainer for more than ``SEND_TIMEOUT``; what the pipe
        cannot take yet is written before the next message."""
        assert self._control is not None
        self._sent = message
        self._unsent += message
        give_up_at = time.monotonic() + SEND_TIMEOUT
        while self._unsent:
            try:
                written = os.write(self._control, self._unsent)
            except BlockingIOError:
                left = give_up_at - time.monotonic()
                if left <= 0 or not select.select([], [self._control], [], left)[1]:
                    return
                continue
            except OSError:  # EPIPE: the watchdog is gone
                self._lost()
                return
            del self._unsent[:written]

    def _lost(self) -> None:
        _lost_unsaid.append(self)
        self._close()

    def _close(self) -> None:
        for fd in (self._control, self._ready):
            if fd is not None:
                os.close(fd)
        self._control = self._ready = None
        if self in _armed:
            _armed.remove(self)

    def _forget_in_child(self) -> None:
        """In a forked child: close this process's copies at once; the child has no watchdog."""
        for fd in (self._control, self._ready):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._control = self._ready = None

    def _start(self) -> None:
        """Start the watchdog process, hand it the state and wait until it says it holds it."""
        if not sys.executable:
            raise FlushError("cannot start a watchdog: sys.executable is unknown")
        first = self._state_message()
        control_read, self._control = os.pipe()
        self._ready, ready_write = os.pipe()
        command = [sys.executable, _HELPER, "--trainer-pid", str(os.getpid()),
                   "--control-fd", str(control_read), "--ready-fd", str(ready_write)]
        # Blocked while it starts, so a Ctrl-C or TERM to the group meanwhile cannot kill it half-way.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _watchdog_process.IGNORED_SIGNALS)
        try:
            process = subprocess.Popen(command, pass_fds=(control_read, ready_write), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, cwd="/")
        except OSError as exc:
            self._close()
            raise FlushError(f"cannot start a watchdog process: {exc.strerror or exc}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(control_read)
            os.close(ready_write)
        os.set_blocking(self._control, False)
        self._send(first)
        self.pid = self._read_ack()
        try:
            process.wait(ARM_TIMEOUT)  # the first process exits once it has forked: no zombie is left
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if not self.pid:
            self._close()
            raise FlushError(f"the watchdog process did not start (exit status {process.returncode})")

    def _read_ack(self) -> int:
        """The watchdog's pid from its ``armed PID`` line; 0 if none came in time."""
        assert self._ready is not None
        data = b""
        give_up_at = time.monotonic() + ARM_TIMEOUT
        while not data.endswith(b"\n"):
            left = give_up_at - time.monotonic()
            if left <= 0 or not select.select([self._ready], [], [], left)[0]:
                return 0
            chunk = os.read(self._ready, 64)
            if not chunk:
                return 0
            data += chunk
        word, _, pid = data.strip().partition(b" ")
        return int(pid) if word == _watchdog_process.ARMED and pid.isdigit() else 0

    def __repr__(self) -> str:
        return f"Watchdog(pid={self.pid}, armed={self.armed}, ledger={self.ledger!r})"


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
    """The ledger directory (argument, else ``SWE_FLUSH_LEDGER``), created with mode 0700 if missing
    (an existing one's mode is never changed); None when neither is set.

    A directory another user owns or may write is refused: ``recover`` would not trust it.
    """
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


def watchdog(args: Any, *, environ: Mapping[str, str] | None = None,
             **options: Unpack[HookOptionKwargs]) -> Watchdog:
    """Arm a watchdog process that flushes every instance of ``args`` when this process ends.

    However the trainer ends (SIGKILL, the OOM killer, a segfault, ``os._exit``, an exception, a
    normal exit, Ctrl-C, a Ray actor's death), the watchdog sees the end-of-file of a pipe only
    this process writes, flushes the last ids it was handed (every server in parallel, within
    ``deadline``, until idle by default), writes one summary line to the stderr it inherited and
    exits: at most ``deadline`` plus about a second after the trainer. It runs in its own session
    (a double fork), ignores SIGINT, SIGTERM and SIGHUP, and uses no CPU while it waits.

    Servers and bearers are read from ``environ`` like ``abort`` does; the ids from ``args``.
    Hand changed ids over with ``Watchdog.refresh()`` or any ``abort(args)`` (the same ``args``
    object). Secrets travel over the pipe, never on its command line.

    Args:
        args: trainer args (attributes) or a Mapping; the same object for ``abort`` and the hooks.
        environ: the environment to read instead of ``os.environ``.
        **options: as for ``abort`` but ``linger``; ``until_idle`` defaults to True here.
            ``ledger``: a directory (default ``SWE_FLUSH_LEDGER``) where the watchdog keeps a
            record of the ids for ``recover()``.

    Returns:
        The armed ``Watchdog``; the same one when called again for the same ``args``.

    Raises:
        ConfigError: a bad option, bad ``args``, or no agent server configured.
        FlushError: the watchdog process could not be started.

    Example:
        >>> guard = watchdog(args, deadline=30)  # doctest: +SKIP
    """
    options.setdefault("until_idle", True)
    flush_options = FlushOptions(**options, linger=0.0)
    env = os.environ if environ is None else environ
    if not resolve_server_urls(env):
        raise ConfigError(f"watchdog: no agent server configured ({' and '.join(URL_ENV_VARS)} unset)")
    with _lock:
        for armed in _armed:
            if armed._args is args and armed.armed:
                return armed
        guard = Watchdog(args, environ, flush_options, _ledger_folder(flush_options.ledger, env))
        guard._start()
        _armed.append(guard)
        return guard


def refresh_watchdogs(args: Any) -> None:
    """Hand the current ids of ``args`` to its armed watchdog, if any (cheap when unchanged)."""
    for guard in [armed for armed in _armed if armed._args is args]:
        guard.refresh()


def warn_lost_watchdogs() -> None:
    """Log one warning for each watchdog found ended since the last call."""
    while _lost_unsaid:
        guard = _lost_unsaid.pop()
        log.warning("the watchdog process (pid %d) has ended: a hard death of this trainer now flushes "
                    "nothing; arm a new one with watchdog(args)", guard.pid)


def disarm_flushed(report: FlushReport) -> None:
    """Disarm every watchdog whose pairs ``report`` flushed, when it flushed every pair."""
    if not report.ok:
        return
    flushed = {(result.server_url, result.instance_id) for result in report.results}
    with _lock:
        for guard in list(_armed):
            if guard._pairs <= flushed:
                guard.disarm()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    for guard in _armed:
        guard._forget_in_child()
    _armed.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
