"""The guard is fair to every server (issue 54): the deaths of a server that never answers, or
answers slowly, never delay the flush of another server's trainer. 1.1 served every flush first
come, first served on 16 workers and 36 HTTP threads: a healthy server's death was flushed 58 s
late behind 200 deaths on a black-holed one, and 11.6 s late behind two large slow ones."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from swe_flush_sync._guard_pool import WorkPool
from swe_flush_sync.testing import AgentServerStub

from .conftest import StartGuard, wait_until
from .helpers import a_state, answer, connect, state_line

BOUND = 1.0  # seconds from a healthy server's trainer's death to its first /flush (1.1: 11.6-58 s)


class _BlackHole:
    """A server that accepts TCP connections and never answers on them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.listener.accept()[0])
            except OSError:  # shut down
                return

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self._thread.join(10)
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def black_hole() -> Iterator[_BlackHole]:
    hole = _BlackHole()
    yield hole
    hole.close()


def _dies_holding(path: str, state: dict[str, object]) -> float:
    """A trainer that hands ``state`` over, is held, and dies (its connection ends); when it died."""
    with connect(path) as peer:
        peer.sendall(state_line(state))
        assert answer(peer).startswith(b"held")
    return time.monotonic()


def _first_flush_after(stub: AgentServerStub, died: float) -> float:
    assert wait_until(lambda: stub.requests != [], 30.0), "never flushed"
    return stub.requests[0].at - died


def test_deaths_on_a_black_holed_server_never_delay_another_servers_flush(start_guard: StartGuard,
                                                                           black_hole: _BlackHole) -> None:
    guard = start_guard()
    for number in range(200):
        _dies_holding(guard.socket, a_state(urls=[black_hole.url], ids=[f"dead-{number}"], trainer=f"{number:032x}",
                                            options={"until_idle": False, "deadline": 30.0}))
    assert wait_until(lambda: len(black_hole.accepted) >= 4, 10.0)  # its flushes hold their share now
    with AgentServerStub() as healthy:
        died = _dies_holding(guard.socket, a_state(urls=[healthy.url], ids=["healthy"], trainer="f" * 32))
        assert _first_flush_after(healthy, died) < BOUND
        assert wait_until(lambda: healthy.flushed_ids() == ["healthy"], 10.0)
    assert guard.proc.poll() is None


def test_large_trainers_on_a_slow_server_never_delay_another_servers_flush(start_guard: StartGuard) -> None:
    guard = start_guard()
    with AgentServerStub(teardown=3.0) as slow, AgentServerStub() as healthy:
        for name in ("a", "b"):
            _dies_holding(guard.socket, a_state(urls=[slow.url], ids=[f"{name}-{i}" for i in range(500)],
                                                trainer=name * 32))
        assert wait_until(lambda: len(slow.requests) >= 2, 10.0)  # (its requests arrive before their teardown)
        died = _dies_holding(guard.socket, a_state(urls=[healthy.url], ids=["c"], trainer="c" * 32))
        assert _first_flush_after(healthy, died) < BOUND
        guard.proc.kill()  # its retries of the slow server's pairs would keep a drain waiting
        guard.proc.wait(10)


def test_the_pool_takes_keys_in_turn_fresh_before_due_and_within_a_share() -> None:
    """The scheduler itself: 4 workers, a share of 1 each key; a key's jobs never run two at once."""
    pool = WorkPool("test-fair", 4, lambda line: None)
    ran: list[str] = []
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    lock, gate = threading.Lock(), threading.Event()

    def job(key: str, name: str) -> None:
        with lock:
            running[key] = running.get(key, 0) + 1
            most[key] = max(most.get(key, 0), running[key])
        gate.wait(10)
        with lock:
            running[key] -= 1
            ran.append(name)

    for number in range(6):  # a key with a crowd of jobs, all waiting on the gate
        pool.submit(lambda number=number: job("crowd", f"crowd-{number}"), key="crowd")
    pool.submit(lambda: job("retry", "retry"), delay=0.01, key="retry")
    pool.submit(lambda: job("late", "late"), key="late")  # submitted last, run before the crowd's second
    assert wait_until(lambda: running.get("late") == 1 and running.get("retry") == 1, 5.0)
    assert running["crowd"] == 1
    gate.set()
    assert wait_until(lambda: len(ran) == 8 and len(pool) == 0, 10.0)
    assert most == {"crowd": 1, "retry": 1, "late": 1}
