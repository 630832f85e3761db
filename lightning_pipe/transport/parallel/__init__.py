"""A stage over its replicas, one module per parallelism: ``ddp`` (torch's DDP), ``fsdp`` (FSDP2), and what they
share (``reduction``, ``averages``) and FSDP's checkpoint shards (``shards``)."""
