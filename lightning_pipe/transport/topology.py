"""Which process does what: ranks → (replica, stage, tensor rank), pipelines, drivers and stage groups.

World = replicas × stages × tensor ranks (``tensor``: 1 unless stages are split by tensor parallel, below). A
pipeline is a run of consecutive global ranks (so its stages share a node when a node has at least as many devices
as there are stages); its first rank is the **driver**, which runs the Lightning loop and holds stage 0. Rank ``r``
holds stage ``r % stages`` of replica ``r // stages``::

    4 processes, 2 stages:   rank 0 (driver, replica 0) ─ rank 1 (stage 1)
                             rank 2 (driver, replica 1) ─ rank 3 (stage 1)
    stage data-parallel groups: {0, 2} (the drivers: Lightning's world) and {1, 3}

With virtual stages (an interleaved schedule), "stage" here is a process's place in its pipeline: process
``j`` of a pipeline of ``p`` holds the partitions ``j, j + p, j + 2p, ...``.

With tensor parallel (``tensor = t > 1``) each stage runs in ``t`` processes, consecutive ranks (the tensor
dimension innermost: one node), and a replica is ``t`` pipelines side by side, one per tensor rank: pipeline
``k`` of a replica links tensor rank ``k`` of every stage, so activations go between matching tensor ranks. Rank
``r`` holds stage ``(r // t) % stages``, tensor rank ``r % t``, of replica ``r // (stages t)``::

    8 processes, 2 stages, t = 2:   replica 0: ranks 0, 1 (stage 0) ─ ranks 2, 3 (stage 1)
                                    replica 1: ranks 4, 5 (stage 0) ─ ranks 6, 7 (stage 1)
    pipelines: 0 ─ 2, 1 ─ 3, 4 ─ 6, 5 ─ 7 (drivers 0, 1, 4, 5: Lightning's world)
    stage groups: {0, 1, 4, 5} and {2, 3, 6, 7}, each a ("data", "tensor") mesh of 2 x 2

Every pipeline of a replica is driven with the same batches and the same schedule: the collectives inside a stage
(tensor parallel's) meet because each of its processes runs the same actions in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__: list[str] = []


@dataclass(frozen=True)
class Topology:
    """The layout of ``world`` processes into pipelines of ``stages`` stages, each stage in ``tensor`` processes."""

    world: int
    stages: int
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"a pipeline needs at least one stage (stages: {self.stages})")
        if self.tensor < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1 (got: {self.tensor})")
        if self.tensor > 1 and self.world % (self.stages * self.tensor):
            raise ValueError(
                f"the number of processes must be a multiple of stages x tensor_parallel_size (devices x nodes: "
                f"{self.world}, stages: {self.stages}, tensor_parallel_size: {self.tensor}); use devices x num_nodes "
                f"= {self.stages} x {self.tensor} x replicas")
        if self.world % self.stages:
            raise ValueError(
                f"the number of processes must be a multiple of the number of pipeline stages "
                f"(devices x nodes: {self.world}, stages: {self.stages}); use devices x num_nodes = "
                f"{self.stages} x replicas, or a balance with a number of entries that divides {self.world}"
            )

    @property
    def replicas(self) -> int:
        """How many copies of the model train side by side on different batches (data parallel)."""
        return self.world // (self.stages * self.tensor)

    @property
    def pipelines(self) -> int:
        """How many pipelines there are: ``tensor`` per replica (each with a driver: Lightning's world)."""
        return self.world // self.stages

    def stage_of(self, rank: int) -> int:
        """The stage that process ``rank`` holds."""
        return (rank // self.tensor) % self.stages

    def replica_of(self, rank: int) -> int:
        """The replica process ``rank`` belongs to (which batches it trains on)."""
        return rank // (self.stages * self.tensor)

    def tensor_of(self, rank: int) -> int:
        """Process ``rank``'s tensor rank among the ``tensor`` processes of its stage."""
        return rank % self.tensor

    def pipeline_of(self, rank: int) -> int:
        """The pipeline process ``rank`` belongs to: its replica's, at its tensor rank (its rank in its stage
        group, and a driver's rank in Lightning's world)."""
        return self.replica_of(rank) * self.tensor + self.tensor_of(rank)

    def is_driver(self, rank: int) -> bool:
        """Whether ``rank`` drives its pipeline (stage 0: runs the Lightning loop)."""
        return self.stage_of(rank) == 0

    def pipeline(self, index: int) -> list[int]:
        """The ranks of pipeline ``index`` (:meth:`pipeline_of`), stage by stage."""
        replica, k = divmod(index, self.tensor)
        return [(replica * self.stages + j) * self.tensor + k for j in range(self.stages)]

    def stage_group(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every pipeline, by pipeline: they average that stage's gradients (over
        the replicas) and split it (over the tensor ranks)."""
        return [self.pipeline(index)[stage] for index in range(self.pipelines)]

    def drivers(self) -> list[int]:
        """The drivers: the processes Lightning sees (its world)."""
        return self.stage_group(0)
