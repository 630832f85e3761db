"""A job whose model is wrong or whose stage 1 fails mid-training, for the tests of errors.

    python fail.py WHAT OUT_DIR     WHAT: forward | backward | kill | hang | interrupt | nan (stage 1 fails,
                                    dies, stops answering, is interrupted, or makes a NaN gradient
                                    under detect_anomaly=True) | no_body |
                                    not_sequential | bad_balance | no_example (a model that cannot be split) |
                                    sync_batchnorm | swa | pruning | backbone (Trainer settings or callbacks the
                                    strategy refuses) | refusals (all of the refused ones, in turn) |
                                    fused_scaler (a fused optimizer under a gradient scaler, refused at setup) |
                                    bare_backward (manual optimization calling loss.backward() with 2 replicas) |
                                    comm_hook (2 replicas, a DDP comm hook that raises when called) |
                                    lambda_loss (loss_on_last_stage given a lambda, which cannot reach stage 1) |
                                    slow (stage 1 takes 1.5 s a micro-batch, longer than LP_TIMEOUT in all:
                                    it must train, not time out)

The other processes are forked where the job reaches fit (LP_START_METHOD, default ``fork``: no second import of
Lightning); the tests of a killed or silent process start them as scripts (``popen``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Model, data  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe import PipeStrategy  # noqa: E402


class Breaks(nn.Module):
    """Raises in forward or backward from the third training step on."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        if self.where == "kill" and self.calls > 2 * 4:
            os.kill(os.getpid(), signal.SIGKILL)  # the stage's process dies mid-step
        if self.where == "hang" and self.calls > 2 * 4:
            time.sleep(3600)  # the stage's process stops answering
        if self.where == "interrupt" and self.calls == 2 * 4 + 1:
            open(os.environ["LP_MARK"], "w").close()  # tell the test training is under way
        if self.where == "interrupt" and self.calls > 2 * 4:
            time.sleep(0.5)  # still training when the interrupt comes, however loaded the machine (12 s left)
        if self.where == "slow" and self.training:
            time.sleep(1.5)
        if self.where == "forward" and self.calls > 2 * 4:  # 4 micro-batches a step
            raise ValueError(f"shape mismatch in layer 3 (input shape: {tuple(x.shape)})")
        if self.where == "nan" and self.calls > 2 * 4:
            return _NaNBackward.apply(x)
        return _Backward.apply(x) if self.where == "backward" and self.calls > 2 * 4 else x


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("non-finite gradient in layer 3")


class _NaNBackward(torch.autograd.Function):
    """Finite forward, a gradient of NaN: what an unstable layer does."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class BareBackward(Model):
    """Manual optimization that calls ``loss.backward()`` itself instead of ``self.manual_backward(loss)``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = nn.functional.mse_loss(self(x), y)
        loss.backward()
        opt.step()


class LambdaLoss(Model):
    """The loss on the last stage by a lambda: it cannot be pickled, so it cannot reach the last stage's process."""

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lightning_pipe.loss_on_last_stage(self.sequential_module, x, y,
                                                 lambda out, target: nn.functional.mse_loss(out, target))


def raising_hook(state, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001
    """A DDP comm hook that fails as soon as any stage's DDP calls it."""
    raise RuntimeError(f"the comm hook was called (bucket {bucket.index()} of a stage's DDP)")


def main(what: str, out: str) -> None:
    if what == "interrupt":
        # Ctrl+C in a terminal: the default handler, whatever the test runner's parent left (a shell's background
        # job, as CI may be, starts its commands with SIGINT ignored, which a process inherits).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # slow: 8 samples, one step (4 micro-batches of 1.5 s each on stage 1)
    config = {"samples": 8 if what == "slow" else 64, "batch_size": 8,
              "optimizer": "adam-fused" if what == "fused_scaler" else "sgd", "manual": what == "bare_backward",
              "last_stage_loss": what == "lambda_loss"}
    model = {"bare_backward": BareBackward, "lambda_loss": LambdaLoss}.get(what, Model)(config)
    balance = [2, 3] if what == "lambda_loss" else [2, 2]  # the loss on the last stage: its head ends the body
    plugins = []
    if what == "fused_scaler":
        from pytorch_lightning.plugins import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    if what in ("forward", "backward", "kill", "hang", "interrupt", "nan", "slow"):
        model.sequential_module = nn.Sequential(*list(model.sequential_module)[:3], Breaks(what))
    elif what == "no_body":
        del model.sequential_module
    elif what == "not_sequential":
        model.sequential_module = nn.ModuleList(list(model.sequential_module))
    elif what == "bad_balance":
        balance = [2, 3]
    elif what == "no_example":
        model.example_input_array = None
        balance = None
    devices = 4 if what in ("bare_backward", "comm_hook") else 2
    ddp = {"ddp_comm_hook": raising_hook, "find_unused_parameters": True, "bucket_cap_mb": 1,
           "broadcast_buffers": False} if what == "comm_hook" else {}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_epochs=1, logger=False, enable_progress_bar=False,
                         detect_anomaly=what == "nan", sync_batchnorm=what == "sync_batchnorm", plugins=plugins,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=out,
                         callbacks={"swa": [StochasticWeightAveraging(swa_lrs=0.01)],
                                    "pruning": [ModelPruning("l1_unstructured", amount=0.3)],
                                    "backbone": [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]}.get(what, []),
                         strategy=PipeStrategy(balance=balance, microbatches=4,
                                               rpc_timeout_sec=float(os.environ.get("LP_TIMEOUT", 20)),
                                               start_method=os.environ.get("LP_START_METHOD", "fork"), **ddp))
    trainer.fit(model, DataLoader(data(model.config), batch_size=8))


REFUSED = ("no_body", "not_sequential", "bad_balance", "no_example", "sync_batchnorm", "swa", "pruning", "backbone")


def refusals(out: str) -> None:
    """Every model or setting refused before any process starts, one after another in this process: each
    must fail in the launcher, having started no other process (which would set the launcher's variable)."""
    from lightning_pipe.transport.wire.session import PARENT_ENV

    for what in REFUSED:
        try:
            main(what, os.path.join(out, what))
        except Exception as exc:  # noqa: BLE001 - the refusal this case expects, reported to the test
            print(f"[refused {what}] {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        else:
            print(f"[not refused {what}]", flush=True)
            sys.exit(1)
        if PARENT_ENV in os.environ:
            print(f"[started processes {what}]", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "refusals":
        refusals(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
