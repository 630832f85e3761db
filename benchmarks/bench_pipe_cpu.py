"""Speed-up of ``Pipe`` over the unwrapped model on CPU, against the GPipe bound p·m/(m+p−1).

A balanced model is split into 2 partitions; the process uses one intra-op thread, so the unwrapped model
runs on one core and the pipe's partitions on one core each. Timed side by side in one run (alternating,
several rounds, median), training steps of forward + backward:

- unwrapped: the model on the whole batch;
- micro-batched: the model on the same micro-batches one after another (what the pipe computes, serially):
  its gap to ``unwrapped`` is the cost of smaller matrix products, not of the pipeline;
- pipe: ``Pipe`` with 2 partitions;
- and, for scale, the two halves' micro-batches run in two independent threads at once (no pipeline): how
  much parallel speed this machine's cores deliver at all (shared caches and memory bandwidth, or
  hyper-threads, can make two busy cores much slower than twice one).

    python benchmarks/bench_pipe_cpu.py [--chunks 8] [--batch 2048] [--width 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
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


def chunked_step_time(model: nn.Module, x: torch.Tensor, chunks: int, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        for piece in x.tensor_split(chunks):
            (model(piece).square().sum() / x.size(0)).backward()
    return (time.perf_counter() - start) / steps


def parallel_capacity(halves: list[nn.Module], x: torch.Tensor, chunks: int) -> float:
    """Speed-up of running the two halves' micro-batches in two threads at once over one after the other."""

    def work(model: nn.Module) -> None:
        torch.set_num_threads(1)
        for piece in x.tensor_split(chunks):
            model(piece).square().sum().backward()

    start = time.perf_counter()
    for half in halves:
        work(half)
    serial = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(half,)) for half in halves]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
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

    plain_times, chunked_times, pipe_times = [], [], []
    for _ in range(args.rounds):
        plain_times.append(step_time(plain, x, args.steps))
        chunked_times.append(chunked_step_time(plain, x, args.chunks, args.steps))
        pipe_times.append(step_time(pipe, x, args.steps))
    t_plain, t_pipe = statistics.median(plain_times), statistics.median(pipe_times)
    t_chunked = statistics.median(chunked_times)
    n_half = args.layers // 2
    halves = [nn.Sequential(*list(plain)[: 2 * n_half]), nn.Sequential(*list(plain)[2 * n_half:])]
    capacity = statistics.median(parallel_capacity(halves, x, args.chunks) for _ in range(3))
    p, m = 2, min(args.chunks, args.batch)
    bound = p * m / (m + p - 1)
    speedup = t_plain / t_pipe
    print(f"model: {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, 2 partitions, "
          f"{m} micro-batches, checkpoint={args.checkpoint}, 1 intra-op thread")
    print(f"unwrapped step:     {t_plain * 1e3:8.1f} ms")
    print(f"micro-batched step: {t_chunked * 1e3:8.1f} ms   (cost of micro-batching alone: "
          f"{t_chunked / t_plain - 1:+.1%})")
    print(f"pipe step:          {t_pipe * 1e3:8.1f} ms")
    print(f"speed-up:           {speedup:8.2f}x   GPipe bound p*m/(m+p-1) = {bound:.2f}x   "
          f"ratio to bound: {speedup / bound:.1%}")
    print(f"engine efficiency (speed-up over the micro-batched run / bound): {t_chunked / t_pipe / bound:.1%}")
    print(f"this machine: two independent threads run {capacity:.2f}x as fast as one (ideal 2.00x), so the "
          f"pipe's speed-up over the micro-batched run reaches {t_chunked / t_pipe / capacity:.0%} of what its "
          "cores deliver in parallel")


if __name__ == "__main__":
    main()
