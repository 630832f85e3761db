"""Checkpointing flags: whether this thread is in a checkpointed forward or in its recomputation.

A micro-batch that is checkpointed runs its partition twice: once without storing activations
(:func:`is_checkpointing` is true), and again in backward to rebuild them (:func:`is_recomputing` is true).
Layers with side effects (counters, running statistics) use these flags to act once per micro-batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_checkpointing", "is_recomputing"]

_state = threading.local()


def is_checkpointing() -> bool:
    """Whether the current thread runs the first, activation-free forward of a checkpointed micro-batch."""
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """Whether the current thread re-runs a checkpointed forward in backward to rebuild its activations.

    A layer that must count forward passes or update state once per micro-batch skips its side effect
    when this is true::

        def forward(self, x):
            if not is_recomputing():
                self.calls += 1
            return x
    """
    return getattr(_state, "recomputing", False)


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def checkpointing() -> contextmanager[None]:  # type: ignore[type-arg]
    """Mark the enclosed code as the first forward of a checkpointed micro-batch."""
    return _flag("checkpointing")


def recomputing() -> contextmanager[None]:  # type: ignore[type-arg]
    """Mark the enclosed code as the recomputation of a checkpointed micro-batch."""
    return _flag("recomputing")
