"""Fine-tune a Hugging Face causal language model through PipeStrategy, offline, with 1F1B and the loss on the
last stage, then write it back as a Hugging Face checkpoint.

    python examples/finetune_causal_lm.py fit --config configs/finetune_causal_lm/cpu.yaml

The model is a Hugging Face ``*ForCausalLM`` made a pipeline body by ``lightning_pipe.models.to_sequential``
(embeddings, one layer per decoder block, final norm and head). ``--model.pretrained DIR`` fine-tunes a Hugging
Face checkpoint directory (``config.json``, ``model.safetensors``, and ``tokenizer.json`` if it has its own
vocabulary; any architecture ``to_sequential`` takes); it is built on the ``meta`` device and receives the
file's weights by the model's names. Without it, a Llama-style decoder (RMSNorm, rotary positions, grouped-query
attention) is built from a config of the sizes given, over bytes (no pretrained decoder ships in a PyPI
package). The text is ``--data.corpus`` (the opening of *Coriolanus* shipped here), in windows of ``context``
tokens: bytes, or the checkpoint's tokens. ``--data.documents true`` trains on the text's speeches instead, each
a sequence of its own length (6 to 1,015 bytes, cut at ``context``), every batch padded to its own longest
(``pad_batch``, dynamic padding) and, with ``--data.group_by_length true``, batches of similar lengths
(``LengthGroupedSampler``): the pipeline carries any shape in each hand-off, so a batch of any length needs nothing
more. The validation loss and a sample continuing ``--data.prompt`` are
shown before and after; the fine-tuned model is written to ``<log dir>/hf_model`` in Hugging Face's format,
which ``--model.pretrained`` (or ``AutoModelForCausalLM.from_pretrained``) reads back.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import CORPUS, TextCorpus  # noqa: E402

import lightning_pipe  # noqa: E402 - registers strategy="pipe"


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the next token at every position but the padded ones (target -100, which
    ``cross_entropy`` ignores; module-level: it runs on the last stage)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pad_batch(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic padding (a DataLoader's ``collate_fn``): the inputs and targets of ``samples`` padded to the
    longest of this batch, not of the data (inputs with 0; targets with -100, which the loss ignores). With a
    decoder's causal attention, padding on the right changes nothing before it."""
    longest = max(len(x) for x, _ in samples)
    inputs = torch.zeros(len(samples), longest, dtype=torch.long)
    targets = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, (x, y) in enumerate(samples):
        inputs[row, :len(x)], targets[row, :len(y)] = x, y
    return inputs, targets


class LengthGroupedSampler(Sampler[int]):
    """The indices of samples of ``lengths`` shuffled, then sorted by length (longest first) within mega-batches of
    ``mega * batch_size``, as Hugging Face's ``group_by_length`` does, the batches of a mega-batch then shuffled:
    each batch holds samples of similar lengths, so dynamic padding pads little. A new order each pass, the same
    in every process (seeded by ``seed`` and the pass)."""

    def __init__(self, lengths: list[int], batch_size: int, mega: int = 50, seed: int = 0) -> None:
        self.lengths, self.batch, self.size, self.seed, self.passes = lengths, batch_size, mega * batch_size, seed, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):  # noqa: ANN204 - an iterator of ints
        generator = torch.Generator().manual_seed(self.seed + self.passes)
        self.passes += 1
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        for k in range(0, len(order), self.size):
            mega = sorted(order[k:k + self.size], key=lambda i: -self.lengths[i])
            batches = [mega[j:j + self.batch] for j in range(0, len(mega), self.batch)]
            for b in torch.randperm(len(batches), generator=generator).tolist():  # not longest to shortest
                yield from batches[b]


