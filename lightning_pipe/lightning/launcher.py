"""Lightning's script launcher for ``PipeStrategy``: drivers run the script, stage workers serve their stage.

The launcher checks the model and settings before any process starts, then starts the processes as
Lightning's script launcher does; in each, the strategy joins the process's session
(:mod:`lightning_pipe.transport.wire.session`). Drivers return to the script and run the Lightning loop; stage
workers serve RPC until every driver is done, and never return to the script.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Protocol

import pytorch_lightning as pl
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_pipe.transport.wire.session import _PARENT_ENV, serve_until_shutdown

__all__: list[str] = []


class Launching(Protocol):
    """What the launcher asks of the strategy that owns it."""

    is_driver: bool

    def check_settings(self, trainer: pl.Trainer | None) -> None: ...

    def check_model(self, module: pl.LightningModule) -> None: ...

    def start_session(self) -> None: ...

    def share_cores(self) -> None: ...


class Serving:
    """Mixed in before a Lightning script launcher (the Trainer's or Fabric's): drivers run the launched function,
    stage workers serve RPC until every driver is done and never return to the script."""

    _strategy: Launching

    def serving(self, function: Callable[..., Any], model: Any = None) -> Callable[..., Any]:
        """``function`` as each process runs it: joining its session first; a stage worker serves instead (and
        gives back the memory of ``model``, the script's copy of the whole model, where it can)."""

        def role(*a: Any, **kw: Any) -> Any:
            self._strategy.start_session()
            if self._strategy.is_driver:
                return function(*a, **kw)
            if model is not None:
                # The script built the whole model here too; this process serves the stage its driver sends
                # and never returns to the script, so the model's memory is given back (best effort: a model
                # that cannot move keeps it, and nothing else changes).
                with contextlib.suppress(Exception):
                    model.to("meta")
            serve_until_shutdown()  # never returns: a worker must not continue into the user's script
            return None

        return role

    def _call_children_scripts(self) -> None:
        os.environ[_PARENT_ENV] = str(os.getpid())
        self._strategy.share_cores()  # before the children start, so their thread pools start at that size
        super()._call_children_scripts()  # type: ignore[misc]


class PipeLauncher(Serving, _SubprocessScriptLauncher):
    """Lightning's script launcher, except that stage workers serve RPC instead of running the loop."""

    def __init__(self, strategy: Launching, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        model = args[0] if args and isinstance(args[0], pl.LightningModule) else None
        model = model or getattr(trainer, "lightning_module", None)
        # Before any process starts (here) or on every rank (torchrun).
        self._strategy.check_settings(trainer)
        if model is not None:
            self._strategy.check_model(model)
        return super().launch(self.serving(function, model), *args, trainer=trainer, **kwargs)
