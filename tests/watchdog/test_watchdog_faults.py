"""The watchdog and the ledger under the faults a long training job brings (issue 29): threads,
signals, full pipes, stopped processes, a removed ledger, closed descriptors. One test per defect,
each over real processes; the numbers in the test names are the issue's. Defect 11 (a dead
watchdog unreported while the ids stay the same) is tested in ``test_watchdog``
(``test_a_killed_watchdog_is_noticed_and_rearmed``)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from swe_flush_sync import Watchdog, abort, recover
from swe_flush_sync._process.proc import process_stopped as stopped
from swe_flush_sync._watchdog import api as watchdog_module
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, _watchdog_pids, blocked_in, gone, spawn, subprocess_env, wait_until
from ..helpers import ENV, IDS, PRELUDE, Trainer, records

BIG = "{n: f'big-{n:05d}-' + 'x' * 70 for n in range(2000)}"  # ~170 KB a state: more than a pipe holds


def test_sigterm_hook_never_waits_on_a_thread_stuck_in_user_code(stub: AgentServerStub) -> None:
    """A thread's abort() is stuck in its bearer provider (it logs; the main thread, interrupted
    inside a logging handler, holds the handler's lock). The SIGTERM hook must still end the process."""
    trainer = Trainer(stub, """
        import logging, threading
        from swe_flush_sync import StaticBearer
        class Slow(logging.Handler):
            def emit(self, record):
                if record.getMessage() == "SLOW":
                    print("IN_EMIT", flush=True)
                    time.sleep(30)
        app = logging.getLogger("app")
        app.addHandler(Slow())
        app.setLevel(logging.INFO)
        static = StaticBearer(os.environ["HARBOR_ADMIN_SECRET"])
        def provider(instance_id):
            app.info("token for %s", instance_id)  # blocks on the handler's lock while main is in emit
            return static(instance_id)
        armed(watchdog(args, bearer=provider, until_idle=False))
        flush_on_signal(args, deadline=3, until_idle=False)
        def steps():
            n = 0
            while True:
                n += 1
                args.session_server_instance_id = f"wd-step-{n}"  # a new state each step
                abort(args, bearer=provider, deadline=1)
        threading.Thread(target=steps, daemon=True).start()
        time.sleep(0.3)
        app.warning("SLOW")
    """)
    trainer.armed()
    trainer.read("IN_EMIT")
    time.sleep(0.5)  # the stepping thread is now blocked inside its provider
    trainer.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert wait_until(lambda: trainer.proc.poll() is not None, 8.0), "the SIGTERM hook deadlocked"
    assert time.monotonic() - sent < 3 + 1 + 1.5  # deadline plus a second, and a margin
    assert trainer.proc.returncode == -signal.SIGTERM


