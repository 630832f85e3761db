"""A whole Lightning training step through PipeStrategy against a hand-written torch.distributed.pipelining loop.

The same model, batches, loss, optimizer and micro-batch count on 2 processes (one intra-op thread each):

    ours:   ``Trainer.fit`` of a LightningModule whose ``training_step`` returns ``loss_on_last_stage(...)``, with
            ``PipeStrategy(schedule=..., microbatches=..., checkpoint=...)``: everything the Trainer does per batch
            (the next batch from the DataLoader, the hooks, the pipeline, the optimizer's step on every process,
            ``zero_grad``). ``--checkpoint never`` by default: pipelining recomputes nothing, and the strategy's own
            default (``except_last``, torchgpipe's) recomputes every micro-batch's forward but the last in backward,
            a third more compute on this body.
    theirs: what a user writes with pipelining: ``PipelineStage`` + ``ScheduleGPipe`` or ``Schedule1F1B`` over a gloo
            group (the loss on the last stage) and, per batch of the same DataLoader, ``schedule.step``, then
            ``optimizer.step()`` and ``optimizer.zero_grad()`` in each process.

``--clip C``: both clip the gradients by their global norm over every stage first (ours: the Trainer's
``gradient_clip_val``; theirs: each process's sum of squares, an all-reduce, and the scaling, as torchtitan does).
A step is timed on process 0 from one batch's start to the next's (ours: ``on_train_batch_start``, through a
callback; theirs: the loop's top), so each side pays everything its loop does between batches. Each round runs a
fresh job of each engine (order alternating); the ratio of their median steps is printed per round and over all
rounds, ending with ``RESULT trainer_step_ours_over_theirs=`` (below 1: ours faster). Both jobs' weights after
their last step are compared (they train the same model on the same batches).

    python benchmarks/bench_trainer_step.py [--schedule 1f1b] [--width 512] [--layers 2] [--batch 1024]
                                            [--chunks 16] [--steps 30] [--rounds 4]
                                            [--checkpoint never] [--clip 0.5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from processes import run_processes
from torch import nn

WARMUP = 3  # steps not timed: threads, connections, the optimizers' state


def build(args: argparse.Namespace) -> nn.Sequential:
    """``2 x layers`` x (Linear(width) + ReLU), ``layers`` for each process; the same weights everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(2 * args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())])


def loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """``WARMUP + steps`` batches of ``batch`` rows and a zero target (the loss: the mean squared output)."""
    g = torch.Generator().manual_seed(1)
    rows = args.batch * (WARMUP + args.steps)
    data = torch.utils.data.TensorDataset(torch.randn(rows, args.width, generator=g), torch.zeros(rows, args.width))
    return torch.utils.data.DataLoader(data, batch_size=args.batch)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=1e-3, momentum=0.9)


# ---------------------------------------------------------------------- ours: a Trainer in a process of its own
def ours(args: argparse.Namespace) -> dict[str, Any]:
    """``Trainer.fit`` through PipeStrategy on 2 processes (its launcher starts the second); process 0's steps."""
    import lightning.pytorch as pl

    from lightning_pipe import PipeStrategy, loss_on_last_stage

    class Body(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.sequential_module = build(args)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return loss_on_last_stage(self.sequential_module, x, y, loss_fn)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters())

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return loader(args)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

    clock, model = Clock(), Body()
    half = 2 * args.layers  # modules per process: its blocks' Linear and ReLU
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=WARMUP + args.steps, logger=False,
                         gradient_clip_val=args.clip or None,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[clock], strategy=PipeStrategy(balance=[half, half],
                                                                  microbatches=args.chunks, schedule=args.schedule,
                                                                  checkpoint=args.checkpoint))
    trainer.fit(model)
    times = [b - a for a, b in zip(clock.starts, clock.starts[1:])][WARMUP:]
    return {"times": times, "weight": model.sequential_module[0].weight.detach().sum().item()}


