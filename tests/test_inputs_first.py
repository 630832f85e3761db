"""A stage's backward in two parts: the gradients that go upstream first, its parameters' gradients later."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.engine.backward_split import twice_safe
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import split_module
from lightning_pipe.engine.stage import Stage
from lightning_pipe.engine.timeline import Recorder


class Scale(nn.Module):
    """A user-defined layer: its backward could hold anything, so it is never run twice."""

    def forward(self, x):
        return x * 2


def body() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.2),
                         nn.Linear(8, 3))


def test_twice_safe_only_for_built_in_layers_without_hooks():
    assert twice_safe(body())
    assert twice_safe(nn.Sequential(nn.TransformerEncoderLayer(8, 2), nn.Dropout(0.1), nn.GELU()))
    assert not twice_safe(nn.Sequential(nn.Linear(3, 3), Scale()))
    # Buffers: the graph kept between the two parts may have saved them, and recomputing other micro-batches
    # meanwhile changes them in place.
    assert not twice_safe(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    assert not twice_safe(nn.Sequential(nn.Linear(3, 3), DeferredBatchNorm(3)))
    layer = nn.Linear(3, 3)
    registers = (layer.register_full_backward_hook, layer.register_full_backward_pre_hook,
                 layer.register_forward_hook, layer.register_forward_pre_hook,
                 nn.modules.module.register_module_full_backward_hook,
                 nn.modules.module.register_module_full_backward_pre_hook,
                 nn.modules.module.register_module_forward_hook)
    for register in registers:
        handle = register(lambda *args: None)
        try:
            assert not twice_safe(nn.Sequential(layer, nn.ReLU())), register
        finally:
            handle.remove()
        assert twice_safe(nn.Sequential(layer, nn.ReLU()))
    # The partitions of a pipe, which their stages call as modules: safe by themselves, not with a hook on them.
    partition = split_module(body(), [6])[0]
    assert twice_safe(partition)
    for register in (partition.register_forward_hook, partition.register_forward_pre_hook,
                     partition.register_full_backward_hook):
        handle = register(lambda *args: None)
        assert not twice_safe(partition), register
        handle.remove()


def _forward(stage: Stage, xs: list[torch.Tensor], checkpoint: bool) -> list[torch.Tensor]:
    outs = []
    for i, x in enumerate(xs):
        out, _ = stage.forward("run", i, Batch((x.requires_grad_(),), True), {}, seed=lambda: 0, save=True,
                               checkpoint=checkpoint, last=i == len(xs) - 1)
        outs.append(out.tensors[0])
    return outs


@pytest.mark.parametrize("checkpoint", [False, True])
def test_inputs_first_gives_the_same_gradients_with_the_parameters_left_for_later(checkpoint):
    module = body()
    whole, split = Stage(1, copy.deepcopy(module), torch.device("cpu")), Stage(1, module, torch.device("cpu"))
    xs = [torch.randn(4, 6) for _ in range(3)]
    grads = [torch.randn(4, 3) for _ in range(3)]
    outs = _forward(whole, [x.clone() for x in xs], checkpoint)
    assert len(_forward(split, [x.clone() for x in xs], checkpoint)) == len(outs)
    expected = [whole.backward("run", [(i, (grads[i],), {})]) for i in reversed(range(3))]

    got, finish = split.backward_inputs_first("run", [(2, (grads[2],), {})])
    assert all(p.grad is None for p in split.partition.parameters())  # nothing but what goes upstream yet
    got += [split.backward("run", [(i, (grads[i],), {})])[0] for i in (1, 0)]
    finish()
    finish()  # once only: a second call adds nothing
    for (a, _), (b, _) in zip(got, [e[0] for e in expected]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (name, p), q in zip(split.partition.named_parameters(), whole.partition.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)  # the same sums, micro-batch 2's added last
    assert not split.has_saved("run")


def test_inputs_first_dropped_after_a_failure_computes_nothing_more():
    stage = Stage(1, body(), torch.device("cpu"))
    _forward(stage, [torch.randn(4, 6)], checkpoint=True)
    results, finish = stage.backward_inputs_first("run", [(0, (torch.randn(4, 3),), {})])
    assert results[0][0][0] is not None and results[0][0][0].shape == (4, 6)
    finish(False)
    finish()  # dropped: nothing left to compute
    assert all(p.grad is None for p in stage.partition.parameters())


def test_batchnorm_partitions_run_their_backward_at_once():
    """Recomputing a micro-batch changes BatchNorm's running statistics in place, which the graph of the one
    before saved: a partition with buffers gets its whole backward at once, so the recomputation in between
    breaks nothing."""
    torch.manual_seed(0)
    stage = Stage(1, nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), torch.device("cpu"))
    assert not twice_safe(stage.partition)
    _forward(stage, [torch.randn(4, 8) for _ in range(2)], checkpoint=True)
    _, finish = stage.backward_inputs_first("run", [(1, (torch.randn(4, 2),), {})])
    assert all(p.grad is not None for p in stage.partition.parameters())
    stage.backward("run", [(0, (torch.randn(4, 2),), {})])  # recomputes micro-batch 0 in training mode
    finish()
    assert not stage.has_saved("run")


def test_a_user_defined_layer_gets_its_whole_backward_at_once():
    module = nn.Sequential(nn.Linear(6, 3), Scale())
    stage = Stage(1, module, torch.device("cpu"))
    _forward(stage, [torch.randn(4, 6)], checkpoint=False)
    results, finish = stage.backward_inputs_first("run", [(0, (torch.randn(4, 3),), {})])
    assert all(p.grad is not None for p in module.parameters())  # nothing was left for later
    grads = [p.grad.clone() for p in module.parameters()]
    finish()
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads))


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_local_engine_leaves_later_stages_parameters_gradients_for_last(pipelined):
    from lightning_pipe import Pipe
    from lightning_pipe.engine.timeline import Recorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    pipe = Pipe(copy.deepcopy(model), [2, 2, 2], chunks=4, checkpoint="except_last")
    recorders = []
    for stage in pipe.pipeline.stages:
        stage.recorder = Recorder()
        recorders.append(stage.recorder)
    if not pipelined:
        original = pipe.pipeline.backward
        pipe.pipeline.backward = lambda run, grads, **kwargs: original(run, grads, **{**kwargs, "pipelined": False})
    x = torch.randn(8, 6)
    pipe(x.clone().requires_grad_()).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for j, recorder in enumerate(recorders):
        done = [(e.kind, e.microbatch) for e in sorted(recorder.events(), key=lambda e: (e.start, e.end))
                if e.kind != "F"]
        if not pipelined:
            expected = [("B", i) for i in range(4)] + [("W", i) for i in range(4)] * (j > 0)
            assert sorted(done) == sorted(expected), j
        else:
            assert done == [("B", i) for i in (3, 2, 1, 0)] + [("W", 3)] * (j > 0), j


def test_declared_layers_and_what_they_hold_are_trusted(monkeypatch):
    import lightning_pipe.engine.backward_split as split_module
    from lightning_pipe import pure_backward_layer

    monkeypatch.setattr(split_module, "_PURE_BACKWARD", set())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.inner = nn.Linear(3, 3), Scale()  # an undeclared user layer inside

        def forward(self, x):
            return self.inner(self.linear(x))

    class Sub(Block):
        pass

    assert not twice_safe(nn.Sequential(Block(), nn.ReLU()))
    assert pure_backward_layer(Block) is Block
    assert twice_safe(nn.Sequential(Block(), nn.ReLU()))
    assert not twice_safe(nn.Sequential(Sub(), nn.ReLU()))  # exactly the declared class
    assert not twice_safe(nn.Sequential(Block(), Scale()))  # an undeclared one outside it
    block = Block()
    handle = block.inner.register_forward_hook(lambda *args: None)
    assert not twice_safe(nn.Sequential(block))  # hooks count inside a declared layer too
    handle.remove()
    block.register_buffer("steps", torch.zeros(()))
    assert not twice_safe(nn.Sequential(block))  # and buffers

    stage = Stage(1, nn.Sequential(Block(), nn.Tanh(), Block()), torch.device("cpu"))
    _forward(stage, [torch.randn(4, 3)], checkpoint=False)
    _, finish = stage.backward_inputs_first("run", [(0, (torch.randn(4, 3),), {})])
    assert all(p.grad is None for p in stage.partition.parameters())
    finish()
    assert all(p.grad is not None for p in stage.partition.parameters())


class _Counted(torch.autograd.Function):
    """tanh whose backward counts its calls: a side effect that must not run twice."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


