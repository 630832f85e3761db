"""Optimizers across stages: the driver's optimizer, mirrored on every stage, stepped as one.

The user's ``configure_optimizers`` runs once, on the driver, over the whole model (parameters of remote
stages are present there as placeholders, with their real names), so parameter groups built from names
work as on one device. Each stage then builds the same optimizer class over its own parameters with the
same groups, and every step copies the driver's current hyper-parameters (learning rates moved by
schedulers included) into the stages' groups before they step.

Optimizer state is kept where the parameters are and merged, for checkpoints, into exactly the
``state_dict`` the optimizer of the unpipelined model would have, indexed in the driver's order.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

#: Optimizers whose ``step`` evaluates the closure several times need all gradients in one place.
UNSUPPORTED = (torch.optim.LBFGS,)


@dataclass
class OptimizerSpec:
    """What a stage needs to build its part of an optimizer: class, defaults and, per group, the
    hyper-parameters and the names of this stage's parameters in it."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyper-parameters of every group (everything but the parameters themselves)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, groups: Sequence[Mapping[str, Any]]) -> None:
    """Copy the driver's hyper-parameters into ``optimizer``'s groups."""
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(f"the stage's optimizer has {len(optimizer.param_groups)} parameter groups but the "
                           f"driver's has {len(groups)}; add_param_group after setup is not supported")
    for group, hp in zip(optimizer.param_groups, groups):
        group.update(hp)


def flat_names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """The name of each parameter in the order of the optimizer's ``state_dict`` indices."""
    out = []
    for k, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"{type(optimizer).__name__} holds a parameter that is not part of the "
                                 f"LightningModule (group {k}, shape {tuple(p.shape)}); build optimizers from "
                                 "self.parameters() or self.named_parameters()")
            out.append(names[id(p)])
    return out


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that cannot be split across stages, saying why."""
    if isinstance(optimizer, UNSUPPORTED):
        raise TypeError(f"{type(optimizer).__name__} evaluates its closure several times per step and needs "
                        "every gradient in one process; it cannot be used with pipeline stages. Use a "
                        "first-order optimizer (SGD, Adam, AdamW, ...)")


def specs_for_stages(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                     owner: Callable[[str], int], stages: int) -> list[OptimizerSpec | None]:
    """Split ``optimizer`` into one spec per stage (``None`` where a stage has no parameter in it)."""
    check_supported(optimizer)
    hps = hyperparameters(optimizer)
    per_stage: list[list[dict[str, Any]]] = [[] for _ in range(stages)]
    for group, hp in zip(optimizer.param_groups, hps):
        owned: list[list[str]] = [[] for _ in range(stages)]
        for p in group["params"]:
            name = names[id(p)]
            owned[owner(name)].append(name)
        for j in range(stages):
            per_stage[j].append({**copy.deepcopy(hp), "names": owned[j]})
    return [
        OptimizerSpec(type(optimizer), copy.deepcopy(optimizer.defaults), groups)
        if any(g["names"] for g in groups) else None
        for groups in per_stage
    ]


def build(spec: OptimizerSpec, named: Mapping[str, Tensor]) -> torch.optim.Optimizer:
    """Build a stage's optimizer from ``spec`` over its parameters ``named``.

    The class's own constructor runs (it may set up state and flags beyond its defaults) with the defaults
    it accepts; defaults it does not take as arguments (AdamW's ``decoupled_weight_decay``) reach the
    groups through their hyper-parameters, which every group carries.
    """
    groups = [{**{k: v for k, v in g.items() if k != "names"}, "params": [named[n] for n in g["names"]]}
              for g in spec.groups]
    return spec.cls(groups, **_accepted(spec.cls, spec.defaults))


def _accepted(cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``cls``'s constructor takes as keyword arguments."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters and k not in ("self", "params")}


def drop_placeholder_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget state an optimizer created at construction for parameters that live in other processes.

    Some optimizers (Adagrad's ``sum``) build per-parameter state in ``__init__``; for a placeholder on the
    meta device that state is a meta tensor, which cannot be moved or saved. The real state is built by
    the stage that holds the parameter.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_meta:
                optimizer.state.pop(p, None)


def as_held(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` (whole tensors, indexed as ``optimizer``'s) with the state of each parameter that is a
    shard (a ``DTensor``: a stage sharded over its replicas) cut to this process's shard, as the optimizer's own
    state holds it."""
    from lightning_pipe.transport.parallel import fsdp

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(fsdp.is_dtensor(p) for p in params):
        return dict(state_dict)
    state = {i: {key: fsdp.like(params[int(i)], v) if isinstance(v, Tensor) else v for key, v in s.items()}
             for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def whole(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with every shard (``DTensor``) gathered whole: a collective of each shard's
    group, which every replica of the stage runs at once, in the same order."""
    from lightning_pipe.transport.parallel import fsdp

    state = {i: {key: fsdp.full(v) if isinstance(v, Tensor) else v for key, v in s.items()}
             for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def held_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state this process holds of ``optimizer``: its ``state_dict``, or a driver's part alone where its
    ``state_dict`` gives the whole model's (``held_state_dict``)."""
    return getattr(optimizer, "held_state_dict", optimizer.state_dict)()


def state_by_name(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The per-parameter state of ``optimizer``, keyed by parameter name (``names`` in index order)."""
    state = held_state(optimizer)["state"]
    return {names[i]: _to_cpu(s) for i, s in state.items()}


def load_state_by_name(optimizer: torch.optim.Optimizer, names: Sequence[str],
                       states: Mapping[str, Mapping[str, Any]]) -> None:
    """Load per-parameter ``states`` (by name) into ``optimizer``, keeping its groups' hyper-parameters."""
    full = optimizer.state_dict()
    index = {n: i for i, n in enumerate(names)}
    full["state"] = {index[n]: dict(s) for n, s in states.items() if n in index}
    optimizer.load_state_dict(full)


def merge(driver_state: dict[str, Any], names: Sequence[str], remote: Mapping[str, Mapping[str, Any]],
          local: Callable[[str], bool]) -> dict[str, Any]:
    """The driver's ``state_dict`` with the state of remote parameters filled in from ``remote``."""
    merged = {"state": {}, "param_groups": copy.deepcopy(driver_state["param_groups"])}
    for i, name in enumerate(names):
        if local(name):
            if i in driver_state["state"]:
                merged["state"][i] = driver_state["state"][i]
        elif name in remote:
            merged["state"][i] = dict(remote[name])
    return merged


def split(state_dict: Mapping[str, Any], names: Sequence[str], owner: Callable[[str], int]
          ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Split a merged ``state_dict`` into the driver's own (stage 0) and, per remote stage, states by name."""
    own = {"state": {}, "param_groups": copy.deepcopy(state_dict["param_groups"])}
    remote: dict[int, dict[str, Any]] = {}
    for i, s in state_dict["state"].items():
        name = names[int(i)]
        stage = owner(name)
        if stage == 0:
            own["state"][i] = s
        else:
            remote.setdefault(stage, {})[name] = s
    return own, remote


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with its tensors on CPU (a shard of a stage sharded over its replicas, a ``DTensor``, stays as it
    is: whole or saved by DCP, it is read where it lives)."""
    from lightning_pipe.transport.parallel import fsdp

    return {k: v.detach() if fsdp.is_dtensor(v) else v.detach().cpu() if isinstance(v, Tensor) else v
            for k, v in state.items()}
