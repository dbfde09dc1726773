"""Signals reach the main thread (issue 40): no thread the library starts in a trainer takes the
trainer's SIGTERM, so a main thread blocked in a sleep, a lock or a read is interrupted at once
and the hook flushes then, not when the blocking call returns. Real processes, real signals."""

from __future__ import annotations

import json
import signal
import time

from swe_flush_sync.testing import AgentServerStub

from ..conftest import StartGuard, blocked_in, wait_until
from ..helpers import Trainer

MASKS = """
import json, threading
hooks = flush_on_signal(args, deadline=5), flush_at_exit(args, deadline=5)
keeper = watchdog(args, guard={path!r}, until_idle=False)  # the follower thread
abort(args)  # the flush executor's workers
def blocked(native_id):
    with open(f"/proc/self/task/{{native_id}}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    return [number for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
            if mask & (1 << (number - 1))]
threads = {{t.name: blocked(t.native_id) for t in threading.enumerate() if t.name.startswith("swe-flush")}}
print("MASKS", json.dumps({{"main": blocked(threading.main_thread().native_id), "threads": threads}}), flush=True)
keeper.disarm()
"""


def test_library_threads_block_the_trainers_signals(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = Trainer(stub, MASKS.format(path=guard.socket))
    masks = json.loads(" ".join(trainer.read("MASKS")[1:]))
    assert masks["main"] == []  # the trainer's own thread is left as it was
    names = {name.split("_")[0] for name in masks["threads"]}
    assert {"swe-flush-standby", "swe-flush-guard-follower", "swe-flush"} <= names, names
    every = sorted([signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
    assert all(sorted(numbers) == every for numbers in masks["threads"].values()), masks["threads"]
    trainer.proc.communicate(timeout=20)


ROUNDS = 20
BLOCKING = """
import faulthandler, threading
faulthandler.register(signal.SIGUSR1)  # the test dumps every thread's stack if a round never flushes
class Interrupted(Exception):
    pass
def previous(signum, frame):
    raise Interrupted  # the handler the hook hands over to: it ends the blocking call
signal.signal(signal.SIGTERM, previous)
held = threading.Lock()
held.acquire()
for round in range({rounds}):
    for case in ("sleep", "lock", "stdin"):
        args.session_server_instance_ids = {{}}
        args.session_server_instance_id = f"r{{round}}-{{case}}"
        hook = flush_on_signal(args, deadline=5, until_idle=False)
        try:  # the signal may come as soon as READY is out
            print("READY", round, case, flush=True)
            if case == "sleep":
                time.sleep(30)
            elif case == "lock":
                held.acquire(timeout=30)
            else:
                sys.stdin.readline()
        except Interrupted:
            pass
        hook.uninstall()
print("END", flush=True)
"""


def test_sigterm_interrupts_a_blocked_main_thread_at_once(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, BLOCKING.format(rounds=ROUNDS), stdin=True)
    late: list[tuple[str, float]] = []
    for _ in range(ROUNDS * 3):
        _, round_number, case = trainer.read("READY")
        instance_id = f"r{round_number}-{case}"
        if case != "lock":  # (a lock wait looks like any other futex wait)
            assert blocked_in(trainer.proc.pid, "read" if case == "stdin" else "sleep")
        sent = time.monotonic()
        trainer.proc.send_signal(signal.SIGTERM)
        if not wait_until(lambda wanted=instance_id: wanted in stub.flushed_ids(), 10.0):
            trainer.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            trainer.proc.kill()
            _, err = trainer.proc.communicate(timeout=10)
            raise AssertionError(f"{instance_id} never flushed; the trainer's stderr and threads:\n{err}")
        started = next(r.at for r in stub.requests if r.instance_id == instance_id) - sent
        if started >= 1.0:
            late.append((instance_id, round(started, 3)))
    trainer.read("END")
    assert late == [], f"{len(late)} of {ROUNDS * 3} flushes started a second or more after the signal: {late}"
