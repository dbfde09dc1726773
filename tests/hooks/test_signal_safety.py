"""A step's deadline holds whatever the trainer's signals and its watchdog do (issue 52).

Real trainers, real signals: the main thread flushes every step while its handler, on a signal every
3-20 ms for 3 s, flushes too. Each call must end within its deadline, and the trainer must go on.
The signals come from a thread of the trainer that blocks them itself, so the kernel delivers them
to the main thread: they interrupt its blocking calls too, not only the bytecodes between them.
Then watchdog trouble: one that died and whose replacement starts late, a guard that is stopped.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from swe_flush_sync._process.proc import process_stopped
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, StartGuard, _watchdog_pids, subprocess_env, wait_until
from ..helpers import Trainer

DEADLINE = 2.0
MARGIN = 1.5  # a loaded host's scheduling, on top of the deadline

STORM = """
import asyncio, faulthandler, random, threading
faulthandler.register(signal.SIGUSR2)  # the test asks for every thread's stack before it ends a hung trainer
from swe_flush_sync import Flusher, abort_async, flush
URL, SECRET = os.environ["AGENT_SERVER_URL"], os.environ["HARBOR_ADMIN_SECRET"]
DEADLINE = {deadline}
flusher = Flusher(URL, admin_secret=SECRET)
handler_args = argparse.Namespace(session_server_instance_id="h-0")
slowest, handled, steps, depth = [0.0, ""], [0], [0], [0]
dog = None

def timed(what, call):
    started = time.monotonic()
    call()
    took = time.monotonic() - started
    if took > slowest[0]:
        slowest[:] = [took, what]

def main_call():
    {main}

def handler_call():
    {handler}

def loop_running():  # a handler nested in a handler's asyncio.run: asyncio allows one loop a thread
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True

def on_signal(signum, frame):
    if depth[0] >= 2:  # a handler may interrupt a handler; deeper, a loaded host's storm would only recurse
        return
    depth[0] += 1
    try:
        handled[0] += 1
        handler_args.session_server_instance_id = f"h-{{handled[0]}}"
        timed("handler", handler_call)
    finally:
        depth[0] -= 1

signal.signal(signal.{signal}, on_signal)
{arm}
stop = threading.Event()

def storm():
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.{signal}}})  # delivered to the main thread
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        time.sleep(random.uniform(0.003, 0.02))
        os.kill(os.getpid(), signal.{signal})
    stop.set()

threading.Thread(target=storm, daemon=True).start()
while not stop.is_set():
    steps[0] += 1
    args.session_server_instance_id = f"m-{{steps[0]}}"
    timed("main", main_call)
signal.signal(signal.{signal}, signal.SIG_IGN)
if dog is not None:
    dog.disarm()
