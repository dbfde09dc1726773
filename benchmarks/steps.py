"""``python -m benchmarks.steps [--steps N]``: what a training step's ``abort()`` costs when the ids
change every step and a watchdog is armed, through a ``swe-flush guard`` and with a local watchdog.

A trainer process arms (through a guard, or a local watchdog), then runs ``--steps`` steps, each
setting 8 new ids and calling ``abort(args)`` against a stub agent server (0 s teardown) in this
process; each step hands the new ids to the watchdog, waits for its word, and flushes them.
Measured in the trainer: the median, 99th percentile and worst step. Writes ``benchmarks/steps.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from swe_flush_sync.testing import AgentServerStub

RESULTS = Path(__file__).with_name("steps.md")
GOAL_P99 = 0.020  # seconds
TRAINER = """
import json, sys, time
from swe_flush_sync import abort, watchdog
args = {"session_server_instance_ids": ["first"]}
keeper = watchdog(args, guard=sys.argv[1] or None, until_idle=False)
durations = []
for step in range(int(sys.argv[2])):
    args["session_server_instance_ids"] = [f"step{step}-{port}" for port in range(8)]
    started = time.monotonic()
    abort(args, deadline=5)
    durations.append(time.monotonic() - started)
print(json.dumps(durations), flush=True)
sys.stdin.read()
keeper.disarm()  # the benchmark's stub is about to stop: nothing to flush at the exit
"""


def _steps(stub: AgentServerStub, guard: str, steps: int) -> list[float]:
    env = {**os.environ, "AGENT_SERVER_URL": stub.url}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, guard, str(steps)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert trainer.stdout is not None
        durations: list[float] = json.loads(trainer.stdout.readline())
        trainer.communicate(timeout=10)  # stdin closed: it disarms and exits
        return durations
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def _row(what: str, durations: list[float]) -> str:
    ordered = sorted(durations)
    p99 = ordered[int(len(ordered) * 0.99)]
    verdict = "met" if p99 < GOAL_P99 else "not met"
    return (f"| {what} | {statistics.median(ordered) * 1000:.1f} ms | {p99 * 1000:.1f} ms | "
            f"{ordered[-1] * 1000:.1f} ms | p99 under {GOAL_P99 * 1000:.0f} ms: {verdict} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per trainer (default 1000)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    ns = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="sfg-steps-", dir="/tmp")
    path = os.path.join(folder, "guard.sock")
    guard = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
        with AgentServerStub() as stub:
            through_guard = _steps(stub, path, ns.steps)
            local = _steps(stub, "", ns.steps)
    finally:
        guard.kill()
        guard.wait()
        shutil.rmtree(folder, ignore_errors=True)
    lines = [f"# steps benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{ns.steps} steps, each with 8 new ids handed to the watchdog and flushed by `abort(args)`, "
             f"stub with 0 s teardown (`python -m benchmarks.steps --steps {ns.steps}`).\n",
             "| watchdog | median step | p99 | worst | goal |", "|---|---|---|---|---|",
             _row("through a guard", through_guard), _row("local process", local)]
    text = "\n".join(lines) + "\n"
    print(text)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
