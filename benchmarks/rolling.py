"""``python -m benchmarks.rolling [--restarts 50] [--trainers 20]``: a rolling-restart soak of the guard.

A guard (``--drain 1``, a ledger) is restarted ``--restarts`` times (SIGTERM, the successor started
at once) while ``--trainers`` slots each run one trainer process after another: it arms through the
guard with an id of its own, refreshes every 50 ms, and after 0.5-3 s either disarms and exits or
is SIGKILLed (half each). A probe connects to the socket path every 10 ms. Three forms:

- ``plain``: the old guard drains and exits on its own;
- ``kill-old``: the old guard is SIGKILLed 0.3 s after its successor says it is guarding;
- ``kill-successor``: the successor is SIGKILLed as soon as it says it is guarding (mid-hand-over),
  and another successor is started.

Counted from the stub's requests (in this process: one clock): a trainer flushed before its death
(``live``), a disarmed trainer flushed at all (``disarmed``), a death flushed more than once
(``twice``), a death never flushed within 20 s of the end (``lost``), trainers that could not arm,
and the longest time the path did not accept a connection. Writes ``benchmarks/rolling.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from swe_flush_sync.testing import AgentServerStub

RESULTS = Path(__file__).with_name("rolling.md")
FORMS = ("plain", "kill-old", "kill-successor")
TRAINER = """
import argparse, sys, time
from swe_flush_sync import watchdog
args = argparse.Namespace(session_server_instance_ids={1: sys.argv[2]}, session_server_instance_id=None)
try:
    dog = watchdog(args, guard=sys.argv[1], deadline=5, until_idle=False)
except Exception as exc:
    print("FAILED", type(exc).__name__, exc, flush=True)
    sys.exit(1)
