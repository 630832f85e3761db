"""Command line: ``python -m lightning_pipe COMMAND ...`` (``--help`` for the commands, ``COMMAND --help`` for one).

- ``timeline TRACE PNG``: draw a recorded pipeline timeline and print its bubble fraction;
- ``consolidate DIR FILE``: make one checkpoint file of a sharded checkpoint;
- ``plan MODEL --devices N --memory-per-device 8GiB``: the layouts that fit, predicted before any process starts.

Nothing here imports Lightning: ``consolidate`` loads it when it runs, ``--help`` and the refusals never do; ``plan``
loads torch when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_pipe.engine import timeline

PROG = "python -m lightning_pipe"

TIMELINE = f"""\
Draw a pipeline timeline recorded by PipeStrategy(timeline="trace.json") (or written by
lightning_pipe.engine.timeline.write_chrome_trace) as a picture: one row per stage, time across, each
micro-batch's forward, backward and deferred parameters' gradients in their own colours, bubbles blank.
Prints the measured bubble fraction beside the schedule's theoretical one. The trace also opens in Perfetto
(ui.perfetto.dev) or chrome://tracing.

example:
  {PROG} timeline trace.json timeline.png            # the last 3 steps
  {PROG} timeline trace.json timeline.png --last 0   # every step recorded
"""

CONSOLIDATE = f"""\
Make one checkpoint file of a sharded checkpoint: the directory PipeStrategy(state_dict_type="sharded") writes
at each save (a torch.distributed.checkpoint directory: .metadata and a __N_0.distcp file per process). The file
is the one a "full" save writes: Lightning's format, the plain model's state_dict and optimizer states, which
Model.load_from_checkpoint and a Trainer without PipeStrategy (fit(ckpt_path=FILE)) take; of a Fabric loop's
directory, the file its fabric.save writes with state_dict_type="full". It holds the whole model in memory.
A one-file checkpoint needs no consolidating; resuming with PipeStrategy takes the directory itself.

example:
  {PROG} consolidate lightning_logs/version_0/checkpoints/epoch=3-step=400.ckpt model.ckpt
"""

PLAN = f"""\
Measure a model's body once on this process and predict every layout of it on N devices: each process's peak
memory (parameters, gradients, optimizer state, activations per the schedule, hand-off buffers, the runtime's own)
and the step time. Prints the best layouts that fit, and why the first was chosen; where none fits, what is
largest and what would make it fit (docs/planning.md).

example:
  {PROG} plan mypackage.models:MyModel --devices 4 --memory-per-device 16GiB --init-args '{{"layers": 24}}'
  {PROG} plan Qwen/Qwen3-0.6B --hf --devices 4 --memory-per-device 4GiB --rows 8 --sequence 1024
"""

OVERVIEW = f"""\
Command-line tools of lightning_pipe, pipeline parallelism for PyTorch Lightning.

examples:
  {PROG} timeline trace.json timeline.png
  {PROG} consolidate lightning_logs/version_0/checkpoints/epoch=3-step=400.ckpt model.ckpt
  {PROG} plan mypackage.models:MyModel --devices 4 --memory-per-device 16GiB

Run '{PROG} COMMAND --help' for a command's arguments.
"""


def consolidate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``consolidate DIR FILE``: the sharded checkpoint ``DIR`` as one file (Lightning's format, the plain
    model's state dict) at ``FILE``. A path that is not what it must be ends in a message and status 2."""
    from lightning_pipe.transport.parallel.shards import check_directory

    try:
        check_directory(args.directory)
    except OSError as exc:
        parser.error(str(exc))
    output = os.path.abspath(args.output)
    if os.path.isdir(output):
        parser.error(f"{args.output} is a directory: give the path of the file to write, e.g. "
                     f"{os.path.join(args.output, 'model.ckpt')}")
    if not os.path.isdir(os.path.dirname(output)):
        parser.error(f"the folder of {args.output} does not exist: create {os.path.dirname(output)} first")
    from lightning_pipe import packages

    packages.binding().consolidate_checkpoint(args.directory, args.output)  # whichever Lightning is installed
    print(f"wrote {args.output}")


#: The optimizers ``plan --optimizer`` names.
OPTIMIZERS = ("adamw", "adam", "sgd", "none")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's arguments."""
    parser.add_argument("model", metavar="MODEL", help="package.module:Class of a LightningModule (or nn.Module) "
                        "holding an nn.Sequential body and an example_input_array; with --hf, a Hugging Face causal "
                        "LM's config: a name, a folder, or a JSON object with its model_type")
    parser.add_argument("--devices", type=int, required=True, help="processes of the job (every node's)")
    parser.add_argument("--memory-per-device", required=True, help="what each may hold: bytes, or 8GiB, 512MiB, 16GB")
    parser.add_argument("--init-args", default="{}", help="the class's arguments, as JSON")
    parser.add_argument("--hf", action="store_true", help="MODEL is a Hugging Face config (pip install "
                        "'lightning_pipe[hf]')")
    parser.add_argument("--rows", type=int, default=8, help="--hf: samples per batch")
    parser.add_argument("--sequence", type=int, default=128, help="--hf: tokens per sample")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="rows a step trains over every replica (default: each replica trains the example's)")
    parser.add_argument("--device", default="cpu", help="where the layers are measured (cuda for a GPU's times)")
    parser.add_argument("--module-name", default="sequential_module")
    parser.add_argument("--top", type=int, default=8, help="layouts in the table")


