"""The planner against itself: each layout of a grid trained by the Trainer, every process's measured peak and the
step beside what :func:`lightning_pipe.plan_layout` predicted for it, and the planner's choice against the best
layout measured.

Two bodies: an MLP (``--layers`` x (Linear(``--width``) + ReLU), a regression loss) and a small language model
(``--model lm``: an embedding, ``--layers`` transformer-like blocks, a head; the token loss), both trained by AdamW
with the loss on the last stage. The grid: stages 1-4 (and 2 per process in a V or interleaved), tensor-parallel size
1-2 (the MLP's layers split colwise, rowwise in turn), replicas 1-2 (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD), each
schedule, recomputation on and off. Each layout runs as jobs of ``--steps`` steps each: once for its memory
(``MALLOC_MMAP_THRESHOLD_`` at 64 KiB: every tensor of the grid's micro-batches its own mapping, given back when freed,
so the peaks are what the processes hold, not what glibc's heap keeps; at 1 MiB, the LM's 4-process layouts, whose
micro-batches' tensors are 512 KiB, measured 15% above what they held), then for its step (glibc's default: as a
user runs it; the median over the steps after ``--warmup``; ``--repeats`` runs of each 2-process layout, the median
of theirs, taken in rounds: every layout once, then every 2-process layout again, so that a slow minute of the
machine falls on one run of several layouts, not on every run of one); every replica's driver reports the peak resident
memory (``VmHWM``) of each process of its pipeline, above what the process held as it
joined its session (``memory_per_process()``'s ``base``: torch and Lightning imported, no stage yet). The prediction
is made here, in this process, from the body
measured once per number of processes (each process computes on ``cores / processes`` threads), before any job runs,
and for the 2 processes again before each later round: each timed run is compared with the step predicted from the
measurement made minutes before it (the ratio of the two, its median over the runs), not with one made at the start
of a run of half an hour, during which the machine's speed moved by a fifth.

The machine's speed: on a shared VM the same kernel runs 20% faster or slower from one second to the next, and a
job's step moved by 25-40% between runs of the same layout. The body's measurement takes the fastest of its passes
(the machine undisturbed), so the prediction is a step at the machine's fastest. A reference piece of the body's work
(:func:`reference_speed`: one of the MLP's layers on a micro-batch; one of the language model's blocks forward and
backward) is timed at its fastest before and after the body is measured (:func:`fastest_speed`, as many copies at
once as the job has processes, up to the cores, as the body is measured) and, in a job, after every step by as many
of the pipeline's processes at once (its own time left out of the steps); each step is also compared at the
prediction's speed: times the reference's fastest time then over its fastest in the job. That correction was made
for a prediction an hour older than the step; a prediction minutes older needs it less than the correction's own
noise costs (two readings of the reference, each 10-15% apart from run to run): the steps as timed give
``plan_step_error_max`` and the choice, the corrected ones ``plan_step_error_max_at_prediction_speed``.

Printed: per layout, each process's predicted and measured peak, their error, the step predicted and measured (median
over the steps after the first two); then ``RESULT plan_memory_error_max=`` (the largest |predicted - measured| /
measured peak over every process of every layout), ``RESULT plan_step_error_max=`` (the same for the step, layouts of
2 processes) and ``RESULT plan_choice_over_best=`` (the planner's choice among the 2-process layouts of the grid, its
measured step over the best measured).

    python benchmarks/bench_plan.py [--model mlp|lm] [--steps 6] [--only 3,5] [--repeats 3]

"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: glibc's mmap threshold for the memory runs (bytes): below the smallest activation of the grid's layouts.
MMAP_THRESHOLD = 64 << 10
#: (processes, virtual stages, tensor size, replicas, sharding, micro-batches, schedule, checkpoint)
GRID = [
    (1, 1, 1, 1, "NO_SHARD", 4, "gpipe", "never"),
    (2, 1, 1, 1, "NO_SHARD", 4, "gpipe", "never"),
    (2, 1, 1, 1, "NO_SHARD", 4, "1f1b", "never"),
    (2, 1, 1, 1, "NO_SHARD", 8, "1f1b", "never"),
    (2, 1, 1, 1, "NO_SHARD", 4, "1f1b", "always"),
    (2, 1, 1, 1, "NO_SHARD", 4, "zero-bubble", "never"),
    (2, 2, 1, 1, "NO_SHARD", 4, "zbv", "never"),
    (2, 2, 1, 1, "NO_SHARD", 4, "interleaved-1f1b", "except_last"),
    (1, 1, 2, 1, "NO_SHARD", 4, "gpipe", "never"),
    (1, 1, 1, 2, "NO_SHARD", 4, "gpipe", "never"),
    (1, 1, 1, 2, "FULL_SHARD", 4, "gpipe", "never"),
    (4, 1, 1, 1, "NO_SHARD", 8, "1f1b", "never"),
    (4, 1, 1, 1, "NO_SHARD", 4, "gpipe", "always"),
    (2, 1, 2, 1, "NO_SHARD", 4, "1f1b", "never"),
    (2, 1, 1, 2, "NO_SHARD", 4, "1f1b", "never"),
    (2, 1, 1, 2, "SHARD_GRAD_OP", 4, "1f1b", "never"),
    (2, 1, 1, 2, "FULL_SHARD", 4, "gpipe", "except_last"),
    (2, 2, 1, 2, "NO_SHARD", 4, "dualpipev", "never"),
]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The MLP's loss."""
    return nn.functional.mse_loss(output, target)


