"""The planner: what it measures of a body, what it predicts of a layout, what it refuses, and ``"auto"`` in the
Trainer (chosen before the processes start, trained to one device's weights)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from strategy_utils import REPO, run_script
from torch import nn

from lightning_pipe import plan_layout
from lightning_pipe.engine.planning import Costs, Layout, check_precision, format_bytes, measure_body, parse_bytes
from lightning_pipe.engine.planning.layouts import predict
from lightning_pipe.engine.planning.memory import OptimizerModel, optimizer_model

#: The scripts' warnings printed (the tests' processes ignore them by default): a plan's "above the planned" is seen.
WARNINGS_SHOWN = {"PYTHONWARNINGS": "default"}


def body(layers: int = 6, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def saved_bytes(module: nn.Sequential, x: torch.Tensor) -> int:
    """What autograd saves running ``module`` on ``x`` (parameters left out), its input and output counted: what a
    stage holds per micro-batch, counted directly."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 3), (2, 6), (0, 6)])
def test_a_stages_activations_are_what_autograd_saves_there(lo, hi):
    """Measured once per layer, a stage of any layers holds per sample exactly what running those layers saves."""
    module, x = body(), torch.randn(16, 64)
    profile = measure_body(module, x, repeats=1)
    stage_input = x if lo == 0 else module[:lo](x).detach()
    assert profile.activations(lo, hi) * 16 == saved_bytes(module[lo:hi], stage_input)


def test_the_optimizers_state_is_measured():
    cpu = torch.device("cpu")
    assert optimizer_model(torch.optim.AdamW, cpu).states == 2.0
    assert optimizer_model(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), cpu).states == 1.0
    assert optimizer_model(lambda ps: torch.optim.SGD(ps, lr=0.1), cpu).states == 0.0


ADAM = OptimizerModel(2.0, False)


def predicted(layout: Layout, optimizer: OptimizerModel = ADAM, **kwargs):
    module = body()
    profile = measure_body(module, torch.randn(16, 64), repeats=1)
    return predict(layout, profile, batch=16, fixed_global=False, optimizer=optimizer, costs=Costs(),
                   splittable=kwargs.pop("splittable", lambda lo, hi: 0.0), cores=2, **kwargs), profile


def test_each_term_follows_the_layout():
    """Parameters by stage; Adam's state twice the trainable; sharding divides the state (FULL_SHARD the parameters
    and the gradients, scattered by each backward; SHARD_GRAD_OP's gradients accumulate whole until the last
    backward); DDP's buckets copy the gradients; tensor parallel divides what its plan splits."""
    one, profile = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 4, "1f1b", "never"), aside=False)
    stage = profile.total("params", 0, 3)
    m = one.memory[0]
    assert m.parameters == stage and m.gradients == stage and m.optimizer == 2 * stage and m.buffers > 0
    ddp, _ = predicted(Layout(2, 1, (3, 3), 1, 2, "NO_SHARD", 4, "1f1b", "never"), aside=False)
    assert ddp.memory[0].buffers - m.buffers == stage  # the buckets
    grad_op, _ = predicted(Layout(2, 1, (3, 3), 1, 2, "SHARD_GRAD_OP", 4, "1f1b", "never"), aside=False)
    assert grad_op.memory[0].gradients == stage and grad_op.memory[0].optimizer == stage  # whole until scattered
    assert grad_op.memory[0].parameters == stage / 2 + stage  # its shard, and the whole it gathered for the step
    full, _ = predicted(Layout(2, 1, (3, 3), 1, 2, "FULL_SHARD", 4, "1f1b", "never"), aside=False)
    assert full.memory[0].parameters == stage / 2
    assert full.memory[0].gradients == stage / 2  # each backward reduces and scatters them: the shard alone
    # A layer's backward holds four whole layers (its parameters and their gradient, the one before prefetched, the
    # last reduce-scatter's input) besides the gradients flowing: the transient, the body's layers even.
    flowing = (profile.largest_saved(0, 3) + profile.boundary(0)) * 16 / 4
    assert full.memory[0].transient == pytest.approx(flowing + 4 * profile.total("params", 0, 1))
    split, _ = predicted(Layout(2, 1, (3, 3), 2, 1, "NO_SHARD", 4, "1f1b", "never"), aside=False,
                         splittable=lambda lo, hi: profile.total("params", lo, hi))
    assert split.memory[0].parameters == stage / 2
    aside, _ = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 4, "1f1b", "never"), aside=True)
    assert aside.memory[0].gradients == 2 * stage  # the previous step's, and this one's made aside
    # The data plane's rings (shared memory), two per other process of the pipeline, in every process's runtime.
    three, _ = predicted(Layout(3, 1, (2, 2, 2), 1, 1, "NO_SHARD", 4, "1f1b", "never"), aside=False)
    costs = Costs()
    assert [m.runtime for m in three.memory] == \
        [costs.driver_memory + 2 * costs.peer_memory] + [costs.runtime_memory + 2 * costs.peer_memory] * 2
    assert m.runtime == costs.driver_memory + costs.peer_memory  # 2 processes: one peer
    # GPipe's activations peak before its first backward: the step's gradients are made as that backward frees its
    # micro-batch's, so the peak holds the activations of all but one beside them, not all of them.
    gpipe, _ = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 4, "gpipe", "never"), aside=True)
    first = profile.activations(0, 3) * 16 / 4  # one micro-batch's at stage 0
    assert gpipe.memory[0].gradients == pytest.approx(2 * stage - first)


