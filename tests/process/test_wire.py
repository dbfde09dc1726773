"""The trainer-to-watchdog wire, in process and fast: the state the trainer builds, its encoding and
shape check, the line parser, the guard's check of a state, and the guard's serial worker."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swe_flush_sync import ConfigError, FlushOptions
from swe_flush_sync._guard.daemon import _SerialWorker, checked_state
from swe_flush_sync._process.wire import (
    MAX_CONTAINERS,
    MAX_IDS,
    MAX_ITEMS,
    MAX_STRINGS,
    BadLine,
    encode_state,
    parse_line,
    shape_problem,
)
from swe_flush_sync._watchdog.api import _Source

from ..conftest import wait_until

URL = "http://agent:8000"
# Any str flush() accepts: every code point, lone surrogates, quotes and backslashes included.
ANY_ID = st.text(st.characters(blacklist_categories=()), min_size=1, max_size=12)


def built(ids: list[str], *, bearer: bool = True) -> bytes:
    """The control line a trainer would write for ``ids`` (the real builder, then the framing)."""
    source = _Source({"session_server_instance_ids": ids}, {"AGENT_SERVER_URL": URL},
                     FlushOptions(bearer=(lambda instance_id: "t-" + instance_id) if bearer else None), None, "a" * 32)
    payload, pairs = source.state(lock=True, last=b"")
    assert pairs == {(URL, instance_id) for instance_id in dict.fromkeys(ids)}
    return b'{"seq": 1, "v": 2, "state": %s}' % payload


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(ANY_ID, min_size=1, max_size=20))
def test_any_id_flush_accepts_survives_the_round_trip(ids: list[str]) -> None:
    line = built(ids)
    assert b"\n" not in line and shape_problem(line) is None
    message = parse_line(line, strict=True)
    state, dropped = checked_state(message["state"])
    unique = list(dict.fromkeys(ids))
    assert state["ids"] == unique and dropped == []
    assert state["tokens"] == {instance_id: "t-" + instance_id for instance_id in unique}
    assert state["trainer"] == hashlib.sha256(b"a" * 32).hexdigest() and state["lock_fd"] is True  # kept as a digest


def test_the_largest_state_the_trainer_builds_passes_the_shape_check() -> None:
    line = built([f"id-{number}" for number in range(MAX_IDS)])  # each with a bearer: the most strings
    assert shape_problem(line) is None


def test_nothing_over_the_bounds_is_built() -> None:
    with pytest.raises(ConfigError, match=f"at most {MAX_IDS}"):
        built([f"id-{number}" for number in range(MAX_IDS + 1)], bearer=False)


@settings(max_examples=100, deadline=None)
@given(over=st.integers(1, 50))
def test_the_shape_check_refuses_what_is_over_a_bound(over: int) -> None:
    nested = b"[" * (MAX_CONTAINERS + over) + b"]" * (MAX_CONTAINERS + over)
    assert shape_problem(nested) == f"a message of more than {MAX_CONTAINERS} lists and objects"
    items = b"[" + b"0," * (MAX_ITEMS + over) + b"0]"
    assert shape_problem(items) == f"a message of more than {MAX_ITEMS} items"
    strings = b"[" + b'"",' * (MAX_STRINGS + over) + b'""]'
    assert shape_problem(strings) == f"a message of more than {MAX_STRINGS} strings"


@pytest.mark.parametrize("line", [b'{"ids": ["a\\"b"]}', b'{"ids": ["a\\\\b"]}'])
def test_the_shape_check_refuses_raw_escapes_the_encoder_never_writes(line: bytes) -> None:
    assert json.loads(line)  # valid JSON, but not protocol 2
    assert shape_problem(line) == "a message with a raw backslash escape (not protocol 2)"
    assert encode_state(json.loads(line)) != line and shape_problem(encode_state(json.loads(line))) is None


@pytest.mark.parametrize(("line", "why"), [(b"not json", "a line that is not JSON"),
                                           (b"[1, 2]", "a message that is not an object"),
                                           (b"[" * 100_000, "a line that is not JSON")])
def test_the_line_parser_says_what_is_wrong(line: bytes, why: str) -> None:
    with pytest.raises(BadLine, match=why):
        parse_line(line, strict=False)


@pytest.mark.parametrize(("state", "why"), [
    ({"urls": "x", "ids": []}, "urls must be a list of str"),
    ({"urls": [], "ids": [1]}, "ids must be a list of str"),
    ({"urls": [], "ids": [], "tokens": {"a": 1}}, "tokens must be a map of str"),
    ({"urls": [], "ids": [], "options": []}, "options must be an object"),
    ({"urls": [], "ids": [], "trainer": "A" * 32}, "trainer must be 32 lowercase hex digits"),
    ({"urls": [], "ids": [], "lock_fd": "yes"}, "lock_fd must be true or false"),
    ({"urls": [], "ids": [], "pid": 0}, "pid must be a positive integer"),
    ({"urls": [], "ids": [], "options": {"deadline": -1}}, "deadline"),
    ({"urls": ["ftp://x"], "ids": []}, "http"),
])
def test_the_guard_refuses_a_bad_state_saying_why(state: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        checked_state(state)


def test_the_guard_drops_unknown_options_and_a_lock_without_a_trainer() -> None:
    state, dropped = checked_state({"urls": [URL], "ids": ["a", "a"], "lock_fd": True,
                                    "options": {"deadline": 5, "from_the_future": 1}})
    assert state["ids"] == ["a"] and state["options"] == {"deadline": 5} and dropped == ["from_the_future"]
    assert state["lock_fd"] is False  # a trainer without a token cannot be told from another: no lock


def test_the_serial_worker_runs_in_order_once_per_waiting_key_and_drops_past_its_limit() -> None:
    gate, done = threading.Event(), []
    worker = _SerialWorker("test-serial", limit=3)
    worker.submit(gate.wait)  # holds the worker
    assert wait_until(lambda: worker._running, 5.0)
    worker.submit(lambda: done.append("first"), key="k")
    worker.submit(lambda: done.append("again"), key="k")  # the same key waits already: not queued
    worker.submit(lambda: done.append("second"))
    worker.submit(lambda: done.append("third"))
    worker.submit(lambda: done.append("over"))  # a fourth waiting job: dropped and counted
    gate.set()
    worker.drain(5.0)
    assert done == ["first", "second", "third"] and worker.dropped == 1
