"""The user's optimizers across stages: built once on the driver, mirrored on every stage, stepped as one.

``configure_optimizers`` runs on the driver over the whole LightningModule (the layers of remote stages are
placeholders there, with their real names), so parameter groups built from names work as on one device.
Each stage then builds the same optimizer class over its own parameters (:mod:`lightning_pipe.transport.stages.optim`).
As soon as the driver's step has its final gradients (its closure evaluated, clipping included), every remote
stage starts its part with the same hyper-parameters (learning rates moved by schedulers included), while the
driver updates its own parameters; :meth:`StageOptimizers.step_remote` (``PipeStrategy.post_optimizer_step``)
waits for them and raises their errors. Zeroing reaches every stage at once; checkpoints hold the state the
plain model's optimizer would have.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from lightning_pipe.lightning.tied import TiedSync, add_twins, twin_states
from lightning_pipe.transport.stages import optim
from lightning_pipe.transport.stages.remote import HostGroup

__all__: list[str] = []


class _MirroredOptimizer:
    """Mixed into the driver's optimizers: ``step`` has every remote stage start its part of the step as soon as
    the gradients are final (the closure evaluated, once), with the driver's hyper-parameters, while the driver
    updates its own parameters; ``zero_grad`` acts on every stage."""

    _lp_hosts: HostGroup
    _lp_index: int
    _lp_stepping: list[Future[Any]] | None
    _lp_before_update: Callable[[], None]
    _lp_owner: StageOptimizers

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        evaluations = [0]

        def once() -> Any:
            evaluations[0] += 1
            if evaluations[0] > 1:
                raise RuntimeError(
                    f"{type(self).__name__}.step evaluated its closure a second time in one step (as LBFGS and "
                    "sharpness-aware optimizers such as SAM do): the stages in other processes step once, as soon "
                    "as the first evaluation is over, and cannot follow a second one. Use an optimizer that "
                    "evaluates the closure once per step (SGD, Adam, AdamW, ...)")
            result = closure()  # type: ignore[misc]
            self._lp_start()
            return result

        if closure is None:
            self._lp_start()  # the gradients are final already (manual optimization, a gradient scaler's step)
            return super().step()  # type: ignore[misc]
        loss = super().step(once)  # type: ignore[misc]
        if self._lp_stepping is None:  # an optimizer that did not evaluate the closure
            self._lp_start()
        return loss

    def _lp_start(self) -> None:
        """The remote stages start their part of this step, with the hyper-parameters the driver's uses; this
        process's stages are ready for their update (whole copies of sharded parameters dropped)."""
        self._lp_stepping = self._lp_hosts.start("step", self._lp_index, optim.hyperparameters(self),
                                                 plane=True)  # type: ignore[arg-type]
        before = getattr(self, "_lp_before_update", None)
        if before is not None:
            before()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        # No round trip: it goes with what next reaches each process (its step, the optimizer's step, a read of the
        # gradients), which applies it first.
        self._lp_hosts.call_later("zero_grad", self._lp_index, set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the plain model's optimizer's state (as one device's optimizer, or this one's whole
        ``state_dict`` in a Fabric loop, gives it): each stage's part reaches its stage."""
        self._lp_owner.load(self, state_dict)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The plain model's optimizer's state, every stage's part fetched (as one device's optimizer holds it): a
        snapshot that :meth:`load_state_dict` puts back in every stage. Refused where no process can hold it whole
        (stages split over tensor ranks or sharded over their replicas)."""
        return self._lp_owner.whole_state(self)  # type: ignore[arg-type]

    def held_state_dict(self) -> dict[str, Any]:
        """This process's part of the state alone (what its stages' parameters hold), as a plain optimizer's
        ``state_dict`` is laid out."""
        return super().state_dict()  # type: ignore[misc]


def load_held(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load ``state``, in the form this process's part of ``optimizer`` holds it (:func:`optim.as_held`), into
    that part alone (a mirrored optimizer's ``load_state_dict`` takes the whole model's, for every stage)."""
    if isinstance(optimizer, _MirroredOptimizer):
        super(_MirroredOptimizer, optimizer).load_state_dict(state)  # type: ignore[misc]
    else:
        optimizer.load_state_dict(state)


def mix_in(obj: Any, mixin: type) -> None:
    """Give ``obj`` a class that puts ``mixin`` before its own (as Lightning does for LightningOptimizer)."""
    cls = type(obj)
    if not isinstance(obj, mixin):
        # The names stay the original's: Lightning keys checkpoint entries by the qualified name (the precision
        # plugin's scaler state is saved under "MixedPrecision", and must load back under that key), and
        # LearningRateMonitor its metrics by the class name ("lr-SGD", as on one device).
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        obj.__class__ = type(cls.__name__, (mixin, cls), names)


