"""``swe-flush guard`` (issue 30): a process outside the trainer's container, reached over a Unix
socket, that flushes a trainer when its connection ends, the whole container's death included.
Every guard, trainer and container here is a real process, ended by its pid after the test."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from swe_flush_sync import ConfigError, FlushError, recover, watchdog
from swe_flush_sync._watchdog import api as watchdog_module
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, GuardProcess, StartGuard, spawn, stays, subprocess_env, wait_until
from ..helpers import (
    ENV,
    IDS,
    Trainer,
    draining,
    guarded_trainer,
    namespace_init,
    needs_unshare,
    records,
    write_record,
)


def test_the_whole_container_dies_and_the_guard_flushes(stub: AgentServerStub,
                                                        start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = guarded_trainer(stub, guard)
    words = trainer.read("ARMED")
    assert words[1:] == [str(guard.proc.pid), "True"]
    trainer.proc.kill()
    died = trainer.death()
    assert wait_until(lambda: len(stub.requests) >= len(IDS), 3.0)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1) and all(r.status == 200 for r in stub.requests)
    assert all(request.at - died < 1.0 for request in stub.requests)
    assert guard.proc.poll() is None  # it lives on for everyone else


@needs_unshare
@pytest.mark.parametrize("how", ["guard=", "SWE_FLUSH_GUARD"])
def test_a_trainer_that_is_pid_1_of_its_container(stub: AgentServerStub, start_guard: StartGuard,
                                                  how: str) -> None:
    guard = start_guard()
    for instance_id in IDS:
        stub.add_trials(instance_id, 2)
    arm = f"watchdog(args, guard={guard.socket!r}, until_idle=False)" if how == "guard=" \
        else "watchdog(args, until_idle=False)"
    env = {"SWE_FLUSH_GUARD": guard.socket} if how == "SWE_FLUSH_GUARD" else {}
    unshare = Trainer(stub, f"""
        guard = {arm}
        print("ARMED", os.getpid(), guard.guard, flush=True)
        time.sleep(60)
    """, contained=True, **env).proc
    init = namespace_init(unshare)
    assert unshare.stdout is not None
    assert unshare.stdout.readline().split() == ["ARMED", "1", guard.socket]
    os.kill(init, signal.SIGKILL)  # PID 1 dies: the kernel kills everything in its namespace
    unshare.wait(10)
    assert wait_until(lambda: [stub.trials(i) for i in IDS] == [0, 0, 0], 5.0)
    assert stays(lambda: Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)) and guard.proc.poll() is None


@needs_unshare
def test_a_local_watchdog_armed_by_pid_1_warns(stub: AgentServerStub) -> None:
    unshare = Trainer(stub, """
        dog = watchdog(args, until_idle=False)  # no logging set up: warnings.warn reaches stderr anyway
        print("ARMED", os.getpid(), flush=True)
        dog.disarm()
    """, contained=True).proc
    _, err = unshare.communicate(timeout=30)
    assert "UserWarning: the watchdog" in err and "armed by PID 1 of its PID namespace" in err
    assert "swe-flush guard" in err
    assert err.count("PID 1 of its PID namespace") == 1


def test_disarm_then_death_flushes_nothing(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = guarded_trainer(stub, guard, """dog.disarm()
        print("DISARMED", dog.armed, flush=True)
        time.sleep(60)""")
    trainer.read("ARMED")
    assert trainer.read("DISARMED")[1] == "False"
    trainer.proc.kill()
    trainer.death()
    time.sleep(0.5)
    assert stub.requests == [] and guard.proc.poll() is None


def test_refresh_then_death_flushes_the_new_ids(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = guarded_trainer(stub, guard, """args.session_server_instance_ids = {9: "wd-new"}
        print("REFRESHED", refreshed(dog), flush=True)
        time.sleep(60)""")
    trainer.read("ARMED")
    assert trainer.read("REFRESHED")[1] == "True"
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(stub.requests) >= 2, 3.0)
    assert stays(lambda: sorted(stub.flushed_ids()) == ["wd-c", "wd-new"])


def test_twelve_trainers_killed_at_once(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainers = []
    for index in range(12):
        trainer = Trainer(stub, f"""
            args = argparse.Namespace(session_server_instance_ids={{1: "t{index}-a", 2: "t{index}-b"}})
            dog = watchdog(args, guard={guard.socket!r}, until_idle=False)
            print("ARMED", dog.pid, flush=True)
            time.sleep(60)
        """)
        trainers.append(trainer)
    for trainer in trainers:
        trainer.read("ARMED")
    assert _status(guard) == (guard.proc.pid, 12)
    for trainer in trainers:
        trainer.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 24, 5.0)
    expected = {f"t{index}-{side}": 1 for index in range(12) for side in "ab"}
    assert stays(lambda: Counter(stub.flushed_ids()) == expected)
    assert Counter(stub.flushed_ids()) == expected and _status(guard) == (guard.proc.pid, 0)


def _status_line(guard: GuardProcess) -> str:
    return subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", guard.socket, "--status"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=30).stdout.strip()


def _status(guard: GuardProcess) -> tuple[int, int] | None:
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", guard.socket, "--status"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=30)
    if out.returncode != 0:
        assert out.returncode == 1 and "no guard answers" in out.stdout
        return None
    words = out.stdout.split()  # guard pid N, M trainers
    return int(words[2].rstrip(",")), int(words[3])


def test_a_restarted_guard_takes_the_trainer_back(stub: AgentServerStub, start_guard: StartGuard) -> None:
    first = start_guard()
    trainer = Trainer(stub, stdin=True, body=f"""
        dog = watchdog(args, guard={first.socket!r}, until_idle=False)
        print("ARMED", dog.pid, dog.armed, flush=True)
        second = int(sys.stdin.readline())
        started = time.monotonic()
        while not (dog.armed and dog.pid == second) and time.monotonic() - started < 20:
            time.sleep(0.005)  # no refresh, no abort: the trainer reconnects by itself
        print("BACK", dog.armed, dog.pid, round(time.monotonic() - started, 2), flush=True)
        args.session_server_instance_id = "wd-later"
        print("REFRESHED", refreshed(dog), dog.armed, flush=True)
        time.sleep(60)
    """)
    trainer.read("ARMED")
    first.proc.kill()  # the sidecar is restarted
    first.proc.wait()
    second = start_guard(path=first.socket)  # the stale socket file is replaced
    trainer.go_on(str(second.proc.pid))
    words = trainer.read("BACK")
    assert words[1:3] == ["True", str(second.proc.pid)] and float(words[3]) < 2.0
    assert trainer.read("REFRESHED")[1:] == ["True", "True"]
    assert stub.requests == []  # the first guard's death flushed nothing
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)
    assert stays(lambda: sorted(stub.flushed_ids()) == ["wd-a", "wd-b", "wd-later"])


def test_aborts_from_two_threads_while_the_guard_restarts_never_garble_a_line(
        stub: AgentServerStub, start_guard: StartGuard) -> None:
    """Two threads abort with changing ids while the follower thread reconnects to a guard that is
    restarted three times: every line each guard got was whole (none dropped the connection)."""
    guards = [start_guard()]
    trainer = Trainer(stub, stdin=True, body=f"""
        import threading
        dog = watchdog(args, guard={guards[0].socket!r}, until_idle=False)
        print("ARMED", dog.pid, flush=True)
        stop = threading.Event()

        def hammer(attribute, make):
            step = 0
            while not stop.is_set():
                step += 1
                setattr(args, attribute, make(step))
                abort(args, deadline=0.5, until_idle=False)

        threads = [threading.Thread(target=hammer, args=("session_server_instance_ids",
                                                         lambda step: {{n: f"m{{step}}-{{n}}" for n in range(4)}})),
                   threading.Thread(target=hammer, args=("session_server_instance_id", lambda step: f"s{{step}}"))]
        for thread in threads:
            thread.start()
        for line in iter(sys.stdin.readline, "end\\n"):  # the pid of the guard restarted meanwhile
            started = time.monotonic()
            while dog.pid != int(line) and time.monotonic() - started < 20:
                time.sleep(0.01)
            print("BACK", dog.pid, flush=True)
        stop.set()
        for thread in threads:
            thread.join()
        print("DONE", refreshed(dog), flush=True)  # the guard's word on the last state may come after the abort
        time.sleep(60)
    """)
    trainer.read("ARMED")
    for _ in range(3):
        old = guards[-1]
        old.proc.kill()
        old.proc.wait()
        guards.append(start_guard(path=old.socket))
        trainer.go_on(str(guards[-1].proc.pid))
        assert trainer.read("BACK")[1] == str(guards[-1].proc.pid)
    trainer.go_on("end")
    assert trainer.read("DONE")[1] == "True"
    trainer.proc.kill()
    trainer.death()
    guards[-1].proc.kill()
    guards[-1].proc.wait()
    said = [guard.stderr() for guard in guards]
    assert not any("dropped the connection" in text for text in said), said


def test_a_live_guard_keeps_its_socket(stub: AgentServerStub, start_guard: StartGuard,
                                       short_dir: Path) -> None:
    guard = start_guard()
    assert oct(os.stat(guard.socket).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(guard.socket)).st_mode & 0o777) == "0o700"  # made for it
    second = spawn([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", guard.socket], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, env=subprocess_env())
    out, err = second.communicate(timeout=30)
    assert second.returncode == 2 and "already serving" in err and guard.socket in err and "guarding" not in out
    assert _status(guard) == (guard.proc.pid, 0)
    not_a_socket = short_dir / "file"
    not_a_socket.write_text("mine")
    third = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", str(not_a_socket)],
                           capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert third.returncode == 2 and "is not a socket" in third.stderr and not_a_socket.read_text() == "mine"
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    trainer.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)


def test_status_live_and_absent(start_guard: StartGuard, short_dir: Path) -> None:
    assert _status(GuardProcess(proc=None, socket=str(short_dir / "none.sock"), lines=[])) is None  # type: ignore[arg-type]
    guard = start_guard()
    assert _status(guard) == (guard.proc.pid, 0)


def test_garbage_costs_only_its_connection(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    for garbage in (b"garbage\xff\x00 not json\n", b'{"seq": "one", "state": []}\n', b"[1, 2, 3]\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.settimeout(5)
            peer.connect(guard.socket)
            peer.sendall(garbage)
            said = b""
            while chunk := peer.recv(100):
                said += chunk
            assert said.startswith(b"refused ") and said.count(b"\n") == 1  # told why, then dropped
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:  # a 4 MiB line, never ended
        peer.connect(guard.socket)
        peer.sendall(b"x" * (4 << 20))
        assert _status(guard) == (guard.proc.pid, 1)
    trainer.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1) and guard.proc.poll() is None
    guard.proc.send_signal(signal.SIGTERM)
    assert guard.proc.wait(10) == 0
    err = guard.stderr()  # one line a minute at most, the rest counted at the end
    assert err.count("dropped the connection") == 1 and "2 more 'dropped connection' line(s) held back" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a peer of another uid)")
def test_a_peer_of_another_uid_is_refused(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    os.chmod(guard.socket, 0o666)  # even when the file lets it connect
    for folder in (os.path.dirname(guard.socket), os.path.dirname(os.path.dirname(guard.socket))):
        os.chmod(folder, 0o755)
    code = textwrap.dedent("""
        import os, socket, sys
        os.setgid(4242)
        os.setuid(4242)
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(sys.argv[1])
        try:
            peer.sendall(b'{"status": true}\\n')  # the guard may have closed already: a broken pipe
            print(repr(peer.recv(100)))
        except (BrokenPipeError, ConnectionResetError):
            print("reset")
    """)
    out = subprocess.run([PYTHON, "-c", code, guard.socket], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() in ("b''", "reset"), out  # closed without an answer
    guard.proc.send_signal(signal.SIGTERM)
    assert guard.proc.wait(10) == 0 and "refused a connection from uid 4242" in guard.stderr()


def test_sigterm_hands_the_path_over_and_flushes_a_death_meanwhile(stub: AgentServerStub,
                                                                   start_guard: StartGuard) -> None:
    guard = start_guard("--drain", "20")
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    guard.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: draining(guard.socket), 5.0)  # the path's lock is let go at once ...
    successor = start_guard(path=guard.socket)  # ... so a successor binds at once
    assert _status(successor) == (successor.proc.pid, 0)
    trainer.proc.kill()  # a death during the drain: the old guard, which held it, flushes it
    killed = time.monotonic()
    assert guard.proc.wait(10) == 0 and time.monotonic() - killed < 3.0
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)


def test_a_draining_guard_answers_and_arms_trainers_until_a_successor_takes_the_path(
        stub: AgentServerStub, start_guard: StartGuard) -> None:
    """A rolling update leaves no moment without a guard (issue 53): 1.1 gave the path up at the
    drain's start, so --status failed and a trainer arming then waited 10 s and raised FlushError."""
    guard = start_guard("--drain", "30")
    held = guarded_trainer(stub, guard)
    held.read("ARMED")
    guard.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: draining(guard.socket), 5.0)
    assert _status_line(guard) == f"guard pid {guard.proc.pid}, 1 trainers, draining"
    late = Trainer(stub, f"""
        args = argparse.Namespace(session_server_instance_id="armed-while-draining")
        started = time.monotonic()
        dog = watchdog(args, guard={guard.socket!r}, until_idle=False)
        print("ARMED", time.monotonic() - started, flush=True)
        time.sleep(60)
    """)
    assert float(late.read("ARMED")[1]) < 1.0  # (1.1: 10 s, then FlushError)
    assert _status(guard) == (guard.proc.pid, 2)
    successor = start_guard(path=guard.socket)  # takes the path's lock the draining guard let go
    assert _status(successor) == (successor.proc.pid, 0)
    late.proc.kill()  # a death during the drain: the guard that held it flushes it, once
    held.proc.kill()
    assert guard.proc.wait(10) == 0
    assert Counter(stub.flushed_ids()) == {"armed-while-draining": 1, **dict.fromkeys(IDS, 1)}


