"""The one interpreter of a plan: a share's actions over a channel, and the in-process channel's hand-offs."""

from __future__ import annotations

import threading
from concurrent.futures import InvalidStateError

import pytest
import torch
from torch import nn

from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.rng import LazySeed
from lightning_pipe.engine.schedule import schedule_plan
from lightning_pipe.engine.share import Handoff, LocalChannel, ShareStep, Skipped, run_share
from lightning_pipe.engine.skip.layout import inspect_skip_layout
from lightning_pipe.engine.stage import Stage


def _taking(channel: LocalChannel, handoff: Handoff) -> tuple[threading.Thread, list]:
    got: list = []

    def take() -> None:
        try:
            got.append(channel.take(handoff))
        except Skipped as exc:
            got.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, got


@pytest.mark.timeout(60)
def test_a_hand_off_reaches_its_taker_once_and_an_abort_wakes_every_wait():
    channel = LocalChannel(n=2)
    thread, got = _taking(channel, Handoff("F", 0, 1, 0))
    channel.send(Handoff("F", 0, 1, 0), "x0")
    thread.join(timeout=10)
    assert got == ["x0"]
    thread, got = _taking(channel, Handoff("F", 1, 1, 0))
    channel.abort()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(got[0], Skipped)
    with pytest.raises(Skipped):  # a wait begun after the abort
        channel.take(Handoff("B", 0, 0, 1))
    channel.send(Handoff("B", 1, 0, 1), "late")  # a share still running: its sends are dropped


def test_a_hand_off_sent_twice_is_an_error_and_the_callers_share_is_kept_apart():
    channel = LocalChannel(n=2)
    channel.send(Handoff("F", 0, 1, 0), "x0")
    with pytest.raises(InvalidStateError):
        channel.send(Handoff("F", 0, 1, 0), "again")
    channel.send(Handoff("F", 0, 2, 1), "y0")  # stage n: the caller's output
    channel.send(Handoff("B", 0, -1, 0), ("g0",))  # stage -1: the caller's input gradients
    assert channel.outputs == {0: "y0"} and channel.input_grads == {0: ("g0",)}


@pytest.mark.timeout(120)
def test_two_shares_on_threads_run_a_1f1b_plan_to_one_devices_outputs_and_gradients():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    stages = {0: Stage(0, body[:2], torch.device("cpu")), 1: Stage(1, body[2:], torch.device("cpu"), offset=2)}
    layout = inspect_skip_layout([stages[0].partition, stages[1].partition])
    x = torch.randn(4, 4)
    plan = schedule_plan("1f1b", 2, 2)
    channel = LocalChannel(n=2)
    step = ShareStep(0, 2, True, 0, LazySeed())
    inputs = [Batch((part,), True) for part in x.chunk(2)]
    for i in range(2):
        channel.give(Handoff("B", i, 1, 2), (torch.ones(2, 3),))
    errors: list[BaseException] = []

    def share(r: int) -> None:
        try:
            run_share(stages, 2, layout, step, plan.actions[r], channel, inputs=inputs)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            channel.abort()

    threads = [threading.Thread(target=share, args=(r,), daemon=True) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    torch.testing.assert_close(torch.cat([channel.outputs[i].tensors[0] for i in range(2)]), body(x))
    grads = {name: p.grad.clone() for name, p in body.named_parameters()}
    body.zero_grad()
    body(x).sum().backward()
    for name, p in body.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_a_plan_whose_inputs_are_not_given_is_refused_instead_of_waiting_for_them():
    from lightning_pipe.engine.pipeline import LocalPipeline, Run

    body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stages = [Stage(0, body[:1], torch.device("cpu")), Stage(1, body[1:], torch.device("cpu"), offset=1)]
    pipeline = LocalPipeline(stages, inspect_skip_layout([s.partition for s in stages]))
    run = Run(stages, [2, 2], checkpoint_stop=0)
    with pytest.raises(ValueError, match=r"runs forwards of stage 0: give its micro-batches \(inputs\)"):
        pipeline.execute(run, schedule_plan("gpipe", 2, 2))
    with pytest.raises(ValueError, match=r"runs backwards of the last stage: give the gradients of its outputs"):
        pipeline.execute(run, schedule_plan("1f1b", 2, 2), inputs=[Batch((torch.randn(2, 4),), True)] * 2)
