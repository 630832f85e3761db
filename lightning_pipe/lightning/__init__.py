"""The Lightning binding: ``PipeStrategy`` and what it delegates to, the driver's stand-in body, callbacks.

What it offers, by module:

- ``strategy``: ``PipeStrategy``, which reads as Lightning's hook order and delegates each concern to:
  ``processes`` (what Lightning sees of the processes: the drivers), ``launcher`` (starting them), ``requeue``
  (SLURM's requeue signal: handled between batches, ignored by stage workers), ``checks``
  (what it refuses), ``build`` (the body cut into a pipeline), ``layers`` (modes and ``requires_grad`` in
  step), ``optimizers`` (the user's optimizers across stages), ``precision`` (clipping and loss scaling
  across stages), ``replicas`` (averaging over replicas), ``checkpoints`` (Lightning's checkpoint hooks:
  ``streamed``, one file that loads into the plain model, written stage by stage; ``sharded``, a file per
  process), ``observe`` (timelines and memory);
- ``body``: ``PipelinedSequential``, the driver's body: stage 0's layers, the others' placeholders;
- ``report``: ``PipelineReport``, the callback that draws the loss curve and the timeline;
- ``gradients``: ``grad_norm`` over every stage.
"""

from lightning_pipe.lightning.gradients import grad_norm
from lightning_pipe.lightning.report import PipelineReport
from lightning_pipe.lightning.sharded import consolidate_checkpoint
from lightning_pipe.lightning.strategy import PipeStrategy

__all__ = ["PipeStrategy", "PipelineReport", "consolidate_checkpoint", "grad_norm"]
