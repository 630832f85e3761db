"""The layout chosen for a body before the first step: every layout of stages, tensor parallel, replicas, sharding,
micro-batches, schedule and recomputation predicted (each process's peak memory and the step time) from the body
measured once on one process, and the fastest that fits chosen (docs/planning.md)."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.loss import each_tensor
from lightning_pipe.engine.planning.layouts import (
    CHECKPOINTS,
    SHARDINGS,
    Costs,
    Layout,
    Prediction,
    candidates,
    predict,
    tensor_sizes,
)
from lightning_pipe.engine.planning.measure import BodyProfile, concurrently, measure_body
from lightning_pipe.engine.planning.memory import Memory, optimizer_model
from lightning_pipe.engine.planning.tensor import split_bytes, split_modules, tensor_probes
from lightning_pipe.engine.schedule import SCHEDULES

__all__ = ["BodyProfile", "Costs", "Layout", "LayoutPlan", "Memory", "Prediction", "format_bytes", "measure_body",
           "body_and_input", "check_precision", "optimizer_time", "parse_bytes",
           "plan_layout", "tensor_probes"]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``value`` in bytes: a number, or a string such as ``"8GiB"``, ``"512 MiB"``, ``"16GB"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"memory_per_device must be a positive number of bytes or a size such as '8GiB', '512MiB' or "
                         f"'16GB' (got: {value!r})")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float, up: bool = False) -> str:
    """``n`` bytes in GiB or MiB, for tables and messages; ``up``: rounded up (a budget that holds ``n``)."""
    unit, scale, digits = ("GiB", 2**30, 100) if abs(n) >= 2**30 else ("MiB", 2**20, 10)
    shown = math.ceil(n / scale * digits) / digits if up else round(n / scale * digits) / digits
    return f"{shown:.{len(str(digits)) - 1}f} {unit}"


#: The precisions the planner models, and Lightning's other names for them.
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
PRECISION_ALIASES = {"32": "32-true", 32: "32-true", "64": "64-true", 64: "64-true", "16": "16-mixed",
                     16: "16-mixed", "bf16": "bf16-mixed"}


def check_precision(precision: Any) -> str:
    """``precision`` as the planner names it (Lightning's aliases taken: ``"64"`` is ``"64-true"``); a value it does
    not model is refused."""
    named = PRECISION_ALIASES.get(precision, precision)
    if named not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)} (or Lightning's aliases "
                         f"{[k for k in PRECISION_ALIASES if isinstance(k, str)]}; got: {precision!r})")
    return named


@dataclass(frozen=True)
class LayoutPlan:
    """What :func:`plan_layout` found: :attr:`chosen` (the fastest layout that fits), every layout that fits from
    the fastest (:attr:`ranked`), how many were predicted, the budget, and why the first was chosen."""

    chosen: Prediction
    ranked: tuple[Prediction, ...]
    considered: int
    budget: int
    profile: BodyProfile
    per_sample: bool

    @property
    def layout(self) -> Layout:
        """The chosen layout."""
        return self.chosen.layout

    def why(self) -> str:
        """Why the first layout was chosen, in a sentence."""
        what = "step per sample" if self.per_sample else "step"
        text = (f"chosen: the fastest predicted {what} ({self.chosen.step * 1e3:.1f} ms a step, bubble "
                f"{self.chosen.bubble:.0%}) of the {len(self.ranked)} layouts of {self.considered} whose every process "
                f"fits {format_bytes(self.budget)} (its largest process: {format_bytes(self.chosen.peak)})")
        if len(self.ranked) > 1:
            key = (lambda p: p.per_sample) if self.per_sample else (lambda p: p.step)
            text += f"; the next is {key(self.ranked[1]) / key(self.chosen):.2f}x as slow ({self.ranked[1].layout})"
        return text

    def table(self, rows: int = 8) -> str:
        """The best ``rows`` layouts that fit: predicted step, bubble, and each pipeline process's peak."""
        lines = [f"{'#':>2}  {'step':>9}  {'bubble':>6}  {'peak per process':<34}  layout"]
        for k, p in enumerate(self.ranked[:rows]):
            peaks = " ".join(f"{m.total / 2**20:.0f}" for m in p.memory) + " MiB"
            lines.append(f"{k + 1:>2}  {p.step * 1e3:>7.1f}ms  {p.bubble:>6.1%}  {peaks:<34}  {p.layout}")
        largest = self.chosen.memory[max(range(len(self.chosen.memory)), key=lambda r: self.chosen.memory[r].total)]
        terms = ", ".join(f"{name} {format_bytes(value)}" for name, value in vars(largest).items())
        return "\n".join(lines) + f"\nthe chosen layout's largest process: {terms}\n{self.why()}"

    def __str__(self) -> str:
        return self.table()


def body_and_input(module: nn.Module, example: Any, module_name: str) -> tuple[nn.Sequential, Any]:
    """The ``nn.Sequential`` body and its input: ``module`` and ``example`` themselves, or a model's body
    ``module_name`` and what the model's forward of ``example`` gives it (``example`` itself for a model without a
    forward of its own). ``example``'s floating tensors are taken in the dtype of ``module``'s parameters, as a
    precision converts a batch for the model it converted (``"64-true"``: float64)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        example = each_tensor(example, lambda t: t.to(dtype) if t.is_floating_point() else t)
    if isinstance(module, nn.Sequential):
        return module, example
    body = getattr(module, module_name, None)
    if not isinstance(body, nn.Sequential):
        raise ValueError(f"plan_layout needs an nn.Sequential body: {type(module).__name__} has no nn.Sequential "
                         f"attribute {module_name!r}")
    own = ("torch.", "lightning", "pytorch_lightning")  # the libraries' classes: their forward is not the model's
    if "forward" not in {name for cls in type(module).__mro__[:-1] if not cls.__module__.startswith(own)
                         for name in vars(cls)}:
        return body, example  # no forward of its own: the example is the body's input
    captured: list[Any] = []
    handle = body.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            module(**example) if isinstance(example, Mapping) else \
                module(*example) if isinstance(example, tuple) else module(example)
    finally:
        handle.remove()
        module.train(training)
    if not captured:
        raise ValueError(f"{type(module).__name__}.forward(example) did not call self.{module_name}")
    return body, captured[0]


def optimizer_time(optimizer: Any, device: torch.device, concurrent: int = 1) -> float:
    """Seconds per byte of trainable parameter of ``optimizer``'s step, measured on a probe of 32 MiB (beyond the
    caches: a step streams its states from memory) while ``concurrent`` such steps run at once (the processes of a
    machine step together)."""
    if optimizer is None:
        return 0.0

    def step() -> tuple[float]:
        probe = nn.Parameter(torch.zeros(8 << 20, device=device))
        probe.grad = torch.ones_like(probe)
        made = optimizer([probe])
        made.step()
        best = float("inf")
        for _ in range(5):  # the fastest: what the machine does undisturbed
            tick = time.perf_counter()
            made.step()
            best = min(best, time.perf_counter() - tick)
        return (best / (probe.numel() * probe.element_size()),)

    return concurrently(step, concurrent)[0]


def plan_layout(module: nn.Module, example_input: Any, *, devices: int, memory_per_device: int | float | str,
                optimizer: Any = None, precision: str = "32-true", global_batch: int | None = None,
                device: torch.device | str = "cpu", tensor_parallel_plan: Any = None, loss_on_last_stage: bool = True,
                schedules: Sequence[str] | None = None, checkpoints: Sequence[str] = CHECKPOINTS,
                shardings: Sequence[str] = SHARDINGS, microbatches: Sequence[int] | None = None,
                costs: Costs | Callable[[list[tuple[int, int, int]]], Costs] | None = None,
                cores: int | None = None, profile: BodyProfile | None = None,
                module_name: str = "sequential_module", balance: Sequence[int] | None = None,
                where: Callable[[Layout], bool] | None = None) -> LayoutPlan:
    """Choose how to run ``module``'s body on ``devices`` processes of ``memory_per_device`` each.

    The body (``module`` itself if an ``nn.Sequential``, else its ``module_name``, fed by the model's forward of
    ``example_input``) is measured once here (:func:`measure_body`); every layout (:class:`Layout`) is predicted
    from it: each process's peak (parameters, gradients, ``optimizer``'s state, the activations its stages hold as
    the schedule's simulation runs, a backward's or the optimizer step's passing buffers, the hand-off receives, the
    runtime's own) and the step (the schedule simulated with the measured stage times, the hand-offs and
    collectives of ``costs``: given, or a function of :func:`tensor_probes`' shapes, called once the body is
    measured, that measures them, tensor parallel's on a pair of layers shaped as the body's split ones). The
    fastest that fits is chosen: per step with ``global_batch`` (the rows a step trains over all replicas: each
    replica gets its share), else per sample trained (each replica trains the example's rows, as Lightning's
    loaders give each replica a batch). ``optimizer``: a class or a function of the parameters
    (``torch.optim.AdamW``, ``lambda ps: SGD(ps, lr=0.1, momentum=0.9)``); ``schedules`` all of
    :data:`~lightning_pipe.engine.schedule.SCHEDULES` with ``loss_on_last_stage``, else GPipe's alone; tensor
    parallel is tried where a ``tensor_parallel_plan`` is given; ``balance`` fixes the stages, ``where`` keeps the
    layouts it is true of (the arguments a caller fixed). Raises ``ValueError`` where no layout fits, naming
    the smallest peak found, its largest term, and what would make it fit."""
    budget = parse_bytes(memory_per_device)
    precision = check_precision(precision)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive number of processes (got: {devices!r})")
    device = torch.device(device)
    body, sample = body_and_input(module, example_input, module_name)
    if cores is None:
        cores = (os.cpu_count() or 1) if device.type == "cpu" else devices
    local = min(devices, cores) if device.type == "cpu" else 1  # processes computing at once on this machine
    if profile is None:
        profile = measure_body(body, sample, device=device, precision=precision,
                               threads=max(1, cores // devices) if device.type == "cpu" else None, concurrent=local)
    if callable(costs):  # measured now that the body is: tensor parallel's on a pair shaped as its split layers
        costs = costs(tensor_probes(body, tensor_parallel_plan, profile))
    costs = costs or Costs.for_device(device.type)
    if costs.optimizer_per_byte == 0.0:
        costs = replace(costs, optimizer_per_byte=optimizer_time(optimizer, device, local))
    model = optimizer_model(optimizer, device)
    names = list(schedules or (SCHEDULES if loss_on_last_stage else ["gpipe"]))
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"schedules {unknown} are not among {list(SCHEDULES)}")
    rows = global_batch if global_batch is not None else profile.rows
    splittable, modules = split_bytes(body, tensor_parallel_plan), split_modules(body, tensor_parallel_plan)
    found = [predict(layout, profile, batch=rows, fixed_global=global_batch is not None, optimizer=model, costs=costs,
                     splittable=splittable, split_modules=modules, cores=cores, aside=loss_on_last_stage)
             for layout in candidates(profile, devices, batch=rows, fixed_global=global_batch is not None,
                                      tensor_sizes=tensor_sizes(devices, tensor_parallel_plan is not None),
                                      schedules=names, checkpoints=checkpoints, shardings=shardings,
                                      microbatches=microbatches, balance=balance)
             if where is None or where(layout)]
    if not found:
        fixed = " that the arguments given allow (balance, schedule, ... fixed)" if where or balance else ""
        raise ValueError(f"no layout of a body of {len(profile)} layers on {devices} devices with {rows} rows per "
                         f"batch{fixed}: give fewer devices, more layers or rows, or fix fewer arguments")
    key = (lambda p: (p.step, p.peak)) if global_batch is not None else (lambda p: (p.per_sample, p.peak))
    ranked = sorted((p for p in found if p.peak <= budget), key=key)
    if not ranked:
        smallest = min(found, key=lambda p: p.peak)
        biggest = max(smallest.memory, key=lambda m: m.total)
        term, value = biggest.largest()
        raise ValueError(
            f"no layout fits memory_per_device={format_bytes(budget)} on {devices} devices: of {len(found)} layouts "
            f"the smallest predicted peak is {format_bytes(smallest.peak)} ({smallest.layout}), whose largest term is "
            f"{term} ({format_bytes(value)}). It fits with memory_per_device >= "
            f"{format_bytes(smallest.peak, up=True)}; or with more devices, fewer rows per batch, or an optimizer that "
            "keeps less state")
    return LayoutPlan(ranked[0], tuple(ranked), len(found), budget, profile, global_batch is None)
