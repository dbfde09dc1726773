"""End-to-end: the flush over real loopback sockets against the stub agent server."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from swe_flush_sync import Flusher, FlushFailed, abort, flush, recover
from swe_flush_sync._core import transport
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, ours, subprocess_env, wait_no_library_threads, wait_threads_gone, wait_until
from ..helpers import env_for, write_record


def test_abort_flushes_plural_and_singular_once_with_bearer(stub: AgentServerStub) -> None:
    for instance_id, trials in (("a", 2), ("b", 3), ("c", 1)):
        stub.add_trials(instance_id, trials)
    args = argparse.Namespace(session_server_instance_ids={8000: "a", 8001: "b"}, session_server_instance_id="c")
    report = abort(args, environ=env_for(stub))
    assert report.ok and report.cancelled == 6
    assert sorted(stub.flushed_ids()) == ["a", "b", "c"]
    assert {r.authorization for r in stub.requests} == {f"Bearer {SECRET}"}
    assert all(stub.trials(i) == 0 for i in "abc")


def test_two_servers_three_ids_six_results(stub_factory) -> None:  # type: ignore[no-untyped-def]
    one, two = stub_factory(secret=SECRET), stub_factory(secret=SECRET)
    report = flush([one.url, two.url], ["x", "y", "z"], admin_secret=SECRET)
    assert len(report.results) == 6 and report.ok
    assert [(r.server_url, r.instance_id) for r in report.results] == [
        (s.url, i) for s in (one, two) for i in "xyz"]
    assert sorted(one.flushed_ids()) == sorted(two.flushed_ids()) == ["x", "y", "z"]


def test_eight_ids_flush_in_parallel(stub_factory) -> None:  # type: ignore[no-untyped-def]
    server = stub_factory(secret=SECRET, teardown=0.5)
    ids = [f"i{n}" for n in range(8)]
    report = flush(server.url, ids, admin_secret=SECRET)
    assert report.ok and len(report.results) == 8
    assert report.elapsed < 2.0, report.elapsed  # one by one: 8 x 0.5 = 4 s
    assert sum(r.elapsed for r in report.results) >= 8 * 0.5


def test_hung_id_fails_at_deadline_others_ok(stub: AgentServerStub) -> None:
    stub.fault("hung", hang=True)
    started = time.monotonic()
    report = flush(stub.url, ["a", "hung", "b"], admin_secret=SECRET, deadline=2)
    took = time.monotonic() - started
    assert 1.9 <= took < 2.5, took
    by_id = {r.instance_id: r for r in report.results}
    assert by_id["a"].ok and by_id["b"].ok
    assert not by_id["hung"].ok and "deadline passed" in (by_id["hung"].error or "")
    assert by_id["hung"].attempts == 1
    assert wait_no_library_threads() == []


def test_503_503_200_real_retries(stub: AgentServerStub) -> None:
    stub.fault("r", statuses=[503, 503])
    [result] = flush(stub.url, ["r"], admin_secret=SECRET).results
    assert (result.ok, result.attempts, result.status_code) == (True, 3, 200)
    assert [r.status for r in stub.requests] == [503, 503, 200]


def test_503_forever_exhausts_retries(stub: AgentServerStub) -> None:
    stub.fault("r", statuses=[503] * 10)
    [result] = flush(stub.url, ["r"], admin_secret=SECRET, retries=2, backoff_factor=0.01).results
    assert (result.ok, result.attempts, result.status_code) == (False, 3, 503)
    assert len(stub.requests) == 3


def test_429_retry_after_is_honoured(stub: AgentServerStub) -> None:
    stub.fault("r", statuses=[429], retry_after=1)
    [result] = flush(stub.url, ["r"], admin_secret=SECRET, deadline=5).results
    first, second = stub.requests
    assert result.ok and result.attempts == 2
    assert 0.9 <= second.at - first.at < 2.0


def test_retry_after_past_deadline_fails_at_once(stub: AgentServerStub) -> None:
    stub.fault("r", statuses=[429], retry_after=30)
    started = time.monotonic()
    [result] = flush(stub.url, ["r"], admin_secret=SECRET, deadline=3).results
    assert time.monotonic() - started < 1.0
    assert result.status_code == 429 and not result.ok and result.attempts == 1
    assert "Retry-After: 30 reaches past the deadline" in (result.error or "")
    assert len(stub.requests) == 1


@pytest.mark.parametrize("status", [401, 404, 422])
def test_no_retry_on_client_errors(stub: AgentServerStub, status: int) -> None:
    stub.fault("r", statuses=[status] * 5)
    [result] = flush(stub.url, ["r"], admin_secret=SECRET).results
    assert (result.ok, result.status_code, result.attempts) == (False, status, 1)
    assert len(stub.requests) == 1


def test_wrong_secret_is_401_not_retried(stub: AgentServerStub) -> None:
    [result] = flush(stub.url, ["r"], admin_secret="wrong").results
    assert result.status_code == 401 and "bearer" in (result.error or "")
    assert len(stub.requests) == 1


def test_wrong_path_prefix_is_404(stub: AgentServerStub) -> None:
    [result] = flush(stub.url + "/nope", ["r"], admin_secret=SECRET).results
    assert result.status_code == 404 and "no /flush endpoint" in (result.error or "")


def test_secret_never_in_logs_repr_or_report(stub: AgentServerStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    stub.fault("bad", statuses=[401])
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        report = flusher.flush(["ok", "bad"])
        shown = repr(flusher)
    with pytest.raises(FlushFailed) as info:
        report.raise_for_failures()
    texts = [caplog.text, shown, repr(report), json.dumps(report.to_dict()), str(info.value), report.summary()]
    assert not any(SECRET in text for text in texts)
    assert info.value.report is report


def test_logging_one_info_and_one_warning_per_failure_from_caller(stub: AgentServerStub,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swe_flush_sync")
    stub.fault("f1", statuses=[404])
    stub.fault("f2", statuses=[422])
    flush(stub.url, ["ok", "f1", "f2"], admin_secret=SECRET)
    ours_records = [r for r in caplog.records if r.name.startswith("swe_flush_sync")]
    assert [r.levelname for r in ours_records].count("WARNING") == 2
    assert [r.levelname for r in ours_records].count("INFO") == 1
    assert {r.threadName for r in ours_records} == {threading.current_thread().name}
    assert "flushed 1/3 targets" in caplog.text


def test_no_library_thread_left_after_flush(stub: AgentServerStub) -> None:
    before = set(threading.enumerate())
    flush(stub.url, [f"i{n}" for n in range(16)], admin_secret=SECRET)
    # library workers, and the stub's per-connection threads (they end when the pool closes)
    assert wait_threads_gone(lambda: [t for t in threading.enumerate() if t not in before], 1.0) == []


def test_no_connection_pool_full_warning(stub: AgentServerStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        for _ in range(3):
            assert flusher.flush([f"i{n}" for n in range(64)]).ok
    assert "Connection pool is full" not in caplog.text


def test_reused_flusher_opens_no_new_connections(stub: AgentServerStub) -> None:
    stub.teardown = 0.05  # as a real flush: every pair in flight at once
    ids = [f"i{n}" for n in range(8)]
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        for _ in range(2):  # warm-up: a first call may open up to one connection per pair
            assert flusher.flush(ids).ok
        warm = stub.connections
        assert 1 <= warm <= 8
        for _ in range(20):
            assert flusher.flush(ids).ok
    assert len(stub.requests) == 22 * 8 and stub.connections == warm  # kept alive, never discarded


def test_abort_reuses_its_flusher_across_steps(stub: AgentServerStub) -> None:
    args = {"session_server_instance_ids": {1: "a", 2: "b"}}
    for _ in range(4):
        assert abort(args, environ=env_for(stub)).ok
    assert len(stub.requests) == 8 and stub.connections <= 2  # one warm pool across steps


def test_abort_nothing_to_do(stub: AgentServerStub) -> None:
    assert abort({"session_server_instance_ids": None}, environ={}).ok  # no ids, no server: nothing to do
    unsent = abort({"session_server_instance_ids": {1: "a"}}, environ={})  # ids, no server: never ok
    assert not unsent.ok and unsent.results == () and "AGENT_SERVER_URL" in (unsent.error or "")
    report = abort({"session_server_instance_ids": None, "session_server_instance_id": None}, environ=env_for(stub))
    assert report.ok and report.results == () and report.error is None
    assert stub.requests == []


def test_abort_never_raises_on_bad_config(stub: AgentServerStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swe_flush_sync")
    report = abort({"session_server_instance_id": 5}, environ=env_for(stub))
    assert not report.ok and "session_server_instance_id is an int (5), not a str" in (report.failed[0].error or "")
    report = abort({"session_server_instance_id": "a"}, environ={"AGENT_SERVER_URL": "http://u:pw@h:1"})
    assert "***@" in (report.error or "") and "pw" not in (report.error or "")
    report = abort({"session_server_instance_id": "a"}, environ=env_for(stub), deadline=-1)
    assert "deadline" in (report.error or "")
    report = abort({"session_server_instance_id": "a"}, environ=env_for(stub), max_workers=[1])  # type: ignore[arg-type]
    assert report.error == "max_workers must be an int, not list"
    assert caplog.text.count("did not flush: ") == 3 and caplog.text.count("not a str: not flushed") == 1
    assert stub.requests == []


def test_close_during_flush_returns_promptly(stub: AgentServerStub) -> None:
    stub.fault("hung", hang=True)
    flusher = Flusher(stub.url, admin_secret=SECRET, deadline=10)
    closed_at: list[float] = []

    def answered(instance_id: str) -> bool:
        pending = flusher._inflight.get((stub.url, instance_id))
        return pending is not None and pending.future.done()

    def close_once_hung_arrived_and_ok_answered() -> None:  # (a timer could fire before a loaded host sent them)
        wait_until(lambda: "hung" in {r.instance_id for r in stub.requests} and answered("ok"), timeout=20)
        closed_at.append(time.monotonic())
        flusher.close()

    threading.Thread(target=close_once_hung_arrived_and_ok_answered, daemon=True).start()
    report = flusher.flush(["hung", "ok"])
    assert closed_at and time.monotonic() - closed_at[0] < 1.5
    by_id = {r.instance_id: r for r in report.results}
    assert by_id["ok"].ok and "the Flusher was closed" in (by_id["hung"].error or "")
    assert wait_no_library_threads() == []


def test_close_while_a_request_connects_returns_promptly(stub: AgentServerStub,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A close that lands while a worker connects, before its socket exists, shuts the socket as
    soon as it is made: a worker preempted there on a loaded host kept its request, and the call
    waiting on it, for the whole deadline."""
    stub.fault("hung", hang=True)
    connecting, closed = threading.Event(), threading.Event()
    new_conn = transport._TrackedHTTPConnection._new_conn

    def slow_new_conn(self: transport._TrackedHTTPConnection) -> object:
        connecting.set()
        closed.wait(5)  # the worker is preempted here, and the Flusher closed meanwhile
        return new_conn(self)

    monkeypatch.setattr(transport._TrackedHTTPConnection, "_new_conn", slow_new_conn)
    flusher = Flusher(stub.url, admin_secret=SECRET, deadline=10)

    def close_while_connecting() -> None:
        connecting.wait(5)
        flusher.close()
        closed.set()

    threading.Thread(target=close_while_connecting, daemon=True).start()
    started = time.monotonic()
    report = flusher.flush(["hung"])
    assert time.monotonic() - started < 2.0
    assert closed.is_set() and "the Flusher was closed" in (report.results[0].error or ""), report.results
    assert wait_no_library_threads() == []


