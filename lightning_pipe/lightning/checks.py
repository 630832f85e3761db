"""What ``PipeStrategy`` refuses, and why: its own arguments, Trainer settings, callbacks and models it cannot honour.

Each check raises one error that names the value and says what to do instead. The launcher runs the checks of
settings and model before any process starts (Lightning's launcher), or on every rank (torchrun, SLURM).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from lightning_pipe.engine.partition import check_checkpoint, check_chunks, check_sequential
from lightning_pipe.engine.plan import Plan
from lightning_pipe.engine.schedule import MULTISTAGE, V_SHAPED, check_schedule, schedule_plan
from lightning_pipe.engine.skip.skippable import verify_skippables
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.transport.topology import Topology

__all__: list[str] = []

BALANCE_MODES = ("balance_by_size", "balance_by_time")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Reject ``value`` for argument ``name`` unless it is one of ``choices``, naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} (got: {value!r})")


def check_arguments(balance: Any, microbatches: Any, checkpoint: Any, balance_mode: Any, rpc_timeout_sec: Any,
                    module_name: Any, schedule: Any, virtual_stages: Any, kwargs: dict[str, Any]) -> list[int] | None:
    """Reject ``PipeStrategy`` arguments that cannot work; return ``balance`` as a list (or None)."""
    if balance is not None:
        if not isinstance(balance, (list, tuple)) or not balance or any(
                isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in balance):
            raise ValueError(f"balance must be a list of positive integers, one per stage (balance: {balance!r})")
        balance = list(balance)
    check_chunks(microbatches, "microbatches")
    check_checkpoint(checkpoint)
    if balance_mode not in BALANCE_MODES:
        raise ValueError(f"balance_mode must be one of {', '.join(map(repr, BALANCE_MODES))} (got: {balance_mode!r})")
    if not isinstance(rpc_timeout_sec, (int, float)) or not rpc_timeout_sec > 0:
        raise ValueError(f"rpc_timeout_sec must be a positive number of seconds (got: {rpc_timeout_sec!r})")
    if not isinstance(module_name, str) or not module_name.isidentifier():
        raise ValueError(f"module_name must be the name of an attribute (got: {module_name!r})")
    check_schedule(schedule)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive integer (got: {virtual_stages!r})")
    if isinstance(schedule, Plan):  # a schedule given as data: its stages per process are virtual_stages
        if schedule.stages // schedule.processes != virtual_stages:
            raise ValueError(f"the schedule given as data holds {schedule.stages // schedule.processes} stages per "
                             f"process, and virtual_stages={virtual_stages}: pass "
                             f"virtual_stages={schedule.stages // schedule.processes}")
        if schedule.microbatches != microbatches:
            raise ValueError(f"the schedule given as data runs {schedule.microbatches} micro-batches, and "
                             f"microbatches={microbatches}: make them agree")
    elif (schedule in MULTISTAGE) != (virtual_stages > 1):
        runs = "several stages" if schedule in MULTISTAGE else "one stage"
        raise ValueError(f"schedule={schedule!r} runs {runs} per process (virtual_stages: {virtual_stages}): use "
                         f"one of {', '.join(map(repr, MULTISTAGE))} with virtual_stages >= 2 ('zbv' and "
                         "'dualpipev': exactly 2), or another schedule with virtual_stages=1")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ValueError(f"schedule={schedule!r} places 2 stages per process in a V (virtual_stages: "
                         f"{virtual_stages}): use virtual_stages=2")
    if balance is not None:
        if len(balance) % virtual_stages:
            raise ValueError(f"balance must have processes x virtual_stages entries (balance: {len(balance)} "
                             f"entries, virtual_stages: {virtual_stages}); it cannot be spread evenly over processes")
        schedule_plan(schedule, microbatches, len(balance) // virtual_stages, virtual_stages)
    if kwargs.get("start_method", "popen") not in ("popen", "fork"):
        raise ValueError(f"PipeStrategy starts processes as scripts (start_method='popen') or forks them from the "
                         f"launching process (start_method='fork'); got start_method={kwargs['start_method']!r}")
    return balance


def check_pipelined_backward(pipelined: Any, schedule: Any) -> None:
    """Reject ``pipelined_backward`` that is not a bool, and ``False`` with a schedule other than GPipe's: one
    backward per stage over all its micro-batches needs every forward done first, which no other order has."""
    if not isinstance(pipelined, bool):
        raise ValueError(f"pipelined_backward must be True or False (got: {pipelined!r})")
    if not pipelined and schedule != "gpipe":
        shown = "a schedule given as data names each micro-batch's backward" if isinstance(schedule, Plan) else \
            f"schedule={schedule!r} may choose one that interleaves them" if schedule == "auto" else \
            f"schedule={schedule!r} interleaves them"
        raise ValueError(f"pipelined_backward=False runs each stage's backward once, over all its micro-batches, after "
                         f"every forward: GPipe's order alone allows it, and {shown}. Leave pipelined_backward=True "
                         "(the default) with this schedule, or use schedule='gpipe'")


#: The DistributedDataParallel arguments that keep their meaning when stages are sharded (FSDP2 in place of DDP).
SHARDED_DDP_ARGUMENTS = ("init_sync", "broadcast_buffers")


def check_sharding(setting: Any, shard_size: Any, ddp_given: list[str]) -> str:
    """Reject a ``sharding_strategy`` (and ``hybrid_shard_size``) that cannot work, and DDP arguments that would
    mean nothing with it (no DDP wraps a sharded stage); return the setting's name."""
    from lightning_pipe.transport.parallel.fsdp import SETTINGS

    name = getattr(setting, "name", setting)  # torch's ShardingStrategy enum, as Lightning's FSDPStrategy takes
    if not isinstance(name, str) or name.upper() not in SETTINGS:
        raise ValueError(f"sharding_strategy must be one of {', '.join(map(repr, SETTINGS))} (got: {setting!r})")
    name = name.upper()
    if shard_size is not None and (name != "HYBRID_SHARD" or isinstance(shard_size, bool)
                                   or not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"hybrid_shard_size is the number of replicas per shard group under "
                         f"sharding_strategy='HYBRID_SHARD', a positive integer (got: {shard_size!r} with "
                         f"sharding_strategy={name!r})")
    ignored = [k for k in ddp_given if k not in SHARDED_DDP_ARGUMENTS]
    if name != "NO_SHARD" and ignored:
        raise ValueError(f"sharding_strategy={name!r} shards each stage with FSDP2 instead of wrapping it in "
                         f"DistributedDataParallel, so {', '.join(ignored)} would do nothing: leave them out, or "
                         "use sharding_strategy='NO_SHARD' (DDP per stage)")
    return name


