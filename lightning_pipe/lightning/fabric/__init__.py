"""Fabric's binding: ``PipeStrategy`` for ``Fabric(strategy=...)``, with ``fabric.save`` and ``fabric.load``."""

from lightning_pipe.lightning.fabric.strategy import PipeStrategy

__all__ = ["PipeStrategy"]