def tokens(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The language model's loss."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


class Block(nn.Module):
    """A residual block of the language model: a feed-forward of 4x the width, layer-normed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def body(args: argparse.Namespace) -> nn.Sequential:
    """The benchmark's body."""
    if args.model == "lm":
        return nn.Sequential(nn.Embedding(args.vocab, args.width), *[Block(args.width) for _ in range(args.layers)],
                             nn.Linear(args.width, args.vocab))
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)])


def tensor_plan(args: argparse.Namespace) -> dict[str, str]:
    """The MLP's layers split colwise and rowwise in turn; the language model's blocks, up colwise, down rowwise."""
    if args.model == "lm":
        return {f"{k}.{name}": style for k in range(1, args.layers + 1)
                for name, style in (("up", "colwise"), ("down", "rowwise"))}
    return {f"{k}.0": "colwise" if k % 2 == 0 else "rowwise" for k in range(args.layers)}


def data(args: argparse.Namespace, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` samples of inputs and targets."""
    g = torch.Generator().manual_seed(0)
    if args.model == "lm":
        x = torch.randint(0, args.vocab, (rows, args.sequence), generator=g)
        return x, torch.roll(x, -1, dims=1)
    return torch.randn(rows, args.width, generator=g), torch.randn(rows, args.width, generator=g)


class Model(pl.LightningModule):
    """The body trained by AdamW, the loss on the last stage."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.sequential_module = body(args)
        self.loss_fn = tokens if args.model == "lm" else mse

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from lightning_pipe import loss_on_last_stage

        x, y = batch
        return loss_on_last_stage(self.sequential_module, x, y, self.loss_fn)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


#: Each body's settings where the command line leaves them out: its layers, width, vocabulary and sequence (the
#: language model's), and the rows of a replica's batch.
BODIES = {"mlp": {"layers": 8, "width": 1536, "vocab": 8192, "sequence": 64, "batch": 64},
          "lm": {"layers": 8, "width": 512, "vocab": 8192, "sequence": 64, "batch": 32}}


def body_settings(model: str, **given: int | None) -> argparse.Namespace:
    """The settings of body ``model`` (``"mlp"`` or ``"lm"``): :data:`BODIES`' where ``given`` has None or nothing."""
    return argparse.Namespace(model=model, **{k: v if given.get(k) is None else given[k]
                                              for k, v in BODIES[model].items()})


#: The reference kernel's shapes: one of the MLP's layers on a micro-batch of 16 rows.
REFERENCE = (16, 1536)
#: The language model's reference: one of its blocks on this many sequences (a micro-batch of 8 rows).
REFERENCE_ROWS = 8


def one_thread_mean(call: Callable[[], object], calls: int) -> float:
    """The seconds one ``call`` takes on one intra-op thread, the mean of ``calls`` after one to warm up."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call()  # warm
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls
    finally:
        torch.set_num_threads(previous)


def speed(calls: int = 20) -> float:
    """This machine's speed now for the MLP: the seconds one call of a fixed kernel takes on one thread, the mean of
    ``calls`` (a 16 x 1536 by 1536 x 1536 product and a ReLU: one of the MLP's layers on a micro-batch). On a shared VM
    the same work runs 20% faster or slower from one second to the next."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(REFERENCE, generator=g), torch.randn(REFERENCE[1], REFERENCE[1], generator=g)
    return one_thread_mean(lambda: torch.relu(x @ w), calls)


def block_speed(width: int, sequence: int, calls: int = 2) -> float:
    """This machine's speed now for the language model: the seconds one of its blocks takes forward and backward on
    :data:`REFERENCE_ROWS` sequences, on one thread (the mean of ``calls``): its products are as large as the LM's
    actions', which move with the machine where the MLP's small kernel does not (docs/benchmarks.md)."""
    torch.manual_seed(0)
    block = Block(width)
    x = torch.randn(REFERENCE_ROWS, sequence, width, requires_grad=True)
    return one_thread_mean(lambda: block(x).sum().backward(), calls)


def reference_speed(model: str, width: int, sequence: int) -> float:
    """The reference of body ``model``: :func:`block_speed` for the language model, :func:`speed` for the MLP."""
    return block_speed(width, sequence) if model == "lm" else speed()


def fastest_speed(args: argparse.Namespace, copies: int, samples: int = 8) -> float:
    """The body's reference (:func:`reference_speed`) at its fastest over ``samples``, ``copies`` of it running at
    once (as the body is measured, and as a job's processes run it between steps): the machine undisturbed, as the
    planner's measurement of the body takes the fastest of its passes."""
    from lightning_pipe.engine.planning.measure import concurrently

    work = lambda: (reference_speed(args.model, args.width, args.sequence),)  # noqa: E731
    return min(concurrently(work, copies)[0] for _ in range(samples))


class StepTimes(pl.Callback):
    """Each training batch's time from the end of the one before (the reference's time left out), and the body's
    reference (:func:`reference_speed`) right after it, run by the pipeline's first processes at once, as many as the
    machine has cores (their mean). ``together``: every process is a replica's driver (one stage, no tensor ranks),
    which runs its own reference: they start it at once (a barrier), as the planner's measurement ran its copies;
    each on its own clock, the fastest sample was one where the other replica's was not running beside it."""

    def __init__(self, args: argparse.Namespace, kernel: bool = True, together: bool = False) -> None:
        self.reference = (args.model, args.width, args.sequence)
        self.kernel = kernel
        self.together = together
        self.steps: list[float] = []
        self.speeds: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        import torch.distributed.rpc as rpc

        end = time.perf_counter()
        if self._last is not None:
            self.steps.append(end - self._last)
        if self.kernel:
            # As many processes at once as the machine has cores (as at the prediction; one process alone: none).
            pipeline, cores = trainer.strategy._pipeline, os.cpu_count() or 1
            if self.together:
                torch.distributed.barrier()
            others = [rpc.rpc_async(peer, reference_speed, args=self.reference)
                      for peer in (pipeline.peers[1:cores] if pipeline is not None else ())]
            mine = reference_speed(*self.reference)
            self.speeds.append(statistics.mean([mine, *(f.wait() for f in others)]))
        self._last = time.perf_counter()  # the reference's own time is no step's


def balance_of(args: argparse.Namespace, layout: tuple, profile: Any) -> list[int]:
    """The layout's balance as the planner splits it (by time)."""
    from lightning_pipe.engine.planning.layouts import balances

    p, v, t, d, _, m, _, _ = layout
    return list(balances(profile, p * v, args.batch / m)[0])


def job(args: argparse.Namespace, layout: tuple, balance: list[int], out: str, memory: bool) -> None:
    """One layout trained; every replica's driver writes its pipeline's peaks and step times to ``out`` (``memory``:
    without the reference kernel between steps, whose tensors would count in the driver's peak)."""
    from lightning_pipe import PipeStrategy

    p, v, t, d, sharding, m, schedule, checkpoint = layout
    pl.seed_everything(0)
    strategy = PipeStrategy(balance=balance, microbatches=m, schedule=schedule, virtual_stages=v, checkpoint=checkpoint,
                            tensor_parallel_size=t, tensor_parallel_plan=tensor_plan(args) if t > 1 else None,
                            sharding_strategy=sharding)
    times = StepTimes(args, kernel=not memory, together=p == 1 and t == 1 and d > 1)
    trainer = pl.Trainer(accelerator="cpu", devices=p * t * d, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[times])
    with trainer.init_module():
        model = Model(args)
    x, y = data(args, args.batch * d * args.steps)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch))
    reports = trainer.strategy.memory_per_process()
    peaks = [q["peak"] - q["base"] for q in reports]  # above what each held as it joined its session
    with open(os.path.join(out, f"replica{trainer.global_rank}.json"), "w") as f:
        json.dump({"held": peaks, "steps": times.steps[1:], "speeds": times.speeds[1:]}, f)


def measure(args: argparse.Namespace, index: int, layout: tuple, balance: list[int], memory: bool
            ) -> list[dict[str, Any]]:
    """Run layout ``index`` as a job of its own; every replica's report. ``memory``: with glibc's mmap threshold
    fixed (every large tensor its own mapping, given back when freed: the peaks are what the processes hold), else
    as a user runs it (the step: a fixed threshold makes every large allocation fault its pages in afresh)."""
    out = tempfile.mkdtemp(prefix="lp-bench-plan-")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if memory else dict(os.environ)
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--job", str(index),
               "memory" if memory else "step", ",".join(map(str, balance)), out]
    try:
        subprocess.run(command, env=env, timeout=args.timeout, check=True, stdout=subprocess.DEVNULL)
        d = layout[3]
        return [json.load(open(os.path.join(out, f"replica{r}.json"))) for r in range(d)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    """Predict every layout of the grid, run each, and print the errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp")
    parser.add_argument("--layers", type=int, default=None, help="default: 8")
    parser.add_argument("--width", type=int, default=None, help="default: 1536 (mlp), 512 (lm)")
    parser.add_argument("--vocab", type=int, default=None, help="lm: default 8192")
    parser.add_argument("--sequence", type=int, default=None, help="lm: default 64")
    parser.add_argument("--batch", type=int, default=None, help="rows per replica's batch; default: 64 (mlp), 32 (lm)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the step's median")
    parser.add_argument("--only", default=None, help="grid indices, comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each 2-process layout (the median of their steps at the prediction's "
                             "speed)")
    parser.add_argument("--job", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    vars(args).update(vars(body_settings(args.model, **{k: getattr(args, k) for k in BODIES[args.model]})))
    if args.job:
        job(args, GRID[int(args.job[0])], [int(b) for b in args.job[2].split(",")], args.job[3],
            args.job[1] == "memory")
        return
    from lightning_pipe.engine.planning import format_bytes, measure_body, plan_layout
    from lightning_pipe.engine.planning.layouts import Layout

    torch.manual_seed(0)
    module = body(args)
    sample = data(args, args.batch)[0]
    cores = os.cpu_count() or 1
    grid = [GRID[int(k)] for k in args.only.split(",")] if args.only else GRID
    indices = [int(k) for k in args.only.split(",")] if args.only else list(range(len(GRID)))
    print(f"body: {args.model}, {args.layers} layers of width {args.width}; {args.batch} rows per replica's batch; "
          f"AdamW; "
          f"{cores} cores\n")
    from dataclasses import replace

    from lightning_pipe.engine.planning import optimizer_time, tensor_probes
    from lightning_pipe.lightning.planned import measured_costs

    def machine_costs(profile: Any) -> Any:
        """This machine's collectives, as plan_layout's callers measure them: tensor parallel's on pairs of layers
        shaped as the body's split ones (:func:`tensor_probes`)."""
        found = measured_costs(min(2, cores), tensor_probes(module, tensor_plan(args), profile))
        print(f"collectives measured: {found.collective * 1e3:.2f} ms fixed, all-reduce "
              f"{found.collective_bandwidth / 1e9:.2f} GB/s per process; FSDP {found.sharded_per_byte * 1e9:.2f} ns "
              f"per byte and use; tensor parallel per split module and action {found.tensor_action * 1e3:.2f} ms "
              f"and {found.tensor_per_byte * 1e9:.2f} ns per byte of its input\n")
        return found

    costs = None
    profiles: dict[int, Any] = {}
    speeds: dict[int, float] = {}  # the kernel's fastest (:func:`fastest_speed`) around each profile's measurement
    costs_of: dict[int, Any] = {}
    errors_memory: list[float] = []
    errors_scaled: list[float] = []
    errors_step: list[float] = []
    measured_two: dict[Layout, float] = {}

    def planned(devices: int, where: Any, balance: list[int] | None = None, tensor: bool = True) -> Any:
        """What plan_layout predicts of the layouts ``where`` keeps (the body measured once per process count, as
        the planner measures it for that many processes)."""
        return plan_layout(module, sample, devices=devices, memory_per_device=2**50, optimizer=torch.optim.AdamW,
                           tensor_parallel_plan=tensor_plan(args) if tensor else None,
                           profile=profiles[devices], balance=balance, where=where,
                           costs=costs_of[devices])

    def measured_body(devices: int) -> Any:
        """The body measured as the planner measures it for ``devices`` processes; this machine's fastest then (the
        kernel's fastest before and after)."""
        before = fastest_speed(args, min(devices, cores))
        profile = measure_body(module, sample, threads=max(1, cores // devices), concurrent=min(devices, cores))
        speeds[devices] = min(before, fastest_speed(args, min(devices, cores)))
        return profile

    def at_prediction_speed(run: dict[str, Any], speed: float) -> list[float]:
        """A run's steps after the warm-up, each as long as it would have been at the speed the prediction was made
        at (``speed``): times the kernel's fastest time then over its fastest in the run (the fastest of one statistic
        on either side: a step scaled by the kernel's time right around it took each sample's noise, most of it
        slowness, for the machine's, and moved one layout's error from 2% to 27% between two runs)."""
        scale = speed / min(run["speeds"])
        return [step * scale for step in run["steps"]][args.warmup:]

    def timed(index: int, layout: tuple, record: dict[str, Any]) -> Any:
        """One timed run of layout ``index``, beside the step predicted from the body's latest measurement; that
        prediction."""
        devices, t = record["devices"], layout[2]
        predicted = planned(devices, lambda lay, mine=record["mine"]: lay == mine, record["balance"], t > 1).chosen
        record["runs"].append({"jobs": measure(args, index, layout, record["balance"], memory=False),
                               "predicted": predicted.step, "speed": speeds[devices]})
        return predicted

    planned_runs: dict[int, dict[str, Any]] = {}  # per grid index: its layout, prediction, memory and step runs
    for index, layout in zip(indices, grid):
        p, v, t, d, sharding, m, schedule, checkpoint = layout
        devices = p * t * d
        if devices not in profiles:  # measured once per process count, as plan_layout measures them
            profiles[devices] = measured_body(devices)
            costs = costs or machine_costs(profiles[devices])
            torch.set_num_threads(max(1, cores // devices))
            costs_of[devices] = replace(costs, optimizer_per_byte=optimizer_time(
                torch.optim.AdamW, torch.device("cpu"), min(devices, cores)))
            torch.set_num_threads(cores)
        balance = balance_of(args, layout, profiles[devices])
        mine = Layout(p, v, tuple(balance), t, d, sharding, m, schedule, checkpoint)
        start = time.perf_counter()
        planned_runs[index] = record = {"mine": mine, "balance": balance, "devices": devices,
                                        "reports": measure(args, index, layout, balance, memory=True), "runs": []}
        record["predicted"] = timed(index, layout, record)  # (its memory, compared below)
        print(f"[{index:2}] {mine}: memory and a first step measured ({time.perf_counter() - start:.0f} s)", flush=True)
    twos = [(index, layout) for index, layout in zip(indices, grid) if planned_runs[index]["devices"] == 2]
    for round_ in range(1, args.repeats if twos else 1):  # the 2-process layouts again, in rounds
        # The body measured again first: each run beside a prediction made minutes before it, not an hour.
        profiles[2] = measured_body(2)
        for index, layout in twos:
            timed(index, layout, planned_runs[index])
        print(f"round {round_ + 1} of {args.repeats} measured", flush=True)
    print()
    for index, layout in zip(indices, grid):
        p, v, t, d, sharding, m, schedule, checkpoint = layout
        record = planned_runs[index]
        mine, devices, predicted, reports, runs = (record[k] for k in ("mine", "devices", "predicted", "reports",
                                                                         "runs"))
        measured = [q for r in reports for q in r["held"]]
        # Each replica's pipeline, per process (every tensor rank of a process reports apart: its own process).
        per_process = [mem.total for mem in predicted.memory]
        errors = []
        for r in reports:
            held = r["held"]
            ranks = len(held) // p if len(held) % p == 0 else 1
            for k, h in enumerate(held):
                want = per_process[min(k // ranks, p - 1)]
                errors.append(abs(want - h) / h)
        # Each run's median step (every replica's), raw and at its prediction's speed, over the step predicted
        # beside it; the median of those ratios over the runs.
        raw_steps = [statistics.median(s for r in run["jobs"] for s in r["steps"][args.warmup:]) for run in runs]
        steps = [statistics.median(s for r in run["jobs"] for s in at_prediction_speed(r, run["speed"]))
                 for run in runs]
        predictions = [run["predicted"] for run in runs]
        error_scaled = abs(statistics.median(w / s for w, s in zip(predictions, steps)) - 1)
        error = abs(statistics.median(w / s for w, s in zip(predictions, raw_steps)) - 1)
        errors_memory.append(max(errors))
        if devices == 2:
            errors_scaled.append(error_scaled)
            errors_step.append(error)
            if d == 1:  # the choice among layouts of the same work per step (a replica more trains twice the rows)
                measured_two[mine] = statistics.median(raw_steps)
        print(f"[{index:2}] {mine}\n     peak predicted "
              f"{' '.join(format_bytes(x) for x in per_process)}; measured "
              f"{' '.join(format_bytes(x) for x in measured)}"
              f"; largest error {max(errors):.1%}\n     step predicted "
              f"{', '.join(f'{w * 1e3:.1f}' for w in predictions)} ms, measured at the prediction's speed "
              f"{', '.join(f'{s * 1e3:.1f}' for s in steps)} ms ({error_scaled:.1%}; as timed "
              f"{', '.join(f'{s * 1e3:.1f}' for s in raw_steps)} ms, {error:.1%})", flush=True)
    print(f"\nRESULT plan_memory_error_max={max(errors_memory):.3f}")
    if errors_step:
        print(f"RESULT plan_step_error_max={max(errors_step):.3f}")
        print(f"RESULT plan_step_error_max_at_prediction_speed={max(errors_scaled):.3f}")
    if measured_two:
        # The planner's choice among the 2-process layouts of one replica run: plan_layout's over them alone.
        chosen = planned(2, lambda lay: lay in measured_two).layout
        best = min(measured_two.values())
        print(f"the planner's choice of the {len(measured_two)} 2-process layouts of one replica: {chosen} "
              f"(measured {measured_two[chosen] * 1e3:.1f} ms, best {best * 1e3:.1f} ms)")
        print(f"RESULT plan_choice_over_best={measured_two[chosen] / best:.3f}")

if __name__ == "__main__":
    main()
