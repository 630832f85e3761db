"""The bubble of every schedule across processes, measured on the timeline, beside the schedule's theory.

Every stage is one layer that only sleeps: ``t_f`` in forward, ``t_i`` for its input gradients and ``t_w``
for its parameter's gradient (declared ``pure_backward_layer``: a schedule may split its backward in two,
input gradients first), so a step's ideal timeline is known exactly (:func:`~lightning_pipe.engine.schedule.simulate`
with those times) and the measurement needs no cores. Each of ``p`` processes holds one stage (two for
the schedules of several stages per process: each then sleeps half as long, the same work per process; in a V
for ZBV and DualPipeV); the loss is computed on the last
stage. Every stage records when it ran what (the timeline); the bubble of a step is the idle fraction of the
processes between its first start and its last end, printed beside the theory's, with the step time beside
the simulated one. The driver's time outside the actions is what a step spends beyond them (its start, the loss's
backward commit, the answers, Python): the step's wall time less the span from its first action to its last.

    python benchmarks/bench_schedules.py [--stages 4] [--chunks 8] [--t-fwd-ms 10] [--t-in-ms 10] [--t-w-ms 10]
                                         [--draw docs/timelines]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from processes import run_processes
from sleeping import SleepingIdentity
from torch import nn

from lightning_pipe import pure_backward_layer
from lightning_pipe.engine import pipeline_loss
from lightning_pipe.engine.schedule import placement_of, schedule_plan, simulate
from lightning_pipe.engine.timeline import Event, Recorder, render
from lightning_pipe.transport import pipeline_over_rpc

RPC_TIMEOUT = 60.0
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2),
             ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2)]
#: torch.distributed.pipelining's class for each schedule of ours that it ships too.
THEIRS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
          "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble", "looped-bfs": "ScheduleLoopedBFS",
          "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


@pure_backward_layer
class SleepLayer(nn.Module):
    """Sleeps ``t_f`` in forward, ``t_i`` for its input's gradient and ``t_w`` for its parameter's."""

    def __init__(self, t_f: float, t_i: float, t_w: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.times = (t_f, t_i, t_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t_f, t_i, t_w = self.times
        # The parameter's branch: the gradient of the weight alone goes through the second sleep.
        return SleepingIdentity.apply(x, t_f, t_i) + SleepingIdentity.apply(self.weight, 0.0, t_w)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def _record(key: str, on: bool) -> list[Event]:
    """Start recording every stage of pipeline ``key`` in this process, or stop and return the events."""
    from lightning_pipe.transport.stages.entries import RUNNERS

    events: list[Event] = []
    for stage in RUNNERS[key].stages.values():
        if on:
            stage.recorder = Recorder()
        elif stage.recorder is not None:
            events += stage.recorder.events()
            stage.recorder = None
    return events


def their_schedule(name: str, rank: int, world: int, v: int, times: tuple[float, float, float], chunks: int
                   ) -> tuple[Any, bool, bool] | None:
    """Pipelining's ``name`` over this process's stages of the same placement as ours (their loss on the last
    stage), and whether they include the first and the last stage; None where it has no such schedule."""
    import torch.distributed.pipelining as pipelining

    if name not in THEIRS:
        return None
    n, mine = world * v, schedule_plan(name, chunks, world, v).stages_of(rank)
    stages = [pipelining.PipelineStage(nn.Sequential(SleepLayer(*times)), s, n, torch.device("cpu")) for s in mine]
    schedule = getattr(pipelining, THEIRS[name])(stages if v > 1 else stages[0], chunks, loss_fn=mse)
    return schedule, 0 in mine, n - 1 in mine


def _their_step(theirs: tuple[Any, bool, bool], x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of pipelining's schedule (:func:`their_schedule`) in this process, ended with every process's (a
    barrier)."""
    schedule, first, last = theirs
    kwargs = {"target": y, "losses": []} if last else {}
    if first:
        schedule.step(x, **kwargs)
    else:
        schedule.step(**kwargs)
    dist.barrier()


