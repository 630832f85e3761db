"""The transport: stages of one pipeline in other processes, over ``torch.distributed.rpc``; no Lightning.

By room:

- ``wire/``, how bytes move: ``session`` (each process's RPC session for its whole life), ``messages`` (the
  mailbox that receives tensors; how errors travel back), ``codec`` (a hand-off as one message), ``dataplane``
  (hand-offs by point-to-point gloo beside RPC);
- ``stages/``, a stage in its process: ``runner`` (``StageRunner``, its share of each step in schedule order),
  ``driver`` (``RemotePipeline``: stage 0 here, the others there; ``pipeline_over_rpc`` to set one up without
  Lightning), ``steps`` (a step's control messages), ``rendezvous`` (where the data plane meets), ``host`` (a
  process hosting one stage with its optimizers, gradients and state), ``optim``, ``stagestate``, ``tied``,
  ``settled``;
- ``parallel/``, a stage over its replicas or its tensor ranks, one module per parallelism: ``ddp`` (torch's DDP),
  ``fsdp`` (FSDP2), ``tensor`` (a tensor-parallel plan checked and applied to a stage), what they share
  (``reduction``, ``averages``) and FSDP's checkpoint shards (``shards``);
- ``topology`` (which process does what) and ``placing`` (checkpoints put into place atomically).
"""

from lightning_pipe.transport.stages.driver import RemotePipeline, pipeline_over_rpc
from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.topology import Topology

__all__ = ["RemotePipeline", "StageRunner", "Topology", "pipeline_over_rpc"]
