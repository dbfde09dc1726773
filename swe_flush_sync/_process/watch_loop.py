"""One thread serving trainers' control channels: the watchdog process's one pipe, a guard's many
connections. A ``Channel`` takes one trainer's lines, answers them and keeps its ledger record; a
``WatchLoop`` reads every channel (``selectors``), keeps their records' heartbeats and hands on
each channel that ends. Standard library only until a flush (the watchdog process imports it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from .._core.text import shown
from .liveness import LockFile
from .proc import alive
from .record import DEFAULT_HEARTBEAT, RecordKeeper
from .wire import (
    CANCEL,
    HELD,
    LEDGER,
    MAX_STATE_BYTES,
    OFFLOAD_BYTES,
    PROTOCOL,
    REFUSED,
    STATUS,
    BadLine,
    parse_line,
    write_all,
)

if TYPE_CHECKING:
    from swe_flush_sync import FlushReport

    from .._core.threads import Runner

STATUS_ONLY_BYTES: Final = 4096  # a longer line from a status-only connection ends it unparsed
SAY_TIMEOUT: Final = 0.5  # seconds a line to the inherited stderr may take (a reader that stopped reading)


def say(line: str) -> None:
    """One line on the inherited stderr, given up after ``SAY_TIMEOUT`` (a full or broken one)."""
    if sys.stderr is None:  # fd 2 was closed when the trainer started us
        return
    writer = threading.Thread(target=write_all, args=(2, (line + "\n").encode("utf-8", "replace")), daemon=True)
    writer.start()
    writer.join(SAY_TIMEOUT)


LedgerIO = Callable[["Channel", Callable[[], None]], None]
"""Runs one channel's record I/O (a write or a removal): a guard queues it on a writer thread."""


def trainer_name(state: dict[str, Any], peer_pid: int, uid: int | None, *, record: bool = False) -> str:
    """A trainer for an operator: its pid as its own PID namespace sees it (sent in its state; the
    peer's pid here is 0 across namespaces), its uid when known, its host (a pod's name: every
    sidecar trainer is pid 1) and, with ``record``, the first characters of the name of its record
    (the digest of its token, as a guard keeps it: ``guard-DIGEST.json``)."""
    said = [f"uid {uid}"] if uid is not None else []
    if isinstance(state.get("host"), str):
        said.append(shown(state["host"], 64))
    if record and isinstance(state.get("trainer"), str):
        said.append(f"record {state['trainer'][:8]}")
    return f"pid {state.get('pid') or peer_pid}" + (f" ({', '.join(said)})" if said else "")


