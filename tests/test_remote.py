"""Stages in other processes over torch.distributed.rpc: the same outputs and gradients as one process."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed.rpc as rpc
from dist_utils import run_processes
from torch import nn

from lightning_pipe.engine import pipeline_loss, run_pipeline
from lightning_pipe.skip import pop, skippable, stash
from lightning_pipe.transport import pipeline_over_rpc


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x * 1.5


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x + skip.sin()


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Stash(), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), Pop(), nn.Linear(8, 2))


class _SingleBackward:
    """A pipeline whose backward runs one autograd call per stage (pipelined_backward=False)."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.stages = pipeline.stages
        self.forward = pipeline.forward

    def backward(self, run, grads, **kwargs):
        return self.pipeline.backward(run, grads, **{**kwargs, "pipelined": False})


class _InlineStage0:
    """A pipeline whose stage 0 runs its backward on the calling thread, as it does when that thread is
    autograd's thread for stage 0's GPU; records which threads ran stage 0's backward."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.stages = pipeline.stages
        self.forward = pipeline.forward
        self.threads: set[int] = set()
        self.caller: int | None = None
        stage = pipeline.runner.stage  # stage 0
        original = stage.backward

        def backward(*args, **kwargs):
            self.threads.add(threading.get_ident())
            return original(*args, **kwargs)

        stage.backward = backward

    def backward(self, run, grads, **kwargs):
        self.caller = threading.get_ident()
        return self.pipeline.backward(run, grads, **{**kwargs, "inline_device": self.pipeline.runner.stage.device})


def _transparency(rank: int, world: int, balances: list[list[int]], configs: list[tuple[int, str, bool | str]],
                  plane: str = "auto"):
    checked = []
    for k, balance in enumerate(balances):  # one pipeline after another in the same processes
        pipeline = pipeline_over_rpc(f"test{k}", build(), balance, [f"worker{r}" for r in range(world)], timeout=20,
                                     data_plane=plane)
        if pipeline is not None:  # else this process hosts its stage (until rpc.shutdown)
            checked.append(_compare(pipeline, balance, configs))
    return checked if rank == 0 else None


def _compare(pipeline, balance: list[int], configs: list[tuple[int, str, bool | str]]) -> int:
    reference = build()
    checked = 0
    for chunks, checkpoint, pipelined in configs:
        x = torch.randn(10, 6)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x1)
        driver = {True: pipeline, False: _SingleBackward(pipeline), "inline": _InlineStage0(pipeline)}[pipelined]
        actual = run_pipeline(driver, x2, chunks=chunks, checkpoint=checkpoint, training=True, parameters=iter([]))
        torch.testing.assert_close(actual, expected)
        expected.pow(2).sum().backward()
        actual.pow(2).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad)
        if pipelined == "inline":
            assert driver.threads == {driver.caller}
            del pipeline.runner.stage.backward  # the class's again
        grads = {}
        for j in range(len(balance)):
            grads.update(pipeline.call(j, "named_grads"))
            pipeline.call(j, "zero_grad")
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=f"{name} ({chunks}, {checkpoint})")
            checked += 1
        reference.zero_grad()
        with torch.no_grad():
            evaluated = run_pipeline(pipeline, x, chunks=chunks, checkpoint=checkpoint, training=False,
                                     parameters=iter([]))
        torch.testing.assert_close(evaluated, reference(x))
    pipeline.close()
    return checked


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plane", ["auto", "rpc"])
def test_remote_stages_match_one_process(plane):
    """Over the default data plane (point-to-point) and over RPC alone."""
    configs = [(1, "never", True), (4, "always", True), (3, "except_last", True), (10, "never", True),
               (4, "always", False), (5, "never", False), (4, "except_last", "inline")]
    out = run_processes(_transparency, 3, [[2, 3, 2], [1, 5, 1]], configs, plane, timeout=150)
    assert out[0] == [6 * len(configs)] * 2  # every parameter's gradient compared, in every configuration


def _schedules(rank: int, world: int, cases: list[tuple[str, int, int, str]], plane: str = "auto"):
    """Every schedule through processes, the loss on the last stage: the plain model's loss, parameters' and
    input's gradients (with 2 processes x 2 stages each for the interleaved one), over data plane ``plane``."""
    compared = []
    for k, (schedule, v, chunks, checkpoint) in enumerate(cases):
        model = build()
        n = len(model)
        parts = world * v
        balance = [n // parts + (1 if j < n % parts else 0) for j in range(parts)]
        pipeline = pipeline_over_rpc(f"schedule{k}", model, balance, [f"worker{r}" for r in range(world)],
                                     timeout=20, virtual_stages=v, data_plane=plane)
        if pipeline is None:
            continue
        reference = build()
        x, y = torch.randn(10, 6), torch.randn(10, 2)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = _mse(reference(x1), y)
        for step in range(2):  # the second accumulates onto the first, through commit
            loss = pipeline_loss(pipeline, x2, y, _mse, chunks=chunks, checkpoint=checkpoint, training=True,
                                 parameters=iter([]), schedule=schedule)
            torch.testing.assert_close(loss, expected)
            (loss * (step + 1)).backward()
        (expected * 3).backward()
        torch.testing.assert_close(x2.grad, x1.grad)
        grads = {}
        for r in range(world):
            grads.update(pipeline.call(r, "named_grads"))
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=f"{name} ({schedule})")
        with torch.no_grad():  # evaluation: losses alone come back
            torch.testing.assert_close(pipeline_loss(pipeline, x, y, _mse, chunks=chunks, checkpoint=checkpoint,
                                                     training=False, parameters=iter([]), schedule=schedule),
                                       _mse(reference(x), y))
        compared.append(schedule)
        pipeline.close()
    return compared if rank == 0 else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plane", ["auto", "rpc"])