def test_activations_follow_the_schedule_and_recomputation():
    """GPipe holds every micro-batch at stage 0, 1F1B as many as there are stages; recomputing holds each one's input
    alone (as the engine keeps it: its output is handed on, not kept), and one micro-batch whole while it is
    recomputed."""
    from lightning_pipe.engine.microbatch import Batch
    from lightning_pipe.engine.partition import split_module
    from lightning_pipe.engine.rng import LazySeed
    from lightning_pipe.engine.stage import Stage

    stage = Stage(0, split_module(body(), [3, 3])[0], torch.device("cpu"))
    x = torch.randn(2, 64)
    out, _ = stage.forward(0, 0, Batch((x,), True), {}, seed=LazySeed(), save=True, checkpoint=True, last=False)
    kept = stage._saved[(0, 0)]
    assert kept.outputs is None and [t.data_ptr() for t in kept.inputs] == [x.data_ptr()]
    gpipe, profile = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 8, "gpipe", "never"))
    one_f, _ = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 8, "1f1b", "never"))
    every = profile.activations(0, 3) * 2  # one micro-batch of 2 rows at stage 0
    assert gpipe.memory[0].activations == pytest.approx(8 * every)
    assert one_f.memory[0].activations == pytest.approx(2 * every)
    recomputed, _ = predicted(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 8, "gpipe", "always"))
    inputs = profile.boundary(0) * 2  # what a recomputed micro-batch keeps: its input
    assert recomputed.memory[0].activations == pytest.approx(8 * inputs + every - inputs)
    assert recomputed.memory[0].activations < gpipe.memory[0].activations


def test_the_fastest_layout_that_fits_is_chosen_and_what_is_fixed_stays():
    module, x = body(), torch.randn(32, 64)
    plan = plan_layout(module, x, devices=2, memory_per_device="1GiB", optimizer=torch.optim.AdamW)
    assert all(p.peak <= 2**30 for p in plan.ranked)
    assert plan.ranked[0].per_sample <= min(p.per_sample for p in plan.ranked)
    assert "chosen" in plan.table() and str(plan.layout) in plan.table()
    fixed = plan_layout(module, x, devices=2, memory_per_device="1GiB", profile=plan.profile, balance=[2, 4],
                        schedules=["1f1b"], where=lambda layout: layout.replicas == 1)
    assert {(p.layout.balance, p.layout.schedule, p.layout.replicas) for p in fixed.ranked} == {((2, 4), "1f1b", 1)}


def test_a_budget_no_layout_meets_is_refused_naming_the_largest_term_and_the_budget_it_names_fits():
    """The budget the refusal names is rounded up: given back, it fits (rounded to the nearest, 7.3 MiB for a
    7.34 MiB peak, it was refused again)."""
    module, x = body(), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"no layout fits memory_per_device=1.0 MiB on 2 devices.*largest term is "
                                         r"\w+ .*fits with memory_per_device >=") as refused:
        plan_layout(module, x, devices=2, memory_per_device="1MiB", optimizer=torch.optim.AdamW)
    named = re.search(r"memory_per_device >= ([0-9.]+ [GM]iB)", str(refused.value)).group(1)
    profile = measure_body(module, x)  # the same body, measured once for both plans below
    smallest = min(p.peak for p in plan_layout(module, x, devices=2, memory_per_device="1GiB", profile=profile,
                                               optimizer=torch.optim.AdamW).ranked)
    assert parse_bytes(named) >= smallest
    plan_layout(module, x, devices=2, memory_per_device=format_bytes(smallest, up=True), profile=profile,
                optimizer=torch.optim.AdamW)


@pytest.mark.parametrize("given,named", [("64", "64-true"), (64, "64-true"), ("bf16", "bf16-mixed"),
                                         ("16-true", "16-true")])
