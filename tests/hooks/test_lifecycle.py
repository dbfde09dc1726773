"""Lifecycle hooks in real subprocesses that really receive signals and really exit."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from swe_flush_sync import ConfigError, abort, abort_async, flush_at_exit, flush_on_signal
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, blocked_in, ours, read_until, spawn, subprocess_env

IDS = ["inst-a", "inst-b", "inst-c"]
PRELUDE = """
import argparse, os, signal, sys, time
from swe_flush_sync import flush_on_signal, flush_at_exit
args = argparse.Namespace()  # filled only after the hooks are installed
def fill_ids():
    args.session_server_instance_ids = {8000: "inst-a", 8001: "inst-b"}
    args.session_server_instance_id = "inst-c"
def ready():
    print("READY", flush=True)
"""


class Child:
    """A Python child running ``PRELUDE + body`` against the stub, killed on demand."""

    def __init__(self, stub: AgentServerStub, body: str, tmp_path: Path | None = None, **env: str) -> None:
        script = PRELUDE + textwrap.dedent(body)
        environ = subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET, **env)
        if tmp_path is not None:
            environ["PYTHONPATH"] = str(tmp_path) + ":" + environ["PYTHONPATH"]
        self.proc = spawn([PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)
        self.stdout: list[str] = []
        self.started = time.monotonic()
        self.signalled: float | None = None

    def wait_for(self, marker: str, timeout: float = 20) -> None:
        if read_until(self.proc, lambda line: line == marker, self.stdout, timeout) is not None:
            return
        self.proc.kill()
        raise AssertionError(f"child never printed {marker}: {self.stdout} {self.proc.stderr.read()}")  # type: ignore[union-attr]

    def kill(self, signum: int = signal.SIGTERM) -> float:
        sent = time.monotonic()
        self.proc.send_signal(signum)
        if self.signalled is None:
            self.signalled = sent
        return sent

    def signal_at(self, marker: str = "READY") -> tuple[int, float, float, str, str]:
        """Wait for ``marker``, send SIGTERM, wait for the exit: (code, sent, ended, out, err)."""
        self.wait_for(marker)
        blocked_in(self.proc.pid)  # in its sleep (also where it sleeps in an import)
        sent = self.kill()
        code, ended, out, err = self.finish()
        return code, sent, ended, out, err

    def finish(self, timeout: float = 30) -> tuple[int, float, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        ended = time.monotonic()
        since = "the signal" if self.signalled else "start"
        print(f"[timing] exited {ended - (self.signalled or self.started):.2f}s after {since}")  # shown with -s
        self.stdout.extend(out.split())
        return self.proc.returncode, ended, " ".join(self.stdout), err


def assert_each_id_flushed_once(stub: AgentServerStub) -> None:
    assert Counter(stub.flushed_ids()) == Counter(IDS), stub.requests


def test_sigterm_flushes_ids_set_after_install_and_dies_of_it(stub: AgentServerStub) -> None:
    child = Child(stub, """
        flush_on_signal(args, deadline=5)
        fill_ids(); ready(); time.sleep(30)
    """)
    code, sent, ended, _out, err = child.signal_at()
    assert code == -signal.SIGTERM, err
    assert_each_id_flushed_once(stub)
    assert {r.authorization for r in stub.requests} == {f"Bearer {SECRET}"}
    assert ended - sent < 5


def test_previous_python_handler_runs_after_the_flush(stub: AgentServerStub) -> None:
    child = Child(stub, """
        def previous(signum, frame):
            print("PREVIOUS", signum, hook.report.ok, len(hook.report.results), flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, previous)
        hook = flush_on_signal(args, deadline=5)
        fill_ids(); ready(); time.sleep(30)
    """)
    code, _, _, out, err = child.signal_at()
    assert code == 7, err
    assert f"PREVIOUS {int(signal.SIGTERM)} True 3" in out
    assert_each_id_flushed_once(stub)


def test_previous_sig_ign_keeps_process_running(stub: AgentServerStub) -> None:
    child = Child(stub, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        hook = flush_on_signal(args, deadline=5)
        fill_ids(); ready()
        while hook.report is None:
            time.sleep(0.01)
        print("ALIVE", hook.report.ok, flush=True)
    """)
    code, _, _, out, err = child.signal_at()
    assert code == 0, err
    assert "ALIVE True" in out
    assert_each_id_flushed_once(stub)


def test_hung_server_still_dies_within_deadline_plus_one_second(stub: AgentServerStub) -> None:
    stub.fault("inst-b", hang=True)
    child = Child(stub, """
        flush_on_signal(args, deadline=2)
        fill_ids(); ready(); time.sleep(30)
    """)
    code, sent, ended, _, err = child.signal_at()
    assert code == -signal.SIGTERM, err
    assert ended - sent < 2 + 1, ended - sent
    assert Counter(stub.flushed_ids()) == Counter(["inst-a", "inst-c"])


