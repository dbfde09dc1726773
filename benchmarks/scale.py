"""``python -m benchmarks.scale``: does one overall deadline hold at 10,000 and 100,000 ids?

The stub agent server runs in a process of its own (``swe-flush stub``), so that it takes no share
of the measuring interpreter's GIL; ``flush(url, ids, deadline=5)`` is timed from the call to its
return, with the pairs answered, and those the deadline left unsent (reported as such).
Writes ``benchmarks/scale.md``.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    ns = parser.parse_args(argv)
    stub = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "stub", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    rows = []
    try:
        assert stub.stdout is not None
        url = stub.stdout.readline().split()[-1]
        for count in (10_000, 100_000):
            ids = [f"scale-{number:06d}" for number in range(count)]
            started = time.monotonic()
            report = flush(url, ids, deadline=DEADLINE)
            took = time.monotonic() - started
            unsent = sum(result.error == "deadline passed before it was sent" for result in report.results)
            rows.append(f"| {count:,} | {took:.2f} s | {sum(r.ok for r in report.results):,} | {unsent:,} | "
                        f"within {DEADLINE:g} s + 0.5 s: {'met' if took <= DEADLINE + 0.5 else 'not met'} |")
    finally:
        stub.kill()
        stub.wait()
    text = "\n".join([f"# scale benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; "
                      f"`flush(url, ids, deadline={DEADLINE:g})` against `swe-flush stub` in its own process "
                      "(`python -m benchmarks.scale`). 1.0.0: 10,000 ids in 5.18 s, 100,000 in 13.5-15 s.\n",
                      "| ids | returned after | answered | never sent (reported) | goal |", "|---|---|---|---|---|",
                      *rows]) + "\n"
    print(text)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
