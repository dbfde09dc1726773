"""Unit tests of the transport with ``responses``: wire format, retry policy, error messages."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import requests
import responses
from responses.registries import OrderedRegistry
from urllib3.exceptions import MaxRetryError, NameResolutionError, NewConnectionError, ProtocolError, ReadTimeoutError

from swe_flush_sync import ConfigError, Flusher, FlushOptions, ScopedBearer, StaticBearer, __version__, flush
from swe_flush_sync._core.failures import describe_failure
from swe_flush_sync._core.transport import build_retry

from ..conftest import SECRET

URL = "http://agent.test:8000"
FLUSH = URL + "/flush"
# The transport sends through requests' own HTTPAdapter.send: responses' default target.
mocked = responses.RequestsMock(assert_all_requests_are_fired=False)


def ok_body(instance_id: str, cancelled: object = 2) -> dict[str, object]:
    return {"session_server_instance_id": instance_id, "cancelled": cancelled}


@mocked.activate
def test_wire_format_with_bearer() -> None:
    mocked.post(FLUSH, json=ok_body("i1", 3))
    report = flush(URL, ["i1"], admin_secret=SECRET)
    assert report.ok and report.cancelled == 3
    request = mocked.calls[0].request
    assert request.headers["Authorization"] == f"Bearer {SECRET}"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["User-Agent"] == f"swe-flush-sync/{__version__}"
    # nothing a flush does not need: no gzip (the body is never decoded), no Accept, no Connection
    assert {name.lower() for name in request.headers} == {"authorization", "content-type", "content-length",
                                                           "user-agent"}
    assert json.loads(request.body) == {"session_server_instance_id": "i1"}
    assert request.headers["Content-Length"] == str(len(request.body))


@mocked.activate
def test_no_authorization_header_without_secret() -> None:
    mocked.post(FLUSH, json=ok_body("i1"))
    assert flush(URL, ["i1"]).ok
    assert "Authorization" not in mocked.calls[0].request.headers


@mocked.activate(registry=OrderedRegistry)
def test_503_503_200_is_ok_after_three_attempts() -> None:
    mocked.post(FLUSH, status=503)
    mocked.post(FLUSH, status=503)
    mocked.post(FLUSH, json=ok_body("i1", 1))
    [result] = flush(URL, ["i1"]).results
    assert (result.ok, result.attempts, result.status_code, result.cancelled) == (True, 3, 200, 1)
    assert len(mocked.calls) == 3


@mocked.activate
def test_retries_bound_attempts() -> None:
    mocked.post(FLUSH, status=502)
    [result] = flush(URL, ["i1"], retries=2).results
    assert not result.ok and result.attempts == 3 and len(mocked.calls) == 3
    assert result.status_code == 502 and result.error == "HTTP 502: retries exhausted"


@mocked.activate
def test_retries_zero_means_one_attempt() -> None:
    mocked.post(FLUSH, status=503)
    [result] = flush(URL, ["i1"], retries=0).results
    assert result.attempts == 1 and len(mocked.calls) == 1


@pytest.mark.parametrize(
    ("status", "hint"),
    [(401, "wrong or missing bearer"), (403, "forbidden"), (404, "no /flush endpoint"), (405, "not allowed"),
     (422, "rejected the request body"), (400, None), (409, None)],
)
@mocked.activate
def test_client_errors_not_retried(status: int, hint: str | None) -> None:
    mocked.post(FLUSH, status=status, json={"detail": "x"})
    [result] = flush(URL, ["i1"], retries=3).results
    assert len(mocked.calls) == 1
    assert (result.ok, result.status_code, result.attempts) == (False, status, 1)
    assert result.error is not None and result.error.startswith(f"HTTP {status}")
    if hint:
        assert hint in result.error


@pytest.mark.parametrize("status", [301, 302, 307, 308])
@mocked.activate
def test_redirect_not_followed(status: int) -> None:
    mocked.post(FLUSH, status=status, headers={"Location": "http://elsewhere.test/flush"})
    [result] = flush(URL, ["i1"], admin_secret=SECRET).results
    assert not result.ok and result.status_code == status and "redirect not followed" in (result.error or "")
    assert len(mocked.calls) == 1


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"cancelled": "3"}', b'{"cancelled": true}', b"{}", b""],
)
@mocked.activate
def test_a_2xx_that_is_not_the_flush_answer_fails_saying_what_came_back(body: bytes) -> None:
    """A proxy's default page (200, text/html) is no flush: 1.2.0 said ok, and the CLI exited 0."""
    mocked.post(FLUSH, body=body, status=200, content_type="text/html")
    report = flush(URL, ["i1"])
    [result] = report.results
    assert not report.ok and not result.ok and result.status_code == 200 and result.cancelled is None
    assert "HTTP 200 with content type text/html" in (result.error or "") and "no flush answer" in (result.error or "")
    assert (body.decode() or "an empty body") in (result.error or ""), result.error


@mocked.activate
def test_a_2xx_body_that_echoes_the_bearer_is_shown_masked() -> None:
    mocked.post(FLUSH, body=b"<pre>Authorization: Bearer s3cr3t-value</pre>", status=200)
    [result] = flush(URL, ["i1"], admin_secret="s3cr3t-value").results
    assert not result.ok and "s3cr3t" not in (result.error or "") and "Bearer ***" in (result.error or ""), result.error


@mocked.activate
def test_202_counts_as_success() -> None:
    mocked.post(FLUSH, status=202, json=ok_body("i1", 4))
    assert flush(URL, ["i1"]).cancelled == 4


