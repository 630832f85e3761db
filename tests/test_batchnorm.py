"""Deferred BatchNorm: running statistics equal to those of the whole batch through an unsplit BatchNorm."""

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe
from lightning_pipe.engine.batchnorm import DeferredBatchNorm


def conv_model(momentum=0.1) -> nn.Sequential:
    # Only layers that treat samples independently come before the BatchNorm, so the statistics it sees
    # are exactly the whole batch's: deferral must reproduce them.
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=momentum), nn.ReLU(),
                         nn.Flatten(), nn.Linear(6 * 5 * 5, 2))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("chunks,checkpoint", [(1, "never"), (4, "never"), (4, "always"), (3, "except_last")])
def test_running_stats_match_the_whole_batch(chunks, checkpoint, momentum):
    plain = conv_model(momentum)
    piped = Pipe(copy.deepcopy(plain), [1, 4], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
    assert isinstance(piped[1], DeferredBatchNorm)
    for _ in range(3):
        x = torch.randn(12, 3, 5, 5) * 3 + 1
        plain(x).sum().backward()
        piped(x).sum().backward()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(piped[1], name), getattr(plain[1], name), rtol=1e-4, atol=1e-5,
                                   msg=name)
    plain.eval()
    piped.eval()
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(piped(x), plain(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("made", ["built in float64", "converted to float64"])
def test_float64_statistics_are_the_whole_batchs_to_float64s_rounding(made):
    """Under ``precision="64-true"`` the deferred statistics accumulate in float64, as the whole batch's BatchNorm
    takes them (in float32 they ended 6e-9 from one device's)."""
    torch.manual_seed(0)
    base = conv_model()
    plain = copy.deepcopy(base).double()
    if made == "built in float64":
        piped = Pipe(copy.deepcopy(plain), [1, 4], chunks=4, checkpoint="except_last", deferred_batch_norm=True)
    else:
        piped = Pipe(copy.deepcopy(base), [1, 4], chunks=4, checkpoint="except_last", deferred_batch_norm=True)
        piped.double()
    for _ in range(3):
        x = torch.randn(12, 3, 5, 5, dtype=torch.float64) * 3 + 1
        plain(x).sum().backward()
        piped(x).sum().backward()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(piped[1], name), getattr(plain[1], name), rtol=1e-13, atol=1e-14,
                                   msg=name)


def test_without_deferral_stats_move_per_micro_batch():
    plain = conv_model()
    piped = Pipe(copy.deepcopy(plain), [1, 4], chunks=4)
    x = torch.randn(12, 3, 5, 5) * 3 + 1
    plain(x)
    piped(x)
    assert not torch.allclose(piped[1].running_var, plain[1].running_var, rtol=1e-3)


def test_state_dict_keys_are_those_of_batchnorm():
    bn = nn.BatchNorm1d(3)
    deferred = DeferredBatchNorm.convert(nn.Sequential(bn))[0]
    assert isinstance(deferred, DeferredBatchNorm)
    assert set(deferred.state_dict()) == set(bn.state_dict())
    nn.BatchNorm1d(3).load_state_dict(deferred.state_dict())


def test_convert_leaves_untracked_and_sync_batchnorm():
    m = nn.Sequential(nn.BatchNorm1d(3, track_running_stats=False), nn.SyncBatchNorm(3))
    out = DeferredBatchNorm.convert(m)
    assert type(out[0]) is nn.BatchNorm1d and type(out[1]) is nn.SyncBatchNorm


def test_convert_keeps_the_parameters_and_buffers_themselves():
    # Conversion used to build new parameters and load the old values into them: a frozen BatchNorm came
    # back trainable, and an optimizer built before wrapping updated tensors the model no longer used.
    bn = nn.BatchNorm1d(3).double()
    bn.requires_grad_(False)
    bn.running_mean.add_(1)
    deferred = DeferredBatchNorm.convert(nn.Sequential(bn))[0]
    assert isinstance(deferred, DeferredBatchNorm)
    assert deferred.weight is bn.weight and deferred.bias is bn.bias
    assert not deferred.weight.requires_grad and not deferred.bias.requires_grad
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert getattr(deferred, name) is getattr(bn, name), name
    assert deferred._mean.dtype == torch.float64  # statistics accumulate in the layer's dtype, float32 at the least
    assert deferred(torch.randn(4, 3, dtype=torch.float64)).dtype == torch.float64
    half = DeferredBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(3).half()))[0]
    assert half._mean.dtype == torch.float32


def test_optimizer_built_before_wrapping_trains_the_pipe():
    plain = conv_model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    piped = Pipe(plain, [1, 4], chunks=2, deferred_batch_norm=True)
    before = piped[1].weight.detach().clone()
    piped(torch.randn(4, 3, 5, 5)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(piped[1].weight, before)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zero-bubble", 1), ("zbv", 2), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("checkpoint", ["except_last", "always", "never"])
def test_without_deferral_every_schedule_recomputes_to_the_micro_batches_gradients_and_statistics(schedule, v,
                                                                                                  checkpoint):
    """A BatchNorm normalising each micro-batch by its own statistics, under the schedules that interleave forwards
    and backwards: the gradients and running statistics of the micro-batches through the plain model in turn. With
    ``except_last``, restoring the statistics after a recomputed backward bumped their version, which the last
    micro-batch's graph (not recomputed; BatchNorm saves them) refused at its backward, after the others'."""
    from lightning_pipe import loss_on_last_stage

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(3)],
                          nn.Linear(8, 1)).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin()
    plain = copy.deepcopy(model)
    sum(nn.functional.mse_loss(plain(xc), yc) * len(xc) / len(x) for xc, yc in zip(x.chunk(4), y.chunk(4))).backward()
    piped = Pipe(copy.deepcopy(model), [1, 3] if v == 1 else [1, 1, 1, 1], chunks=4, checkpoint=checkpoint,
                 schedule=schedule, virtual_stages=v)
    loss_on_last_stage(piped, x, y, nn.functional.mse_loss).backward()
    for a, b in zip(piped.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    for a, b in zip(piped.buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
