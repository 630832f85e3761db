"""A stage in its process: runs the stage's share of each step in schedule order, and the RPC entry points
through which its driver reaches it.

Each stage executes its actions in schedule order on one worker thread, exactly like the local pipeline,
with the same :class:`~lightning_pipe.engine.stage.Stage` doing the work; inputs are taken from the
mailbox, outputs sent straight to the stage that needs them::

    driver ──act F(i)──► stage 1 ──act F(i)──► ...        (one RPC per stage and step, its actions in order)
    stage 0 ══ x_i ══► stage 1 ══ x_i ══► stage 2 ══ y_i ══► driver

A failure anywhere aborts the run on every stage (waiting actions wake up and skip). Every wait is bounded
by the RPC timeout, so a lost process becomes an error, not a hang.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.pipeline import _Skipped
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.engine.stage import Grads, Stage
from lightning_pipe.engine.worker import Inline, Worker, autocast_context
from lightning_pipe.transport.messages import (
    MAILBOX,
    Slot,
    _alive,
    _chain_into,
    _deliver,
    _Failure,
    _landed,
    _located,
    _maps,
    _pack,
    _unpack,
    _wire,
    where,
)

__all__: list[str] = []

_RUNNERS: dict[str, StageRunner] = {}


class StageRunner:
    """Runs the actions of stage ``index`` of pipeline ``key`` in this process.

    ``peers[j]`` is the RPC name of the process holding stage ``j``; ``peers[n]`` receives the last
    stage's outputs (the driver).
    """

    def __init__(self, key: str, stage: Stage, peers: Sequence[str], layout: SkipLayout, timeout: float) -> None:
        self.key = key
        self.stage = stage
        self.index = stage.index
        self.peers = list(peers)
        self.n = len(peers) - 1
        self.layout = layout
        self.timeout = timeout
        self.me = rpc.get_worker_info().name
        self.worker = Worker(f"lightning_pipe.{key}.stage{self.index}")
        # Where sends start (see ``_send``): on the stage's own thread for a CPU stage.
        self.sender: Worker | Inline = Inline() if stage.device.type == "cpu" else \
            Worker(f"lightning_pipe.{key}.stage{self.index}.send")
        self._seeds: dict[int, LazySeed] = {}
        self._failed: collections.deque[int] = collections.deque(maxlen=4096)
        # The last stage's outputs for a driver in another process, per run and micro-batch: they go back
        # in the answer to the forward's actions (the driver needs none before the last one), one message
        # instead of one delivery and its acknowledgement per micro-batch.
        self._held: dict[int, dict[int, Any]] = {}
        self._beat = 0.0  # when this stage last told the driver it is still working
        # False: the run's training flag sets every layer's mode. True: each layer's mode is set as the
        # driver's copy of it is (by PipeStrategy: ``layer.eval()`` on one layer, frozen BatchNorm).
        self.modes_from_driver = False
        self._direct: dict[int, torch.device | None] = {}

    def direct(self, dst: int) -> torch.device | None:
        """This stage's GPU if its tensors go to stage ``dst`` (``n``: the driver) as they are, GPU to GPU
        (in this process, or by RPC with a device map); None if they go through host memory."""
        if dst not in self._direct:
            device, peer = self.stage.device, self.peers[dst]
            mapped = device.type == "cuda" and (peer == self.me or _maps(peer, device))
            self._direct[dst] = device if mapped else None
        return self._direct[dst]

    def describe(self) -> str:
        """The stage and the process, for error messages."""
        return f"stage {self.index} of pipeline '{self.key}' ({where(self.me)})"

    def _send(self, dst: int, slot: Slot, payload: Any) -> Future[Any] | None:
        """Deliver ``payload`` to stage ``dst``; returns the send in flight (None when ``dst`` is here).

        A CPU stage starts the message itself, before its next micro-batch: its cores are busy computing,
        so a thread of its own would have to wait for one while the next stage waits for the message (2.5-
        3.6% slower per step on 2 cores, measured). A GPU stage hands it to its sender thread and goes back
        to launching kernels. Either way an error in starting the send (a payload that cannot be pickled)
        fails this send, and so the action, instead of leaving the receiver to wait out the timeout.
        """
        peer = self.peers[dst]
        if peer == self.me:
            MAILBOX.put(slot, payload)
            return None
        sent: Future[Any] = Future()
        describe = lambda: f"{self.describe()} could not send to stage {dst} ({where(peer)})"  # noqa: E731

        def send() -> None:
            _chain_into(rpc.rpc_async(peer, _deliver, args=(slot, payload), timeout=self.timeout), sent, describe)

        def started(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None and not sent.done():
                sent.set_exception(_located(exc, describe))

        self.sender.submit(send).add_done_callback(started)
        return sent

    def _take(self, slot: Slot, timeout: float | None = None) -> Any:
        if slot[1] in self._failed:
            raise _Skipped()
        src = slot[5]
        if isinstance(src, int):
            source = f"stage {src} ({where(self.peers[src])})" if src < self.n else "the driver"
        else:
            source = f"the stage stashing '{src[1]}'"
        return MAILBOX.take(slot, timeout or self.timeout,
                            lambda: f"{self.describe()}, micro-batch {slot[3]} ({slot[2]}) from {source}")

    def forward(self, run: int, i: int, m: int, save: bool, checkpoint_stop: int, training: bool,
                autocast: list[tuple[str, torch.dtype]], inputs: Batch | None = None) -> list[Future[Any]]:
        """Forward of micro-batch ``i`` in mode ``training`` under the driver's ``autocast``; sends the
        outputs on and returns the sends in flight."""
        j = self.index
        if not self.modes_from_driver and self.stage.partition.training != training:
            self.stage.partition.train(training)
        if inputs is None:
            tensors, flags, atomic = self._take((self.key, run, "F", i, j, j - 1))
            inputs = Batch(_unpack(tensors, flags), atomic)
        imports = {}
        for skip in self.layout.imports[j]:
            tensors, flags = self._take((self.key, run, "F", i, j, skip))
            imports[skip] = _unpack(tensors, flags)[0]
        seed = self._seeds.setdefault(run, LazySeed())
        with autocast_context(autocast):
            out, exports = self.stage.forward(run, i, inputs, imports, seed=seed, save=save,
                                              checkpoint=i < checkpoint_stop, last=i == m - 1)
        if not save and i == m - 1:
            self._seeds.pop(run, None)  # nothing to recompute: the seed is not needed any more
        if j + 1 == self.n and self.peers[self.n] != self.me:
            # Through host memory: it goes back in an RPC answer, which the driver waits for on no stream.
            self._held.setdefault(run, {})[i] = (*_pack(out.tensors), out.atomic)
            sends = []
        else:
            payload = (*_pack(out.tensors, self.direct(j + 1)), out.atomic)
            sends = [self._send(j + 1, (self.key, run, "F", i, j + 1, j), payload)]
        for skip, dst in self.layout.exports[j].items():
            sends.append(self._send(dst, (self.key, run, "F", i, dst, skip), _pack([exports[skip]], self.direct(dst))))
        return [s for s in sends if s is not None]

    def backward(self, run: int, microbatches: Sequence[int], later: list[Callable[..., None]] | None = None
                 ) -> list[Future[Any]] | list[Grads]:
        """Backward of ``microbatches`` (several: one autograd call); sends input grads upstream.

        Stage 0 returns its input gradients instead of sending them. With ``later``, only what goes upstream
        is computed before it is sent, where that is safe (:meth:`Stage.backward_inputs_first`), and the
        function that computes the rest is appended to ``later``.
        """
        j = self.index
        items = []
        for i in microbatches:
            grads = self._take((self.key, run, "B", i, j, j + 1))
            skip_grads = {skip: self._take((self.key, run, "B", i, j, skip))[0] for skip in self.layout.exports[j]}
            items.append((i, grads, skip_grads))
        if later is None:
            results = self.stage.backward(run, items)
        else:
            results, finish = self.stage.backward_inputs_first(run, items)
            later.append(finish)
        if not self.stage.has_saved(run):
            self._seeds.pop(run, None)  # the run's last backward here: nothing will be recomputed
        if j == 0:
            return [grad_inputs for grad_inputs, _ in results]
        sends = []
        for i, (grad_inputs, grad_imports) in zip(microbatches, results):
            sends.append(self._send(j - 1, (self.key, run, "B", i, j - 1, j), _wire(grad_inputs, self.direct(j - 1))))
            for skip, src in self.layout.imports[j].items():
                sends.append(self._send(src, (self.key, run, "B", i, src, skip),
                                        _wire((grad_imports.get(skip),), self.direct(src))))
        return [s for s in sends if s is not None]

    def run_actions(self, kind: str, run: int, groups: Sequence[Sequence[int]], m: int, save: bool,
                    checkpoint_stop: int, training: bool, autocast: list[tuple[str, torch.dtype]],
                    anomaly: bool = False, dtype: torch.dtype | None = None) -> list[Future[Any]]:
        """This stage's share of one step, in schedule order: forward (``"F"``) of each micro-batch, or
        backward (``"B"``) of each group of micro-batches, with the driver's anomaly detection and default
        dtype (``precision="64-true"`` sets it there: tensors a layer creates must have it here too).
        Returns the sends still in flight."""
        sends: list[Future[Any]] = []
        self._beat = time.monotonic()
        if dtype is not None and torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)  # a process of its own, serving this stage
        # The stage before waits for this stage's first backward: it gets its gradients before this stage
        # computes its parameters' gradients of that backward, which are left for the end of the share.
        later: list[Callable[..., None]] = []
        with torch.autograd.set_detect_anomaly(anomaly):
            try:
                for k, group in enumerate(groups):
                    if kind == "F":
                        (i,) = group
                        sends += self.forward(run, i, m, save, checkpoint_stop, training, autocast)
                    else:
                        first = k == 0 and self.index > 0
                        sends += self.backward(run, group, later if first else None)  # type: ignore[arg-type]
                    self._still_working(run)
            except BaseException:
                for finish in later:
                    finish(False)
                raise
            for finish in later:
                finish()
                self._still_working(run)
        return sends

    def _still_working(self, run: int) -> None:
        """Tell a driver in another process that this stage is making progress, at most every third of the
        timeout: a slow stage that keeps finishing micro-batches is not taken for a stuck one (a stuck one
        finishes none). Fast stages never send it."""
        driver = self.peers[self.n]
        now = time.monotonic()
        if driver != self.me and now - self._beat >= self.timeout / 3:
            self._beat = now
            rpc.rpc_async(driver, _alive, args=(self.key, run), timeout=self.timeout)

    def take_held(self, run: int) -> dict[int, Any] | None:
        """The outputs held for the driver from run ``run`` (see ``forward``), forgotten here."""
        return self._held.pop(run, None)

    def named_grads(self) -> dict[str, Tensor | None]:
        """The gradients of this stage's parameters, by name within the partition."""
        return {name: None if p.grad is None else p.grad.detach().cpu()
                for name, p in self.stage.partition.named_parameters()}

    def zero_grad(self) -> None:
        """Drop this stage's parameter gradients."""
        self.stage.partition.zero_grad(set_to_none=True)

    def fail(self, run: int) -> None:
        """Mark ``run`` failed: its queued actions skip and its waits wake up."""
        self._failed.append(run)
        self._held.pop(run, None)
        MAILBOX.abort(self.key, run)

    def stop(self) -> None:
        """Let this stage's threads finish their queued work and exit."""
        self.worker.stop()
        if isinstance(self.sender, Worker):
            self.sender.stop()

    def release(self, run: int) -> None:
        """Forget what is kept for ``run``."""
        self._seeds.pop(run, None)
        self._held.pop(run, None)
        self.stage.release(run)


