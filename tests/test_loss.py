"""The loss on the last stage, under every schedule: the plain model's loss and gradients, whatever runs between
the forward and the backward (zeroing, a scaled loss, accumulation)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pipe, loss_on_last_stage
from lightning_pipe.skip import pop, skippable, stash


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def with_extras(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": F.mse_loss(output, target), "mean_output": output.mean(), "per_sample": output.sum(dim=1)}


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


def body(skips: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]
    if skips:
        layers[1:1] = [Stash()]
        layers[-1:-1] = [Pop()]
    return nn.Sequential(*layers)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2),
             ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2)]


def pipe_for(model: nn.Sequential, schedule: str, v: int, chunks: int, checkpoint: str = "never") -> Pipe:
    if schedule == "dualpipev" and chunks < 2 * v:  # (2 processes of v stages)
        pytest.skip("dualpipev needs as many micro-batches as stages (4 here)")
    n = len(model)
    parts = 2 * v
    balance = [n // parts + (1 if k < n % parts else 0) for k in range(parts)]
    return Pipe(copy.deepcopy(model), balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                virtual_stages=v)


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("chunks,checkpoint", [(4, "never"), (3, "except_last"), (8, "always"), (1, "never")])
def test_loss_and_gradients_equal_the_plain_models(schedule, v, chunks, checkpoint):
    model = body()
    pipe = pipe_for(model, schedule, v, chunks, checkpoint)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = mse(model(x1), y)
    loss = loss_on_last_stage(pipe, x2, y, mse)
    torch.testing.assert_close(loss, expected)
    expected.backward()
    loss.backward()
    for got, want in zip(grads(pipe), grads(model)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(x2.grad, x1.grad)  # the input's gradient, through every stage


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_what_runs_between_forward_and_backward_counts_as_on_one_device(schedule, v):
    """Schedules that run their backwards during the forward set the gradients they make aside until the
    loss's backward: zeroing in between, a scaled loss and accumulation over steps all end as on one device."""
    model = body()
    pipe = pipe_for(model, schedule, v, chunks=4)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for step in range(3):  # two accumulating steps, then one zeroed after the forward
        expected, loss = mse(model(x + step), y), loss_on_last_stage(pipe, x + step, y, mse)
        if step == 2:
            model.zero_grad()
            pipe.zero_grad()
        (3.0 * expected).backward()
        (3.0 * loss).backward()
    for got, want in zip(grads(pipe), grads(model)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_a_loss_never_backpropagated_changes_no_gradient(schedule, v):
    pipe = pipe_for(body(), schedule, v, chunks=4)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    loss_on_last_stage(pipe, x, y, mse).backward()
    before = grads(pipe)
    loss = loss_on_last_stage(pipe, x * 2, y, mse)  # never backpropagated
    del loss
    assert all(torch.equal(a, b) for a, b in zip(grads(pipe), before))
    assert all(stage.aside.pending() == 0 for stage in pipe.pipeline.stages)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_extras_come_back_combined_and_the_sum_reduction(schedule, v):
    model = body()
    pipe = pipe_for(model, schedule, v, chunks=4)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    expected = with_extras(model(x), y)
    got = loss_on_last_stage(pipe, x, y, with_extras)
    assert set(got) == {"loss", "mean_output", "per_sample"}
    for key in got:
        torch.testing.assert_close(got[key], expected[key])
    assert not got["mean_output"].requires_grad and got["loss"].requires_grad

    def summed(output, target):
        return F.mse_loss(output, target, reduction="sum")

    model.zero_grad()
    pipe.zero_grad()
    summed(model(x), y).backward()
    loss_on_last_stage(pipe, x, y, summed, reduction="sum").backward()
    for a, b in zip(grads(pipe), grads(model)):
        torch.testing.assert_close(a, b)


def counted(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """A loss with the scalars a user logs beside it: a count (an integer), a sum and a count held as floats, a mean."""
    return {"loss": F.mse_loss(output, target), "correct": (output.argmax(1) == target.argmax(1)).sum(),
            "abs_error": (output - target).abs().sum(), "seen": torch.tensor(float(len(output))),
            "mean_output": output.mean()}


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("zbv", 2)])
def test_scalar_extras_come_back_as_the_whole_batchs_counts_sums_and_means(schedule, v):
    """Micro-batches of 3, 3, 2 and 2 rows: a count is added up, a floating scalar combined as ``extras`` names it
    ("sum" or "mean"), whatever the loss's reduction; each the whole batch's value, in its own dtype."""
    model = body()
    pipe = pipe_for(model, schedule, v, chunks=4)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    expected = counted(model(x), y)
    named = {"abs_error": "sum", "seen": "sum", "mean_output": "mean"}
    for reduction in ("mean", "sum"):
        got = loss_on_last_stage(pipe, x, y, counted, extras=named, reduction=reduction)
        for key in ("correct", "abs_error", "seen", "mean_output"):
            torch.testing.assert_close(got[key], expected[key])
            assert got[key].dtype == expected[key].dtype, key
    # Unnamed, a floating scalar goes as the loss does: here a mean over samples.
    got = loss_on_last_stage(pipe, x, y, counted)
    torch.testing.assert_close(got["mean_output"], expected["mean_output"])
    torch.testing.assert_close(got["correct"], expected["correct"])
    assert got["seen"] != expected["seen"]  # (a count held as a float, not named "sum": averaged, as documented)