def test_every_schedule_across_processes_matches_one_process(plane):
    cases = [("gpipe", 1, 4, "except_last"), ("1f1b", 1, 4, "never"), ("zero-bubble", 1, 5, "always"),
             ("interleaved-1f1b", 2, 4, "except_last")]
    out = run_processes(_schedules, 2, cases, plane, timeout=150)
    assert out[0] == [c[0] for c in cases]


def _stage_state(key: str) -> dict[str, int]:
    """What the remote stage of pipeline ``key`` in this process keeps, and how often it was told to release."""
    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS[key]
    if not hasattr(runner, "released"):
        runner.released = 0
        original = runner.release

        def release(run: int) -> None:
            original(run)
            runner.released += 1  # counted once done: a state read meanwhile must not see it half-released

        runner.release = release
    return {"saved": len(runner.stage._saved), "seeds": len(runner._seeds), "held": len(runner._held),
            "aside": sum(stage.aside.pending() for stage in runner.stages.values()), "released": runner.released}


def _releases(rank: int, world: int):
    import gc
    import time

    from lightning_pipe.transport.wire.riders import settle_commits

    pipeline = pipeline_over_rpc("test", build(), [2, 3, 2], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    def states():
        # As whatever reaches a process next for the pipeline: the commits not sent yet go (or went) first.
        settle_commits("test")
        return [rpc.rpc_sync(f"worker{j}", _stage_state, args=("test",)) for j in (1, 2)]

    states()
    seen = {}
    for case in ("backward", "eval", "unused", "backward of one micro-batch group", "1f1b loss", "1f1b loss unused"):
        x = torch.randn(8, 6, requires_grad=True)
        kwargs = dict(chunks=4, checkpoint="except_last", training=case != "eval", parameters=iter([]))
        if case.startswith("1f1b"):  # the backwards run in the forward, their gradients set aside for commit
            y = pipeline_loss(pipeline, x, torch.randn(8, 2), _mse, schedule="1f1b", **kwargs)
            if case == "1f1b loss":
                y.backward()
        elif case == "eval":
            with torch.no_grad():
                y = run_pipeline(pipeline, x, **kwargs)
        else:
            driver = _SingleBackward(pipeline) if case.startswith("backward of one") else pipeline
            y = run_pipeline(driver, x, **kwargs)
            if case != "unused":
                y.pow(2).sum().backward()
        del y
        gc.collect()
        deadline = time.monotonic() + 10
        while True:  # a release message travels on its own: wait for it a little
            seen[case] = states()
            if "unused" not in case or all(s["aside"] == 0 and s["released"] for s in seen[case]) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    remembered = len(pipeline._settled)
    pipeline.close()
    return seen, remembered


@pytest.mark.timeout(120)
def test_runs_done_with_need_no_release_message():
    """A run whose backward (or saving-nothing forward) finished leaves nothing on remote stages, so freeing
    it sends them nothing; a forward freed without its backward is released there."""
    seen, remembered = run_processes(_releases, 3, timeout=100)[0]
    for case, stages in seen.items():
        for j, state in enumerate(stages, 1):
            assert (state["saved"], state["seeds"], state["held"], state["aside"]) == (0, 0, 0, 0), (case, j, state)
    released = {case: [s["released"] for s in stages] for case, stages in seen.items()}
    assert released["backward"] == [0, 0] and released["eval"] == [0, 0]
    assert released["unused"] == [1, 1]  # counted since the start: the one run that needed it
    assert released["backward of one micro-batch group"] == [1, 1]  # nothing more after it
    assert released["1f1b loss"] == [1, 1]  # its gradients were committed: nothing more
    assert released["1f1b loss unused"] == [2, 2]  # never committed: released, and its gradients dropped
    assert remembered == 0  # the driver forgets settled runs as they are freed


def _events(key: str) -> list[tuple[float, str, int]]:
    """The events recorded so far by this process's stage of pipeline ``key`` (recording starts
    with the first call)."""
    from lightning_pipe.engine.timeline import Recorder
    from lightning_pipe.transport.stages.entries import RUNNERS

    stage = RUNNERS[key].stage
    if stage.recorder is None:
        stage.recorder = Recorder()
    return sorted((e.start, e.kind, e.microbatch) for e in stage.recorder.events())


def _inputs_first(rank: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16),
                          nn.Linear(16, 2))
    pipeline = pipeline_over_rpc("test", copy.deepcopy(model), [2, 4], [f"worker{r}" for r in range(world)],
                                 timeout=20)
    if pipeline is None:
        return None
    rpc.rpc_sync("worker1", _events, args=("test",))
    x = torch.randn(8, 6)
    for checkpoint in ("except_last", "always"):
        out = run_pipeline(pipeline, x, chunks=4, checkpoint=checkpoint, training=True,
                           parameters=pipeline.runner.stage.partition.parameters())
        out.square().sum().backward()
    pipeline.settle()  # the last stage did not answer the backwards (they went well): done before it is asked
    order = [kind + str(i) for _, kind, i in rpc.rpc_sync("worker1", _events, args=("test",))]
    grads = {**pipeline.call(0, "named_grads"), **pipeline.call(1, "named_grads")}
    for _ in range(2):
        model(x).square().sum().backward()
    expected = dict(model.named_parameters())
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].grad, msg=name)
    pipeline.close()
    return order, len(grads)