def _model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model, its example input, and its tensor-parallel plan (its ``tensor_parallel_plan``, if any)."""
    import importlib
    import json


    if args.hf:  # named by its class path: lightning_pipe.models stays an optional layer nothing imports
        config = json.loads(args.model) if args.model.lstrip().startswith("{") else args.model
        args.init_args = json.dumps({"config": config, "rows": args.rows, "sequence": args.sequence})
        args.model = "lightning_pipe.models.planned:CausalLMBody"
    if ":" not in args.model:
        raise SystemExit(f"MODEL must be package.module:Class (got: {args.model!r})")
    module, name = args.model.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"MODEL {args.model!r} cannot be found ({type(exc).__name__}: {exc}): give it as "
                         "package.module:Class, importable from here") from None
    try:
        init = json.loads(args.init_args)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--init-args must be a JSON object of {name}'s arguments (got {args.init_args!r}: "
                         f"{exc})") from None
    if not isinstance(init, dict):
        raise SystemExit(f"--init-args must be a JSON object of {name}'s arguments (got {args.init_args!r})")
    try:
        model = cls(**init)
    except TypeError as exc:  # its arguments: the one line that says which
        raise SystemExit(f"{name}(**{init!r}) cannot be made: {exc}") from None
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise SystemExit(f"{args.model} has no example_input_array: set one batch of inputs in its __init__")
    return model, example, getattr(model, "tensor_parallel_plan", None)


def plan(args: argparse.Namespace) -> None:
    """``plan MODEL``: measure the model's body, predict every layout, and print the table of the best that fit
    (status 1 with what is largest where none fits)."""
    from functools import partial

    import torch

    from lightning_pipe.engine.planning import plan_layout
    from lightning_pipe.lightning.planned import measured_costs

    model, example, tensor_plan = _model(args)
    costs = None
    if args.device == "cpu" and args.devices > 1:  # this machine's collectives, between processes started for it
        costs = partial(measured_costs, min(args.devices, os.cpu_count() or 1))
    try:
        found = plan_layout(model, example, devices=args.devices, memory_per_device=args.memory_per_device,
                            optimizer={"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
                                       "none": None}[args.optimizer], precision=args.precision,
                            global_batch=args.global_batch, device=args.device, tensor_parallel_plan=tensor_plan,
                            module_name=args.module_name, costs=costs)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(found.table(args.top))
    print(f"\nPipeStrategy(**{found.layout.arguments()})")
    if found.layout.replicas > 1:  # what the strategy's "auto" would not choose on one node: say why they differ
        print(f"(these arguments train {found.layout.replicas} replicas, each on its share of a batch; "
              "PipeStrategy(..., 'auto') keeps one pipeline per node, a step training the samples one device would, "
              "and chooses among those layouts alone)")


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per tool, each with its own ``--help``."""
    def raw(prog: str) -> argparse.HelpFormatter:  # the descriptions as written
        return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30, width=110)

    main = argparse.ArgumentParser(prog=PROG, description=OVERVIEW, formatter_class=raw)
    commands = main.add_subparsers(title="commands", dest="command")
    drawing = commands.add_parser("timeline", help="draw a recorded pipeline timeline as a PNG, with its bubble",
                                  description=TIMELINE, formatter_class=raw)
    timeline.add_arguments(drawing)
    drawing.set_defaults(run=timeline.run)
    merging = commands.add_parser("consolidate", help="make one checkpoint file of a sharded checkpoint directory",
                                  description=CONSOLIDATE, formatter_class=raw)
    merging.add_argument("directory", metavar="DIR",
                         help='the sharded checkpoint: a directory written by PipeStrategy(state_dict_type="sharded")')
    merging.add_argument("output", metavar="FILE", help="where to write the one-file checkpoint")
    merging.set_defaults(run=lambda args: consolidate(args, merging))
    planning = commands.add_parser("plan", help="the layouts of a model that fit, predicted before any process starts",
                                   description=PLAN, formatter_class=raw)
    plan_arguments(planning)
    planning.set_defaults(run=plan)
    return main


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch ``python -m lightning_pipe COMMAND ...``; without a command, the overview and status 2."""
    command_line = parser()
    args = command_line.parse_args(argv)
    if args.command is None:
        command_line.print_help(sys.stderr)
        raise SystemExit(2)
    args.run(args)


if __name__ == "__main__":
    main()
