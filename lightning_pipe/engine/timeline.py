"""When each stage ran the forward and backward of each micro-batch: recording, Chrome traces, pictures.

    python -m lightning_pipe timeline trace.json timeline.png

renders a trace written by ``PipeStrategy(timeline="trace.json")`` (or :func:`write_chrome_trace`) as a
stages × time picture (forward, backward and deferred parameter gradients in their own colours, bubbles
blank) and prints the measured bubble
fraction beside GPipe's theoretical one, (p − 1) / (m + p − 1). The trace opens in Perfetto as well.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Event", "Recorder", "bubble_fraction", "read_chrome_trace", "read_trace_schedule", "render",
           "write_chrome_trace"]


@dataclass(frozen=True)
class Event:
    """Stage ``stage`` ran ``kind`` of micro-batch ``microbatch`` of step ``run`` from ``start`` to ``end``
    (seconds since the epoch, so that processes on one machine share a clock). Kinds: ``"F"`` forward,
    ``"B"`` backward, ``"W"`` the parameters' gradients of a backward whose input gradients went first, ``"R"``
    the averaging of the stage's gradients over replicas left after its last backward (``microbatch`` -1)."""

    stage: int
    kind: str
    microbatch: int
    run: int
    start: float
    end: float


class Recorder:
    """Collects the events of one stage (thread-safe), keeping the latest ``limit`` so that memory stays
    bounded on long runs and the last steps are always there to draw."""

    def __init__(self, limit: int = 200_000) -> None:
        self._events: collections.deque[Event] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()
        self.limit = limit

    def record(self, stage: int, kind: str, microbatches: Iterable[int], run: int, start: float) -> None:
        """Record that ``kind`` of ``microbatches`` ran from ``start`` until now."""
        end = time.time()
        with self._lock:
            for i in microbatches:
                self._events.append(Event(stage, kind, i, int(run), start, end))

    def events(self) -> list[Event]:
        """Everything recorded so far."""
        with self._lock:
            return list(self._events)


def write_chrome_trace(events: Sequence[Event], path: str, ranks: Sequence[int] | None = None,
                       schedule: Any = "gpipe", processes: int | None = None) -> None:
    """Write ``events`` as a Chrome trace (one track per stage), viewable in Perfetto or chrome://tracing;
    ``schedule`` and ``processes`` (stage ``s`` ran in process ``s % processes``, or in a V for the V-shaped
    schedules) are kept beside them, for :func:`bubble_fraction`. ``ranks[r]``: the rank of process ``r``."""
    from lightning_pipe.engine.schedule import placement_of

    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    stages = sorted({e.stage for e in events})
    processes = processes or len(stages) or 1
    placement = placement_of(schedule, processes, len(stages) // processes) if len(stages) % processes == 0 else ()
    for stage in stages:
        process = placement[stage] if placement else stage % processes
        rank = ranks[process] if ranks is not None else process
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
                      "args": {"name": f"stage {stage} (rank {rank})"}})
    for e in events:
        category = {"F": "forward", "R": "reduction"}.get(e.kind, "backward")
        trace.append({"name": f"{e.kind}{e.microbatch}" if e.kind != "R" else "all-reduce", "cat": category,
                      "ph": "X", "pid": 0, "tid": e.stage, "ts": (e.start - origin) * 1e6,
                      "dur": (e.end - e.start) * 1e6, "args": asdict(e)})
    named = schedule if isinstance(schedule, str) else [[str(a) for a in row] for row in schedule.actions]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms",
                   "metadata": {"schedule": named, "processes": processes}}, f)


def read_chrome_trace(path: str) -> list[Event]:
    """The events of a trace written by :func:`write_chrome_trace`."""
    with open(path) as f:
        trace = json.load(f)
    return [Event(**e["args"]) for e in trace["traceEvents"] if e.get("ph") == "X"]


def read_trace_schedule(path: str) -> tuple[Any, int | None]:
    """The schedule (its name, or the plan of one given as data) and the number of processes a trace was recorded
    with (``("gpipe", None)`` if unsaid)."""
    with open(path) as f:
        metadata = json.load(f).get("metadata", {})
    schedule = metadata.get("schedule", "gpipe")
    if not isinstance(schedule, str):
        from lightning_pipe.engine.plan import plan_from_actions

        schedule = plan_from_actions(schedule)
    return schedule, metadata.get("processes")


