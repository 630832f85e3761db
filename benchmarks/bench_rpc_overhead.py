"""Overhead of the RPC engine (stages in 4 processes) over the GPipe bound (m+p-1)·(t_f+t_b), next to the local Pipe.

Every stage is one layer that only sleeps (t_f in forward, t_b in backward), so the ideal step time is known
exactly and the measurement needs no cores: what exceeds the bound is the engine's own cost (scheduling,
RPC round trips, serialisation, thread hand-offs). The driver (process 0) holds stage 0 and drives the
schedule; processes 1..p-1 hold one stage each. The local ``Pipe`` (worker threads, one process) runs the same
layers in the driver, alternating step by step with the RPC engine. checkpoint='never' (no recomputation).

    python benchmarks/bench_rpc_overhead.py [--stages 4] [--chunks 16] [--t-fwd-ms 20] [--t-bwd-ms 20]
                                            [--steps 8] [--timeout 150]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from processes import run_processes
from sleeping import SleepingIdentity
from torch import nn

from lightning_pipe import Pipe
from lightning_pipe.engine import run_pipeline
from lightning_pipe.transport import pipeline_over_rpc

RPC_TIMEOUT = 60.0


# ---------------------------------------------------------------------- the sleeping layer
class Sleep(nn.Module):
    """Sleeps ``t_fwd`` seconds in forward and ``t_bwd`` in backward; the identity otherwise."""

    def __init__(self, t_fwd: float, t_bwd: float) -> None:
        super().__init__()
        self.t_fwd, self.t_bwd = t_fwd, t_bwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepingIdentity.apply(x, self.t_fwd, self.t_bwd)


def build(p: int, t_fwd: float, t_bwd: float) -> nn.Sequential:
    return nn.Sequential(*[Sleep(t_fwd, t_bwd) for _ in range(p)])


# ---------------------------------------------------------------------- one timed step
def timed_step(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """Forward and backward of one training step through ``forward``; returns their wall times."""
    x = x.detach().requires_grad_()  # the layers have no parameters: the input's gradient drives backward
    start = time.perf_counter()
    out = forward(x)
    mid = time.perf_counter()
    out.sum().backward()
    end = time.perf_counter()
    return mid - start, end - mid


# ---------------------------------------------------------------------- what each process runs
def _cpu_seconds() -> float:
    """CPU time used so far by this process, all threads (an RPC target)."""
    return time.process_time()


def _job(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT,
                                              num_worker_threads=16)
    if args.transport != "default":
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT,
                                                  num_worker_threads=16, _transports=[args.transport])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    t_fwd, t_bwd = args.t_fwd_ms / 1e3, args.t_bwd_ms / 1e3
    peers = [f"worker{r}" for r in range(world)]
    pipeline = pipeline_over_rpc("bench", build(world, t_fwd, t_bwd), [1] * world, peers, timeout=RPC_TIMEOUT)
    if pipeline is None:
        rpc.shutdown(timeout=args.timeout)  # serves this stage until the driver is done
        return None

    local = Pipe(build(world, t_fwd, t_bwd), [1] * world, devices=["cpu"] * world, chunks=args.chunks,
                 checkpoint="never")
    x = torch.randn(args.chunks * 4, 16)

    def remote(inp: torch.Tensor) -> torch.Tensor:
        return run_pipeline(pipeline, inp, chunks=args.chunks, checkpoint="never", training=True,
                            parameters=iter([]))

    def cpu() -> list[float]:
        return [time.process_time()] + [rpc.rpc_sync(peer, _cpu_seconds, timeout=RPC_TIMEOUT)
                                        for peer in peers[1:world]]

    timed_step(remote, x)  # warm-up: threads, connections, first-call paths
    timed_step(local, x)
    times: dict[str, list[tuple[float, float]]] = {"rpc": [], "local": []}
    cpu_used: dict[str, list[list[float]]] = {"rpc": [], "local": []}
    for _ in range(args.steps):  # alternate, so both see the same machine load
        for name, forward in (("rpc", remote), ("local", local)):
            before = cpu()
            times[name].append(timed_step(forward, x))
            cpu_used[name].append([b - a for a, b in zip(before, cpu())])
    pipeline.close()
    rpc.shutdown(timeout=args.timeout)
    return times, cpu_used


# ---------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="p: stages = processes")
    parser.add_argument("--chunks", type=int, default=16, help="m: micro-batches")
    parser.add_argument("--t-fwd-ms", type=float, default=20.0, help="sleep per layer forward, per micro-batch")
    parser.add_argument("--t-bwd-ms", type=float, default=20.0, help="sleep per layer backward, per micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per engine (after one warm-up)")
    parser.add_argument("--transport", default="uv", choices=["default", "uv", "shm"],
                        help="TensorPipe transport: uv (TCP, as PipeStrategy), shm, or default (TensorPipe picks)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds before every process is killed")
    args = parser.parse_args()

    p, m = args.stages, args.chunks
    t_f, t_b = args.t_fwd_ms / 1e3, args.t_bwd_ms / 1e3
    print("Engine overhead over the GPipe bound: each stage is one layer that sleeps t_f (forward) and t_b "
          "(backward) per micro-batch,")
    print(f"so a training step ideally takes (m+p-1)*(t_f+t_b). p={p} stages, m={m} micro-batches, "
          f"t_f={args.t_fwd_ms:g} ms, t_b={args.t_bwd_ms:g} ms, checkpoint='never'.")
    print(f"rpc:   {p} processes (driver holds stage 0), TensorPipe RPC on 127.0.0.1 (transport: {args.transport}), "
          "16 RPC worker threads each")
    print(f"local: Pipe, {p} worker threads in the driver process; alternating step by step with rpc, "
          f"median of {args.steps} steps after 1 warm-up")
    start = time.perf_counter()
    times, cpu_used = run_processes(_job, p, args, timeout=args.timeout, label="rpc overhead")[0]
    ticks = m + p - 1
    bounds = (ticks * t_f, ticks * t_b, ticks * (t_f + t_b))
    print(f"\n{'engine':<7}{'forward':>10}{'backward':>10}{'step':>10}{'bound':>10}{'step/bound':>12}"
          f"{'excess/tick':>13}")
    print(f"{'bound':<7}{bounds[0] * 1e3:>8.1f}ms{bounds[1] * 1e3:>8.1f}ms{bounds[2] * 1e3:>8.1f}ms")
    for name in ("rpc", "local"):
        fwd = statistics.median(f for f, _ in times[name])
        bwd = statistics.median(b for _, b in times[name])
        step = statistics.median(f + b for f, b in times[name])
        excess = (step - bounds[2]) / (2 * ticks)  # per clock tick, forward and backward together
        ratio = f"{step / bounds[2]:>12.3f}" if bounds[2] > 0 else f"{'n/a':>12}"
        print(f"{name:<7}{fwd * 1e3:>8.1f}ms{bwd * 1e3:>8.1f}ms{step * 1e3:>8.1f}ms{bounds[2] * 1e3:>8.1f}ms"
              f"{ratio}{excess * 1e3:>11.2f}ms")
    print("\nCPU time per step (all threads), by process: the layers only sleep, so this is engine, RPC and "
          "idle-polling cost")
    for name in ("rpc", "local"):
        per = [statistics.median(c[k] for c in cpu_used[name]) for k in range(p)]
        step = statistics.median(f + b for f, b in times[name])
        print(f"{name:<7}" + "  ".join(f"proc{k} {c * 1e3:6.1f}ms" for k, c in enumerate(per))
              + f"   total {sum(per) * 1e3:6.1f}ms = {sum(per) / step:.2f} cores busy")
    print("(during 'local' steps processes 1..p-1 are idle: their CPU there is the RPC agent's idle cost)")
    print("(target: rpc step/bound <= 1.10; excess/tick = (step - bound) / (2*(m+p-1)), the engine's cost per "
          f"schedule tick)\nwall time of the benchmark: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
