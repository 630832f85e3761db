"""torchgpipe's skip connections: ``from lightning_pipe.compat.torchgpipe.skip import skippable, stash, pop``.

The engine's own (:mod:`lightning_pipe.skip`), which behave as torchgpipe documents: every name declared in
``@skippable(stash=..., pop=...)`` must be stashed or popped in every forward (else ``RuntimeError``),
``stash(name, None)`` pops as ``None``, and :func:`verify_skippables` raises ``TypeError`` naming every
unmatched stash or pop. ``Skippable.isolate(ns, only=...)`` refuses names the module does not declare
(torchgpipe accepted them and did nothing).
"""

from lightning_pipe.engine.skip import Namespace, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
