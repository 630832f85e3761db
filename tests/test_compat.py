"""torchgpipe's and torch's sync.Pipe names: the engine under them, their documented behaviour, and programs
written for them that run after changing their imports alone."""

from __future__ import annotations

import copy
import difflib
import inspect
import re
import sys
import textwrap

import pytest
import torch
from dist_utils import free_port
from strategy_utils import run_command
from torch import nn

import lightning_pipe
from lightning_pipe.compat import sync, torchgpipe
from lightning_pipe.compat.sync import LocalRRef, WithDevice
from lightning_pipe.compat.torchgpipe import GPipe
from lightning_pipe.skip import pop, skippable, stash

MODES = ["always", "except_last", "never"]


def layers(n: int = 4) -> list[nn.Module]:
    return [nn.Linear(4, 4) for _ in range(n)]


def piped(kind: str, modules: list[nn.Module], balance: list[int], **kwargs):
    """The pipe of ``kind`` over ``modules`` cut by ``balance``, and a function giving its output on an input
    (sync.Pipe's is the RRef's local value). sync.Pipe takes its cut from nested ``nn.Sequential`` s on the CPU."""
    if kind == "sync":
        starts = [sum(balance[:j]) for j in range(len(balance))]
        pipe = sync.Pipe(nn.Sequential(*[nn.Sequential(*modules[s:s + b]) for s, b in zip(starts, balance)]), **kwargs)
        assert pipe.balance == balance
        return pipe, lambda x: pipe(x).local_value()
    pipe = (lightning_pipe.Pipe if kind == "Pipe" else GPipe)(nn.Sequential(*modules), balance, **kwargs)
    return pipe, pipe


KINDS = ["Pipe", "GPipe", "sync"]


# ---------------------------------------------------------------------- the names
def test_the_names_are_the_engine_under_other_names():
    assert issubclass(GPipe, lightning_pipe.Pipe) and issubclass(sync.Pipe, lightning_pipe.Pipe)
    assert torchgpipe.is_checkpointing is lightning_pipe.is_checkpointing is sync.is_checkpointing
    assert torchgpipe.is_recomputing is lightning_pipe.is_recomputing is sync.is_recomputing
    for skip in (torchgpipe.skip, sync.skip):
        assert {n: getattr(skip, n) for n in skip.__all__} == {n: getattr(lightning_pipe.skip, n) for n in skip.__all__}
        assert set(skip.__all__) == {"skippable", "stash", "pop", "verify_skippables", "Namespace"}
    from lightning_pipe.compat.torchgpipe.balance import balance_by_size, balance_by_time  # noqa: F401
    from lightning_pipe.compat.torchgpipe.skip import Namespace, verify_skippables  # noqa: F401


def test_signatures_are_those_documented():
    def shape(f):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(f).parameters.values()]

    empty = inspect.Parameter.empty
    assert shape(GPipe) == [("module", "POSITIONAL_OR_KEYWORD", empty), ("balance", "POSITIONAL_OR_KEYWORD", None),
                            ("devices", "KEYWORD_ONLY", None), ("chunks", "KEYWORD_ONLY", 1),
                            ("checkpoint", "KEYWORD_ONLY", "except_last"),
                            ("deferred_batch_norm", "KEYWORD_ONLY", False)]
    assert shape(sync.Pipe) == [("module", "POSITIONAL_OR_KEYWORD", empty), ("chunks", "POSITIONAL_OR_KEYWORD", 1),
                                ("checkpoint", "POSITIONAL_OR_KEYWORD", "except_last"),
                                ("deferred_batch_norm", "POSITIONAL_OR_KEYWORD", False)]
    common = [("partitions", "POSITIONAL_OR_KEYWORD", empty), ("module", "POSITIONAL_OR_KEYWORD", empty)]
    assert shape(torchgpipe.balance.balance_by_time) == [*common, ("sample", "POSITIONAL_OR_KEYWORD", empty),
                                                         ("timeout", "KEYWORD_ONLY", 1.0),
                                                         ("device", "KEYWORD_ONLY", None)]
    assert shape(torchgpipe.balance.balance_by_size) == [*common, ("input", "POSITIONAL_OR_KEYWORD", empty),
                                                         ("chunks", "KEYWORD_ONLY", 1),
                                                         ("param_scale", "KEYWORD_ONLY", 2.0),
                                                         ("device", "KEYWORD_ONLY", None)]


