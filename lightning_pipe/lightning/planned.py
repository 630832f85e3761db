"""``PipeStrategy``'s ``"auto"`` arguments: chosen by the planner before any process starts, the same in every process,
the choice and its prediction logged, and each process's measured peak compared with the prediction once training
has taken its steps."""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_pipe.engine.planning import Costs, LayoutPlan, format_bytes, plan_layout
from lightning_pipe.engine.planning.layouts import Layout
from lightning_pipe.transport.parallel.measured import collective_costs
from lightning_pipe.transport.stages import resident
from lightning_pipe.transport.wire.measured import handoff_costs

__all__: list[str] = []

#: Where the launching process leaves its choice for the processes it starts (they run the script again).
LAYOUT_ENV = "LIGHTNING_PIPE_LAYOUT"
#: How far above its prediction a process's measured peak may be before a warning says so (and by at least
#: :data:`FLOOR` bytes: the runtime's own memory varies by tens of MiB from one job to another).
TOLERANCE, FLOOR = 0.10, 64 * 2**20


def _machine_share(devices: int) -> int:
    """This machine's memory divided by ``devices`` (the processes share it), for CPU processes."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return total // devices


def _optimizer(module: Any) -> Any:
    """The optimizer ``configure_optimizers`` makes, as a function of parameters (its class and settings); AdamW's
    where it cannot be called before fit (it reads the Trainer), said in the log."""
    try:
        made = module.configure_optimizers()
    except Exception as exc:  # noqa: BLE001 - a configure_optimizers that needs the Trainer: assume Adam's state
        rank_zero_info(f"PipeStrategy: configure_optimizers() could not be called before fit ({type(exc).__name__}: "
                       f"{exc}); the plan assumes an optimizer keeping two states per parameter (Adam's)")
        return torch.optim.AdamW
    return _optimizer_of(made)


def _optimizer_of(made: Any) -> Any:
    """The optimizer ``made`` (or the first of a list, or a ``configure_optimizers`` dict's) as a function of
    parameters; None where there is none."""
    while isinstance(made, (list, tuple)) and made:
        made = made[0]
    if isinstance(made, dict):
        made = made.get("optimizer")
    if not isinstance(made, torch.optim.Optimizer):
        return None
    defaults = {k: v for k, v in made.defaults.items() if k in inspect.signature(type(made)).parameters}
    return lambda params: type(made)(params, **defaults)


def _loss_on_last_stage(module: Any) -> bool:
    """Whether ``training_step`` computes the loss on the last stage (every schedule but GPipe needs it), as its
    source says (``loss_on_last_stage`` or ``pipeline_loss``); False where the source cannot be read."""
    try:
        source = inspect.getsource(type(module).training_step)
    except (OSError, TypeError):
        return False
    return calls_loss_on_last_stage(source)


def calls_loss_on_last_stage(source: str) -> bool:
    """Whether the code ``source`` calls ``loss_on_last_stage`` or ``pipeline_loss`` (a call, not the name in a
    comment or a string); where it does not parse, whether it names them."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return "loss_on_last_stage" in source or "pipeline_loss" in source
    names = ("loss_on_last_stage", "pipeline_loss")
    return any(isinstance(node, ast.Call) and (isinstance(node.func, ast.Name) and node.func.id in names or
                                               isinstance(node.func, ast.Attribute) and node.func.attr in names)
               for node in ast.walk(tree))


def constraints(strategy: Any) -> Any:
    """What the arguments not left to ``"auto"`` fix, but the balance (:func:`plan` passes it): a predicate on a
    :class:`Layout`."""
    auto = set(strategy._auto)
    fixed_v = getattr(strategy, "_given_virtual_stages", None)

    def allowed(layout: Layout) -> bool:
        return (layout.replicas == strategy.num_nodes  # as balance=None: a pipeline per node, a step's samples kept
                and ("microbatches" in auto or layout.microbatches == strategy.microbatches)
                and ("schedule" in auto or layout.schedule == strategy.schedule)
                and ("checkpoint" in auto or layout.checkpoint == strategy.checkpoint)
                and ("tensor_parallel_size" in auto or layout.tensor_parallel_size == strategy.tensor_parallel_size)
                and ("sharding_strategy" in auto or layout.sharding_strategy == strategy.sharding_strategy)
                and (fixed_v is None or layout.virtual_stages == fixed_v))

    return allowed


def measured_costs(processes: int, probes: Sequence[tuple[int, int, int]] = ()) -> Costs:
    """This machine's collectives and hand-offs, measured between ``processes`` processes started for it; tensor
    parallel's on pairs of Linear layers of ``probes``' shapes (:func:`~lightning_pipe.engine.planning.tensor_probes`:
    as the body's split layers)."""
    return Costs(**collective_costs(processes, extra=handoff_costs, tensor_pairs=probes))


def plan(strategy: Any, module: Any, precision: str, optimizer: Any, last: bool) -> LayoutPlan:
    """The plan of ``module``'s body for ``strategy``'s devices, within its ``memory_per_device`` (on a GPU its
    memory; on the CPU this machine's divided among the processes), trained at ``precision`` by ``optimizer`` (a
    function of parameters), the loss on the last stage where ``last``."""
    example = getattr(module, "example_input_array", None)
    if example is None:  # a bare nn.Sequential given to Fabric: its own
        example = getattr(getattr(module, strategy.module_name, None), "example_input_array", None)
    if example is None:
        raise ValueError(f"PipeStrategy({', '.join(f'{n}=auto' for n in strategy._auto)}) plans the layout from "
                         f"{type(module).__name__}.example_input_array (one batch as a replica's loader gives it), "
                         "which is not set: set it in __init__, or pass those arguments")
    devices = strategy.num_processes * strategy.num_nodes
    if "sharding_strategy" not in strategy._auto and strategy.sharding_strategy != "NO_SHARD" and \
            strategy.num_nodes == 1:
        raise ValueError(
            f"PipeStrategy(sharding_strategy={strategy.sharding_strategy!r}) shards each stage over its replicas, and "
            f"the layout left to 'auto' ({', '.join(strategy._auto)}) has one pipeline per node (a step trains the "
            "samples one device would): on one node no stage has a replica to shard over. Leave sharding_strategy to "
            "'auto' or 'NO_SHARD', or give the layout without 'auto' (a balance on more devices than stages "
            "replicates the stages)")
    device = strategy.root_device
    budget = strategy.memory_per_device
    if budget is None:
        budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else \
            _machine_share(strategy.num_processes)
    auto = set(strategy._auto)
    costs = None
    if device.type == "cpu" and devices > 1:  # this machine's collectives, between processes started for it
        costs = partial(measured_costs, min(strategy.num_processes, os.cpu_count() or 1))
    return plan_layout(
        module, example, devices=devices, memory_per_device=budget, optimizer=optimizer, precision=precision,
        device=device, module_name=strategy.module_name,
        tensor_parallel_plan=strategy.tensor_parallel_plan if "tensor_parallel_size" in auto or
        strategy.tensor_parallel_size > 1 else None, loss_on_last_stage=last, where=constraints(strategy),
        balance=None if "balance" in auto else strategy.balance, costs=costs)


def apply(strategy: Any, arguments: dict[str, Any]) -> None:
    """Set the chosen layout's arguments on ``strategy`` (those it left to ``"auto"``, and the stages per process
    the chosen schedule takes)."""
    for name in strategy._auto:
        setattr(strategy, name, arguments[name])
    if getattr(strategy, "_given_virtual_stages", None) is None:
        strategy.virtual_stages = arguments["virtual_stages"]
    strategy._predicted = arguments.get("_peaks")
    strategy._budget = arguments.get("_budget")


def resolve(strategy: Any, module: Any, trainer: Any) -> None:
    """Choose what ``strategy`` left to ``"auto"``: in the launching process by the plan (its choice handed to the
    processes it starts), in those by what it handed them. Processes started by another (torchrun, SLURM) plan once
    they have met (:func:`resolve_after_launch`, as ``setup`` builds the pipeline): there the tensor size, which
    decides at launch which process does what, cannot be left to the plan, and is refused."""
    if not strategy._auto or getattr(strategy, "_planned", False):
        return
    handed = json.loads(os.environ.get(LAYOUT_ENV, "{}"))
    if handed.get("_for") == type(module).__qualname__:  # the launching process's plan of this model
        if handed.get("_given") != _given(strategy):
            chosen = {name: handed[name] for name in handed.get("_given", {}).get("auto", []) if name in handed}
            raise ValueError(
                f"this program planned the layout of {type(module).__name__} for a first Trainer (arguments left to "
                f"'auto' and budget: {handed.get('_given')}); a later Trainer of the same program runs in the same "
                f"processes, with that layout, and asks for another ({_given(strategy)}): give it the same 'auto' "
                f"arguments and memory_per_device, or the layout chosen then as its arguments ({chosen})")
        apply(strategy, handed)
    elif strategy.cluster_environment is not None and strategy.cluster_environment.creates_processes_externally:
        refuse_after_launch(strategy._auto, "these processes were started by another launcher (torchrun, SLURM)",
                            "the Trainer's setup")
        strategy._plan_after_launch = True
        return
    else:
        found = plan(strategy, module, str(getattr(trainer, "precision", "32-true")), _optimizer(module),
                     _loss_on_last_stage(module))
        arguments = _chosen(strategy, module, found)
        apply(strategy, arguments)
        os.environ[LAYOUT_ENV] = json.dumps(arguments)
    strategy._planned = True


def _chosen(strategy: Any, module: Any, found: LayoutPlan) -> dict[str, Any]:
    """The arguments of the layout ``found`` chose for ``module``, each process's predicted peak beside them; the
    table logged."""
    rank_zero_info(f"PipeStrategy: the layout planned for {type(module).__name__} "
                   f"({', '.join(strategy._auto)} chosen):\n{found.table(5)}")
    return {**found.layout.arguments(), "_peaks": [m.total for m in found.chosen.memory],
            "_budget": found.budget, "_for": type(module).__qualname__, "_given": _given(strategy)}


def _given(strategy: Any) -> dict[str, Any]:
    """What a plan was asked for: the arguments ``strategy`` left to ``"auto"`` and its budget."""
    return {"auto": sorted(strategy._auto), "memory_per_device": strategy.memory_per_device}


def refuse_after_launch(auto: Sequence[str], started: str, when: str) -> None:
    """Refuse what cannot be left to ``"auto"`` where the processes were ``started`` before any plan (Fabric's
    ``launch()``, torchrun, SLURM): ``tensor_parallel_size``, which decides there which process does what; the rest
    is planned at ``when``."""
    if "tensor_parallel_size" in auto:
        raise ValueError(
            f"{started[0].upper()}{started[1:]} before any layout was planned, and tensor_parallel_size decides as "
            "they start which process does what, so PipeStrategy(tensor_parallel_size='auto') cannot be planned "
            f"there: pass a size (the other layout arguments may stay 'auto': they are planned at {when}), or plan "
            "the whole layout first with lightning_pipe.plan_layout(model, example_input, devices=..., "
            "memory_per_device=...) or `python -m lightning_pipe plan`, and pass "
            "PipeStrategy(**plan.layout.arguments()) (docs/planning.md)")


def resolve_after_launch(strategy: Any, module: Any, precision: str, optimizer: Any, last: bool) -> None:
    """Choose what ``strategy`` left to ``"auto"`` where its processes were started before any plan (Fabric's
    ``launch()``, torchrun, SLURM), as the pipeline is built (the processes have met; as many per pipeline as
    launched): planned by the first driver for ``optimizer`` (a function of parameters) at ``precision``, the loss on
    the last stage where ``last``, its choice broadcast to the other drivers (each would measure its own plan)."""
    if not strategy._auto or getattr(strategy, "_planned", False):
        return
    arguments = None
    if strategy.is_global_zero:
        arguments = _chosen(strategy, module, plan(strategy, module, precision, optimizer, last))
    if strategy.topology.pipelines > 1:
        arguments = strategy.broadcast(arguments, 0)
    apply(strategy, arguments)
    resident.remember_base()  # the peak from here on: the plan's own measurements are not what the stages hold
    strategy._planned = True


def resolve_in_fabric(strategy: Any, module: Any, optimizers: Sequence[Any]) -> None:
    """Fabric's :func:`resolve_after_launch` as ``fabric.setup`` builds the pipeline: for the ``optimizers`` given to
    it and Fabric's precision, the loss on the last stage where the script calls ``loss_on_last_stage``."""
    resolve_after_launch(strategy, module, str(strategy.precision.precision), _optimizer_of(list(optimizers)),
                         _loss_in_script(module))


def resolve_in_setup(strategy: Any, module: Any, trainer: Any) -> None:
    """The Trainer's :func:`resolve_after_launch` (processes started by torchrun or SLURM) as its ``setup`` builds the
    pipeline: ``configure_optimizers``'s optimizer and the Trainer's precision."""
    if getattr(strategy, "_plan_after_launch", False):
        resolve_after_launch(strategy, module, str(trainer.precision), _optimizer(module),
                             _loss_on_last_stage(module))


def _loss_in_script(module: Any) -> bool:
    """Whether a Fabric loop computes the loss on the last stage: its script (or the module's class) calls
    ``loss_on_last_stage`` or ``pipeline_loss``, as its source says; False where no source can be read."""
    for where in (sys.modules.get("__main__"), type(module)):
        try:
            source = inspect.getsource(where)  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue
        if calls_loss_on_last_stage(source):
            return True
    return False


def check_after_steps(strategy: Any, memory: Callable[[], list[dict[str, int]]]) -> None:
    """Count a Fabric loop's optimizer steps; after the second (the optimizer's state made), each process's peak
    against the plan's (:func:`check_peaks` of ``memory()``)."""
    strategy._lp_steps = getattr(strategy, "_lp_steps", 0) + 1
    if strategy._lp_steps == 2 and getattr(strategy, "_predicted", None):
        check_peaks(strategy, memory())


def check_peaks(strategy: Any, measured: list[dict[str, int]]) -> None:
    """Warn where a process of the driver's pipeline holds more than :data:`TOLERANCE` above its predicted peak, or
    more than the budget the plan was made for (``measured``: ``memory_per_process()``'s, each process's peak above
    what it held as its session started; on GPUs, what it allocated there)."""
    predicted = getattr(strategy, "_predicted", None)
    if not predicted:
        return
    ranks = max(1, len(measured) // len(predicted))
    on_gpu = strategy.root_device.type == "cuda"  # what the plan predicts: the GPU's memory there, else the host's
    budget = getattr(strategy, "_budget", None)
    for k, report in enumerate(measured):
        peak, base = ("device_peak", "device_base") if on_gpu else ("peak", "base")
        held = report.get(peak, 0) - report.get(base, 0)
        want = predicted[min(k // ranks, len(predicted) - 1)]
        over = budget is not None and held > budget
        if (on_gpu or report.get("base")) and (over or held > (1 + TOLERANCE) * want and held - want > FLOOR):
            warnings.warn(f"PipeStrategy: process {k} of the pipeline holds {format_bytes(held)} at its peak, "
                          f"{held / want - 1:.0%} above the planned {format_bytes(want)}"
                          + (f", over memory_per_device ({format_bytes(budget)})" if over else "")
                          + " (docs/planning.md says what the plan cannot see)", stacklevel=2)
