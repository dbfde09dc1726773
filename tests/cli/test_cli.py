"""The swe-flush command line: exit codes, output, input files, the demo."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from swe_flush_sync import recover
from swe_flush_sync._cli.main import USAGE, main
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, subprocess_env


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_all_flushed_exit_0_table(stub: AgentServerStub, secret_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stub.add_trials("a", 2)
    code, out, err = run(["--url", stub.url, "--id", "a", "--id", "b", "--secret-file", str(secret_file)], capsys)
    assert code == 0, err
    assert "INSTANCE" in out and "flushed 2/2 targets" in out and "2 trials cancelled" in out
    # until idle by default: the round cancelled 2, so both ids went again, and the next round cancelled 0
    assert sorted(stub.flushed_ids()) == ["a", "a", "b", "b"]


def test_failure_exit_1_json(stub: AgentServerStub, secret_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stub.fault("b", statuses=[404])
    code, out, _ = run(["--url", stub.url, "--id", "a", "--id", "b", "--json", "--secret-file", str(secret_file)],
                       capsys)
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False and [r["ok"] for r in data["results"]] == [True, False]
    assert data["results"][1]["status_code"] == 404 and SECRET not in out


def test_env_urls_and_secret(stub: AgentServerStub, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AGENT_SERVER_URL", stub.url)
    monkeypatch.setenv("MILES_HARBOR_AUTH_TOKEN", SECRET)
    code, _, err = run(["--id", "a"], capsys)
    assert code == 0, err
    assert stub.requests[0].authorization == f"Bearer {SECRET}"


def test_nothing_to_do_exit_0(stub: AgentServerStub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--url", stub.url], capsys)
    assert code == 0 and "nothing to flush" in out and stub.requests == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('["a", "b", "a"]', ["a", "b"]),
        ('{"8000": "a", "8001": "b"}', ["a", "b"]),
        ('{"session_server_instance_ids": {"1": "a"}, "session_server_instance_id": "c"}', ["a", "c"]),
    ],
)
def test_ids_json_shapes(stub: AgentServerStub, secret_file: Path, tmp_path: Path, content: str,
                         expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(content)
    code, _, err = run(["--url", stub.url, "--ids-json", str(ids_file), "--secret-file", str(secret_file)], capsys)
    assert code == 0, err
    assert sorted(stub.flushed_ids()) == expected


def test_ids_json_from_stdin(stub: AgentServerStub, secret_file: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('["s1"]'))
    code, _, _ = run(["--url", stub.url, "--ids-json", "-", "--secret-file", str(secret_file)], capsys)
    assert code == 0 and stub.flushed_ids() == ["s1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--id", "a"], "no agent server URL"),
        (["--url", "ftp://x", "--id", "a"], "--url: ftp://x must start with http"),
        (["--url", "http://u:pw@h:1", "--id", "a"], "***@"),
        (["--url", "http//127.0.0.1:9", "--id", "a"], "--url: 'http//127.0.0.1:9' must start with http"),
        (["--url", "http://h:1", "--id", ""], "--id was given an empty value"),
        (["--url", "http://h:1", "--ids-json", "/nonexistent/ids.json"], "--ids-json: cannot read"),
        (["--url", "http://h:1", "--secret-file", "/nonexistent/secret"], "--secret-file: cannot read"),
        (["--url", "http://h:1", "--deadline", "0", "--id", "a"], "deadline must be > 0"),
        (["--url", "http://h:1", "--workers", "0", "--id", "a"], "--workers must be between 1"),
        (["--url", "http://h:1", "--retries", "-1", "--id", "a"], "retries must be between 0"),
        (["--deadline", "soon"], "invalid float value"),
        (["--no-such-flag"], "unrecognized option(s): --no-such-flag"),
        (["--secret", "hunter2", "--id", "a"], "never taken as a flag value"),
        (["--token=hunter2"], "never taken as a flag value"),
        (["--secret-f", "x"], "unrecognized option(s): --secret-f"),
        (["--url", "http://h:1", "--id", "a", "--until-idle", "--one-pass"], "not allowed with argument"),
    ],
)
def test_usage_and_config_errors_exit_2_one_line(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert "pw@" not in err and "hunter2" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "is not valid JSON"), ("42", "must hold a list of ids"),
     ('[1, 2]', "ids must be str"), ('"a"', "must hold a list")],
)
def test_bad_ids_json_exit_2(tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(content)
    code, _, err = run(["--url", "http://h:1", "--ids-json", str(ids_file)], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_empty_secret_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "secret"
    empty.write_text("  \n")
    code, _, err = run(["--url", "http://h:1", "--id", "a", "--secret-file", str(empty)], capsys)
    assert code == 2 and "is empty" in err


def test_module_entry_point_and_demo_subprocess() -> None:
    proc = subprocess.run([PYTHON, "-m", "swe_flush_sync", "demo", "--instances", "4", "--teardown", "0.2"],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "flushed 4/4 targets" in proc.stdout and "one by one it would have taken" in proc.stdout
    assert "Trials left running or waiting: 0" in proc.stdout
    bad = subprocess.run([PYTHON, "-m", "swe_flush_sync", "--url", "nope", "--id", "x"],
                         capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["demo", "--instances", "3", "--teardown", "0.1", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ok"] and len(data["results"]) == 3 and data["trials_left"] == 0
    assert data["one_by_one_seconds"] >= 3 * 0.1


def test_a_one_pass_demo_with_waiting_runs_says_why_it_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["demo", "--instances", "4", "--teardown", "0.05", "--max-concurrent", "4"], capsys)
    assert code == 1 and "one pass leaves them running" in out and "--until-idle flushes again" in out
    code, out, _ = run(["demo", "--instances", "4", "--teardown", "0.05", "--max-concurrent", "4", "--until-idle"],
                       capsys)
    assert code == 0 and "Trials left running or waiting: 0." in out


def test_demo_watchdog_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["demo", "--watchdog", "--instances", "3", "--teardown", "0.05", "--max-concurrent", "4",
                        "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["trials_started"] == 9 and data["trials_left"] == 0
    assert f"swe-flush watchdog for pid {data['trainer_pid']}: trainer gone; flushed 3/3 targets" \
        in data["watchdog_said"]
    assert data["flush_requests"] >= 3 and data["watchdog_exited_after_seconds"] < 11
    assert not Path(f"/proc/{data['watchdog_pid']}/cmdline").exists() or \
        Path(f"/proc/{data['watchdog_pid']}/cmdline").read_bytes() == b""  # gone (or a zombie for init)


# -- a new user's stumbles (issue 42): each says what was typed and what to type -------------------------
def _cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "swe_flush_sync", *argv], capture_output=True, text=True, timeout=30,
                          env=subprocess_env(**env))


def test_recover_on_a_missing_folder_or_a_file_exits_2_with_one_line(tmp_path: Path) -> None:
    missing = _cli("recover", str(tmp_path / "nope"), "--url", "http://127.0.0.1:9")
    assert missing.returncode == 2 and missing.stdout == "" and missing.stderr.count("\n") == 1
    assert f"{tmp_path / 'nope'} does not exist: give the ledger directory" in missing.stderr
    a_file = tmp_path / "file"
    a_file.write_text("x")
    on_a_file = _cli("recover", str(a_file), "--url", "http://127.0.0.1:9")
    assert on_a_file.returncode == 2 and f"{a_file} is a file, not the ledger directory" in on_a_file.stderr


def test_the_library_recover_at_a_first_start_stays_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="swe_flush_sync"):
        report = recover(str(tmp_path / "not-yet"), servers="http://127.0.0.1:9")
    assert report.ok and report.results == () and caplog.records == []


def test_recover_speaks_cli(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir(mode=0o700)
    no_server = _cli("recover", str(ledger))
    assert no_server.returncode == 2 and "pass --url URL (or set AGENT_SERVER_URL or SWE_AGENT_URL)" in no_server.stderr
    assert "servers=" not in no_server.stderr
    flag = _cli("recover", "--ledger", str(ledger), "--url", "http://127.0.0.1:9")
    assert flag.returncode == 2
    assert "the ledger directory is positional: swe-flush recover DIR --url URL" in flag.stderr
    assert str(ledger) not in flag.stderr  # values are never shown


@pytest.mark.parametrize("content", ['[{"x": 1}]', '{"8000": [1, 2]}', '"abc"'])
def test_ids_json_names_the_shape_it_wants(tmp_path: Path, content: str) -> None:
    path = tmp_path / "ids.json"
    path.write_text(content)
    out = _cli("--url", "http://127.0.0.1:9", "--ids-json", str(path))
    assert out.returncode == 2
    assert 'must hold a list of ids (["a", "b"]), an object of port -> id ({"8000": "a"}), or an object holding ' \
           "session_server_instance_ids and/or session_server_instance_id" in out.stderr


@pytest.mark.parametrize(("typed", "shown_as"), [("127.0.0.1:8000", "'127.0.0.1:8000'"),
                                                 ("http//admin:hunter2@host/x", "'***@host/x'")])
def test_a_bad_url_shows_what_was_typed_without_credentials(typed: str, shown_as: str) -> None:
    out = _cli("--url", typed, "--id", "a")
    assert out.returncode == 2 and f"--url: {shown_as} must start with http:// or https://" in out.stderr
    assert "hunter2" not in out.stderr


def test_the_stub_server_is_loaded_only_for_demo_and_stub(stub: AgentServerStub) -> None:
    probe = ("import sys; from swe_flush_sync._cli.main import main; code = main(sys.argv[1:]); "
             "print(code, 'swe_flush_sync._stub' in sys.modules, 'swe_flush_sync._cli.demo' in sys.modules)")
    flush = subprocess.run([PYTHON, "-c", probe, "--url", stub.url, "--id", "a", "-q"], capture_output=True,
                           text=True, env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET), timeout=60)
    assert flush.stdout.splitlines()[-1] == "0 False False", flush.stdout + flush.stderr
    demo = subprocess.run([PYTHON, "-c", probe, "demo", "--instances", "1", "--teardown", "0"], capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert demo.stdout.splitlines()[-1] == "0 True True", demo.stdout + demo.stderr


@pytest.mark.parametrize("command", [[], ["demo"], ["recover"], ["guard"], ["doctor"], ["stub"]])
def test_help_fits_80_columns(command: list[str]) -> None:
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", *command, "--help"], capture_output=True, text=True,
                         timeout=60, env=subprocess_env(COLUMNS="80"))
    assert out.returncode == 0 and max(map(len, out.stdout.splitlines())) <= 80, out.stdout


def test_the_usage_in_cli_md_is_the_commands_own() -> None:
    page = (Path(__file__).parent.parent.parent / "docs" / "cli.md").read_text()
    block = page.split("## Usage\n\n```\n", 1)[1].split("```", 1)[0]
    documented = [line for line in block.splitlines() if not line.startswith("python -m")]
    assert " ".join(" ".join(documented).split()) == " ".join(USAGE.split())
