"""Two models trained one after the other in one script: once the first is freed, so are its stages.

    python two_models.py OUT_DIR      writes OUT_DIR/stages.json from the main process
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import pytorch_lightning as pl
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Model, data  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402


def fit(out: str, seed: int) -> tuple[pl.Trainer, Model]:
    model = Model({"samples": 32, "batch_size": 8, "seed": seed})
    strategy = PipeStrategy(balance=[2, 2], microbatches=2, start_method="fork")  # the other process forked at fit
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(model, DataLoader(data(model.config), batch_size=8))
    return trainer, model


def main(out: str) -> None:
    first = fit(out, 1)
    trainer, _ = fit(out, 2)
    both = trainer.strategy.memory_per_process()[1]["stages"]
    del first
    gc.collect()
    deadline = time.monotonic() + 10  # the stages are told without waiting: give the message time to land
    while (left := trainer.strategy.memory_per_process()[1]["stages"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if trainer.is_global_zero:
        with open(os.path.join(out, "stages.json"), "w") as f:
            json.dump({"both": both, "left": left}, f)


if __name__ == "__main__":
    main(sys.argv[1])
