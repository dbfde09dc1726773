"""``python -m benchmarks.tls [--reps N] [N:L ...]``: flushing over TLS against the raw floor.

The stub agent server serves https (a trustme certificate) in its own process with teardown
latency L. Timed, warm and interleaved in one run: ``http.client.HTTPSConnection`` on threads,
one kept-alive connection per worker, request bytes prepared up front (the floor), bare urllib3
(``HTTPSConnectionPool.urlopen``) on the same threads, and a warm ``Flusher``. Median of
``--reps``; writes ``benchmarks/tls.md``. The goal: N=64, L=0.2 within 1.10x the floor.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import trustme
import urllib3

from swe_flush_sync import Flusher
from swe_flush_sync.testing import AgentServerStub

RESULTS = Path(__file__).with_name("tls.md")
HEADERS = {"Content-Type": "application/json"}


def serve(cert: str, key: str) -> None:
    """Child side: the stub over TLS; stdin lines set the teardown; EOF stops it."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    with AgentServerStub(tls=context) as stub:
        print(stub.url, flush=True)
        for line in sys.stdin:
            stub.teardown = float(line)
            print("ok", flush=True)


class Floors:
    """The raw http.client floor and bare urllib3, over TLS, on the same kind of threads."""

    def __init__(self, url: str, ca_file: str, workers: int) -> None:
        host, port = url.removeprefix("https://").split(":")
        self.address = (host, int(port))
        self.context = ssl.create_default_context(cafile=ca_file)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="bench-floor")
        self.local = threading.local()
        self.urllib3_pool = urllib3.HTTPSConnectionPool(host, int(port), maxsize=workers, ca_certs=ca_file)
        self.retry = urllib3.Retry(total=3, allowed_methods=None, status_forcelist={429, 500, 502, 503, 504})

    def _raw(self, body: bytes) -> bool:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPSConnection(*self.address, context=self.context)
        conn.request("POST", "/flush", body=body, headers=HEADERS)
        response = conn.getresponse()
        response.read()
        return 200 <= response.status < 300

    def _urllib3(self, body: bytes) -> bool:
        response = self.urllib3_pool.urlopen("POST", "/flush", body=body, headers=HEADERS, retries=self.retry,
                                             timeout=urllib3.Timeout(connect=3, read=30))
        return 200 <= response.status < 300

    def run(self, which: str, bodies: list[bytes]) -> bool:
        call = self._raw if which == "raw" else self._urllib3
        done, _ = wait_futures([self.pool.submit(call, body) for body in bodies])
        return all(future.result() for future in done)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.urllib3_pool.close()


def measure(url: str, ca_file: str, n: int, reps: int) -> dict[str, float]:
    """Median seconds of each peer for ``n`` ids, interleaved, after two warm-up rounds."""
    ids = [f"tls-bench-{index}" for index in range(n)]
    bodies = [json.dumps({"session_server_instance_id": i}).encode() for i in ids]
    floors = Floors(url, ca_file, n)
    times: dict[str, list[float]] = {"http.client floor": [], "urllib3 floor": [], "swe_flush_sync": []}
    with Flusher(url, ca_bundle=ca_file, max_workers=n, deadline=30) as flusher:
        peers: dict[str, Callable[[], bool]] = {"http.client floor": lambda: floors.run("raw", bodies),
                                                "urllib3 floor": lambda: floors.run("urllib3", bodies),
                                                "swe_flush_sync": lambda: flusher.flush(ids).ok}
        for round_ in range(reps + 2):
            for name, call in peers.items():
                started = time.perf_counter()
                assert call(), f"{name} failed"
                if round_ >= 2:
                    times[name].append(time.perf_counter() - started)
    floors.close()
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tls", description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="*", default=["64:0.2", "64:0", "8:0.2"], metavar="N:L")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per peer (default 7)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1")
        paths = {name: os.path.join(folder, f"{name}.pem") for name in ("ca", "cert", "key")}
        ca.cert_pem.write_to_path(paths["ca"])
        leaf.cert_chain_pems[0].write_to_path(paths["cert"])
        leaf.private_key_pem.write_to_path(paths["key"])
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.tls", "--serve", paths["cert"], paths["key"]],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert server.stdin is not None and server.stdout is not None
        url = server.stdout.readline().strip()
        rows = []
        try:
            for cell in ns.cells:
                n, latency = int(cell.split(":")[0]), float(cell.split(":")[1])
                server.stdin.write(f"{latency}\n")
                server.stdin.flush()
                server.stdout.readline()
                result = measure(url, paths["ca"], n, ns.reps)
                floor = result["http.client floor"]
                rows.append(f"| {n} | {latency:g} | {floor * 1000:.1f} | {result['urllib3 floor'] * 1000:.1f} | "
                            f"**{result['swe_flush_sync'] * 1000:.1f}** | {result['swe_flush_sync'] / floor:.2f}x | "
                            f"{result['swe_flush_sync'] / result['urllib3 floor']:.2f}x |")
                print(rows[-1], flush=True)
        finally:
            server.stdin.close()
            server.wait(10)
    text = (f"# TLS benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; the stub over "
            f"https in its own process; warm, interleaved, median of {ns.reps}; ms "
            f"(`python -m benchmarks.tls --reps {ns.reps} {' '.join(ns.cells)}`). Goal: N=64, L=0.2 within 1.10x "
            "the http.client floor.\n\n| N | L (s) | http.client floor | urllib3 floor | swe_flush_sync | sfs / floor "
            "| sfs / urllib3 floor |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    ns.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
