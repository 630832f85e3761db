"""What a stage's process is told as it comes to host its stages of a pipeline: one object, made by the driver and
carried to every process of the pipeline (each with its own device)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_pipe.engine.skip.layout import SkipLayout
from lightning_pipe.transport.stages.tied import TiedParameter

__all__ = ["StageSetup", "TensorSplit"]


class TensorSplit(NamedTuple):
    """Every stage split by tensor parallel over the ``size`` processes that hold it, by ``plan`` (a
    ``parallelize_module`` plan by layer, or a function of the stage and its mesh)."""

    size: int
    plan: Any


@dataclass(frozen=True)
class StageSetup:
    """How a process hosts its stages of a pipeline: on ``device``; ``peers[s]`` the process of stage ``s`` and
    ``peers[n]`` the driver; the skip connections' ``layout``; every wait bounded by ``timeout`` seconds (and the
    setting up itself by ``setup_timeout``, default ``timeout``: materialising and meeting the other replicas);
    ``prefix`` turning a layer's parameter names into the LightningModule's; ``record``: the stages record their
    timeline; ``tied``: the parameters its layers share with other processes' layers; ``init_sync``: every replica
    takes replica 0's weights (else each keeps its own, as built); ``split``: the stages split by tensor parallel."""

    device: str
    peers: Sequence[str]
    layout: SkipLayout
    timeout: float
    prefix: str
    record: bool = False
    tied: Sequence[TiedParameter] = ()
    init_sync: bool = True
    split: TensorSplit | None = None
    setup_timeout: float | None = None
