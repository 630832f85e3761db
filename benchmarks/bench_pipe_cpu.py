"""Speed-up of ``Pipe`` over the unwrapped model on CPU, against the GPipe bound p·m/(m+p−1).

A balanced model is split into 2 partitions; the process uses one intra-op thread, so the unwrapped model
runs on one core and the pipe's partitions on one core each. Both are timed side by side in one run
(alternating, several rounds, median), training steps of forward + backward.

    python benchmarks/bench_pipe_cpu.py [--chunks 8] [--batch 1024] [--width 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_pipe import Pipe


def build(layers: int, width: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def step_time(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--checkpoint", default="never", choices=["always", "except_last", "never"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = build(args.layers, args.width)
    n = len(plain)
    pipe = Pipe(build(args.layers, args.width), [n // 2, n - n // 2], devices=["cpu", "cpu"],
                chunks=args.chunks, checkpoint=args.checkpoint)
    x = torch.randn(args.batch, args.width)
    step_time(plain, x, 1)  # warm-up
    step_time(pipe, x, 1)

    plain_times, pipe_times = [], []
    for _ in range(args.rounds):
        plain_times.append(step_time(plain, x, args.steps))
        pipe_times.append(step_time(pipe, x, args.steps))
    t_plain, t_pipe = statistics.median(plain_times), statistics.median(pipe_times)
    p, m = 2, min(args.chunks, args.batch)
    bound = p * m / (m + p - 1)
    speedup = t_plain / t_pipe
    print(f"model: {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, 2 partitions, "
          f"{m} micro-batches, checkpoint={args.checkpoint}, 1 intra-op thread")
    print(f"unwrapped step: {t_plain * 1e3:8.1f} ms")
    print(f"pipe step:      {t_pipe * 1e3:8.1f} ms")
    print(f"speed-up:       {speedup:8.2f}x   GPipe bound p*m/(m+p-1) = {bound:.2f}x   "
          f"ratio to bound: {speedup / bound:.1%}")


if __name__ == "__main__":
    main()
