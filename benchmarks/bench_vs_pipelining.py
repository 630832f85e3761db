"""Training throughput of our RPC engine vs torch.distributed.pipelining's ScheduleGPipe, 2 CPU processes, side by side.

The same model (``layers`` x Linear(width, width) + ReLU, cut into two halves), the same batch, the same loss
(mean of the squared output) and the same micro-batch count run on 2 processes with one intra-op thread each:

    ours:   the driver (process 0) holds stage 0 and drives the GPipe schedule; process 1 holds stage 1.
            RemotePipeline + run_pipeline(checkpoint='never') over TensorPipe RPC. The last stage's output
            goes back to the driver, which computes the loss there and sends its gradient back.
    theirs: PipelineStage + ScheduleGPipe(stage, n_microbatches, loss_fn) over a gloo process group; the
            loss is computed on the last stage (process 1), nothing returns to process 0.

Each round spawns a fresh 2-process job per engine (order alternating), times ``--steps`` training steps after
``--warmup`` ones on process 0; the ratio of the two engines' median step times is printed per round (two jobs
back to back, so a noisy minute hits both) and over all rounds. Parameters are never updated, so every step
does the same work; gradients accumulate in both engines alike.

``--paired N``: instead, one 2-process job holds both engines (RPC and a gloo group side by side, each engine
with its own copy of the weights) and alternates them step by step, N steps each, with a barrier between
steps: both see the same moment of a noisy machine, and the per-pair ratios give the spread. ``--jobs K``
runs K such jobs one after another: a job's median moves by a few percent from one job to the next (where
the scheduler happens to put the threads of that job), more than within one, so K jobs give the spread
that matters and the median over all their pairs. ``--pin``: process r runs on core r only (both engines
alike), so that a process's helper threads share its core with its compute instead of using an idle one.

    python benchmarks/bench_vs_pipelining.py [--width 1024] [--layers 8] [--batch 512] [--chunks 8]
                                             [--rounds 6] [--steps 6] [--transport default]
                                             [--paired 40 --jobs 5] [--pin]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import threading
import time
import warnings
from typing import Any

import torch
from processes import run_processes
from torch import nn

RPC_TIMEOUT = 120.0


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same weights in every process and engine
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def halves(args: argparse.Namespace) -> list[nn.Sequential]:
    from lightning_pipe.engine import split_module

    model = build(args.layers, args.width)
    n = len(model)
    return split_module(model, [n // 2, n - n // 2])


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.zeros(args.batch, args.width)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of the squared output (the target is zeros; ScheduleGPipe's loss_fn takes one)."""
    return (output - target).square().mean()


def _grad_norm(part: nn.Sequential) -> float:
    grad = part[0].weight.grad
    return float("nan") if grad is None else grad.norm().item()


# ---------------------------------------------------------------------- ours: RemotePipeline over RPC
def _start_ours(rank: int, port: int, args: argparse.Namespace) -> tuple[list[nn.Sequential], Any]:
    """Join RPC (rendezvous on ``port``) and set up our 2-stage pipeline: the halves and, in process 0, the
    pipeline (None in process 1, whose RPC threads serve its stage)."""
    import torch.distributed.rpc as rpc

    from lightning_pipe.transport import pipeline_over_rpc

    kwargs: dict[str, Any] = {} if args.transport == "default" else {"_transports": [args.transport]}
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT, num_worker_threads=16,
                     **kwargs))
    parts = halves(args)
    pipeline = pipeline_over_rpc("bench", nn.Sequential(*parts[0], *parts[1]), [len(parts[0]), len(parts[1])],
                                 ["worker0", "worker1"], timeout=RPC_TIMEOUT)
    return parts, pipeline


