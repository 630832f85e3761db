"""Tensor parallel inside a stage: a plan over the body's module names, checked, and applied to each stage.

A plan maps module names of the body to how torch's tensor parallel (``torch.distributed.tensor.parallel``,
DTensor) splits each module over the ``t`` processes of a stage's tensor group::

    {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}           # Linear, Tanh, Linear, Tanh, Linear
    {"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": "rowwise", ...}   # * stands for one name part

Names are the body's own (``dict(body.named_modules())``), ``*`` matching any one dotted part, as in Hugging
Face's ``base_model_tp_plan``; values are torch ``ParallelStyle`` s or Hugging Face's style names (:data:`STYLES`,
with the layouts Hugging Face gives them). A plan may instead be a function ``(stage_module, tp_mesh) -> None``
that parallelizes a stage itself, which nothing here checks. What flows between layers, for the body above at t=2::

    x whole ─ 0 colwise ─► slice of 16 ─ 1 Tanh ─► slice ─ 2 rowwise ─► whole (all-reduce) ─ 3 ─ 4 colwise_rep ─► whole

Checks, each a ``ValueError`` that says what to do: :func:`resolve_plan` refuses a name that matches no module
(listing close ones), an unknown style name, a style on a module it cannot split, two entries for one module and a
dimension that does not divide by ``t``; :func:`check_stage_boundaries` follows the layout from layer to layer of
the body cut into stages and refuses a sharded activation that reaches a layer expecting it whole (or a whole one
reaching a layer expecting a slice), a stage's sharded output handed to a stage whose first layer does not take
slices, and a body whose output stays sharded. :func:`parallelize_stage` applies a stage's part of the plan
(:mod:`~lightning_pipe.transport.parallel.building`: to a stage built on the meta device, layer by layer).
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from functools import partial
from typing import Any, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_pipe.transport.parallel.styles import STYLES, SummedGradients, Whole, describe, style_of

__all__ = ["STYLES", "SummedGradients", "Whole", "check_stage_boundaries", "own_dropout_streams", "parallelize_stage",
           "resolve_plan", "stage_plan"]

Plan = Union[Mapping[str, Union[ParallelStyle, str]], Callable[[nn.Module, Any], None]]  # noqa: UP007 - runtime


def _named(module: nn.Module, names: Mapping[str, str] | None = None) -> dict[str, nn.Module]:
    """Every module under ``module`` (not itself) by its name in the body: its children renamed by ``names``
    (the stage's name of a child: the body's), else as they are (``split_module`` keeps the body's)."""
    found: dict[str, nn.Module] = {}
    for child, layer in module._modules.items():
        if layer is None:
            continue
        top = (names or {}).get(child, child)
        for sub, inner in layer.named_modules():
            found[f"{top}.{sub}" if sub else top] = inner
    return found


def _match(key: str, named: Mapping[str, nn.Module]) -> list[str]:
    if key in named:
        return [key]
    if not any(c in key for c in "*?["):
        return []
    parts = key.split(".")
    return [name for name in named if len(name.split(".")) == len(parts)
            and all(fnmatchcase(a, b) for a, b in zip(name.split("."), parts))]


def _sharded_dim(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """The attribute of ``module`` that ``style`` splits over the tensor ranks, and its size."""
    col, row = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear) and (col or row):
        attribute = "out_features (the weight's dim 0)" if col else "in_features (the weight's dim 1)"
        return attribute, module.out_features if col else module.in_features
    if isinstance(module, nn.Embedding) and (col or row):
        attribute = "embedding_dim (the weight's dim 1)" if col else "num_embeddings (the weight's dim 0)"
        return attribute, module.embedding_dim if col else module.num_embeddings
    return None


def _check(name: str, module: nn.Module, style: ParallelStyle, tp_size: int | None) -> None:
    kind = getattr(style, "plan_kind", None)
    if kind is None and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        kind = (nn.Linear, nn.Embedding)
    if kind is not None and not isinstance(module, kind):
        wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"tensor_parallel_plan gives {name!r} ({type(module).__name__}) the style {describe(style)}, "
                         f"which splits an nn.{wanted} only; name the {wanted} layers inside it, or give it "
                         "'replicate' (or leave it out: every tensor rank then holds it whole)")
    split = _sharded_dim(module, style)
    if tp_size is not None and split is not None and split[1] % tp_size:
        attribute, size = split
        raise ValueError(f"tensor_parallel_plan splits {name!r} ({module}) {describe(style)} over "
                         f"tensor_parallel_size={tp_size}: its {attribute} is {size}, which does not divide by "
                         f"{tp_size}; choose a tensor_parallel_size that divides {size}, or leave {name!r} whole "
                         "(out of the plan, or 'replicate')")


