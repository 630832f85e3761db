"""A recorded build's program: the steps that make some tensors, replayed in any process; tensors put into modules.

:mod:`lightning_pipe.engine.deferred` records a build on the meta device; :meth:`Recording.program
<lightning_pipe.engine.deferred.Recording.program>` cuts out of it a :class:`Program`, the steps some tensors
need, which is plain data (it is pickled to the stage that runs it). :meth:`Program.run` replays them on CPU,
each random op from the generator state recorded before it, and returns the tensors by name;
:func:`materialize` puts them in place of a module's meta tensors (:func:`named_tensors` names them);
:func:`materialize_layers` does it one layer at a time (:meth:`Program.select`), so that a caller can split or send
each layer before the next one exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["Program", "materialize", "materialize_layers", "named_tensors"]

#: ``torch.nn.init`` functions that return at once on a meta tensor: recorded as whole calls, replayed by name.
SKIPPING_INITIALISERS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
ORIGINALS: dict[str, Callable[..., Any]] = {name: getattr(nn.init, name) for name in SKIPPING_INITIALISERS}


@dataclass(frozen=True)
class Ref:
    """A meta tensor as an op saw it: its storage's key and the view it took of it."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class MetaDevice:
    """Stands for ``device="meta"`` in a recorded op's arguments; the replay's device takes its place."""


@dataclass
class Step:
    """One recorded op: ``kind`` is ``"op"`` (an aten op, ``target`` its name), ``"call"`` (a whole
    ``torch.nn.init`` call) or ``"const"`` (data copied in from a real tensor, ``args[0]``)."""

    kind: str
    target: str
    args: Any
    kwargs: dict[str, Any]
    outputs: list[Ref | None]
    reads: frozenset[int]
    writes: frozenset[int]
    rng: Tensor | None = None  # the CPU generator's state before a random op
    generators: dict[int, Tensor] = field(default_factory=dict)  # states of generators passed as arguments


def storage_key(t: Tensor) -> int:
    """Which storage ``t`` views (its identity while the storage lives)."""
    return t.untyped_storage()._cdata


