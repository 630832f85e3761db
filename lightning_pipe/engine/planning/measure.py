"""A body measured once for the planner: each layer's forward and backward time, its parameters, and what a
sample leaves saved for backward, so that any stage's activations can be counted without running it again."""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.backward_split import input_gradients_first, twice_safe
from lightning_pipe.engine.balance.profile import (
    as_layer_input,
    batch_size_of,
    copy_to,
    detach_batch,
    layer_sandbox,
    map_tensors,
    synchronize_device,
    tensors_of_batch,
)

__all__ = ["BodyProfile", "LayerMeasure", "concurrently", "measure_body"]

#: Precisions whose layers compute in half precision under autocast (the parameters stay as they are).
AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
#: Precisions whose parameters and activations are all in a half type.
TRUE_HALF = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


@dataclass(frozen=True)
class LayerMeasure:
    """One layer of a body: its share of the body's forward and backward time, sizes in bytes (``saved``,
    ``input`` and ``output`` per sample, each an ``(id, bytes)`` of a storage: one id is one storage, shared where
    layers share it, e.g. a layer's saved output that the next layer saves as its input)."""

    forward: float
    backward: float
    params: int
    trainable: int
    buffers: int
    largest_param: int
    saved: tuple[tuple[int, float], ...]
    input: tuple[int, float]
    output: tuple[int, float]
    #: whether a zero-bubble schedule may run its backward in two (on the CPU, a layer that allows it: ``twice_safe``)
    splits: bool = False


@dataclass(frozen=True)
class BodyProfile:
    """Every layer of a body measured (:func:`measure_body`), and what a stage of layers ``lo .. hi - 1`` costs."""

    layers: tuple[LayerMeasure, ...]
    rows: int
    threads: int
    #: (rows, forward, backward seconds, and the backward's two parts where zero-bubble schedules split it, each over
    #: the whole backward) of the whole body, by rows
    chain: tuple[tuple[int, float, float, float, float], ...]
    input_grad: bool = False  # whether the body's input needs a gradient (else the first stage's backward is whole)

    def __len__(self) -> int:
        return len(self.layers)

    def activations(self, lo: int, hi: int) -> float:
        """Bytes per sample that one micro-batch keeps at a stage of layers ``lo .. hi - 1`` from its forward to
        its backward: what autograd saves there, the stage's input and its output (held for the backward)."""
        held: dict[int, float] = {}
        for layer in self.layers[lo:hi]:
            held.update(layer.saved)
        held.update([self.layers[lo].input, self.layers[hi - 1].output])
        return sum(held.values())

    def splits(self, lo: int, hi: int) -> bool:
        """Whether a stage of layers ``lo .. hi - 1`` runs a zero-bubble schedule's backward in two (input gradients,
        then its parameters', the micro-batch held until then), as the engine does: where each of its layers allows it
        and its input needs a gradient (else each ``I`` is a whole backward, its ``W`` nothing)."""
        return all(layer.splits for layer in self.layers[lo:hi]) and (lo > 0 or self.input_grad)

    def boundary(self, k: int) -> float:
        """Bytes per sample handed to layer ``k`` (the body's input for 0; ``len``: the body's output)."""
        return self.layers[k].input[1] if k < len(self.layers) else self.layers[-1].output[1]

    def largest_saved(self, lo: int, hi: int) -> float:
        """The largest single saved tensor's bytes per sample at a stage: about what a backward holds at once
        besides what is saved (the gradient flowing through it)."""
        return max([b for layer in self.layers[lo:hi] for _, b in layer.saved] + [self.boundary(hi)])

    def total(self, what: str, lo: int = 0, hi: int | None = None) -> int:
        """The sum of ``what`` (``params``, ``trainable``, ``buffers``) over layers ``lo .. hi - 1``."""
        return sum(getattr(layer, what) for layer in self.layers[lo:hi])

    def time(self, direction: str, lo: int, hi: int, rows: float) -> float:
        """Seconds of ``direction`` (``forward`` or ``backward``; ``inputs`` or ``weights``: the backward's two parts
        where a zero-bubble schedule splits it) of layers ``lo .. hi - 1`` on ``rows`` samples: their share of the
        whole body's, measured at the row counts nearest ``rows`` (linear between them). The first stage's backward
        is not split where the body's input needs no gradient (nothing goes upstream)."""
        if direction in ("inputs", "weights"):
            backward = self.time("backward", lo, hi, rows)
            if not self.splits(lo, hi):
                return backward if direction == "inputs" else 0.0
            return backward * self._interpolated(3 if direction == "inputs" else 4, rows)
        share = sum(getattr(layer, direction) for layer in self.layers[lo:hi])
        return self._interpolated(1 if direction == "forward" else 2, rows, per_row=True) * share

    def _interpolated(self, k: int, rows: float, per_row: bool = False) -> float:
        """Item ``k`` of :attr:`chain` at ``rows`` (linear between the row counts measured; beyond them, in proportion
        to the rows where ``per_row``, else the nearest)."""
        points = self.chain
        below = max((pt for pt in points if pt[0] <= rows), default=points[0], key=lambda pt: pt[0])
        above = min((pt for pt in points if pt[0] >= rows), default=points[-1], key=lambda pt: pt[0])
        if above[0] == below[0]:
            return below[k] * rows / below[0] if per_row else below[k]
        return below[k] + (above[k] - below[k]) * (rows - below[0]) / (above[0] - below[0])


