"""The ledger record in process and fast: what a keeper writes ``Record.read`` reads back, the
owner-gone rule case by case, records refused or set aside, and a keeper's cleanup."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swe_flush_sync._process.liveness import LockFile, LockFolder, LockState
from swe_flush_sync._process.proc import Place, process_start_time
from swe_flush_sync._process.record import (
    STALE_HEARTBEATS,
    BadRecord,
    Record,
    RecordKeeper,
    UntrustedRecord,
)

URLS = ("http://agent:8000", "https://other:9000/base")
ANY_ID = st.text(st.characters(blacklist_categories=()), min_size=1, max_size=12).filter(str.strip)


def dead_pid() -> tuple[int, int]:
    """A pid whose process has ended (reaped), and the start time it had."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    started = process_start_time(child.pid)
    assert started is not None
    child.communicate(b"")
    return child.pid, started


def a_record(**changes: object) -> Record:
    me = os.getpid()
    record = Record(urls=URLS, ids=("a", "b"), place=Place.here(), pid=me, start_time=process_start_time(me),
                    watchdog_pid=me, watchdog_start_time=process_start_time(me), heartbeat=time.time(),
                    heartbeat_interval=10.0)
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def test_what_a_keeper_writes_reads_back(tmp_path: Path) -> None:
    keeper = RecordKeeper(str(tmp_path), os.getpid(), 2.5, token="t" * 32,
                          locks={"trainer_lock": LockFile("/run/l/t", "1:2"),
                                 "guard_lock": LockFile("/run/l/g", "1:3")})
    keeper.update({"urls": list(URLS), "ids": ["a", "b"], "tokens": {"a": "secret"}})
    before = time.time()
    keeper.write()
    record = Record.read(keeper.path)
    assert os.path.basename(keeper.path) == f"trainer-{'t' * 32}.json"
    assert (record.urls, record.ids, record.pid, record.trainer) == (URLS, ("a", "b"), os.getpid(), "t" * 32)
    assert record.locks() == (LockFile("/run/l/g", "1:3"), LockFile("/run/l/t", "1:2")) and not record.gone
    assert record.place == Place.here() and record.start_time == process_start_time(os.getpid())
    assert record.heartbeat_interval == 2.5 and before <= record.heartbeat <= time.time()
    assert "secret" not in Path(keeper.path).read_text()  # a record never holds a bearer
    assert os.stat(keeper.path).st_mode & 0o777 == 0o600
    keeper.gone = True
    keeper.write()
    assert Record.read(keeper.path).gone
    keeper.remove()
    keeper.remove()  # twice: nothing to remove is no error
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(ANY_ID, max_size=10, unique=True))
def test_any_id_survives_a_record(tmp_path_factory: pytest.TempPathFactory, ids: list[str]) -> None:
    folder = tmp_path_factory.mktemp("ledger")
    record = a_record(ids=tuple(ids))
    record.write(str(folder / "r.json"))
    assert Record.read(str(folder / "r.json")) == record


def test_the_owner_gone_rule() -> None:
    here, now = Place.here(), time.time()
    dead, dead_start = dead_pid()
    stale = now - STALE_HEARTBEATS * 10.0 - 1
    elsewhere = Place("elsewhere", "another-boot", 1)
    # Marked gone by its keeper: gone, whatever else it says.
    assert a_record(gone=True).owner_gone(here, now)
    # Here: a live keeper flushes it; a dead keeper's is gone when its trainer is dead, not when it lives.
    assert not a_record(pid=dead, start_time=dead_start).owner_gone(here, now)
    assert a_record(pid=dead, start_time=dead_start, watchdog_pid=dead, watchdog_start_time=dead_start).owner_gone(
        here, now)
    assert not a_record(watchdog_pid=dead, watchdog_start_time=dead_start).owner_gone(here, now)
    # A pid reused by another process is not the trainer: its start time differs.
    assert a_record(start_time=(process_start_time(os.getpid()) or 0) + 1, watchdog_pid=dead,
                    watchdog_start_time=dead_start).owner_gone(here, now)
    # Elsewhere (or a pid that meant nothing to its guard): the heartbeat decides.
    assert not a_record(place=elsewhere).owner_gone(here, now)
    assert a_record(place=elsewhere, heartbeat=stale).owner_gone(here, now)
    assert a_record(start_time=None, watchdog_pid=dead, watchdog_start_time=dead_start, heartbeat=stale).owner_gone(
        here, now)


