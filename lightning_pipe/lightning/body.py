"""The driver's stand-in for the sequential body: its own process's layers for real, the others as placeholders.

After partitioning, the LightningModule's ``sequential_module`` is a :class:`PipelinedSequential`. It keeps
every layer under its original name, so ``named_parameters()`` (and parameter groups built from it),
``ModelSummary`` and ``state_dict`` keys are those of the unpipelined model. Layers of remote stages stay as
parameter-shaped placeholders on the ``meta`` device (:mod:`lightning_pipe.lightning.placeholders`), holding no
memory; moving or casting the module (``.to()``, ``.cuda()``, ``.half()``) touches only the real layers. Its
forward runs the whole pipeline; :meth:`PipelinedSequential.pipeline_loss` has the last stage compute the loss.

A placeholder cannot be changed in place (an initialiser or a hook editing weights): the change would never
reach its stage, so the next forward or ``state_dict`` raises.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_pipe.engine.autograd import pipeline_loss, run_pipeline
from lightning_pipe.engine.loss import LossFn, check_sendable
from lightning_pipe.engine.microbatch import Batch, TensorOrTensors
from lightning_pipe.lightning.placeholders import BODIES, listed, refuse_remote_call, version, wrap_placeholders
from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.parallel.dtensors import check_same_inputs

__all__: list[str] = []


class PipelinedSequential(nn.Module):
    """An ``nn.Sequential`` body split into stages: forward goes through ``pipeline``.

    ``stage_of[name]`` is the stage of each layer (by child name), held by process ``process_of[stage]`` of the
    pipeline (``owner[name]``); the layers of process 0 (this one) are real, the others placeholders on the
    meta device. ``hosts`` (the handle on the other processes) and ``balance`` stay with the module, so that a
    later Trainer's strategy takes over the same pipeline. ``schedule`` orders the micro-batches of a step;
    ``loss_scale()`` is the gradient the loss's backward is expected to bring (see
    :func:`~lightning_pipe.engine.autograd.pipeline_loss`).
    """

    def __init__(self, body: nn.Sequential, stage_of: dict[str, int], pipeline: Any, *, chunks: int,
                 checkpoint: str, hosts: Any = None, balance: list[int] | None = None,
                 name: str = "sequential_module", processes: int | None = None, schedule: str = "gpipe",
                 process_of: Sequence[int] | None = None) -> None:
        super().__init__()
        # The remote stages name their state as the LightningModule does: "<name>.3.weight".
        self.name = name
        self.processes = processes or max(stage_of.values()) + 1
        # The process of each stage (a V's, for the V-shaped schedules), by default stage % processes.
        self.process_of = list(process_of) if process_of is not None else \
            [s % self.processes for s in range(max(stage_of.values()) + 1)]
        owner = {child: self.process_of[s] for child, s in stage_of.items()}
        # A parameter tied to one of this process's layers stays real (and one parameter) in the remote layers
        # that share it, as in the plain model; their own copies are in their processes (lightning/tied.py).
        local = {id(p) for child, layer in body.named_children() if owner[child] == 0 for p in layer.parameters()}
        made: dict[int, Any] = {}
        for child, layer in body.named_children():
            if owner[child] != 0:
                _to_meta(layer, keep=local)
                wrap_placeholders(layer, f"{name}.{child}.", stage_of[child], owner[child], made)
                layer.register_forward_pre_hook(functools.partial(refuse_remote_call, f"{name}.{child}",
                                                                  stage_of[child]))
            self.add_module(child, layer)
        self.tied: list[Any] = []  # the parameters tied across processes (TiedParameter), set by the build
        self.tied_sync: Any = None  # sums their copies' gradients (lightning/tied.py), where there are any
        self.retie: Callable[[], None] = lambda: None  # remote layers take the local parameters tied to them again
        #: Built on the meta device and split (tensor parallel): the most its local stages held while they were built
        #: (:func:`~lightning_pipe.transport.parallel.building.materialize_split`); None otherwise.
        self.built: dict[str, int] | None = None
        self.stage_of_layer = dict(stage_of)
        self.owner = owner
        self.pipeline = pipeline
        self.hosts = hosts
        self.balance = balance if balance is not None else [list(stage_of.values()).count(j)
                                                            for j in range(max(stage_of.values()) + 1)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.before_forward: Callable[[], None] | None = None
        self.on_backward: Callable[[], None] | None = None  # called when the output's gradient arrives
        self._warned_small = False
        self.local_only = False  # True: state_dict() leaves remote layers' entries as placeholders
        self.sharded = False  # its stages are sharded over the replicas (FSDP2); they stay so once they are
        self.tensor_group: Any = None  # split by tensor parallel: the drivers that split stage 0 (see _prepare)
        self._runs = 0  # runs of the pipeline so far
        # Module-level functions, not bound methods: no reference cycle keeps a freed body (and its stages).
        self.register_state_dict_post_hook(_remote_state)
        self.register_load_state_dict_pre_hook(_load_remote_state)
        self.register_load_state_dict_post_hook(_loaded)
        self._placeholders: list[tuple[str, Tensor]] = []
        self._versions: list[int] = []
        self._loading: tuple[set[str], dict[str, int]] | None = None
        self._record_placeholders()
        BODIES.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._placeholders, self._versions = [], []
        self._record_placeholders()  # a copy's tensors start new version counters (and unpickled, plain class)

    def _record_placeholders(self, loading: tuple[set[str], dict[str, int]] | None = None) -> None:
        """Remember every placeholder (parameters and buffers of remote layers, by name in this module) and
        its version counter, which any in-place change bumps, meta tensors included. After a load,
        ``loading`` holds the names loaded and the counters just before: those loaded, or changed by the load
        itself, are taken afresh; the others keep theirs, so a change made before still shows. Parameters put
        in by ``load_state_dict(assign=True)`` become placeholders again."""
        made: dict[int, Any] = {}
        for child, layer in self.named_children():
            if self.owner[child] != 0:
                wrap_placeholders(layer, f"{self.name}.{child}.", self.stage_of_layer[child],
                                  self.owner[child], made)
        recorded = dict(zip((name for name, _ in self._placeholders), self._versions))
        loaded, before_load = loading if loading is not None else (set(), {})
        self._placeholders = [(f"{child}.{name}", t) for child, layer in self.named_children()
                              if self.owner[child] != 0
                              for name, t in [*layer.named_parameters(), *layer.named_buffers()]
                              if t.is_meta]  # not a parameter tied to a local layer
        self._versions = []
        for name, t in self._placeholders:
            now = version(t)
            fresh = loading is None or name in loaded or name not in recorded or now != before_load.get(name)
            self._versions.append(now if fresh else recorded[name])

    def check_placeholders(self) -> None:
        """Raise if a remote layer's placeholder was changed in place here (an initialiser, or a hook or
        callback editing weights or buffers): the change never reached the stage that holds the layer."""
        versions = [version(t) for _, t in self._placeholders]
        if versions == self._versions:
            return
        changed = [name for (name, _), v, was in zip(self._placeholders, versions, self._versions) if v != was]
        stages = sorted({self.stage_of_layer[name.split(".", 1)[0]] for name in changed})
        shown = listed([f"{self.name}.{name}" for name in changed])
        raise RuntimeError(
            f"{shown} changed in place in this process, where the layers of remote stages "
            f"({', '.join(map(str, stages))}) are placeholders without data: the change did not reach the stages "
            "that hold them, and training would go on without it. Change their weights through "
            "model.load_state_dict(...), which reaches every stage, or in the layer's own forward (a change "
            "through .data is not seen here, nor anywhere)")

    def speak_for(self, module: nn.Module) -> None:
        """Have ``module``, which holds this body's layers under the same names (the bare ``nn.Sequential`` given to
        ``fabric.setup``, through which Fabric's wrapper reads and loads its state), read and load its state as this
        body does: ``module.state_dict()`` is the whole model's, fetched from every stage, and
        ``module.load_state_dict(...)`` reaches every stage (without this, its remote layers' entries are their
        placeholders: meta tensors, silently)."""
        ref = weakref.ref(self)  # (no reference from the user's module keeps a freed body and its stages)
        module.register_state_dict_post_hook(_through(ref, _remote_state))
        module.register_load_state_dict_pre_hook(_through(ref, _load_remote_state))
        module.register_load_state_dict_post_hook(_through(ref, _loaded))

    def _apply(self, fn: Any, recurse: bool = True) -> PipelinedSequential:
        for name, child in self.named_children():
            if self.owner[name] == 0:
                child._apply(fn, recurse)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int | slice) -> nn.Module:
        """The layer at ``index`` (or an ``nn.Sequential`` of a slice), as in the original ``nn.Sequential``.
        A remote stage's layer is its placeholder: its weights are in :meth:`state_dict`."""
        items = list(self._modules.items())
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(items[index]))
        try:
            return items[index][1]  # type: ignore[return-value]
        except IndexError:
            raise IndexError(f"index {index} is out of range for a body of {len(items)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def stage_of(self, name: str) -> int:
        """The pipeline process holding the LightningModule's parameter ``name`` (``"<name>.3.weight"``;
        anything outside this body: process 0, the driver)."""
        prefix = self.name + "."
        return self.owner.get(name[len(prefix):].split(".", 1)[0], 0) if name.startswith(prefix) else 0

    def local_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """Stage 0's parameters, by their names in this module."""
        for name, child in self.named_children():
            if self.owner[name] == 0:
                for pname, p in child.named_parameters():
                    yield f"{name}.{pname}", p

    def _prepare(self, input: Any, target: Any = None) -> None:
        """What precedes every run of the pipeline: refusals (inputs that differ between the tensor ranks of a
        split stage 0 among them), the driver's settings sent on, a warning."""
        if torch.jit.is_tracing():
            raise RuntimeError(
                "the pipelined body cannot be traced (torch.jit.trace, or TensorBoardLogger(log_graph=True), which "
                "traces the model at the start of fit): its layers run in other processes, outside the trace. Use "
                "TensorBoardLogger(log_graph=False), or trace the plain model without PipeStrategy")
        self.check_placeholders()
        batch = Batch.of(input, "input of the pipeline")
        self._runs += 1
        if self.tensor_group is not None:
            tensors = [t for t in (*batch.tensors, *([target] if isinstance(target, Tensor) else []))
                       if isinstance(t, Tensor)]
            check_same_inputs(self.tensor_group, tensors, self._runs)
        if self.before_forward is not None:
            self.before_forward()
        size = batch.tensors[0].size(0) if self.chunks > 1 else self.chunks
        if size < self.chunks and not self._warned_small:
            self._warned_small = True
            rank_zero_warn(f"a batch of {size} samples was split into {size} micro-batches, fewer than "
                           f"microbatches={self.chunks}: stages overlap less. Use batches of at least "
                           f"{self.chunks} samples (or drop_last=True), or fewer micro-batches")

    def _tie(self, out: Any) -> None:
        """Check, when the gradient of ``out`` arrives, that the backward may run (``on_backward``)."""
        tied = next((t for t in (out if isinstance(out, tuple) else (out,))
                     if isinstance(t, Tensor) and t.requires_grad), None)
        if tied is not None and self.on_backward is not None:
            check, sync = self.on_backward, self.tied_sync
            tied.register_hook(lambda grad: (check(), sync is not None and sync.pending(), grad)[-1])

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Run ``input`` through every stage of the pipeline."""
        if self.schedule != "gpipe" and torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                f"PipeStrategy(schedule={self.schedule!r}) runs backwards between forwards, so the loss must be "
                "computed on the last stage: in training_step, call lightning_pipe.loss_on_last_stage(self."
                f"{self.name}, input, target, loss_fn) instead of self.{self.name}(input), or use schedule='gpipe'")
        self._prepare(input)
        out = run_pipeline(self.pipeline, input, chunks=self.chunks, checkpoint=self.checkpoint,
                           training=self.training, parameters=self.parameters())
        self._tie(out)
        return out

    def pipeline_loss(self, input: TensorOrTensors, target: Any, loss_fn: LossFn, *,
                      reduction: str = "mean", extras: Mapping[str, str] | None = None) -> Any:
        """``loss_fn(self(input), target)`` with the loss computed on the last stage, micro-batch by micro-batch,
        in this body's schedule (see :func:`lightning_pipe.loss_on_last_stage`). ``loss_fn`` must pickle where the
        last stage is in another process: refused here otherwise, before anything is sent."""
        if self.processes > 1:
            check_sendable(loss_fn, self.processes)
        self._prepare(input, target)
        out = pipeline_loss(self.pipeline, input, target, loss_fn, chunks=self.chunks, checkpoint=self.checkpoint,
                            training=self.training, parameters=self.parameters(), schedule=self.schedule,
                            reduction=reduction, loss_scale=self.loss_scale(), extras=extras)
        self._tie(out["loss"] if isinstance(out, dict) else out)
        return out

    def extra_repr(self) -> str:
        return (f"stages={len(self.balance)}, processes={self.processes}, chunks={self.chunks}, "
                f"checkpoint={self.checkpoint!r}, schedule={self.schedule!r}")


def _to_meta(layer: nn.Module, keep: set[int]) -> None:
    """Move ``layer`` to the meta device in place, but for the parameters in ``keep`` (by id), left as they are."""
    kept = [(m, n, p) for m in layer.modules() for n, p in m._parameters.items() if p is not None and id(p) in keep]
    for m, n, _ in kept:
        m._parameters[n] = None
    layer.to("meta")
    for m, n, p in kept:
        m._parameters[n] = p


def _remote_state(module: PipelinedSequential, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """``state_dict`` hook: the remote layers' entries as their stages hold them now (on CPU), not their
    placeholders, so that ``model.state_dict()`` on the driver is the whole model's (never without a change
    made here in place, which the stages do not have). A parameter tied across processes is one tensor under
    each of its names, as in the plain model's ``state_dict``: its first owner's."""
    module.check_placeholders()
    if module.hosts is None or module.local_only:
        return
    if module.sharded:
        raise RuntimeError(
            "model.state_dict() cannot put the whole model together in one process when its stages are split over "
            "tensor ranks (tensor_parallel_size) or sharded over their replicas (sharding_strategy): every process "
            "holds a part. Save with fabric.save(path, {'model': model, 'optimizer': optimizer, ...}) or "
            "trainer.save_checkpoint(path), called in every process, which gather the parts into one file of the "
            "plain model's state (fabric.load, or the plain model's load_state_dict, read it back)")
    cut = len(module.name) + 1
    for part in module.hosts.call("state_dict"):
        for name, value in part.items():
            key = prefix + name[cut:]
            if key in state:
                state[key] = value
    for tied in module.tied:
        first = prefix + tied.names[0][cut:]
        for name in tied.names[1:]:
            if first in state and prefix + name[cut:] in state:
                state[prefix + name[cut:]] = state[first]


def _through(ref: Callable[[], PipelinedSequential | None], hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` of a body, registered on another module (:meth:`PipelinedSequential.speak_for`): called with the
    body in place of that module, while the body lives."""

    def call(_module: nn.Module, *args: Any) -> Any:
        body = ref()
        return hook(body, *args) if body is not None else None

    return call


