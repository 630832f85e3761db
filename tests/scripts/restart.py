"""train.py's training, interrupted as a long job is: a stage's process killed, or the requeue signal of SLURM.

    python restart.py '{"devices": 2, "balance": [2, 2], ...}' OUT_DIR

The config is train.py's, with two more entries (each acts on the first run only):

- ``"kill_stage_at_step": N``: as the batch of ``trainer.global_step == N`` starts, on torchrun's first attempt
  (``TORCHELASTIC_RESTART_COUNT=0``), the driver has the process of stage 1 kill itself (SIGKILL) while the step
  goes on; a restarted attempt finds the checkpoints written so far.
- ``"requeue_at_step": N``: during the optimizer step of ``trainer.global_step == N``, right after the driver
  has stepped its own part and before the other stages step theirs, every process of the job receives SLURM's
  requeue signal (SIGUSR1), as ``sbatch --signal=USR1@...`` delivers it to every task; ``LP_REQUEUE=driver``
  sends it to the driver alone, ``LP_REQUEUE=0`` not at all (the requeued job).

Every process of the job writes ``OUT_DIR/pids/<pid>`` as it starts (a test kills them all by pid).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import pytorch_lightning as pl
import torch.distributed.rpc as rpc
import train


def _everyone_but_me(trainer: pl.Trainer) -> list[str]:
    strategy = trainer.strategy
    return [f"worker{r}" for r in range(strategy.topology.world) if r != strategy.rank]


class KillStageOne(pl.Callback):
    """Has stage 1's process kill itself as step ``step`` starts, on torchrun's first attempt."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            rpc.rpc_async("worker1", signal.raise_signal, args=(signal.SIGKILL,))


class RequeueSignal(pl.Callback):
    """Sends SIGUSR1 to every process of the job in the middle of optimizer step ``step``: after the driver's own
    part stepped (an optimizer post-hook), before the other stages step theirs."""

    def __init__(self, step: int, everyone: bool) -> None:
        self.step, self.everyone = step, everyone

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        def hook(optimizer: Any, *args: Any) -> None:
            if trainer.global_step == self.step and trainer.is_global_zero:
                # raised in each process, as SLURM signals every task
                for name in _everyone_but_me(trainer) if self.everyone else ():
                    rpc.rpc_sync(name, signal.raise_signal, args=(signal.SIGUSR1,))
                os.kill(os.getpid(), signal.SIGUSR1)

        trainer.optimizers[0].register_step_post_hook(hook)


def main(config: dict[str, Any], out: str) -> None:
    os.makedirs(os.path.join(out, "pids"), exist_ok=True)
    open(os.path.join(out, "pids", str(os.getpid())), "w").close()
    interruptions = {k: config.pop(k) for k in ("kill_stage_at_step", "requeue_at_step") if k in config}
    trainer_for = train.trainer_for

    def with_interruptions(config: dict[str, Any], out: str, plain: bool = False) -> pl.Trainer:
        trainer = trainer_for(config, out, plain)
        if interruptions.get("kill_stage_at_step") is not None:
            trainer.callbacks.append(KillStageOne(interruptions["kill_stage_at_step"]))
        if interruptions.get("requeue_at_step") is not None and os.environ.get("LP_REQUEUE") != "0":
            trainer.callbacks.append(RequeueSignal(interruptions["requeue_at_step"],
                                                 os.environ.get("LP_REQUEUE") != "driver"))
        return trainer

    train.trainer_for = with_interruptions
    train.main(config, out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