def test_the_locks_decide_before_pids_and_heartbeats(tmp_path: Path) -> None:
    here, now = Place.here(), time.time()
    folder = LockFolder(str(tmp_path / "guard.sock.locks"))
    folder.open()
    dead, dead_start = dead_pid()
    gone_here = {"pid": dead, "start_time": dead_start, "watchdog_pid": dead, "watchdog_start_time": dead_start,
                 "heartbeat": now - 3600}

    def naming(trainer: LockFile | None = None, guard: LockFile | None = None, **changes: object) -> Record:
        return a_record(trainer_lock=trainer and trainer.path, trainer_lock_inode=trainer and trainer.inode,
                        guard_lock=guard and guard.path, guard_lock_inode=guard and guard.inode, **changes)

    held, trainer_lock = folder.create("trainer-")
    try:  # a trainer whose lock is held lives, however old its heartbeat, while its pid cannot be seen
        assert not naming(trainer_lock, place=Place("elsewhere", None, None), heartbeat=now - 3600).owner_gone(here,
                                                                                                             now)
        # ... and not once its pid is proven gone here: the holder outlived it
        assert naming(trainer_lock, **gone_here).owner_gone(here, now)
        assert folder.state(trainer_lock) is LockState.HELD
    finally:
        os.close(held)
    # its lock free: gone, however fresh the heartbeat
    assert naming(trainer_lock, place=Place("elsewhere", None, None)).owner_gone(here, now)
    assert folder.state(trainer_lock) is LockState.FREE
    guard_fd, guard_lock = folder.create("guard-")
    try:  # a live guard's record is that guard's to flush, even with the trainer's lock free
        assert not naming(trainer_lock, guard_lock).owner_gone(here, now)
        # A held file renamed onto the trainer's (another inode) proves nothing: pids and heartbeats decide.
        os.replace(guard_lock.path, trainer_lock.path)
        assert naming(trainer_lock, **gone_here).owner_gone(here, now)
        assert not naming(trainer_lock, place=Place("elsewhere", None, None)).owner_gone(here, now)
        assert folder.state(trainer_lock) is LockState.UNKNOWN
    finally:
        os.close(guard_fd)
    # A lock that cannot be examined (no such file) leaves the rule to pids and heartbeats.
    assert naming(LockFile(str(tmp_path / "none"), "1:1"), **gone_here).owner_gone(here, now)
    # ... and so does a folder others may write.
    os.chmod(folder.path, 0o777)
    fd, open_lock = folder.create("trainer-")
    try:
        assert naming(open_lock, place=Place("elsewhere", None, None), heartbeat=now - 3600).owner_gone(here, now)
        assert not naming(open_lock, place=Place("elsewhere", None, None)).owner_gone(here, now)
    finally:
        os.close(fd)
        folder.close()


@pytest.mark.parametrize(("content", "why"), [
    (b"not json", "is not JSON"),
    (b'{"version": 2}', "is not a version 1 record"),
    (b"[]", "is not a version 1 record"),
    (b'{"version": 1, "ids": "a", "urls": []}', "has no valid 'ids'"),
    (b'{"version": 1, "ids": [], "urls": ["ftp://agent"]}', "the record's urls"),
    (b'{"version": 1, "ids": [], "urls": ["http://agent"], "host": "h", "boot_id": null, "pid": true}',
     "has no valid 'pid'"),
])
def test_a_bad_record_says_what_is_wrong(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(BadRecord, match=why):
        Record.read(str(path))


def test_ids_that_are_not_text_are_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    a_record().write(str(path))
    raw = json.loads(path.read_text())
    raw["ids"] = ["a", 7, None, "a", "", " ", "b", [1]]  # None and "" are no id (as abort skips them)
    path.write_text(json.dumps(raw))
    record = Record.read(str(path))
    assert record.ids == ("a", " ", "b") and record.set_aside == "2 of its ids set aside (not text)"


def test_a_record_another_user_could_write_is_untrusted(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    a_record().write(str(path))
    path.chmod(0o622)
    with pytest.raises(UntrustedRecord, match="writable by its group or others"):
        Record.read(str(path))
    (tmp_path / "link.json").symlink_to(path)
    with pytest.raises(UntrustedRecord, match="symbolic link"):
        Record.read(str(tmp_path / "link.json"))
    with pytest.raises(FileNotFoundError):
        Record.read(str(tmp_path / "claimed.json"))


def test_a_keeper_removes_the_records_of_its_trainers_dead_keepers_only(tmp_path: Path) -> None:
    dead, _ = dead_pid()
    keeper = RecordKeeper(str(tmp_path), os.getpid(), 10.0)
    stem = os.path.basename(keeper.path).rpartition(".")[0].rpartition(".")[0]  # host.pid.start
    (tmp_path / f"{stem}.{dead}.json").write_text("{}")  # this trainer, a keeper that died
    (tmp_path / f"{stem}.1.json").write_text("{}")  # this trainer, a keeper alive (PID 1)
    (tmp_path / f"other.{os.getpid()}.0.{dead}.json").write_text("{}")  # another trainer's
    keeper.update({"urls": list(URLS), "ids": ["a"]})
    keeper.write()
    keeper.remove_older()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [os.path.basename(keeper.path), f"{stem}.1.json", f"other.{os.getpid()}.0.{dead}.json"])