def check_tensor_parallel(size: Any, plan: Any, sharding: str, ddp_given: list[str], planned: bool = False) -> None:
    """Reject a ``tensor_parallel_size`` that is not a positive integer, a ``tensor_parallel_plan`` that is neither a
    mapping nor a function, ``HYBRID_SHARD`` with it, and DDP arguments that would do nothing (stages split by tensor
    parallel are averaged over their replicas without DDP). The plan itself is checked against the body at setup.
    ``planned``: the size is left to the layout's plan (``"auto"``, ``size`` its placeholder): a plan given is
    checked as for a split, which the layout's plan may choose, and not refused for the placeholder's 1."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size is how many processes split each stage, a positive integer (got: "
                         f"{size!r})")
    if plan is not None and not isinstance(plan, Mapping) and not callable(plan):
        raise TypeError(f"tensor_parallel_plan must be a dict from the body's module names to styles, or a function "
                        f"(stage_module, tp_mesh) -> None (got: {type(plan).__name__})")
    if size == 1 and (plan is None or not planned):
        if plan is not None:
            raise ValueError("tensor_parallel_plan is given with tensor_parallel_size=1, which splits nothing: the "
                             "plan would be ignored. Set tensor_parallel_size to how many processes split each stage "
                             "(2 or more), or leave tensor_parallel_plan out")
        return
    shown = "'auto'" if planned else size
    if callable(plan) and not isinstance(plan, Mapping):  # it travels to every stage's processes, pickled
        import pickle

        try:
            pickle.dumps(plan)
        except Exception as exc:  # noqa: BLE001 - pickle raises several kinds
            raise TypeError(f"tensor_parallel_plan={plan!r} cannot be pickled ({type(exc).__name__}: {exc}), and "
                            "every stage's processes must receive it: define it as a function at the top level of "
                            "a module (not a lambda, a nested function or a bound method of an object that does "
                            "not pickle)") from exc
    if sharding == "HYBRID_SHARD":
        raise ValueError(f"sharding_strategy='HYBRID_SHARD' with tensor_parallel_size={shown} is not supported: use "
                         "'FULL_SHARD' or 'SHARD_GRAD_OP' (each stage sharded over every replica), or 'NO_SHARD'")
    ignored = [k for k in ddp_given if k not in SHARDED_DDP_ARGUMENTS]
    if ignored:
        raise ValueError(f"tensor_parallel_size={shown} averages each split stage over its replicas without "
                         f"DistributedDataParallel (which takes no DTensor), so {', '.join(ignored)} would do nothing: "
                         "leave them out, or use tensor_parallel_size=1")


def check_replicas(setting: str, shard_size: int | None, topology: Topology) -> None:
    """Once the number of replicas is known (the Trainer's devices and nodes), before any process starts: refuse a
    ``hybrid_shard_size`` that does not divide it, and warn that ``sharding_strategy`` does nothing with one
    replica (as DDP's arguments do: a setting of the job's size, not of the arguments, so a configuration made for
    several replicas still runs on one; each process then keeps its whole stage, as with ``NO_SHARD``)."""
    if setting == "NO_SHARD":
        return
    replicas = topology.replicas
    layout = f"devices x nodes: {topology.world}, processes per pipeline: {topology.stages}"
    if replicas == 1:
        rank_zero_warn(f"PipeStrategy(sharding_strategy={setting!r}) has no effect with one replica ({layout}): a "
                       "stage has no other replica to be sharded over, so each process keeps its whole stage, as with "
                       "'NO_SHARD'. Use devices x nodes = processes per pipeline x replicas with 2 replicas or more "
                       "to shard, or sharding_strategy='NO_SHARD' on one replica")
    elif shard_size is not None and replicas % shard_size:
        divisors = [d for d in range(1, replicas + 1) if replicas % d == 0]
        raise ValueError(f"hybrid_shard_size must divide the number of replicas of each stage (hybrid_shard_size: "
                         f"{shard_size}, replicas: {replicas}; {layout}): use one of {divisors}, or devices x nodes "
                         f"= {topology.stages} x a multiple of {shard_size}")


def check_settings(trainer: pl.Trainer | None, sync_batchnorm: bool) -> None:
    """Reject Trainer settings and callbacks that cannot work across stages in other processes."""
    if sync_batchnorm:
        raise ValueError(
            "Trainer(sync_batchnorm=True) is not supported by PipeStrategy: torch's SyncBatchNorm runs on GPUs only, "
            "and in a pipeline it would normalise each micro-batch with the statistics of the same micro-batch of "
            "every replica (a collective per micro-batch and per recomputation), which no run on several GPUs has "
            "checked yet. Use PipeStrategy(deferred_batch_norm=True), which gives each replica the running "
            "statistics of its whole batch (with broadcast_buffers, the default, every replica's buffers follow "
            "replica 0's at each step), and leave sync_batchnorm off")
    from pytorch_lightning import callbacks as pl_callbacks
    from pytorch_lightning.callbacks import BackboneFinetuning, BaseFinetuning, ModelPruning, StochasticWeightAveraging

    # WeightAveraging (EMAWeightAveraging) exists from Lightning 2.6 on.
    weight_averaging = getattr(pl_callbacks, "WeightAveraging", StochasticWeightAveraging)
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, BackboneFinetuning):
            raise ValueError(
                "the BackboneFinetuning callback is not supported by PipeStrategy: it adds a parameter group "
                "to the optimizer during training, which the stages in other processes cannot follow. Put "
                "every parameter in the optimizer from the start and freeze or unfreeze layers by "
                "requires_grad (BaseFinetuning.freeze and make_trainable in your own callback), which reaches "
                "every stage")
        if isinstance(callback, BaseFinetuning):  # its own finetune_function may add a group: said, if it does
            callback.unfreeze_and_add_param_group = functools.partial(_no_group_added, type(callback).__name__)
        if isinstance(callback, (StochasticWeightAveraging, weight_averaging, ModelPruning)):
            averaging = isinstance(callback, (StochasticWeightAveraging, weight_averaging))
            instead = " and average saved checkpoints' weights instead" if averaging else ""
            raise ValueError(
                f"the {type(callback).__name__} callback is not supported by PipeStrategy: it changes the "
                "weights of the driver's copy of the model, where only stage 0's layers are (the other "
                "stages' live in their own processes), so it would fail or leave them unchanged. Remove it "
                "from Trainer(callbacks=...)" + instead)


def _no_group_added(name: str, *args: Any, **kwargs: Any) -> None:
    """A finetuning callback's ``unfreeze_and_add_param_group`` under PipeStrategy (it failed inside Lightning, on the
    placeholders of the other stages' parameters, with torch's words about meta tensors)."""
    raise ValueError(
        f"{name}.unfreeze_and_add_param_group adds a parameter group to the optimizer during training, which the "
        "stages in other processes cannot follow. Put every parameter in the optimizer from the start and unfreeze "
        "layers by requires_grad (BaseFinetuning.make_trainable), which reaches every stage")


def body_of(module: pl.LightningModule, module_name: str) -> Any:
    """The LightningModule's body (``module.<module_name>``), or an error that says where to put it."""
    body = getattr(module, module_name, None)
    if body is None:
        raise AttributeError(
            f"{type(module).__name__} has no attribute '{module_name}': PipeStrategy partitions the "
            f"nn.Sequential held there. Put the layers in self.{module_name} = nn.Sequential(...), or "
            "pass PipeStrategy(module_name=...) naming the attribute that holds them")
    return body


