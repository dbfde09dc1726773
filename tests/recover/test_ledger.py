"""The ledger and ``recover`` with real processes: trainers and watchdogs killed as a lost pod kills them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from swe_flush_sync import ConfigError, ScopedBearer, Watchdog, recover, watchdog
from swe_flush_sync._watchdog import api as watchdog_module
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, gone, proc_stat, spawn, subprocess_env, wait_until
from ..helpers import ENV, IDS, Trainer, here, port_held, records, write_record


def test_a_lost_pod_is_recovered_once(stub: AgentServerStub, tmp_path: Path) -> None:
    for instance_id in IDS:
        stub.add_trials(instance_id, 2)
    trainer = Trainer(stub, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}))
        time.sleep(60)
    """)
    pid = trainer.armed()
    [record] = records(tmp_path)  # there once watchdog() returned
    data = json.loads(record.read_text())
    assert data["ids"] == list(IDS) and data["urls"] == [stub.url] and data["pid"] == trainer.proc.pid
    assert SECRET not in record.read_text()
    os.kill(pid, signal.SIGKILL)  # the pod is deleted: its watchdog dies first, or with the trainer
    assert wait_until(lambda: gone(pid), 2.0)
    trainer.proc.kill()
    trainer.death()
    time.sleep(0.3)
    assert stub.requests == [] and [stub.trials(i) for i in IDS] == [2, 2, 2]  # nothing flushed them

    report = recover(str(tmp_path), servers=stub.url, environ=ENV, until_idle=False)
    assert report.ok and report.cancelled == 6 and sorted(r.instance_id for r in report.results) == sorted(IDS)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)
    assert records(tmp_path) == [] and list(tmp_path.iterdir()) == []

    again = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert again.ok and again.results == ()
    assert len(stub.requests) == len(IDS)


def test_recover_leaves_queued_runs_of_a_dead_trainer_nothing(stub_factory: Callable[..., AgentServerStub],
                                                              tmp_path: Path) -> None:
    server = stub_factory(secret=SECRET, teardown=0.05, max_concurrent=4)
    server.add_trials("wd-a", 7)
    server.add_trials("wd-b", 5)
    assert server.waiting() == 8
    trainer = Trainer(server, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}))
        time.sleep(60)
    """)
    pid = trainer.armed()
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: gone(pid), 5.0)  # until then the record's watchdog is alive: left alone
    trainer.proc.kill()
    trainer.death()
    report = recover(str(tmp_path), servers=server.url, environ=ENV)  # until idle by default
    assert report.ok and report.cancelled == 12 and all(result.idle for result in report.results)
    assert [server.trials(i) for i in IDS] == [0, 0, 0] and server.waiting() == 0
    assert records(tmp_path) == []


def test_live_owners_are_left_alone(stub: AgentServerStub, tmp_path: Path) -> None:
    trainer = Trainer(stub, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}))
        time.sleep(60)
    """)
    trainer.armed()
    fresh = write_record(tmp_path, "fresh", ["far-fresh"], stub.url, heartbeat_age=5)
    stale = write_record(tmp_path, "stale", ["far-stale"], stub.url, heartbeat_age=31)
    report = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert report.ok and stub.flushed_ids() == ["far-stale"]
    assert fresh.exists() and not stale.exists() and len(records(tmp_path)) == 2  # the live trainer's and fresh
    trainer.proc.kill()  # the trainer's watchdog flushes, and removes its record
    trainer.death()
    assert wait_until(lambda: len(records(tmp_path)) == 1, 3.0)
    assert records(tmp_path) == [fresh]


def test_a_dead_pid_on_this_host_is_gone(stub: AgentServerStub, tmp_path: Path) -> None:
    dead = spawn([PYTHON, "-c", "pass"])
    dead.wait()
    write_record(tmp_path, "dead", ["dead-pid"], stub.url, heartbeat_age=0, pid=dead.pid, start_time=123,
                 **here())
    mine = write_record(tmp_path, "mine", ["my-own"], stub.url, heartbeat_age=0, pid=os.getpid(),
                        start_time=_start_time(os.getpid()), **here())
    report = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert report.ok and stub.flushed_ids() == ["dead-pid"] and records(tmp_path) == [mine]