def _resolve(named: Mapping[str, nn.Module], plan: Any, tp_size: int | None, strict: bool,
             what: str = "the body") -> dict[str, ParallelStyle]:
    if callable(plan) and not isinstance(plan, Mapping):
        raise TypeError("a tensor_parallel_plan given as a function (stage_module, tp_mesh) -> None is applied as it "
                        "is (parallelize_stage calls it): there are no names to resolve")
    if not isinstance(plan, Mapping):
        raise TypeError(f"tensor_parallel_plan must be a dict from module names to styles, or a function "
                        f"(stage_module, tp_mesh) -> None (got: {type(plan).__name__})")
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
        raise ValueError(f"tensor_parallel_size must be a positive integer (got: {tp_size!r})")
    chosen: dict[str, tuple[str, ParallelStyle]] = {}
    for key, value in plan.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"tensor_parallel_plan's keys are module names of {what}, as named_modules() gives "
                             f"them (got: {key!r})")
        style = style_of(value, key)
        found = _match(key, named)
        if not found and strict:
            pool = list(named) + sorted({re.sub(r"\d+", "*", n) for n in named} if "*" in key else ())
            close = difflib.get_close_matches(key, pool, n=5, cutoff=0.5)
            hint = f"; close names: {', '.join(map(repr, close))}" if close else ""
            raise ValueError(f"tensor_parallel_plan names no module of {what}: {key!r}{hint}. The names are "
                             f"{what}'s own, as dict(body.named_modules()) lists them (a body's layers are "
                             "'0', '1', ...), with * for any one dotted part")
        for name in found:
            if name in chosen and chosen[name][0] != key:
                raise ValueError(f"tensor_parallel_plan gives the module {name!r} twice: by {chosen[name][0]!r} and "
                                 f"by {key!r}; give it one entry")
            _check(name, named[name], style, tp_size)
            chosen[name] = (key, style)
    order = {name: k for k, name in enumerate(named)}
    return {name: chosen[name][1] for name in sorted(chosen, key=order.__getitem__)}


def resolve_plan(body_or_stage: nn.Module, plan: Plan, tp_size: int) -> dict[str, ParallelStyle]:
    """``plan`` (names with ``*`` patterns, styles or Hugging Face's style names) as one torch ``ParallelStyle``
    per module of ``body_or_stage`` by its exact name, in the module's order, checked (see the module's docstring).
    Every entry must name a module of it: give the body and the whole plan (a stage cut by ``split_module``, whose
    layers keep the body's names, and only its part of the plan; :func:`stage_plan` takes a stage's part)."""
    return _resolve(_named(body_or_stage), plan, tp_size, strict=True)


def stage_plan(stage_module: nn.Module, plan: Plan, tp_size: int | None = None,
               names: Mapping[str, str] | None = None) -> dict[str, ParallelStyle]:
    """The part of the body's ``plan`` for one stage, by the stage's own module names. The stage's layers are named
    as in the body (as ``split_module`` keeps them) unless ``names`` maps each child's name in the stage to its
    name in the body (``{"0": "3", "1": "4"}`` for layers 3 and 4 re-indexed from 0). Entries naming modules of
    other stages are left out: check the plan against the whole body first (:func:`check_stage_boundaries`)."""
    resolved = _resolve(_named(stage_module, names), plan, tp_size, strict=False, what="the stage")
    back = {body: stage for stage, body in (names or {}).items()}
    relative = {}
    for name, style in resolved.items():
        top, _, rest = name.partition(".")
        mine = back.get(top, top)
        relative[f"{mine}.{rest}" if rest else mine] = style
    return relative


def parallelize_stage(stage_module: nn.Module, plan: Plan, tp_mesh: Any, *, names: Mapping[str, str] | None = None,
                      src_data_rank: int | None = 0) -> nn.Module:
    """Split ``stage_module`` over the tensor ranks of ``tp_mesh`` (a 1-D ``DeviceMesh``: each of its processes holds
    this stage) by its part of ``plan`` (:func:`stage_plan`; ``names`` as there), with torch's
    ``parallelize_module``; a function plan is called as ``plan(stage_module, tp_mesh)`` instead. Collective over the
    mesh. ``src_data_rank``: the rank whose weights every rank's shards are cut from (0: as one process would hold
    them); None: each rank cuts its own weights (already equal, or materialised each in its process). Returns
    ``stage_module``, changed in place: its split parameters are ``DTensor`` s."""
    if callable(plan) and not isinstance(plan, Mapping):
        plan(stage_module, tp_mesh)
        return stage_module
    if getattr(tp_mesh, "ndim", None) != 1:
        raise ValueError(f"parallelize_stage needs the stage's 1-D tensor mesh (of a larger mesh, its tensor "
                         f"dimension: mesh['tensor']) (got: {tp_mesh!r})")
    resolved = stage_plan(stage_module, plan, tp_mesh.size(), names)
    for name, style in resolved.items():
        parallelize_module(stage_module.get_submodule(name), tp_mesh, style, src_data_rank=src_data_rank)
    own_dropout_streams(stage_module, resolved, tp_mesh)
    return stage_module


