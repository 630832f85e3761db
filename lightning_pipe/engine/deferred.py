"""Modules built on the meta device, then materialised piece by piece, each tensor as the plain build made it.

Under :func:`deferred_init`, building a model allocates nothing: every tensor is created on the ``meta``
device, and what the build did to each is recorded, op by op (``torch.empty``, ``uniform_``, ``copy_`` of a
constant, ``.half()``...). Random ops take the random numbers they would have taken on CPU: each is run once
on a temporary CPU tensor of its size, which advances the generator exactly as the plain build would, and the
generator's state before it is recorded. :meth:`Recording.program` then cuts, for any set of the model's
tensors (one pipeline stage's layers), the ops they depend on; :meth:`Program.run` replays those alone,
random ops from their recorded states, in any process: each stage materialises its own layers, bit for bit
the values the plain model gets under the same seed, and never the others::

    with deferred_init():                      every tensor on meta; ops recorded
        model = Model()                        (random ops advance the CPU generator as usual)
    program = recording_of(stage).program(named_tensors(stage))      ops of this stage's tensors only
    materialize(stage, program.run())          real tensors, this stage's alone

The initialisers of ``torch.nn.init`` that do nothing on the meta device (``trunc_normal_``, whose
rejection sampling draws as many numbers as its values ask, ``orthogonal_``, ``dirac_``, ``sparse_``) are
recorded as whole calls while recording, and run for real on a temporary tensor then, and on the stage's
tensor at replay. A tensor that nothing initialised (``torch.empty`` alone: an initialiser that skipped the
meta device, imported under another name) is refused by name rather than materialised with garbage.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.engine.materialize import (
    ORIGINALS,
    SKIPPING_INITIALISERS,
    MetaDevice,
    Program,
    Ref,
    Step,
    materialize,
    named_tensors,
    needed_steps,
    ref_of,
    storage_key,
)

__all__ = ["Program", "Recording", "deferred_init", "is_deferred", "materialize", "named_tensors", "recording_of"]

_FACTORIES_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, Tensor.new_tensor}
_EMPTY = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
_LOCK = threading.Lock()
_REGISTRY: dict[int, Recording] = {}  # storage key -> the recording that made it (until released)


class Recording:
    """What one :func:`deferred_init` block did to the tensors it created (see the module's docstring)."""

    def __init__(self, skip_initialisers: bool = False) -> None:
        self.steps: list[Step] = []
        self.skip_initialisers = skip_initialisers
        self._storages: dict[int, Any] = {}  # keeps each meta storage alive, so that its key stays unique

    # ------------------------------------------------------------------ recording
    def _keep(self, t: Tensor) -> Ref:
        ref = ref_of(t)
        if ref.storage not in self._storages:
            self._storages[ref.storage] = t.untyped_storage()
            with _LOCK:
                _REGISTRY[ref.storage] = self
        return ref

    def _encode(self, value: Any, generators: dict[int, Tensor]) -> Any:
        def encode(x: Any) -> Any:
            if isinstance(x, Tensor) and x.is_meta:
                return self._keep(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return MetaDevice()
            if isinstance(x, torch.Generator):
                generators[id(x)] = x.get_state()
                return ("generator", id(x))
            return x
        return tree_map(encode, value)

    def record(self, kind: str, target: str, args: Any, kwargs: dict[str, Any], outputs: Any,
               writes: list[Tensor], random: bool) -> None:
        """Add one step (called by the recording modes)."""
        generators: dict[int, Tensor] = {}
        rng = torch.get_rng_state() if random else None
        encoded_args, encoded_kwargs = self._encode((args, kwargs), generators)
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor) and x.is_meta]
        outs = [self._keep(x) if isinstance(x, Tensor) and x.is_meta else None for x in tree_flatten(outputs)[0]]
        written = [storage_key(x) for x in writes] + [o.storage for o in outs if o is not None]
        self.steps.append(Step(kind, target, encoded_args, encoded_kwargs, outs,
                               frozenset(storage_key(x) for x in inputs), frozenset(written), rng, generators))

    # ------------------------------------------------------------------ slicing
    def program(self, tensors: Mapping[str, Tensor]) -> Program:
        """The steps that ``tensors`` (by name; meta tensors this recording made) depend on, as a
        :class:`Program` that materialises them anywhere. Raises if one of them was created and never
        initialised (only ``torch.empty``), unless initialisers were skipped on purpose (``empty_init``)."""
        targets = {}
        for name, t in tensors.items():
            if not t.is_meta or storage_key(t) not in self._storages:
                raise ValueError(f"{name} was not created under this deferred_init (device: {t.device})")
            targets[name] = ref_of(t)
        kept = needed_steps(self.steps, {ref.storage for ref in targets.values()})
        if not self.skip_initialisers:
            written = {s for step in kept if step.target.split(".")[0] not in _EMPTY for s in step.writes}
            blank = [name for name, ref in targets.items() if ref.storage not in written]
            if blank:
                raise RuntimeError(
                    f"{', '.join(blank[:5])}{' ...' if len(blank) > 5 else ''} were created and never initialised "
                    "while the model was built on the meta device (torch.empty alone), so they have no value to "
                    "materialise. An initialiser that does nothing on meta tensors ran (one of torch.nn.init's "
                    f"{', '.join(SKIPPING_INITIALISERS)} imported by name before the build, or code that skips meta "
                    "tensors): call it as torch.nn.init.<name>(...), or build the model without deferred "
                    "initialisation")
        return Program(kept, targets)

    @contextlib.contextmanager
    def resume(self) -> Iterator[Recording]:
        """Record into this recording again (modules converted after the build: their new tensors are
        recorded like the build's)."""
        with _recording(self):
            yield self

    def release(self) -> None:
        """Forget this recording (its meta tensors can no longer be materialised)."""
        with _LOCK:
            for key in self._storages:
                if _REGISTRY.get(key) is self:
                    del _REGISTRY[key]
        self._storages.clear()
        self.steps.clear()


