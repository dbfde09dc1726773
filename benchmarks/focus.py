"""A few cells, three peers, more repetitions: ``python -m benchmarks.focus [--reps R] [--workers] [N:L ...]``.

Times the http.client floor, the urllib3 floor and swe_flush_sync (the full run's peers, same
stub process), interleaved, and prints medians and ratios: a quick check of one target
without the 20-minute grid. ``--workers`` also times a 64-id flush at L=0 with a range of
``max_workers``: how far the stack is from the floor when threads do not contend.
"""

from __future__ import annotations

import argparse
import statistics
import time

from swe_flush_sync import Flusher

from .run import SECRET, LoopThread, Peers, time_interleaved
from .stub_process import StubProcess

TRIO = ("http.client floor", "urllib3 floor", "swe_flush_sync")


def cell(stub: StubProcess, peers: Peers, n: int, latency: float, reps: int) -> dict[str, float]:
    """Median milliseconds of each of ``TRIO`` for ``n`` ids at teardown ``latency``."""
    stub.teardown(latency)
    ids = [f"focus-{n}-{latency}-{k}" for k in range(n)]
    times = time_interleaved(peers, list(TRIO), ids, reps, where=f"cell N={n} L={latency}", cap=60)
    return {peer: statistics.median(t) * 1000 for peer, t in times.items()}


def workers_sweep(stub: StubProcess, reps: int, counts: tuple[int, ...] = (2, 4, 8, 16, 64)) -> dict[int, float]:
    """Median milliseconds of a 64-id flush at L=0 for each ``max_workers`` in ``counts``."""
    stub.teardown(0)
    ids = tuple(f"sweep-{k}" for k in range(64))
    flushers = {count: Flusher(stub.url, admin_secret=SECRET, max_workers=count) for count in counts}
    try:
        for flusher in flushers.values():
            flusher.flush(ids)
        times: dict[int, list[float]] = {count: [] for count in counts}
        for _ in range(reps):
            for count, flusher in flushers.items():
                started = time.perf_counter()
                flusher.flush(ids)
                times[count].append(time.perf_counter() - started)
    finally:
        for flusher in flushers.values():
            flusher.close()
    return {count: statistics.median(t) * 1000 for count, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.focus", description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="*", default=["256:0.2", "64:0"], help="N:L pairs (default 256:0.2 64:0)")
    parser.add_argument("--reps", type=int, default=15, help="repetitions per peer (default 15)")
    parser.add_argument("--workers", action="store_true", help="also sweep max_workers at N=64 L=0")
    args = parser.parse_args(argv)
    cells = [(int(n), float(latency)) for n, latency in (text.split(":") for text in args.cells)]
    loop = LoopThread()
    try:
        with StubProcess(secret=SECRET) as stub:
            peers = Peers(stub.url, max(n for n, _ in cells), loop)
            try:
                for n, latency in cells:
                    med = cell(stub, peers, n, latency, args.reps)
                    floor, urllib3_floor, sfs = (med[peer] for peer in TRIO)
                    print(f"N={n} L={latency:g}: http.client floor {floor:.1f} ms, "
                          f"urllib3 floor {urllib3_floor:.1f} ms ({urllib3_floor / floor:.2f}x), "
                          f"swe_flush_sync {sfs:.1f} ms ({sfs / floor:.2f}x floor, "
                          f"{sfs / urllib3_floor:.2f}x urllib3 floor)", flush=True)
            finally:
                peers.close()
            if args.workers:
                for count, ms in workers_sweep(stub, args.reps).items():
                    print(f"N=64 L=0, max_workers={count}: swe_flush_sync {ms:.1f} ms", flush=True)
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
