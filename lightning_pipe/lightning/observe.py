"""Seeing a pipeline at work from its driver: the timeline of its stages, and each process's memory.

A timeline records when each stage ran the forward and backward of each micro-batch (every stage of the
driver's pipeline records its own events; the driver collects them into one Chrome trace). Memory is each
process's resident size and what the pipeline keeps between steps (all 0 when idle).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.engine.timeline import Recorder, write_chrome_trace
from lightning_pipe.lightning.body import PipelinedSequential
from lightning_pipe.transport.stages import host

__all__: list[str] = []


def _stages(body: PipelinedSequential | None, what: str) -> tuple[PipelinedSequential, host.HostGroup]:
    if body is None or body.hosts is None:
        raise RuntimeError(f"{what} needs the pipeline, which PipeStrategy sets up when fit, validate, test or "
                           "predict starts; call it from on_fit_start or later")
    return body, body.hosts


def record_timeline(body: PipelinedSequential | None, on: bool) -> None:
    """Start (keeping what is recorded already) or stop recording every stage of ``body``'s pipeline."""
    body, hosts = _stages(body, "record_timeline()")
    stage = body.pipeline.runner.stage
    if on != (stage.recorder is not None):
        stage.recorder = Recorder() if on else None
        hosts.call("set_recording", on)


def write_timeline(body: PipelinedSequential | None, path: str, ranks: Sequence[int]) -> None:
    """Write what every stage of ``body``'s pipeline (at ``ranks``) recorded as a Chrome trace at ``path``."""
    body, hosts = _stages(body, "write_timeline()")
    stage = body.pipeline.runner.stage
    events = stage.recorder.events() if stage.recorder is not None else []
    for part in hosts.call("timeline_events"):
        events += part
    write_chrome_trace(events, path, ranks=ranks, schedule=body.schedule, processes=body.processes)


def memory(body: PipelinedSequential | None) -> list[dict[str, int]]:
    """Per process of ``body``'s pipeline, stage by stage: resident memory (bytes) and the pipeline's
    bookkeeping between steps (saved micro-batches, undelivered messages, seeds)."""
    body, hosts = _stages(body, "memory_per_process()")
    return [host.process_memory(body.pipeline.runner), *hosts.call("memory")]
