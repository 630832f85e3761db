"""The loss where the output is born: the user's loss per micro-batch on the last stage, combined into the batch's.

``loss_fn(output, target)`` runs on the last stage right after each micro-batch's forward, on that
micro-batch's slice of the target; only the loss (and any small extras it returns) travels back. It returns
a scalar tensor, or a mapping with the scalar under ``"loss"`` and other tensors beside it (a count of correct
predictions, per-sample scores) that come back detached::

    def loss_fn(logits, targets):                       # a module-level function, or an nn.Module
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss, "correct": (logits.argmax(-1) == targets).sum()}

The batch's loss is ``sum_i w_i * loss_i``: with ``reduction="mean"`` (the default) ``w_i`` is the micro-batch's
share of the samples, which gives exactly the whole batch's loss for any loss that is a mean over samples;
with ``"sum"``, ``w_i = 1``, for a loss that is a sum over samples (or a sum divided by a count the caller
computed over the whole batch). Extras with a value per sample are concatenated along dim 0. A scalar extra is one
number per micro-batch, which cannot say how the batch's number is made from them: an integer or boolean one (a
count: a mean of integers is no integer) is added up; a floating one is combined as ``extras`` names it, ``"mean"``
(weighted by each micro-batch's share of the samples: an accuracy, a mean score) or ``"sum"`` (added up: a sum of
errors, a count held as a float), and as the loss (``reduction``) where ``extras`` does not name it::

    loss_on_last_stage(body, x, y, loss_fn, extras={"abs_error": "sum"})
"""

from __future__ import annotations

import contextlib
import pickle
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["REDUCTIONS", "CastOutput", "MicroLoss", "check_extras", "check_sendable", "combine", "compute", "weights"]

#: The accepted values of ``reduction``.
REDUCTIONS = ("mean", "sum")

LossFn = Callable[[Any, Any], Any]


class MicroLoss(NamedTuple):
    """One micro-batch's loss as it comes back from the last stage: the value and the extras, detached
    (``extras`` is None when the loss function returned a tensor, not a mapping)."""

    value: Tensor
    extras: dict[str, Tensor] | None


class CastOutput:
    """``loss_fn`` given the output with its floating-point tensors cast as ``casts`` says (dtype -> dtype; a
    module's output as a precision plugin converts it where the module's forward returns it, before the caller's
    loss): picklable where ``loss_fn`` is, for a last stage in another process."""

    def __init__(self, loss_fn: LossFn, casts: Mapping[torch.dtype, torch.dtype]) -> None:
        self.loss_fn, self.casts = loss_fn, dict(casts)

    def _cast(self, t: Tensor) -> Tensor:
        return t.to(self.casts[t.dtype]) if t.dtype in self.casts else t

    def __call__(self, output: Any, target: Any) -> Any:
        return self.loss_fn(each_tensor(output, self._cast), target)