def test_balancing_defaults_to_the_cpu_without_cuda_and_says_when_cuda_is_asked_for(monkeypatch):
    from lightning_pipe.compat.torchgpipe.balance import balance_by_size, balance_by_time

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, sample = nn.Sequential(*layers()), torch.randn(8, 4)
    by_time = balance_by_time(2, model, sample, timeout=0.01)  # profiled on the CPU
    assert len(by_time) == 2 and sum(by_time) == 4
    assert balance_by_size(2, model, sample, chunks=2) == [2, 2]  # four layers of one size
    for balance in (balance_by_time, balance_by_size):
        with pytest.raises(ValueError, match=r"cannot profile the layers on cuda(:0)?: CUDA is not available here"):
            balance(2, model, sample, device="cuda")


# ---------------------------------------------------------------------- GPipe as torchgpipe documents it
def test_gpipe_attributes_and_container_behaviour():
    modules = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    model = GPipe(nn.Sequential(*modules), [2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    assert model.balance == [2, 3] and model.chunks == 3 and model.checkpoint == "never"
    assert model.devices == [torch.device("cpu")] * 2
    assert isinstance(model.partitions, nn.ModuleList)
    assert [type(p).__mro__[1] for p in model.partitions] == [nn.Sequential] * 2
    assert [list(p) for p in model.partitions] == [modules[:2], modules[2:]]
    assert len(model) == 5 and list(model) == modules
    assert [model[k] for k in range(5)] == modules and [model[-k] for k in range(1, 6)] == modules[::-1]
    with pytest.raises(IndexError):
        model[5]
    assert list(model.state_dict())[:2] == ["partitions.0.0.weight", "partitions.0.0.bias"]  # torchgpipe's keys
    assert list(model.state_dict())[-1] == "partitions.1.4.bias"


def test_gpipe_default_devices_follow_torchgpipe(monkeypatch):
    monkeypatch.undo()  # the suite's own default (every partition on the CPU) is not what is tested here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GPipe(nn.Sequential(*layers()), [1, 3]).devices == [torch.device("cpu")] * 2  # torchgpipe: no device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)  # no GPU needed to place them
    assert GPipe(nn.Sequential(*layers()), [1, 3]).devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(IndexError, match=r"too few devices to hold given partitions \(devices: 3, partitions: 4\)"):
        GPipe(nn.Sequential(*layers()), [1, 1, 1, 1])


def test_gpipe_errors_have_torchgpipe_types():
    with pytest.raises(TypeError, match="must be nn.Sequential"):
        GPipe(nn.Linear(2, 2), [1])
    with pytest.raises(ValueError, match=r"module and sum of balance have different length \(module: 4, sum of "
                                         r"balance: 3\)"):
        GPipe(nn.Sequential(*layers()), [1, 2])
    with pytest.raises(ValueError, match="balance_by_time"):
        GPipe(nn.Sequential(*layers()))
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        GPipe(nn.Sequential(*layers()), [4], chunks=0)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        GPipe(nn.Sequential(*layers()), [4], checkpoint="often")
    with pytest.raises(IndexError, match="too few devices"):
        GPipe(nn.Sequential(*layers()), [2, 2], devices=["cpu"])
    with pytest.raises(ValueError, match=r"has no layers \(an empty nn.Sequential"):  # torchgpipe took it
        GPipe(nn.Sequential(), [])


@pytest.mark.parametrize("kind", KINDS)
def test_moving_is_a_type_error(kind):
    model, _ = piped(kind, layers(), [2, 2])
    for move in (lambda: model.to(0), lambda: model.to(device=0), lambda: model.to("cpu"), lambda: model.cuda(),
                 lambda: model.cpu(), lambda: model.to(torch.zeros(1))):
        with pytest.raises(TypeError, match="cannot be moved"):
            move()
    assert next(model.to(torch.float64).parameters()).dtype == torch.float64


# ---------------------------------------------------------------------- the engine's behaviour, under every name
@skippable(stash=["skip"])
class StashMaybe(nn.Module):
    def __init__(self, on: bool) -> None:
        super().__init__()
        self.on = on

    def forward(self, x):
        yield stash("skip", x * 2 if self.on else None)
        return x + 1


@skippable(pop=["skip"])
class PopMaybe(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x * 3 if skip is None else x - skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_none_crosses_partitions(kind, checkpoint):
    for on in (False, True):
        torch.manual_seed(0)
        modules = [nn.Linear(4, 4), StashMaybe(on), nn.Linear(4, 4), nn.Tanh(), PopMaybe(), nn.Linear(4, 2)]
        plain = copy.deepcopy(nn.Sequential(*modules))
        _, run = piped(kind, modules, [2, 2, 2], chunks=3, checkpoint=checkpoint)
        x1 = torch.randn(6, 4, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        expected, actual = plain(x1), run(x2)
        torch.testing.assert_close(actual, expected)
        expected.square().sum().backward()
        actual.square().sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_on_partitions_run(kind):
    model, run = piped(kind, layers(), [2, 2], chunks=2, checkpoint="except_last")
    calls = []
    model.partitions[0].register_forward_pre_hook(lambda module, args: calls.append(("pre", 0)))
    model.partitions[1].register_forward_hook(lambda module, args, out: calls.append(("post", 1)))
    run(torch.randn(4, 4, requires_grad=True)).sum().backward()
    # Two micro-batches' forwards, and the recomputation of the first (checkpointed) one in backward.
    assert sorted(calls) == [("post", 1)] * 3 + [("pre", 0)] * 3


@skippable(stash=["skip"])
class StashesNothing(nn.Module):
    def forward(self, x):
        return x
        yield


@pytest.mark.parametrize("kind", KINDS)
def test_a_declared_stash_never_made_is_an_error(kind):
    _, run = piped(kind, [StashesNothing(), nn.Linear(4, 4), PopMaybe()], [1, 2], chunks=2)
    with pytest.raises(RuntimeError, match=r"StashesNothing did not stash 'skip' in this forward"):
        run(torch.randn(4, 4))


# ---------------------------------------------------------------------- a torchgpipe program, imports changed
TORCHGPIPE_PROGRAM = '''
import torch
from torch import nn
import torchgpipe
from torchgpipe import GPipe
from torchgpipe.balance import balance_by_time
from torchgpipe.skip import Namespace, pop, skippable, stash, verify_skippables


@skippable(stash=["identity"])
class Identity(nn.Module):
    def forward(self, input):
        yield stash("identity", input)
        return input


@skippable(pop=["identity"])
class Residual(nn.Module):
    def forward(self, input):
        identity = yield pop("identity")
        return input + identity


class Counter(nn.Module):
    """Counts forward passes, not their recomputation."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, input):
        if not torchgpipe.is_recomputing():
            self.forwards += 1
        return input


def block(ns):
    return [Identity().isolate(ns), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
            Residual().isolate(ns)]


def build():
    torch.manual_seed(0)
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(nn.Linear(8, 16), *block(ns1), Counter(), *block(ns2), nn.Linear(16, 4))


def train_step(model, input, target, chunks, checkpoint):
    verify_skippables(model)
    balance = balance_by_time(3, model, input[:4], timeout=0.05, device="cpu")
    model = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
    output = model(input)
    loss = nn.functional.mse_loss(output, target.to(model.devices[-1]))
    loss.backward()
    return model, output
'''


def migrate(program: str, old: str, new: str) -> str:
    """``program`` with its imports of module ``old`` and its submodules made imports of ``new`` (``import old``
    becomes ``from <new's parent> import <old's name>``), checked to differ in import lines alone."""
    parent, _, name = new.rpartition(".")
    lines = program.splitlines()
    migrated = [re.sub(rf"^from {re.escape(old)}(\.|\s)", rf"from {new}\1",
                       re.sub(rf"^import {re.escape(old)}$", f"from {parent} import {name}", line)) for line in lines]
    changed = [d for d in difflib.unified_diff(lines, migrated, lineterm="", n=0)
               if d[:1] in "+-" and d[:3] not in ("---", "+++")]
    assert changed and all(d[1:].startswith(("import ", "from ")) for d in changed), changed
    return "\n".join(migrated) + "\n"


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_torchgpipe_program_runs_after_changing_its_imports(checkpoint):
    code = migrate(TORCHGPIPE_PROGRAM, "torchgpipe", "lightning_pipe.compat.torchgpipe")
    assert "from lightning_pipe.compat import torchgpipe\n" in code and "torchgpipe.skip import" in code
    program: dict = {"__name__": "torchgpipe_program"}
    exec(compile(code, "torchgpipe_program.py", "exec"), program)
    chunks = 4
    torch.manual_seed(1)
    x, target = torch.randn(16, 8), torch.randn(16, 4)
    model, output = program["train_step"](program["build"](), x, target, chunks, checkpoint)
    assert len(model.balance) == 3 and sum(model.balance) == len(model) == 15
    counter = next(layer for layer in model if type(layer).__name__ == "Counter")
    assert counter.forwards == chunks  # recomputation is not counted (is_recomputing)

    # The plain model on each micro-batch (BatchNorm normalises each by its own statistics, as in the pipe).
    plain = program["build"]()
    norms = [m for m in plain.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    fresh = copy.deepcopy(norms)
    seen: dict[int, list[torch.Tensor]] = {k: [] for k in range(len(norms))}
    for k, norm in enumerate(norms):
        norm.register_forward_pre_hook(lambda module, args, k=k: seen[k].append(args[0].detach()))
    expected = torch.cat([plain(part) for part in x.tensor_split(chunks)])
    nn.functional.mse_loss(expected, target).backward()
    torch.testing.assert_close(output, expected)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    # Deferred BatchNorm: running statistics updated once, as by one pass of the whole mini-batch's inputs.
    deferred = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(deferred) == len(fresh) == 2
    for k, (mine, theirs) in enumerate(zip(deferred, fresh)):
        theirs(torch.cat(seen[k]))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), msg=f"{name} of norm {k}")
    # In eval mode, the pipe is the plain model with those statistics.
    whole = program["build"]()
    for norm, theirs in zip([m for m in whole.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)], fresh):
        norm.load_state_dict(theirs.state_dict())
    model.eval()
    whole.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), whole(x))


