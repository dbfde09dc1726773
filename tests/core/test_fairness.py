"""Fairness: warm connections, retries that fit the deadline, and a hung server that never
starves a healthy one however many steps."""

from __future__ import annotations

import time

import pytest

from swe_flush_sync import Flusher, abort, flush
from swe_flush_sync._core import flusher
from swe_flush_sync.testing import AgentServerStub

from ..conftest import SECRET, HungServer, ours

# -- fairness and retries -----------------------------------------------------------------------

# -- connections ---------------------------------------------------------------------------------

def test_warm_flusher_opens_no_new_connection_at_a_real_teardown(stub: AgentServerStub) -> None:
    stub.teardown = 0.05
    ids = [f"i{n}" for n in range(8)]
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        for _ in range(2):
            assert flusher.flush(ids).ok
        warm = stub.connections
        assert warm <= len(ids)
        for _ in range(20):
            assert flusher.flush(ids).ok
    assert stub.connections == warm, (warm, stub.connections)


def test_a_lingering_request_never_delays_fresh_pairs(stub: AgentServerStub) -> None:
    stub.fault("hung", hang=True)
    with Flusher(stub.url, admin_secret=SECRET, max_workers=4, linger=30) as flusher:
        assert not flusher.flush(["hung"], deadline=0.2).ok  # one of the 4 workers stays on it
        started = time.monotonic()
        report = flusher.flush([f"i{n}" for n in range(8)], deadline=5)
        took = time.monotonic() - started
    assert report.ok and took < 0.5


def test_every_server_gets_its_share_under_a_deadline(stub_factory) -> None:  # type: ignore[no-untyped-def]
    stubs = [stub_factory(secret=SECRET, teardown=0.05) for _ in range(4)]
    ids = [f"i{n}" for n in range(300)]
    report = flush([s.url for s in stubs], ids, admin_secret=SECRET, max_workers=16, deadline=1.0)
    shares = [len(s.requests) for s in stubs]
    assert min(shares) >= max(shares) / 2, shares
    assert report.elapsed <= 1.0 + 0.5
    assert [r.server_url for r in report.results[:300]] == [stubs[0].url] * 300  # report stays server-major


def test_three_503s_then_200_fit_in_the_deadline(stub: AgentServerStub) -> None:
    ids = [f"i{n}" for n in range(20)]
    for instance_id in ids:
        stub.fault(instance_id, statuses=[503, 503, 503])
    report = flush(stub.url, ids, admin_secret=SECRET, deadline=1.5)
    assert report.ok, report.summary()
    assert all(r.attempts == 4 for r in report.results)

# -- a hung server never starves another one ---------------------------------------------------------

def test_a_hung_server_never_starves_a_healthy_one_however_many_steps(stub: AgentServerStub,
                                                                      hung: HungServer) -> None:
    environ = {"AGENT_SERVER_URL": f"{hung.url},{stub.url}", "HARBOR_ADMIN_SECRET": SECRET}
    workers = 16  # 2 steps of 8 ids on both servers fill every worker with lingering requests
    peak = 0
    for step in range(6):  # (a deadline of 1 s: a loaded host may take a few 100 ms to free a given-up worker)
        ids = [f"s{step}-{n}" for n in range(8)]
        report = abort({"session_server_instance_ids": ids}, environ=environ, deadline=1.0, max_workers=workers)
        healthy = [r for r in report.results if r.server_url == stub.url]
        assert all(r.ok for r in healthy), (step, [r.error for r in healthy if not r.ok])
        assert all("left in flight" in (r.error or "") for r in report.results if r.server_url == hung.url)
        peak = max(peak, len(ours()))
    assert peak <= workers, peak
    assert len(stub.flushed_ids()) == 6 * 8


def test_a_request_left_lingering_before_the_deadline_gives_its_worker_to_the_next_call(
        stub: AgentServerStub, hung: HungServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call returns the time its report takes before its deadline: a request it leaves in flight
    lingers from then on, and a call that comes at once, short of a worker, gives it up. (Counted as
    lingering only once its deadline passed, it kept the next step's healthy pair from a worker.)"""
    with Flusher([hung.url, stub.url], admin_secret=SECRET, max_workers=2, deadline=1.5, linger=60) as warm:
        for step in range(3):
            monkeypatch.setattr(flusher._measured, "report", 0.3)  # as if measured: the call ends 0.6 s early
            monkeypatch.setattr(flusher._measured, "unsent", 1e-6)
            report = warm.flush([f"early-{step}"])
            by_server = {r.server_url: r for r in report.results}
            assert by_server[stub.url].ok, (step, report.summary())
            assert "left in flight" in (by_server[hung.url].error or ""), report.summary()
            assert by_server[hung.url].elapsed < 1.5 - 0.3  # it returned before the deadline
    assert stub.flushed_ids() == ["early-0", "early-1", "early-2"]