# ---------------------------------------------------------------------- RPC entry points of a stage's process
def register(runner: StageRunner) -> None:
    """Make ``runner`` reachable by its pipeline key in this process."""
    _RUNNERS[runner.key] = runner


def unregister(key: str) -> None:
    """Forget the runner of pipeline ``key`` in this process."""
    _RUNNERS.pop(key, None)


def _chain(runner: StageRunner, work: Callable[[], tuple[list[Future[Any]], Any]]) -> torch.futures.Future:
    """Run ``work`` on the stage's worker; once it and the sends it started are done, answer with the value
    it returned beside them."""
    out: torch.futures.Future = torch.futures.Future()

    def finish(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_result(_Failure(exc))
            return
        sends, value = f.result()
        pending = [len(sends)]
        if not sends:
            out.set_result(value)
            return
        lock = threading.Lock()

        def sent(s: Future[Any]) -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            with lock:
                if out.done():
                    return
                if s.exception() is not None:
                    out.set_result(_Failure(s.exception()))  # type: ignore[arg-type]
                elif last:
                    out.set_result(value)

        for s in sends:
            s.add_done_callback(sent)

    runner.worker.submit(work).add_done_callback(finish)
    return out


@rpc.functions.async_execution
def _act(key: str, kind: str, run: int, groups: list[list[int]], m: int, save: bool, checkpoint_stop: int,
         training: bool, autocast: list[tuple[str, torch.dtype]], anomaly: bool, dtype: torch.dtype,
         deliveries: Sequence[tuple[Slot, Any]] = ()) -> torch.futures.Future:
    runner = _RUNNERS[key]
    for slot, payload in deliveries:  # inputs that travelled with the actions (the output gradients)
        MAILBOX.put(slot, _landed(payload))

    def work() -> tuple[list[Future[Any]], Any]:
        sends = runner.run_actions(kind, run, groups, m, save, checkpoint_stop, training, autocast, anomaly, dtype)
        return sends, runner.take_held(run) if kind == "F" else None

    return _chain(runner, work)


def _abort(key: str, run: int) -> None:
    runner = _RUNNERS.get(key)
    if runner is not None:
        runner.fail(run)


def _release(key: str, run: int) -> None:
    runner = _RUNNERS.get(key)
    if runner is not None:
        runner.release(run)


def call_runner(key: str, method: str, *args: Any) -> Any:
    """Call ``method`` of this process's runner of pipeline ``key`` (an RPC entry point)."""
    return getattr(_RUNNERS[key], method)(*args)


def _is_registered(key: str) -> bool:
    return key in _RUNNERS