# ---------------------------------------------------------------------- sync.Pipe: placement by the layers' devices
def test_sync_partitions_follow_the_devices_of_the_layers():
    # Real placement on two kinds of device this machine has: meta layers merge, CPU layers each stand alone.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8, device="meta"),
                          nn.Sequential(nn.Linear(8, 8, device="meta"), nn.Tanh()), WithDevice(nn.Tanh(), "meta"),
                          nn.Linear(8, 2), nn.Sequential(nn.ReLU(), nn.Identity()))
    pipe = sync.Pipe(model, chunks=2)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert pipe.devices == [cpu, cpu, meta, cpu, cpu] and pipe.balance == [1, 1, 4, 1, 2]
    assert [type(layer).__name__ for layer in pipe.partitions[2]] == ["Linear", "Linear", "Tanh", "Tanh"]
    assert list(pipe.state_dict()) == [f"partitions.{j}.{k}.{p}" for j, k in ((0, 0), (2, 0), (2, 1), (3, 0))
                                       for p in ("weight", "bias")]  # torch's names


def test_sync_partitions_on_gpus_by_torchs_rule(monkeypatch):
    """Placement on GPUs, without GPUs: each layer's device is given by a stand-in for the lookup of its
    parameters' device, and moves are not made."""
    on = {}

    def place(layer: nn.Module, device: str) -> nn.Module:
        on[id(layer)] = torch.device(device)
        return layer

    monkeypatch.setattr(sync, "layer_device", lambda name, layer: on.get(id(layer)))
    monkeypatch.setattr(nn.Module, "to", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fc1, fc2, fc3, fc4 = (place(nn.Linear(4, 4), d) for d in ("cuda:0", "cuda:0", "cuda:1", "cuda:1"))
    # A layer without parameters runs on the CPU (a partition of its own) unless WithDevice says otherwise.
    pipe = sync.Pipe(nn.Sequential(fc1, fc2, nn.ReLU(), fc3, fc4), chunks=8)
    assert pipe.balance == [2, 1, 2]
    assert pipe.devices == [torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda", 1)]
    pipe = sync.Pipe(nn.Sequential(fc1, fc2, WithDevice(nn.ReLU(), "cuda:1"), fc3, fc4,
                                   WithDevice(nn.Dropout(), "cuda:1")), chunks=8)
    assert pipe.balance == [2, 4] and pipe.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_sync_refuses_a_layer_on_several_devices():
    layer = nn.Linear(2, 2)
    layer.register_buffer("scale", torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"layer '1' \(Linear\) has parameters or buffers on several devices "
                                         r"\(cpu, meta\); each layer runs on one device"):
        sync.Pipe(nn.Sequential(nn.Linear(2, 2), layer))
    with pytest.raises(TypeError, match="must be nn.Sequential"):
        sync.Pipe(nn.Linear(2, 2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"layer '1' is WithDevice\(\.\.\., 'cuda:1'\), but CUDA is not "
                                             r"available here"):
            sync.Pipe(nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "cuda:1")))
    with pytest.raises(ValueError, match="has no layers"):
        sync.Pipe(nn.Sequential(nn.Sequential()))


class Fork(nn.Module):
    def forward(self, x):
        return x.sin(), x.cos()


class Join(nn.Module):
    def forward(self, a, b):
        return a * b


class Both(nn.Module):
    def forward(self, a, b):
        return a + 1, b - 1


def test_sync_spreads_tuples_over_arguments_as_torch_did():
    plain = [Fork(), Both(), Join(), nn.Linear(4, 2)]
    x = torch.randn(6, 4)
    a, b = Fork()(x)
    expected = plain[3](plain[2](*plain[1](a, b)))
    for grouping in ([plain[:2], plain[2:]], [plain[:1], plain[1:3], plain[3:]], [plain]):
        pipe = sync.Pipe(nn.Sequential(*[nn.Sequential(*g) for g in grouping]), chunks=3)
        torch.testing.assert_close(pipe(x).local_value(), expected)
    # Several inputs are the first layer's arguments.
    pipe = sync.Pipe(nn.Sequential(nn.Sequential(Both()), nn.Sequential(Join(), plain[3])), chunks=2)
    torch.testing.assert_close(pipe(a, b).local_value(), expected)
    torch.testing.assert_close(pipe((a, b)).local_value(), expected)
    with pytest.raises(TypeError, match="one tensor or several"):
        pipe()


def test_sync_without_rpc_returns_a_local_rref():
    pipe = sync.Pipe(nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2)), 2)
    assert pipe.chunks == 2 and pipe.checkpoint == "except_last"
    x = torch.randn(4, 4)
    out = pipe(x)
    assert isinstance(out, LocalRRef) and out.is_owner()
    assert out.local_value() is out.to_here()
    torch.testing.assert_close(out.local_value(), pipe.partitions[1](pipe.partitions[0](x)))
    with pytest.raises(AttributeError, match=r"LocalRRef has no 'owner': the output was computed while "
                                             r"torch.distributed.rpc was not initialised.*init_rpc"):
        out.owner()
    assert len(pipe) == 2 and isinstance(pipe[0:2], nn.Sequential) and list(pipe[0:2]) == list(pipe)


