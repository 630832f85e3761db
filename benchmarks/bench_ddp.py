"""Averaging replicas with DDP during the pipeline's backward: the communication left exposed, and gradient memory.

2 replicas x 2 stages (4 processes, Lightning's launcher) train an MLP body under GPipe with ``PipeStrategy``,
five times, side by side in one run, each stage's layers either computing on the host's cores (``cpu``: the
all-reduce, which gloo computes on those cores too, competes with them) or sleeping besides (``sleep``: compute
that leaves the cores free, as a GPU's kernels do):

- ``overlap``: each stage's DDP reducer is prepared for its last backward of the step, so its buckets are
  all-reduced while that backward still runs and while the stage before it is in its backward;
- ``after``: the same DDP, its reduction started only once the stage's whole backward is over (what averaging
  after the pipeline's backward gives: ``lightning_pipe.transport.parallel.ddp.OVERLAP = False``);
- ``overlap, views``: as ``overlap``, with ``gradient_as_bucket_view=True``.

Per stage (replica 0's process of each), median over the timed steps:

- exposed: from the moment the stage's last backward produced its last gradient to the end of its reduction
  (the "R" events of the timeline): what the optimizer step waits for;
- reduction: from the first bucket handed to the comm hook to the last bucket's all-reduce done (a timing hook
  around torch's ``allreduce_hook``);
- gradient memory: bytes of the parameters' ``.grad`` and of DDP's buckets, counted without double counting
  storage they share (``gradient_as_bucket_view=True``: the gradients are views of the buckets), beside the
  gradients alone; the former hand-written averaging concatenated every gradient into one new flat tensor
  (2.00x at the reduction).

The timeline of the ``sleep, overlap`` run, drawn with each stage's reductions under its row, goes to
``--picture`` (default ``ddp_timeline.png``).

    python benchmarks/bench_ddp.py [--width 1024] [--layers 4] [--batch 64] [--chunks 4] [--sleep-ms 10]
                                   [--bucket-cap-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from lightning_pipe import PipeStrategy

#: name -> (compute, overlap, gradient_as_bucket_view)
RUNS = {"cpu, overlap": ("cpu", True, False), "cpu, after": ("cpu", False, False),
        "cpu, overlap, views": ("cpu", True, True), "sleep, overlap": ("sleep", True, False),
        "sleep, after": ("sleep", False, False)}


class Timing:
    """The timing hook's state: where this process writes its records, and the stage it times."""

    def __init__(self, directory: str, stage: int, process_group: Any) -> None:
        self.directory, self.stage, self.process_group = directory, stage, process_group


