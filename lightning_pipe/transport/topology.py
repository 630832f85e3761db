"""Which process does what: ranks → (replica, stage), pipelines, drivers and stage data-parallel groups.

World = replicas × stages. A pipeline is a run of consecutive global ranks (so its stages share a node
when a node has at least as many devices as there are stages); its first rank is the **driver**, which
runs the Lightning loop and holds stage 0. Rank ``r`` holds stage ``r % stages`` of replica
``r // stages``::

    4 processes, 2 stages:   rank 0 (driver, replica 0) ─ rank 1 (stage 1)
                             rank 2 (driver, replica 1) ─ rank 3 (stage 1)
    stage data-parallel groups: {0, 2} (the drivers: Lightning's world) and {1, 3}

With virtual stages (an interleaved schedule), "stage" here is a process's place in its pipeline: process
``j`` of a pipeline of ``p`` holds the partitions ``j, j + p, j + 2p, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__: list[str] = []


@dataclass(frozen=True)
class Topology:
    """The layout of ``world`` processes into pipelines of ``stages`` stages."""

    world: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"a pipeline needs at least one stage (stages: {self.stages})")
        if self.world % self.stages:
            raise ValueError(
                f"the number of processes must be a multiple of the number of pipeline stages "
                f"(devices x nodes: {self.world}, stages: {self.stages}); use devices x num_nodes = "
                f"{self.stages} x replicas, or a balance with a number of entries that divides {self.world}"
            )

    @property
    def replicas(self) -> int:
        """How many copies of the pipeline train side by side (data parallel)."""
        return self.world // self.stages

    def stage_of(self, rank: int) -> int:
        """The stage that process ``rank`` holds."""
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        """The pipeline replica process ``rank`` belongs to."""
        return rank // self.stages

    def is_driver(self, rank: int) -> bool:
        """Whether ``rank`` drives its pipeline (stage 0: runs the Lightning loop)."""
        return self.stage_of(rank) == 0

    def pipeline(self, replica: int) -> list[int]:
        """The ranks of one pipeline, stage by stage."""
        return [replica * self.stages + j for j in range(self.stages)]

    def stage_group(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: they average that stage's gradients."""
        return [r * self.stages + stage for r in range(self.replicas)]

    def drivers(self) -> list[int]:
        """The drivers: the processes Lightning sees (its world)."""
        return self.stage_group(0)