def measure_body(module: nn.Sequential, sample: Any, *, device: torch.device | str = "cpu", precision: str = "32-true",
                 threads: int | None = None, repeats: int = 5, concurrent: int = 1) -> BodyProfile:
    """Measure every layer of ``module`` on ``sample`` (a batch of inputs, dimension 0 the samples): its forward and
    backward time at the batch's rows and at a quarter of them (a line through both: fixed and per-sample cost,
    the median of ``repeats`` runs, on ``threads`` intra-op threads), its parameter bytes, and which storages
    autograd saves, per sample. ``concurrent``: the body's time is measured while as many copies of it run at once
    (the processes of a job on one machine share its memory bandwidth and caches). ``module`` is left as it was
    (each layer runs in a throwaway copy)."""
    device = torch.device(device)
    rows = batch_size_of(sample)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        alone = _times(module, sample, device, precision, repeats)
        counts = sorted({max(1, rows >> k) for k in range(6)})
        chain = tuple((r, *concurrently(functools.partial(_chain, module, sample, r, device, precision, repeats),
                                        concurrent)) for r in counts)
        saved, inputs, outputs = _saved(module, sample, device, precision)
    finally:
        torch.set_num_threads(previous)
    totals = [sum(t[d] for t in alone) or 1.0 for d in (0, 1)]
    layers = []
    for k, layer in enumerate(module):
        params = list(layer.parameters())
        scale = _param_scale(precision, params)
        layers.append(LayerMeasure(
            forward=alone[k][0] / totals[0], backward=alone[k][1] / totals[1],
            params=int(sum(p.numel() * p.element_size() for p in params) * scale),
            trainable=int(sum(p.numel() * p.element_size() for p in params if p.requires_grad) * scale),
            buffers=sum(b.numel() * b.element_size() for b in layer.buffers()),
            largest_param=int(max([p.numel() * p.element_size() for p in params] or [0]) * scale),
            saved=tuple((key, nbytes / rows) for key, nbytes in saved[k].items()),
            input=(inputs[k][0], inputs[k][1] / rows), output=(outputs[k][0], outputs[k][1] / rows),
            splits=device.type == "cpu" and twice_safe(layer)))
    return BodyProfile(tuple(layers), rows, threads or previous, chain,
                       any(t.requires_grad for t in tensors_of_batch(sample)))


def _param_scale(precision: str, params: Sequence[Tensor]) -> float:
    """What a parameter's bytes become under ``precision`` (2-byte parameters under the true half precisions)."""
    if precision in TRUE_HALF and params and params[0].is_floating_point():
        return 2 / params[0].element_size()
    if precision == "64-true" and params and params[0].is_floating_point():
        return 8 / params[0].element_size()
    return 1.0


def _rows(sample: Any, rows: int, k: int = 0) -> Any:
    return map_tensors(lambda t: t[k * rows:(k + 1) * rows] if t.dim() > 0 else t, sample)


