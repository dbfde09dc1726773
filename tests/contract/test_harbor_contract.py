"""swe_flush_sync against a real FastAPI server with the Harbor bridge's /flush semantics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.util
import inspect
import json
import logging
import signal
import subprocess
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from swe_flush_sync import ScopedBearer, abort, flush
from swe_flush_sync._cli.main import main

from ..conftest import PYTHON, blocked_in, spawn, subprocess_env
from .conftest import Harbor
from .harbor_app import scoped_bearer

MASTER = "master-secret-" + "x" * 40
ADMIN = "admin-secret-never-logged"
TOKEN = "auth-token-never-logged"
IDS = ["inst-a", "inst-b", "inst-c"]
HarborFactory = Callable[..., Harbor]


def start_trials(harbor: Harbor, instance_id: str, count: int) -> None:
    requests.post(f"{harbor.url}/trials", json={"session_server_instance_id": instance_id, "count": count},
                  timeout=5).raise_for_status()


def args_for(ids: list[str]) -> dict[str, object]:
    return {"session_server_instance_ids": {8000 + n: i for n, i in enumerate(ids)},
            "session_server_instance_id": ids[0]}


def test_the_app_mirrors_the_bridge(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory(admin_secret=ADMIN)
    bad_body = requests.post(f"{harbor.url}/flush", json={"id": 1}, headers={"Authorization": f"Bearer {ADMIN}"},
                             timeout=5)
    assert bad_body.status_code == 422
    assert requests.post(f"{harbor.url}/flush", json={"session_server_instance_id": "a"}, timeout=5).status_code == 401
    assert requests.post(f"{harbor.url}/nope", json={}, timeout=5).status_code == 404


def test_static_admin_secret_flushes_and_counts(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, teardown=0.1)
    start_trials(harbor, "inst-a", 3)
    report = flush(harbor.url + "/", IDS, admin_secret=ADMIN)
    assert report.ok and report.cancelled == 3
    wrong = flush(harbor.url, IDS, admin_secret="wrong")
    assert {r.error for r in wrong.results} == {"HTTP 401: unauthorized: wrong or missing bearer secret"}


@pytest.mark.parametrize("variable", ["HARBOR_ADMIN_SECRET", "MILES_HARBOR_AUTH_TOKEN", "AGENT_SERVER_AUTH_TOKEN"])
def test_each_static_variable_is_read(harbor_factory: HarborFactory, variable: str) -> None:
    harbor = harbor_factory(auth_token=TOKEN)  # no admin secret: the bridge takes its auth token
    report = abort(args_for(IDS), environ={"AGENT_SERVER_URL": harbor.url, variable: TOKEN})
    assert report.ok and Counter(harbor.stats.flushes) == dict.fromkeys(IDS, 1)


def test_variables_are_tried_in_order(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory(admin_secret=ADMIN)
    env = {"AGENT_SERVER_URL": harbor.url, "HARBOR_ADMIN_SECRET": " ", "MILES_HARBOR_AUTH_TOKEN": ADMIN,
           "AGENT_SERVER_AUTH_TOKEN": "later", "HARBOR_RUN_SECRET": MASTER}
    assert abort(args_for(IDS), environ=env).ok  # blank counts as unset; the first set static bearer wins


def test_open_server_needs_no_secret(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory()
    assert abort(args_for(IDS), environ={"AGENT_SERVER_URL": harbor.url}).ok


def test_scoped_bearers_from_the_run_secret(harbor_factory: HarborFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    harbor = harbor_factory(run_secret=MASTER, teardown=0.05)
    start_trials(harbor, "inst-b", 2)
    ids = [*IDS, "../escape", "x" * 129]
    report = abort(args_for(ids), environ={"AGENT_SERVER_URL": harbor.url, "HARBOR_RUN_SECRET": MASTER})
    by_id = {r.instance_id: r for r in report.results}
    assert all(by_id[i].ok for i in IDS) and report.cancelled == 2
    for bad in ("../escape", "x" * 129):
        assert not by_id[bad].ok and by_id[bad].attempts == 0
        assert "cannot have a scoped bearer" in (by_id[bad].error or "")
    assert Counter(harbor.stats.flushes) == dict.fromkeys(IDS, 1)  # the bad ids were never sent
    derived = [scoped_bearer(MASTER, i) for i in IDS]
    shown = caplog.text + json.dumps(report.to_dict()) + repr(report) + report.summary()
    assert MASTER not in shown and not any(token in shown for token in derived)
    static = abort(args_for(IDS), environ={"AGENT_SERVER_URL": harbor.url, "HARBOR_ADMIN_SECRET": MASTER})
    assert {r.status_code for r in static.results} == {401}  # a scoped server accepts only the derived bearer


def test_scoped_derivation_matches_an_independent_hmac() -> None:
    for instance_id in ["inst-1", "A.b_c-9", "z" * 128]:
        expected = hmac.new(MASTER.encode("utf-8"), b"miles-harbor-flush-session-v1\x00session:"
                            + instance_id.encode("utf-8"), hashlib.sha256).hexdigest()
        assert ScopedBearer(MASTER)(instance_id) == expected


@pytest.mark.parametrize("value", ["short", "y" * 4097, "x" * 20 + "\r\n" + "x" * 20, "x" * 40 + "\n"])
def test_bad_run_secret_is_a_config_error_naming_the_variable(harbor_factory: HarborFactory, value: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    harbor = harbor_factory(run_secret=MASTER)
    caplog.set_level(logging.DEBUG)
    report = abort(args_for(IDS), environ={"AGENT_SERVER_URL": harbor.url, "HARBOR_RUN_SECRET": value})
    assert report.error is not None and "HARBOR_RUN_SECRET" in report.error
    assert value.strip() not in report.error and value.strip() not in caplog.text
    assert caplog.text.count("did not flush: ") == 1 and harbor.stats.flushes == []


def test_per_step_aborts_never_interrupt_a_teardown(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, teardown=1.0)
    for instance_id in IDS:
        start_trials(harbor, instance_id, 2)
    env = {"AGENT_SERVER_URL": harbor.url, "HARBOR_ADMIN_SECRET": ADMIN}
    for _ in range(3):
        abort(args_for(IDS), environ=env, deadline=0.2)
    final = abort(args_for(IDS), environ=env, deadline=3)
    assert final.ok and all(r.joined for r in final.results) and final.cancelled == 6
    assert harbor.stats.interrupted_teardowns == 0 and Counter(harbor.stats.flushes) == dict.fromkeys(IDS, 1)


def test_drop_in_abort_hook_loaded_from_a_file(harbor_factory: HarborFactory, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    harbor = harbor_factory(run_secret=MASTER)
    monkeypatch.setenv("AGENT_SERVER_URL", harbor.url)
    monkeypatch.setenv("HARBOR_RUN_SECRET", MASTER)
    path = tmp_path / "my_abort_hook.py"
    path.write_text("from swe_flush_sync import abort_async as abort\n")
    spec = importlib.util.spec_from_file_location("my_abort_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = asyncio.run(module.abort(args_for(IDS)))
    assert report.ok and Counter(harbor.stats.flushes) == dict.fromkeys(IDS, 1)


def test_cli_against_the_server(harbor_factory: HarborFactory, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    harbor = harbor_factory(run_secret=MASTER)
    monkeypatch.setenv("HARBOR_RUN_SECRET", MASTER)
    assert main(["--url", harbor.url, "--id", "inst-a", "--id", "inst-b", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["ok"] is True and MASTER not in out and scoped_bearer(MASTER, "inst-a") not in out


@pytest.mark.parametrize("hook", ["signal", "exit"])
def test_hooks_in_a_real_process(harbor_factory: HarborFactory, hook: str) -> None:
    harbor = harbor_factory(run_secret=MASTER, teardown=0.1)
    body = f"""
        import time
        from swe_flush_sync import flush_at_exit, flush_on_signal
        args = {args_for(IDS)!r}
        {"flush_on_signal(args, deadline=5)" if hook == "signal" else "flush_at_exit(args, deadline=5)"}
        print("READY", flush=True)
        {"time.sleep(30)" if hook == "signal" else ""}
    """
    proc = spawn([PYTHON, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 env=subprocess_env(AGENT_SERVER_URL=harbor.url, HARBOR_RUN_SECRET=MASTER))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    if hook == "signal":
        assert blocked_in(proc.pid)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == (-signal.SIGTERM if hook == "signal" else 0), err
    assert Counter(harbor.stats.flushes) == dict.fromkeys(IDS, 1)


def test_until_idle_stops_the_runs_queued_behind_the_bridges_slots(harbor_factory: HarborFactory) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, teardown=0.05, max_concurrent=8)
    start_trials(harbor, "inst-a", 20)  # 8 running, 12 waiting for a slot
    one_pass = flush(harbor.url, ["inst-a"], admin_secret=ADMIN)
    assert one_pass.cancelled == 8
    time.sleep(0.2)
    assert harbor.stats.running_or_waiting() == 12  # the waiting runs took the slots and go on
    [result] = flush(harbor.url, ["inst-a"], admin_secret=ADMIN, until_idle=True).results
    assert result.ok and result.idle is True and result.cancelled == 12 and result.passes == 3  # 8, 4, 0
    time.sleep(0.2)
    assert harbor.stats.running_or_waiting() == 0 and harbor.stats.interrupted_teardowns == 0


def test_until_idle_drop_in_hook_with_ids_sharing_the_bridges_slots(harbor_factory: HarborFactory, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    harbor = harbor_factory(admin_secret=ADMIN, teardown=0.05, max_concurrent=8)
    start_trials(harbor, "inst-a", 8)
    start_trials(harbor, "inst-b", 8)  # all waiting behind inst-a's runs
    monkeypatch.setenv("AGENT_SERVER_URL", harbor.url)
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", ADMIN)
    path = tmp_path / "my_abort_hook.py"  # the README's drop-in hook, as written there
    path.write_text("import functools\nfrom swe_flush_sync import abort_async\n"
                    "abort = functools.partial(abort_async, until_idle=True)\n")
    spec = importlib.util.spec_from_file_location("my_abort_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert inspect.iscoroutinefunction(module.abort)
    report = asyncio.run(module.abort(args_for(["inst-a", "inst-b"])))
    assert report.ok and report.cancelled == 16 and all(r.idle for r in report.results)
    time.sleep(0.2)
    assert harbor.stats.running_or_waiting() == 0 and harbor.stats.interrupted_teardowns == 0
