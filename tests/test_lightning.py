"""PipeStrategy with the rest of Lightning: every stage of a script, metrics across replicas, the CLI."""

from __future__ import annotations

import pytest
import torch
from scripts import train as script
from strategy_utils import run_script


@pytest.mark.timeout(300)
def test_fit_validate_test_predict_in_one_script(tmp_path):
    run_script("phases.py", str(tmp_path), timeout=240)
    out = torch.load(tmp_path / "phases.pt", weights_only=False)
    assert out["world_size"] == 2
    model = script.Model.load_from_checkpoint(tmp_path / "final.ckpt", map_location="cpu").eval()
    x, y = script.data(model.config).tensors
    with torch.no_grad():
        full = model(x)
    loss = torch.nn.functional.mse_loss(full, y).item()
    # Validation and test losses are means over both replicas' halves of the data: the whole set's loss.
    assert out["validate"][0]["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert out["test"][0]["test_loss"] == pytest.approx(loss, rel=1e-5)
    # A torchmetrics metric logged with sync_dist was computed over both replicas.
    assert "train_mse" in out["fit"] and out["fit"]["train_mse"] > 0
    # Replica 0 predicts its share of the samples (every other one), through the pipeline.
    torch.testing.assert_close(out["predict"], full[0::2], rtol=1e-5, atol=1e-6)
