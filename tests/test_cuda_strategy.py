"""PipeStrategy on GPUs (several processes may share one): the weights of plain training on one GPU.

Skipped without a GPU. Run on a machine with one: ``python -m pytest tests/test_cuda_strategy.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from scripts import train as script
from strategy_utils import assert_same_weights, train

pytestmark = [pytest.mark.gpu,
              pytest.mark.timeout(300), pytest.mark.usefixtures("full_precision_matmul")]

REMOTE = "sequential_module.3.0.weight"  # a layer of the last stage, in another process

# As in test_strategy.py, each case changes a few things from train.py's defaults (2 processes, balance
# [2, 2], 4 micro-batches, SGD with momentum, 2 epochs of 8 steps).
CASES = {
    "2stages-sgd": {},
    "3stages-chunks8-always-adamw-steplr": {"devices": 3, "balance": [1, 2, 1], "microbatches": 8,
                                             "checkpoint": "always", "optimizer": "adamw", "scheduler": "step"},
    "2replicas-x-2stages-accumulate-clip": {"devices": 4, "batch_size": 4, "accumulate": 2, "clip": 0.05,
                                            "optimizer": "adamw"},
    "manual-two-optimizers-single-backward": {"manual": True, "optimizer": "two", "balance": [1, 3],
                                              "pipelined_backward": False},
    # The V shapes: stage i and stage 3 - i in one process, the loss computed where the batch is.
    "zbv-adamw-clip": {"schedule": "zbv", "virtual_stages": 2, "last_stage_loss": True, "balance": [1, 1, 1, 2],
                       "optimizer": "adamw", "clip": 0.05},
    "dualpipev-2replicas": {"schedule": "dualpipev", "virtual_stages": 2, "last_stage_loss": True,
                            "balance": [1, 1, 1, 2], "devices": 4, "batch_size": 4, "optimizer": "adamw"},
}


def plain_weights(config: dict, out: Path) -> dict[str, torch.Tensor]:
    """The weights of training ``config`` plain on one GPU, with the global batch."""
    config = copy.deepcopy(config)
    processes = len(config.get("balance", [2, 2])) // config.get("virtual_stages", 1)
    replicas = config.get("devices", 2) // (processes * config.get("tensor_parallel_size", 1))
    config["batch_size"] = config.get("batch_size", 8) * replicas
    model = script.main(config, str(out), plain=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def pipe_weights(config: dict, out: Path) -> dict[str, torch.Tensor]:
    """The weights of training ``config`` through PipeStrategy, as the consolidated checkpoint loads them
    into the plain module (no strategy)."""
    result = train(config, out, timeout=240)
    assert result["route"] == "cuda:0"  # activations went from GPU to GPU (device maps), not through host memory
    return script.Model.load_from_checkpoint(out / "final.ckpt", map_location="cpu").state_dict()


@pytest.mark.parametrize("name", list(CASES))
def test_same_weights_as_one_gpu(name, tmp_path):
    config = {**CASES[name], "accelerator": "gpu"}
    actual = pipe_weights(config, tmp_path / "pipe")
    expected = plain_weights(config, tmp_path / "plain")
    assert_same_weights(actual, expected)
    initial = script.Model(config).state_dict()
    assert not torch.allclose(actual[REMOTE], initial[REMOTE])  # the remote stage did train


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_matches_one_gpu(precision, tmp_path):
    """Autocast and (16-mixed) the CUDA gradient scaler reach every stage: the same weights and the same
    loss scale as one GPU, and weights that differ from float32 training's."""
    # One micro-batch: a half-precision matrix product of 2 rows rounds differently from one of 8.
    config = {"accelerator": "gpu", "precision": precision, "balance": [1, 3], "optimizer": "adamw",
              "microbatches": 1}
    actual = pipe_weights(config, tmp_path / "pipe")
    expected = plain_weights(config, tmp_path / "plain")
    assert_same_weights(actual, expected)
    fp32 = plain_weights({**config, "precision": "32-true"}, tmp_path / "fp32")
    assert (fp32[REMOTE] - expected[REMOTE]).abs().max() > 1e-5  # the check can tell half from full precision
    if precision == "16-mixed":
        piped = torch.load(tmp_path / "pipe" / "final.ckpt", weights_only=False)
        plain = torch.load(tmp_path / "plain" / "final.ckpt", weights_only=False)
        assert piped["MixedPrecision"]["scale"] == plain["MixedPrecision"]["scale"]


