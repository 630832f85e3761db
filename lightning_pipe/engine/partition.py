"""Splitting an ``nn.Sequential`` into partitions: the checks of a body, a balance and a device, and the cut.

Both placements use these: the local :class:`~lightning_pipe.engine.pipe.Pipe` and the processes of
:mod:`lightning_pipe.transport`. Errors say what is wrong with the values in parentheses.

The cut gives :class:`Partition` modules: ``nn.Sequential`` s that a stage calls as a whole, so that hooks
registered on a partition run, while the stage still watches each layer (see :func:`watching_layers`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union

import torch
from torch import Tensor, nn

from lightning_pipe.engine.rng import no_random_layer

__all__ = ["CHECKPOINT_MODES", "Partition"]

#: The accepted values of ``checkpoint``.
CHECKPOINT_MODES = ("always", "except_last", "never")

Device = Union[torch.device, str, int]  # noqa: UP007 - a runtime alias on Python 3.10

BALANCE_HINT = """balance is required: the number of layers in each partition. To find one automatically:

    from lightning_pipe.balance import balance_by_time
    partitions = torch.cuda.device_count() or 2
    sample = torch.empty(128, 3, 224, 224)  # one mini-batch of your inputs
    balance = balance_by_time(partitions, model, sample)
    model = Pipe(model, balance, chunks=8)
"""


def checkpoint_stop(mode: str, microbatches: int, training: bool) -> int:
    """How many leading micro-batches are checkpointed (none in eval mode)."""
    if not training:
        return 0
    return {"always": microbatches, "except_last": microbatches - 1, "never": 0}[mode]


def check_checkpoint(checkpoint: str) -> None:
    """Reject an unknown checkpoint mode, naming the valid ones."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} "
                         f"(got: {checkpoint!r})")


def check_chunks(chunks: Any, what: str = "chunks") -> None:
    """Reject a micro-batch count that is not a positive integer."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{what} must be a positive integer (got: {chunks!r})")


#: What to do instead of repeating a layer, for the errors that refuse it.
REPEAT_HINT = ("give each position its own layer: copy.deepcopy(layer) for a second one with its own weights, or, to "
               "apply the same weights twice, one position that calls it twice (nn.Sequential(layer, layer) as a "
               "single layer, or a module whose forward calls it twice)")


def check_repeats(named: Iterable[tuple[str, nn.Module | None]], what: str = "module", hint: str = REPEAT_HINT
                  ) -> None:
    """Refuse a layer found at several of the positions ``named`` (name, layer), naming them: the partitions,
    which may put them on two stages, hold each position's layer once. Walk positions with
    ``module._modules.items()``: ``named_children()`` and ``children()`` list a repeated layer once, and a
    body built from them silently leaves out its second use."""
    positions: dict[int, list[str]] = {}
    for name, layer in named:
        if layer is not None:
            positions.setdefault(id(layer), []).append(name)
    repeated = [names for names in positions.values() if len(names) > 1]
    if repeated:
        where = "; ".join(", ".join(map(repr, names)) for names in repeated)
        raise ValueError(f"{what} with duplicate children is not supported (the same layer appears as: "
                         f"{where}); {hint}")


def check_sequential(module: Any, what: str = "module") -> None:
    """Reject a module that is not an ``nn.Sequential`` of distinct children. Layers may share parameters: each
    partition that uses one holds a copy kept in step (``Pipe``: :mod:`lightning_pipe.engine.tied`;
    ``PipeStrategy``: a copy per owning process)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"{what} must be nn.Sequential to be partitioned (got: {type(module).__name__})")
    if len(module._modules) == 0:
        raise ValueError(f"{what} has no layers (an empty nn.Sequential, length: 0): there is nothing to split "
                         "into partitions; a model that returns its input is nn.Identity()")
    empty = [name for name, child in module._modules.items() if child is None]
    if empty:
        raise ValueError(f"{what} has positions without a layer (names: {', '.join(map(repr, empty))}); "
                         "remove them or put a layer there")
    check_repeats(module._modules.items(), what)  # every position; children() would drop the repeats


def check_balance(module: nn.Sequential, balance: Sequence[int] | None) -> list[int]:
    """Validate ``balance`` against ``module``; return it as a list."""
    if balance is None:
        raise ValueError(BALANCE_HINT)
    balance = list(balance)
    if not balance or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in balance):
        raise ValueError(f"all balance numbers must be positive integers (balance: {balance})")
    if sum(balance) != len(module):
        raise ValueError(f"module and sum of balance have different length "
                         f"(module: {len(module)}, sum of balance: {sum(balance)})")
    return balance


class LayerWatch(Protocol):
    """What a stage does around each layer of its partition: notes where an error came from, and, where
    ``checking``, checks what the layer changed."""

    checking: bool  # whether :meth:`passed` has anything to check

    def failed(self, exc: BaseException, k: int, name: str, layer: nn.Module) -> None:
        """Layer ``k`` (``name``) raised ``exc``, which is raised on after this."""

    def passed(self, k: int, name: str, layer: nn.Module) -> None:
        """Layer ``k`` (``name``; -1: the partition's hooks) returned; raise if it did what it must not."""


