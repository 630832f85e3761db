"""The pipeline engine: micro-batches, stages, schedules, the local pipeline and ``Pipe``; no RPC, no Lightning.

What it offers, by module:

- ``microbatch``: one ``Batch`` type for "tensor or tuple of tensors", split into micro-batches and joined back;
- ``schedule``: the order of work as data (which micro-batch each partition runs at each tick);
- ``stage``: one partition on one device, running the forward and backward of its micro-batches;
- ``backward_split``: a backward in two parts, input gradients first (``pure_backward_layer``);
- ``pipeline``: stages on worker threads in schedule order (``LocalPipeline``), and a step's ``Run``;
- ``pipe``: ``Pipe``, the user-facing module, and ``loss_on_last_stage``;
- ``autograd``: ``run_pipeline`` and ``pipeline_loss``, which tie any pipeline into autograd;
- ``loss``, ``aside``: the loss on the last stage, combined over micro-batches; gradients a step made ahead;
- ``partition``: the checks of a body and a balance, and the cut into partitions;
- ``checkpoint``, ``rng``: recomputation flags, and random numbers that replay exactly;
- ``batchnorm``, ``skip``, ``balance``: deferred BatchNorm, skip connections, automatic balancing;
- ``worker``, ``timeline``: the threads partitions run on, and the record of when they ran;
- ``deferred``, ``materialize``: models built on the meta device, recorded, and materialised stage by stage as
  built (a recording's programs, replayed anywhere).

The transport (:mod:`lightning_pipe.transport`) runs the same stages in other processes.
"""

from lightning_pipe.engine.autograd import pipeline_loss, run_pipeline
from lightning_pipe.engine.backward_split import pure_backward_layer
from lightning_pipe.engine.batchnorm import DeferredBatchNorm
from lightning_pipe.engine.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.engine.deferred import deferred_init
from lightning_pipe.engine.microbatch import Batch
from lightning_pipe.engine.partition import CHECKPOINT_MODES, split_module
from lightning_pipe.engine.pipe import Pipe, loss_on_last_stage
from lightning_pipe.engine.pipeline import LocalPipeline, Run
from lightning_pipe.engine.schedule import SCHEDULES, Plan, schedule_plan
from lightning_pipe.engine.stage import Stage

__all__ = ["Pipe", "loss_on_last_stage", "run_pipeline", "pipeline_loss", "SCHEDULES", "Plan", "schedule_plan",
           "Stage", "LocalPipeline", "Run", "Batch", "DeferredBatchNorm", "split_module", "CHECKPOINT_MODES",
           "is_checkpointing", "is_recomputing", "pure_backward_layer", "deferred_init"]
