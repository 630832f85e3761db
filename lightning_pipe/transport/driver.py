"""The driver's side of a pipeline across processes: stage 0 here, the other stages in their processes.

:class:`RemotePipeline` has the interface of the local pipeline (``forward`` and ``backward`` of a
:class:`~lightning_pipe.engine.pipeline.Run`), so :func:`~lightning_pipe.engine.pipe.run_pipeline` drives
either. Per step it gives every stage all its actions in one message and waits, each wait bounded, for their
answers; the last stage's outputs come back in its answer. :func:`pipeline_over_rpc` sets one up without
Lightning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import normalize_device, split_module
from lightning_pipe.engine.pipeline import Run, _Skipped, drain
from lightning_pipe.engine.schedule import Action, backward_plan, forward_plan, stage_order
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.stage import Grads, Stage, _move
from lightning_pipe.engine.worker import Inline
from lightning_pipe.transport.messages import (
    _PROGRESS,
    _PROGRESS_LOCK,
    MAILBOX,
    Slot,
    _unpack,
    _wire,
    to_concurrent,
    where,
)
from lightning_pipe.transport.runner import (
    StageRunner,
    _abort,
    _act,
    _is_registered,
    _release,
    call_runner,
    register,
    unregister,
)

__all__ = ["RemotePipeline", "pipeline_over_rpc"]


def wait_registered(peers: Sequence[str], key: str, timeout: float) -> None:
    """Wait until every process in ``peers`` hosts its stage of pipeline ``key``."""
    deadline = time.monotonic() + timeout
    for peer in peers:
        while not rpc.rpc_sync(peer, _is_registered, args=(key,), timeout=timeout):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process '{peer}' did not set up its stage of pipeline '{key}' within "
                                   f"{timeout:.0f} s")
            time.sleep(0.01)


def pipeline_over_rpc(key: str, module: nn.Sequential, balance: Sequence[int], names: Sequence[str], *,
                      device: torch.device | str = "cpu", timeout: float = 60.0) -> RemotePipeline | None:
    """Split ``module`` by ``balance`` across the processes ``names`` (stage j in process ``names[j]``).

    Call it in each of those processes after ``rpc.init_rpc``, with the same arguments. In the process of
    stage 0 it returns the pipeline to run with :func:`~lightning_pipe.engine.pipe.run_pipeline` once every stage
    is ready; elsewhere it hosts this process's stage and returns None (RPC threads serve it until
    ``rpc.shutdown``). This is what ``PipeStrategy`` does for Lightning, without Lightning.
    """
    me = rpc.get_worker_info().name
    if me not in names:
        raise ValueError(f"this process ('{me}') holds no stage of pipeline '{key}' (processes: {list(names)})")
    j = list(names).index(me)
    parts = split_module(module, balance)
    layout = inspect_skip_layout(parts)
    device = normalize_device(device)  # "cuda" is cuda:N, as the tensors placed there say
    parts[j].to(device)
    stage = Stage(j, parts[j], device, offset=sum(balance[:j]), exports=layout.exports[j].keys(),
                  imports=layout.imports[j].keys())
    runner = StageRunner(key, stage, [*names, names[0]], layout, timeout)
    if j != 0:
        register(runner)
        return None
    pipeline = RemotePipeline(runner)
    wait_registered(list(names[1:]), key, timeout)
    return pipeline


class _Settled:
    """Runs that left nothing behind on any remote stage (their backward, or a forward that saved nothing,
    finished without error), each with the number of remote stages yet to hear that it was freed: freeing
    them needs no message. Runs are freed by whichever thread drops them, hence the lock."""

    def __init__(self) -> None:
        self._left: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, run: int, stages: int) -> None:
        """Mark ``run`` settled on ``stages`` remote stages (none: nothing to remember)."""
        if stages > 0:
            with self._lock:
                self._left[run] = stages

    def take(self, run: int) -> bool:
        """Whether ``run`` is settled on the remote stage that asks (each asks once, when it is freed)."""
        with self._lock:
            left = self._left.pop(run, 0)
            if left > 1:
                self._left[run] = left - 1
            return left > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._left)


class _RemoteStageRef:
    """What a :class:`Run` releases when it is freed: the saved state of a remote stage, unless the run is
    among the ``settled`` ones (it left nothing behind on any stage: one message less per step)."""

    def __init__(self, key: str, peer: str, settled: _Settled) -> None:
        self.key, self.peer = key, peer
        self.settled = settled

    def release(self, run: int) -> None:
        if self.settled.take(run):
            return
        try:
            rpc.rpc_async(self.peer, _release, args=(self.key, run))
        except Exception:  # noqa: BLE001 - RPC already shut down: nothing is kept any more
            pass


class RemotePipeline:
    """The driver's view of a pipeline whose stage 0 is here and stages 1..n-1 are in other processes.

    Same interface as :class:`~lightning_pipe.engine.pipeline.LocalPipeline`: :meth:`forward` and
    :meth:`backward` per :class:`~lightning_pipe.engine.pipeline.Run`.
    """

    def __init__(self, runner: StageRunner) -> None:
        if runner.index != 0:
            raise ValueError(f"the driver must hold stage 0 (got stage {runner.index})")
        self.runner = runner
        self.key = runner.key
        self.n = runner.n
        self._settled = _Settled()
        # What a Run releases when freed: this process's runner and every remote stage.
        self.stages: list[Any] = [runner] + [_RemoteStageRef(self.key, p, self._settled)
                                             for p in runner.peers[1:self.n]]
        self.pipelined = True  # backward micro-batch by micro-batch (False: one backward per stage)
        register(runner)

    def _describe(self, j: int) -> Callable[[], str]:
        return lambda: f"in stage {j} of pipeline '{self.key}' ({where(self.runner.peers[j])})"

    def _submit(self, run: Run, plan: list[list[Action]], local: Callable[[list[list[int]]], Any],
                args: Callable[[list[list[int]]], tuple[Any, ...]],
                collect: Callable[[], Any] | None = None,
                deliveries: dict[int, list[tuple[Slot, Any]]] | None = None, inline: bool = False) -> Any:
        """Give every stage its actions of ``plan`` at once (one message per stage, not per action), run
        ``collect`` (the driver's own waits, each bounded) meanwhile, and wait for every stage.
        ``deliveries[j]``: mailbox items that travel to stage ``j`` in the same message as its actions.
        Returns what ``collect`` returned and each stage's answer (None for stage 0).

        ``inline``: stage 0's share runs on the calling thread, once the others have theirs. A backward on a
        GPU is called on autograd's thread for that device, which stage 0's own autograd call needs: on the
        stage's worker, that call would wait for the very thread that waits for it.

        Nothing waits unboundedly: a failure aborts the others, who then get at most the RPC timeout to
        stop; once the driver has what it needs (stage 0 done, ``collect`` returned), stages still busy get
        the RPC timeout from their last sign of progress (a share finished, or a slow stage's word that it
        finished another micro-batch) before they are reported as not answering.
        """
        sends: list[Future[Any]] = []
        aborted = threading.Event()

        def on_done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not isinstance(exc, _Skipped) and not aborted.is_set():
                aborted.set()
                self._abort(run)

        def start(groups: list[list[int]]) -> None:
            out = local(groups)
            if isinstance(out, list):  # sends in flight: waited for below, not on the worker
                sends.extend(out)

        futures: list[Future[Any]] = [Future() for _ in range(self.n)]  # stage j's share, in stage order
        collected = None
        progress = (self.key, run.id)
        with _PROGRESS_LOCK:
            _PROGRESS[progress] = 0.0
        try:
            # Inside the try: a stage that cannot be reached aborts those that already have their actions.
            for j in [*range(1, self.n), 0] if inline else range(self.n):
                groups = [[a.microbatch] if a.microbatch >= 0 else list(range(len(run.sizes)))
                          for a in stage_order(plan, j)]
                if j == 0:
                    future = (Inline() if inline else self.runner.worker).submit(partial(start, groups))
                else:
                    # No RPC timeout on the whole share: its waits are bounded one by one, a lost process fails
                    # the call at once, and a silent one is caught below.
                    extra = (deliveries or {}).get(j)
                    rf = rpc.rpc_async(self.runner.peers[j], _act, timeout=0,
                                       args=(*args(groups), extra) if extra else args(groups))
                    future = to_concurrent(rf, self._describe(j))
                future.add_done_callback(on_done)
                futures[j] = future
            if collect is not None:
                try:
                    collected = collect()
                except _Skipped:
                    pass  # a stage failed: the error is in its future
            drain(futures, grace=self.runner.timeout, ready=futures[0], alive=lambda: _PROGRESS.get(progress, 0.0),
                  describe=lambda j: f"stage {j} ({where(self.runner.peers[j])}) of pipeline '{self.key}'")
            drain(sends)
        except BaseException:
            if not aborted.is_set():
                aborted.set()
                self._abort(run)
            raise
        finally:
            with _PROGRESS_LOCK:
                _PROGRESS.pop(progress, None)
        return collected, [None] + [f.result() for f in futures[1:]]

    def _abort(self, run: Run) -> None:
        run.failed = True
        self.runner.fail(run.id)
        for peer in self.runner.peers[1:self.n]:
            try:
                rpc.rpc_async(peer, _abort, args=(self.key, run.id), timeout=self.runner.timeout)
            except Exception:  # noqa: BLE001 - an unreachable stage is what the error already reports
                pass

    def forward(self, run: Run, microbatches: list[Batch], *, save: bool) -> list[Batch]:
        """Run every micro-batch through every stage; return the last stage's outputs."""
        m, n, key = len(microbatches), self.n, self.key

        def local(groups: list[list[int]]) -> list[Future[Any]]:
            sends: list[Future[Any]] = []
            for (i,) in groups:
                sends += self.runner.forward(run.id, i, m, save, run.checkpoint_stop, run.training, [],
                                             microbatches[i])
            return sends

        def collect() -> list[Any]:
            # A little longer than the stages' own waits, so that the stage that noticed a silent neighbour
            # first reports it (more precisely than "no output").
            return [self.runner._take((key, run.id, "F", i, n, n - 1), timeout=1.5 * self.runner.timeout)
                    for i in range(m)]

        # The last stage answers with its outputs when it is in another process; here, they are delivered.
        collected, answers = self._submit(run, forward_plan(m, n), local,
                                          lambda groups: (key, "F", run.id, groups, m, save, run.checkpoint_stop,
                                                          run.training, run.autocast, run.anomaly, run.dtype),
                                          collect if n == 1 else None)
        if not save:
            self._settled.add(run.id, n - 1)
        outputs = collected if n == 1 else [answers[n - 1][i] for i in range(m)]
        # They travelled through host memory; the driver's code goes on with them where stage 0 is (its GPU).
        device = self.runner.stage.device
        return [Batch(_unpack([_move(t, device) for t in tensors], flags), atomic)
                for tensors, flags, atomic in outputs]

    def backward(self, run: Run, grad_outputs: list[Grads], *, pipelined: bool | None = None,
                 inline_device: torch.device | None = None) -> list[Grads]:
        """Backward of every micro-batch from the last stage's output gradients; returns stage 0's input
        gradients per micro-batch. ``pipelined=False``: each stage runs one backward over all its
        micro-batches (default: :attr:`pipelined`)."""
        m, n, key = len(grad_outputs), self.n, self.key
        if pipelined is None:
            pipelined = self.pipelined
        # The output gradients go to the last stage inside the message carrying its actions: one message
        # instead of m + 1, on the critical path between the forward and the backward.
        direct = self.runner.direct(n - 1)
        deliveries = [((key, run.id, "B", i, n - 1, n), _wire(grads, direct)) for i, grads in enumerate(grad_outputs)]
        if n == 1:
            for slot, payload in deliveries:
                MAILBOX.put(slot, payload)
        plan = backward_plan(m, n) if pipelined else [[Action(j, "B", -1)] for j in reversed(range(n))]
        result: dict[int, Grads] = {}

        def local(groups: list[list[int]]) -> None:
            for group in groups:
                for i, grads in zip(group, self.runner.backward(run.id, group)):
                    result[i] = grads  # type: ignore[assignment]

        self._submit(run, plan, local,
                     lambda groups: (key, "B", run.id, groups, m, True, 0, run.training, [], run.anomaly,
                                     run.dtype),
                     deliveries={n - 1: deliveries} if n > 1 else None,
                     inline=inline_device is not None and self.runner.stage.device == inline_device)
        self._settled.add(run.id, n - 1)
        return [result[i] for i in range(m)]

    def call(self, stage: int, method: str, *args: Any) -> Any:
        """Call ``method`` of stage ``stage``'s runner (here for stage 0, by RPC otherwise)."""
        if stage == 0:
            return getattr(self.runner, method)(*args)
        return rpc.rpc_sync(self.runner.peers[stage], call_runner, args=(self.key, method, *args),
                            timeout=self.runner.timeout)

    def close(self) -> None:
        """Stop the local worker and forget this pipeline here."""
        unregister(self.key)
        self.runner.stop()
