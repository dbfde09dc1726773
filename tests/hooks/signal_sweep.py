"""The signal sweep's driver (``python signal_sweep.py ENTRY``; see ``test_signal_sweep``).

Its main thread runs one public entry point again and again; a profile function raises SIGUSR1 at
the k-th call event of library code and of the standard library's ``threading``, ``queue``,
``weakref`` and ``selectors`` under it (a Python function called there; with ``SWEEP_C_CALLS=1``
also each C function called from there), for k = 1, 2, ... until a call has no k-th event. The
handler calls the same entry point (the same options: the same Flusher), and every third time makes
a new ``Flusher`` and keeps it. A hang ends the driver with every thread's stack (faulthandler);
anything raised out of a call, a call failed although the server answers in time, or a hook that did
not post its final ids is a problem. The last line is JSON: the entry, the sweeps run, the signals
handled and the problems.

The hooks' flushes and the package's first use run in a forked child per k (each ends its process);
the other entries in this process, on the same Flusher throughout, as a trainer's steps do.
"""

from __future__ import annotations

import _weakrefset
import argparse
import faulthandler
import functools
import json
import os
import queue
import selectors
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import swe_flush_sync as sfs  # first: the first-use entry installs its handler right after the import
from swe_flush_sync.testing import AgentServerStub

HANG = 60.0  # seconds one sweep may take before it counts as a hang
LIBRARY = os.path.dirname(sfs.__file__) + os.sep
WATCHED = {module.__file__ for module in (threading, queue, weakref, _weakrefset, selectors)}
OPTIONS = {"deadline": 5.0, "max_workers": 2}
SHORT = {"deadline": 0.02, "max_workers": 2}
# Python calls; with SWEEP_C_CALLS=1 also C calls made from there (2.7 times the sweeps: run it by hand)
EVENTS = ("call", "c_call") if os.environ.get("SWEEP_C_CALLS") == "1" else ("call",)
IDS = {8001: "a", 8002: "slow"}  # "slow" answers after 0.2 s for abort-short


class Sweep:
    """What the profile function and the handler share: the target, the count, what happened."""

    target = 0
    count = 0
    fired = False
    handled = 0
    handler: Callable[[], object] = staticmethod(lambda: None)
    problems: ClassVar[list[str]] = []
    kept: ClassVar[list[sfs.Flusher]] = []
    tell: int | None = None  # a forked child's pipe to the driver: each line is said at once
    every_pair_answers = True  # the server answers every pair in time: each call's report must be ok

    @classmethod
    def problem(cls, line: str) -> None:
        cls.problems.append(line)
        if cls.tell is not None:
            os.write(cls.tell, line.encode().replace(b"\n", b" | ") + b"\n")


def profile(frame: object, event: str, arg: object) -> None:
    if event not in EVENTS:
        return
    name = frame.f_code.co_filename  # type: ignore[attr-defined]
    if not (name.startswith(LIBRARY) or name in WATCHED):
        return
    Sweep.count += 1
    if Sweep.count == Sweep.target:
        sys.setprofile(None)
        Sweep.fired = True
        if Sweep.tell is not None:
            os.write(Sweep.tell, b"fired\n")
        signal.raise_signal(signal.SIGUSR1)


def on_signal(signum: int, frame: object) -> None:
    Sweep.handled += 1
    try:
        checked("handler's", Sweep.handler())
        if Sweep.target % 3 == 0:
            Sweep.kept.append(sfs.Flusher(os.environ["AGENT_SERVER_URL"], **OPTIONS))
    except BaseException:
        Sweep.problem(f"k={Sweep.target}: the handler's call raised:\n{traceback.format_exc()}")


def checked(whose: str, out: object) -> None:
    """A report that is not ok where the server answers every pair in time is a problem (a call that
    waited on a request the call it interrupted could not hand over, until its deadline)."""
    report = out[-1] if isinstance(out, tuple) else out
    if Sweep.every_pair_answers and isinstance(report, sfs.FlushReport) and not report.ok:
        Sweep.problem(f"k={Sweep.target}: the {whose} call failed: {report.summary()}")


def args(name: str, k: int) -> argparse.Namespace:
    return argparse.Namespace(session_server_instance_ids={**IDS, 9000: f"{name}-{k}"},
                              session_server_instance_id="a")


def swept(call: Callable[[], object], k: int) -> None:
    """Run ``call`` with the signal forced at the k-th event."""
    Sweep.target, Sweep.count, Sweep.fired = k, 0, False
    faulthandler.dump_traceback_later(HANG, exit=True)
    sys.setprofile(profile)
    try:
        call()
    except BaseException:
        Sweep.problem(f"k={k}: the main thread's call raised:\n{traceback.format_exc()}")
    finally:
        sys.setprofile(None)
        faulthandler.cancel_dump_traceback_later()


