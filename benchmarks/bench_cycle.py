"""Where a short 1F1B step's time goes at 2 processes: the cycle of one micro-batch through both stages, traced.

Under 1F1B with 2 stages, the last stage (process 1) runs F(i), B(i), F(i+1), B(i+1), ... and stage 0 (process 0)
runs ... B(i-1), F(i+1), B(i), F(i+2): the last stage's next forward needs stage 0's output of it, which stage 0
makes only after the backward whose gradient the last stage sent a forward and a backward earlier. So each
micro-batch's cycle is the longer of the last stage's own forward and backward and the loop through stage 0 (the
gradient's hand-off, stage 0's backward and next forward, the output's hand-off): every microsecond a hand-off or
an action's Python costs on that loop lengthens the step once it is the longer.

Ours alone (``bench_vs_pipelining.py --model comm``'s body: one Linear(512) + ReLU per process, micro-batches of 64
rows, the loss on the last stage; RPC over TensorPipe's ``uv`` transport, as ``PipeStrategy`` uses; the data plane
``"auto"``: shared memory). Each process records when its stage's forwards and backwards ran and when it sent and took
each hand-off (wall clock: one machine, one clock), a barrier between steps. Printed, per piece of the cycle, its
median over the steady micro-batches of every step after ``--warmup``; and the last stage's period per micro-batch
over its own forward and backward (1.0: the last stage never waits; the theory's bound), with the driver's step
outside the stages' work (before stage 0's first forward, after its last backward).

    python benchmarks/bench_cycle.py [--microbatches 8] [--steps 60] [--warmup 15]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from bench_vs_pipelining import _start_ours, batch, ours_step
from processes import run_processes

_EVENTS: list[tuple[float, float, str, int | None]] = []  # (start, end, what, micro-batch) in this process


def _traced(owner: Any, name: str, what: str) -> None:
    """Record each call of ``owner.name`` as ``what`` (a stage's action: with its micro-batch)."""
    call = getattr(owner, name)

    @functools.wraps(call)
    def traced(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return call(*args, **kwargs)
        finally:
            microbatch = args[2] if what == "F" else args[2][0][0] if what == "B" else None
            _EVENTS.append((start, time.time(), what, microbatch))

    setattr(owner, name, traced)


def _job(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from lightning_pipe.engine.stage import Stage
    from lightning_pipe.transport.wire.dataplane import DataPlane

    torch.set_num_threads(1)
    _traced(Stage, "forward", "F")
    _traced(Stage, "backward", "B")
    _traced(DataPlane, "send", "send")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    parts, ours, _, _ = _start_ours(rank, port, args)
    x, y = batch(args)
    steps = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.time()
        if ours is not None:  # process 1 serves its stage from its step listener meanwhile
            ours_step(ours, parts, x, y, args, "1f1b")
        steps.append((start, time.time()))
        dist.barrier()
    if ours is not None:
        ours.close()
    rpc.shutdown()
    return {"events": _EVENTS, "steps": steps[args.warmup:]}


def _pieces(out: dict[int, Any], m: int) -> tuple[dict[str, list[float]], list[float]]:
    """Each piece of the cycle (ms), one value per steady micro-batch of every step; and the last stage's period per
    micro-batch over its own forward and backward, per micro-batch."""
    pieces: dict[str, list[float]] = defaultdict(list)
    periods: list[float] = []
    for start, end in out[0]["steps"]:
        events = {r: [e for e in out[r]["events"] if start <= e[0] <= end] for r in (0, 1)}

        def action(r: int, kind: str, i: int, events: dict[int, list[Any]] = events) -> tuple[float, float]:
            return next((s, e) for s, e, what, mb in events[r] if what == kind and mb == i)

        def sent(r: int, after: float, events: dict[int, list[Any]] = events) -> float:
            return min((s, e) for s, e, what, _ in events[r] if what == "send" and s >= after)[1]

        f0 = [(s, e) for s, e, what, _ in events[0] if what == "F"]
        b0 = [(s, e) for s, e, what, _ in events[0] if what == "B"]
        pieces["the driver before stage 0's first forward"].append(min(f0)[0] - start)
        pieces["the driver after stage 0's last backward"].append(end - max(b0)[1])
        for i in range(1, m - 2):  # the steady micro-batches: a B of stage 0 between two of its forwards
            gradient = sent(1, action(1, "B", i)[1])  # the last stage's gradient of micro-batch i on its way
            b0i, f0n = action(0, "B", i), action(0, "F", i + 2)
            output = sent(0, f0n[1])  # stage 0's output of micro-batch i + 2 on its way
            f1, b1 = action(1, "F", i + 1), action(1, "B", i + 1)
            ready = sent(1, b1[1])  # the last stage sent its gradient of i + 1: it needs i + 2's input now
            f1n = action(1, "F", i + 2)
            pieces["last stage: forward and backward of a micro-batch"].append(b1[1] - f1[0])
            pieces["last stage: backward's end -> its gradient sent"].append(ready - b1[1])
            pieces["loop: gradient sent -> stage 0's backward starts"].append(b0i[0] - gradient)
            pieces["loop: stage 0's backward"].append(b0i[1] - b0i[0])
            pieces["loop: stage 0's backward's end -> next forward"].append(f0n[0] - b0i[1])
            pieces["loop: stage 0's forward"].append(f0n[1] - f0n[0])
            pieces["loop: stage 0's forward's end -> its output sent"].append(output - f0n[1])
            pieces["loop: output sent -> last stage's forward starts"].append(f1n[0] - max(output, ready))
            pieces["the loop through stage 0: gradient sent -> output sent"].append(output - gradient)
            pieces["last stage meanwhile: gradient sent -> next one sent"].append(ready - gradient)
            pieces["last stage: waits for its next input"].append(f1n[0] - ready)
            periods.append((f1n[0] - f1[0]) / (b1[1] - f1[0]))
    return {name: [v * 1e3 for v in values] for name, values in pieces.items()}, periods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="traced steps")
    parser.add_argument("--warmup", type=int, default=15, help="steps before them, not traced")
    parser.add_argument("--timeout", type=float, default=300.0)
    cli = parser.parse_args()
    if cli.microbatches < 4:
        parser.error(f"--microbatches {cli.microbatches}: the steady cycle needs at least 4")
    args = argparse.Namespace(model="mlp", width=512, layers=2, chunks=cli.microbatches, batch=64 * cli.microbatches,
                              target_width=None, processes=2, transport="uv", data_plane="auto", paired=0,
                              schedules=["1f1b"], loss="last", vocab=0, sequence=0, steps=cli.steps,
                              warmup=cli.warmup)
    started = time.perf_counter()
    out = run_processes(_job, 2, args, timeout=cli.timeout, label="bench_cycle")
    steps = [(e - s) * 1e3 for s, e in out[0]["steps"]]
    print(f"ours, 1F1B, 2 processes, {cli.microbatches} micro-batches of 64 rows, one Linear(512) + ReLU per process; "
          f"median step {statistics.median(steps):.2f} ms over {len(steps)} traced steps\n")
    pieces, periods = _pieces(out, cli.microbatches)
    for name, values in pieces.items():
        print(f"  {name:55s} {statistics.median(values):7.3f} ms")
    print(f"\nwall time of the benchmark: {time.perf_counter() - started:.0f} s")
    print(f"RESULT cycle_period_over_last_stage_work={statistics.median(periods):.3f}")


if __name__ == "__main__":
    main()