def test_extras_that_cannot_be_combined_as_named_are_refused_saying_why():
    pipe = pipe_for(body(), "1f1b", 1, chunks=4)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with pytest.raises(ValueError, match=r"'mean' \(weighted.*or 'sum' \(added up\).*'abs_error': 'max'"):
        loss_on_last_stage(pipe, x, y, counted, extras={"abs_error": "max"})
    with pytest.raises(TypeError, match="extras must map the names"):
        loss_on_last_stage(pipe, x, y, counted, extras=["abs_error"])
    with pytest.raises(ValueError, match=r"\['typo'\], which the loss function does not return.*'abs_error'"):
        loss_on_last_stage(pipe, x, y, counted, extras={"typo": "sum"})
    with pytest.raises(ValueError, match=r"'correct' 'mean'.*torch.int64.*\.float\(\)\.mean\(\)"):
        loss_on_last_stage(pipe, x, y, counted, extras={"correct": "mean"})
    with pytest.raises(ValueError, match=r"'per_sample' \('sum'\), a tensor of shape \(2,\)"):
        loss_on_last_stage(pipe, x, y, with_extras, extras={"per_sample": "sum"})
    with pytest.raises(ValueError, match=r"returned the loss alone"):
        loss_on_last_stage(pipe, x, y, mse, extras={"abs_error": "sum"})
    with pytest.raises(ValueError, match="or 'sum'"):  # on one device too, before anything runs
        loss_on_last_stage(body(), x, y, counted, extras={"abs_error": "median"})


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_skip_connections_across_stages(schedule, v):
    model = body(skips=True)
    pipe = pipe_for(model, schedule, v, chunks=4, checkpoint="except_last")
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    loss_on_last_stage(pipe, x, y, mse).backward()
    mse(model(x), y).backward()
    for a, b in zip(grads(pipe), grads(model)):
        torch.testing.assert_close(a, b)


def test_on_a_plain_module_it_is_the_loss_of_its_output():
    model = body()
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    assert torch.equal(loss_on_last_stage(model, x, y, mse), mse(model(x), y))
    assert set(loss_on_last_stage(model, x, y, with_extras)) == {"loss", "mean_output", "per_sample"}


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_evaluation_computes_the_loss_on_the_last_stage_too(schedule, v):
    model = body()
    pipe = pipe_for(model, schedule, v, chunks=4).eval()
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    with torch.no_grad():
        torch.testing.assert_close(loss_on_last_stage(pipe, x, y, mse), mse(model(x), y))
        torch.testing.assert_close(pipe(x), model(x))  # and outputs, with any schedule