# ---------------------------------------------------------------------- theirs: the loop a user writes
def _theirs(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from lightning_pipe.engine import split_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        parts = split_module(build(args), [2 * args.layers] * 2)
        part = nn.Sequential(*parts[rank])
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule](stage, args.chunks, loss_fn=loss_fn)
        opt = optimizer(part.parameters())
        starts = []
        for x, y in loader(args):
            starts.append(time.perf_counter())
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            if args.clip:  # by the global norm over both processes' gradients
                grads = [p.grad for p in part.parameters() if p.grad is not None]
                total = torch.stack([g.square().sum() for g in grads]).sum()
                dist.all_reduce(total)
                coefficient = args.clip / (float(total.sqrt()) + 1e-6)
                if coefficient < 1.0:
                    for g in grads:
                        g.mul_(coefficient)
            opt.step()
            opt.zero_grad()
        starts.append(time.perf_counter())
        dist.barrier()
        weight = part[0].weight.detach().sum().item() if rank == 0 else None
        return {"times": [b - a for a, b in zip(starts, starts[1:])][WARMUP:], "weight": weight}
    finally:
        dist.destroy_process_group()


def run(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``engine``: ours in a fresh interpreter (the Trainer's launcher starts its processes), theirs in 2
    spawned processes."""
    if engine == "theirs":
        return run_processes(_theirs, 2, args, timeout=args.timeout, label="theirs")[0]
    command = [sys.executable, __file__, "--job", *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("JOB ")]
    if done.returncode or not lines:
        raise RuntimeError(f"our job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"],
                        help="ours: which micro-batches recompute their forward in backward (theirs: none)")
    parser.add_argument("--clip", type=float, default=0.0, help="clip by the global norm to this (0: no clipping)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1, help="Linear + ReLU blocks per process")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per job (after 3 untimed)")
    parser.add_argument("--rounds", type=int, default=4, help="jobs per engine, order alternating")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job before it is ended")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one job of ours, in this process
    args = parser.parse_args()
    if args.job:
        print("JOB " + json.dumps(ours(args)), flush=True)
        return
    if args.batch % args.chunks:
        parser.error(f"--batch {args.batch} must be a multiple of --chunks {args.chunks} (equal micro-batches)")
    print(f"model: {2 * args.layers} x (Linear({args.width}) + ReLU), {args.layers} per process; batch {args.batch}, "
          f"{args.chunks} micro-batches, {args.schedule}, the loss on the last stage, SGD with momentum, ours with "
          f"checkpoint={args.checkpoint!r}{f', clipped by the global norm to {args.clip:g}' if args.clip else ''}; "
          "2 processes, "
          f"1 intra-op thread each; {args.steps} steps timed per job after {WARMUP}, {args.rounds} rounds\n")
    start = time.perf_counter()
    steps: dict[str, list[float]] = {"ours": [], "theirs": []}
    ratios, weights = [], {}
    for r in range(args.rounds):
        medians = {}
        for engine in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            out = run(engine, args)
            steps[engine] += out["times"]
            medians[engine] = statistics.median(out["times"])
            weights.setdefault(engine, out["weight"])
        ratios.append(medians["ours"] / medians["theirs"])
        print(f"round {r + 1}: ours {medians['ours'] * 1e3:6.2f} ms   theirs {medians['theirs'] * 1e3:6.2f} ms a step"
              f"   ours/theirs {ratios[-1]:.3f}", flush=True)
    ours_ms, theirs_ms = (statistics.median(steps[e]) * 1e3 for e in ("ours", "theirs"))
    print(f"\nmedian step over every round: ours {ours_ms:.2f} ms, theirs {theirs_ms:.2f} ms; per round "
          f"{min(ratios):.3f}-{max(ratios):.3f}")
    print(f"same training? the sum of stage 0's first weight after the last step: ours {weights['ours']:.7e}, "
          f"theirs {weights['theirs']:.7e}")
    print(f"wall time of the benchmark: {time.perf_counter() - start:.0f} s")
    print(f"RESULT trainer_step_ours_over_theirs={ours_ms / theirs_ms:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