def check_model(module: pl.LightningModule, module_name: str, balance: list[int] | None, stages: int) -> None:
    """Reject a LightningModule that cannot be split into ``stages`` stages by ``balance``, with what to
    change. A body built in ``configure_model`` is checked when it exists, at setup."""
    if getattr(module, module_name, None) is None and is_overridden("configure_model", module):
        return
    body = body_of(module, module_name)
    if isinstance(body, PipelinedSequential):
        return
    check_sequential(body, f"{type(module).__name__}.{module_name}")  # shared across stages: lightning/tied.py
    verify_skippables(body)
    if balance is not None:
        check_balance_sum(body, balance, f"{type(module).__name__}.{module_name}")
    elif getattr(module, "example_input_array", None) is None:
        raise ValueError(
            f"PipeStrategy(balance=None) infers the split from {type(module).__name__}.example_input_array, "
            "which is not set: set self.example_input_array to one batch of inputs in __init__, or pass "
            f"balance=[...] with {stages} entries summing to {len(body)}")
    elif len(body) < stages:
        raise ValueError(f"too few layers to split into one stage per device (layers: {len(body)}, "
                         f"stages: {stages}); pass balance=[...] and fewer devices")


def check_balance_sum(body: Any, balance: list[int], where: str) -> None:
    """Reject a ``balance`` that does not sum to the layers of the body ``where`` (``Model.sequential_module``),
    saying how many layers to add or remove and suggesting a balance with as many stages that does."""
    layers, total = len(body), sum(balance)
    if total == layers:
        return
    stages = len(balance)
    given = f"(PipeStrategy(balance={balance}) sums to {total})"
    if layers < stages:
        raise ValueError(f"balance must sum to the {layers} layers of {where} {given}, and {stages} stages need at "
                         f"least {stages} layers: use fewer stages (at most {layers}), or add layers to {where}")
    base, extra = divmod(layers, stages)
    even = [base + 1] * extra + [base] * (stages - extra)
    difference = abs(layers - total)
    count, whom = ("a layer", "a stage") if difference == 1 else (f"{difference} layers", "the stages")
    change = f"add {count} to {whom}" if total < layers else f"remove {count} from {whom}"
    raise ValueError(f"balance must sum to the {layers} layers of {where} {given}: {change}, e.g. balance={even}")


def warn_batch_norm(body: Any, microbatches: int, name: str) -> None:
    """Warn where ``body`` has BatchNorm layers and batches are split into ``microbatches`` > 1: in training each
    micro-batch is normalised with its own mean and variance, so the weights are not one device's."""
    norms = [n for n, m in body.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms and isinstance(microbatches, int) and microbatches > 1:
        rank_zero_warn(
            f"PipeStrategy(microbatches={microbatches}): {name}.{norms[0]} (and {len(norms) - 1} more BatchNorm "
            "layers) normalises each micro-batch with its own mean and variance in training, where one device "
            "normalises the whole batch: the weights are not one device's (deferred_batch_norm=True makes the running "
            "statistics the whole batch's, not the normalisation). microbatches=1 gives one device's; GroupNorm or "
            "LayerNorm do not depend on the batch")
