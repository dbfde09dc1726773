"""The two far ends a ``Watchdog`` links to, behind one interface (``End``): a ``ProcessEnd`` spawns
a local watchdog process over two pipes (and kills or respawns it); a ``GuardEnd`` reaches a
``swe-flush guard``'s socket (the liveness lock it passes, peer and protocol checks, a follower
thread that reconnects, refusals).
"""
from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Final

from .._core.errors import ConfigError, FlushError
from .._core.text import shown
from .._core.threads import start_daemon_thread
from .._process import watchdog_process
from .._process.proc import process_stopped
from .._process.wire import OLDEST_GUARD, PROTOCOL
from . import link as link_module
from .guard_client import ImpostorError, connect_to_guard
from .link import Fd, Link

GUARD_ENV_VAR: Final = "SWE_FLUSH_GUARD"
ARM_TIMEOUT: Final = 10.0  # seconds arming waits for the watchdog to say it holds the ids
SEND_TIMEOUT: Final = 0.5  # seconds a hand-over may wait for room in the pipe and the watchdog's word
REARM_INTERVAL: Final = 60.0  # seconds between two attempts of abort() to re-arm a watchdog that failed to start
RECONNECT_INTERVAL: Final = 0.1  # seconds between two attempts to reach a guard that went away
FOLLOW_INTERVAL: Final = 0.5  # seconds the guard's follower thread waits for its word before it looks again
RECORD_WAIT: Final = 0.25  # seconds arming waits for the guard's record of it (never for a slow disk longer)
REFUSED_RETRY: Final = 5.0  # seconds before the follower offers a refused state again (a draining guard)
_HELPER: Final = watchdog_process.__file__

# Warnings for the next abort() (the hooks and the follower thread log nothing); any thread drains it.
unsaid: collections.deque[str] = collections.deque()
_ends: weakref.WeakSet[End] = weakref.WeakSet()  # a forked child forgets them all


class End:
    """What a watchdog's far end does at each point of its life; the base does nothing."""

    reconnects = False  # arming tries again when the far end goes away before it held the state

    def __init__(self, link: Link) -> None:
        self.link = link
        _ends.add(self)

    @property
    def wants_lock(self) -> bool:
        """Does the state ask the far end for a lock to hold (a guard's: see ``_process.liveness``)?"""
        return False

    def prepare(self) -> None:
        """Before the first state is built."""

    def open(self, patience: float) -> subprocess.Popen[bytes] | None:
        """Open the link's ends (trying up to ``patience`` s); the process started, if any."""
        raise NotImplementedError

    def opened(self, held: bool, process: subprocess.Popen[bytes] | None, payload: bytes, waited: float,
               left: float) -> None:
        """After the first state was handed over (``waited`` s after arming began, ``left`` s of its
        patience left): unless retired meanwhile, raise if it was not ``held``."""

    def before_refresh(self, payload: bytes, patience: float) -> None:
        """Before ``payload`` is handed over by a refresh that waits at most ``patience`` seconds."""

    def after_refresh(self, payload: bytes) -> None:
        """After a refresh handed ``payload`` over (or tried)."""

    def stopped(self) -> bool:
        """Is the far end known to be stopped (it reads nothing for now)?"""
        return False

    def retire(self) -> None:
        """A disarm: stop whatever runs for the link (``LOCK`` held)."""

    def settle_disarm(self) -> None:
        """A disarm is written only in part: make sure the far end never flushes (no lock held)."""

    def rearm(self, start: Callable[[], None]) -> None:
        """The link was lost: ``start`` the watchdog again, or reach the far end again."""

    def release(self) -> None:
        """After a disarm or a failed arming: let go of what ``prepare`` took."""

    def forget_in_child(self) -> None:
        """In a forked child: nothing of the far end is the child's."""


