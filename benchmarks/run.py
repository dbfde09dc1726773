"""Benchmark runner: ``python -m benchmarks [--quick] [--out PATH]``.

Starts the stub agent server in its own process with a per-request teardown latency L and
times, interleaved and warm, the median of several repetitions of:

1. ``one-by-one async``: awaits one POST per id on an ``httpx.AsyncClient`` with no timeout,
   retrying any exception up to 3 times with a fixed 1 s sleep (today's async abort hook);
2. ``sequential requests``: a plain loop of ``requests.post``;
3. ``asyncio.gather`` over one ``httpx.AsyncClient`` (the best async peer), and
   ``gather+Semaphore(16)`` with a 30 s timeout per request (the newer async hook);
4. ``requests-futures`` ``FuturesSession`` (thread pool over requests);
5. ``http.client floor``: raw ``http.client`` threads, one kept-alive connection per worker;
6. ``urllib3 floor``: bare urllib3 ``urlopen`` (Retry, Timeout, one shared pool) on the same
   threads: the floor of the stack swe_flush_sync is built on;
7. ``swe_flush_sync`` with a reused ``Flusher``;
8. the ideal: L, one round trip.

Then the fault cells, connection reuse, peak RSS and threads of a 256-id flush, import time,
and the targets. Prints a markdown report and writes it to ``benchmarks/results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import requests
import urllib3
from requests_futures.sessions import FuturesSession

from swe_flush_sync import Flusher

from .stub_process import StubProcess

SECRET = "bench-secret"
HEADERS = {"Authorization": f"Bearer {SECRET}"}
PEERS = ("one-by-one async", "sequential requests", "asyncio.gather", "gather+Semaphore(16)", "requests-futures",
         "http.client floor", "urllib3 floor", "swe_flush_sync")
SEQUENTIAL = ("one-by-one async", "sequential requests")
SEQUENTIAL_LIMIT = 60.0  # a sequential measurement estimated longer than this is skipped
QUICK_SEQUENTIAL_LIMIT = 1.0
RESULTS = Path(__file__).with_name("results.md")
RESULTS_JSON = Path(__file__).with_name("results.json")
CHART = Path(__file__).with_name("results.png")
FLOOR_HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"}


class LoopThread:
    """An asyncio loop in a background thread, so async peers stay warm across measurements."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Peers:
    """Every contender, warm, against one server URL."""

    def __init__(self, url: str, max_n: int, loop: LoopThread, deadline: float = 30.0) -> None:
        self.flush_url = url + "/flush"
        self.loop = loop
        self.cpu = 0.0
        limits = httpx.Limits(max_connections=max_n, max_keepalive_connections=max_n)
        self.gather_client = loop.run(self._client(limits))
        self.one_by_one_client = loop.run(self._client(httpx.Limits()))
        self.semaphore_client = loop.run(self._client(limits))
        self.futures = FuturesSession(max_workers=max_n)
        self.flusher = Flusher(url, admin_secret=SECRET, deadline=deadline)
        # The floor: raw http.client on threads, one kept-alive connection per worker, the
        # request bytes prepared up front. What any thread-per-pair Python client can reach.
        split = urlsplit(url)
        self.floor_address = (split.hostname or "127.0.0.1", split.port or 80)
        self.floor_pool = ThreadPoolExecutor(max_workers=max_n, thread_name_prefix="bench-floor")
        self.floor_local = threading.local()
        self.floor_bodies: dict[str, bytes] = {}
        # The floor of the stack swe_flush_sync is built on: bare urllib3 ``urlopen`` with a
        # Retry and a Timeout, one shared pool sized to the workers, on the same kind of threads.
        self.urllib3_pool = urllib3.HTTPConnectionPool(*self.floor_address, maxsize=max_n)
        self.urllib3_retry = urllib3.Retry(total=3, allowed_methods=None, status_forcelist={429, 500, 502, 503, 504})

    @staticmethod
    async def _client(limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=None, limits=limits)

    def body(self, instance_id: str) -> dict[str, str]:
        return {"session_server_instance_id": instance_id}

    def one_by_one(self, ids: list[str], cap: float) -> bool:
        async def run() -> bool:
            ok = True
            for instance_id in ids:
                for attempt in range(4):
                    try:
                        response = await self.one_by_one_client.post(self.flush_url, json=self.body(instance_id),
                                                                      headers=HEADERS)
                        ok = ok and response.is_success
                        break
                    except Exception:
                        if attempt == 3:
                            ok = False
                        else:
                            await asyncio.sleep(1)
            return ok

        return bool(self.loop.run(run(), cap))

    def sequential(self, ids: list[str], cap: float) -> bool:
        return _capped(lambda: all(requests.post(self.flush_url, json=self.body(i), headers=HEADERS).ok
                                   for i in ids), cap)

    def gather(self, ids: list[str], cap: float) -> bool:
        async def run() -> bool:
            responses = await asyncio.gather(*(self.gather_client.post(self.flush_url, json=self.body(i),
                                                                       headers=HEADERS) for i in ids))
            return all(r.is_success for r in responses)

        return bool(self.loop.run(run(), cap))

    def gather_semaphore(self, ids: list[str], cap: float) -> bool:
        """The framework's newer async hook: gather under Semaphore(16), 30 s per request."""
        async def run() -> bool:
            semaphore = asyncio.Semaphore(16)

            async def one(instance_id: str) -> bool:
                async with semaphore:
                    response = await self.semaphore_client.post(self.flush_url, json=self.body(instance_id),
                                                                headers=HEADERS, timeout=30)
                    return response.is_success

            return all(await asyncio.gather(*(one(i) for i in ids)))

        return bool(self.loop.run(run(), cap))

    def _floor_post(self, instance_id: str) -> bool:
        conn = getattr(self.floor_local, "conn", None)
        if conn is None:
            conn = self.floor_local.conn = http.client.HTTPConnection(*self.floor_address)
        body = self.floor_bodies[instance_id]
        conn.request("POST", "/flush", body=body, headers=FLOOR_HEADERS)
        response = conn.getresponse()
        response.read()
        return 200 <= response.status < 300

    def floor(self, ids: list[str], cap: float) -> bool:
        for instance_id in ids:  # prepared up front, outside the timed part's per-request work
            if instance_id not in self.floor_bodies:
                self.floor_bodies[instance_id] = json.dumps(self.body(instance_id)).encode()
        done, pending = wait_futures([self.floor_pool.submit(self._floor_post, i) for i in ids], timeout=cap)
        if pending:
            raise TimeoutError
        return all(f.result() for f in done)

    def _urllib3_post(self, instance_id: str) -> bool:
        response = self.urllib3_pool.urlopen("POST", "/flush", body=self.floor_bodies[instance_id],
                                             headers=FLOOR_HEADERS, retries=self.urllib3_retry,
                                             timeout=urllib3.Timeout(connect=3, read=30))
        return 200 <= response.status < 300

    def urllib3_floor(self, ids: list[str], cap: float) -> bool:
        for instance_id in ids:
            if instance_id not in self.floor_bodies:
                self.floor_bodies[instance_id] = json.dumps(self.body(instance_id)).encode()
        done, pending = wait_futures([self.floor_pool.submit(self._urllib3_post, i) for i in ids], timeout=cap)
        if pending:
            raise TimeoutError
        return all(f.result() for f in done)

    def futures_session(self, ids: list[str], cap: float) -> bool:
        futures = [self.futures.post(self.flush_url, json=self.body(i), headers=HEADERS) for i in ids]
        done, pending = wait_futures(futures, timeout=cap)
        if pending:
            raise TimeoutError
        return all(f.result().ok for f in done)

    def swe_flush_sync(self, ids: list[str], cap: float, deadline: float | None = None) -> bool:
        return self.flusher.flush(ids, deadline=deadline).ok

    def run(self, peer: str, ids: list[str], cap: float, deadline: float | None = None) -> tuple[float, bool | None]:
        """Seconds the peer took and whether every id was flushed; (cap, None) when capped.

        ``self.cpu`` is then the CPU seconds this process spent meanwhile (the stub runs in another).
        """
        call: Callable[[list[str], float], bool] = {
            "one-by-one async": self.one_by_one, "sequential requests": self.sequential,
            "asyncio.gather": self.gather, "gather+Semaphore(16)": self.gather_semaphore,
            "requests-futures": self.futures_session, "http.client floor": self.floor,
            "urllib3 floor": self.urllib3_floor,
            "swe_flush_sync": lambda i, c: self.swe_flush_sync(i, c, deadline),
        }[peer]
        started, cpu = time.perf_counter(), time.process_time()
        try:
            ok = call(ids, cap)
        except TimeoutError:
            return cap, None
        finally:
            self.cpu = time.process_time() - cpu
        return time.perf_counter() - started, ok

    def close(self) -> None:
        self.flusher.close()
        # FuturesSession.close() joins its workers, forever when one is stuck on a hung server
        self.futures.executor.shutdown(wait=False, cancel_futures=True)
        self.floor_pool.shutdown(wait=False, cancel_futures=True)
        self.urllib3_pool.close()
        requests.Session.close(self.futures)
        for client in (self.gather_client, self.one_by_one_client, self.semaphore_client):
            with contextlib.suppress(Exception):
                self.loop.run(client.aclose(), 5)


