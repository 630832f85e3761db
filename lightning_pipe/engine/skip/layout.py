"""Which partition sends each skip tensor to which: the routes a pipeline wires between stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_pipe.engine.skip.namespace import SkipKey
from lightning_pipe.engine.skip.skippable import Skippable

__all__: list[str] = []


@dataclass
class SkipLayout:
    """Cross-partition skips: ``exports[j]`` maps each key stashed in partition j to the popping partition;
    ``imports[j]`` maps each key popped in partition j to the stashing partition."""

    exports: list[dict[SkipKey, int]] = field(default_factory=list)
    imports: list[dict[SkipKey, int]] = field(default_factory=list)


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Find the skips that cross partitions (those within one partition stay local to it)."""
    n = len(partitions)
    layout = SkipLayout([{} for _ in range(n)], [{} for _ in range(n)])
    stashed_in: dict[SkipKey, int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition:
            if not isinstance(layer, Skippable):
                continue
            for key in layer.poppable():
                src = stashed_in.get(key)
                if src is not None and src != j:
                    layout.exports[src][key] = j
                    layout.imports[j][key] = src
            for key in layer.stashable():
                stashed_in[key] = j
    return layout
