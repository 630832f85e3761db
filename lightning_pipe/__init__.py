"""lightning_pipe: pipeline parallelism for PyTorch and PyTorch Lightning.

Three layers, each importing only those before it: :mod:`lightning_pipe.engine` (the pipeline in one
process: ``Pipe``), :mod:`lightning_pipe.transport` (its stages in other processes, over RPC) and
:mod:`lightning_pipe.lightning` (``PipeStrategy`` for Lightning's Trainer). The optional
:mod:`lightning_pipe.models` (``pip install 'lightning_pipe[hf]'``) makes Hugging Face models bodies; it is not
imported here.

The Lightning binding's names (``PipeStrategy``, ``PipelineReport``, ``consolidate_checkpoint``, ``grad_norm``)
are imported on first use, so a program that uses the engine or the transport alone (``Pipe``,
``pipeline_over_rpc``, :mod:`lightning_pipe.compat`) starts without loading Lightning (about 4 s of imports).
They are those of the Lightning package the program imported, ``lightning`` or ``pytorch_lightning``
(:mod:`lightning_pipe.packages`); either package's ``Trainer(strategy="pipe")`` works once this package is
imported.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lightning_pipe import packages
from lightning_pipe.engine import (
    Pipe,
    deferred_init,
    is_checkpointing,
    is_recomputing,
    loss_on_last_stage,
    pure_backward_layer,
    run_pipeline,
)
from lightning_pipe.engine.planning import plan_layout
from lightning_pipe.transport import pipeline_over_rpc

if TYPE_CHECKING:
    from lightning_pipe.lightning import PipelineReport, PipeStrategy, consolidate_checkpoint, grad_norm

packages.install()  # strategy="pipe" in whichever Lightning package is (or will be) imported

#: The names of the Lightning binding offered here, imported when first asked for.
_LIGHTNING_NAMES = ("PipeStrategy", "PipelineReport", "consolidate_checkpoint", "grad_norm")

__all__ = ["Pipe", "PipeStrategy", "PipelineReport", "consolidate_checkpoint", "deferred_init", "grad_norm",
           "is_checkpointing", "is_recomputing", "loss_on_last_stage", "pipeline_over_rpc", "plan_layout",
           "pure_backward_layer", "run_pipeline"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The Lightning binding's names, from the binding of the Lightning package that the asking module imported
    from, or else that this program imported (asked each time: a program may import its Lightning package after
    this one)."""
    if name in _LIGHTNING_NAMES:
        return getattr(packages.binding(namespace=sys._getframe(1).f_globals), name)
    raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LIGHTNING_NAMES))
