"""fit, then validate, test and predict in one script through PipeStrategy (2 replicas x 2 stages).

    python phases.py OUT_DIR      writes OUT_DIR/phases.pt from the main process
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Model, data  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402


def main(out: str) -> None:
    config = {"log_metric": True, "validate": True, "epochs": 2, "samples": 32, "batch_size": 4}
    pl.seed_everything(7)
    model = Model(config)
    best = ModelCheckpoint(dirpath=os.path.join(out, "best"), monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=PipeStrategy(balance=[2, 2], microbatches=2),
                         max_epochs=2, logger=False, enable_progress_bar=False, callbacks=[best],
                         default_root_dir=out, num_sanity_val_steps=0)
    loader = DataLoader(data(model.config), batch_size=4)
    trainer.fit(model, loader, loader)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, loader, verbose=False)
    tested = trainer.test(model, loader, verbose=False)
    predicted = trainer.predict(model, loader)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    trainer.strategy.rpc_save_model(
        trainer, lambda t, path: torch.save(t.lightning_module.state_dict(), path), os.path.join(out, "whole.pt"))
    if trainer.is_global_zero:
        torch.save({"fit": fit_metrics, "best": best.best_model_path, "best_score": float(best.best_model_score),
                    "validate": validated, "test": tested,
                    "predict": torch.cat(predicted), "world_size": trainer.world_size}, os.path.join(out, "phases.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
