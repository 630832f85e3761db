"""Running the strategy's test script as a real multi-process job, bounded in time, and comparing weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import warm

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parent.parent


def run_script(script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
               expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` (or a repository path with a "/"), which launches its own worker processes;
    see :func:`run_command`."""
    path = SCRIPTS / script if "/" not in script else REPO / script
    return run_command([sys.executable, str(path), *args], timeout=timeout, env=env, expect_ok=expect_ok,
                       name=script)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from /proc: found by parentage, not by session,
    so that a worker in a session of its own (torchrun 2.13 starts each so) is found too."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def end(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc``, its session and every process below it (by pid: listed first, so that none is orphaned out of
    reach by its parent's death), then reap ``proc`` (bounded)."""
    if proc.poll() is None:  # alive, so its pid is still its own (a reaped one may be another process's now)
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): report it, do not hang on it
        print(f"process {proc.pid} did not exit after SIGKILL", file=sys.stderr)


def run_command(argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None,
                expect_ok: bool = True, name: str = "job", cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``cwd`` in a new session (:func:`start_logged`: a Python script warm); on timeout, and after
    it ends in any case, every process it started (and only those) is killed. Fails with the output when the job
    fails and ``expect_ok``."""
    with tempfile.TemporaryDirectory(prefix="job-") as tmp:
        log = Path(tmp) / "output.log"
        proc = start_logged(argv, env or {}, log, cwd=cwd)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end(proc)  # whatever the outcome, nothing of this job outlives the test
        out = log.read_text(errors="replace") if log.exists() else ""
    if timed_out:
        raise AssertionError(f"{name} did not finish within {timeout:.0f} s:\n{out[-6000:]}")
    result = subprocess.CompletedProcess(argv, proc.returncode, out, "")
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{name} failed with status {proc.returncode}:\n{out[-6000:]}")
    return result


class _Warm:
    """A script's process started by :mod:`warm`, as :func:`end` handles a ``subprocess.Popen``."""

    def __init__(self, proc: Any) -> None:
        self.proc, self.pid = proc, proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return self.proc.exitcode


def start_logged(argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> Any:
    """Start ``argv`` in ``cwd`` in a session of its own, with this environment and ``env`` added, its output in the
    file ``log`` (a file, not a pipe: no process blocks on its output, and none left behind holds it); a Python
    script warm (:mod:`warm`). The process is returned as a ``subprocess.Popen`` or what :func:`end` takes alike."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", **env}
    if warm.runs_warm(argv, env):
        return _Warm(warm.start(argv, cwd, environment, log))
    with open(log, "w") as f:
        return subprocess.Popen(argv, cwd=cwd, env=environment, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_together(commands: list[tuple[list[str], dict[str, str]]], out: Path, timeout: float = 200) -> None:
    """Start every ``(argv, environment)`` at once, as the nodes of a cluster would, each in a session of its
    own with its output in ``out/launch<i>.log``; wait for all (a hang fails within ``timeout``), then end
    every process started here, whatever happened."""
    import time

    procs: list[Any] = []
    try:
        for i, (argv, env) in enumerate(commands):
            procs.append(start_logged(argv, env, out / f"launch{i}.log"))
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))  # a hang fails here, and the finally ends it
            log = (out / f"launch{i}.log").read_text()
            assert p.returncode == 0, f"{commands[i][0][:3]} failed with status {p.returncode}:\n{log[-4000:]}"
    finally:
        for p in procs:  # only the processes started here, each worker by pid (torchrun's are in sessions of their own)
            end(p)


def train(config: dict[str, Any], out: Path, **kwargs: Any) -> dict[str, Any]:
    """Train ``config`` through PipeStrategy in its own processes; return the main process's result."""
    out.mkdir(parents=True, exist_ok=True)
    run_script("train.py", json.dumps(config), str(out), **kwargs)
    return json.loads((out / "result.json").read_text())


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)
