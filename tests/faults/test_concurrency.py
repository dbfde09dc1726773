"""Concurrent callers of the shared abort Flusher, draining stragglers, close mid-flush."""

from __future__ import annotations

import threading
import time
from collections import Counter

from swe_flush_sync import Flusher, FlushReport, abort
from swe_flush_sync.testing import AgentServerStub

from ..conftest import SECRET
from .conftest import Promises


def env(stub: AgentServerStub) -> dict[str, str]:
    return {"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET}


def test_two_threads_abort_at_once(stub_factory, promises: Promises) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(secret=SECRET, teardown=0.2)
    reports: list[FlushReport] = []
    barrier = threading.Barrier(2)

    def step(ids: list[str]) -> None:
        barrier.wait()
        reports.append(abort({"session_server_instance_ids": ids}, environ=env(stub), deadline=3))

    threads = [threading.Thread(target=step, args=(ids,)) for ids in (["a", "b", "c"], ["c", "d"])]
    promises.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(reports) == 2 and all(r.ok for r in reports)
    promises.check(reports[0], 3)
    # single flight: "c" is sent once; the later of the two calls joins the earlier's request
    assert Counter(stub.flushed_ids()) == Counter(["a", "b", "c", "d"])
    joined = [r for report in reports for r in report.results if r.joined]
    assert [r.instance_id for r in joined] == ["c"] and joined[0].ok


def test_abort_while_previous_hung_workers_drain(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("hung", hang=True)
    args = {"session_server_instance_ids": ["hung", "a"]}
    first = abort(args, environ=env(stub), deadline=1)
    assert [r.ok for r in first.results] == [False, True]
    promises.start()
    second = abort({"session_server_instance_ids": ["b", "c"]}, environ=env(stub), deadline=1)
    promises.check(second, 1)
    assert second.ok and second.elapsed < 0.5


def test_close_during_flush_from_another_thread(stub: AgentServerStub, promises: Promises) -> None:
    stub.fault("hung", hang=True)
    flusher = Flusher(stub.url, admin_secret=SECRET, deadline=5)
    closer = threading.Timer(0.3, flusher.close)
    closer.start()
    promises.start()
    report = flusher.flush(["hung", "a", "b"])
    promises.check(report, 1.0)  # far sooner than its 5 s deadline
    closer.join()
    by_id = {r.instance_id: r for r in report.results}
    assert by_id["a"].ok and by_id["b"].ok
    assert by_id["hung"].error == "the Flusher was closed while in flight"
    assert flusher.closed


def test_many_threads_share_one_flusher(stub: AgentServerStub, promises: Promises) -> None:
    reports: list[FlushReport] = []
    lock = threading.Lock()

    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        def worker(n: int) -> None:
            for step in range(5):
                report = flusher.flush([f"t{n}-s{step}-{k}" for k in range(4)])
                with lock:
                    reports.append(report)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        promises.start()
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert time.monotonic() - started < 10
    assert len(reports) == 40 and all(r.ok for r in reports)
    assert len(stub.flushed_ids()) == len(set(stub.flushed_ids())) == 160


def test_concurrent_calls_sharing_a_small_executor_do_not_stall(stub_factory, promises: Promises) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(teardown=0.1)
    reports: list[tuple[FlushReport, float]] = []
    with Flusher(stub.url, max_workers=4, deadline=5) as flusher:
        def call(tag: str) -> None:
            started = time.monotonic()
            report = flusher.flush([f"{tag}{k}" for k in range(8)])
            reports.append((report, time.monotonic() - started))

        threads = [threading.Thread(target=call, args=(tag,)) for tag in "ABC"]
        promises.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert len(reports) == 3 and all(report.ok for report, _ in reports)
    # each call's workers wait at most briefly for executor threads held by the others
    assert max(took for _, took in reports) < 2.5
    assert stub.connections <= 4
    promises.check(reports[0][0], 5)
