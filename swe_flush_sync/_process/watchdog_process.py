"""The watchdog process: waits for its trainer's end, then flushes the trainer's last ids.

Run by ``watchdog()`` as a fresh interpreter (``python <this file> --trainer-pid N ...``), it
double-forks into its own session, ignores SIGINT, SIGTERM and SIGHUP, and blocks reading the
control pipe whose write end only the trainer holds (one ``Channel`` on a ``WatchLoop``). Each line
is a JSON message (``wire``): a state (servers, ids, per-id bearers, options, the trainer's
``sys.path``, the ledger) or a disarm. End-of-file means the trainer is gone, however it died: the
watchdog then imports ``swe_flush_sync`` (only now: while it waits it holds nothing but the
standard library), calls the public ``flush`` with the last state, writes one summary line to
the stderr it inherited and exits. With a ledger, it keeps its trainer's record there (``record``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import signal
import sys
import types
from typing import TYPE_CHECKING, Final, NoReturn

if TYPE_CHECKING:
    from .watch_loop import Channel

IGNORED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PROCESS_NAME: Final = b"swe-flush-watch"  # /proc/PID/comm, at most 15 bytes
# The standard library that requests, urllib3 and the flush need, imported while the watchdog waits:
# about 10 MiB more (20 MiB in all) for about 40 ms less between the trainer's death and the first
# flush request. requests itself (another 10 MiB) is imported only then.
PRELOADED: Final = ("ssl", "http.client", "email.parser", "concurrent.futures.thread", "logging", "dataclasses",
                    "urllib.parse", "hmac", "hashlib", "queue", "weakref", "typing")
# The package the package's folder is imported as when this file runs as a script: the package's own
# __init__ is not run, and the trainer's own swe_flush_sync is imported afresh for the flush.
LEAN_PACKAGE: Final = "_swe_flush_watchdog"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the watchdog process (``--trainer-pid N --control-fd R --ready-fd W``)."""
    from .watch_loop import Channel, WatchLoop, flush_state, say  # here: a script has no package until _run_as_script

    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED_SIGNALS)  # blocked by the trainer while it started us
    args = dict(zip(*[iter(argv if argv is not None else sys.argv[1:])] * 2, strict=False))
    trainer_pid = int(args["--trainer-pid"])
    control_fd, ready_fd = int(args["--control-fd"]), int(args["--ready-fd"])
    _detach()
    ended: list[Channel] = []
    loop = WatchLoop(ended.append)
    channel = Channel(control_fd, ready_fd, trainer_pid)
    loop.add(channel)
    code, said, preloaded = 0, "", False
    try:
        while not ended:
            loop.run_once()
            if channel.state is not None and not preloaded:  # once it holds a state: while watchdog() returns
                for module in PRELOADED:
                    importlib.import_module(module)
                preloaded = True
        if channel.disarmed:
            channel.settle(None)  # the trainer's own hook flushed everything
        else:
            sys.path[:] = (channel.state or {}).get("sys_path") or sys.path  # the trainer's swe_flush_sync
            report = flush_state(channel.state)
            code = 0 if report is None or report.ok else 1
            said = "" if report is None else f"trainer gone; {report.summary()}"
            channel.settle(report)
    except Exception as exc:  # noqa: BLE001 - the last words of a process nobody waits for
        code, said = 2, f"failed: {type(exc).__name__}"
    if said:  # after the record is settled: a stalled stderr holds us at most SAY_TIMEOUT
        say(f"swe-flush watchdog for pid {trainer_pid}: {said}")
    os._exit(code)  # no lingering worker thread (a DNS lookup, a connect) may hold the exit


def _detach() -> None:
    """Double fork into a new session; only the grandchild returns (the others exit, reaped)."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)  # the middle process ends at once: no zombie stays
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(PROCESS_NAME)
    except OSError:
        pass


def lean_module() -> types.ModuleType:
    """This file imported as a module of ``LEAN_PACKAGE`` (the package's folder, with no ``__init__`` of
    the package run: its rooms' own import nothing), so that its relative imports find the modules
    it needs."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.ModuleSpec(LEAN_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [os.path.dirname(here)]
    sys.modules[LEAN_PACKAGE] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{LEAN_PACKAGE}.{os.path.basename(here)}.{os.path.basename(__file__)[:-3]}")


def _run_as_script() -> NoReturn:
    lean_module().main()
    raise AssertionError("main returned")  # it ends in os._exit


if __name__ == "__main__":
    _run_as_script()
