"""swe_flush_sync against the FastAPI app served by uvicorn over TLS (certificates made by trustme)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import pytest

from swe_flush_sync import flush

from .conftest import Harbor
from .test_harbor_contract import ADMIN, IDS

trustme = pytest.importorskip("trustme")

HarborFactory = Callable[..., Harbor]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder: Path = tmp_path_factory.mktemp("harbor-pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("trainer@example.org")
    files = {"ca": ca.cert_pem, "cert": server.cert_chain_pems[0], "key": server.private_key_pem,
             "client": client.private_key_and_cert_chain_pem}
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return {name: str(folder / f"{name}.pem") for name in files}


def test_flush_until_idle_over_tls(harbor_factory: HarborFactory, pki: dict[str, str]) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, teardown=0.05, max_concurrent=4,
                            tls={"ssl_certfile": pki["cert"], "ssl_keyfile": pki["key"]})
    assert harbor.url.startswith("https://")
    report = flush(harbor.url, IDS, admin_secret=ADMIN, ca_bundle=pki["ca"], until_idle=True)
    assert report.ok and all(result.idle for result in report.results)
    assert sorted(set(harbor.stats.flushes)) == IDS


def test_a_client_certificate_required_by_uvicorn(harbor_factory: HarborFactory, pki: dict[str, str]) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, tls={"ssl_certfile": pki["cert"], "ssl_keyfile": pki["key"],
                                                     "ssl_ca_certs": pki["ca"], "ssl_cert_reqs": ssl.CERT_REQUIRED})
    given = flush(harbor.url, IDS, admin_secret=ADMIN, ca_bundle=pki["ca"], client_cert=pki["client"])
    assert given.ok
    # uvicorn (asyncio's TLS) closes the connection without sending TLS 1.3's certificate_required
    # alert: the client sees an end of file, a dropped connection retried as one, or, as the timing
    # of the close falls, the TLS layer's own word for that end (it varies from run to run).
    missing = flush(harbor.url, IDS, admin_secret=ADMIN, ca_bundle=pki["ca"], deadline=5, retries=1)
    assert not missing.ok
    for result in missing.results:
        assert result.error == "connection dropped by the server" or (result.error or "").startswith("TLS error: ")
    assert harbor.stats.flushes.count("inst-a") == 1  # only the flush with the certificate got through
    untrusted = flush(harbor.url, IDS, admin_secret=ADMIN, deadline=5)
    for result in untrusted.results:  # uvicorn sends its CA in the chain: "self-signed certificate in ..."
        assert (result.error or "").startswith("TLS error: certificate verify failed: ") and result.attempts == 1
