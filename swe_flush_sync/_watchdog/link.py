"""The trainer's line link to its watchdog or guard (the protocol is ``_process.wire``'s): its ends, what is
still to be written, and what the far end said it holds. A newer state replaces one not written
yet; a line cut by that is ended with ``CANCEL`` first, and the far end drops it.

Threads: every read and write of a link's buffers and ends happens under ``LOCK`` (one for all
links; the signal hooks take it too), which is never held while user code runs or while a thread
waits. One thread at a time reads a link's answers (its reader: the guard's follower thread, or a
thread waiting for a word); the others wait on ``HEARD``, which the reader notifies whenever it
hears something, loses the link or stops reading. ``LOCK``, ``HEARD`` and ``FORK_LOCK`` are new
objects in a forked child: use them as attributes of this module, never imported by name.

Signal handlers: ``LOCK`` is re-entrant, so a handler that runs as the main thread's ``os.write``
returns (before the write is counted) may use the link too. It finds the line cut (``_cut`` is
True while a write is under way): what it queues, or the message it writes again, starts by ending
that line, and the interrupted write leaves the outbox to it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Final

from .._process.ownership import HeldLocks
from .._process.wire import CANCEL, HELD, LOCK_WORD, PROTOCOL, RECORDED, REFUSED, receive_with_fds

_DISARM: Final = b'{"disarm": true}\n'
_END_CUT_LINE: Final = CANCEL + b"\n"

# Re-entrant: a signal hook may run while the main thread holds it.
LOCK = threading.RLock()
HEARD = threading.Condition(LOCK)  # notified when a link's reader heard a word, lost the link or stopped reading
# Held while ends exist that no link has taken yet; os.fork() waits for it (at-fork hook), so a
# child forked by another thread meanwhile never keeps a write end open.
FORK_LOCK = threading.RLock()
_open_ends: set[Fd] = set()  # ends of ours that are open: a forked child closes them
_links: weakref.WeakSet[Link] = weakref.WeakSet()  # a forked child forgets them all


class Fd:
    """A descriptor we opened, with its identity: a number reused by others never gets our writes or closes."""

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
    def pipe(cls) -> tuple[Fd, Fd]:
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
    """The far end has ended, or our end is no longer ours."""


class Link:
    """One watchdog's link: call every method but ``wait`` and ``confirm`` with ``LOCK`` held.
    ``hear(word, rest)`` takes each line but ``held`` and ``refused`` (``LOCK`` held)."""

    def __init__(self, hear: Callable[[bytes, bytes], None]) -> None:
        self._hear = hear
        self._control: Fd | None = None  # where we write (a pipe's write end, or the guard's socket)
        self._ready: Fd | None = None  # where we read its words; end-of-file at its end
        self._inbox = b""  # a line of the far end's not read whole yet
        self._reader: int | None = None  # the thread that reads the far end's words now (see wait)
        self._outbox = bytearray()  # what is still to be written: at most one message (after a cut line's end)
        self._message = b""  # ... and that message whole
        self._replaced = 0  # how many times the outbox was replaced
        self._cut = False  # what was written so far ends in the middle of a line (True while a write is under way)
        self._writing = False  # a write is under way: a signal handler runs as os.write returns
        self.retired = False  # set by a disarm: the link is never opened again
        self.payload = b""  # the state last queued
        self.pairs: frozenset[tuple[str, str]] = frozenset()  # ... and its (server, id) pairs
        self.seq = 0  # its number
        self.held = 0  # the number of the newest state the far end said it holds whole
        self.written = 0  # bytes written in all
        self.pid = 0  # the far end's pid, as its last "held" said
        self.protocol = PROTOCOL  # the far end's protocol, as its last "held" said
        self.refused: str | None = None  # why the far end refused the state last queued
        self.refused_payload = b""  # ... and that state
        self.refused_at = 0.0  # ... and when
        self._passes_fds = False  # the ready end is a guard's socket: read with the descriptors it passes
        self._passed: list[Fd] = []  # descriptors passed, not yet named by a word
        self.locks = HeldLocks()  # the locks guards passed ("lock"), held while this process lives (see ownership)
        self.lock_missing = False  # this connection's lock did not arrive (or other code closed it): none asked
        _links.add(self)

    @property
    def open(self) -> bool:
        """Are the ends open (not lost, closed or never opened)?"""
        return self._ready is not None

    @property
    def caught_up(self) -> bool:
        """Is everything written, and the newest state held?"""
        return self.held == self.seq and not self._outbox

    @property
    def unwritten(self) -> bool:
        """Does something still wait to be written?"""
        return bool(self._outbox)

    def take_ends(self, control: Fd, ready: Fd, *, passes_fds: bool = False) -> None:
        """Use these fresh ends (non-blocking): nothing is owed to them yet. ``passes_fds``: ``ready``
        is a guard's socket, which passes lock descriptors."""
        self._control, self._ready, self.held, self._inbox, self._cut = control, ready, self.seq, b"", False
        self._passes_fds, self.lock_missing = passes_fds, False
        HEARD.notify_all()

    def queue(self, payload: bytes, pairs: frozenset[tuple[str, str]]) -> None:
        """Make ``payload`` the next state to write, in place of any not written yet."""
        self.seq += 1
        self.payload, self.pairs = payload, pairs
        self._replace_outbox(b'{"seq": %d, "v": %d, "state": %s}\n' % (self.seq, PROTOCOL, payload))

    def queue_disarm(self) -> None:
        """Make a disarm the next message, in place of any state not written yet."""
        self._replace_outbox(_DISARM)

    def _replace_outbox(self, message: bytes) -> None:
        self._message, self._replaced = message, self._replaced + 1
        self._outbox[:] = (_END_CUT_LINE if self._cut else b"") + message  # a cut line is ended: the far end drops it

    def talk(self) -> bool:
        """Read the far end's words (unless another thread reads) and write what fits; False when not open."""
        if self._control is None or self._ready is None:
            return False
        try:
            if self._reader in (None, threading.get_ident()):
                self._read_words(self._ready)
            self._write_outbox(self._control)
        except _Lost:
            self.close()
            HEARD.notify_all()
            return False
        return self.open  # (a signal handler may have closed it meanwhile)

    def _read_words(self, ready: Fd) -> None:
        if not ready.ours():
            raise _Lost
        ended = False
        while True:
            try:
                chunk = self._read(ready)
            except BlockingIOError:
                break
            except OSError:  # ECONNRESET: as good as the end
                chunk = b""
            if not chunk:
                ended = True
                break
            self._inbox += chunk
        *lines, self._inbox = self._inbox.split(b"\n")
        for line in lines:  # before a loss is raised: a guard says why it refused, then closes
            self._take_word(line)
        if lines:
            HEARD.notify_all()
        if ended:
            raise _Lost

    def _read(self, ready: Fd) -> bytes:
        """One read of the far end's words, taking the descriptors a guard passes with them. Those are
        registered before any fork (``FORK_LOCK``, tried only: the thread that opens ends takes it
        before ``LOCK``), so a forked child closes its copies; a busy ``FORK_LOCK`` reads later."""
        if not self._passes_fds:
            return os.read(ready.fd, 4096)
        if not FORK_LOCK.acquire(blocking=False):
            raise BlockingIOError
        try:
            chunk, fds, truncated = receive_with_fds(ready.fd, 4096)
            if truncated:  # descriptors lost (no free one here): none of this read's is held; its lock
                for fd in fds:  # word finds none, and the trainer says so (``lock_missing``)
                    os.close(fd)
                fds = []
            self._passed.extend(Fd(fd) for fd in fds)
        finally:
            FORK_LOCK.release()
        return chunk

    def _take_word(self, line: bytes) -> None:
        word, _, rest = line.partition(b" ")
        if word == HELD:
            seq, pid, *protocol = rest.split(b" ")
            if seq.isdigit() and pid.isdigit():
                self.held, self.pid = max(self.held, int(seq)), int(pid)
                self.protocol = int(protocol[0]) if protocol and protocol[0].isdigit() else 1
                self.refused = None
        elif word == LOCK_WORD:  # the newest lock; the one before is kept until this one is on record
            if self._passed:
                self.locks.take(self._passed.pop(0))
            else:  # its descriptor did not arrive: the trainer says so in its next state (see lock_wanted)
                self.lock_missing = True
        elif word == RECORDED:  # the newest lock's guard wrote the record naming it: the older ones go
            self.locks.recorded()
        elif word == REFUSED:
            self.refused, self.refused_payload = rest.decode("utf-8", "replace"), self.payload
            self.refused_at = time.monotonic()
        else:
            self._hear(word, rest)

    def _write_outbox(self, control: Fd) -> None:
        """Write what fits (re-entered by a signal handler: see the module's docstring)."""
        if self._writing:  # a handler, as our os.write returned: what it wrote is unknown, the message starts over
            self._replace_outbox(self._message)
        while self._outbox:
            if not control.ours():
                raise _Lost
            cut, replaced, self._cut, self._writing = self._cut, self._replaced, True, True
            try:
                written = os.write(control.fd, self._outbox)
            except BlockingIOError:
                self._cut = cut
                return
            except OSError:  # EPIPE: the far end is gone
                raise _Lost from None
            finally:
                self._writing = False
            if replaced == self._replaced:
                self._cut = self._outbox[written - 1:written] != b"\n"
                del self._outbox[:written]
            self.written += written

    def confirm(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until everything is written and the newest state held; True if so."""
        return self.wait(lambda: self.caught_up, timeout)

    def wait(self, satisfied: Callable[[], bool], timeout: float) -> bool:
        """Talk until ``satisfied()``, a loss or ``timeout``; True when satisfied. Call it without ``LOCK``.

        One thread at a time is the reader and polls the ready end; the others wait on ``HEARD`` (or
        poll the control end alone for room), so none races the reader for a word.
        """
        me = threading.get_ident()
        give_up_at = time.monotonic() + timeout
        reading = False
        try:
            while True:
                with LOCK:
                    if self._reader is None:
                        self._reader, reading = me, True
                    if not self.talk():
                        return False
                    if satisfied():
                        return True
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        return False
                    if self._reader != me and not self._outbox:
                        HEARD.wait(left)  # the reader hears for us
                        continue
                    if self._control is None or self._ready is None:  # closed by a signal handler meanwhile
                        return False
                    ready = self._ready.fd if self._reader == me else None
                    control = self._control.fd if self._outbox else None
                if not _wait_for(ready, control, left):  # closed meanwhile by a disarm in another thread
                    return False
        finally:
            if reading:
                with LOCK:
                    if self._reader == me:
                        self._reader = None
                    HEARD.notify_all()  # a waiter may take over the reading

    def close(self) -> None:
        """Close both ends (at the end-of-file, the far end flushes unless disarmed)."""
        for end in (self._control, self._ready):
            if end is not None:
                end.close()
        self._control = self._ready = None
        self._outbox.clear()
        self._cut = False
        for passed in self._passed:  # a guard's lock whose word was not read yet: the newest lock held (the
            self.locks.take(passed)  # guard may have named it in a record), marked when a disarm or a newer
        self._passed.clear()  # guard's record lets it go; closed unmarked, a successor took the trainer for dead

    def release_lock(self) -> None:
        """A disarm: the locks guards passed are marked ``disarmed`` and let go (no guard need prove
        this trainer alive any more, and none that finds them free flushes it)."""
        self.locks.disarm()

    def forget_in_child(self) -> None:
        """In a forked child: the ends, the lock (its copy closed with the ends) and the reader are the parent's."""
        self._control = self._ready = None
        self._reader = None
        self.locks.forget()
        self._passed = []
        self.retired = True


def _wait_for(read_fd: int | None, write_fd: int | None, timeout: float) -> bool:
    """Poll until ``read_fd`` is readable or ``write_fd`` writable; False when one was closed meanwhile."""
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


def _before_fork() -> None:
    FORK_LOCK.acquire()


def _after_fork_in_parent() -> None:
    FORK_LOCK.release()


def _after_fork_in_child() -> None:
    global LOCK, HEARD, FORK_LOCK
    LOCK = threading.RLock()
    HEARD = threading.Condition(LOCK)
    FORK_LOCK = threading.RLock()
    for end in list(_open_ends):  # the links' ends, and any made for a watchdog still arming
        end.close()
    for link in list(_links):
        link.forget_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
