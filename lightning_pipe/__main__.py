"""Command line: ``python -m lightning_pipe COMMAND ...`` (``--help`` for the commands, ``COMMAND --help`` for one).

- ``timeline TRACE PNG``: draw a recorded pipeline timeline and print its bubble fraction;
- ``consolidate DIR FILE``: make one checkpoint file of a sharded checkpoint;
- ``plan MODEL --devices N --memory-per-device 8GiB``: the layouts that fit, predicted before any process starts.

Nothing here imports Lightning: ``consolidate`` loads it when it runs, ``--help`` and the refusals never do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lightning_pipe.engine import timeline
from lightning_pipe.engine.planning import command

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
    command.add_arguments(planning)
    planning.set_defaults(run=command.run)
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
