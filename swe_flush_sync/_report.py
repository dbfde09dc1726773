"""What a flush did: one ``FlushResult`` per (server, instance) pair, gathered in a ``FlushReport``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._errors import FlushFailed
from ._text import shown

_SHOWN_FAILURES = 3


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


@dataclass(frozen=True, slots=True)
class FlushReport:
    """Everything one flush call did.

    Attributes:
        results: one ``FlushResult`` per (url, id) pair, URL-major in the order given
            (requests go out interleaved across servers; the report keeps this order).
        elapsed: wall seconds the call took.
        error: a problem that stopped the flush before any pair ran (bad configuration in
            ``abort``), or that ``recover`` met beside its results (ids set aside), else None.

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
        }

    def raise_for_failures(self) -> None:
        """Raise ``FlushFailed`` (carrying this report) unless ``ok``."""
        if self.ok:
            return
        raise FlushFailed(self.summary(), self)

    def summary(self) -> str:
        """One line: what was flushed, what failed and why (first few)."""
        if self.error is not None and not self.results:
            return f"flush not run: {shown(self.error)}"
        failed = self.failed
        line = (
            f"flushed {len(self.results) - len(failed)}/{len(self.results)} targets "
            f"in {self.elapsed:.2f}s, {self.cancelled} trials cancelled"
        )
        counted = [result.idle for result in self.results if result.idle is not None]
        if counted:  # until_idle
            passes = sum(result.passes for result in self.results)
            line += f" in {passes} passes, {sum(counted)}/{len(counted)} idle"
        if failed:
            listed = "; ".join(str(result) for result in failed[:_SHOWN_FAILURES])
            more = f"; and {len(failed) - _SHOWN_FAILURES} more" if len(failed) > _SHOWN_FAILURES else ""
            line += f"; {len(failed)} failed: {listed}{more}"
        if self.error is not None:
            line += f"; {shown(self.error)}"
        return line
