"""The ownership protocol as a model (issue 61): hypothesis drives real guards and real trainers through
arming, refreshes, disarms, SIGKILL, SIGSTOP/SIGCONT, a guard's SIGTERM with its successor started at
once, a guard's SIGKILL (a supervisor starts another), a successor on a slow volume, and ``recover``
from a resumed rank. After every step: no live or stopped trainer is flushed, no disarmed one ever is,
no death is flushed twice, and a guard answers at the path. At the end every death is flushed once.

One limit is the model's own: a guard SIGKILLed between a flush's answer and its record's removal
leaves the successor a record it cannot tell from one never flushed, and that death is flushed again
(at least once, not exactly once: the request and the removal cannot be one step). So a guard SIGKILL
here draws whether it lands once every death so far is settled (flushed, its record gone) or at once;
deaths in flight at a SIGKILL at once are held to "at least once"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from swe_flush_sync import recover
from swe_flush_sync._guard.daemon import guard_status
from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, gone, read_until, spawn, stays, subprocess_env, wait_until
from ..helpers import Trainer

STRACE = shutil.which("strace")
TRAINER = """
args = argparse.Namespace(session_server_instance_ids={{1: "{name}"}})
dog = watchdog(args, guard={path!r}, until_idle=False)
print("ARMED", dog.pid, flush=True)
for line in sys.stdin:
    if line.strip() == "refresh":
        dog.refresh()
    if line.strip() == "disarm":
        dog.disarm()
        print("DISARMED", flush=True)
        break
