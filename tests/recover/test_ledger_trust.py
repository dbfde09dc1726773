"""What ``recover`` may believe (issue 28): bearers only to the servers it was given, ledgers and
records only of this user, pids only in this PID namespace, and a zombie as dead as it will get."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from swe_flush_sync import ConfigError, Watchdog, recover, watchdog
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, gone, proc_stat, subprocess_env, wait_until
from ..helpers import (
    ENV,
    IDS,
    Trainer,
    namespace_init,
    needs_unshare,
    records,
    write_record,
)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")


def test_a_bearer_goes_only_to_the_servers_recover_was_given(stub: AgentServerStub,
                                                              stub_factory: Callable[..., AgentServerStub],
                                                              tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    listener = stub_factory()  # records every Authorization header it is sent
    foreign = write_record(tmp_path, "foreign", ["steal-me"], listener.url)
    mixed = write_record(tmp_path, "mixed", ["half"], stub.url, urls=[stub.url, listener.url])
    ours = write_record(tmp_path, "ours", ["ours-a", "ours-b"], stub.url)
    before = foreign.read_bytes()
    env = {**ENV, "AGENT_SERVER_URL": stub.url}  # the servers come from the environment, as abort's do
    with caplog.at_level("WARNING", logger="swe_flush_sync"):
        report = recover(str(tmp_path), environ=env)
    assert listener.requests == [] and listener.connections == 0
    assert sorted(stub.flushed_ids()) == ["ours-a", "ours-b"] and not ours.exists()
    assert not report.ok and report.error == "left 2 record(s) alone (2 naming a server recover was not given)"
    assert foreign.read_bytes() == before and mixed.exists() and records(tmp_path) == [foreign, mixed]
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert sum("foreign.json" in message and "left alone" in message for message in warnings) == 1
    assert sum("mixed.json" in message and "left alone" in message for message in warnings) == 1
    assert SECRET not in caplog.text

    named = recover(str(tmp_path), servers=[stub.url, listener.url], environ=ENV)  # named explicitly: trusted
    assert named.ok and sorted(listener.flushed_ids()) == ["half", "steal-me"] and records(tmp_path) == []


@pytest.mark.parametrize("how", ["mode 0777", "mode 0770", "another owner"])
def test_a_ledger_others_may_write_is_not_touched(stub: AgentServerStub, tmp_path: Path, how: str) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir(mode=0o700)
    record = write_record(ledger, "lost", ["lost-a"], stub.url)
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("needs root (chown to another uid)")
        os.chown(ledger, 4242, 4242)
    else:
        ledger.chmod(int(how.split()[1], 8))
    report = recover(str(ledger), servers=stub.url, environ=ENV)
    assert not report.ok and report.results == () and report.error is not None
    assert str(ledger) in report.error and ("writable by its group or others" in report.error
                                            or "owned by uid 4242" in report.error)
    assert stub.requests == [] and records(ledger) == [record] and sorted(os.listdir(ledger)) == ["lost.json"]
    cli = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(ledger), "--url", stub.url],
                         capture_output=True, text=True, env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET), timeout=60)
    assert cli.returncode == 1 and "nothing in it was flushed" in cli.stdout + cli.stderr
    assert stub.requests == [] and records(ledger) == [record]


def test_records_others_could_write_are_left_alone(stub: AgentServerStub, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    shared = write_record(tmp_path, "shared", ["shared-a"], stub.url)
    shared.chmod(0o666)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    target = write_record(elsewhere, "x", ["linked-a"], stub.url)
    (tmp_path / "linked.json").symlink_to(target)
    good = write_record(tmp_path, "good", ["good-a"], stub.url)
    with caplog.at_level("WARNING", logger="swe_flush_sync"):
        report = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert stub.flushed_ids() == ["good-a"] and not good.exists()
    assert not report.ok and report.error == "left 2 record(s) alone (1 a symbolic link, 1 another user could have " \
                                             "written)"
    assert shared.exists() and (tmp_path / "linked.json").is_symlink() and target.exists()
    assert "shared.json is writable by its group or others (mode 0666); left alone" in caplog.text
    assert "linked.json is a symbolic link; left alone" in caplog.text
    shutil.rmtree(elsewhere)


@root_only
def test_a_record_another_user_owns_is_left_alone(stub: AgentServerStub, tmp_path: Path) -> None:
    theirs = write_record(tmp_path, "theirs", ["theirs-a"], stub.url)
    os.chown(theirs, 4242, 4242)
    good = write_record(tmp_path, "good", ["good-a"], stub.url)
    report = recover(str(tmp_path), servers=stub.url, environ=ENV)
    assert stub.flushed_ids() == ["good-a"] and not good.exists() and theirs.exists()
    assert not report.ok and report.error == "left 1 record(s) alone (1 another user could have written)"
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "recover", str(tmp_path), "--url", stub.url, "--json"],
                         capture_output=True, text=True, env=subprocess_env(**ENV), timeout=30)
    assert out.returncode == 1 and json.loads(out.stdout)["error"] == report.error  # the CLI says it and fails


def test_watchdog_refuses_a_ledger_others_may_write(stub: AgentServerStub, tmp_path: Path,
                                                    arm_in_process: Callable[..., Watchdog]) -> None:
    args = argparse.Namespace(session_server_instance_id="x")
    env = {"AGENT_SERVER_URL": stub.url}
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ConfigError, match=r"^ledger: the directory is writable by its group or others \(mode 0777\)"):
        watchdog(args, environ=env, ledger=str(open_dir))
    with pytest.raises(ConfigError, match=r"^SWE_FLUSH_LEDGER: the directory is writable"):
        watchdog(args, environ={**env, "SWE_FLUSH_LEDGER": str(open_dir)})
    assert oct(open_dir.stat().st_mode & 0o777) == "0o777"  # an existing directory's mode is never changed
    assert stub.requests == []

    made = tmp_path / "made" / "ledger"
    dog = arm_in_process(args, environ=env, ledger=str(made))
    assert oct(made.stat().st_mode & 0o777) == "0o700"
    dog.disarm()
    kept = tmp_path / "kept"
    kept.mkdir()
    kept.chmod(0o750)
    dog = arm_in_process(args, environ=env, ledger=str(kept))
    assert oct(kept.stat().st_mode & 0o777) == "0o750"


@needs_unshare
def test_a_live_trainer_in_another_pid_namespace_is_left_alone(stub: AgentServerStub, tmp_path: Path) -> None:
    for instance_id in IDS:
        stub.add_trials(instance_id, 2)
    unshare = Trainer(stub, f"""
        dog = watchdog(args, ledger={str(tmp_path)!r})
        print("ARMED", os.getpid(), dog.pid, flush=True)
        time.sleep(60)
    """, contained=True).proc
    init = namespace_init(unshare)
    try:
        assert unshare.stdout is not None
        line = unshare.stdout.readline().split()
        assert line[:2] == ["ARMED", "1"], line  # PID 1 inside: a pid that names another process out here
        [record] = records(tmp_path)
        report = recover(str(tmp_path), servers=stub.url, environ=ENV)
        assert report.ok and report.results == () and stub.requests == []
        assert records(tmp_path) == [record] and [stub.trials(i) for i in IDS] == [2, 2, 2]
    finally:
        os.kill(init, signal.SIGKILL)  # the container's main process: the kernel takes its namespace along
        unshare.wait(10)


def test_a_trainer_killed_but_not_reaped_is_gone(stub: AgentServerStub, tmp_path: Path) -> None:
    for instance_id in IDS:
        stub.add_trials(instance_id, 1)
    trainer = Trainer(stub, f"""
        armed(watchdog(args, ledger={str(tmp_path)!r}))
        time.sleep(60)
    """)
    watchdog_pid = trainer.armed()
    os.kill(watchdog_pid, signal.SIGKILL)
    assert wait_until(lambda: gone(watchdog_pid), 2.0)
    os.kill(trainer.proc.pid, signal.SIGKILL)  # and nobody reaps it (its Popen is not polled)

    def zombie() -> bool:
        return proc_stat(trainer.proc.pid)[0] == b"Z"

    assert wait_until(zombie, 2.0)
    report = recover(str(tmp_path), servers=stub.url, environ=ENV, until_idle=False)
    assert zombie()  # still unreaped while recover judged it
    assert report.ok and sorted(stub.flushed_ids()) == sorted(IDS) and records(tmp_path) == []
