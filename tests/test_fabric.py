"""``PipeStrategy`` under Lightning Fabric: a loop written as Fabric's docs write it trains through the pipeline to
the weights of the same loop on one device, in both of Lightning's packages.

Each job launches its processes once and runs its cases one after another (tests/scripts/fabric_loop.py): every
case is its own Fabric and pipeline, the stage workers serving them all. The reference is the same loop, run in
this process by a Fabric on one device with the global batch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from filelock import FileLock
from jobs import config as case_config
from scripts import fabric_loop
from strategy_utils import assert_same_weights, run_script

import lightning_pipe

# Each job: its processes and its cases (changes from fabric_loop.DEFAULTS: 2 stages [3, 2], 4 micro-batches,
# GPipe, SGD with momentum, 8 steps of 8 samples).
JOBS: dict[str, dict[str, Any]] = {
    # Forked where the script reaches fabric.launch() (start_method='fork'): no second import, the same training;
    # the standalone package's job below starts its process as a script (Fabric's launcher, as its users run it).
    "2 processes": {"devices": 2, "start_method": "fork", "cases": {
        "sgd-clip-scheduler": {"clip": 0.05, "scheduler": "step", "own_state": True},
        "adamw-1f1b-accumulate-clip": {"optimizer": "adamw", "schedule": "1f1b", "last_stage_loss": True,
                                       "accumulate": 2, "clip": 0.1},
        "zero-bubble-clip-value": {"schedule": "zero-bubble", "last_stage_loss": True, "clip_value": 0.01},
        "head-outside-launch-fn": {"model": "module", "launch_fn": True, "balance": [2, 3], "optimizer": "adamw",
                                   "own_state": True},
        "bf16-mixed": {"precision": "bf16-mixed", "microbatches": 1},
        "bf16-true": {"precision": "bf16-true", "microbatches": 1},
        "64-true": {"precision": "64-true"},
        # The loss on the last stage of the bare nn.Sequential given to fabric.setup: the input converted and the
        # output cast to float32 before the loss, as Fabric's module does on one device (the loss was the raw float64
        # output's, 2e-6 off after 6 steps; under bf16-true a float32 input failed at the first forward).
        "64-true-1f1b-last-stage": {"precision": "64-true", "schedule": "1f1b", "last_stage_loss": True,
                                    "optimizer": "adamw"},
        "bf16-true-1f1b-last-stage": {"precision": "bf16-true", "microbatches": 1, "schedule": "1f1b",
                                      "last_stage_loss": True},
        "16-true": {"precision": "16-true", "microbatches": 1},
        # A CheckpointIO of the user's takes the whole checkpoint (nothing streamed), and fabric.save's filter keeps
        # the module's weights alone: the remote stages' were written as their placeholders (meta tensors).
        "custom-checkpoint-io-filter": {"checkpoint_io": "custom", "save_filter": True},
        "interleaved-1f1b": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "last_stage_loss": True,
                             "balance": [1, 1, 1, 2], "optimizer": "adamw", "clip": 0.1},
        # fp16 with a gradient scaler (GPUs' 16-mixed, here on CPU): every stage unscaled before clipping, steps
        # taken and the scale moved as on one device (one micro-batch: fp16 rounds smaller products otherwise).
        "fp16-scaler-clip": {"precision": "16-mixed-scaler", "microbatches": 1, "clip": 0.5, "optimizer": "adamw"},
        "init-module": {"build": "init_module", "optimizer": "adamw", "own_state": True},
        # A second program's loop: the first case's file loaded (model, optimizer, scheduler, step), at another
        # balance, then one more epoch.
        "load-other-balance": {"clip": 0.05, "scheduler": "step", "balance": [1, 4],
                               "load": "sgd-clip-scheduler/final.pt"},
        # The same as a sharded directory (each process writes its entries), loaded by a second program at another
        # balance, which saves one file.
        "sharded-save": {"clip": 0.05, "scheduler": "step", "state_dict_type": "sharded"},
        "sharded-load-other-balance": {"clip": 0.05, "scheduler": "step", "balance": [1, 4],
                                       "load": "sharded-save/final.pt"},
        # The first case's own files (torch.save of model.state_dict() and optimizer.state_dict()) loaded by the
        # module's and optimizer's own load_state_dict, at another balance.
        "own-state-load-other-balance": {"clip": 0.05, "balance": [1, 4], "load_own": "sgd-clip-scheduler"},
        # The V shapes: 2 stages per process, the first and the last in the driver's (the loss computed there).
        "zbv-adamw-clip": {"schedule": "zbv", "virtual_stages": 2, "last_stage_loss": True, "balance": [1, 1, 1, 2],
                           "optimizer": "adamw", "clip": 0.1},
        "dualpipev-adamw-clip": {"schedule": "dualpipev", "virtual_stages": 2, "last_stage_loss": True,
                                 "balance": [1, 1, 1, 2], "optimizer": "adamw", "clip": 0.1},
        # LitGPT's GPT as a body (to_sequential), in LitGPT's fine-tuning shape: against the plain GPT
        # (test_litgpts_gpt_through_a_fabric_loop_trains_the_plain_gpts_weights).
        "litgpt-1f1b-adamw-clip": {"model": "litgpt", "balance": [3, 3], "schedule": "1f1b", "last_stage_loss": True,
                                   "optimizer": "adamw", "clip": 0.5, "samples": 32, "own_state": True},
    }},
    # Forked where the script reaches fabric.launch() (start_method='fork'): no second import, the same training.
    "4 processes": {"devices": 4, "start_method": "fork", "cases": {
        "2replicas-adamw-1f1b-accumulate-clip": {"optimizer": "adamw", "schedule": "1f1b", "last_stage_loss": True,
                                                 "accumulate": 2, "clip": 0.1, "batch_size": 4, "collectives": True,
                                                 "own_state": True},
        "2replicas-sgd-head-outside": {"model": "module", "balance": [2, 3], "batch_size": 4, "clip": 0.05},
        "2replicas-zbv": {"schedule": "zbv", "virtual_stages": 2, "last_stage_loss": True, "balance": [1, 1, 1, 2],
                          "optimizer": "adamw", "clip": 0.1, "batch_size": 4},
        "2replicas-dualpipev": {"schedule": "dualpipev", "virtual_stages": 2, "last_stage_loss": True,
                                "balance": [1, 1, 1, 2], "optimizer": "adamw", "clip": 0.1, "batch_size": 4},
        # The 2-process job's checkpoint, loaded by two replicas.
        "2replicas-load": {"clip": 0.05, "scheduler": "step", "batch_size": 4,
                           "load": "../2-processes/sgd-clip-scheduler/final.pt"},
        # The 2-process job's own files, read by fabric.load_raw into the module and into the optimizer.
        "2replicas-load-raw": {"clip": 0.05, "batch_size": 4, "load_own": "../2-processes/sgd-clip-scheduler",
                               "load_with": "load_raw", "own_state": True},
        # Each stage sharded over its 2 replicas by FSDP2: the one file gathered from the shards, and loaded into
        # shards again (FULL_SHARD, then SHARD_GRAD_OP at another balance, as a later program).
        "2replicas-full-shard-1f1b-accumulate-clip": {"sharding": "FULL_SHARD", "optimizer": "adamw",
                                                      "schedule": "1f1b", "last_stage_loss": True, "accumulate": 2,
                                                      "clip": 0.1, "batch_size": 4, "own_state": True},
        "2replicas-shard-grad-op-load": {"sharding": "SHARD_GRAD_OP", "clip": 0.05, "scheduler": "step",
                                         "batch_size": 4, "balance": [2, 3],
                                         "load": "../2-processes/sgd-clip-scheduler/final.pt"},
        # The 2-process job's sharded directory read into shards (each process reads its shard's rows), and saved
        # as one: every replica writes its shards at once.
        # The 2-process job's own files loaded by the module's and optimizer's load_state_dict into shards.
        "2replicas-full-shard-load-own": {"sharding": "FULL_SHARD", "clip": 0.05, "batch_size": 4,
                                          "load_own": "../2-processes/sgd-clip-scheduler"},
        "2replicas-full-shard-sharded": {"sharding": "FULL_SHARD", "clip": 0.05, "scheduler": "step",
                                         "batch_size": 4, "state_dict_type": "sharded",
                                         "load": "../2-processes/sharded-save/final.pt"},
    }},
    "2 processes, lightning_fabric": {"devices": 2, "package": "lightning_fabric", "cases": {
        "standalone-1f1b-adamw": {"optimizer": "adamw", "schedule": "1f1b", "last_stage_loss": True, "clip": 0.1},
        "standalone-head-outside-launch-fn-bf16-init-module": {"model": "module", "launch_fn": True, "balance": [2, 3],
                                                               "precision": "bf16-mixed", "microbatches": 1,
                                                               "build": "init_module", "optimizer": "adamw"},
        "standalone-sharded-save": {"clip": 0.05, "scheduler": "step", "state_dict_type": "sharded"},
        "standalone-sharded-load-other-balance": {"clip": 0.05, "scheduler": "step", "balance": [1, 4],
                                                  "load": "standalone-sharded-save/final.pt"},
    }},
    # Each stage split over 2 tensor ranks (2 stages x 2 tensor ranks) by the scenarios' plan, in Fabric's loop.
    "4 processes, tensor parallel": {"devices": 4, "start_method": "fork", "cases": {
        "tensor-parallel-1f1b-adamw-clip": {"tensor_parallel_size": 2, "optimizer": "adamw", "schedule": "1f1b",
                                            "last_stage_loss": True, "clip": 0.1, "own_state": True,
                                            "collectives": True},
        # The 2-process job's own files loaded by load_state_dict into split stages.
        "tensor-parallel-load-own": {"tensor_parallel_size": 2, "clip": 0.05,
                                     "load_own": "../2-processes/sgd-clip-scheduler"},
        # The data sharded by hand by fabric.global_rank, which counts tensor ranks: refused at the first step.
        "tensor-parallel-data-by-process": {"tensor_parallel_size": 2, "shard_by_rank": True},
    }},
}
NEEDS = {"4 processes": "2 processes", "4 processes, tensor parallel": "2 processes"}
CASES = [(job, case) for job, spec in JOBS.items() for case, config in spec["cases"].items()
         if config.get("model") != "litgpt" and not config.get("shard_by_rank")]  # (tested on their own)


#: What a case's ``load`` file was written by: that program's config (2 processes, one replica).
FIRST = {"sgd-clip-scheduler/final.pt": JOBS["2 processes"]["cases"]["sgd-clip-scheduler"],
         "../2-processes/sgd-clip-scheduler/final.pt": JOBS["2 processes"]["cases"]["sgd-clip-scheduler"],
         "sharded-save/final.pt": JOBS["2 processes"]["cases"]["sgd-clip-scheduler"],
         "../2-processes/sharded-save/final.pt": JOBS["2 processes"]["cases"]["sgd-clip-scheduler"],
         "standalone-sharded-save/final.pt": JOBS["2 processes"]["cases"]["sgd-clip-scheduler"]}


def job_directory(root: Path, job: str) -> Path:
    """Where ``job`` wrote its cases (it runs once per test session, under a lock shared by pytest's workers)."""
    if job in NEEDS:
        job_directory(root, NEEDS[job])
    out = root / job.replace(",", "").replace(" ", "-")
    done, failed = out.with_suffix(".done"), out.with_suffix(".failed")
    with FileLock(str(out.with_suffix(".lock")), timeout=900):
        if not done.exists() and not failed.exists():
            spec = JOBS[job]
            cases = {name: {**case, **({"load": str(out / case["load"])} if case.get("load") else {}),
                            **({"load_own": str(out / case["load_own"])} if case.get("load_own") else {}),
                            "package": spec.get("package", "lightning"),
                            "start_method": spec.get("start_method", "popen")} for name, case in spec["cases"].items()}
            try:
                job_spec = {"devices": spec["devices"], "package": spec.get("package", "lightning"), "cases": cases}
                run_script("fabric_loop.py", json.dumps(job_spec), str(out), timeout=600)
            except AssertionError as exc:
                failed.write_text(str(exc))
            else:
                done.touch()
    if failed.exists():
        raise AssertionError(f"the Fabric job {job!r} failed:\n{failed.read_text()}")
    return out


def plain(config: dict[str, Any], replicas: int, out: Path) -> dict[str, Any]:
    """The same loop on one device (a Fabric of one CPU), with the global batch; its saved state."""
    config = {**config, "batch_size": config.get("batch_size", 8) * replicas}
    fabric = L.Fabric(accelerator="cpu", devices=1, **fabric_loop.fabric_arguments({**fabric_loop.DEFAULTS, **config}))
    fabric_loop.run(fabric, config, str(out))
    return torch.load(out / "final.pt", weights_only=True)


def saved_state(path: Path, tmp_path: Path) -> dict[str, Any]:
    """What ``fabric.save`` wrote at ``path``: a file, or a sharded directory consolidated into the file it would
    have written."""
    if not path.is_dir():
        return torch.load(path, weights_only=True)
    assert (path / ".metadata").is_file() and len(list(path.glob("*.distcp"))) >= 2  # every process wrote its part
    lightning_pipe.consolidate_checkpoint(str(path), str(tmp_path / "consolidated.pt"))
    return torch.load(tmp_path / "consolidated.pt", weights_only=True)


@pytest.fixture
def fabric_jobs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Where the Fabric jobs write, shared by pytest's workers."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if worker_id != "master" else base) / "fabric-jobs"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("job", "case"), CASES, ids=[case for _, case in CASES])
def test_a_fabric_loop_trains_one_devices_weights(job, case, fabric_jobs, tmp_path):
    """The module's weights, the optimizer's state (by value), the scheduler's learning rate and the loop's own
    values in the file ``fabric.save`` wrote equal those of the same loop on one device (rtol 1e-4, atol 2e-5):
    SGD with momentum and AdamW with parameter groups, clipping by the global norm and by value, accumulation
    under ``no_backward_sync``, GPipe, 1F1B and zero-bubble with the loss on the last stage, a head outside the
    body, ``launch(fn)``, bf16-mixed, ``init_module``, 2 replicas x 2 stages, ``fabric.load`` in a later program at
    another balance and replica count, and the standalone ``lightning_fabric`` package."""
    out = job_directory(fabric_jobs, job) / case
    config = {**JOBS[job]["cases"][case]}
    stages = len(config.get("balance", fabric_loop.DEFAULTS["balance"])) // config.get("virtual_stages", 1)
    tensor = config.get("tensor_parallel_size", 1)  # a replica's pipelines: one per tensor rank
    replicas = JOBS[job]["devices"] // (stages * tensor)  # (processes per pipeline: stages over virtual stages)
    if config.get("load"):  # the reference runs the first program and the second in turn
        plain(FIRST[config["load"]], 1, tmp_path / "first")
        config["load"] = str(tmp_path / "first" / "final.pt")
    if config.get("load_own"):
        plain(FIRST[config["load_own"] + "/final.pt"], 1, tmp_path / "first")
        config["load_own"] = str(tmp_path / "first")
    expected = plain(config, replicas, tmp_path / "plain")
    saved = saved_state(out / "final.pt", tmp_path)
    assert saved["step"] == expected["step"] > 0
    assert not any(t.is_meta for t in saved["model"].values()), "placeholders written for the remote stages"
    if config.get("save_filter"):  # the filter kept the weights alone, every stage's
        assert sorted(saved["model"]) == sorted(k for k in expected["model"] if k.endswith("weight")) == [
            "0.weight", "2.weight", "4.weight"]
    # float64: one device's weights to its rounding (1e-4 would hide a loss computed in another dtype).
    rtol, atol = (1e-10, 1e-12) if config.get("precision") == "64-true" else (1e-4, 2e-5)
    assert_same_weights(saved["model"], expected["model"], rtol=rtol, atol=atol)
    assert saved["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert sorted(saved["optimizer"]["state"]) == sorted(expected["optimizer"]["state"])
    for i, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["optimizer"]["state"][i][key], value, rtol=1e-4, atol=2e-5,
                                       msg=f"{i} {key}")
    if "scheduler" in expected:
        assert saved["scheduler"] == expected["scheduler"]
    if "scale" in expected:  # the scaler took steps (AdamW's state exists) and moved its scale as on one device
        assert saved["scale"] == expected["scale"] != fabric_loop.DEFAULTS["init_scale"]
        assert expected["optimizer"]["state"]
    result = json.loads((out / "result.json").read_text())
    package = JOBS[job].get("package", "lightning")
    tree = "lightning_pipe.lightning" if package == "lightning_fabric" else "lightning_pipe.lightning_pytorch"
    assert result["strategy"] == f"{tree}.fabric.strategy.PipeStrategy"
    assert result["world_size"] == replicas * tensor and result["global_rank"] == 0  # Fabric sees the drivers alone
    if config.get("collectives"):  # among the drivers: one value per replica
        assert result["all_reduce"] == sum(range(1, replicas * tensor + 1, tensor))
        assert result["broadcast"] == "from 0"
        # Over the replicas, not the tensor ranks (which hold the same values): a sum counts each replica once.
        assert result["all_reduce_ones"] == result["all_gathered"] == replicas
    plain_model = fabric_loop.model({**fabric_loop.DEFAULTS, **config})
    plain_model.load_state_dict(saved["model"], strict=not config.get("save_filter"))  # no strategy at all
    if config.get("own_state"):
        check_own_state(out, config, result, expected, replicas * tensor)


def check_own_state(out: Path, config: dict[str, Any], result: dict[str, Any], expected: dict[str, Any],
                    drivers: int) -> None:
    """The loop's own ``model.state_dict()`` and ``optimizer.state_dict()``, in every driver, are one device's:
    every entry whole (none a placeholder), equal to the plain model's and its optimizer's; where the stages are
    split over tensor ranks or sharded over replicas (no process holds them whole), both are refused, saying to
    save with ``fabric.save``."""
    if config.get("sharding", "NO_SHARD") != "NO_SHARD" or config.get("tensor_parallel_size", 1) > 1:
        assert "fabric.save(" in (result["own_state_error"] or ""), result["own_state_error"]
        return
    assert result["own_state_error"] is None, result["own_state_error"]
    for rank in range(drivers):
        model = torch.load(out / f"own-model-{rank}.pt", weights_only=True)
        assert not any(t.is_meta for t in model.values()), f"driver {rank}: placeholders in model.state_dict()"
        assert_same_weights(model, expected["model"], rtol=1e-4, atol=2e-5)
        optimizer = torch.load(out / f"own-optimizer-{rank}.pt", weights_only=True)
        assert optimizer["param_groups"] == expected["optimizer"]["param_groups"], rank
        assert sorted(optimizer["state"]) == sorted(expected["optimizer"]["state"]), rank  # every stage's
        for i, state in expected["optimizer"]["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(optimizer["state"][i][key], value, rtol=1e-4, atol=2e-5,
                                           msg=f"driver {rank}: {i} {key}")


def test_a_state_a_sharded_directory_cannot_hold_is_refused_saying_what_to_do():
    """A sharded ``fabric.save`` writes the module set up and every optimizer by their stages: a state without the
    module, missing an optimizer, or using a key the directory keeps for itself is refused before anything is
    written."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_pipe.lightning.fabric.checkpoints import _split

    root = nn.Sequential(nn.Linear(2, 2))
    body = SimpleNamespace(name="sequential_module")
    first, second = (torch.optim.SGD(root.parameters(), lr=0.1) for _ in range(2))
    first._lp_index, second._lp_index = 0, 1
    key, prefix, optimizers, rest = _split({"m": root, "b": second, "a": first, "step": 3}, body, root, root, 2)
    assert (key, prefix, list(optimizers), rest) == ("m", "", ["a", "b"], {"step": 3})
    with pytest.raises(ValueError, match="needs the module fabric.setup returned"):
        _split({"a": first, "b": second}, body, root, root, 2)
    with pytest.raises(ValueError, match=r"every optimizer fabric.setup returned \(2\); the state holds 1 \('a'\)"):
        _split({"m": root, "a": first}, body, root, root, 2)
    with pytest.raises(ValueError, match="'state_dict', which a sharded checkpoint uses for itself"):
        _split({"m": root, "a": first, "b": second, "state_dict": {}}, body, root, root, 2)


def test_the_strategy_given_to_a_fabric_becomes_fabrics_and_pipe_is_registered():
    """``lightning_pipe.PipeStrategy`` (the Trainer's class of the program's package) becomes that package's Fabric
    strategy when a Fabric takes it, keeping its arguments; ``strategy="pipe"`` names it in both Fabric packages'
    registries."""
    import lightning_fabric

    strategy = lightning_pipe.PipeStrategy(balance=[3, 2], microbatches=6, schedule="1f1b")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert type(fabric.strategy).__module__ == "lightning_pipe.lightning_pytorch.fabric.strategy"
    assert (fabric.strategy.balance, fabric.strategy.microbatches, fabric.strategy.schedule) == ([3, 2], 6, "1f1b")
    named = L.Fabric(accelerator="cpu", devices=2, strategy="pipe")
    assert type(named.strategy).__module__ == "lightning_pipe.lightning_pytorch.fabric.strategy"
    standalone = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="pipe")
    assert type(standalone.strategy).__module__ == "lightning_pipe.lightning.fabric.strategy"


def test_a_plugin_fabric_cannot_run_across_stages_is_refused_as_fabric_gives_it():
    """A precision plugin of the user's own (here Fabric's transformer-engine-like ``Precision`` subclass that the
    stages could not follow) is refused as Fabric hands it to the strategy, naming those it takes."""
    from lightning.fabric.plugins.precision import Precision

    class Custom(Precision):
        precision = "custom"

    with pytest.raises(ValueError, match="does not take precision='custom'"):
        L.Fabric(accelerator="cpu", devices=2, strategy=lightning_pipe.PipeStrategy(balance=[3, 2]),
                 plugins=[Custom()])


@pytest.mark.timeout(600)
def test_torchrun_on_two_nodes_starts_the_fabric_loop_to_one_devices_weights(tmp_path):
    """The Fabric script started by ``torchrun --nnodes=2 --node_rank=0|1 --nproc_per_node=2`` (both nodes on this
    machine, loopback) and ``Fabric(num_nodes=2, devices=2)``: each node holds one pipeline, the two replicas'
    stages averaged across the nodes, AdamW clipped by the global norm, to one device's weights; and with the layout
    left to "auto", planned by the first driver and its choice broadcast to the other, the same."""
    import os
    import sys

    from dist_utils import free_port
    from strategy_utils import SCRIPTS, run_together

    case = {"optimizer": "adamw", "clip": 0.1, "batch_size": 4, "nodes": 2}
    # The layout left to the plan: the first driver's choice broadcast to the other node's (each would measure its own).
    auto = {"optimizer": "adamw", "batch_size": 4, "nodes": 2, "last_stage_loss": True, "balance": "auto",
            "microbatches": "auto", "schedule": "auto", "checkpoint": "auto", "sharding": "auto",
            "memory_per_device": "1GiB", "virtual_stages": None}
    job = {"devices": 2, "cases": {"two-nodes": case, "two-nodes-auto": auto}}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    run_together([([torchrun, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                    f"--master_port={port}", str(SCRIPTS / "fabric_loop.py"), json.dumps(job), str(tmp_path)], {})
                  for node in (0, 1)], tmp_path, timeout=400)
    result = json.loads((tmp_path / "two-nodes" / "result.json").read_text())
    assert result["world_size"] == 2  # the drivers, one per node
    saved = torch.load(tmp_path / "two-nodes" / "final.pt", weights_only=True)
    expected = plain({k: v for k, v in case.items() if k != "nodes"}, 2, tmp_path / "plain")
    assert saved["step"] == expected["step"] > 0
    assert_same_weights(saved["model"], expected["model"], rtol=1e-4, atol=2e-5)
    chosen = json.loads((tmp_path / "two-nodes-auto" / "result.json").read_text())["layout"]
    assert chosen["predicted"] and sum(chosen["balance"]) == 5, chosen
    saved = saved_state(tmp_path / "two-nodes-auto" / "final.pt", tmp_path)
    laid = ("nodes", "balance", "microbatches", "schedule", "checkpoint", "sharding", "memory_per_device")
    expected = plain({k: v for k, v in auto.items() if k not in laid}, 2, tmp_path / "plain-auto")
    assert saved["step"] == expected["step"] > 0
    assert_same_weights(saved["model"], expected["model"], rtol=1e-4, atol=2e-5)


def test_litgpts_gpt_through_a_fabric_loop_trains_the_plain_gpts_weights(fabric_jobs, tmp_path):
    """LitGPT's ``GPT`` as a body (``to_sequential``), in a Fabric loop of LitGPT's fine-tuning shape (1F1B with the
    loss on the last stage, AdamW with weight decay on the weights, clipping by the global norm) over 2 stages: its
    weights, in the file ``fabric.save`` wrote and in the loop's own ``model.state_dict()``, are the plain
    ``GPT``'s trained by the same loop on one device (``hf_state_dict`` gives them LitGPT's names, which
    ``GPT.load_state_dict`` takes strictly: a ``lit_model.pth``)."""
    pytest.importorskip("litgpt")
    from lightning_pipe.models import hf_state_dict

    out = job_directory(fabric_jobs, "2 processes") / "litgpt-1f1b-adamw-clip"
    config = {**JOBS["2 processes"]["cases"]["litgpt-1f1b-adamw-clip"], "model": "litgpt-plain",
              "last_stage_loss": False}
    expected = plain(config, 1, tmp_path / "plain")
    body = fabric_loop.model({**fabric_loop.DEFAULTS, "model": "litgpt"})  # its names (the weights are not read)
    initial = fabric_loop.model({**fabric_loop.DEFAULTS, **config}).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in expected["model"].items())  # it trained
    for what, state in (("fabric.save", saved_state(out / "final.pt", tmp_path)["model"]),
                        ("model.state_dict()", torch.load(out / "own-model-0.pt", weights_only=True))):
        lit = hf_state_dict(body, state)
        assert lit.keys() == expected["model"].keys(), what
        assert_same_weights(lit, expected["model"], rtol=1e-4, atol=2e-5)
        gpt = fabric_loop.model({**fabric_loop.DEFAULTS, **config})
        gpt.load_state_dict(lit, strict=True)  # a lit_model.pth LitGPT loads


def test_tensor_ranks_given_different_batches_are_refused_at_the_first_step(fabric_jobs):
    """Under tensor parallel ``fabric.world_size`` counts every tensor rank (2 replicas x 2 here, or 1 x 2), and a
    script sharding its data by ``global_rank`` by hand (as for Fabric's own strategies) fed the two tensor ranks of
    a stage different batches: each computed its slices of another batch, and the run trained garbage, silently (as
    under Lightning's own ModelParallelStrategy). The drivers now compare a digest of their inputs every run: the
    first step is refused, saying to split the data by replica."""
    out = job_directory(fabric_jobs, "4 processes, tensor parallel") / "tensor-parallel-data-by-process"
    error = json.loads((out / "result.json").read_text())["error"]
    assert re.search(r"received different inputs in run 1 of the pipeline .*distributed_sampler_kwargs", error), error
    assert not (out / "final.pt").exists()


@pytest.mark.timeout(900)
def test_a_fabric_loop_reads_a_trainers_sharded_directory(jobs, tmp_path):
    """A Fabric loop given the sharded directory a Trainer wrote (its LightningModule and the optimizer of its own
    ``configure_optimizers``, at another balance) reads each stage's entries into its processes: saved again as one
    file, the weights and AdamW's state are the Trainer's at that epoch (its one-file twin's, to the bit)."""
    from scripts import train

    directory = jobs.directory("sharded-resume-full") / "ckpts" / "epoch=0.ckpt"
    twin = torch.load(jobs.directory("full-twin-of-sharded") / "ckpts" / "epoch=0.ckpt", weights_only=False)
    config = {**train.DEFAULTS, **case_config("sharded-resume-full")}
    case = {"trainer_module": config, "balance": [1, 3], "epochs": 0, "optimizer": config["optimizer"],
            "load": str(directory), "package": "lightning", "start_method": "fork"}
    run_script("fabric_loop.py", json.dumps({"devices": 2, "cases": {"from-trainer": case}}), str(tmp_path),
               timeout=300)
    saved = torch.load(tmp_path / "from-trainer" / "final.pt", weights_only=True)
    assert_same_weights(saved["model"], twin["state_dict"], rtol=0, atol=0)
    expected = twin["optimizer_states"][0]
    assert saved["optimizer"]["param_groups"] == expected["param_groups"]
    assert sorted(saved["optimizer"]["state"]) == sorted(expected["state"]) and expected["state"]
    for i, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["optimizer"]["state"][i][key], value, rtol=0, atol=0, msg=f"{i} {key}")