def _start_time(pid: int) -> int:
    return int(proc_stat(pid)[19])


def test_a_failed_watchdog_flush_keeps_the_record(stub_factory: Callable[..., AgentServerStub],
                                                  tmp_path: Path) -> None:
    server = stub_factory(secret=SECRET)
    port = int(server.url.rpartition(":")[2])
    trainer = Trainer(server, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}, deadline=1, retries=0))
        time.sleep(60)
    """)
    pid = trainer.armed()
    server.stop()  # the agent server is down when the trainer dies
    with port_held(port):
        trainer.proc.kill()
        trainer.death()
        err = trainer.stderr_after_watchdog(3.0)
        assert "0/3 targets" in err
        assert len(records(tmp_path)) == 1  # kept for recover
    del pid

    back = stub_factory(secret=SECRET, port=port)
    report = recover(str(tmp_path), servers=back.url, environ=ENV)
    assert report.ok and sorted(back.flushed_ids()) == sorted(IDS) and records(tmp_path) == []


def test_a_recover_that_fails_gives_the_record_back(stub_factory: Callable[..., AgentServerStub],
                                                   tmp_path: Path) -> None:
    server = stub_factory(secret=SECRET)
    write_record(tmp_path, "lost", ["lost-a", "lost-b"], server.url)
    server.fault("lost-b", statuses=[503] * 10)
    report = recover(str(tmp_path), servers=server.url, environ=ENV, retries=0)
    assert not report.ok and [path.name for path in records(tmp_path)] == ["lost.json"]
    report = recover(str(tmp_path), servers=server.url, environ=ENV, retries=0)
    assert not report.ok
    server.fault("lost-b", statuses=[])
    report = recover(str(tmp_path), servers=server.url, environ=ENV)
    assert report.ok and records(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_two_recovers_at_once_flush_each_record_once(stub: AgentServerStub, tmp_path: Path) -> None:
    ids = [f"many-{index}" for index in range(40)]
    for index in range(20):
        write_record(tmp_path, f"r{index:02d}", ids[2 * index:2 * index + 2], stub.url)
    env = subprocess_env(HARBOR_ADMIN_SECRET=SECRET, AGENT_SERVER_URL=stub.url)
    command = [PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path), "--json"]
    both = [spawn(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(2)]
    outputs = [proc.communicate(timeout=60) for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outputs
    assert Counter(stub.flushed_ids()) == dict.fromkeys(ids, 1)
    flushed = [len(json.loads(out)["results"]) for out, _ in outputs]
    assert sum(flushed) == len(ids)
    assert list(tmp_path.iterdir()) == []


def test_bad_records_are_moved_aside_and_the_rest_recovered(stub: AgentServerStub, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    good = write_record(tmp_path, "good", ["fine"], stub.url)
    (tmp_path / "corrupt.json").write_text('{"version": 1, "urls": [')
    (tmp_path / "unreadable.json").mkdir()
    write_record(tmp_path, "huge", ["x" * 5000], stub.url)
    write_record(tmp_path, "number", [12345], stub.url)
    write_record(tmp_path, "badurl", ["y"], "ftp://nope")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "notes.txt").write_text("not a record: ignored")
    with caplog.at_level("WARNING", logger="swe_flush_sync"):
        report = recover(str(tmp_path), servers=[stub.url, "ftp://nope".replace("ftp", "http")], environ=ENV)
    # one rule for what an id is: a long id abort would flush is flushed here too
    assert sorted(stub.flushed_ids()) == ["fine", "x" * 5000] and not good.exists()
    assert sorted(result.instance_id for result in report.results if result.ok) == ["fine", "x" * 5000]
    # records whose ids no flush can take: set aside once the rest flushed, and said in the report
    assert not report.ok and report.error is not None
    assert "huge.json" not in report.error and "number.json" in report.error and "corrupt" not in report.error
    bad = ["badurl", "binary", "corrupt", "number", "unreadable"]
    warnings = [record.getMessage() for record in caplog.records
                if record.levelname == "WARNING" and "ledger record" in record.getMessage()
                and "moved aside" in record.getMessage()]
    assert len(warnings) == len(bad)
    for name in bad:
        assert (tmp_path / f"{name}.json.bad").exists()
        assert sum(f"{name}.json" in message for message in warnings) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([f"{n}.json.bad" for n in bad] + ["notes.txt"])
    assert "xxxxxxxxxx" not in caplog.text  # what a record holds is never echoed


def test_no_file_in_the_ledger_holds_a_secret(stub_factory: Callable[..., AgentServerStub], tmp_path: Path) -> None:
    master = "scoped-master-secret-" + "m" * 20
    server = stub_factory(scoped_secret=master)
    trainer = Trainer(server, f"""
        dog = watchdog(args, ledger={str(tmp_path)!r})
        armed(dog)
        args.session_server_instance_ids = {{8003: "wd-d"}}
        dog.refresh()
        print("REFRESHED", flush=True)
        time.sleep(60)
    """, HARBOR_ADMIN_SECRET="", HARBOR_RUN_SECRET=master)
    trainer.armed()
    trainer.read("REFRESHED")
    bearer = ScopedBearer(master)
    assert wait_until(lambda: "wd-d" in records(tmp_path)[0].read_text(), 2.0)  # updated when the ids change
    for path in tmp_path.iterdir():
        text = path.read_text()
        assert master not in text and not any(bearer(i) in text for i in ["wd-a", "wd-b", "wd-c", "wd-d"])
    assert oct(tmp_path.stat().st_mode & 0o777) == "0o700"
    assert oct(records(tmp_path)[0].stat().st_mode & 0o777) == "0o600"


def test_heartbeat_and_disarm(stub: AgentServerStub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              arm_in_process: Callable[..., Watchdog]) -> None:
    monkeypatch.setattr(watchdog_module, "DEFAULT_HEARTBEAT", 0.2)
    args = argparse.Namespace(session_server_instance_ids={1: "hb-a"})
    dog = arm_in_process(args, environ={"AGENT_SERVER_URL": stub.url}, ledger=str(tmp_path / "new" / "ledger"))
    [record] = records(tmp_path / "new" / "ledger")  # the directory is made
    first = json.loads(record.read_text())["heartbeat"]
    assert wait_until(lambda: json.loads(record.read_text())["heartbeat"] > first, 2.0)
    dog.disarm()
    assert wait_until(lambda: not record.exists(), 1.0) and wait_until(lambda: gone(dog.pid), 1.0)
    assert stub.requests == []


def test_the_environment_names_the_ledger(stub: AgentServerStub, tmp_path: Path,
                                          arm_in_process: Callable[..., Watchdog]) -> None:
    args = argparse.Namespace(session_server_instance_ids={1: "env-a"})
    dog = arm_in_process(args, environ={"AGENT_SERVER_URL": stub.url, "SWE_FLUSH_LEDGER": str(tmp_path)})
    assert dog.ledger == str(tmp_path) and len(records(tmp_path)) == 1


def test_nothing_to_do_and_bad_arguments(tmp_path: Path) -> None:
    named = "http://127.0.0.1:9"
    assert recover(str(tmp_path / "missing"), servers=named).results == ()
    assert recover(str(tmp_path), environ={"AGENT_SERVER_URL": named}).results == ()
    for bad in ("", 42, None):
        with pytest.raises(ConfigError, match="ledger"):
            recover(bad, servers=named)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="deadline"):
        recover(str(tmp_path), servers=named, deadline=-1)
    with pytest.raises(ConfigError, match="no agent server named"):
        recover(str(tmp_path), environ=ENV)  # a secret but no server: never trust a record's URL with it
    with pytest.raises(ConfigError, match="servers"):
        recover(str(tmp_path), servers="ftp://nope")
    with pytest.raises(TypeError):
        recover(str(tmp_path), linger=1)  # type: ignore[call-arg]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="ledger: cannot create"):
        watchdog(argparse.Namespace(session_server_instance_id="x"), environ={"AGENT_SERVER_URL": "http://h:1"},
                 ledger=str(blocker / "sub"))


def test_cli_recover(stub: AgentServerStub, tmp_path: Path) -> None:
    write_record(tmp_path, "cli", ["cli-a", "cli-b"], stub.url)
    env = subprocess_env(HARBOR_ADMIN_SECRET=SECRET, AGENT_SERVER_URL=stub.url)
    ok = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path), "--json"], capture_output=True,
                        text=True, env=env, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] and sorted(stub.flushed_ids()) == ["cli-a", "cli-b"]
    write_record(tmp_path, "down", ["down-a"], "http://127.0.0.1:9")
    failed = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path), "--deadline", "1",
                             "--retries", "0", "--url", stub.url, "--url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert failed.returncode == 1 and "0/1 targets" in failed.stdout
    no_server = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path)], capture_output=True,
                               text=True, env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET), timeout=60)
    assert no_server.returncode == 2 and "no agent server named" in no_server.stderr
    assert "Traceback" not in no_server.stderr
    usage = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover"], capture_output=True, text=True, env=env,
                           timeout=60)
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_recover_gives_a_running_watchdog_its_moment_and_then_flushes(stub: AgentServerStub, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """1.1: a trainer and its watchdog SIGKILLed, recover() at once flushed 0/0 and said ok in 6 of 15 calls: the
    killed watchdog had not died yet (state R) and its record was left to it. 1.2.0 waited without a word."""
    caplog.set_level(logging.WARNING, logger="swe_flush_sync")
    trainer = Trainer(stub, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}, deadline=1, until_idle=False))
        time.sleep(60)
    """)
    keeper = trainer.armed()
    assert wait_until(lambda: len(records(tmp_path)) == 1, 5.0)
    os.kill(keeper, signal.SIGSTOP)  # runs, but never flushes: as one killed a moment ago, not yet gone
    try:
        trainer.proc.kill()
        trainer.death()
        started = time.monotonic()
        report = recover(str(tmp_path), servers=stub.url, environ=ENV, until_idle=False)
        waited = time.monotonic() - started
    finally:
        os.kill(keeper, signal.SIGKILL)
    assert report.ok and sorted(stub.flushed_ids()) == sorted(IDS) and records(tmp_path) == [], report.summary()
    assert waited >= 1.0  # its deadline (1 s) went to the watchdog first
    [said] = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert re.match(r"recover: waiting up to [12]\.\d s for the watchdog\(s\) of 1 record\(s\) whose trainer died",
                    said), said
    assert wait_until(lambda: gone(keeper), 5.0)


