"""fit, then validate, test and predict in one script through PipeStrategy (2 replicas x 2 stages).

    python phases.py OUT_DIR [cpu|gpu]      writes OUT_DIR/phases.pt from the main process
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Model, data, placement  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402


def main(out: str, accelerator: str = "cpu") -> None:
    config = {"log_metric": True, "validate": True, "epochs": 2, "samples": 32, "batch_size": 4}
    pl.seed_everything(7)
    model = Model(config)
    # A buffer outside the state_dict, in a layer of stage 1: the gathered model must have it too.
    model.sequential_module[3].register_buffer("hint", torch.arange(4.0), persistent=False)
    best = ModelCheckpoint(dirpath=os.path.join(out, "best"), monitor="val_loss", save_top_k=1)
    every = ModelCheckpoint(dirpath=os.path.join(out, "epochs"), save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    devices, shared = placement(accelerator, 4)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices,
                         strategy=PipeStrategy(balance=[2, 2], microbatches=2, **shared),
                         max_epochs=2, logger=False, enable_progress_bar=False, callbacks=[best, every],
                         default_root_dir=out, num_sanity_val_steps=0)
    loader = DataLoader(data(model.config), batch_size=4)
    trainer.fit(model, loader, loader)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, loader, verbose=False)
    tested = trainer.test(model, loader, verbose=False)
    predicted = trainer.predict(model, loader)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))

    def save_whole(t: pl.Trainer, path: str) -> None:
        torch.save({**t.lightning_module.state_dict(), **dict(t.lightning_module.named_buffers())}, path)

    trainer.strategy.rpc_save_model(trainer, save_whole, os.path.join(out, "whole.pt"))
    # A new Trainer takes over the same pipeline and loads every stage's weights from a checkpoint.
    again = pl.Trainer(accelerator=accelerator, devices=devices,
                       strategy=PipeStrategy(balance=[2, 2], microbatches=4, **shared),
                       logger=False, enable_progress_bar=False, default_root_dir=out)
    retested = again.test(model, loader, ckpt_path=os.path.join(out, "epochs", "epoch=0.ckpt"), verbose=False)
    # The model in the script's hands, between Trainers: its state_dict is the whole model's (remote layers
    # included), and loading one into it reaches every stage, as with the unpipelined model.
    body = model.sequential_module
    state_after_retest = {k: v.clone() for k, v in model.state_dict().items()}  # local entries share storage
    model.load_state_dict(torch.load(os.path.join(out, "final.ckpt"), weights_only=False)["state_dict"])
    third = pl.Trainer(accelerator=accelerator, devices=devices,
                       strategy=PipeStrategy(balance=[2, 2], microbatches=4, **shared),
                       logger=False, enable_progress_bar=False, default_root_dir=out)
    reloaded = third.test(model, loader, verbose=False)
    if trainer.is_global_zero:
        torch.save({"fit": fit_metrics, "best": best.best_model_path, "best_score": float(best.best_model_score),
                    "validate": validated, "test": tested, "retested": retested,
                    "predict": torch.cat(predicted), "world_size": trainer.world_size,
                    "state_after_retest": state_after_retest, "reloaded": reloaded,
                    "indexing": {"len": len(body), "last": type(body[-1]).__name__, "slice": len(body[1:3]),
                                 "iter": [type(layer).__name__ for layer in body],
                                 "same": body[3] is getattr(body, "3")}},
                   os.path.join(out, "phases.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
