"""Skip connections: a layer stashes a tensor, a later layer pops it, across partitions and devices."""

from lightning_pipe.engine.skip.namespace import Namespace
from lightning_pipe.engine.skip.skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable"]