def test_two_sigterms_one_flush_and_death(stub_factory) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(secret=SECRET, teardown=0.5)
    child = Child(stub, """
        flush_on_signal(args, deadline=5)
        fill_ids(); ready(); time.sleep(30)
    """)
    child.wait_for("READY")
    child.kill()
    time.sleep(0.05)
    child.kill()
    code, _, _, err = child.finish()
    assert code == -signal.SIGTERM, err
    assert_each_id_flushed_once(stub)


def test_signal_during_slow_logging_emit_does_not_deadlock(stub: AgentServerStub) -> None:
    child = Child(stub, """
        import logging
        class SlowHandler(logging.Handler):
            def emit(self, record):
                print("IN-EMIT", flush=True)
                time.sleep(2)
        logging.basicConfig(level=logging.WARNING, handlers=[SlowHandler()])
        flush_on_signal(args, deadline=3)
        fill_ids(); ready()
        logging.getLogger("trainer").warning("step done")
        time.sleep(30)
    """)
    code, sent, ended, _, err = child.signal_at("IN-EMIT")
    assert code == -signal.SIGTERM, err
    assert_each_id_flushed_once(stub)
    assert max(r.at for r in stub.requests) - sent < 3  # flushed within the deadline, mid-emit
    assert ended - sent < 3 + 2 + 1


def test_signal_during_an_import_does_not_deadlock(stub: AgentServerStub, tmp_path: Path) -> None:
    (tmp_path / "slow_module.py").write_text("import time\nprint('IN-IMPORT', flush=True)\ntime.sleep(3)\n")
    child = Child(stub, """
        flush_on_signal(args, deadline=3)
        fill_ids(); ready()
        import slow_module
        time.sleep(30)
    """, tmp_path=tmp_path)
    code, sent, ended, _, err = child.signal_at("IN-IMPORT")
    assert code == -signal.SIGTERM, err
    assert_each_id_flushed_once(stub)
    assert max(r.at for r in stub.requests) - sent < 3
    assert ended - sent < 3 + 3 + 1


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_flush_at_exit(stub: AgentServerStub, ending: str) -> None:
    child = Child(stub, f"""
        flush_at_exit(args, deadline=5)
        fill_ids(); ready()
        if {ending == "raise"}:
            raise RuntimeError("trainer crashed")
    """)
    code, _, _, err = child.finish()
    assert code == (1 if ending == "raise" else 0), err
    assert ("trainer crashed" in err) == (ending == "raise")
    assert_each_id_flushed_once(stub)


def test_flush_at_exit_is_parallel(stub_factory) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(secret=SECRET, teardown=0.5)
    child = Child(stub, """
        import threading
        args.session_server_instance_ids = {8000 + n: f"i{n}" for n in range(8)}
        args.session_server_instance_id = None
        flush_at_exit(args, deadline=5)
        # a per-step pool left idle, as a trainer would have: the executor refuses work at exit
        from swe_flush_sync import abort
        abort({"session_server_instance_id": "warm"})
        print("EXITING", time.monotonic(), flush=True)
    """)
    code, ended, out, err = child.finish()
    assert code == 0, err
    exiting = float(out.split("EXITING", 1)[1].split()[0])
    assert sorted(stub.flushed_ids()) == sorted([f"i{n}" for n in range(8)] + ["warm"])
    print(f"[timing] exit flush of 8 ids at 0.5 s teardown took {ended - exiting:.2f}s")
    assert ended - exiting < 2.0, ended - exiting  # one by one: 8 x 0.5 = 4 s


def test_signal_flush_is_not_repeated_at_exit(stub: AgentServerStub) -> None:
    child = Child(stub, """
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))
        flush_on_signal(args, deadline=5)
        flush_at_exit(args, deadline=5)
        fill_ids(); ready(); time.sleep(30)
    """)
    code, _, _, _, err = child.signal_at()
    assert code == 3, err
    assert_each_id_flushed_once(stub)


def test_uninstall_restores_and_unregisters(stub: AgentServerStub) -> None:
    child = Child(stub, """
        previous = signal.getsignal(signal.SIGTERM)
        hook = flush_on_signal(args, deadline=5)
        assert hook.installed
        hook.uninstall()
        assert signal.getsignal(signal.SIGTERM) is previous and not hook.installed
        flush_at_exit(args, deadline=5).uninstall()
        fill_ids(); ready(); time.sleep(30)
    """)
    code, _, _, _, err = child.signal_at()
    assert code == -signal.SIGTERM, err
    assert stub.requests == []


