"""The GPipe schedule, checked as data."""

import pytest

from lightning_pipe.engine.schedule import backward_plan, clock_cycles, forward_plan, render, stage_order


def test_clock_cycles_4x3():
    assert list(clock_cycles(4, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(3, 0), (2, 1), (1, 2)],
        [(3, 1), (2, 2)],
        [(3, 2)],
    ]


def test_forward_plan_golden():
    assert render(forward_plan(3, 2)) == "0F0\n0F1 1F0\n0F2 1F1\n1F2"


def test_backward_plan_golden():
    assert render(backward_plan(3, 2)) == "1B2\n1B1 0B2\n1B0 0B1\n0B0"


@pytest.mark.parametrize("m,n", [(1, 1), (1, 4), (4, 1), (8, 2), (16, 4), (3, 5)])
def test_plan_properties(m, n):
    fwd, bwd = forward_plan(m, n), backward_plan(m, n)
    assert len(fwd) == len(bwd) == m + n - 1  # the GPipe bound: m + n - 1 ticks each way
    done = set()
    for tick in fwd:
        stages = [a.stage for a in tick]
        assert len(stages) == len(set(stages))  # a stage does one thing per tick
        for a in tick:
            assert a.stage == 0 or (a.microbatch, a.stage - 1) in done  # input ready
        done |= {(a.microbatch, a.stage) for a in tick}
    assert done == {(i, j) for i in range(m) for j in range(n)}
    done = set()
    for tick in bwd:
        for a in tick:
            assert a.stage == n - 1 or (a.microbatch, a.stage + 1) in done
        done |= {(a.microbatch, a.stage) for a in tick}
    assert len(done) == m * n
    for j in range(n):
        assert [a.microbatch for a in stage_order(fwd, j)] == list(range(m))
        assert [a.microbatch for a in stage_order(bwd, j)] == list(reversed(range(m)))


def test_bad_sizes():
    with pytest.raises(ValueError, match=r"m: 0, n: 2"):
        list(clock_cycles(0, 2))
