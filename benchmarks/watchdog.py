"""``python -m benchmarks.watchdog [--reps N]``: what a watchdog costs and how fast it flushes.

A trainer process arms a watchdog for 8 ids against a stub agent server (0 s teardown, in this
process, so its request times and the kill share one clock), waits, and is killed with SIGKILL.
Measured over ``--reps`` runs (median, min, max): the arming time (in the trainer), a refresh of
a changed 10,000-id state until the watchdog says it holds it, the watchdog's
RSS while it waits, the time from the SIGKILL to the first and the last flush request at the
server, and to the watchdog's exit. Writes ``benchmarks/watchdog.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from swe_flush_sync.testing import AgentServerStub

RESULTS = Path(__file__).with_name("watchdog.md")
IDS = [f"bench-{index}" for index in range(8)]
TRAINER = """
import sys, time
from swe_flush_sync import watchdog
started = time.monotonic()
args = {"session_server_instance_ids": sys.argv[1:]}
guard = watchdog(args, deadline=10, until_idle=False)
armed = time.monotonic() - started
refreshes = []
for step in range(5):  # a changed state of 10,000 ids, handed over and confirmed whole
    args["session_server_instance_ids"] = [f"step{step}-{n:05d}-0123456789abcdef" for n in range(10000)]
    started = time.monotonic()
    assert guard.refresh()
    refreshes.append(time.monotonic() - started)
args["session_server_instance_ids"] = sys.argv[1:]
assert guard.refresh()
print(armed, guard.pid, sorted(refreshes)[2], flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024


def one_run(stub: AgentServerStub) -> dict[str, float]:
    """Arm, wait, SIGKILL, and time what follows."""
    stub.clear_requests()
    env = {**os.environ, "AGENT_SERVER_URL": stub.url}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *IDS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env=env, text=True)
    assert trainer.stdout is not None and trainer.stdin is not None
    took, pid, refresh = trainer.stdout.readline().split()
    watchdog_pid = int(pid)
    time.sleep(0.5)
    rss = _rss_mib(watchdog_pid)
    killed = time.monotonic()
    trainer.kill()
    trainer.wait()
    while not _gone(watchdog_pid):
        time.sleep(0.001)
    exited = time.monotonic() - killed
    trainer.stdin.close()
    trainer.stdout.close()
    arrivals = sorted(request.at for request in stub.requests)
    assert len(arrivals) == len(IDS), f"{len(arrivals)} flush requests, expected {len(IDS)}"
    return {"arming_s": float(took), "refresh_s": float(refresh), "rss_mib": rss,
            "first_request_s": arrivals[0] - killed, "last_request_s": arrivals[-1] - killed, "exit_s": exited}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watchdog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="runs (default 10)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    ns = parser.parse_args(argv)
    with AgentServerStub() as stub:
        runs = [one_run(stub) for _ in range(ns.reps)]
    rows = [("arming (in the trainer)", "arming_s", 1000, "ms", "0.5 s"),
            ("refresh of a changed 10,000-id state, confirmed (median of 5)", "refresh_s", 1000, "ms", "13-33 ms"),
            ("watchdog RSS while it waits", "rss_mib", 1, "MiB", "30 MB"),
            ("SIGKILL to the first flush request", "first_request_s", 1000, "ms", "0.1 s"),
            ("SIGKILL to the last of 8 flush requests", "last_request_s", 1000, "ms", ""),
            ("SIGKILL to the watchdog's exit", "exit_s", 1000, "ms", "deadline + 1 s")]
    lines = [f"# watchdog benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"8 ids, 0 s teardown, stub in the measuring process; {ns.reps} runs "
             f"(`python -m benchmarks.watchdog --reps {ns.reps}`).\n",
             "| what | median | min | max | goal |", "|---|---|---|---|---|"]
    for label, key, scale, unit, goal in rows:
        values = [run[key] * scale for run in runs]
        lines.append(f"| {label} | {statistics.median(values):.1f} {unit} | {min(values):.1f} | {max(values):.1f} "
                     f"| {goal} |")
    text = "\n".join(lines) + "\n"
    print(text)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
