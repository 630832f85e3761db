"""Peak memory per process, and step time, of a decoder body at 2 stages x t tensor ranks (t = 1, 2, 4), AdamW.

The body is a Llama made a body by ``lightning_pipe.models.to_sequential`` (``--blocks`` decoder blocks of width
``--width``, MLP ``--mlp``, vocabulary ``--vocab``), built under ``trainer.init_module()`` (each process materialises
its own stage alone) and split by the model's own Hugging Face plan: q, k, v, gate and up projections by columns,
o and down by rows, the embedding by rows of the vocabulary, the head by columns (gathered). The loss is taken on
the last stage (``loss_on_last_stage``: the logits never leave it). One replica: devices = 2 x t. Each job trains
``--steps`` steps of ``--microbatches`` micro-batches; every pipeline's driver reports the peak resident memory
(``VmHWM``) of every process of its pipeline once training is over, and when it starts (the stage built: at t > 1
materialised layer by layer, each layer split before the next is made; at t = 1 whole), the stage's training state
each holds (its parameters, as many gradients and AdamW's states, counted exactly), the most parameters it held
while building (counted), and the mean step time after the first two.

Printed, per process above the base every process has (torch and Lightning imported), and against t = 1 (the same
stage's process): in theory each of the stage's weights, gradients and AdamW's two states, and its activations,
divided by t, except what the plan leaves whole in every tensor rank (the RMS norms' weights, a handful of
vectors). ``RESULT`` lines give each t's worst process over t = 1's worst, each process over its own at t = 1, and
the step time over t = 1's (measured one job after another, on the same machine; with more processes than cores,
the step time measures the cores, not the split).

Every job runs with ``MALLOC_MMAP_THRESHOLD_=1048576`` (as ``bench_sharded_memory.py``: the peaks are what the
processes hold, not what glibc's heap keeps).

    python benchmarks/bench_tensor_parallel_memory.py [--sizes 1 2 4] [--width 512] [--blocks 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed.tensor.parallel  # noqa: F401 - imported before the base is taken, as transformers is
import transformers  # noqa: F401
from bench_large_model_memory import GiB, peak
from bench_sharded_memory import _job  # one job in its own session, its drivers' files read
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe.models  # noqa: F401


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token (sent to the last stage: top level)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class Decoder(pl.LightningModule):
    """A Llama's body (``to_sequential``), trained by AdamW on next-token prediction, its loss on the last stage."""

    def __init__(self, width: int, mlp: int, blocks: int, vocab: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        from lightning_pipe.models import to_sequential

        config = LlamaConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=blocks, vocab_size=vocab,
                             num_attention_heads=width // 64, num_key_value_heads=width // 64,
                             max_position_embeddings=512, tie_word_embeddings=False)
        self.sequential_module = to_sequential(LlamaForCausalLM(config))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import lightning_pipe

        ids, target = batch
        return lightning_pipe.loss_on_last_stage(self.sequential_module, ids, target, next_token_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class BuildPeaks(pl.Callback):
    """Every process's peak resident memory when training starts (its stage built, no step taken yet)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peaks = [peak(), *[p["peak"] for p in trainer.strategy.memory_per_process()[1:]]]


class StepTimes(pl.Callback):
    """When each training batch ended."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.ends.append(time.perf_counter())


def run(args: argparse.Namespace, size: int, out: str) -> None:
    """One job at ``size`` tensor ranks; every pipeline's driver writes its processes' peaks and the step time to
    ``out``/pipeline<k>.json."""
    from lightning_pipe import PipeStrategy

    pl.seed_everything(0)
    base = peak()  # the interpreter with torch and Lightning imported, before any model
    blocks = args.blocks
    strategy = PipeStrategy(balance=[1 + blocks // 2, blocks - blocks // 2 + 1], microbatches=args.microbatches,
                            tensor_parallel_size=size)
    times, built = StepTimes(), BuildPeaks()
    trainer = pl.Trainer(accelerator="cpu", devices=2 * size, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[times, built])
    with trainer.init_module():
        model = Decoder(args.width, args.mlp, blocks, args.vocab)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch * args.steps, args.length + 1), generator=g)
    trainer.fit(model, DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=args.batch))
    peaks = [peak(), *[p["peak"] for p in trainer.strategy.memory_per_process()[1:]]]
    # The stage's training state each process holds: its parameters (its shards of the split ones), as many
    # gradients, and AdamW's states for them, in bytes (float32).
    from lightning_pipe.transport.parallel.fsdp import held

    real = [p for p in model.sequential_module.parameters() if not p.is_meta]
    counts = [held(real, [o.optimizer if hasattr(o, "optimizer") else o for o in trainer.optimizers]),
              *[s["held"] for s in trainer.strategy._body.hosts.call("stats")]]
    state = [4 * (2 * c["parameters"] + c["optimizer"]) for c in counts]
    # While each process built its stage (t > 1: layer by layer, each split before the next is made): the most
    # parameter bytes it held at once, counted, and of its stage whole.
    building = [trainer.strategy._body.built, *[s["built"] for s in trainer.strategy._body.hosts.call("stats")]]
    counted = [4 * b["built"] if b else 4 * c["whole"] for b, c in zip(building, counts)]
    later = times.ends[2:]
    step = (later[-1] - later[0]) / (len(later) - 1) if len(later) > 1 else float("nan")
    with open(os.path.join(out, f"pipeline{trainer.global_rank}.json"), "w") as f:
        json.dump({"base": base, "peaks": peaks, "state": state, "step": step, "build_peaks": built.peaks,
                   "built": counted, "stage": [4 * c["whole"] for c in counts]}, f)


