"""``swe-flush guard --metrics`` (issue 36): scraped with ``prometheus_client``'s own parser after real
deaths, and checked against the stub's own counts. Every guard and trainer is a real process."""

from __future__ import annotations

import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, GuardProcess, StartGuard, subprocess_env, wait_until
from ..helpers import IDS, Trainer, guarded_trainer, records, write_record

parser = pytest.importorskip("prometheus_client.parser")


def metrics_url(guard: GuardProcess) -> str:
    return guard.lines[-1].rsplit("metrics on ", 1)[1]


def scrape(guard: GuardProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the guard serves: (name, sorted labels) -> value."""
    with urllib.request.urlopen(metrics_url(guard), timeout=10) as answer:
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_deaths_flushes_and_drops_are_counted(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard("--metrics", "127.0.0.1:0")
    assert metrics_url(guard).startswith("http://127.0.0.1:")
    for instance_id in IDS:
        stub.add_trials(instance_id, 2)
    trainers = [guarded_trainer(stub, guard) for _ in range(2)]
    for trainer in trainers:
        trainer.read("ARMED")
    assert value(scrape(guard), "swe_flush_guard_trainers") == 2
    with socket.socket(socket.AF_UNIX) as peer:  # a peer that sends garbage
        peer.connect(guard.socket)
        peer.sendall(b"garbage\n")
        peer.settimeout(5)
        assert peer.makefile("rb").read().startswith(b"refused ")  # told why, then dropped
    for trainer in trainers:
        trainer.proc.kill()
    assert wait_until(lambda: value(scrape(guard), "swe_flush_guard_flushes_total", outcome="ok") == 2, 10.0)
    samples = scrape(guard)
    assert value(samples, "swe_flush_guard_pairs_total", outcome="ok") == len(stub.requests) == 6
    assert value(samples, "swe_flush_guard_pairs_total", outcome="failed") == 0
    assert value(samples, "swe_flush_guard_trials_cancelled_total") == 6  # the 2 trials of each of 3 ids it held
    assert [stub.trials(instance_id) for instance_id in IDS] == [0, 0, 0]
    assert value(samples, "swe_flush_guard_death_to_flush_seconds_count") == 2
    assert value(samples, "swe_flush_guard_death_to_flush_seconds_sum") < 10
    assert value(samples, "swe_flush_guard_connections_dropped_total", reason="bad_message") == 1
    assert value(samples, "swe_flush_guard_flushes_total", outcome="failed") == 0
    assert value(samples, "swe_flush_guard_trainers") == 0 and value(samples, "swe_flush_guard_retries_pending") == 0
    assert value(samples, "process_resident_memory_bytes") > 0  # the standard process metrics come along


def test_a_failing_flush_is_counted_and_pending(stub: AgentServerStub, start_guard: StartGuard) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once it is closed: the server is down
    guard = start_guard("--metrics", "0")
    trainer = Trainer(stub, AGENT_SERVER_URL=f"http://127.0.0.1:{port}", body=f"""
        dog = watchdog(args, guard={guard.socket!r}, until_idle=False, deadline=2, retries=0)
        print("ARMED", flush=True)
        time.sleep(60)
    """)
    trainer.read("ARMED")
    trainer.proc.kill()
    assert wait_until(lambda: value(scrape(guard), "swe_flush_guard_retries_pending") == 1, 10.0)
    samples = scrape(guard)
    assert value(samples, "swe_flush_guard_flushes_total", outcome="failed") >= 1
    assert value(samples, "swe_flush_guard_pairs_total", outcome="failed") >= len(IDS)
    assert value(samples, "swe_flush_guard_flushes_total", outcome="ok") == 0


def test_recovered_records_are_counted(stub: AgentServerStub, start_guard: StartGuard,
                                       short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    ledger.mkdir(mode=0o700)
    write_record(ledger, "lost", ["lost-a", "lost-b"], stub.url)  # a trainer lost with its node
    guard = start_guard("--ledger", str(ledger), "--metrics", "127.0.0.1:0", AGENT_SERVER_URL=stub.url,
                        HARBOR_ADMIN_SECRET=SECRET)
    assert wait_until(lambda: value(scrape(guard), "swe_flush_guard_records_recovered_total") == 1, 15.0)
    assert sorted(stub.flushed_ids()) == ["lost-a", "lost-b"] and records(ledger) == []
    samples = scrape(guard)  # counted like a trainer's death: the flush, its pairs, its trials
    assert value(samples, "swe_flush_guard_flushes_total", outcome="ok") == 1
    assert value(samples, "swe_flush_guard_pairs_total", outcome="ok") == 2
    assert value(samples, "swe_flush_guard_death_to_flush_seconds_count") == 1  # 1.2.0: 0
    guard.proc.terminate()
    assert guard.proc.wait(15) == 0
    err = guard.stderr()  # and said in one line
    assert len(re.findall(r"recovered 1 record\(s\) of trainers gone \(pid \d+\); flushed 2/2 targets", err)) == 1, err


def test_without_the_extra_the_guard_says_what_to_install(short_dir: Path) -> None:
    blocked = "import sys; sys.modules['prometheus_client'] = None; from swe_flush_sync._cli.main import main; " \
              "sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([PYTHON, "-c", blocked, "guard", "--socket", str(short_dir / "g.sock"), "--metrics", "0"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.returncode == 2 and "pip install prometheus_client" in out.stderr and "'.[metrics]'" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    bad = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", str(short_dir / "g.sock"),
                          "--metrics", "host:port"], capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert bad.returncode == 2 and "--metrics must be [HOST:]PORT" in bad.stderr


def test_no_metrics_no_import() -> None:
    code = ("import sys; import swe_flush_sync, swe_flush_sync._guard.daemon, swe_flush_sync._cli.main; "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.stdout.strip() == "False"  # a trainer, and a guard without --metrics, never load it
