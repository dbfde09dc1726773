"""Core v2: single flight, Ctrl-C, exit, fork, logging locks, fairness, retries that fit, typed options."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from collections import Counter

import pytest

from swe_flush_sync import ConfigError, Flusher, abort, flush
from swe_flush_sync.testing import AgentServerStub

from .conftest import PYTHON, SECRET, blocked_in, spawn, subprocess_env


def env_for(stub: AgentServerStub) -> dict[str, str]:
    return {"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET}


# -- single flight -----------------------------------------------------------------------------

def test_reflush_while_in_flight_joins_the_earlier_request(stub: AgentServerStub) -> None:
    stub.teardown = 1.0
    stub.add_trials("a", 2)
    with Flusher(stub.url, admin_secret=SECRET, linger=10) as flusher:
        first = flusher.flush(["a"], deadline=0.2)
        assert not first.ok and "left in flight" in (first.results[0].error or "")
        second = flusher.flush(["a"], deadline=3)
        result = second.results[0]
        assert result.ok and result.joined and result.cancelled == 2
        assert len(stub.requests) == 1 and stub.recancels == 0  # the teardown was never interrupted
        third = flusher.flush(["a"], deadline=3)  # the answer is in: a new request
        assert third.ok and not third.results[0].joined
    assert len(stub.requests) == 2 and stub.recancels == 0


def test_linger_zero_cuts_at_the_deadline_and_sends_again(stub: AgentServerStub) -> None:
    stub.teardown = 1.0
    with Flusher(stub.url, admin_secret=SECRET, linger=0) as flusher:
        # cut at the deadline: by the caller, or on a loaded host a moment first by the clamped read timeout
        error = flusher.flush(["a"], deadline=0.2).results[0].error or ""
        assert error in ("deadline passed while in flight", "read timed out; deadline passed before the next retry")
        flusher.flush(["a"], deadline=0.2)
    assert stub.recancels >= 1  # what linger exists to prevent


def test_per_step_aborts_shorter_than_the_teardown_send_one_flush_per_id(stub: AgentServerStub) -> None:
    stub.teardown = 1.2
    args = {"session_server_instance_ids": {8000: "a", 8001: "b"}, "session_server_instance_id": "c"}
    for _ in range(3):
        report = abort(args, environ=env_for(stub), deadline=0.2)
        assert not report.ok
    time.sleep(1.3)
    assert Counter(r.instance_id for r in stub.requests) == {"a": 1, "b": 1, "c": 1}
    assert stub.recancels == 0
    report = abort(args, environ=env_for(stub), deadline=3)  # the teardown ended: flushed again
    assert report.ok and len(stub.requests) == 6


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


# -- typed options --------------------------------------------------------------------------------

def test_misspelt_option_is_a_type_error_at_the_call() -> None:
    with pytest.raises(TypeError):
        abort({}, dealine=10)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Flusher("http://127.0.0.1:9", max_worker=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(("option", "value"), [("max_workers", [1]), ("linger", -1), ("linger", "5"),
                                               ("retries", 1.5), ("bearer", "not-callable")])
def test_wrong_typed_option_names_it(stub: AgentServerStub, option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=option):
        Flusher(stub.url, **{option: value})  # type: ignore[arg-type]
    report = abort({"session_server_instance_id": "a"}, environ=env_for(stub), **{option: value})  # type: ignore[arg-type]
    assert option in (report.error or "") and stub.requests == []


# -- real processes: Ctrl-C, exit, fork, signals under logging locks -------------------------------

def run_child(stub: AgentServerStub, body: str, **env: str) -> subprocess.Popen[str]:
    environ = subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET, **env)
    return spawn([PYTHON, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)


def wait_line(proc: subprocess.Popen[str], marker: str, timeout: float = 20) -> float:
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.strip() == marker:
            return time.monotonic()
        if not line:
            break
    proc.kill()
    raise AssertionError(f"child never printed {marker}: {proc.stderr.read() if proc.stderr else ''}")


def test_ctrl_c_during_a_long_flush_ends_the_process_at_once(stub: AgentServerStub) -> None:
    stub.fault("hung", hang=True)
    proc = run_child(stub, """
        import os, sys
        from swe_flush_sync import flush
        print("READY", flush=True)
        flush(os.environ["AGENT_SERVER_URL"], ["hung", "a"], admin_secret=os.environ["HARBOR_ADMIN_SECRET"],
              deadline=30)
    """)
    wait_line(proc, "READY")
    end = time.monotonic() + 10  # the flush is waiting on the hung id, "a" answered
    while not ({"hung", "a"} <= {r.instance_id for r in stub.requests} and "a" in stub.flushed_ids()):
        assert time.monotonic() < end, stub.requests
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    took = time.monotonic() - sent
    print(f"[timing] exited {took:.2f}s after SIGINT")
    assert "KeyboardInterrupt" in err and took <= 1.5


@pytest.mark.parametrize("fault", ["hang", "trickle"])
def test_exit_within_a_second_after_a_timed_out_flush_that_lingers(stub: AgentServerStub, fault: str) -> None:
    stub.fault("slow", hang=fault == "hang", trickle=0.2 if fault == "trickle" else None)
    proc = run_child(stub, """
        from swe_flush_sync import abort
        report = abort({"session_server_instance_ids": ["slow", "a"]}, deadline=0.5)  # linger 120 s
        assert "left in flight" in report.results[0].error, report.results[0].error
        print("DONE", flush=True)
    """)
    done = wait_line(proc, "DONE")
    proc.communicate(timeout=10)
    took = time.monotonic() - done
    print(f"[timing] exited {took:.2f}s after the call returned")
    assert proc.returncode == 0 and took <= 1.0


def test_abort_in_a_forked_child_works_and_the_parent_is_unaffected(stub: AgentServerStub) -> None:
    proc = run_child(stub, """
        import os, time
        from swe_flush_sync import abort
        args = {"session_server_instance_ids": {8000: "a", 8001: "b"}}
        assert abort(args, deadline=2).ok  # warm pool and workers in the parent
        pid = os.fork()
        if pid == 0:
            started = time.monotonic()
            report = abort({"session_server_instance_ids": ["child-1", "child-2"]}, deadline=2)
            os._exit(0 if report.ok and time.monotonic() - started < 1 else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert abort(args, deadline=2).ok
        print("OK", flush=True)
    """)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "OK" in out, err
    assert Counter(stub.flushed_ids()) == {"a": 2, "b": 2, "child-1": 1, "child-2": 1}
    child_connections = {r.connection for r in stub.requests if r.instance_id and r.instance_id.startswith("child")}
    parent_connections = {r.connection for r in stub.requests if r.instance_id in ("a", "b")}
    assert not child_connections & parent_connections  # no socket shared with the parent


LOCK_SCENARIOS = {
    "module lock held by the main thread": """
        logging._acquireLock() if hasattr(logging, "_acquireLock") else logging._lock.acquire()
    """,
    "handler lock held by the main thread at DEBUG": """
        handler.acquire()
    """,
    "handler lock held for ever by another thread": """
        import threading
        threading.Thread(target=handler.acquire, daemon=True).start()
        time.sleep(0.1)
    """,
}


@pytest.mark.parametrize("scenario", sorted(LOCK_SCENARIOS))
def test_sigterm_while_a_logging_lock_is_held(stub: AgentServerStub, scenario: str) -> None:
    ids = [f"inst-{n}" for n in range(6)]
    proc = run_child(stub, f"""
        import logging, sys, time
        from swe_flush_sync import flush_on_signal
        handler = logging.StreamHandler(sys.stderr)
        logging.root.addHandler(handler)
        logging.root.setLevel(logging.DEBUG)
        flush_on_signal({{"session_server_instance_ids": {ids!r}}}, deadline=5)
        print("READY", flush=True)
    """ + textwrap.indent(textwrap.dedent(LOCK_SCENARIOS[scenario]), "        ") + """
        time.sleep(30)
    """)
    wait_line(proc, "READY")
    time.sleep(0.3)
    blocked_in(proc.pid)  # (a scenario may keep it from its sleep: then it is signalled where it is)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    took = time.monotonic() - sent
    print(f"[timing] {scenario}: died {took:.2f}s after SIGTERM")
    assert proc.returncode == -signal.SIGTERM
    assert took <= 5 + 1.5
    assert Counter(stub.flushed_ids()) == dict.fromkeys(ids, 1)
