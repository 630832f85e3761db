"""Stages in other processes: hosted behind ``torch.distributed.rpc``, driven from the driver's pipe.

The driver holds stage 0 and runs the schedule; every other stage lives in its own process. Tensors go
straight from stage to stage (``deliver`` into the receiver's :class:`Mailbox`), never through the
driver, and only small control messages come from it::

    driver ──act F(i)──► stage 1 ──act F(i)──► ...        (one RPC per action, in schedule order)
    stage 0 ══ x_i ══► stage 1 ══ x_i ══► stage 2 ══ y_i ══► driver mailbox

Each stage executes its actions in schedule order on one worker thread, exactly like the local
pipeline, with the same :class:`~lightning_pipe.stage.Stage` doing the work. A failure anywhere aborts
the run on every stage (waiting actions wake up and skip), and the driver raises the first real error,
naming the stage and the process. Every wait is bounded by the RPC timeout, so a lost process becomes an
error, not a hang.
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from lightning_pipe.microbatch import Batch
from lightning_pipe.pipeline import Run, _Skipped, drain
from lightning_pipe.rng import LazySeed
from lightning_pipe.schedule import Action, backward_plan, forward_plan, stage_order
from lightning_pipe.skip.layout import SkipLayout, inspect_skip_layout
from lightning_pipe.stage import Grads, Stage, _move
from lightning_pipe.worker import Inline, Worker, autocast_context

__all__: list[str] = []

#: Where a message goes: (pipe key, run id, "F" or "B", micro-batch, receiving stage, sender or skip key).
Slot = tuple[str, int, str, int, int, Hashable]


class Mailbox:
    """Tensors delivered to this process, waiting for the action that consumes them."""

    def __init__(self) -> None:
        self._items: dict[Slot, Any] = {}
        self._cond = threading.Condition()
        self._aborted: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)

    def put(self, slot: Slot, value: Any) -> None:
        """Deliver ``value`` to ``slot``."""
        with self._cond:
            if slot[:2] not in self._aborted:
                self._items[slot] = value
                self._cond.notify_all()

    def take(self, slot: Slot, timeout: float, describe: Callable[[], str]) -> Any:
        """Wait for ``slot`` (at most ``timeout`` seconds) and remove it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while slot not in self._items:
                if slot[:2] in self._aborted:
                    raise _Skipped()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{describe()} waited {timeout:.1f} s for its input and got none; the "
                                       "process that should send it is stuck or gone (rpc_timeout_sec bounds "
                                       "this wait)")
                self._cond.wait(remaining)
            return self._items.pop(slot)

    def pending(self) -> int:
        """How many delivered messages wait for their consumer."""
        with self._cond:
            return len(self._items)

    def abort(self, key: str, run: int) -> None:
        """Wake every wait of run ``run`` (they skip) and drop what was delivered for it."""
        with self._cond:
            self._aborted.append((key, run))
            for slot in [s for s in self._items if s[:2] == (key, run)]:
                del self._items[slot]
            self._cond.notify_all()


MAILBOX = Mailbox()
_RUNNERS: dict[str, StageRunner] = {}

# When a driver last heard that a remote stage is still working on a step: (pipeline key, run) -> the
# time.monotonic() of that sign of life. An entry exists while the driver waits for that step.
_PROGRESS: dict[tuple[str, int], float] = {}
_PROGRESS_LOCK = threading.Lock()


def _alive(key: str, run: int) -> None:
    with _PROGRESS_LOCK:
        if (key, run) in _PROGRESS:
            _PROGRESS[(key, run)] = time.monotonic()


def _pack(batch_tensors: Sequence[Tensor], direct: torch.device | None = None) -> tuple[list[Tensor], list[bool]]:
    # Tensors cross processes detached, on CPU unless they are on the GPU ``direct`` that RPC maps to the
    # receiver's; the flags say which ones need a gradient back.
    return list(_wire(batch_tensors, direct)), [t.requires_grad for t in batch_tensors]


def _wire(tensors: Sequence[Tensor | None], direct: torch.device | None = None) -> tuple[Tensor | None, ...]:
    """``tensors`` as they go to another process: detached; on CPU, except those on ``direct``, a GPU from
    which RPC sends them to the receiver's GPU as they are (a TensorPipe device map)."""
    return tuple(None if t is None else t.detach() if t.device == direct else t.detach().cpu() for t in tensors)


