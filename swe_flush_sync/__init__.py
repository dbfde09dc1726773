"""swe_flush_sync: flush every agent session-server instance in parallel, within a deadline.

A blocking, thread-based twin of the training framework's async abort hook. One line in a
training script:

    from swe_flush_sync import abort
    report = abort(args)  # ids from args, servers and secret from the environment

See ``Flusher`` for a reusable flusher, ``flush`` for a one-shot call, and
``flush_on_signal`` / ``flush_at_exit`` / ``abort_async`` for the lifecycle hooks, and
``watchdog`` for a process that flushes when the trainer dies without running any Python, and
``recover`` for the ids of trainers lost with their pod or node.
"""

import logging

from ._core.auth import BearerProvider, ScopedBearer, StaticBearer
from ._core.errors import ConfigError, FlushError
from ._core.flusher import Flusher, flush
from ._core.options import DEFAULT_DEADLINE, FlushOptions
from ._core.report import FlushFailed, FlushReport, FlushResult
from ._core.resolve import resolve_bearer, resolve_instance_ids, resolve_server_urls
from ._hooks import ExitHook, SignalHook, abort, abort_async, flush_at_exit, flush_on_signal
from ._recover import recover
from ._version import __version__ as __version__
from ._watchdog.api import Watchdog, watchdog

# Every public name is bound before ``import swe_flush_sync`` returns: a signal handler that calls
# ``swe_flush_sync.abort`` never finds a module half-imported (``docs/architecture.md``, "Signal
# handlers"). The pytest plugin is the top-level ``swe_flush_sync_pytest``, which imports none of this.

__all__ = [
    "DEFAULT_DEADLINE",
    "BearerProvider",
    "ConfigError",
    "ExitHook",
    "FlushError",
    "FlushFailed",
    "FlushOptions",
    "FlushReport",
    "FlushResult",
    "Flusher",
    "ScopedBearer",
    "SignalHook",
    "StaticBearer",
    "Watchdog",
    "abort",
    "abort_async",
    "flush",
    "flush_at_exit",
    "flush_on_signal",
    "recover",
    "resolve_bearer",
    "resolve_instance_ids",
    "resolve_server_urls",
    "watchdog",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
