"""A ledger record: one trainer's servers and ids (never a secret), and how to tell it is gone.

A watchdog or a guard keeps one record a trainer in the ledger folder (``RecordKeeper``: written
at each state and heartbeat, removed once flushed); ``recover`` reads them (``Record.read``) and
flushes those whose owner is gone. Standard library only (the watchdog process imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypedDict

from .._core.errors import ConfigError
from .._core.resolve import normalize_instance_ids, normalize_server_urls
from .._core.text import shown
from .liveness import LockFile, LockState, is_held, lock_state, record_lock
from .ownership import Verdict, judge
from .proc import Place, alive, process_start_time
from .trust import ownership_problem
from .wire import MAX_STATE_BYTES

RECORD_VERSION: Final = 1
RECORD_SUFFIX: Final = ".json"
GUARD_RECORD_PREFIX: Final = "trainer-"  # a guard's record: trainer-<the token's digest>.json, one per trainer
DEFAULT_HEARTBEAT: Final = 10.0  # seconds between two heartbeats of a record
STALE_HEARTBEATS: Final = 3  # an owner elsewhere is gone when its heartbeat is older than this many intervals


class BadRecord(Exception):
    """A record that cannot be used; the message says why (never its content). Moved aside."""


class UntrustedRecord(Exception):
    """A record that someone else could have written; the message says why. Left alone."""


@dataclass(frozen=True, slots=True)
class Record:
    """One trainer's record: where its ids live and how to tell whether it is gone.

    ``set_aside`` (read only) says why some of the values in the file's ids were not taken.
    """

    urls: tuple[str, ...]
    ids: tuple[str, ...]
    place: Place
    pid: int
    start_time: int | None
    watchdog_pid: int | None  # its keeper: a watchdog, or a guard
    watchdog_start_time: int | None
    heartbeat: float
    heartbeat_interval: float
    trainer: str | None = None  # the trainer's token's digest (a guard's record), None for a watchdog's
    gone: bool = False  # its keeper saw the trainer die and has not flushed it yet
    trainer_lock: str | None = None  # a guard's record: the trainer's lock file (held while it lives)
    trainer_lock_inode: str | None = None  # ... and its inode (DEV:INO): another file there proves nothing
    guard_lock: str | None = None  # ... and the lock of the guard that keeps it (held while that guard lives)
    guard_lock_inode: str | None = None
    deadline: float | None = None  # seconds its keeper's flush takes at most (the trainer's ``deadline``)
    set_aside: str | None = None

    def write(self, path: str, commit: Callable[[Callable[[], None]], bool] | None = None) -> None:
        """Write it to ``path`` atomically: a temporary file beside it, fsync, rename, fsync the folder.
        ``commit(rename)``, where given, renames (or not: False, and the temporary file goes) under its
        keeper's lock, so that a removal waits for a rename, never for an fsync on a slow volume."""
        fields = {"version": RECORD_VERSION, **dataclasses.asdict(self), **dataclasses.asdict(self.place)}
        del fields["place"], fields["set_aside"]
        folder = os.path.dirname(path) or "."
        temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")  # (one writer a record)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(fields).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        rename = functools.partial(os.replace, temporary, path)
        if commit is None:
            rename()
        elif not commit(rename):  # its keeper let it go meanwhile
            os.unlink(temporary)
            return
        with contextlib.suppress(OSError):
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    @classmethod
    def read(cls, path: str) -> Record:
        """Read and check the record at ``path``: its ids as ``abort`` takes ids, its URLs as ``flush`` does.

        Raises:
            FileNotFoundError: it is gone (another recover claimed it).
            UntrustedRecord: another user owns it or may write it, or it is a symbolic link.
            BadRecord: it cannot be read or is not a valid record (the message says what is wrong).
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedRecord("is a symbolic link") from None
            raise BadRecord(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
        try:
            problem = ownership_problem(os.fstat(fd))  # of the file opened, not of whatever the path names now
            if problem is not None:
                raise UntrustedRecord(problem)
            with os.fdopen(fd, "rb", closefd=False) as handle:
                data = handle.read(MAX_STATE_BYTES + 1)
        except OSError as exc:
            raise BadRecord(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
        finally:
            os.close(fd)
        if len(data) > MAX_STATE_BYTES:
            raise BadRecord(f"is larger than {MAX_STATE_BYTES} bytes")
        try:
            raw = json.loads(data)
        except ValueError:
            raise BadRecord("is not JSON") from None
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
            raise BadRecord(f"is not a version {RECORD_VERSION} record")
        return cls._from_fields(raw)

    @classmethod
    def _from_fields(cls, raw: dict[str, Any]) -> Record:
        ids, invalid = _valid_ids(_field(raw, "ids", list))
        try:
            urls = normalize_server_urls(_field(raw, "urls", list), "the record's urls")
        except ConfigError as exc:
            raise BadRecord(str(exc)) from None
        number = (int, type(None))
        text = {name: raw.get(name) if isinstance(raw.get(name), str) else None
                for name in ("trainer", "trainer_lock", "trainer_lock_inode", "guard_lock", "guard_lock_inode")}
        return cls(urls=urls, ids=ids, gone=raw.get("gone") is True, **text,
                   place=Place(_field(raw, "host", str), _field(raw, "boot_id", (str, type(None))),
                               raw.get("pid_ns") if isinstance(raw.get("pid_ns"), int) else None),
                   pid=_field(raw, "pid", int), start_time=_field(raw, "start_time", number),
                   watchdog_pid=_field(raw, "watchdog_pid", number),
                   watchdog_start_time=_field(raw, "watchdog_start_time", number),
                   heartbeat=float(_field(raw, "heartbeat", (int, float))),
                   heartbeat_interval=float(_field(raw, "heartbeat_interval", (int, float))),
                   deadline=float(raw["deadline"]) if type(raw.get("deadline")) in (int, float) else None,
                   set_aside=f"{invalid} of its ids set aside (not text)" if invalid else None)

    def locks(self) -> tuple[LockFile | None, LockFile | None]:
        """The guard's lock and the trainer's that the record names (None for a watchdog's record)."""
        return (record_lock(self.guard_lock, self.guard_lock_inode),
                record_lock(self.trainer_lock, self.trainer_lock_inode))

    def owner_gone(self, here: Place, now: float) -> bool:
        """Is its owner gone? (``why_kept`` says why not.)"""
        return self.why_kept(here, now) is None

    def why_kept(self, here: Place, now: float) -> str | None:
        """Why its owner is not gone, in words for an operator; None when it is. Marked gone by its
        keeper: gone. Else what the locks prove (a live guard's record is its own; a trainer lives while
        its lock is held; a free lock is a death unless it was marked or its pid lives here: see
        ``ownership``); else, in this host, boot and PID namespace, its keeper is not alive and the
        trainer is dead; else (elsewhere, or a pid its guard could not see) the heartbeat is stale."""
        if self.gone:
            return None
        guard_lock, trainer_lock = self.locks()
        if guard_lock is not None and is_held(guard_lock):
            return f"its guard (pid {self.watchdog_pid}) is alive and keeps it"
        if trainer_lock is not None:
            verdict = judge(lock_state(trainer_lock), self.trainer_alive(here))
            if verdict is Verdict.DEAD:
                return None
            if verdict is Verdict.ALIVE or verdict is Verdict.DISARMED:
                return f"its trainer (pid {self.pid}) " + ("disarmed" if verdict is Verdict.DISARMED else
                                                            "holds its lock: alive")
        if here.boot_id is not None and here.pid_ns is not None and self.place == here:
            if alive(self.watchdog_pid, self.watchdog_start_time):
                return f"its watchdog (pid {self.watchdog_pid}) is alive"
            if self.start_time is not None:
                return f"its trainer (pid {self.pid}) is alive" if alive(self.pid, self.start_time) else None
        if self.stale(now):
            return None
        where = (f"on another host ({shown(self.place.host, 64)})" if self.place.host != here.host
                 else "in another boot or PID namespace")
        return (f"{where}: its heartbeat is {max(now - self.heartbeat, 0.0):.0f} s old, gone after "
                f"{STALE_HEARTBEATS * self.heartbeat_interval:.0f} s")

    def trainer_alive(self, here: Place) -> bool | None:
        """Is the trainer's pid (with its start time) alive? None where it cannot be seen from ``here``."""
        if here.boot_id is None or here.pid_ns is None or self.place != here or self.start_time is None:
            return None
        return alive(self.pid, self.start_time)

    def disarmed(self) -> bool:
        """Did its trainer disarm (its lock free and marked so)? Such a record is removed, never flushed."""
        _, trainer_lock = self.locks()
        return trainer_lock is not None and lock_state(trainer_lock) is LockState.DISARMED

    def dying(self, here: Place) -> bool:
        """In this host, boot and PID namespace: its trainer is dead and its watchdog still runs (flushing
        it, or killed with it a moment ago and not yet gone)."""
        return (here.boot_id is not None and here.pid_ns is not None and self.place == here and not self.gone
                and self.start_time is not None and not alive(self.pid, self.start_time)
                and alive(self.watchdog_pid, self.watchdog_start_time))

    def stale(self, now: float) -> bool:
        """Is its heartbeat older than ``STALE_HEARTBEATS`` intervals?"""
        return now - self.heartbeat > STALE_HEARTBEATS * self.heartbeat_interval


def _valid_ids(values: list[Any]) -> tuple[tuple[str, ...], int]:
    """The ids a flush may take (``abort``'s rule), deduplicated, and how many values were not ids."""
    ids: dict[str, None] = {}
    invalid = 0
    for value in values:
        try:
            ids.update(dict.fromkeys(normalize_instance_ids([value])))
        except ConfigError:
            invalid += 1
    return tuple(ids), invalid


def _field(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``raw[name]`` if it is of ``kind`` (a missing key reads as None), else ``BadRecord``."""
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRecord(f"has no valid {name!r}")
    return value


class _LockFields(TypedDict):
    """A record's fields that name the trainer's lock and its guard's."""

    trainer_lock: str | None
    trainer_lock_inode: str | None
    guard_lock: str | None
    guard_lock_inode: str | None


def _lock_fields(locks: Mapping[str, LockFile | None]) -> _LockFields:
    trainer, guard = locks.get("trainer_lock"), locks.get("guard_lock")
    return _LockFields(trainer_lock=_path(trainer), trainer_lock_inode=_inode(trainer), guard_lock=_path(guard),
                       guard_lock_inode=_inode(guard))


def _path(lock: LockFile | None) -> str | None:
    return lock.path if lock is not None else None


def _inode(lock: LockFile | None) -> str | None:
    return lock.inode if lock is not None else None


class RecordKeeper:
    """One trainer's record in a ledger folder, kept by its watchdog or guard: ``update`` takes a
    state, ``write`` and ``remove`` do the file I/O. A guard's record is named by the trainer's
    ``token`` (its digest: see ``checked_state``); a watchdog's by the trainer's host, pid and start
    time, and its own pid."""

    def __init__(self, folder: str, trainer_pid: int, heartbeat: float, token: str | None = None,
                 locks: Mapping[str, LockFile | None] | None = None) -> None:
        me, locks = os.getpid(), locks or {}
        self._base = Record(urls=(), ids=(), place=Place.here(), pid=trainer_pid,
                            start_time=process_start_time(trainer_pid) if trainer_pid > 0 else None,
                            watchdog_pid=me, watchdog_start_time=process_start_time(me), heartbeat=0.0,
                            heartbeat_interval=heartbeat, trainer=token, **_lock_fields(locks))
        self.heartbeat = heartbeat
        self.gone = False  # the trainer is gone and its flush has not succeeded yet: any recover may take it
        self.written = False  # the record was written once (a missing one was then removed or claimed)
        self.removed = False  # removed for good (flushed, disarmed): a write that comes later writes nothing
        self.retired = False  # its keeper owns the trainer no more (handed over): later writes write nothing
        self._io = threading.Lock()  # a guard writes on its ledger thread and removes a flushed one on a flush worker
        if token is not None:
            name = f"{GUARD_RECORD_PREFIX}{token}{RECORD_SUFFIX}"
        else:
            host = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in self._base.place.host)[:64] or "host"
            name = f"{host}.{trainer_pid}.{self._base.start_time or 0}.{me}{RECORD_SUFFIX}"
        self.path = os.path.join(folder, name)
        self._state: Mapping[str, Any] = {}

    def name_locks(self, locks: Mapping[str, LockFile | None]) -> None:
        """The locks the next ``write`` names (a trainer that holds none of its guard's any more)."""
        self._base = dataclasses.replace(self._base, **_lock_fields(locks))

    def update(self, state: Mapping[str, Any]) -> None:
        """The state the next ``write`` records."""
        self._state = state

    def write(self) -> None:
        """Write (or rewrite) the record with the last state's servers and ids and a fresh heartbeat;
        nothing once it was removed."""
        state = self._state
        deadline = (state.get("options") or {}).get("deadline")
        record = dataclasses.replace(self._base, urls=tuple(state.get("urls", ())), ids=tuple(state.get("ids", ())),
                                     heartbeat=time.time(), gone=self.gone,
                                     deadline=float(deadline) if isinstance(deadline, (int, float)) else None)
        if self.removed or self.retired:
            return
        record.write(self.path, commit=self._commit)

    def _commit(self, rename: Callable[[], None]) -> bool:
        """Rename a written record into place unless it was removed or let go meanwhile (under the
        lock a removal takes: a removal never waits for a write's fsync, and no write comes after it)."""
        with self._io:
            if self.removed or self.retired:
                return False
            rename()
            self.written = True
            return True

    def remove(self) -> None:
        """Remove the record for good: a write queued before this writes nothing after it."""
        with self._io:
            self.removed = True
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def remove_older(self) -> None:
        """Remove this trainer's records kept by watchdogs that are gone."""
        if self._base.trainer is not None:
            return
        folder, mine = os.path.split(self.path)
        prefix = mine[:-len(RECORD_SUFFIX)].rpartition(".")[0] + "."
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                keeper = name[len(prefix):-len(RECORD_SUFFIX)]
                if name != mine and name.startswith(prefix) and name.endswith(RECORD_SUFFIX) and keeper.isdigit() \
                        and process_start_time(int(keeper)) is None:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
