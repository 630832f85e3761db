"""torch's ``sync.skip``: ``from lightning_pipe.compat.sync.skip import skippable, stash, pop``.

The engine's skip connections (:mod:`lightning_pipe.skip`), which behave as torch's did: every declared name
is stashed or popped in every forward, ``stash(name, None)`` pops as ``None``, and :func:`verify_skippables`
raises ``TypeError`` naming every unmatched pair.
"""

from lightning_pipe.engine.skip import Namespace, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
