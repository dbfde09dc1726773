"""``python -m benchmarks.scale``: does one overall deadline hold at 10,000 and 100,000 ids?

The stub agent server runs in a process of its own (``swe-flush stub``), so that it takes no share
of the measuring interpreter's GIL; ``flush(url, ids, deadline=5)`` is timed from the call to its
return, with the pairs answered, those the deadline left unsent (reported as such), and the time
left when sending stopped (a pair never sent says how long it was kept waiting). ``--burners N``
runs N CPU burners (``yes``) meanwhile, ended by their pids; the load average is printed with each
row. ``--teardown S`` makes each /flush wait S seconds for its trials' teardown: with 30, every
request sent is still in flight at the deadline (a server slow to answer). The bounds: the call
returns within the deadline plus 0.5 s, and stops sending with at most 0.5 s left. Writes
``benchmarks/scale.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from swe_flush_sync import flush

RESULTS = Path(__file__).with_name("scale.md")
DEADLINE = 5.0
SLACK = 0.5  # seconds past the deadline a call may return, and left unused when it stops sending
UNSENT = "deadline passed before it was sent"


def measure(url: str, count: int) -> str:
    """One row: ``flush`` of ``count`` fresh ids, timed, with the time left when sending stopped."""
    ids = [f"scale-{time.monotonic_ns()}-{number:06d}" for number in range(count)]
    load = os.getloadavg()[0]
    started = time.monotonic()
    report = flush(url, ids, deadline=DEADLINE)
    took = time.monotonic() - started
    unsent = [result for result in report.results if result.error == UNSENT]
    left = DEADLINE - max(result.elapsed for result in unsent) if unsent else None
    met = took <= DEADLINE + SLACK and (left is None or left <= SLACK)
    return (f"| {count:,} | {load:.1f} | {took:.2f} s | {sum(r.ok for r in report.results):,} | {len(unsent):,} | "
            f"{'-' if left is None else f'{left:.2f} s'} | {'met' if met else 'NOT MET'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--runs", type=int, default=1, help="runs of each size (default 1)")
    parser.add_argument("--burners", type=int, default=0, help="CPU burners running meanwhile (default 0)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="id counts")
    parser.add_argument("--teardown", type=float, default=0.0, help="seconds each /flush takes (default 0)")
    ns = parser.parse_args(argv)
    stub = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "stub", "--port", "0", "--teardown",
                             str(ns.teardown)], stdout=subprocess.PIPE, text=True)
    burners = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(ns.burners)]
    rows = []
    try:
        assert stub.stdout is not None
        url = stub.stdout.readline().split()[-1]
        for count in ns.sizes:
            for _ in range(ns.runs):
                rows.append(measure(url, count))
                print(rows[-1], flush=True)
    finally:
        for process in [stub, *burners]:
            process.kill()
            process.wait()
    text = "\n".join([f"# scale benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}, "
                      f"{ns.burners} CPU burner(s); `flush(url, ids, deadline={DEADLINE:g})` against `swe-flush stub "
                      f"--teardown {ns.teardown:g}` in its own process (`python -m benchmarks.scale --runs {ns.runs} "
                      f"--burners {ns.burners} --teardown {ns.teardown:g}`). "
                      f"Bounds: returned within {DEADLINE:g} s + {SLACK:g} s, sending stopped with at most "
                      f"{SLACK:g} s left.\n",
                      "| ids | load | returned after | answered | never sent (reported) | left when sending stopped "
                      "| bounds |", "|---|---|---|---|---|---|---|", *rows]) + "\n"
    print(text)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