class Channel:
    """One trainer's control channel: the lines it sends, our word back, its ledger record.

    ``strict`` (a guard's connection): a bad line is answered ``refused WHY``, and ends the channel
    unless it already holds a good state (``error`` says why). Otherwise (the watchdog's own pipe)
    a bad line is skipped. A guard passes its own ``ledger``, ``heartbeat`` and ``ledger_io``; the
    watchdog's ledger comes with the state, and its record is written before it says ``held``.
    """

    def __init__(self, read_fd: int, reply_fd: int, trainer_pid: int, *, trainer_uid: int | None = None,
                 strict: bool = False,
                 ledger: str | None = None, heartbeat: float = DEFAULT_HEARTBEAT,
                 check: Callable[[dict[str, Any], bool, int], dict[str, Any]] | None = None,
                 ledger_io: LedgerIO | None = None, status: Callable[[], bytes] | None = None,
                 locks: Callable[[Channel], dict[str, LockFile | None]] | None = None,
                 armed: Callable[[Channel], None] | None = None,
                 offload: Callable[[Channel, bytearray], None] | None = None,
                 recorded: Callable[[Channel], None] | None = None,
                 listener: Callable[[Channel], None] | None = None,
                 unlocked: Callable[[Channel], None] | None = None) -> None:
        self.read_fd = read_fd
        self.reply_fd = reply_fd
        self.trainer_pid = trainer_pid  # as this process's PID namespace sees it: 0 from another one
        self.trainer_uid = trainer_uid
        self.strict = strict
        self._ledger_folder = ledger if strict else None  # a guard's own --ledger; the pipe's comes with the state
        self._heartbeat = heartbeat
        self._check = check
        self._ledger_io = ledger_io
        self._status = status
        self._locks = locks
        self._armed = armed  # a guard: called with a trainer's first state taken, before "held"
        self.lock: LockFile | None = None  # the lock file a guard gave the trainer (see _process.liveness)
        self.lock_recorded = False  # a record naming ``lock`` was written (the trainer was told ``recorded``)
        self._recorded = recorded  # a guard: called (on its ledger thread) once a record names ``lock``
        self._listener = listener  # a guard: a successor asks for the listening socket
        self._unlocked = unlocked  # a guard: the trainer says it holds no lock of ours (lock_fd false)
        self.status_only = False  # a guard's connection past its peer limit: a status query or a successor's only
        self.trainer_start: int | None = None  # the trainer's start time, where its pid can be seen here
        self._offload = offload  # a guard parses lines over OFFLOAD_BYTES on a worker: the loop never waits on one
        self.parsing = False  # a line of this channel is being parsed elsewhere: the lines after it wait
        self.state: dict[str, Any] | None = None
        self.keeper: RecordKeeper | None = None  # keeps its trainer's record in the ledger folder, once it has one
        self.disarmed = False
        self.error: str | None = None
        self.next_beat = float("inf")
        self.pending = bytearray()  # the start of a line not yet ended
        self._skipping = False  # the rest of a line over the bound is dropped up to its end
        self._ledger_error: str | None = None
        os.set_blocking(reply_fd, False)  # a trainer that does not read our word never stops us

    @property
    def token(self) -> str | None:
        """The trainer's token as its check keeps it (a guard: its digest), None before its first state or
        from an older trainer."""
        token = (self.state or {}).get("trainer")
        return token if isinstance(token, str) else None

    @property
    def who(self) -> str:
        """The trainer for an operator (``trainer_name``)."""
        return trainer_name(self.state or {}, self.trainer_pid, self.trainer_uid, record=self.strict)

    def read(self) -> bool:
        """Take what can be read; False when the channel has ended (end-of-file, disarm, ``error``)."""
        try:
            chunk = os.read(self.read_fd, 1 << 18)
        except BlockingIOError:
            return True
        except OSError as exc:  # ECONNRESET: the peer is gone
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return True
            chunk = b""
        if not chunk:
            return False
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return True
            chunk, self._skipping = chunk[end + 1:], False
        start = len(self.pending)
        self.pending += chunk
        return self._take_lines(start)

    def _take_lines(self, start: int = 0) -> bool:
        """Take the lines ended in ``pending`` (from ``start``) until one is offloaded; False when it ends."""
        end = self.pending.find(b"\n", start)
        while end >= 0 and not self.parsing:
            line = self.pending[:end]
            del self.pending[:end + 1]
            if not self._take_guarded(line):
                return False
            end = self.pending.find(b"\n")
        if len(self.pending) > MAX_STATE_BYTES and not self.parsing:
            self.pending.clear()
            self._skipping = True
            return self.refuse_line(f"a line over {MAX_STATE_BYTES} bytes")
        return True

    def refuse_line(self, why: str, told: str | None = None) -> bool:
        """A line that cannot be taken (see the class); the peer is ``told`` why, else ``why``."""
        if not self.strict:
            return True
        self.tell(REFUSED + b" " + (why if told is None else told).encode("utf-8", "replace"))
        if self.state is None:
            self.error = why
            return False
        return True

    def _take_guarded(self, line: bytearray) -> bool:
        """``_take``, with whatever it raises ending only this line (and a strict channel)."""
        try:
            return self._take(line)
        except Exception as exc:  # noqa: BLE001 - what a peer sends never stops the loop
            return self.refuse_line(f"a message that raised {type(exc).__name__}")

    def _take(self, line: bytearray) -> bool:
        """Apply one line; False when the channel ends (disarm, or a strict channel's bad line)."""
        if line.endswith(CANCEL) or not line:
            return True  # a line the trainer could write only in part and then ended: the next one replaces it
        if self.status_only and len(line) > STATUS_ONLY_BYTES:
            return False
        if self._offload is not None and len(line) > OFFLOAD_BYTES:
            self.parsing = True
            self._offload(self, line)  # a copy of its own; taken back by take_parsed, on the loop's thread
            return True
        try:
            message = self.parse(line)
        except BadLine as exc:
            return self.refuse_line(str(exc))
        return self._apply(message, len(line))

    def parse(self, line: bytes | bytearray) -> dict[str, Any]:
        """``parse_line`` as this channel checks lines (any thread: it touches nothing of the channel's)."""
        return parse_line(line, self.strict)

    def take_parsed(self, parsed: dict[str, Any] | BadLine, size: int) -> bool:
        """Apply a line parsed elsewhere, then the lines behind it; False when the channel ends."""
        self.parsing = False
        try:
            alive = self.refuse_line(str(parsed)) if isinstance(parsed, BadLine) else self._apply(parsed, size)
        except Exception as exc:  # noqa: BLE001 - what a peer sends never stops the loop
            alive = self.refuse_line(f"a message that raised {type(exc).__name__}")
        return alive and self._take_lines()

    def _apply(self, message: dict[str, Any], size: int) -> bool:
        """Apply one parsed message; False when the channel ends."""
        if message.get("disarm") is True:
            self.disarmed = True
            return False
        if message.get("listener") is True and self._listener is not None:  # a successor guard: its
            self._listener(self)  # connection stays open for its life (its end is the successor's death)
            return True
        if message.get("status") is True:  # a probe (swe-flush guard --status): how many trainers are held
            self.tell(STATUS + b" %d " % os.getpid() + (self._status() if self._status else b"1"))
            return True
        if self.status_only:  # a trainer past the peer limit: closed, as if never accepted
            return False
        state, seq = message.get("state"), message.get("seq")
        if not isinstance(state, dict) or isinstance(seq, bool) or not isinstance(seq, int):
            return self.refuse_line("a message of the wrong shape")
        if self._check is not None:
            try:
                state = self._check(state, self.state is None, size)
            except ValueError as exc:
                return self.refuse_line(f"a state it refused: {exc}", told=str(exc))
        if self.token is not None and state.get("trainer") != self.token:
            return self.refuse_line("a state of another trainer")
        first = self.state is None
        self.state = state
        if first and self._armed is not None:
            self._armed(self)
        elif self.lock is not None and state.get("lock_fd") is False and self._unlocked is not None:
            self._unlocked(self)  # before the record is written again: it names no lock from now on
        self.keep_record(state)  # first: once watchdog() or refresh() returns, recover() can see it
        if first and self.keeper is not None:
            self._run_ledger_io(self.keeper.remove_older)
        version = message.get("v")
        protocol = b" %d" % PROTOCOL if isinstance(version, int) and version >= 2 else b""  # 0.5.0 reads 2 words
        self.tell(HELD + b" %d %d" % (seq, os.getpid()) + protocol)
        return True

    def tell(self, word: bytes) -> None:
        """One line to the trainer; dropped when the trainer is gone or has not read for long."""
        with contextlib.suppress(OSError):
            os.write(self.reply_fd, word + b"\n")

    def keep_record(self, state: dict[str, Any] | None = None) -> None:
        """Write the ledger record (with ``state``, else a heartbeat)."""
        if self.keeper is None and state is not None:
            if self.strict:
                folder, heartbeat = self._ledger_folder, self._heartbeat
            else:
                folder, heartbeat = state.get("ledger"), _positive(state.get("heartbeat"), DEFAULT_HEARTBEAT)
            if isinstance(folder, str):
                self.keeper = RecordKeeper(folder, self.trainer_pid, heartbeat, self.token if self.strict else None,
                                            self._locks(self) if self._locks is not None else None)
        if self.keeper is None:
            return
        if state is not None:
            self.keeper.update(state)
        self.next_beat = time.monotonic() + self.keeper.heartbeat
        self._run_ledger_io(self._write_record)

    def _write_record(self) -> None:
        """Write the record; the first write that names the trainer's lock is said (``recorded``)."""
        assert self.keeper is not None
        self.keeper.write()
        if self.lock is not None and not self.lock_recorded and self._recorded is not None:
            self.lock_recorded = True
            self._recorded(self)

    def trainer_alive(self) -> bool | None:
        """Is the trainer's pid still the process that connected? None where it cannot be seen."""
        return alive(self.trainer_pid, self.trainer_start) if self.trainer_start is not None else None

    def _run_ledger_io(self, job: Callable[[], None]) -> None:
        """Run a record write or removal (a guard queues it), saying each new failure once."""
        if self._ledger_io is not None:
            self._ledger_io(self, job)
            return
        error = io_error(job)
        if error != self._ledger_error:
            self._ledger_error = error
            self.tell(LEDGER + b" " + (b"ok" if error is None else error.encode("utf-8", "replace")))
            if error is not None:
                say(f"swe-flush watchdog for pid {self.trainer_pid}: cannot write the ledger record: {error}")

    def mark_gone(self) -> None:
        """Say in the record that the trainer is gone and not yet flushed, so any recover may take it."""
        if self.keeper is not None:
            self.keeper.gone = True
            self._run_ledger_io(self._write_record)

    def settle(self, report: FlushReport | None, *, now: bool = False) -> None:
        """Remove the record after a flush that succeeded (or nothing to flush, or a disarm); ``now``: in
        this thread at once (a guard's flush worker: a guard killed a moment later leaves no record of a
        death it flushed), else in turn with the record's writes."""
        if self.keeper is not None and (report is None or report.ok):
            if now:
                io_error(self.keeper.remove)
            else:
                self._run_ledger_io(self.keeper.remove)