def state_bytes(width: int, mlp: int, blocks: int, vocab: int) -> tuple[float, float]:
    """The bytes of weights of the whole body and of what the plan leaves whole (the norms), float32."""
    block = 4 * width * width + 3 * width * mlp
    norms = (2 * blocks + 1) * width
    return 4.0 * (blocks * block + 2 * vocab * width + norms), 4.0 * norms


def main() -> None:
    """Run every size and print the peaks and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--mlp", type=int, default=1408)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--job", nargs=2, metavar=("SIZE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run(args, int(args.job[0]), args.job[1])
        return
    weights, whole = state_bytes(args.width, args.mlp, args.blocks, args.vocab)
    print(f"body: Llama, {args.blocks} blocks of width {args.width} (MLP {args.mlp}), vocabulary {args.vocab}: "
          f"{weights / GiB:.3f} GiB of float32 weights, {4 * weights / GiB:.3f} GiB of training state with AdamW "
          f"(2 stages: {2 * weights / GiB:.3f} GiB per stage); left whole by the plan: {whole / 2**10:.0f} KiB",
          flush=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    held: dict[int, list[float]] = {}
    state: dict[int, list[float]] = {}
    steps: dict[int, float] = {}
    building: dict[int, list[float]] = {}  # peak above base when training starts: the stage built
    counted: dict[int, list[float]] = {}  # the most parameter bytes held while building / the stage's whole
    for size in args.sizes:
        out = tempfile.mkdtemp(prefix="lp-bench-tp-")
        command = [sys.executable, os.path.abspath(__file__), *_passed(args), "--job", str(size), out]
        start = time.perf_counter()
        try:
            results = _job(command, size, out, "pipeline", args.timeout, env, f"t={size}")
        finally:
            shutil.rmtree(out, ignore_errors=True)
        # By stage, then tensor rank: pipeline k holds tensor rank k of every stage.
        held[size] = [result["peaks"][j] - result["base"] for j in range(2) for result in results]
        state[size] = [result["state"][j] for j in range(2) for result in results]
        steps[size] = sum(result["step"] for result in results) / size
        building[size] = [result["build_peaks"][j] - result["base"] for j in range(2) for result in results]
        counted[size] = [result["built"][j] / result["stage"][j] for j in range(2) for result in results]
        print(f"t={size} ({time.perf_counter() - start:5.1f} s): per process, stage 0's then stage 1's: peak above "
              f"base (GiB) {' '.join(f'{b / GiB:.3f}' for b in held[size])}; training state (parameters, gradients, "
              f"AdamW) {' '.join(f'{b / GiB:.3f}' for b in state[size])}; step {steps[size] * 1000:.0f} ms; built: "
              f"peak above base (GiB) {' '.join(f'{b / GiB:.3f}' for b in building[size])}, parameters held at most "
              f"/ the stage's {' '.join(f'{r:.3f}' for r in counted[size])}", flush=True)
    if 1 not in held:
        return
    for size in args.sizes:
        if size == 1:
            continue
        own = [b / held[1][j // size] for j, b in enumerate(held[size])]  # each process over its stage's at t = 1
        states = [b / state[1][j // size] for j, b in enumerate(state[size])]
        print(f"RESULT t={size}: training state per process / its stage's at t=1: "
              f"{' '.join(f'{r:.3f}' for r in states)} (theory {1 / size:.3f}, plus what stays whole); peak per "
              f"process / its stage's at t=1: {' '.join(f'{r:.3f}' for r in own)}; worst peak / t=1's worst = "
              f"{max(held[size]) / max(held[1]):.3f}; step time / t=1's = {steps[size] / steps[1]:.2f}")
        built = [b / building[1][j // size] for j, b in enumerate(building[size])]
        print(f"RESULT t={size} built: peak above base when training starts / its stage's at t=1 (built whole): "
              f"{' '.join(f'{r:.3f}' for r in built)}; parameters held at most while building / the stage's "
              f"{' '.join(f'{r:.3f}' for r in counted[size])} (layer by layer: its shards plus one layer whole)")


def _passed(args: argparse.Namespace) -> list[str]:
    """The job's arguments, as given to this run."""
    names = ("width", "mlp", "blocks", "vocab", "batch", "length", "microbatches", "steps")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


if __name__ == "__main__":
    main()
