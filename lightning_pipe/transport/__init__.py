"""The transport: stages of one pipeline in other processes, over ``torch.distributed.rpc``; no Lightning.

What it offers, by module:

- ``messages``: the mailbox that receives tensors, how they are packed, and how errors travel back;
- ``runner``: a stage in its process (``StageRunner``), running its share of each step in schedule order;
- ``driver``: the driver's side (``RemotePipeline``: stage 0 here, the others there), and
  ``pipeline_over_rpc`` to set one up without Lightning;
- ``host``: a process hosting one stage with what training it needs (optimizers, gradients, state);
- ``optim``: an optimizer split across stages; ``dataparallel``: averaging gradients across replicas;
- ``topology``, ``session``: which process does what, and each process's RPC session for its whole life.
"""

from lightning_pipe.transport.driver import RemotePipeline, pipeline_over_rpc
from lightning_pipe.transport.runner import StageRunner
from lightning_pipe.transport.topology import Topology

__all__ = ["RemotePipeline", "StageRunner", "Topology", "pipeline_over_rpc"]
