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

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # imported on first use (PEP 562): a pytest run that only loads the plugin pays nothing
    from ._auth import BearerProvider, ScopedBearer, StaticBearer
    from ._errors import ConfigError, FlushError, FlushFailed
    from ._flusher import Flusher, flush
    from ._ledger import recover
    from ._lifecycle import ExitHook, SignalHook, abort, abort_async, flush_at_exit, flush_on_signal
    from ._options import DEFAULT_DEADLINE, FlushOptions
    from ._report import FlushReport, FlushResult
    from ._resolve import resolve_bearer, resolve_instance_ids, resolve_server_urls
    from ._watchdog import Watchdog, watchdog

_HOMES = {
    "._auth": ("BearerProvider", "ScopedBearer", "StaticBearer"),
    "._errors": ("ConfigError", "FlushError", "FlushFailed"),
    "._flusher": ("Flusher", "flush"),
    "._ledger": ("recover",),
    "._lifecycle": ("ExitHook", "SignalHook", "abort", "abort_async", "flush_at_exit", "flush_on_signal"),
    "._options": ("DEFAULT_DEADLINE", "FlushOptions"),
    "._report": ("FlushReport", "FlushResult"),
    "._resolve": ("resolve_bearer", "resolve_instance_ids", "resolve_server_urls"),
    "._watchdog": ("Watchdog", "watchdog"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


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