def test_a_precision_is_read_with_lightnings_aliases(given, named):
    assert check_precision(given) == named


def test_a_precision_the_planner_does_not_model_is_refused():
    """Any string was planned as 32-true before ("64" at half the parameters' bytes)."""
    with pytest.raises(ValueError, match=r"precision must be one of .*got: '17-weird'"):
        plan_layout(body(), torch.randn(32, 64), devices=2, memory_per_device="1GiB", precision="17-weird")


def test_a_process_over_the_budget_the_plan_was_made_for_is_warned_of():
    """Within 10% of its predicted peak but over the budget (a small budget: the 64 MiB floor hid it): warned."""
    import warnings
    from types import SimpleNamespace

    from lightning_pipe.lightning.planned import check_peaks

    mib = 2**20
    strategy = SimpleNamespace(_predicted=[200 * mib, 200 * mib], _budget=215 * mib, root_device=torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"process 1 of the pipeline holds 218.0 MiB at its peak, 9% above the planned "
                                         r"200.0 MiB, over memory_per_device \(215.0 MiB\)"):
        check_peaks(strategy, [{"peak": 201 * mib, "base": mib}, {"peak": 219 * mib, "base": mib}])
    strategy._budget = 230 * mib
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_peaks(strategy, [{"peak": 201 * mib, "base": mib}, {"peak": 219 * mib, "base": mib}])


