"""The Trainer's binding: ``PipeStrategy`` for ``Trainer(strategy=...)``, its callbacks and logging helpers."""

from lightning_pipe.lightning.trainer.gradients import grad_norm
from lightning_pipe.lightning.trainer.report import PipelineReport
from lightning_pipe.lightning.trainer.strategy import PipeStrategy

__all__ = ["PipeStrategy", "PipelineReport", "grad_norm"]
