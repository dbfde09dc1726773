"""Threads the library starts inside a trainer never take the trainer's signals.

CPython runs Python signal handlers only in the main thread, once it gets past its current
blocking call. A process-directed SIGTERM that the kernel delivers to another thread (any that
does not block it) interrupts nothing: the main thread's ``sleep``, ``lock.acquire`` or
``readline`` goes on, and ``flush_on_signal`` runs only when that call returns (seen on Python
3.14 and 3.15). So every thread the library starts blocks every asynchronous signal: a plain
thread is started while its creator blocks them (a new thread inherits its creator's mask), an
executor's workers block them first thing (``block_signals`` as the initializer). Faults that the
kernel sends to the thread that caused them (SIGSEGV, SIGBUS, ...) stay unblocked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

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
