"""Gradient norms of a pipelined LightningModule, every stage's parameters included, for logging.

Lightning's ``grad_norm(self, 2)`` reads ``p.grad`` of each parameter in the process it runs in; on the
driver, the layers of remote stages are placeholders without gradients, so it would report stage 0 alone.
:func:`grad_norm` returns the same entries as if the whole model were in one process.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.lightning.placeholders import is_placeholder
from lightning_pipe.transport.parallel import fsdp

__all__ = ["grad_norm"]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their overall norm, as ``lightning.pytorch.utilities.grad_norm``
    reports them, over every stage of the pipeline (the remote stages compute their parameters' norms).

    ::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_pipe.grad_norm(self, norm_type=2))

    Keys are ``grad_{norm}_norm{group_separator}{parameter name}`` for every parameter with a gradient, in
    ``named_parameters()`` order, and ``grad_{norm}_norm_total`` for the norm of all of them taken as one
    vector. ``norm_type`` is a positive number or ``'inf'``. A module that is not pipelined gets exactly
    Lightning's answer. With several replicas, call it where gradients are averaged already
    (``on_before_optimizer_step``, or after ``manual_backward``); it runs on the driver, one round trip
    per remote stage.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    remote, reached = _remote_norms(module, norm_type)
    device = next((p.device for p in module.parameters() if not is_placeholder(p)), torch.device("cpu"))
    norms: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        if is_placeholder(p):
            if id(p) not in reached and p.requires_grad:
                raise ValueError(f"grad_norm cannot reach the stage that holds {name!r}: call it on the "
                                 "LightningModule (self) or on its pipelined body, whose stages it asks")
            value = remote.get(name)
            if value is not None:
                value = value.to(device)
        else:
            # (a shard of a stage sharded over the replicas: the norm of the whole gradient, from every shard)
            value = fsdp.full(p.grad.detach().norm(norm_type)) if p.grad is not None else None
        if value is not None:
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = value
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def _remote_norms(module: nn.Module, norm_type: float) -> tuple[dict[str, Tensor], set[int]]:
    """The gradient norms of the remote stages' parameters, by their names in ``module``, and the ids of
    the placeholders whose stages were asked."""
    out: dict[str, Tensor] = {}
    reached: set[int] = set()
    for prefix, sub in module.named_modules():
        if not isinstance(sub, PipelinedSequential) or sub.hosts is None:
            continue
        reached.update(id(p) for p in sub.parameters() if is_placeholder(p))
        cut = len(sub.name) + 1  # the stages name parameters as the LightningModule does
        for part in sub.hosts.call("grad_norms", norm_type):
            for name, value in part.items():
                local = name[cut:]
                out[f"{prefix}.{local}" if prefix else local] = value
    return out, reached
