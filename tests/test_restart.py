"""A long job loses a process, or its time: torchrun's restarts and SLURM's requeue resume it exactly.

- ``torchrun --max-restarts``: stage 1's process is killed mid-epoch; torchrun starts both again, and the new
  attempt rendezvouses afresh (the agent's store still holds the dead attempt's keys), resumes from
  ``last.ckpt`` and ends with the weights of one device trained without interruption.
- SLURM's requeue (``SLURMEnvironment(auto_requeue=True)``): the requeue signal arrives in the middle of an
  optimizer step; the hpc checkpoint is written once the step is over, complete (``full`` and ``sharded``),
  ``scontrol requeue`` is called, and the requeued job resumes from it to the uninterrupted weights.

Each job runs in sessions of its own, bounded in time; every process it started is killed by pid afterwards
(torchrun starts each worker in a session of its own: the workers write their pids, and are killed by them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import free_port
from scripts import train as script
from strategy_utils import SCRIPTS, assert_same_weights, end, start_logged
from test_strategy import load, plain_weights

from lightning_pipe import consolidate_checkpoint

#: 2 epochs of 8 steps, one pipeline of 2 stages; train.py's defaults otherwise.
CONFIG = {"balance": [2, 2], "epochs": 2}


def _ours(pid: int, out: Path) -> bool:
    """Whether ``pid`` is still a process of the job writing to ``out`` (not a pid reused since)."""
    try:
        return str(out) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _kill_everything(procs: list[subprocess.Popen], out: Path) -> None:
    """End every process started here and all below it (``strategy_utils.end``), then every process of the job
    that wrote its pid and still runs (a worker whose parent died is no longer below anything started here)."""
    for p in procs:
        end(p)
    for name in os.listdir(out / "pids") if (out / "pids").is_dir() else []:
        if _ours(int(name), out):
            try:
                os.kill(int(name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _log(out: Path, name: str) -> str:
    path = out / name
    return path.read_text(errors="replace")[-5000:] if path.exists() else ""


def _start(argv: list[str], out: Path, log: str, env: dict[str, str]) -> Any:
    return start_logged(argv, env, out / log)  # (a task of the SLURM job: a Python script, started warm)


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_killed_stage_and_resumes_to_the_uninterrupted_weights(tmp_path):
    """`torchrun --standalone --nproc-per-node 2 --max-restarts 1`, `ModelCheckpoint(save_last=True)`,
    `fit(ckpt_path="last")`: stage 1's process is killed (SIGKILL) at step 11 of 16 on the first attempt. The
    second attempt joins the agent's store, which still holds the first attempt's keys, rendezvouses afresh,
    resumes from the last checkpoint (epoch 0's) and ends with one device's uninterrupted weights."""
    out = tmp_path / "job"
    out.mkdir()
    config = {**CONFIG, "save_every": "epoch", "resume": "last", "kill_stage_at_step": 11}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
            str(SCRIPTS / "restart.py"), json.dumps(config), str(out)]
    procs = [_start(argv, out, "torchrun.log", {})]
    try:
        procs[0].wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish within 180 s:\n{_log(out, 'torchrun.log')}")
    finally:
        _kill_everything(procs, out)
    log = _log(out, "torchrun.log")
    assert procs[0].returncode == 0, f"torchrun failed with status {procs[0].returncode}:\n{log}"
    assert len(os.listdir(out / "pids")) == 4, log  # two attempts of two processes
    assert f"Restored all states from the checkpoint at {out / 'ckpts' / 'last.ckpt'}" in log, log
    assert torch.load(out / "ckpts" / "epoch=1.ckpt", weights_only=True)["global_step"] == 16
    assert_same_weights(load(out / "final.ckpt"), plain_weights(CONFIG, tmp_path / "plain"))


def _srun(config: dict, out: Path, env: dict[str, str], *, until_requeued: bool, timeout: float = 150) -> None:
    """Two tasks of a SLURM job (one node), started as `srun` starts them: SLURM's variables, no launcher. With
    ``until_requeued``, the job is ended (SIGKILL, as SLURM ends a requeued job) once `scontrol requeue` was
    called; otherwise it must finish."""
    port = str(free_port())
    argv = [sys.executable, str(SCRIPTS / "restart.py"), json.dumps(config), str(out)]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "pipe",
             "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = []
    deadline = time.monotonic() + timeout
    try:
        for rank in range(2):
            procs.append(_start(argv, out, f"task{rank}.log",
                                {**slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), **env}))
        while time.monotonic() < deadline:
            if until_requeued and (out / "scontrol.log").exists():
                time.sleep(0.5)  # the driver logs the requeue; SLURM would now end the job
                return
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        logs = f"{_log(out, 'task0.log')}\n{_log(out, 'task1.log')}"
        if time.monotonic() >= deadline:
            pytest.fail(f"the job did not {'requeue' if until_requeued else 'finish'} within {timeout:.0f} s:\n{logs}")
        codes = [p.returncode for p in procs]
        assert not until_requeued, f"the job ended (exit codes {codes}) and never called scontrol requeue:\n{logs}"
        assert codes == [0, 0], f"the job failed (exit codes {codes}):\n{logs}"
    finally:
        _kill_everything(procs, out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("state_dict_type", "signalled"), [("full", "every task"), ("sharded", "the driver")])
def test_slurm_requeue_saves_a_complete_checkpoint_and_the_requeued_job_resumes_exactly(
        tmp_path, state_dict_type, signalled):
    """SLURM's requeue signal (SIGUSR1, to every task as `sbatch --signal=USR1@90` sends it, or to the driver
    alone) arrives during optimizer step 8, after the driver stepped its own stage and before stage 1 stepped.
    Stage 1's process survives it; the driver writes `hpc_ckpt_1.ckpt` once the step is over (the start of epoch
    1: every stage stepped 8 times), complete; rank 0 calls `scontrol requeue 4242`; SLURM ends the job. The
    requeued job (the same variables, no signal) resumes from that checkpoint, as Lightning does under SLURM with
    no `ckpt_path`, to the weights of one device trained without interruption."""
    out = tmp_path / "job"
    out.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records its call, as the real one would requeue the job
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    config = {**CONFIG, "state_dict_type": state_dict_type, "requeue_at_step": 7}
    path = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    _srun(config, out, {**path, "LP_REQUEUE": "everyone" if signalled == "every task" else "driver"},
          until_requeued=True)
    assert (out / "scontrol.log").read_text().split("\n")[0] == "requeue 4242"
    hpc = out / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in out.glob("hpc_ckpt_*")) == ["hpc_ckpt_1.ckpt"]
    if state_dict_type == "sharded":
        assert sorted(os.listdir(hpc)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        consolidate_checkpoint(str(hpc), str(tmp_path / "hpc.ckpt"))  # outside the job's folder
    whole = tmp_path / "hpc.ckpt" if state_dict_type == "sharded" else hpc
    checkpoint = torch.load(whole, weights_only=True)
    assert checkpoint["global_step"] == 8 and checkpoint["epoch"] == 1  # after step 8, not in its middle
    saved = script.Model.load_from_checkpoint(whole, map_location="cpu").state_dict()  # complete, no strategy
    assert_same_weights(saved, plain_weights({**CONFIG, "epochs": 1}, tmp_path / "plain1"))  # 8 steps each

    _srun(config, out, {**path, "LP_REQUEUE": "0", "SLURM_RESTART_COUNT": "1"}, until_requeued=False)
    assert f"Restored all states from the checkpoint at {hpc}" in _log(out, "task0.log")
    assert_same_weights(load(out / "final.ckpt"), plain_weights(CONFIG, tmp_path / "plain2"))


@pytest.mark.timeout(60)
def test_the_processes_of_an_attempt_agree_on_a_token_that_no_earlier_attempt_used():
    """The agent's store outlives the workers: a new attempt's processes may read a dead attempt's token before
    rank 0 of theirs publishes its own, one whose rendezvous completed (go given) or one whose rank 0 died
    before. Each process agrees on rank 0's fresh token all the same, whatever order they start in; the restart
    count of torchrun (per node, not agreed) plays no part."""
    import torch.distributed as dist

    from lightning_pipe.transport.wire import session

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20))
    key = session._ATTEMPT_KEY
    for stale, went in (("completed", True), ("died-before-go", False)):
        store.set(key, stale)  # what the dead attempt left
        if went:
            store.set(f"{key}/{stale}/go", "1")
        tokens: dict[int, str] = {}

        def join(rank: int, tokens: dict[int, str] = tokens) -> None:
            client = dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=20))
            tokens[rank] = session._agree_on_attempt(client, rank, 3, timedelta(seconds=20))

        others = [threading.Thread(target=join, args=(r,)) for r in (1, 2)]
        for t in others:  # the other ranks first: they read the stale token
            t.start()
        time.sleep(0.5)
        join(0)
        for t in others:
            t.join(timeout=20)
        assert len(tokens) == 3 and len(set(tokens.values())) == 1 and tokens[0] != stale, tokens


def test_a_checkpoint_being_written_is_no_version_to_lightnings_requeue(tmp_path):
    """Lightning's SLURM requeue resumes from the ``hpc_ckpt_<n>`` with the largest n, reading n from the digits
    of every name holding ``hpc_ckpt_``: a save killed midway left ``hpc_ckpt_2.ckpt.tmp<pid>`` (or a sharded
    ``.partial-<pid>``), read as version 2<pid>, and every later resume looked for that file. The staging names
    hold no ``hpc_ckpt_``."""
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_pipe.transport.parallel.shards import staging

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"a whole checkpoint")
    for kind in (".tmp", ".partial-", ".old-"):
        staged = staging(str(tmp_path / "hpc_ckpt_2.ckpt"), kind)
        assert os.path.dirname(staged) == str(tmp_path) and kind in os.path.basename(staged)
        open(staged, "w").close()  # what a save killed midway leaves
    assert _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_") == 1