"""


class OwnershipModel(RuleBasedStateMachine):
    """One socket path, one ledger, the stub; trainers by name with what the model knows of each."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="sfm-", dir="/tmp"))
        self.path, self.ledger = str(self.folder / "g.sock"), str(self.folder / "ledger")
        self.stub = AgentServerStub()
        self.stub.start()
        self.env = {"AGENT_SERVER_URL": self.stub.url, "HARBOR_ADMIN_SECRET": SECRET}
        self.guards: list[tuple[subprocess.Popen[str], int]] = []  # (process, the guard's own pid)
        self.trainers: dict[str, Trainer] = {}
        self.state: dict[str, str] = {}  # name -> alive, stopped, disarmed, dead
        self.count = 0
        self.at_least_once: set[str] = set()  # deaths in flight when a guard was SIGKILLed
        self._start_guard()

    # -- the world ------------------------------------------------------------------------------------
    def _start_guard(self, slow: bool = False) -> None:
        command = [PYTHON, "-m", "swe_flush_sync", "guard", "--socket", self.path, "--ledger", self.ledger,
                   "--drain", "1", "--heartbeat", "0.5"]
        if slow and STRACE:  # every fsync of the successor's takes 0.5 s
            command = [STRACE, "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "-e", "trace=fsync", "-e",
                       "inject=fsync:delay_enter=500000", *command]
        proc = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(**self.env),
                     start_new_session=True)
        line = read_until(proc, lambda text: text.startswith("guarding"), [])
        if line is None:
            proc.kill()
            raise AssertionError(f"a guard did not start: {proc.communicate(timeout=10)[1]}")
        self.guards.append((proc, int(line.rsplit(" ", 1)[1].rstrip(")"))))

    def _serving(self) -> tuple[subprocess.Popen[str], int]:
        return self.guards[-1]

    def _named(self, state: str) -> list[str]:
        return sorted(name for name, now in self.state.items() if now == state)

    def _settled(self, name: str) -> bool:
        """Is the death of ``name`` flushed, and no record in the ledger names it any more?"""
        if name not in self.stub.flushed_ids():
            return False
        for record in Path(self.ledger).iterdir():
            try:
                if name in json.loads(record.read_text()).get("ids", ()):
                    return False
            except (OSError, ValueError, AttributeError):
                continue  # (a temporary file, or one renamed meanwhile)
        return True

    # -- rules ----------------------------------------------------------------------------------------
    @precondition(lambda self: len(self._named("alive")) + len(self._named("stopped")) < 4)
    @rule()
    def arm(self) -> None:
        self.count += 1
        name = f"m{self.count}"
        trainer = Trainer(self.stub, TRAINER.format(name=name, path=self.path), stdin=True)
        trainer.read("ARMED")
        self.trainers[name], self.state[name] = trainer, "alive"

    @precondition(lambda self: self._named("alive"))
    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        self.trainers[data.draw(st.sampled_from(self._named("alive")))].go_on("refresh")

    @precondition(lambda self: self._named("alive"))
    @rule(data=st.data())
    def disarm(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self._named("alive")))
        self.trainers[name].go_on("disarm")
        self.trainers[name].read("DISARMED")
        self.state[name] = "disarmed"

    @precondition(lambda self: self._named("alive") or self._named("stopped"))
    @rule(data=st.data())
    def sigkill(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self._named("alive") + self._named("stopped")))
        self.trainers[name].proc.kill()
        self.trainers[name].proc.wait(10)
        self.state[name] = "dead"

    @precondition(lambda self: self._named("alive"))
    @rule(data=st.data())
    def sigstop(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self._named("alive")))
        self.trainers[name].proc.send_signal(signal.SIGSTOP)
        self.state[name] = "stopped"

    @precondition(lambda self: self._named("stopped"))
    @rule(data=st.data())
    def sigcont(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self._named("stopped")))
        self.trainers[name].proc.send_signal(signal.SIGCONT)
        self.state[name] = "alive"

    @rule(slow=st.booleans())
    def rolling_restart(self, slow: bool) -> None:
        """SIGTERM to the serving guard, its successor started at once (on a slow volume, or not)."""
        _, pid = self._serving()
        os.kill(pid, signal.SIGTERM)
        self._start_guard(slow)

    @rule(settled=st.booleans())
    def guard_sigkill(self, settled: bool) -> None:
        """The serving guard SIGKILLed (once every death so far is settled, or at once); a supervisor
        starts another."""
        dead = self._named("dead")
        if settled:
            assert wait_until(lambda: all(self._settled(name) for name in dead), 30.0), self.stub.flushed_ids()
        else:
            self.at_least_once |= {name for name in dead if not self._settled(name)}
        _, pid = self._serving()
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: gone(pid), 10.0)
        self._start_guard()

    @rule()
    def resumed_rank_recovers(self) -> None:
        """A resumed rank runs recover on the ledger, as the docs say to."""
        recover(self.ledger, servers=self.stub.url, environ=self.env)

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def no_live_or_disarmed_trainer_is_flushed(self) -> None:
        flushed = set(self.stub.flushed_ids())
        touched = [name for name in self._named("alive") + self._named("stopped") + self._named("disarmed")
                   if name in flushed]
        assert touched == [], {name: self.state[name] for name in touched}

    @invariant()
    def no_death_is_flushed_twice(self) -> None:
        flushed = self.stub.flushed_ids()
        assert [name for name in set(flushed) - self.at_least_once if flushed.count(name) > 1] == []

    @invariant()
    def a_guard_answers(self) -> None:
        assert guard_status(self.path) is not None

    def teardown(self) -> None:
        problem = None
        dead = set(self._named("dead"))
        if dead and not wait_until(lambda: dead <= set(self.stub.flushed_ids()), 30.0):
            problem = f"deaths never flushed: {sorted(dead - set(self.stub.flushed_ids()))}"
        elif dead and not stays(lambda: set(self.stub.flushed_ids()) == dead and all(
                self.stub.flushed_ids().count(name) == 1 for name in dead - self.at_least_once)):
            problem = f"flushed: {self.stub.flushed_ids()}, dead: {sorted(dead)}"
        for trainer in self.trainers.values():
            if trainer.proc.poll() is None:
                trainer.proc.send_signal(signal.SIGCONT)
                trainer.proc.kill()
            trainer.proc.wait(10)
        said = []
        for proc, pid in self.guards:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)  # the guard first: a killed tracer would let it run on
            if proc.poll() is None:
                proc.kill()
            said.append(f"guard {pid}: {proc.communicate(timeout=10)[1]}")
        self.stub.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
        assert problem is None, problem + "\n" + "\n".join(said)


OwnershipModel.TestCase.settings = settings(
    max_examples=6, stateful_step_count=10, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck))


@pytest.mark.usefixtures("reap_children")
class TestOwnershipModel(OwnershipModel.TestCase):  # type: ignore[misc,valid-type]
    pass
