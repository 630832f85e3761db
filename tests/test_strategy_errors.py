"""PipeStrategy refuses bad input with one clear message, and a failing stage ends the whole job."""

from __future__ import annotations

import re
import warnings
from concurrent.futures import Future

import pytest
import pytorch_lightning as pl
import torch
from strategy_utils import run_script

from lightning_pipe import PipeStrategy


@pytest.mark.parametrize("kwargs,message", [
    ({"balance": [2, 0]}, r"positive integers, one per stage \(balance: \[2, 0\]\)"),
    ({"balance": "2,2"}, r"positive integers, one per stage \(balance: '2,2'\)"),
    ({"microbatches": 0}, r"microbatches must be a positive integer \(got: 0\)"),
    ({"checkpoint": "sometimes"}, r"checkpoint must be one of 'always', 'except_last', 'never' \(got: 'sometimes'\)"),
    ({"balance_mode": "by_magic"}, r"balance_mode must be one of .*\(got: 'by_magic'\)"),
    ({"rpc_timeout_sec": 0}, r"rpc_timeout_sec must be a positive number of seconds \(got: 0\)"),
    ({"module_name": "not a name"}, r"module_name must be the name of an attribute \(got: 'not a name'\)"),
    ({"start_method": "spawn"}, r"start_method='popen'.*got start_method='spawn'"),
    ({"memory_per_device": "1KiB"}, r"memory_per_device='1KiB' is the budget of the planner, which chooses the "
                                    r"arguments left to 'auto' \(balance, .*\), and none is"),
])
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipeStrategy(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"schedule": "zbv", "virtual_stages": 3}, r"schedule='zbv' places 2 stages per process in a V \(virtual_stages: "
                                               r"3\): use virtual_stages=2"),
    ({"schedule": "looped-bfs"}, r"schedule='looped-bfs' runs several stages per process \(virtual_stages: 1\)"),
    ({"schedule": "dualpipev", "balance": [1, 1, 1, 1], "microbatches": 3},
     r"dualpipev needs at least as many micro-batches as stages \(micro-batches: 3, stages: 4\)"),
    ({"schedule": [["0F0", "0B0"], ["1B0", "1F0"]], "microbatches": 1},
     r"process 1's action 1B0 comes before that micro-batch's forward on stage 1"),
    ({"schedule": [["0F0", "0B0"], ["1F0", "1B0"]], "microbatches": 2},
     r"the schedule runs 1 micro-batches and microbatches=2: make them agree"),
    ({"schedule": [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]], "microbatches": 1,
      "virtual_stages": 1}, r"holds 2 stages per process, and virtual_stages=1: pass virtual_stages=2"),
])
def test_schedules_that_cannot_run_fail_at_construction_naming_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipeStrategy(**kwargs)


@pytest.mark.parametrize("schedule,shown", [("1f1b", "schedule='1f1b' interleaves them"),
                                            ("zbv", "schedule='zbv' interleaves them"),
                                            ("auto", "schedule='auto' may choose one that interleaves them"),
                                            ([["0F0", "0B0"], ["1F0", "1B0"]],
                                             "a schedule given as data names each micro-batch's backward")])
def test_one_backward_per_stage_is_refused_where_the_schedule_interleaves_forwards_and_backwards(schedule, shown):
    """``pipelined_backward=False`` (each stage's backward once, over all its micro-batches) needs GPipe's order: with
    another it was accepted and ignored. Refused by both loops' strategies, saying what to change."""
    from lightning_pipe.lightning.fabric.strategy import PipeStrategy as FabricPipeStrategy

    extra = {"microbatches": 1} if isinstance(schedule, list) else {"memory_per_device": "1GiB"} \
        if schedule == "auto" else {}
    for strategy in (PipeStrategy, FabricPipeStrategy):
        with pytest.raises(ValueError, match=rf"pipelined_backward=False .* GPipe's order alone allows it, and "
                                             rf"{re.escape(shown)}\. Leave pipelined_backward=True"):
            strategy(schedule=schedule, pipelined_backward=False, **extra)
        strategy(schedule=schedule, pipelined_backward=True, **extra)
    PipeStrategy(schedule="gpipe", pipelined_backward=False)
    with pytest.raises(ValueError, match=r"pipelined_backward must be True or False \(got: 'no'\)"):
        PipeStrategy(pipelined_backward="no")