@mocked.activate
def test_exception_from_transport_becomes_result() -> None:
    mocked.post(FLUSH, body=requests.ConnectionError(ProtocolError("Connection aborted.")))
    [result] = flush(URL, ["i1"]).results
    assert not result.ok and result.error == "connection dropped by the server" and result.attempts == 1


@mocked.activate
def test_results_are_url_major_and_deduplicated() -> None:
    other = "http://other.test:9"
    mocked.post(FLUSH, json=ok_body("x"))
    mocked.post(other + "/flush", json=ok_body("x"))
    report = flush([URL, other], ["a", "b", "a"])
    assert [(r.server_url, r.instance_id) for r in report.results] == [
        (URL, "a"), (URL, "b"), (other, "a"), (other, "b")]


def test_retry_policy() -> None:
    retry = build_retry(3, 0.2)
    assert retry.total == 3
    assert "POST" in retry.allowed_methods
    assert set(retry.status_forcelist) == {429, 500, 502, 503, 504}
    assert retry.raise_on_status is False
    assert retry.respect_retry_after_header is True
    assert retry.is_retry("POST", 503) and retry.is_retry("POST", 429)
    assert not any(retry.is_retry("POST", s) for s in (401, 403, 404, 422))
    assert retry.backoff_jitter > 0


def test_describe_failure() -> None:
    refused = NewConnectionError(None, "Failed")  # type: ignore[arg-type]
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert describe_failure(exc=requests.ConnectionError(MaxRetryError(None, "/", refused))) == \
        "could not connect: connection refused"  # type: ignore[arg-type]
    dns = NameResolutionError("x.invalid", None, OSError("no"))  # type: ignore[arg-type]
    assert describe_failure(exc=requests.ConnectionError(MaxRetryError(None, "/", dns))) == \
        "host name did not resolve"  # type: ignore[arg-type]
    assert describe_failure(exc=ReadTimeoutError(None, "/", "x")) == "read timed out"  # type: ignore[arg-type]
    assert describe_failure(exc=requests.ReadTimeout()) == "read timed out"
    assert describe_failure(exc=KeyError("k")) == "unexpected KeyError"


@pytest.mark.parametrize("bearer", [StaticBearer(SECRET), ScopedBearer(SECRET * 2)], ids=["static", "scoped"])
@mocked.activate
def test_reused_flusher_sends_each_pair_its_own_body_and_bearer(bearer: StaticBearer | ScopedBearer) -> None:
    other = "http://agent-2.test:8000"
    mocked.post(FLUSH, json=ok_body("x"))
    mocked.post(other + "/flush", json=ok_body("x"))
    with Flusher([URL, other], bearer=bearer) as flusher:
        for _ in range(3):
            assert flusher.flush(["a", "b", "c"]).ok
    sent = Counter((call.request.url, json.loads(call.request.body)["session_server_instance_id"],
                    call.request.headers["Authorization"]) for call in mocked.calls)
    assert sent == {(url + "/flush", i, "Bearer " + bearer(i)): 3 for url in (URL, other) for i in "abc"}


def test_bearer_reprs_hide_secrets() -> None:
    master = SECRET * 2
    for provider in (StaticBearer(SECRET), ScopedBearer(master)):
        assert SECRET not in repr(provider) and "***" in repr(provider)
        assert SECRET not in repr(FlushOptions(bearer=provider))
    assert SECRET not in repr(FlushOptions(admin_secret=SECRET))


def test_flusher_repr_hides_secret() -> None:
    with Flusher(URL, admin_secret=SECRET) as flusher:
        assert SECRET not in repr(flusher) and "***" in repr(flusher)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("deadline", 0, "deadline must be > 0"),
        ("deadline", -1, "deadline must be > 0"),
        ("deadline", math.nan, "deadline must be > 0"),
        ("deadline", math.inf, "deadline must be > 0"),
        ("deadline", 1e9, "deadline must be > 0 and <= 3600"),
        ("deadline", "5", "deadline must be a number"),
        ("deadline", True, "deadline must be a number"),
        ("max_workers", 0, "max_workers must be between 1"),
        ("max_workers", -3, "max_workers must be between 1"),
        ("max_workers", 2.0, "max_workers must be an int"),
        ("retries", -1, "retries must be between 0"),
        ("retries", None, "retries must be an int"),
        ("connect_timeout", 0, "connect_timeout must be > 0"),
        ("backoff_factor", -1, "backoff_factor must be a number from 0"),
        ("admin_secret", 123, "admin_secret must be a str"),
        ("admin_secret", "bad\nsecret", "admin_secret must be non-empty printable ASCII"),
    ],
)
def test_flusher_options_validated(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        Flusher(URL, **{option: value})  # type: ignore[arg-type]
    assert "bad\nsecret" not in str(info.value)


def test_flush_deadline_validated_per_call() -> None:
    with Flusher(URL) as flusher, pytest.raises(ConfigError, match="deadline"):
        flusher.flush(["a"], deadline=-1)


def test_flush_on_closed_flusher_raises() -> None:
    flusher = Flusher(URL)
    flusher.close()
    from swe_flush_sync import FlushError

    with pytest.raises(FlushError, match="closed"):
        flusher.flush(["a"])


def test_empty_ids_send_nothing() -> None:
    with responses.RequestsMock() as mock:  # any request would fail: nothing is registered
        report = flush(URL, [])
    assert report.ok and report.results == () and len(mock.calls) == 0
