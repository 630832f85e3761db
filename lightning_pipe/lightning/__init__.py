"""The Lightning binding: one room per loop over the core both share.

- ``trainer/``: the Trainer's ``PipeStrategy`` (``strategy``), its processes' and replicas' hooks
  (``processes``), its checkpoint hooks (``checkpoints``), ``PipelineReport`` (``report``) and ``grad_norm``
  (``gradients``);
- ``fabric/``: Fabric's ``PipeStrategy`` (``strategy``) and ``fabric.save``/``fabric.load`` (``checkpoints``);
- the core, used by both: ``processes`` (the job's pipelines; what a loop sees: the drivers), ``launcher``,
  ``settings`` (the arguments both take), ``checks`` (what they refuse), ``build`` (the body cut into a
  pipeline), ``body`` (``PipelinedSequential``, the driver's body: stage 0's layers, the others' placeholders),
  ``placeholders``, ``layers`` (modes and ``requires_grad`` in step), ``optimizers`` (the user's optimizers
  across stages), ``precision`` (clipping and loss scaling across stages), ``replicas`` and ``ddp`` (averaging
  over replicas), ``tied``, ``checkpoints`` (what both loops' saves share), ``streamed`` (one file written stage
  by stage), ``sharded`` (DCP directories), ``requeue`` (SLURM's signal), ``observe`` (timelines, memory).
"""

from typing import Any

__all__ = ["PipeStrategy", "PipelineReport", "consolidate_checkpoint", "grad_norm"]


def __getattr__(name: str) -> Any:
    """The binding's names, on first use: ``consolidate_checkpoint`` (and the core's modules, such as ``sharded``)
    load no Lightning, so that ``python -m lightning_pipe consolidate`` starts in the time torch takes."""
    if name == "consolidate_checkpoint":
        from lightning_pipe.lightning.sharded import consolidate_checkpoint

        return consolidate_checkpoint
    if name in ("PipeStrategy", "PipelineReport", "grad_norm"):
        from lightning_pipe.lightning import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
