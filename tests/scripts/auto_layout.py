"""A Trainer job with every layout argument left to "auto": trains the body and writes its weights (from the
checkpoint, the plain model's names) and the chosen layout; ``plain`` trains one device instead."""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy, loss_on_last_stage


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class Body(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        self.example_input_array = torch.randn(16, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_on_last_stage(self.sequential_module, x, y, mse)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def main() -> None:
    mode, devices, budget, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    accelerator = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    placed: dict = {}
    if accelerator == "gpu" and mode != "plain" and torch.cuda.device_count() < devices:  # processes share the GPUs
        placed = {"parallel_devices": [torch.device("cuda", i % torch.cuda.device_count()) for i in range(devices)],
                  "process_group_backend": "gloo"}
    pl.seed_everything(0)
    model = Body()
    auto = "auto"
    # "auto-t1": the tensor size given (torchrun starts the processes before any plan: it cannot be left to one).
    strategy = "auto" if mode == "plain" else PipeStrategy(
        balance=auto, microbatches=auto, schedule=auto, checkpoint=auto,
        tensor_parallel_size=1 if mode == "auto-t1" else auto, sharding_strategy=auto, memory_per_device=budget,
        **placed)
    trainer = pl.Trainer(accelerator=accelerator, devices=1 if placed or mode == "plain" else devices,
                         strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    if mode == "plain":
        torch.save({k: v.cpu() for k, v in model.sequential_module.state_dict().items()}, out)
        return
    trainer.save_checkpoint(out + ".ckpt")
    if trainer.is_global_zero:
        state = torch.load(out + ".ckpt", weights_only=False)["state_dict"]
        torch.save({k[len("sequential_module."):]: v for k, v in state.items()}, out)
        s = trainer.strategy
        peak, base = ("device_peak", "device_base") if accelerator == "gpu" else ("peak", "base")
        held = [q[peak] - q[base] for q in s.memory_per_process()]
        with open(out + ".json", "w") as f:
            json.dump({"balance": s.balance, "microbatches": s.microbatches, "schedule": s.schedule,
                       "checkpoint": s.checkpoint, "replicas": s.replicas, "held": held, "predicted": s._predicted,
                       "budget": s.memory_per_device}, f)


if __name__ == "__main__":
    main()
