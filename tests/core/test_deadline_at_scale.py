"""The one overall deadline holds at any size the package accepts (issue 42): 100,000 ids, with
``deadline=5``, from a process of their own against the stub over real sockets. The call returns
within a bound of the deadline (1.0.0 took 13.5-15 s), submitting stops in time, and every pair
never sent is reported as such."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import select
import socket
import subprocess
import textwrap
import time

import pytest

from swe_flush_sync import FlushResult, flush
from swe_flush_sync._core import flusher
from swe_flush_sync._core.report import collector_paused, never_sent
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, HungServer, subprocess_env, wait_until

CALLER = """
import json, os, sys, time
from collections import Counter
from swe_flush_sync import abort, flush
ids = [f"scale-{{number:06d}}" for number in range(100_000)]
started = time.monotonic()
if {entry!r} == "flush":
    report = flush({url!r}, ids, admin_secret=os.environ["HARBOR_ADMIN_SECRET"], deadline=5)
else:
    report = abort({{"session_server_instance_ids": ids}}, deadline=5)
took = time.monotonic() - started
errors = Counter("ok" if r.ok else ("never sent" if r.error == "deadline passed before it was sent" else
                                    "at the deadline" if "deadline passed" in (r.error or "") else r.error)
                 for r in report.results)
print(json.dumps({{"took": took, "results": len(report.results), "errors": errors}}), flush=True)
"""


@pytest.mark.alone  # it times a CPU-bound call against its deadline: neighbours would be measured too
@pytest.mark.parametrize("entry", ["flush", "abort"])
def test_100000_ids_return_within_the_deadline(stub: AgentServerStub, entry: str) -> None:
    out = subprocess.run([PYTHON, "-c", textwrap.dedent(CALLER.format(entry=entry, url=stub.url))],
                         capture_output=True, text=True, timeout=120,
                         env=subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET))
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout)
    # The goal, the deadline plus 0.5 s, is met quiet and at a load of 5 (benchmarks.scale). Here five
    # suites run side by side on two cores: they took up to 6.0 s, and once 6.51 s (the floors lane, 1.2.0
    # before the report came ahead of the workers' wake-up). The bound keeps a margin: 1.0.0 took 13.5-15 s.
    assert seen["took"] <= 5.0 + 2.5, seen
    assert seen["results"] == 100_000
    assert set(seen["errors"]) <= {"ok", "never sent", "at the deadline"}, seen["errors"]
    # what was answered in time is reported ok; the stub also counts those answered after the caller
    # reported them cut at the deadline
    errors = seen["errors"]
    assert 0 < errors["ok"] <= len(stub.flushed_ids()) <= errors["ok"] + errors.get("at the deadline", 0)
    assert seen["errors"]["never sent"] > 0  # the stub cannot take 100,000 in 5 s here: the rest is said


def _hung_up(peer: socket.socket) -> bool:
    """The client end of ``peer`` was shut down (it may still have unread request bytes)."""
    poll = select.poll()
    poll.register(peer, select.POLLRDHUP)
    return bool(poll.poll(0))


def test_pairs_in_flight_are_reported_and_logged_before_their_requests_are_given_up(
        hung: HungServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for answers ends when the time left is what the report is measured to take, and the
    requests still out are given up (their workers woken: 256 at 100,000 ids) only once the report
    is made and logged. Waiting to the deadline itself, a report of 100,000 pairs on a loaded host
    was made while every worker woke at once, and returned 1.5 s late."""
    monkeypatch.setattr(flusher._measured, "report", 0.2)  # a sent pair's report, as if measured: 0.2 s
    monkeypatch.setattr(flusher._measured, "unsent", 1e-6)
    open_at_log: list[list[bool]] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            open_at_log.append([not _hung_up(peer) for peer in list(hung.held)])

    probe, logger = Probe(), logging.getLogger("swe_flush_sync")
    logger.addHandler(probe)
    try:
        started = time.monotonic()
        report = flush(hung.url, ["a", "b", "c"], deadline=2.0)
        took = time.monotonic() - started
    finally:
        logger.removeHandler(probe)
    # 0.6 s to report the three pairs sent: the call ends with them at about 1.4 s, never at 2.0 s
    assert took < 2.0 - 0.15, took
    assert [r.error for r in report.results if r.error != "deadline passed before it was sent"] and \
        {r.error for r in report.results} <= {"deadline passed while in flight", "deadline passed before it was sent"}
    assert open_at_log and open_at_log[0] and all(all(peers) for peers in open_at_log), open_at_log
    assert wait_until(lambda: all(_hung_up(peer) for peer in hung.held), timeout=10)  # then given up


def test_a_pass_larger_than_the_workers_prepares_only_what_they_take() -> None:
    """Pairs are handed to the executor as workers take them (two a worker ahead): what the deadline
    finds unsent was never prepared (its bearer never asked for), and it is reported at once."""
    asked: list[str] = []

    def bearer(instance_id: str) -> str:
        asked.append(instance_id)
        return SECRET

    ids = [f"window-{number:02d}" for number in range(40)]
    with AgentServerStub(secret=SECRET, teardown=1.0) as slow:
        report = flush(slow.url, ids, bearer=bearer, max_workers=2, deadline=1.9)
        flushed = slow.flushed_ids()
    never = [r.instance_id for r in report.results if r.error == "deadline passed before it was sent"]
    # The window holds 4 (2 workers, 2 a worker); a pair that went out and ended makes room for one,
    # however it ended (answered at 1 s, or timed out at the deadline a moment before feeding stopped).
    # The first two are answered at 1 s or a loaded host's moment later; the next two, sent then, never
    # before 2 s, past the deadline.
    went_out = len(ids) - len(never)
    assert len(asked) <= 4 + went_out < len(ids), (asked, went_out)
    assert set(ids) - set(asked) <= set(never)  # (those queued for a worker, prepared, are never sent too)
    assert set(flushed) <= set(asked)
    assert sum(r.ok for r in report.results) == 2 and len(flushed) >= 2


def test_results_of_pairs_never_sent_are_the_results_flush_reports() -> None:
    """``never_sent`` builds results slot by slot, for speed: each equals the ``FlushResult`` it
    stands for, field by field, in repr, hash and frozenness."""
    made = never_sent("http://agent:8000", ["a", "b"], elapsed=1.5, error="deadline passed before it was sent",
                      idle=False)
    expected = [FlushResult("http://agent:8000", i, ok=False, elapsed=1.5, error="deadline passed before it was sent",
                            idle=False) for i in ("a", "b")]
    assert made == expected and [repr(r) for r in made] == [repr(r) for r in expected]
    assert [dataclasses.astuple(r) for r in made] == [dataclasses.astuple(r) for r in expected]
    assert hash(made[0]) == hash(expected[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].ok = True  # type: ignore[misc]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_results_are_built_and_left_as_found(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # a signal handler's call inside a call: the outer one resumes it
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(KeyboardInterrupt), collector_paused():
            raise KeyboardInterrupt
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
