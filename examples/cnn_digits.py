"""A CNN image classifier trained through PipeStrategy on scikit-learn's bundled digits (8x8 images).

    python examples/cnn_digits.py fit --config configs/cnn_digits/cpu.yaml

BatchNorm with deferred statistics (``deferred_batch_norm``), dropout, and a balance inferred from the
model's ``example_input_array`` (``balance: null``). Validation accuracy is logged with torchmetrics. BatchNorm
normalises each of the 4 micro-batches alone in training (the strategy warns of it): the weights are those of a
micro-batched BatchNorm, not one device's; ``--trainer.strategy.init_args.microbatches=1`` gives one device's.
"""

from __future__ import annotations

import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe  # noqa: F401 - registers strategy="pipe"


def conv_block(cin: int, cout: int, dropout: float) -> nn.Sequential:
    """Conv → BatchNorm → ReLU → Dropout2d."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.Dropout2d(dropout))


class DigitsCNN(LightningModule):
    """Four conv blocks and a classifier in an ``nn.Sequential`` body."""

    def __init__(self, channels: int = 32, dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.sequential_module = nn.Sequential(
            conv_block(1, channels, dropout), conv_block(channels, channels, dropout), nn.MaxPool2d(2),
            conv_block(channels, 2 * channels, dropout), conv_block(2 * channels, 2 * channels, dropout),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, 10))
        self.example_input_array = torch.zeros(16, 1, 8, 8)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.accuracy, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Digits(LightningDataModule):
    """scikit-learn's 1797 handwritten digits, shipped with the package (no download): 80% train, 20% val."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        split = len(y) * 4 // 5
        train, val = order[:split], order[split:]
        self.train_set, self.val_set = TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main() -> None:
    LightningCLI(DigitsCNN, Digits, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