@needs_unshare
def test_the_guard_names_contained_trainers_so_that_they_can_be_told_apart(stub: AgentServerStub,
                                                                          start_guard: StartGuard) -> None:
    """In the sidecar layout the guard sees every trainer as pid 0; it names them as they see themselves
    (1.1: "trainer pid 0 gone" for each), with their host and their record's name: 1.2.0 named every
    sidecar trainer "pid 1 (uid 0)"."""
    guard = start_guard()
    trainers = [Trainer(stub, f"""
        args = argparse.Namespace(session_server_instance_ids={{1: "{name}"}})
        dog = watchdog(args, guard={guard.socket!r}, until_idle=False)
        print("ARMED", os.getpid(), flush=True)
        time.sleep(60)
    """, contained=True) for name in ("side-a", "side-b")]
    for trainer in trainers:
        assert trainer.read("ARMED")[1] == "1"  # PID 1 of its container
        trainer.proc.kill()
    assert wait_until(lambda: sorted(stub.flushed_ids()) == ["side-a", "side-b"], 5.0)
    guard.proc.send_signal(signal.SIGTERM)  # nothing held: it ends at once
    assert guard.proc.wait(10) == 0
    said = guard.stderr()
    named = f"trainer pid 1 (uid {os.geteuid()}, {socket.gethostname()}, record "
    records_named = {line.split(named, 1)[1][:8] for line in said.splitlines() if named in line and " gone;" in line}
    assert len(records_named) == 2 and "pid 0" not in said, said


