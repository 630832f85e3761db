"""Command line: ``python -m lightning_pipe timeline TRACE PNG`` draws a recorded pipeline timeline;
``python -m lightning_pipe consolidate DIR FILE`` makes one checkpoint file of a sharded checkpoint."""

from __future__ import annotations

import sys

from lightning_pipe.engine import timeline


def consolidate(argv: list[str]) -> None:
    """``consolidate DIR FILE``: the sharded checkpoint ``DIR`` as one file (Lightning's format, the plain
    model's state dict) at ``FILE``."""
    if len(argv) != 2:
        raise SystemExit("usage: python -m lightning_pipe consolidate SHARDED_CHECKPOINT_DIR OUTPUT_FILE "
                         f"(got: {' '.join(argv) or 'nothing'})")
    from lightning_pipe.lightning.sharded import consolidate_checkpoint

    consolidate_checkpoint(argv[0], argv[1])
    print(f"wrote {argv[1]}")


def main() -> None:
    """Dispatch ``python -m lightning_pipe COMMAND ...``."""
    commands = {"timeline": timeline.main, "consolidate": consolidate}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: python -m lightning_pipe {{{','.join(commands)}}} ... "
                         f"(got: {' '.join(sys.argv[1:]) or 'nothing'})")
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