@pytest.mark.timeout(120)
def test_later_stages_send_input_gradients_before_computing_their_parameters_gradients():
    """The last stage's first backward (micro-batch 3) computes what stage 0 waits for, sends it, and leaves
    its parameters' gradients of that micro-batch for after the others; the gradients are still the plain
    model's, with and without recomputation."""
    order, compared = run_processes(_inputs_first, 2, timeout=100)[0]
    # Per step: the input gradients of 3 ("B3"), then 2, 1 and 0 whole, then the parameters' gradients of 3.
    assert order == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0", "W3"] * 2
    assert compared == 8  # every parameter's gradient matched the plain model's (checked in the driver)


class Unsendable(torch.Tensor):
    """A tensor that cannot be pickled, so it cannot travel to another process."""

    def __reduce_ex__(self, protocol):
        raise TypeError("this tensor cannot leave its process")


class Fails(nn.Module):
    """Raises in forward or backward on command (``mode`` is set through the stage's partition), or hands
    on a tensor that cannot be sent."""

    def __init__(self):
        super().__init__()
        self.mode = "none"

    def forward(self, x):
        if self.mode == "forward":
            raise ValueError("bad shape in the middle")
        if self.mode == "unsendable":
            return x.as_subclass(Unsendable)
        return _Raise.apply(x) if self.mode == "backward" else x


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward broke in the middle")


def _set_mode(mode: str) -> None:
    from lightning_pipe.engine.worker import Inline, Worker
    from lightning_pipe.transport.stages.entries import RUNNERS

    runner = RUNNERS["test"]
    threaded = mode.endswith("(send thread)")  # sends started from a thread of their own, as a GPU stage's are
    runner.sender = Worker("sends") if threaded else Inline()
    runner.stage.partition[0].mode = mode.removesuffix(" (send thread)")


def _errors(rank: int, world: int):
    model = nn.Sequential(nn.Linear(3, 3), Fails(), nn.Linear(3, 3))
    pipeline = pipeline_over_rpc("test", model, [1, 1, 1], [f"worker{r}" for r in range(world)], timeout=20)
    if pipeline is None:
        return None
    seen = {}
    for mode in ("forward", "backward", "unsendable", "unsendable (send thread)"):
        rpc.rpc_sync("worker1", _set_mode, args=(mode,))
        try:
            run_pipeline(pipeline, torch.randn(8, 3), chunks=4, checkpoint="never", training=True,
                         parameters=iter([torch.zeros(1, requires_grad=True)])).sum().backward()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            seen[mode] = (type(exc).__name__, str(exc) + "\n".join(getattr(exc, "__notes__", [])))
    rpc.rpc_sync("worker1", _set_mode, args=("none",))
    out = run_pipeline(pipeline, torch.randn(8, 3), chunks=4, checkpoint="never", training=True,
                       parameters=iter([torch.zeros(1, requires_grad=True)]))
    out.sum().backward()  # the pipeline works again after the failures
    pipeline.close()
    return seen


