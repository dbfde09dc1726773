"""The exceptions of swe_flush_sync:

    Exception
    └── FlushError               root: catch this to catch everything the library raises
        ├── ConfigError          bad input (also a ValueError): ids, URLs, options, hooks
        └── FlushFailed          raised by FlushReport.raise_for_failures(); carries .report

A target that fails to flush is not an exception: it is a ``FlushResult`` with ``ok=False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._report import FlushReport


class FlushError(Exception):
    """Root of every exception raised by swe_flush_sync."""


class ConfigError(FlushError, ValueError):
    """Bad configuration or input; the message names what was wrong (never a secret)."""


class FlushFailed(FlushError):
    """Some targets failed to flush.

    Attributes:
        report: the full ``FlushReport`` of the call.
    """

    def __init__(self, message: str, report: FlushReport) -> None:
        super().__init__(message)
        self.report = report
