"""Skip connections: stash in one partition, pop in another, with correct values and gradients."""

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe
from lightning_pipe.skip import Namespace, pop, skippable, stash, verify_skippables


@skippable(stash=["skip"])
class Stash(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        yield stash("skip", x * 2)
        return self.linear(x)


@skippable(pop=["skip"])
class Pop(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) + skip.tanh()


def model() -> nn.Sequential:
    return nn.Sequential(Stash(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), Pop(), nn.Linear(4, 1))


def test_skippable_works_in_a_plain_sequential():
    torch.manual_seed(0)
    m = model()
    x = torch.randn(3, 4)
    manual = m[5](m[4].module.linear(m[3](m[2](m[1](m[0].module.linear(x))))) + (x * 2).tanh())
    torch.testing.assert_close(m(x), manual)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_skip_from_partition_0_to_2_matches_unwrapped(checkpoint, chunks):
    plain = model()
    piped = Pipe(copy.deepcopy(plain), [2, 2, 2], chunks=chunks, checkpoint=checkpoint)
    layout = piped.pipeline.layout
    assert list(layout.exports[0].values()) == [2] and list(layout.imports[2].values()) == [0]
    assert not layout.exports[1] and not layout.imports[1]  # partition 1 never sees the skip
    x1 = torch.randn(6, 4, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    expected, actual = plain(x1), piped(x2)
    torch.testing.assert_close(actual, expected)
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad)
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_skip_within_one_partition():
    plain = model()
    piped = Pipe(copy.deepcopy(plain), [5, 1], chunks=2)
    x = torch.randn(4, 4)
    torch.testing.assert_close(piped(x), plain(x))


def test_namespaces_separate_instances():
    ns1, ns2 = Namespace(), Namespace()
    m = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2), Pop().isolate(ns1))
    verify_skippables(m)
    x = torch.randn(2, 4)
    piped = Pipe(copy.deepcopy(m), [1, 1, 1, 1], chunks=2)
    torch.testing.assert_close(piped(x), m(x))
    with pytest.raises(ValueError, match=r"unknown: \['nope'\]"):
        Stash().isolate(ns1, only=["nope"])


def test_verify_names_every_mismatch():
    m = nn.Sequential(Pop(), Stash(), Stash())
    with pytest.raises(TypeError) as info:
        verify_skippables(m)
    message = str(info.value)
    assert "'0' pops 'skip' before '1' stashes it" in message
    assert "'2' stashes 'skip' which '1' already stashes" in message
    with pytest.raises(TypeError, match="'0' stashes 'skip' but it is not popped"):
        Pipe(nn.Sequential(Stash(), nn.Identity()), [1, 1])


def test_undeclared_stash_is_an_error():
    @skippable(stash=["a"])
    class Sneaky(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            return x

    with pytest.raises(RuntimeError, match=r"stashes 'b' without declaring it"):
        Sneaky()(torch.zeros(1))


@skippable(stash=["skip"])
class StashNothing(nn.Module):
    def forward(self, x):
        yield stash("skip", None)
        return x + 1


@skippable(pop=["skip"])
class PopNothing(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        assert skip is None
        return x * 2


@pytest.mark.parametrize("balance", [None, [3], [2, 1], [1, 2]], ids=["plain", "one", "1to2", "0to1"])
def test_none_is_passed_through_a_skip(balance):
    m = nn.Sequential(StashNothing(), nn.Linear(4, 4), PopNothing())
    x = torch.randn(4, 4)
    expected = (m[1](x + 1)) * 2
    model = m if balance is None else Pipe(m, balance, chunks=2)
    torch.testing.assert_close(model(x), expected)


def test_a_skippable_whose_forward_yields_nothing_must_still_stash():
    @skippable(stash=["skip"])
    class Plain(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(RuntimeError, match=r"Plain did not stash 'skip' in this forward"):
        Plain()(torch.zeros(1))
