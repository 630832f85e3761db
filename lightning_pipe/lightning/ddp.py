"""Lightning's DDP arguments under ``PipeStrategy``: which it honours, which it refuses and why, and how the
``DistributedDataParallel`` of one stage is built from them.

``PipeStrategy(**kwargs)`` takes what ``DDPStrategy`` takes: its own keywords (``ddp_comm_hook``,
``ddp_comm_state``, ``ddp_comm_wrapper``, ``model_averaging_period``, ``start_method``) and, as Lightning passes
them on, ``DistributedDataParallel``'s (``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``,
``gradient_as_bucket_view``, ``broadcast_buffers``, ...). Each of those goes to the DDP of every stage (and of
the driver's layers outside the body); the few that cannot mean anything there are refused up front, as is any
name neither knows, with the closest known one.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import pickle
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__: list[str] = []

#: DDPStrategy's own keywords that reach ``**kwargs``.
LIGHTNING = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period", "start_method")

#: DistributedDataParallel arguments that cannot apply to a stage, and why.
REFUSED = {
    "module": "PipeStrategy gives each stage's DDP that stage's layers",
    "device_ids": "PipeStrategy gives each stage's DDP the device its stage runs on",
    "output_device": "PipeStrategy gives each stage's DDP the device its stage runs on",
    "process_group": "PipeStrategy gives each stage's DDP a group of that stage's replicas",
    "device_mesh": "PipeStrategy gives each stage's DDP a group of that stage's replicas",
    "dim": "the pipeline splits each batch into micro-batches along dim 0 itself; DDP's forward, which scatters "
           "along dim, is not called",
    "mixed_precision": "DDP's mixed precision casts in DDP's forward, which the stages do not call: use "
                       "Trainer(precision='bf16-mixed') or '16-mixed', which every stage follows",
    "delay_all_reduce_named_params": "a stage runs one backward per micro-batch, and these parameters would be "
                                     "all-reduced after each, not once per step",
    "param_to_hook_all_reduce": "a stage runs one backward per micro-batch, and the delayed parameters would be "
                                "all-reduced after each, not once per step",
}

_FLAGS = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "init_sync", "check_reduction",
          "skip_all_reduce_unused_params", "batched_grad_copy")


def ddp_parameters() -> list[str]:
    """The keywords of ``DistributedDataParallel`` that PipeStrategy passes on to each stage's DDP."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return [n for n in names if n not in ("self", "module") and n not in REFUSED]


def is_default(name: str, value: Any) -> bool:
    """Whether ``value`` is ``DistributedDataParallel``'s default for ``name`` (LightningCLI passes every DDP
    keyword, each at its default unless the config sets it)."""
    parameter = inspect.signature(DistributedDataParallel.__init__).parameters.get(name)
    return parameter is not None and parameter.default is not inspect.Parameter.empty and (
        value is parameter.default or (type(value) is type(parameter.default) and value == parameter.default))


def check_arguments(kwargs: dict[str, Any], known: list[str]) -> None:
    """Refuse ``PipeStrategy``'s ``**kwargs`` that would not do what their names promise: unknown names (with
    the closest of ``known``, PipeStrategy's own, and DDP's), DDP arguments a stage cannot use, values of the
    wrong kind, and a comm hook's parts that could not reach the stages' processes."""
    accepted = ddp_parameters()
    for name in kwargs:
        if name in REFUSED and is_default(name, kwargs[name]):
            continue  # left at DDP's default (LightningCLI passes them all): the strategy sets it
        if name in REFUSED:
            raise ValueError(f"PipeStrategy does not take DistributedDataParallel's {name}={kwargs[name]!r}: "
                             f"{REFUSED[name]}")
        if name not in accepted and name not in LIGHTNING:
            close = difflib.get_close_matches(name, [*known, *LIGHTNING, *accepted], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"PipeStrategy got an unexpected keyword argument {name!r}{hint}. It takes its own arguments, "
                f"DDPStrategy's ({', '.join(LIGHTNING)}) and DistributedDataParallel's "
                f"({', '.join(accepted)})")
    for name in _FLAGS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ValueError(f"{name} must be True or False (got: {kwargs[name]!r})")
    for name in ("broadcast_buffers", "forward_sync_buffers"):
        if kwargs.get(name) is not None and not isinstance(kwargs[name], bool):
            raise ValueError(f"{name} must be True, False or None (got: {kwargs[name]!r})")
    cap = kwargs.get("bucket_cap_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB (got: {cap!r})")
    caps = kwargs.get("bucket_cap_mb_list")
    if caps is not None and (not isinstance(caps, (list, tuple)) or not caps or any(
            isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0 for c in caps)):
        raise ValueError(f"bucket_cap_mb_list must be a list of positive numbers of MiB (got: {caps!r})")
    _check_comm(kwargs)