def ref_of(t: Tensor) -> Ref:
    """``t`` as a recorded op sees it."""
    return Ref(storage_key(t), t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def needed_steps(steps: list[Step], storages: set[int]) -> list[Step]:
    """The steps of ``steps`` (in their order) that the values of ``storages`` depend on: each one writing a
    storage needed, and, back from it, those writing what it reads."""
    needed = set(storages)
    kept: list[Step] = []
    for step in reversed(steps):
        if step.writes & needed:
            kept.append(step)
            needed |= step.reads
    kept.reverse()
    return kept


@dataclass
class Program:
    """The recorded steps that some tensors depend on (picklable: it travels to the stage that runs it)."""

    steps: list[Step]
    targets: dict[str, Ref]

    def select(self, names: Iterable[str]) -> Program:
        """The program of some of its targets alone (``names``): the steps they depend on, no other. Run, it
        gives them the values the whole program gives them (each random op replays from its own recorded
        state)."""
        targets = {name: self.targets[name] for name in names}
        return Program(needed_steps(self.steps, {ref.storage for ref in targets.values()}), targets)

    def run(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Replay the steps on CPU, then return each target by name on ``device``. Targets that shared a
        storage (views, tied weights) share it again. The caller's random state is left as it was."""
        real: dict[int, Any] = {}
        last = {}
        for i, step in enumerate(self.steps):
            for s in step.reads | step.writes:
                last[s] = i
        keep = {ref.storage for ref in self.targets.values()}
        cpu_state = torch.get_rng_state()
        try:
            with torch.no_grad(), _no_meta_default():
                for i, step in enumerate(self.steps):
                    _replay(step, real)
                    for s in step.reads | step.writes:
                        if last[s] == i and s not in keep:
                            real.pop(s, None)  # a temporary of the build, done with
        finally:
            torch.set_rng_state(cpu_state)
        out = {}
        moved: dict[int, Any] = {}
        target = torch.device(device)
        for name, ref in self.targets.items():
            if ref.storage not in real:
                raise RuntimeError(f"no recorded op produced {name}: it cannot be materialised")
            storage = real[ref.storage]
            if target.type != "cpu":
                if ref.storage not in moved:
                    whole = _view(storage, torch.uint8, (storage.nbytes(),), (1,), 0)
                    moved[ref.storage] = whole.to(target).untyped_storage()
                storage = moved[ref.storage]
            out[name] = _view(storage, ref.dtype, ref.size, ref.stride, ref.offset)
        return out


def _view(storage: Any, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _resolve(target: str) -> Callable[..., Any]:
    if target.startswith("torch.nn.init."):
        return ORIGINALS[target.rsplit(".", 1)[1]]
    name, overload = target.split(".")[0], target.split(".")[1] if "." in target else "default"
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _replay(step: Step, real: dict[int, Any]) -> None:
    generators = {k: torch.Generator().set_state(state) for k, state in step.generators.items()}

    def decode(x: Any) -> Any:
        if isinstance(x, Ref):
            if x.storage not in real:
                raise RuntimeError(f"a recorded op ({step.target}) reads a tensor no earlier op produced")
            return _view(real[x.storage], x.dtype, x.size, x.stride, x.offset)
        if isinstance(x, MetaDevice):
            return torch.device("cpu")
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "generator":
            return generators[x[1]]
        return x

    def is_leaf(x: Any) -> bool:
        return isinstance(x, tuple) and len(x) == 2 and x[0] == "generator"

    args = tree_map(decode, step.args, is_leaf=is_leaf)
    kwargs = tree_map(decode, step.kwargs, is_leaf=is_leaf)
    if step.rng is not None:
        torch.set_rng_state(step.rng)
    if step.kind == "const":
        (value,) = args
        (ref,) = step.outputs
        assert ref is not None
        if ref.storage in real:  # made by a recorded factory a moment before: the data goes into it
            _view(real[ref.storage], ref.dtype, ref.size, ref.stride, ref.offset).copy_(value)
            return
        out = value.detach().clone()
    else:
        out = _resolve(step.target)(*args, **kwargs)
    for ref, t in zip(step.outputs, tree_flatten(out)[0]):
        if ref is not None and isinstance(t, Tensor):
            real.setdefault(ref.storage, t.untyped_storage())


@contextlib.contextmanager
def _no_meta_default() -> Iterator[None]:
    """Replay allocates on CPU even inside a ``with torch.device("meta")`` block."""
    with torch.device("cpu"):
        yield



def named_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every tensor of ``module`` by name: parameters and buffers (a shared one under every name it has), and
    the meta tensors its modules keep in plain attributes (``example_input_array``, a metric's states and
    defaults), named ``<module>.<attribute>`` or, inside a list or dict, ``<module>.<attribute>#<leaf>``."""
    out: dict[str, Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                out[dot + name] = p
        for name, b in m._buffers.items():
            if b is not None:
                out[dot + name] = b
        for key, value in _attributes(m):
            leaves, _ = tree_flatten(value)
            if isinstance(value, Tensor):
                out[dot + key] = value
            else:
                out.update({f"{dot}{key}#{i}": t for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_meta})
    return out


def _attributes(m: nn.Module) -> list[tuple[str, Any]]:
    """``m``'s plain attributes that are meta tensors or hold some (in lists, tuples, dicts)."""
    found = []
    for key, value in vars(m).items():
        if key in ("_parameters", "_buffers", "_modules") or isinstance(value, nn.Module):
            continue
        if isinstance(value, Tensor):
            if value.is_meta:
                found.append((key, value))
        elif isinstance(value, (list, tuple, dict)) and any(
                isinstance(t, Tensor) and t.is_meta for t in tree_flatten(value)[0]):
            found.append((key, value))
    return found


def materialize(module: nn.Module, values: Mapping[str, Tensor], fill: bool = True) -> list[nn.Module]:
    """Put ``values`` (by name, from :meth:`Program.run`) in place of ``module``'s meta tensors (names as
    :func:`named_tensors` gives them): a parameter stays a parameter (same ``requires_grad``); one shared
    under several names stays shared.

    Then each submodule that got a tensor here and holds no meta tensor any more, and has an
    ``after_materialize()`` method, has it called: a layer may fill itself from elsewhere (a pretrained
    checkpoint's tensors, read by the process that materialises it alone). ``fill=False``: not yet; those
    submodules are returned, for the caller to call once it has placed or split them."""
    done: dict[int, Tensor] = {}

    def real(name: str, t: Tensor, parameter: bool = False) -> Tensor:
        if id(t) not in done:
            value = values[name]
            done[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else \
                value.requires_grad_(t.requires_grad)
        return done[id(t)]

    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in list(m._parameters.items()):
            if p is not None and dot + name in values:
                m._parameters[name] = real(dot + name, p, parameter=True)  # type: ignore[assignment]
        for name, b in list(m._buffers.items()):
            if b is not None and dot + name in values:
                m._buffers[name] = real(dot + name, b)
        for key, value in _attributes(m):
            if isinstance(value, Tensor):
                if dot + key in values:
                    m.__dict__[key] = real(dot + key, value)
                continue
            leaves, spec = tree_flatten(value)
            names = [f"{dot}{key}#{i}" for i in range(len(leaves))]
            if any(n in values for n in names):
                leaves = [real(n, t) if n in values else t for n, t in zip(names, leaves)]
                m.__dict__[key] = tree_unflatten(leaves, spec)
    made = {id(t) for t in done.values()}
    ready = []
    for m in module.modules():
        tensors = [*m.parameters(), *m.buffers()]
        if callable(getattr(m, "after_materialize", None)) and any(id(t) in made for t in tensors) \
                and not any(t.is_meta for t in tensors):
            ready.append(m)
    if fill:
        for m in ready:
            m.after_materialize()
    return ready


def layer_groups(module: nn.Module, program: Program) -> list[tuple[list[str], list[str]]]:
    """``program``'s targets in ``module`` (named as :func:`named_tensors` names them) grouped by ``module``'s
    children, in their order: ``(children, targets)``, one group per child (one without tensors to make too: its
    ``targets`` are empty), except that children sharing a tensor
    (a weight tied between two layers) are one group, at the place of the first. Targets that are ``module``'s own
    (no child's) come first, a group of no child (unless they share a tensor with one)."""
    children = [name for name, m in module._modules.items() if m is not None]
    owner = {name: k for k, name in enumerate(children)}
    by_child: dict[int, list[str]] = {}  # child index (-1: the module's own) -> its targets
    for name in program.targets:
        top, dot, _ = name.partition(".")
        by_child.setdefault(owner.get(top, -1) if dot else -1, []).append(name)
    groups: list[tuple[list[int], list[str], set[int]]] = []  # (child indices, targets, their storages)
    for k in sorted(set(by_child) | set(range(len(children)))):  # every child, with tensors to make or not
        names = by_child.get(k, [])
        storages = {program.targets[n].storage for n in names}
        joined = [g for g in groups if g[2] & storages]
        if not joined:
            groups.append(([k], list(names), storages))
            continue
        first = joined[0]
        for g in joined[1:]:  # this child ties two earlier groups together: one group, at the first's place
            first[0].extend(g[0])
            first[1].extend(g[1])
            first[2].update(g[2])
        groups = [g for g in groups if not any(g is j for j in joined[1:])]
        first[0].append(k)
        first[1].extend(names)
        first[2].update(storages)
    return [([children[k] for k in sorted(indices) if k >= 0], names) for indices, names, _ in groups]


def materialize_layers(module: nn.Module, program: Program, each: Callable[[list[str]], None],
                       device: torch.device | str = "cpu") -> None:
    """Materialise ``module`` (a stage built on the meta device) from ``program`` one layer at a time, calling
    ``each(children)`` once a layer's tensors are real (on ``device``) and before the next layer's are made: what
    ``each`` does with a layer (splits it into shards, sends it) is done while the layers after it hold nothing.
    A layer that fills itself (``after_materialize``: a pretrained checkpoint's entries) does so after ``each``, as
    ``each`` left it (split: it reads its shards alone). Layers that share a tensor are made together
    (:func:`layer_groups`). The values are those ``materialize(module, program.run(device))`` puts in: each random
    op replays from its own recorded state."""
    for children, names in layer_groups(module, program):
        ready = materialize(module, program.select(names).run(device), fill=False) if names else []
        each(children)
        for m in ready:
            m.after_materialize()
