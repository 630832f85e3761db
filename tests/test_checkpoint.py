"""Checkpointing: the flags, recomputation without side effects, and random numbers that replay exactly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_pipe.engine.stage as stage_module
from lightning_pipe import Pipe, is_checkpointing, is_recomputing
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.rng import StageRandom, attention, draws_no_random


class Counter(nn.Module):
    """Counts forward passes, skipping recomputation, and records the flags it saw."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        if not is_recomputing():
            self.calls += 1
        return x * 1


@pytest.mark.parametrize("checkpoint,recomputed", [("always", 4), ("except_last", 3), ("never", 0)])
def test_is_recomputing_lets_a_layer_count_once(checkpoint, recomputed):
    counter = Counter()
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), counter), [1, 1], chunks=4, checkpoint=checkpoint)
    pipe(torch.randn(8, 2)).sum().backward()
    assert counter.calls == 4  # one per micro-batch, whatever the mode
    assert sum(r for _, r in counter.seen) == recomputed
    assert sum(c for c, _ in counter.seen) == recomputed  # checkpointed forwards are the recomputed ones
    assert not any(c and r for c, r in counter.seen)


def test_no_checkpointing_in_eval_or_without_grad():
    counter = Counter()
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), counter), [1, 1], chunks=2, checkpoint="always")
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    pipe.eval()
    pipe(torch.randn(4, 2)).sum().backward()
    assert counter.seen == [(False, False)] * 4


def test_flags_are_false_outside():
    assert not is_checkpointing() and not is_recomputing()


def dropout_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 32), nn.Dropout2d(0.3),
                         nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 4))


def run(mode: str, seed: int = 7):
    torch.manual_seed(0)
    pipe = Pipe(dropout_model(), [2, 3, 3], chunks=4, checkpoint=mode)
    x = torch.randn(16, 8)
    torch.manual_seed(seed)
    y = pipe(x)
    y.pow(2).sum().backward()
    return y.detach(), [p.grad.clone() for p in pipe.parameters()]


def test_dropout_masks_are_reproducible_under_concurrency():
    y0, g0 = run("never")
    for _ in range(5):
        y, g = run("never")
        assert torch.equal(y, y0)
        assert all(torch.equal(a, b) for a, b in zip(g, g0))
    y1, _ = run("never", seed=8)
    assert not torch.equal(y1, y0)  # a different seed gives other masks


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputation_replays_dropout_exactly(mode):
    y0, g0 = run("never")
    y, g = run(mode)
    assert torch.equal(y, y0)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_actually_drops_and_scales():
    pipe = Pipe(nn.Sequential(nn.Dropout(0.5), nn.Identity()), [1, 1], chunks=2)
    y = pipe(torch.ones(64, 64))
    assert set(y.unique().tolist()) == {0.0, 2.0}
    assert 0.4 < (y == 0).float().mean().item() < 0.6
    pipe.eval()
    assert torch.equal(pipe(torch.ones(4, 4)), torch.ones(4, 4))


def test_model_without_randomness_leaves_the_default_generator_alone():
    pipe = Pipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), [1, 1], chunks=2)
    torch.manual_seed(3)
    pipe(torch.randn(4, 3)).sum().backward()
    after_pipe = torch.rand(1)
    torch.manual_seed(3)
    torch.randn(4, 3)
    assert torch.equal(torch.rand(1), after_pipe)


class MyLinear(nn.Linear):
    """A subclass of a layer that draws nothing: its forward may be anything."""


def test_draws_no_random_only_for_known_layers_without_hooks():
    assert draws_no_random(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.LayerNorm(3), nn.BatchNorm1d(3),
                                         DeferredBatchNorm(3), nn.Conv1d(3, 3, 1), nn.GELU(), nn.Identity()))
    for random in (nn.Dropout(0.1), nn.AlphaDropout(0.1), nn.RReLU(), nn.MultiheadAttention(4, 2),
                   nn.TransformerEncoderLayer(4, 2), MyLinear(3, 3), Counter()):
        assert not draws_no_random(nn.Sequential(nn.Linear(3, 3), random)), type(random).__name__
    layer = nn.Linear(3, 3)
    for register in (layer.register_forward_hook, layer.register_forward_pre_hook,
                     nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook):
        handle = register(lambda *args: None)
        try:
            assert not draws_no_random(nn.Sequential(layer, nn.ReLU()))
        finally:
            handle.remove()
        assert draws_no_random(nn.Sequential(layer, nn.ReLU()))
    # The partitions of a pipe: the container adds no draw, a hook on it may.
    partition = Pipe(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), [2]).partitions[0]
    assert draws_no_random(partition)
    handle = partition.register_forward_pre_hook(lambda *args: None)
    assert not draws_no_random(partition)
    handle.remove()