def _capped(function: Callable[[], bool], cap: float) -> bool:
    """Run a blocking peer in a daemon thread; TimeoutError if it has not returned by ``cap``."""
    box: list[bool] = []

    def target() -> None:
        with contextlib.suppress(Exception):  # a capped peer's request fails when the stub goes away
            box.append(function())

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(cap)
    if not box:
        raise TimeoutError
    return box[0]


def time_interleaved(peers: Peers, names: list[str], ids: list[str], reps: int, *, where: str,
                     cap: float = 120, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds of each of ``names`` flushing ``ids``, ``reps`` times, in rotating order, after a warm-up;
    the CPU seconds of each run go to ``cpu`` when given."""
    for peer in names:  # warm-up, untimed (the sequential peers gain nothing from it)
        if peer not in SEQUENTIAL:
            peers.run(peer, ids, cap=cap)
    times: dict[str, list[float]] = {peer: [] for peer in names}
    for rep in range(reps):
        for peer in names[rep % len(names):] + names[:rep % len(names)]:  # interleaved
            seconds, ok = peers.run(peer, ids, cap=cap)
            if not ok:
                raise RuntimeError(f"{peer} failed to flush in {where}")
            times[peer].append(seconds)
            if cpu is not None:
                cpu.setdefault(peer, []).append(peers.cpu)
    return times


def grid(stub: StubProcess, loop: LoopThread, ns: list[int], ls: list[float], reps: int,
         sequential_limit: float) -> list[dict[str, Any]]:
    """Median seconds of every peer in every (N, L) cell."""
    peers = Peers(stub.url, max(ns), loop)
    cells = []
    try:
        for n in ns:
            for latency in ls:
                stub.teardown(latency)
                ids = [f"n{n}-l{latency}-{k}" for k in range(n)]
                skipped = [p for p in SEQUENTIAL if n * (latency + 0.002) > sequential_limit]
                cpu: dict[str, list[float]] = {}
                times = time_interleaved(peers, [p for p in PEERS if p not in skipped], ids, reps,
                                         where=f"cell N={n} L={latency}", cpu=cpu)
                cells.append({"n": n, "latency": latency, "skipped": skipped,
                              "median": {p: statistics.median(t) for p, t in times.items() if t},
                              "cpu_per_pair": {p: statistics.median(t) / n for p, t in cpu.items() if t}})
                print(f"  N={n:<4} L={latency:<5} " + "  ".join(
                    f"{p}={statistics.median(t) * 1000:.1f}ms" for p, t in times.items() if t), flush=True)
    finally:
        peers.close()
    return cells


def fault_cells(loop: LoopThread, reps: int, cap: float) -> list[dict[str, Any]]:
    """1 of 8 ids hangs (swe_flush_sync deadline 2 s); 1 of 8 answers 503 twice then 200."""
    rows = []
    ids = [f"f{k}" for k in range(8)]
    for name in ("hang", "503x2"):
        times: dict[str, list[float]] = {p: [] for p in PEERS}
        flushed: dict[str, list[bool | None]] = {p: [] for p in PEERS}
        with StubProcess(SECRET) as stub:
            peers = Peers(stub.url, 8, loop)
            try:
                for peer in PEERS:  # warm-up against a healthy server
                    peers.run(peer, ids, cap=10)
                for rep in range(reps):
                    for peer in PEERS[rep % len(PEERS):] + PEERS[:rep % len(PEERS)]:
                        if name == "hang":
                            stub.fault("f3", hang=True)
                        else:
                            stub.fault("f3", statuses=[503, 503])
                        seconds, ok = peers.run(peer, ids, cap=cap, deadline=2.0)
                        times[peer].append(seconds)
                        flushed[peer].append(ok)
            finally:
                peers.close()
        rows.append({"fault": name, "cap": cap,
                     "median": {p: statistics.median(t) for p, t in times.items()},
                     "capped": {p: any(ok is None for ok in flushed[p]) for p in PEERS},
                     "all_flushed": {p: all(ok is True for ok in flushed[p]) for p in PEERS}})
        print(f"  fault {name}: " + "  ".join(f"{p}={statistics.median(t):.2f}s" for p, t in times.items()),
              flush=True)
    return rows


REUSE_LATENCY = 0.05


def connection_reuse(stub: StubProcess, calls: int) -> dict[str, Any]:
    """New TCP connections and per-call time of repeated 8-id flushes at a 0.05 s teardown with one Flusher."""
    stub.teardown(REUSE_LATENCY)
    ids = [f"reuse-{k}" for k in range(8)]
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        before = stub.stats()["connections"]
        for _ in range(2):  # warm-up: a first call may open up to one connection per pair
            flusher.flush(ids)
        after_first = stub.stats()["connections"]
        durations = []
        for _ in range(calls):
            started = time.perf_counter()
            assert flusher.flush(ids).ok
            durations.append(time.perf_counter() - started)
        after_all = stub.stats()["connections"]
    per_call = statistics.median(durations)
    return {"warm_up_connections": after_first - before, "new_after_first": after_all - after_first,
            "calls": calls, "per_call": per_call, "per_request": per_call / len(ids)}


def queued_runs(ids: int = 8, runs: int = 20, slots: int = 8, latency: float = 0.05) -> list[dict[str, Any]]:
    """``ids`` ids with ``runs`` runs each on ``slots`` slots: one pass, then ``until_idle``."""
    rows = []
    for until_idle in (False, True):
        with StubProcess(SECRET) as stub:
            stub.teardown(latency)
            stub.slots(slots)
            names = [f"queued-{k}" for k in range(ids)]
            for name in names:
                stub.add_trials(name, runs)
            with Flusher(stub.url, admin_secret=SECRET, until_idle=until_idle) as flusher:
                started = time.perf_counter()
                report = flusher.flush(names, deadline=30)
                wall = time.perf_counter() - started
            stats = stub.stats()
        rows.append({"until_idle": until_idle, "rounds": max(r.passes for r in report.results), "wall": wall,
                     "cancelled": report.cancelled, "left": stats["running"] + stats["waiting"],
                     "idle": sum(bool(r.idle) for r in report.results), "ids": ids, "runs": runs, "slots": slots,
                     "latency": latency})
        print(f"  queued runs, until_idle={until_idle}: {rows[-1]}", flush=True)
    return rows


PROBE = r"""
import json, sys, threading, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from swe_flush_sync import Flusher
flusher = Flusher(sys.argv[1], admin_secret=sys.argv[2])
baseline_rss, baseline_threads = status("VmRSS:"), threading.active_count()
peak = {"threads": 0}
done = threading.Event()
def sample():
    while not done.is_set():
        peak["threads"] = max(peak["threads"], threading.active_count())
        time.sleep(0.002)
sampler = threading.Thread(target=sample); sampler.start()
started = time.perf_counter()
report = flusher.flush([f"rss-{k}" for k in range(256)])
elapsed = time.perf_counter() - started
done.set(); sampler.join()
print(json.dumps({"ok": report.ok, "elapsed": elapsed, "baseline_rss": baseline_rss, "peak_rss": status("VmHWM:"),
                  "baseline_threads": baseline_threads, "peak_threads": peak["threads"] - 1}))
"""


def memory_and_threads(stub: StubProcess) -> dict[str, Any]:
    """Peak RSS and threads of a fresh process flushing 256 ids at L=0.2 (sampler thread excluded)."""
    stub.teardown(0.2)
    out = subprocess.run([sys.executable, "-c", PROBE, stub.url, SECRET], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def import_time(reps: int) -> dict[str, float]:
    """Median cumulative import time (ms) of swe_flush_sync and of requests alone, in fresh processes."""
    def one(module: str) -> float:
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                             capture_output=True, text=True, check=True).stderr
        for line in reversed(err.splitlines()):
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] == module:
                return int(parts[1]) / 1000
        raise RuntimeError(f"no import time line for {module}")

    return {module: statistics.median(one(module) for _ in range(reps)) for module in ("swe_flush_sync", "requests")}


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}x"


def report_markdown(args: argparse.Namespace, cells: list[dict[str, Any]], faults: list[dict[str, Any]],
                    reuse: dict[str, Any], probe: dict[str, Any], imports: dict[str, float],
                    queued: list[dict[str, Any]], took: float) -> str:
    lines = [f"# swe_flush_sync benchmark{' (quick)' if args.quick else ''}", "",
             f"Machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; stub agent server in its own process "
             f"on 127.0.0.1; median of {args.reps} interleaved warm repetitions; times in ms; "
             f"run took {took:.0f}s (`python -m benchmarks{' --quick' if args.quick else ''}`).", "",
             "| N | L (s) | ideal | http.client floor | urllib3 floor | swe_flush_sync | asyncio.gather "
             "| gather+Semaphore(16) | requests-futures | sequential requests | one-by-one async | sfs / floor "
             "| urllib3 floor / floor | sfs / urllib3 floor | sfs / gather | Semaphore(16) / sfs | one-by-one / sfs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        med = cell["median"]
        ideal = cell["latency"] or None
        sfs = med["swe_flush_sync"]
        lines.append(
            f"| {cell['n']} | {cell['latency']:g} | {ms(ideal) if ideal else '0'} | {ms(med['http.client floor'])} | "
            f"{ms(med['urllib3 floor'])} | **{ms(sfs)}** | {ms(med['asyncio.gather'])} | "
            f"{ms(med['gather+Semaphore(16)'])} | "
            f"{ms(med['requests-futures'])} | "
            f"{ms(med.get('sequential requests')) if 'sequential requests' in med else 'skipped'} | "
            f"{ms(med.get('one-by-one async')) if 'one-by-one async' in med else 'skipped'} | "
            f"{ratio(sfs, med['http.client floor'])} | {ratio(med['urllib3 floor'], med['http.client floor'])} | "
            f"{ratio(sfs, med['urllib3 floor'])} | {ratio(sfs, med['asyncio.gather'])} | "
            f"{ratio(med['gather+Semaphore(16)'], sfs)} | {ratio(med.get('one-by-one async'), sfs)} |")
    skipped = [(c["n"], c["latency"], c["skipped"]) for c in cells if c["skipped"]]
    for n, latency, peers in skipped:
        lines.append(f"\nSkipped (one measurement over {args.sequential_limit:g}s): N={n} L={latency:g}: "
                     f"{', '.join(peers)}")
    cpu_peers = ("http.client floor", "urllib3 floor", "swe_flush_sync", "asyncio.gather", "requests-futures")
    lines += ["", "## CPU per pair (this process's CPU time over the call, divided by N; µs)", "",
              "| N | L (s) | " + " | ".join(cpu_peers) + " | sfs / urllib3 floor |",
              "|---|---|" + "---|" * (len(cpu_peers) + 1)]
    for cell in cells:
        cpu = cell["cpu_per_pair"]
        lines.append(f"| {cell['n']} | {cell['latency']:g} | " + " | ".join(
            f"{cpu[p] * 1e6:.0f}" for p in cpu_peers) + f" | {ratio(cpu['swe_flush_sync'], cpu['urllib3 floor'])} |")
    first = queued[0]
    lines += ["", f"## Runs queued behind slots ({first['ids']} ids x {first['runs']} runs on {first['slots']} slots, "
              f"{first['latency']:g} s teardown per flush)", "",
              "| swe_flush_sync | rounds | wall (ms) | trials cancelled | left running or waiting | ids idle |",
              "|---|---|---|---|---|---|"]
    for row in queued:
        lines.append(f"| {'until_idle=True' if row['until_idle'] else 'one pass (default)'} | {row['rounds']} | "
                     f"{row['wall'] * 1000:.0f} | {row['cancelled']} | {row['left']} | "
                     f"{row['idle'] if row['until_idle'] else '-'} |")
    lines += ["", "## Faults (8 ids; seconds to return, capped; swe_flush_sync deadline 2 s)", "",
              "| fault | " + " | ".join(PEERS) + " |", "|---|" + "---|" * len(PEERS)]
    for row in faults:
        cells_text = []
        for peer in PEERS:
            seconds = row["median"][peer]
            text = f"> {row['cap']:g} (capped)" if row["capped"][peer] else f"{seconds:.2f}"
            text += "" if row["all_flushed"][peer] else ", NOT all flushed"
            cells_text.append(text)
        label = "1 of 8 hangs" if row["fault"] == "hang" else "1 of 8: 503, 503, 200"
        lines.append(f"| {label} | " + " | ".join(cells_text) + " |")
    lines += ["", "## Resources", "",
              f"- Reused Flusher, 8 ids at L={REUSE_LATENCY:g}, {reuse['calls']} calls after two warm-up calls: "
              f"{reuse['warm_up_connections']} TCP connections opened by the warm-up, "
              f"{reuse['new_after_first']} new after it; {reuse['per_call'] * 1000:.2f} ms per call "
              f"({reuse['per_request'] * 1000:.3f} ms per request).",
              f"- 256-id flush at L=0.2 in a fresh process: {probe['elapsed']:.3f}s, peak threads "
              f"{probe['peak_threads']} (baseline {probe['baseline_threads']}), RSS "
              f"{probe['baseline_rss'] / 2**20:.1f} MiB before, peak {probe['peak_rss'] / 2**20:.1f} MiB.",
              f"- Import time (cumulative, `-X importtime`, median of {args.import_reps}): swe_flush_sync "
              f"{imports['swe_flush_sync']:.1f} ms, of which requests alone {imports['requests']:.1f} ms.", ""]
    lines += ["## Targets", ""] + [f"- {t}" for t in targets(cells, faults, reuse)] + [""]
    return "\n".join(lines)


def targets(cells: list[dict[str, Any]], faults: list[dict[str, Any]], reuse: dict[str, Any]) -> list[str]:
    found = {(c["n"], c["latency"]): c["median"] for c in cells}
    out = []

    def verdict(name: str, value: float | None, limit: float, higher_is_better: bool = False) -> None:
        if value is None:
            out.append(f"{name}: not measured in this run")
            return
        met = value >= limit if higher_is_better else value <= limit
        comparison = ">=" if higher_is_better else "<="
        out.append(f"{name}: {value:.2f} ({'MET' if met else 'MISSED'}; target {comparison} {limit:g})")

    def over_floor(n: int, latency: float) -> float | None:
        cell = found.get((n, latency))
        return cell and cell.get("http.client floor") and cell["swe_flush_sync"] / cell["http.client floor"]

    verdict("N=64 L=0.2 swe_flush_sync / http.client floor", over_floor(64, 0.2), 1.10)
    verdict("N=256 L=0.2 swe_flush_sync / http.client floor", over_floor(256, 0.2), 1.15)
    cell = found.get((64, 0.0))
    verdict("N=64 L=0 swe_flush_sync / urllib3 floor", cell and cell["swe_flush_sync"] / cell["urllib3 floor"], 1.25)
    cell = found.get((64, 0.0))
    verdict("N=64 L=0 swe_flush_sync / asyncio.gather", cell and cell["swe_flush_sync"] / cell["asyncio.gather"], 0.5)
    cell = found.get((64, 0.2))
    verdict("N=64 L=0.2 gather+Semaphore(16) / swe_flush_sync", cell and cell["gather+Semaphore(16)"] /
            cell["swe_flush_sync"], 1, higher_is_better=True)
    hang = next((f for f in faults if f["fault"] == "hang"), None)
    verdict("hung id, deadline 2 s: swe_flush_sync seconds to return", hang and hang["median"]["swe_flush_sync"], 2.1)
    verdict("reused Flusher: new TCP connections after two warm-up calls", float(reuse["new_after_first"]), 0)
    for n, latency in ((64, 0.2), (256, 0.2), (64, 0.0)):  # context, not targets: the stack's own floor
        cell = found.get((n, latency))
        if cell and cell.get("urllib3 floor"):
            out.append(f"(context) N={n} L={latency:g}: urllib3 floor / http.client floor "
                       f"{cell['urllib3 floor'] / cell['http.client floor']:.2f}, swe_flush_sync / urllib3 floor "
                       f"{cell['swe_flush_sync'] / cell['urllib3 floor']:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid, under 60 s")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--plot", action="store_true", help=f"also draw the chart, {CHART.name} (matplotlib)")
    parser.add_argument("--replot", action="store_true",
                        help=f"only redraw {CHART.name} from the last run's {RESULTS_JSON.name}, running nothing")
    args = parser.parse_args(argv)
    if args.replot:
        from .plot import plot

        print(plot(json.loads(RESULTS_JSON.read_text()), CHART))
        return 0
    if args.quick:
        ns, ls, args.reps, fault_reps, cap, reuse_calls, args.import_reps = [8, 64], [0.0, 0.05], 5, 1, 3.0, 10, 3
        args.sequential_limit = QUICK_SEQUENTIAL_LIMIT
    else:
        ns, ls, args.reps, fault_reps, cap, reuse_calls, args.import_reps = \
            [1, 8, 64, 256], [0.0, 0.05, 0.2], 5, 5, 5.0, 20, 5
        args.sequential_limit = SEQUENTIAL_LIMIT
    started = time.perf_counter()
    loop = LoopThread()
    try:
        print("grid:", flush=True)
        with StubProcess(SECRET) as stub:
            cells = grid(stub, loop, ns, ls, args.reps, args.sequential_limit)
            reuse = connection_reuse(stub, reuse_calls)
            probe = memory_and_threads(stub)
        print("faults:", flush=True)
        faults = fault_cells(loop, fault_reps, cap)
        print("queued runs:", flush=True)
        queued = queued_runs()
    finally:
        loop.close()
    imports = import_time(args.import_reps)
    text = report_markdown(args, cells, faults, reuse, probe, imports, queued, time.perf_counter() - started)
    print("\n" + text)
    args.out.write_text(text)
    data = {"machine": f"{os.cpu_count()} cores, Python {sys.version.split()[0]}", "cells": cells, "faults": faults}
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    if args.plot:
        from .plot import plot

        print(plot(data, args.out.with_suffix(".png")))
    return 0
