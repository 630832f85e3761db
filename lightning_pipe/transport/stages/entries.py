"""The RPC entry points of a stage's process: how its driver reaches the runner of each pipeline it hosts (by key),
where the data plane does not carry the call."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.rpc as rpc

from lightning_pipe.engine.schedule import Action
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.wire.messages import MAILBOX, Slot, StepSpec, chain_work, landed

__all__: list[str] = []

#: The runner of each pipeline this process hosts, by key.
RUNNERS: dict[str, StageRunner] = {}


def register(runner: StageRunner) -> None:
    """Make ``runner`` reachable by its pipeline key in this process."""
    RUNNERS[runner.key] = runner


def unregister(key: str) -> None:
    """Forget the runner of pipeline ``key`` in this process."""
    RUNNERS.pop(key, None)


@rpc.functions.async_execution
def run_share(key: str, run: int, actions: list[Action], spec: StepSpec,
              deliveries: Sequence[tuple[Slot, Any]] = ()) -> torch.futures.Future:
    """Run this process's ``actions`` of run ``run`` of pipeline ``key`` on its stage's worker (a step sent by RPC,
    where the data plane does not carry it; ``deliveries``: the last stage's targets and output gradients that
    travelled with it); answers with the sends it started and what it holds for the driver."""
    runner = RUNNERS[key]
    for slot, payload in deliveries:  # inputs that travelled with the actions (output gradients, targets)
        MAILBOX.put(slot, landed(payload))

    def work() -> tuple[list[Future[Any]], Any]:
        sends, _ = runner.run_actions(run, actions, spec)
        return sends, runner.take_held(run)

    return chain_work(runner.worker.submit, work)


def commit_run(key: str, run: int, scale: float) -> None:
    """Add what run ``run``'s backwards made aside, times ``scale``, into this process's stages' gradients."""
    runner = RUNNERS.get(key)
    if runner is not None:
        runner.commit(run, scale)


def abort_run(key: str, run: int) -> None:
    """Fail run ``run`` of pipeline ``key`` here: its waiting actions wake up and skip."""
    runner = RUNNERS.get(key)
    if runner is not None:
        runner.fail(run)


def release_run(key: str, run: int) -> None:
    """Forget what this process keeps for run ``run`` of pipeline ``key`` (its saved activations, seeds)."""
    runner = RUNNERS.get(key)
    if runner is not None:
        runner.release(run)


def call_runner(key: str, method: str, *args: Any) -> Any:
    """Call ``method`` of this process's runner of pipeline ``key`` (an RPC entry point) once it settled."""
    RUNNERS[key].averages.settle()
    return getattr(RUNNERS[key], method)(*args)


def is_registered(key: str) -> bool:
    """Whether this process hosts its stages of pipeline ``key`` yet."""
    return key in RUNNERS