class Documents(Dataset):
    """``(input, next-token target)`` of each document of ``documents`` (lists of token ids) at its own length,
    one that is longer than ``context`` tokens cut into pieces of at most ``context``."""

    def __init__(self, documents: list[list[int]], context: int) -> None:
        self.pieces = [torch.tensor(doc[k:k + context + 1], dtype=torch.long) for doc in documents
                       for k in range(0, len(doc) - 1, context)]
        self.pieces = [piece for piece in self.pieces if len(piece) > 1]

    def lengths(self) -> list[int]:
        """Each sample's tokens."""
        return [len(piece) - 1 for piece in self.pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pieces[i][:-1], self.pieces[i][1:]


class Tokens:
    """Text ↔ token ids: the checkpoint's ``tokenizer.json`` where ``directory`` has one, else UTF-8 bytes."""

    def __init__(self, directory: str | None) -> None:
        path = Path(directory) / "tokenizer.json" if directory else None
        self.tokenizer = None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self.tokenizer.encode(text).ids if self.tokenizer else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        return self.tokenizer.decode(ids) if self.tokenizer else bytes(ids).decode("utf-8", errors="replace")


def decoder_config(layers: int, width: int, heads: int, kv_heads: int, context: int) -> Any:
    """A Llama-style decoder over bytes: ``layers`` blocks of ``width``, ``heads`` query and ``kv_heads`` key/value
    heads (grouped-query attention), the head untied from the embedding."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def causal_lm_body(pretrained: str | None, config: Any) -> nn.Sequential:
    """The body of ``pretrained``'s model, built on the meta device: under PipeStrategy each stage's process
    reads its own tensors from the checkpoint's files, and no process holds the whole model (``pretrained_body``);
    or of a fresh model of ``config`` (initialised as Hugging Face initialises it)."""
    from transformers import AutoModelForCausalLM

    from lightning_pipe.models import pretrained_body, to_sequential

    if pretrained is None:
        return to_sequential(AutoModelForCausalLM.from_config(config))
    return pretrained_body(pretrained)


class CausalLM(LightningModule):
    """A Hugging Face causal LM whose whole network is the pipelined body ``sequential_module``."""

    def __init__(self, pretrained: str | None = None, layers: int = 4, width: int = 128, heads: int = 4,
                 kv_heads: int = 2, context: int = 64, lr: float = 3e-3, weight_decay: float = 0.05,
                 max_new_tokens: int = 120, temperature: float = 0.8, export: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoConfig

        if pretrained is None:
            torch.manual_seed(0)  # the same fresh model in every process and every run
            self.hf_config = decoder_config(layers, width, heads, kv_heads, context)
        else:
            self.hf_config = AutoConfig.from_pretrained(pretrained)
        self.sequential_module = causal_lm_body(pretrained, self.hf_config)
        self.example_input_array = torch.zeros(4, context, dtype=torch.long)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(ids)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # next_token_loss(self(x), y) on one device; under PipeStrategy on the last stage
        return lightning_pipe.loss_on_last_stage(self.sequential_module, x, y, next_token_loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> list[list[int]]:
        """Continue each prompt of ``batch`` (token ids, one row per sample) by ``max_new_tokens`` tokens."""
        generator = torch.Generator().manual_seed(1234 + batch_idx)
        ids = batch
        for _ in range(self.hparams.max_new_tokens):
            logits = self(ids[:, -self.hparams.context:])[:, -1].float().cpu()
            probs = torch.softmax(logits / self.hparams.temperature, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).to(ids.device)], dim=1)
        return ids.tolist()

    def configure_optimizers(self) -> dict:
        decay = [p for n, p in self.named_parameters() if p.dim() == 2 and "embed" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr, betas=(0.9, 0.99))
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, pct_start=0.1,
                                                       total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def export(self, directory: str | Path) -> None:
        """Write the model in Hugging Face's format (``save_pretrained``): every stage's weights, by the model's
        names, loaded strictly into the Hugging Face model first."""
        from transformers import AutoModelForCausalLM

        from lightning_pipe.models import hf_state_dict

        model = AutoModelForCausalLM.from_config(self.hf_config)
        missing, unexpected = model.load_state_dict(hf_state_dict(self.sequential_module), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"the body's state is not the model's (missing: {missing}, unexpected: {unexpected})")
        model.save_pretrained(str(directory))
        tokenizer = Path(self.hparams.pretrained or "") / "tokenizer.json"
        if self.hparams.pretrained and tokenizer.is_file():
            shutil.copy(tokenizer, directory)


class TokenCorpus(TextCorpus):
    """A UTF-8 text as tokens (see :class:`Tokens`): the first 90% for training (a window at every token, or with
    ``documents`` each part between blank lines at its own length, batches padded to their longest and, with
    ``group_by_length``, of similar lengths), the rest for validation (windows); ``samples`` copies of ``prompt``
    to continue in ``predict``."""

    def __init__(self, corpus: str = str(CORPUS), pretrained: str | None = None, context: int = 64,
                 batch_size: int = 32, val_fraction: float = 0.1, prompt: str = "First Citizen:\n",
                 samples: int = 4, documents: bool = False, group_by_length: bool = False) -> None:
        super().__init__(corpus, context, batch_size, val_fraction, prompt, samples)  # saves every argument
        self.tokens = Tokens(pretrained)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.hparams.documents:  # the text's parts between blank lines (a play's speeches), each at its length
            text = Path(self.hparams.corpus).read_text(encoding="utf-8")
            training = text[:int(len(text) * (1 - self.hparams.val_fraction))]
            self.train_set = Documents([self.encode(part + "\n\n") for part in training.split("\n\n") if part.strip()],
                                       self.hparams.context)

    def train_dataloader(self) -> DataLoader:
        if not self.hparams.documents:
            return super().train_dataloader()
        if self.hparams.group_by_length:
            sampler = LengthGroupedSampler(self.train_set.lengths(), self.hparams.batch_size)
            return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler,
                              collate_fn=pad_batch, drop_last=True)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=pad_batch,
                          drop_last=True)

    def read(self, path: Path) -> list[int]:
        """The corpus at ``path`` as tokens."""
        return self.tokens.encode(path.read_text(encoding="utf-8"))

    def encode(self, text: str) -> list[int]:
        """``text`` as tokens."""
        return self.tokens.encode(text)


class FineTuneCLI(LightningCLI):
    """Shows the validation loss and a sample before and after fine-tuning; writes the Hugging Face checkpoint."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - LightningArgumentParser
        parser.link_arguments("model.context", "data.context")
        parser.link_arguments("model.pretrained", "data.pretrained")

    def _show(self, when: str) -> None:
        metrics = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        samples = self.trainer.predict(self.model, datamodule=self.datamodule)
        if self.trainer.is_global_zero:
            print(f"validation loss {when} fine-tuning: {metrics[0]['val_loss']:.3f}", flush=True)
            for k, ids in enumerate(samples[0] if samples else []):
                print(f"--- sample {when} fine-tuning {k + 1} ---\n{self.datamodule.tokens.decode(ids)}", flush=True)

    def before_fit(self) -> None:
        self._show("before")

    def after_fit(self) -> None:
        self._show("after")
        if self.model.hparams.export and self.trainer.is_global_zero:
            directory = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "hf_model"
            self.model.export(directory)
            print(f"Hugging Face checkpoint: {directory}", flush=True)


def main() -> None:
    FineTuneCLI(CausalLM, TokenCorpus, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
