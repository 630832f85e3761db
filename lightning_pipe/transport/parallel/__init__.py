"""A stage over its replicas or its tensor ranks, one module per parallelism: ``ddp`` (torch's DDP), ``fsdp``
(FSDP2), ``tensor`` (a tensor-parallel plan checked and applied to a stage; ``building``: to a stage built on the
meta device, layer by layer), and what they share (``reduction``, ``averages``) and FSDP's checkpoint shards
(``shards``)."""
