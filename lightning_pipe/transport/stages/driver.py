"""The driver's side of a pipeline across processes: stage 0 here, the other stages in their processes.

:class:`RemotePipeline` has the interface of the local pipeline (``forward`` and ``backward`` of a
:class:`~lightning_pipe.engine.pipeline.Run`), so :func:`~lightning_pipe.engine.pipe.run_pipeline` drives
either. Per step it gives every stage all its actions in one message and waits, each wait bounded, for their
answers; the last stage's outputs come back in its answer. :func:`pipeline_over_rpc` sets one up without
Lightning.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import normalize_device, split_module
from lightning_pipe.engine.pipeline import Run, Step, ahead, check_placement, drain
from lightning_pipe.engine.schedule import Plan, forward_only, gpipe
from lightning_pipe.engine.share import Skipped
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.stage import Grads, Stage, move_to
from lightning_pipe.engine.worker import Inline
from lightning_pipe.transport.stages import answers, steps
from lightning_pipe.transport.stages.entries import (
    call_runner,
    register,
    run_share,
    unregister,
)
from lightning_pipe.transport.stages.rendezvous import connect, detach, wait_registered
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.stages.settled import RemoteStageRef, Settled
from lightning_pipe.transport.wire.messages import (
    MAILBOX,
    PROGRESS,
    PROGRESS_LOCK,
    Slot,
    StepSpec,
    to_concurrent,
    to_wire,
    to_wire_any,
    unpack_batch,
    where,
)
from lightning_pipe.transport.wire.riders import defer_commits, settle_commits

__all__ = ["RemotePipeline", "pipeline_over_rpc"]


def pipeline_over_rpc(key: str, module: nn.Sequential, balance: Sequence[int], names: Sequence[str], *,
                      device: torch.device | str = "cpu", timeout: float = 60.0,
                      virtual_stages: int = 1, data_plane: str = "auto", lane: str | None = None,
                      placement: Sequence[int] = ()) -> RemotePipeline | None:
    """Split ``module`` by ``balance`` across the processes ``names``: stage ``s`` in process
    ``names[s % len(names)]`` (``len(balance) == len(names) * virtual_stages``), or ``names[placement[s]]`` (a V).

    Call it in each of those processes after ``rpc.init_rpc``, with the same arguments. In the process of
    stage 0 it returns the pipeline to run with :func:`~lightning_pipe.engine.autograd.run_pipeline` or
    :func:`~lightning_pipe.engine.autograd.pipeline_loss` once every stage is ready; elsewhere it hosts this
    process's stages and returns None (RPC threads serve them until ``rpc.shutdown``). This is what
    ``PipeStrategy`` does for Lightning, without Lightning. Close it (``pipeline.close()``) before ``rpc.shutdown``:
    the other processes' step listeners end then (else as this process exits, and theirs wait for it, at most
    :data:`~lightning_pipe.transport.wire.listeners.EXIT_WAIT`). ``data_plane``: how tensors go from process to
    process (:data:`~lightning_pipe.transport.wire.dataplane.DATA_PLANES`); ``lane``: its tensors beside the messages
    (:func:`~lightning_pipe.transport.stages.rendezvous.connect`).
    """
    me = rpc.get_worker_info().name
    if me not in names:
        raise ValueError(f"this process ('{me}') holds no stage of pipeline '{key}' (processes: {list(names)})")
    p = len(names)
    if len(balance) != p * virtual_stages:
        raise ValueError(f"balance must have one entry per stage: processes x virtual_stages (balance: "
                         f"{len(balance)} entries, processes: {p}, virtual_stages: {virtual_stages})")
    r = list(names).index(me)
    where = list(placement) or [s % p for s in range(len(balance))]
    parts = split_module(module, balance)
    layout = inspect_skip_layout(parts)
    device = normalize_device(device)  # "cuda" is cuda:N, as the tensors placed there say
    stages = []
    for s in (s for s in range(len(parts)) if where[s] == r):
        parts[s].to(device)
        stages.append(Stage(s, parts[s], device, offset=sum(balance[:s]), exports=layout.exports[s].keys(),
                            imports=layout.imports[s].keys()))
    runner = StageRunner(key, stages, [names[where[s]] for s in range(len(parts))] + [names[0]], layout, timeout)
    if r != 0:
        register(runner)
        return None
    pipeline = RemotePipeline(runner, processes=p, placement=tuple(placement))
    wait_registered(list(names[1:]), key, timeout)
    connect(runner, list(names), data_plane, lane)
    return pipeline


class RemotePipeline:
    """The driver's view of a pipeline whose first process (stage 0, and every ``processes``-th after it) is
    here and whose other processes hold the rest.

    Same interface as :class:`~lightning_pipe.engine.pipeline.LocalPipeline`: :meth:`execute` of a plan, its
    GPipe halves :meth:`forward` and :meth:`backward`, and :meth:`commit`.
    """

    def __init__(self, runner: StageRunner, processes: int | None = None, placement: tuple[int, ...] = ()) -> None:
        if runner.index != 0:
            raise ValueError(f"the driver must hold stage 0 (got stage {runner.index})")
        self.runner = runner
        self.key = runner.key
        self.n = runner.n
        self.processes = processes or self.n
        self.placement = placement  # stage s in process placement[s] (empty: s % processes), as a Plan's
        # The process of each process index: the one holding stage r.
        self.peers = [runner.peers[r] for r in range(self.processes)]
        self._settled = Settled()
        # What a Run releases when freed: this process's runner and every remote process.
        self.stages: list[Any] = [runner] + [RemoteStageRef(self.key, peer, self._settled) for peer in self.peers[1:]]
        self.pipelined = True  # backward micro-batch by micro-batch (False: one backward per stage)
        # Whether the step starting now averages its gradients over replicas (PipeStrategy's, while fitting
        # with replicas and not under no_sync): each stage's last backward then runs through its DDP.
        self.reduce: Callable[[], bool] = lambda: False
        self._unanswered: dict[int, answers.Unanswered] = {}  # per process, the quiet steps it did not answer
        register(runner)

    @property
    def num_stages(self) -> int:
        """How many stages (partitions) the pipeline has, over all its processes."""
        return self.n

    def _stages(self, r: int) -> str:
        """The stages of process ``r``, for messages: ``"1"``, or ``"1, 3"`` (interleaved)."""
        return ", ".join(map(str, Plan("", 0, self.n, self.processes, (), self.placement).stages_of(r)))

    def _ask(self, r: int) -> Callable[[Callable[[], str]], Any]:
        """What asks process ``r``'s listener for a word (``answers.Unanswered``): a call that does nothing."""
        return lambda located: steps.call(self.runner, self.peers[r], r, None, (), located)

    def _describe(self, r: int) -> Callable[[], str]:
        return lambda: f"in stage {self._stages(r)} of pipeline '{self.key}' ({where(self.peers[r])})"

    # ------------------------------------------------------------------ the plan's parts
    def forward(self, run: Run, microbatches: list[Batch], *, save: bool) -> list[Batch]:
        """Every forward (GPipe's first half, or evaluation); return the last stage's outputs."""
        plan = forward_only(len(microbatches), self.processes, self.n // self.processes, self.placement)
        return self.execute(run, plan, inputs=microbatches, save=save).outputs  # type: ignore[return-value]

    def backward(self, run: Run, grad_outputs: list[Grads], *, pipelined: bool | None = None,
                 inline_device: torch.device | None = None) -> list[Grads]:
        """GPipe's second half: every backward, from the last stage's output gradients; returns stage 0's input
        gradients per micro-batch. ``pipelined=False``: each stage runs one backward over all its micro-batches
        (default: :attr:`pipelined`)."""
        plan = gpipe(len(grad_outputs), self.processes, pipelined=self.pipelined if pipelined is None else pipelined)
        backward = Plan(plan.schedule, plan.microbatches, plan.stages, plan.processes,
                        tuple(plan.split(r)[1] for r in range(plan.processes)))
        return self.execute(run, backward, output_grads=grad_outputs,  # type: ignore[return-value]
                            inline_device=inline_device).input_grads

    def commit(self, run: Run, scale: float) -> None:
        """Add what ``run``'s backwards made aside, times ``scale``, into every stage's gradients (a plan that
        ran its backwards ahead of its caller's), here and in every other process at once (there, done before
        anything else reaches them for this pipeline)."""
        settle_commits(self.key, before_steps=True)  # those not sent yet go first, with what carries this one
        futures = [steps.riding_commit(self.runner, peer, r, run.id, scale) or
                   steps.commit_by_rpc(self.runner, peer, run.id, scale, self._describe(r))
                   for r, peer in enumerate(self.peers) if r > 0]
        self.runner.commit(run.id, scale)
        # Not waited for (a round trip a step); not even sent where the plane carries the process's steps: it goes
        # with what reaches that process next for this pipeline (a step, an optimizer step), which applies it first.
        defer_commits(self.key, futures)
        self._settled.add(run.id, self.processes - 1)
        self.runner.averages.settle()  # the gradients here are averaged before the caller goes on

    # ------------------------------------------------------------------ running a plan
    def execute(self, run: Run, plan: Plan, *, inputs: list[Batch] | None = None,
                output_grads: list[Grads] | None = None, save: bool = True,
                inline_device: torch.device | None = None) -> Step:
        """Run ``plan``: every process gets all its actions of the step in one message (the output gradients
        and the targets of the last stage travel with them), stage 0's share runs here; returns the last
        stage's outputs or losses and stage 0's input gradients (see ``LocalPipeline.execute``).

        ``inline_device``: stage 0's share runs on the calling thread, once the others have theirs. A backward
        on a GPU is called on autograd's thread for that device, which stage 0's own autograd call needs: on the
        stage's worker, that call would wait for the very thread that waits for it.

        Nothing waits unboundedly: a failure aborts the others, who then get at most the RPC timeout to stop; once
        the driver has what it needs (stage 0 done, the last stage's outputs here), processes still busy get the RPC
        timeout from their last sign of progress (a share or a micro-batch finished) before they are reported."""
        m, n, p, key = plan.microbatches, self.n, self.processes, self.key
        check_placement(plan, self.placement, p)
        spec = StepSpec(m, save, run.checkpoint_stop, run.training, run.autocast, run.anomaly, run.dtype,
                        eager=ahead(run, plan, output_grads), loss=run.loss, weights=run.weights,
                        loss_scale=run.loss_scale, reduce=save and self.reduce())
        last = plan.process_of(n - 1)
        deliveries: list[tuple[Slot, Any]] = []
        if output_grads is not None:
            # With the last stage's actions: one message instead of m + 1, between the forward and the backward.
            direct = self.runner.direct(n - 1)
            deliveries += [(Slot(key, run.id, "B", i, n - 1, n), g if run.loss is not None else to_wire(g, direct))
                           for i, g in enumerate(output_grads)]
        if run.loss is not None and any(a.kind == "F" and a.stage == n - 1 for a in plan.actions[last]):
            deliveries += [(Slot(key, run.id, "T", i, n - 1, "target"), to_wire_any(t))
                           for i, t in enumerate(run.targets)]
        if last == 0:
            for slot, payload in deliveries:
                MAILBOX.put(slot, payload)
        grads: dict[int, Grads] = {}
        targets: dict[int, list[tuple[Slot, Any]]] = {}  # sent with stage 0's output of their micro-batch
        forwards = any(a.kind == "F" and a.stage == n - 1 for a in plan.actions[last])

        def local() -> list[Future[Any]]:
            sends, mine = self.runner.run_actions(run.id, plan.actions[0], spec, inputs,
                                                  (lambda i: targets.pop(i, [])) if targets else None)
            grads.update(mine)
            return sends

        def collect() -> list[Any]:
            # A little longer than the stages' own waits, so that the stage that noticed a silent neighbour
            # first reports it (more precisely than "no output").
            return [self.runner.take(Slot(key, run.id, "F", i, n, n - 1), timeout=1.5 * self.runner.timeout)
                    for i in range(m)]

        # Stage 0 on the calling thread: where a GPU backward needs it; never inside autograd's backward (the
        # output gradients are there: the stage's own backward would then be a reentrant one, in which FSDP's and
        # DDP's hooks act otherwise); elsewhere where it saves a wake-up (``_submit``).
        inline = True if inline_device is not None and self.runner.stage.device == inline_device else \
            False if output_grads is not None else None
        # A process holding nothing for the driver answers only if its share fails, where the step leaves nothing
        # behind there (nothing saved, or its backward done, or committed later): :mod:`.answers`.
        settles = not save or spec.eager or any(a.kind != "F" for a in plan.actions[0])
        quiet = {r for r in range(1, p) if settles and not (forwards and r == last)}
        collected, answers = self._submit(run, plan, spec, local, collect if forwards and last == 0 else None,
                                          {last: deliveries} if last != 0 else {}, inline, targets, quiet)
        if not save or (not spec.eager and any(a.kind != "F" for a in plan.actions[0])):
            self._settled.add(run.id, p - 1)  # nothing saved, or a backward done: nothing left behind elsewhere
        results = collected if forwards and last == 0 else None
        if forwards and last != 0:
            if answers[last] is None:  # its outputs dropped as the run was aborted: by a share failing late, whose
                self.settle()  # error this raises (a quiet process's late answer), or:
                raise RuntimeError(f"the last stage's outputs of run {run.id} were dropped: the run was aborted")
            results = [answers[last][i] for i in range(m)]
        losses = outputs = None
        if results is not None and run.loss is not None:
            losses = results
        elif results is not None:
            # They travelled through host memory; the driver's code goes on with them where stage 0 is (its GPU).
            device = self.runner.stage.device
            outputs = [Batch(unpack_batch([move_to(t, device) for t in tensors], flags), atomic)
                       for tensors, flags, atomic in results]
        backwards = any(a.kind in "BI" and a.stage == 0 for a in plan.actions[0])
        self.runner.averages.settle()  # the gradients here are averaged before the caller goes on
        return Step(outputs, losses, [grads[i] for i in range(m)] if backwards else None)

    def _submit(self, run: Run, plan: Plan, spec: StepSpec, local: Callable[[], Any],
                collect: Callable[[], Any] | None, deliveries: dict[int, list[tuple[Slot, Any]]],
                inline: bool | None, targets: dict[int, list[tuple[Slot, Any]]], quiet: set[int]) -> Any:
        """Give every process its actions of ``plan`` at once (one message per process), run ``collect`` (the
        driver's own waits, each bounded) meanwhile, and wait for every process. Returns what ``collect``
        returned and each process's answer (None for this one). ``inline``: stage 0 runs on the calling thread
        (True), on its worker (False), or on the calling thread where that saves waking a thread (None: on the
        CPU, no outputs to collect, every other process's step on the data plane). The targets of a step on the
        data plane that do not travel with it go into ``targets`` by micro-batch, for stage 0 to send with its
        output."""
        sends: list[Future[Any]] = []
        aborted = threading.Event()

        def abort() -> None:
            if not aborted.is_set():
                aborted.set()
                self.abort_run(run)

        def on_done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not isinstance(exc, Skipped):
                abort()

        def start() -> None:
            sends.extend(local())  # sends in flight: waited for below, not on the worker

        def send_later() -> None:
            for r, left in later.items():
                sends.extend(steps.deliver(self.runner, self.peers[r], run.id, left))
            later.clear()

        # The last step's gradients are in before this one's actions arrive: where its commit went to the step
        # listener, this step follows it there; the others are waited for now (and those, before a step by RPC).
        settle_commits(self.key, before_steps=True)
        futures: list[Future[Any]] = [Future() for _ in range(self.processes)]  # each process's share
        on_plane: list[int] = []  # the processes whose step went on the data plane: they answer there
        numbers: dict[int, int] = {}  # each one's step: its message's number (answers.sent)
        later: dict[int, list[tuple[Slot, Any]]] = {}  # deliveries too large to travel in a step on the plane
        collected = None
        progress = (self.key, run.id)
        with PROGRESS_LOCK:
            PROGRESS[progress] = 0.0
        try:
            # Inside the try: a process that cannot be reached aborts those that already have their actions.
            # The others' actions first: stage 0 starting here would compete with sending them (for the GIL,
            # and for the cores), and the later stages need their actions before their first input.
            for r in [*range(1, self.processes), 0]:
                if r == 0:
                    # On the calling thread where it can: as the driver waits for nothing else meanwhile (no
                    # outputs to collect; every other process's step on the plane, its failures aborting the run
                    # here), the answers are read next, without a thread to wake in between.
                    if inline is None:
                        inline = collect is None and len(on_plane) == self.processes - 1 and \
                            self.runner.stage.device.type == "cpu"
                    if inline:  # what did not fit into a step goes before stage 0 runs here to its end
                        send_later()
                    future = (Inline() if inline else self.runner.worker).submit(start)
                elif (started := steps.start(self.runner, self.peers[r], run.id, plan.actions[r], spec,
                                             deliveries.get(r, ()), r in quiet)) is not None:
                    left, numbers[r] = started
                    for slot, payload in left:
                        if slot.kind == "T":
                            targets.setdefault(slot.microbatch, []).append((slot, payload))
                        else:
                            later.setdefault(r, []).append((slot, payload))
                    on_plane.append(r)
                    continue
                else:
                    settle_commits(self.key)  # an RPC may overtake a commit sent to the step listener
                    # No RPC timeout on the whole share: its waits are bounded one by one, a lost process fails
                    # the call at once, and a silent one is caught below.
                    extra = deliveries.get(r)
                    args = (self.key, run.id, list(plan.actions[r]), spec) + ((extra,) if extra else ())
                    future = to_concurrent(rpc.rpc_async(self.peers[r], run_share, timeout=0, args=args),
                                           self._describe(r))
                future.add_done_callback(on_done)
                futures[r] = future
            send_later()  # stage 0 has started on its worker: what did not fit into a step goes now
            if collect is not None:
                with contextlib.suppress(Skipped):  # a stage failed: the error is in its future
                    collected = collect()
            error: BaseException | None = None
            by_rpc = [r for r in range(self.processes) if r not in on_plane]  # this process first
            try:
                drain([futures[r] for r in by_rpc], grace=self.runner.timeout, ready=futures[0],
                      alive=lambda: PROGRESS.get(progress, 0.0),
                      describe=lambda k: f"stage {self._stages(by_rpc[k])} ({where(self.peers[by_rpc[k]])}) of "
                                         f"pipeline '{self.key}'")
            except BaseException as exc:  # noqa: BLE001 - raised once the answers on the plane are in
                error = exc
            failed = error is not None or aborted.is_set() or run.failed or self.runner.has_failed(run.id) or \
                any(futures[r].done() and futures[r].exception() is not None for r in by_rpc)
            # Every answer, after a failure too: the first real error in process order wins.
            late = answers.collect(self.runner, self.peers, run.id, futures, on_plane, numbers, quiet, self._stages,
                                   failed, abort, on_done, self._unanswered, self._ask)
            error = error or late
            if error is not None:
                raise error
            drain(sends)
            settle_commits(self.key, shares=False)  # the last commits' answers came before this step's
        except BaseException:
            abort()
            raise
        finally:
            with PROGRESS_LOCK:
                PROGRESS.pop(progress, None)
        return collected, [None] + [f.result() for f in futures[1:]]

    def abort_run(self, run: Run) -> None:
        """Fail ``run`` here and in every other process of the pipeline."""
        run.failed = True
        steps.abort_everywhere(self.runner, run.id)

    def settle(self) -> None:
        """Wait until every process is done with what it was sent (the steps it did not answer, commits in flight),
        raising their errors: a step returns once the driver has what it needs, so a process may still be finishing
        its share (its parameters' gradients). Before reaching a process by an RPC of one's own, settle."""
        settle_commits(self.key)

    def call(self, process: int, method: str, *args: Any) -> Any:
        """Call ``method`` of process ``process``'s runner (here for process 0, by RPC otherwise), once settled."""
        self.settle()
        if process == 0:
            return getattr(self.runner, method)(*args)
        return rpc.rpc_sync(self.peers[process], call_runner, args=(self.key, method, *args),
                            timeout=self.runner.timeout)

    def close(self) -> None:
        """Stop the local worker and forget this pipeline here (an error of a commit in flight is raised)."""
        unregister(self.key)
        try:
            settle_commits(self.key)
        finally:
            answers.forget(self.key)
            self._close_plane()

    def _close_plane(self) -> None:
        if self.runner.plane is not None:
            for peer in self.peers[1:]:
                try:
                    rpc.rpc_async(peer, detach, args=(self.key,), timeout=self.runner.timeout)
                except Exception:  # noqa: BLE001 - a process already gone has no plane left
                    pass
        self.runner.stop()
