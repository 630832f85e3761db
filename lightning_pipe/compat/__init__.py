"""Programs written for torchgpipe or torch's ``sync.Pipe``, run on this engine by changing their imports.

- :mod:`lightning_pipe.compat.torchgpipe`: ``import torchgpipe`` becomes
  ``from lightning_pipe.compat import torchgpipe`` (``GPipe``, ``torchgpipe.skip``, ``torchgpipe.balance``);
  fairscale's ``fairscale.nn.Pipe`` is the same module under another name.
- :mod:`lightning_pipe.compat.sync`: ``from torch.distributed.pipeline.sync import Pipe`` becomes
  ``from lightning_pipe.compat.sync import Pipe`` (partitions placed where the layers are, an RRef out).

Both are :class:`lightning_pipe.Pipe` under the names and conventions those programs use, not engines of
their own; docs/migration.md lists what differs and why.
"""

__all__: list[str] = []