@contextlib.contextmanager
def _precision(precision: str, device: torch.device) -> Iterator[None]:
    if precision in AUTOCAST:
        with torch.autocast(device.type, dtype=AUTOCAST[precision]):
            yield
    else:
        yield


def _cast(precision: str, layer: nn.Module, batch: Any) -> tuple[nn.Module, Any]:
    dtype = TRUE_HALF.get(precision, torch.float64 if precision == "64-true" else None)
    if dtype is None:
        return layer, batch
    return layer.to(dtype), map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def _times(module: nn.Sequential, sample: Any, device: torch.device, precision: str,
           repeats: int) -> list[tuple[float, float]]:
    """Per layer, the median forward and backward seconds over ``repeats`` passes (after one to warm up)."""
    runs: list[list[tuple[float, float]]] = []
    for _ in range(repeats + 1):
        batch = map_tensors(lambda t: copy_to(t, device).requires_grad_(t.requires_grad), sample)
        times = []
        for layer in module:
            with layer_sandbox(layer, device) as sandbox, torch.enable_grad():
                sandbox, batch = _cast(precision, sandbox, batch)
                inputs = as_layer_input(batch)
                synchronize_device(device)
                tick = time.perf_counter()
                with _precision(precision, device):
                    output = sandbox(inputs)
                synchronize_device(device)
                middle = time.perf_counter()
                targets = [t for t in tensors_of_batch(output) if t.requires_grad]
                if targets:
                    torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])
                synchronize_device(device)
                times.append((middle - tick, time.perf_counter() - middle))
            batch = detach_batch(output)
            del sandbox, inputs, output, targets
        runs.append(times)
    runs = runs[1:]
    return [(statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs))
            for k in range(len(module))]


def concurrently(work: Callable[[], tuple[float, ...]], copies: int) -> tuple[float, ...]:
    """``work``'s result (seconds) while ``copies`` of it run at once on threads started together (their median)."""
    if copies <= 1:
        return work()
    start = threading.Barrier(copies)
    results: list[tuple[float, ...]] = []

    def run() -> None:
        start.wait()
        results.append(work())

    threads = [threading.Thread(target=run, daemon=True) for _ in range(copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tuple(statistics.median(r[k] for r in results) for k in range(len(results[0])))


def _chain(module: nn.Sequential, sample: Any, rows: int, device: torch.device, precision: str,
           repeats: int) -> tuple[float, float, float, float]:
    """The whole body's forward and backward seconds per micro-batch of ``rows`` samples, as a stage runs them: the
    sample's micro-batches forward one after the other, its layers in one graph, then their backwards, the
    gradients added up (the fastest of ``repeats`` passes after one to warm up: what the machine does undisturbed;
    a median moves with whatever else runs); and a backward split in two (:func:`_split_backward`), each part's
    time over the whole backward's (1 and 0 where the engine would not split it)."""
    count = max(1, batch_size_of(sample) // rows)
    forward, backward = [], []
    # Zero-bubble schedules split a backward in two where the engine can (on the CPU, layers that allow it): what
    # that costs over the whole backward, measured where the layers' input needs a gradient.
    upstream = len(module) > 1 or any(t.is_floating_point() for t in tensors_of_batch(sample))
    splits = device.type == "cpu" and upstream and all(twice_safe(layer) for layer in module)
    parts: list[tuple[float, float, float]] = []
    with contextlib.ExitStack() as stack:
        sandboxes = []
        for layer in module:
            sandbox = stack.enter_context(layer_sandbox(layer, device))
            sandboxes.append(_cast(precision, sandbox, None)[0])
        for _ in range(repeats + 1):
            batches = [_cast(precision, nn.Identity(), map_tensors(
                lambda t: copy_to(t, device).requires_grad_(t.requires_grad), _rows(sample, rows, k)))[1]
                for k in range(count)]
            synchronize_device(device)
            tick = time.perf_counter()
            with torch.enable_grad(), _precision(precision, device):
                for k in range(count):
                    batch = as_layer_input(batches[k])
                    for sandbox in sandboxes:
                        batch = sandbox(batch)
                    batches[k] = batch
            synchronize_device(device)
            middle = time.perf_counter()
            for batch in batches:  # each micro-batch's backward, its parameter gradients added up as a stage's are
                targets = [t for t in tensors_of_batch(batch) if t.requires_grad]
                if targets:
                    torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])
            synchronize_device(device)
            forward.append((middle - tick) / count)
            backward.append((time.perf_counter() - middle) / count)
            del batches, batch, targets
            if splits:
                parts.append(_split_backward(sandboxes, sample, rows, count, device, precision))
    whole, inputs, weights = (min(p[d] for p in parts[1:]) for d in range(3)) if parts[1:] else (1.0, 1.0, 0.0)
    return min(forward[1:]), min(backward[1:]), inputs / whole, weights / whole


def _split_backward(sandboxes: Sequence[nn.Module], sample: Any, rows: int, count: int, device: torch.device,
                    precision: str) -> tuple[float, float, float]:
    """Seconds per micro-batch of the backward of the layers after the first (their input needs a gradient, as a
    later stage's does): whole, then in two as zero-bubble schedules run it (:func:`input_gradients_first`: the
    input gradients of every micro-batch, then their parameters')."""
    first, rest = (sandboxes[:1], sandboxes[1:]) if len(sandboxes) > 1 else ([], sandboxes)
    starts = []
    with torch.enable_grad(), _precision(precision, device):
        for k in range(count):
            batch = _cast(precision, nn.Identity(),
                          map_tensors(lambda t: copy_to(t, device), _rows(sample, rows, k)))[1]
            for sandbox in first:
                batch = sandbox(batch)
            starts.append(map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), batch))

    def forwards() -> list[tuple[list[Tensor], list[Tensor]]]:
        made = []
        with torch.enable_grad(), _precision(precision, device):
            for start in starts:
                batch = as_layer_input(start)
                for sandbox in rest:
                    batch = sandbox(batch)
                made.append(([t for t in tensors_of_batch(batch) if t.requires_grad],
                             [t for t in tensors_of_batch(start) if t.requires_grad]))
        return made

    made = forwards()
    synchronize_device(device)
    tick = time.perf_counter()
    for targets, _ in made:
        torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])
    synchronize_device(device)
    whole = time.perf_counter() - tick
    made = forwards()
    synchronize_device(device)
    tick = time.perf_counter()
    later = [input_gradients_first(targets, [torch.ones_like(t) for t in targets], upstream)[1]
             for targets, upstream in made]
    synchronize_device(device)
    middle = time.perf_counter()
    for finish in later:
        if finish is not None:
            finish()
    synchronize_device(device)
    return whole / count, (middle - tick) / count, (time.perf_counter() - middle) / count


