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


def test_the_pytest_plugin_loads_no_http_client() -> None:
    """pytest loads the plugin in every run where the package is installed: it costs the stub, not requests."""
    import subprocess
    import sys

    probe = "import sys, swe_flush_sync.pytest_plugin; print(sorted({'requests', 'urllib3'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_every_public_name_is_where_the_type_checker_sees_it() -> None:
    """The package imports its names on first use; each lazily found name is the one its module defines."""
    import importlib

    for module, names in swe_flush_sync._HOMES.items():
        for name in names:
            assert getattr(swe_flush_sync, name) is getattr(importlib.import_module(module, "swe_flush_sync"), name)
    assert set(swe_flush_sync._HOME) == set(swe_flush_sync.__all__)
