"""The watchdog in real processes: trainers that really die, a watchdog that really flushes over sockets.

Every trainer is a child Python started in its own session (so a signal to its group reaches
nothing else); every watchdog it arms is ended by its pid after the test if it still runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable

import pytest

from swe_flush_sync import ConfigError, Watchdog, watchdog
from swe_flush_sync._process.proc import process_stat
from swe_flush_sync.testing import AgentServerStub

from ..conftest import SECRET, _watchdog_pids, blocked_in, gone, proc_stat, proc_status, wait_until
from ..helpers import IDS, Trainer

DEATHS = {
    "sigkill": "time.sleep(60)",
    "segfault": "import ctypes; ctypes.string_at(0)",
    "os.abort": "os.abort()",
    "os._exit": "os._exit(3)",
    "uncaught exception": "raise RuntimeError('the trainer failed')",
    "normal return": "pass",
    "sigint to the group": "time.sleep(60)",
}


@pytest.mark.parametrize("death", list(DEATHS))
def test_every_death_flushes_each_id_once(stub: AgentServerStub, death: str) -> None:
    for instance_id in IDS:
        stub.add_trials(instance_id, 2)
    deadline = 5.0
    trainer = Trainer(stub, f"""
        armed(watchdog(args, deadline={deadline}, until_idle=False))
        {DEATHS[death]}
    """)
    trainer.armed()
    if death == "sigkill":
        trainer.proc.kill()
    elif death == "sigint to the group":
        assert blocked_in(trainer.proc.pid)
        os.killpg(trainer.proc.pid, signal.SIGINT)  # Ctrl-C: the trainer's whole process group
    died = trainer.death()
    assert wait_until(lambda: len(stub.requests) >= len(IDS), 3.0), f"{death}: not flushed within 3 s"
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)
    assert all(request.at - died <= 3.0 for request in stub.requests), [r.at - died for r in stub.requests]
    assert [stub.trials(instance_id) for instance_id in IDS] == [0, 0, 0]
    err = trainer.stderr_after_watchdog(deadline + 1 - (time.monotonic() - died))
    assert f"swe-flush watchdog for pid {trainer.proc.pid}: trainer gone; flushed 3/3 targets" in err
    assert len(stub.requests) == len(IDS)  # and nothing more: the watchdog is gone (the stub records before it answers)


def stays_idle(pid: int, window: float, timeout: float) -> bool:
    """Wait until the process used no CPU for ``window`` seconds; False if not within ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ticks = _cpu_ticks(pid)
        if not wait_until(lambda before=ticks: _cpu_ticks(pid) != before, window):
            return True
    return False