def _load_remote_state(module: PipelinedSequential, state: dict[str, Any], prefix: str, metadata: Any,
                       strict: bool, missing: list[str], unexpected: list[str], errors: list[str]) -> None:
    """``load_state_dict`` hook: the remote layers' entries go to their stages; their placeholders here are
    given placeholders of the entries (``state`` is load_state_dict's own copy), which still have their
    shapes checked and count as loaded."""
    for name, target in [*module.named_parameters(), *module.named_buffers()]:
        key = prefix + name
        if fsdp.is_dtensor(target) and isinstance(state.get(key), Tensor) and not fsdp.is_dtensor(state[key]):
            state[key] = fsdp.like(target, state[key])  # a stage sharded over the replicas: its shard here
    parts: dict[int, dict[str, Any]] = {}
    empty: list[str] = []
    real = {f"{child}.{name}" for child, layer in module.named_children() if module.owner[child] != 0
            for name, t in layer.named_parameters(remove_duplicate=False) if not t.is_meta}  # tied to a local one
    for key, value in list(state.items()):
        local = key[len(prefix):] if key.startswith(prefix) else None
        j = module.owner.get(local.split(".", 1)[0], 0) if local is not None else 0
        if j != 0 and isinstance(value, Tensor) and value.is_meta:
            empty.append(key)
        elif j != 0:
            parts.setdefault(j, {})[f"{module.name}.{local}"] = value
            if isinstance(value, Tensor) and module.hosts is not None and local not in real:
                state[key] = value.to("meta")  # (a parameter tied to a local layer loads here too)
    module._loading = ({name[len(module.name) + 1:] for part in parts.values() for name in part},
                       {name: version(t) for name, t in module._placeholders})
    if empty:
        errors.append(f"{listed(empty)} hold no data (meta tensors): copies of this process's placeholders for the "
                      "layers of remote stages, whose weights are in those stages? Take a state with every "
                      "stage's weights from model.state_dict(), which fetches them")
    if module.hosts is None:
        return
    # Not strict in the stage: this hook is always called with strict=True (torch filters by the caller's strict
    # afterwards), and the remote layers' placeholders here already count their missing and unexpected entries.
    for j, part in parts.items():
        try:
            module.hosts.call_stage(j, "load_state_dict", part, False)
        except Exception as exc:  # noqa: BLE001 - reported the way load_state_dict reports a layer's error
            errors.append(f"stage {j} could not load its layers' entries: {exc}")


def _loaded(module: PipelinedSequential, incompatible: Any) -> None:
    """``load_state_dict`` hook: the loaded placeholders' own copies are no change (their stages loaded the
    entries); a placeholder changed before and not loaded still counts as changed."""
    module._record_placeholders(module._loading)
    module._loading = None
