"""The exceptions of swe_flush_sync:

    Exception
    └── FlushError               root: catch this to catch everything the library raises
        ├── ConfigError          bad input (also a ValueError): ids, URLs, options, hooks
        └── FlushFailed          raised by FlushReport.raise_for_failures(); carries .report
                                 (defined beside FlushReport, in ``report``)

A target that fails to flush is not an exception: it is a ``FlushResult`` with ``ok=False``.
"""


class FlushError(Exception):
    """Root of every exception raised by swe_flush_sync."""


class ConfigError(FlushError, ValueError):
    """Bad configuration or input; the message names what was wrong (never a secret)."""