print("DONE", steps[0], handled[0], round(slowest[0], 3), slowest[1], flush=True)
"""

CALLS = {
    "abort": ("abort(args, deadline=DEADLINE)", "abort(handler_args, deadline=DEADLINE)"),
    "flush": ("flush(URL, [f'm-{steps[0]}', 'wd-a'], admin_secret=SECRET, deadline=DEADLINE)",
              "flush(URL, [f'h-{handled[0]}', 'wd-a'], admin_secret=SECRET, deadline=DEADLINE)"),
    "Flusher.flush": ("flusher.flush([f'm-{steps[0]}', 'wd-a'], deadline=DEADLINE)",
                      "flusher.flush([f'h-{handled[0]}', 'wd-a'], deadline=DEADLINE)"),
    "refresh": ("abort(args, deadline=DEADLINE)", "dog.refresh()"),
    # (a handler cannot start an event loop while the one it interrupted runs: one side is synchronous)
    "abort_async in the handler": ("abort(args, deadline=DEADLINE)",
                                   "abort(handler_args, deadline=DEADLINE) if loop_running() else "
                                   "asyncio.run(abort_async(handler_args, deadline=DEADLINE))"),
    "abort_async interrupted": ("asyncio.run(abort_async(args, deadline=DEADLINE))",
                                "abort(handler_args, deadline=DEADLINE)"),
}


def storm(stub: AgentServerStub, call: str, *, signal: str = "SIGUSR1", arm: str = "") -> Trainer:
    main, handler = CALLS[call]
    if arm:
        arm += "; print('ARMED', dog.pid, flush=True)"
    trainer = Trainer(stub, STORM.format(deadline=DEADLINE, main=main, handler=handler, signal=signal, arm=arm),
                      HARBOR_ADMIN_SECRET=SECRET)
    if arm:
        trainer.armed()  # ended by its pid after the test, whatever happens
    return trainer


def weathered(trainer: Trainer) -> None:
    """The trainer got through the storm: it said DONE, no call took longer than its deadline, it ended."""
    proc = trainer.proc
    try:  # the storm lasts 3 s and a call at most DEADLINE: a trainer still running long after is hung
        out, err = proc.communicate(timeout=30 + 10 * (DEADLINE + MARGIN))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR2)  # its stacks, for the failure message
        try:
            out, err = proc.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=30)
        pytest.fail(f"the trainer hung; its threads:\n{err[-6000:]}")
    assert proc.returncode == 0, err
    words = next(line.split() for line in out.splitlines() if line.startswith("DONE"))
    steps, handled, slowest, who = int(words[1]), int(words[2]), float(words[3]), words[4]
    print(f"[storm] {steps} steps, {handled} signals handled, slowest call {slowest:.3f}s ({who})")
    assert handled > 0 and steps > 0
    assert slowest <= DEADLINE + MARGIN, f"a {who} call took {slowest:.3f}s of a {DEADLINE}s deadline"


@pytest.mark.parametrize("run", [1, 2, 3])
def test_a_handlers_abort_during_the_main_threads_abort_never_hangs(stub: AgentServerStub, run: int) -> None:
    weathered(storm(stub, "abort"))


@pytest.mark.parametrize("call", ["flush", "Flusher.flush", "abort_async in the handler", "abort_async interrupted"])
def test_a_handlers_flush_during_the_main_threads_flush_never_hangs(stub: AgentServerStub, call: str) -> None:
    weathered(storm(stub, call))


def test_a_sigterm_handlers_abort_never_hangs(stub: AgentServerStub) -> None:
    weathered(storm(stub, "abort", signal="SIGTERM"))


@pytest.mark.parametrize("call", ["abort", "refresh"])
def test_a_handler_with_a_local_watchdog_never_hangs(stub: AgentServerStub, call: str) -> None:
    weathered(storm(stub, call, arm="dog = watchdog(args, until_idle=False)"))


def test_a_handlers_abort_through_a_guard_never_hangs(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    weathered(storm(stub, "abort", arm=f"dog = watchdog(args, guard={guard.socket!r}, until_idle=False)"))


def test_a_watchdog_that_died_is_armed_again_beside_the_flush(stub: AgentServerStub, tmp_path: Path) -> None:
    """The OOM killer took the watchdog, and its replacement starts 2 s late (a loaded node): the next
    step's flush starts at once with its whole deadline, and the re-arming is said at a later abort."""
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f"#!/bin/sh\nsleep 2\nexec {PYTHON} \"$@\"\n")
    slow_python.chmod(slow_python.stat().st_mode | stat.S_IXUSR)
    trainer = Trainer(stub, stdin=True, body=f"""
        import logging
        said = []
        class Keep(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("swe_flush_sync").addHandler(Keep())
        dog = watchdog(args, until_idle=False)
        armed(dog)
        sys.stdin.readline()  # the watchdog is SIGKILLed meanwhile
        until(lambda: not dog.linked)
        sys.executable = {str(slow_python)!r}  # what starts the next watchdog
        args.session_server_instance_id = "after-the-death"
        started = time.monotonic()
        report = abort(args, deadline=0.5)
        print("ABORTED", round(time.monotonic() - started, 3), report.ok, flush=True)
        until(lambda: dog.armed)
        print("REARMED", dog.pid, flush=True)
        until(lambda: abort(args, deadline=0.5).ok and said)  # a later abort says what happened meanwhile
        print("SAID", said, flush=True)
        dog.disarm()
    """)
    first = trainer.armed()
    os.kill(first, signal.SIGKILL)
    trainer.go_on()
    words = trainer.read("ABORTED", timeout=30)
    print(f"[rearm] abort took {words[1]}s of a 0.5 s deadline while the new watchdog started")
    assert float(words[1]) <= 1.0 and words[2] == "True"
    assert "after-the-death" in stub.flushed_ids()  # sent within the deadline, not after the re-arming
    second = int(trainer.read("REARMED", timeout=30)[1])
    _watchdog_pids.append(second)
    assert second != first
    line = " ".join(trainer.read("SAID", timeout=30))
    assert f"had ended; re-armed as pid {second}" in line, line
    _, err = trainer.proc.communicate(timeout=30)
    assert trainer.proc.returncode == 0, err


