"""A minimal LightningCLI program trained through PipeStrategy: an MLP regressor on synthetic data.

    python examples/mlp.py fit --config configs/mlp/cpu.yaml

The model keeps its layers in ``self.sequential_module``; the YAML config picks the strategy
(``trainer.strategy.class_path: lightning_pipe.PipeStrategy``) and its balance and micro-batches.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe  # noqa: F401 - registers strategy="pipe"


class MLP(LightningModule):
    """``depth`` residual-free blocks of Linear + GELU in an ``nn.Sequential`` body, and a linear head."""

    def __init__(self, features: int = 32, width: int = 128, depth: int = 8, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        blocks = [nn.Sequential(nn.Linear(features if i == 0 else width, width), nn.GELU()) for i in range(depth)]
        self.sequential_module = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 1)
        self.example_input_array = torch.zeros(8, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sequential_module(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Synthetic(LightningDataModule):
    """y = sin(sum of a random projection of x): smooth, learnable, generated from a fixed seed."""

    def __init__(self, features: int = 32, samples: int = 2048, batch_size: int = 64) -> None:
        super().__init__()
        self.features, self.samples, self.batch_size = features, samples, batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.features, generator=g)
        w = torch.randn(self.features, 1, generator=g) / self.features**0.5
        y = torch.sin(3 * x @ w)
        split = self.samples * 7 // 8
        self.train_set, self.val_set = TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main() -> None:
    LightningCLI(MLP, Synthetic, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