def flush_state(state: dict[str, Any] | None, pairs: Mapping[str, tuple[str, ...]] | None = None, *,
                max_workers: int | None = None, retries: int | None = None, connect_timeout: float | None = None,
                workers: Runner | None = None) -> FlushReport | None:
    """Flush a channel's last ``state`` (or its ``pairs``: server -> ids) without logging; None when there
    were none. ``max_workers`` and ``connect_timeout`` cap the trainer's, ``retries`` replaces its,
    ``workers`` send them (a guard's shared HTTP workers)."""
    if state is None or not state.get("ids") or not state.get("urls"):
        return None
    from swe_flush_sync._core.groups import flush_groups  # imported only now: the watchdog's wait stays lean
    from swe_flush_sync._core.options import FlushOptions

    tokens = state.get("tokens")
    options = dict(state.get("options") or {})
    if isinstance(tokens, dict):
        options["bearer"] = tokens.__getitem__  # a missing token fails that pair only
    if max_workers is not None:
        options["max_workers"] = min(options.get("max_workers") or max_workers, max_workers)
    if retries is not None:
        options["retries"] = retries
    if connect_timeout is not None:
        options["connect_timeout"] = min(options.get("connect_timeout") or connect_timeout, connect_timeout)
    groups: Mapping[tuple[str, ...], Iterable[str]] = {tuple(state["urls"]): state["ids"]} if pairs is None \
        else {(url,): ids for url, ids in pairs.items()}
    return flush_groups(groups, FlushOptions(**options, linger=0.0), workers)


