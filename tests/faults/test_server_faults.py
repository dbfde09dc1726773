"""Server and network faults, each alone and mixed in one call."""

from __future__ import annotations

import email.utils
import logging
import threading
import time
import tracemalloc

import pytest

from swe_flush_sync import Flusher, flush
from swe_flush_sync.testing import AgentServerStub

from ..conftest import SECRET, ours
from .conftest import Promises
from .peers import RawPeer, refused_url

DEADLINE = 1.5


def flush_one(stub: AgentServerStub, promises: Promises, instance_id: str = "bad", deadline: float = DEADLINE,
              **options: object):  # type: ignore[no-untyped-def]
    """Flush the faulty id plus two healthy ones; return the faulty result after the common checks."""
    promises.start()
    report = flush(stub.url, ["ok-1", instance_id, "ok-2"], admin_secret=SECRET, deadline=deadline,
                   backoff_factor=0.05, **options)
    promises.check(report, deadline)
    by_id = {r.instance_id: r for r in report.results}
    assert by_id["ok-1"].ok and by_id["ok-2"].ok, report.summary()
    return by_id[instance_id]


@pytest.mark.parametrize("mode", ["no-accept", "no-answer"])
def test_silent_peers_fail_at_the_deadline(mode: str, stub: AgentServerStub, promises: Promises) -> None:
    with RawPeer(mode) as peer:
        promises.start()
        report = flush([peer.url, stub.url], ["a", "b"], admin_secret=SECRET, deadline=DEADLINE)
    promises.check(report, DEADLINE)
    for result in report.results:
        if result.server_url == peer.url:
            assert not result.ok and "deadline passed" in (result.error or "") and result.status_code is None
        else:
            assert result.ok


def test_refused(stub: AgentServerStub, promises: Promises) -> None:
    url = refused_url()
    promises.start()
    report = flush([url, stub.url], ["a"], admin_secret=SECRET, deadline=DEADLINE, backoff_factor=0.05)
    promises.check(report, DEADLINE)
    refused, fine = report.results
    assert fine.ok
    assert not refused.ok and refused.error == "could not connect: connection refused" and refused.attempts == 4


def test_a_2xx_whose_body_is_cut_off_is_no_flush(stub: AgentServerStub, promises: Promises) -> None:
    """A 2xx that is not the whole flush answer: nothing proves the server flushed (1.2.0 called it ok)."""
    with RawPeer("cut-body") as peer:
        promises.start()
        report = flush([peer.url, stub.url], ["a"], admin_secret=SECRET, deadline=DEADLINE)
    promises.check(report, DEADLINE)
    cut, fine = report.results
    assert fine.ok and not cut.ok and cut.status_code == 200 and cut.cancelled is None
    assert "no flush answer" in (cut.error or "") or "cut off" in (cut.error or ""), cut.error