def test_the_random_mode_is_left_out_only_where_nothing_draws(monkeypatch):
    entered = []

    class Recording(StageRandom):
        def __enter__(self):
            entered.append(True)
            return super().__enter__()

    monkeypatch.setattr(stage_module, "StageRandom", Recording)
    Pipe(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)), [2, 1], chunks=2)(torch.randn(4, 3))
    assert entered == []
    Pipe(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 3)), [2, 1], chunks=2)(torch.randn(4, 3))
    assert len(entered) == 2  # the partition with dropout, once per micro-batch


@pytest.mark.parametrize("where", ["layer", "partition", "global"])
def test_a_hook_that_draws_noise_is_replayed_in_recomputation(where):
    """A forward hook on a layer of a partition of layers that draw nothing, on the partition itself, or on
    every module puts it back under the mode: the noise it draws is the stage's, and recomputation replays it."""

    def noisy(module, args, output):
        return output + torch.rand_like(output)

    def run_with(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        pipe = Pipe(model, [2, 3], chunks=4, checkpoint=mode)
        register = {"layer": model[2].register_forward_hook, "partition": pipe.partitions[1].register_forward_hook,
                    "global": nn.modules.module.register_module_forward_hook}[where]
        handle = register(noisy)
        try:
            torch.manual_seed(5)
            y = pipe(torch.randn(8, 4))
            y.square().sum().backward()
        finally:
            handle.remove()
        return y.detach(), [p.grad.clone() for p in pipe.parameters()]

    y0, g0 = run_with("never")
    y, g = run_with("always")
    assert torch.equal(y, y0)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_recomputation_does_not_touch_batchnorm_running_stats():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    a = Pipe(copy.deepcopy(plain), [2, 1], chunks=1, checkpoint="never")
    b = Pipe(copy.deepcopy(plain), [2, 1], chunks=1, checkpoint="always")
    a(x).sum().backward()
    b(x).sum().backward()
    assert torch.equal(a[1].running_mean, b[1].running_mean)
    assert torch.equal(a[1].num_batches_tracked, b[1].num_batches_tracked)


# --------------------------------------------------------------------------- random draws inside other functions
class SelfAttention(nn.Module):
    """Multi-head self-attention returning its output; with weights, dropout runs inside the functional MHA."""

    def __init__(self, need_weights: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        return self.attention(x, x, x, need_weights=self.need_weights)[0]


def random_model(kind: str) -> tuple[nn.Sequential, list[int], torch.Tensor]:
    torch.manual_seed(0)
    if kind == "rrelu":
        layers = [nn.Linear(8, 32), nn.RReLU(), nn.Linear(32, 32), nn.RReLU(0.05, 0.6, inplace=True), nn.Linear(32, 4)]
        return nn.Sequential(*layers), [2, 3], torch.randn(16, 8)
    if kind == "transformer":  # its self-attention calls scaled_dot_product_attention with dropout_p=0.1
        block = [nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)]
    else:  # the attention weights are dropped by F.dropout inside F.multi_head_attention_forward
        block = [SelfAttention(need_weights=True)]
    layers = [nn.Linear(16, 16), *block, nn.Linear(16, 16), *copy.deepcopy(block), nn.Linear(16, 4)]
    return nn.Sequential(*layers), [2, 3], torch.randn(8, 5, 16)


def run_random(kind: str, mode: str, chunks: int, seed: int = 7):
    model, balance, x = random_model(kind)
    pipe = Pipe(model, balance, chunks=chunks, checkpoint=mode)
    torch.manual_seed(seed)
    y = pipe(x)
    y.pow(2).sum().backward()
    return y.detach(), [p.grad.clone() for p in pipe.parameters()]


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("kind", ["transformer", "attention_weights", "rrelu"])
def test_recomputation_replays_attention_dropout_and_rrelu_exactly(kind, chunks):
    y0, g0 = run_random(kind, "never", chunks)
    for mode in ["always", "except_last"]:
        y, g = run_random(kind, mode, chunks)
        assert torch.equal(y, y0), mode
        assert all(torch.equal(a, b) for a, b in zip(g, g0)), f"gradients differ with checkpoint={mode}"
    y1, g1 = run_random(kind, "always", chunks)  # and again: nothing depends on thread timing
    assert torch.equal(y1, y0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
    y2, _ = run_random(kind, "never", chunks, seed=8)
    assert not torch.equal(y2, y0)  # the layers are random: another seed gives other draws


def test_routed_functions_draw_nothing_from_the_default_generator():
    x = torch.randn(2, 2, 6, 8)
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def draws(default_seed: int) -> list[torch.Tensor]:
        torch.manual_seed(default_seed)
        with StageRandom(lambda: 1234):
            return [F.scaled_dot_product_attention(x, x, x, dropout_p=0.5, is_causal=True),
                    mha(x[0], x[0], x[0], need_weights=False)[0], mha(x[0], x[0], x[0])[0],
                    F.rrelu(x, training=True), torch.rrelu(x, 0.1, 0.3, True), F.rrelu_(x.clone(), training=True),
                    F.gumbel_softmax(x[0, 0])]

    for a, b in zip(draws(1), draws(2)):
        assert torch.equal(a, b)
    rrelu = draws(1)[3]
    slope = rrelu[x < 0] / x[x < 0]
    assert torch.equal(rrelu[x >= 0], x[x >= 0])
    assert 1 / 8 <= slope.min() and slope.max() <= 1 / 3 and slope.std() > 0.02  # a slope per element


def test_attention_without_dropout_and_eval_rrelu_are_native_and_draw_no_seed():
    x = torch.randn(2, 2, 6, 8)
    seed_asked = []
    with StageRandom(lambda: seed_asked.append(1) or 1234):
        y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        r = F.rrelu(x, 0.1, 0.3, training=False)
    assert torch.equal(y, F.scaled_dot_product_attention(x, x, x, is_causal=True))
    assert torch.equal(r, torch.where(x >= 0, x, x * 0.2))
    assert seed_asked == []


def sdpa_cases():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
    bool_mask = torch.rand(5, 7) > 0.4
    bool_mask[1] = False  # a query that sees no key: zeros, as the native kernel gives
    yield "plain", (q, k, v), {}
    yield "causal_square", (q, q, q), {"is_causal": True}
    yield "causal_rect", (q, k, v), {"is_causal": True}
    yield "bool_mask", (q, k, v, bool_mask), {}
    yield "float_mask", (q, k, v, torch.randn(2, 1, 5, 7)), {}
    yield "scale", (q, k, v), {"scale": 0.3}
    kv = torch.randn(2, 2, 7, 8)
    yield "gqa", (q, kv, kv), {"enable_gqa": True, "scale": 0.5}
    yield "double", (q.double(), k.double(), v.double()), {"is_causal": True}


@pytest.mark.parametrize("name,args,kwargs", list(sdpa_cases()), ids=[c[0] for c in sdpa_cases()])
def test_written_out_attention_matches_the_native_kernel(name, args, kwargs):
    expected = F.scaled_dot_product_attention(*args, **kwargs)
    actual = attention(*args, **kwargs)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected)
    if name == "bool_mask":
        assert torch.equal(actual[:, :, 1], torch.zeros_like(actual[:, :, 1]))


def test_written_out_attention_drops_and_scales():
    s, p = 64, 0.3
    zero = torch.zeros(4, 64, s, 8)  # every key equally likely: weights 1/s; value = identity shows the weights
    eye = torch.eye(s).expand(4, 64, s, s)
    y = attention(zero, zero, eye, dropout_p=p, generator=torch.Generator().manual_seed(5))
    assert set(y.unique().tolist()) == pytest.approx([0.0, 1 / (s * (1 - p))])
    assert abs((y == 0).float().mean().item() - p) < 0.01
    again = attention(zero, zero, eye, dropout_p=p, generator=torch.Generator().manual_seed(5))
    assert torch.equal(y, again)
    assert torch.equal(attention(zero, zero, eye, dropout_p=1.0), torch.zeros_like(y))
    with pytest.raises(ValueError, match="between 0 and 1, but got 1.5"):
        attention(zero, zero, eye, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"is_causal=True \(attn_mask: \(64, 64\)\)"):
        attention(zero, zero, eye, torch.ones(s, s, dtype=torch.bool), dropout_p=p, is_causal=True)
    with pytest.raises(ValueError, match="query: 64, key: 3, value: 3"):
        attention(zero, zero[:, :3], eye[:, :3], enable_gqa=True)
