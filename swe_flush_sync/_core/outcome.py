"""``Gate`` and ``Outcome``: ``threading.Event`` and ``concurrent.futures.Future`` without their locks.

A signal handler may run in the main thread at any bytecode, also while that thread is inside one
of these. ``Event.set`` holds its Condition's plain ``Lock`` while Python code runs, and a handler
that set the same Event waited on that lock for ever. A ``Future`` holds its Condition's lock in
``add_done_callback``, ``cancel`` and ``done``: a worker finishing the future waited on it behind
the interrupted main thread, and a handler waiting for that future waited out its whole deadline.
Here every step is one C-level operation that never waits (an attribute, a non-blocking
``Lock.acquire``, a ``SimpleQueue``), and the only waits are a C-level lock's, released by the
thread that finishes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Generic, TypeVar

T = TypeVar("T")


class Gate:
    """``threading.Event``'s part the library uses: ``set`` from any thread or handler, ``wait`` anywhere."""

    def __init__(self) -> None:
        self._flag = False
        self._bell = threading.Lock()  # released once set (held again only for a moment by each waiter)
        self._bell.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(RuntimeError):  # released already (a second set, or a waiter's release)
            self._bell.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for ``set``; whether it is set."""
        if not self._flag and self._bell.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            with contextlib.suppress(RuntimeError):  # (left released for the next waiter)
                self._bell.release()
        return self._flag


class Outcome(Generic[T]):
    """The outcome of one call run on another thread: ``concurrent.futures.Future``'s part the library
    uses, with the same meanings, lock-free.

    The call is claimed once, without waiting: by the thread that runs it
    (``set_running_or_notify_cancel``) or by ``cancel``. Callbacks wait on a ``SimpleQueue``; the
    thread that finishes the outcome, and any that adds one afterwards, take them off one at a time,
    so each runs once (in whichever thread took it).
    """

    def __init__(self) -> None:
        self._claim = threading.Lock()
        self._cancelled = False
        self._finished = Gate()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: queue.SimpleQueue[Callable[[Outcome[T]], object]] = queue.SimpleQueue()

    def set_running_or_notify_cancel(self) -> bool:
        """Claim the call to run it: False when it was cancelled (or claimed) already."""
        return self._claim.acquire(blocking=False)

    def cancel(self) -> bool:
        """Cancel the call unless it runs or ran; whether it is cancelled."""
        if self._claim.acquire(blocking=False):
            self._cancelled = True
            self._finish()
        return self._cancelled

    def run(self, call: Callable[[], T]) -> None:
        """Run ``call`` into this outcome, unless it was cancelled or another thread claimed it; what
        ``call`` raises (a bug) is carried to the waiter, as an executor does."""
        if not self.set_running_or_notify_cancel():
            return
        try:
            self.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - carried, not swallowed
            self.set_exception(exc)

    def set_result(self, value: T) -> None:
        self._value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def done(self) -> bool:
        return self._finished.is_set()

    def cancelled(self) -> bool:
        return self._cancelled

    def result(self, timeout: float | None = None) -> T:
        """The call's value (waiting up to ``timeout`` seconds; None: for ever).

        Raises:
            TimeoutError: not finished in time. concurrent.futures.CancelledError: cancelled.
            The call's own exception.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError("the call has not finished")
        if self._cancelled:
            raise CancelledError()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def add_done_callback(self, callback: Callable[[Outcome[T]], object]) -> None:
        """Call ``callback(self)`` once it is done (at once, here, if it is)."""
        self._callbacks.put(callback)
        if self._finished.is_set():
            self._call_back()

    def _finish(self) -> None:
        self._finished.set()
        self._call_back()

    def _call_back(self) -> None:
        while True:
            try:
                callback = self._callbacks.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):  # as a Future does (it logs them): the others still run
                callback(self)