def _job(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    # Theirs over gloo; the same port: tcp:// rendezvous stores are multi-tenant within a process.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT, num_worker_threads=16, _transports=["uv"]))
    peers = [f"worker{r}" for r in range(world)]
    results = {}
    for name, v in SCHEDULES:
        scale = 1.0 / v  # v stages per process, each 1/v of the work
        times = (args.t_fwd_ms / 1e3 * scale, args.t_in_ms / 1e3 * scale, args.t_w_ms / 1e3 * scale)
        body = nn.Sequential(*[SleepLayer(*times) for _ in range(world * v)])
        key = f"bench-{name}"
        pipeline = pipeline_over_rpc(key, body, [1] * (world * v), peers, timeout=RPC_TIMEOUT, virtual_stages=v,
                                     placement=placement_of(name, world, v))
        theirs = their_schedule(name, rank, world, v, times, args.chunks)
        x, y = torch.randn(args.chunks, 4), torch.randn(args.chunks, 4)
        if pipeline is None:  # this process serves its stages until the driver is done, and runs theirs
            for _ in range(args.steps + 1 if theirs is not None else 0):
                _their_step(theirs, x, y)
            continue

        def step(name: str = name, pipeline: Any = pipeline, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            pipeline_loss(pipeline, x, y, mse, chunks=args.chunks, checkpoint="never", training=True,
                          parameters=pipeline.runner.stage.partition.parameters(), schedule=name).backward()

        step()  # warm-up: threads and connections
        if theirs is not None:
            _their_step(theirs, x, y)
        for peer in peers:
            rpc.rpc_sync(peer, _record, args=(key, True))
        walls, their_walls, spans = [], [], []
        for _ in range(args.steps):  # in turn, step by step: both see the same minutes of the machine
            start, began = time.perf_counter(), time.time()
            step()
            walls.append(time.perf_counter() - start)
            spans.append((began, time.time()))
            if theirs is not None:
                start = time.perf_counter()
                _their_step(theirs, x, y)
                their_walls.append(time.perf_counter() - start)
        events = [e for peer in peers for e in rpc.rpc_sync(peer, _record, args=(key, False))]
        results[name] = (walls, events, their_walls, spans)
        pipeline.close()
    rpc.shutdown(timeout=args.timeout)
    dist.destroy_process_group()
    return results if rank == 0 else None


def bubble(events: list[Event], processes: int, spans: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Per step: the idle fraction of the processes between its first start and last end, and the driver's
    time outside the actions: the step's span (``spans``, the driver's wall clock around each step, in order)
    less the span of its actions."""
    fractions, outside = [], []
    for run, (began, ended) in zip(sorted({e.run for e in events}), spans):
        step = [e for e in events if e.run == run]
        first, last = min(e.start for e in step), max(e.end for e in step)
        busy = sum(e.end - e.start for e in {(e.stage, e.kind, e.start, e.end): e for e in step}.values())
        fractions.append(1 - busy / (processes * (last - first)))
        outside.append((ended - began) - (last - first))
    return fractions, outside


def _input_of(step: dict[tuple[int, str, int], Event], last_stage: int, e: Event) -> Event | None:
    """The action of ``step`` whose result action ``e`` needs from another stage (or its own ``I``, for a ``W``)."""
    if e.kind == "F":
        return step.get((e.stage - 1, "F", e.microbatch))
    if e.kind == "W":
        return step.get((e.stage, "I", e.microbatch))
    if e.stage == last_stage:
        return step.get((e.stage, "F", e.microbatch))
    return step.get((e.stage + 1, "B", e.microbatch)) or step.get((e.stage + 1, "I", e.microbatch))


def critical_path(events: list[Event], processes: int, placement: tuple[int, ...] = ()
                  ) -> dict[str, tuple[float, float]]:
    """Per step, walked back from its last action: each action's wait after the later of its input's action
    (the previous stage's forward, the next stage's backward, its own input gradients for a ``W``) and the
    previous action of its process. Returns, over the steps (medians), the count and milliseconds of the waits
    after an input from another process ("hand-offs") and after the process's own previous action ("within a
    process"): what the engine adds between the actions on the step's critical path."""
    out: dict[str, list[tuple[int, float]]] = {"hand-offs": [], "within a process": []}
    for run in sorted({e.run for e in events}):
        step = {(e.stage, e.kind, e.microbatch): e for e in events if e.run == run}
        last_stage = max(stage for stage, _, _ in step)
        previous: dict[tuple[int, str, int], Event] = {}
        for q in range(processes):
            mine = sorted((e for e in step.values()
                           if (placement[e.stage] if placement else e.stage % processes) == q), key=lambda e: e.start)
            previous.update({(b.stage, b.kind, b.microbatch): a for a, b in zip(mine, mine[1:])})

        waits = {name: [0, 0.0] for name in out}
        event: Event | None = max(step.values(), key=lambda e: e.end)
        while event is not None:
            key = (event.stage, event.kind, event.microbatch)
            before, given = previous.get(key), _input_of(step, last_stage, event)
            if before is None and given is None:
                break
            after = max((e for e in (before, given) if e is not None), key=lambda e: e.end)
            name = "within a process" if after is before else "hand-offs"
            waits[name][0] += 1
            waits[name][1] += event.start - after.end
            event = after
        for name, (count, spent) in waits.items():
            out[name].append((count, spent))
    return {name: (statistics.median(c for c, _ in v), statistics.median(t for _, t in v) * 1e3)
            for name, v in out.items() if v}


def layer_times(t_f: float, t_i: float, t_w: float, repeats: int = 15) -> dict[str, float]:
    """What one layer's forward, input gradients, parameters' gradients and whole backward take here, alone,
    in ms (median of ``repeats``): a sleep overshoots its time on this machine (about 0.15 ms for 10 ms), and
    the theory that the engine is held to is the schedule run with the layer's real times."""
    layer = SleepLayer(t_f, t_i, t_w)
    times: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}
    for _ in range(repeats):
        x = torch.randn(1, 4, requires_grad=True)
        for kind, wrt in (("I", [x]), ("W", [layer.weight]), ("B", [x, layer.weight])):
            start = time.perf_counter()
            y = layer(x)
            middle = time.perf_counter()
            torch.autograd.grad(y.sum(), wrt)
            times[kind].append((time.perf_counter() - middle) * 1e3)
            times["F"].append((middle - start) * 1e3)
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="p: processes (one stage each; 2 interleaved)")
    parser.add_argument("--chunks", type=int, default=8, help="m: micro-batches")
    parser.add_argument("--t-fwd-ms", type=float, default=10.0, help="a process's forward per micro-batch")
    parser.add_argument("--t-in-ms", type=float, default=10.0, help="its input gradients per micro-batch")
    parser.add_argument("--t-w-ms", type=float, default=10.0, help="its parameters' gradients per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per schedule (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before every process is killed")
    parser.add_argument("--draw", default=None, metavar="DIR",
                        help="draw each schedule's last timed step there, as DIR/<schedule>.png (the timeline)")
    args = parser.parse_args()
    p, m = args.stages, args.chunks
    costs = {"F": args.t_fwd_ms, "B": args.t_in_ms + args.t_w_ms, "I": args.t_in_ms, "W": args.t_w_ms}
    print(f"{p} processes, {m} micro-batches; per process and micro-batch: forward {args.t_fwd_ms:g} ms, input "
          f"gradients {args.t_in_ms:g} ms, parameters' gradients {args.t_w_ms:g} ms (sleeps); the loss on the last "
          f"stage; median of {args.steps} steps after a warm-up\n")
    start = time.perf_counter()
    results = run_processes(_job, p, args, timeout=args.timeout, label="schedules")[0]
    measured = {v: layer_times(args.t_fwd_ms / 1e3 / v, args.t_in_ms / 1e3 / v, args.t_w_ms / 1e3 / v)
                for v in sorted({v for _, v in SCHEDULES})}
    for v, times in measured.items():
        print(f"one layer alone at 1/{v} of the times: " + ", ".join(f"{k} {t:.2f} ms" for k, t in times.items()))
    print("theory: the schedule with the nominal times; real: with the layer's times measured alone (what the "
          "engine adds is step/real)\n")
    print(f"{'schedule':<18}{'bubble':>8}{'theory':>8}{'step':>10}{'theory':>10}{'real':>10}{'step/theory':>13}"
          f"{'step/real':>11}{'outside':>10}{'theirs':>10}{'step/theirs':>13}")
    for name, v in SCHEDULES:
        walls, events, their_walls, spans = results[name]
        fractions, outside = bubble(events, p, spans)
        scaled = {k: t / v for k, t in costs.items()}
        theory = simulate(schedule_plan(name, m, p, v), scaled)
        real = simulate(schedule_plan(name, m, p, v), measured[v])
        step = statistics.median(walls) * 1e3
        print(f"{name:<18}{statistics.median(fractions):>8.1%}{theory.bubble:>8.1%}{step:>8.1f}ms"
              f"{theory.makespan:>8.1f}ms{real.makespan:>8.1f}ms{step / theory.makespan:>13.3f}"
              f"{step / real.makespan:>11.3f}{statistics.median(outside) * 1e3:>8.1f}ms"
              + (f"{statistics.median(their_walls) * 1e3:>8.1f}ms{step / (statistics.median(their_walls) * 1e3):>13.3f}"
                 if their_walls else f"{'-':>10}{'-':>13}"))
        if their_walls:
            print(f"RESULT {name}_step_over_theirs={step / (statistics.median(their_walls) * 1e3):.3f}")
        print(f"RESULT {name}_step_over_real={step / real.makespan:.3f}")
        print(f"RESULT {name}_step_over_theory={step / theory.makespan:.3f}")
        path = critical_path(events, p, placement_of(name, p, v))
        if args.draw:
            last = max(e.run for e in events)
            render([e for e in events if e.run == last], os.path.join(args.draw, f"{name}.png"),
                   title=f"{p} processes, {m} micro-batches:", schedule=name, processes=p)
        print("    on the critical path, the engine's waits between actions: " + "; ".join(
            f"{kind} {count:.0f} x {spent / count if count else 0:.2f} ms = {spent:.1f} ms"
            for kind, (count, spent) in path.items()))
    print(f"\nwall time of the benchmark: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
