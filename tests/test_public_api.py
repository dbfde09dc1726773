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
    """pytest loads the plugin in every run where the package is installed: it costs nothing of the package."""
    import subprocess
    import sys

    probe = ("import sys, importlib.metadata as m; [plugin] = [e for e in m.entry_points(group='pytest11') "
             "if e.name == 'swe_flush_sync']; plugin.load(); "
             "print(sorted({'requests', 'urllib3', 'swe_flush_sync'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_every_public_name_is_bound_when_the_import_returns() -> None:
    """A signal handler may call any public name at any instant: none is imported on first use (issue 62)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import swe_flush_sync as s; "
                          "print(sorted(n for n in s.__all__ if n not in vars(s)), '__getattr__' in vars(s))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "False"], out


def test_the_guards_parser_process_runs_without_the_package() -> None:
    """The guard's parser child parses lines with the standard library alone: no requests, no package __init__."""
    import subprocess
    import sys

    from swe_flush_sync._guard.parser import _CHILD_CODE

    looked = "; print(sorted({'requests', 'urllib3', 'swe_flush_sync'} & set(sys.modules)))"
    probe = _CHILD_CODE.replace(".main()", looked)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, input="")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