def timed_allreduce(state: Timing, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001
    """torch's ``allreduce_hook``, recording when each bucket was handed over and when its all-reduce ended,
    and the bytes of the bucket and of its parameters' gradients (those that are not views of it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    start = time.time()
    buffer = bucket.buffer()
    low = buffer.untyped_storage().data_ptr()
    own = sum(p.grad.nbytes for p in bucket.parameters()
              if p.grad is not None and p.grad.untyped_storage().data_ptr() != low)
    record = {"stage": state.stage, "index": bucket.index(), "last": bucket.is_last(), "start": start,
              "bucket": buffer.nbytes, "grads": sum(p.numel() * p.element_size() for p in bucket.parameters()),
              "own": own}
    future = default_hooks.allreduce_hook(state.process_group, bucket)

    def done(f: Any) -> Any:
        record["end"] = time.time()
        rank = os.environ.get("LOCAL_RANK", "0")  # Lightning's launcher numbers the processes it starts
        with open(os.path.join(state.directory, f"{rank}.jsonl"), "a") as out:
            out.write(json.dumps(record) + "\n")
        return f.value()

    return future.then(done)


class _Sleep(torch.autograd.Function):
    """The identity that sleeps ``t`` in forward and ``2 t`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: float) -> torch.Tensor:
        ctx.t = t
        time.sleep(t)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(2 * ctx.t)
        return grad, None


class Sleep(nn.Module):
    """Compute that leaves the host's cores free, as a GPU's kernels do: ``t`` seconds forward, ``2 t``
    backward, per micro-batch."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.t)


class TimedPipe(PipeStrategy):
    """``PipeStrategy`` whose stages' DDPs time their reductions (``configure_ddp`` overridden), writing into
    ``records``. Sent to the stages' processes, which find it here by name."""

    def __init__(self, records: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records = records

    def configure_ddp(self, module: nn.Module, device_ids: Any, process_group: Any, stage: Any) -> Any:
        ddp = super().configure_ddp(module, device_ids, process_group, stage)
        if stage is not None:
            ddp.register_comm_hook(Timing(self.records, stage, process_group), timed_allreduce)
        return ddp


def child(args: argparse.Namespace) -> None:
    """One training run (this process and the 3 Lightning starts): the run's records go to ``args.out``."""
    import lightning.pytorch as pl

    from lightning_pipe.transport.parallel import ddp

    torch.set_num_threads(1)
    compute, ddp.OVERLAP, views = RUNS[args.child]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks: list[nn.Module] = []
            for _ in range(2 * args.layers):
                blocks += [nn.Linear(args.width, args.width),
                           nn.Tanh() if compute == "cpu" else Sleep(args.sleep_ms / 1e3)]
            self.sequential_module = nn.Sequential(*blocks)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.sequential_module(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    batch = args.batch if compute == "cpu" else args.chunks  # sleeping: one sample per micro-batch
    data = torch.utils.data.TensorDataset(torch.randn(batch * 2 * (args.steps + 2), args.width))
    strategy = TimedPipe(args.out, balance=[2 * args.layers, 2 * args.layers], microbatches=args.chunks,
                         checkpoint="never", timeline=os.path.join(args.out, "trace.json"),
                         process_group_backend="gloo", gradient_as_bucket_view=views,
                         find_unused_parameters=False, bucket_cap_mb=args.bucket_cap_mb)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=batch))


def launch(run: str, args: argparse.Namespace, out: str) -> None:
    """Run ``run`` in its own processes, bounded by ``args.timeout``; every process ends with it."""
    import signal

    argv = [sys.executable, __file__, "--child", run, "--out", out, *sys.argv[1:]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.wait() != 0:
        raise RuntimeError(f"the {run!r} run failed (status {proc.returncode}):\n{output[-4000:]}")


def measure(out: str, run: str, warmup: int) -> dict[int, dict[str, float]]:
    """Per stage of replica 0: median exposed and whole reduction times (ms), gradient and bucket bytes."""
    from lightning_pipe.engine.timeline import read_chrome_trace

    events = read_chrome_trace(os.path.join(out, "trace.json"))
    records: dict[int, list[dict[str, Any]]] = {}
    for rank in (0, 1):  # replica 0's processes: stage 0 (the driver) and stage 1
        with open(os.path.join(out, f"{rank}.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        records[lines[0]["stage"]] = lines
    result = {}
    for stage in sorted({e.stage for e in events}):
        runs = sorted({e.run for e in events if e.stage == stage and e.kind == "R"})[warmup:]
        exposed = []
        for r in runs:
            reduction = next(e for e in events if e.stage == stage and e.kind == "R" and e.run == r)
            backward = max(e.end for e in events if e.stage == stage and e.run == r and e.kind in "BW")
            produced = max(backward, reduction.start) if RUNS[run][1] else backward
            exposed.append(reduction.end - produced)
        reductions: list[list[dict[str, Any]]] = [[]]  # each reduction: its buckets, up to the last one
        for rec in sorted(records[stage], key=lambda rec: rec["start"]):
            reductions[-1].append(rec)
            if rec["last"]:
                reductions.append([])
        reductions.pop()
        whole = [max(c["end"] for c in red) - min(c["start"] for c in red) for red in reductions[warmup:]]
        last = reductions[-1]
        result[stage] = {"exposed": statistics.median(exposed) * 1e3, "whole": statistics.median(whole) * 1e3,
                         "grads": sum(rec["grads"] for rec in last),
                         "memory": sum(rec["bucket"] + rec["own"] for rec in last)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="features of every linear layer")
    parser.add_argument("--layers", type=int, default=4, help="linear layers per stage")
    parser.add_argument("--batch", type=int, default=64, help="samples per replica and step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches")
    parser.add_argument("--sleep-ms", type=float, default=10.0,
                        help="the sleep runs: a layer's forward per micro-batch (its backward: twice)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="DDP's bucket size (4: about one layer's gradients per bucket at width 1024)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run's processes are killed")
    parser.add_argument("--picture", default="ddp_timeline.png", help="where to draw the overlap run's timeline")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"2 replicas x 2 stages (4 processes, gloo on loopback, 1 thread each), {args.layers} linear layers of "
          f"{args.width} per stage ({args.layers * (args.width + 1) * args.width * 4 / 2**20:.0f} MiB of float32 "
          f"gradients, buckets of {args.bucket_cap_mb:g} MiB), {args.chunks} micro-batches, GPipe; median of "
          f"{args.steps} steps after 2 warm-up steps.\n"
          f"cpu: the layers compute on the host's cores (batch {args.batch} per replica), as the all-reduce does; "
          f"sleep: each layer also sleeps {args.sleep_ms:g} ms forward, {2 * args.sleep_ms:g} ms backward per "
          "micro-batch (one sample each), leaving the cores to the all-reduce, as a GPU's kernels would\n")
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            out = os.path.join(tmp, run.replace(", ", "-"))
            os.makedirs(out)
            launch(run, args, out)
            results[run] = measure(out, run, warmup=2)
            if run == "sleep, overlap":
                from lightning_pipe.engine.timeline import read_chrome_trace, render

                events = read_chrome_trace(os.path.join(out, "trace.json"))
                last = sorted({e.run for e in events})[-3:]
                render([e for e in events if e.run in last], args.picture, title="2 replicas x 2 stages, GPipe, "
                       "sleeping layers: each stage's all-reduce")
    print(f"{'run':<20}{'stage':>6}{'exposed':>11}{'reduction':>12}{'exposed/reduction':>19}{'grad memory':>14}"
          f"{'/ gradients':>13}")
    for run, stages in results.items():
        for stage, r in stages.items():
            print(f"{run:<20}{stage:>6}{r['exposed']:>9.1f}ms{r['whole']:>10.1f}ms{r['exposed'] / r['whole']:>19.2f}"
                  f"{r['memory'] / 2**20:>10.1f}MiB{r['memory'] / r['grads']:>12.2f}x")
    print()
    for compute in ("cpu", "sleep"):
        for stage in results[f"{compute}, overlap"]:
            on, off = results[f"{compute}, overlap"][stage], results[f"{compute}, after"][stage]
            print(f"{compute}, stage {stage}: exposed with overlap / exposed after the backward: "
                  f"{on['exposed'] / off['exposed']:.2f} ({on['exposed']:.1f} / {off['exposed']:.1f} ms)")
    print(f"\ntimeline of the sleep, overlap run: {args.picture}")
    print(f"wall time of the benchmark: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