class ProcessEnd(End):
    """A local watchdog process, over a control pipe (we write) and a ready pipe (it answers)."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self._rearm_after = 0.0

    def open(self, patience: float) -> subprocess.Popen[bytes]:
        """Start the watchdog process over two fresh pipes; the trainer's ends become the link's."""
        if not sys.executable:
            raise FlushError("cannot start a watchdog: sys.executable is unknown")
        # Forks wait meanwhile: a child of another thread keeps neither a pipe end nor Popen's own
        # exec-status pipe (which would hold the arming until that child ends).
        with link_module.FORK_LOCK:
            try:
                control_read, control = Fd.pipe()
                ready, ready_write = Fd.pipe()
            except OSError as exc:
                raise FlushError(f"cannot start a watchdog: no pipe ({exc.strerror or exc})") from None
            os.set_blocking(control.fd, False)  # our ends only: each end is its own open file
            os.set_blocking(ready.fd, False)
            command = [sys.executable, _HELPER, "--trainer-pid", str(os.getpid()),
                       "--control-fd", str(control_read.fd), "--ready-fd", str(ready_write.fd)]
            # Blocked while it starts, so a Ctrl-C or TERM to the group meanwhile cannot kill it half-way.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, watchdog_process.IGNORED_SIGNALS)
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
        with link_module.LOCK:
            self.link.take_ends(control, ready)
        return process

    def opened(self, held: bool, process: subprocess.Popen[bytes] | None, payload: bytes, waited: float,
               left: float) -> None:
        assert process is not None
        try:
            process.wait(ARM_TIMEOUT)  # the first process exits once it has forked: no zombie is left
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if not held and not self.link.retired:
            with link_module.LOCK:
                self.link.close()
            raise FlushError(f"the watchdog process did not start (exit status {process.returncode})")
        if held and os.getpid() == 1:
            warnings.warn(f"the watchdog (pid {self.link.pid}) was armed by PID 1 of its PID namespace (a "
                          "container's main process): it dies with the container and flushes nothing then; run "
                          f"swe-flush guard outside the container and arm with guard=PATH (or {GUARD_ENV_VAR})",
                          UserWarning, stacklevel=4)

    def stopped(self) -> bool:
        """Is the watchdog process stopped (SIGSTOP, a debugger)?"""
        return bool(self.link.pid) and process_stopped(self.link.pid)

    def settle_disarm(self) -> None:
        if self.link.pid:  # it must not flush later
            with contextlib.suppress(OSError):
                os.kill(self.link.pid, signal.SIGKILL)  # still ours: the link was open just now

    def rearm(self, start: Callable[[], None]) -> None:
        """Start a new watchdog process (at most once a minute after a failure)."""
        if time.monotonic() < self._rearm_after:
            return
        ended = self.link.pid
        try:
            start()
        except (FlushError, ConfigError) as exc:
            self._rearm_after = time.monotonic() + REARM_INTERVAL
            unsaid.append(f"the watchdog process (pid {ended}) has ended and could not be re-armed ({exc}): a "
                          f"hard death of this trainer flushes nothing; abort(args) tries again in "
                          f"{REARM_INTERVAL:g} s")
            return
        unsaid.append(f"the watchdog process (pid {ended}) had ended; re-armed as pid {self.link.pid}")


class GuardEnd(End):
    """A ``swe-flush guard`` on a Unix socket (one descriptor for both ends), followed by a thread.
    The guard passes a lock with its first word; the link holds it until a disarm (a newer guard's
    replaces it)."""

    reconnects = True

    def __init__(self, link: Link, path: str, token: str) -> None:
        super().__init__(link)
        self.path = path
        self._token = token  # names this trainer to a guard across reconnects and restarts
        self._reconnecting = threading.Lock()  # one reconnect at a time (the follower thread, refresh, abort)
        self._following: threading.Event | None = None  # set to end the follower thread
        self._said: set[str] = set()  # warnings said once (until a reconnect succeeds)

    @property
    def wants_lock(self) -> bool:
        """Asks for a lock, unless this connection's did not arrive (no free descriptor) or other code
        closed it: the state then says the trainer holds none, and the guard judges it by its pid
        and heartbeat until it connects again (said once)."""
        with link_module.LOCK:
            link = self.link
            newest = link.locks.newest
            if newest is not None and not link.lock_missing and not newest.ours():
                link.lock_missing = True
                self._say_once("lock closed", f"other code closed the descriptor of the lock the guard at "
                                              f"{shown(self.path)} passed this trainer (os.closerange, a daemonizing "
                                              "library?): it is judged by its pid and heartbeat until it connects "
                                              "again")
            return not link.lock_missing

    def open(self, patience: float) -> None:
        """Connect, trying for up to ``patience`` (a sidecar may start later); ``FlushError`` (or
        ``ImpostorError``: another user listens there) when it cannot."""
        started = time.monotonic()
        give_up_at = started + patience
        while True:
            with link_module.FORK_LOCK:  # no fork between the socket's creation and its registration
                try:
                    sock = connect_to_guard(self.path, SEND_TIMEOUT)
                except OSError as exc:
                    why = exc.strerror or type(exc).__name__
                else:
                    end = Fd(sock.detach())
                    os.set_blocking(end.fd, False)
                    with link_module.LOCK:
                        self.link.take_ends(end, end, passes_fds=True)
                    return None
            if time.monotonic() >= give_up_at:
                raise FlushError(f"no guard answers at {shown(self.path)} ({why}; tried for "
                                 f"{time.monotonic() - started:.1f} s)")
            time.sleep(0.05)

    def opened(self, held: bool, process: subprocess.Popen[bytes] | None, payload: bytes, waited: float,
               left: float) -> None:
        if not held:
            if self.link.retired:
                return
            with link_module.LOCK:
                lost = not self.link.open
                self.link.close()
            self.after_refresh(payload)
            raise FlushError(f"the guard at {shown(self.path)} did not take the state in {waited:.1f} s"
                             + (" (it went away before it held it, and no guard took it since)" if lost else ""))
        self._check_protocol()
        link = self.link
        if link.protocol >= 3 and link.locks.newest is not None:  # armed once a record names the lock
            link.wait(lambda: link.locks.on_record, min(left, RECORD_WAIT))  # (see _process.ownership)
        if self._following is None:  # the follower thread (once)
            self._following = threading.Event()
            start_daemon_thread(self._follow, args=(self._following,), name="swe-flush-guard-follower")

    def before_refresh(self, payload: bytes, patience: float) -> None:
        """Say a refusal of this very state; reach a guard that went away (a sidecar restarted)."""
        self.after_refresh(payload)
        with link_module.LOCK:
            alive = self.link.talk()
        if not alive:
            self._reconnect(patience, patience)

    def after_refresh(self, payload: bytes) -> None:
        """Raise the guard's refusal of ``payload``, if it refused it."""
        refused = self.link.refused
        if refused is not None and self.link.refused_payload == payload:
            raise FlushError(f"the guard at {shown(self.path)} refused this trainer's state: {shown(refused)}")

    def settle_disarm(self) -> None:
        """A busy guard (never killed) gets a moment to read the disarm."""
        self.link.wait(lambda: not self.link.unwritten, SEND_TIMEOUT)

    def retire(self) -> None:
        """End the follower thread (at its next look)."""
        if self._following is not None:
            self._following.set()

    def rearm(self, start: Callable[[], None]) -> None:
        """Try the guard once more (the follower thread retries every 0.1 s meanwhile)."""
        if not self._reconnect(0.0):
            self._say_once("unreachable", f"the guard at {shown(self.path)} went away and cannot be reached "
                                          "again: a hard death of this trainer flushes nothing until it is back "
                                          "(tried again every 0.1 s)")

    def release(self) -> None:
        with link_module.LOCK:
            self.link.release_lock()

    def forget_in_child(self) -> None:
        """No follower thread, and the lock stays the parent's (the at-fork hook closed the copy)."""
        self._following = None
        self._reconnecting = threading.Lock()

    def _check_protocol(self) -> None:
        """A guard older than this trainer is disarmed at once and refused with a ``FlushError``."""
        link = self.link
        if link.protocol >= OLDEST_GUARD:
            return
        with link_module.LOCK:
            link.queue_disarm()
            link.talk()
        link.wait(lambda: not link.unwritten, SEND_TIMEOUT)  # the disarm written: it must not flush us later
        with link_module.LOCK:
            link.close()
        self.release()
        raise FlushError(f"the guard at {shown(self.path)} speaks protocol {link.protocol}, older than this "
                         f"trainer's oldest, {OLDEST_GUARD} (it speaks {PROTOCOL}): upgrade it to this "
                         "swe_flush_sync version or later")

    def _follow(self, stop: threading.Event) -> None:
        """The follower thread: notices a lost guard and reconnects; it ends only at a disarm."""
        while not stop.is_set():
            try:
                with link_module.LOCK:
                    if self.link.retired:
                        return
                    connected = self.link.open
                if connected:  # be the link's reader (or wait on it) a while: a word, or the guard's end
                    self.link.wait(stop.is_set, FOLLOW_INTERVAL)
                    continue
                self._reconnect(0.0)
            except Exception as exc:  # noqa: BLE001 - said once; the trainer must stay guarded
                self._say_once(f"follower {type(exc).__name__}",
                               f"the guard follower thread met an unexpected {type(exc).__name__}; it goes on")
            stop.wait(RECONNECT_INTERVAL)

    def _reconnect(self, wait: float, patience: float = SEND_TIMEOUT) -> bool:
        """Hand the last state (no user code) to the guard again; True when held. Waits up to ``wait``
        for a reconnect under way, and up to ``patience`` for the guard's word."""
        acquired = self._reconnecting.acquire(True, wait) if wait > 0 else self._reconnecting.acquire(False)
        if not acquired:
            return False
        link = self.link
        try:
            with link_module.LOCK:
                if link.retired or link.talk():
                    return not link.retired
                if link.refused is not None and link.refused_payload == link.payload \
                        and time.monotonic() - link.refused_at < REFUSED_RETRY:
                    return False  # refused just now: offered again only after a while (refresh() says why)
                ended = link.pid
            try:
                self.open(0.0)
            except ImpostorError as exc:
                self._say_once(f"impostor {exc.uid}", f"{exc}; this trainer stays unguarded until its guard "
                                                      "is back")
                return False
            except FlushError:
                return False  # not back yet
            with link_module.LOCK:
                if link.retired:
                    link.close()
                    return False
                link.queue(link.payload, link.pairs)
            if not link.confirm(patience):
                with link_module.LOCK:
                    link.close()
                return False
            try:
                self._check_protocol()
            except FlushError as exc:
                self._say_once("protocol", str(exc))
                return False
            unsaid.append(f"the guard at {shown(self.path)} went away (pid {ended}); handed over again to pid "
                          f"{link.pid}")
            self._said.clear()
            return True
        finally:
            self._reconnecting.release()

    def _say_once(self, kind: str, warning: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            unsaid.append(warning)


def _after_fork_in_child() -> None:
    for end in list(_ends):
        end.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