# ---------------------------------------------------------------------------------- dropout on slices
_saved = threading.local()  # the random state a dropout of a split region set aside, by module, in this thread


def _own_stream(rank: int, module: nn.Module, args: Any) -> None:
    """Before a dropout on a slice: draw one seed from the random stream every tensor rank shares (each draws the
    same, so the stream stays the same in all of them), then run the dropout on a stream of this rank's own."""
    x = args[0] if args else None
    if not module.training or not getattr(module, "p", 0) or not isinstance(x, Tensor):
        return
    seed = int(torch.randint(0, 1 << 62, (1,)).item()) + rank
    if x.device.type == "cuda":
        saved = (x.device, torch.cuda.get_rng_state(x.device))
        with torch.cuda.device(x.device):
            torch.cuda.manual_seed(seed)
    else:
        saved = (x.device, torch.get_rng_state())
        torch.random.default_generator.manual_seed(seed)
    vars(_saved).setdefault("states", {})[id(module)] = saved


def _shared_stream(module: nn.Module, args: Any, output: Any) -> None:
    """After a dropout on a slice: the shared random stream back where it was (see :func:`_own_stream`)."""
    saved = vars(_saved).get("states", {}).pop(id(module), None)
    if saved is None:
        return
    device, state = saved
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def own_dropout_streams(stage_module: nn.Module, resolved: Mapping[str, ParallelStyle], tp_mesh: Any) -> list[str]:
    """Give each dropout of ``stage_module`` that acts on slices (a layer of the stage between a layer leaving its
    output sharded and one taking it whole, as a ``Dropout`` between a colwise and a rowwise ``Linear``) a random
    stream of its tensor rank's own, as Megatron's model-parallel generator does: with the stream every rank shares,
    each rank's slice would get the same mask as the others' (correlated masks, which one device never draws). A
    dropout on whole activations keeps the shared stream (every rank must mask them alike). Dropouts inside a layer
    whose own modules are planned (a block) are left as they are: nothing here follows the layout inside it.
    ``resolved``: the stage's plan (:func:`stage_plan`). Returns the names of the dropouts given their own stream."""
    layout: Any = Replicate()  # what reaches the stage's first layer (slices only if it takes them: checked before)
    done: list[str] = []
    rank = tp_mesh.get_local_rank()
    for child, layer in stage_module.named_children():
        takes, leaves, _, _ = _layer_layouts(child, resolved)
        if takes is not None:
            layout = takes
        if leaves is _PASS and takes is None and isinstance(layout, Shard):  # a layer of no style, on slices
            for name, module in layer.named_modules(prefix=child):
                if isinstance(module, nn.modules.dropout._DropoutNd):
                    module.register_forward_pre_hook(partial(_own_stream, rank))
                    module.register_forward_hook(_shared_stream)
                    done.append(name)
        if leaves is not _PASS:
            layout = leaves
    return done


# ---------------------------------------------------------------------------------- layouts from layer to layer
_PASS = object()  # a style that leaves the layout as it found it


