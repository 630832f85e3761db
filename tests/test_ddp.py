"""Replicas averaged by torch's DistributedDataParallel: Lightning's DDP arguments and comm hooks honoured.

2 replicas x 2 stages train in the shared job "4 processes DDP" (tests/jobs.py) and end with the plain model's
weights; comm hooks run in every process holding parameters, once per optimizer step (never while accumulating);
buffers follow replica 0's as under Lightning's DDPStrategy; misspelt or meaningless arguments are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jobs import GROUPS
from jobs import config as case_config
from scripts import train as script
from strategy_utils import assert_same_weights, run_script
from test_strategy import load, plain_weights

from lightning_pipe import PipeStrategy

GRID = [name for name in GROUPS["4 processes DDP"] if name.endswith(("-no-hook", "-record"))]


def hook_calls(out: Path) -> dict[str, list[tuple[int, int, int]]]:
    """What the recording comm hook wrote, per process: (bucket index, last bucket of a reduction, elements)."""
    return {path.stem: [tuple(int(v) for v in line.split()) for line in path.read_text().splitlines()]
            for path in sorted((out / "hooks").glob("*.log"))}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", GRID)
def test_replicas_averaged_by_ddp_train_the_plain_models_weights(name, jobs, tmp_path):
    """Every checkpoint mode, GPipe and 1F1B, no hook or a hook that records its calls and all-reduces: the
    weights of one device with the global batch. The hook runs in all 4 processes (each holds parameters), on
    each DDP once per optimizer step: with accumulation, the backwards under no_sync reduce nothing."""
    config = case_config(name)
    out = jobs.directory(name)
    assert_same_weights(load(out / "final.ckpt"), plain_weights(config, tmp_path / "plain"))
    steps = jobs.result(name)["global_step"]
    assert steps == 4
    calls = hook_calls(out)
    if config["hook"] is None:
        assert calls == {}
        return
    assert len(calls) == 4, calls.keys()  # every process: 2 stages x 2 replicas
    # One DDP per stage; under GPipe the drivers' head (outside the body) has its own, as DDPStrategy wraps it.
    reductions = {pid: sum(last for _, last, _ in c) for pid, c in calls.items()}
    ddps = 4 + (2 if config.get("schedule", "gpipe") == "gpipe" else 0)
    assert sum(reductions.values()) == steps * ddps, reductions
    assert all(r in (steps, 2 * steps) for r in reductions.values()), reductions
    assert {index for c in calls.values() for index, _, _ in c} == {0}  # default bucket_cap_mb: one bucket


def largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two models' weights."""
    return max((a[k] - b[k]).abs().max().item() for k in b)


def compression_gap(name: str, schedule: str, jobs, tmp_path) -> tuple[float, float, float]:  # noqa: ANN001
    """Case ``name``'s gap to the plain model's weights, how far training moved them, and the gap of its twin
    without a hook (float32 alone)."""
    config = case_config(name)
    plain = plain_weights(config, tmp_path / "plain")
    moved = largest(plain, script.Model(config).state_dict())  # the seed makes the same initial weights
    gap = largest(load(jobs.directory(name) / "final.ckpt"), plain)
    float32 = largest(load(jobs.directory(f"ddp-{schedule}-except_last-no-hook") / "final.ckpt"), plain)
    return gap, moved, float32


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bf16_compression_hook_trains_within_bf16s_precision(schedule, jobs, tmp_path):
    """torch's bf16_compress_hook: the gradients travel as bfloat16 (8 significant bits: 2^-8 per rounding), so
    the weights differ from the plain model's far more than without the hook (float32 alone) and within 2^-7 of
    how far training moved them (measured ~1e-3 of it). The former bound, rtol 2e-2 / atol 2e-3, allowed 50-70%
    of an update."""
    gap, moved, float32 = compression_gap(f"ddp-{schedule}-bf16", schedule, jobs, tmp_path)
    assert gap > 100 * float32, (gap, float32)
    assert 2**-14 * moved < gap <= 2**-7 * moved, (gap, moved)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fp16_compression_runs_in_every_process_and_trains_within_fp16s_rounding(schedule, jobs, tmp_path):
    """Issue 31 reported ``ddp_comm_hook=default_hooks.fp16_compress_hook`` (no state) on 2 replicas x 2 stages
    running on one replica only, its job dying in the first backward with gloo's "Received data size doesn't
    match expected size (144 vs 72)": one replica's float32 buckets met the other's float16 ones. Each process
    records the hook's calls (a ddp_comm_wrapper around torch's own hook): all 4 run it, on each of their DDPs
    once per step. The weights differ from the plain model's by fp16's rounding of the averaged gradients: far
    more than the same run without the hook (float32 alone, ~1e-7 of how far training moved them), and within
    2^-10 of that distance (fp16 keeps 11 significant bits: 2^-11 per rounding; measured ~1.2e-4)."""
    name = f"ddp-{schedule}-fp16"
    out = jobs.directory(name)
    steps = jobs.result(name)["global_step"]
    calls = hook_calls(out)
    assert len(calls) == 4, calls.keys()  # every process: 2 stages x 2 replicas
    reductions = {pid: sum(last for _, last, _ in c) for pid, c in calls.items()}
    ddps = 4 + (2 if schedule == "gpipe" else 0)  # under GPipe, the drivers' head has a DDP of its own
    assert sum(reductions.values()) == steps * ddps, reductions
    assert all(r in (steps, 2 * steps) for r in reductions.values()), reductions
    gap, moved, float32 = compression_gap(name, schedule, jobs, tmp_path)
    assert gap > 100 * float32, (gap, float32)
    assert 2**-16 * moved < gap <= 2**-10 * moved, (gap, moved)


