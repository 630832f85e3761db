"""torchgpipe's automatic balancing: ``from lightning_pipe.compat.torchgpipe.balance import balance_by_time``.

The signatures are torchgpipe's, keyword arguments and defaults included; the work is the engine's
(:mod:`lightning_pipe.balance`). Two differences: without a ``device``, layers are profiled on the current
CUDA device as in torchgpipe, or on the CPU on a machine without CUDA (where torchgpipe failed); and
:func:`balance_by_size` counts the bytes autograd saves in each layer's forward rather than reading CUDA's
allocator, so it also works on the CPU (torchgpipe refused any device but CUDA) and its sizes, though not
their meaning, may differ from torchgpipe's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_pipe.engine import balance as engine_balance
from lightning_pipe.engine.partition import Device, normalize_device

__all__ = ["balance_by_time", "balance_by_size"]


def _device(device: Device | None) -> torch.device:
    """``device``, or torchgpipe's default: the current CUDA device (the CPU on a machine without CUDA)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = normalize_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"cannot profile the layers on {device}: CUDA is not available here "
                         "(torch.cuda.is_available() is False); pass device='cpu', or leave device out")
    return device


def balance_by_time(partitions: int, module: nn.Sequential, sample: Tensor | tuple[Tensor, ...], *,
                    timeout: float = 1.0, device: Device | None = None) -> list[int]:
    """Naive automatic balancing by the forward + backward time of each layer, as in torchgpipe::

        sample = torch.empty(128, 3, 224, 224)
        balance = balance_by_time(torch.cuda.device_count(), model, sample)
        gpipe = GPipe(model, balance, chunks=8)

    ``timeout``: profiling repeats until this many seconds have passed; ``device``: where each layer is
    profiled (default: the current CUDA device, or the CPU without CUDA). Returns the number of layers of each
    of the ``partitions`` partitions. See :func:`lightning_pipe.balance.balance_by_time`.
    """
    return engine_balance.balance_by_time(partitions, module, sample, timeout=timeout, device=_device(device))


def balance_by_size(partitions: int, module: nn.Sequential, input: Tensor | tuple[Tensor, ...], *,
                    chunks: int = 1, param_scale: float = 2.0, device: Device | None = None) -> list[int]:
    """Naive automatic balancing by the training memory of each layer, as in torchgpipe::

        balance = balance_by_size(torch.cuda.device_count(), model, torch.empty(1024, 3, 224, 224),
                                  chunks=8, param_scale=4.0)   # 4 for Adam

    ``input``: a mini-batch of the size trained on; ``chunks``: the micro-batches it will be split into;
    ``param_scale``: copies of the parameters training keeps (2 for SGD, 3 with momentum, 4 to 5 for Adam);
    ``device``: where each layer is profiled (default: the current CUDA device, or the CPU without CUDA).
    See :func:`lightning_pipe.balance.balance_by_size`.
    """
    return engine_balance.balance_by_size(partitions, module, input, chunks=chunks, param_scale=param_scale,
                                          device=_device(device))
