"""What an operator sees: grouped logs, escaped ids, credential-proof URLs, the CLI, the stub command."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import textwrap
import time
import warnings

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from swe_flush_sync import ConfigError, Flusher, abort, flush
from swe_flush_sync._cli.main import main
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, spawn, subprocess_env


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_64_ids_against_a_down_server_log_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    url = f"http://127.0.0.1:{closed_port()}"
    ids = [f"id{n}" for n in range(64)]
    report = abort({"session_server_instance_ids": ids}, environ={"AGENT_SERVER_URL": url}, deadline=3)
    assert len(report.failed) == 64
    lines = [r.getMessage() for r in caplog.records]
    print(f"[lines] {len(lines)} log lines for 64 ids against a down server")
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"flush failed for 64 of 64 instances at {url}: could not connect")
    assert "(id0, id1, id2, ...)" in lines[0]


def test_no_urllib3_record_from_a_worker_but_the_apps_own_pass(stub: AgentServerStub,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    stub.fault("flaky", statuses=[503])
    flush(f"http://127.0.0.1:{closed_port()}", ["a"], deadline=1)
    flush(stub.url, ["flaky", "b"], admin_secret=SECRET)
    assert [r for r in caplog.records if r.name.startswith("urllib3")] == []
    requests.post(stub.url + "/flush", json={"session_server_instance_id": "x"}, timeout=5)  # the app's own
    assert any(r.name.startswith("urllib3") for r in caplog.records)


def test_ids_but_no_server_is_warned_once(recwarn: pytest.WarningsRecorder) -> None:
    from swe_flush_sync import _hooks as hooks

    hooks._State.said_no_server = False
    assert abort({}, environ={}).ok  # no ids either: nothing to say
    assert len(recwarn) == 0
    for _ in range(3):  # nothing flushed is never ok: each report says why, the warning comes once
        report = abort({"session_server_instance_id": "a"}, environ={})
        assert not report.ok and "no agent server configured (AGENT_SERVER_URL and SWE_AGENT_URL" in report.error
    said = [str(w.message) for w in recwarn if "no agent server" in str(w.message)]
    assert len(said) == 1 and "1 instance id(s)" in said[0] and "AGENT_SERVER_URL" in said[0]
    assert recwarn[0].filename == __file__  # it points at the caller's abort(), not at the library


def test_ids_but_no_server_reaches_stderr_with_no_logging_set_up() -> None:
    code = "from swe_flush_sync import abort; abort({'session_server_instance_id': 'a'}, environ={})"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.returncode == 0 and "UserWarning" in out.stderr and "no agent server configured" in out.stderr


HOSTILE = ["a\nCRITICAL swe_flush_sync: all flushed OK", "b\r\x1b[2J", "c\udc80", "d\x1b]0;title\x07"]


def test_ids_cannot_forge_log_lines_or_escape_the_terminal(caplog: pytest.LogCaptureFixture,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG, logger="swe_flush_sync")
    url = f"http://127.0.0.1:{closed_port()}"
    abort({"session_server_instance_ids": HOSTILE}, environ={"AGENT_SERVER_URL": url}, deadline=2)
    assert any("a\\nCRITICAL" in r.getMessage() and "\\x1b[2J" in r.getMessage() for r in caplog.records)
    for record in caplog.records:
        message = record.getMessage()
        assert not any(ch in message for ch in "\n\r\x1b\x07"), message
        message.encode("utf-8", "strict")  # a lone surrogate would break a strict handler
    assert main(["--url", url, "--deadline", "1", *[f"--id={i}" for i in HOSTILE]]) == 1
    out = capsys.readouterr().out
    assert not any(ch in out.replace("\n", "") for ch in "\r\x1b\x07") and out.count("\n") == len(HOSTILE) + 2


LEAKY_URLS = {
    "http://admin:pa55w0rdQ/x@host:9": "pa55w0rdQ",
    "http://admin:12345/s3cr3tpw@127.0.0.1:9": "s3cr3tpw",
    "http://h:9/flush?token=t0k3n": "t0k3n",
    "http://h:9/#t0k3n": "t0k3n",
    "http://user:hunter2@h:9": "hunter2",
}


@pytest.mark.parametrize("url", sorted(LEAKY_URLS))
def test_refused_urls_never_echo_a_password(url: str, caplog: pytest.LogCaptureFixture,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    password = LEAKY_URLS[url]
    with pytest.raises(ConfigError) as info:
        Flusher(url)
    assert password not in str(info.value)
    caplog.set_level(logging.DEBUG)
    report = abort({"session_server_instance_id": "a"}, environ={"AGENT_SERVER_URL": url})
    assert report.error and password not in report.error and password not in caplog.text
    assert main(["--url", url, "--id", "a"]) == 2
    assert main(["--url", url, "--id", "a", "--json"]) == 2
    captured = capsys.readouterr()
    assert password not in captured.out + captured.err


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=30), st.sampled_from(["/", "?", "#", ":", "@", ""]))
def test_no_password_survives_a_refused_url(password: str, sep: str) -> None:
    url = f"http://admin:{password}{sep}zz@127.0.0.1:9/p"
    with pytest.raises(ConfigError) as info:
        Flusher(url)
    assert f"admin:{password}" not in str(info.value)


def test_unknown_options_are_named_never_their_values(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--auth-token=SUPERSECRET"], ["--admin_secret", "SUPERSECRET"], ["--bearer=SUPERSECRET", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "SUPERSECRET" not in err and "unrecognized option" in err


def test_json_errors_are_json_and_messages_name_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", "http://127.0.0.1:9", "--id", "a", "--workers", "0", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert error == {"ok": False, "error": "--workers must be between 1 and 4096, got 0"}


def test_usage_shows_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "swe-flush demo" in out and "swe-flush stub" in out


def test_quiet_prints_only_the_summary(stub: AgentServerStub, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", SECRET)
    assert main(["--url", stub.url, "--id", "a", "--id", "b", "-q"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flushed 2/2 targets")


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_in_the_cli_exits_130_with_the_partial_report(stub: AgentServerStub, presses: int) -> None:
    stub.fault("hung", hang=True)
    proc = spawn([PYTHON, "-m", "swe_flush_sync", "--url", stub.url, "--id", "hung", "--id", "ok", "--deadline", "30"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET))
    end = time.monotonic() + 10
    while set(stub.flushed_ids()) != {"ok"} or not any(r.instance_id == "hung" for r in stub.requests):
        assert time.monotonic() < end, stub.requests
        time.sleep(0.02)
    time.sleep(0.1)  # the CLI has read the answer of "ok" by now
    sent = time.monotonic()
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=10)
    took = time.monotonic() - sent
    assert proc.returncode == 130 and took < 1.5, (out, err)
    assert "Traceback" not in err and "interrupted while in flight" in out and "flushed 1/2" in out


def test_stub_command_serves_until_ctrl_c(tmp_path: object) -> None:
    proc = spawn([PYTHON, "-m", "swe_flush_sync", "stub", "--port", "0", "--secret-env", "STUB_SECRET"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(STUB_SECRET=SECRET))
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert flush(url, ["a"], admin_secret=SECRET).ok
    assert not flush(url, ["a"], admin_secret="wrong").ok
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "Traceback" not in err


def test_agent_server_fixture_from_the_plugin(agent_server: AgentServerStub) -> None:
    agent_server.add_trials("inst-1", 2)
    agent_server.fault("inst-2", statuses=[503])
    report = flush(agent_server.url, ["inst-1", "inst-2"])
    assert report.ok and report.cancelled == 2 and sorted(agent_server.flushed_ids()) == ["inst-1", "inst-2"]


def test_verbose_logs_the_summary_to_stderr(stub: AgentServerStub, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", SECRET)
    logger = logging.getLogger("swe_flush_sync")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))  # undo the CLI's handler afterwards
    monkeypatch.setattr(logger, "level", logger.level)
    assert main(["--url", stub.url, "--id", "a", "-v"]) == 0
    err = capsys.readouterr().err
    assert "INFO swe_flush_sync" in err and "flushed 1/1 targets" in err and SECRET not in err


def test_stub_checks_scoped_bearers() -> None:
    master = "m" * 40
    with AgentServerStub(scoped_secret=master) as scoped:
        report = abort({"session_server_instance_ids": ["a", "b"]},
                       environ={"AGENT_SERVER_URL": scoped.url, "HARBOR_RUN_SECRET": master})
        assert report.ok and sorted(scoped.flushed_ids()) == ["a", "b"]
        static = flush(scoped.url, ["a"], admin_secret=master)
        assert static.results[0].status_code == 401


def test_no_server_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    """1.2.0 logged a WARNING at every step besides the warning: 50 steps, 51 lines. Each report still says it."""
    from swe_flush_sync import _hooks as hooks

    hooks._State.logged_no_server = False
    caplog.set_level(logging.WARNING, logger="swe_flush_sync")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = [abort({"session_server_instance_id": "a"}, environ={}) for _ in range(5)]
    assert all(not report.ok and "no agent server configured" in (report.error or "") for report in reports)
    assert len([r for r in caplog.records if "no agent server configured" in r.getMessage()]) == 1


@pytest.mark.parametrize("hook", ["flush_on_signal", "flush_at_exit"])
def test_a_hook_with_ids_and_no_server_says_so_at_install_and_when_it_fires(hook: str) -> None:
    """1.2.0's hooks said nothing, at install or when they fired, unless the script set up logging."""
    code = textwrap.dedent(f"""
        import os, signal
        from swe_flush_sync import {hook}
        {hook}({{"session_server_instance_id": "a"}}, environ={{}})
        print("INSTALLED", flush=True)
        if "{hook}" == "flush_on_signal":
            signal.raise_signal(signal.SIGTERM)
    """)
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert out.returncode == (-signal.SIGTERM if hook == "flush_on_signal" else 0), out
    installed, _, fired = out.stderr.partition("swe_flush_sync: the signal or exit hook flushed nothing")
    assert f"UserWarning: {hook}: 1 instance id(s) in args but no agent server configured" in installed, out.stderr
    assert fired.count("\n") == 1 and "no agent server configured" in fired, out.stderr