def test_built_in_layers_holding_a_users_function_or_renormalising_are_not_trusted():
    assert twice_safe(nn.Sequential(nn.TransformerEncoderLayer(8, 2, activation=torch.nn.functional.gelu)))
    layer = nn.TransformerEncoderLayer(8, 2, activation=_Counted.apply, dropout=0.0)
    assert not twice_safe(nn.Sequential(layer))
    assert not twice_safe(nn.Sequential(nn.TransformerEncoderLayer(8, 2, activation=lambda x: x.relu())))
    assert not twice_safe(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)))
    assert twice_safe(nn.Sequential(nn.Embedding(10, 4)))
    # What it protects: the counting backward runs once per micro-batch.
    stage = Stage(1, nn.Sequential(nn.Linear(8, 8), layer), torch.device("cpu"))
    _forward(stage, [torch.randn(3, 4, 8)], checkpoint=False)
    _Counted.calls = 0
    _, finish = stage.backward_inputs_first("run", [(0, (torch.randn(3, 4, 8),), {})])
    finish()
    assert _Counted.calls == 1


def test_a_custom_functions_ctx_variable_is_not_taken_for_a_leaf(monkeypatch):
    import lightning_pipe.engine.backward_split as split_module

    class Keeps(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.variable = torch.zeros(1)  # an attribute that an AccumulateGrad node also has
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Doubler(nn.Module):
        def forward(self, x):
            return Keeps.apply(x)

    monkeypatch.setattr(split_module, "_PURE_BACKWARD", {Doubler})
    stage = Stage(1, nn.Sequential(nn.Linear(4, 4), Doubler(), nn.Linear(4, 2)), torch.device("cpu"))
    _forward(stage, [torch.randn(3, 4)], checkpoint=False)
    _, finish = stage.backward_inputs_first("run", [(0, (torch.randn(3, 2),), {})])
    finish()
    assert all(p.grad is not None for p in stage.partition.parameters())


def test_a_parameter_frozen_after_the_forward_gets_no_gradient_as_in_a_whole_backward():
    stage = Stage(1, body(), torch.device("cpu"))
    _forward(stage, [torch.randn(4, 6)], checkpoint=False)
    _, finish = stage.backward_inputs_first("run", [(0, (torch.randn(4, 3),), {})])
    stage.partition[0].weight.requires_grad_(False)
    finish()
    assert stage.partition[0].weight.grad is None and stage.partition[0].bias.grad is not None


def test_nothing_is_left_for_later_without_trainable_parameters_or_on_a_gpu():
    for case in ("frozen", "gpu"):
        stage = Stage(1, body(), torch.device("cpu"))
        stage.recorder = Recorder()
        if case == "frozen":
            stage.partition.requires_grad_(False)
        stage.forward(7, 0, Batch((torch.randn(4, 6, requires_grad=True),), True), {}, seed=lambda: 0,
                      save=True, checkpoint=False, last=True)
        if case == "gpu":  # what the choice reads: a stage placed on a GPU runs its backward at once
            stage.device = torch.device("cuda", 0)
        results, finish = stage.backward_inputs_first(7, [(0, (torch.randn(4, 3),), {})])
        assert results[0][0][0] is not None
        if case == "gpu":
            assert all(p.grad is not None for p in stage.partition.parameters())
        finish()
        assert [e.kind for e in stage.recorder.events()] == ["F", "B"], case


def test_the_parameters_part_computes_nothing_the_input_gradients_computed(monkeypatch):
    """The later call starts where each parameter's branch leaves the path to the input (captured in the first
    call), so the backward of a layer between two linear layers runs once, not again on the way to the first
    one's weight; the gradients are a whole backward's. A parameter used twice, and one made into the output
    alone (its branch never meets the path), get theirs too."""
    import lightning_pipe.engine.backward_split as split_module

    calls = []

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g * 3

    class Middle(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(5, 5)  # used twice: its gradient sums both uses
            self.offset = nn.Parameter(torch.randn(5))  # meets the output without the input's path

        def forward(self, x):
            return self.shared(torch.tanh(self.shared(Counted.apply(x)))) + self.offset * 2

    monkeypatch.setattr(split_module, "_PURE_BACKWARD", {Middle})
    module = nn.Sequential(nn.Linear(4, 5), Middle(), nn.Linear(5, 2))
    whole, split = Stage(1, copy.deepcopy(module), torch.device("cpu")), Stage(1, module, torch.device("cpu"))
    x, g = torch.randn(3, 4), torch.randn(3, 2)
    _forward(whole, [x.clone()], checkpoint=False)
    _forward(split, [x.clone()], checkpoint=False)
    expected = whole.backward("run", [(0, (g,), {})])
    calls.clear()
    got, finish = split.backward_inputs_first("run", [(0, (g,), {})])
    assert len(calls) == 1 and all(p.grad is None for p in split.partition.parameters())
    finish()
    assert len(calls) == 1  # the parameters' part did not go through it again
    torch.testing.assert_close(got[0][0][0], expected[0][0][0])
    for (name, p), q in zip(split.partition.named_parameters(), whole.partition.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
