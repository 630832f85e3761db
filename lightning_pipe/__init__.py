"""lightning_pipe: pipeline parallelism for PyTorch and PyTorch Lightning.

Three layers, each importing only those before it: :mod:`lightning_pipe.engine` (the pipeline in one
process: ``Pipe``), :mod:`lightning_pipe.transport` (its stages in other processes, over RPC) and
:mod:`lightning_pipe.lightning` (``PipeStrategy`` for Lightning's Trainer). The optional
:mod:`lightning_pipe.models` (``pip install 'lightning_pipe[hf]'``) makes Hugging Face models bodies; it is not
imported here.
"""

from lightning_pipe.engine import (
    Pipe,
    deferred_init,
    is_checkpointing,
    is_recomputing,
    loss_on_last_stage,
    pure_backward_layer,
    run_pipeline,
)
from lightning_pipe.lightning import PipelineReport, PipeStrategy, consolidate_checkpoint, grad_norm
from lightning_pipe.transport import pipeline_over_rpc

__all__ = ["Pipe", "PipeStrategy", "PipelineReport", "consolidate_checkpoint", "deferred_init", "grad_norm",
           "is_checkpointing", "is_recomputing", "loss_on_last_stage", "pipeline_over_rpc", "pure_backward_layer",
           "run_pipeline"]
__version__ = "0.1.0"