def _ghost(x: Any) -> Any:
    """A real CPU stand-in for a meta tensor (same size and dtype), so that a random op draws its numbers."""
    if isinstance(x, Tensor) and x.is_meta:
        return torch.zeros(x.size(), dtype=x.dtype, device="cpu")
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


class _Dispatch(TorchDispatchMode):
    """Records every aten op that touches a meta tensor; runs random ones once on CPU stand-ins."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs, out))[0]
        if not any(isinstance(x, Tensor) and x.is_meta for x in leaves):
            return out  # real tensors: it ran for real (and drew its random numbers, if any)
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view: replay rebuilds every view from its storage, size, stride and offset
        random = torch.Tag.nondeterministic_seeded in func.tags
        mutated = [a for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, Tensor) and a.is_meta and spec.alias_info is not None and spec.alias_info.is_write]
        mutated += [v for k, v in kwargs.items() if isinstance(v, Tensor) and v.is_meta and
                    any(s.name == k and s.alias_info is not None and s.alias_info.is_write
                        for s in func._schema.arguments)]
        self.recording.record("op", f"{func._schema.name}.{func._overloadname}", args, kwargs, out, mutated, random)
        if random:
            func(*tree_map(_ghost, args), **tree_map(_ghost, kwargs))  # the same draws, on CPU
        return out


class _Functions(TorchFunctionMode):
    """Factories make meta tensors unless told a device; tensors made from data (``torch.tensor(...)``) keep
    their data: made on CPU, recorded as a constant."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES_FROM_DATA:
            if func in _device_constructors() and kwargs.get("device") is None:
                kwargs["device"] = "meta"  # as under torch.device("meta"), which libraries read as "do not init"
            return func(*args, **kwargs)
        device = kwargs.get("device")
        if device is None:
            device = args[0].device if func is Tensor.new_tensor else "meta"
        if torch.device(device).type != "meta":
            return func(*args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs["device"] = "cpu"
        if func is Tensor.new_tensor:
            source, data = args[0], args[1]
            kwargs.setdefault("dtype", source.dtype)
            value = torch.tensor(data, **kwargs)
        else:
            value = func(*args, **kwargs)
        meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
        self.recording.record("const", "const", (value,), {}, meta, [meta], False)
        return meta.requires_grad_(requires_grad)


def _recorded_initialiser(name: str) -> Callable[..., Any]:
    original = ORIGINALS[name]

    def initialiser(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        recording = _ACTIVE.recording
        if recording is None or not isinstance(tensor, Tensor) or not tensor.is_meta:
            return original(tensor, *args, **kwargs)
        return _record_call(recording, name, tensor, args, kwargs)

    initialiser.__name__ = initialiser.__qualname__ = name
    initialiser.__doc__ = original.__doc__
    return initialiser


def _record_call(recording: Recording, name: str, tensor: Tensor, args: Any, kwargs: dict[str, Any]) -> Tensor:
    """Record ``torch.nn.init.<name>(tensor, ...)`` as a whole call, and run it once on a CPU stand-in: it
    draws the random numbers it would draw (as many as its values ask, for rejection sampling)."""
    if recording.skip_initialisers:
        return tensor
    recording.record("call", f"torch.nn.init.{name}", (tensor, *args), kwargs, None, [tensor], True)
    ORIGINALS[name](_ghost(tensor), *args, **kwargs)
    return tensor


class _Active(threading.local):
    recording: Recording | None = None


_ACTIVE = _Active()


class _SkipInitialisers(TorchFunctionMode):
    """``torch.nn.init`` functions do nothing (``empty_init=True``: weights loaded later), as Lightning's
    ``_EmptyInit`` has them; the random numbers they would draw are not drawn."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def deferred_init(skip_initialisers: bool = False) -> Iterator[Recording]:
    """Build modules inside on the meta device, recording how each tensor was made (see the module's
    docstring); yields the :class:`Recording`. ``skip_initialisers``: ``torch.nn.init`` functions do nothing
    (for weights that will be loaded), as under Lightning's ``init_module(empty_init=True)``.

    ::

        with deferred_init():
            model = Model()            # no memory: every parameter on meta
    """
    with _recording(Recording(skip_initialisers)) as recording:
        yield recording


@contextlib.contextmanager
def _recording(recording: Recording) -> Iterator[Recording]:
    previous = _ACTIVE.recording
    _ACTIVE.recording = recording
    saved = {name: getattr(nn.init, name) for name in SKIPPING_INITIALISERS}
    saved_private = nn.init._no_grad_trunc_normal_
    for name in SKIPPING_INITIALISERS:
        setattr(nn.init, name, _recorded_initialiser(name))
    nn.init._no_grad_trunc_normal_ = _recorded_private_trunc_normal  # type: ignore[assignment]
    try:
        with contextlib.ExitStack() as stack:
            for patch in _LIBRARY_PATCHES:
                stack.enter_context(patch())
            if recording.skip_initialisers:
                stack.enter_context(_SkipInitialisers())
            stack.enter_context(_Functions(recording))
            stack.enter_context(_Dispatch(recording))
            yield recording
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
        nn.init._no_grad_trunc_normal_ = saved_private  # type: ignore[assignment]
        _ACTIVE.recording = previous


@contextlib.contextmanager
def _transformers_initialises_on_meta() -> Iterator[None]:
    """Hugging Face models skip their weight initialisation when built on the meta device: under a recording
    they run it, so that its draws are recorded as a plain build makes them (nothing is imported here: only a
    ``transformers`` already loaded is changed, for the recording's time)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    model = getattr(modeling, "PreTrainedModel", None)
    if model is None or not hasattr(model, "initialize_weights"):
        yield
        return
    original = model.init_weights

    def init_weights(self: Any) -> None:
        self.initialize_weights()
        self.tie_weights(recompute_mapping=False)

    model.init_weights = init_weights
    try:
        yield
    finally:
        model.init_weights = original


#: Context managers entered while recording, for libraries that build differently on the meta device.
_LIBRARY_PATCHES: list[Callable[[], contextlib.AbstractContextManager[None]]] = [_transformers_initialises_on_meta]


_ORIGINAL_PRIVATE_TRUNC = nn.init._no_grad_trunc_normal_


def _recorded_private_trunc_normal(tensor: Tensor, mean: float, std: float, a: float, b: float,
                                   generator: torch.Generator | None = None) -> Tensor:
    # trunc_normal_ imported by name before the build still calls this module global: a meta tensor is recorded.
    recording = _ACTIVE.recording
    if recording is None or not tensor.is_meta:
        return _ORIGINAL_PRIVATE_TRUNC(tensor, mean, std, a, b, generator=generator)
    return _record_call(recording, "trunc_normal_", tensor, (),
                        {"mean": mean, "std": std, "a": a, "b": b, "generator": generator})


def recording_of(tensor: Tensor) -> Recording | None:
    """The live :class:`Recording` that made ``tensor`` (a meta tensor built under :func:`deferred_init`), or
    None."""
    if not isinstance(tensor, Tensor) or not tensor.is_meta:
        return None
    with _LOCK:
        return _REGISTRY.get(storage_key(tensor))


def is_deferred(module: nn.Module) -> bool:
    """Whether ``module`` holds meta tensors that a live :func:`deferred_init` recording can materialise."""
    return any(recording_of(t) is not None for _, t in named_tensors(module).items())

