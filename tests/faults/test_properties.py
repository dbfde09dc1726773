"""Property-based tests (hypothesis) of id resolution and URL parsing."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from swe_flush_sync import ConfigError, resolve_instance_ids, resolve_server_urls
from swe_flush_sync._core.resolve import redact_url

ids = st.one_of(st.none(), st.just(""), st.text(min_size=1, max_size=8))
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
ports = st.integers(min_value=1, max_value=65535)
segments = st.lists(st.from_regex(r"[a-zA-Z0-9_.-]{1,6}", fullmatch=True), max_size=3)


def dedupe(values: list[str | None]) -> tuple[str, ...]:
    seen: list[str] = []
    for value in values:
        if value and value not in seen:
            seen.append(value)
    return tuple(seen)


@settings(max_examples=300, deadline=None)
@given(plural=st.dictionaries(st.integers(0, 65535), ids, max_size=12), singular=ids)
def test_ids_are_plural_values_then_singular_deduplicated(plural: dict[int, str | None], singular: str | None) -> None:
    args = argparse.Namespace(session_server_instance_ids=plural, session_server_instance_id=singular)
    assert resolve_instance_ids(args) == dedupe([*plural.values(), singular])


@settings(max_examples=300, deadline=None)
@given(plural=st.lists(ids, max_size=12))
def test_iterable_plural_keeps_first_seen_order(plural: list[str | None]) -> None:
    result = resolve_instance_ids({"session_server_instance_ids": plural})
    assert result == dedupe(plural)
    assert len(set(result)) == len(result) and "" not in result


@settings(max_examples=200, deadline=None)
@given(plural=st.lists(st.one_of(st.integers(), st.binary(min_size=1), st.floats()), min_size=1, max_size=4))
def test_non_str_ids_always_config_error(plural: list[object]) -> None:
    with pytest.raises(ConfigError):
        resolve_instance_ids({"session_server_instance_ids": ["ok", *plural]})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["http", "https"]), hosts, ports, segments, st.integers(0, 3)),
                min_size=1, max_size=5), st.sampled_from([",", " , ", ",  "]))
def test_url_lists_normalise(parts: list[tuple[str, str, int, list[str], int]], separator: str) -> None:
    raw, expected = [], []
    for scheme, host, port, path, slashes in parts:
        base = f"{scheme}://{host}:{port}" + "".join("/" + p for p in path)
        raw.append(base + "/" * slashes)
        if base not in expected:
            expected.append(base)
    assert resolve_server_urls({"AGENT_SERVER_URL": separator.join(raw)}) == tuple(expected)


@settings(max_examples=300, deadline=None)
@given(user=st.from_regex(r"[a-z]{1,8}", fullmatch=True), password=st.from_regex(r"[A-Za-z0-9]{6,12}", fullmatch=True),
       host=hosts, port=ports)
def test_userinfo_never_shown(user: str, password: str, host: str, port: int) -> None:
    assume(password not in f"{host}:{port}/x")
    url = f"http://{user}:{password}@{host}:{port}/x"
    assert password not in redact_url(url)
    with pytest.raises(ConfigError) as info:
        resolve_server_urls({"AGENT_SERVER_URL": url})
    assert password not in str(info.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_any_text_either_parses_or_config_error(text: str) -> None:
    try:
        urls = resolve_server_urls({"SWE_AGENT_URL": text})
    except ConfigError as exc:
        assert str(exc).startswith("SWE_AGENT_URL: ")
    else:
        assert all(u.startswith(("http://", "https://")) and not u.endswith("/") for u in urls)
