"""Micro-batches: checking a batch, splitting it along dim 0 and joining the pieces back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

__all__: list[str] = []

#: What flows between partitions: one tensor, or a tuple of tensors.
TensorOrTensors = Union[Tensor, tuple[Tensor, ...]]  # noqa: UP007 - a runtime alias on Python 3.10


class Batch:
    """One value that flows between partitions: a tensor or a tuple of tensors, seen uniformly.

    Nothing else in the engine branches on "tensor or tuple": it asks ``batch.tensors`` for the tuple and
    ``batch.value`` for what a module receives or returned.
    """

    __slots__ = ("tensors", "atomic")

    def __init__(self, tensors: tuple[Tensor, ...], atomic: bool) -> None:
        self.tensors = tensors
        self.atomic = atomic

    @classmethod
    def of(cls, value: Any, what: str) -> Batch:
        """Wrap ``value`` (a tensor or a tuple/list of tensors); ``what`` names it in errors."""
        if isinstance(value, Tensor):
            return cls((value,), True)
        if isinstance(value, (tuple, list)):
            if not value:
                raise TypeError(f"{what} is an empty tuple; expected a tensor or a tuple of tensors")
            bad = [f"{i}: {type(v).__name__}" for i, v in enumerate(value) if not isinstance(v, Tensor)]
            if bad:
                raise TypeError(
                    f"{what} must be a tensor or a tuple of tensors (non-tensor elements: {', '.join(bad)})"
                )
            return cls(tuple(value), False)
        raise TypeError(f"{what} must be a tensor or a tuple of tensors (got: {type(value).__name__})")

    @property
    def value(self) -> TensorOrTensors:
        """The tensor (atomic batch) or the tuple of tensors."""
        return self.tensors[0] if self.atomic else self.tensors

    def with_tensors(self, tensors: Sequence[Tensor]) -> Batch:
        """A batch of the same shape (atomic or tuple) holding other tensors."""
        return Batch(tuple(tensors), self.atomic)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(t.shape)) for t in self.tensors)
        return f"Batch({shapes}{'' if self.atomic else ','})"


def batch_size(batch: Batch) -> int:
    """The size of dim 0, checked to agree across the tuple and to be positive."""
    sizes = []
    for t in batch.tensors:
        if t.dim() == 0:
            raise ValueError(
                f"input tensors must have a batch dimension to split into micro-batches (got a 0-dim tensor "
                f"of shape {tuple(t.shape)})"
            )
        sizes.append(t.size(0))
    if len(set(sizes)) != 1:
        raise ValueError(
            f"tensors of one input disagree in their batch dimension (dim 0 sizes: {sizes}); every tensor of "
            "a tuple input must have the same number of samples"
        )
    if sizes[0] == 0:
        raise ValueError("input is an empty batch (dim 0 size: 0); a pipeline needs at least one sample")
    return sizes[0]


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split ``batch`` into ``min(chunks, batch size)`` micro-batches of as equal sizes as possible."""
    n = min(chunks, batch_size(batch))
    pieces = [t.tensor_split(n, dim=0) for t in batch.tensors]
    return [batch.with_tensors([p[i] for p in pieces]) for i in range(n)]


def gather(batches: Sequence[Batch]) -> Batch:
    """Concatenate micro-batches back along dim 0 (the inverse of :func:`scatter`)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    columns = zip(*(b.tensors for b in batches))
    return first.with_tensors([torch.cat(col, dim=0) for col in columns])