def check_reduction(reduction: object) -> None:
    """Reject an unknown reduction, naming the valid ones."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))} (got: {reduction!r})")


def check_extras(extras: object) -> None:
    """Reject an ``extras`` that is not a mapping of names to ``"mean"`` or ``"sum"`` (or None), saying which."""
    if extras is None:
        return
    if not isinstance(extras, Mapping) or any(not isinstance(k, str) for k in extras):
        raise TypeError(f"extras must map the names of what the loss function returns beside 'loss' to 'mean' or "
                        f"'sum' (got: {extras!r})")
    bad = {k: v for k, v in extras.items() if v not in REDUCTIONS}
    if bad:
        raise ValueError(f"extras must map each name to 'mean' (weighted by the micro-batches' shares of the samples) "
                         f"or 'sum' (added up) (got: {bad!r})")


#: The loss functions found to pickle, so that each is checked once (not pickled again at every step), kept no longer
#: than the program keeps them.
_SENDABLE: weakref.WeakSet[Any] = weakref.WeakSet()


def check_sendable(loss_fn: LossFn, processes: int) -> None:
    """Reject a ``loss_fn`` that cannot reach the last stage, in another of the pipeline's ``processes``: it travels
    there by pickle, which takes functions by their module-level name. Says what to pass instead."""
    with contextlib.suppress(TypeError):  # unhashable, or no weak reference to it: checked every time
        if loss_fn in _SENDABLE:
            return
    try:
        pickle.dumps(loss_fn)
    except Exception as exc:  # pickle raises PicklingError, AttributeError or TypeError, by what it met
        raise TypeError(
            f"loss_on_last_stage cannot send its loss_fn to the last stage, which runs in another process (a pipeline "
            f"of {processes} processes): the loss function travels there by pickle, and {loss_fn!r} does not pickle "
            f"({type(exc).__name__}: {exc}). Pass a function defined at the top level of a module (def "
            "loss_fn(output, target): ...), a functools.partial of one (functools.partial("
            "torch.nn.functional.cross_entropy, label_smoothing=0.1)), or an nn.Module loss "
            "(torch.nn.CrossEntropyLoss()); not a lambda, a function defined inside another, or an object holding "
            "one") from exc
    with contextlib.suppress(TypeError):
        _SENDABLE.add(loss_fn)


def compute(loss_fn: LossFn, output: Any, target: Any) -> tuple[Tensor, dict[str, Tensor] | None]:
    """``loss_fn(output, target)`` as (the scalar loss, the other tensors it returned, or None if it returned
    the loss alone)."""
    result = loss_fn(output, target)
    extras: dict[str, Tensor] | None = None
    if isinstance(result, Mapping):
        if "loss" not in result:
            raise ValueError(f"the loss function returned a mapping without a 'loss' entry (keys: {sorted(result)}); "
                             "put the scalar to minimise under 'loss'")
        extras = {k: v for k, v in result.items() if k != "loss"}
        result = result["loss"]
    if not isinstance(result, Tensor) or result.numel() != 1:
        shape = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise ValueError(f"the loss function must return a scalar tensor (or a mapping with one under 'loss'); "
                         f"got {shape}. Reduce it to one value per micro-batch (a mean or a sum over samples)")
    bad = sorted(k for k, v in (extras or {}).items() if not isinstance(v, Tensor))
    if bad:
        raise ValueError(f"what the loss function returns beside 'loss' must be tensors (not: {bad})")
    return result.reshape(()), extras


def weights(sizes: Sequence[int], reduction: str) -> list[float]:
    """Each micro-batch's weight in the batch's loss: its share of the samples (``"mean"``) or 1 (``"sum"``)."""
    check_reduction(reduction)
    total = sum(sizes)
    return [n / total for n in sizes] if reduction == "mean" else [1.0] * len(sizes)


def combine(losses: Sequence[MicroLoss], w: Sequence[float], sizes: Sequence[int],
            extras: Mapping[str, str] | None = None) -> MicroLoss:
    """The batch's loss and extras from the micro-batches' (of ``sizes`` samples; see the module's docstring): the
    loss weighted by ``w``; a floating scalar extra that ``extras`` names ``"mean"`` by each micro-batch's share of the
    samples, one it names ``"sum"`` or an integer or boolean one added up, another by ``w``."""
    if all(loss.value.device.type == "cpu" and loss.value.is_floating_point() for loss in losses):
        # The same sum in the same order in Python's doubles: one call into torch per micro-batch, not three.
        total = 0.0
        for wi, loss in zip(w, losses):
            total += wi * float(loss.value)
        value = torch.tensor(total, dtype=torch.float64).to(losses[0].value.dtype)
    else:
        value = sum((wi * loss.value.double() for wi, loss in zip(w, losses)), torch.zeros((), dtype=torch.float64))
        value = value.to(losses[0].value.dtype)
    if losses[0].extras is None:
        if extras:
            raise ValueError(f"extras names {sorted(extras)}, but the loss function returned the loss alone (a tensor, "
                             "not a mapping with 'loss' and them)")
        return MicroLoss(value, None)
    unknown = sorted(set(extras or ()) - set(losses[0].extras))
    if unknown:
        raise ValueError(f"extras names {unknown}, which the loss function does not return (it returns "
                         f"{sorted(losses[0].extras)} beside 'loss')")
    combined: dict[str, Tensor] = {}
    for key in losses[0].extras:
        parts = [loss.extras[key] for loss in losses]  # type: ignore[index]
        how = (extras or {}).get(key)
        if parts[0].dim() and how is not None:
            raise ValueError(f"extras names {key!r} ({how!r}), a tensor of shape {tuple(parts[0].shape)} per "
                             "micro-batch: one with a value per sample is joined along dim 0, not combined; name "
                             "scalars alone")
        if parts[0].dim():
            combined[key] = torch.cat(parts)
        elif not parts[0].is_floating_point() and not parts[0].is_complex():
            if how == "mean":
                raise ValueError(f"extras names {key!r} 'mean', but the loss function returns it as "
                                 f"{parts[0].dtype} (a count): a mean of integers is no integer; return it as a "
                                 "float (e.g. .float().mean()) to have it averaged")
            combined[key] = torch.stack(parts).sum()  # a count, added up in its own type
        else:
            weight = w if how is None else weights(sizes, how)
            wide = torch.complex128 if parts[0].is_complex() else torch.float64
            combined[key] = sum((wi * p.to(wide) for wi, p in zip(weight, parts)),
                                torch.zeros((), dtype=wide)).to(parts[0].dtype)
    return MicroLoss(value, combined)


def detach(value: Tensor, extras: Mapping[str, Tensor] | None) -> MicroLoss:
    """What goes back from the last stage: the loss and extras, detached."""
    return MicroLoss(value.detach(), None if extras is None else {k: v.detach() for k, v in extras.items()})


def each_tensor(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` (a tensor, or tuples, lists and mappings of them) with ``fn`` applied to each of its tensors."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(each_tensor(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: each_tensor(v, fn) for k, v in value.items()}
    return value


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a target: a tensor, or tuples, lists and mappings of them) with its tensors on ``device``."""
    return each_tensor(value, lambda t: t.to(device, non_blocking=device.type == "cuda"))


def scatter_target(target: Any, sizes: Sequence[int]) -> list[Any]:
    """``target`` split along dim 0 into micro-batches of ``sizes``: a tensor, or a tuple, list or mapping of
    tensors (each split alike); anything else (None, a number) goes to every micro-batch as it is."""
    if isinstance(target, Tensor):
        if target.dim() == 0 or target.size(0) != sum(sizes):
            raise ValueError(f"the target must have the input's batch size along dim 0 to be split into "
                             f"micro-batches (target shape: {tuple(target.shape)}, batch size: {sum(sizes)})")
        return list(target.split(list(sizes)))
    if isinstance(target, (tuple, list)):
        columns = [scatter_target(t, sizes) for t in target]
        return [type(target)(column[i] for column in columns) for i in range(len(sizes))]
    if isinstance(target, Mapping):
        columns = {k: scatter_target(t, sizes) for k, t in target.items()}
        return [{k: column[i] for k, column in columns.items()} for i in range(len(sizes))]
    return [target] * len(sizes)