@pytest.mark.timeout(900)
def test_static_graph_trains_the_plain_models_weights(jobs, tmp_path):
    """static_graph: the reducer is prepared at the step's first backward and counts every micro-batch's
    gradient hooks, reducing each parameter at its last."""
    name = "ddp-static-graph"
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain_weights(case_config(name), tmp_path / "plain"))


def test_powersgd_over_gloo_is_refused_before_training_with_what_to_use():
    """torch's PowerSGD hooks block on an all-reduce inside another's callback: over gloo a stage's replicas
    can deadlock, so they are refused there (the check runs as fitting starts, before any DDP is built)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from lightning_pipe.lightning import ddp

    for hook in (powersgd.powerSGD_hook, powersgd.batched_powerSGD_hook):
        with pytest.raises(ValueError, match=rf"ddp_comm_hook={hook.__name__} cannot run over gloo .*bf16_compress"):
            ddp.check_backend(hook, "gloo")
        ddp.check_backend(hook, "nccl")  # GPUs: as Lightning's docs teach
    ddp.check_backend(default_hooks.bf16_compress_hook, "gloo")


@pytest.mark.timeout(900)
def test_configure_ddp_of_one_stage_and_small_buckets(jobs, tmp_path):
    """A subclass's configure_ddp registers a recording hook on stage 1's DDP alone: it runs in stage 1's
    process of each replica and nowhere else. bucket_cap_mb=0.001 splits stage 1's gradients into several
    buckets (one per layer; the default 25 MiB holds a stage's whole gradients in one, as the recording grid's
    cases show); gradient_as_bucket_view keeps the weights exact."""
    name = "ddp-stage-1-hook-small-buckets"
    out = jobs.directory(name)
    assert_same_weights(load(out / "final.ckpt"), plain_weights(case_config(name), tmp_path / "plain"))
    calls = hook_calls(out)
    assert len(calls) == 2, calls.keys()
    steps = jobs.result(name)["global_step"]
    for c in calls.values():
        assert sum(last for _, last, _ in c) == steps
        assert {index for index, _, _ in c} == {0, 1}  # two buckets: bucket_cap_mb reached the DDP
        assert max(n for _, _, n in c) * 4 <= 2 * 1024  # none much above 0.001 MiB (one tensor may exceed it)


def assert_gated_as_on_one_device(name: str, jobs, tmp_path) -> None:  # noqa: ANN001
    """Case ``name`` (train.py's RareGate: ``rare`` used by 2 of 64 samples, ``never`` by none) trained one
    device's weights; ``never`` kept no gradient (AdamW's weight decay left it as it was), ``rare`` trained."""
    piped = load(jobs.directory(name) / "final.ckpt")
    assert_same_weights(piped, plain_weights(case_config(name), tmp_path / "plain"))
    never = next(v for k, v in piped.items() if k.endswith(".never"))
    rare = next(v for k, v in piped.items() if k.endswith(".rare"))
    assert torch.equal(never, torch.full_like(never, 0.2))
    assert not torch.allclose(rare, torch.full_like(rare, 0.1))


@pytest.mark.timeout(900)
def test_parameters_unused_on_some_replicas_or_on_all(jobs, tmp_path):
    """A parameter used only by a few samples (some replicas, some steps) is averaged with zero where unused;
    one used nowhere keeps no gradient (AdamW's weight decay leaves it as it was), as on one device."""
    assert_gated_as_on_one_device("ddp-unused-parameters", jobs, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_unused_on_one_replica_joins_the_others_reduction(schedule, jobs, tmp_path):
    """A stage whose every parameter goes unused on one replica's batch (a gate used by 2 of 64 samples, alone in
    stage 0) ran no backward there, and its reduction left the other replica waiting until the step timed out.
    It joins with zeros, as a DDP rank does for an unused parameter: one device's weights; the parameter no
    replica uses keeps no gradient (AdamW's weight decay leaves it as it was)."""
    assert_gated_as_on_one_device(f"ddp-idle-stage-{schedule}", jobs, tmp_path)


@pytest.mark.timeout(900)
def test_batchnorm_buffers_follow_replica_0_as_under_lightnings_ddp(jobs, tmp_path):
    """BatchNorm in both stages, one micro-batch: every replica's weights and buffers (running statistics) equal
    those Lightning's DDPStrategy gives the same replica of the plain model, with broadcast_buffers (replica 1
    starts each step from replica 0's statistics) and without (each replica keeps its own)."""
    names = {"broadcast": "ddp-batchnorm-broadcast", "no-broadcast": "ddp-batchnorm-no-broadcast"}
    cases = {key: {**case_config(name), "devices": 2, "balance": None, "strategy": "ddp"}
             for key, name in names.items()}
    run_script("train.py", json.dumps({"cases": cases}), str(tmp_path), timeout=300)
    states = {}
    for key, name in names.items():
        for r in (0, 1):
            piped = torch.load(jobs.directory(name) / f"state_replica{r}.pt", weights_only=True)
            ddp = torch.load(tmp_path / key / f"state_replica{r}.pt", weights_only=True)
            assert any("running_mean" in k for k in ddp)
            assert_same_weights(piped, ddp)
            states[key, r] = piped
    stats = [k for k in states["broadcast", 1] if "running_mean" in k]
    # The argument did something: without broadcasting, replica 1's statistics are its own batches' alone.
    assert any(not torch.allclose(states["broadcast", 1][k], states["no-broadcast", 1][k]) for k in stats)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"bucket_cap": 25}, TypeError, r"unexpected keyword argument 'bucket_cap' \(did you mean 'bucket_cap_mb'\?\)"),
    ({"find_unused_parameter": True}, TypeError, r"'find_unused_parameter' \(did you mean 'find_unused_parameters'"),
    ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb must be a positive number of MiB \(got: 0\)"),
    ({"static_graph": "yes"}, ValueError, r"static_graph must be True or False \(got: 'yes'\)"),
    ({"broadcast_buffers": 1}, ValueError, r"broadcast_buffers must be True, False or None \(got: 1\)"),
    ({"dim": 1}, ValueError, r"does not take DistributedDataParallel's dim=1"),
    ({"device_ids": [0]}, ValueError, r"does not take DistributedDataParallel's device_ids=\[0\]"),
    ({"model_averaging_period": 4}, ValueError, r"does not support post-local SGD .*model_averaging_period: 4"),
    ({"ddp_comm_state": object()}, ValueError, r"ddp_comm_state was given without ddp_comm_hook"),
    ({"ddp_comm_hook": lambda state, bucket: None}, ValueError, r"ddp_comm_hook cannot be sent to the processes"),
])
def test_ddp_arguments_that_would_not_do_what_they_say_are_refused(kwargs, error, message):
    """Refused as the strategy is built, before any process starts, naming the argument and its value."""
    with pytest.raises(error, match=message):
        PipeStrategy(balance=[2, 2], **kwargs)


