"""Automatic balancing: choose how many layers each pipeline partition gets.

Both helpers profile an ``nn.Sequential`` layer by layer and return a
*balance* (the number of consecutive layers per partition) that minimises
the cost of the most expensive partition::

    from lightning_pipe.balance import balance_by_time

    balance = balance_by_time(4, model, sample, timeout=2.0, device="cuda:0")
    # e.g. [5, 9, 8, 6]

``balance_by_time`` balances compute (forward + backward time), which is
what limits pipeline throughput; ``balance_by_size`` balances memory, which
is what limits the batch or model size that fits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_pipe.engine.balance import blockpartition
from lightning_pipe.engine.balance.profile import profile_sizes, profile_times

__all__ = ["balance_by_time", "balance_by_size"]


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Tensor | tuple[Tensor, ...],
    *,
    timeout: float = 1.0,
    device: torch.device | str = "cpu",
) -> list[int]:
    """Balance ``module`` by the forward + backward time of each layer.

    ``sample`` runs through the layers one after the other, as in the real
    model (a layer may take and return a tuple of tensors; like
    ``nn.Sequential``, each layer receives the previous layer's output as its
    single argument, and the first layer receives ``sample``).  Each layer's
    forward and a backward pass from its outputs (all-ones gradient) to its
    inputs and parameters are timed with :func:`time.perf_counter`
    (synchronising the device first when it is asynchronous, e.g. CUDA).
    After one untimed warm-up pass (which absorbs one-off costs such as lazy
    initialisation), whole passes are repeated until ``timeout`` seconds have
    elapsed since the start (at least one timed pass) and the times are
    summed per layer.  The sample should be
    a typical micro-batch, since that is what each partition will process.

    Profiling works on one temporary copy of one layer at a time, placed on
    ``device`` and put in training mode; parameters already on ``device`` are
    shared with the copy rather than duplicated.  ``module`` itself is never
    modified: its training mode, devices, parameter values, buffers (e.g.
    batch-norm running statistics) and ``.grad`` attributes stay as they were.

    Args:
        partitions: Number of partitions, between 1 and ``len(module)``.
        module: The model to balance.
        sample: Example input: a tensor or a tuple of tensors.
        timeout: Profiling budget in seconds (wall clock).
        device: Device to profile on; ideally the kind the pipeline runs on.

    Returns:
        The balance: ``partitions`` positive layer counts summing to
        ``len(module)``, minimising the slowest partition's time.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``sample`` is
            not a tensor or tuple of tensors.
        ValueError: ``partitions`` is not positive or exceeds the number of
            layers, ``timeout`` is not positive, or ``sample`` is empty.
    """
    _check_common(partitions, module)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive (timeout: {timeout})")
    _check_sample(sample, "sample", need_batch_dim=False)
    times = profile_times(module, sample, timeout, torch.device(device))
    return blockpartition.solve(times, partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Tensor | tuple[Tensor, ...],
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: torch.device | str = "cpu",
) -> list[int]:
    """Balance ``module`` by the training memory of each layer.

    A micro-batch made of the first ``max(1, input.size(0) // chunks)`` rows
    of ``input`` runs through the layers one after the other, in training
    mode.  The size of a layer is the number of bytes autograd saves for
    backward during its forward (counted with
    :func:`torch.autograd.graph.saved_tensors_hooks`, each distinct storage
    once; the layer's own parameters and buffers are not counted there) plus
    ``param_scale`` times the bytes of its parameters.  This needs no CUDA
    memory statistics, so it gives the same answer on CPU.

    ``param_scale`` is how many parameter-sized tensors training keeps per
    parameter: ``2.0`` (the default) for the parameter and its gradient, as
    with plain SGD; ``3.0`` for SGD with momentum; ``4.0`` for Adam or AdamW
    (two moment buffers); ``0.0`` to balance activations only.

    Profiling uses one temporary copy of one layer at a time (see
    :func:`balance_by_time`); ``module`` itself is never modified.

    Args:
        partitions: Number of partitions, between 1 and ``len(module)``.
        module: The model to balance.
        input: Example mini-batch: a tensor or a tuple of tensors whose
            dimension 0 is the batch.
        chunks: Number of micro-batches each mini-batch is split into.
        param_scale: Multiplier of the parameter bytes (non-negative).
        device: Device to profile on.

    Returns:
        The balance: ``partitions`` positive layer counts summing to
        ``len(module)``, minimising the largest partition's memory.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``input`` is
            not a tensor or tuple of tensors.
        ValueError: ``partitions`` is not positive or exceeds the number of
            layers, ``chunks`` is not positive, ``param_scale`` is negative,
            or ``input`` is empty or has no batch dimension.
    """
    _check_common(partitions, module)
    if chunks < 1:
        raise ValueError(f"chunks must be a positive integer (chunks: {chunks})")
    if not param_scale >= 0:
        raise ValueError(f"param_scale must not be negative (param_scale: {param_scale})")
    _check_sample(input, "input", need_batch_dim=True)
    sizes = profile_sizes(module, input, chunks, param_scale, torch.device(device))
    return blockpartition.solve(sizes, partitions)


def _check_common(partitions: int, module: nn.Sequential) -> None:
    """Validate the module type and the number of partitions."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned (module: {type(module).__name__})")
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer (partitions: {partitions})")
    if len(module) < partitions:
        raise ValueError(f"too few layers to split into partitions (layers: {len(module)}, partitions: {partitions})")


def _check_sample(sample: object, name: str, *, need_batch_dim: bool) -> None:
    """Validate a sample: a non-empty tensor or tuple of tensors."""
    if isinstance(sample, Tensor):
        tensors = [sample]
    elif isinstance(sample, (tuple, list)):
        tensors = [x for x in sample if isinstance(x, Tensor)]
        if len(tensors) != len(sample):
            kinds = ", ".join(type(x).__name__ for x in sample)
            raise TypeError(f"{name} must be a tensor or a tuple of tensors (types: {kinds})")
        if not tensors:
            raise ValueError(f"{name} must not be empty (tensors: 0)")
    else:
        raise TypeError(f"{name} must be a tensor or a tuple of tensors (type: {type(sample).__name__})")
    first = tensors[0]
    if first.dim() == 0:
        if need_batch_dim:
            raise ValueError(f"{name} must have a batch dimension (dim: 0)")
        return
    if first.size(0) == 0:
        raise ValueError(f"{name} must not be empty (batch size: 0)")
