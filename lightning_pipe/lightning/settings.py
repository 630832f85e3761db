"""The arguments both loops' ``PipeStrategy`` take (the Trainer's and Fabric's): checked once, set on the strategy.

Each strategy's constructor passes its own arguments through :func:`pipeline_settings` before building its
``DDPStrategy`` with the rest, then sets what it returns; so the two loops accept, refuse and default the same
arguments with the same words.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_pipe.engine.planning import parse_bytes
from lightning_pipe.engine.schedule import schedule_from, stages_per_process
from lightning_pipe.lightning import checks, ddp
from lightning_pipe.transport.wire.dataplane import DATA_PLANES

__all__: list[str] = []

#: The pipeline's own arguments, with their defaults (those of both strategies' constructors).
DEFAULTS: dict[str, Any] = {
    "balance": None, "microbatches": 8, "checkpoint": "except_last", "balance_mode": "balance_by_size",
    "pipelined_backward": True, "rpc_timeout_sec": 60.0, "module_name": "sequential_module",
    "deferred_batch_norm": False, "timeline": None, "schedule": "gpipe", "virtual_stages": None,
    "state_dict_type": "full", "sharding_strategy": "NO_SHARD", "hybrid_shard_size": None, "data_plane": "auto",
    "tensor_parallel_size": 1, "tensor_parallel_plan": None, "memory_per_device": None,
}

#: The arguments that take ``"auto"`` (chosen by the planner before the processes start), and what each is checked
#: as meanwhile.
AUTO = {"balance": None, "microbatches": 8, "schedule": "gpipe", "checkpoint": "except_last", "tensor_parallel_size": 1,
        "sharding_strategy": "NO_SHARD"}


def pipeline_settings(base: type, cls: type, given: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check the pipeline's arguments ``given`` (named as in :data:`DEFAULTS`) and the DDP keywords ``kwargs`` of a
    ``cls`` being built, a subclass of the loop's ``PipeStrategy`` ``base`` (whose arguments are the known names; a
    subclass's own ``configure_ddp`` is refused with sharding), and return the attributes to set on it; ``kwargs``
    gets PipeStrategy's DDP defaults."""
    values = {**DEFAULTS, **given}
    auto = tuple(name for name in AUTO if isinstance(values[name], str) and values[name] == "auto")
    values.update({name: AUTO[name] for name in auto})
    if "schedule" in auto and (values["virtual_stages"] or 1) > 1:  # checked meanwhile as a schedule that takes them
        values["schedule"] = "interleaved-1f1b"
    if "sharding_strategy" in auto and values["hybrid_shard_size"] is not None:
        raise ValueError(f"hybrid_shard_size={values['hybrid_shard_size']!r} sets HYBRID_SHARD's shard groups, and "
                         "sharding_strategy='auto' may choose another sharding: give sharding_strategy='HYBRID_SHARD' "
                         "with it, or leave hybrid_shard_size out")
    if values["memory_per_device"] is not None:
        values["memory_per_device"] = parse_bytes(values["memory_per_device"])
        if not auto:
            raise ValueError(
                f"memory_per_device={given['memory_per_device']!r} is the budget of the planner, which chooses the "
                f"arguments left to 'auto' ({', '.join(AUTO)}), and none is: set those it should choose to 'auto', or "
                "leave memory_per_device out")
    values["schedule"] = schedule_from(values["schedule"], values["microbatches"])
    checks.check_pipelined_backward(values["pipelined_backward"], "auto" if "schedule" in auto else values["schedule"])
    if values["virtual_stages"] is None:
        values["virtual_stages"] = stages_per_process(values["schedule"])
    values["balance"] = checks.check_arguments(values["balance"], values["microbatches"], values["checkpoint"],
                                               values["balance_mode"], values["rpc_timeout_sec"],
                                               values["module_name"], values["schedule"], values["virtual_stages"],
                                               kwargs)
    checks.check_choice("state_dict_type", values["state_dict_type"], ("full", "sharded"))
    checks.check_choice("data_plane", values["data_plane"], DATA_PLANES)
    ddp.check_arguments(kwargs, [n for n in inspect.signature(base).parameters if n != "kwargs"])
    explicit = [k for k, v in kwargs.items() if (k in ddp.LIGHTNING[:4] and v is not None)
                or (k not in ddp.LIGHTNING and not ddp.is_default(k, v))]
    values["sharding_strategy"] = checks.check_sharding(values["sharding_strategy"], values["hybrid_shard_size"],
                                                        explicit)
    checks.check_tensor_parallel(values["tensor_parallel_size"], values["tensor_parallel_plan"],
                                 values["sharding_strategy"], explicit, planned="tensor_parallel_size" in auto)
    if values["tensor_parallel_size"] > 1 and getattr(cls, "configure_ddp", None) is not base.configure_ddp:
        raise ValueError(f"{cls.__name__} overrides configure_ddp, which stages split by tensor parallel never call "
                         f"(tensor_parallel_size={values['tensor_parallel_size']}: their replicas average their "
                         "DTensor gradients by all-reduce, no DDP): leave configure_ddp alone, or use "
                         "tensor_parallel_size=1")
    if values["sharding_strategy"] != "NO_SHARD" and getattr(cls, "configure_ddp", None) is not base.configure_ddp:
        raise ValueError(f"{cls.__name__} overrides configure_ddp, which sharded stages never call "
                         f"(sharding_strategy={values['sharding_strategy']!r} shards each stage with FSDP2, no DDP): "
                         "use sharding_strategy='NO_SHARD' with it, or leave configure_ddp alone")
    ddp.defaults(kwargs)
    values["rpc_timeout_sec"] = float(values["rpc_timeout_sec"])
    values["_ddp_explicit"] = explicit
    values["_auto"] = auto
    values["_given_virtual_stages"] = given.get("virtual_stages")
    return values


def sharding_of(strategy: Any) -> Any:
    """How each stage of ``strategy`` is sharded over its replicas (None: DDP, ``NO_SHARD``)."""
    if strategy.sharding_strategy == "NO_SHARD":
        return None
    from lightning_pipe.transport.parallel.fsdp import Sharding

    return Sharding(strategy.sharding_strategy, strategy.hybrid_shard_size,
                    broadcast_buffers=strategy._ddp_kwargs.get("broadcast_buffers", True) is not False)