def test_abort_async_keeps_the_event_loop_serving(stub_factory) -> None:  # type: ignore[no-untyped-def]
    stub = stub_factory(secret=SECRET, teardown=0.5)
    environ = {"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET}

    async def main() -> tuple[int, object]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        report = await abort_async({"session_server_instance_ids": ["x", "y"]}, environ=environ)
        task.cancel()
        return ticks, report

    ticks, report = asyncio.run(main())
    assert report.ok and sorted(stub.flushed_ids()) == ["x", "y"]  # type: ignore[attr-defined]
    assert ticks >= 20, ticks  # 0.5 s of flushing, a tick every 10 ms


def test_flush_on_signal_off_main_thread_is_a_clear_error() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            flush_on_signal({"session_server_instance_id": "x"})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(5)
    [error] = errors
    assert isinstance(error, ConfigError) and "main thread" in str(error)


def test_hook_options_are_validated_at_install() -> None:
    with pytest.raises(ConfigError, match="deadline"):
        flush_on_signal({}, deadline=0)
    with pytest.raises(ConfigError, match="retries must be an int"):
        flush_at_exit({}, retries="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        flush_at_exit({}, no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="signals"):
        flush_on_signal({}, signals=(signal.SIGKILL,))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL or sys.platform != "linux"


def test_flush_at_exit_when_no_thread_can_start(stub: AgentServerStub) -> None:
    """Where no thread can start at all (not even the hook's standby threads): one pair after another."""
    child = Child(stub, """
        import threading
        def start(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        threading.Thread.start = start
        flush_at_exit(args, deadline=5)
        fill_ids(); ready()
    """)
    code, _, _, err = child.finish()
    assert code == 0, err
    assert_each_id_flushed_once(stub)
    assert len({r.connection for r in stub.requests}) == 1  # one after another, on one connection


def test_exit_flush_logs_its_summary_on_every_python(stub: AgentServerStub) -> None:
    """Python 3.12 starts no thread at exit: the summary is logged from a standby thread."""
    child = Child(stub, """
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
        flush_at_exit(args, deadline=5)
        fill_ids(); ready()
    """)
    code, _, out, err = child.finish()
    assert code == 0, err
    assert "swe_flush_sync: flushed 3/3 targets" in out, out


def _standby_threads() -> list[threading.Thread]:
    return [t for t in ours() if t.name == "swe-flush-standby"]


def _count_settles(expected: int, timeout: float = 1.0) -> bool:
    end = time.monotonic() + timeout
    while len(_standby_threads()) != expected and time.monotonic() < end:
        time.sleep(0.01)
    return len(_standby_threads()) == expected


def test_standby_threads_live_only_while_a_hook_is_installed() -> None:
    assert _count_settles(0, 2.0)  # whatever earlier tests installed is gone
    args = {"session_server_instance_id": "x"}
    hook = flush_on_signal(args, signals=(signal.SIGUSR2,), max_workers=4)
    assert len(_standby_threads()) == 4
    exit_hook = flush_at_exit(args, max_workers=2)
    assert len(_standby_threads()) == 4  # kept: the most any hook wants
    hook.uninstall()
    hook.uninstall()  # idempotent: lets go once
    assert len(_standby_threads()) == 4  # the exit hook still holds them
    exit_hook.uninstall()
    assert _count_settles(0), "the last uninstall ends them within a second"
    again = flush_on_signal(args, signals=(signal.SIGUSR2,), max_workers=3)
    assert len(_standby_threads()) == 3  # a later hook starts them again
    again.uninstall()
    assert _count_settles(0)


def test_a_hook_that_fired_lets_its_standby_threads_go() -> None:
    assert _count_settles(0, 2.0)
    called: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: called.append(signum))
    try:
        hook = flush_on_signal({"session_server_instance_id": "x"}, signals=(signal.SIGUSR2,), max_workers=4,
                               environ={})
        assert len(_standby_threads()) == 4
        signal.raise_signal(signal.SIGUSR2)  # no server configured: nothing sent (and said), then the handler before
        assert called == [signal.SIGUSR2] and hook.report is not None and hook.report.results == ()
        assert "no agent server configured" in (hook.report.error or "")
        assert _count_settles(0), "a hook that has fired ends its standby threads within a second"
        hook.uninstall()
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_bad_entry_of_the_server_list_is_skipped_and_named_and_the_good_ones_flushed(stub: AgentServerStub) -> None:
    """1.1: one mistyped entry of AGENT_SERVER_URL stopped the good server from being flushed, with no word of which."""
    environ = {"AGENT_SERVER_URL": f"http//typo:9, {stub.url}", "HARBOR_ADMIN_SECRET": SECRET}
    report = abort({"session_server_instance_ids": ["x", "y"]}, environ=environ, until_idle=False)
    assert sorted(stub.flushed_ids()) == ["x", "y"] and all(result.ok for result in report.results)
    assert not report.ok and report.error is not None
    assert "skipped AGENT_SERVER_URL: 'http//typo:9' must start with http://" in report.error
    only_bad = abort({"session_server_instance_ids": ["z"]}, environ={"AGENT_SERVER_URL": "ftp://x"})
    assert not only_bad.ok and only_bad.results == () and "ftp://x" in (only_bad.error or "")