def test_the_drain_time_runs_out_and_the_trainer_arms_with_the_next_guard(stub: AgentServerStub,
                                                                          start_guard: StartGuard) -> None:
    guard = start_guard("--drain", "0.5")
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    guard.proc.send_signal(signal.SIGTERM)
    assert guard.proc.wait(10) == 0
    assert f"handed over trainers pid {trainer.proc.pid} (uid {os.geteuid()}, {socket.gethostname()}, record " \
        in guard.stderr()
    assert stub.requests == []
    successor = start_guard(path=guard.socket)
    assert wait_until(lambda: _status(successor) == (successor.proc.pid, 1), 15.0)  # its follower re-armed
    trainer.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)


def test_ledger_guard_and_trainer_killed_then_recover(stub: AgentServerStub, start_guard: StartGuard,
                                                      short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger))
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    assert wait_until(lambda: len(records(ledger)) == 1, 5.0)  # written off the guard's loop
    [record] = records(ledger)
    data = json.loads(record.read_text())
    assert data["pid"] == trainer.proc.pid and data["watchdog_pid"] == guard.proc.pid
    assert SECRET not in record.read_text()
    assert recover(str(ledger), servers=stub.url, environ=ENV).results == ()  # alive: left alone
    guard.proc.kill()  # the node agent and the trainer die together
    guard.proc.wait()
    trainer.proc.kill()
    trainer.death()
    report = recover(str(ledger), servers=stub.url, environ=ENV, until_idle=False)
    assert report.ok and Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1) and records(ledger) == []


