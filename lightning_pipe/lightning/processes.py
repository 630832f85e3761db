"""The processes of a ``PipeStrategy`` job and what Lightning sees of them: the drivers alone.

Processes are laid out as replicas x stages (:class:`~lightning_pipe.transport.topology.Topology`); Lightning's
cluster environment keeps the view of all of them (its launchers, torchrun and SLURM use it), while the
strategy shows Lightning the drivers alone: ``world_size`` is the number of pipelines (replicas, times
``tensor_parallel_size``), ``global_rank`` the pipeline's index; its distributed sampler splits the data by
replica. Each process joins its stage group and RPC once (:mod:`lightning_pipe.transport.wire.session`).
SLURM's requeue signal is handled between training batches on the drivers and ignored by the stage workers
(:mod:`lightning_pipe.lightning.requeue`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_pipe.engine.schedule import placement_of
from lightning_pipe.lightning import checks, observe, requeue
from lightning_pipe.transport.stages import resident
from lightning_pipe.transport.topology import Topology
from lightning_pipe.transport.wire.session import start_session

__all__: list[str] = []


def share_cores(device: torch.device, processes: int) -> None:
    """On CPU, give each of this node's ``processes`` its share of the cores, unless OMP_NUM_THREADS is set; and say
    how many they are (``LOCAL_WORLD_SIZE``, unless set: a data plane in shared memory keeps its waiting readers awake
    only where each process can have a core).

    As torchrun does: processes that each start a thread pool as large as the machine fight for its cores
    (seen: steps 5x slower with 2 processes on 2 cores).
    """
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(processes))
    if device.type != "cpu":
        return
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def devices_by_rank(topology: Topology, devices: list[torch.device] | None, processes: int,
                    node_rank: int) -> list[torch.device | None] | None:
    """The device of every process of the job that runs on this node (None for the others).

    Every node has the same devices (as Lightning assumes): process ``r`` uses device ``r % processes``, on
    node ``r // processes``. Processes on other nodes get None: RPC maps GPUs within a machine only.
    """
    if not devices:
        return None
    return [torch.device(devices[r % processes]) if r // processes == node_rank else None
            for r in range(topology.world)]


class PipelineLayout:
    """What a pipeline strategy of either of Lightning's loops (the Trainer's ``DDPStrategy``, Fabric's) makes of
    its processes: Lightning's launchers and cluster environments start them all, Lightning's loop sees the
    drivers alone. Mixed in before the loop's ``DDPStrategy``; subclasses set ``balance``, ``virtual_stages`` and
    ``rpc_timeout_sec``."""

    cluster_environment: Any
    node_rank: int
    local_rank: int
    num_processes: int
    num_nodes: int
    parallel_devices: list[torch.device] | None
    root_device: torch.device
    _timeout: Any

    balance: list[int] | None
    virtual_stages: int = 1
    rpc_timeout_sec: float
    sharding_strategy: str
    hybrid_shard_size: int | None
    tensor_parallel_size: int = 1
    _topology: Topology | None = None
    _checked_topology: Topology | None = None  # the layout the sharding settings were last checked against
    _rank = -1
    _replica_group: Any = None
    _requeue: requeue.DeferredRequeue | None = None

    @property
    def topology(self) -> Topology:
        """The layout of processes into replicas and stages."""
        if self._topology is None:
            raise RuntimeError("the process layout is not known before the Trainer sets the strategy up")
        return self._topology

    @property
    def rank(self) -> int:
        """This process's rank among all processes of the job (drivers and stage workers)."""
        return self._rank

    @property
    def stages(self) -> int:
        """The number of pipeline stages (partitions of the body): ``len(balance)``, or one per device of a node
        times ``virtual_stages``."""
        return len(self.balance) if self.balance is not None else self.num_processes * self.virtual_stages

    @property
    def pipeline_processes(self) -> int:
        """The number of processes of one pipeline: each holds ``virtual_stages`` stages."""
        return self.stages // self.virtual_stages

    @property
    def placement(self) -> tuple[int, ...]:
        """Where the schedule puts each stage (a :class:`~lightning_pipe.engine.plan.Plan`'s ``placement``): a V for
        the V-shaped schedules, a schedule given as data's own, empty for stage ``s`` on ``s % pipeline_processes``."""
        return placement_of(getattr(self, "schedule", "gpipe"), self.pipeline_processes, self.virtual_stages)

    def process_of(self, stage: int) -> int:
        """The process of a pipeline (its index there) that holds ``stage`` (see :attr:`placement`)."""
        placement = self.placement
        return placement[stage] if placement else stage % self.pipeline_processes

    @property
    def is_driver(self) -> bool:
        """Whether this process drives a pipeline (runs the Lightning loop and holds stage 0)."""
        return self.topology.is_driver(self._rank)

    @property
    @override
    def global_rank(self) -> int:
        return super().global_rank if self._topology is None else self._topology.pipeline_of(self._rank)

    @property
    @override
    def world_size(self) -> int:
        return super().world_size if self._topology is None else self._topology.pipelines

    @property
    def replicas(self) -> int:
        """How many replicas train on different batches (Lightning's world, divided by
        ``tensor_parallel_size``: the pipelines of one replica see the same batches)."""
        return super().world_size if self._topology is None else self._topology.replicas

    @property
    @override
    def is_global_zero(self) -> bool:
        return super().is_global_zero if self._topology is None else self._rank == 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.topology.replicas, "rank": self.topology.replica_of(self._rank)}

    @override
    def set_world_ranks(self) -> None:
        # The cluster environment keeps the view of all processes (the launcher and torchrun/SLURM use it);
        # Lightning's properties above show only the drivers.
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._rank = self.cluster_environment.global_rank()
        self._topology = topology = Topology(self.cluster_environment.world_size(), self.pipeline_processes,
                                             self.tensor_parallel_size)
        rank_zero_only.rank = topology.pipeline_of(self._rank) if topology.is_driver(self._rank) else self._rank
        if topology != self._checked_topology:  # once per layout (again in each process, by the same strategy)
            # Known as the loop is made, before any process starts: the sharding settings against the replicas.
            checks.check_replicas(self.sharding_strategy, self.hybrid_shard_size, topology)
            self._checked_topology = topology

    def replica_group(self) -> Any:
        """Where a sum or a gathering over the replicas' batches runs: the drivers of this process's tensor rank, one
        per replica (a group of the drivers' default group, made by its members at its first use); None (the default
        group) with one tensor rank. The tensor ranks of a replica drive the same batch: over every driver, a sum
        counts each sample ``tensor_parallel_size`` times, as under Lightning's ``ModelParallelStrategy``."""
        topology = self._topology
        if topology is None or topology.tensor == 1:
            return None
        if self._replica_group is None:
            k = topology.tensor_of(self._rank)
            self._replica_group = torch.distributed.new_group(
                [r * topology.tensor + k for r in range(topology.replicas)], use_local_synchronization=True)
        return self._replica_group

    def over_replicas(self, group: Any) -> Any:
        """The group a loop's sum or gathering asked over ``group`` runs over: :meth:`replica_group` for the default
        group (None, or ``WORLD``, which ``self.all_gather`` and Fabric's collectives pass for None), else ``group``."""
        default = group is None or (torch.distributed.is_available() and group is torch.distributed.group.WORLD)
        return self.replica_group() if default else group

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """One entry per replica (:meth:`over_replicas`), not per tensor rank: ``self.all_gather`` and Fabric's."""
        return super().all_gather(tensor, self.over_replicas(group), sync_grads)  # type: ignore[misc]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``decision`` agreed by every driver, each tensor rank's too (over the default group, not
        :meth:`replica_group`): True where all (``all``) or any decided so, as Lightning's strategies agree."""
        agreed = torch.tensor(int(decision), device=self.root_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.SUM)
        return bool(agreed == self.world_size) if all else bool(agreed)

    def group_metrics(self, module: torch.nn.Module) -> None:
        """Each torchmetrics ``Metric`` of ``module`` left to sync over the default group syncs over
        :meth:`replica_group` instead (its samples counted once, not once per tensor rank)."""
        group = self.replica_group() if self.is_driver else None
        for metric in module.modules() if group is not None else ():
            if hasattr(metric, "_sync_dist") and getattr(metric, "process_group", 0) is None:
                metric.process_group = group

    def memory_per_process(self) -> list[dict[str, int]]:
        """Per process of this driver's pipeline: its memory (resident now, at its peak and as it joined its session;
        on GPUs, what it allocated there) and what it keeps between steps (all 0)."""
        return observe.memory(self._body)  # type: ignore[attr-defined]

    def share_cores(self) -> None:
        """On CPU, give each of this node's processes its share of the cores, unless OMP_NUM_THREADS is set."""
        share_cores(self.root_device, self.num_processes)

    def start_session(self) -> None:
        """Join this process's stage group and RPC (once per process)."""
        self.set_world_ranks()
        self.share_cores()
        assert self.cluster_environment is not None
        resident.remember_base()
        start_session(self.topology, self._rank, self.cluster_environment.main_address,
                      self.cluster_environment.main_port, backend=self._get_process_group_backend(),
                      pg_timeout=self._timeout or default_pg_timeout, rpc_timeout=self.rpc_timeout_sec,
                      devices=devices_by_rank(self.topology, self.parallel_devices, self.num_processes, self.node_rank))
        if not self.is_driver:
            requeue.ignore_in_worker(self.cluster_environment)

    def join(self) -> None:
        """Set this process up as the strategies' ``setup_distributed`` does: re-seeded where the plain run would
        be, then its session joined (once per process)."""
        self.set_world_ranks()
        if self.topology.pipelines > 1 or not self.is_driver:
            # As under DDP, every process restarts from seed_everything's seed (a stage process takes the seeds
            # of its random operations from it). The driver of a single pipeline keeps the generator as the
            # program left it, as one device does: a shuffling loader then gives one device's batches.
            reset_seed()
        self._process_group_backend = self._get_process_group_backend()  # type: ignore[attr-defined]
        self.start_session()