def test_part_of_a_state_reaches_the_watchdog_after_a_stop(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, stdin=True, body=f"""
        dog = watchdog(args, until_idle=False, deadline=20)
        armed(dog)
        sys.stdin.readline()  # the test stops the watchdog
        args.session_server_instance_ids = {BIG}
        started = time.monotonic()
        print("STOPPED", dog.refresh(), dog.armed, round(time.monotonic() - started, 2), flush=True)
        sys.stdin.readline()  # the test lets it go on
        confirmed = refreshed(dog)  # the watchdog, running again, catches up with the pipe (loaded: a while)
        print("AGAIN", confirmed, dog.armed, flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: stopped(pid), 2.0)
    trainer.go_on()
    words = trainer.read("STOPPED")
    assert words[1:3] == ["False", "False"] and float(words[3]) < 1.0  # not confirmed, and armed says so
    os.kill(pid, signal.SIGCONT)
    trainer.go_on()
    assert trainer.read("AGAIN", timeout=40)[1:] == ["True", "True"]  # the same ids: the rest is written all the same
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(stub.requests) >= 2001, 15.0), len(stub.requests)
    assert len(set(stub.flushed_ids())) == 2001 and "wd-c" in stub.flushed_ids()


@pytest.mark.parametrize("then", ["SIGKILL", "a normal exit"])
@pytest.mark.parametrize("previous", ["a graceful-stop handler", "SIG_IGN"])
def test_a_sigterm_the_trainer_survives_keeps_the_watchdog_armed(stub: AgentServerStub, previous: str,
                                                                  then: str) -> None:
    handler = "lambda signum, frame: print('GRACEFUL', flush=True)" if previous != "SIG_IGN" else "signal.SIG_IGN"
    for instance_id in IDS:
        stub.add_trials(instance_id, 1)
    trainer = Trainer(stub, stdin=True, body=f"""
        signal.signal(signal.SIGTERM, {handler})
        armed(watchdog(args, until_idle=False))
        flush_on_signal(args, until_idle=False)
        print("READY", flush=True)
        sys.stdin.readline()  # after the SIGTERM: the trainer goes on
        print("GOING_ON", flush=True)
        if sys.stdin.readline().strip() == "exit":
            sys.exit(0)
        time.sleep(60)
    """)
    pid = trainer.armed()
    trainer.read("READY")
    assert blocked_in(trainer.proc.pid, "read")
    trainer.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: len(stub.requests) == len(IDS), 5.0)
    trainer.go_on()
    trainer.read("GOING_ON")
    assert trainer.proc.poll() is None and not gone(pid)  # it survived, and so did its watchdog
    assert [stub.trials(i) for i in IDS] == [0, 0, 0]
    for instance_id in IDS:  # the trainer goes on and starts trials again
        stub.add_trials(instance_id, 2)
    if then == "SIGKILL":  # the grace period ends
        trainer.proc.kill()
        trainer.death()
        assert wait_until(lambda: [stub.trials(i) for i in IDS] == [0, 0, 0], 3.0), "the watchdog flushed nothing"
        assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 2)
    else:  # nothing since the SIGTERM's flush: it was the last one; each pair flushed once
        trainer.go_on("exit")
        trainer.death()
        assert wait_until(lambda: gone(pid), 2.0)
        time.sleep(0.2)
        assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)


def test_recover_never_races_a_live_watchdog(stub_factory: Callable[..., AgentServerStub], tmp_path: Path) -> None:
    server = stub_factory(secret=SECRET, teardown=1.0)
    for instance_id in IDS:
        server.add_trials(instance_id, 1)
    trainer = Trainer(server, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}, deadline=10))  # until idle
        time.sleep(60)
    """)
    pid = trainer.armed()
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(server.requests) >= len(IDS), 3.0)
    time.sleep(0.3)  # the watchdog's first pass is tearing down
    assert not gone(pid) and len(records(tmp_path)) == 1
    report = recover(str(tmp_path), servers=server.url, environ=ENV)  # a trainer restarted at once
    assert report.ok and report.results == ()
    assert wait_until(lambda: gone(pid), 12.0)
    assert server.recancels == 0 and records(tmp_path) == []
    per_id = Counter(server.flushed_ids())
    assert set(per_id) == set(IDS) and all(count == 2 for count in per_id.values())  # the watchdog's two passes