def test_the_v_shapes_take_two_stages_per_process_and_a_schedule_as_data_its_own():
    """``schedule='zbv'`` (or ``'dualpipev'``) with virtual_stages left out holds 2 stages per process in a V; a
    schedule given as data (here ZBV's, as text) holds the stages its processes name."""
    from lightning_pipe.engine.schedule import schedule_plan

    strategy = PipeStrategy(balance=[1, 1, 1, 2], schedule="zbv")
    assert strategy.virtual_stages == 2 and strategy.pipeline_processes == 2
    assert [strategy.process_of(s) for s in range(4)] == [0, 1, 1, 0]
    rows = [[str(a) for a in row] for row in schedule_plan("zbv", 8, 2, 2).actions]
    given = PipeStrategy(balance=[1, 1, 1, 2], schedule=rows)
    assert given.virtual_stages == 2 and [given.process_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert given.schedule.actions == schedule_plan("zbv", 8, 2, 2).actions


def test_a_parameter_shared_by_a_layer_outside_the_body_and_a_stage_in_another_process_is_refused():
    """An input projection outside the body tied to the body's last layer (as an LM ties its embedding and head): on
    one device one parameter; the driver's copy and the stage's would train apart (silently, before). Refused, naming
    both and what to change; shared with a layer of stage 0 (the driver's process), or within the body, it is taken."""
    from torch import nn

    from lightning_pipe.engine.partition import split_module
    from lightning_pipe.lightning.tied import check_outside_ties

    class Model(nn.Module):
        def __init__(self, tie_to: int) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 8, bias=False)
            self.sequential_module = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
            self.sequential_module[tie_to].weight = self.embed.weight

    model = Model(tie_to=2)
    parts = split_module(model.sequential_module, [2, 1])
    with pytest.raises(ValueError, match=r"Model\.embed\.weight is the same parameter as sequential_module\.2\.weight, "
                                         r"which stage 1 holds in another process.*Keep the layers that share it"):
        check_outside_ties(model, "sequential_module.", parts, [0, 1])
    check_outside_ties(model, "sequential_module.", parts, [0, 0])  # a V: the last stage is the driver's too
    model = Model(tie_to=0)
    check_outside_ties(model, "sequential_module.", split_module(model.sequential_module, [2, 1]), [0, 1])


def test_a_parameter_shared_by_two_stages_is_found_in_one_process_too():
    """Under a V schedule the first and the last stage share a process: an embedding tied to the head there is no tie
    across processes, and trained as one (each stage setting its gradient aside) the tied weight was 2e-2 from one
    device's after two steps (step 2's gradient held step 1's). ``stage_ties`` finds it by stage, whatever the process,
    and the build refuses it under virtual stages, as it did ties across processes."""
    from torch import nn

    from lightning_pipe.engine.partition import split_module
    from lightning_pipe.lightning.tied import find_tied, stage_ties

    embed = nn.Linear(4, 8, bias=False)
    head = nn.Linear(8, 4, bias=False)
    head.weight = embed.weight
    body = nn.Sequential(embed, nn.Tanh(), nn.Linear(8, 8), head)
    parts = split_module(body, [1, 1, 1, 1])
    assert find_tied(parts, [0, 1, 1, 0], [0, 1], "m.") == []  # a V: both users in the driver's process
    assert stage_ties(parts, "m.") == [("m.0.weight", "m.3.weight")]
    assert stage_ties(split_module(body, [4]), "m.") == []  # one stage: one parameter


