"""The public names other code depends on, pinned."""

import swe_flush_sync
from swe_flush_sync import ConfigError, FlushError, FlushFailed

CONTRACT = {
    "resolve_instance_ids", "resolve_server_urls", "Flusher", "flush", "abort", "abort_async",
    "flush_on_signal", "flush_at_exit", "FlushReport", "FlushResult", "FlushError", "ConfigError", "FlushFailed",
    "watchdog", "recover",
}


def test_all_is_the_contract_plus_hooks() -> None:
    assert set(swe_flush_sync.__all__) == CONTRACT | {
        "DEFAULT_DEADLINE", "SignalHook", "ExitHook", "FlushOptions", "BearerProvider", "StaticBearer",
        "ScopedBearer", "resolve_bearer", "Watchdog"}
    for name in swe_flush_sync.__all__:
        assert hasattr(swe_flush_sync, name), name


def test_exception_tree() -> None:
    assert issubclass(ConfigError, FlushError) and issubclass(ConfigError, ValueError)
    assert issubclass(FlushFailed, FlushError)


def test_default_deadline_documented() -> None:
    assert swe_flush_sync.DEFAULT_DEADLINE == 10.0
    assert "10 s" in (swe_flush_sync.Flusher.__doc__ or "")


def test_library_logger_has_null_handler() -> None:
    import logging

    handlers = logging.getLogger("swe_flush_sync").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_py_typed_shipped() -> None:
    from pathlib import Path

    assert (Path(swe_flush_sync.__file__).parent / "py.typed").exists()