def test_a_full_stderr_pipe_never_keeps_the_watchdog(stub: AgentServerStub, tmp_path: Path) -> None:
    trainer = Trainer(stub, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}, deadline=2, until_idle=False))
        fd = os.open(f"/proc/self/fd/2", os.O_WRONLY | os.O_NONBLOCK)  # the same pipe, our own file
        try:
            while True:
                os.write(fd, b"x" * 4096)  # the launcher stopped reading: fill it up
        except BlockingIOError:
            pass
        print("FULL", flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    trainer.read("FULL")
    trainer.proc.kill()
    died = trainer.death()
    assert wait_until(lambda: gone(pid), 2 + 1 + 1.0), "the watchdog hung on its stderr"
    assert time.monotonic() - died < 2 + 1 + 1.0
    assert sorted(stub.flushed_ids()) == sorted(IDS) and records(tmp_path) == []


def test_a_record_that_cannot_be_written_is_said(arm_in_process: Callable[..., Watchdog], stub: AgentServerStub,
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(watchdog_module, "DEFAULT_HEARTBEAT", 0.2)
    ledger = tmp_path / "ledger"
    args = argparse.Namespace(session_server_instance_id="hb-a")
    dog = arm_in_process(args, environ={"AGENT_SERVER_URL": stub.url}, ledger=str(ledger))
    assert dog.ledger_error is None and len(records(ledger)) == 1
    shutil.rmtree(ledger)  # the volume went away (a full one says ENOSPC the same way)
    assert wait_until(lambda: dog.armed and dog.ledger_error is not None, 10.0)
    assert "No such file or directory" in (dog.ledger_error or "")
    with caplog.at_level("WARNING", logger="swe_flush_sync"):
        for _ in range(3):
            abort(args, environ={})
            time.sleep(0.25)  # more failed heartbeats
    assert caplog.text.count("cannot write its ledger record") == 1 and dog.armed
    ledger.mkdir(mode=0o700)  # heartbeats are retried: the record comes back
    assert wait_until(lambda: dog.armed and dog.ledger_error is None and len(records(ledger)) == 1, 10.0)
    assert stub.requests == []


def test_a_fork_during_arming_never_hides_the_death(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        import threading
        children, arming = [], threading.Event()
        def fork_meanwhile():  # a data loader's workers, forked by another thread
            arming.wait()
            while arming.is_set() and len(children) < 200:  # all through the arming
                child = os.fork()
                if child == 0:
                    time.sleep(20)
                    os._exit(0)
                children.append(child)
                time.sleep(0.005)
        forker = threading.Thread(target=fork_meanwhile)
        forker.start()
        arming.set()
        dog = watchdog(args, until_idle=False)
        arming.clear()
        forker.join()
        print("CHILDREN", *children, flush=True)
        armed(dog)
        time.sleep(60)
    """)
    children = [int(pid) for pid in trainer.read("CHILDREN")[1:]]
    try:
        trainer.armed()
        assert children, "no child was forked during arming"
        trainer.proc.kill()
        died = trainer.death()
        assert wait_until(lambda: len(stub.requests) >= len(IDS), 10.0), "a forked child held the pipe open"
        assert all(request.at - died < 2.0 for request in stub.requests)
    finally:
        for child in children:
            if not gone(child):
                os.kill(child, signal.SIGKILL)


def test_descriptors_closed_and_reused_are_never_ours(stub: AgentServerStub, tmp_path: Path) -> None:
    log_file = tmp_path / "app.log"
    trainer = Trainer(stub, f"""
        dog = watchdog(args, until_idle=False)
        armed(dog)
        os.closerange(3, 256)  # daemonizing code
        logs = [open({str(log_file)!r}, "a") for _ in range(4)]  # takes the freed numbers
        args.session_server_instance_id = "wd-after"
        print("CLOSED", dog.refresh(), dog.armed, flush=True)
        for handle in logs:
            handle.write("still mine\\n")
            handle.flush()
        print("WROTE", flush=True)
        report = abort(args, deadline=5)  # re-arms, beside the flush
        until(lambda: dog.armed)
        print("REARMED", report.ok, dog.armed, dog.pid, flush=True)
        time.sleep(60)
    """)
    trainer.armed()
    assert trainer.read("CLOSED")[1:] == ["False", "False"]
    trainer.read("WROTE")
    words = trainer.read("REARMED")
    _watchdog_pids.append(int(words[3]))
    assert words[1:3] == ["True", "True"] and int(words[3]) != trainer.watchdog_pid
    text = log_file.read_text()
    assert text == "still mine\n" * 4  # nothing of ours was written there, and nothing of theirs closed
    assert SECRET not in text


def test_big_records_and_long_ids_are_recovered(stub: AgentServerStub, tmp_path: Path) -> None:
    trainer = Trainer(stub, f"""
        args.session_server_instance_ids = {{n: f"long-{{n:04d}}-" + "y" * 480 for n in range(2500)}}
        args.session_server_instance_id = "z" * 2000
        armed(watchdog(args, ledger={str(tmp_path)!r}))
        time.sleep(60)
    """)
    pid = trainer.armed()
    [record] = records(tmp_path)
    assert record.stat().st_size > 1 << 20
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: gone(pid), 2.0)
    trainer.proc.kill()
    trainer.death()
    report = recover(str(tmp_path), servers=stub.url, environ=ENV, until_idle=False)
    # Every id abort would flush, the 2,000-character one included (issue 34: one rule for an id).
    assert len(report.results) == 2501 and report.ok and report.error is None
    assert len(set(stub.flushed_ids())) == 2501 and "z" * 2000 in stub.flushed_ids()
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_watchdog_costs_one_state_and_no_waiting(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, stdin=True, body="""
        import tracemalloc
        dog = watchdog(args, until_idle=False, deadline=20)
        armed(dog)
        sys.stdin.readline()
        tracemalloc.start()
        started = time.monotonic()
        for step in range(60):
            args.session_server_instance_ids = {n: f"s{step:02d}-{n:05d}-" + "x" * 70 for n in range(2000)}
            dog.refresh()
        took = time.monotonic() - started
        held, _ = tracemalloc.get_traced_memory()
        print("STEPS", round(took, 2), held, flush=True)
        sys.stdin.readline()
        end = time.monotonic() + 20  # the resumed watchdog catches up with what waited in its pipe
        confirmed = dog.refresh()
        while not confirmed and time.monotonic() < end:  # only refresh() reads its word: none is missed
            time.sleep(0.01)
            confirmed = dog.refresh()
        print("AGAIN", confirmed, dog.armed, flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: stopped(pid), 2.0)
    trainer.go_on()
    words = trainer.read("STEPS", timeout=60)
    assert float(words[1]) < 0.5 * 60 / 2  # not a wait a step (60 x 0.5 s): half of that, a loaded host's margin
    assert int(words[2]) < 2_000_000  # about one state's worth is kept, not 60 of them (0.4.0: 27 MB)
    os.kill(pid, signal.SIGCONT)
    trainer.go_on()
    assert trainer.read("AGAIN", timeout=30)[1:] == ["True", "True"]
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(stub.requests) >= 2001, 15.0)
    flushed = set(stub.flushed_ids())
    assert len(flushed) == 2001 and all(instance_id.startswith(("s59-", "wd-c")) for instance_id in flushed)


def test_arming_with_stdio_closed(stub: AgentServerStub, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = PRELUDE + textwrap.dedent(f"""
        with open({str(out)!r}, "w") as note:
            dog = watchdog(args, until_idle=False)
            note.write(f"ARMED {{dog.pid}} {{dog.armed}}\\n")
            args.session_server_instance_id = "wd-late"
            note.write(f"REFRESHED {{refreshed(dog)}}\\n")
        time.sleep(60)
    """)
    env = subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    proc = spawn(["sh", "-c", 'exec "$0" -c "$1" <&- >&- 2>&-', PYTHON, script], env=env, start_new_session=True)
    assert wait_until(lambda: out.exists() and "REFRESHED" in out.read_text(), 20.0), \
        out.read_text() if out.exists() else "no output"
    words = out.read_text().split()
    _watchdog_pids.append(int(words[1]))
    assert words[2:] == ["True", "REFRESHED", "True"]
    proc.kill()
    proc.wait()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)
    assert sorted(stub.flushed_ids()) == ["wd-a", "wd-b", "wd-late"]


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.015, 0.02, 0.03])
def test_sigterm_during_arming_flushes_each_pair_once(stub: AgentServerStub, delay: float) -> None:
    trainer = Trainer(stub, """
        flush_on_signal(args, until_idle=False)
        print("ARMING", flush=True)
        dog = watchdog(args, until_idle=False)
        armed(dog)
        time.sleep(60)
    """)
    trainer.read("ARMING")
    time.sleep(delay)
    trainer.proc.send_signal(signal.SIGTERM)
    trainer.death()
    assert trainer.proc.returncode == -signal.SIGTERM
    time.sleep(1.5)  # a watchdog that was not disarmed would have flushed by now
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)
    assert trainer.proc.stdout is not None
    for line in trainer.proc.stdout.read().splitlines():
        if line.startswith("ARMED"):
            _watchdog_pids.append(int(line.split()[1]))
