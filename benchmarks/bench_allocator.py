"""What glibc's handling of freed memory costs a CPU job's step: the same Trainer job as glibc runs it by default, and
with freed memory kept for the next step, in alternation.

The job is one of ``bench_plan.py``'s layouts (``--model lm`` by default: 2 stages, 1F1B, 4 micro-batches, the
loss on the last stage). By default glibc maps each allocation above its mmap threshold afresh and unmaps it when
freed: an activation of megabytes is then faulted in again on every forward and backward. ``kept`` sets
``MALLOC_MMAP_THRESHOLD_`` to 32 MiB (glibc's largest) and ``MALLOC_TRIM_THRESHOLD_`` to 4 GiB in every process of the
job, so what a step frees stays for the next one. Each job's step is the median of its steps after ``--warmup``;
each stage's forward and backward are read from the job's timeline (their medians).

Printed: per job, the step and each stage's action times; then ``RESULT allocator_kept_over_default=`` (the median of
the kept jobs' steps over the default jobs').

    python benchmarks/bench_allocator.py [--model lm|mlp] [--rounds 2] [--steps 8]
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

#: What "kept" sets in the job's environment (every process of the job inherits it).
KEPT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def job(args: argparse.Namespace, out: str) -> None:
    """One 2-stage 1F1B job of ``bench_plan.py``'s body; writes its steps and timeline to ``out``."""
    import bench_plan
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipeStrategy

    body = bench_plan.body_settings(args.model)
    balance = [6, 4] if args.model == "lm" else [4, 4]
    pl.seed_everything(0)
    times = bench_plan.StepTimes(body, kernel=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[times],
                         strategy=PipeStrategy(balance=balance, microbatches=4, schedule="1f1b", checkpoint="never",
                                               timeline=os.path.join(out, "trace.json")))
    with trainer.init_module():
        model = bench_plan.Model(body)
    x, y = bench_plan.data(body, body.batch * args.steps)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=body.batch))
    with open(os.path.join(out, "steps.json"), "w") as f:
        json.dump(times.steps, f)


def measure(args: argparse.Namespace, kept: bool) -> tuple[float, dict[str, float]]:
    """One job in its own processes: its median step (seconds) and each stage's median action times (ms)."""
    from lightning_pipe.engine.timeline import read_chrome_trace

    out = tempfile.mkdtemp(prefix="lp-bench-allocator-")
    env = {**os.environ, **KEPT} if kept else {k: v for k, v in os.environ.items() if k not in KEPT}
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--job", out], env=env,
                       timeout=args.timeout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(out, "steps.json")) as f:
            steps = json.load(f)[args.warmup:]
        events = read_chrome_trace(os.path.join(out, "trace.json"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    runs = sorted({e.run for e in events})[args.warmup:]
    actions: dict[str, list[float]] = {}
    for e in events:
        if e.run in runs:
            actions.setdefault(f"stage {e.stage} {e.kind}", []).append((e.end - e.start) * 1e3)
    return statistics.median(steps), {k: statistics.median(v) for k, v in sorted(actions.items())}


def main() -> None:
    """Alternate the two ways, ``--rounds`` times, and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("lm", "mlp"), default="lm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args, args.job)
        return
    print(f"body: {args.model}, 2 stages, 1F1B, 4 micro-batches; {args.rounds} rounds, default and kept in turn\n")
    steps: dict[str, list[float]] = {"default": [], "kept": []}
    for _ in range(args.rounds):
        for name in steps:
            step, actions = measure(args, name == "kept")
            steps[name].append(step)
            print(f"{name:8} step {step * 1e3:7.1f} ms; " + ", ".join(f"{k} {v:.1f} ms" for k, v in actions.items()),
                  flush=True)
    ratio = statistics.median(steps["kept"]) / statistics.median(steps["default"])
    print(f"\nRESULT allocator_kept_over_default={ratio:.3f}")


if __name__ == "__main__":
    main()
