"""Single flight: a pair in flight is joined, never sent twice; only the call that sent a request
gives it up (a joiner's deadline or Ctrl-C never cuts it); a Ctrl-C while a pass is fed gives up what it sent."""

from __future__ import annotations

import _thread
import threading
import time
from collections import Counter

import pytest

from swe_flush_sync import Flusher, FlushReport, abort
from swe_flush_sync.testing import AgentServerStub

from ..conftest import SECRET
from ..helpers import env_for


def flush_in_thread(flusher: Flusher, ids: list[str], deadline: float) -> tuple[threading.Thread, list[FlushReport]]:
    box: list[FlushReport] = []
    thread = threading.Thread(target=lambda: box.append(flusher.flush(ids, deadline=deadline)))
    thread.start()
    return thread, box


def wait_for_connection(stub: AgentServerStub, timeout: float = 5) -> None:
    """Until the stub accepted a connection, and a little more for the request on it to arrive."""
    end = time.monotonic() + timeout
    while not stub.connections and time.monotonic() < end:
        time.sleep(0.005)
    time.sleep(0.1)


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

# -- only the call that sent a request may give it up ---------------------------------------------

def test_a_joiner_never_cancels_the_owners_queued_pair(stub: AgentServerStub) -> None:
    stub.fault("slow", latency=0.8)
    with Flusher(stub.url, admin_secret=SECRET, max_workers=1) as flusher:
        owner, owner_box = flush_in_thread(flusher, ["slow", "a"], deadline=5)
        time.sleep(0.1)  # "slow" holds the only worker; "a" is queued behind it
        joiner = flusher.flush(["a"], deadline=0.3)
        owner.join(10)
    [joined] = joiner.results
    assert not joined.ok and joined.joined and "waiting on the request an earlier call sent" in (joined.error or "")
    [report] = owner_box
    assert report.ok, report.summary()  # "a" was sent after "slow", by its owner
    assert Counter(r.instance_id for r in stub.requests) == {"slow": 1, "a": 1}


def test_a_joiner_never_cuts_the_owners_request_in_flight(stub: AgentServerStub) -> None:
    stub.teardown = 1.0
    stub.add_trials("a", 2)
    with Flusher(stub.url, admin_secret=SECRET, linger=0) as flusher:
        owner, owner_box = flush_in_thread(flusher, ["a"], deadline=5)
        wait_for_connection(stub)
        started = time.monotonic()
        joiner = flusher.flush(["a"], deadline=0.3)
        assert time.monotonic() - started < 0.6
        owner.join(10)
    [joined] = joiner.results
    assert not joined.ok and joined.joined and joined.error == \
        "deadline passed while waiting on the request an earlier call sent"
    [result] = owner_box[0].results
    assert result.ok and result.cancelled == 2 and not result.joined  # the teardown ran to its end
    assert len(stub.requests) == 1 and stub.recancels == 0


def test_ctrl_c_in_a_joiner_leaves_the_owners_request_alone(stub: AgentServerStub) -> None:
    stub.teardown = 0.6
    with Flusher(stub.url, admin_secret=SECRET) as flusher:
        owner, owner_box = flush_in_thread(flusher, ["a"], deadline=5)
        wait_for_connection(stub)
        threading.Timer(0.1, _thread.interrupt_main).start()  # Ctrl-C while the joiner waits
        with pytest.raises(KeyboardInterrupt):
            flusher.flush(["a"], deadline=5)
        owner.join(10)
    assert owner_box[0].ok and len(stub.requests) == 1


def test_ctrl_c_while_a_pass_is_fed_gives_up_what_it_sent(stub: AgentServerStub) -> None:
    """A Ctrl-C between two pairs of a pass (raised here by the third pair's bearer) gives up the
    pairs already sent: a later call sends them afresh instead of joining what was given up."""
    stub.teardown = 1.0
    asked: list[str] = []

    def bearer(instance_id: str) -> str:
        asked.append(instance_id)
        if len(asked) == 3:
            raise KeyboardInterrupt
        return SECRET

    with Flusher(stub.url, bearer=bearer, max_workers=4, linger=30) as flusher:
        with pytest.raises(KeyboardInterrupt):
            flusher.flush(["a", "b", "c", "d"], deadline=5)
        report = flusher.flush(["a", "b"], deadline=5)
    assert asked[:3] == ["a", "b", "c"]
    assert report.ok and not any(r.joined for r in report.results), report.summary()
