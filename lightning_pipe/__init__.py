"""lightning_pipe: GPipe pipeline parallelism for PyTorch and PyTorch Lightning."""

from lightning_pipe.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.gradients import grad_norm
from lightning_pipe.pipe import Pipe
from lightning_pipe.report import PipelineReport
from lightning_pipe.stage import pure_backward_layer
from lightning_pipe.strategy import PipeStrategy

__all__ = ["Pipe", "PipeStrategy", "PipelineReport", "grad_norm", "is_checkpointing", "is_recomputing",
           "pure_backward_layer"]
__version__ = "0.1.0"
