"""until_idle: flush each server's ids in rounds until a round cancels nothing (runs queued behind slots)."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import threading
import time

import pytest

from swe_flush_sync import ConfigError, abort, flush
from swe_flush_sync._cli.main import main
from swe_flush_sync._core import flusher as flusher_module
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, blocked_in, spawn, subprocess_env


@pytest.fixture
def slots(stub_factory) -> AgentServerStub:  # type: ignore[no-untyped-def]
    """A stub like the bridge's default: 8 trials at once, the rest wait for a slot."""
    server: AgentServerStub = stub_factory(secret=SECRET, teardown=0.02, max_concurrent=8)
    return server


def test_the_stub_runs_at_most_max_concurrent_and_starts_waiting_runs_when_slots_free(
        slots: AgentServerStub) -> None:
    slots.add_trials("a", 20)
    assert (slots.trials("a"), slots.waiting("a")) == (8, 12)
    report = flush(slots.url, ["a"], admin_secret=SECRET)  # one pass: what the framework's hook does
    assert report.cancelled == 8
    assert (slots.trials("a"), slots.waiting("a")) == (8, 4)  # the waiting runs took the freed slots


def test_one_id_with_queued_runs_is_flushed_until_idle(slots: AgentServerStub) -> None:
    slots.add_trials("a", 20)
    [result] = flush(slots.url, ["a"], admin_secret=SECRET, until_idle=True).results
    assert result.ok and result.cancelled == 20 and result.passes == 4 and result.idle is True  # 8, 8, 4, 0
    assert slots.trials("a") == 0 and slots.waiting() == 0
    assert slots.recancels == 0  # each pass went out after the previous answer, never alongside it


def test_one_pass_leaves_queued_runs_and_says_nothing_of_idle(slots: AgentServerStub) -> None:
    slots.add_trials("a", 20)
    [result] = flush(slots.url, ["a"], admin_secret=SECRET).results
    assert result.ok and result.cancelled == 8 and result.passes == 1 and result.idle is None
    assert slots.trials("a") + slots.waiting("a") == 12


def test_ids_sharing_slots_are_flushed_again_together(slots: AgentServerStub) -> None:
    slots.add_trials("a", 8)  # a's runs hold every slot
    slots.add_trials("b", 5)  # b's wait: a flush of b alone cancels nothing
    assert flush(slots.url, ["b"], admin_secret=SECRET).cancelled == 0
    report = flush(slots.url, ["a", "b"], admin_secret=SECRET, until_idle=True)
    a, b = report.results
    assert (a.cancelled, b.cancelled) == (8, 5)  # round 1: 8 and 0; round 2: 0 and 5; round 3: 0 and 0
    # (2 rounds when b's request of round 1 is read only after a's teardown started b's runs: a loaded host)
    assert a.passes == b.passes in (2, 3) and a.idle is b.idle is True
    assert slots.trials("a") + slots.trials("b") + slots.waiting() == 0
    assert f"in {2 * a.passes} passes, 2/2 idle" in report.summary()


def test_the_deadline_cuts_the_rounds_short_on_time(stub_factory) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(secret=SECRET, teardown=0.3, max_concurrent=2)
    stub.add_trials("a", 100)  # 50 rounds of 0.3 s
    started = time.monotonic()
    # the deadline falls halfway through the fourth round: 150 ms from either of its ends
    [result] = flush(stub.url, ["a"], admin_secret=SECRET, until_idle=True, deadline=1.05).results
    took = time.monotonic() - started
    assert took <= 1.05 + 0.3, took
    assert result.idle is False and result.passes >= 3 and result.cancelled == 2 * result.passes
    assert not result.ok and "deadline passed" in (result.error or "")  # the pass cut in flight
    assert result.elapsed <= took  # the pass cut in flight counts from its own start, not the call's


def test_the_round_cap_stops_a_server_that_never_goes_idle(slots: AgentServerStub,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flusher_module, "MAX_ROUNDS", 2)
    slots.add_trials("a", 30)
    [result] = flush(slots.url, ["a"], admin_secret=SECRET, until_idle=True).results
    assert result.ok and result.passes == 2 and result.cancelled == 16 and result.idle is False


def test_an_answer_without_a_count_ends_the_pair_failed(stub: AgentServerStub) -> None:
    stub.fault("a", body=b'{"session_server_instance_id": "a"}')  # no "cancelled": not the flush's answer
    [result] = flush(stub.url, ["a"], admin_secret=SECRET, until_idle=True).results
    assert not result.ok and result.cancelled is None and "no flush answer" in (result.error or "")
    assert len(stub.requests) == 1


def test_a_failed_pass_ends_that_pair_and_the_others_go_on(slots: AgentServerStub) -> None:
    slots.add_trials("a", 20)
    slots.fault("b", statuses=[503])
    a, b = flush(slots.url, ["a", "b"], admin_secret=SECRET, until_idle=True, retries=0).results
    assert (a.ok, a.passes, a.cancelled, a.idle) == (True, 4, 20, True)
    assert (b.ok, b.status_code, b.passes, b.idle) == (False, 503, 0, None)
    assert [r.instance_id for r in slots.requests].count("b") == 1


