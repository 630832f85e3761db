"""Per-layer profiling (time and memory) of an ``nn.Sequential`` for balancing."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["profile_sizes", "profile_times"]

# A value flowing between layers: a tensor, or a tuple/list of tensors (and other objects).
Batch = Any


def profile_times(module: nn.Sequential, sample: Batch, timeout: float, device: torch.device) -> list[float]:
    """Return the forward + backward time of every layer of ``module``, in seconds.

    The sample flows through the layers one after the other as in the real
    model (layer ``k`` receives the detached output of layer ``k - 1``).  For
    each layer the clock covers its forward and a backward pass from all of
    its outputs that require grad (with an all-ones gradient) to its inputs
    and parameters.  A first, untimed warm-up pass absorbs one-off costs
    (lazy initialisation of autograd or the device, allocator growth, kernel
    selection); then timed passes over the whole sequence are repeated until
    ``timeout`` seconds of wall-clock time, counted from the start, have
    elapsed (at least one timed pass), and the per-layer times are summed, so
    only their ratios matter.

    Every layer runs in a temporary sandbox in training mode (see
    :func:`layer_sandbox`), so ``module`` itself is never modified.

    Args:
        module: The layers to profile.
        sample: A tensor or a tuple of tensors; the input of the first layer.
        timeout: Wall-clock budget in seconds (validated by the caller).
        device: Where the layers run.

    Returns:
        One non-negative time per layer.
    """
    begun_at = time.perf_counter()
    _time_pass(module, sample, device)  # warm-up, discarded
    times = _time_pass(module, sample, device)
    while time.perf_counter() - begun_at < timeout:
        for index, seconds in enumerate(_time_pass(module, sample, device)):
            times[index] += seconds
    return times


def _time_pass(module: nn.Sequential, sample: Batch, device: torch.device) -> list[float]:
    """Run ``sample`` through ``module`` once; return each layer's forward + backward time."""
    times: list[float] = []
    batch = map_tensors(lambda t: copy_to(t, device).requires_grad_(t.requires_grad), sample)
    for layer in module:
        with layer_sandbox(layer, device) as sandbox, torch.enable_grad():
            inputs = as_layer_input(batch)
            synchronize_device(device)
            tick = time.perf_counter()
            output = sandbox(inputs)
            targets = [t for t in tensors_of_batch(output) if t.requires_grad]
            if targets:
                torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])
            synchronize_device(device)
            times.append(time.perf_counter() - tick)
        batch = detach_batch(output)
        del sandbox, inputs, output, targets  # free this layer before copying the next
    return times


