"""What the library logs, and what it keeps urllib3 from logging.

Worker threads never log. urllib3 logs from inside its pool ("Starting new HTTP
connection", "Retrying (...)") on whatever thread sends; a filter on urllib3's loggers drops
every record made on a flush worker thread (the application's own urllib3 records pass). A
signal handler or exit hook goes further while it flushes: it sets ``Logger.disabled`` on
urllib3's loggers, which ``isEnabledFor`` reads before it takes any lock, so a worker never
waits for a logging lock the interrupted main thread may hold.

The calling thread logs one INFO summary and at most one WARNING per (server, cause).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Final

from .report import FlushReport
from .text import shown

log = logging.getLogger("swe_flush_sync")

WORKER_THREAD_PREFIX: Final = "swe-flush"
_IDS_SHOWN: Final = 3
_URLLIB3_LOGGER_NAMES: Final = ("urllib3", "urllib3.connectionpool", "urllib3.connection", "urllib3.response",
                                "urllib3.poolmanager", "urllib3.util.retry", "urllib3.util.ssl_")


def _not_from_a_worker(record: logging.LogRecord) -> bool:
    return not threading.current_thread().name.startswith(WORKER_THREAD_PREFIX)


_urllib3_loggers: list[logging.Logger] = []  # filled by install_urllib3_filter


def install_urllib3_filter() -> None:
    """Drop every urllib3 record made on a flush worker thread; once, when the first pool is built.

    Looking loggers up takes logging's lock, so this never runs on a signal or exit path: the
    hooks build their pool when they are installed.
    """
    if _urllib3_loggers:
        return
    names = {name for name in logging.root.manager.loggerDict.copy() if name.startswith("urllib3.")}
    loggers = [logging.getLogger(name) for name in sorted(names.union(_URLLIB3_LOGGER_NAMES))]
    for logger in loggers:
        logger.addFilter(_not_from_a_worker)
    _urllib3_loggers.extend(loggers)


@contextlib.contextmanager
def urllib3_silenced() -> Iterator[None]:
    """Disable urllib3's loggers meanwhile (lock-free for any thread that would log)."""
    saved = [(logger, logger.disabled) for logger in _urllib3_loggers]
    for logger, _ in saved:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in saved:
            logger.disabled = disabled


def logging_set_up() -> bool:
    """Does a record of the library's logger reach a handler other than a ``NullHandler``?"""
    logger: logging.Logger | None = log
    while logger is not None:
        if any(not isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def log_report(report: FlushReport) -> None:
    """One WARNING per (server, cause) with a count and a few ids, per-pair DEBUG, one INFO.

    A report whose ``error`` stopped the flush gets one WARNING saying why; an error beside
    results (ids ``recover`` set aside) is in the summary, at WARNING.
    """
    try:
        if report.error is not None and not report.results:
            log.warning("did not flush: %s", shown(report.error))
            return
        if log.isEnabledFor(logging.WARNING):
            _log_failures(report)
        if log.isEnabledFor(logging.DEBUG):
            for result in report.results:
                log.debug("%s", result)
        log.log(logging.INFO if report.error is None else logging.WARNING, "%s", report.summary())
    except Exception:  # noqa: BLE001 - a logging failure is not the trainer's
        pass


def _log_failures(report: FlushReport) -> None:
    per_server: dict[str, int] = {}
    groups: dict[tuple[str, str], list[str]] = {}
    for result in report.results:
        per_server[result.server_url] = per_server.get(result.server_url, 0) + 1
        if not result.ok:
            groups.setdefault((result.server_url, result.error or "failed"), []).append(result.instance_id)
    for (server, cause), ids in groups.items():
        listed = ", ".join(shown(instance_id, 80) for instance_id in ids[:_IDS_SHOWN])
        more = ", ..." if len(ids) > _IDS_SHOWN else ""
        log.warning("flush failed for %d of %d instances at %s: %s (%s%s)", len(ids), per_server[server],
                    shown(server), shown(cause), listed, more)