@pytest.mark.parametrize("fault", ["hang", "trickle"])
def test_script_exits_soon_after_the_call_returns(stub: AgentServerStub, fault: str) -> None:
    stub.fault("slow", hang=fault == "hang", trickle=1.0 if fault == "trickle" else None)
    script = textwrap.dedent(f"""
        import time, sys
        from swe_flush_sync import flush
        report = flush({stub.url!r}, ["slow", "fine"], admin_secret={SECRET!r}, deadline=1.5)
        print(time.monotonic(), report.results[0].error, report.results[1].ok, flush=True)
    """)
    proc = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=30, env=subprocess_env())
    ended = time.monotonic()
    returned_at, *rest = proc.stdout.split(" ", 1)
    assert proc.returncode == 0, proc.stderr
    assert "deadline passed" in rest[0] and rest[0].strip().endswith("True")
    assert ended - float(returned_at) < 1.0, ended - float(returned_at)


def test_ours_helper_sees_workers(stub: AgentServerStub) -> None:
    stub.fault("hung", hang=True)
    flusher = Flusher(stub.url, admin_secret=SECRET)
    done = threading.Event()
    threading.Thread(target=lambda: (flusher.flush(["hung"], deadline=1), done.set())).start()
    time.sleep(0.3)
    assert ours() != []  # the thread accounting above is not vacuous
    done.wait(3)
    flusher.close()
    assert wait_no_library_threads() == []


