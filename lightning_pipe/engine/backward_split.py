"""A backward in two parts: the gradients that go upstream first, the parameters' gradients later.

In a pipeline's drain, stage ``j - 1`` waits for stage ``j``'s input gradients, not for its parameters'. A
stage that computes the input gradients of a micro-batch first (one autograd call, graph kept) and its
parameters' gradients later (a second call, pruned to the remaining leaves) lets the stage before start its
backward earlier: zero-bubble pipelines call the two halves ``B`` and ``W``::

    grad of outputs ─► autograd.grad(outputs, inputs, retain_graph=True) ─► grad of inputs ─► stage j-1
                             (later) autograd.backward(outputs, inputs=parameters) ─► parameters' .grad

The first call captures, with hooks on the autograd graph's nodes, the gradient that flows into each node where
a parameter's branch leaves the path to the inputs (a linear layer's matrix product, say); the second starts
there and computes the parameters' branches alone, so nothing of the first is computed twice
(:func:`input_gradients_first`). Hooks on a partition's modules could see a layer's backward split in two, so
it applies only where that changes nothing but the time: :func:`twice_safe` says where.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_pipe.engine.partition import Partition

__all__ = ["pure_backward_layer"]


def finish_nothing(compute: bool = True, finisher: Any = None) -> None:
    """The weight gradients' finish of a backward that left none for later (every gradient made at once)."""


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


def _node(t: Tensor) -> Node:
    """The autograd node a gradient of ``t`` flows into: its grad_fn, or a leaf's gradient accumulator."""
    return t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``starts`` towards the outputs (``parents``), not passing through ``stop``; and
    the nodes of ``stop`` met on the way."""
    seen, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def input_gradients_first(tensors: Sequence[Tensor], grads: Sequence[Tensor], upstream: Sequence[Tensor]
                          ) -> tuple[tuple[Tensor | None, ...], Callable[[], None] | None]:
    """The gradients of ``upstream`` from a backward of ``tensors`` with ``grads``, now, and the function that
    accumulates every other leaf's (the parameters') into ``.grad`` later (None if there is none).

    The graph is kept until then. Each parameter's branch meets the path from the outputs to ``upstream`` at
    some nodes (the "intermediates": the matrix product of a linear layer, which makes both its input's and its
    weight's gradient); the first call records the gradients flowing into them, and the later one starts from
    those and runs the parameters' branches alone. A parameter whose branch never meets that path (a tensor
    made from parameters alone) is computed from the outputs, as a whole backward would."""
    leaves = _leaves(tensors, exclude=upstream)
    if not leaves:
        return torch.autograd.grad(tensors, upstream, grads, retain_graph=False, allow_unused=True), None
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    roots = [_node(t) for t in tensors]
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    path, _ = _above([_node(t) for t in upstream], parents, set())
    groups: dict[Node, dict[str, set[Any]]] = {}  # intermediate -> its group: params and intermediates
    alone: list[Tensor] = []
    for leaf in leaves:
        _, met = _above([_node(leaf)], parents, path)
        if not met:
            alone.append(leaf)
            continue
        group: dict[str, set[Any]] = {"params": {leaf}, "nodes": set(met)}
        for node in met:  # parameters whose branches meet the path at a common node are computed together
            other = groups.get(node)
            if other is not None and other is not group:
                group["params"] |= other["params"]
                group["nodes"] |= other["nodes"]
        for node in group["nodes"]:
            groups[node] = group
    captured: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = [node.register_prehook(lambda grad_outputs, node=node: captured.__setitem__(node, grad_outputs))
               for node in groups]
    try:
        found = torch.autograd.grad(tensors, upstream, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    unique = list({id(g): g for g in groups.values()}.values())

    def weights() -> None:
        for group in unique:
            params = [p for p in group["params"] if p.requires_grad]  # frozen since the forward: none, as ever
            nodes = [n for n in group["nodes"] if n in captured]
            edges = [GradientEdge(n, i) for n in nodes for i, g in enumerate(captured[n]) if g is not None]
            if not params or not edges:
                continue
            # Each node gets exactly what it got in the first call: one intermediate reached from another adds
            # nothing that call's gradient did not hold already.
            clamps = [n.register_prehook(lambda grad_outputs, saved=captured[n]: saved) for n in nodes] \
                if len(nodes) > 1 else []
            try:
                torch.autograd.backward(edges, [g for n in nodes for g in captured[n] if g is not None],
                                        inputs=params, retain_graph=True)
            finally:
                for handle in clamps:
                    handle.remove()
        left = [p for p in alone if p.requires_grad]
        if left:
            torch.autograd.backward(tensors, grads, inputs=left, retain_graph=True)

    return found, weights