@pytest.mark.parametrize("value,expected", [("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), ("16GB", 16 * 10**9),
                                            (1000, 1000)])
def test_sizes_are_read(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["8 parsecs", "-1GiB", 0, "lots", True])
def test_a_size_that_is_not_one_is_refused(value):
    with pytest.raises(ValueError, match="memory_per_device must be"):
        parse_bytes(value)


def test_collectives_and_handoffs_are_measured_between_processes_started_for_it():
    """The collectives, FSDP's and tensor parallel's costs, and (the same processes, over a data plane of their own)
    a hand-off's: what the planner's step model takes instead of its defaults."""
    from lightning_pipe.transport.parallel.measured import collective_costs
    from lightning_pipe.transport.wire.measured import handoff_costs

    costs = collective_costs(2, nbytes=1 << 20, repeats=2, extra=handoff_costs, tensor_pairs=[(64, 256, 512)])
    assert set(costs) == {"collective", "collective_bandwidth", "sharded_per_byte", "tensor_action",
                          "tensor_per_byte", "handoff", "bandwidth", "peer_memory"}
    # One machine: the plane through shared memory, whose two rings per peer each process holds; the default the same.
    from lightning_pipe.transport.wire.shm import RING_MEMORY

    assert costs["peer_memory"] == 2 * RING_MEMORY == Costs().peer_memory
    assert all(costs[name] > 0 for name in ("collective", "collective_bandwidth", "handoff", "bandwidth"))
    # One shape: its cost fixed, none per byte; a split pair's two all-reduces cost more than its halves alone.
    assert costs["tensor_per_byte"] == 0.0 and costs["tensor_action"] > 0
    assert costs["handoff"] < 0.05  # a message of a few numbers between two processes of one machine
    made = Costs(**costs)
    assert (made.collective_bandwidth, made.handoff) == (costs["collective_bandwidth"], costs["handoff"])


class Block(nn.Module):
    """A transformer-like block: a feed-forward of 4x the width, layer-normed, on (rows, sequence, width)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def test_the_split_modules_and_the_probes_are_read_from_the_plan_and_the_body():
    """Each layer's split modules are those the plan's names reach (``*`` any layer; not those kept whole), a
    function plan's its Linear layers; the probe stands for the split layer with the longest forward: its first
    split Linear's sizes, on a micro-batch of an eighth and of half the rows, each row the layer's tokens."""
    from lightning_pipe.engine.planning.tensor import PROBE_WEIGHT_BYTES, PROBE_WORK, split_modules, tensor_probes

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 32), Block(), Block(), nn.Linear(32, 8))
    plan = {"1.up": "colwise", "1.down": "rowwise", "*.up": "colwise", "*.norm": "replicate"}
    assert split_modules(module, plan) == [0, 2, 1, 0]
    assert split_modules(module, {"1": "colwise"}) == [0, 1, 0, 0]  # the layer itself
    assert split_modules(module, {"*.*": "colwise"}) == [0, 3, 3, 0]  # each * one name part
    assert split_modules(module, lambda layer, mesh: layer) == [1, 2, 2, 1]
    assert split_modules(module, None) == [0, 0, 0, 0]
    profile = measure_body(module, torch.randn(16, 5, 32), repeats=1)
    assert tensor_probes(module, plan, profile) == [(2 * 5, 32, 128), (8 * 5, 32, 128)]
    assert tensor_probes(module, None, profile) == []
    wide = nn.Sequential(nn.Linear(64, 2 * PROBE_WEIGHT_BYTES // (64 * 4)))
    found = tensor_probes(wide, {"0": "colwise"}, measure_body(wide, torch.randn(4, 64), repeats=1))
    assert found == [(1, 64, PROBE_WEIGHT_BYTES // (64 * 4)), (2, 64, PROBE_WEIGHT_BYTES // (64 * 4))]  # cut
    # Half the rows' product passes PROBE_WORK: its tokens cut to it.
    most = PROBE_WORK // (512 * 2048)
    long = nn.Sequential(Block(512))
    profile = measure_body(long, torch.randn(16, most // 4, 512), repeats=1)  # half the rows: 2 x most
    assert tensor_probes(long, {"0.up": "colwise"}, profile) == [(most // 2, 512, 2048), (most, 512, 2048)]


def test_tensor_parallel_costs_each_split_module_and_action_by_its_inputs_bytes():
    """A layer of two split modules costs twice one's; the cost per byte follows the micro-batch's input bytes,
    once per module, forward and backward, on one stage's every micro-batch."""
    layout = Layout(1, 1, (6,), 2, 1, "NO_SHARD", 4, "gpipe", "never")
    module = body()
    profile = measure_body(module, torch.randn(16, 64), repeats=1)

    def step(modules: list[int], costs: Costs) -> float:
        return predict(layout, profile, batch=16, fixed_global=False, optimizer=ADAM, costs=costs,
                       splittable=lambda lo, hi: profile.total("params", lo, hi), cores=64,
                       split_modules=modules).step  # cores enough: the simulated step, not the work over them

    base = Costs(tensor_action=0.0, tensor_per_byte=0.0)
    none, fixed = step([1] * 6, base), Costs(tensor_action=1e-3, tensor_per_byte=0.0)
    assert step([1] * 6, fixed) - none == pytest.approx(6 * 4 * 2 * 1e-3)
    assert step([2] * 6, fixed) - none == pytest.approx(2 * 6 * 4 * 2 * 1e-3)
    per_byte = Costs(tensor_action=0.0, tensor_per_byte=1e-9)
    assert step([1] * 6, per_byte) - none == pytest.approx(6 * 4 * 2 * 1e-9 * 4 * profile.boundary(0))


def test_the_command_prints_the_table_and_refuses_a_budget_too_small(tmp_path):
    (tmp_path / "plannable.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Model(nn.Module):\n    def __init__(self, width=64):\n"
        "        super().__init__()\n        self.sequential_module = nn.Sequential(*[nn.Linear(width, width) for _ in "
        "range(4)])\n        self.example_input_array = torch.randn(16, width)\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "lightning_pipe", "plan", "plannable:Model", "--devices", "2"]
    ok = subprocess.run([*command, "--memory-per-device", "1GiB", "--init-args", '{"width": 32}'], env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "PipeStrategy(**{'balance'" in ok.stdout and "chosen: the fastest" in ok.stdout
    # A choice of replicas says why PipeStrategy(..., "auto") would choose otherwise (one pipeline per node).
    assert ("replicas 2" in ok.stdout.splitlines()[1]) == ("keeps one pipeline per node" in ok.stdout), ok.stdout
    refused = subprocess.run([*command, "--memory-per-device", "1KiB"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1 and "no layout fits" in refused.stderr


@pytest.mark.parametrize("model,init,says", [
    ("no_such_package.models:Model", "{}", r"MODEL 'no_such_package.models:Model' cannot be found \(ModuleNotFound"),
    ("torch.nn:NoSuchClass", "{}", r"MODEL 'torch.nn:NoSuchClass' cannot be found \(AttributeError"),
    ("torch.nn:Linear", "{in_features: 3}", r"--init-args must be a JSON object of Linear's arguments"),
    ("torch.nn:Linear", '{"in_featres": 3}', r"Linear\(\*\*\{'in_featres': 3\}\) cannot be made: .*in_featres"),
])
def test_the_command_says_in_one_line_what_is_wrong_with_the_model_it_is_given(model, init, says):
    """A class path that does not import or name a class, arguments that are not JSON or not the class's: one line
    that says which, where a traceback came out."""
    done = subprocess.run([sys.executable, "-m", "lightning_pipe", "plan", model, "--init-args", init, "--devices",
                           "2", "--memory-per-device", "1GiB"], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert re.search(says, done.stderr), done.stderr


def test_the_command_plans_a_hugging_face_config():
    """``--hf`` with a config as JSON: the model's body built from it and planned, its blocks a layer each."""
    pytest.importorskip("transformers")
    config = json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 100})
    done = subprocess.run([sys.executable, "-m", "lightning_pipe", "plan", config, "--hf", "--devices", "2",
                           "--memory-per-device", "1GiB", "--rows", "4", "--sequence", "16", "--top", "2"],
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "PipeStrategy(**{'balance'" in done.stdout


def test_auto_everywhere_trains_one_devices_weights_within_the_budget(tmp_path):
    """Every layout argument "auto" with 2 devices: planned before the processes start (the log shows the table), the
    same weights as one device, and every process under the budget it was planned for."""
    plain, auto = tmp_path / "plain.pt", tmp_path / "auto.pt"
    run_script("auto_layout.py", "plain", "1", "0", str(plain), timeout=180)
    result = run_script("auto_layout.py", "auto", "2", "512MiB", str(auto), timeout=240, env=WARNINGS_SHOWN)
    assert "the layout planned for Body" in result.stdout + result.stderr
    # Each process's peak counts from its session on: not the planner's own measurements in the launching process.
    assert "above the planned" not in result.stdout + result.stderr
    chosen = json.loads((tmp_path / "auto.pt.json").read_text())
    assert len(chosen["balance"]) == 2 and chosen["replicas"] == 1
    assert all(held <= chosen["budget"] for held in chosen["held"])
    want, got = torch.load(plain), torch.load(auto)
    assert sorted(want) == sorted(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)


def test_under_torchrun_auto_is_planned_once_the_processes_have_met(tmp_path):
    """torchrun starts every process before any plan: the first driver plans as the Trainer's setup builds the
    pipeline (the table logged), the same weights as one device, every process within its budget and its plan."""
    import os

    from dist_utils import free_port
    from strategy_utils import SCRIPTS, run_together

    plain, auto = tmp_path / "plain.pt", tmp_path / "auto.pt"
    run_script("auto_layout.py", "plain", "1", "0", str(plain), timeout=180)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run_together([([torchrun, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                    str(SCRIPTS / "auto_layout.py"), "auto-t1", "2", "512MiB", str(auto)], WARNINGS_SHOWN)],
                 tmp_path, timeout=300)
    log = (tmp_path / "launch0.log").read_text()
    assert "the layout planned for Body" in log and "above the planned" not in log
    chosen = json.loads((tmp_path / "auto.pt.json").read_text())
    assert len(chosen["balance"]) in (2, 4) and chosen["predicted"]
    assert all(0 < held <= chosen["budget"] for held in chosen["held"])
    want, got = torch.load(plain), torch.load(auto)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)


def test_under_torchrun_or_slurm_the_tensor_size_cannot_be_left_to_the_plan():
    """Processes started by another launcher hold their roles before any plan: tensor_parallel_size="auto" is refused
    there saying what to do; the other arguments wait for the Trainer's setup."""
    from types import SimpleNamespace

    from lightning_pipe.lightning import planned

    outside = SimpleNamespace(creates_processes_externally=True)
    strategy = SimpleNamespace(_auto=("balance", "tensor_parallel_size"), cluster_environment=outside)
    with pytest.raises(ValueError, match=r"torchrun, SLURM.*tensor_parallel_size.*python -m lightning_pipe plan"):
        planned.resolve(strategy, nn.Linear(1, 1), None)
    strategy = SimpleNamespace(_auto=("balance", "schedule"), cluster_environment=outside)
    planned.resolve(strategy, nn.Linear(1, 1), None)
    assert strategy._plan_after_launch and not getattr(strategy, "_planned", False)


def test_a_plan_with_the_tensor_size_left_to_the_layouts_plan_is_taken():
    """``tensor_parallel_size="auto"`` with a plan: the plan may split the stages or not, so its placeholder size of
    1 does not refuse the plan; the plan is still checked as for a split, and a size of 1 given refuses it."""
    from lightning_pipe import PipeStrategy

    plan = {"*.up": "colwise", "*.down": "rowwise"}
    strategy = PipeStrategy(balance="auto", tensor_parallel_size="auto", tensor_parallel_plan=plan,
                            memory_per_device="1GiB")
    assert "tensor_parallel_size" in strategy._auto and strategy.tensor_parallel_plan == plan
    with pytest.raises(ValueError, match="tensor_parallel_size='auto' is not supported"):
        PipeStrategy(balance="auto", tensor_parallel_size="auto", tensor_parallel_plan=plan,
                     sharding_strategy="HYBRID_SHARD", memory_per_device="1GiB")
    with pytest.raises(ValueError, match="tensor_parallel_size=1, which splits nothing"):
        PipeStrategy(balance="auto", tensor_parallel_size=1, tensor_parallel_plan=plan, memory_per_device="1GiB")


def test_fabric_refuses_auto_tensor_parallel_size_saying_how_to_plan():
    """Fabric starts its processes before any model exists, and the tensor size decides their roles there."""
    from lightning_pipe.lightning.fabric.strategy import PipeStrategy

    with pytest.raises(ValueError, match=r"fabric.launch\(\).*tensor_parallel_size.*plan_layout"):
        PipeStrategy(balance="auto", tensor_parallel_size="auto", memory_per_device="1GiB")
    PipeStrategy(balance="auto", microbatches="auto", schedule="auto", checkpoint="auto", sharding_strategy="auto",
                 memory_per_device="1GiB")  # the rest is planned as fabric.setup builds the pipeline


def test_auto_in_a_fabric_loop_is_planned_as_setup_builds_the_pipeline(tmp_path):
    """A Fabric loop with the layout left to "auto" (the loss on the last stage, AdamW): planned by the driver as
    ``fabric.setup`` builds the pipeline, the table logged, one device's weights, and each process under its budget
    and within the plan (no "above the planned" warning after two steps); and with the schedule given as ZBV (two
    stages per process in a V, the processes launched before the plan) the rest planned around it, the same."""
    import lightning as L
    from scripts import fabric_loop

    auto = {"balance": "auto", "microbatches": "auto", "schedule": "auto", "checkpoint": "auto", "sharding": "auto",
            "memory_per_device": "512MiB", "last_stage_loss": True, "optimizer": "adamw", "epochs": 2}
    cases = {"auto": auto, "zbv": {**auto, "schedule": "zbv", "virtual_stages": None}}
    result = run_script("fabric_loop.py", json.dumps({"cases": cases, "devices": 2}), str(tmp_path),
                        timeout=300, env=WARNINGS_SHOWN)
    assert result.stdout.count("the layout planned for FabricModel") + \
        result.stderr.count("the layout planned for FabricModel") == 2
    assert "above the planned" not in result.stdout + result.stderr
    fabric = L.Fabric(accelerator="cpu", devices=1)
    planned = ("balance", "microbatches", "schedule", "checkpoint", "sharding")
    plain = {k: v for k, v in auto.items() if k not in planned}
    fabric_loop.run(fabric, plain, str(tmp_path / "plain"))
    want = torch.load(tmp_path / "plain" / "final.pt", weights_only=True)
    for name, stages in (("auto", (2, 4)), ("zbv", (4,))):
        chosen = json.loads((tmp_path / name / "result.json").read_text())
        layout = chosen["layout"]
        assert len(layout["balance"]) in stages and sum(layout["balance"]) == 5 and layout["predicted"], layout
        assert name == "auto" or layout["schedule"] == "zbv"
        assert all(0 < held <= 512 * 2**20 for held in chosen["held"]), chosen["held"]
        got = torch.load(tmp_path / name / "final.pt", weights_only=True)
        for key, value in want["model"].items():
            torch.testing.assert_close(got["model"][key], value, rtol=1e-4, atol=2e-5)
        assert got["step"] == want["step"] == 16


def test_auto_arguments_parse_from_a_lightning_cli_config():
    import yaml
    from jsonargparse import ArgumentParser

    from lightning_pipe import PipeStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(PipeStrategy, "strategy")
    config = parser.parse_string(yaml.safe_dump({"strategy": {
        "balance": "auto", "microbatches": "auto", "schedule": "auto", "checkpoint": "auto",
        "tensor_parallel_size": "auto", "sharding_strategy": "auto", "memory_per_device": "2GiB"}}))
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    strategy = instantiate(config).strategy
    assert set(strategy._auto) == {"balance", "microbatches", "schedule", "checkpoint", "tensor_parallel_size",
                                   "sharding_strategy"}
    assert strategy.memory_per_device == 2 * 2**30


def test_the_split_backward_is_measured_where_the_engine_splits_it():
    """Zero-bubble schedules run a backward in two (input gradients, then the parameters'), which costs more than the
    whole one (two autograd calls): measured per micro-batch size on the body's later layers; the first stage's is
    whole where nothing goes upstream, and a body the engine does not split (BatchNorm's running statistics) is
    measured as whole."""
    body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    profile = measure_body(body, torch.randn(32, 64), repeats=2)
    assert all(inputs > 0 and weights > 0 for _, _, _, inputs, weights in profile.chain)
    assert profile.time("weights", 0, 2, 8) == 0.0
    assert profile.time("inputs", 0, 2, 8) == profile.time("backward", 0, 2, 8)
    assert 0 < profile.time("weights", 1, 3, 8) and 0 < profile.time("inputs", 1, 3, 8)
    frozen = measure_body(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64)),
                          torch.randn(64, 64), repeats=2)
    assert all((inputs, weights) == (1.0, 0.0) for _, _, _, inputs, weights in frozen.chain)


class OwnLayer(nn.Module):
    """A layer of the user's own: the engine cannot know that its backward may run in two."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def test_a_micro_batch_is_held_until_its_weight_gradients_only_where_the_engine_splits_its_backward():
    """Zero-bubble keeps a micro-batch's graph from its input gradients (I) to its parameters' (W) where the stage
    splits its backward; where it cannot (a layer of the user's own, ``twice_safe`` False), each I is a whole backward
    that frees the micro-batch, so the last process holds one at a time, as under 1F1B, and W costs nothing."""
    from lightning_pipe.engine.backward_split import twice_safe

    def activations(make: type[nn.Module] | None, schedule: str) -> tuple[list[float], object]:
        torch.manual_seed(0)
        layers = [make() if make else nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)]
        profile = measure_body(nn.Sequential(*layers), torch.randn(16, 64), repeats=1)
        prediction = predict(Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 8, schedule, "never"), profile, batch=16,
                             fixed_global=False, optimizer=ADAM, costs=Costs(), splittable=lambda lo, hi: 0.0,
                             cores=2)
        return [m.activations for m in prediction.memory], profile

    assert not twice_safe(OwnLayer()) and twice_safe(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    split_zb, split = activations(None, "zero-bubble")
    split_1f1b, _ = activations(None, "1f1b")
    assert split.splits(3, 6) and split_zb[1] == pytest.approx(2 * split_1f1b[1])  # one more micro-batch, awaiting W
    own_zb, own = activations(OwnLayer, "zero-bubble")
    own_1f1b, _ = activations(OwnLayer, "1f1b")
    assert not own.splits(3, 6) and own_zb == pytest.approx(own_1f1b)
    assert own.time("weights", 3, 6, 2) == 0.0 and own.time("inputs", 3, 6, 2) == own.time("backward", 3, 6, 2)


def test_a_recomputed_micro_batch_keeps_its_rebuilt_graph_until_its_weight_gradients():
    """Recomputed in its I, a micro-batch's graph serves its W too: where the stage splits its backward, what was
    rebuilt is held until the W, and zero-bubble's last process then holds two rebuilt micro-batches at once (the
    one awaiting its W, the one in its I); where it cannot split, one."""
    from lightning_pipe.engine.planning.memory import activation_peak
    from lightning_pipe.engine.schedule import schedule_plan, simulate

    plan = schedule_plan("zero-bubble", 4, 2, 1)
    times = simulate(plan, {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}).times
    for split, rebuilt in ((True, 2.0), (False, 1.0)):
        peak = activation_peak(plan, times, 1, lambda s, i: 0.0, lambda s, i: 1.0,
                               split=lambda s, split=split: split)
        assert peak == rebuilt


def test_the_loss_on_the_last_stage_adds_its_gradient_to_the_backward():
    """The last stage's backward starts from the loss's own: one more tensor as large as the body's output in flight
    there (a cross-entropy's gradient of its log-softmax beside the logits'), not on the other stages."""
    bare = OptimizerModel(0.0, False)  # no optimizer step: the backward's moment is the transient
    layout = Layout(2, 1, (3, 3), 1, 1, "NO_SHARD", 4, "1f1b", "never")
    there, profile = predicted(layout, bare, aside=True)
    elsewhere, _ = predicted(layout, bare, aside=False)
    rows = 16 / 4
    assert there.memory[1].transient - elsewhere.memory[1].transient == pytest.approx(profile.boundary(6) * rows)
    assert there.memory[0].transient == elsewhere.memory[0].transient


def test_a_later_trainer_asking_for_another_plan_than_the_one_its_processes_run_is_refused(monkeypatch):
    """The launching process keeps the first Trainer's plan for the processes it starts (they run the program again);
    a later Trainer of the same model class took that plan whatever it asked (a budget of 1 KiB was accepted with the
    first plan's layout). Asking for the same, it takes it; asking for another, refused, naming the layout to pass."""
    from types import SimpleNamespace

    from lightning_pipe.lightning.planned import LAYOUT_ENV, resolve

    class Net(nn.Module):
        pass

    handed = {"balance": [3, 3], "microbatches": 1, "virtual_stages": 1, "_peaks": [1, 1], "_budget": 2**30,
              "_for": Net.__qualname__, "_given": {"auto": ["balance", "microbatches"], "memory_per_device": 2**30}}
    monkeypatch.setenv(LAYOUT_ENV, json.dumps(handed))

    def strategy(budget):
        return SimpleNamespace(_auto=("microbatches", "balance"), memory_per_device=budget, balance=None,
                               microbatches=8, virtual_stages=None, _given_virtual_stages=None,
                               cluster_environment=None)

    same = strategy(2**30)
    resolve(same, Net(), None)
    assert (same.balance, same.microbatches, same._planned) == ([3, 3], 1, True)
    with pytest.raises(ValueError, match=r"planned the layout of Net for a first Trainer .*a later Trainer of the same "
                                         r"program .* asks for another .*memory_per_device': 1024.*"
                                         r"\{'balance': \[3, 3\], 'microbatches': 1\}"):
        resolve(strategy(1024), Net(), None)


def test_where_the_loss_is_computed_is_read_from_the_calls_not_the_words():
    """schedule='auto' considers the schedules that need the loss on the last stage where training_step calls
    loss_on_last_stage (or pipeline_loss): a comment or a string naming it is not a call (it let the planner choose
    1F1B for a loss computed on the driver, refused once the processes had started)."""
    from lightning_pipe.lightning.planned import calls_loss_on_last_stage

    assert calls_loss_on_last_stage("def step(self, b):\n    return loss_on_last_stage(self.body, *b, mse)\n")
    assert calls_loss_on_last_stage("    def step(self, b):\n        return self.body.pipeline_loss(*b, mse)\n")
    assert not calls_loss_on_last_stage("def step(self, b):\n    # not loss_on_last_stage here\n"
                                        "    return mse(self(b[0]), b[1])  # 'pipeline_loss'\n")


def test_arguments_given_beside_auto_are_checked_against_what_the_plan_may_choose_not_a_placeholder():
    """schedule='auto' with virtual_stages=2 was refused as "schedule='gpipe' runs one stage per process", a value
    never given: taken (the plan chooses among the schedules of 2 stages per process). hybrid_shard_size with
    sharding_strategy='auto' named 'NO_SHARD': refused, saying why (the plan may choose another sharding)."""
    from lightning_pipe import PipeStrategy

    strategy = PipeStrategy(schedule="auto", virtual_stages=2, memory_per_device="1GiB")
    assert strategy.virtual_stages == 2 and strategy._auto == ("schedule",)
    with pytest.raises(ValueError, match=r"hybrid_shard_size=2 sets HYBRID_SHARD's shard groups, and "
                                         r"sharding_strategy='auto' may choose another"):
        PipeStrategy(sharding_strategy="auto", hybrid_shard_size=2, memory_per_device="1GiB")


def test_a_fixed_sharding_with_the_layout_left_to_auto_on_one_node_says_why_it_cannot_be():
    """'auto' keeps one pipeline per node: on one node no stage has a replica to shard over. Said before anything is
    measured (the refusal was "no layout ...: give fewer devices, more layers or rows", which could not help)."""
    from types import SimpleNamespace

    from lightning_pipe.lightning.planned import plan

    class Net(nn.Module):
        example_input_array = torch.randn(8, 16)

    strategy = SimpleNamespace(_auto=("balance",), sharding_strategy="FULL_SHARD", num_nodes=1, num_processes=4,
                               module_name="sequential_module")
    with pytest.raises(ValueError, match=r"sharding_strategy='FULL_SHARD'\) shards each stage over its replicas, and "
                                         r"the layout left to 'auto' \(balance\) has one pipeline per node.*no stage "
                                         r"has a replica to shard over"):
        plan(strategy, Net(), "32-true", None, False)


def test_the_example_is_taken_in_the_models_dtype_as_a_precision_converts_a_batch():
    """``balance=None`` under ``precision="64-true"``: Lightning converts the model to float64 and each batch with it,
    but the float32 ``example_input_array`` reached the model's forward as it was and the inferred balance failed
    with torch's "mat1 and mat2 must have the same dtype". The body's input is now taken in the model's dtype, through
    the model's forward or without one; integer inputs (token ids) stay as they are."""
    from lightning_pipe.engine.planning import body_and_input

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sequential_module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.sequential_module(x + ids.unsqueeze(1))

    model = Model().double()
    body, sample = body_and_input(model, (torch.randn(3, 4), torch.arange(3)), "sequential_module")
    assert body is model.sequential_module and sample.dtype == torch.float64
    bare = nn.Sequential(nn.Linear(4, 4)).double()
    _, (x, ids) = body_and_input(bare, (torch.randn(3, 4), torch.arange(3)), "sequential_module")
    assert x.dtype == torch.float64 and ids.dtype == torch.int64
