"""The engine's own work per micro-batch: a stage's forward against its layers called directly, on CPU.

One partition of ``layers`` x (Linear(width, width) + ReLU) runs the forward of one micro-batch three ways,
alternating, one intra-op thread, timed by thread CPU time (median over ``--repeats``):

- layers: the partition called directly (what any engine must compute);
- stage: ``Stage.forward`` as the pipeline runs it (saving what backward needs, which it frees after);
- stage under the random-number mode: the same with :class:`~lightning_pipe.engine.rng.StageRandom` installed, as
  it is for a partition that may draw random numbers (built-in layers that draw none run without it).

The differences are the engine's own work per micro-batch and what the mode adds to it. At a small width
the layers cost little and the engine's Python is what is measured; at a large one it is lost in the
matrix products.

    python benchmarks/bench_stage_overhead.py [--width 16] [--layers 4] [--rows 64] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import lightning_pipe.engine.stage as stage_module
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import split_module
from lightning_pipe.engine.rng import LazySeed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="Linear+ReLU blocks in the partition")
    parser.add_argument("--rows", type=int, default=64, help="rows of the micro-batch")
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    body = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    partition = split_module(body, [len(body)])[0]  # a Partition, as a pipeline's stages hold
    stage = stage_module.Stage(0, partition, torch.device("cpu"))
    x = torch.randn(args.rows, args.width)
    runs = iter(range(10**9))
    draws_no_random = stage_module.draws_no_random

    def layers() -> float:
        start = time.thread_time()
        partition(x)
        return time.thread_time() - start

    def staged(mode: bool) -> float:
        run = next(runs)
        stage_module.draws_no_random = (lambda module: False) if mode else draws_no_random
        try:
            start = time.thread_time()
            stage.forward(run, 0, Batch((x,), True), {}, seed=LazySeed(), save=True, checkpoint=False, last=False)
            spent = time.thread_time() - start
        finally:
            stage_module.draws_no_random = draws_no_random
        stage.release(run)
        return spent

    ways = {"layers": layers, "stage": lambda: staged(False), "stage under the mode": lambda: staged(True)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            times[name].append(way())
    median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"partition: {args.layers} x (Linear({args.width}, {args.width}) + ReLU), micro-batch of {args.rows} "
          f"rows, 1 thread; median of {args.repeats} forwards, thread CPU time")
    for name, value in median.items():
        extra = "" if name == "layers" else f"   engine's own work: {value - median['layers']:7.1f} us"
        print(f"{name:<22}{value:9.1f} us{extra}")


if __name__ == "__main__":
    main()
