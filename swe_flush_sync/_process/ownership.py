"""Who owns a trainer, at every instant: the protocol between a trainer's link, guard A, its successor
B, the ledger record and ``recover`` (docs/architecture.md draws it as a table).

A trainer armed through a guard holds an exclusive ``flock`` on a lock file the guard made and passed
to it (``_process.liveness``); the guard's ledger record names that file. Whoever judges the trainer
reads the lock, never a timer:

- **The trainer keeps its old lock until the new one is on record.** When it arms with B, B passes a
  new lock (``lock``), writes the record naming it, and only then says ``recorded``; until that word
  the trainer holds both, so the record on disk (A's, or B's) always names a lock it holds. On
  ``recorded`` it marks every older lock ``handed`` and lets it go (``HeldLocks``).
- **A disarm is written into the lock before the lock goes** (``disarmed``), whether or not a guard
  answers: a successor or ``recover`` that finds the lock free and so marked removes the record and
  flushes nothing.
- **A free lock is a death only while the pid is not alive here.** A free, unmarked lock whose
  trainer (pid and start time, in this host, boot and PID namespace) still runs proves nothing
  (``judge``): the trainer is judged by its pids and heartbeat, as a lockless one is.
- **A held lock is life only while the pid may be alive.** A lock still held once the trainer's pid
  is proven gone here (a child that kept the descriptor, another process of its uid that took the
  file) is a death: the guard says who holds it and flushes.
- **A guard judges only the trainers whose connection ended on it** without a disarm, and stops at a
  lock marked ``handed`` or a live pid: the trainer is another guard's now. One that it closed at the
  end of its drain (handed over) it never judges.

States of one trainer (the owner is who flushes it if it dies now):

| state | trainer holds | record names | owner |
| --- | --- | --- | --- |
| armed with A | A's lock | A's lock | A (its connection's end-of-file) |
| A draining, B listening | A's lock | A's lock | A, until A's drain ends and A closes the connection |
| re-armed with B, not yet on record | A's and B's locks | A's lock | B (its connection) |
| on B's record (``recorded``) | B's lock (A's marked ``handed``) | B's lock | B |
| disarmed | nothing (every lock marked ``disarmed``) | nothing, or a lock marked ``disarmed`` | nobody |
| dead, its guard alive | nothing | its guard's lock (held) | that guard |
| dead, every guard gone | nothing | a free, unmarked lock | the first ``recover`` or guard to claim the record |

Standard library only (the watchdog process imports it).
"""

from __future__ import annotations

import contextlib
import os
from enum import Enum
from typing import Final, Protocol

from .liveness import DISARMED_MARK, HANDED_MARK, LockState

MAX_PREVIOUS_LOCKS: Final = 4  # older locks a trainer keeps until a guard says ``recorded`` (an old guard never does)


class Verdict(Enum):
    """What a trainer's lock (and pid, where it can be seen) lets a judge conclude."""

    ALIVE = "alive"  # its lock is held (and its pid alive here, or unseen)
    DEAD = "dead"  # its lock is free and unmarked, and its pid is not alive here (or cannot be seen); or
    # its lock is held and its pid is proven gone (pid and start time): the holder outlived the trainer
    DISARMED = "disarmed"  # it disarmed before it let its lock go: never flushed; its record may go
    HANDED = "handed"  # it let this lock go for a newer guard's: not a death of this lock's guard
    UNKNOWN = "unknown"  # nothing proven: judged by its pids and heartbeat


def judge(lock: LockState, pid_alive: bool | None) -> Verdict:
    """The verdict on a trainer from its lock's state and whether its pid is alive here (None: unseen)."""
    if lock is LockState.HELD:  # ... by the trainer, unless its pid is proven gone: then by a process that
        return Verdict.DEAD if pid_alive is False else Verdict.ALIVE  # outlived it (a child, one of its uid)
    if lock is LockState.DISARMED:
        return Verdict.DISARMED
    if lock is LockState.HANDED:
        return Verdict.HANDED
    if lock is LockState.FREE:
        return Verdict.UNKNOWN if pid_alive else Verdict.DEAD
    return Verdict.UNKNOWN


class Descriptor(Protocol):
    """A descriptor the trainer holds (``_watchdog.link.Fd``)."""

    fd: int

    def ours(self) -> bool: ...

    def close(self) -> None: ...


class HeldLocks:
    """The trainer's side: the newest lock a guard passed, and the older ones kept until it is on record."""

    def __init__(self) -> None:
        self.newest: Descriptor | None = None
        self.previous: list[Descriptor] = []
        self.on_record = False  # the newest lock's guard said ``recorded``

    def take(self, lock: Descriptor) -> None:
        """A guard passed ``lock``: the newest now; the older ones are kept until ``recorded``."""
        if self.newest is not None:
            self.previous.append(self.newest)
        self.newest, self.on_record = lock, False
        while len(self.previous) > MAX_PREVIOUS_LOCKS:
            _let_go(self.previous.pop(0), HANDED_MARK)

    def recorded(self) -> None:
        """The newest lock's guard wrote the record naming it: the older ones are let go, marked ``handed``."""
        previous, self.previous, self.on_record = self.previous, [], True
        for lock in previous:
            _let_go(lock, HANDED_MARK)

    def disarm(self) -> None:
        """A disarm: every lock marked ``disarmed``, then let go."""
        locks = [*self.previous, *([self.newest] if self.newest is not None else [])]
        self.newest, self.previous = None, []
        for lock in locks:
            _let_go(lock, DISARMED_MARK)

    def forget(self) -> None:
        """In a forked child: the locks are the parent's (the at-fork hook closed the child's copies)."""
        self.newest, self.previous = None, []


def _let_go(lock: Descriptor, mark: bytes) -> None:
    """Write ``mark`` into the lock file (through the descriptor: no path is trusted), then close it."""
    if lock.ours():
        with contextlib.suppress(OSError):
            os.pwrite(lock.fd, mark, 0)
    lock.close()
