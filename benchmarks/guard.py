"""``python -m benchmarks.guard [--reps N]``: what a ``swe-flush guard`` costs and how fast it flushes.

A guard serves 100 trainers: 10 trainer processes each arm 10 watchdogs through it (one
connection each, 2 ids each), against a stub agent server with a 0.2 s teardown in this process
(so its request times and the kill share one clock). Measured: arming through the guard (in the
trainer), the guard's RSS and CPU time while 100 trainers are connected and nobody dies, and,
``--reps`` times, one trainer process SIGKILLed (10 trainers dying at once): the time from the
kill to the first flush request of each of the 10 (median and worst).

Then the hostile rows, each against a fresh guard: 50 peers each sending a line just under the
per-line bound (32 MiB) at once, and 1,100 idle connections to a guard whose descriptor limit is
1,024; in each, one trainer is SIGKILLed in the middle of it (the time to its first flush
request), and the guard's peak RSS and CPU are read from /proc. Then the bounded parts: death to
first flush request beside 50 peers sending garbage, the guard's threads after 200 deaths whose
flushes retry, and its memory while 8 states of 28 MiB arrive. Then fairness by server: a healthy
server's death to its first flush after 200 deaths on a server that accepts and never answers,
and after two large deaths on a slow one. Last, a crowded node: the same after 4 and 16
black-holed servers x 100 deaths, and a healthy server's ids when every trainer also lists a
black-holed one. Writes ``benchmarks/guard.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from swe_flush_sync._process.wire import PROTOCOL, encode_state
from swe_flush_sync._stub import black_holes
from swe_flush_sync.testing import AgentServerStub

RESULTS = Path(__file__).with_name("guard.md")
PROCESSES = 10
PER_PROCESS = 10
TRAINER = """
import sys, time
from swe_flush_sync import watchdog
arming = []
guards = []
for index in range(int(sys.argv[2])):
    args = {"session_server_instance_ids": [f"{sys.argv[3]}-{index}-a", f"{sys.argv[3]}-{index}-b"]}
    started = time.monotonic()
    guards.append(watchdog(args, guard=sys.argv[1], deadline=10, until_idle=False))
    arming.append(time.monotonic() - started)
print(" ".join(map(str, arming)), flush=True)
sys.stdin.read()
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":")) / 1024


LIMITED = "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); " \
          "from swe_flush_sync._cli.main import main; sys.exit(main(sys.argv[1:]))"


