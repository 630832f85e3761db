"""Training throughput of our RPC engine vs torch.distributed.pipelining's schedules, 2 CPU processes, side by side.

The same model, the same batch, the same loss and the same micro-batch count run on 2 processes with one
intra-op thread each:

    --model mlp  ``layers`` x Linear(width, width) + ReLU cut in two halves; loss = mean of the squared output
    --model lm   a language model: Embedding(vocab, width), ``layers`` x (Linear + ReLU), Linear(width, vocab)
                 head, cut in two halves (the head on the last stage); loss = the tokens' cross-entropy

    ours:   the driver (process 0) holds stage 0 and drives the schedule; process 1 holds stage 1.
            RemotePipeline over TensorPipe RPC. ``--loss last``: the loss on the last stage per micro-batch
            (pipeline_loss), only losses come back; ``--loss driver``: run_pipeline, the last stage's output
            goes back to the driver, which computes the loss there and sends its gradient back (GPipe only).
    theirs: PipelineStage + ScheduleGPipe or Schedule1F1B(stage, n_microbatches, loss_fn) over a gloo process
            group; the loss is computed on the last stage (process 1), nothing returns to process 0.

Each round spawns a fresh 2-process job per engine (order alternating), times ``--steps`` training steps after
``--warmup`` ones on process 0; the ratio of the two engines' median step times is printed per round (two jobs
back to back, so a noisy minute hits both) and over all rounds. Parameters are never updated, so every step
does the same work; gradients accumulate in both engines alike.

``--paired N`` (the default for ``--model lm``): instead, one 2-process job holds both engines (RPC and a gloo
group side by side, each engine with its own copy of the weights) and alternates them step by step, N steps
each per schedule, with a barrier between steps: both see the same moment of a noisy machine, and the per-pair
ratios give the spread. ``--jobs K`` runs K such jobs one after another: a job's median moves by a few percent
from one job to the next (where the scheduler happens to put the threads of that job), more than within one,
so K jobs give the spread that matters and the median over all their pairs. It ends with the line
``RESULT <model>_ours_over_theirs=<median over every pair of our step time / theirs>`` (below 1: ours faster).
``--pin``: process r runs on core r only (both engines alike), so that a process's helper threads share its
core with its compute instead of using an idle one.

After paired jobs it times the busiest stage's work alone (its forwards, the loss on the last stage, and backwards
of every micro-batch, in a process of its own on one thread): no engine's step can be shorter with this cut, so
``RESULT <model>_p<processes>_lowest_possible_ours_over_theirs`` is the lowest ratio any engine of ours could reach.

    python benchmarks/bench_vs_pipelining.py --model lm [--paired 10 --jobs 1] [--schedules gpipe,1f1b]
    python benchmarks/bench_vs_pipelining.py --model lm --schedules zbv,dualpipev   (2 x processes stages in a V)
    python benchmarks/bench_vs_pipelining.py [--width 1024] [--layers 8] [--batch 512] [--chunks 8]
                                             [--rounds 6] [--steps 6] [--transport default] [--loss last]
                                             [--paired 40 --jobs 5] [--pin]
    python benchmarks/bench_vs_pipelining.py --model comm [--processes 4] [--target-width 1]
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
THEIRS = ("gpipe", "1f1b", "zbv", "dualpipev")  # the schedules of theirs compared with ours of the same name
V_SHAPED = ("zbv", "dualpipev")  # 2 stages per process, in a V: both engines cut the model in 2 x processes stages


def build(args: argparse.Namespace) -> nn.Sequential:
    """The model: ``mlp``, layers x (Linear(width) + ReLU); ``lm``, an embedding of ``vocab`` tokens, layers x
    (Linear(width) + ReLU) and a vocabulary head (the last stage's output: tokens x vocab logits)."""
    torch.manual_seed(0)  # the same weights in every process and engine
    blocks: list[nn.Module] = [nn.Embedding(args.vocab, args.width)] if args.model == "lm" else []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    if args.model == "lm":
        blocks.append(nn.Linear(args.width, args.vocab))
    return nn.Sequential(*blocks)


def halves(args: argparse.Namespace, per_process: int = 1) -> list[nn.Sequential]:
    """The model cut into ``args.processes`` stages of whole blocks (two halves by default); ``per_process=2``:
    twice as many (the V shapes)."""
    from lightning_pipe.engine import split_module

    model = build(args)
    n, p = len(model), args.processes * per_process
    blocks = [1 if isinstance(m, nn.Embedding) or m is model[-1] and args.model == "lm" else 2 for m in model
              if not isinstance(m, nn.ReLU)]
    per = [len(blocks) // p + (1 if j < len(blocks) % p else 0) for j in range(p)]
    balance, k = [], 0
    for count in per:
        balance.append(sum(blocks[k:k + count]))
        k += count
    assert sum(balance) == n, (balance, n)
    return [nn.Sequential(*part) for part in split_module(model, balance)]


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if args.model == "lm":  # batch x sequence token ids, and the next tokens to predict
        tokens = torch.randint(args.vocab, (args.batch, args.sequence + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    # ``--target-width 1``: one column of zeros, the same loss and gradients, 1/width of the bytes: ours ships the
    # driver's targets to the last stage with the activations, theirs is given them on its last process.
    return torch.randn(args.batch, args.width, generator=g), torch.zeros(args.batch, args.target_width or args.width)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared output (mlp: the target is zeros), or the tokens' mean cross-entropy (lm)."""
    if output.dim() == 3:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return (output - target).square().mean()


def _grad_norm(part: nn.Sequential) -> float:
    grad = part[0].weight.grad
    return float("nan") if grad is None else grad.norm().item()


# ---------------------------------------------------------------------- ours: RemotePipeline over RPC
def _start_ours(rank: int, port: int, args: argparse.Namespace) -> tuple[list[nn.Sequential], Any, Any, Any]:
    """Join RPC (rendezvous on ``port``) and set up our pipeline: the stages and, in process 0, the pipeline
    over ``args.data_plane``, one over RPC alone where that is another, and, for the V-shaped schedules, one of
    2 x processes stages in a V (None in the other processes, whose threads serve their stages)."""
    import torch.distributed.rpc as rpc

    from lightning_pipe.transport import pipeline_over_rpc

    kwargs: dict[str, Any] = {} if args.transport == "default" else {"_transports": [args.transport]}
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=args.processes,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT, num_worker_threads=16,
                     **kwargs))
    parts = halves(args)
    names = [f"worker{r}" for r in range(args.processes)]
    pipeline = pipeline_over_rpc("bench", nn.Sequential(*[m for part in parts for m in part]), [len(q) for q in parts],
                                 names, timeout=RPC_TIMEOUT, data_plane=args.data_plane)
    over_rpc = v = None
    if args.data_plane != "rpc" and args.paired:  # the same weights, the other plane
        over_rpc = pipeline_over_rpc("bench-rpc", nn.Sequential(*[m for part in halves(args) for m in part]),
                                     [len(q) for q in parts], names, timeout=RPC_TIMEOUT, data_plane="rpc")
    if set(args.schedules) & set(V_SHAPED):
        from lightning_pipe.engine.plan import v_placement

        quarters = halves(args, 2)
        v = pipeline_over_rpc("bench-v", nn.Sequential(*[m for part in quarters for m in part]),
                              [len(q) for q in quarters], names, timeout=RPC_TIMEOUT, data_plane=args.data_plane,
                              virtual_stages=2, placement=v_placement(args.processes))
    return parts, pipeline, over_rpc, v


def ours_step(pipeline: Any, parts: list[nn.Sequential], x: torch.Tensor, y: torch.Tensor,
              args: argparse.Namespace, schedule: str) -> float:
    """One training step of our engine: the loss on the last stage (``--loss last``), or the output back on
    the driver and the loss there (``--loss driver``, GPipe only)."""
    from lightning_pipe.engine import pipeline_loss, run_pipeline

    if args.loss == "last":
        loss = pipeline_loss(pipeline, x, y, loss_fn, chunks=args.chunks, checkpoint="never", training=True,
                             parameters=pipeline.runner.stage.partition.parameters(), schedule=schedule)
    else:
        loss = loss_fn(run_pipeline(pipeline, x, chunks=args.chunks, checkpoint="never", training=True,
                                    parameters=parts[0].parameters()), y)
    loss.backward()
    return loss.item()


def _ours(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed.rpc as rpc

    parts, pipeline, _, _ = _start_ours(rank, port, args)
    if pipeline is None:
        rpc.shutdown(timeout=args.timeout)  # serves this stage until the driver is done
        return None
    x, y = batch(args)

    def step() -> float:
        return ours_step(pipeline, parts, x, y, args, args.schedules[0])

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


# ---------------------------------------------------------------------- theirs: torch's schedules over gloo
def _theirs(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    try:
        part = halves(args)[rank]
        schedule = their_schedule(part, rank, args, args.schedules[0])
        x, y = batch(args)
        losses: list[torch.Tensor] = []

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            elif rank == args.processes - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()

        step()
        # The whole batch's mean = the mean of the micro-batches' means (equal micro-batch sizes).
        first_loss = torch.stack(losses).mean().item() if rank == args.processes - 1 else None
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


def their_schedule(part: nn.Sequential, rank: int, args: argparse.Namespace, schedule: str) -> Any:
    """torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B over ``part`` (stage ``rank``), or its
    ScheduleZBVZeroBubble or ScheduleDualPipeV over stages ``rank`` and ``2p - 1 - rank`` of the model cut in 2p
    (``part`` unused), its loss on the last stage, gradients scaled by 1 / micro-batches (the whole batch's mean
    loss)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleZBVZeroBubble,
    )

    cpu = torch.device("cpu")
    if schedule in V_SHAPED:
        quarters, n = halves(args, 2), 2 * args.processes
        stages = [PipelineStage(quarters[s], s, n, cpu) for s in (rank, n - 1 - rank)]
        return {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule](stages, args.chunks,
                                                                                      loss_fn=loss_fn)
    stage = PipelineStage(part, rank, args.processes, cpu)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, args.chunks, loss_fn=loss_fn)


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

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    # The same port as the gloo group: tcp:// rendezvous stores are multi-tenant within a process.
    parts, ours, over_rpc, ours_v = _start_ours(rank, port, args)
    engines = ("ours", "ours-rpc", "theirs") if args.data_plane != "rpc" else ("ours", "theirs")
    part = halves(args)[rank]  # theirs: its own copy of the same weights
    theirs = {name: their_schedule(part, rank, args, name) for name in args.schedules if name in THEIRS}
    x, y = batch(args)
    losses: dict[str, list[float]] = {f"{engine} {name}": [] for engine in engines for name in args.schedules
                                      if (engine != "theirs" or name in theirs)
                                      and (engine != "ours-rpc" or name not in V_SHAPED)}

    def step(engine: str, name: str) -> None:
        if engine.startswith("ours"):
            pipeline = ours_v if name in V_SHAPED else ours if engine == "ours" else over_rpc
            if pipeline is not None:  # the other processes serve their stages from RPC threads meanwhile
                losses[f"{engine} {name}"].append(ours_step(pipeline, parts, x, y, args, name))
        elif name in V_SHAPED:  # the first and the last stage on process 0: the batch and the targets there
            out: list[torch.Tensor] = []
            if rank == 0:
                theirs[name].step(x, target=y, losses=out)
                losses[f"theirs {name}"].append(torch.stack(out).mean().item())
            else:
                theirs[name].step()
        elif rank == 0:
            theirs[name].step(x)
        elif rank == args.processes - 1:
            out: list[torch.Tensor] = []
            theirs[name].step(target=y, losses=out)
            losses[f"theirs {name}"].append(torch.stack(out).mean().item())
        else:
            theirs[name].step()

    # CPU by kind of thread, per engine: each step's share is what the threads used from the barrier before
    # it to the barrier after it (read outside the timed part). Compute: where each engine runs its stage.
    from lightning_pipe.transport.stages.entries import RUNNERS

    def compute(engine: str, name: str) -> set[int]:
        """The threads that run the stage: the worker's (steps by RPC), the step listener (steps on the data plane:
        it runs them), and the main thread (theirs; ours on the driver, where stage 0 runs on it with the plane)."""
        ours_key = "bench-v" if name in V_SHAPED else "bench"
        runner = RUNNERS.get({"ours": ours_key, "ours-rpc": "bench-rpc"}.get(engine, ""))
        threads = [threading.current_thread()]
        if runner is not None:
            threads = [runner.worker._thread] + ([threading.current_thread()] if rank == 0 else [])
            threads += [t for t in threading.enumerate() if t.name == f"lightning_pipe.{runner.key}.steps"]
        return {t.native_id for t in threads if t is not None and t.native_id is not None}

    cpu: dict[str, dict[str, float]] = {engine: {} for engine in engines}
    times: dict[str, list[float]] = {key: [] for key in losses}
    for k in range(args.warmup + args.paired):
        for name in args.schedules:
            for engine in engines[:: 1 if k % 2 == 0 else -1]:
                if f"{engine} {name}" not in losses:
                    continue  # a schedule theirs does not offer
                dist.barrier()
                before = _thread_cpu()
                start = time.perf_counter()
                step(engine, name)
                if k >= args.warmup:
                    times[f"{engine} {name}"].append(time.perf_counter() - start)
                dist.barrier()
                if k >= args.warmup:
                    for tid, (thread, used) in _thread_cpu().items():
                        kind = _kind(tid, thread, compute(engine, name))
                        cpu[engine][kind] = cpu[engine].get(kind, 0.0) + used - before.get(tid, (thread, 0.0))[1]
    steps = args.paired * len(args.schedules)
    for pipeline in (ours, over_rpc, ours_v):
        if pipeline is not None:
            pipeline.close()
    rpc.shutdown(timeout=args.timeout)
    dist.destroy_process_group()
    return {"times": times, "losses": losses,
            "cpu": {engine: {kind: used / steps for kind, used in kinds.items()} for engine, kinds in cpu.items()}}


def paired(args: argparse.Namespace) -> None:
    """The engines in one job, alternating step by step, for each schedule (``args.jobs`` such jobs): ours over
    ``args.data_plane``, ours over RPC alone (where that is another) and theirs; print the per-pair ratios of
    each of our step times to theirs, per schedule and job, and over everything."""
    start = time.perf_counter()
    engines = ["ours", "ours-rpc", "theirs"] if args.data_plane != "rpc" else ["ours", "theirs"]
    print(f"{args.jobs} job(s) of {args.paired} rounds of steps per schedule ({', '.join(args.schedules)}), each "
          f"job holding every engine ({', '.join(engines)}), alternating (the order reversed each round), a "
          "barrier before each step; timed on process 0\n")
    ratios: dict[str, list[float]] = {}  # "<engine> <schedule>" -> our step time / theirs, per round
    steps: dict[str, list[float]] = {}
    medians: list[float] = []
    bests: list[float] = []  # our fastest schedule's step / their fastest's, per round
    cpu: dict[tuple[int, str, str], list[float]] = {}  # (process, engine, kind of thread) -> per job
    losses: dict[str, float] = {}
    for job in range(args.jobs):
        every = run_processes(_job, args.processes, "paired", args, timeout=args.timeout, label="paired")
        for rank, result in every.items():
            for engine, kinds in result["cpu"].items():
                for kind, used in kinds.items():
                    cpu.setdefault((rank, engine, kind), []).append(used)
            for key, values in result["losses"].items():
                if values:
                    losses.setdefault(key, values[0])
        times = every[0]["times"]
        line = []
        # A schedule theirs does not offer is compared with their best in this job, round by round.
        best = min((name for name in args.schedules if name in THEIRS),
                   key=lambda name: statistics.median(times[f"theirs {name}"]))
        ours_best = min(args.schedules, key=lambda name: statistics.median(times[f"ours {name}"]))
        for name in args.schedules:
            for engine in engines:
                if f"{engine} {name}" in times:
                    steps.setdefault(f"{engine} {name}", []).extend(times[f"{engine} {name}"])
            for engine in engines[:-1]:
                if f"{engine} {name}" not in times:
                    continue  # (ours over RPC alone runs one stage per process)
                against = f"theirs {name if name in THEIRS else best}"
                mine = [o / t for o, t in zip(times[f"{engine} {name}"], times[against])]
                if engine == "ours" and name == ours_best:
                    bests.extend(o / t for o, t in zip(times[f"ours {name}"], times[f"theirs {best}"]))
                ratios.setdefault(f"{engine} {name}", []).extend(mine)
                if engine == "ours":
                    medians.append(statistics.median(mine))
            line.append(f"{name}: " + ", ".join(f"{engine} {statistics.median(times[f'{engine} {name}']) * 1e3:.1f} "
                                                 "ms" for engine in engines if f"{engine} {name}" in times)
                        + f", ours/theirs {medians[-1]:.3f}")
        print(f"job {job + 1}: " + "; ".join(line), flush=True)
    print(f"\n{'schedule':<13}{'engine':<10}{'median step':>13}{'/ theirs, median of rounds (quartiles)':>42}")
    for name in args.schedules:
        for engine in engines:
            extra = ""
            if f"{engine} {name}" not in steps:
                continue
            if engine != "theirs":
                r = sorted(ratios[f"{engine} {name}"])
                q = lambda f, r=r: r[min(len(r) - 1, int(f * len(r)))]  # noqa: E731
                extra = f"{statistics.median(r):.3f} ({q(0.25):.3f}-{q(0.75):.3f})"
            print(f"{name:<13}{engine:<10}{statistics.median(steps[f'{engine} {name}']) * 1e3:>11.1f}ms{extra:>42}")
    print("\nthe same work? the first step's loss, same weights and batch:")
    for key, value in sorted(losses.items()):
        print(f"  {key:<16} {value:.6f}")
    if cpu:
        print("\nCPU per step by thread, ms (median over jobs; compute: the thread running the stage, which "
              "also starts its sends; a step's share runs from the barrier before it to the one after):")
        for rank in range(args.processes):
            for engine in engines:
                kinds = sorted((k for r, e, k in cpu if (r, e) == (rank, engine)), key=lambda k: k != "compute")
                line = ", ".join(f"{k} {statistics.median(cpu[(rank, engine, k)]) * 1e3:.1f}" for k in kinds)
                print(f"  process {rank}, {engine:<8}: {line}")
    if args.jobs > 1:
        print(f"per-job medians (ours): {min(medians):.3f}-{max(medians):.3f}")
    bound = run_processes(_job, 1, "bound", args, timeout=args.timeout, label="bound")[0]
    theirs_best = min(statistics.median(steps[f"theirs {name}"]) for name in args.schedules if name in THEIRS)
    ours_best = min(statistics.median(steps[f"ours {name}"]) for name in args.schedules)
    print(f"\nthe busiest stage's work alone (forward{' and loss' if args.loss == 'last' else ''} and backward of "
          f"every micro-batch, a process of its own on one thread, no pipeline; the fastest of 7): {bound * 1e3:.1f} "
          "ms, a step's lower bound for any engine "
          f"with this layout; their fastest schedule {theirs_best / bound:.3f}x it, ours {ours_best / bound:.3f}x; "
          f"so ours / theirs cannot go below {bound / theirs_best:.3f} here")
    print(f"RESULT {args.model}_p{args.processes}_lowest_possible_ours_over_theirs={bound / theirs_best:.3f}")
    print(f"wall time of the benchmark: {time.perf_counter() - start:.1f} s")
    for name in args.schedules:
        for engine in (e for e in engines[:-1] if f"{e} {name}" in ratios):
            print(f"RESULT {args.model}_p{args.processes}_{name}_{engine.replace('-', '_')}_over_theirs="
                  f"{statistics.median(ratios[f'{engine} {name}']):.3f}")
    every_ratio = sorted(x for name in args.schedules for x in ratios[f"ours {name}"])
    print(f"RESULT {args.model}_ours_over_theirs={statistics.median(every_ratio):.3f}")
    if any(name not in THEIRS for name in args.schedules):  # each engine at its fastest schedule, round by round
        print(f"RESULT {args.model}_best_ours_over_best_theirs={statistics.median(bests):.3f}")


def busiest_stage(rank: int, port: int, args: argparse.Namespace, repeats: int = 7) -> float:
    """Seconds of the busiest stage's share of a step done alone, in a process of its own on one thread, as the
    jobs' processes run: the forward (and the loss, on the last stage) and the backward of each micro-batch, one
    after another (the fastest of ``repeats`` after one warm-up). No pipeline step can be shorter: each stage does
    its share on one thread of its own."""
    parts = halves(args)
    x, y = batch(args)
    xs, ys = x.chunk(args.chunks), y.chunk(args.chunks)
    shares = []
    for r, part in enumerate(parts):
        inputs = list(xs)
        for earlier in parts[:r]:  # the stage's own inputs: what the stages before it hand on
            with torch.no_grad():
                inputs = [earlier(xb) for xb in inputs]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for xb, yb in zip(inputs, ys):
                xb = xb.detach().requires_grad_(xb.is_floating_point())
                out = part(xb)
                if r == len(parts) - 1 and args.loss == "last":
                    loss_fn(out, yb).backward()
                else:
                    out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        shares.append(min(times[1:]))
    return max(shares)


def _job(rank: int, world: int, port: int, engine: str, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # every thread started from now on too
    return {"ours": _ours, "theirs": _theirs, "paired": _paired, "bound": busiest_stage}[engine](rank, port, args)


# ---------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "lm", "comm"],
                        help="mlp: Linear+ReLU blocks; lm: embedding, blocks and a vocabulary head (defaults: paired "
                             "steps, both schedules, the loss on the last stage); comm: bound by its hand-offs, one "
                             "Linear(512) + ReLU per process, micro-batches of 64 rows (defaults: 16 micro-batches, "
                             "paired steps, both schedules, the loss on the last stage)")
    parser.add_argument("--processes", type=int, default=2, help="processes, one stage each (default 2)")
    parser.add_argument("--data-plane", default="auto", choices=["auto", "p2p", "rpc"],
                        help="ours: how tensors go between processes (pipeline_over_rpc's data_plane); paired "
                             "jobs also run ours over RPC alone, where this is another")
    parser.add_argument("--width", type=int, default=None, help="default: 1024 (mlp), 256 (lm)")
    parser.add_argument("--layers", type=int, default=None, help="Linear+ReLU blocks, split in two halves; "
                                                                 "default: 8 (mlp), 4 (lm)")
    parser.add_argument("--batch", type=int, default=None, help="samples (mlp: default 512) or sequences (lm: 8)")
    parser.add_argument("--sequence", type=int, default=128, help="lm: tokens per sequence")
    parser.add_argument("--target-width", type=int, default=None,
                        help="mlp, comm: columns of the zero target (default: the width; 1 gives the same loss and "
                             "tells what shipping the targets to the last stage costs ours)")
    parser.add_argument("--vocab", type=int, default=32000, help="lm: vocabulary")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches")
    parser.add_argument("--schedules", default=None, help="comma-separated: gpipe, 1f1b, zero-bubble (ours alone, "
                                                          "compared with their fastest; default: gpipe for mlp, "
                                                          "gpipe,1f1b for lm)")
    parser.add_argument("--loss", default=None, choices=["last", "driver"],
                        help="ours: the loss on the last stage (default for lm) or on the driver, the output "
                             "travelling back (default for mlp, GPipe only)")
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
    if args.model == "comm":  # an MLP of one small block per process, where the hand-offs are the cost
        args.model = "mlp"
        args.width = args.width or 512
        args.layers = args.layers or args.processes
        args.chunks = 16 if args.chunks == 8 else args.chunks
        args.batch = args.batch or 64 * args.chunks
        args.schedules = args.schedules or "gpipe,1f1b"
        args.loss = args.loss or "last"
        args.paired = args.paired or 40
    lm = args.model == "lm"
    args.width = args.width or (256 if lm else 1024)
    args.layers = args.layers or (4 if lm else 8)
    args.batch = args.batch or (8 if lm else 512)
    args.schedules = (args.schedules or ("gpipe,1f1b" if lm else "gpipe")).split(",")
    args.loss = args.loss or ("last" if lm else "driver")
    if lm and not args.paired:
        args.paired = 10
    ours_only = set(args.schedules) - set(THEIRS)
    if set(args.schedules) - {*THEIRS, "zero-bubble"} or (args.loss == "driver" and args.schedules != ["gpipe"]) \
            or (ours_only and not (args.paired and set(args.schedules) & set(THEIRS))) \
            or (set(args.schedules) & set(V_SHAPED) and not args.paired):
        parser.error(f"--schedules takes gpipe, 1f1b, zbv, dualpipev and zero-bubble (ours alone: with --paired and "
                     f"one of theirs, compared with their fastest; zbv and dualpipev with --paired), and the loss on "
                     f"the driver runs gpipe alone (got --schedules {','.join(args.schedules)}, --loss {args.loss})")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error(f"--pin needs 2 cores; this process may use {len(os.sched_getaffinity(0))}")
    if args.warmup < 1 or args.batch % args.chunks:
        parser.error("--warmup must be >= 1 and --batch a multiple of --chunks (equal micro-batches)")
    if args.jobs < 1 or (args.jobs > 1 and not args.paired):
        parser.error(f"--jobs must be >= 1 and goes with --paired (got --jobs {args.jobs}, --paired {args.paired})")

    if lm:
        print(f"model: Embedding({args.vocab}, {args.width}), {args.layers} x (Linear({args.width}, {args.width}) + "
              f"ReLU), Linear({args.width}, {args.vocab}) head, cut in two halves; batch {args.batch} x "
              f"{args.sequence} tokens, {args.chunks} micro-batches; loss = token cross-entropy (logits: "
              f"{args.batch * args.sequence * args.vocab * 4 / 2**20:.0f} MiB a step); 2 processes, 1 intra-op "
              "thread each")
    else:
        print(f"model: {args.layers} x (Linear({args.width}, {args.width}) + ReLU), 2 stages of "
              f"{args.layers // 2} and {args.layers - args.layers // 2} blocks; batch {args.batch}, {args.chunks} "
              f"micro-batches; loss = mean(output**2); 2 processes, 1 intra-op thread each")
    where = (f"the loss on the last stage (process {args.processes - 1}), per micro-batch; only losses come back"
             if args.loss == "last"
             else "the loss on the driver (process 0): the last stage's output travels back to it and the output "
                  "gradient travels out")
    print(f"ours:   RemotePipeline, data plane {args.data_plane!r} (RPC over TensorPipe transport {args.transport}), "
          f"{', '.join(args.schedules)}; "
          f"{where}")
    print(f"theirs: torch.distributed.pipelining PipelineStage + {', '.join(n for n in args.schedules if n in THEIRS)} "
          "over gloo; loss on the "
          "last stage (process 1), grads scaled by 1/n_microbatches (= the whole batch's mean loss)")
    if set(args.schedules) & set(V_SHAPED):
        print(f"{', '.join(n for n in args.schedules if n in V_SHAPED)}: both engines cut the model in "
              f"{2 * args.processes} stages, stages r and {2 * args.processes - 1} - r in process r (a V): the first "
              "and the last stage, and so the loss, in process 0")
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
