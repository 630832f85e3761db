"""PipelineReport outside a pipeline: the loss curve alone, its arguments checked."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineReport
from lightning_pipe.engine.timeline import Recorder
from lightning_pipe.lightning.trainer.report import plot_losses

PNG = b"\x89PNG\r\n\x1a\n"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.sequential_module(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_report_under_a_plain_strategy_draws_the_loss_curve(tmp_path, capsys):
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    report = PipelineReport(directory=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
    trainer.fit(Tiny(), data)
    assert len(report.losses) == 6
    assert report.losses[0] > report.losses[-1]  # it learned, and the curve shows each batch's loss
    assert set(report.paths) == {"loss_curve"}  # no pipeline, no timeline; no checkpoint written
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == PNG
    assert str(tmp_path / "loss_curve.png") in capsys.readouterr().out


def test_plot_losses_of_a_single_batch(tmp_path):
    plot_losses([2.5], str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_report_rejects_a_bad_number_of_steps(steps):
    with pytest.raises(ValueError, match=f"timeline_steps must be a positive number of steps \\(got: {steps}\\)"):
        PipelineReport(timeline_steps=steps)


def test_recorder_keeps_the_latest_events():
    recorder = Recorder(limit=5)
    for run in range(3):
        recorder.record(0, "F", range(3), run, start=0.0)
    kept = recorder.events()
    assert [(e.run, e.microbatch) for e in kept] == [(1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