def _check_comm(kwargs: dict[str, Any]) -> None:
    hook, state, wrapper = (kwargs.get(k) for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"))
    if kwargs.get("model_averaging_period") is not None or type(state).__name__ == "PostLocalSGDState":
        raise ValueError(
            "PipeStrategy does not support post-local SGD (model_averaging_period, PostLocalSGDState): its "
            "subgroups and the averaging of weights after each step would be needed for every stage's group of "
            f"replicas (model_averaging_period: {kwargs.get('model_averaging_period')!r}, ddp_comm_state: "
            f"{type(state).__name__}). Average every step (no ddp_comm_state), or compress the reduction with "
            "ddp_comm_hook (fp16 or bf16 compression, PowerSGD)")
    if hook is None and (state is not None or wrapper is not None):
        given = "ddp_comm_state" if state is not None else "ddp_comm_wrapper"
        raise ValueError(f"{given} was given without ddp_comm_hook, and does nothing without it: pass the hook "
                         f"it is for (ddp_comm_hook=...)")
    for name, value in (("ddp_comm_hook", hook), ("ddp_comm_wrapper", wrapper)):
        if value is not None and not callable(value):
            raise ValueError(f"{name} must be a function (got: {value!r})")
    if getattr(state, "process_group", None) is not None:
        raise ValueError(
            f"ddp_comm_state.process_group must be None (got: {state.process_group!r}): each stage's DDP "
            "averages over a group of that stage's replicas, which the state is given in each stage's process")
    for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
        if kwargs.get(name) is not None:
            try:
                pickle.dumps(kwargs[name])
            except Exception as exc:  # noqa: BLE001 - any failure to pickle says the same
                raise ValueError(
                    f"{name} cannot be sent to the processes of the other stages ({type(exc).__name__}: {exc}), "
                    "where each stage builds its own DDP: use a module-level function (not a lambda or a local "
                    "function) and a state that pickles") from None


def check_settings(kwargs: dict[str, Any], trainer: Any) -> None:
    """Refuse DDP arguments the Trainer's settings break in torch's reducer: ``static_graph`` with
    ``accumulate_grad_batches`` fails there (an internal assertion, under Lightning's DDPStrategy too)."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if kwargs.get("static_graph") and accumulate > 1:
        raise ValueError(
            f"static_graph=True cannot be combined with Trainer(accumulate_grad_batches={accumulate}): torch's DDP "
            "reducer fails on the backwards that no_sync runs under a static graph (as under DDPStrategy). Leave "
            "static_graph off (find_unused_parameters=False gives most of its speed), or do not accumulate")


def check_backend(hook: Any, backend: str | None) -> None:
    """Refuse torch's PowerSGD hooks over gloo: they wait for an all-reduce inside the callback of another, on
    the thread that completes gloo's collectives, and a stage's replicas deadlock when two buckets' callbacks
    meet there (seen on CPU, intermittently)."""
    name = getattr(hook, "__name__", "")
    if backend == "gloo" and name in ("powerSGD_hook", "batched_powerSGD_hook"):
        raise ValueError(
            f"ddp_comm_hook={name} cannot run over gloo (the CPU backend here): it blocks on an all-reduce inside "
            "another's callback, which deadlocks the stages' replicas. Use it on GPUs (NCCL), or compress with "
            "default_hooks.bf16_compress_hook / fp16_compress_hook, which work over gloo")


def defaults(kwargs: dict[str, Any]) -> None:
    """PipeStrategy's defaults for DDP's arguments where they differ from DDPStrategy's: unused parameters are
    found (a parameter unused on some replicas counts as zero there, one unused everywhere keeps no gradient),
    unless ``static_graph`` says the graph never changes."""
    if not kwargs.get("static_graph", False):
        kwargs.setdefault("find_unused_parameters", True)


def wrap(strategy: Any, module: nn.Module, device_ids: list[int] | None, process_group: Any
         ) -> DistributedDataParallel:
    """``module`` in a ``DistributedDataParallel`` over ``process_group`` with ``strategy``'s DDP arguments
    and comm hook (``PipeStrategy.configure_ddp``'s default). Each DDP gets its own copy of the hook's state
    (PowerSGD keeps errors per bucket); a missing state, or a state without a group, gets ``process_group``,
    which torch's hooks all-reduce over."""
    kwargs = {k: v for k, v in strategy._ddp_kwargs.items() if k not in REFUSED}  # those left at their defaults
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=process_group, **kwargs)
    hook = strategy._ddp_comm_hook
    if hook is not None:
        state = copy.deepcopy(strategy._ddp_comm_state)
        if state is None:
            state = process_group
        elif hasattr(state, "process_group") and state.process_group is None:
            state.process_group = process_group
        if strategy._ddp_comm_wrapper is not None:
            hook = strategy._ddp_comm_wrapper(hook)
        ddp.register_comm_hook(state, hook)
    return ddp


#: What a strategy holds only for its Trainer, in the driver's process: left out of the copy sent to stages.
_RUNTIME = ("_accelerator", "_checkpoint_io", "_precision_plugin", "precision_plugin", "_lightning_module", "_model",
            "_launcher", "_optimizers", "_lightning_optimizers", "lr_scheduler_configs", "cluster_environment",
            "_layer_sync", "_forward_redirection", "_model_averager", "_body", "_stage_optimizers", "_replicas",
            "_arguments", "_lp_layers", "_precision", "_backward_sync_control", "_module", "model", "_mirrored",
            "_replica_group")


def stage_copy(strategy: Any) -> Any:
    """A copy of ``strategy`` to send to the stages' processes, where its ``configure_ddp`` builds each stage's
    DDP: its arguments (and a subclass's own attributes), without what only its Trainer uses (accelerator,
    cluster environment, model, optimizers)."""
    twin = object.__new__(type(strategy))
    twin.__dict__.update({k: v for k, v in vars(strategy).items() if k not in _RUNTIME})
    twin.__dict__.update(_optimizers=[], _lightning_optimizers=[], lr_scheduler_configs=[])
    return twin


def rebuild_copy(strategy: Any) -> Any:
    """A :func:`stage_copy` whose ``configure_ddp`` rebuilds a DDP mid-training: without ``init_sync`` (the
    replicas are in step: nothing to broadcast from replica 0)."""
    twin = stage_copy(strategy)
    twin._ddp_kwargs = {**twin._ddp_kwargs, "init_sync": False}
    return twin