def _maps(peer: str, device: torch.device) -> bool:
    """Whether RPC sends CUDA tensors on ``device`` to process ``peer`` as they are (a device map for it)."""
    try:
        mapping = rpc.api._get_current_rpc_agent()._get_device_map(rpc.get_worker_info(peer))
    except Exception:  # noqa: BLE001 - no TensorPipe agent, or an older one: through host memory
        return False
    return any(torch.device(local) == device for local in mapping)


def _landed(payload: Any) -> Any:
    """``payload`` as received by RPC, ready for this process's threads: CUDA tensors arrive on a stream of
    RPC's own, so wait for it, and let the memory allocator know that the default stream uses them."""
    tensors = [t for t in _tensors(payload) if t.is_cuda]
    for device in {t.device for t in tensors}:
        torch.cuda.current_stream(device).synchronize()
    for t in tensors:
        t.record_stream(torch.cuda.default_stream(t.device))
    return payload


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _unpack(tensors: Sequence[Tensor], flags: Sequence[bool]) -> tuple[Tensor, ...]:
    return tuple(t.requires_grad_(f) if t.is_floating_point() or t.is_complex() else t
                 for t, f in zip(tensors, flags))


def where(name: str) -> str:
    """``"rank 3, process 'worker3'"``: how errors name a process."""
    try:
        return f"rank {rpc.get_worker_info(name).id}, process '{name}'"
    except Exception:  # noqa: BLE001 - RPC already down: the name is all there is
        return f"process '{name}'"


def _deliver(slot: Slot, payload: Any) -> None:
    MAILBOX.put(slot, _landed(payload))


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


class _Failure:
    """An action's error, sent back as a value: RPC would turn an exception set on an async function's
    future into a plain return value, so failures travel explicitly. The exception keeps its type, its
    message and its notes; its remote traceback comes along as a note."""

    def __init__(self, exc: BaseException) -> None:
        if not isinstance(exc, _Skipped) and exc.__traceback__ is not None:
            exc.add_note("Traceback in the stage's process (most recent call last):\n" +
                         "".join(traceback.format_tb(exc.__traceback__)).rstrip())
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that cannot cross processes becomes one that can
            plain = RuntimeError(f"{type(exc).__name__}: {exc}")
            for note in getattr(exc, "__notes__", []):
                plain.add_note(note)
            exc = plain
        self.exc = exc


def _chain_into(future: torch.futures.Future, result: Future[Any], describe: Callable[[], str]) -> None:
    """Complete ``result`` with the outcome of an RPC ``future`` (a sent failure becomes its exception)."""

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
            if isinstance(value, _Failure):
                raise value.exc
            result.set_result(value)
        except BaseException as exc:  # noqa: BLE001
            result.set_exception(_located(exc, describe))

    future.add_done_callback(done)


def to_concurrent(future: torch.futures.Future, describe: Callable[[], str]) -> Future[Any]:
    """A ``concurrent.futures.Future`` with the outcome of an RPC ``future``; its error is noted with
    ``describe()`` (where it came from)."""
    result: Future[Any] = Future()
    _chain_into(future, result, describe)
    return result


def _located(exc: BaseException, describe: Callable[[], str]) -> BaseException:
    if isinstance(exc, _Skipped) or "_Skipped" in str(exc).split("\n", 1)[0]:
        return _Skipped()
    if not getattr(exc, "_lightning_pipe_where", False):
        text = str(exc)
        lost = any(sign in text for sign in ("EOF", "end of file", "Connection reset", "pipe closed",
                                             "Connection refused"))
        exc.add_note(describe() + (": its process exited or was killed" if lost else ""))
        exc._lightning_pipe_where = True  # type: ignore[attr-defined]
    return exc


# ---------------------------------------------------------------------- host-side RPC entry points
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
    stage 0 it returns the pipeline to run with :func:`~lightning_pipe.pipe.run_pipeline` once every stage
    is ready; elsewhere it hosts this process's stage and returns None (RPC threads serve it until
    ``rpc.shutdown``). This is what ``PipeStrategy`` does for Lightning, without Lightning.
    """
    from lightning_pipe.pipe import normalize_device, split_module  # pipe.py depends on this module's neighbours

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


# ---------------------------------------------------------------------- the driver side
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

    Same interface as :class:`~lightning_pipe.pipeline.LocalPipeline`: :meth:`forward` and
    :meth:`backward` per :class:`~lightning_pipe.pipeline.Run`.
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
