"""The driver's stand-in for the sequential body: stage 0's layers for real, the others as placeholders.

After partitioning, the LightningModule's ``sequential_module`` is a :class:`PipelinedSequential`. It keeps
every layer under its original name, so ``named_parameters()`` (and parameter groups built from it),
``ModelSummary`` and ``state_dict`` keys are those of the unpipelined model. Layers of remote stages stay as
parameter-shaped placeholders on the ``meta`` device, holding no memory; moving or casting the module
(``.to()``, ``.cuda()``, ``.half()``) touches only the real layers. Its forward runs the whole pipeline.

A placeholder never has a gradient (its gradient is in its stage's process): the functions that clip or
measure every parameter's ``.grad`` would silently cover stage 0 alone, so a placeholder refuses to be read by
them, saying what covers every stage instead; ``zero_grad()`` of a module holding placeholders (the
LightningModule: Lightning calls it as fit starts and before validation) zeroes them in their stages. Nor can
it be changed in place (an initialiser or a hook editing weights): the change would never reach its stage, so
the next forward or ``state_dict`` raises.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_pipe.engine.microbatch import Batch, TensorOrTensors
from lightning_pipe.engine.pipe import run_pipeline

__all__: list[str] = []

_CLIP_NORM = ("self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm') or "
              "Trainer(gradient_clip_val=...), which clip by the norm over every stage")
_CLIP_VALUE = ("self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='value') or "
               "Trainer(gradient_clip_val=..., gradient_clip_algorithm='value'), which clip every stage")
_NORMS = "lightning_pipe.grad_norm(module, norm_type), which covers every stage"
#: (module, function) reading every parameter's ``.grad`` to clip or measure them -> what to use instead.
STAGE0_ONLY = {
    ("torch.nn.utils.clip_grad", "clip_grad_norm_"): _CLIP_NORM,
    ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_"): _CLIP_NORM,
    ("torch.nn.utils.clip_grad", "clip_grad_value_"): _CLIP_VALUE,
    ("pytorch_lightning.utilities.grads", "grad_norm"): _NORMS,
    ("lightning.pytorch.utilities.grads", "grad_norm"): _NORMS,
}
_GRAD = torch.Tensor.grad


class Placeholder(nn.Parameter):
    """A remote stage's parameter as the driver holds it: name, shape, dtype and ``requires_grad``, on the
    meta device, and never a gradient. Read by a function of :data:`STAGE0_ONLY`, its ``.grad`` raises an
    error naming the parameter, its stage and what to use instead; anywhere else it is ``None``."""

    param_name = "a parameter of a remote stage"
    stage = -1

    def __deepcopy__(self, memo: dict[int, Any]) -> Placeholder:
        if id(self) not in memo:
            copied = Placeholder(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
            copied.param_name, copied.stage = self.param_name, self.stage
            memo[id(self)] = copied
        return memo[id(self)]

    @property  # type: ignore[override]
    def grad(self) -> Tensor | None:
        _refuse_stage0_only(self)
        return _GRAD.__get__(self)

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)


def _refuse_stage0_only(p: Placeholder) -> None:
    try:
        frame = sys._getframe(2)  # whoever read .grad (0: this function, 1: the property)
    except ValueError:  # read from outside any Python function
        return
    if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _ZERO_GRAD:
        _zero_remote(p, frame)
        return
    if not p.requires_grad:
        return  # frozen: no gradient in its stage either, so stage 0's answer is the whole model's
    for _ in range(2):  # that function, or the one around its comprehension
        if frame is None:
            return
        key = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        if key in STAGE0_ONLY:
            raise RuntimeError(
                f"{key[1].lstrip('_')} read the gradient of {p.param_name!r}, which lives in the process of "
                f"pipeline stage {p.stage}: the driver holds the layers of remote stages as placeholders without "
                f"gradients, so it would silently cover stage 0 alone. Use {STAGE0_ONLY[key]}")
        frame = frame.f_back


#: ``nn.Module.zero_grad``, which reads every parameter's ``.grad``: for placeholders, it reaches their stages.
_ZERO_GRAD = ("torch.nn.modules.module", "zero_grad")
_BODIES: weakref.WeakSet[PipelinedSequential] = weakref.WeakSet()  # every split body (not copies of one)
_zeroing = threading.local()  # the zero_grad call in progress: its module and how many placeholders it has left


def _zero_remote(p: Placeholder, frame: Any) -> None:
    """``module.zero_grad()`` is reading ``p.grad``. On the first placeholder it reads, the gradients of every
    placeholder of ``module`` (the LightningModule, the body or a layer) are zeroed in their stages, one call
    per stage; the module's other placeholders, read next by the same call, are then passed over."""
    module = frame.f_locals.get("self")
    state = getattr(_zeroing, "state", None)
    if state is not None and state[0] == id(module) and state[1] > 0:
        _zeroing.state = (state[0], state[1] - 1)
        return
    if not isinstance(module, nn.Module):
        return
    placeholders = {id(q) for q in module.parameters() if isinstance(q, Placeholder)}
    _zeroing.state = (id(module), len(placeholders) - 1)
    set_to_none = frame.f_locals.get("set_to_none", True)
    for body in list(_BODIES):
        names: dict[int, list[str]] = {}
        for q in body.parameters():
            if id(q) in placeholders:
                names.setdefault(q.stage, []).append(q.param_name)  # type: ignore[attr-defined]
        if body.hosts is not None:
            for j, stage_names in names.items():
                body.hosts.call_stage(j, "zero_named", stage_names, set_to_none)