def test_a_disarm_removes_the_guards_record(stub: AgentServerStub, start_guard: StartGuard,
                                            short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger))
    trainer = guarded_trainer(stub, guard, """dog.disarm()
        print("DISARMED", flush=True)
        time.sleep(60)""")
    trainer.read("DISARMED")
    assert wait_until(lambda: records(ledger) == [], 2.0) and stub.requests == []


def test_a_guard_started_on_a_ledger_recovers_it(stub: AgentServerStub, start_guard: StartGuard,
                                                 short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    ledger.mkdir(mode=0o700)
    write_record(ledger, "dead", ["dead-a", "dead-b"], stub.url)  # a trainer lost with its node
    guard = start_guard("--ledger", str(ledger), AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert wait_until(lambda: sorted(stub.flushed_ids()) == ["dead-a", "dead-b"], 10.0)
    assert wait_until(lambda: records(ledger) == [], 2.0) and guard.proc.poll() is None


def test_a_guard_with_no_server_says_it_cannot_recover(start_guard: StartGuard, short_dir: Path) -> None:
    guard = start_guard("--ledger", str(short_dir / "ledger"))
    time.sleep(0.5)
    guard.proc.send_signal(signal.SIGTERM)
    assert guard.proc.wait(10) == 0
    assert guard.stderr().count("cannot recover the ledger") == 1


def test_no_guard_is_an_error_not_a_fallback(stub: AgentServerStub, short_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog_module, "ARM_TIMEOUT", 0.5)
    args = argparse.Namespace(session_server_instance_id="x")
    env = {"AGENT_SERVER_URL": stub.url}
    with pytest.raises(FlushError, match=r"no guard answers at .*nobody\.sock"):
        watchdog(args, environ=env, guard=str(short_dir / "nobody.sock"))
    with pytest.raises(ConfigError, match="at most 107 bytes"):
        watchdog(args, environ={**env, "SWE_FLUSH_GUARD": "/tmp/" + "x" * 120})
    assert stub.requests == []
