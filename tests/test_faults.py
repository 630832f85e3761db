"""Faults a distributed job meets and one process never does: every one ends the job promptly, with an
error that says where, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from strategy_utils import REPO, SCRIPTS, run_script

FAST = {"LP_TIMEOUT": "5"}  # rpc_timeout_sec for these jobs


@pytest.mark.timeout(120)
def test_stage_process_killed_mid_step(tmp_path):
    started = time.monotonic()
    result = run_script("fail.py", "kill", str(tmp_path), timeout=90, expect_ok=False, env=FAST)
    assert result.returncode != 0
    assert "in stage 1 of pipeline" in result.stdout
    assert "(rank 1, process 'worker1'): its process exited or was killed" in result.stdout
    # The output pipe, which every process of the job holds, closed by itself: none is left.
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_stage_that_stops_answering_fails_the_step_within_the_timeout(tmp_path):
    started = time.monotonic()
    result = run_script("fail.py", "hang", str(tmp_path), timeout=90, expect_ok=False, env=FAST)
    assert result.returncode != 0
    assert "TimeoutError" in result.stdout and "from stage 1 (rank 1, process 'worker1')" in result.stdout
    assert time.monotonic() - started < 60  # 1.5 x the 5 s timeout after the stage fell silent, plus start-up


@pytest.mark.timeout(120)
def test_interrupting_the_driver_ends_every_process(tmp_path):
    mark = tmp_path / "training"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "fail.py"), "interrupt", str(tmp_path)], cwd=REPO,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "LP_MARK": str(mark), "PYTHONWARNINGS": "ignore"})
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl+C in the driver's terminal
        out, _ = proc.communicate(timeout=45)  # returns once every process holding the output has exited
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in out  # Lightning's own handling ran
