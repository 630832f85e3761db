"""The styles a tensor-parallel plan names: Hugging Face's style names as torch's ``ParallelStyle`` s, and the two of
its own (:class:`Whole`, :class:`SummedGradients`)."""

from __future__ import annotations

import copy
import difflib
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["STYLES", "UNSUPPORTED", "SummedGradients", "Whole", "describe", "style_of"]


class Whole(ParallelStyle):
    """Hugging Face's ``"replicate"``: the module stays whole in every tensor rank, its parameters plain tensors
    (as any module the plan leaves out)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


def _sum_over(group: Any, grad: Tensor) -> Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class SummedGradients(ParallelStyle):
    """Hugging Face's ``"replicated_with_grad_allreduce"``: the module's own parameters stay whole in every tensor
    rank, and each gradient reaching them is summed over the ranks (a norm over a sharded axis, as Qwen3's per-head
    ``q_norm``, sees only its rank's heads). Summed per backward, before it accumulates: right for micro-batches.

    The sum is hooked on the parameters the module's forward uses, as it runs, not on those it holds when the style
    is applied: materialising, loading, and FSDP2's ``fully_shard`` over the replicas replace its parameters (FSDP2
    runs the forward with whole parameters of its own, whose gradients it then reduces into the shards); a hook on
    the tensors of the time would be left behind, and the gradients silently not summed."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        hooked: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        module.register_forward_pre_hook(partial(_hook_sums, device_mesh.get_group(), hooked))
        return module


def _hook_sums(group: Any, hooked: weakref.WeakValueDictionary[int, Tensor], module: nn.Module, args: Any) -> None:
    """Before ``module``'s forward: each parameter it will use that needs a gradient, not hooked yet, has its
    gradients summed over ``group`` (``hooked``: those that have, by id, while they live)."""
    for p in module.parameters(recurse=False):
        if p.requires_grad and hooked.get(id(p)) is not p:
            p.register_hook(partial(_sum_over, group))
            hooked[id(p)] = p


def _named_style(name: str, style: ParallelStyle, kind: type[nn.Module] | None) -> Callable[[], ParallelStyle]:
    def make() -> ParallelStyle:
        made = copy.copy(style)
        made.plan_name, made.plan_kind = name, kind  # type: ignore[attr-defined]
        return made

    return make


#: Hugging Face's style names (``transformers.distributed.tensor_parallel``) as torch's styles, with their
#: layouts: ``colwise`` takes its input whole and leaves its output sharded on the last dim, ``rowwise`` the
#: reverse (its partial sums all-reduced), the ``_rep``/``gather_output``/``split_input`` forms whole on both sides;
#: ``embedding_rowwise`` shards the vocabulary, ``embedding_colwise`` the embedding dim; ``sequence_parallel``
#: takes and leaves the input's slice on dim 1; ``all_reduce`` sums the module's partial output.
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    name: _named_style(name, style, kind) for name, style, kind in [
        ("colwise", ColwiseParallel(), nn.Linear),
        ("colwise_rep", ColwiseParallel(output_layouts=Replicate()), nn.Linear),
        ("colwise_gather_output", ColwiseParallel(output_layouts=Replicate()), nn.Linear),
        ("rowwise", RowwiseParallel(), nn.Linear),
        ("rowwise_rep", RowwiseParallel(input_layouts=Replicate()), nn.Linear),
        ("rowwise_split_input", RowwiseParallel(input_layouts=Replicate()), nn.Linear),
        ("embedding_rowwise", RowwiseParallel(input_layouts=Replicate()), nn.Embedding),
        ("embedding_colwise", ColwiseParallel(output_layouts=Replicate()), nn.Embedding),
        ("sequence_parallel", SequenceParallel(use_local_output=True), None),
        ("all_reduce", PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()), None),
        ("replicate", Whole(), None),
        ("replicated_with_grad_allreduce", SummedGradients(), None),
    ]}

#: Hugging Face's style names that need its own modules or packed weights: a function plan can apply them.
UNSUPPORTED = ("packed_colwise", "packed_rowwise", "local_colwise", "local_rowwise", "local_packed_rowwise", "local",
               "gather", "local_params", "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert", "grouped_gemm",
               "ep_dispatch_experts", "ep_router")


def style_of(value: Any, key: str) -> ParallelStyle:
    """The style ``value`` names in ``tensor_parallel_plan[key]`` (a ``ParallelStyle`` as it is); refused, with the
    known names, where it names none."""
    if isinstance(value, ParallelStyle):
        return value
    if not isinstance(value, str):
        raise TypeError(f"tensor_parallel_plan[{key!r}] must be a torch ParallelStyle or a style name "
                        f"(got: {value!r})")
    if value in STYLES:
        return STYLES[value]()
    if value in UNSUPPORTED:
        raise ValueError(f"tensor_parallel_plan[{key!r}] is {value!r}, a Hugging Face style for its own modules or "
                         f"packed weights, not supported here; give a torch ParallelStyle, or a function "
                         f"(stage_module, tp_mesh) -> None as the whole plan. Supported names: {', '.join(STYLES)}")
    close = difflib.get_close_matches(value, list(STYLES), n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    raise ValueError(f"tensor_parallel_plan[{key!r}] is an unknown style name {value!r}{hint}; the known names: "
                     f"{', '.join(STYLES)}; or a torch ParallelStyle")


def describe(style: ParallelStyle) -> str:
    """``style`` in an error message: its name in the plan, else its class's."""
    return repr(getattr(style, "plan_name", None) or type(style).__name__)