def _ours(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed.rpc as rpc

    from lightning_pipe.engine import run_pipeline

    parts, pipeline = _start_ours(rank, port, args)
    if pipeline is None:
        rpc.shutdown(timeout=args.timeout)  # serves this stage until the driver is done
        return None
    x, y = batch(args)

    def step() -> float:
        out = run_pipeline(pipeline, x, chunks=args.chunks, checkpoint="never", training=True,
                           parameters=parts[0].parameters())
        loss = loss_fn(out, y)
        loss.backward()
        return loss.item()

    first_loss = step()
    first_grad = _grad_norm(parts[0])
    for _ in range(args.warmup - 1):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    pipeline.close()
    rpc.shutdown(timeout=args.timeout)
    return {"times": times, "loss": first_loss, "grad": first_grad}


# ---------------------------------------------------------------------- theirs: ScheduleGPipe over gloo
def _theirs(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    try:
        part = halves(args)[rank]
        stage = PipelineStage(part, rank, 2, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, args.chunks, loss_fn=loss_fn)  # scale_grads: mean over micro-batches
        x, y = batch(args)
        losses: list[torch.Tensor] = []

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)

        step()
        # The whole batch's mean = the mean of the micro-batches' means (equal micro-batch sizes).
        first_loss = torch.stack(losses).mean().item() if rank == 1 else None
        first_grad = _grad_norm(part) if rank == 0 else None
        for _ in range(args.warmup - 1):
            step()
        dist.barrier()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        dist.barrier()
        return {"times": times, "loss": first_loss, "grad": first_grad}
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- both, step by step in one job
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by each thread of this process, with its name (Linux; empty elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)  # utime + stime
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return out


def _kind(tid: int, name: str, compute: set[int]) -> str:
    if tid in compute:
        return "compute"
    if name.startswith("TP_"):
        return "TensorPipe I/O"
    if name.startswith("gloo"):
        return "gloo I/O"
    return "other"


def _paired(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from lightning_pipe.engine import run_pipeline

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    # The same port as the gloo group: tcp:// rendezvous stores are multi-tenant within a process.
    parts, ours = _start_ours(rank, port, args)
    part = halves(args)[rank]  # theirs: its own copy of the same weights
    schedule = ScheduleGPipe(PipelineStage(part, rank, 2, torch.device("cpu")), args.chunks, loss_fn=loss_fn)
    x, y = batch(args)

    def ours_step() -> None:
        if ours is not None:  # process 1 serves its stage from RPC threads meanwhile
            loss_fn(run_pipeline(ours, x, chunks=args.chunks, checkpoint="never", training=True,
                                 parameters=parts[0].parameters()), y).backward()

    def theirs_step() -> None:
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])

    # CPU by kind of thread, per engine: each step's share is what the threads used from the barrier before
    # it to the barrier after it (read outside the timed part). Compute: where each engine runs its stage.
    from lightning_pipe.transport.runner import _RUNNERS

    def compute(engine: str) -> set[int]:  # the stage's worker thread has started once a step has run
        thread = _RUNNERS["bench"].worker._thread if engine == "ours" else threading.current_thread()
        return {thread.native_id} if thread is not None and thread.native_id is not None else set()

    cpu: dict[str, dict[str, float]] = {"ours": {}, "theirs": {}}
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for k in range(args.warmup + args.paired):
        for name, step in (("ours", ours_step), ("theirs", theirs_step))[:: 1 if k % 2 == 0 else -1]:
            dist.barrier()
            before = _thread_cpu()
            start = time.perf_counter()
            step()
            if k >= args.warmup:
                times[name].append(time.perf_counter() - start)
            dist.barrier()
            if k >= args.warmup:
                for tid, (thread, used) in _thread_cpu().items():
                    kind = _kind(tid, thread, compute(name))
                    cpu[name][kind] = cpu[name].get(kind, 0.0) + used - before.get(tid, (thread, 0.0))[1]
    times["cpu"] = {engine: {kind: used / args.paired for kind, used in kinds.items()}  # type: ignore[assignment]
                    for engine, kinds in cpu.items()}
    if ours is not None:
        ours.close()
    rpc.shutdown(timeout=args.timeout)
    dist.destroy_process_group()
    return times


def paired(args: argparse.Namespace) -> None:
    """Both engines in one job, alternating step by step (``args.jobs`` such jobs); print the per-pair
    throughput ratios, per job and over all jobs."""
    start = time.perf_counter()
    print(f"{args.jobs} job(s) of {args.paired} pairs of steps, each job holding both engines, alternating "
          "(first of a pair swapped each time), a barrier before each step; timed on process 0\n")
    steps: dict[str, list[float]] = {"ours": [], "theirs": []}
    ratios: list[float] = []
    medians: list[float] = []
    cpu: dict[tuple[int, str, str], list[float]] = {}  # (process, engine, kind of thread) -> per job
    for job in range(args.jobs):
        both = run_processes(_job, 2, "paired", args, timeout=args.timeout, label="paired")
        for rank, result in both.items():
            for engine, kinds in result["cpu"].items():
                for kind, used in kinds.items():
                    cpu.setdefault((rank, engine, kind), []).append(used)
        out = both[0]
        mine = [t / o for o, t in zip(out["ours"], out["theirs"])]
        medians.append(statistics.median(mine))
        ratios += mine
        for engine in steps:
            steps[engine] += out[engine]
        print(f"job {job + 1}: median step ours {statistics.median(out['ours']) * 1e3:.1f} ms, theirs "
              f"{statistics.median(out['theirs']) * 1e3:.1f} ms; throughput ours/theirs, median of its pairs "
              f"{medians[-1]:.3f}; ours faster in {sum(r > 1 for r in mine)} of {len(mine)}", flush=True)
    ratios.sort()
    q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
    ours, theirs = statistics.median(steps["ours"]), statistics.median(steps["theirs"])
    print(f"\n{'engine':<8}{'median step':>13}{'samples/s':>12}")
    print(f"{'ours':<8}{ours * 1e3:>11.1f}ms{args.batch / ours:>12.1f}")
    print(f"{'theirs':<8}{theirs * 1e3:>11.1f}ms{args.batch / theirs:>12.1f}")
    print(f"throughput ours/theirs over all {len(ratios)} pairs: median {statistics.median(ratios):.3f}, quartiles "
          f"{q(0.25):.3f}-{q(0.75):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}; ours faster in "
          f"{sum(r > 1 for r in ratios)} of {len(ratios)} pairs   (target >= 1.0)")
    if cpu:
        print("\nCPU per step by thread, ms (median over jobs; compute: the thread running the stage, which "
              "also starts its sends; a step's share runs from the barrier before it to the one after):")
        for rank in (0, 1):
            for engine in ("ours", "theirs"):
                kinds = sorted((k for r, e, k in cpu if (r, e) == (rank, engine)), key=lambda k: k != "compute")
                line = ", ".join(f"{k} {statistics.median(cpu[(rank, engine, k)]) * 1e3:.1f}" for k in kinds)
                print(f"  process {rank}, {engine:<6}: {line}")
    if args.jobs > 1:
        print(f"per-job medians: {min(medians):.3f}-{max(medians):.3f}, their median {statistics.median(medians):.3f}; "
              f"ours ahead in {sum(m > 1 for m in medians)} of {args.jobs} jobs")
    print(f"wall time of the benchmark: {time.perf_counter() - start:.1f} s")


