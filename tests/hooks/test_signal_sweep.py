"""A signal handler may call any public function at any instant, proved by a sweep (issue 62).

For each public entry point, a real process (``signal_sweep.py``) runs it in its main thread while a
profile function raises SIGUSR1 at the k-th call event of library code and of ``threading``,
``queue``, ``weakref`` and ``selectors`` under it, for every k until a call has no k-th event; the
handler calls the same entry point on the same Flusher, and every third time makes a new Flusher and
keeps it. No sweep may hang (faulthandler ends a driver whose sweep takes a minute, with every
thread's stack), raise out of a call, fail a call the server answers in time, or leave a hook's final
ids unposted. On 1.2.0 ``abort`` with a short deadline and ``recover`` hung, the first use raised
"partially initialized module", and a handler's flush waited out its deadline on a Future whose lock
the interrupted main thread held.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from ..conftest import PYTHON, SECRET, _watchdog_pids, spawn, subprocess_env

DRIVER = Path(__file__).with_name("signal_sweep.py")
ENTRIES = ["abort-short", "abort-long", "flush", "Flusher.flush", "refresh", "recover", "sigterm-hook", "exit-hook",
           "first-use"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_signal_at_every_call_of_the_main_threads_call_is_handled(entry: str) -> None:
    driver = spawn([PYTHON, str(DRIVER), entry], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   env=subprocess_env(HARBOR_ADMIN_SECRET=SECRET), start_new_session=True)
    try:
        out, err = driver.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the children it forked (its process group)
        out, err = driver.communicate()
    _watchdog_pids.extend(int(line.split()[1]) for line in out.splitlines() if line.startswith("watchdog "))
    assert driver.returncode == 0, err[-20000:]
    verdict = json.loads(out.splitlines()[-1])
    assert verdict["problems"] == [], "\n".join(verdict["problems"][:5])
    assert verdict["sweeps"] > 50 and verdict["handled"] == verdict["sweeps"] - 1, verdict  # one signal a sweep
