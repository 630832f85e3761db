"""The test machinery ends every process a job started, however it hides: a hung job is killed within its time
limit, and a worker in a session of its own (as torch 2.13's torchrun starts each) dies with it."""

from __future__ import annotations

import sys
import time

import pytest
from strategy_utils import run_command

#: A job whose child starts a session of its own (as torchrun's workers do), writes its pid, and both hang.
HIDING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_hung_job_is_killed_with_a_worker_in_its_own_session(tmp_path):
    """Killing the job's session alone (os.killpg, as this machinery did) left the worker running for 10 minutes
    after the test: it is found by parentage and killed by pid."""
    pidfile = tmp_path / "worker.pid"
    with pytest.raises(AssertionError, match="did not finish within 5 s"):
        run_command([sys.executable, "-c", HIDING, str(pidfile)], timeout=5, name="hiding")
    worker = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), f"the worker {worker} outlived its job"
