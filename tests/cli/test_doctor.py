"""``swe-flush doctor`` (issue 36): each check against a real setup, right and wrong, run as a user
runs it (a subprocess with the trainer's environment), against the stub over loopback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import textwrap
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, REPO, SECRET, StartGuard, read_until, spawn, subprocess_env
from ..helpers import needs_unshare

MASTER = "scoped-master-secret-" + "m" * 20
ENV = {"HARBOR_ADMIN_SECRET": SECRET}


def doctor(*args: str, **env: str) -> tuple[int, dict[str, dict[str, str]], str]:
    """(exit code, {check name: {status, detail}}, the text output) of one run."""
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "doctor", *args, "--json"], capture_output=True,
                         text=True, env=subprocess_env(**env), timeout=60)
    text = subprocess.run([PYTHON, "-m", "swe_flush_sync", "doctor", *args], capture_output=True, text=True,
                          env=subprocess_env(**env), timeout=60).stdout
    answer = json.loads(out.stdout)
    assert answer["ok"] is (out.returncode == 0)
    return out.returncode, {check["name"]: check for check in answer["checks"]}, text


def server_check(checks: dict[str, dict[str, str]]) -> dict[str, str]:
    [check] = [check for name, check in checks.items() if name.startswith("server ")]
    return check


def test_a_right_setup_is_all_ok(stub: AgentServerStub) -> None:
    code, checks, text = doctor(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert code == 0, text
    assert checks["servers"]["status"] == "ok" and "from AGENT_SERVER_URL" in checks["servers"]["detail"]
    assert checks["bearer"] == {"name": "bearer", "status": "ok", "detail": "static, from HARBOR_ADMIN_SECRET"}
    assert server_check(checks)["status"] == "ok" and "bearer is accepted" in server_check(checks)["detail"]
    assert [r.status for r in stub.requests] == [200, 200]  # one probe each run, of an id no trainer has
    assert all(r.instance_id and r.instance_id.startswith("swe-flush-doctor-") for r in stub.requests)
    assert SECRET not in text and text.splitlines()[0].startswith("ok   servers:")
    assert {check["status"] for check in checks.values()} <= {"ok", "warn"}


def test_a_wrong_bearer_fails_and_says_what_to_set(stub: AgentServerStub) -> None:
    code, checks, text = doctor(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET="not-the-secret")
    assert code == 1 and server_check(checks)["status"] == "fail"
    assert "answered 401" in server_check(checks)["detail"] and "HARBOR_ADMIN_SECRET" in server_check(checks)["detail"]
    assert "not-the-secret" not in text and SECRET not in text


def test_a_fail_that_follows_from_an_earlier_one_says_so(stub: AgentServerStub, tmp_path: Path) -> None:
    """Issue 55: a too-short HARBOR_RUN_SECRET failed the bearer line, then the server's line advised
    "no bearer is set: set HARBOR_ADMIN_SECRET", the wrong variable for a scoped deployment."""
    code, checks, text = doctor(AGENT_SERVER_URL=stub.url, HARBOR_RUN_SECRET="too-short")
    assert code == 1 and checks["bearer"]["status"] == "fail" and "HARBOR_RUN_SECRET" in checks["bearer"]["detail"]
    assert "because the bearer check above failed" in server_check(checks)["detail"]
    assert "set HARBOR_ADMIN_SECRET" not in server_check(checks)["detail"] and "too-short" not in text
    missing = str(tmp_path / "missing-ca.pem")
    code, checks, text = doctor("--ca-bundle", missing, AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert code == 1 and f"cannot read the file {missing}" in server_check(checks)["detail"]
    assert "give the path of a readable PEM file" in server_check(checks)["detail"]


def test_a_scoped_bearer_is_derived_for_the_probe(stub_factory: Callable[..., AgentServerStub]) -> None:
    server = stub_factory(scoped_secret=MASTER)
    code, checks, text = doctor(AGENT_SERVER_URL=server.url, HARBOR_RUN_SECRET=MASTER)
    assert code == 0, text
    assert checks["bearer"]["detail"].startswith("scoped") and server_check(checks)["status"] == "ok"
    assert MASTER not in text


def test_no_server_and_a_server_down_fail(stub: AgentServerStub) -> None:
    code, checks, _ = doctor()
    assert code == 1 and checks["servers"]["status"] == "fail" and "AGENT_SERVER_URL" in checks["servers"]["detail"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once it is closed
    code, checks, _ = doctor(AGENT_SERVER_URL=f"http://127.0.0.1:{port}")
    assert code == 1 and "not reachable" in server_check(checks)["detail"]
    assert checks["bearer"]["status"] == "warn"  # no bearer at all: said, not failed


def test_tls_with_and_without_the_ca(agent_server_tls: AgentServerStub) -> None:
    code, checks, _ = doctor("--ca-bundle", str(agent_server_tls.ca_bundle), AGENT_SERVER_URL=agent_server_tls.url)
    assert code == 0 and server_check(checks)["status"] == "ok"
    code, checks, _ = doctor(AGENT_SERVER_URL=agent_server_tls.url)
    assert code == 1 and "certificate" in server_check(checks)["detail"]


def test_a_guard_that_answers_and_one_that_does_not(stub: AgentServerStub, start_guard: StartGuard,
                                                    short_dir: Path) -> None:
    guard = start_guard()
    code, checks, _ = doctor(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET, SWE_FLUSH_GUARD=guard.socket)
    assert code == 0 and checks["guard"]["status"] == "ok" and f"pid {guard.proc.pid}" in checks["guard"]["detail"]
    assert checks["container"]["status"] == "ok" and "guard" in checks["container"]["detail"]
    code, checks, _ = doctor("--guard", str(short_dir / "nobody.sock"), **{"AGENT_SERVER_URL": stub.url, **ENV})
    assert code == 1 and "no guard answers" in checks["guard"]["detail"] and "fix --guard" in checks["guard"]["detail"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a process of another uid)")
def test_a_guard_of_another_uid_fails(stub: AgentServerStub, short_dir: Path) -> None:
    short_dir.chmod(0o755)
    folder = short_dir / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    path = str(folder / "guard.sock")
    listener = spawn([PYTHON, "-c", textwrap.dedent("""
        import os, socket, sys
        os.setgid(4242)
        os.setuid(4242)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(sys.argv[1])
        listener.listen(8)
        print("LISTENING", flush=True)
        while True:
            listener.accept()[0].close()
    """), path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert read_until(listener, lambda line: line == "LISTENING", []) is not None
    code, checks, _ = doctor("--guard", path, AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert code == 1 and "uid 4242" in checks["guard"]["detail"]


def test_the_ledger(stub: AgentServerStub, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code, checks, _ = doctor("--ledger", str(shared), AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert code == 1 and checks[f"ledger {shared}"]["status"] == "fail" and "chmod 700" in checks[f"ledger {shared}"][
        "detail"]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    code, checks, _ = doctor(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET, SWE_FLUSH_LEDGER=str(private))
    assert code == 0 and checks[f"ledger {private}"]["status"] == "ok"
    code, checks, _ = doctor("--ledger", str(tmp_path / "later"), AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    assert code == 0 and "made it here, mode 0700" in checks[f"ledger {tmp_path / 'later'}"]["detail"]
    assert oct((tmp_path / "later").stat().st_mode & 0o777) == "0o700"
    code, checks, _ = doctor(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET, SWE_FLUSH_LEDGER="/proc/ledger")
    detail = checks["ledger /proc/ledger"]["detail"]  # 1.1 said "it will be made" by asking access(), which root passes
    assert code == 1 and "cannot be made" in detail and "fix SWE_FLUSH_LEDGER" in detail


@needs_unshare
def test_pid_1_with_no_guard_fails_and_names_the_guard(stub: AgentServerStub,
                                                       start_guard: StartGuard) -> None:
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", PYTHON, "-m", "swe_flush_sync",
               "doctor", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60,
                         env=subprocess_env(AGENT_SERVER_URL=stub.url, **ENV))
    checks = {check["name"]: check for check in json.loads(out.stdout)["checks"]}
    assert out.returncode == 1 and checks["container"]["status"] == "fail"
    assert "PID 1" in checks["container"]["detail"] and "SWE_FLUSH_GUARD" in checks["container"]["detail"]
    guard = start_guard()
    out = subprocess.run(command, capture_output=True, text=True, timeout=60,
                         env=subprocess_env(AGENT_SERVER_URL=stub.url, SWE_FLUSH_GUARD=guard.socket, **ENV))
    assert out.returncode == 0, out.stdout


def test_the_limits_and_versions_are_said(stub: AgentServerStub) -> None:
    low = "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(" \
          "resource.RLIMIT_NOFILE)[1])); from swe_flush_sync._cli.main import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([PYTHON, "-c", low, "doctor", "--json"], capture_output=True, text=True, timeout=60,
                         env=subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET))
    checks = {check["name"]: check for check in json.loads(out.stdout)["checks"]}
    assert out.returncode == 0  # a warning is not a failure
    assert checks["open files"]["status"] == "warn" and "ulimit -n" in checks["open files"]["detail"]
    assert {"python", "requests", "urllib3"} <= set(checks) and checks["python"]["status"] == "ok"


def test_every_failing_server_line_says_what_to_change(stub: AgentServerStub,
                                                      agent_server_tls: AgentServerStub) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    expected = {
        f"http://127.0.0.1:{port}": "not reachable: could not connect: connection refused; nothing listens there: "
                                    "start the agent server, or fix the host and port in the URL",
        agent_server_tls.url: "not reachable: TLS error: certificate verify failed: unable to get local issuer "
                              "certificate; pass --ca-bundle PATH (or set REQUESTS_CA_BUNDLE) to the CA that signed "
                              "the server's certificate, or fix the certificate",
        agent_server_tls.url.replace("https://", "http://"): "not reachable: connection dropped by the server; if the "
                                                             "server speaks https, use https:// in the URL",
        stub.url: "/flush answered 401 and no bearer is set: set HARBOR_ADMIN_SECRET to the server's secret (or "
                  "HARBOR_RUN_SECRET for scoped bearers)",
    }
    for url, detail in expected.items():
        code, checks, _ = doctor(AGENT_SERVER_URL=url)
        assert code == 1 and server_check(checks) == {"name": server_check(checks)["name"], "status": "fail",
                                                      "detail": detail}


def test_the_python_check_follows_the_classifiers() -> None:
    from swe_flush_sync._cli.doctor import tested_pythons

    declared = re.findall(r"Programming Language :: Python :: (3\.\d+)\n", (REPO / "setup.cfg").read_text())
    assert [f"3.{minor}" for _, minor in tested_pythons()] == declared  # one list: the package's metadata
    assert tested_pythons()[0] == (3, 10) and (3, 15) in tested_pythons()


class _ProxyPage(BaseHTTPRequestHandler):
    """A proxy's default page: 200, text/html, for any request."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<html><body>Welcome to nginx!</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_url_that_answers_200_with_a_page_is_no_agent_server(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """1.2.0 called a proxy's default page a flush: ok, exit 0. Now the CLI exits 1 and doctor says why."""
    from swe_flush_sync._cli.main import main

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    try:
        assert main(["--url", url, "--id", "a", "--secret-file", str(secret_file), "--json"]) == 1
        [result] = json.loads(capsys.readouterr().out)["results"]
        assert not result["ok"] and "text/html" in result["error"] and "Welcome to nginx" in result["error"]
        code, checks, _ = doctor(AGENT_SERVER_URL=url, HARBOR_ADMIN_SECRET=SECRET)
        assert code == 1 and server_check(checks)["status"] == "fail"
        assert "does not look like an agent server" in server_check(checks)["detail"], checks
    finally:
        server.shutdown()
        server.server_close()


def test_a_leftover_bearer_that_takes_priority_is_named_to_unset(stub_factory: Callable[..., AgentServerStub]) -> None:
    """A right HARBOR_RUN_SECRET and a leftover HARBOR_ADMIN_SECRET: 1.2.0 said "set HARBOR_ADMIN_SECRET, or
    HARBOR_RUN_SECRET"; the fix is to unset the one that takes priority."""
    server = stub_factory(scoped_secret=MASTER)
    code, checks, text = doctor(AGENT_SERVER_URL=server.url, HARBOR_RUN_SECRET=MASTER, HARBOR_ADMIN_SECRET="leftover")
    assert code == 1 and "takes priority over HARBOR_RUN_SECRET" in checks["bearer"]["detail"]
    detail = server_check(checks)["detail"]
    assert "if HARBOR_RUN_SECRET is the right one, unset HARBOR_ADMIN_SECRET" in detail, detail
    assert MASTER not in text and "leftover" not in text
