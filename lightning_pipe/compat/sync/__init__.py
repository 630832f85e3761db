"""torch's ``sync.Pipe`` on this engine: ``from lightning_pipe.compat.sync import Pipe, WithDevice``.

``torch.distributed.pipeline.sync`` was removed from PyTorch; a program written for it runs after changing its
imports (``...pipeline.sync.skip`` becomes :mod:`lightning_pipe.compat.sync.skip`). As in torch:

- partitions follow the devices the layers already live on: consecutive layers on one GPU form one partition,
  and every layer on the CPU is a partition of its own (group CPU layers in an ``nn.Sequential`` child to keep
  them together; on a machine without a GPU that is how a model is split). A layer's device is that of its
  parameters and buffers; a layer with neither runs on the CPU unless wrapped in :class:`WithDevice`;
- a child ``nn.Sequential`` is flattened into its partition, whose layers are named ``0``, ``1``, ... as in
  torch (so ``state_dict`` keys are torch's ``partitions.{j}.{k}.*``);
- several inputs, ``model(a, b)``, are the first layer's arguments, and a tuple a layer returns is spread over
  the next layer's arguments;
- the forward returns an RRef: ``model(x).local_value()`` is the output.

torch's ``sync.Pipe`` required ``torch.distributed.rpc.init_rpc`` first. Here that requirement is lifted: with RPC
initialised, the forward returns a ``torch.distributed.rpc.RRef`` as torch's did; without it, a
:class:`LocalRRef` whose ``local_value()`` and ``to_here()`` give the output and which says, for anything
else, that RPC is not initialised. What else differs on purpose is listed in docs/migration.md.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from lightning_pipe.compat.sync import skip
from lightning_pipe.engine.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.engine.partition import Device, Partition, check_repeats, normalize_device
from lightning_pipe.engine.pipe import Pipe as _EnginePipe

__all__ = ["Pipe", "WithDevice", "LocalRRef", "is_checkpointing", "is_recomputing", "skip"]

T = TypeVar("T")


class WithDevice(nn.Module):
    """Run ``module`` on ``device``, as torch's ``WithDevice``: for a layer without parameters or buffers, which
    :class:`Pipe` would otherwise run on the CPU (``WithDevice(nn.Dropout(), "cuda:1")``). :class:`Pipe` moves
    ``module`` there and places it in its partition unwrapped."""

    def __init__(self, module: nn.Module, device: Device) -> None:
        super().__init__()
        self._module = module
        self._device = torch.device(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module."""
        return self._module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._module

    @property
    def device(self) -> torch.device:
        """Where the wrapped module runs."""
        return self._device


class LocalRRef(Generic[T]):
    """An output held in this process: what :meth:`Pipe.forward` returns when ``torch.distributed.rpc`` is not
    initialised (with RPC, it returns a ``torch.distributed.rpc.RRef``). ``local_value()`` and ``to_here()``
    return the output; ``is_owner()`` is true; anything else of ``RRef``'s says that it needs RPC."""

    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value = value

    def local_value(self) -> T:
        """The output itself."""
        return self._value

    def to_here(self, timeout: float = 0.0) -> T:
        """The output itself (it is already here)."""
        return self._value

    def is_owner(self) -> bool:
        """True: this process holds the output."""
        return True

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"LocalRRef has no '{name}': the output was computed while torch.distributed.rpc was not initialised, "
            "so Pipe returned it held in this process. Use local_value() (or to_here()), or call "
            "torch.distributed.rpc.init_rpc(...) before the forward to get a torch.distributed.rpc.RRef")

    def __repr__(self) -> str:
        return f"LocalRRef({type(self._value).__name__})"


def layer_device(name: str, layer: nn.Module) -> torch.device | None:
    """The device of the parameters and buffers of ``layer`` (named ``name``); None if it has neither."""
    devices = {t.device for t in itertools.chain(layer.parameters(), layer.buffers())}
    if len(devices) > 1:
        raise ValueError(f"layer '{name}' ({type(layer).__name__}) has parameters or buffers on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); each layer runs on one device: place it "
                         "whole with .to(device), or split it into layers")
    return next(iter(devices), None)


