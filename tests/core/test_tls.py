"""Agent servers behind TLS: real certificates (trustme), real handshakes over loopback."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swe_flush_sync import ConfigError, Flusher, flush
from swe_flush_sync._core.tls import tls_failure
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, ours, wait_threads_gone
from ..faults.peers import RawPeer
from ..helpers import Trainer

trustme = pytest.importorskip("trustme")

IDS = ["tls-a", "tls-b"]


def workers() -> list[threading.Thread]:
    """The executors' worker threads (the hooks' standby threads are not theirs)."""
    return [t for t in ours() if t.name.startswith("swe-flush_")]


class Certificates:
    """One CA and what it issued, as PEM files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem)
        self.good = self.ca.issue_cert("127.0.0.1", "localhost")
        self.client = self.ca.issue_cert("trainer@example.org")
        self.client_pem = self._write("client.pem", self.client.private_key_pem, *self.client.cert_chain_pems)
        self.client_cert = self._write("client-cert.pem", *self.client.cert_chain_pems)
        self.client_key = self._write("client-key.pem", self.client.private_key_pem)

    def _write(self, name: str, *blobs: object) -> str:
        path = self.folder / name
        path.write_bytes(b"".join(blob.bytes() for blob in blobs))  # type: ignore[attr-defined]
        return str(path)

    def server_context(self, leaf: object | None = None, *, require_client: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        (leaf or self.good).configure_cert(context)  # type: ignore[attr-defined]
        if require_client:
            context.verify_mode = ssl.CERT_REQUIRED
            self.ca.configure_trust(context)
        return context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def tls_stub(certs: Certificates) -> Iterator[Callable[..., AgentServerStub]]:
    started: list[AgentServerStub] = []

    def make(leaf: object | None = None, *, require_client: bool = False, **kwargs: object) -> AgentServerStub:
        server = AgentServerStub(tls=certs.server_context(leaf, require_client=require_client),
                                 ca_bundle=certs.ca_file, **kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def test_trusted_by_option(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    server = tls_stub()
    server.add_trials("tls-a", 2)
    report = flush(server.url, IDS, ca_bundle=certs.ca_file)
    assert server.url.startswith("https://127.0.0.1:")
    assert report.ok and report.cancelled == 2 and sorted(server.flushed_ids()) == IDS


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"])
def test_trusted_by_environment(tls_stub: Callable[..., AgentServerStub], certs: Certificates,
                                monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, certs.ca_file)
    server = tls_stub()
    assert flush(server.url, IDS).ok


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to hash a CA directory")
def test_trusted_by_a_directory(tls_stub: Callable[..., AgentServerStub], certs: Certificates,
                                tmp_path: Path) -> None:
    subject_hash = subprocess.run(["openssl", "x509", "-hash", "-noout", "-in", certs.ca_file], check=True,
                                  capture_output=True, text=True).stdout.strip()
    shutil.copy(certs.ca_file, tmp_path / f"{subject_hash}.0")
    server = tls_stub()
    assert flush(server.url, IDS, ca_bundle=str(tmp_path)).ok


def test_the_agent_server_tls_fixture(agent_server_tls: AgentServerStub) -> None:
    assert flush(agent_server_tls.url, IDS, ca_bundle=agent_server_tls.ca_bundle).ok


def _one_attempt_failure(server: AgentServerStub, message: str, **options: object) -> None:
    started = time.monotonic()
    report = flush(server.url, IDS, deadline=5, **options)  # type: ignore[arg-type]
    took = time.monotonic() - started
    assert not report.ok
    for result in report.results:
        assert result.error == f"TLS error: {message}", result.error
        assert result.attempts == 1  # not retried: no retry changes a certificate
    assert took < 1.0  # far under the 5 s deadline
    assert server.flushed_ids() == []


def test_untrusted_certificate(tls_stub: Callable[..., AgentServerStub]) -> None:
    _one_attempt_failure(tls_stub(), "certificate verify failed: unable to get local issuer certificate")


def test_self_signed_certificate(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    self_signed = trustme.CA()  # a CA's own certificate is self-signed: serve with it as the leaf

    class Leaf:
        @staticmethod
        def configure_cert(context: ssl.SSLContext) -> None:
            with self_signed.cert_pem.tempfile() as cert, self_signed.private_key_pem.tempfile() as key:
                context.load_cert_chain(cert, key)

    _one_attempt_failure(tls_stub(Leaf()), "certificate verify failed: self-signed certificate",
                         ca_bundle=certs.ca_file)


def test_expired_certificate(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    expired = certs.ca.issue_cert("127.0.0.1", not_before=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
                                  not_after=datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone.utc))
    _one_attempt_failure(tls_stub(expired), "certificate verify failed: certificate has expired",
                         ca_bundle=certs.ca_file)


def test_wrong_host_name(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    _one_attempt_failure(tls_stub(certs.ca.issue_cert("agent.example.org")),
                         "certificate verify failed: hostname mismatch", ca_bundle=certs.ca_file)


def test_client_certificate_given(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    server = tls_stub(require_client=True)
    assert flush(server.url, IDS, ca_bundle=certs.ca_file, client_cert=certs.client_pem).ok
    assert flush(server.url, IDS, ca_bundle=certs.ca_file, client_cert=(certs.client_cert, certs.client_key)).ok
    assert len(server.flushed_ids()) == 4


def test_client_certificate_missing(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    server = tls_stub(require_client=True)
    for _ in range(10):  # TLS 1.3 says so on the read; the write usually fails first
        _one_attempt_failure(server, "the server requires a client certificate", ca_bundle=certs.ca_file)


def test_http_server_behind_an_https_url(stub: AgentServerStub, certs: Certificates) -> None:
    url = stub.url.replace("http://", "https://")
    started = time.monotonic()
    report = flush(url, IDS, deadline=5, ca_bundle=certs.ca_file)
    assert [r.error for r in report.results] == ["TLS error: handshake failed (wrong version number)"] * 2
    assert all(r.attempts == 1 for r in report.results) and time.monotonic() - started < 1.0


def test_a_hung_handshake_ends_at_the_deadline_and_releases_its_worker(certs: Certificates) -> None:
    peer = RawPeer("no-answer")  # accepts TCP, never speaks TLS
    url = peer.url.replace("http://", "https://")
    try:
        started = time.monotonic()
        report = flush(url, IDS, deadline=1.0, connect_timeout=30, ca_bundle=certs.ca_file)
        took = time.monotonic() - started
        assert not report.ok and took <= 1.5
        assert all("deadline passed" in (r.error or "") for r in report.results)
        assert wait_threads_gone(workers, 2.0) == []  # the workers were not left in the handshake

        with Flusher(url, deadline=0.5, connect_timeout=30, linger=60, ca_bundle=certs.ca_file) as flusher:
            report = flusher.flush(IDS)  # left in flight (lingering), mid-handshake
            assert all("left in flight" in (r.error or "") for r in report.results)
        assert wait_threads_gone(workers, 2.0) == []  # close() gave them up: their sockets shut down
    finally:
        peer.close()


def test_ctrl_c_during_a_handshake(certs: Certificates) -> None:
    peer = RawPeer("no-answer")
    try:
        with Flusher(peer.url.replace("http://", "https://"), deadline=20, connect_timeout=30,
                     ca_bundle=certs.ca_file) as flusher:
            # a real SIGINT to the main thread, as Ctrl-C sends it: it interrupts the wait at once
            threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                flusher.flush(IDS)
            assert time.monotonic() - started < 2.0
        assert wait_threads_gone(workers, 2.0) == []
    finally:
        peer.close()


def test_a_handshake_that_lingers_makes_room_for_fresh_pairs(tls_stub: Callable[..., AgentServerStub],
                                                              certs: Certificates) -> None:
    peer = RawPeer("no-answer")
    good = tls_stub()
    try:
        hung = peer.url.replace("http://", "https://")
        with Flusher([hung, good.url], max_workers=2, deadline=0.5, linger=60, connect_timeout=30,
                     ca_bundle=certs.ca_file) as flusher:
            for step in range(3):
                report = flusher.flush([f"room-{step}"])
                healthy = [r for r in report.results if r.server_url == good.url]
                assert [r.ok for r in healthy] == [True], report.summary()
    finally:
        peer.close()


def test_tls_connections_are_reused(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    server = tls_stub(teardown=0.05)
    ids = [f"reuse-{index}" for index in range(8)]
    with Flusher(server.url, ca_bundle=certs.ca_file) as flusher:
        for _ in range(2):
            assert flusher.flush(ids).ok  # warm-up
        opened = server.connections
        for _ in range(20):
            assert flusher.flush(ids).ok
    assert opened <= len(ids) and server.connections == opened  # no new handshake in 20 steps


def test_cli_flags(tls_stub: Callable[..., AgentServerStub], certs: Certificates) -> None:
    server = tls_stub(require_client=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")}
    base = [PYTHON, "-m", "swe_flush_sync", "--url", server.url, "--id", "cli-a", "--json"]
    ok = subprocess.run([*base, "--ca-bundle", certs.ca_file, "--client-cert", certs.client_cert,
                         "--client-key", certs.client_key], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = subprocess.run([*base, "--ca-bundle", certs.ca_file], capture_output=True, text=True, env=env,
                             timeout=60)
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["results"][0]["error"] == "TLS error: the server requires a client certificate"
    bad = subprocess.run([*base, "--ca-bundle", "/nonexistent/ca.pem"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "--ca-bundle: cannot read the file" in bad.stdout


def test_bad_option_values(tmp_path: Path, certs: Certificates, monkeypatch: pytest.MonkeyPatch,
                           tls_stub: Callable[..., AgentServerStub]) -> None:
    with pytest.raises(ConfigError, match=r"ca_bundle: cannot read the file .*missing.pem: No such file.*; give the"):
        Flusher("https://127.0.0.1:9", ca_bundle=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="client_cert must be a path or a"):
        Flusher("https://127.0.0.1:9", client_cert=("a", "b", "c"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="client_cert's key: cannot read"):
        Flusher("https://127.0.0.1:9", client_cert=(certs.client_cert, str(tmp_path / "nokey.pem")))
    with pytest.raises(ConfigError, match="ca_bundle must be a file path"):
        Flusher("https://127.0.0.1:9", ca_bundle=42)  # type: ignore[arg-type]
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("password=hunter2\n")
    server = tls_stub()
    with pytest.raises(ConfigError, match="ca_bundle: not a PEM CA bundle") as caught:
        flush(server.url, IDS, ca_bundle=str(not_pem))
    assert "hunter2" not in str(caught.value)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(certs.client.private_key_pem.bytes().replace(b"PRIVATE KEY", b"ENCRYPTED PRIVATE KEY"))
    with pytest.raises(ConfigError, match="client_cert: not a PEM certificate with its unencrypted key"):
        flush(server.url, IDS, ca_bundle=certs.ca_file, client_cert=(certs.client_cert, str(encrypted)))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "gone.pem"))
    with pytest.raises(ConfigError, match="REQUESTS_CA_BUNDLE: cannot read the file"):
        flush(server.url, IDS)
    assert server.requests == []


def test_tls_failure_classifies_only_final_failures() -> None:
    assert tls_failure(ssl.SSLEOFError(8, "EOF occurred in violation of protocol")) is None
    assert tls_failure(ConnectionResetError(104, "reset")) is None
    assert tls_failure(TimeoutError("The handshake operation timed out")) is None
    assert tls_failure(None) is None
    wrapped = OSError("outer")
    wrapped.__cause__ = ssl.SSLCertVerificationError(1, "certificate verify failed")
    wrapped.__cause__.verify_code, wrapped.__cause__.verify_message = 10, "certificate has expired"
    assert tls_failure(wrapped) == "certificate verify failed: certificate has expired"


def test_a_watchdog_flushes_over_tls_with_its_trainers_certificates(tls_stub: Callable[..., AgentServerStub],
                                                                    certs: Certificates) -> None:
    from ..conftest import gone, wait_until

    server = tls_stub(require_client=True)
    ca = os.path.relpath(certs.ca_file)  # relative to the trainer's directory: the watchdog runs in /
    trainer = Trainer(server, f"""
        os.chdir({os.getcwd()!r})
        armed(watchdog(args, until_idle=False, ca_bundle={ca!r}, client_cert={certs.client_pem!r}))
        time.sleep(60)
    """, HARBOR_ADMIN_SECRET="")
    pid = trainer.armed()
    trainer.proc.kill()
    trainer.death()
    assert wait_until(lambda: gone(pid), 6.0)
    assert sorted(server.flushed_ids()) == ["wd-a", "wd-b", "wd-c"]