def test_watchdog_survives_signals_and_waits_without_cpu(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        started = time.monotonic()
        dog = watchdog(args, until_idle=False)
        print("TOOK", time.monotonic() - started, flush=True)
        armed(dog)
        time.sleep(60)
    """)
    took = float(trainer.read("TOOK")[1])
    pid = trainer.armed()
    assert took < 2.0  # the issue asks 0.5 s: measured in benchmarks/, here only a bound with a margin
    fields = proc_stat(pid)
    parent, group, session = int(fields[1]), int(fields[2]), int(fields[3])
    # double-forked into a session of its own: not the trainer's child, not in its group or session
    assert parent != trainer.proc.pid and group != trainer.proc.pid and session != os.getsid(trainer.proc.pid)
    assert session != pid  # and not a session leader: it can never acquire a controlling terminal
    assert not [child for child in _children_of(trainer.proc.pid)]  # no zombie left in the trainer

    # it loads part of the standard library once watchdog() has returned: wait until it is done
    assert stays_idle(pid, 1.0, 20.0)
    cpu_before = _cpu_ticks(pid)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        os.kill(pid, signum)
    time.sleep(1.0)
    assert not gone(pid) and stub.requests == []
    assert _cpu_ticks(pid) == cpu_before  # blocked on the pipe: no CPU while it waits
    assert _rss_kib(pid) < 30 * 1024

    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        command = handle.read().replace(b"\0", b" ").decode()
    assert SECRET not in command
    assert "_process/watchdog_process.py" in command and f"--trainer-pid {trainer.proc.pid}" in command
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: len(stub.requests) == len(IDS), 5.0)


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = process_stat(int(entry))
            if fields is not None and int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _cpu_ticks(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[11]) + int(fields[12])  # utime + stime


def _rss_kib(pid: int) -> int:
    return proc_status(pid, "VmRSS")


def test_disarm_then_sigkill_flushes_nothing(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        dog = watchdog(args)
        armed(dog)
        dog.disarm()
        dog.disarm()  # idempotent
        print("DISARMED", dog.armed, flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    assert trainer.read("DISARMED") == ["DISARMED", "False"]
    assert wait_until(lambda: gone(pid), 1.0), "a disarmed watchdog must exit within a second"
    trainer.proc.kill()
    trainer.death()
    assert stub.requests == []  # and no watchdog is left that could send one


def test_refresh_hands_over_changed_ids(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        dog = watchdog(args, until_idle=False)
        armed(dog)
        unchanged = dog.refresh()
        args.session_server_instance_ids = {8002: "wd-new"}
        args.session_server_instance_id = None
        print("REFRESHED", unchanged, refreshed(dog), dog.refresh(), flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    assert trainer.read("REFRESHED") == ["REFRESHED", "False", "True", "False"]
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 5.0)  # it flushed, then exited: nothing more can come
    assert stub.flushed_ids() == ["wd-new"]


def test_abort_hands_the_new_ids_to_the_watchdog(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        dog = watchdog(args, until_idle=False)
        armed(dog)
        args.session_server_instance_ids = {8002: "wd-new"}
        args.session_server_instance_id = None
        # abort handed them over: once the watchdog holds them, a refresh has nothing new to hand
        print("ABORTED", abort(args).ok, until(lambda: dog.armed), dog.refresh(), flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    assert trainer.read("ABORTED") == ["ABORTED", "True", "True", "False"]
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 5.0)  # it flushed, then exited: nothing more can come
    assert stub.flushed_ids() == ["wd-new", "wd-new"]  # abort's flush, then the watchdog's


@pytest.mark.parametrize("hook", ["exit", "sigterm"])
def test_a_hook_that_flushed_everything_disarms_the_watchdog(stub: AgentServerStub, hook: str) -> None:
    install = "flush_at_exit(args, deadline=5)" if hook == "exit" else "flush_on_signal(args, deadline=5)"
    trainer = Trainer(stub, f"""
        {install}
        armed(watchdog(args, deadline=5, until_idle=False))
        {"pass" if hook == "exit" else "time.sleep(60)"}
    """)
    pid = trainer.armed()
    if hook == "sigterm":
        assert blocked_in(trainer.proc.pid)
        trainer.proc.send_signal(signal.SIGTERM)
    trainer.death()
    assert trainer.proc.returncode == (0 if hook == "exit" else -signal.SIGTERM)
    assert wait_until(lambda: gone(pid), 1.0)  # the watchdog is gone: nothing more can come
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)  # by the hook; the watchdog was disarmed


def test_a_hook_that_failed_leaves_the_watchdog_armed(stub: AgentServerStub) -> None:
    stub.fault("wd-b", statuses=[500] * 10)
    trainer = Trainer(stub, """
        flush_at_exit(args, deadline=5, retries=0)
        armed(watchdog(args, deadline=5, retries=0, until_idle=False))
    """)
    pid = trainer.armed()
    trainer.death()
    assert wait_until(lambda: gone(pid), 6.0)
    flushed = Counter(request.instance_id for request in stub.requests)
    assert flushed == dict.fromkeys(IDS, 2)  # the hook's, then the watchdog's: wd-b failed at exit


# The os module as the trainer's link sees it: its next write takes only half of what it is given,
# and a real SIGUSR1 arrives as that write returns (before the link knows how much it wrote).
CUT_SHORT = """
from swe_flush_sync._watchdog import link as _watchdog_link
class CutShort:
    fired = False
    def __getattr__(self, name):
        return getattr(os, name)
    def write(self, fd, data):
        if self.fired:
            return os.write(fd, data)
        self.fired = True
        written = os.write(fd, bytes(data[:len(data) // 2]))
        os.kill(os.getpid(), signal.SIGUSR1)
        return written
"""


def test_a_disarm_in_a_signal_handler_that_cuts_a_hand_over_short_leaves_no_flush(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, CUT_SHORT + """
dog = watchdog(args)
armed(dog)
signal.signal(signal.SIGUSR1, lambda *_: dog.disarm())  # the trainer flushed everything itself
_watchdog_link.os = CutShort()
args.session_server_instance_id = "wd-d"
dog.refresh()
print("DISARMED", dog.linked, flush=True)
time.sleep(60)
""")
    pid = trainer.armed()
    assert trainer.read("DISARMED") == ["DISARMED", "False"]
    assert wait_until(lambda: gone(pid), 5.0), "a disarmed watchdog must exit"
    trainer.proc.kill()
    trainer.death()
    assert stub.requests == []  # the disarm was read whole: the half-written state before it was dropped


def test_a_hook_that_cuts_a_hand_over_short_leaves_the_watchdog_the_new_ids(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, CUT_SHORT + """
signal.signal(signal.SIGUSR1, lambda *_: None)  # a graceful stop: the trainer goes on after the hook
flush_on_signal(args, signals=(signal.SIGUSR1,), deadline=5)
dog = watchdog(args, until_idle=False)
armed(dog)
_watchdog_link.os = CutShort()
args.session_server_instance_id = "wd-d"
dog.refresh()
print("HELD", until(lambda: dog.refresh() or dog.armed), flush=True)
time.sleep(60)
""")
    pid = trainer.armed()
    assert trainer.read("HELD") == ["HELD", "True"]
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 5.0)
    new_ids = {"wd-a", "wd-b", "wd-d"}  # the singular id was replaced
    assert Counter(stub.flushed_ids()) == dict.fromkeys(new_ids, 2)  # the hook's flush, then the watchdog's


def test_a_forked_child_does_not_hide_the_death(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, """
        dog = watchdog(args, until_idle=False)
        armed(dog)
        child = os.fork()
        if child == 0:  # a data loader, say: lives on after the trainer is killed
            known = sys.modules["swe_flush_sync._watchdog.api"]._watchdogs
            print("CHILD", os.getpid(), dog.armed, len(known), flush=True)
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
    """)
    trainer.armed()
    child = trainer.read("CHILD")
    child_pid = int(child[1])
    try:
        assert child[2:] == ["False", "0"]  # the child closed its copy and has no watchdog
        trainer.proc.kill()
        trainer.death()
        assert not gone(child_pid)
        assert wait_until(lambda: len(stub.requests) >= len(IDS), 5.0)  # (hidden: not before the child's 60 s)
        assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_nothing_is_left_running_on_a_server_with_slots(stub_factory: Callable[..., AgentServerStub]) -> None:
    server = stub_factory(secret=SECRET, teardown=0.05, max_concurrent=4)
    server.add_trials("wd-a", 7)
    server.add_trials("wd-b", 5)
    assert server.waiting() == 8
    trainer = Trainer(server, """
        armed(watchdog(args, deadline=10))  # until_idle by default
        time.sleep(60)
    """)
    trainer.armed()
    trainer.proc.kill()
    died = trainer.death()
    err = trainer.stderr_after_watchdog(11 - (time.monotonic() - died))
    assert [server.trials(i) for i in IDS] == [0, 0, 0] and server.waiting() == 0
    assert "12 trials cancelled" in err and "3/3 idle" in err


def test_scoped_bearers_and_a_broken_stderr(stub_factory: Callable[..., AgentServerStub]) -> None:
    master = "m" * 40
    server = stub_factory(scoped_secret=master)
    trainer = Trainer(server, """
        armed(watchdog(args, until_idle=False))
        time.sleep(60)
    """, HARBOR_ADMIN_SECRET="", HARBOR_RUN_SECRET=master)
    pid = trainer.armed()
    assert trainer.proc.stderr is not None
    trainer.proc.stderr.close()  # nobody reads the trainer's stderr any more: the summary line is lost
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 6.0)
    assert sorted(server.flushed_ids()) == list(IDS)
    assert all(request.status == 200 for request in server.requests)  # each with its own scoped bearer


# In this process: arm, inspect and disarm (never left armed: this process's end would trigger it).

@pytest.fixture
def args() -> argparse.Namespace:
    return argparse.Namespace(session_server_instance_ids={1: "wd-a"}, session_server_instance_id=None)


@pytest.fixture
def arm(stub: AgentServerStub, arm_in_process: Callable[..., Watchdog]) -> Callable[..., Watchdog]:
    """``arm_in_process`` against the stub."""
    return functools.partial(arm_in_process, environ={"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET})


def test_same_args_same_watchdog(arm: Callable[..., Watchdog], args: argparse.Namespace) -> None:
    first = arm(args)
    assert arm(args) is first and first.armed and "ledger=None" in repr(first)
    other = arm(argparse.Namespace(**vars(args)))
    assert other is not first and other.pid != first.pid
    first.disarm()
    assert not first.armed
    again = arm(args)
    assert again is not first and again.armed


def test_a_killed_watchdog_is_noticed_and_rearmed(arm: Callable[..., Watchdog], args: argparse.Namespace,
                                                 caplog: pytest.LogCaptureFixture, stub: AgentServerStub) -> None:
    from swe_flush_sync import abort

    dog = arm(args)
    ended = dog.pid

    def said_at_a_step(times: int) -> bool:
        abort(args, environ={}, deadline=1)  # (no server: nothing sent; the watchdog's news is said)
        return caplog.text.count("had ended") == times

    os.kill(ended, signal.SIGKILL)
    assert wait_until(lambda: not dog.armed, 10.0)
    with caplog.at_level("WARNING", logger="swe_flush_sync"):
        abort(args, environ={}, deadline=1)  # re-arms beside the flush, and says so at a later abort
        assert wait_until(lambda: dog.armed, 20.0)
        _watchdog_pids.append(dog.pid)
        # the same ids as before: the death is said all the same, once the re-arming thread has said it
        assert wait_until(lambda: said_at_a_step(1), 20.0)
        assert caplog.text.count(f"the watchdog process (pid {ended}) had ended; re-armed as pid {dog.pid}") == 1
        assert dog.pid != ended and dog.armed and arm(args) is dog
        for _ in range(3):
            abort(args, environ={}, deadline=1)
        assert caplog.text.count("had ended") == 1  # once per watchdog that ended
        os.kill(dog.pid, signal.SIGKILL)
        assert wait_until(lambda: not dog.armed, 10.0)
        abort(args, environ={}, deadline=1)
        assert wait_until(lambda: dog.armed, 20.0)
        _watchdog_pids.append(dog.pid)
        assert wait_until(lambda: said_at_a_step(2), 20.0)
    assert caplog.text.count("had ended") == 2 and dog.armed
    assert stub.requests == []  # SIGKILLed watchdogs flush nothing


def test_fork_in_this_process(arm: Callable[..., Watchdog], args: argparse.Namespace,
                              stub: AgentServerStub) -> None:
    dog = arm(args)
    with warnings.catch_warnings():  # 3.12+ warns of a fork while threads run (3.15 raises it under -W error)
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:
        os._exit(0 if not dog.armed and not dog.refresh() else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(0.3)
    assert dog.armed and stub.requests == []  # the child's exit is not the trainer's death


@pytest.mark.parametrize(("options", "environ", "message"), [
    ({}, {}, "no agent server configured"),
    ({"deadline": 0}, None, "deadline"),
    ({"ledger": ""}, None, "ledger"),
])
def test_bad_configuration(args: argparse.Namespace, stub: AgentServerStub, options: dict[str, object],
                           environ: dict[str, str] | None, message: str) -> None:
    env = {"AGENT_SERVER_URL": stub.url} if environ is None else environ
    with pytest.raises(ConfigError, match=message):
        watchdog(args, environ=env, **options)  # type: ignore[arg-type]


def test_misspelt_option_is_a_type_error(args: argparse.Namespace) -> None:
    with pytest.raises(TypeError):
        watchdog(args, linger=0)  # type: ignore[call-arg]  # linger does not apply to a watchdog


def test_disarming_a_stopped_watchdog_kills_it(arm: Callable[..., Watchdog], args: argparse.Namespace,
                                               stub: AgentServerStub) -> None:
    dog = arm(args)
    os.kill(dog.pid, signal.SIGSTOP)  # it reads nothing any more: the pipe fills up
    args.session_server_instance_ids = {n: f"wd-{n:06d}-" + "x" * 40 for n in range(2000)}  # ~100 KB a message
    dog.refresh()
    args.session_server_instance_id = "wd-more"
    dog.refresh()  # cannot be written in full: the rest waits for room
    started = time.monotonic()
    dog.disarm()
    assert time.monotonic() - started < 2.0  # bounded, never blocked on the pipe
    assert wait_until(lambda: gone(dog.pid), 1.0) and not dog.armed
    time.sleep(0.3)
    assert stub.requests == []  # killed, not flushed


def _watchdogs_of_this_trainer(trainer: int | None = None) -> list[int]:
    """The live watchdog processes of ``trainer`` (default: this process; their command line names it)."""
    mine = f"--trainer-pid\0{trainer or os.getpid()}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if mine in handle.read() and not gone(int(name)):
                    found.append(int(name))
                    _watchdog_pids.append(int(name))  # ended by its pid after the test if it still runs
        except (OSError, ValueError):
            continue
    return found


def test_arming_again_a_watchdog_that_has_not_confirmed_starts_no_second_one(
        arm: Callable[..., Watchdog], args: argparse.Namespace, stub: AgentServerStub) -> None:
    dog = arm(args)
    os.kill(dog.pid, signal.SIGSTOP)  # linked, but it confirms nothing now
    try:
        args.session_server_instance_id = "wd-new"
        assert not dog.refresh() and not dog.armed
        assert arm(args) is dog and dog.linked
        assert _watchdogs_of_this_trainer() == [dog.pid]
    finally:
        os.kill(dog.pid, signal.SIGCONT)
    assert wait_until(lambda: dog.refresh() or dog.armed, 10.0)
    dog.disarm()
    assert wait_until(lambda: not _watchdogs_of_this_trainer(), 10.0)
    assert stub.requests == []  # disarmed: no watchdog of this trainer is left to flush


@pytest.mark.parametrize("handler", ["abort(args)", "watchdog(args)"])
def test_a_signal_handler_while_watchdog_arms_starts_no_second_one(stub: AgentServerStub, handler: str) -> None:
    trainer = Trainer(stub, f"""
from swe_flush_sync._watchdog import ends as _watchdog_ends
signal.signal(signal.SIGUSR1, lambda *_: {handler})  # a user's handler
prepare = _watchdog_ends.End.prepare
def prepare_after_a_signal(self):
    _watchdog_ends.End.prepare = prepare
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while watchdog() arms, before anything is linked
    prepare(self)
_watchdog_ends.End.prepare = prepare_after_a_signal
armed(watchdog(args, until_idle=False))
time.sleep(60)
""")
    pid = trainer.armed()
    assert _watchdogs_of_this_trainer(trainer.proc.pid) == [pid]
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 5.0)
    flushes = 2 if handler.startswith("abort") else 1  # the handler's abort, then the one watchdog's
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, flushes)


def test_threads_arming_one_args_at_once_share_one_watchdog(arm: Callable[..., Watchdog],
                                                             args: argparse.Namespace) -> None:
    start = threading.Barrier(4)
    dogs: list[Watchdog] = []

    def arm_now() -> None:
        start.wait()
        dogs.append(arm(args))

    threads = [threading.Thread(target=arm_now) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(dogs) == 4 and all(dog is dogs[0] for dog in dogs) and dogs[0].armed
    assert _watchdogs_of_this_trainer() == [dogs[0].pid]


def test_threads_aborting_after_the_watchdog_died_rearm_it_once(arm: Callable[..., Watchdog],
                                                                 args: argparse.Namespace) -> None:
    from swe_flush_sync import abort

    dog = arm(args)
    os.kill(dog.pid, signal.SIGKILL)
    assert wait_until(lambda: not dog.linked, 10.0)
    start = threading.Barrier(4)

    def abort_now() -> None:
        start.wait()
        abort(args, environ={}, deadline=1)

    threads = [threading.Thread(target=abort_now) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _watchdog_pids.append(dog.pid)
    assert wait_until(lambda: dog.armed, 10.0)
    # armed turns True as the re-arming thread (beside the aborts) is about to reap the double fork's
    # first process: that one may still be seen for a moment; a second watchdog would stay
    assert wait_until(lambda: _watchdogs_of_this_trainer() == [dog.pid], 10.0), _watchdogs_of_this_trainer()
