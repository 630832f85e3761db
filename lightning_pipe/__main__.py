"""Command line: ``python -m lightning_pipe timeline TRACE PNG`` draws a recorded pipeline timeline."""

from __future__ import annotations

import sys

from lightning_pipe.engine import timeline


def main() -> None:
    """Dispatch ``python -m lightning_pipe COMMAND ...``."""
    commands = {"timeline": timeline.main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: python -m lightning_pipe {{{','.join(commands)}}} ... "
                         f"(got: {' '.join(sys.argv[1:]) or 'nothing'})")
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
