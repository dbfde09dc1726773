"""``watchdog``: a process that flushes the trainer's ids when the trainer dies, however it dies.

The trainer side: starts the watchdog process (``_watchdog_process``) as a fresh interpreter, or
connects to a ``swe-flush guard`` outside the container; hands it the servers, ids and bearers
over a pipe (or socket) only the trainer holds, and again when they change (``refresh``;
``abort`` does it too, and re-arms one that ended). The watchdog confirms each state it holds
whole. A forked child closes its copies at once, so it never hides the trainer's death. The exit
hook, and a signal hook when the process dies of its signal, disarm the watchdogs whose pairs
they flushed, so each pair is flushed once.

Threads: every read and write of a link's buffers and ends happens under ``_lock``, which is never
held while user code runs or while a thread waits. One thread at a time reads a link's answers
(its reader: the guard's follower thread, or a thread waiting for a word); the others wait on
``_heard``, which the reader notifies whenever it hears something, loses the link or stops reading.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from . import _watchdog_process
from ._errors import ConfigError, FlushError
from ._guard_client import ImpostorError, connect_to_guard
from ._liveness import hold, trainer_lock_path
from ._options import FlushOptions
from ._resolve import URL_ENV_VARS, resolve_bearer, resolve_instance_ids, resolve_server_urls
from ._text import shown
from ._threads import start_daemon_thread
from ._trust import directory_problem

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._options import HookOptionKwargs
    from ._report import FlushReport

log = logging.getLogger(__name__)

LEDGER_ENV_VAR: Final = "SWE_FLUSH_LEDGER"
DEFAULT_HEARTBEAT: Final = _watchdog_process.DEFAULT_HEARTBEAT  # seconds between two heartbeats of a record
ARM_TIMEOUT: Final = 10.0  # seconds arming waits for the watchdog to say it holds the ids
SEND_TIMEOUT: Final = 0.5  # seconds a hand-over may wait for room in the pipe and the watchdog's word
REARM_INTERVAL: Final = 60.0  # seconds between two attempts of abort() to re-arm a watchdog that failed to start
_HELPER: Final = _watchdog_process.__file__
_DISARM: Final = b'{"disarm": true}\n'
_END_CUT_LINE: Final = _watchdog_process.CANCEL + b"\n"
GUARD_ENV_VAR: Final = "SWE_FLUSH_GUARD"
MAX_SOCKET_PATH: Final = 107  # bytes in sockaddr_un's sun_path, less its NUL
RECONNECT_INTERVAL: Final = 0.1  # seconds between two attempts to reach a guard that went away
FOLLOW_INTERVAL: Final = 0.5  # seconds the guard's follower thread waits for its word before it looks again
REFUSED_RETRY: Final = 5.0  # seconds before the follower offers a refused state again (a draining guard)

# Held only around non-blocking pipe I/O, never while user code (args getters, bearer providers,
# logging) runs, so a signal hook never waits on it for long. Re-entrant: a signal hook may run
# while the main thread holds it.
_lock = threading.RLock()
_heard = threading.Condition(_lock)  # notified when a link's reader heard a word, lost the link or stopped reading
# Held while pipe ends exist that no Watchdog has taken yet; os.fork() waits for it (at-fork hook),
# so a child forked by another thread meanwhile never keeps a write end open.
_fork_lock = threading.RLock()
_watchdogs: list[Watchdog] = []  # every watchdog not disarmed, lost ones included (abort re-arms them)
_unsaid: list[str] = []  # warnings for the next abort() (the hooks log nothing)
_open_ends: set[_Fd] = set()  # pipe ends of ours that are open: a forked child closes them


class _Fd:
    """A descriptor this process opened, with the identity it had: code that closes or reuses
    descriptor numbers (``os.closerange``, a daemonizer) must never get our writes or closes."""

    __slots__ = ("fd", "identity")

    def __init__(self, fd: int) -> None:
        if fd <= 2:  # stdio closed when we started: Popen would put /dev/null there in the child
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            os.close(fd)
            fd = moved
        info = os.fstat(fd)
        self.fd = fd
        self.identity = (info.st_dev, info.st_ino)
        _open_ends.add(self)

    @classmethod
    def pipe(cls) -> tuple[_Fd, _Fd]:
        """A pipe (read end, write end), not inheritable, neither end on fd 0-2."""
        read_end, write_end = os.pipe()
        return cls(read_end), cls(write_end)

    def ours(self) -> bool:
        """Does the number still name what we opened?"""
        try:
            info = os.fstat(self.fd)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity

    def close(self) -> None:
        """Close it if it is still ours; forget it either way."""
        if self in _open_ends:
            _open_ends.discard(self)
            if self.ours():
                with contextlib.suppress(OSError):
                    os.close(self.fd)


class _Lost(Exception):
    """The watchdog process has ended, or our end of its pipes is no longer ours."""


class Watchdog:
    """A watchdog process armed by ``watchdog()`` for one trainer ``args``.

    Attributes:
        pid: the watchdog process's id (a re-armed watchdog has a new one); through a guard, the
            guard's.
        ledger: the ledger directory its record is kept in, or None.
        guard: the guard's socket path when the watchdog is a ``swe-flush guard``, else None.
        ledger_error: why the watchdog last failed to write its ledger record (a full volume,
            the directory removed), None while it writes it; it keeps retrying every heartbeat.
    """

    def __init__(self, args: Any, environ: Mapping[str, str] | None, options: FlushOptions,
                 ledger: str | None, guard: str | None = None) -> None:
        self._args = args
        self.guard = guard
        self._environ = environ
        self._options = options
        self.ledger = ledger
        self.ledger_error: str | None = None
        self.pid = 0
        self._control: _Fd | None = None  # write end of the control pipe (or the guard's socket): only we hold it
        self._ready: _Fd | None = None  # read end of the ready pipe (or the socket): its word, end-of-file at its end
        self._inbox = b""  # a line of the watchdog's not read whole yet
        self._reader: int | None = None  # the thread that reads the watchdog's answers now (see _await)
        self._token = secrets.token_hex(16)  # names this trainer to a guard across reconnects and restarts
        self._liveness: _Fd | None = None  # through a guard: the flock that proves this trainer alive (see _liveness)
        self._guard_protocol = _watchdog_process.PROTOCOL  # what the guard said in its last "held"
        self._refused: str | None = None  # why the guard refused the state last queued
        self._refused_payload = b""  # ... and that state
        self._refused_at = 0.0  # ... and when
        self._reconnecting = threading.Lock()  # one reconnect at a time (the follower thread, refresh, abort)
        self._following: threading.Event | None = None  # set to end the follower thread (guards only)
        self._said: set[str] = set()  # warnings of the follower thread said once
        self._outbox = bytearray()  # what is still to be written: at most one message (after a cut line's end)
        self._cut = False  # what was written so far ends in the middle of a line
        self._payload = b""  # the state last queued
        self._seq = 0  # its number
        self._held = 0  # the number of the newest state the watchdog said it holds whole
        self._written = 0  # bytes written to the control pipe in all
        self._pairs: frozenset[tuple[str, str]] = frozenset()
        self._disarmed = False
        self._lost = False
        self._rearm_after = 0.0

    @property
    def armed(self) -> bool:
        """True while the watchdog process lives and has said it holds the newest state whole."""
        with _lock:
            return self._talk() and self._held == self._seq and not self._outbox

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
            return self._refresh()
        except (ConfigError, FlushError):
            raise
        except Exception as exc:  # the documented contract: nothing else reaches the caller
            raise FlushError(f"the watchdog could not be handed the state: unexpected {type(exc).__name__}") from exc

    def _refresh(self) -> bool:
        payload, pairs = self._state()  # user code: no lock held
        written, held = self._written, self._held
        if self.guard is not None and not self._disarmed:
            self._refuse_if_refused(payload)
            with _lock:
                alive = not self._lost and self._talk()
            if not alive:
                self._reconnect(SEND_TIMEOUT)  # the guard went away (a sidecar restarted)
        with _lock:
            if not self._talk():
                return False
            caught_up = self._held == self._seq and not self._outbox
            if payload != self._payload:
                self._queue(payload, pairs)
            elif caught_up:
                return self._held > held  # confirmed just now, else nothing new
            # Wait only for a watchdog that reads (it confirmed its last state, or one since the last
            # call, or took more of a long one) and is not stopped: a stopped one costs each step
            # nothing (its pipe buffer taking a write is not a sign that it reads).
            reading = (caught_up or self._written > written or self._held > held) and not self._stopped()
        confirmed = self._confirm(SEND_TIMEOUT if reading else 0.0)
        self._refuse_if_refused(payload)
        return confirmed

    def _refuse_if_refused(self, payload: bytes) -> None:
        refused = self._refused
        if refused is not None and self._refused_payload == payload:
            raise FlushError(f"the guard at {shown(self.guard or '')} refused this trainer's state: {shown(refused)}")

    def _stopped(self) -> bool:
        """Is the local watchdog process stopped (SIGSTOP, a debugger)? Never known for a guard."""
        if self.guard is not None or not self.pid:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as handle:
                return handle.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
        except (OSError, IndexError):
            return False

    def disarm(self) -> None:
        """Let the watchdog exit without flushing (within a second); its ledger record is removed.

        Idempotent. Call it when the trainer has flushed everything itself. A watchdog that does
        not read its pipe (stopped, hung) is killed instead, and its ledger record stays (a guard is
        never killed: it gets half a second to read the disarm).
        """
        with _lock:
            self._disarmed = True
            if self._following is not None:
                self._following.set()
            if self in _watchdogs:
                _watchdogs.remove(self)
            if self._control is None:
                return
            self._outbox[:] = (_END_CUT_LINE if self._cut else b"") + _DISARM  # replaces any state not yet sent
            alive = self._talk()
            if alive and self._outbox and self.guard is None and self.pid:  # it must not flush later
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)  # still ours: its end of the ready pipe is open
        if alive and self._outbox and self.guard is not None:  # a busy guard: a moment to read it
            self._await(lambda: not self._outbox, SEND_TIMEOUT)  # no lock held meanwhile
        with _lock:
            self._close()
        self._release_liveness_lock()

    # -- the pipes ---------------------------------------------------------------------------
    def _state(self) -> tuple[bytes, frozenset[tuple[str, str]]]:
        """The state the watchdog needs to flush now, and its pairs. Runs user code: no lock held."""
        env = os.environ if self._environ is None else self._environ
        urls = resolve_server_urls(env)
        ids = resolve_instance_ids(self._args)
        provider = self._options.bearer_provider or resolve_bearer(env)
        tokens = None if provider is None else _tokens(provider, ids)
        options = self._options
        if len(ids) > _watchdog_process.MAX_IDS:
            raise ConfigError(f"watchdog: {len(ids)} ids; a watchdog holds at most {_watchdog_process.MAX_IDS}")
        state = {
            "urls": urls, "ids": ids, "tokens": tokens, "ledger": self.ledger, "heartbeat": DEFAULT_HEARTBEAT,
            "trainer": self._token, "lock": self._liveness is not None,
            "sys_path": [os.path.abspath(path) for path in sys.path],
            "options": {"deadline": options.deadline, "retries": options.retries, "max_workers": options.max_workers,
                        "connect_timeout": options.connect_timeout, "backoff_factor": options.backoff_factor,
                        "until_idle": options.until_idle, "ca_bundle": _absolute(options.ca_bundle),
                        "client_cert": _absolute(options.client_cert)},  # paths: the watchdog runs in /
        }
        payload = _watchdog_process.encode_state(state)
        if len(payload) > _watchdog_process.MAX_STATE_BYTES:
            raise ConfigError(f"watchdog: {len(ids)} ids make a state over {_watchdog_process.MAX_STATE_BYTES} bytes")
        if payload != self._payload:
            problem = _watchdog_process.shape_problem(payload)
            if problem is not None:
                raise ConfigError(f"watchdog: the state would be {problem}")
        return payload, frozenset((url, instance_id) for url in urls for instance_id in ids)

    def _queue(self, payload: bytes, pairs: frozenset[tuple[str, str]]) -> None:
        """Make ``payload`` the next state to write, in place of any not written yet; a line written in
        part is ended first (the watchdog drops it: it keeps the last state it had whole)."""
        self._seq += 1
        self._payload, self._pairs = payload, pairs
        message = b'{"seq": %d, "v": %d, "state": %s}\n' % (self._seq, _watchdog_process.PROTOCOL, payload)
        self._outbox[:] = (_END_CUT_LINE if self._cut else b"") + message

    def _talk(self) -> bool:
        """Read what the watchdog said (unless another thread is the link's reader) and write what the
        pipe takes, without blocking; False when lost. Called with ``_lock`` held."""
        if self._control is None or self._ready is None:
            return False
        try:
            if self._reader in (None, threading.get_ident()):
                self._read_word(self._ready)
            self._write_outbox(self._control)
        except _Lost:
            self._forget_lost()
            _heard.notify_all()
            return False
        return True

    def _read_word(self, ready: _Fd) -> None:
        if not ready.ours():
            raise _Lost
        ended = False
        while True:
            try:
                chunk = os.read(ready.fd, 4096)
            except BlockingIOError:
                break
            except OSError:
                ended = True
                break
            if not chunk:
                ended = True
                break
            self._inbox += chunk
        *lines, self._inbox = self._inbox.split(b"\n")
        for line in lines:  # before a loss is raised: a guard says why it refused, then closes
            self._hear(line)
        if lines:
            _heard.notify_all()
        if ended:
            raise _Lost

    def _hear(self, line: bytes) -> None:
        """Take one line the watchdog or guard said."""
        word, _, rest = line.partition(b" ")
        if word == _watchdog_process.HELD:
            seq, pid, *protocol = rest.split(b" ")
            if seq.isdigit() and pid.isdigit():
                self._held, self.pid = max(self._held, int(seq)), int(pid)
                self._guard_protocol = int(protocol[0]) if protocol and protocol[0].isdigit() else 1
                self._refused = None
        elif word == _watchdog_process.REFUSED:
            self._refused, self._refused_payload = rest.decode("utf-8", "replace"), self._payload
            self._refused_at = time.monotonic()
        elif word == _watchdog_process.LEDGER:
            error = None if rest == b"ok" else rest.decode("utf-8", "replace")
            if error is not None and error != self.ledger_error:
                _unsaid.append(f"the watchdog (pid {self.pid}) cannot write its ledger record in "
                               f"{shown(self.ledger or '')}: {shown(error)}; recover() elsewhere may take this "
                               "trainer for gone (it keeps trying every heartbeat)")
            self.ledger_error = error

    def _write_outbox(self, control: _Fd) -> None:
        while self._outbox:
            if not control.ours():
                raise _Lost
            try:
                written = os.write(control.fd, self._outbox)
            except BlockingIOError:
                return
            except OSError:  # EPIPE: the watchdog is gone
                raise _Lost from None
            self._cut = self._outbox[written - 1:written] != b"\n"
            del self._outbox[:written]
            self._written += written

    def _confirm(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the outbox to be written and the newest state held; True if it is."""
        return self._await(lambda: self._held == self._seq and not self._outbox, timeout)

    def _await(self, satisfied: Callable[[], bool], timeout: float) -> bool:
        """Talk until ``satisfied()`` (checked under the lock), the link is lost, or ``timeout`` passes;
        True when satisfied. Never holds the lock while it waits.

        One thread at a time is the link's reader: it polls the ready end and reads what comes. Every
        other thread waits on ``_heard`` (the reader notifies it), or polls the control end alone while
        the outbox waits for room; none races the reader for the same bytes, so no word is missed.
        """
        me = threading.get_ident()
        give_up_at = time.monotonic() + timeout
        reading = False
        try:
            while True:
                with _lock:
                    if self._reader is None:
                        self._reader, reading = me, True
                    if not self._talk():
                        return False
                    if satisfied():
                        return True
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        return False
                    if self._reader != me and not self._outbox:
                        _heard.wait(left)  # the reader hears for us
                        continue
                    assert self._control is not None and self._ready is not None  # _talk() says so
                    ready = self._ready.fd if self._reader == me else None
                    control = self._control.fd if self._outbox else None
                if not _wait_for(ready, control, left):  # closed meanwhile by disarm() in another thread
                    return False
        finally:
            if reading:
                with _lock:
                    if self._reader == me:
                        self._reader = None
                    _heard.notify_all()  # a waiter may take over the reading

    def _forget_lost(self) -> None:
        self._lost = True
        self._close()

    def _close(self) -> None:
        for end in (self._control, self._ready):
            if end is not None:
                end.close()
        self._control = self._ready = None
        self._outbox.clear()
        self._cut = False

    def _start(self, patience: float | None = None) -> None:
        """Start the watchdog process, or connect to the guard, hand it the state and wait (up to
        ``patience``, default ``ARM_TIMEOUT``) until it says it holds it whole."""
        patience = ARM_TIMEOUT if patience is None else patience
        if self.guard is not None:
            self._hold_liveness_lock()
        payload, pairs = self._state()  # user code: before any lock
        process = None
        if self.guard is not None:
            self._connect(patience)
        else:
            process = self._spawn()
        with _lock:
            if self._disarmed:  # by a signal hook meanwhile
                self._close()
                return
            self._queue(payload, pairs)
        held = self._confirm(patience)
        if process is not None:
            try:
                process.wait(ARM_TIMEOUT)  # the first process exits once it has forked: no zombie is left
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not held and not self._disarmed:
            with _lock:
                self._close()
            if process is None:
                self._refuse_if_refused(payload)
                raise FlushError(f"the guard at {shown(self.guard or '')} did not take the state in {patience:g} s")
            raise FlushError(f"the watchdog process did not start (exit status {process.returncode})")
        if held and process is None:
            self._check_guard_protocol()
            self._follow()
        if held and process is not None and os.getpid() == 1:
            warnings.warn(f"the watchdog (pid {self.pid}) was armed by PID 1 of its PID namespace (a container's "
                          "main process): it dies with the container and flushes nothing then; run swe-flush guard "
                          f"outside the container and arm with guard=PATH (or {GUARD_ENV_VAR})", UserWarning,
                          stacklevel=3)

    def _hold_liveness_lock(self) -> None:
        """Through a guard: hold a ``flock`` next to its socket for as long as this trainer lives (once).
        A guard, a restarted one too, never flushes a trainer whose lock is held, and flushes at once
        one whose lock is free. Where it cannot be held, guards judge this trainer by the older rules."""
        if self._liveness is not None or self.guard is None:
            return
        with _fork_lock:  # a child forked meanwhile must not keep the lock's descriptor
            try:
                self._liveness = _Fd(hold(trainer_lock_path(self.guard, self._token)))
            except OSError as exc:
                self._say_once("lock", f"cannot hold a lock next to the guard's socket ({exc.strerror or exc}): a "
                                       "guard restarted while this trainer cannot run judges it by a grace and its "
                                       "heartbeat")

    def _release_liveness_lock(self) -> None:
        if self._liveness is not None and self.guard is not None:
            with contextlib.suppress(OSError):
                os.unlink(trainer_lock_path(self.guard, self._token))
            self._liveness.close()
            self._liveness = None

    def _take_ends(self, control: _Fd, ready: _Fd) -> None:
        with _lock:
            self._control, self._ready, self._lost, self._held, self._inbox = control, ready, False, self._seq, b""
            self._cut = False
            _heard.notify_all()

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Start the watchdog process over two fresh pipes; the trainer's ends become ours."""
        if not sys.executable:
            raise FlushError("cannot start a watchdog: sys.executable is unknown")
        # Forks wait meanwhile: a child of another thread keeps neither a pipe end nor Popen's own
        # exec-status pipe (which would hold the arming until that child ends).
        with _fork_lock:
            try:
                control_read, control = _Fd.pipe()
                ready, ready_write = _Fd.pipe()
            except OSError as exc:
                raise FlushError(f"cannot start a watchdog: no pipe ({exc.strerror or exc})") from None
            os.set_blocking(control.fd, False)  # our ends only: each end is its own open file
            os.set_blocking(ready.fd, False)
            command = [sys.executable, _HELPER, "--trainer-pid", str(os.getpid()),
                       "--control-fd", str(control_read.fd), "--ready-fd", str(ready_write.fd)]
            # Blocked while it starts, so a Ctrl-C or TERM to the group meanwhile cannot kill it half-way.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _watchdog_process.IGNORED_SIGNALS)
            try:
                process = subprocess.Popen(command, pass_fds=(control_read.fd, ready_write.fd),
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd="/")
            except OSError as exc:
                control.close()
                ready.close()
                raise FlushError(f"cannot start a watchdog process: {exc.strerror or exc}") from None
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                control_read.close()
                ready_write.close()
        self._take_ends(control, ready)
        return process

    def _connect(self, patience: float) -> None:
        """Connect to the guard's socket, trying for up to ``patience`` (a sidecar may start later).

        Raises:
            ImpostorError: another user listens there; nothing was sent.
            FlushError: no guard answered in time.
        """
        path = self.guard or ""
        give_up_at = time.monotonic() + patience
        while True:
            with _fork_lock:  # no fork between the socket's creation and its registration
                try:
                    sock = connect_to_guard(path, SEND_TIMEOUT)
                except OSError as exc:
                    why = exc.strerror or type(exc).__name__
                else:
                    end = _Fd(sock.detach())
                    os.set_blocking(end.fd, False)
                    self._take_ends(end, end)
                    return
            if time.monotonic() >= give_up_at:
                raise FlushError(f"no guard answers at {shown(path)} ({why})")
            time.sleep(0.05)

    def _check_guard_protocol(self) -> None:
        """A guard older than this trainer is disarmed at once and refused with a ``FlushError``."""
        if self._guard_protocol >= _watchdog_process.PROTOCOL:
            return
        with _lock:
            self._outbox[:] = (_END_CUT_LINE if self._cut else b"") + _DISARM
            self._talk()
        self._await(lambda: not self._outbox, SEND_TIMEOUT)  # the disarm written: it must not flush us later
        with _lock:
            self._close()
        self._release_liveness_lock()
        raise FlushError(f"the guard at {shown(self.guard or '')} speaks protocol {self._guard_protocol}, older "
                         f"than this trainer's {_watchdog_process.PROTOCOL}: upgrade it to this swe_flush_sync "
                         "version or later")

    def _follow(self) -> None:
        """Start the follower thread (once): it notices within a second that the guard went away and
        reconnects as soon as its socket is back, handing the last state over again."""
        if self._following is not None:
            return
        self._following = threading.Event()
        start_daemon_thread(self._follow_guard, args=(self._following,), name="swe-flush-guard-follower")

    def _follow_guard(self, stop: threading.Event) -> None:
        """The follower thread: it never ends before a disarm, whatever one turn of it meets."""
        while not stop.is_set():
            try:
                with _lock:
                    if self._disarmed:
                        return
                    connected = self._ready is not None and not self._lost
                if connected:  # be the link's reader (or wait on it) a while: a word, or the guard's end
                    self._await(stop.is_set, FOLLOW_INTERVAL)
                    continue
                self._reconnect(0.0)
            except Exception as exc:  # noqa: BLE001 - said once; the trainer must stay guarded
                self._say_once(f"follower {type(exc).__name__}",
                               f"the guard follower thread met an unexpected {type(exc).__name__}; it goes on")
            stop.wait(RECONNECT_INTERVAL)

    def _reconnect(self, wait: float) -> bool:
        """Connect to the guard again and hand it the last state; True when it holds it. Runs no user
        code (the follower thread calls it). Waits up to ``wait`` for a reconnect already under way."""
        acquired = self._reconnecting.acquire(True, wait) if wait > 0 else self._reconnecting.acquire(False)
        if not acquired:
            return False
        try:
            with _lock:
                if self._disarmed or (self._ready is not None and self._talk()):
                    return not self._disarmed
                if self._refused is not None and self._refused_payload == self._payload \
                        and time.monotonic() - self._refused_at < REFUSED_RETRY:
                    return False  # refused just now: offered again only after a while (refresh() says why)
                ended = self.pid
            try:
                self._connect(0.0)
            except ImpostorError as exc:
                self._say_once(f"impostor {exc.uid}", f"{exc}; this trainer stays unguarded until its guard "
                                                      "is back")
                return False
            except FlushError:
                return False  # not back yet
            with _lock:
                if self._disarmed:
                    self._close()
                    return False
                self._queue(self._payload, self._pairs)
            if not self._confirm(SEND_TIMEOUT):
                with _lock:
                    self._close()
                return False
            try:
                self._check_guard_protocol()
            except FlushError as exc:
                self._say_once("protocol", str(exc))
                return False
            _unsaid.append(f"the guard at {shown(self.guard or '')} went away (pid {ended}); handed over again "
                           f"to pid {self.pid}")
            self._said.clear()
            return True
        finally:
            self._reconnecting.release()

    def _say_once(self, kind: str, warning: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            _unsaid.append(warning)

    def _rearm(self) -> None:
        """Start a new watchdog process for a lost one (by ``abort``; at most once a minute after a
        failure), or try the guard once more (the follower thread retries every 0.1 s meanwhile)."""
        if time.monotonic() < self._rearm_after:
            return
        ended = self.pid
        if self.guard is not None:
            if not self._reconnect(0.0):
                self._say_once("unreachable", f"the guard at {shown(self.guard)} went away and cannot be reached "
                                              "again: a hard death of this trainer flushes nothing until it is back "
                                              "(tried again every 0.1 s)")
            return
        try:
            self._start()
        except (FlushError, ConfigError) as exc:
            self._rearm_after = time.monotonic() + REARM_INTERVAL
            _unsaid.append(f"the watchdog process (pid {ended}) has ended and could not be re-armed ({exc}): a "
                           f"hard death of this trainer flushes nothing; abort(args) tries again in "
                           f"{REARM_INTERVAL:g} s")
            return
        _unsaid.append(f"the watchdog process (pid {ended}) had ended; re-armed as pid {self.pid}")

    def _forget_in_child(self) -> None:
        """In a forked child: the child has no watchdog (its copies are closed by the at-fork hook) and
        no follower thread."""
        self._control = self._ready = None
        self._liveness = None  # the at-fork hook closed the child's copy: the lock stays the parent's
        self._reader = None
        self._disarmed = True
        self._following = None
        self._reconnecting = threading.Lock()

    def __repr__(self) -> str:
        return f"Watchdog(pid={self.pid}, armed={self.armed}, ledger={self.ledger!r})"


def _wait_for(read_fd: int | None, write_fd: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` until ``read_fd`` is readable or ``write_fd`` writable (``poll``: any fd
    number); False when a descriptor was closed meanwhile."""
    poller = select.poll()
    if read_fd is not None:
        poller.register(read_fd, select.POLLIN)
    if write_fd is not None:
        poller.register(write_fd, select.POLLOUT)
    try:
        events = poller.poll(max(timeout, 0.0) * 1000)
    except (OSError, ValueError):
        return False
    return not any(flags & select.POLLNVAL for _, flags in events)


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
        The armed ``Watchdog``; the same one when called again for the same ``args``.

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
    with _lock:
        known = [armed for armed in _watchdogs if armed._args is args]
        keeper = known[0] if known else Watchdog(args, environ, flush_options, ledger, socket_path)
        if known and keeper.armed:
            return keeper
        if not known:
            _watchdogs.append(keeper)  # before it starts: a signal hook meanwhile can disarm it
    try:
        keeper._start()
    except BaseException:
        with _lock:
            if keeper in _watchdogs:
                _watchdogs.remove(keeper)
        keeper._release_liveness_lock()
        raise
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


def hand_over_to_watchdogs(args: Any, *, rearm: bool = True) -> None:
    """Hand the current ids of ``args`` to its watchdogs, if any (cheap when unchanged); ``rearm``
    (``abort``, not the hooks) starts a new process for one found ended. Never raises: whatever goes
    wrong is said at the next ``abort`` (the flush that follows goes on regardless)."""
    try:
        _refresh_watchdogs(args, rearm)
    except FlushError as exc:  # a watchdog's trouble never costs the flush
        _unsaid.append(f"the watchdog was not handed this trainer's ids: {exc}")
    except Exception as exc:  # noqa: BLE001 - as above; the message of an unexpected error could hold anything
        _unsaid.append(f"the watchdog was not handed this trainer's ids: unexpected {type(exc).__name__}")


def _refresh_watchdogs(args: Any, rearm: bool) -> None:
    with _lock:
        mine = [(keeper, not keeper._lost and keeper._talk()) for keeper in _watchdogs if keeper._args is args]
    for keeper, alive in mine:
        if alive:
            keeper.refresh()
        elif rearm:
            keeper._rearm()


def warn_lost_watchdogs() -> None:
    """Log what the watchdogs said since the last call: ended, re-armed, ledger records not written."""
    while _unsaid:
        log.warning("%s", _unsaid.pop(0))


def disarm_flushed(report: FlushReport) -> None:
    """Disarm every watchdog whose pairs ``report`` flushed, when it flushed every pair."""
    if not report.ok:
        return
    flushed = {(result.server_url, result.instance_id) for result in report.results}
    with _lock:  # picked under the lock, disarmed outside it: a disarm may wait for a busy guard
        chosen = [keeper for keeper in _watchdogs if keeper._pairs <= flushed]
    for keeper in chosen:
        keeper.disarm()


def _before_fork() -> None:
    _fork_lock.acquire()


def _after_fork_in_parent() -> None:
    _fork_lock.release()


def _after_fork_in_child() -> None:
    global _lock, _fork_lock, _heard
    _lock = threading.RLock()
    _heard = threading.Condition(_lock)
    _fork_lock = threading.RLock()
    for end in list(_open_ends):  # the pipes' ends, and any made for a watchdog still arming
        end.close()
    for guard in _watchdogs:
        guard._forget_in_child()
    _watchdogs.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