def _hostile(stub: AgentServerStub, folder: str, kind: str) -> tuple[float, float, float]:
    """One hostile case (``long-lines`` or ``idle``) against a fresh guard: (ms from a trainer's SIGKILL
    to its first flush request, the guard's peak RSS in MiB, the guard's CPU seconds over the case)."""
    path = os.path.join(folder, f"{kind}.sock")
    command = [sys.executable, "-c", LIMITED] if kind == "idle" else [sys.executable, "-m", "swe_flush_sync"]
    guard = subprocess.Popen([*command, "guard", "--socket", path], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    trainer = None
    peers: list[socket.socket] = []
    try:
        assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
        env = {**os.environ, "AGENT_SERVER_URL": stub.url}
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, path, "1", f"hostile-{kind}"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert trainer.stdout is not None and trainer.stdout.readline()
        cpu = _cpu_seconds(guard.pid)
        senders = []
        if kind == "idle":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # ours, not the guard's
            for _ in range(1100):
                peer = socket.socket(socket.AF_UNIX)
                peer.connect(path)
                peers.append(peer)
        else:
            line = b"x" * ((32 << 20) - 1024)
            peers = [socket.socket(socket.AF_UNIX) for _ in range(50)]
            for peer in peers:
                peer.connect(path)

            def send(peer: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    peer.sendall(line)

            senders = [threading.Thread(target=send, args=(peer,)) for peer in peers]
            for sender in senders:
                sender.start()
        stub.clear_requests()
        killed = time.monotonic()
        trainer.kill()
        trainer.wait()
        end = time.monotonic() + 30
        while not stub.requests and time.monotonic() < end:
            time.sleep(0.005)
        first = (stub.requests[0].at - killed) * 1000 if stub.requests else float("nan")
        for sender in senders:
            sender.join(60)
        return first, _rss_mib(guard.pid, "VmHWM"), _cpu_seconds(guard.pid) - cpu
    finally:
        for peer in peers:
            peer.close()
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        guard.kill()
        guard.wait()


def _peer_state(urls: list[str], ids: list[str], number: int) -> bytes:
    """One trainer's state line, as a trainer of this version sends it."""
    state = {"urls": urls, "ids": ids, "tokens": None, "options": {"until_idle": False}, "trainer": f"{number:032x}"}
    return b'{"seq": 1, "v": %d, "state": %s}\n' % (PROTOCOL, encode_state(state))


def _held(path: str, line: bytes) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(path)
    peer.sendall(line)
    peer.settimeout(30)
    assert peer.recv(4096).startswith(b"held")
    return peer


def _flood(path: str, stop: threading.Event) -> None:
    """A same-uid peer gone wrong: a bad line, again and again, until ``stop``."""
    while not stop.is_set():
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as peer:
            peer.connect(path)
            peer.sendall(b"not json\n")
            peer.recv(4096)


def _bounded(stub: AgentServerStub, folder: str) -> dict[str, str]:
    """The rows of issue 39, each against a fresh guard: death to first request beside 50 garbage peers,
    threads after 200 deaths whose flushes retry, and memory with 8 states of 28 MiB arriving."""
    rows: dict[str, str] = {}
    for kind in ("garbage", "retrying", "large"):
        path = os.path.join(folder, f"{kind}.sock")
        guard = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stop = threading.Event()
        flooders: list[threading.Thread] = []
        try:
            assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
            if kind == "garbage":
                held = [_held(path, _peer_state([stub.url], [f"g-{n}"], n)) for n in range(100)]
                flooders = [threading.Thread(target=_flood, args=(path, stop)) for _ in range(50)]
                for flooder in flooders:
                    flooder.start()
                time.sleep(1.0)
                firsts = []
                for number in range(0, 100, 10):
                    stub.clear_requests()
                    killed = time.monotonic()
                    held[number].close()
                    end = time.monotonic() + 5
                    while not stub.requests and time.monotonic() < end:
                        time.sleep(0.001)
                    firsts.append((stub.requests[0].at - killed) * 1000 if stub.requests else float("nan"))
                rows[kind] = f"{statistics.median(firsts):.1f} ms / {max(firsts):.1f} ms"
                for peer in held:
                    peer.close()
            elif kind == "retrying":
                down = AgentServerStub().start()
                down.stop()
                for number in range(200):
                    _held(path, _peer_state([down.url], [f"r-{number}"], number)).close()
                time.sleep(3.0)  # the first attempts failed; retries wait on the heap
                with open(f"/proc/{guard.pid}/status") as status:
                    rows[kind] = next(line.split()[1] for line in status if line.startswith("Threads:"))
            else:
                peers = []
                answers = []
                for number in range(8):
                    line = _peer_state([], [f"big{number}-{i:06d}-" + "x" * 270 for i in range(100_000)], number)
                    peer = socket.socket(socket.AF_UNIX)
                    peer.connect(path)
                    peer.sendall(line)
                    answers.append(peer.recv(4096))
                    peers.append(peer)
                held_count = sum(answer.startswith(b"held") for answer in answers)
                rows[kind] = (f"{held_count} of 8 held, peak RSS {_rss_mib(guard.pid, 'VmHWM'):.0f} MiB, "
                              f"RSS {_rss_mib(guard.pid):.0f} MiB")
                for peer in peers:
                    peer.close()
        finally:
            stop.set()
            for flooder in flooders:
                flooder.join(10)
            guard.kill()
            guard.wait()
    return rows


def _black_hole() -> tuple[socket.socket, str, list[socket.socket]]:
    """A server that accepts TCP and never answers: its listener, URL, and the connections it holds."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}", held


def _fair(folder: str) -> dict[str, float]:
    """Issue 54's rows, each against a fresh guard: ms from a healthy server's trainer's death to its
    first /flush, after 200 deaths on a black-holed server, and after two 500-id deaths on a server
    taking 3 s per /flush."""
    rows: dict[str, float] = {}
    for kind in ("black-holed", "slow"):
        path = os.path.join(folder, f"fair-{kind}.sock")
        guard = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        listener, hole_url, held = _black_hole()
        try:
            assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
            with AgentServerStub(teardown=3.0) as slow, AgentServerStub() as healthy:
                if kind == "black-holed":
                    for number in range(200):
                        _held(path, _peer_state([hole_url], [f"dead-{number}"], number)).close()
                    while len(held) < 4:  # its flushes hold their share of the guard
                        time.sleep(0.01)
                else:
                    for number in range(2):
                        _held(path, _peer_state([slow.url], [f"s{number}-{i}" for i in range(500)], number)).close()
                    while len(slow.requests) < 2:
                        time.sleep(0.01)
                killed = time.monotonic()
                _held(path, _peer_state([healthy.url], ["healthy"], 999)).close()
                end = time.monotonic() + 60
                while not healthy.requests and time.monotonic() < end:
                    time.sleep(0.001)
                rows[kind] = (healthy.requests[0].at - killed) * 1000 if healthy.requests else float("nan")
        finally:
            guard.kill()
            guard.wait()
            listener.close()
            for conn in held:
                conn.close()
    return rows


def _first_flush_ms(path: str, healthy: AgentServerStub, number: int) -> float:
    """A healthy server's trainer dies now: ms to its first /flush."""
    healthy.clear_requests()
    killed = time.monotonic()
    _held(path, _peer_state([healthy.url], [f"healthy-{number}"], number)).close()
    end = time.monotonic() + 60
    while not healthy.requests and time.monotonic() < end:
        time.sleep(0.001)
    return (healthy.requests[0].at - killed) * 1000 if healthy.requests else float("nan")


def _crowded(folder: str) -> dict[str, str]:
    """Issue 63's rows, each against a fresh guard: a healthy death's first /flush after 4 and 16
    black-holed servers x 100 deaths (at once, and 3 s later, once each has failed), and the worst
    delay of a healthy server's ids from 200 deaths of trainers listing a black-holed server too."""
    rows: dict[str, str] = {}
    for holes in (4, 16, 0):
        path = os.path.join(folder, f"crowded-{holes}.sock")
        guard = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
            with black_holes(max(holes, 1)) as urls, AgentServerStub() as healthy:
                if holes:
                    for number in range(100 * holes):
                        _held(path, _peer_state([urls[number % holes]], [f"dead-{number}"], number)).close()
                    at_once = _first_flush_ms(path, healthy, 100_000)
                    time.sleep(3.0)
                    later = max(_first_flush_ms(path, healthy, 100_001 + rep) for rep in range(5))
                    rows[f"holes-{holes}"] = f"{at_once:.1f} ms / {later:.1f} ms"
                    continue
                deaths: dict[str, float] = {}
                for number in range(200):
                    deaths[f"both-{number}"] = time.monotonic()
                    _held(path, _peer_state([urls[0], healthy.url], [f"both-{number}"], number)).close()
                end = time.monotonic() + 120
                while len({request.instance_id for request in healthy.requests}) < 200 and time.monotonic() < end:
                    time.sleep(0.01)
                firsts: dict[str, float] = {}
                for request in healthy.requests:
                    firsts.setdefault(request.instance_id or "", request.at - deaths[request.instance_id or ""])
                rows["beside"] = (f"{len(firsts)} of 200, the last {max(firsts.values()) * 1000:.0f} ms after its death"
                                  if firsts else "none")
        finally:
            guard.kill()
            guard.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="trainer processes killed one after another (max 10)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    ns = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="sfg-bench-", dir="/tmp")
    path = os.path.join(folder, "guard.sock")
    processes: list[subprocess.Popen[str]] = []
    guard = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert guard.stdout is not None and guard.stdout.readline().startswith("guarding ")
        with AgentServerStub(teardown=0.2) as stub:
            env = {**os.environ, "AGENT_SERVER_URL": stub.url}
            arming: list[float] = []
            for number in range(PROCESSES):
                trainer = subprocess.Popen([sys.executable, "-c", TRAINER, path, str(PER_PROCESS), f"p{number}"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
                processes.append(trainer)
                assert trainer.stdout is not None
                arming += [float(value) for value in trainer.stdout.readline().split()]
            time.sleep(1.0)
            cpu_before = _cpu_seconds(guard.pid)
            time.sleep(5.0)
            idle_cpu = _cpu_seconds(guard.pid) - cpu_before
            rss = _rss_mib(guard.pid)
            firsts: list[float] = []
            worsts: list[float] = []
            for number in range(min(ns.reps, PROCESSES)):
                stub.clear_requests()
                killed = time.monotonic()
                processes[number].kill()
                processes[number].wait()
                end = time.monotonic() + 5
                while len(stub.requests) < 2 * PER_PROCESS and time.monotonic() < end:
                    time.sleep(0.005)
                first_per_trainer: dict[str, float] = {}
                for request in stub.requests:
                    trainer_key = (request.instance_id or "").rpartition("-")[0]
                    first_per_trainer.setdefault(trainer_key, request.at - killed)
                assert len(first_per_trainer) == PER_PROCESS, f"{len(first_per_trainer)} trainers flushed"
                firsts.append(statistics.median(first_per_trainer.values()))
                worsts.append(max(first_per_trainer.values()))
                time.sleep(0.5)  # the 0.2 s teardowns end before the next kill
            hostile = {kind: _hostile(stub, folder, kind) for kind in ("long-lines", "idle")}
            bounded = _bounded(stub, folder)
            fair = _fair(folder)
            crowded = _crowded(folder)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        guard.kill()
        guard.wait()
        shutil.rmtree(folder, ignore_errors=True)
    lines = [f"# guard benchmark\n\nMachine: {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{PROCESSES * PER_PROCESS} trainers ({PROCESSES} processes x {PER_PROCESS} connections, 2 ids each), "
             f"stub with 0.2 s teardown in the measuring process (`python -m benchmarks.guard --reps {ns.reps}`).\n",
             "| what | value | goal |", "|---|---|---|",
             f"| arming through the guard (median / max of {len(arming)}) | {statistics.median(arming) * 1000:.1f} ms "
             f"/ {max(arming) * 1000:.1f} ms | under 0.1 s |",
             f"| guard RSS, 100 trainers connected | {rss:.1f} MiB | under 40 MB |",
             f"| guard CPU over 5 s, 100 trainers, nobody dying | {idle_cpu * 1000:.0f} ms | none |",
             f"| SIGKILL of 10 trainers at once to each one's first flush request (median of medians, "
             f"{len(firsts)} kills) | {statistics.median(firsts) * 1000:.1f} ms | under 0.1 s |",
             f"| the same, the slowest of the 10 (worst of {len(worsts)} kills) | {max(worsts) * 1000:.1f} ms | |"]
    long_lines, idle = hostile["long-lines"], hostile["idle"]
    lines += ["", "Hostile peers (one trainer SIGKILLed during each; 0.5.0 in the last column, from issue 34):", "",
              "| case | death to first flush | guard peak RSS | guard CPU | 0.5.0 |", "|---|---|---|---|---|",
              f"| 50 peers, each a line just under the 32 MiB bound | {long_lines[0]:.0f} ms | {long_lines[1]:.0f} MiB "
              f"| {long_lines[2]:.1f} s | 4.5 s to flush, 3.2 GiB, 340 s CPU |",
              f"| 1,100 idle connections, descriptor limit 1,024 | {idle[0]:.0f} ms | {idle[1]:.0f} MiB "
              f"| {idle[2]:.1f} s | flush failed (EMFILE), loop at 71-94 % of a core |"]
    lines += ["", "Bounded parts (each against a fresh guard; 1.0.0 in the last column, from issue 39):", "",
              "| case | measured | goal | 1.0.0 |", "|---|---|---|---|",
              f"| death to first flush request, median / worst of 10, 100 trainers beside 50 peers sending garbage "
              f"| {bounded['garbage']} | under 0.1 s | 309-856 ms median, 1.6 s worst |",
              f"| the guard's threads after 200 trainers died for a server that is down | {bounded['retrying']} "
              f"| at most 64 | a thread per retrying flush (crashed under a pids limit of 150) |",
              f"| 8 states of 28 MiB, one after another, default budget (256 MiB) | {bounded['large']} "
              f"| within the budget and a margin | all held, RSS 426 MiB, 548-675 MiB after they closed |"]
    lines += ["", "Fair by server (each against a fresh guard; 1.1.0 in the last column, from issue 54). Load "
              f"average at the end: {os.getloadavg()[0]:.1f}.", "",
              "| case | a healthy server's death to its first /flush | goal | 1.1.0 |", "|---|---|---|---|",
              f"| after 200 deaths on a server that accepts TCP and never answers | {fair['black-holed']:.1f} ms "
              "| under 0.1 s | 58.0 s |",
              f"| after 2 deaths of 500 ids each on a server taking 3 s per /flush | {fair['slow']:.1f} ms "
              "| under 0.1 s | 11.6 s |"]
    lines += ["", "A crowded node (each against a fresh guard; 1.2.0 in the last column, from issue 63). A black-holed "
              "server's connects never complete (a listener whose queue is full).", "",
              "| case | measured | goal | 1.2.0 |", "|---|---|---|---|",
              f"| 4 black-holed servers x 100 deaths, then a healthy death: its first /flush at once / the worst of "
              f"5, 3 s later | {crowded['holes-4']} | under 0.1 s | 17.8-18.1 s |",
              f"| 16 black-holed servers x 100 deaths, the same | {crowded['holes-16']} | under 0.1 s | |",
              f"| 200 trainers listing a black-holed X and a healthy H2 (`AGENT_SERVER_URL=X,H2`), SIGKILLed one "
              f"after another: H2's ids | {crowded['beside']} | each within 1 s of its death "
              "| 25/50/75/100 % after 41/101/161/221 s |"]
    text = "\n".join(lines) + "\n"
    print(text)
    ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
