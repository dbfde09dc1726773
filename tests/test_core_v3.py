"""Core v3: only the sender gives a request up; a hung server never starves another; typed options."""

from __future__ import annotations

import _thread
import dataclasses
import inspect
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from swe_flush_sync import Flusher, FlushOptions, FlushReport, abort, abort_async, flush
from swe_flush_sync._options import HookOptionKwargs, OptionKwargs, RecoverOptionKwargs
from swe_flush_sync._transport import Transport
from swe_flush_sync.testing import AgentServerStub

from .conftest import PYTHON, SECRET, ours, subprocess_env


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


# -- a hung server never starves another one ---------------------------------------------------------

class HungServer:
    """Accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        for held in [*self.held, self.sock]:
            held.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer()
    yield server
    server.close()


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


# -- the transport sends through requests' own adapter -----------------------------------------------

def test_transport_has_no_short_send_and_no_request_cache() -> None:
    from swe_flush_sync._transport import _FlushAdapter

    assert "send" not in vars(_FlushAdapter)  # requests' own HTTPAdapter.send
    transport = Transport(("http://127.0.0.1:9",), FlushOptions(max_workers=1))
    try:
        first = transport.prepare("http://127.0.0.1:9", "a", "Bearer t")
        assert first is not transport.prepare("http://127.0.0.1:9", "a", "Bearer t")
        assert first.headers["Content-Length"] == str(len(first.body or b""))
        assert "Authorization" not in transport.prepare("http://127.0.0.1:9", "a", None).headers
    finally:
        transport.close()


def test_a_programming_error_in_the_library_fails_loudly(monkeypatch: pytest.MonkeyPatch,
                                                         stub: AgentServerStub) -> None:
    def broken(*args: object) -> None:
        raise AttributeError("a bug")

    monkeypatch.setattr(Transport, "prepare", broken)
    with pytest.raises(AttributeError, match="a bug"):
        flush(stub.url, ["a"], admin_secret=SECRET)
    report = abort({"session_server_instance_id": "a"}, environ={"AGENT_SERVER_URL": stub.url})
    assert report.error == "unexpected AttributeError while flushing"  # the public "never raises" boundary


# -- options carried once --------------------------------------------------------------------------------

def test_option_keywords_are_the_fields_of_flush_options() -> None:
    fields = {f.name for f in dataclasses.fields(FlushOptions)}
    assert OptionKwargs.__optional_keys__ == fields
    assert HookOptionKwargs.__optional_keys__ == fields - {"linger"}
    assert RecoverOptionKwargs.__optional_keys__ == fields - {"linger", "ledger"}


def test_abort_async_is_a_plain_coroutine_function_and_flush_ids_is_private() -> None:
    assert inspect.iscoroutinefunction(abort_async)
    assert not hasattr(Flusher, "flush_ids")
    assert list(inspect.signature(abort_async).parameters) == list(inspect.signature(abort).parameters)


def test_import_does_no_work_that_can_wait() -> None:
    code = """
import logging
import swe_flush_sync
names = [n for n in logging.root.manager.loggerDict if n.startswith("urllib3")]
assert all(not logging.getLogger(n).filters for n in names), names
with swe_flush_sync.Flusher("http://127.0.0.1:9") as flusher:
    flusher.warm_up()
assert logging.getLogger("urllib3.connectionpool").filters
print("OK")
"""
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.stdout.strip() == "OK", out.stderr
