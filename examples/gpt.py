"""Train a small GPT-style language model through PipeStrategy on the text corpus shipped here, then sample.

    python examples/gpt.py fit --config configs/gpt/cpu.yaml

The model reads bytes (a vocabulary of 256, so any UTF-8 text works: ``--data.corpus PATH``) and is an
``nn.Sequential`` of token+position embeddings → transformer blocks (pre-norm causal self-attention and an
MLP, with residuals) → a final norm and the output projection, which PipeStrategy cuts into stages. The
output projection is not tied to the embedding: stages share no parameters. The loss is computed on the last
stage, where the logits are born (``lightning_pipe.loss_on_last_stage``): only losses travel back, and the
configs run the 1F1B schedule. The validation loss is shown before and after training, and the trained model
writes a few samples from a prompt.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_pipe  # registers strategy="pipe"

CORPUS = Path(__file__).parent / "data" / "shakespeare.txt"
VOCAB = 256  # bytes


@lightning_pipe.pure_backward_layer  # torch operations only: backward may run in two parts
class Embeddings(nn.Module):
    """Token ids (batch, time) → token + learned position embeddings (batch, time, width)."""

    def __init__(self, width: int, context: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


@lightning_pipe.pure_backward_layer  # torch operations only: backward may run in two parts
class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a GELU MLP, each residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width must be a multiple of heads (width: {width}, heads: {heads})")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              dropout_p=self.p if self.training else 0.0)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.norm2(x)))


@lightning_pipe.pure_backward_layer  # torch operations only: backward may run in two parts
class Head(nn.Module):
    """Final layer norm and the projection to next-byte logits (batch, time, 256)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the next byte at every position (module-level: it runs on the last stage)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT(LightningModule):
    """A decoder-only transformer whose whole network is the pipelined body ``sequential_module``."""

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, context: int = 64, dropout: float = 0.1,
                 lr: float = 3e-3, weight_decay: float = 0.05, max_new_bytes: int = 200,
                 temperature: float = 0.8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.sequential_module = nn.Sequential(Embeddings(width, context, dropout),
                                               *[Block(width, heads, dropout) for _ in range(layers)], Head(width))
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("proj.weight", "mlp.2.weight")):  # residual outputs, scaled by depth
                    p.data.mul_(1 / math.sqrt(2 * layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        self.example_input_array = torch.zeros(4, context, dtype=torch.long)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(ids)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # the same as next_byte_loss(self(x), y) on one device; under PipeStrategy on the last stage
        return lightning_pipe.loss_on_last_stage(self.sequential_module, x, y, next_byte_loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> list[str]:
        """Continue each prompt of ``batch`` (byte ids, one row per sample) by ``max_new_bytes`` bytes."""
        generator = torch.Generator().manual_seed(1234 + batch_idx)
        ids = batch
        for _ in range(self.hparams.max_new_bytes):
            logits = self(ids[:, -self.hparams.context:])[:, -1].float().cpu()
            probs = torch.softmax(logits / self.hparams.temperature, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).to(ids.device)], dim=1)
        return [bytes(row.tolist()).decode("utf-8", errors="replace") for row in ids]

    def configure_optimizers(self) -> dict:
        decay = [p for n, p in self.named_parameters() if p.dim() == 2 and "tokens" not in n and "positions" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() == 2 and "tokens" not in n and
                                                              "positions" not in n)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr, betas=(0.9, 0.99))
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, pct_start=0.1,
                                                       total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Windows(Dataset):
    """(input, next-byte target) pairs of ``context`` bytes starting every ``stride`` bytes of ``data``."""

    def __init__(self, data: torch.Tensor, context: int, stride: int) -> None:
        if len(data) <= context:
            raise ValueError(f"the text has {len(data)} bytes, too few for windows of context={context} + 1; "
                             "use a longer corpus or a smaller context")
        self.data, self.context = data, context
        self.starts = range(0, len(data) - context, stride)  # each window needs context + 1 bytes

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[self.starts[i]:self.starts[i] + self.context + 1]
        return window[:-1], window[1:]


class TextCorpus(LightningDataModule):
    """A UTF-8 text as bytes: the first 90% for training (a window at every byte), the rest for validation;
    ``samples`` copies of ``prompt`` to continue in ``predict``."""

    def __init__(self, corpus: str = str(CORPUS), context: int = 64, batch_size: int = 32,
                 val_fraction: float = 0.1, prompt: str = "First Citizen:\n", samples: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def read(self, path: Path) -> list[int]:
        """The corpus at ``path`` as the model's inputs: its bytes."""
        return list(path.read_bytes())

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's inputs: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def setup(self, stage: str) -> None:
        path = Path(self.hparams.corpus)
        if not path.is_file():
            raise FileNotFoundError(f"no corpus at {path}: --data.corpus takes the path of a UTF-8 text file")
        data = torch.tensor(self.read(path), dtype=torch.long)
        split = int(len(data) * (1 - self.hparams.val_fraction))
        context = self.hparams.context
        self.train_set = Windows(data[:split], context, stride=1)
        self.val_set = Windows(data[split:], context, stride=context)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        prompt = torch.tensor(self.encode(self.hparams.prompt), dtype=torch.long)
        return DataLoader([prompt] * self.hparams.samples, batch_size=self.hparams.samples)


class LanguageModelCLI(LightningCLI):
    """Shows the validation loss before and after training, then samples from the trained model."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - LightningArgumentParser
        parser.link_arguments("model.context", "data.context")

    def before_fit(self) -> None:
        before = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            print(f"validation loss before training: {before[0]['val_loss']:.3f}", flush=True)

    def after_fit(self) -> None:
        after = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        samples = self.trainer.predict(self.model, datamodule=self.datamodule)
        if self.trainer.is_global_zero:
            print(f"validation loss after training: {after[0]['val_loss']:.3f}", flush=True)
            for k, text in enumerate(samples[0] if samples else []):
                print(f"--- sample {k + 1} ---\n{text}", flush=True)


def main() -> None:
    LanguageModelCLI(GPT, TextCorpus, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
