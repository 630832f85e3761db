"""Peak memory per process, and step time, of one body at p stages x d replicas under each ``sharding_strategy``.

The body is ``layers`` x ``Linear(width, width)`` (8 x 4096 by default: 0.54 GB of float32 weights, 2.1 GB of
training state with AdamW's two states and the gradients), built under ``trainer.init_module()`` (each stage
materialised in its own processes), trained for ``steps`` steps of ``microbatches`` micro-batches, then saved
(``state_dict_type="sharded"``: every process writes its shards). Every setting is its own job; each replica's
driver reports the peak resident memory (``VmHWM``) of every process of its pipeline once training is over (and
again after the save), and the mean time of the steps after the first two. Printed, per process above the base
every process has (torch and Lightning imported): its peak against the theory, ``W`` the weights of one stage
(``weights / p``), ``U`` one layer's::

    NO_SHARD       W (weights) + W (gradients) + W (DDP's buckets) + 2W (AdamW)              = 5W
    SHARD_GRAD_OP  4W/d (shards: weights, gradients, AdamW) + W (weights, whole during a step)
                   + W (gradients, whole until the step's reduce-scatter)                        = 4W/d + 2W
    FULL_SHARD     4W/d + 4U (in a layer's backward: its weights whole and the layer before's, prefetched;
                   its gradient whole, and FSDP's reduce-scatter buffer of it)                  = 4W/d + 4U

and ``RESULT`` lines with each setting's worst process against the same job's worst under ``NO_SHARD``, and its
step time against ``NO_SHARD``'s (measured one job after another, on the same machine).

Then each setting's checkpoint is resumed by a job of its own (the same layout, its ``max_steps`` reached: the
checkpoint is read, nothing is trained), and each process's peak while resuming is printed against its own peak
while training: ``RESULT ... resume: largest peak_resuming/peak_training of a process`` (at most 1 when resuming
fits wherever training fits; ``--no-resume`` skips it).

Every job runs with ``MALLOC_MMAP_THRESHOLD_=1048576`` (glibc: blocks of 1 MiB or more are mapped and given
back when freed), so that the peaks are what the processes hold, not what glibc's heap keeps: with its default,
dynamic threshold, buffers of a shard's size (16 MiB at d = 4) are carved from the heap, which fragments as
they come and go (measured at d = 4, ``FULL_SHARD``: 0.75-1.04 GiB per process, against 0.54 GiB with the
threshold fixed). ``--default-malloc`` leaves it dynamic.

    python benchmarks/bench_sharded_memory.py [--layers 8] [--width 4096] [--stages 2] [--replicas 2 4]
                                              [--settings NO_SHARD SHARD_GRAD_OP FULL_SHARD] [--no-resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
from bench_large_model_memory import Body, GiB, peak  # the same body, peak measured the same way
from torch.utils.data import DataLoader, TensorDataset

SETTINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")


class StepTimes(pl.Callback):
    """When each training batch ended."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.ends.append(time.perf_counter())