def in_process(entry: str, stub: AgentServerStub) -> int:
    url = stub.url
    flusher = sfs.Flusher(url, **OPTIONS)
    ledger = tempfile.mkdtemp(prefix="sweep-ledger-")
    calls: dict[str, Callable[[int, str], object]] = {
        "abort-short": lambda k, who: sfs.abort(args(who, k), **SHORT),
        "abort-long": lambda k, who: sfs.abort(args(who, k), **OPTIONS),
        "flush": lambda k, who: sfs.flush(url, [*IDS.values(), f"{who}-{k}"], **OPTIONS),
        "Flusher.flush": lambda k, who: flusher.flush([*IDS.values(), f"{who}-{k}"]),
        "recover": lambda k, who: (lost(ledger, url, f"{who}-{k}"), sfs.recover(ledger, servers=url)),
    }
    if entry == "refresh":
        trainer_args = args("main", 0)
        dog = sfs.watchdog(trainer_args, until_idle=False)
        print("watchdog", dog.pid, flush=True)

        def refresh(k: int, who: str) -> object:
            trainer_args.session_server_instance_ids[9000] = f"{who}-{k}"  # a new state to hand over
            return dog.refresh()
        calls["refresh"] = refresh
    call = calls[entry]
    k = 0
    while True:
        k += 1
        Sweep.handler = lambda k=k: call(k, "handler")  # type: ignore[misc]
        swept(lambda k=k: call(k, "main"), k)  # type: ignore[misc]
        if not Sweep.fired:
            if entry == "refresh":
                dog.disarm()
            return k
        if entry == "recover":
            flushed = set(stub.flushed_ids())
            missing = [f"{who}-{k}" for who in ("main", "handler") if f"{who}-{k}" not in flushed]
            if missing:
                Sweep.problems.append(f"k={k}: recover left {missing} unflushed")


def lost(ledger: str, url: str, instance_id: str) -> None:
    """A record of a trainer lost with its node (another host, no heartbeat for an hour)."""
    path = Path(ledger, f"lost-{instance_id}.json")
    path.write_text(json.dumps({"version": 1, "urls": [url], "ids": [instance_id], "host": "elsewhere", "pid": 1,
                                "start_time": 1, "boot_id": "another-boot", "heartbeat": time.time() - 3600,
                                "heartbeat_interval": 10.0}))
    path.chmod(0o600)


def in_children(entry: str, stub: AgentServerStub) -> int:
    """Each k in a forked child: the hooks end their process, and a first use is first once."""
    k = 0
    while True:
        k += 1
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (the stub's thread: the child needs none of it)
            pid = os.fork()
        if pid == 0:
            os.close(read)
            child(entry, k, write)  # never returns
        os.close(write)
        with os.fdopen(read) as said:
            lines = said.read().splitlines()
        _, status = os.waitpid(pid, 0)
        expected = -signal.SIGTERM if entry == "sigterm-hook" else 0
        if os.waitstatus_to_exitcode(status) != expected:
            Sweep.problems.append(f"k={k}: the child ended with {os.waitstatus_to_exitcode(status)}, not {expected}")
        Sweep.problems += [line for line in lines if line.startswith("k=")]
        Sweep.handled += "fired" in lines
        if entry != "first-use" and f"final-{k}" not in stub.flushed_ids():
            Sweep.problems.append(f"k={k}: the {entry} did not post its final ids")
        if "fired" not in lines:
            return k


def child(entry: str, k: int, write: int) -> None:
    Sweep.tell = write
    final = argparse.Namespace(session_server_instance_ids={**IDS, 9000: f"final-{k}"})
    Sweep.handler = lambda: sfs.abort(args("handler", k), **OPTIONS)  # the hooks' options: the same Flusher
    if entry == "first-use":
        swept(lambda: sfs.abort(args("main", k), **OPTIONS), k)
        os._exit(0)
    if entry == "sigterm-hook":
        sfs.flush_on_signal(final, **OPTIONS)
        Sweep.target, Sweep.count = k, 0
        faulthandler.dump_traceback_later(HANG, exit=True)
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        sys.setprofile(profile)
        # The installed handler, called as the signal would (Python 3.10 profiles no code that a delivered
        # signal runs): it flushes, then dies of the signal.
        handler(signal.SIGTERM, None)
        os._exit(3)  # (not reached)
    from swe_flush_sync._hooks import register_at_thread_exit  # (here: a first use imports nothing before its call)

    register_at_thread_exit(functools.partial(sys.setprofile, None))  # run after the hook's flush (registered later)
    sfs.flush_at_exit(final, **OPTIONS)
    Sweep.target, Sweep.count = k, 0
    faulthandler.dump_traceback_later(HANG, exit=True)
    sys.setprofile(profile)
    sys.exit(0)  # the exit hook flushes as the main thread ends (nothing above this frame catches it)


def main() -> None:
    entry = sys.argv[1]
    os.nice(5)  # thousands of calls, none of them timed: the suite's timed tests (and CI's other lanes) go first
    signal.signal(signal.SIGUSR1, on_signal)
    stub = AgentServerStub().start()  # no ``with``: a forked child's SystemExit must unwind nothing of the driver
    if entry == "abort-short":  # its requests outlive its deadline: lingering, joined, given up for room
        stub.fault("slow", latency=0.2)
        Sweep.every_pair_answers = False
    os.environ["AGENT_SERVER_URL"] = stub.url
    sweeps = (in_children if entry in ("sigterm-hook", "exit-hook", "first-use") else in_process)(entry, stub)
    print(json.dumps({"entry": entry, "sweeps": sweeps, "handled": Sweep.handled, "problems": Sweep.problems}))
    stub.stop()


if __name__ == "__main__":
    main()
