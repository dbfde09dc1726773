"""What a flush did: one ``FlushResult`` per (server, instance) pair, gathered in a ``FlushReport``."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import FlushError
from .text import shown

_SHOWN_FAILURES = 3


class FlushFailed(FlushError):
    """Some targets failed to flush.

    Attributes:
        report: the full ``FlushReport`` of the call.
    """

    def __init__(self, message: str, report: FlushReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True, slots=True)
class FlushResult:
    """The outcome of flushing one instance id on one agent server.

    Attributes:
        server_url: the agent server (never with credentials).
        instance_id: the session-server instance id flushed.
        ok: True when the server answered 2xx.
        status_code: the last HTTP status received, None if no answer came.
        cancelled: trials the server reported cancelled; None if it did not say.
        attempts: HTTP attempts actually made (0 if the pair was never sent).
        elapsed: seconds spent on this pair (one never sent: how long the call kept it waiting).
        error: why it failed, None when ok.
        joined: True when this call sent nothing for the pair but waited on a request an
            earlier call had left in flight (single flight); the answer is that request's.
        passes: requests for the pair that the server answered 2xx (with ``until_idle``, one
            per round; ``cancelled``, ``attempts`` and ``elapsed`` are summed over them).
        idle: with ``until_idle``: True when the pair's last round cancelled nothing on its
            server, False when the deadline (a pass it cut included) or the round cap stopped the
            rounds first; None without ``until_idle``, after a pass that failed before the
            deadline, or when the server's answer gives no ``cancelled`` count.
    """

    server_url: str
    instance_id: str
    ok: bool
    status_code: int | None = None
    cancelled: int | None = None
    attempts: int = 0
    elapsed: float = 0.0
    error: str | None = None
    joined: bool = False
    passes: int = 0
    idle: bool | None = None

    def __str__(self) -> str:
        outcome = f"cancelled={self.cancelled}" if self.ok else f"failed: {self.error}"
        return f"{shown(self.instance_id)} @ {shown(self.server_url)}: {outcome}"


_SLOT_SETTERS = tuple(getattr(FlushResult, field.name).__set__ for field in fields(FlushResult))


def never_sent(server_url: str, instance_ids: list[str], *, elapsed: float, error: str,
               idle: bool | None) -> list[FlushResult]:
    """``FlushResult(server_url, i, ok=False, elapsed=..., error=..., idle=...)`` of each id, equal to
    those, at under half their cost: a frozen dataclass's ``__init__`` calls ``object.__setattr__``
    once a field, and a call stopped at its deadline reports up to 100,000 pairs never sent within it.
    (A field added to ``FlushResult`` fails the unpacking below at import, and is added here.)"""
    (set_url, set_id, set_ok, set_status, set_cancelled, set_attempts, set_elapsed, set_error, set_joined,
     set_passes, set_idle) = _SLOT_SETTERS
    made = []
    for instance_id in instance_ids:
        result = object.__new__(FlushResult)
        set_url(result, server_url)
        set_id(result, instance_id)
        set_ok(result, False)
        set_status(result, None)
        set_cancelled(result, None)
        set_attempts(result, 0)
        set_elapsed(result, elapsed)
        set_error(result, error)
        set_joined(result, False)
        set_passes(result, 0)
        set_idle(result, idle)
        made.append(result)
    return made


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a call builds its results against its deadline, as
    ``timeit`` pauses it (its full passes over a trainer's heap cost 0.1-0.6 s of a 100,000-pair
    report under load, unforeseeably); it runs after. One already paused (by the trainer, or by the
    call a signal handler's call interrupted) is left so."""
    pausing = gc.isenabled()
    if pausing:
        gc.disable()
    try:
        yield
    finally:
        if pausing:
            gc.enable()


@dataclass(frozen=True, slots=True)
class FlushReport:
    """Everything one flush call did.

    Attributes:
        results: one ``FlushResult`` per (url, id) pair, URL-major in the order given
            (requests go out interleaved across servers; the report keeps this order).
        elapsed: wall seconds the call took.
        error: a problem that stopped the flush before any pair ran (bad configuration in
            ``abort``), or that ``recover`` met beside its results (ids set aside), else None.
        left_alone: ``recover``'s records it did not flush, each ``"NAME: why"`` (alive, its
            watchdog flushing it, a server not given, not trusted); only the last two are errors.

    Examples:
        ```python
        report = FlushReport(results=(), elapsed=0.0)
        report.ok, report.cancelled
        # (True, 0)
        ```
    """

    results: tuple[FlushResult, ...] = ()
    elapsed: float = 0.0
    error: str | None = None
    left_alone: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every pair flushed and there was no error (also when there was nothing to do)."""
        return self.error is None and all(result.ok for result in self.results)

    @property
    def failed(self) -> tuple[FlushResult, ...]:
        """The results that did not flush."""
        return tuple(result for result in self.results if not result.ok)

    @property
    def cancelled(self) -> int:
        """Total trials the servers reported cancelled."""
        return sum(result.cancelled or 0 for result in self.results)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the report, with its derived fields."""
        return {
            "ok": self.ok,
            "elapsed": self.elapsed,
            "cancelled": self.cancelled,
            "error": self.error,
            "results": [asdict(result) for result in self.results],
            "left_alone": list(self.left_alone),
        }

    def raise_for_failures(self) -> None:
        """Raise ``FlushFailed`` (carrying this report) unless ``ok``."""
        if self.ok:
            return
        raise FlushFailed(self.summary(), self)

    def summary(self) -> str:
        """One line: what was flushed, what failed and why (first few)."""
        if self.error is not None and not self.results:
            return f"flush not run: {shown(self.error)}" + self._left_alone_said()
        failed = self.failed
        line = (
            f"flushed {len(self.results) - len(failed)}/{len(self.results)} targets "
            f"in {self.elapsed:.2f}s, {self.cancelled} trials cancelled"
        )
        counted = [result.idle for result in self.results if result.idle is not None]
        if counted:  # until_idle
            passes = sum(result.passes for result in self.results)
            line += f" in {passes} pass{'' if passes == 1 else 'es'}, {sum(counted)}/{len(counted)} idle"
        if failed:
            listed = "; ".join(str(result) for result in failed[:_SHOWN_FAILURES])
            more = f"; and {len(failed) - _SHOWN_FAILURES} more" if len(failed) > _SHOWN_FAILURES else ""
            line += f"; {len(failed)} failed: {listed}{more}"
        if self.error is not None:
            line += f"; {shown(self.error)}"
        return line + self._left_alone_said()

    def _left_alone_said(self) -> str:
        if not self.left_alone:
            return ""
        more = f"; and {len(self.left_alone) - _SHOWN_FAILURES} more" if len(self.left_alone) > _SHOWN_FAILURES else ""
        return (f"; left {len(self.left_alone)} record(s) alone: "
                + "; ".join(shown(why) for why in self.left_alone[:_SHOWN_FAILURES]) + more)