def _layouts(style: ParallelStyle) -> tuple[Placement | None, Any]:
    """What ``style`` takes (None: anything) and leaves (``_PASS``: what it took; None: unknown)."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return style.input_layouts[0], style.output_layouts[0]
    if isinstance(style, SequenceParallel):
        return style.sequence_sharding[0], style.sequence_sharding[0]
    if isinstance(style, PrepareModuleOutput):
        return None, style.desired_output_layouts[0]
    if isinstance(style, (Whole, SummedGradients)):
        return None, _PASS
    return None, None


def _layer_layouts(layer: str, resolved: Mapping[str, ParallelStyle]) -> tuple[Any, Any, str | None, str | None]:
    """What body layer ``layer`` takes and leaves under the plan, and the planned modules whose layouts these are:
    its own style's, else the first and the last module planned inside it (in their order of definition), else none
    (it takes anything, and leaves what it took)."""
    inside = [layer] if layer in resolved else [name for name in resolved if name.startswith(layer + ".")]
    if not inside:
        return None, _PASS, None, None
    return _layouts(resolved[inside[0]])[0], _layouts(resolved[inside[-1]])[1], inside[0], inside[-1]


def _meet(takes: Any, layout: Any) -> bool:
    """Whether what a layer takes meets what reaches it: both whole, or both sharded on one dimension (a negative
    and a non-negative dimension may be one, -1 and 1 of a 2-D activation: let through, unknown here)."""
    if isinstance(takes, Shard) != isinstance(layout, Shard):
        return False
    if isinstance(takes, Shard) and (takes.dim < 0) == (layout.dim < 0):
        return bool(takes.dim == layout.dim)
    return True


def _whole(layout: Any) -> str:
    return f"sharded on dim {layout.dim}" if isinstance(layout, Shard) else "whole" if isinstance(layout, Replicate) \
        else str(layout)


def check_stage_boundaries(partitions: Sequence[nn.Module], plan: Plan, tp_size: int | None = None
                           ) -> dict[str, ParallelStyle]:
    """Check ``plan`` against the body cut into ``partitions`` (as ``split_module`` cuts it: each layer named by its
    index in the body), following the layout of what flows from layer to layer, and return it resolved
    (:func:`resolve_plan`; the dimensions checked against ``tp_size`` where given). Refused: a layer that takes its
    input whole after one that leaves it sharded, or sharded after a whole one; a stage leaving its output sharded
    unless the next stage's first layer is planned to take the slices (a ``rowwise`` layer: each process then
    hands its slice to the matching tensor rank of the next stage); a body whose output stays sharded. A layer
    without a style passes on what it receives (as a ``Tanh`` between a colwise and a rowwise layer). A function
    plan is not checked (returned as ``{}``)."""
    if callable(plan) and not isinstance(plan, Mapping):
        return {}
    named: dict[str, nn.Module] = {}
    for partition in partitions:
        named.update(_named(partition))
    resolved = _resolve(named, plan, tp_size, strict=True)
    layout: Any = Replicate()  # the body's input: whole in every tensor rank
    last = ""  # the planned module that left ``layout``
    for j, partition in enumerate(partitions):
        for k, layer in enumerate(name for name, m in partition._modules.items() if m is not None):
            takes, leaves, first, final = _layer_layouts(layer, resolved)
            kind = type(partition._modules[layer]).__name__
            source = f"{last!r} is {describe(resolved[last])}" if last else "the body's input"
            handed = isinstance(takes, Shard) and _meet(takes, layout)  # the slices a stage hands on taken as they are
            if k == 0 and j > 0 and isinstance(layout, Shard) and not handed:
                raise ValueError(
                    f"tensor_parallel_plan leaves stage {j - 1}'s output {_whole(layout)} ({source}), and stage {j}'s "
                    f"first layer {layer!r} ({kind}) is not planned to take slices. Gather it in stage {j - 1}: "
                    f"make {last!r} 'colwise_rep', or end stage {j - 1} with a 'rowwise' layer after it; or cut the "
                    f"stages so that stage {j} begins with the layer that takes the slices (a 'rowwise' one)")
            if takes is not None and layout is not None and not _meet(takes, layout):
                fix = (f"a style there that takes what reaches it (sharded on dim {layout.dim}), or one before it "
                       f"that leaves its output so" if isinstance(takes, Shard) and isinstance(layout, Shard) else
                       "a style there that takes it whole ('rowwise_rep' for 'rowwise': it cuts its input itself)"
                       if isinstance(takes, Shard) else
                       f"'colwise_rep' for {last!r} (its output gathered whole), or a 'rowwise' layer between them")
                raise ValueError(
                    f"tensor_parallel_plan gives {first!r} "
                    f"({f'{kind}, ' if first == layer else f'in layer {layer!r}, '}stage {j}) "
                    f"{describe(resolved[first])}, which takes its input {_whole(takes)}, but what reaches it is "
                    f"{_whole(layout)} ({source}); use {fix}")
            if leaves is not _PASS:
                layout, last = leaves, final
    if isinstance(layout, Shard):
        raise ValueError(f"tensor_parallel_plan leaves the body's output {_whole(layout)} ({last!r} is "
                         f"{describe(resolved[last])}): the last stage would hand the loss a slice per tensor rank. "
                         f"Gather it: 'colwise_rep' for {last!r}, or a 'rowwise' layer after it")
    return resolved
