"""The guard on bounded parts (issue 39): a fixed number of threads whatever dies or retries, retries
that end, updates that keep the last good state, and a path that stays the guard's. Real guard
processes, real sockets, a real pids cgroup; every process ended by its pid after the test."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swe_flush_sync import recover
from swe_flush_sync._guard import Guard as GuardDaemon
from swe_flush_sync._guard import _Retrying
from swe_flush_sync.testing import AgentServerStub

from .conftest import PYTHON, SECRET, Guard, read_until, spawn, subprocess_env
from .test_guard_walls import OTHER_UID, a_state, answer, connect, impostor, needs_root, state_line
from .test_ledger import records
from .test_watchdog import wait_until

MAX_THREADS = 64
PIDS_ROOT = Path("/sys/fs/cgroup/pids")


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("Threads:")))


def _dies_holding(path: str, state: dict[str, object]) -> None:
    """A trainer that hands ``state`` over, is held, and dies (its connection ends)."""
    with connect(path) as peer:
        peer.sendall(state_line(state))
        assert answer(peer).startswith(b"held")


def _token(number: int) -> str:
    return f"{number:032x}"


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    """A pids cgroup (v1) limited to 150 tasks, like a pod's pids limit; skipped where none can be made."""
    group = PIDS_ROOT / f"sfg-{uuid.uuid4().hex[:12]}"
    try:
        group.mkdir()
        (group / "pids.max").write_text("150")
    except OSError as exc:
        pytest.skip(f"no pids cgroup here: {exc}")
    yield group
    with contextlib.suppress(OSError):
        group.rmdir()  # empty once its processes have ended


def test_a_pids_limit_never_ends_the_guard(short_dir: Path, pids_cgroup: Path) -> None:
    down = AgentServerStub().start()
    down_url = down.url
    down.stop()  # every dead trainer's server is down: each flush fails and is retried
    path = str(short_dir / "g.sock")
    guard = spawn(["sh", "-c", f'echo $$ > {pids_cgroup}/cgroup.procs && exec "$0" "$@"', PYTHON, "-m",
                   "swe_flush_sync", "guard", "--socket", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                  env=subprocess_env())
    try:
        assert read_until(guard, lambda line: line.startswith("guarding "), []) is not None
        for number in range(200):
            _dies_holding(path, a_state(urls=[down_url], ids=[f"dead-{number}"], trainer=_token(number)))
        assert wait_until(lambda: guard.poll() is not None or _threads(guard.pid) > 8, 5.0)
        with AgentServerStub() as up:
            died = time.monotonic()
            _dies_holding(path, a_state(urls=[up.url], ids=["later"], trainer=_token(999)))
            assert wait_until(lambda: up.flushed_ids() == ["later"], 5.0), "a later death was not flushed"
            assert up.requests[0].at - died < 5.0
        peak = 0
        for _ in range(20):  # the retries go on meanwhile: the count stays bounded
            peak = max(peak, _threads(guard.pid))
            time.sleep(0.05)
        assert guard.poll() is None and peak <= MAX_THREADS, peak
    finally:
        guard.kill()
        guard.communicate(timeout=10)


def test_a_refused_bearer_is_retried_slowly_and_not_after_recover(short_dir: Path,
                                                                   start_guard: Callable[..., Guard]) -> None:
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger))
    with AgentServerStub(secret=SECRET) as stub:
        for number in range(10):  # a rotated secret: the guard holds bearers the server refuses
            _dies_holding(guard.socket, a_state(urls=[stub.url], ids=[f"rotated-{number}"], tokens=None,
                                                trainer=_token(number)))
        assert wait_until(lambda: len(stub.requests) >= 10, 5.0)
        assert all(request.status == 401 for request in stub.requests)
        assert wait_until(lambda: len(records(ledger)) == 10 and all(b'"gone": true' in r.read_bytes()
                                                                     for r in records(ledger)), 5.0)
        report = recover(str(ledger), servers=[stub.url], environ={"HARBOR_ADMIN_SECRET": SECRET})
        assert report.ok and len(report.results) == 10 and records(ledger) == []
        after = len(stub.requests)
        window = time.monotonic() + 3.5  # 1.0.0 retried every 1, 2, 4 s: at least 2 more rounds in it
        while time.monotonic() < window:
            time.sleep(0.05)
        assert len(stub.requests) == after  # no further request from the guard
    guard.proc.kill()  # a drain would wait for the retries still due
    guard.proc.wait()
    err = guard.stderr()
    assert err.count("retrying in 600 s") == 1  # one line a minute at most, however many retry