def test_ddp_defaults_as_lightningcli_passes_them_are_accepted():
    """LightningCLI passes every DistributedDataParallel keyword at its default: those the strategy sets itself
    (process_group, dim, ...) are accepted at their defaults, and then nothing counts as given explicitly."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    every = {n: p.default for n, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()
             if n not in ("self", "module")}
    assert PipeStrategy(balance=[2, 2], **every)._ddp_explicit == []


def test_every_ddp_argument_reaches_the_stages_ddp():
    """configure_ddp's default builds a DDP with each argument given (here over a group of one process)."""
    import torch.distributed as dist
    from dist_utils import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        strategy = PipeStrategy(balance=[1, 1], bucket_cap_mb=3, broadcast_buffers=False, static_graph=True,
                                gradient_as_bucket_view=True)
        module = torch.nn.Sequential(torch.nn.Linear(4, 4))
        ddp = strategy.configure_ddp(module, None, dist.group.WORLD, 1)
        assert ddp.module is module and ddp.bucket_bytes_cap == 3 * 1024 * 1024
        assert not ddp.broadcast_buffers and ddp.static_graph and ddp.gradient_as_bucket_view
        assert not ddp.find_unused_parameters  # PipeStrategy's default, unless static_graph says otherwise
        ddp = PipeStrategy(balance=[1, 1]).configure_ddp(torch.nn.Linear(2, 2), None, dist.group.WORLD, 0)
        assert ddp.find_unused_parameters and ddp.broadcast_buffers
    finally:
        dist.destroy_process_group()


def test_static_graph_with_accumulation_is_refused_before_training():
    """torch's reducer fails on no_sync's backwards under a static graph (under Lightning's DDPStrategy too):
    refused, saying what to do instead."""
    import pytorch_lightning as pl

    trainer = pl.Trainer(accelerator="cpu", devices=2, accumulate_grad_batches=2, logger=False,
                         strategy=PipeStrategy(balance=[2, 2], static_graph=True))
    message = r"static_graph=True cannot be combined with Trainer\(accumulate_grad_batches=2\)"
    with pytest.raises(ValueError, match=message):
        trainer.strategy.check_settings(trainer)
    trainer = pl.Trainer(accelerator="cpu", devices=2, logger=False,
                         strategy=PipeStrategy(balance=[2, 2], static_graph=True))
    trainer.strategy.check_settings(trainer)  # without accumulation, accepted
