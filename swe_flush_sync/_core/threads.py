"""Threads the library starts inside a trainer: they never take the trainer's signals, and a flush
reaches them without a lock.

CPython runs Python signal handlers only in the main thread, once it gets past its current
blocking call. A process-directed SIGTERM that the kernel delivers to another thread (any that
does not block it) interrupts nothing: the main thread's ``sleep``, ``lock.acquire`` or
``readline`` goes on, and ``flush_on_signal`` runs only when that call returns (seen on Python
3.14 and 3.15). So every thread the library starts blocks every asynchronous signal: a plain
thread is started while its creator blocks them (a new thread inherits its creator's mask), an
executor's workers block them first thing (``block_signals`` as the initializer). Faults that the
kernel sends to the thread that caused them (SIGSEGV, SIGBUS, ...) stay unblocked.

A signal handler may flush at any instant, also while the thread it interrupted is inside a flush.
So on the way from a caller to the threads that send, no lock is taken that the interrupted code
may hold: ``Workers`` hands calls over through ``queue.SimpleQueue`` (its ``put`` is documented
re-entrant) and counts idle threads with another, and a caller waits on an ``Inbox`` of its own.
(``ThreadPoolExecutor.submit`` holds a plain ``Lock``; a handler's flush that re-entered it hung
the trainer for ever.) A call's outcome and a request's cancellation are ``outcome.Outcome`` and
``outcome.Gate``, for the same reason. The rule, and how to check a change against it (the signal
sweep, ``tests/hooks/test_signal_sweep.py``): docs/architecture.md, "Signal handlers".
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Final, Generic, Protocol, TypeVar

from .outcome import Outcome

T = TypeVar("T")

_SYNCHRONOUS: Final = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, signal.SIGSYS,
                       signal.SIGABRT, signal.SIGKILL, signal.SIGSTOP}
BLOCKED_SIGNALS: Final = frozenset(signal.valid_signals()) - _SYNCHRONOUS  # blocked in every library thread


def block_signals() -> None:
    """Block ``BLOCKED_SIGNALS`` in the calling thread (an executor's ``initializer``)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED_SIGNALS)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal that came meanwhile is delivered now


def start_daemon_thread(target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """Start a daemon thread that blocks ``BLOCKED_SIGNALS`` from its first instruction.

    Raises:
        RuntimeError: the thread could not start (interpreter shutdown, a pids limit).
    """
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    with _signals_blocked():
        thread.start()
    return thread


class Inbox(Generic[T]):
    """A call's own queue: ``put`` from any thread, done-callback or signal handler (a ``SimpleQueue``'s,
    re-entrant); ``get`` waits in the owning thread, and ends by its timeout whatever signals come.

    The wait is a lock's (``Lock.acquire(timeout=...)``, rung by each ``put``), not
    ``SimpleQueue.get(timeout=...)``: on CPython 3.10-3.12 that waits for ever once a signal handler
    runs past its timeout (it takes the negative time left for "no timeout"); a signal every few ms
    hung a waiting main thread within seconds. 3.13 fixed it; ``Lock.acquire`` always checked.
    """

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._bell = threading.Lock()  # released ("rung") when an item may be waiting; a C-level lock
        self._bell.acquire()

    def put(self, item: T) -> None:
        self._items.put(item)
        with contextlib.suppress(RuntimeError):  # rung already: the owner looks at every item anyway
            self._bell.release()

    def get(self, timeout: float) -> T:
        """The next item, waiting up to ``timeout`` seconds; ``queue.Empty`` when none came."""
        give_up_at = time.monotonic() + timeout
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                left = give_up_at - time.monotonic()
                if left <= 0 or not self._bell.acquire(timeout=left):
                    return self._items.get_nowait()  # (one last look: queue.Empty when nothing came)


class Runner(Protocol):
    """What runs a flush's requests: ``run`` puts ``call`` on a thread and its outcome in ``future``
    (False, ``future`` cancelled, when it cannot any more); ``key`` names the call's agent server."""

    def run(self, future: Outcome[T], call: Callable[[], T], key: Hashable = None) -> bool: ...


class Workers:
    """Daemon threads that run calls handed to them: the one way a flush's requests reach a thread.

    ``run`` puts the call on a ``SimpleQueue`` and starts a thread only when none is idle (as
    ``ThreadPoolExecutor`` does, up to ``limit``), so a signal handler may call it while the thread it
    interrupted is inside it. Where no thread can start at all (interpreter shutdown, a pids limit)
    and none runs, the call runs in the calling thread. ``stop`` lets the threads end once the calls
    already handed over are done; a stopped pool runs nothing more.
    """

    def __init__(self, name: str, limit: int, *, numbered: bool = True) -> None:
        self._name = name
        self._numbered = numbered  # threads named NAME_0, NAME_1, ... as an executor's are
        self._limit = limit
        self._numbers = itertools.count()
        self._stopped = False
        self._begin()

    def _begin(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Outcome[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._idle: queue.SimpleQueue[None] = queue.SimpleQueue()  # one item per thread waiting for a call
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()  # one item per thread that may still start
        for _ in range(self._limit):
            self._slots.put(None)

    @property
    def threads(self) -> int:
        """The threads started (and starting) since the last ``let_go``."""
        return self._limit - self._slots.qsize()

    def run(self, future: Outcome[T], call: Callable[[], T], key: Hashable = None) -> bool:
        """Run ``call`` into ``future`` on a thread, in turn (``key`` changes nothing here); False
        (``future`` cancelled) once stopped."""
        if self._stopped:
            future.cancel()
            return False
        try:
            self._idle.get_nowait()  # an idle thread takes it
        except queue.Empty:
            self._start_one()
        if not self.threads:  # no thread could ever start: here, now (bounded by the call's own deadline)
            future.run(call)
            return True
        tasks = self._tasks
        tasks.put((future, call))
        if self._stopped or self._tasks is not tasks:  # stopped or let go meanwhile (another thread): the put
            future.cancel()  # may have landed behind the threads' ends or with none; still queued, it never runs
        return True

    def keep(self, count: int) -> None:
        """Start threads until ``count`` run (fewer where none can start)."""
        while self.threads < min(count, self._limit) and self._start_one():
            pass

    def _start_one(self) -> bool:
        """Start one more thread, if ``limit`` allows and one can start."""
        slots = self._slots
        try:
            slots.get_nowait()  # a slot taken is a thread counted, whatever other callers do meanwhile
        except queue.Empty:
            return False
        try:
            name = f"{self._name}_{next(self._numbers)}" if self._numbered else self._name
            start_daemon_thread(self._serve, name=name, args=(self._tasks, self._idle))
        except RuntimeError:  # "can't create new thread at interpreter shutdown", a pids limit
            slots.put(None)
            return False
        return True

    @staticmethod
    def _serve(tasks: queue.SimpleQueue[tuple[Outcome[Any], Callable[[], Any]] | None],
               idle: queue.SimpleQueue[None]) -> None:
        while (task := tasks.get()) is not None:
            future, call = task
            future.run(call)
            del task, future, call  # nothing of a finished call is kept while idle
            idle.put(None)

    def stop(self) -> None:
        """Let every thread end after the calls already handed over; run nothing more."""
        self._stopped = True
        self.let_go()

    def let_go(self) -> None:
        """Let every thread end after the calls already handed over; a later ``run`` starts new ones."""
        tasks, threads = self._tasks, self.threads
        self._begin()
        for _ in range(threads):
            tasks.put(None)  # after the calls already queued: each thread ends on one

    def forget_after_fork(self) -> None:
        """In a forked child the threads are gone, and what was queued for them with them."""
        self._begin()