def _job(rank: int, world: int, port: int, engine: str, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # every thread started from now on too
    return {"ours": _ours, "theirs": _theirs, "paired": _paired}[engine](rank, port, args)


# ---------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks, split in two halves")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches")
    parser.add_argument("--rounds", type=int, default=6, help="jobs per engine, alternating")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per job (at least 1)")
    parser.add_argument("--transport", default="uv", choices=["default", "uv", "shm"],
                        help="TensorPipe transport for ours: uv (TCP, what PipeStrategy uses), shm, or default "
                             "(TensorPipe picks)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job before it is killed")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="one job holding both engines, N steps each, alternating step by step")
    parser.add_argument("--jobs", type=int, default=1, metavar="K",
                        help="with --paired: K such jobs, one after another")
    parser.add_argument("--pin", action="store_true", help="run process r on core r only (needs 2 cores)")
    args = parser.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error(f"--pin needs 2 cores; this process may use {len(os.sched_getaffinity(0))}")
    if args.warmup < 1 or args.batch % args.chunks:
        parser.error("--warmup must be >= 1 and --batch a multiple of --chunks (equal micro-batches)")
    if args.jobs < 1 or (args.jobs > 1 and not args.paired):
        parser.error(f"--jobs must be >= 1 and goes with --paired (got --jobs {args.jobs}, --paired {args.paired})")

    print(f"model: {args.layers} x (Linear({args.width}, {args.width}) + ReLU), 2 stages of "
          f"{args.layers // 2} and {args.layers - args.layers // 2} blocks; batch {args.batch}, {args.chunks} "
          f"micro-batches; loss = mean(output**2); 2 processes, 1 intra-op thread each")
    print(f"ours:   RemotePipeline over TensorPipe RPC (transport: {args.transport}); loss on the driver "
          "(process 0): the last stage's output travels back to it and the output gradient travels out")
    print("theirs: torch.distributed.pipelining PipelineStage + ScheduleGPipe over gloo; loss on the last "
          "stage (process 1), grads scaled by 1/n_microbatches (= the whole batch's mean loss)")
    if args.pin:
        print("pinned: process r runs on core r only, helper threads included")
    if args.paired:
        return paired(args)
    print(f"{args.rounds} rounds x {args.steps} timed steps (after {args.warmup} warm-up) per engine, "
          "order alternating, timed on process 0; median over all steps\n")
    start = time.perf_counter()
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    ratios: list[float] = []  # per round: ours/theirs throughput of two jobs run back to back
    checks: dict[str, tuple[float, float]] = {}
    for r in range(args.rounds):
        order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
        line, medians = [], {}
        for engine in order:
            out = run_processes(_job, 2, engine, args, timeout=args.timeout, label=engine)
            times[engine] += out[0]["times"]
            if engine not in checks:
                loss = out[0]["loss"] if engine == "ours" else out[1]["loss"]
                checks[engine] = (loss, out[0]["grad"])
            medians[engine] = statistics.median(out[0]["times"])
            line.append(f"{engine} {args.batch / medians[engine]:7.1f} samples/s")
        ratios.append(medians["theirs"] / medians["ours"])
        print(f"round {r + 1}: " + "   ".join(line) + f"   ours/theirs {ratios[-1]:.3f}")

    print("\nsame work? first step, same weights and batch:")
    for engine in ("ours", "theirs"):
        loss, grad = checks[engine]
        print(f"  {engine:<7} loss {loss:.9e}   |grad| of stage 0's first weight {grad:.9e}")
    rel = abs(checks["ours"][0] - checks["theirs"][0]) / abs(checks["theirs"][0])
    print(f"  loss relative difference {rel:.1e}")

    ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    print(f"\n{'engine':<8}{'step':>10}{'samples/s':>12}")
    print(f"{'ours':<8}{ours * 1e3:>8.1f}ms{args.batch / ours:>12.1f}")
    print(f"{'theirs':<8}{theirs * 1e3:>8.1f}ms{args.batch / theirs:>12.1f}")
    print(f"throughput ours/theirs: {theirs / ours:.3f} over all steps; per round: median "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}   (target >= 1.0)")
    print(f"wall time of the benchmark: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
