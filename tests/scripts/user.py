"""A user's program, in a fresh process: ``import lightning_pipe`` first, then one of Lightning's packages.

    python user.py PACKAGE HOW OUT_DIR

PACKAGE is ``lightning`` (``import lightning as L``, as Lightning's docs write it) or ``pytorch_lightning``. HOW:

- ``string``: ``Trainer(strategy="pipe")``: registered by ``import lightning_pipe`` alone, before the package;
- ``early``: ``PipeStrategy(balance=...)`` made before the package is imported (so for the default package),
  then given to PACKAGE's Trainer;
- ``plain``: one device, the reference;
- ``resume``: ``Trainer(strategy="pipe")``, 2 epochs of 4 steps uninterrupted, then the same model trained for its
  first epoch, saved, and resumed from that file by a new Trainer for its second (``fit(ckpt_path=...)``).

Trains 2 processes (the plain run one) for 4 steps and writes, from the main process, OUT_DIR/final.ckpt,
OUT_DIR/final.pt (the plain model's weights, loaded from it) and OUT_DIR/result.json (the Trainer's and the
strategy's modules). ``resume`` writes final.pt from the resumed run and uninterrupted.pt beside it.
"""

from __future__ import annotations

import json
import os
import sys

import lightning_pipe

package, how, out = sys.argv[1:4]
early = lightning_pipe.PipeStrategy(balance=[3, 2], microbatches=2) if how == "early" else None
if package == "lightning":
    import lightning as L
else:
    import pytorch_lightning as L  # noqa: N812 - the same name for both packages
import torch  # noqa: E402 - after the package, as the program chose
from torch import nn  # noqa: E402


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                               nn.Linear(16, 1))
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def resume() -> None:
    """8 steps uninterrupted, then 4 + 4 resumed from a checkpoint, each from the same seed (see the docstring)."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1)),
                                       batch_size=8)
    steps = {}
    for run, epochs, ckpt in (("uninterrupted", 2, None), ("first", 1, None), ("final", 2, "first.ckpt")):
        L.seed_everything(3)
        model = Model()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="pipe", max_epochs=epochs, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, data, ckpt_path=ckpt and os.path.join(out, ckpt))
        trainer.save_checkpoint(os.path.join(out, f"{run}.ckpt"))
        steps[run] = trainer.global_step
    if trainer.is_global_zero:
        for run in ("uninterrupted", "final"):
            loaded = Model.load_from_checkpoint(os.path.join(out, f"{run}.ckpt"), map_location="cpu")
            torch.save(loaded.state_dict(), os.path.join(out, f"{run}.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"trainer": type(trainer).__module__, "strategy": type(trainer.strategy).__module__,
                       "steps": steps}, f)


if __name__ == "__main__" and how == "resume":
    resume()
elif __name__ == "__main__":
    L.seed_everything(3)
    model = Model()
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    strategy = {"string": "pipe", "early": early, "plain": "auto"}[how]
    trainer = L.Trainer(accelerator="cpu", devices=1 if how == "plain" else 2, strategy=strategy, max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    if trainer.is_global_zero:  # the checkpoint loads into the plain model, with no strategy
        loaded = Model.load_from_checkpoint(os.path.join(out, "final.ckpt"), map_location="cpu")
        torch.save(loaded.state_dict(), os.path.join(out, "final.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"trainer": type(trainer).__module__, "strategy": type(trainer.strategy).__module__,
                       "balance": getattr(trainer.strategy, "balance", None), "steps": trainer.global_step}, f)
