"""Regression tests: each tells the story of a bug the engine had, and checks that it stays fixed."""

import copy
import re

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe
from lightning_pipe.skip import pop, skippable, stash

MODES = ["always", "except_last", "never"]


def run(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Output, input gradient and parameter gradients of ``model`` on ``x`` (a fresh leaf)."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    y = model(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


def assert_same(actual, expected) -> None:
    (y, gx, gp), (ey, egx, egp) = actual, expected
    torch.testing.assert_close(y, ey)
    torch.testing.assert_close(gx, egx)
    assert len(gp) == len(egp)
    for k, (g, e) in enumerate(zip(gp, egp)):
        torch.testing.assert_close(g, e, msg=f"parameter {k}")


@pytest.mark.parametrize("checkpoint", MODES)
def test_inplace_layer_first_inside_a_container(checkpoint):
    """Stages copied their input for in-place layers only when the partition's *first child* said
    ``inplace=True``. A first child that is itself a container, ``nn.Sequential(nn.ReLU(inplace=True), ...)``,
    got the stage's leaf, and the pipe failed with "a leaf Variable that requires grad is being used in an
    in-place operation" where the plain model ran. Now the stage looks at every module of its partition."""
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2)))
    piped = Pipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    assert_same(run(piped, x), run(plain, x))


@pytest.mark.parametrize("first", [nn.LeakyReLU(0.1, inplace=True), nn.Dropout(0.5, inplace=True)],
                         ids=["leaky_relu", "dropout"])
def test_inplace_first_layer_under_checkpointing(first):
    """A checkpointed forward runs without grad and copied nothing, so an in-place first layer modified
    the input the stage had saved for recomputation; backward then applied the layer a second time
    (LeakyReLU's slope squared, dropout's mask and scale twice) and checkpoint='always' gave other
    gradients than 'never'. Now a partition with an in-place module works on a copy of saved inputs."""
    plain = nn.Sequential(nn.Linear(4, 4), first, nn.Linear(4, 2))
    x = torch.randn(6, 4)
    never = run(Pipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint="never"), x)
    for checkpoint in ("always", "except_last"):
        assert_same(run(Pipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint=checkpoint), x), never)
    if isinstance(first, nn.LeakyReLU):  # deterministic: the plain model agrees too
        assert_same(never, run(plain, x))