def _saved(module: nn.Sequential, sample: Any, device: torch.device, precision: str
           ) -> tuple[list[dict[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """One forward through every layer in one graph: per layer, the storages autograd saved (parameters and
    buffers left out) by a small id and their bytes, and the storage of its input and of its output."""
    ids: dict[int, int] = {}
    saved: list[dict[int, int]] = []
    inputs: list[tuple[int, int]] = []
    outputs: list[tuple[int, int]] = []
    current: dict[int, int] = {}

    def key(t: Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        return ids.setdefault(storage.data_ptr(), len(ids)), storage.nbytes()

    with contextlib.ExitStack() as stack:
        batch = map_tensors(lambda t: copy_to(t, device).requires_grad_(t.requires_grad), sample)
        kept: list[Any] = []
        for layer in module:
            sandbox = stack.enter_context(layer_sandbox(layer, device))
            sandbox, batch = _cast(precision, sandbox, batch)
            state = {t.untyped_storage().data_ptr() for t in (*sandbox.parameters(), *sandbox.buffers())}
            current = {}

            def pack(t: Tensor, state: set[int] = state, current: dict[int, int] = current) -> Tensor:
                if t.untyped_storage().data_ptr() not in state:
                    k, nbytes = key(t)
                    current[k] = max(current.get(k, 0), nbytes)
                return t

            first = next(tensors_of_batch(batch), None)
            inputs.append(key(first) if first is not None else (-1, 0))
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    _precision(precision, device):
                batch = sandbox(as_layer_input(batch) if not kept else batch)
            saved.append(current)
            last = next(tensors_of_batch(batch), None)
            outputs.append(key(last) if last is not None else (-1, 0))
            kept.append((sandbox, batch))
        del kept
    return saved, inputs, outputs