def _mirror(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` record its steps and zero every stage.

    An LR scheduler wraps ``optimizer.step`` on the instance, bound to the class's function at that time;
    that wrapper would bypass the mirrored ``step`` and leave the step unrecorded, so it is replaced by one
    that keeps the scheduler's bookkeeping and calls the mirrored ``step``.
    """
    mix_in(optimizer, _MirroredOptimizer)
    optimizer._lp_stepping = None  # type: ignore[attr-defined]
    if "step" not in vars(optimizer):
        return
    owner = weakref.ref(optimizer)
    mirrored = type(optimizer).step

    @functools.wraps(mirrored)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        assert opt is not None
        opt._opt_called = True  # type: ignore[attr-defined] - what the scheduler's wrapper records
        return mirrored(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def raw(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer behind a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


class StageOptimizers:
    """The driver's optimizers and their parts on the remote stages of one pipeline.

    ``stage_of(name)`` gives the stage holding LightningModule parameter ``name``.
    """

    def __init__(self, hosts: HostGroup, stage_of: Callable[[str], int], processes: int, tied: TiedSync | None = None,
                 sharded: Callable[[], bool] = lambda: False) -> None:
        self.hosts = hosts
        self.sharded = sharded  # whether the stages are split or sharded (no process holds a whole state)
        self.stage_of = stage_of
        self.processes = processes
        self.tied = tied  # the parameters tied across processes: every copy in its process's part
        self.count = 0
        self.before_update: Callable[[], None] = lambda: None  # this process's stages, before their update

    def mirror(self, optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str],
               amp_scaler: Any = None, precision: str = "") -> None:
        """Make each of ``optimizers`` (the driver's, over the whole module: ``names`` maps parameter ids to
        names) an optimizer of every stage: its part is built on each remote stage."""
        per_stage: list[list[optim.OptimizerSpec | None]] = [[] for _ in range(self.processes)]
        self.count = len(optimizers)  # how many are mirrored (a sharded save holds them all)
        for k, optimizer in enumerate(optimizers):
            if amp_scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                # Such an optimizer unscales and skips inside its own step, where the other stages' gradients
                # and overflows cannot reach.
                raise ValueError(f"{type(optimizer).__name__}(fused=True) cannot be used with a gradient scaler "
                                 f"(precision={precision!r}) across pipeline stages: build it with fused=False "
                                 "(the default), or use precision='bf16-mixed'")
            optimizer._lp_names = optim.flat_names(optimizer, names)  # type: ignore[attr-defined]
            specs = optim.specs_for_stages(optimizer, names, self.stage_of, self.processes)
            if self.tied is not None:
                add_twins(specs, optimizer, names, self.tied.tied)
            for j, spec in enumerate(specs):
                per_stage[j].append(spec)
            optim.drop_placeholder_state(optimizer)
            optimizer._lp_hosts = self.hosts  # type: ignore[attr-defined]
            optimizer._lp_index = k  # type: ignore[attr-defined]
            optimizer._lp_before_update = self.before_update  # type: ignore[attr-defined]
            optimizer._lp_tied = self.tied  # type: ignore[attr-defined] - summed before clipping
            optimizer._lp_owner = self  # type: ignore[attr-defined] - loads reach every stage through it
            _mirror(optimizer)
        for j, future in enumerate(self.hosts.start_each("build_optimizers", per_stage[1:]), start=1):
            try:
                future.result()
            except Exception as exc:
                exc.add_note(f"while building the optimizers of stage {j}")
                raise

    def step_remote(self, optimizer: torch.optim.Optimizer) -> bool:
        """Wait until every remote stage has stepped its part of ``optimizer``, if the driver stepped since the
        last call (a gradient scaler skips the step on an overflow: then no stage steps); a stage's error is
        raised here. Returns whether they stepped."""
        stepping = getattr(optimizer, "_lp_stepping", None)
        if stepping is None:
            return False
        optimizer._lp_stepping = None  # type: ignore[attr-defined]
        for future in stepping:
            future.result()
        return True

    def whole_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` called by the user: :meth:`state`, once the stages' step is over; refused
        where the stages are split or sharded (no process holds the whole state)."""
        if self.sharded():
            raise RuntimeError(
                f"optimizer.state_dict() cannot put {type(optimizer).__name__}'s whole state together in one process "
                "when the stages are split over tensor ranks (tensor_parallel_size) or sharded over their replicas "
                "(sharding_strategy): every process holds a part. Save it with the checkpoint "
                "(trainer.save_checkpoint, or fabric.save in every process), which gathers the parts into the plain "
                "model's optimizer's state")
        self.step_remote(optimizer)  # (a step of its own still under way in the stages)
        return self.state(optimizer)

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s ``state_dict`` with every stage's state in, as the plain model's optimizer has it."""
        state = optim.held_state(optimizer)
        if not hasattr(optimizer, "_lp_index"):
            return state
        remote: dict[str, Any] = {}
        for part in self.hosts.call("optimizer_state", optimizer._lp_index):
            remote.update(part)
        return optim.merge(state, optimizer._lp_names, remote,  # type: ignore[attr-defined]
                           lambda name: self.stage_of(name) == 0)

    def load(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load a consolidated ``state`` (see :meth:`state`): the driver's part here, each stage's there."""
        own, remote = optim.split(state, optimizer._lp_names, self.stage_of)  # type: ignore[attr-defined]
        if self.tied is not None:  # a tied parameter's state, held once, for each of its copies
            named = {optimizer._lp_names[int(i)]: s for i, s in state["state"].items()}  # type: ignore[attr-defined]
            for j, states in twin_states(named, self.tied.tied).items():
                remote.setdefault(j, {}).update(states)
        load_held(optimizer, optim.as_held(optimizer, own))
        # Every stage loads, also one the checkpoint has no state for (saved before any step, as the
        # learning-rate finder's is): what it built since must go, as it does from the driver's.
        for j in range(1, self.processes):
            self.hosts.call_stage(j, "load_optimizer_state", optimizer._lp_index,  # type: ignore[attr-defined]
                                  remote.get(j, {}))
