"""SLURM's auto-requeue (``SLURMEnvironment(auto_requeue=True)``, Lightning's default under SLURM) for pipelines.

SLURM sends the requeue signal (SIGUSR1 by default, ``sbatch --signal=USR1@90``) to every task of the job, and
Lightning's handler, from inside the signal handler wherever the main thread is, saves the ``hpc_ckpt_<n>.ckpt``
checkpoint (on every rank; rank 0 writes) and has rank 0 call ``scontrol requeue``. A pipeline's processes need
two things of their own:

- **A stage worker** runs no Lightning loop, so Lightning installs no handler there: the signal's default action
  would end it, and with it its stage, which the driver's save then fails to fetch. Workers ignore the signal
  (:func:`ignore_in_worker`): their driver saves their stage.
- **A driver** may be in the middle of a step: after its own optimizer step and before the other stages' (a
  checkpoint mixing two steps, which the loop's progress counts as the earlier one), or while a stage's step runs
  on its RPC threads. During ``fit`` the handler waits (:class:`DeferredRequeue`): it runs at the start of the
  next training batch (once an accumulation window has stepped) or as training ends, where nothing is in flight
  and the checkpoint is what ``ModelCheckpoint`` would write there. With replicas the drivers agree on the batch.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import SLURMEnvironment

__all__: list[str] = []


def _requeue_signal(environment: Any) -> int | None:
    """The signal SLURM requeues with, where Lightning handles it (a SLURM environment with auto-requeue on)."""
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def ignore_in_worker(environment: Any) -> None:
    """In a stage worker (main thread): the requeue signal does not end the process; its driver saves its stage."""
    signum = _requeue_signal(environment)
    if signum is not None:
        signal.signal(signum, signal.SIG_IGN)


class DeferredRequeue:
    """On a driver during ``fit``: Lightning's requeue handler, run between training batches instead of where the
    signal lands."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.handler: Any = None  # Lightning's handler, which the signal now only notes
        self.pending = False

    def install(self, environment: Any) -> None:
        """As training starts (after Lightning installed its handlers): note the signal instead of handling it."""
        signum = _requeue_signal(environment)
        if signum is None:
            return
        handler = signal.getsignal(signum)
        if not callable(handler) or handler == self._note:
            return
        self.signum, self.handler, self.pending = signum, handler, False
        signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def at_batch_start(self, strategy: Any, trainer: pl.Trainer) -> None:
        """At the start of a training batch: handle a signal received since, unless gradients are accumulating
        (no checkpoint holds them: it waits for the window's step)."""
        if self.handler is None:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.current.completed % trainer.accumulate_grad_batches:
            return
        self._handle_if_pending(strategy)

    def uninstall(self, strategy: Any) -> None:
        """As training ends: handle a signal still pending, and give Lightning its handler back."""
        if self.handler is None:
            return
        try:
            self._handle_if_pending(strategy)
        finally:
            if signal.getsignal(self.signum) == self._note:
                signal.signal(self.signum, self.handler)
            self.handler = None

    def _handle_if_pending(self, strategy: Any) -> None:
        pending = self.pending
        if strategy.world_size > 1:  # every driver saves at the same batch (the save is collective)
            pending = strategy.reduce_boolean_decision(pending, all=False)
        if pending:
            self.pending = False
            self.handler(self.signum, None)