SYNC_PROGRAM = '''
import os

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.pipeline.sync import Pipe, WithDevice
from torch.distributed.pipeline.sync.skip import pop, skippable, stash


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, input):
        yield stash("1to3", input)
        return self.linear(input)


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def forward(self, input):
        skip_1to3 = yield pop("1to3")
        return input + skip_1to3


def build():
    """The layers, placed by hand: on one GPU each with .cuda(i); here every stage on the CPU, each an
    nn.Sequential of its own (a partition)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
        nn.Sequential(Layer1(), nn.ReLU(), nn.Linear(16, 16)),
        WithDevice(nn.Tanh(), "cpu"),
        nn.Sequential(Layer3(), nn.Linear(16, 4)),
    )


def main(checkpoint):
    model = Pipe(build(), chunks=4, checkpoint=checkpoint)
    input = torch.randn(12, 8)
    output_rref = model(input)
    output = output_rref.local_value()
    output.square().sum().backward()
    return model, input, output_rref, output


if __name__ == "__main__":
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ.setdefault("MASTER_PORT", "29500")
    rpc.init_rpc("worker", rank=0, world_size=1)
    try:
        for checkpoint in ("always", "except_last", "never"):
            check(*main(checkpoint))
    finally:
        rpc.shutdown()
'''

SYNC_CHECK = '''
def check(model, input, output_rref, output):
    assert isinstance(output_rref, rpc.RRef), type(output_rref)
    assert model.balance == [2, 3, 1, 2], model.balance
    plain = nn.Sequential(*[layer for child in build() for layer in (child if isinstance(child, nn.Sequential)
                                                                       else [child.module])])
    expected = plain(input)
    expected.square().sum().backward()
    torch.testing.assert_close(output, expected)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    print("checked", model.checkpoint, flush=True)
'''


@pytest.mark.timeout(120)
def test_a_sync_pipe_program_runs_after_changing_its_imports(tmp_path):
    """A program written for torch's sync.Pipe (RPC initialised, layers placed by hand, the output from the
    RRef's local value), with its imports changed, gives the plain model's outputs and gradients."""
    code = migrate(SYNC_PROGRAM, "torch.distributed.pipeline.sync", "lightning_pipe.compat.sync")
    main = code.index('if __name__ == "__main__":')
    (tmp_path / "program.py").write_text(code[:main] + textwrap.dedent(SYNC_CHECK) + "\n\n" + code[main:])
    result = run_command([sys.executable, "program.py"], cwd=tmp_path, timeout=100, name="program.py",
                         env={"MASTER_PORT": str(free_port())})
    assert result.stdout.split() == ["checked", "always", "checked", "except_last", "checked", "never"], \
        result.stdout[-3000:]
