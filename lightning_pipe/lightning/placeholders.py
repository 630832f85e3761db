"""Placeholders: the driver's stand-ins for the parameters and buffers of layers that live in other processes.

A placeholder has its parameter's name, shape, dtype and ``requires_grad``, on the ``meta`` device, and never a
gradient (its gradient is in its stage's process): the functions that clip or measure every parameter's
``.grad`` would silently cover stage 0 alone, so a placeholder refuses to be read by them, saying what covers
every stage instead; ``zero_grad()`` of a module holding placeholders (the LightningModule: Lightning calls it
as fit starts and before validation) zeroes them in their stages.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
from torch import Tensor, nn

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
    stage = -1  # the pipeline stage of its layer
    process = -1  # the pipeline's process that holds that stage

    def __deepcopy__(self, memo: dict[int, Any]) -> Placeholder:
        if id(self) not in memo:
            copied = Placeholder(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
            copied.param_name, copied.stage, copied.process = self.param_name, self.stage, self.process
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
BODIES: weakref.WeakSet[Any] = weakref.WeakSet()  # every split body (not copies of one): their ``hosts``
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
    for body in list(BODIES):
        names: dict[int, list[str]] = {}
        for q in body.parameters():
            if id(q) in placeholders:
                names.setdefault(q.process, []).append(q.param_name)  # type: ignore[attr-defined]
        if body.hosts is not None:
            for j, stage_names in names.items():
                body.hosts.call_stage(j, "zero_named", stage_names, set_to_none)


#: Optimizers found holding no placeholder by :func:`_refuse_unmirrored`: how many parameters each held then (a
#: change rechecks).
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_step_hook: Any = None


def _refuse_unmirrored(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimizer's step: refuse one holding trainable placeholders that no pipeline mirrors on its
    stages (built after the split, never set up by the strategy): its step would update this process's stages
    alone. (Frozen ones have no gradient in their stages either: stepping them does nothing, as on one device.)"""
    if hasattr(optimizer, "_lp_index"):
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    held = [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, Placeholder)]
    remote = [p for p in held if p.requires_grad]
    if remote:
        stages = sorted({p.stage for p in remote})
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters of layers in other pipeline stages "
            f"({listed([p.param_name for p in remote])}: stages {', '.join(map(str, stages))}), which this process "
            "holds as placeholders: its step would update this process's layers alone. Set the optimizer up with "
            "the model, model, optimizer = fabric.setup(model, optimizer) in a Fabric loop (not setup_module), or "
            "return it from configure_optimizers under the Trainer: then every stage steps with it")
    if not held:
        _CHECKED[optimizer] = count


def wrap_placeholders(layer: nn.Module, prefix: str, stage: int, process: int,
                      made: dict[int, tuple[Tensor, Placeholder]] | None = None) -> None:
    """Make the (meta) parameters of ``layer`` :class:`Placeholder` s named ``prefix`` + their name, keeping
    those that are already and any sharing between its modules (and with the layers wrapped before with the
    same ``made``: a parameter tied across layers stays one placeholder, named and placed by its first)."""
    global _step_hook
    if _step_hook is None:  # (once per process: a hook on every optimizer's step)
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_refuse_unmirrored)
    made = {} if made is None else made
    for module_name, module in layer.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, Placeholder) or not p.is_meta or p.is_inference():
                continue
            if id(p) not in made:  # (the original kept alive with it: its id is not reused while ``made`` lives)
                placeholder = Placeholder(p.data, p.requires_grad)
                placeholder.param_name = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
                placeholder.stage, placeholder.process = stage, process
                made[id(p)] = (p, placeholder)
            module._parameters[name] = made[id(p)][1]


def refuse_remote_call(name: str, stage: int, module: nn.Module, args: Any) -> None:
    """A forward pre-hook of a remote stage's layer on the driver (``name``, in stage ``stage``): called on its own
    (a loop over the body's layers, a slice of the body), it would run on placeholders; refused, saying what to do."""
    body = name.rsplit(".", 1)[0]
    raise RuntimeError(
        f"{name} ({type(module).__name__}) is a layer of pipeline stage {stage}, which lives in another process: "
        f"this process holds a placeholder of it on the meta device. Call the body as a whole, {body}(x), which runs "
        f"every stage through the pipeline; calling its layers one by one (for layer in {body}: ...) or a slice of "
        f"it ({body}[:k](x)) would run them here")


def listed(names: list[str], limit: int = 6) -> str:
    """``names`` for an error message: the first ``limit``, then how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def version(t: Tensor) -> int:
    """``t``'s version counter, which every in-place change bumps (-1 for an inference tensor: it has none)."""
    return -1 if t.is_inference() else t._version


def is_placeholder(t: Tensor) -> bool:
    """Whether ``t`` stands for a tensor that lives in a remote stage."""
    return t.is_meta
