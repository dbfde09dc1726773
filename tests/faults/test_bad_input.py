"""Bad input through the public entry points: a clear ConfigError naming what was wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swe_flush_sync import ConfigError, Flusher, abort, flush


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        ("", "no URL given"),
        ("   ", "no URL given"),
        ("agent:8000", "must start with http"),
        ("ftp://agent:21", "must start with http"),
        ("http://", "has no host"),
        ("http://user:pw@agent:8000", "carries credentials"),
    ],
)
def test_flusher_urls(urls: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        Flusher(urls)
    assert str(info.value).startswith("server_urls")
    assert ":pw@" not in str(info.value)


def test_flusher_url_forms_accepted() -> None:
    with Flusher(" http://a:1/prefix/ , http://[::1]:8000//,http://a:1/prefix") as flusher:
        assert flusher.server_urls == ("http://a:1/prefix", "http://[::1]:8000")


@pytest.mark.parametrize("ids", [[1], [b"x"], ["ok", 2.0], 5, b"abc"])
def test_flush_bad_ids(ids: object) -> None:
    with pytest.raises(ConfigError, match="instance_ids"):
        flush("http://127.0.0.1:9", ids)  # type: ignore[arg-type]


def test_flush_ids_skip_none_and_empty() -> None:
    report = flush("http://127.0.0.1:9", [None, ""])  # type: ignore[list-item]
    assert report.ok and report.results == ()


def test_abort_args_whose_attribute_raises() -> None:
    class Args:
        def __getattr__(self, name: str) -> object:
            raise KeyError(name)

    report = abort(Args(), environ={"AGENT_SERVER_URL": "http://127.0.0.1:9"})
    assert not report.ok and "raised KeyError" in (report.error or "")


def test_abort_args_without_either_attribute() -> None:
    report = abort(SimpleNamespace(), environ={"AGENT_SERVER_URL": "http://127.0.0.1:9"})
    assert not report.ok and "has neither" in (report.error or "")


@pytest.mark.parametrize("deadline", [0, -1, float("nan"), 1e12])
def test_abort_bad_deadline_is_reported_not_raised(deadline: float) -> None:
    report = abort({"session_server_instance_id": "a"}, environ={"AGENT_SERVER_URL": "http://127.0.0.1:9"},
                   deadline=deadline)
    assert "deadline must be > 0" in (report.error or "")
