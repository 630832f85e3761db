"""Fine-tuning as people do it, under replicas: PEFT's LoRA adapters, stages with nothing to train, parameters
frozen and unfrozen mid-training; each against one device's weights.

2 replicas x 2 stages of a tiny Llama train in the shared job "4 processes fine-tuning" (tests/jobs.py,
tests/scripts/hf_train.py). Before the averaging followed ``requires_grad``, an embedding unfrozen at step 2 under
DDP ended ~1e-2 away from one device's (torch's DDP never averages a parameter that did not require a gradient when
it was built), and adapters on the last stage alone under FULL_SHARD failed every save (stage 0, with nothing to
train, was left unsharded while stage 1 was sharded).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from jobs import GROUPS
from jobs import config as case_config
from strategy_utils import run_script

from lightning_pipe.models import to_sequential

CASES = list(GROUPS["4 processes fine-tuning"])
#: What the pipeline alone reads (how it schedules, shards, saves and resumes): cases that differ in these only
#: are one training on one device, which :func:`one_device` runs once per test process.
PIPELINE_ONLY = ("schedule", "last_stage_loss", "microbatches", "checkpoint", "sharding", "state_dict_type", "resume")


@functools.cache
def _one_device(training: str) -> dict[str, torch.Tensor]:
    from scripts.hf_train import train_plain

    return to_sequential(train_plain(json.loads(training))).state_dict()


def one_device(config: dict) -> dict[str, torch.Tensor]:
    """The weights of ``config``'s model trained on one device with the global batch."""
    return _one_device(json.dumps({k: v for k, v in config.items() if k not in PIPELINE_ONLY}, sort_keys=True))


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """The plain model's state from a checkpoint the pipeline wrote (a sharded one consolidated first)."""
    if path.is_dir():
        import lightning_pipe

        lightning_pipe.consolidate_checkpoint(str(path), str(path) + ".consolidated")
        path = Path(str(path) + ".consolidated")
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CASES)
def test_fine_tuning_under_replicas_trains_one_devices_weights(name, jobs):
    """Each case ends with the weights of the same model trained on one device with the global batch (rtol 1e-4,
    atol 2e-5), frozen parameters unchanged, trained ones moved: LoRA on every block or on the last only, every
    sharding setting, both checkpoint formats and a resume from each, parameters unfrozen and frozen mid-training
    (with accumulation), a whole stage unfrozen."""
    from scripts.hf_train import DEFAULTS, build

    config = {**DEFAULTS, **case_config(name)}
    state = checkpoint_state(jobs.directory(name) / "final.ckpt")
    reference = one_device(config)
    initial = to_sequential(build(config)).state_dict()
    assert sorted(k.removeprefix("sequential_module.") for k in state) == sorted(reference)
    moved = []
    for key, expected in reference.items():
        torch.testing.assert_close(state[f"sequential_module.{key}"], expected, rtol=1e-4, atol=2e-5, msg=key)
        if not torch.equal(expected, initial[key]):
            moved.append(key)
    if config["lora"]:  # the adapters trained (B starts at zero, so A moves from the second step), nothing else
        assert moved and all("lora_" in k for k in moved), moved
        assert any("lora_A" in k for k in moved) and any("lora_B" in k for k in moved)
        if config["lora"] == "last":
            assert all(k.startswith("4.") for k in moved), moved
    else:  # the frozen parameters trained in the steps where they were trainable
        assert any(k.startswith(tuple(config["frozen"])) for k in moved), moved
    replicas = config["devices"] // len(config["balance"])
    steps = config["epochs"] * config["samples"] // (config["batch_size"] * replicas * config["accumulate"])
    assert jobs.result(name)["global_step"] == steps


@pytest.mark.timeout(300)
def test_replicas_that_unfreeze_at_different_steps_are_refused_before_the_step(tmp_path):
    """Replica 1 unfreezes the embedding at step 2, replica 0 does not: each would step it apart from the other
    (torch's DDP and Lightning's DDPStrategy let that happen silently). Every driver refuses the step, saying
    what differs and what to do, and the job ends."""
    config = {**case_config("ft-unfreeze-embedding-ddp"), "unfreeze_on_replica": 1, "start_method": "fork"}
    result = run_script("train.py", json.dumps({"cases": {"apart": config}}), str(tmp_path), expect_ok=False,
                        timeout=240)
    assert result.returncode != 0
    assert "the replicas do not train the same parameters in this step" in result.stdout, result.stdout[-3000:]
    assert "Change requires_grad on every replica at the same step" in result.stdout
    assert not (tmp_path / "apart" / "final.ckpt").exists()