def _wrap_placeholders(layer: nn.Module, prefix: str, stage: int) -> None:
    """Make the (meta) parameters of ``layer`` :class:`Placeholder` s named ``prefix`` + their name, keeping
    those that are already and any sharing between its modules."""
    made: dict[int, Placeholder] = {}
    for module_name, module in layer.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, Placeholder) or not p.is_meta or p.is_inference():
                continue
            if id(p) not in made:
                made[id(p)] = Placeholder(p.data, p.requires_grad)
                made[id(p)].param_name = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
                made[id(p)].stage = stage
            module._parameters[name] = made[id(p)]


def _listed(names: list[str], limit: int = 6) -> str:
    """``names`` for an error message: the first ``limit``, then how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _version(t: Tensor) -> int:
    return -1 if t.is_inference() else t._version  # an inference tensor has no version counter (nor changes)


class PipelinedSequential(nn.Module):
    """An ``nn.Sequential`` body split into stages: forward goes through ``pipeline``.

    ``owner[name]`` is the stage of each layer (by child name); layers of stage 0 are real, the others
    placeholders on the meta device. ``hosts`` (the handle on the remote stages) and ``balance`` stay with
    the module, so that a later Trainer's strategy takes over the same pipeline.
    """

    def __init__(self, body: nn.Sequential, owner: dict[str, int], pipeline: Any, *, chunks: int,
                 checkpoint: str, hosts: Any = None, balance: list[int] | None = None,
                 name: str = "sequential_module") -> None:
        super().__init__()
        # The remote stages name their state as the LightningModule does: "<name>.3.weight".
        self.name = name
        for child, layer in body.named_children():
            if owner[child] != 0:
                layer = layer.to("meta")
                _wrap_placeholders(layer, f"{name}.{child}.", owner[child])
            self.add_module(child, layer)
        self.owner = owner
        self.pipeline = pipeline
        self.hosts = hosts
        self.balance = balance if balance is not None else [list(owner.values()).count(j)
                                                            for j in range(max(owner.values()) + 1)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.before_forward: Callable[[], None] | None = None
        self.on_backward: Callable[[], None] | None = None  # called when the output's gradient arrives
        self._warned_small = False
        self.local_only = False  # True: state_dict() leaves remote layers' entries as placeholders
        # Module-level functions, not bound methods: no reference cycle keeps a freed body (and its stages).
        self.register_state_dict_post_hook(_remote_state)
        self.register_load_state_dict_pre_hook(_load_remote_state)
        self.register_load_state_dict_post_hook(_loaded)
        self._placeholders: list[tuple[str, Tensor]] = []
        self._versions: list[int] = []
        self._loading: tuple[set[str], dict[str, int]] | None = None
        self._record_placeholders()
        _BODIES.add(self)

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
        for child, layer in self.named_children():
            if self.owner[child] != 0:
                _wrap_placeholders(layer, f"{self.name}.{child}.", self.owner[child])
        recorded = dict(zip((name for name, _ in self._placeholders), self._versions))
        loaded, before_load = loading if loading is not None else (set(), {})
        self._placeholders = [(f"{child}.{name}", t) for child, layer in self.named_children()
                              if self.owner[child] != 0
                              for name, t in [*layer.named_parameters(), *layer.named_buffers()]]
        self._versions = []
        for name, t in self._placeholders:
            now = _version(t)
            fresh = loading is None or name in loaded or name not in recorded or now != before_load.get(name)
            self._versions.append(now if fresh else recorded[name])

    def check_placeholders(self) -> None:
        """Raise if a remote layer's placeholder was changed in place here (an initialiser, or a hook or
        callback editing weights or buffers): the change never reached the stage that holds the layer."""
        versions = [_version(t) for _, t in self._placeholders]
        if versions == self._versions:
            return
        changed = [name for (name, _), v, was in zip(self._placeholders, versions, self._versions) if v != was]
        stages = sorted({self.owner[name.split(".", 1)[0]] for name in changed})
        shown = _listed([f"{self.name}.{name}" for name in changed])
        raise RuntimeError(
            f"{shown} changed in place in this process, where the layers of remote stages "
            f"({', '.join(map(str, stages))}) are placeholders without data: the change did not reach the stages "
            "that hold them, and training would go on without it. Change their weights through "
            "model.load_state_dict(...), which reaches every stage, or in the layer's own forward (a change "
            "through .data is not seen here, nor anywhere)")

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
        """The stage holding the LightningModule's parameter ``name`` (``"<name>.3.weight"``; anything outside
        this body: stage 0)."""
        prefix = self.name + "."
        return self.owner.get(name[len(prefix):].split(".", 1)[0], 0) if name.startswith(prefix) else 0

    def local_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """Stage 0's parameters, by their names in this module."""
        for name, child in self.named_children():
            if self.owner[name] == 0:
                for pname, p in child.named_parameters():
                    yield f"{name}.{pname}", p

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Run ``input`` through every stage of the pipeline."""
        if torch.jit.is_tracing():
            raise RuntimeError(
                "the pipelined body cannot be traced (torch.jit.trace, or TensorBoardLogger(log_graph=True), which "
                "traces the model at the start of fit): its layers run in other processes, outside the trace. Use "
                "TensorBoardLogger(log_graph=False), or trace the plain model without PipeStrategy")
        self.check_placeholders()
        if self.before_forward is not None:
            self.before_forward()
        size = Batch.of(input, "input of the pipeline").tensors[0].size(0) if self.chunks > 1 else self.chunks
        if size < self.chunks and not self._warned_small:
            self._warned_small = True
            rank_zero_warn(f"a batch of {size} samples was split into {size} micro-batches, fewer than "
                           f"microbatches={self.chunks}: stages overlap less. Use batches of at least "
                           f"{self.chunks} samples (or drop_last=True), or fewer micro-batches")
        out = run_pipeline(self.pipeline, input, chunks=self.chunks, checkpoint=self.checkpoint,
                           training=self.training, parameters=self.parameters())
        tied = next((t for t in (out if isinstance(out, tuple) else (out,))
                     if isinstance(t, Tensor) and t.requires_grad), None)
        if tied is not None and self.on_backward is not None:
            check = self.on_backward
            tied.register_hook(lambda grad: (check(), grad)[1])
        return out

    def extra_repr(self) -> str:
        stages = max(self.owner.values()) + 1
        return f"stages={stages}, chunks={self.chunks}, checkpoint={self.checkpoint!r}"


def _remote_state(module: PipelinedSequential, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """``state_dict`` hook: the remote layers' entries as their stages hold them now (on CPU), not their
    placeholders, so that ``model.state_dict()`` on the driver is the whole model's (never without a change
    made here in place, which the stages do not have)."""
    module.check_placeholders()
    if module.hosts is None or module.local_only:
        return
    cut = len(module.name) + 1
    for part in module.hosts.call("state_dict"):
        for name, value in part.items():
            key = prefix + name[cut:]
            if key in state:
                state[key] = value


def _load_remote_state(module: PipelinedSequential, state: dict[str, Any], prefix: str, metadata: Any,
                       strict: bool, missing: list[str], unexpected: list[str], errors: list[str]) -> None:
    """``load_state_dict`` hook: the remote layers' entries go to their stages; their placeholders here are
    given placeholders of the entries (``state`` is load_state_dict's own copy), which still have their
    shapes checked and count as loaded."""
    parts: dict[int, dict[str, Any]] = {}
    empty: list[str] = []
    for key, value in list(state.items()):
        local = key[len(prefix):] if key.startswith(prefix) else None
        j = module.owner.get(local.split(".", 1)[0], 0) if local is not None else 0
        if j != 0 and isinstance(value, Tensor) and value.is_meta:
            empty.append(key)
        elif j != 0:
            parts.setdefault(j, {})[f"{module.name}.{local}"] = value
            if isinstance(value, Tensor) and module.hosts is not None:
                state[key] = value.to("meta")
    module._loading = ({name[len(module.name) + 1:] for part in parts.values() for name in part},
                       {name: _version(t) for name, t in module._placeholders})
    if empty:
        errors.append(f"{_listed(empty)} hold no data (meta tensors): copies of this process's placeholders for the "
                      "layers of remote stages, whose weights are in those stages? Take a state with every "
                      "stage's weights from model.state_dict(), which fetches them")
    if module.hosts is None:
        return
    for j, part in parts.items():
        try:
            module.hosts.call_stage(j, "load_state_dict", part, strict)
        except Exception as exc:  # noqa: BLE001 - reported the way load_state_dict reports a layer's error
            errors.append(f"stage {j} could not load its layers' entries: {exc}")


def _loaded(module: PipelinedSequential, incompatible: Any) -> None:
    """``load_state_dict`` hook: the loaded placeholders' own copies are no change (their stages loaded the
    entries); a placeholder changed before and not loaded still counts as changed."""
    module._record_placeholders(module._loading)
    module._loading = None


def is_placeholder(t: Tensor) -> bool:
    """Whether ``t`` stands for a tensor that lives in a remote stage."""
    return t.is_meta
