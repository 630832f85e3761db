"""A Lightning callback that shows what a pipelined fit did: its loss curve and its pipeline timeline, as PNGs.

    Trainer(strategy=PipeStrategy(...), callbacks=[PipelineReport()])

At the end of ``fit`` the main process writes ``loss_curve.png`` (the training loss per batch) and, under
:class:`~lightning_pipe.PipeStrategy`, ``timeline.json`` (a Chrome trace of the last steps' forward and
backward per stage and micro-batch) with its picture ``timeline.png`` into the run's log directory, and
prints where they are, with the checkpoint and the measured bubble fraction beside GPipe's.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_pipe.engine.timeline import bubble_fraction, read_chrome_trace, read_trace_schedule, render

__all__ = ["PipelineReport", "plot_losses"]


def plot_losses(losses: Sequence[float], path: str, title: str = "training loss") -> None:
    """Draw ``losses`` (one per training batch) and their running mean into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = torch.tensor(list(losses), dtype=torch.float64)
    window = max(1, min(25, len(values) // 10))
    kernel = torch.ones(1, 1, window, dtype=torch.float64) / window
    smooth = torch.nn.functional.conv1d(values.view(1, 1, -1), kernel).flatten()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(values) + 1), values.tolist(), color="#9DB7D5", linewidth=1, label="per batch")
    if window > 1:
        ax.plot(range(window, len(values) + 1), smooth.tolist(), color="#1F4E79", linewidth=2,
                label=f"mean of {window}")
    ax.set_xlabel("training batch")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: {values[0].item():.3f} at the first batch, {values[-1].item():.3f} at the last")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class PipelineReport(Callback):
    """Write a loss-curve PNG and a pipeline-timeline PNG at the end of ``fit``, and print where they are.

    Args:
        directory: where the files go; default: the run's log directory (``trainer.log_dir``), where
            Lightning keeps its checkpoints too.
        timeline_steps: how many of the last training steps the timeline picture shows.
        monitor: the logged metric plotted when ``training_step`` returns no loss (manual optimization).

    Only the main process writes and prints. The timeline needs :class:`~lightning_pipe.PipeStrategy`: the
    callback starts recording when fit starts; under another strategy only the loss curve is drawn.
    """

    def __init__(self, directory: str | None = None, timeline_steps: int = 3, monitor: str = "train_loss") -> None:
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("PipelineReport draws its pictures with matplotlib, which is not installed; "
                              "install it with: pip install 'lightning_pipe[timeline]'")
        if not isinstance(timeline_steps, int) or timeline_steps < 1:
            raise ValueError(f"timeline_steps must be a positive number of steps (got: {timeline_steps!r})")
        self.directory = directory
        self.timeline_steps = timeline_steps
        self.monitor = monitor
        self.losses: list[torch.Tensor] = []
        #: What the last fit wrote: "loss_curve", "timeline", "trace", "checkpoint" → path (main process).
        self.paths: dict[str, str] = {}
        self.bubble: tuple[float, float] | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.losses, self.paths, self.bubble = [], {}, None
        from lightning_pipe.lightning.trainer.strategy import PipeStrategy

        if isinstance(trainer.strategy, PipeStrategy):
            trainer.strategy.record_timeline(True)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            loss = trainer.callback_metrics.get(self.monitor)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach().float().cpu().reshape(()))  # no .item(): no sync per batch

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_pipe.lightning.trainer.strategy import PipeStrategy

        strategy = trainer.strategy
        if isinstance(strategy, PipeStrategy) and strategy._pipeline is not None:
            trace = self._path(trainer, "timeline.json") if trainer.is_global_zero else None
            if trace is not None:
                strategy.write_timeline(trace)
            if strategy.timeline is None:  # else the strategy goes on recording for its own trace
                strategy.record_timeline(False)
        else:
            trace = None
        if not trainer.is_global_zero:
            return
        lines = []
        checkpoint = trainer.checkpoint_callback
        saved = (checkpoint.best_model_path or checkpoint.last_model_path) if checkpoint is not None else ""
        if saved:
            self.paths["checkpoint"] = os.path.abspath(saved)
            lines.append(f"checkpoint:  {self.paths['checkpoint']}")
        if self.losses:
            path = self._path(trainer, "loss_curve.png")
            plot_losses(torch.stack(self.losses).tolist(), path)
            self.paths["loss_curve"] = path
            lines.append(f"loss curve:  {path}  ({len(self.losses)} batches)")
        if trace is not None:
            events = read_chrome_trace(trace)
            runs = sorted({e.run for e in events})[-self.timeline_steps:]
            events = [e for e in events if e.run in set(runs)]
            if events:
                path = self._path(trainer, "timeline.png")
                schedule, processes = read_trace_schedule(trace)
                render(events, path, title=f"last {len(runs)} training steps;", schedule=schedule, processes=processes)
                self.paths["timeline"], self.paths["trace"] = path, trace
                self.bubble = bubble_fraction(events, schedule, processes)
                lines.append(f"timeline:    {path}  (bubble: measured {self.bubble[0]:.0%}, {schedule} theory "
                             f"{self.bubble[1]:.0%}; trace for Perfetto: {trace})")
        if lines:
            print("\n".join(["", "PipelineReport:", *("  " + line for line in lines)]), flush=True)

    def _path(self, trainer: pl.Trainer, name: str) -> str:
        directory = self.directory or trainer.log_dir or trainer.default_root_dir
        os.makedirs(directory, exist_ok=True)
        return os.path.abspath(os.path.join(directory, name))