def test_trickling_body_is_cut_at_the_deadline(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", trickle=0.2)
    result = flush_one(stub, promises)
    assert not result.ok and "deadline passed" in (result.error or "")


def test_hang(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", hang=True)
    result = flush_one(stub, promises)
    # the caller gives up at the deadline; the worker's clamped read timeout may say so first, and on
    # a loaded host it may end the attempt a moment before the caller does ("read timed out; deadline
    # passed before the next retry"): either way one attempt, cut by the deadline
    assert not result.ok and "deadline passed" in (result.error or "") and result.attempts == 1


def test_dropped_connection_is_retried_then_reported(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", drop=True)
    result = flush_one(stub, promises, retries=2)
    assert not result.ok and result.error == "connection dropped by the server" and result.attempts == 3
    assert [r.instance_id for r in stub.requests].count("bad") == 3


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_5xx_forever(status: int, stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", statuses=[status] * 100)
    result = flush_one(stub, promises, retries=3)
    assert (result.ok, result.status_code, result.attempts) == (False, status, 4)
    assert result.error == f"HTTP {status}: retries exhausted"


@pytest.mark.parametrize("times", [1, 3])
def test_5xx_n_times_then_ok(times: int, stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", statuses=[503] * times)
    result = flush_one(stub, promises, retries=3)
    assert (result.ok, result.status_code, result.attempts) == (True, 200, times + 1)


def test_429_retry_after_seconds(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", statuses=[429], retry_after="1")
    result = flush_one(stub, promises, deadline=3)
    first, second = [r for r in stub.requests if r.instance_id == "bad"]
    assert result.ok and result.attempts == 2 and second.at - first.at >= 0.9


def test_429_retry_after_http_date(stub: AgentServerStub, promises: Promises) -> None:
    # An HTTP date has whole seconds: 3 s past the current whole second is 2-3 s from now, never under 0.9.
    stub.fault("bad", statuses=[429], retry_after=email.utils.formatdate(int(time.time()) + 3, usegmt=True))
    result = flush_one(stub, promises, deadline=5)
    first, second = [r for r in stub.requests if r.instance_id == "bad"]
    assert result.ok and result.attempts == 2 and second.at - first.at >= 0.9


@pytest.mark.parametrize("retry_after", ["86400000", "Fri, 31 Dec 2100 23:59:59 GMT"])
def test_absurd_retry_after_stops_at_once(retry_after: str, stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", statuses=[429, 429], retry_after=retry_after)
    started = time.monotonic()
    result = flush_one(stub, promises, deadline=3)
    assert time.monotonic() - started < 1.0
    assert (result.ok, result.status_code, result.attempts) == (False, 429, 1)
    assert "reaches past the deadline" in (result.error or "")


@pytest.mark.parametrize("status", [401, 403, 404, 405, 422])
def test_client_errors(status: int, stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", statuses=[status] * 5)
    result = flush_one(stub, promises)
    assert (result.ok, result.status_code, result.attempts) == (False, status, 1)


@pytest.mark.parametrize("body", [b"<html>ok</html>", b'["cancelled", 3]', b'{"cancelled": "3"}'])
def test_odd_2xx_bodies_are_no_flush(body: bytes, stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", body=body)
    result = flush_one(stub, promises)
    assert (result.ok, result.status_code, result.cancelled) == (False, 200, None)
    assert body.decode() in (result.error or ""), result.error  # what came back, said


def test_huge_body_is_not_read_into_memory(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("bad", body=b" " * (10 * 1024 * 1024))
    tracemalloc.start()
    try:
        result = flush_one(stub, promises)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (result.ok, result.cancelled) == (False, None)
    assert peak < 3 * 1024 * 1024, peak


def test_redirect_to_another_host_is_not_followed(stub_factory, promises: Promises) -> None:  # type: ignore[no-untyped-def]
    elsewhere = stub_factory()
    here = stub_factory(secret=SECRET)
    here.fault("bad", statuses=[307], redirect_to=elsewhere.url + "/flush")
    result = flush_one(here, promises)
    assert (result.ok, result.status_code) == (False, 307) and "redirect not followed" in (result.error or "")
    assert elsewhere.requests == []


def test_unresolvable_host(stub: AgentServerStub, promises: Promises) -> None:
    promises.start()
    report = flush(["http://flush-target.invalid:8000", stub.url], ["a"], admin_secret=SECRET,
                   deadline=DEADLINE, retries=1)
    promises.check(report, DEADLINE)
    dns, fine = report.results
    assert fine.ok and not dns.ok and dns.error == "host name did not resolve"


def test_sixteen_ids_mixed_faults_in_one_call(stub_factory, promises: Promises) -> None:  # type: ignore[no-untyped-def]
    elsewhere = stub_factory()
    stub = stub_factory(secret=SECRET)
    stub.fault("hang", hang=True)
    stub.fault("drop", drop=True)
    stub.fault("trickle", trickle=0.2)
    stub.fault("503-forever", statuses=[503] * 100)
    stub.fault("503-twice", statuses=[503, 503])
    stub.fault("429-1s", statuses=[429], retry_after="1")
    stub.fault("429-absurd", statuses=[429], retry_after="999999")
    stub.fault("401", statuses=[401])
    stub.fault("422", statuses=[422])
    stub.fault("not-json", body=b"nope")
    stub.fault("huge", body=b" " * (10 * 1024 * 1024))
    stub.fault("redirect", statuses=[302], redirect_to=elsewhere.url + "/flush")
    expected = {
        "ok-1": (True, 200, None), "ok-2": (True, 200, None), "ok-3": (True, 200, None),
        "ok-4": (True, 200, None), "503-twice": (True, 200, None), "429-1s": (True, 200, None),
        "not-json": (False, 200, "no flush answer"), "huge": (False, 200, "no flush answer"),
        "hang": (False, None, "deadline passed"), "trickle": (False, None, "deadline passed"),
        "drop": (False, None, "connection dropped"), "503-forever": (False, 503, "HTTP 503"),
        "429-absurd": (False, 429, "Retry-After: 999999 reaches past the deadline"),
        "401": (False, 401, "bearer"), "422": (False, 422, "request body"),
        "redirect": (False, 302, "redirect not followed"),
    }
    assert len(expected) == 16
    promises.start()
    report = flush(stub.url, list(expected), admin_secret=SECRET, deadline=3, backoff_factor=0.05)
    promises.check(report, 3)
    for result in report.results:
        ok, status, error = expected[result.instance_id]
        assert result.ok is ok, result
        if ok:
            assert result.error is None
        else:
            assert result.status_code == status and error in (result.error or ""), result
    assert elsewhere.requests == []
    assert report.cancelled == 0 and len(report.failed) == 10


def test_a_thousand_ids(stub: AgentServerStub, promises: Promises, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    ids = [f"id-{n}" for n in range(1000)]
    peak_threads = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak_threads
        while not done.is_set():
            peak_threads = max(peak_threads, len(ours()))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    promises.start()
    with Flusher(stub.url, admin_secret=SECRET, deadline=30) as flusher:
        report = flusher.flush(ids)
    done.set()
    watcher.join()
    promises.check(report, 30)
    assert report.ok and len(report.results) == 1000
    assert sorted(stub.flushed_ids()) == sorted(ids)
    assert 0 < peak_threads <= 256
    assert "Connection pool is full" not in caplog.text
