"""The live Flushers, for the signal and exit hooks (every request given up) and forks (a child
forgets its parent's pools).

Kept with one ``dict`` operation at a time and walked over a snapshot (``list(dict.values())``, one
C call), so that a signal handler that makes a Flusher while a hook walks them changes nothing under
its feet (a ``WeakSet`` walked in Python raised "Set changed size during iteration", and the hook
flushed nothing).
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref
from typing import Protocol


class Live(Protocol):
    def abandon_in_flight(self, reason: str) -> None: ...

    def _forget_after_fork(self) -> None: ...


_live: dict[int, weakref.ref[Live]] = {}
_keys = itertools.count()


def register(flusher: Live) -> int:
    """Count ``flusher`` among the live ones until ``unregister`` or its end; the key to unregister it."""
    key = next(_keys)
    _live[key] = weakref.ref(flusher, functools.partial(_forget, key))
    return key


def unregister(key: int) -> None:
    _live.pop(key, None)


def _forget(key: int, _: object) -> None:
    _live.pop(key, None)


def _flushers() -> list[Live]:
    return [flusher for ref in list(_live.values()) if (flusher := ref()) is not None]


def abandon_all_in_flight(reason: str = "given up at interpreter exit") -> None:
    """Give up every request of every live Flusher (interpreter shutdown, signal handlers)."""
    for flusher in _flushers():
        flusher.abandon_in_flight(reason)


def _after_fork_in_child() -> None:
    for flusher in _flushers():
        flusher._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
