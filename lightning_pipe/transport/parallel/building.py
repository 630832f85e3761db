"""A stage built on the meta device, materialised and split over its tensor ranks one layer at a time.

Materialising a stage whole, then splitting it, holds the whole stage in every one of its ``t`` processes while it
starts. :func:`materialize_split` instead makes one layer (:func:`~lightning_pipe.engine.materialize.
materialize_layers`), has it take replica 0's weights, and splits it by its part of the plan
(:func:`~lightning_pipe.transport.parallel.tensor.stage_plan`) before the next layer is made; a layer that fills
itself from a pretrained checkpoint then reads its own shards alone. A process holds at most its shards of the
layers before, one layer whole, and nothing of those after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor.parallel import parallelize_module

from lightning_pipe.engine.materialize import Program, materialize, materialize_layers
from lightning_pipe.transport.parallel import fsdp
from lightning_pipe.transport.parallel.tensor import Plan, own_dropout_streams, stage_plan

__all__ = ["materialize_split"]


def _holding(module: nn.Module) -> int:
    """The parameter elements ``module`` holds: a split parameter's shard, a meta one nothing."""
    return sum(fsdp.local(p).numel() for p in module.parameters() if not p.is_meta)


def _materialize_split(module: nn.Module, program: Program, plan: Plan, tp_mesh: Any, device: Any,
                       src_data_rank: int | None, before_split: Callable[[list[Tensor]], None] | None) -> int:
    """One stage of :func:`materialize_split`; the most it held while it was built."""
    if callable(plan) and not isinstance(plan, Mapping):
        materialize(module, program.run(device))
        held = _holding(module)  # (whole)
        if before_split is not None:
            before_split([*module.parameters(), *module.buffers()])
        plan(module, tp_mesh)
        return held
    resolved = stage_plan(module, plan, tp_mesh.size())
    most = 0

    def split(children: list[str]) -> None:
        nonlocal most
        most = max(most, _holding(module))
        layers = [module.get_submodule(child) for child in children]
        if before_split is not None:
            before_split([t for layer in layers for t in (*layer.parameters(), *layer.buffers())])
        for name, style in resolved.items():
            if name.partition(".")[0] in children:
                parallelize_module(module.get_submodule(name), tp_mesh, style, src_data_rank=src_data_rank)

    materialize_layers(module, program, split, device)
    own_dropout_streams(module, resolved, tp_mesh)
    return most


def materialize_split(stages: Sequence[tuple[nn.Module, Program]], plan: Plan, tp_mesh: Any, *,
                      device: Any = "cpu", src_data_rank: int | None = None,
                      before_split: Callable[[list[Tensor]], None] | None = None) -> dict[str, int]:
    """Materialise ``stages`` (each built on the meta device, with the :class:`~lightning_pipe.engine.materialize.
    Program` that makes its tensors) and split each over the tensor ranks of ``tp_mesh`` by its part of ``plan``, one
    layer at a time (:func:`~lightning_pipe.engine.materialize.materialize_layers`): a layer is made on ``device``,
    its parameters and buffers handed to ``before_split`` (to take replica 0's values), and split before the next one
    is made. So this process holds, at most, the shards of the layers before, one layer whole, and nothing of the
    layers after, where materialising a stage whole then splitting it holds the whole stage. ``src_data_rank`` as in
    :func:`parallelize_stage`. A function plan needs its stage whole: the stage is materialised, then the plan called.

    Returns, in parameter elements as :func:`~lightning_pipe.transport.parallel.fsdp.held` counts them: ``built``,
    the most the stages held at once while being built (a split parameter's shard, a meta one nothing); ``whole``,
    the stages' parameters whole; ``parameters``, what they hold once split."""
    done = most = whole = 0
    for module, program in stages:
        whole += sum(p.numel() for p in module.parameters())
        most = max(most, done + _materialize_split(module, program, plan, tp_mesh, device, src_data_rank,
                                                   before_split))
        done += _holding(module)
    return {"built": most, "whole": whole, "parameters": done}
