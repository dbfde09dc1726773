"""The watchdog inside a Ray actor killed with ``ray.kill`` (no signal, no atexit): needs the ``ray`` extra."""

from __future__ import annotations

import importlib.util
import subprocess
import time

import pytest

from swe_flush_sync.testing import AgentServerStub

from ..conftest import PYTHON, SECRET, _watchdog_pids, gone, spawn, subprocess_env, wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed "
                                "(pip install '.[ray]')")

DRIVER = """
import argparse, sys
import ray

ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)


@ray.remote
class RolloutWorker:
    def arm(self, url, secret):
        from swe_flush_sync import watchdog

        self.args = argparse.Namespace(session_server_instance_ids={8000: "ray-a"}, session_server_instance_id="ray-b")
        return watchdog(self.args, environ={"AGENT_SERVER_URL": url, "HARBOR_ADMIN_SECRET": secret},
                        until_idle=False).pid


actor = RolloutWorker.remote()
print("ARMED", ray.get(actor.arm.remote(sys.argv[1], sys.argv[2])), flush=True)
ray.kill(actor)
print("KILLED", flush=True)
sys.stdin.readline()
ray.shutdown()
"""


def test_watchdog_in_a_ray_actor_killed_with_ray_kill(stub: AgentServerStub) -> None:
    driver = spawn([PYTHON, "-c", DRIVER, stub.url, SECRET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   stderr=subprocess.DEVNULL, env=subprocess_env())
    assert driver.stdout is not None and driver.stdin is not None
    armed = driver.stdout.readline().split()
    assert armed[:1] == ["ARMED"], armed
    pid = int(armed[1])
    _watchdog_pids.append(pid)
    assert driver.stdout.readline().strip() == "KILLED"
    killed = time.monotonic()
    assert wait_until(lambda: len(stub.requests) >= 2, 5.0), "the watchdog did not flush after ray.kill"
    assert sorted(stub.flushed_ids()) == ["ray-a", "ray-b"] and time.monotonic() - killed < 5.0
    assert wait_until(lambda: gone(pid), 5.0)
    driver.stdin.write("\n")  # ray.shutdown(): Ray's own processes end with the driver
    driver.stdin.flush()
    assert driver.wait(60) == 0