class Fork(nn.Module):
    """Hands on its input untouched beside a new tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x


class Join(nn.Module):
    """Applies an in-place activation to the second tensor it is given (a child, not the first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return xs[0] * self.act(xs[1])


@pytest.mark.parametrize("checkpoint", MODES)
def test_inplace_on_a_tensor_the_previous_stage_saved(checkpoint):
    """A stage hands on its outputs detached, sharing storage with the tensors they came from. Here
    partition 1 hands on its own input, which it saved to recompute from, and partition 2 modifies it in
    place in a nested layer: checkpointed, partition 1 recomputed from the modified tensor; otherwise the
    in-place operation hit a leaf that requires grad. Partition 2 now works on a copy."""
    plain = nn.Sequential(nn.Linear(4, 4), Fork(), Join(), nn.Linear(4, 2))
    piped = Pipe(copy.deepcopy(plain), [1, 1, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    assert_same(run(piped, x), run(plain, x))


class AddOne(nn.Module):
    """Custom code that modifies its input in place, with no ``inplace`` attribute to say so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)


def test_functional_inplace_on_the_input_of_a_checkpointed_forward_is_an_error():
    """Custom code modifying a partition's input in place (``x.add_(1)``) gives no module to look at. In a
    checkpointed forward it changed the saved input, and backward recomputed from it: gradients were
    silently wrong. The stage now compares the inputs' version counters after each layer of a
    checkpointed forward and says which partition and layer did it."""
    model = nn.Sequential(nn.Linear(4, 4), AddOne(), nn.Linear(4, 2))
    piped = Pipe(model, [1, 2], chunks=2, checkpoint="always")
    with pytest.raises(RuntimeError, match=r"partition 1 modified its input in place in a checkpointed forward "
                                           r"\(micro-batch 0, layer 1 \('1': AddOne\)"):
        piped(torch.randn(6, 4))


def test_input_changed_between_forward_and_backward_is_an_error():
    """The first stage saves views of the pipe's input to recompute checkpointed micro-batches. Changing
    the input in place after the forward made backward recompute from the new values without a word (the
    plain model's autograd refuses). The stage records the version counters of what it saved and
    checks them before recomputing."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    piped = Pipe(model, [1, 1], chunks=2, checkpoint="always")
    x = torch.randn(6, 4)
    y = piped(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match=r"inputs that partition 0 saved to recompute micro-batch \d were "
                                           "modified in place after its forward"):
        y.sum().backward()


def test_common_path_gives_layers_the_inputs_without_a_copy():
    """Copying is for partitions with an in-place module: without one, layers see the stage's input
    tensors themselves (no copy per micro-batch)."""
    seen = []

    class Look(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return x * 1

    piped = Pipe(nn.Sequential(nn.Linear(4, 4), Look()), [1, 1], chunks=2, checkpoint="never")
    piped(torch.randn(6, 4)).sum().backward()
    assert [s.is_leaf and s.requires_grad for s in seen] == [True, True]  # the stage's leaves, not copies


class WithMask(nn.Module):
    """Returns its input and a float tensor that depends on nothing differentiable."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x > 0).float()


@pytest.mark.parametrize("chunks", [1, 3])
def test_output_without_grad_does_not_require_grad(chunks):
    """``_PipeFunction.forward`` marked as non-differentiable the tensors from before ``.detach()``, not
    those it returned, so autograd never saw the mark: a float output that requires no grad came back
    with ``requires_grad=True`` (the plain model: False). With several micro-batches the joined output
    could not tell either, being made without grad; the flag now comes from the micro-batches. (A
    checkpointed micro-batch, run without grad, cannot tell: its float outputs are taken to need grad.)"""
    plain = nn.Sequential(nn.Linear(4, 4), WithMask())
    piped = Pipe(copy.deepcopy(plain), [1, 1], chunks=chunks, checkpoint="never")
    x = torch.randn(6, 4)
    expected, actual = plain(x), piped(x)
    assert [t.requires_grad for t in actual] == [t.requires_grad for t in expected] == [True, False]
    actual[0].sum().backward()
    assert all(p.grad is not None for p in piped.parameters())


@skippable(stash=["maybe"])
class MaybeStash(nn.Module):
    """Stashes its input scaled, or ``None`` when it has nothing to pass (a skip that is switched off)."""

    def __init__(self, on: bool) -> None:
        super().__init__()
        self.on = on
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        yield stash("maybe", x * 3 if self.on else None)
        return self.linear(x)


@skippable(pop=["maybe"])
class MaybePop(nn.Module):
    """Adds the popped skip when there is one."""

    def forward(self, x):
        skip = yield pop("maybe")
        return x if skip is None else x + skip


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("on", [False, True], ids=["none", "tensor"])
def test_none_stashed_in_one_partition_pops_as_none_in_another(checkpoint, on):
    """torchgpipe documents ``stash(name, None)``; within one partition it worked, but a ``None`` popped in a
    later partition crashed every checkpoint mode with "'NoneType' object has no attribute 'detach'": the
    stage treated every skip as a tensor (a leaf to make, a version to watch, a gradient to send back). A
    skip stashed as None now crosses partitions as None and gets no gradient."""
    plain = nn.Sequential(MaybeStash(on), nn.Linear(4, 4), nn.Tanh(), MaybePop(), nn.Linear(4, 2))
    piped = Pipe(copy.deepcopy(plain), [2, 1, 2], chunks=3, checkpoint=checkpoint)
    assert piped.pipeline.layout.imports[2]  # the skip crosses from partition 0 to partition 2
    x = torch.randn(6, 4)
    assert_same(run(piped, x), run(plain, x))


def test_hooks_registered_on_a_partition_run():
    """Stages called each layer of their partition in turn, never the partition itself, so a forward hook
    or pre-hook on ``pipe.partitions[j]`` (a profiler's, an activation capture) never ran. torchgpipe called
    the partition; the stage now does too, and hooks see each micro-batch, in recomputation as well."""
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    piped = Pipe(copy.deepcopy(plain), [2, 2], chunks=3, checkpoint="always")
    seen = []
    piped.partitions[1].register_forward_pre_hook(lambda module, args: seen.append(("pre", args[0].shape[0])))
    piped.partitions[1].register_forward_hook(lambda module, args, out: seen.append(("post", out.shape[1])))
    piped.partitions[0].register_forward_hook(lambda module, args, out: out * 2)  # a hook's output is used
    doubled = nn.Sequential(plain[0], plain[1], Scale(2.0), plain[2], plain[3])
    x = torch.randn(6, 4)
    assert_same(run(piped, x), run(doubled, x))
    # Each micro-batch once in forward and once when it is recomputed in backward (checkpoint="always").
    assert seen == [("pre", 2), ("post", 2)] * 6


class Scale(nn.Module):
    """Multiplies by a constant."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@skippable(stash=["typo"])
class StashesAnotherName(nn.Module):
    """Declares ``typo`` but stashes nothing under it (its forward never yields)."""

    def forward(self, x):
        return x * 2


@skippable(stash=["skip"])
class StashOne(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class DeclaresAPopItNeverMakes(nn.Module):
    """Declares a pop and returns without making it (a branch that forgot it)."""

    def forward(self, x):
        return x + 1
        yield  # a generator all the same


@pytest.mark.parametrize("wrapped", [False, True], ids=["sequential", "pipe"])
def test_a_declared_skip_that_is_never_stashed_or_popped_is_an_error(wrapped):
    """A layer declared ``@skippable(stash=["foo"])`` whose forward never stashed ``foo`` (or a declared pop
    that never popped) was silently accepted, so a misspelt skip name trained another model than the one
    declared. torchgpipe raises ``RuntimeError`` after such a forward; so does the engine now, naming the
    skip, in a plain ``nn.Sequential`` as in a pipe."""
    stash_only = nn.Sequential(StashesAnotherName(), nn.Linear(4, 4))  # a pipe refuses it: "typo" is never popped
    no_pop = nn.Sequential(StashOne(), nn.Linear(4, 4), DeclaresAPopItNeverMakes())
    x = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match=r"StashesAnotherName did not stash 'typo' in this forward, which it "
                                           r"declares \(@skippable\(stash=\['typo'\]\)\)"):
        stash_only(x)
    model = Pipe(no_pop, [2, 1], chunks=2) if wrapped else no_pop
    with pytest.raises(RuntimeError, match=r"DeclaresAPopItNeverMakes did not pop 'skip' in this forward, which "
                                           r"it declares \(@skippable\(pop=\['skip'\]\)\)") as info:
        model(x)
    if wrapped:
        assert "raised in partition 1, layer 2 ('2': DeclaresAPopItNeverMakes)" in info.value.__notes__[0]


def test_moving_to_a_device_index_is_a_type_error_on_any_machine():
    """``pipe.to(0)`` let torch parse its arguments first, which looks the index up as an accelerator: on a
    CPU-only torch that failed with a RuntimeError about a missing accelerator instead of the TypeError
    that refuses moving a pipe (``pipe.to("cuda:0")`` gave the TypeError). The arguments are now told apart
    by their types, as torchgpipe did, before torch sees them."""
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1])
    moves = {"to(0)": lambda: pipe.to(0), "to(device=0)": lambda: pipe.to(device=0),
             "to('cuda:1')": lambda: pipe.to("cuda:1"), "to(tensor)": lambda: pipe.to(torch.zeros(1)),
             "to(device, dtype)": lambda: pipe.to(torch.device("cpu"), torch.float64),
             "cuda()": lambda: pipe.cuda(), "cuda(0)": lambda: pipe.cuda(0), "cpu()": lambda: pipe.cpu(),
             "xpu()": lambda: pipe.xpu(), "to_empty": lambda: pipe.to_empty(device="cpu")}
    for what, move in moves.items():
        with pytest.raises(TypeError, match=r"a Pipe cannot be moved with \.\w+.*placed on \['cpu', 'cpu'\]"):
            move()
        assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pipe.parameters()), what
    assert pipe.to(torch.float64) is pipe and pipe.to(dtype=torch.float16).partitions[1][0].weight.dtype == \
        torch.float16


class Twice(nn.Module):
    """One position that applies the same layer twice: what a repeated layer is written as instead."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(self.layer(x))


def test_sync_pipe_refuses_a_repeated_layer_instead_of_dropping_it():
    """``compat.sync.Pipe`` listed the body's layers with ``named_children()`` and flattened a child
    ``nn.Sequential`` with ``children()``, which list a repeated layer once: ``Pipe(nn.Sequential(lin, lin))``
    became a pipe of one layer, ``len(pipe) == 1``, that computed ``lin(x)`` where the model computes
    ``lin(lin(x))``, without an error. torch refused it ("module with duplicate children is not supported",
    its test ``test_verify_module_duplicate_children``); so does the drop-in now, naming the positions in the
    model as written (a flattened child's layers as ``'0.1'``) and what to write instead."""
    from lightning_pipe.compat.sync import Pipe as SyncPipe
    from lightning_pipe.compat.sync import WithDevice

    lin = nn.Linear(2, 2)
    for model, where in [(nn.Sequential(lin, lin), "'0', '1'"),
                         (nn.Sequential(nn.Sequential(lin, lin)), "'0.0', '0.1'"),
                         (nn.Sequential(lin, nn.ReLU(), nn.Sequential(nn.Tanh(), lin)), "'0', '2.1'"),
                         (nn.Sequential(WithDevice(lin, "cpu"), lin), "'0', '1'")]:
        with pytest.raises(ValueError, match=rf"module with duplicate children is not supported \(the same layer "
                                             rf"appears as: {where}\); give each position its own layer: "
                                             r"copy\.deepcopy\(layer\).*a module of your own whose forward calls "
                                             r"it twice \(not an nn\.Sequential, which Pipe flattens"):
            SyncPipe(model)
    # What the message offers instead computes what the model does.
    x = torch.randn(3, 2)
    twice = SyncPipe(nn.Sequential(Twice(lin)))
    torch.testing.assert_close(twice(x).local_value(), lin(lin(x)))
    copied = nn.Sequential(lin, copy.deepcopy(lin))
    torch.testing.assert_close(SyncPipe(copied)(x).local_value(), copied(x))


def test_every_entry_point_refuses_a_repeated_layer_by_its_positions():
    """The same layer at two positions of a body, ``nn.Sequential(lin, relu, lin)``, is refused with its
    positions by every entry point that splits a body (``Pipe``, torchgpipe's ``GPipe``, torch's ``sync.Pipe``,
    ``PipeStrategy``'s model check, run before any process starts and again at setup), so that none of them
    silently drops its second use as ``sync.Pipe`` did. The balancers profile each position (a balance of
    ``len(model)`` entries), which ``Pipe`` then refuses the same way. A layer that calls the same weights
    twice, ``nn.Sequential(lin, lin)`` as one position, is no repeat: the engine computes it."""
    import pytorch_lightning as pl

    from lightning_pipe.balance import balance_by_size, balance_by_time
    from lightning_pipe.compat.sync import Pipe as SyncPipe
    from lightning_pipe.compat.torchgpipe import GPipe
    from lightning_pipe.lightning.checks import check_model

    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    refused = r"duplicate children is not supported \(the same layer appears as: '0', '2'\); give each position"

    class Body(pl.LightningModule):
        def __init__(self, body, example=None):
            super().__init__()
            self.sequential_module = body
            self.example_input_array = example

    x = torch.randn(4, 2)
    balances = [balance_by_size(2, model, x), balance_by_time(2, model, x, timeout=0.01)]
    assert [sum(b) for b in balances] == [3, 3]
    entries = {"Pipe": lambda: Pipe(model, [2, 1]), "GPipe": lambda: GPipe(model, balances[0]),
               "sync.Pipe": lambda: SyncPipe(model),
               "PipeStrategy(balance=[2, 1])": lambda: check_model(Body(model), "sequential_module", [2, 1], 2),
               "PipeStrategy(balance=None)": lambda: check_model(Body(model, x), "sequential_module", None, 2)}
    for what, entry in entries.items():
        try:
            entry()
        except ValueError as exc:
            assert re.search(refused, str(exc)), (what, str(exc))
        else:
            pytest.fail(f"{what} accepted a layer at two positions")
    one_position = nn.Sequential(nn.Sequential(lin, lin), nn.ReLU())
    torch.testing.assert_close(Pipe(one_position, [1, 1], chunks=2)(x), one_position(x))
    check_model(Body(one_position), "sequential_module", [1, 1], 2)


class TwoNames(nn.Module):
    """One BatchNorm held under two names, each normalising its own input."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.first, self.second = bn, bn

    def forward(self, x):
        return self.first(x) + self.second(2 * x + 1)


@pytest.mark.parametrize("checkpoint", MODES)
def test_deferred_batch_norm_converts_a_batch_norm_held_twice(checkpoint):
    """``DeferredBatchNorm.convert`` walked ``named_children()``, which lists a module held twice once: in a
    layer holding one BatchNorm as ``first`` and ``second`` only ``first`` became deferred; ``second`` kept
    the plain BatchNorm, holding the same running statistics, which it moved once per micro-batch: after one
    step of 4 micro-batches with ``checkpoint='always'``, ``num_batches_tracked`` was 5 (2 with one), and the
    other modes failed the backward with "modified by an inplace operation" (the deferred commit changed the
    statistics the plain BatchNorm had saved). Now one deferred BatchNorm is held under both names and the
    statistics move once per mini-batch, from both uses, however the batch is split."""
    from lightning_pipe.engine import DeferredBatchNorm

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), TwoNames(nn.BatchNorm1d(4)), nn.Linear(4, 2))

    x = torch.randn(8, 4)
    stats = []
    for chunks in (1, 4):
        pipe = Pipe(model(), [2, 1], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
        layer = pipe[1]
        assert isinstance(layer.first, DeferredBatchNorm) and layer.second is layer.first
        pipe(x).sum().backward()
        stats.append((layer.first.running_mean.clone(), layer.first.running_var.clone(),
                      int(layer.first.num_batches_tracked)))
    (mean1, var1, n1), (mean4, var4, n4) = stats
    torch.testing.assert_close(mean4, mean1)
    torch.testing.assert_close(var4, var1)
    assert n1 == n4 == 1


@skippable(stash=["skip"])
class StashAgain(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class PopOnce(nn.Module):
    def forward(self, x):
        return x + (yield pop("skip"))


def test_verify_skippables_sees_a_stashing_layer_at_every_position():
    """``verify_skippables`` walked ``named_children()``, so a stashing layer placed twice was seen once: the
    second stash of ``'skip'`` (which no pop takes) passed the check. It now looks at every position."""
    from lightning_pipe.skip import verify_skippables

    stasher = StashAgain()
    with pytest.raises(TypeError, match=r"'2' stashes 'skip' which '0' already stashes"):
        verify_skippables(nn.Sequential(stasher, PopOnce(), stasher))


def test_to_sequential_refuses_an_adapter_that_repeats_a_layer(monkeypatch):
    """``to_sequential`` put whatever layers an adapter returned in an ``nn.Sequential``: an adapter that
    returned one ``HFLayer`` twice (meaning a block applied twice) made a body that every pipeline refused
    only later, under ``Pipe``'s name. It is refused where it is made, naming the positions. And a layer that
    holds one of the model's modules under two names got a Hugging Face name for the first only (the names
    were read with ``named_children()``), so converting the body's state failed on the second."""
    pytest.importorskip("transformers")
    from lightning_pipe.models import adapters, hf_state_dict, to_sequential
    from lightning_pipe.models.layers import HFLayer

    class TinyRepeat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(2, 2)

    class Block(HFLayer):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block
            self.again = block  # the same module under a second name

        def forward(self, x):
            return self.again(self.block(x))

    monkeypatch.setitem(adapters._ADAPTERS, "TinyRepeat", ("tiny", lambda m: [Block(m.block)] * 2))
    with pytest.raises(ValueError, match=r"the body of TinyRepeat \(the layers its adapter returned\) with duplicate "
                                         r"children is not supported \(the same layer appears as: '0', '1'\)"):
        to_sequential(TinyRepeat())
    monkeypatch.setitem(adapters._ADAPTERS, "TinyRepeat", ("tiny", lambda m: [Block(m.block), Block(m.block)]))
    model = TinyRepeat()
    body = to_sequential(model)
    assert body[0].hf_names == {"block": "block", "again": "block"}
    state = hf_state_dict(body)
    assert set(state) == {"block.weight", "block.bias"} and torch.equal(state["block.weight"], model.block.weight)
