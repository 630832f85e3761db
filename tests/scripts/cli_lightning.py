"""A LightningCLI program written against ``lightning.pytorch``, as Lightning's docs write one:

    python cli_lightning.py --config CONFIG.yaml --out OUT_DIR

The YAML picks the strategy (``class_path: lightning_pipe.PipeStrategy``, ``strategy: pipe`` or one device);
after fitting, OUT_DIR/final.ckpt holds the weights, OUT_DIR/final.pt the plain model's loaded from it, and
OUT_DIR/result.json the strategy's module and balance.
"""

from __future__ import annotations

import json
import os

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn

import lightning_pipe  # noqa: F401 - strategy="pipe"


class Model(LightningModule):
    """Five layers in the body; SGD with momentum."""

    def __init__(self, width: int = 16, lr: float = 0.1) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                               nn.Linear(width, 1))
        self.example_input_array = torch.zeros(4, 8)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Data(LightningDataModule):
    """32 random samples from a fixed generator, in order."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def] # noqa: ANN001
        parser.add_argument("--out", required=True)


if __name__ == "__main__":
    cli = CLI(Model, Data, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, cli.datamodule)
    out = cli.config["out"]
    cli.trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    if cli.trainer.is_global_zero:  # the checkpoint loads into the plain model, with no strategy
        loaded = Model.load_from_checkpoint(os.path.join(out, "final.ckpt"), map_location="cpu")
        torch.save(loaded.state_dict(), os.path.join(out, "final.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"strategy": type(cli.trainer.strategy).__module__,
                       "balance": getattr(cli.trainer.strategy, "balance", None)}, f)