def place(module: nn.Sequential) -> tuple[list[nn.Module], list[int], list[torch.device]]:
    """The layers of ``module`` in order (child ``nn.Sequential`` s flattened, :class:`WithDevice` unwrapped and
    its module moved), the number of layers of each partition and each partition's device, by torch's rule:
    consecutive children on one device share a partition, except on the CPU, where each child has its own.
    A layer at several positions (``nn.Sequential(lin, lin)``, also inside a flattened child) is refused, as
    torch refused it: listing the children would keep it once and silently compute ``lin(x)``."""
    named: list[tuple[str, nn.Module]] = []
    balance: list[int] = []
    devices: list[torch.device] = []
    for name, child in module._modules.items():  # every position: named_children() drops a repeated layer
        if child is None:
            continue
        if isinstance(child, WithDevice):
            device = normalize_device(child.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"layer '{name}' is WithDevice(..., '{device}'), but CUDA is not available here "
                                 "(torch.cuda.is_available() is False); name a device this machine has ('cpu')")
            child = child.module.to(device)
        else:
            device = normalize_device(layer_device(name, child) or torch.device("cpu"))
        inner = [(f"{name}.{k}", m) for k, m in child._modules.items() if m is not None] \
            if isinstance(child, nn.Sequential) else [(name, child)]
        if not inner:
            continue  # an empty nn.Sequential passes its input on
        named.extend(inner)
        if devices and devices[-1] == device and device.type != "cpu":
            balance[-1] += len(inner)
        else:
            balance.append(len(inner))
            devices.append(device)
    check_repeats(named, hint="give each position its own layer: copy.deepcopy(layer) for a second one with its "
                              "own weights, or, to apply the same weights twice, a module of your own whose forward "
                              "calls it twice (not an nn.Sequential, which Pipe flattens into its partition)")
    return [layer for _, layer in named], balance, devices


class Pipe(_EnginePipe):
    """torch's ``sync.Pipe(module, chunks=1, checkpoint='except_last', deferred_batch_norm=False)``: the engine's
    :class:`lightning_pipe.Pipe`, with partitions placed where the layers of ``module`` are (see the module's
    description) and an RRef out of the forward. ``devices`` lists each partition's device, ``balance`` its
    number of layers.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be nn.Sequential to be partitioned (got: {type(module).__name__})")
        layers, balance, devices = place(module)
        super().__init__(nn.Sequential(*layers), balance, devices=devices, chunks=chunks, checkpoint=checkpoint,
                         deferred_batch_norm=deferred_batch_norm)
        for j, partition in enumerate(self.partitions):  # torch's names: 0, 1, ... in each partition
            renamed = Partition(*partition.children())
            renamed.spread_tuples = True
            self.partitions[j] = renamed

    def __getitem__(self, index: int | slice) -> nn.Module:
        """The layer at ``index``; a slice gives an ``nn.Sequential`` of those layers (the same objects)."""
        if isinstance(index, slice):
            return nn.Sequential(*list(self)[index])
        return super().__getitem__(index)

    def forward(self, *inputs: Tensor) -> Any:  # type: ignore[override]
        """Run a mini-batch through the pipeline and return an RRef to the output (``.local_value()``).

        Several inputs are the first layer's arguments. Each must be a tensor with the batch along dim 0;
        non-tensor inputs and ``NoChunk`` are not supported (pass such values to the layers another way).
        """
        if not inputs:
            raise TypeError("Pipe.forward takes the mini-batch: one tensor or several (got: none)")
        output = super().forward(inputs[0] if len(inputs) == 1 else inputs)
        return _rref(output)


def _rref(value: Any) -> Any:
    """``value`` in a ``torch.distributed.rpc.RRef`` when RPC is initialised in this process, else a LocalRRef."""
    import torch.distributed.rpc as rpc

    if rpc.is_available() and rpc._is_current_rpc_agent_set():
        return rpc.RRef(value)
    return LocalRRef(value)
