"""A guard's Prometheus metrics (``swe-flush guard --metrics [HOST:]PORT``), from the ``metrics`` extra.

``prometheus_client`` is imported only when metrics are asked for: a guard without them, and every
trainer, has no dependency on it. The metrics live in ``prometheus_client``'s default registry, so
the standard process metrics (CPU, memory, open descriptors) come with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from .._core.report import FlushReport

OUTCOMES: Final = ("ok", "partial", "failed")
DROP_REASONS: Final = ("bad_message", "peer_limit", "other_uid")
# Seconds from a death to the end of its flush: a teardown takes seconds, a server blip minutes.
BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
MISSING: Final = ("--metrics needs prometheus_client: pip install prometheus_client (or the package's metrics "
                  "extra: pip install '.[metrics]' in a checkout)")


def parse_address(value: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (``[::1]:PORT`` for IPv6) as (host, port); the host defaults to 127.0.0.1.

    Raises:
        ConfigError: not a port from 0 to 65535 (0: any free one).
    """
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--metrics must be [HOST:]PORT with a port from 0 to 65535, got {value!r}")
    return host, int(port)


class GuardMetrics:
    """The guard's counters and gauges; ``serve`` exposes them over HTTP at ``/metrics``."""

    def __init__(self, trainers: Callable[[], int], retrying: Callable[[], int]) -> None:
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            raise ConfigError(MISSING) from None
        self.trainers = Gauge("swe_flush_guard_trainers", "Trainers the guard holds (connections that handed a "
                                                          "state over)")
        self.trainers.set_function(trainers)
        self.flushes = Counter("swe_flush_guard_flushes", "Flush attempts for trainers that died, by outcome "
                                                          "(ok: every pair; partial: some; failed: none)", ["outcome"])
        self.pairs = Counter("swe_flush_guard_pairs", "(server, id) pairs flushed for trainers that died, by outcome",
                             ["outcome"])
        self.cancelled = Counter("swe_flush_guard_trials_cancelled", "Trials the agent servers said they cancelled "
                                                                     "for trainers that died")
        self.death_to_flush = Histogram("swe_flush_guard_death_to_flush_seconds", "Seconds from a trainer's death "
                                        "(its connection's end; for a ledger record, the recovery pass's start) "
                                        "to the end of the flush that flushed it",
                                        buckets=BUCKETS)
        self.dropped = Counter("swe_flush_guard_connections_dropped", "Connections the guard ended or refused, by "
                                                                      "reason", ["reason"])
        self.recovered = Counter("swe_flush_guard_records_recovered", "Ledger records of gone owners the guard "
                                                                      "claimed and flushed")
        self.retrying = Gauge("swe_flush_guard_retries_pending", "Flushes of dead trainers that failed and wait to "
                                                                 "be retried")
        self.retrying.set_function(retrying)
        for outcome in OUTCOMES:  # every series exists from the start, at 0: rate() and alerts see the first one
            self.flushes.labels(outcome)
        for outcome in ("ok", "failed"):
            self.pairs.labels(outcome)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)

    def flushed(self, report: FlushReport | None) -> None:
        """Count one flush attempt (None: it raised)."""
        if report is None:
            self.flushes.labels("failed").inc()
            return
        good = sum(result.ok for result in report.results)
        self.flushes.labels("ok" if report.ok else "partial" if good else "failed").inc()
        self.pairs.labels("ok").inc(good)
        self.pairs.labels("failed").inc(len(report.results) - good)
        self.cancelled.inc(report.cancelled)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; the port bound."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host)
        return int(server.server_port)
