"""What the driver sets on its copies of remote layers reaches their stages before the next forward.

On the driver, the layers of remote stages are placeholders (:mod:`lightning_pipe.lightning.body`), but users and
Lightning's callbacks still set things on them: freezing (``requires_grad``, ``BaseFinetuning.freeze``), one
layer's mode (``layer.eval()``), BatchNorm statistics frozen (``train_bn=False``). Before each forward,
:class:`LayerSync` sends each stage whatever changed since it last sent it, one call per stage that changed.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.transport.stages.host import layer_modes

__all__: list[str] = []


class LayerSync:
    """Keeps the remote stages of ``body`` in step with the driver's placeholders of their layers.

    ``body()`` returns the LightningModule's pipelined body (looked up at each call: a user may replace it).
    """

    def __init__(self, body: Callable[[], PipelinedSequential], processes: int) -> None:
        self.body = body
        self.processes = processes
        self._requires_grad = self._requires_grad_flags()
        self._modes: list[tuple[bool, bytes] | None] = [None] * processes  # sent before the first forward

    def _layers(self) -> list[list[nn.Module]]:
        body = self.body()
        layers: list[list[nn.Module]] = [[] for _ in range(self.processes)]
        for name, child in body.named_children():
            layers[body.owner[name]].append(child)
        return layers

    def _requires_grad_flags(self) -> list[tuple[bool, ...]]:
        return [tuple(p.requires_grad for layer in layers for p in layer.parameters()) for layers in self._layers()]

    def __call__(self) -> None:
        """Send each remote stage its layers' modes and ``requires_grad`` where they changed."""
        body = self.body()
        if body.hosts is None:
            return
        for j, layers in enumerate(self._layers()):
            if j == 0:
                continue
            modes = (body.training, layer_modes(layers))
            if modes != self._modes[j]:
                body.hosts.call_stage(j, "set_modes", *modes)
                self._modes[j] = modes
        self.requires_grad()

    def requires_grad(self) -> None:
        """Send each remote stage its parameters' ``requires_grad`` where they changed (also as a backward
        starts: a layer frozen between the forward and the backward gets no gradient, as in one process)."""
        body = self.body()
        if body.hosts is None:
            return
        flags = self._requires_grad_flags()
        if flags == self._requires_grad:
            return
        for j in range(1, self.processes):
            if flags[j] != self._requires_grad[j]:
                named = {f"{body.name}.{n}": p.requires_grad  # a tied parameter under each layer's name
                         for n, p in body.named_parameters(remove_duplicate=False)
                         if body.owner[n.split(".", 1)[0]] == j}
                body.hosts.call_stage(j, "set_requires_grad", named)
        self._requires_grad = flags