def run(layers: int, width: int, stages: int, replicas: int, setting: str, steps: int, out: str,
        resume: bool = False) -> None:
    """One job; every replica's driver writes its pipeline's peaks and step time to ``out``/replica<r>.json.
    ``resume``: the job resumes from the checkpoint the training job saved in ``out`` instead (the same layout,
    its ``max_steps`` reached: the checkpoint is read, nothing trained) and writes its peaks to
    ``out``/resume<r>.json."""
    from lightning_pipe import PipeStrategy

    pl.seed_everything(0)
    base = peak()  # the interpreter with torch and Lightning imported, before any model
    strategy = PipeStrategy(balance=[layers // stages] * stages, microbatches=4, state_dict_type="sharded",
                            sharding_strategy=setting)
    times = StepTimes()
    trainer = pl.Trainer(accelerator="cpu", devices=stages * replicas, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[times])
    with trainer.init_module():
        model = Body(layers, width)
    data = TensorDataset(torch.randn(16 * replicas * steps, width), torch.randn(16 * replicas * steps, width))
    trainer.fit(model, DataLoader(data, batch_size=16), ckpt_path=os.path.join(out, "model.ckpt") if resume else None)
    trained = [peak(), *[p["peak"] for p in trainer.strategy.memory_per_process()[1:]]]
    if resume:
        assert trainer.global_step == steps, trainer.global_step  # restored, and nothing more trained
        with open(os.path.join(out, f"resume{trainer.global_rank}.json"), "w") as f:
            json.dump({"base": base, "peaks": trained}, f)
        return
    trainer.save_checkpoint(os.path.join(out, "model.ckpt"))
    saved = [peak(), *[p["peak"] for p in trainer.strategy.memory_per_process()[1:]]]
    later = times.ends[2:]
    step = (later[-1] - later[0]) / (len(later) - 1) if len(later) > 1 else float("nan")
    with open(os.path.join(out, f"replica{trainer.global_rank}.json"), "w") as f:
        json.dump({"base": base, "peaks": trained, "saved": saved, "step": step}, f)


def theory(setting: str, stage: float, layer: float, replicas: int) -> float:
    """Bytes a process should hold at its peak (see the module's docstring): ``stage`` and ``layer`` weights."""
    if setting == "NO_SHARD":
        return 5 * stage
    if setting == "SHARD_GRAD_OP":
        return 4 * stage / replicas + 2 * stage
    return 4 * stage / replicas + 4 * layer


def main() -> None:
    """Run every setting at every replica count and print the peaks, the theory and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's mmap threshold dynamic (by default every job runs with "
                             "MALLOC_MMAP_THRESHOLD_=1048576, see the module's docstring)")
    parser.add_argument("--no-resume", action="store_true",
                        help="skip the resume (by default each setting's checkpoint is resumed by a job of its own, "
                             "and each process's peak while resuming is compared with its peak while training)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--job", nargs=3, metavar=("REPLICAS", "SETTING", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--resume-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run(args.layers, args.width, args.stages, int(args.job[0]), args.job[1], args.steps, args.job[2],
            args.resume_job)
        return
    layer = (args.width * args.width + args.width) * 4
    stage = layer * args.layers / args.stages
    print(f"body: {args.layers} x Linear({args.width}), {args.stages} stages: W = {stage / GiB:.2f} GiB of weights "
          f"per stage, U = {layer / GiB:.3f} GiB per layer; AdamW", flush=True)
    worst: dict[tuple[int, str], float] = {}
    steps: dict[tuple[int, str], float] = {}
    resumed: dict[tuple[int, str], float] = {}
    env = dict(os.environ) if args.default_malloc else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    for replicas in args.replicas:
        for setting in args.settings:
            out = tempfile.mkdtemp(prefix="lp-bench-sharded-")
            command = [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--width",
                       str(args.width), "--stages", str(args.stages), "--steps", str(args.steps),
                       "--job", str(replicas), setting, out]
            start = time.perf_counter()
            try:
                results = _job(command, replicas, out, "replica", args.timeout, env, f"d={replicas} {setting}")
                if not args.no_resume:
                    resumes = _job([*command, "--resume-job"], replicas, out, "resume", args.timeout, env,
                                   f"d={replicas} {setting} resuming")
            finally:
                shutil.rmtree(out, ignore_errors=True)
            held = [p - result["base"] for result in results for p in result["peaks"]]
            saving = [p - result["base"] for result in results for p in result["saved"]]
            expected = theory(setting, stage, layer, replicas)
            worst[replicas, setting] = max(held)
            steps[replicas, setting] = sum(result["step"] for result in results) / replicas
            print(f"p={args.stages} d={replicas} {setting:13s} ({time.perf_counter() - start:5.1f} s): peak per "
                  f"process above base (GiB) {' '.join(f'{b / GiB:.2f}' for b in held)}; theory "
                  f"{expected / GiB:.2f}, worst/theory {max(held) / expected:.2f}; with the sharded save "
                  f"{max(saving) / GiB:.2f}; step {steps[replicas, setting] * 1000:.0f} ms", flush=True)
            if not args.no_resume:  # each process against itself (same replica, same stage) while training
                resuming = [p - result["base"] for result in resumes for p in result["peaks"]]
                resumed[replicas, setting] = max(r / t for r, t in zip(resuming, held))
                print(f"{'':19s} resuming from its checkpoint: peak per process above base (GiB) "
                      f"{' '.join(f'{b / GiB:.2f}' for b in resuming)}; resuming / training per process "
                      f"{' '.join(f'{r / t:.2f}' for r, t in zip(resuming, held))}", flush=True)
    for replicas in args.replicas:
        for setting in args.settings:
            if setting != "NO_SHARD" and "NO_SHARD" in args.settings:
                print(f"RESULT p={args.stages} d={replicas} {setting}: worst process / NO_SHARD's worst = "
                      f"{worst[replicas, setting] / worst[replicas, 'NO_SHARD']:.2f} (theory "
                      f"{theory(setting, stage, layer, replicas) / theory('NO_SHARD', stage, layer, replicas):.2f}), "
                      f"step time / NO_SHARD's = {steps[replicas, setting] / steps[replicas, 'NO_SHARD']:.2f}")
            if (replicas, setting) in resumed:
                print(f"RESULT p={args.stages} d={replicas} {setting} resume: largest peak_resuming/peak_training "
                      f"of a process = {resumed[replicas, setting]:.2f}")


def _job(command: list[str], replicas: int, out: str, name: str, timeout: float, env: dict[str, str],
         what: str) -> list[dict[str, object]]:
    """Run one job in its own session (on a timeout every process of it is ended, by the job's group id); what
    each replica's driver wrote to ``out``/<name><r>.json."""
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise SystemExit(f"{what}: no result within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{err[-3000:]}")
    results = []
    for r in range(replicas):
        with open(os.path.join(out, f"{name}{r}.json")) as f:
            results.append(json.load(f))
    return results


if __name__ == "__main__":
    main()
