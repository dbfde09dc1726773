"""Every fault case checks the same four promises; this fixture holds them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from swe_flush_sync import FlushReport
from swe_flush_sync._hooks import _close_cached_flushers

from ..conftest import wait_no_library_threads


class Promises:
    """Call ``check(report, deadline)`` after each flush; the fixture checks the rest at teardown."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def start(self) -> None:
        self.started = time.monotonic()

    def check(self, report: FlushReport, deadline: float) -> None:
        took = time.monotonic() - self.started
        assert took < deadline + 0.5, f"took {took:.2f}s for a {deadline}s deadline"
        assert len(report.results) > 0


@pytest.fixture
def promises(capsys: pytest.CaptureFixture[str]) -> Iterator[Promises]:
    promise = Promises()
    yield promise
    _close_cached_flushers()  # abort()'s warm Flushers keep idle workers by design
    assert wait_no_library_threads(1.0) == [], "a library thread outlived the call"
    assert capsys.readouterr().err == "", "the library wrote to stderr"
