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
    from ._core.auth import BearerProvider, ScopedBearer, StaticBearer
    from ._core.errors import ConfigError, FlushError
    from ._core.flusher import Flusher, flush
    from ._core.options import DEFAULT_DEADLINE, FlushOptions
    from ._core.report import FlushFailed, FlushReport, FlushResult
    from ._core.resolve import resolve_bearer, resolve_instance_ids, resolve_server_urls
    from ._hooks import ExitHook, SignalHook, abort, abort_async, flush_at_exit, flush_on_signal
    from ._recover import recover
    from ._watchdog.api import Watchdog, watchdog

_HOMES = {
    "._core.auth": ("BearerProvider", "ScopedBearer", "StaticBearer"),
    "._core.errors": ("ConfigError", "FlushError"),
    "._core.flusher": ("Flusher", "flush"),
    "._recover": ("recover",),
    "._hooks": ("ExitHook", "SignalHook", "abort", "abort_async", "flush_at_exit", "flush_on_signal"),
    "._core.options": ("DEFAULT_DEADLINE", "FlushOptions"),
    "._core.report": ("FlushFailed", "FlushReport", "FlushResult"),
    "._core.resolve": ("resolve_bearer", "resolve_instance_ids", "resolve_server_urls"),
    "._watchdog.api": ("Watchdog", "watchdog"),
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
