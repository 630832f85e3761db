"""Peak memory per process for a body no process should hold whole: plain training beside pipelines of p stages.

A LightningModule whose body is ``layers`` × ``Linear(width, width)`` (16 × 4096 by default: 1.07 GB of float32
weights; with AdamW's two states and the gradients, ~4.3 GB of training state) is built under
``trainer.init_module()`` (on one device: built in place; under ``PipeStrategy``: recorded on the meta device and
each stage materialised in its own process), trained for 2 steps, and saved with ``trainer.save_checkpoint``, as
one file (``state_dict_type="full"``, streamed stage by stage) and as a sharded directory. Every run is its own
job; at its end each of its processes reports its peak resident memory (``VmHWM``). Printed: each process's
peak; the main process's and the largest other stage's beside one stage's share of the training state
(weights + gradients + AdamW's two states, ``/ p``), and beside the plain process; all above the base every
process has (torch and Lightning imported).

    python benchmarks/bench_large_model_memory.py [--layers 16] [--width 4096] [--stages 2 4] [--no-plain]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GiB = 2**30


class Body(pl.LightningModule):
    """``layers`` × Linear(width, width) with ReLU between, trained by AdamW on a regression loss."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                                 for _ in range(layers)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def peak() -> int:
    """This process's peak resident memory (bytes)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run(layers: int, width: int, stages: int, state_dict_type: str, out: str) -> None:
    """One job: build, 2 steps, save; the main process writes every process's peak to ``out``/peaks.json."""
    from lightning_pipe import PipeStrategy

    pl.seed_everything(0)
    base = peak()  # the interpreter with torch and Lightning imported, before any model
    kwargs: dict = {"accelerator": "cpu", "devices": 1}
    if stages > 1:
        kwargs = {"accelerator": "cpu", "devices": stages,
                  "strategy": PipeStrategy(balance=[layers // stages] * stages, microbatches=2,
                                           state_dict_type=state_dict_type)}
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **kwargs)
    with trainer.init_module():
        model = Body(layers, width)
    data = TensorDataset(torch.randn(16, width), torch.randn(16, width))
    trainer.fit(model, DataLoader(data, batch_size=8))
    trainer.save_checkpoint(os.path.join(out, "model.ckpt"))
    if trainer.is_global_zero:
        remote = [p["peak"] for p in trainer.strategy.memory_per_process()[1:]] if stages > 1 else []
        with open(os.path.join(out, "peaks.json"), "w") as f:
            json.dump({"base": base, "peaks": [peak(), *remote]}, f)


def main() -> None:
    """Run plain, then each number of stages with each checkpoint format, and print the peaks and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the plain process (it needs the whole training state at once)")
    parser.add_argument("--job", nargs=3, metavar=("STAGES", "FORMAT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run(args.layers, args.width, int(args.job[0]), args.job[1], args.job[2])
        return
    size = args.layers * (args.width * args.width + args.width) * 4
    print(f"body: {args.layers} x Linear({args.width}) = {size / GiB:.2f} GiB float32 weights, AdamW")
    jobs = ([] if args.no_plain else [(1, "full")]) + [(p, kind) for p in args.stages for kind in ("full", "sharded")]
    results = {}
    for stages, kind in jobs:
        out = tempfile.mkdtemp(prefix="lp-bench-memory-")
        command = [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--width",
                   str(args.width), "--job", str(stages), kind, out]
        start = time.perf_counter()
        try:
            # Its own session: on a timeout every process of the job is ended, by the job's group id.
            proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            try:
                _, err = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.communicate()
                raise SystemExit(f"p={stages} {kind}: no result within {args.timeout:.0f} s") from None
            if proc.returncode != 0:
                raise SystemExit(f"p={stages} {kind} failed:\n{err[-3000:]}")
            with open(os.path.join(out, "peaks.json")) as f:
                results[stages, kind] = json.load(f)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        peaks = results[stages, kind]["peaks"]
        print(f"p={stages} {kind:7s} ({time.perf_counter() - start:5.1f} s): peak per process (GiB) "
              + " ".join(f"{b / GiB:.2f}" for b in peaks), flush=True)
    state = 4 * size  # weights, gradients and AdamW's two states
    print(f"\ntraining state: {state / GiB:.2f} GiB (weights, gradients, AdamW's two states); above each process's "
          f"base (torch and Lightning imported, {results[jobs[0]]['base'] / GiB:.2f} GiB)")
    plain = results[1, "full"]["peaks"][0] - results[1, "full"]["base"] if (1, "full") in results else None
    if plain is not None:
        print(f"plain process: {plain / GiB:.2f} GiB = {plain / state:.2f} x the training state")
    for (stages, kind), result in results.items():
        if stages == 1:
            continue
        peaks = [p - result["base"] for p in result["peaks"]]
        share = state / stages
        line = (f"RESULT p={stages} {kind}: main/(state/p)={peaks[0] / share:.2f} "
                f"largest stage/(state/p)={max(peaks[1:]) / share:.2f} "
                f"main/largest stage={peaks[0] / max(peaks[1:]):.2f} "
                f"overhead over state/p: main {(peaks[0] - share) / GiB:+.2f} GiB, stages "
                f"{(max(peaks[1:]) - share) / GiB:+.2f} GiB")
        if plain is not None:
            line += f" main/plain={peaks[0] / plain:.2f} largest stage/plain={max(peaks[1:]) / plain:.2f}"
        print(line)

if __name__ == "__main__":
    main()