def _disarm_before_end(channel: Channel) -> bool:
    """Of a channel whose peer hung up while a line of it was parsed elsewhere: did a disarm come after
    that line (read now, to the end; only short lines are parsed)?"""
    rest = bytearray(channel.pending)
    with contextlib.suppress(OSError):
        while chunk := os.read(channel.read_fd, 1 << 18):
            rest += chunk
            if len(rest) > MAX_STATE_BYTES:
                break
    for line in rest.split(b"\n")[:-1]:
        with contextlib.suppress(BadLine):
            if len(line) <= OFFLOAD_BYTES and channel.parse(line).get("disarm") is True:
                return True
    return False


def io_error(job: Callable[[], None]) -> str | None:
    """Run the file I/O ``job``; why it failed (the ``OSError``'s text), or None when it did not."""
    try:
        job()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _positive(value: Any, default: float) -> float:
    """``value`` if it is a finite number of seconds above 0.05, else ``default``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.05 <= value < float("inf"):
        return default
    return float(value)


class WatchLoop:
    """One thread, many channels (``selectors``): reads them, keeps their heartbeats, and hands each
    one that ends to ``on_end``. ``max_pending`` bounds the bytes of unfinished lines over all
    channels: a read that would pass it counts as a bad line.
    """

    def __init__(self, on_end: Callable[[Channel], None], max_pending: int = 4 * MAX_STATE_BYTES) -> None:
        self.selector = selectors.DefaultSelector()
        self.channels: list[Channel] = []
        self.pending = 0  # bytes of unfinished lines held over all channels
        self.max_pending = max_pending
        self._on_end = on_end
        # Paused channels that hold a state, watched only for their peer's hang-up: a trainer that dies
        # while a line of it is parsed elsewhere is flushed from the state it holds, without waiting.
        self._hangups: dict[int, Channel] = {}
        self._hangup_poll = select.epoll() if hasattr(select, "epoll") else None
        if self._hangup_poll is not None:
            self.watch(self._hangup_poll.fileno(), self._hung_up)

    def add(self, channel: Channel) -> None:
        self.selector.register(channel.read_fd, selectors.EVENT_READ, channel)
        self.channels.append(channel)

    def watch(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready`` whenever ``fd`` is readable (a listening socket, a signal's wake-up pipe)."""
        self.selector.register(fd, selectors.EVENT_READ, on_ready)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def pause(self, channel: Channel) -> None:
        """Read no more of ``channel`` until ``resume`` (a line of it is parsed elsewhere meanwhile); a
        hang-up of a channel holding a state still ends it."""
        self.unwatch(channel.read_fd)
        if self._hangup_poll is not None and channel.state is not None:
            with contextlib.suppress(OSError):
                self._hangup_poll.register(channel.read_fd, select.EPOLLRDHUP)
                self._hangups[channel.read_fd] = channel

    def _stop_hangup_watch(self, channel: Channel) -> None:
        if self._hangups.pop(channel.read_fd, None) is not None and self._hangup_poll is not None:
            with contextlib.suppress(OSError):
                self._hangup_poll.unregister(channel.read_fd)

    def _hung_up(self) -> None:
        """Paused channels whose peer hung up: ended now, disarmed if a disarm came before the end."""
        assert self._hangup_poll is not None
        for fd, _ in self._hangup_poll.poll(0):
            channel = self._hangups.get(fd)
            if channel is None:
                continue
            self._stop_hangup_watch(channel)
            if channel in self.channels:
                channel.disarmed = _disarm_before_end(channel)
                self.end(channel)

    def resume(self, channel: Channel) -> None:
        self._stop_hangup_watch(channel)
        if channel in self.channels:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.register(channel.read_fd, selectors.EVENT_READ, channel)

    def take_parsed(self, channel: Channel, parsed: dict[str, Any] | BadLine, size: int) -> None:
        """Hand ``channel`` a line parsed elsewhere (on the loop's thread) and read it again, or end it."""
        if channel not in self.channels:
            return  # ended meanwhile
        before = len(channel.pending)
        alive = channel.take_parsed(parsed, size)
        self.pending += len(channel.pending) - before
        if not alive:
            self.end(channel)
        elif not channel.parsing:
            self.resume(channel)

    def end(self, channel: Channel) -> None:
        self._stop_hangup_watch(channel)
        self.unwatch(channel.read_fd)
        self.channels.remove(channel)
        self.pending -= len(channel.pending)
        channel.pending = bytearray()
        self._on_end(channel)

    def _serve(self, channel: Channel) -> None:
        before = len(channel.pending)
        try:
            alive = channel.read()
        except Exception as exc:  # noqa: BLE001 - a second wall: one channel's fault ends that channel only
            channel.error = f"a message that raised {type(exc).__name__}"
            alive = False
        if alive and self.pending + len(channel.pending) - before > self.max_pending:
            alive = channel.refuse_line(f"more than the {self.max_pending >> 20} MiB all peers' unfinished lines "
                                        "may hold")
        self.pending += len(channel.pending) - before
        if not alive:
            self.end(channel)

    def run_once(self, timeout: float | None = None) -> None:
        """Wait for something to read (at most ``timeout``, and never past a heartbeat); handle it."""
        beats = [channel.next_beat for channel in self.channels]
        if beats and min(beats) != float("inf"):
            left = max(min(beats) - time.monotonic(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        for key, _ in self.selector.select(timeout):
            if isinstance(key.data, Channel):
                if key.data in self.channels:  # not ended meanwhile by a callback of this round
                    self._serve(key.data)
            else:
                key.data()
        now = time.monotonic()
        for channel in self.channels:
            if channel.next_beat <= now:
                channel.keep_record()
