"""PipeStrategy with the rest of Lightning: every stage of a script, metrics across replicas, the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch
from scripts import train as script
from strategy_utils import REPO, assert_same_weights, run_script, run_together
from test_strategy import plain_weights


@pytest.mark.timeout(900)
@pytest.mark.parametrize("accelerator", [
    "cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_fit_validate_test_predict_in_one_script(accelerator, tmp_path, jobs):
    plain_dir = tmp_path / "plain"
    if accelerator == "cpu":  # in the shared job of 4 processes (tests/jobs.py)
        tmp_path = jobs.directory("phases")
    else:
        run_script("phases.py", str(tmp_path), accelerator, timeout=240)
    out = torch.load(tmp_path / "phases.pt", weights_only=False, map_location="cpu")
    assert out["world_size"] == 2
    model = script.Model.load_from_checkpoint(tmp_path / "final.ckpt", map_location="cpu").eval()
    x, y = script.data(model.config).tensors
    with torch.no_grad():
        full = model(x)
    loss = torch.nn.functional.mse_loss(full, y).item()
    # Validation and test losses are means over both replicas' halves of the data: the whole set's loss.
    assert out["validate"][0]["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert out["test"][0]["test_loss"] == pytest.approx(loss, rel=1e-5)
    # A torchmetrics metric logged per epoch was computed over both replicas' updates: the last epoch's mean
    # squared error over every sample, as one device training on the global batches computed it.
    if accelerator == "cpu":
        plain_config = {"log_metric": True, "validate": True, "epochs": 2, "samples": 32, "batch_size": 4,
                        "devices": 4, "microbatches": 2}
        plain_weights(plain_config, plain_dir)
        plain = json.loads((plain_dir / "result.json").read_text())["metrics"]
        assert out["fit"]["train_mse"] == pytest.approx(plain["train_mse"], rel=1e-5)
    # Replica 0 predicts its share of the samples (every other one), through the pipeline.
    torch.testing.assert_close(out["predict"], full[0::2], rtol=1e-5, atol=1e-6)
    # ModelCheckpoint(monitor=..., save_top_k=1) recorded a best model (the drivers agree on every decision), whose
    # score is its validation loss over the whole set (both replicas' halves).
    assert out["best"].endswith(".ckpt")
    best = script.Model.load_from_checkpoint(out["best"], map_location="cpu").eval()
    with torch.no_grad():
        assert out["best_score"] == pytest.approx(torch.nn.functional.mse_loss(best(x), y).item(), rel=1e-5)
    # rpc_save_model gave the save function the whole unpipelined model, with every stage's weights.
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(whole[name], value, msg=name)
    torch.testing.assert_close(whole["sequential_module.3.hint"], torch.arange(4.0))  # not in any state_dict
    # A second Trainer testing the epoch-0 checkpoint: every stage runs with that checkpoint's weights.
    first = script.Model.load_from_checkpoint(tmp_path / "epochs" / "epoch=0.ckpt", map_location="cpu").eval()
    with torch.no_grad():
        first_loss = torch.nn.functional.mse_loss(first(x), y).item()
    assert abs(first_loss - loss) > 1e-4  # the two checkpoints can be told apart
    assert out["retested"][0]["test_loss"] == pytest.approx(first_loss, rel=1e-5)
    # Between Trainers, the driver's model.state_dict() holds every stage's weights as they are (here: the
    # epoch-0 checkpoint's, just loaded by the second Trainer), none of them placeholders.
    after = out["state_after_retest"]
    assert not any(t.is_meta for t in after.values())
    assert_same_weights(after, first.state_dict(), rtol=0, atol=0)
    # model.load_state_dict() between Trainers reaches the remote stages: the final weights test as such.
    assert out["reloaded"][0]["test_loss"] == pytest.approx(loss, rel=1e-5)
    # The body indexes and iterates like the nn.Sequential it replaced.
    layers = [type(layer).__name__ for layer in model.sequential_module]
    assert out["indexing"] == {"len": len(layers), "last": layers[-1], "slice": 2, "iter": layers, "same": True}


@pytest.mark.timeout(300)
def test_lightning_cli_yaml_config(tmp_path):
    """`trainer.strategy.class_path: lightning_pipe.PipeStrategy` with init_args from the example's YAML."""
    result = run_script("examples/mlp.py", "fit", "--config", "configs/mlp/cpu.yaml", "--trainer.max_epochs=1",
                        "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
                        "--trainer.strategy.init_args.start_method=fork",  # (the other process forked at fit)
                        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                        timeout=240)
    # ModelSummary (plain or Rich, whichever Lightning picks) counted every stage's parameters, not stage 0's.
    assert re.search(r"119 K\s+Total params|Total params:?\s+119 K", result.stdout), result.stdout[-3000:]
    (ckpt,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    state = torch.load(ckpt, weights_only=False)
    assert state["global_step"] == 4
    assert state["hyper_parameters"]["depth"] == 8
    assert sum(k.startswith("sequential_module.") for k in state["state_dict"]) == 16  # both stages' layers


@pytest.mark.timeout(300)
def test_strategy_by_name_infers_the_balance(tmp_path):
    """strategy="pipe": default arguments, one stage per device, balance found from example_input_array."""
    result = run_script("examples/mlp.py", "fit", "--config", "configs/mlp/cpu.yaml", "--trainer.strategy=pipe",
                        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
                        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                        timeout=240)
    found = re.search(r"inferred balance \[(\d+), (\d+)\] \(balance_by_size\)", result.stdout)
    assert found, result.stdout[-3000:]
    # What balance_by_size gives for the example's body and example input, with the strategy's default chunks.
    import importlib.util

    from lightning_pipe.balance import balance_by_size

    spec = importlib.util.spec_from_file_location("mlp_example", REPO / "examples" / "mlp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.MLP(features=32, width=128, depth=8)
    expected = balance_by_size(2, model.sequential_module, model.example_input_array, chunks=8)
    assert [int(found[1]), int(found[2])] == expected, (found[0], expected)
    (ckpt,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2


@pytest.mark.timeout(300)
def test_forked_processes_train_the_weights_of_processes_started_as_scripts(tmp_path, jobs):
    """start_method='fork': the script runs once up to fit (one process leaves its mark, where the processes
    started as scripts leave one each), the other process is forked there and computes on one CPU thread, and
    the weights are those of the same job started as scripts, to the bit."""
    import json

    from jobs import config as case_config
    from strategy_utils import assert_same_weights, run_script

    name = "2stages-sgd"  # started as scripts in the shared job
    config = {**case_config(name), "start_method": "fork"}
    out = tmp_path / "fork"
    run_script("train.py", json.dumps(config), str(out), timeout=240)
    started = jobs.directory(name) / "started"
    assert len(list(started.iterdir())) == 2, "the processes started as scripts each run the script"
    assert len(list((out / "started").iterdir())) == 1, "a forked process ran the script before fit again"
    stages = json.loads((out / "result.json").read_text())["stages"]["fit"]
    assert [s["threads"] for s in stages] == [1]
    a = script.Model.load_from_checkpoint(out / "final.ckpt", map_location="cpu")
    b = script.Model.load_from_checkpoint(jobs.directory(name) / "final.ckpt", map_location="cpu")
    assert_same_weights(a.state_dict(), b.state_dict(), rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_a_freed_model_frees_its_stages(tmp_path):
    """A script that trains one model after another (a sweep) must not keep every old model's stages (their
    weights, optimizer state and threads) alive in the other processes."""
    run_script("two_models.py", str(tmp_path), timeout=150)
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert stages == {"both": 2, "left": 1}


def assert_two_nodes_train_one_devices_weights(config: dict, out, plain_out) -> None:
    """2 nodes x 2 processes trained 2 replicas x 2 stages (Lightning saw the replicas' drivers alone) to the
    weights of one device with the global batch, drawn in the replicas' sampler's order."""
    assert json.loads((out / "result.json").read_text())["world_size"] == 2
    pipelined = script.Model.load_from_checkpoint(out / "final.ckpt", map_location="cpu").state_dict()
    one_device = script.main({**config, "batch_size": 8}, str(plain_out), plain=True).state_dict()
    assert_same_weights(pipelined, one_device)


@pytest.mark.timeout(420)
def test_slurm_launch_on_two_nodes_trains_the_same_weights_as_one_device(tmp_path):
    """Four processes started as `srun` starts them (SLURM's variables, no launcher: 2 nodes x 2 tasks, here
    on one machine) train 2 replicas x 2 stages to the weights of one device with the global batch: the
    global ranks come from SLURM's node and local ids, and Lightning sees the two replicas' drivers only."""
    import sys

    from dist_utils import free_port
    from strategy_utils import SCRIPTS

    config = {"balance": [2, 2], "epochs": 1, "batch_size": 4, "devices": 2, "nodes": 2}  # batch per replica
    out = tmp_path / "slurm"
    out.mkdir()
    port = str(free_port())
    argv = [sys.executable, str(SCRIPTS / "train.py"), json.dumps(config), str(out)]
    run_together([(argv, {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank),
                          "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_JOB_NAME": "pipe",
                          "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": port}) for rank in range(4)], out)
    assert_two_nodes_train_one_devices_weights(config, out, tmp_path / "plain")


@pytest.mark.timeout(900)
def test_torchrun_on_two_nodes_trains_the_weights_of_lightnings_launcher_and_of_one_device(tmp_path, jobs):
    """`torchrun --nnodes=2 --node_rank=0|1 --nproc_per_node=2`, both nodes on this machine (loopback), with each
    stage split over 2 tensor ranks: a node holds a stage's 2 tensor ranks (the tensor dimension inside a node),
    activations cross the nodes between matching tensor ranks. The same plain Lightning script (its strategy argument
    the only pipeline-specific line) trains, to the bit, the weights Lightning's launcher trains on one node (AdamW
    clipped by the global norm, Lightning's world the 2 drivers), and one device's. (The SLURM test above runs
    2 replicas x 2 stages on two nodes.)"""
    import os
    import sys

    from dist_utils import free_port
    from jobs import config as case_config
    from strategy_utils import SCRIPTS

    config = {**case_config("tp-adamw-clip"), "devices": 2, "nodes": 2}
    out = tmp_path / "torchrun"
    out.mkdir()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    run_together([([torchrun, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                    f"--master_port={port}", str(SCRIPTS / "train.py"), json.dumps(config), str(out)], {})
                  for node in (0, 1)], out)
    assert json.loads((out / "result.json").read_text())["world_size"] == 2  # the 2 pipelines' drivers
    pipelined = script.Model.load_from_checkpoint(out / "final.ckpt", map_location="cpu").state_dict()
    launched = script.Model.load_from_checkpoint(jobs.directory("tp-adamw-clip") / "final.ckpt", map_location="cpu")
    assert_same_weights(pipelined, launched.state_dict(), rtol=0, atol=0)
    one_device = script.main(config, str(tmp_path / "plain"), plain=True).state_dict()
    assert_same_weights(pipelined, one_device, rtol=1e-4, atol=2e-5)