@pytest.mark.parametrize("entry", ["flush", "Flusher", "abort", "flush_at_exit", "recover", "cli"])
def test_one_bearer_rule_in_every_entry_point(stub: AgentServerStub, entry: str, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Issue 55: 1.1's ``flush()`` and ``Flusher()`` ignored ``HARBOR_ADMIN_SECRET`` (HTTP 401) while the docs,
    ``abort``, the hooks, ``watchdog`` and the CLI read it. An argument wins over the environment."""
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", SECRET)
    monkeypatch.setenv("AGENT_SERVER_URL", stub.url)
    args = {"session_server_instance_id": f"{entry}-1"}
    if entry == "flush":
        report = flush(stub.url, [f"{entry}-1"])
    elif entry == "Flusher":
        with Flusher(stub.url) as flusher:
            report = flusher.flush([f"{entry}-1"])
    elif entry == "abort":
        report = abort(args)
    elif entry == "recover":
        write_record(tmp_path, "gone", [f"{entry}-1"], stub.url)
        report = recover(str(tmp_path))
    else:  # a process of its own: the exit hook at a real exit, the command line
        code = (f"from swe_flush_sync import flush_at_exit; flush_at_exit({args!r})" if entry == "flush_at_exit"
                else f"from swe_flush_sync._cli.main import main; raise SystemExit(main(['--id', '{entry}-1']))")
        out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                             env=subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET))
        assert out.returncode == 0, out.stderr
        report = None
    assert report is None or report.ok, report
    assert stub.flushed_ids() == [f"{entry}-1"]
    if entry in ("flush", "Flusher"):  # an argument wins over the environment
        wrong = flush(stub.url, ["wrong"], admin_secret="not-" + SECRET)
        assert not wrong.ok and wrong.results[0].status_code == 401


def test_an_id_that_is_not_a_str_fails_alone(stub: AgentServerStub) -> None:
    """1.2.0 raised for the call and flushed neither; recover already set bad ids aside."""
    args = {"session_server_instance_ids": {"8001": "good-1", "8002": 12345}, "session_server_instance_id": "good-2"}
    report = abort(args, environ={"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET})
    assert sorted(stub.flushed_ids()) == ["good-1", "good-2"] and not report.ok
    [bad] = report.failed
    assert bad.instance_id == "12345" and bad.error == (
        "session_server_instance_ids['8002'] is an int (12345), not a str: not flushed"), bad