def test_a_stopped_guard_costs_no_step_more_than_its_deadline(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = Trainer(stub, stdin=True, body=f"""
        dog = watchdog(args, guard={guard.socket!r}, until_idle=False)
        armed(dog)
        sys.stdin.readline()  # the guard is SIGSTOPped meanwhile
        slowest = 0.0
        for step in range(30):
            args.session_server_instance_id = f"stopped-guard-{{step}}"
            started = time.monotonic()
            abort(args, deadline=0.2)
            slowest = max(slowest, time.monotonic() - started)
        print("SLOWEST", round(slowest, 3), flush=True)
        sys.stdin.readline()  # the guard runs again
        dog.disarm()
    """)
    trainer.armed()
    os.kill(guard.proc.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: process_stopped(guard.proc.pid), 5.0)
        trainer.go_on()
        slowest = float(trainer.read("SLOWEST", timeout=60)[1])
    finally:
        os.kill(guard.proc.pid, signal.SIGCONT)
    print(f"[stopped guard] slowest of 30 aborts: {slowest:.3f}s of a 0.2 s deadline")
    assert slowest <= 0.4
    assert {f"stopped-guard-{step}" for step in range(30)} & set(stub.flushed_ids())  # the flushes still go out
    trainer.go_on()
    _, err = trainer.proc.communicate(timeout=30)
    assert trainer.proc.returncode == 0, err


INBOX_STORM = """
import os, queue, random, signal, threading, time
from swe_flush_sync._core.threads import Inbox
signal.signal(signal.SIGUSR1, lambda signum, frame: time.sleep(0.001))  # a handler that takes a moment
stop = threading.Event()

def storm():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # delivered to the main thread, which waits
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        time.sleep(random.uniform(0.001, 0.003))
        os.kill(os.getpid(), signal.SIGUSR1)
    stop.set()

threading.Thread(target=storm, daemon=True).start()
waits, late = 0, 0.0
while not stop.is_set():
    inbox = Inbox()
    started = time.monotonic()
    try:
        inbox.get(timeout=0.02)
    except queue.Empty:
        pass
    late = max(late, time.monotonic() - started - 0.02)
    waits += 1
print("WAITED", waits, round(late, 3), flush=True)
"""


def test_a_calls_wait_ends_by_its_timeout_whatever_signals_come() -> None:
    """A flush waits for room and for answers in the calling thread, where signal handlers run. On CPython
    3.10-3.12 ``SimpleQueue.get(timeout=...)`` waits for ever once a handler runs past its timeout: this
    storm hung it within 2 s, 3 runs of 3 on 3.11, and the storm of ``Flusher.flush`` above 2 in 70. A call's
    ``Inbox`` waits on a lock, whose timeout holds."""
    out = subprocess.run([PYTHON, "-c", INBOX_STORM], capture_output=True, text=True, timeout=60,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr[-2000:]
    _, waits, late = out.stdout.split()
    assert int(waits) > 10 and float(late) < 1.0, out.stdout
