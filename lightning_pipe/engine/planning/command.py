"""``python -m lightning_pipe plan``: the planner's table for a model named on the command line by its class path,
before any process starts."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

import torch

from lightning_pipe.engine.planning import plan_layout

__all__ = ["add_arguments", "run"]

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "none": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's arguments."""
    parser.add_argument("model", metavar="MODEL", help="package.module:Class of a LightningModule (or nn.Module) "
                        "holding an nn.Sequential body and an example_input_array (a Hugging Face model: a class "
                        "that builds it and makes its body with lightning_pipe.models.to_sequential)")
    parser.add_argument("--devices", type=int, required=True, help="processes of the job (every node's)")
    parser.add_argument("--memory-per-device", required=True, help="what each may hold: bytes, or 8GiB, 512MiB, 16GB")
    parser.add_argument("--init-args", default="{}", help="the class's arguments, as JSON")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="rows a step trains over every replica (default: each replica trains the example's)")
    parser.add_argument("--device", default="cpu", help="where the layers are measured (cuda for a GPU's times)")
    parser.add_argument("--module-name", default="sequential_module")
    parser.add_argument("--top", type=int, default=8, help="layouts in the table")


def _model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model, its example input, and its tensor-parallel plan (its ``tensor_parallel_plan``, if any)."""
    if ":" not in args.model:
        raise SystemExit(f"MODEL must be package.module:Class (got: {args.model!r})")
    module, name = args.model.split(":", 1)
    model = getattr(importlib.import_module(module), name)(**json.loads(args.init_args))
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise SystemExit(f"{args.model} has no example_input_array: set one batch of inputs in its __init__")
    return model, example, getattr(model, "tensor_parallel_plan", None)


def run(args: argparse.Namespace) -> None:
    """Measure the model's body, predict every layout, and print the table of the best that fit (status 1 with what
    is largest where none fits)."""
    model, example, tensor_plan = _model(args)
    try:
        found = plan_layout(model, example, devices=args.devices, memory_per_device=args.memory_per_device,
                            optimizer=OPTIMIZERS[args.optimizer], precision=args.precision,
                            global_batch=args.global_batch, device=args.device, tensor_parallel_plan=tensor_plan,
                            module_name=args.module_name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(found.table(args.top))
    print(f"\nPipeStrategy(**{found.layout.arguments()})")
