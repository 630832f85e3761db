"""Activation memory per stage and schedule, counted with saved-tensor hooks, beside each schedule's theory.

A ``Pipe`` of ``p`` stages (each a few Linear + ReLU layers, every stage alike) runs one training step per
schedule with ``checkpoint="never"`` and the loss on the last stage. While each stage's partition runs, a
``torch.autograd.graph.saved_tensors_hooks`` pair counts the bytes autograd saves for backward (parameters
left out: they are not activations), and a finalizer takes them off when autograd frees them; the peak of
the live bytes, divided by what one micro-batch saves at that stage, is the number of micro-batches the stage
holds at most. The theory is the schedule simulated with unit times (:func:`lightning_pipe.engine.schedule.simulate`):
GPipe holds every micro-batch (``m``) at every stage, 1F1B at most ``p - j`` at stage ``j``; zero-bubble holds
``p`` at stage 0 as 1F1B does and, at later stages, the inputs of the parameter gradients (``W``) it defers;
interleaved 1F1B counts per virtual stage.

    python benchmarks/bench_schedule_memory.py [--stages 4] [--chunks 8] [--width 256] [--batch 512]
"""

from __future__ import annotations

import argparse
import threading
import weakref
from typing import Any

import torch
from torch import nn

from lightning_pipe import Pipe, loss_on_last_stage
from lightning_pipe.engine.schedule import schedule_plan, simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2),
             ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2)]


class Counter:
    """Live bytes that autograd saved for one stage (parameters excluded), and their peak."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.live = 0
        self.peak = 0
        self.unit = 0  # what one micro-batch's forward saves here
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> Any:
        if t.data_ptr() in self.params:
            return t
        size = t.numel() * t.element_size()
        with self.lock:
            self.live += size
            self.peak = max(self.peak, self.live)
        # Detached: a saved output holding its own grad_fn would tie its node to itself through autograd's C++
        # side, a cycle no collector sees once a graph is kept for a later backward (retain_graph).
        box = _Box(t.detach())
        weakref.finalize(box, self._free, size)
        return box

    def _free(self, size: int) -> None:
        with self.lock:
            self.live -= size

    @staticmethod
    def unpack(x: Any) -> torch.Tensor:
        return x.tensor if isinstance(x, _Box) else x


class _Box:
    """What autograd keeps in place of a saved tensor: freed when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def count_saved(pipe: Pipe) -> list[Counter]:
    """Count what every stage of ``pipe`` saves for backward: its forwards (and a last stage's loss) run under
    the counter's hooks, on the stage's own thread. (Not hooks on the modules: a hook would change how the
    stage runs its backward, since its backward could then have side effects.)"""
    counters = []
    for stage in pipe.pipeline.stages:
        counter = Counter({p.data_ptr() for p in stage.partition.parameters()})
        forward = stage.forward

        def counted(*args: Any, forward: Any = forward, counter: Counter = counter, **kwargs: Any) -> Any:
            before = counter.live
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                out = forward(*args, **kwargs)
            counter.unit = counter.unit or counter.live - before  # one micro-batch's, its first forward's
            return out

        stage.forward = counted  # type: ignore[method-assign]
        counters.append(counter)
    return counters


def body(args: argparse.Namespace, stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stages * args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def measure(args: argparse.Namespace, schedule: str, v: int) -> tuple[list[float], list[int]]:
    """Micro-batches held at most by each stage, measured and in theory, for one step of ``schedule``."""
    n = args.stages * v
    model = body(args, n)
    pipe = Pipe(model, [2 * args.layers] * n, chunks=args.chunks, checkpoint="never", schedule=schedule,
                virtual_stages=v)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    loss_on_last_stage(pipe, x, y, mse).backward()  # a first step: workers and lazy state set up
    counters = count_saved(pipe)
    loss_on_last_stage(pipe, x, y, mse).backward()
    theory = simulate(schedule_plan(schedule, args.chunks, args.stages, v), {"F": 1, "B": 2, "I": 1, "W": 1}).held
    return [c.peak / c.unit for c in counters], list(theory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="processes (threads here) of the pipeline")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU blocks per stage")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    if args.batch % args.chunks:
        parser.error("--batch must be a multiple of --chunks (equal micro-batches)")
    rows = args.batch // args.chunks
    print(f"{args.stages} stages (interleaved: x 2 virtual), {args.chunks} micro-batches of {rows} rows,"
          f" {args.layers} x (Linear({args.width}) + ReLU) per stage, checkpoint='never'; micro-batches of "
          "activations each stage held at most, measured (saved-tensor hooks) / theory (the schedule simulated)\n")
    for schedule, v in SCHEDULES:
        measured, theory = measure(args, schedule, v)
        cells = "  ".join(f"{m:4.1f}/{t:<2d}" for m, t in zip(measured, theory))
        worst = max(measured) / max(theory)
        print(f"{schedule:<17} stage 0..{len(measured) - 1}: {cells}   peak of stages / theory's: {worst:.2f}")


if __name__ == "__main__":
    main()
