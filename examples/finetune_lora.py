"""Fine-tune a Hugging Face causal language model with PEFT's LoRA adapters through PipeStrategy, offline; save the
adapters in PEFT's own format and load them back into the plain model.

    python examples/finetune_lora.py fit --config configs/finetune_lora/cpu.yaml

The model is a Hugging Face ``*ForCausalLM`` (``--model.pretrained DIR``, such as the ``hf_model/`` that
``examples/finetune_causal_lm.py`` writes; without it, a fresh Llama-style decoder over bytes), adapted by
``peft.get_peft_model`` with LoRA on the attention's projections, and made a pipeline body by
``to_sequential(peft_model.base_model.model)``: the adapters sit inside the blocks of every stage, the base frozen.
Only the adapters are optimized; checkpoints leave the frozen base out (``drop_frozen``, the base coming from its
own files on resume). ``--model.base_dtype bfloat16`` keeps the frozen base in bfloat16 and the adapters in
float32 (PEFT casts them up) under ``precision: 32-true``: Lightning's ``bf16-true`` would cast the adapters too.

After fitting, the adapters are written by ``lightning_pipe.models.save_adapters`` to ``<log dir>/adapter``
(``adapter_model.safetensors``, ``adapter_config.json``), then loaded with ``PeftModel.from_pretrained`` into the
plain model in this process, whose validation loss is printed beside the pipeline's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_causal_lm import TokenCorpus, decoder_config, next_token_loss  # noqa: E402

import lightning_pipe  # noqa: E402 - registers strategy="pipe"
from lightning_pipe.models import drop_frozen, save_adapters, to_sequential  # noqa: E402


def base_model(pretrained: str | None, config: Any, dtype: torch.dtype) -> Any:
    """The model to adapt: ``pretrained``'s, or a fresh one of ``config`` (seeded: the same in every process)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if pretrained is None:
        return AutoModelForCausalLM.from_config(config).to(dtype)
    return AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype)


class LoRACausalLM(LightningModule):
    """A causal LM adapted by LoRA, its whole network the pipelined body ``sequential_module``."""

    def __init__(self, pretrained: str | None = None, layers: int = 4, width: int = 128, heads: int = 4,
                 kv_heads: int = 2, context: int = 64, rank: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), lr: float = 3e-3,
                 base_dtype: str = "float32") -> None:
        super().__init__()
        self.save_hyperparameters()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig

        config = decoder_config(layers, width, heads, kv_heads, context) if pretrained is None else \
            AutoConfig.from_pretrained(pretrained)
        model = base_model(pretrained, config, getattr(torch, base_dtype))
        torch.manual_seed(1)  # the adapters' initial values: the same in every process
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                      target_modules=list(targets)))
        self.sequential_module = to_sequential(peft_model.base_model.model)  # the adapted model's own modules
        self.__dict__["peft_model"] = peft_model  # for save_adapters: kept out of the module tree
        self.strict_loading = False  # checkpoints hold the adapters, not the frozen base (drop_frozen)
        self.example_input_array = torch.zeros(4, context, dtype=torch.long)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.sequential_module(ids)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return lightning_pipe.loss_on_last_stage(self.sequential_module, x, y, next_token_loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        drop_frozen(checkpoint, self)  # the frozen base stays in its own files

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


class LoRACLI(LightningCLI):
    """Shows the validation loss before and after; writes the adapters in PEFT's format and checks them."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - LightningArgumentParser
        parser.link_arguments("model.context", "data.context")
        parser.link_arguments("model.pretrained", "data.pretrained")

    def _loss(self) -> float:
        return self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)[0]["val_loss"]

    def before_fit(self) -> None:
        loss = self._loss()
        if self.trainer.is_global_zero:
            print(f"validation loss before fine-tuning: {loss:.3f}", flush=True)

    def after_fit(self) -> None:
        loss = self._loss()
        directory = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "adapter"
        save_adapters(self.trainer, self.model.peft_model, str(directory))  # on every process, as a checkpoint
        if self.trainer.is_global_zero:
            print(f"validation loss after fine-tuning: {loss:.3f}", flush=True)
            print(f"adapters in PEFT's format: {directory}", flush=True)
            print(f"the plain model with them, no strategy: validation loss {self._plain_loss(directory):.3f}",
                  flush=True)

    def _plain_loss(self, directory: Path) -> float:
        """The validation loss of the plain base model with the saved adapters loaded by PEFT, in this process."""
        from peft import PeftModel

        h = self.model.hparams
        config = self.model.peft_model.base_model.model.config
        plain = PeftModel.from_pretrained(base_model(h.pretrained, config, getattr(torch, h.base_dtype)),
                                          str(directory)).eval()
        losses, sizes = [], []
        with torch.no_grad():
            for x, y in self.datamodule.val_dataloader():
                losses.append(float(next_token_loss(plain(input_ids=x).logits, y)) * len(x))
                sizes.append(len(x))
        return sum(losses) / sum(sizes)


def main() -> None:
    LoRACLI(LoRACausalLM, TokenCorpus, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
