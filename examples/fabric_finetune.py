"""Fine-tune a decoder with Lightning Fabric through a pipeline, in the shape of LitGPT's fine-tuning scripts.

    python examples/fabric_finetune.py                       # 2 CPU processes, a LitGPT GPT (or a Llama) from scratch
    python examples/fabric_finetune.py --devices 4 --accelerator gpu --precision bf16-mixed

The loop is Fabric's own: ``fabric.launch(main)``, the model built under ``fabric.init_module()`` (each stage
materialised in its own process), ``fabric.setup``, ``fabric.setup_dataloaders``, the loss computed on the last
stage under 1F1B (``loss_on_last_stage``), ``fabric.backward`` under ``fabric.no_backward_sync`` while accumulating,
``fabric.clip_gradients`` (by the norm over every stage), a warm-up then cosine learning-rate schedule, and
``fabric.save``. What changes from a LitGPT script run with ``--devices N`` (FSDP): the strategy
(``PipeStrategy(balance=..., microbatches=..., schedule="1f1b")``), the model made a body
(``to_sequential(GPT(config))``), and the loss (``loss_on_last_stage``). The model is LitGPT's ``GPT`` where
``litgpt`` is installed (``pip install --no-deps litgpt==0.5.13``), else a Hugging Face Llama of the same shape;
``--checkpoint`` continues from a file this script saved. The text is the opening of *Coriolanus*, as bytes.

It prints the validation loss before and after, saves ``<out>/final.pt`` (the plain model's state, by the model's
names, with the optimizer's), and scores the plain model loaded from it in this process, with no strategy.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import CORPUS, Windows  # noqa: E402

from lightning_pipe import PipeStrategy, loss_on_last_stage  # noqa: E402
from lightning_pipe.models import to_sequential  # noqa: E402


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the next byte (module-level: it runs on the last stage)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(args: argparse.Namespace) -> nn.Module:
    """LitGPT's ``GPT`` of a small Llama-style config over bytes, or Hugging Face's Llama where LitGPT is missing."""
    try:
        from litgpt import GPT, Config
    except ImportError:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=args.width, num_hidden_layers=args.layers,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=args.width * 8 // 3, tie_word_embeddings=False,
                                            max_position_embeddings=args.context, bos_token_id=None,
                                            eos_token_id=None, pad_token_id=None))
    config = Config(name="byte-llama", block_size=args.context, vocab_size=256, padded_vocab_size=256,
                    n_layer=args.layers, n_head=4, n_query_groups=2, n_embd=args.width, rotary_percentage=1.0,
                    parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    intermediate_size=args.width * 8 // 3)
    return GPT(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """A linear warm-up, then a cosine decay to a tenth (LitGPT's schedule)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def validate(fabric: L.Fabric, model: Any, loader: DataLoader) -> float:
    """The mean next-byte loss over ``loader``, through the pipeline (averaged over the replicas)."""
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for x, y in loader:
            total += loss_on_last_stage(model, x, y, next_token_loss).detach().cpu() * len(x)
            count += len(x)
    return float(fabric.all_reduce(total / count, reduce_op="mean"))


def main(fabric: L.Fabric, args: argparse.Namespace) -> None:
    """Fine-tune, save, and score the plain model from the saved file."""
    fabric.seed_everything(args.seed)
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    split = int(len(data) * 0.9)
    train = DataLoader(Windows(data[:split], args.context, stride=1), batch_size=args.micro_batch_size,
                       shuffle=True, drop_last=True)
    val = DataLoader(Windows(data[split:], args.context, stride=args.context), batch_size=args.micro_batch_size)
    train, val = fabric.setup_dataloaders(train, val)
    with fabric.init_module(empty_init=args.checkpoint is not None):
        body = to_sequential(build_model(args))  # embeddings, one layer per block, the head
    optimizer = torch.optim.AdamW(body.parameters(), lr=args.lr, weight_decay=0.02, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(body, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_at, args=args))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.checkpoint:
        fabric.load(args.checkpoint, state)
    fabric.print(f"validation loss before fine-tuning: {validate(fabric, model, val):.3f}")
    batches = iter(train)
    while state["step"] < args.steps:
        for k in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(train)
                x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=k < args.accumulate - 1):
                loss = loss_on_last_stage(model, x, y, next_token_loss)  # 1F1B: the loss on the last stage
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        if state["step"] % args.log_every == 0:
            fabric.print(f"step {state['step']}: train loss {float(loss.detach()):.3f}")
    after = validate(fabric, model, val)
    fabric.print(f"validation loss after fine-tuning: {after:.3f}")
    path = os.path.join(args.out, "final.pt")
    fabric.save(path, state)
    if fabric.global_rank == 0:  # the file is the plain model's: it loads with no strategy at all
        plain = to_sequential(build_model(args))
        plain.load_state_dict(torch.load(path, weights_only=True)["model"])
        with torch.no_grad():
            losses = [(float(next_token_loss(plain(x), y)), len(x)) for x, y in
                      DataLoader(Windows(data[split:], args.context, stride=args.context), batch_size=16)]
        plain_loss = sum(value * n for value, n in losses) / sum(n for _, n in losses)
        print(f"saved {path}; the plain model loaded from it: validation loss {plain_loss:.3f}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's arguments (LitGPT's names where it has them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes: stages x replicas")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--balance", type=int, nargs="+", default=[3, 3], help="layers per stage")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--micro_batch_size", type=int, default=16, help="samples per replica per backward")
    parser.add_argument("--accumulate", type=int, default=2, help="backwards per optimizer step")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log_every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--checkpoint", default=None, help="a final.pt this script saved, to continue from")
    parser.add_argument("--out", default="out/fabric_finetune")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    strategy = PipeStrategy(balance=arguments.balance, microbatches=arguments.microbatches, schedule="1f1b")
    fabric = L.Fabric(accelerator=arguments.accelerator, devices=arguments.devices, strategy=strategy,
                      precision=arguments.precision)
    fabric.launch(main, arguments)