def test_interleaving_schedules_need_the_loss_on_the_last_stage():
    pipe = pipe_for(body(), "1f1b", 1, chunks=4)
    with pytest.raises(RuntimeError, match=r"Pipe\(schedule='1f1b'\) runs backwards between forwards, so the loss "
                                           r"must be computed on the last stage.*loss_on_last_stage"):
        pipe(torch.randn(4, 6))


@pytest.mark.parametrize("target,message", [
    (torch.randn(3, 3), r"the target must have the input's batch size along dim 0 .*target shape: \(3, 3\), "
                        r"batch size: 4"),
])
def test_bad_targets_and_losses_are_refused(target, message):
    pipe = pipe_for(body(), "gpipe", 1, chunks=2)
    with pytest.raises(ValueError, match=message):
        loss_on_last_stage(pipe, torch.randn(4, 6), target, mse)
    with pytest.raises(ValueError, match=r"reduction must be one of 'mean', 'sum' \(got: 'max'\)"):
        loss_on_last_stage(pipe, torch.randn(4, 6), torch.randn(4, 3), mse, reduction="max")
    with pytest.raises(ValueError, match=r"the loss function must return a scalar tensor.*got \(2, 3\)"):
        loss_on_last_stage(pipe, torch.randn(4, 6), torch.randn(4, 3), lambda out, t: out - t)
    with pytest.raises(ValueError, match=r"returned a mapping without a 'loss' entry \(keys: \['total'\]\)"):
        loss_on_last_stage(pipe, torch.randn(4, 6), torch.randn(4, 3), lambda out, t: {"total": mse(out, t)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_batchs_loss_is_the_weighted_sum_in_float64_in_micro_batch_order(dtype):
    """On the CPU the sum is made in Python's doubles: bit for bit the float64 tensors' sum it replaces."""
    from lightning_pipe.engine.loss import MicroLoss, combine

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        m = int(torch.randint(1, 20, (), generator=g))
        values = torch.randn(m, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 4, (m,), generator=g)
        sizes = torch.randint(1, 9, (m,), generator=g).tolist()
        w = [n / sum(sizes) for n in sizes]
        losses = [MicroLoss(v.to(dtype), None) for v in values]
        expected = sum((wi * loss.value.double() for wi, loss in zip(w, losses)), torch.zeros((), dtype=torch.float64))
        got = combine(losses, w, sizes).value
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_in_one_process_any_callable_is_a_loss_function():
    """A ``Pipe`` runs every stage in this process: nothing is pickled, so a lambda or a local function works."""
    model = body()
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def local(output, target):
        return F.mse_loss(output, target)

    for loss_fn in (lambda output, target: F.mse_loss(output, target), local):
        loss = loss_on_last_stage(pipe_for(model, "1f1b", 1, chunks=4), x, y, loss_fn)
        torch.testing.assert_close(loss, mse(model(x), y))


def test_a_loss_function_that_cannot_reach_another_process_is_refused_saying_what_to_pass():
    """``check_sendable``, which ``PipeStrategy``'s body runs at ``loss_on_last_stage`` when the last stage is in
    another process: what pickles passes (checked once), what does not is refused with its value and what to pass."""
    import functools

    from lightning_pipe.engine.loss import _SENDABLE, check_sendable

    def local(output, target):
        return F.mse_loss(output, target)

    for loss_fn in (mse, functools.partial(F.cross_entropy, label_smoothing=0.1), nn.CrossEntropyLoss()):
        check_sendable(loss_fn, 2)
    assert mse in _SENDABLE  # not pickled again at the next step
    for loss_fn, name in ((lambda output, target: mse(output, target), "<lambda>"), (local, "local"),
                          (functools.partial(local), "local")):
        with pytest.raises(TypeError) as refused:
            check_sendable(loss_fn, 3)
        message = str(refused.value)
        assert message.startswith("loss_on_last_stage cannot send its loss_fn to the last stage, which runs in another "
                                  "process (a pipeline of 3 processes)"), message
        assert repr(loss_fn) in message and f"<locals>.{name}" in message  # the value, and pickle's word on it
        assert "a function defined at the top level of a module" in message and "functools.partial" in message
        assert "nn.Module loss" in message
