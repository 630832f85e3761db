"""The README's quick start: a small regressor whose body trains as two pipeline stages in two processes (CPU).

    python examples/quickstart.py

The progress bar shows ``train_loss`` falling; at the end the main process prints the first and the last epoch's
mean loss. The targets are a function of the inputs (the sum of their first 8 features, scaled to unit variance),
so that there is something to learn.
"""

import lightning as L
import torch
from torch import nn

from lightning_pipe import PipeStrategy


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.sequential_module = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 1)  # outside the body: stays with stage 0
        self.epoch_losses, self.losses = [], []  # each epoch's mean loss; this epoch's losses

    def forward(self, x):
        return self.head(self.sequential_module(x))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def on_train_epoch_end(self):
        self.epoch_losses.append(sum(self.losses) / len(self.losses))
        self.losses.clear()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


L.seed_everything(0)
x = torch.randn(512, 32)
y = x[:, :8].sum(dim=1, keepdim=True) / 8**0.5
data = torch.utils.data.TensorDataset(x, y)
model = Model()
trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, strategy=PipeStrategy(balance=[2, 2], microbatches=8))
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=64))
if trainer.is_global_zero:  # the main process (the other one holds stage 1 and does not return from fit)
    print(f"mean loss: first epoch {model.epoch_losses[0]:.4f}, last epoch {model.epoch_losses[-1]:.4f}")