def profile_sizes(
    module: nn.Sequential, input: Batch, chunks: int, param_scale: float, device: torch.device
) -> list[float]:
    """Return the estimated training memory of every layer of ``module``, in bytes.

    A micro-batch (the first ``max(1, input.size(0) // chunks)`` rows of
    every tensor of ``input`` that has a dimension) flows through the layers
    one after the other in training mode.  While each layer runs forward,
    :func:`torch.autograd.graph.saved_tensors_hooks` records the tensors that
    autograd keeps for backward; the size of the layer is the total
    ``untyped_storage().nbytes()`` of the distinct storages among them,
    excluding storages of the layer's own parameters and buffers (those are
    accounted for by ``param_scale``, not as activations), plus
    ``param_scale`` times the bytes of the layer's parameters.

    Args:
        module: The layers to profile.
        input: A tensor or a tuple of tensors; dimension 0 is the batch.
        chunks: Number of micro-batches the mini-batch will be split into.
        param_scale: Multiplier of the parameter bytes.
        device: Where the layers run.

    Returns:
        One non-negative size per layer.
    """
    rows = max(1, batch_size_of(input) // chunks)
    batch = map_tensors(
        lambda t: copy_to(t[:rows] if t.dim() > 0 else t, device).requires_grad_(t.requires_grad),
        input,
    )
    sizes: list[float] = []
    for layer in module:
        with layer_sandbox(layer, device) as sandbox, torch.enable_grad():
            inputs = as_layer_input(batch)
            state = {_storage_key(t)[0] for t in (*sandbox.parameters(), *sandbox.buffers())}
            saved: dict[object, int] = {}
            with torch.autograd.graph.saved_tensors_hooks(_counting_pack_hook(state, saved), _identity):
                output = sandbox(inputs)
            param_bytes = sum(p.numel() * p.element_size() for p in sandbox.parameters())
            sizes.append(sum(saved.values()) + param_scale * param_bytes)
        batch = detach_batch(output)
        del sandbox, inputs, output  # free this layer before copying the next
    return sizes


@contextmanager
def layer_sandbox(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Yield a throwaway training-mode copy of ``layer`` on ``device``.

    The copy is made with :func:`copy.deepcopy`, but its parameters and
    buffers are substituted beforehand through the memo (so deepcopy never
    copies them itself):

    * parameters become fresh leaf ``nn.Parameter`` objects on ``device``
      (sharing storage with the originals when they already live there, so
      no memory is duplicated); gradients accumulate on these, never on the
      originals;
    * buffers are copied (cloned even on the same device), so running
      statistics updated in training mode do not leak into ``module``.

    Only one layer is copied at a time, so profiling needs at most one extra
    layer's worth of memory, and the original module's parameters, ``.grad``,
    buffers, training flags and devices are left untouched by construction.
    """
    memo: dict[int, Any] = {}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = copy_to(buffer, device)
    sandbox = copy.deepcopy(layer, memo)
    sandbox.train()
    yield sandbox


def copy_to(tensor: Tensor, device: torch.device) -> Tensor:
    """Return a detached, contiguous copy of ``tensor`` on ``device`` with its own storage."""
    return tensor.detach().to(device=device, copy=True, memory_format=torch.contiguous_format)


def as_layer_input(batch: Batch) -> Batch:
    """Prepare a layer's input: tensors requiring grad become non-leaf clones.

    Autograd refuses in-place operations on leaves that require grad, and a
    layer such as ``nn.ReLU(inplace=True)`` never sees a leaf in the real
    model, so it must not see one here either.
    """
    return map_tensors(lambda t: t.clone() if t.requires_grad else t, batch)


def detach_batch(batch: Batch) -> Batch:
    """Cut ``batch`` from its graph, keeping each tensor's ``requires_grad`` flag."""
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), batch)


def map_tensors(fn: Callable[[Tensor], Tensor], batch: Batch) -> Batch:
    """Apply ``fn`` to a tensor or to the tensors of a tuple/list; leave the rest as is."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        items = [fn(x) if isinstance(x, Tensor) else x for x in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*items)
        return type(batch)(items)
    return batch


def tensors_of_batch(batch: Batch) -> Iterator[Tensor]:
    """Yield the tensor or the tensors of a tuple/list."""
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        yield from (x for x in batch if isinstance(x, Tensor))


def batch_size_of(batch: Batch) -> int:
    """Return dimension 0 of the first tensor of ``batch`` (validated by the caller)."""
    return next(tensors_of_batch(batch)).size(0)


def _storage_key(tensor: Tensor) -> tuple[object, int]:
    """Return a key identifying ``tensor``'s storage and the storage's size in bytes."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. sparse or storage-less tensors
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()
    return (str(tensor.device), storage.data_ptr()), storage.nbytes()


def _counting_pack_hook(exclude: set[object], saved: dict[object, int]) -> Callable[[Tensor], Tensor]:
    """Return a pack hook recording into ``saved`` the bytes of each distinct storage not in ``exclude``."""

    def pack(tensor: Tensor) -> Tensor:
        key, nbytes = _storage_key(tensor)
        if key not in exclude:
            saved[key] = max(saved.get(key, 0), nbytes)
        return tensor

    return pack


def _identity(tensor: Tensor) -> Tensor:
    """Unpack hook: return the saved tensor unchanged."""
    return tensor


def synchronize_device(device: torch.device) -> None:
    """Wait for queued kernels on an asynchronous device, so the clock is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        sync = getattr(backend, "synchronize", None)
        if callable(sync):
            sync()
