"""A backward in two parts: the gradients that go upstream first, the parameters' gradients later.

In a pipeline's drain, stage ``j - 1`` waits for stage ``j``'s input gradients, not for its parameters'. A
stage that computes the input gradients of a micro-batch first (one autograd call, graph kept) and its
parameters' gradients later (a second call, pruned to the remaining leaves) lets the stage before start its
backward earlier: zero-bubble pipelines call the two halves ``B`` and ``W``::

    grad of outputs ─► autograd.grad(outputs, inputs, retain_graph=True) ─► grad of inputs ─► stage j-1
                             (later) autograd.backward(outputs, inputs=parameters) ─► parameters' .grad

The second call runs the backward of every layer above the first again on its way to their parameters, so it
applies only where that changes nothing but the time: :func:`twice_safe` says where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_pipe.engine.partition import Partition

__all__ = ["pure_backward_layer"]


def _nothing(compute: bool = True) -> None:
    pass


_PURE_BACKWARD: set[type] = set()
_Layer = TypeVar("_Layer", bound=type[nn.Module])


def pure_backward_layer(cls: _Layer) -> _Layer:
    """Declare that the backward of layer class ``cls`` (exactly that class: a subclass may override
    ``forward``) has no side effect, everything its forward runs included, so that it may run in two
    autograd calls: partitions made of such layers and built-in ones then hand on their input gradients
    before computing their parameters' (see :meth:`Stage.backward_inputs_first`). True of layers built from
    torch operations and built-in layers alone; not of one whose backward counts or logs something, or that
    uses reentrant ``torch.utils.checkpoint`` (which refuses the first call). Returns ``cls`` (usable as a
    decorator)."""
    _PURE_BACKWARD.add(cls)
    return cls


def _rest(tensors: list[Tensor], grads: list[Tensor], leaves: list[Tensor]) -> None:
    """The backward from ``tensors`` into ``leaves`` alone; a leaf frozen since the forward gets none, as in a
    whole backward."""
    leaves = [t for t in leaves if t.requires_grad]
    if leaves:
        torch.autograd.backward(tensors, grads, inputs=leaves)


def twice_safe(partition: nn.Module) -> bool:
    """Whether the backward of ``partition`` may run in two autograd calls, its input gradients first and the
    rest later, with nothing but the time changed:

    - every module in it is a built-in ``torch.nn`` layer (or the :class:`Partition` holding them) holding no
      function of the user's (as ``TransformerEncoderLayer(activation=...)`` can), whose backward is then plain
      autograd with no side effect, or inside a layer declared with :func:`pure_backward_layer` (another
      user-defined layer may hold an autograd function or a tensor hook that would run twice);
    - no hook is registered on any of them, nor for every module;
    - nothing that the graph kept between the two calls may have saved changes in place meanwhile, when
      other micro-batches are recomputed: no buffer (BatchNorm saves its running statistics) and no
      embedding that renormalises its weight (``max_norm``).
    """
    names = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
             "_global_forward_hooks")
    if any(getattr(nn.modules.module, name, None) for name in names):
        return False
    if next(partition.buffers(), None) is not None:
        return False
    hooks = ("_backward_pre_hooks", "_backward_hooks", "_forward_pre_hooks", "_forward_hooks")
    declared: set[int] = set()  # modules inside a declared layer (modules() lists a module before its own)
    for m in partition.modules():
        if any(getattr(m, h, None) for h in hooks):
            return False
        if id(m) in declared:
            continue
        if getattr(m, "max_norm", None) is not None:
            return False
        if type(m) in _PURE_BACKWARD:
            declared.update(id(inner) for inner in m.modules())
        elif not (type(m) is Partition or type(m).__module__.startswith("torch.nn.modules.")) or not all(
                _of_torch(v) for v in vars(m).values() if callable(v) and not isinstance(v, (nn.Module, type))):
            return False
    return True


def _of_torch(f: Callable[..., Any]) -> bool:
    """Whether ``f`` is a function of torch itself, not one of the user's (whose backward could do anything)."""
    while isinstance(f, partial):
        f = f.func
    owner = getattr(f, "__self__", None)
    module = owner.__module__ if isinstance(owner, type) else getattr(f, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def _leaves(tensors: Sequence[Tensor], exclude: Sequence[Tensor]) -> list[Tensor]:
    """The leaf tensors whose gradients a backward from ``tensors`` accumulates, except ``exclude``."""
    skip = {id(t) for t in exclude}
    found: dict[int, Tensor] = {}
    seen: set[Any] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    for t in tensors:
        if t.grad_fn is None and t.requires_grad and id(t) not in skip:
            found[id(t)] = t
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":  # a leaf's (a custom function's ctx may have .variable)
            variable = node.variable
            if id(variable) not in skip:
                found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return list(found.values())