_watch = threading.local()


def versions(tensors: Sequence[Tensor]) -> tuple[int, ...]:
    """The version counters of ``tensors`` (bumped by every in-place operation on their storage)."""
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


class StageWatch:
    """What a stage (``stage``: its ``index`` and ``_where``) watches around each layer of its partition (a
    :class:`LayerWatch`, which :class:`Partition` calls): where an error came from, and the version counters
    of the inputs a checkpointed forward must leave unchanged."""

    def __init__(self, stage: Any, microbatch: int, watch: Sequence[Tensor]) -> None:
        self.stage = stage
        self.microbatch = microbatch
        self.watch = watch
        self.checking = bool(watch)
        self.versions = versions(watch)

    @staticmethod
    def located(exc: BaseException, note: str) -> None:
        """Add ``note`` to ``exc`` unless an inner layer or stage already said where it was raised."""
        if not getattr(exc, "_lightning_pipe_located", False):
            exc.add_note(note)
            if "leaf Variable that requires grad" in str(exc):
                exc.add_note("the partition's inputs are leaves of its autograd graph, which may not be modified "
                             "in place: make that operation out of place (x = x + y rather than x += y), or copy "
                             "the input first (x.clone())")
            exc._lightning_pipe_located = True  # type: ignore[attr-defined]

    def failed(self, exc: BaseException, k: int, name: str, layer: nn.Module) -> None:
        """Note which layer raised ``exc``."""
        self.located(exc, f"raised in partition {self.stage.index}, {self.stage._where(k, name, layer)}")

    def passed(self, k: int, name: str, layer: nn.Module) -> None:
        """Raise if layer ``k`` (-1: the partition as a whole) modified a watched input in place."""
        if self.checking and versions(self.watch) != self.versions:
            where = self.stage._where(k, name, layer) if k >= 0 else f"partition {self.stage.index} or a hook on it"
            exc = RuntimeError(
                f"partition {self.stage.index} modified its input in place in a checkpointed forward "
                f"(micro-batch {self.microbatch}, {where}); recomputation in backward would start from the "
                "modified input and give wrong gradients. Make that operation out of place (x = x + y rather "
                "than x += y, inplace=False) or copy the input first (x.clone())"
            )
            exc._lightning_pipe_located = True  # type: ignore[attr-defined]
            raise exc


class watching_layers:  # noqa: N801 - used as a function: ``with watching_layers(partition, watch):``
    """Have ``watch`` see each layer of ``partition`` called on this thread in the enclosed code."""

    __slots__ = ("current", "previous")

    def __init__(self, partition: nn.Module, watch: LayerWatch) -> None:
        self.current = (partition, watch)

    def __enter__(self) -> None:
        self.previous = getattr(_watch, "current", None)
        _watch.current = self.current

    def __exit__(self, *exc_info: Any) -> None:
        _watch.current = self.previous


class Partition(nn.Sequential):
    """The layers of one partition, in order: an ``nn.Sequential`` that its stage calls as a whole.

    Hooks registered on it (``pipe.partitions[j].register_forward_hook``) therefore run, in the first forward
    and in recomputation, as torchgpipe ran them; the stage sees each layer through :func:`watching_layers`.
    Each layer receives the previous one's output as its one argument, as in ``nn.Sequential``; with
    ``spread_tuples`` a tuple is spread over the next layer's arguments instead (``layer(*value)``), as the
    layers of torch's ``sync.Pipe`` received it. Called outside a stage, it is the ``nn.Sequential``.
    """

    spread_tuples = False

    def forward(self, input: Any) -> Any:  # type: ignore[override]
        """Run the layers in turn on ``input``."""
        current = getattr(_watch, "current", None)
        watch = current[1] if current is not None and current[0] is self else None
        check = watch is not None and watch.checking
        spread = self.spread_tuples
        if check:
            watch.passed(-1, "", self)  # type: ignore[union-attr] # what its pre-hooks did
        for k, (name, layer) in enumerate(self._modules.items()):
            try:
                input = layer(*input) if spread and isinstance(input, tuple) else layer(input)
            except BaseException as exc:
                if watch is not None:
                    watch.failed(exc, k, name, layer)  # type: ignore[arg-type]
                raise
            if check:
                watch.passed(k, name, layer)  # type: ignore[arg-type,union-attr]
        return input


no_random_layer(Partition)  # it only calls its layers, each of which is looked at in its own right


def split_module(module: nn.Sequential, balance: Sequence[int]) -> list[Partition]:
    """Cut ``module`` into consecutive partitions of ``balance`` layers, keeping the layers' names."""
    items = list(module._modules.items())  # every position (check_sequential refused repeats)
    partitions, start = [], 0
    for size in balance:
        partitions.append(Partition(OrderedDict(items[start:start + size])))
        start += size
    return partitions


def normalize_device(device: Device) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA device without an index becomes the current one (``"cuda"``
    is ``cuda:0`` by default), so that it compares equal to the device of the tensors placed on it."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device