print("ARMED", flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    dog.refresh()
    time.sleep(0.05)
if sys.argv[4] == "disarm":
    dog.disarm()
    print("DISARMED", flush=True)
else:
    print("LIVING", flush=True)
    time.sleep(3600)
"""


@dataclass
class _Ended:
    """What the harness knows of each trainer: when it ended and how (killed or disarmed)."""

    killed: dict[str, float] = field(default_factory=dict)  # id -> the moment before its SIGKILL
    pids: dict[str, int] = field(default_factory=dict)  # id -> its trainer's pid
    disarmed: set[str] = field(default_factory=set)
    failed: list[str] = field(default_factory=list)  # arming errors
    lock: threading.Lock = field(default_factory=threading.Lock)


def _guard(path: str, ledger: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], float]:
    """A guard started and guarding (its stderr in ``PATH.N.log``); when it said so."""
    with open(f"{path}.{time.monotonic_ns()}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "swe_flush_sync", "guard", "--socket", path, "--ledger",
                                 ledger, "--drain", "1"], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("guarding"):
        proc.kill()
        raise RuntimeError(f"a guard did not start: {line!r} (exit {proc.wait()})")
    return proc, time.monotonic()


def _slot(number: int, path: str, env: dict[str, str], stop: threading.Event, ended: _Ended) -> None:
    """One trainer after another until ``stop``."""
    generation = 0
    while not stop.is_set():
        generation += 1
        name = f"t{number}-{generation}"
        how = random.choice(("disarm", "kill"))
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, path, name, f"{random.uniform(0.5, 3.0):.2f}", how],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        first = proc.stdout.readline().split(maxsplit=1)
        if first[:1] != ["ARMED"]:
            with ended.lock:
                ended.failed.append(" ".join(first))
            proc.wait()
            continue
        last = proc.stdout.readline().strip()
        if last == "LIVING":
            with ended.lock:
                ended.killed[name], ended.pids[name] = time.monotonic(), proc.pid
            proc.kill()
        elif last == "DISARMED":
            with ended.lock:
                ended.disarmed.add(name)
        proc.wait()


def _probe(path: str, stop: threading.Event, gaps: list[float]) -> None:
    """Connect every 10 ms; the longest stretch from a connection accepted to the next one, over the
    stretches with a refusal in them, goes in ``gaps`` (0 when none was refused)."""
    last_ok, failing, longest = time.monotonic(), False, 0.0
    while not stop.is_set():
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                failing = True
            else:
                now = time.monotonic()
                if failing:
                    longest, failing = max(longest, now - last_ok), False
                last_ok = now
        stop.wait(0.01)
    gaps.append(max(longest, time.monotonic() - last_ok) if failing else longest)


def soak(form: str, restarts: int, trainers: int) -> dict[str, float]:
    """One form of the soak; its counts."""
    folder = tempfile.mkdtemp(prefix="sfr-", dir="/tmp")
    path, ledger = os.path.join(folder, "g.sock"), os.path.join(folder, "ledger")
    with AgentServerStub() as stub:
        env = {**os.environ, "AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": "soak-secret",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        guards = [_guard(path, ledger, env)[0]]
        stop_trainers, stop_probe = threading.Event(), threading.Event()
        ended, gaps = _Ended(), []
        slots = [threading.Thread(target=_slot, args=(n, path, env, stop_trainers, ended)) for n in range(trainers)]
        prober = threading.Thread(target=_probe, args=(path, stop_probe, gaps))
        for thread in [*slots, prober]:
            thread.start()
        time.sleep(2.0)  # every slot armed once
        for _ in range(restarts):
            old = guards[-1]
            old.send_signal(signal.SIGTERM)
            successor, up = _guard(path, ledger, env)
            guards.append(successor)
            if form == "kill-old":
                time.sleep(max(0.0, up + 0.3 - time.monotonic()))
                old.kill()
            elif form == "kill-successor":
                successor.kill()
                successor.wait()
                guards.append(_guard(path, ledger, env)[0])
            time.sleep(random.uniform(0.3, 0.8))
        stop_trainers.set()
        for thread in slots:
            thread.join()
        time.sleep(1.0)
        stop_probe.set()
        prober.join()
        give_up_at = time.monotonic() + 20.0
        while time.monotonic() < give_up_at and not set(ended.killed) <= set(stub.flushed_ids()):
            time.sleep(0.1)
        for guard in guards:
            if guard.poll() is None:
                guard.kill()
            guard.wait()
        requests = [(r.instance_id, r.at) for r in stub.requests if r.instance_id]
    counts: dict[str, int] = {}
    for instance_id, _ in requests:
        counts[instance_id] = counts.get(instance_id, 0) + 1
    for twice in sorted(i for i in ended.killed if counts.get(i, 0) > 1):  # what the guards said of it
        pid = ended.pids[twice]
        print(f"{form}: {twice} (pid {pid}) flushed at", [round(at - ended.killed[twice], 3) for i, at in requests
                                                          if i == twice], "s after its SIGKILL", file=sys.stderr)
        for log in sorted(Path(folder).glob("*.log")):
            for line in log.read_text().splitlines():
                if f"pid {pid} " in line or "recovered" in line:
                    print(f"  {log.name}: {line}", file=sys.stderr)
    counts = {}
    live = disarmed = 0
    for instance_id, at in requests:
        counts[instance_id] = counts.get(instance_id, 0) + 1
        if instance_id in ended.disarmed:
            disarmed += 1
        elif instance_id in ended.killed and at < ended.killed[instance_id]:
            live += 1
    return {"trainers": len(ended.killed) + len(ended.disarmed) + len(ended.failed), "deaths": len(ended.killed),
            "live": live, "disarmed": disarmed, "twice": sum(1 for i in ended.killed if counts.get(i, 0) > 1),
            "lost": sum(1 for i in ended.killed if i not in counts), "arm failures": len(ended.failed),
            "longest gap (s)": round(gaps[0], 3) if gaps else -1.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=50)
    parser.add_argument("--trainers", type=int, default=20)
    parser.add_argument("--forms", default=",".join(FORMS))
    options = parser.parse_args()
    rows = []
    for form in options.forms.split(","):
        started = time.monotonic()
        result = soak(form, options.restarts, options.trainers)
        print(form, result, f"{time.monotonic() - started:.0f} s", flush=True)
        rows.append((form, result))
    columns = list(rows[0][1])
    lines = [f"# Rolling restarts ({options.restarts} restarts, {options.trainers} trainer slots)", "",
             f"`python -m benchmarks.rolling`, Python {platform.python_version()}, load "
             f"{os.getloadavg()[0]:.1f} at the end.", "",
             "| form | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    lines += [f"| {form} | " + " | ".join(f"{result[c]:g}" for c in columns) + " |" for form, result in rows]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
