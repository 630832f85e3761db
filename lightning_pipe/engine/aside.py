"""Gradients a step made before its caller's backward, kept aside until that backward commits them.

A schedule that interleaves forwards and backwards (1F1B and its kin) runs a step's backwards inside the
forward call, before the caller has called backward on the loss, and before whatever it does in between
(``optimizer.zero_grad()``, Lightning's accumulation, a gradient scaler's scale). So each stage runs those
backwards from empty gradients, sets what they made aside, and puts the earlier gradients back; the
caller's backward then commits them: it adds them into ``.grad``, scaled by the ratio of the gradient that
backward brings to the one the step assumed. Gradients are linear in that factor, so the result is the
backward the step stood for, whatever ran in between::

    defer(run)   .grad of the stage's parameters ──► aside ("before");  .grad = None
    (the step's backwards accumulate into .grad)
    keep(run)    .grad ──► aside ("made");  .grad = "before"
    commit(run, scale)   .grad += scale * "made"
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from torch import Tensor, nn

__all__: list[str] = []


class GradientsAside:
    """The gradients of ``module``'s trainable parameters set aside per run (see the module's docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._lock = threading.Lock()
        self._before: dict[Hashable, list[tuple[nn.Parameter, Tensor | None]]] = {}
        self._made: dict[Hashable, list[tuple[nn.Parameter, Tensor | None]]] = {}

    def defer(self, run: Hashable) -> None:
        """``run``'s backwards are about to start: set the gradients from before aside; they start from none."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        with self._lock:
            self._before[run] = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None

    def keep(self, run: Hashable) -> None:
        """``run``'s backwards are over: set what they made aside, bring back the gradients from before."""
        with self._lock:
            before = self._before.pop(run, [])
            self._made[run] = [(p, p.grad) for p, _ in before]
        for p, grad in before:
            p.grad = grad

    def commit(self, run: Hashable, scale: float) -> None:
        """Add ``scale`` times what ``run``'s backwards made into ``.grad``, once; a parameter frozen since
        (``requires_grad`` now False) gets none, as from a backward that ran now."""
        for p, grad in self.take(run, scale).items():
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)

    def take(self, run: Hashable, scale: float) -> dict[nn.Parameter, Tensor]:
        """What :meth:`commit` would add into each parameter's ``.grad``, taken out (for a caller that adds it
        itself), once."""
        with self._lock:
            made = self._made.pop(run, [])
        taken = {}
        for p, grad in made:
            if grad is not None and p.requires_grad:
                taken[p] = grad.mul_(scale) if scale != 1.0 else grad
        return taken

    def release(self, run: Hashable) -> None:
        """Forget ``run``: what it made is dropped uncommitted; after a failure midway, the gradients from
        before come back."""
        with self._lock:
            self._made.pop(run, None)
            before = self._before.pop(run, None)
        for p, grad in before or ():
            p.grad = grad

    def pending(self) -> int:
        """How many runs hold gradients here (0 between steps)."""
        with self._lock:
            return len(self._before) + len(self._made)
