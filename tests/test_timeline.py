"""The timeline: what each stage ran when, checked against the schedule, and drawn."""

from __future__ import annotations

import json
import sys

import pytest
from strategy_utils import run_command

from lightning_pipe.engine.schedule import gpipe, simulate
from lightning_pipe.engine.timeline import Event, bubble_fraction, read_chrome_trace, render, write_chrome_trace


def ideal(m: int, n: int) -> list[Event]:
    """A perfect GPipe step (the loss on the driver): every action takes one time unit, as soon as it can."""
    simulation = simulate(gpipe(m, n, inputs_first=False), {"F": 1.0, "B": 1.0}, loss_on_last_stage=False)
    return [Event(a.stage, a.kind, a.microbatch, 0, start, end) for a, (start, end) in simulation.times.items()]


@pytest.mark.parametrize("m,n", [(4, 2), (8, 4), (1, 3)])
def test_bubble_of_the_ideal_schedule_is_the_theory(m, n):
    measured, theory = bubble_fraction(ideal(m, n))
    assert theory == pytest.approx((n - 1) / (m + n - 1))
    assert measured == pytest.approx(theory)


def test_trace_roundtrip_and_picture(tmp_path):
    events = ideal(4, 2)
    write_chrome_trace(events, str(tmp_path / "t.json"), ranks=[0, 1])
    trace = json.loads((tmp_path / "t.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["stage 0 (rank 0)", "stage 1 (rank 1)"]
    assert read_chrome_trace(str(tmp_path / "t.json")) == sorted(events, key=events.index)
    render(events, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(900)
def test_timeline_of_a_real_run_follows_the_schedule(tmp_path, jobs):
    trace = jobs.directory("timeline") / "trace.json"  # 3 stages, 4 micro-batches (tests/jobs.py)
    m, n = 4, 3
    events = read_chrome_trace(str(trace))
    runs = sorted({e.run for e in events})
    assert len(runs) == 8  # one per training step
    for run in runs:
        step = [e for e in events if e.run == run]
        for j in range(n):
            mine = sorted((e for e in step if e.stage == j), key=lambda e: e.start)
            # Every micro-batch's forward, then every backward, in schedule order; the stages after the first
            # send the input gradients of their first backward before computing its parameters' gradients,
            # which come last.
            assert [(e.kind, e.microbatch) for e in mine] == \
                [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))] + [("W", m - 1)] * (j > 0)
        at = {(e.kind, e.microbatch, e.stage): e for e in step}
        for i in range(m):
            for j in range(1, n):  # a stage starts a micro-batch after the stage before finished it
                assert at["F", i, j].start >= at["F", i, j - 1].end - 1e-3
                assert at["B", i, j - 1].start >= at["B", i, j].end - 1e-3
    result = run_command([sys.executable, "-m", "lightning_pipe", "timeline", str(trace), str(tmp_path / "t.png")],
                         timeout=60)
    assert "RuntimeWarning" not in result.stdout
    assert "steps of gpipe, bubble fraction measured" in result.stdout and f"theoretical {2 / 6:.1%}" in result.stdout
    assert (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_the_legend_covers_no_bar(schedule, tmp_path, monkeypatch):
    """The legend sits outside the bars (it used to cover the last step of stage 0, GPipe's and 1F1B's alike):
    its box on the rendered picture overlaps no bar's, measured by matplotlib's renderer on the figure that
    :func:`render` draws, with every kind of bar (the averaging over replicas included) and a title."""
    import matplotlib.pyplot as plt

    from lightning_pipe.engine.schedule import schedule_plan

    simulation = simulate(schedule_plan(schedule, 4, 2), {"F": 1.0, "B": 1.0, "W": 1.0})
    events = [Event(a.stage, a.kind, a.microbatch, 0, start, end) for a, (start, end) in simulation.times.items()]
    end = max(e.end for e in events)
    events += [Event(s, "R", -1, 0, end, end + 0.5) for s in (0, 1)]  # under each row, at the very end
    drawn = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: drawn.append(fig))
    render(events, str(tmp_path / "t.png"), title="a title", schedule=schedule)
    (fig,) = drawn
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        bars = [patch for ax in fig.axes for patch in ax.patches]
        assert len(legends) == 1 and len(bars) == len(events)
        box = legends[0].get_window_extent(renderer)
        covered = [e for e, bar in zip(events, bars) if box.overlaps(bar.get_window_extent(renderer))]
        assert covered == []
        # ... and the legend is in the picture, whole, as are the axes' labels
        width, height = fig.canvas.get_width_height()
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height
    finally:
        close(fig)