def test_recover_lists_the_records_it_left_alone_and_live_ones_are_no_error(stub: AgentServerStub,
                                                                           tmp_path: Path) -> None:
    """1.1 warned about a live trainer's record naming another server, and `recover --url A` exited 1."""
    write_record(tmp_path, "live-elsewhere", ["theirs"], "http://server-b:8000", heartbeat_age=0, pid=os.getpid(),
                 start_time=_start_time(os.getpid()), **here())
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path), "--url", stub.url],
                         capture_output=True, text=True, timeout=60, env=subprocess_env(**ENV))
    assert out.returncode == 0, out
    said = f"left 1 record(s) alone: live-elsewhere.json: its trainer (pid {os.getpid()}) is alive"
    assert said in out.stdout and out.stderr == "", out.stdout
    dead = spawn([PYTHON, "-c", "pass"])
    dead.wait()
    write_record(tmp_path, "gone-elsewhere", ["lost"], "http://server-b:8000", heartbeat_age=0, pid=dead.pid,
                 start_time=123, **here())
    report = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert not report.ok and stub.requests == []  # a gone owner's record nobody here may flush: an error
    assert sorted(report.left_alone) == [
        "gone-elsewhere.json: its trainer is gone, but it names a server not given (http://server-b:8000)",
        f"live-elsewhere.json: its trainer (pid {os.getpid()}) is alive"]
    write_record(tmp_path, "other-host", ["far"], stub.url, heartbeat_age=0)  # 1.2.0 said "alive" of each
    assert "other-host.json: on another host (elsewhere): its heartbeat is 0 s old, gone after 30 s" in \
        recover(str(tmp_path), servers=stub.url, environ=ENV).left_alone