def test_a_layer_holding_a_lambda_is_named_where_it_cannot_reach_its_stage(monkeypatch):
    """A stage's layers go to its process by pickle: a layer holding a lambda failed with pickle's words alone (from
    inside RPC, naming no layer). Now the stage, the process, the attribute and what to hold instead are said."""
    import pickle
    import types

    from torch import nn

    from lightning_pipe.transport.stages import host

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = lambda x: x

        def forward(self, x):
            return self.act(x)

    monkeypatch.setattr(host.rpc, "rpc_async", lambda peer, fn, timeout, args: pickle.dumps(args))  # as RPC pickles
    setup = types.SimpleNamespace(setup_timeout=1.0, timeout=1.0)
    with pytest.raises(TypeError, match=r"stage 1 cannot be sent to process 'worker1': .*\(stage 1's 1\.act: "
                                        r".*<lambda>\)\. A stage's layers travel to its process by pickle.*"
                                        r"nn\.Identity\(\)"):
        host.configure_async("worker1", "key", {1: (nn.Sequential(nn.Linear(2, 2), Holder()), 1)}, setup)
    assert host.configure_async("worker1", "key", {1: (nn.Sequential(nn.Linear(2, 2)), 1)}, setup)


def test_batch_norm_split_into_micro_batches_is_warned_of():
    """BatchNorm in training normalises each micro-batch with its own statistics: with more than one micro-batch the
    weights are not one device's (4.8e-2 off on the CNN example's body in float64, exact at one micro-batch), which
    nothing said. A warning names the layer and what gives one device's weights; none at one micro-batch or without
    BatchNorm."""
    import warnings

    from torch import nn

    from lightning_pipe.lightning.checks import warn_batch_norm

    body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()), nn.BatchNorm2d(4))
    with pytest.warns(UserWarning, match=r"PipeStrategy\(microbatches=4\): net\.1\.0 \(and 1 more BatchNorm layers\) "
                                         r"normalises each micro-batch .*microbatches=1 gives one device's"):
        warn_batch_norm(body, 4, "net")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_batch_norm(body, 1, "net")
        warn_batch_norm(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), 4, "net")


def test_fork_is_refused_where_a_forked_process_could_not_work(monkeypatch):
    """start_method='fork' is refused before any fork: with CUDA initialised in the launching process, and with
    OMP_NUM_THREADS asking for more than the one thread a forked process computes with."""
    from lightning_pipe.lightning.launcher import check_fork

    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with pytest.raises(ValueError, match=r"one CPU thread .*OMP_NUM_THREADS=4 cannot be honoured.*popen"):
        check_fork()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    check_fork()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"has initialised CUDA.*start_method='popen'"):
        check_fork()


def test_devices_not_a_multiple_of_stages_fails_before_processes_start():
    with pytest.raises(ValueError, match=r"devices x nodes: 3, stages: 2"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=PipeStrategy(balance=[1, 1]), logger=False)


def test_a_sharding_strategy_with_one_replica_warns_as_the_trainer_is_made_that_it_does_nothing():
    """With one replica a stage has nothing to be sharded over: said as the Trainer is made, before any process
    starts (a warning, as for DDP's arguments with one replica: the job's size, not the argument, makes it a no-op,
    and each process keeps its whole stage as with NO_SHARD). With 2 replicas, no word."""
    with pytest.warns(UserWarning, match=r"PipeStrategy\(sharding_strategy='FULL_SHARD'\) has no effect with one "
                                         r"replica \(devices x nodes: 2, processes per pipeline: 2\)") as said:
        pl.Trainer(accelerator="cpu", devices=2, strategy=PipeStrategy(balance=[1, 1], sharding_strategy="FULL_SHARD"),
                   logger=False)
    assert "or sharding_strategy='NO_SHARD' on one replica" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has no effect with one replica")
        pl.Trainer(accelerator="cpu", devices=4, strategy=PipeStrategy(balance=[1, 1], sharding_strategy="FULL_SHARD"),
                   logger=False)
        pl.Trainer(accelerator="cpu", devices=2, strategy=PipeStrategy(balance=[1, 1]), logger=False)


def test_a_hybrid_shard_size_that_does_not_divide_the_replicas_fails_as_the_trainer_is_made():
    """Found when the number of replicas is known, as the Trainer is made (not in setup, once every process runs),
    with the values and the sizes that would do."""
    with pytest.raises(ValueError, match=r"hybrid_shard_size must divide the number of replicas of each stage "
                                         r"\(hybrid_shard_size: 2, replicas: 3; devices x nodes: 6, processes per "
                                         r"pipeline: 2\): use one of \[1, 3\]"):
        pl.Trainer(accelerator="cpu", devices=6, logger=False,
                   strategy=PipeStrategy(balance=[1, 1], sharding_strategy="HYBRID_SHARD", hybrid_shard_size=2))
    pl.Trainer(accelerator="cpu", devices=6, logger=False,
               strategy=PipeStrategy(balance=[1, 1], sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3))