def bubble_fraction(events: Sequence[Event], schedule: Any = "gpipe", processes: int | None = None
                    ) -> tuple[float, float]:
    """(measured, theoretical) idle fraction of the processes over the steps in ``events``.

    Measured: per step, 1 − busy time / (processes × the step's span). Theoretical: ``schedule``'s bubble with
    a backward twice a forward (:func:`~lightning_pipe.engine.schedule.theory`): for GPipe and 1F1B
    (p − 1) / (m + p − 1). ``processes``: default, one per stage.
    """
    from lightning_pipe.engine.schedule import theory

    events = [e for e in events if e.kind != "R"]  # communication, not a stage's computation
    runs = sorted({e.run for e in events})
    stages = len({e.stage for e in events})
    processes = processes or stages
    measured, micro = [], []
    for run in runs:
        step = [e for e in events if e.run == run]
        span = max(e.end for e in step) - min(e.start for e in step)
        # An event may cover several micro-batches at once (pipelined_backward=False): count its time once.
        busy = sum(e.end - e.start for e in {(e.stage, e.kind, e.start, e.end): e for e in step}.values())
        if span > 0:
            measured.append(1 - busy / (processes * span))
        micro.append(len({e.microbatch for e in step}))
    m = max(micro, default=1)
    expected = theory(schedule, m, processes, max(1, stages // processes))[0]
    return (sum(measured) / len(measured) if measured else 0.0), expected


def render(events: Sequence[Event], path: str, title: str = "", schedule: Any = "gpipe",
           processes: int | None = None) -> None:
    """Draw ``events`` as stages × time (forward blue, backward orange, parameters' gradients computed after
    the input gradients red, the averaging over replicas left after a stage's last backward green under its
    row, bubbles blank, the legend below the axes, clear of every bar) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(e.start for e in events)
    stages = sorted({e.stage for e in events})
    # Constrained layout keeps room below the axes for the legend (drawn there, out of the bars' way).
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(stages) + 2.0), layout="constrained")
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "R": "#55A868"}
    for e in events:
        color = colors.get(e.kind, "#DD8452")
        reduction = e.kind == "R"  # a thin bar under the stage's row: its averaging over replicas
        ax.barh(e.stage + (0.45 if reduction else 0.0), (e.end - e.start) * 1e3, left=(e.start - origin) * 1e3,
                height=0.2 if reduction else 0.8, color=color, edgecolor="white", linewidth=0.5)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    measured, expected = bubble_fraction(events, schedule, processes)
    label = schedule if isinstance(schedule, str) else "a schedule given as data"
    ax.set_title(f"{title} {label}; bubble: measured {measured:.0%}, theory {expected:.0%}".strip())
    from matplotlib.patches import Patch

    handles = [Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward")]
    if any(e.kind == "W" for e in events):
        handles.append(Patch(color=colors["W"], label="parameters' gradients, after the input gradients"))
    if any(e.kind == "R" for e in events):
        handles.append(Patch(color=colors["R"], label="averaging over replicas, after the last backward"))
    # Below the axes, not inside them: inside, it covered the last steps of stage 0 (the first row).
    fig.legend(handles=handles, loc="outside lower center", ncols=2 if len(handles) == 4 else len(handles),
               frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m lightning_pipe timeline``."""
    parser.add_argument("trace", metavar="TRACE", help="the JSON trace written by PipeStrategy(timeline=...)")
    parser.add_argument("png", metavar="PNG", help="where to write the picture")
    parser.add_argument("--last", type=int, default=3, metavar="N",
                        help="how many of the last steps to draw (default: 3; 0: all)")


def run(args: argparse.Namespace) -> None:
    """Render the trace ``args.trace`` as a PNG and print the measured and theoretical bubble fractions."""
    events = read_chrome_trace(args.trace)
    if not events:
        raise SystemExit(f"{args.trace} holds no pipeline events")
    runs = sorted({e.run for e in events})
    if args.last:
        keep = set(runs[-args.last:])
        events = [e for e in events if e.run in keep]
    schedule, processes = read_trace_schedule(args.trace)
    render(events, args.png, schedule=schedule, processes=processes)
    measured, expected = bubble_fraction(events, schedule, processes)
    print(f"wrote {args.png}: {len({e.run for e in events})} steps of {schedule}, bubble fraction measured "
          f"{measured:.1%}, theoretical {expected:.1%}")


def main(argv: Sequence[str] | None = None) -> None:
    """Render a trace as a PNG and print the measured and theoretical bubble fractions (what ``python -m
    lightning_pipe timeline`` runs)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe timeline",
                                     description="Render a lightning_pipe timeline (Chrome trace) as a PNG.")
    add_arguments(parser)
    run(parser.parse_args(argv))