def test_servers_are_independent(stub_factory) -> None:  # type: ignore[no-untyped-def]
    slow = stub_factory(secret=SECRET, teardown=0.4, max_concurrent=8)
    quick = stub_factory(secret=SECRET, teardown=0.01, max_concurrent=8)
    for server in (slow, quick):
        server.add_trials("a", 40)  # 6 rounds each
    report = flush([slow.url, quick.url], ["a"], admin_secret=SECRET, until_idle=True, deadline=1.0)
    on_slow, on_quick = report.results
    assert on_quick.idle is True and on_quick.cancelled == 40  # never held back by the slow server's rounds
    assert on_slow.idle is False


def test_abort_until_idle_and_the_report_dict(slots: AgentServerStub) -> None:
    slots.add_trials("a", 10)
    slots.add_trials("b", 3)
    args = {"session_server_instance_ids": {8000: "a", 8001: "b"}}
    report = abort(args, environ={"AGENT_SERVER_URL": slots.url, "HARBOR_ADMIN_SECRET": SECRET}, until_idle=True)
    assert report.ok and report.cancelled == 13
    assert [(r["instance_id"], r["idle"]) for r in report.to_dict()["results"]] == [("a", True), ("b", True)]
    assert all(r["passes"] >= 2 for r in report.to_dict()["results"])


def test_cli_until_idle(slots: AgentServerStub, capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", SECRET)
    slots.add_trials("a", 20)
    assert main(["--url", slots.url, "--id", "a", "--until-idle", "--json"]) == 0
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert (result["cancelled"], result["passes"], result["idle"]) == (20, 4, True)
    slots.add_trials("a", 9)
    assert main(["--url", slots.url, "--id", "a", "--until-idle"]) == 0
    table = capsys.readouterr().out
    assert "PASSES  IDLE" in table and "in 3 passes, 1/1 idle" in table


def test_stub_takes_runs_over_http(slots: AgentServerStub) -> None:
    import requests

    answer = requests.post(slots.url + "/trials", json={"session_server_instance_id": "a", "count": 10}, timeout=5)
    assert answer.json() == {"running": 8, "waiting": 2} and (slots.trials("a"), slots.waiting("a")) == (8, 2)
    bad = requests.post(slots.url + "/trials", json={"session_server_instance_id": "a", "count": "x"}, timeout=5)
    assert bad.status_code == 422


def test_the_signal_hook_flushes_until_idle(slots: AgentServerStub) -> None:
    slots.add_trials("a", 20)
    proc = spawn([PYTHON, "-c", textwrap.dedent("""
        import time
        from swe_flush_sync import flush_on_signal
        flush_on_signal({"session_server_instance_id": "a"}, deadline=5, until_idle=True)
        print("READY", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=subprocess_env(AGENT_SERVER_URL=slots.url, HARBOR_ADMIN_SECRET=SECRET))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    assert blocked_in(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == -signal.SIGTERM, err
    assert slots.flushed_ids() == ["a"] * 4 and slots.trials("a") + slots.waiting() == 0


# -- until_idle is a property of one call, not of the Flusher ---------------------------------------

def test_an_until_idle_abort_joins_a_one_pass_abort_in_flight(stub: AgentServerStub) -> None:
    from swe_flush_sync import _hooks as hooks

    stub.teardown = 0.6
    stub.add_trials("a", 2)
    env = {"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET}
    args = {"session_server_instance_id": "a"}
    box: list[object] = []
    step = threading.Thread(target=lambda: box.append(abort(args, environ=env, deadline=5)))  # one pass
    step.start()
    end = time.monotonic() + 5
    while not stub.connections and time.monotonic() < end:
        time.sleep(0.005)
    time.sleep(0.1)  # the one-pass flush is at the server, tearing down
    final = abort(args, environ=env, deadline=5, until_idle=True)
    step.join(10)
    [result] = final.results
    assert result.ok and result.idle is True and result.cancelled == 2 and result.passes == 2
    assert len(hooks._cache) == 1  # both modes share one Flusher
    assert stub.recancels == 0  # no second flush while the first was tearing down
    assert [r.status for r in stub.requests] == [200, 200]  # the one pass (joined), then the round that found 0


def test_flusher_until_idle_per_call(slots: AgentServerStub) -> None:
    from swe_flush_sync import Flusher

    slots.add_trials("a", 20)
    with Flusher(slots.url, admin_secret=SECRET) as flusher:  # one pass by default
        [one] = flusher.flush(["a"]).results
        [rest] = flusher.flush(["a"], until_idle=True).results
        [again] = flusher.flush(["a"], until_idle=False).results
        with pytest.raises(ConfigError, match="until_idle must be a bool"):
            flusher.flush(["a"], until_idle="yes")  # type: ignore[arg-type]
    assert (one.cancelled, one.idle, one.passes) == (8, None, 1)
    assert (rest.cancelled, rest.idle) == (12, True) and rest.passes >= 2
    assert (again.cancelled, again.idle, again.passes) == (0, None, 1)