class EightLayers(pl.LightningModule):
    """A body of 8 layers, in ``self.<name>``."""

    def __init__(self, name: str = "sequential_module") -> None:
        super().__init__()
        setattr(self, name, torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(8))))


@pytest.mark.parametrize("balance,name,message", [
    ([3, 4], "sequential_module", "balance must sum to the 8 layers of EightLayers.sequential_module "
                                  "(PipeStrategy(balance=[3, 4]) sums to 7): add a layer to a stage, "
                                  "e.g. balance=[4, 4]"),
    ([5, 4], "sequential_module", "balance must sum to the 8 layers of EightLayers.sequential_module "
                                  "(PipeStrategy(balance=[5, 4]) sums to 9): remove a layer from a stage, "
                                  "e.g. balance=[4, 4]"),
    ([1, 2, 2], "body", "balance must sum to the 8 layers of EightLayers.body (PipeStrategy(balance=[1, 2, 2]) sums "
                        "to 5): add 3 layers to the stages, e.g. balance=[3, 3, 2]"),
    ([4] * 9, "sequential_module", "balance must sum to the 8 layers of EightLayers.sequential_module "
                                   "(PipeStrategy(balance=[4, 4, 4, 4, 4, 4, 4, 4, 4]) sums to 36), and 9 stages need "
                                   "at least 9 layers: use fewer stages (at most 8)"),
])
def test_a_balance_that_misses_layers_names_the_body_and_what_to_change(balance, name, message):
    """The check the launcher runs before any process starts (``check_model``; fail.py below runs it there): the
    balance against the body's layers, naming the body's attribute (``module_name``) and a balance that fits."""
    strategy = PipeStrategy(balance=balance, module_name=name)
    with pytest.raises(ValueError) as refused:
        strategy.check_model(EightLayers(name))
    assert str(refused.value).startswith(message)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every model and setting refused before any process starts, one after another in one process."""
    return run_script("fail.py", "refusals", str(tmp_path_factory.mktemp("refusals")), timeout=150).stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("what,error", [
    ("no_body", "Model has no attribute 'sequential_module'"),
    ("not_sequential", "Model.sequential_module must be nn.Sequential to be partitioned (got: ModuleList)"),
    ("bad_balance", "balance must sum to the 4 layers of Model.sequential_module (PipeStrategy(balance=[2, 3]) sums "
                    "to 5): remove a layer from a stage, e.g. balance=[2, 2]"),
    ("no_example", "Model.example_input_array, which is not set"),
    ("sync_batchnorm", "Trainer(sync_batchnorm=True) is not supported by PipeStrategy"),
    ("swa", "the StochasticWeightAveraging callback is not supported by PipeStrategy"),
    ("pruning", "the ModelPruning callback is not supported by PipeStrategy"),
    ("backbone", "the BackboneFinetuning callback is not supported by PipeStrategy"),
])
def test_bad_model_fails_before_processes_start(what, error, refusals):
    stdout = refusals
    line = next((ln for ln in stdout.splitlines() if ln.startswith(f"[refused {what}]")), None)
    assert line is not None and error in line, stdout[-4000:]
    assert stdout.count(error) == 1, stdout[-4000:]  # one message, not one per process
    assert "[rank: 1]" not in stdout  # no other process was ever started (fail.py also checks the launcher's)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,error", [
    ("forward", "ValueError: shape mismatch in layer 3 (input shape: (2, 16))"),
    ("backward", "FloatingPointError: non-finite gradient in layer 3"),
])
def test_failing_stage_ends_every_process(where, error, tmp_path):
    result = run_script("fail.py", where, str(tmp_path), timeout=90, expect_ok=False)
    assert result.returncode != 0
    assert error in result.stdout, result.stdout[-4000:]
    assert "stage 1 of pipeline" in result.stdout and "(rank 1, process 'worker1')" in result.stdout
    if where == "forward":
        assert "layer 3 ('3': Breaks)" in result.stdout
    # Every process ended by itself: the output pipe, which all of them hold, closed before the timeout (at which
    # run_script would kill them and fail).


@pytest.mark.timeout(120)
def test_bare_backward_with_replicas_is_refused_and_every_process_ends(tmp_path):
    """Manual optimization calling loss.backward() itself, with 2 replicas: nothing would average their
    gradients, so the first step fails saying what to call instead, and all 4 processes end."""
    result = run_script("fail.py", "bare_backward", str(tmp_path), timeout=90, expect_ok=False)
    assert result.returncode != 0
    assert ("RuntimeError: the pipeline's backward ran outside Lightning's backward (loss.backward() instead of "
            "self.manual_backward(loss)?): with 2 replicas" in result.stdout), result.stdout[-4000:]


@pytest.mark.timeout(120)
def test_a_comm_hook_that_raises_fails_the_first_step_and_every_process_ends(tmp_path):
    """DDP's arguments are not accepted and ignored: with 2 replicas x 2 stages, a ddp_comm_hook that raises
    (beside find_unused_parameters, bucket_cap_mb, broadcast_buffers) is called in the first step, its error
    reaches the driver, and all 4 processes end."""
    result = run_script("fail.py", "comm_hook", str(tmp_path), timeout=90, expect_ok=False)
    assert result.returncode != 0
    assert "RuntimeError: the comm hook was called (bucket 0 of a stage's DDP)" in result.stdout, result.stdout[-4000:]


@pytest.mark.timeout(120)
def test_a_loss_function_that_cannot_reach_the_last_stage_is_refused_at_loss_on_last_stage(tmp_path):
    """A lambda passed to ``loss_on_last_stage`` with the last stage in another process: refused at that call, before
    the step is sent (once pickle's "Can't pickle local object" from inside RPC's send), saying what to pass; every
    process ends."""
    result = run_script("fail.py", "lambda_loss", str(tmp_path), timeout=90, expect_ok=False)
    assert result.returncode != 0
    assert ("TypeError: loss_on_last_stage cannot send its loss_fn to the last stage, which runs in another process "
            "(a pipeline of 2 processes): the loss function travels there by pickle, and <function "
            "LambdaLoss._loss.<locals>.<lambda> at 0x") in result.stdout, result.stdout[-4000:]
    assert "Pass a function defined at the top level of a module" in result.stdout
    assert "rpc_async" not in result.stdout  # refused before anything was sent


@pytest.mark.timeout(120)
def test_fused_optimizer_under_a_gradient_scaler_is_refused(tmp_path):
    """A fused optimizer skips an overflowing step inside its own kernel, which the other stages would not
    see (they would step with infinite gradients): refused at setup, and every process ends."""
    result = run_script("fail.py", "fused_scaler", str(tmp_path), timeout=90, expect_ok=False)
    assert result.returncode != 0
    assert "Adam(fused=True) cannot be used with a gradient scaler (precision='16-mixed')" in result.stdout, \
        result.stdout[-4000:]


def test_batch_smaller_than_microbatches_warns_with_the_values():
    """The last batch of an epoch may be small: it trains correctly, and the user hears why it is slower."""
    import torch
    from torch import nn

    from lightning_pipe import Pipe
    from lightning_pipe.lightning.body import PipelinedSequential

    body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    local = Pipe(body, [1, 1], chunks=4).pipeline
    module = PipelinedSequential(body, {"0": 0, "1": 0}, local, chunks=4, checkpoint="never")
    with pytest.warns(UserWarning, match=r"a batch of 3 samples was split into 3 micro-batches, fewer than "
                                         r"microbatches=4"):
        out = module(torch.ones(3, 2))
    torch.testing.assert_close(out, body(torch.ones(3, 2)))


def test_weight_averaging_callbacks_are_refused():
    """EMAWeightAveraging copies the driver's model, whose remote layers are placeholders without data."""
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import EMAWeightAveraging

    with pytest.raises(ValueError, match="the EMAWeightAveraging callback is not supported by PipeStrategy"):
        PipeStrategy().check_settings(SimpleNamespace(callbacks=[EMAWeightAveraging()]))


def test_a_finetuning_callback_adding_a_parameter_group_is_refused_saying_why():
    """A BaseFinetuning of the user's whose finetune_function calls unfreeze_and_add_param_group failed inside
    Lightning with torch's words about meta tensors: refused with what to do instead; its other functions stay."""
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import BaseFinetuning

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            pass

        def finetune_function(self, pl_module, epoch, optimizer):
            self.unfreeze_and_add_param_group(pl_module.head, optimizer)

    callback = Unfreeze()
    PipeStrategy().check_settings(SimpleNamespace(callbacks=[callback]))
    with pytest.raises(ValueError, match=r"Unfreeze\.unfreeze_and_add_param_group adds a parameter group .*"
                                         r"\(BaseFinetuning\.make_trainable\)"):
        callback.finetune_function(SimpleNamespace(head=torch.nn.Linear(2, 2)), 1, None)
    assert callback.make_trainable is BaseFinetuning.make_trainable


class _TwoEvaluations(torch.optim.SGD):
    """Evaluates its closure twice per step, as sharpness-aware minimisation (SAM) does."""

    def step(self, closure=None):
        closure()
        return super().step(closure)


class _Stages:
    """The remote stages' handle, recording what the driver started on them; a step may be made to fail."""

    def __init__(self, failing: Exception | None = None):
        self.called = []
        self.failing = failing

    def start(self, method, *args, timeout=None, plane=False):
        self.called.append((method, *args))
        done = Future()
        done.set_exception(self.failing) if self.failing is not None else done.set_result(None)
        return [done]

    def call(self, method, *args):
        return [f.result() for f in self.start(method, *args)]

    def call_later(self, method, *args):
        self.call(method, *args)


@pytest.mark.parametrize("optimizer", [_TwoEvaluations, torch.optim.SGD])
def test_an_optimizer_evaluating_its_closure_twice_is_refused(optimizer):
    """The stages start their step once the closure has run; a second evaluation could not reach them."""
    from lightning_pipe.lightning.optimizers import StageOptimizers, _MirroredOptimizer, mix_in

    weight = torch.nn.Parameter(torch.ones(2))
    opt = optimizer([weight], lr=0.1)
    mix_in(opt, _MirroredOptimizer)
    stages = _Stages()
    opt._lp_hosts, opt._lp_index, opt._lp_stepping = stages, 0, None

    def closure():
        weight.grad = None
        loss = weight.square().sum()
        loss.backward()
        assert stages.called == []  # not before the gradients are final
        return loss

    if optimizer is _TwoEvaluations:
        with pytest.raises(RuntimeError, match=r"evaluated its closure a second time in one step \(as LBFGS and "
                                               r"sharpness-aware optimizers such as SAM do\)"):
            opt.step(closure)
        return
    opt.step(closure)
    assert torch.allclose(weight.detach(), torch.full((2,), 0.8))
    # The remote stages started with the hyper-parameters the driver stepped with, once; waited for after.
    assert stages.called == [("step", 0, [{k: v for k, v in opt.param_groups[0].items() if k != "params"}])]
    remote = StageOptimizers(stages, lambda name: 0, 2)
    assert remote.step_remote(opt) and not remote.step_remote(opt)


def test_a_remote_stages_failed_step_is_raised_by_post_optimizer_step():
    """post_optimizer_step is where the remote stages' steps end: a stage's error comes out there (without the
    hook, it would come out nowhere before the next forward)."""
    from lightning_pipe.lightning.optimizers import StageOptimizers, _MirroredOptimizer, mix_in

    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    opt = torch.optim.SGD([weight], lr=0.1)
    mix_in(opt, _MirroredOptimizer)
    opt._lp_hosts, opt._lp_index, opt._lp_stepping = _Stages(ValueError("stage 1 ran out of memory")), 0, None
    strategy = PipeStrategy(balance=[1, 1])
    strategy._stage_optimizers = StageOptimizers(opt._lp_hosts, lambda name: 0, 2)
    opt.step()
    with pytest.raises(ValueError, match="stage 1 ran out of memory"):
        strategy.post_optimizer_step(opt)
    strategy.post_optimizer_step(opt)  # reported once: nothing is pending any more
