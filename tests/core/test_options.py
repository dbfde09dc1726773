"""Typed options: a misspelt one is a TypeError, a wrong value names the option, and each entry
point carries the same options once."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess

import pytest

from swe_flush_sync import ConfigError, Flusher, FlushOptions, abort, abort_async
from swe_flush_sync._core.options import HookOptionKwargs, OptionKwargs, RecoverOptionKwargs
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, subprocess_env
from ..helpers import env_for

# -- typed options --------------------------------------------------------------------------------

def test_misspelt_option_is_a_type_error_at_the_call() -> None:
    with pytest.raises(TypeError):
        abort({}, dealine=10)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Flusher("http://127.0.0.1:9", max_worker=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(("option", "value"), [("max_workers", [1]), ("linger", -1), ("linger", "5"),
                                               ("retries", 1.5), ("bearer", "not-callable")])
def test_wrong_typed_option_names_it(stub: AgentServerStub, option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=option):
        Flusher(stub.url, **{option: value})  # type: ignore[arg-type]
    report = abort({"session_server_instance_id": "a"}, environ=env_for(stub), **{option: value})  # type: ignore[arg-type]
    assert option in (report.error or "") and stub.requests == []

# -- options carried once --------------------------------------------------------------------------------

def test_option_keywords_are_the_fields_of_flush_options() -> None:
    fields = {f.name for f in dataclasses.fields(FlushOptions)}
    assert OptionKwargs.__optional_keys__ == fields
    assert HookOptionKwargs.__optional_keys__ == fields - {"linger"}
    assert RecoverOptionKwargs.__optional_keys__ == fields - {"linger", "ledger"}


def test_abort_async_is_a_plain_coroutine_function_and_flush_ids_is_private() -> None:
    assert inspect.iscoroutinefunction(abort_async)
    assert not hasattr(Flusher, "flush_ids")
    assert list(inspect.signature(abort_async).parameters) == list(inspect.signature(abort).parameters)


def test_import_does_no_work_that_can_wait() -> None:
    code = """
import logging
import swe_flush_sync
names = [n for n in logging.root.manager.loggerDict if n.startswith("urllib3")]
assert all(not logging.getLogger(n).filters for n in names), names
with swe_flush_sync.Flusher("http://127.0.0.1:9") as flusher:
    flusher.warm_up()
assert logging.getLogger("urllib3.connectionpool").filters
print("OK")
"""
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.stdout.strip() == "OK", out.stderr
