"""Skip connections, by their public name: ``from lightning_pipe.skip import skippable, stash, pop``.

The implementation is the engine's (:mod:`lightning_pipe.engine.skip`); this module names what users import.
"""

from lightning_pipe.engine.skip import Namespace, Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable"]
