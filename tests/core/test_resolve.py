"""Unit tests: instance ids from trainer args, server URLs and secret from the environment."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from swe_flush_sync import (
    ConfigError,
    ScopedBearer,
    StaticBearer,
    resolve_bearer,
    resolve_instance_ids,
    resolve_server_urls,
)
from swe_flush_sync._core.resolve import normalize_server_urls, redact_url


def ns(**fields: object) -> argparse.Namespace:
    return argparse.Namespace(**fields)


class TestInstanceIds:
    def test_plural_map_values_then_singular_deduplicated(self) -> None:
        args = ns(session_server_instance_ids={8001: "b", 8000: "a", 8002: "b"}, session_server_instance_id="c")
        assert resolve_instance_ids(args) == ("b", "a", "c")

    def test_singular_already_in_plural_counted_once(self) -> None:
        args = ns(session_server_instance_ids={1: "a", 2: "b"}, session_server_instance_id="a")
        assert resolve_instance_ids(args) == ("a", "b")

    def test_only_singular(self) -> None:
        assert resolve_instance_ids(ns(session_server_instance_id="x")) == ("x",)

    def test_only_plural(self) -> None:
        assert resolve_instance_ids(ns(session_server_instance_ids={1: "x"})) == ("x",)

    @pytest.mark.parametrize("plural", [["a", "b", "a"], ("a", "b"), iter(["a", "b"])])
    def test_plural_iterables(self, plural: object) -> None:
        assert resolve_instance_ids(ns(session_server_instance_ids=plural)) == ("a", "b")

    def test_plural_generator(self) -> None:
        def gen() -> Iterator[str]:
            yield "g1"
            yield "g2"

        assert resolve_instance_ids(ns(session_server_instance_ids=gen())) == ("g1", "g2")

    def test_plural_set(self) -> None:
        assert sorted(resolve_instance_ids(ns(session_server_instance_ids={"a", "b"}))) == ["a", "b"]

    def test_none_and_empty_skipped(self) -> None:
        args = ns(session_server_instance_ids={1: None, 2: "", 3: "a"}, session_server_instance_id="")
        assert resolve_instance_ids(args) == ("a",)

    def test_both_none_is_empty(self) -> None:
        assert resolve_instance_ids(ns(session_server_instance_ids=None, session_server_instance_id=None)) == ()

    def test_mapping_args(self) -> None:
        args = {"session_server_instance_ids": {1: "m1"}, "session_server_instance_id": "m2"}
        assert resolve_instance_ids(args) == ("m1", "m2")

    def test_simple_namespace(self) -> None:
        assert resolve_instance_ids(SimpleNamespace(session_server_instance_id="s")) == ("s",)

    def test_missing_both_names_is_config_error(self) -> None:
        with pytest.raises(ConfigError, match="neither 'session_server_instance_ids' nor"):
            resolve_instance_ids(ns(other=1))

    @pytest.mark.parametrize("bad", [1, b"a", 2.5, object()])
    def test_non_str_id_in_plural(self, bad: object) -> None:
        with pytest.raises(ConfigError, match=r"session_server_instance_ids holds an id of type .*; ids must be str"):
            resolve_instance_ids(ns(session_server_instance_ids=["ok", bad]))

    def test_singular_int(self) -> None:
        with pytest.raises(ConfigError, match=r"session_server_instance_id holds an id of type int \(7\)"):
            resolve_instance_ids(ns(session_server_instance_id=7))

    @pytest.mark.parametrize("plural", ["abc", b"abc", 5])
    def test_plural_of_wrong_type(self, plural: object) -> None:
        with pytest.raises(ConfigError, match="must be a mapping of port -> id or an iterable"):
            resolve_instance_ids(ns(session_server_instance_ids=plural))

    def test_attribute_access_that_raises(self) -> None:
        class Args:
            @property
            def session_server_instance_ids(self) -> object:
                raise RuntimeError("boom")

        with pytest.raises(ConfigError, match="reading 'session_server_instance_ids' from args raised RuntimeError"):
            resolve_instance_ids(Args())

    def test_config_error_is_value_error(self) -> None:
        with pytest.raises(ValueError):
            resolve_instance_ids(ns(session_server_instance_id=1))


class TestServerUrls:
    def test_unset_is_empty(self) -> None:
        assert resolve_server_urls({}) == ()

    @pytest.mark.parametrize("blank", ["", "   ", "\t"])
    def test_blank_counts_as_unset_and_falls_back(self, blank: str) -> None:
        assert resolve_server_urls({"AGENT_SERVER_URL": blank}) == ()
        env = {"AGENT_SERVER_URL": blank, "SWE_AGENT_URL": "http://b:1"}
        assert resolve_server_urls(env) == ("http://b:1",)

    def test_primary_wins(self) -> None:
        env = {"AGENT_SERVER_URL": "http://a:1", "SWE_AGENT_URL": "http://b:1"}
        assert resolve_server_urls(env) == ("http://a:1",)

    def test_comma_list_stripped_dedup_trailing_slash(self) -> None:
        env = {"AGENT_SERVER_URL": " http://a:1/ ,http://b:2//, http://a:1,,"}
        assert resolve_server_urls(env) == ("http://a:1", "http://b:2")

    def test_path_prefix_kept(self) -> None:
        assert resolve_server_urls({"AGENT_SERVER_URL": "https://gw.example/harbor/"}) == ("https://gw.example/harbor",)

    def test_ipv6_literal(self) -> None:
        assert resolve_server_urls({"AGENT_SERVER_URL": "http://[::1]:8000"}) == ("http://[::1]:8000",)

    def test_reads_os_environ_by_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SWE_AGENT_URL", "http://env:9")
        assert resolve_server_urls() == ("http://env:9",)

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            ("agent:8000", "must start with http:// or https://"),
            ("ftp://agent", "must start with http:// or https://"),
            ("http://", "has no host"),
            ("http:///path", "has no host"),
            ("http://a b:1", "white space"),
            ("http://a:99999", "not a valid URL"),
            ("http://a:1/?x=1", "query or fragment"),
            ("http://a:1/#frag", "query or fragment"),
        ],
    )
    def test_invalid_urls_name_the_variable(self, value: str, message: str) -> None:
        with pytest.raises(ConfigError, match=message) as info:
            resolve_server_urls({"AGENT_SERVER_URL": value})
        assert str(info.value).startswith("AGENT_SERVER_URL: ")

    def test_fallback_variable_is_named(self) -> None:
        with pytest.raises(ConfigError, match=r"^SWE_AGENT_URL: "):
            resolve_server_urls({"SWE_AGENT_URL": "nope"})

    @pytest.mark.parametrize("value", ["http://user:hunter2@agent:8000", "user:hunter2@agent", "ftp://u:hunter2@x/"])
    def test_userinfo_rejected_and_redacted(self, value: str) -> None:
        with pytest.raises(ConfigError) as info:
            resolve_server_urls({"AGENT_SERVER_URL": value})
        assert "hunter2" not in str(info.value)
        assert "***@" in str(info.value)

    def test_normalize_sequence_and_bad_types(self) -> None:
        assert normalize_server_urls(["http://a:1", "http://b:1,http://a:1/"]) == ("http://a:1", "http://b:1")
        with pytest.raises(ConfigError, match="server_urls: no URL given"):
            normalize_server_urls([])
        with pytest.raises(ConfigError, match="server_urls holds a value of type int"):
            normalize_server_urls([1])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="must be a str or a sequence of str"):
            normalize_server_urls(5)  # type: ignore[arg-type]


def test_redact_url_shows_what_was_typed_but_secrets() -> None:
    assert redact_url("https://u:p@h:1/x?q") == "https://***@h:1/x?q"
    assert redact_url("http://h:1/a@b") == "http://***@b"
    assert redact_url("http://h") == "http://h"
    assert redact_url("http://h:1/path?token=abc&x=1#frag") == "http://h:1/path?token=***&x=***#***"
    assert redact_url("127.0.0.1:8000") == "'127.0.0.1:8000'"  # as typed: the mistake is visible
    assert redact_url("http//user:hunter2@host/x") == "'***@host/x'"  # and still no password
    # 1.1 cut a mistyped value at its first "/": 'http' must start with http://
    assert redact_url("http//127.0.0.1:9") == "'http//127.0.0.1:9'"
    assert redact_url("http:/127.0.0.1:9/") == "'http:/127.0.0.1:9/'"
    assert redact_url("htp://agent:8000/v1") == "htp://agent:8000/v1"


def test_static_bearer_from_env() -> None:
    assert resolve_bearer({}) is None
    assert resolve_bearer({"HARBOR_ADMIN_SECRET": "  ", "MILES_HARBOR_AUTH_TOKEN": "t"}) == StaticBearer("t")
    assert resolve_bearer({"HARBOR_ADMIN_SECRET": "h\n", "MILES_HARBOR_AUTH_TOKEN": "t"}) == StaticBearer("h")
    assert isinstance(resolve_bearer({"HARBOR_RUN_SECRET": "m" * 32}), ScopedBearer)
