"""Every path where the trainer is ending leaves nothing queued on the server (issue 42): the signal
hook, the exit hook and ``swe-flush`` flush until idle by default, against a stub with 2 slots
and 10 runs of the trainer's id, in real processes that really get the signal and really exit."""

from __future__ import annotations

import signal
import subprocess
import textwrap
from collections.abc import Callable

import pytest

from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, blocked_in, read_until, spawn, subprocess_env

TRAINER = """
import argparse, sys, time
from swe_flush_sync import flush_at_exit, flush_on_signal
args = argparse.Namespace(session_server_instance_id="ending")
{hook}
print("READY", flush=True)
{then}
"""


def _busy_server(stub_factory: Callable[..., AgentServerStub]) -> AgentServerStub:
    stub = stub_factory(secret=SECRET, teardown=0.05, max_concurrent=2)
    stub.add_trials("ending", 10)  # 2 running, 8 waiting for a slot
    assert (stub.trials("ending"), stub.waiting("ending")) == (2, 8)
    return stub


def _trainer(stub: AgentServerStub, hook: str, then: str) -> subprocess.Popen[str]:
    proc = spawn([PYTHON, "-c", textwrap.dedent(TRAINER.format(hook=hook, then=then))], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, env=subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET))
    assert read_until(proc, lambda line: line == "READY", []) is not None
    return proc


@pytest.mark.parametrize("one_pass", [False, True], ids=["default", "until_idle=False"])
def test_the_signal_hook_leaves_nothing_queued(stub_factory: Callable[..., AgentServerStub], one_pass: bool) -> None:
    stub = _busy_server(stub_factory)
    option = ", until_idle=False" if one_pass else ""
    trainer = _trainer(stub, f"flush_on_signal(args, deadline=10{option})", "time.sleep(60)")
    assert blocked_in(trainer.pid)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(20) == -signal.SIGTERM
    left = stub.trials("ending") + stub.waiting("ending")
    assert (left > 0) if one_pass else (left == 0), left  # one pass cancels the 2 running; 8 start after it


@pytest.mark.parametrize("one_pass", [False, True], ids=["default", "until_idle=False"])
def test_the_exit_hook_leaves_nothing_queued(stub_factory: Callable[..., AgentServerStub], one_pass: bool) -> None:
    stub = _busy_server(stub_factory)
    option = ", until_idle=False" if one_pass else ""
    trainer = _trainer(stub, f"flush_at_exit(args, deadline=10{option})", "sys.exit(0)")
    assert trainer.wait(20) == 0
    left = stub.trials("ending") + stub.waiting("ending")
    assert (left > 0) if one_pass else (left == 0), left


@pytest.mark.parametrize("flag", [[], ["--one-pass"]], ids=["default", "--one-pass"])
def test_the_cli_leaves_nothing_queued(stub_factory: Callable[..., AgentServerStub], flag: list[str]) -> None:
    stub = _busy_server(stub_factory)
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "--url", stub.url, "--id", "ending", "--deadline", "10",
                          "-q", *flag], capture_output=True, text=True, timeout=60,
                         env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET))
    assert out.returncode == 0, out.stderr
    left = stub.trials("ending") + stub.waiting("ending")
    assert (left > 0) if flag else (left == 0), left