@pytest.mark.timeout(120)
def test_remote_stage_errors_reach_the_driver():
    seen = run_processes(_errors, 3, timeout=100)[0]
    kind, message = seen["forward"]
    assert kind == "ValueError" and "bad shape in the middle" in message
    assert "stage 1" in message and "(rank 1, process 'worker1')" in message and "layer 1" in message
    kind, message = seen["backward"]
    assert kind == "ArithmeticError" and "backward broke in the middle" in message
    assert "stage 1" in message and "worker1" in message
    # An output that cannot be sent fails the stage that sends it, at once: the next stage does not wait
    # out the timeout for an input that never comes.
    for mode in ("unsendable", "unsendable (send thread)"):
        kind, message = seen[mode]
        assert kind == "TypeError" and "cannot leave its process" in message, message
        assert "stage 1" in message and "worker1" in message and "could not send to stage 2" in message


@skippable(stash=["maybe"])
class StashMaybe(nn.Module):
    """Stashes its input, or ``None`` (a skip switched off)."""

    def __init__(self, on: bool) -> None:
        super().__init__()
        self.on = on

    def forward(self, x):
        yield stash("maybe", x * 2 if self.on else None)
        return x * 1.5


@skippable(pop=["maybe"])
class PopMaybe(nn.Module):
    def forward(self, x):
        skip = yield pop("maybe")
        return x if skip is None else x + skip.tanh()


def _none_skips(rank: int, world: int):
    def build_maybe(on: bool) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), StashMaybe(on), nn.Tanh(), nn.Linear(8, 8), PopMaybe(), nn.Linear(8, 2))

    checked = 0
    for on in (False, True):
        key = f"maybe-{on}"
        pipeline = pipeline_over_rpc(key, build_maybe(on), [2, 2, 2], [f"worker{r}" for r in range(world)],
                                     timeout=20)
        if pipeline is None:
            continue  # this process hosts its stage until rpc.shutdown
        reference = build_maybe(on)
        for checkpoint in ("always", "except_last", "never"):
            x = torch.randn(6, 6)
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            expected = reference(x1)
            actual = run_pipeline(pipeline, x2, chunks=3, checkpoint=checkpoint, training=True, parameters=iter([]))
            torch.testing.assert_close(actual, expected)
            expected.pow(2).sum().backward()
            actual.pow(2).sum().backward()
            torch.testing.assert_close(x2.grad, x1.grad)
            grads = {}
            for j in range(3):
                grads.update(pipeline.call(j, "named_grads"))
                pipeline.call(j, "zero_grad")
            for name, p in reference.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, msg=f"{name} ({on}, {checkpoint})")
                checked += 1
            reference.zero_grad()
        pipeline.close()
    return checked


@pytest.mark.timeout(120)
def test_a_skip_stashed_as_none_crosses_processes_as_none():
    """``yield stash(name, None)`` on stage 0 popped on stage 2, in another process: the skip travels as None
    and sends no gradient back, with the same outputs and gradients as one process; a tensor skip too."""
    assert run_processes(_none_skips, 3, timeout=100)[0] == 2 * 3 * 6


_DEFAULTS_SEEN: list[torch.dtype] = []  # in the stage's process: the default dtype each forward there ran under


class _SeesDefault(nn.Module):
    def forward(self, x):
        _DEFAULTS_SEEN.append(torch.get_default_dtype())
        return x


def _defaults_seen() -> tuple[list[torch.dtype], torch.dtype]:
    return list(_DEFAULTS_SEEN), torch.get_default_dtype()


def _default_dtype(rank: int, world: int):
    model = nn.Sequential(nn.Linear(4, 4), _SeesDefault(), nn.Linear(4, 2)).double()
    pipeline = pipeline_over_rpc("default-dtype", model, [1, 2], ["worker0", "worker1"], timeout=20)
    if pipeline is None:
        return None
    torch.set_default_dtype(torch.float64)  # as the driver's forward under precision="64-true"
    try:
        run_pipeline(pipeline, torch.randn(6, 4, dtype=torch.float64), chunks=2, checkpoint="never", training=True,
                     parameters=pipeline.runner.stage.partition.parameters()).sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    seen = rpc.rpc_sync("worker1", _defaults_seen)
    pipeline.close()
    return seen


def test_a_stage_process_takes_the_drivers_default_dtype_for_the_share_alone():
    """The layers of another process make their tensors in the driver's default dtype during the step (64-true sets
    float64 there), and that process's own default is back after it: an optimizer's state made between steps (Adam's
    step count) took float64 there, where one device makes it in the default float32."""
    during, after = run_processes(_default_dtype, 2, timeout=100)[0]
    assert during == [torch.float64, torch.float64] and after == torch.float32
