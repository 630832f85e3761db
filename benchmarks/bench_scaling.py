"""How a step's cost grows with the work: our engine and torch.distributed.pipelining as micro-batches go
8 -> 16 -> 32 -> 64 and processes 2 -> 4, CPU, one job per point holding both engines.

The model is ``bench_vs_pipelining.py --model comm``'s: one Linear(512) + ReLU per process, micro-batches of 64
rows (a batch of 64 x micro-batches), the loss (mean squared output) on the last stage, where the hand-offs are
most of the step. For each point (processes, micro-batches), one job alternates the two engines step by step
(the order reversed each round, a barrier before and after each step, timed on process 0), ``--pairs`` rounds per
schedule of ``--schedules``; each engine is taken at its faster schedule. The table gives the median step and
step / (m + p - 1) (what a schedule tick costs: with equal stages the step is m + p - 1 ticks); a straight line
fitted through each engine's steps at m = 8 .. 64 gives its cost per micro-batch (the slope) and per step (where it
meets m = 0). ``--plot PATH`` draws step time against micro-batches, one line per engine and process count, and
ours over theirs beside it (matplotlib).

    python benchmarks/bench_scaling.py [--pairs 8] [--plot docs/scaling.png]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
import warnings
from typing import Any

import torch
from bench_vs_pipelining import RPC_TIMEOUT, _start_ours, batch, halves, ours_step, their_schedule
from processes import run_processes

ENGINES = ("ours", "theirs")


def _point(rank: int, port: int, args: argparse.Namespace) -> Any:
    """One job at one point: both engines, alternating step by step; process 0's step times per engine and
    schedule."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    parts, ours, _, _ = _start_ours(rank, port, args)
    part = halves(args)[rank]
    theirs = {name: their_schedule(part, rank, args, name) for name in args.schedules}
    x, y = batch(args)

    def step(engine: str, name: str) -> None:
        if engine == "ours":
            if ours is not None:  # the other processes serve their stages from RPC threads meanwhile
                ours_step(ours, parts, x, y, args, name)
        elif rank == 0:
            theirs[name].step(x)
        elif rank == args.processes - 1:
            theirs[name].step(target=y, losses=[])
        else:
            theirs[name].step()

    times: dict[str, list[float]] = {f"{e} {n}": [] for e in ENGINES for n in args.schedules}
    for k in range(args.warmup + args.pairs):
        for name in args.schedules:
            for engine in ENGINES[:: 1 if k % 2 == 0 else -1]:
                dist.barrier()
                start = time.perf_counter()
                step(engine, name)
                if k >= args.warmup:
                    times[f"{engine} {name}"].append(time.perf_counter() - start)
                dist.barrier()
    if ours is not None:
        ours.close()
    rpc.shutdown(timeout=args.timeout)
    dist.destroy_process_group()
    return times


def _job(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    torch.set_num_threads(1)
    return _point(rank, port, args)


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """The least-squares line through (xs, ys): (where it meets x = 0, its slope)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def plot(path: str, args: argparse.Namespace, best: dict[tuple[int, int, str], float]) -> None:
    """Step time against micro-batches per engine and process count, and ours over theirs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for p, style in zip(args.process_counts, ("-", "--")):
        for engine, color in zip(ENGINES, ("tab:blue", "tab:orange")):
            left.plot(args.micro_batches, [best[(p, m, engine)] * 1e3 for m in args.micro_batches], style,
                      color=color, marker="o", label=f"{engine}, {p} processes")
        right.plot(args.micro_batches, [best[(p, m, "ours")] / best[(p, m, "theirs")] for m in args.micro_batches],
                   style, color="tab:blue", marker="o", label=f"{p} processes")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.micro_batches, [str(m) for m in args.micro_batches])
        ax.set_xlabel("micro-batches")
        ax.grid(alpha=0.3)
        ax.legend()
    left.set_ylabel("median step, ms")
    left.set_title("step time, each engine at its faster schedule")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_ylabel("ours / theirs")
    right.set_title("our step over theirs")
    fig.suptitle(f"1 x Linear({args.width}) + ReLU per process, 64 rows per micro-batch, 2-vCPU machine, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="8,16,32,64")
    parser.add_argument("--processes", default="2,4", help="process counts, comma-separated")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated; each engine's faster is used")
    parser.add_argument("--pairs", type=int, default=8, help="timed rounds per schedule and point")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plot", default=None, metavar="PATH", help="write the plot here (PNG)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it is killed")
    args = parser.parse_args()
    args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    args.process_counts = [int(p) for p in args.processes.split(",")]
    args.schedules = args.schedules.split(",")
    # What bench_vs_pipelining's pieces read: its ``--model comm``.
    args.model, args.loss, args.paired, args.target_width, args.vocab = "mlp", "last", 0, None, 0
    args.data_plane, args.transport = "auto", "uv"
    print(f"model: 1 x (Linear({args.width}) + ReLU) per process, {args.rows} rows per micro-batch, loss (mean "
          f"squared output) on the last stage; 1 intra-op thread per process; {args.pairs} rounds per schedule "
          f"({', '.join(args.schedules)}), engines alternating step by step in one job per point\n")
    start = time.perf_counter()
    best: dict[tuple[int, int, str], float] = {}
    print(f"{'processes':>9}{'micro-batches':>15}{'ours':>10}{'theirs':>10}{'ours/theirs':>13}"
          f"{'ours/tick':>11}{'theirs/tick':>13}   per schedule (ours, theirs)")
    for p in args.process_counts:
        for m in args.micro_batches:
            args.processes, args.layers, args.chunks, args.batch = p, p, m, args.rows * m
            times = run_processes(_job, p, args, timeout=args.timeout, label=f"p={p} m={m}")[0]
            med = {key: statistics.median(v) for key, v in times.items()}
            for engine in ENGINES:
                best[(p, m, engine)] = min(med[f"{engine} {n}"] for n in args.schedules)
            o, t = best[(p, m, "ours")], best[(p, m, "theirs")]
            each = "; ".join(f"{n} {med[f'ours {n}'] * 1e3:.1f}, {med[f'theirs {n}'] * 1e3:.1f}"
                             for n in args.schedules)
            print(f"{p:>9}{m:>15}{o * 1e3:>8.1f}ms{t * 1e3:>8.1f}ms{o / t:>13.3f}{o / (m + p - 1) * 1e3:>9.2f}ms"
                  f"{t / (m + p - 1) * 1e3:>11.2f}ms   {each}", flush=True)
    print("\na line through each engine's steps (step = per step + m x per micro-batch):")
    for p in args.process_counts:
        for engine in ENGINES:
            a, b = fit(args.micro_batches, [best[(p, m, engine)] for m in args.micro_batches])
            print(f"  {p} processes, {engine:<6}: {b * 1e3:.2f} ms per micro-batch, {a * 1e3:.1f} ms per step")
    if args.plot:
        plot(args.plot, args, best)
    print(f"wall time of the benchmark: {time.perf_counter() - start:.1f} s")
    every = sorted(best[(p, m, "ours")] / best[(p, m, "theirs")] for p in args.process_counts
                   for m in args.micro_batches)
    print(f"RESULT scaling_ours_over_theirs_median={statistics.median(every):.3f}")
    print(f"RESULT scaling_ours_over_theirs_max={every[-1]:.3f}")


if __name__ == "__main__":
    main()