def test_a_record_a_recover_took_ends_its_retries(short_dir: Path) -> None:
    daemon = GuardDaemon(str(short_dir / "g.sock"))

    class Keeper:
        path = str(short_dir / "claimed-record.json")  # not there: a recover claimed it

    class Dead:
        trainer_pid = 4321
        ledger = Keeper()
        flushed = 0

        def flush(self, *args: object, **kwargs: object) -> None:
            self.flushed += 1

    channel = Dead()
    daemon._flushing.add(channel)  # type: ignore[arg-type]
    daemon._flush(channel, _Retrying(None, time.monotonic(), 2, 2.0))  # type: ignore[arg-type]
    assert channel.flushed == 0 and daemon.flushing() == 0


def test_a_bad_update_keeps_the_last_good_state(start_guard: Callable[..., Guard]) -> None:
    guard = start_guard()
    with AgentServerStub() as stub:
        good = a_state(urls=[stub.url], ids=["good-a", "good-b"], trainer=_token(1))
        with connect(guard.socket) as peer:
            peer.sendall(state_line(good))
            assert answer(peer).startswith(b"held")
            for bad in (state_line(a_state(urls=[stub.url], ids=5, trainer=_token(1)), seq=2),  # a relay's number
                        b'{"seq": 3, "v": 2, "state": {"ids": ["a\\\\qb"]}}\n',  # a 0.5.0 backslash
                        b"not json\n"):
                peer.sendall(bad)
                peer.settimeout(5)
                assert peer.recv(4096).startswith(b"refused ")  # told why; the connection stays
        assert wait_until(lambda: sorted(stub.flushed_ids()) == ["good-a", "good-b"], 5.0), stub.flushed_ids()


@needs_root
def test_status_names_another_uids_socket_and_the_guard_takes_the_path(short_dir: Path,
                                                                        start_guard: Callable[..., Guard]) -> None:
    short_dir.chmod(0o755)
    folder = short_dir / "run"
    folder.mkdir(mode=0o1777)
    folder.chmod(0o1777)
    path = str(folder / "guard.sock")
    other = impostor(path)  # another uid listens at the path and would answer anything
    status = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", path, "--status"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert status.returncode == 1 and f"served by uid {OTHER_UID}" in status.stdout and "not a guard" in status.stdout
    guard = start_guard(path=path)  # root holds the path's lock: it takes the path
    served = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", path, "--status"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert served.returncode == 0 and f"guard pid {guard.proc.pid}" in served.stdout
    other.kill()


def test_a_removed_socket_path_answers_again(start_guard: Callable[..., Guard]) -> None:
    guard = start_guard()
    os.unlink(guard.socket)  # a tmp cleaner, another container on a shared emptyDir
    removed = time.monotonic()

    def answers() -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                peer.settimeout(5)
                peer.connect(guard.socket)
                peer.sendall(b'{"status": true}\n')
                return peer.makefile("rb").readline().startswith(b"status")
        except OSError:
            return False

    assert wait_until(answers, 5.0) and time.monotonic() - removed < 5.0
    assert guard.proc.poll() is None


def test_flush_workers_are_started_once(short_dir: Path) -> None:
    daemon = GuardDaemon(str(short_dir / "g.sock"))
    started = daemon._flushes.threads
    gate = threading.Event()
    for _ in range(100):
        daemon._flushes.submit(gate.wait)
    assert daemon._flushes.threads == started == 4
    gate.set()
    assert wait_until(lambda: len(daemon._flushes) == 0, 5.0)


def test_lines_are_said_at_most_once_a_minute_per_kind(start_guard: Callable[..., Guard]) -> None:
    guard = start_guard()
    for _ in range(20):
        with connect(guard.socket) as peer:
            peer.sendall(b"garbage\n")
            answer(peer)
    guard.proc.terminate()
    assert guard.proc.wait(15) == 0
    lines = [line for line in guard.stderr().splitlines() if line]
    assert Counter("dropped the connection" in line for line in lines)[True] == 1
    assert "19 more 'dropped connection' line(s) held back" in lines[-1]
    shutil.rmtree(Path(guard.socket).parent, ignore_errors=True)