def test_16_mixed_with_micro_batches_is_within_half_precision_rounding(tmp_path):
    """With 4 micro-batches, fp16 matrix products of 2 rows round differently from those of 8: the weights
    differ from one GPU's by about as much as 16-mixed training differs from float32 training (seen on an
    H100: up to 2.3e-4 for both), not more."""
    config = {"accelerator": "gpu", "precision": "16-mixed", "optimizer": "adamw"}
    actual = pipe_weights(config, tmp_path / "pipe")
    expected = plain_weights(config, tmp_path / "plain")
    fp32 = plain_weights({**config, "precision": "32-true"}, tmp_path / "fp32")
    for name in expected:
        gap, half = (actual[name] - expected[name]).abs().max().item(), (fp32[name] - expected[name]).abs().max().item()
        print(f"{name}: pipe vs one GPU {gap:.2e}, 16-mixed vs float32 {half:.2e}")
        assert gap <= 3 * half + 1e-6, f"{name}: {gap:.2e} from one GPU's, beyond fp16 rounding ({half:.2e})"
    assert_same_weights(actual, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_point_to_point_hands_gpu_tensors_off_over_nccl_where_each_process_has_a_gpu(schedule, tmp_path):
    """``data_plane="p2p"`` between GPU stages: each hand-off's message on the plane, its CUDA tensors after it over
    NCCL (a group per direction between two processes), where each process has a GPU of its own; processes sharing
    a GPU (NCCL refuses them) hand off by RPC, GPU to GPU, with a warning. One GPU's weights either way."""
    config = {"accelerator": "gpu", "data_plane": "p2p", "schedule": schedule,
              **({"last_stage_loss": True, "balance": [2, 3]} if schedule == "1f1b" else {})}
    actual = pipe_weights(config, tmp_path / "pipe")
    assert_same_weights(actual, plain_weights(config, tmp_path / "plain"))
    planes = json.loads((tmp_path / "pipe" / "plane_replica0.json").read_text())
    if torch.cuda.device_count() < 2:
        assert planes == [None, None], planes
        return
    for plane in planes:
        assert plane["links"].endswith("tensors over nccl") and plane["sent"] > 0, planes


def test_stages_split_over_tensor_ranks_on_gpus_train_one_gpus_weights(tmp_path):
    """2 stages x 2 tensor ranks on GPUs, built on the meta device (each layer materialised on its GPU and split
    before the next is made), AdamW clipped by the global norm: one GPU's weights. With 4 GPUs or more the tensor
    ranks' collectives go over NCCL; with fewer, the processes share the GPUs over gloo (NCCL refuses two ranks of
    one group on one GPU)."""
    config = {"accelerator": "gpu", "devices": 4, "body": "scenario", "width": 8, "balance": [3, 2],
              "tensor_parallel_size": 2, "tensor_parallel_plan": {"0": "colwise", "2": "rowwise", "4": "colwise_rep"},
              "epochs": 1, "build": "init_module", "optimizer": "adamw", "clip": 0.05}
    train(config, tmp_path / "pipe", timeout=240)
    actual = script.Model.load_from_checkpoint(tmp_path / "pipe" / "final.ckpt", map_location="cpu").state_dict()
    assert_same_weights(actual, plain_weights(config, tmp_path / "plain"), rtol=1e-4, atol=2e-5)
    for k in range(2):  # each tensor rank's pipeline: stage 0 never held whole while it was built
        stage0 = json.loads((tmp_path / "pipe" / f"built_replica{k}.json").read_text())[0]
        assert stage0["parameters"] < stage0["built"] < stage0["whole"], stage0


def test_auto_layout_on_a_gpu_trains_one_gpus_weights_within_the_predicted_memory(tmp_path):
    """Every layout argument "auto", 2 processes sharing the GPU: planned from the GPU's own measurements, one GPU's
    weights, and each process's peak on the GPU (what it allocated there, counted from its session on) within 10% or
    64 MiB of what the plan predicted for it (no "above the planned" warning)."""
    from strategy_utils import run_script

    plain, auto = tmp_path / "plain.pt", tmp_path / "auto.pt"
    run_script("auto_layout.py", "plain", "1", "0", str(plain), "gpu", timeout=180)
    result = run_script("auto_layout.py", "auto", "2", "1GiB", str(auto), "gpu", timeout=240,
                        env={"PYTHONWARNINGS": "default"})  # (the tests' processes ignore warnings by default)
    assert "the layout planned for Body" in result.stdout + result.stderr
    assert "above the planned" not in result.stdout + result.stderr
    chosen = json.loads((tmp_path / "auto.pt.json").read_text())
    print("held on the GPU", chosen["held"], "predicted", chosen["predicted"])
    assert all(0 < held <= chosen["budget"] for held in chosen["held"])
    want, got = torch.load(plain), torch.load(auto)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)
