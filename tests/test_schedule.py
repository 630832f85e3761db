"""Schedules as data: golden plans, and every plan simulated (it finishes, runs each action once, and has the
bubble and the memory its theory says)."""

import pytest

from lightning_pipe.engine.schedule import (
    SCHEDULES,
    Action,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_plan,
    simulate,
    theory,
    zero_bubble,
)


def test_golden_plans():
    assert gpipe(3, 2).render() == "0F0 0F1 0F2 0B2 0B1 0B0\n1F0 1F1 1F2 1I2 1B1 1B0 1W2"
    assert gpipe(2, 2, pipelined=False, inputs_first=False).render() == "0F0 0F1 0B*\n1F0 1F1 1B*"
    assert one_f_one_b(4, 2).render() == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    assert zero_bubble(4, 2).render() == ("0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3\n"
                                          "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3")
    assert interleaved_1f1b(4, 2, 2).render() == ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
                                                  "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3")
    assert forward_only(2, 2, 2).render() == "0F0 0F1 2F0 2F1\n1F0 1F1 3F0 3F1"


CASES = [(name, m, p, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2),
                                          ("interleaved-1f1b", 3))
         for m, p in ((1, 1), (1, 3), (4, 1), (4, 2), (8, 4), (3, 5), (16, 4), (12, 3))
         if name != "interleaved-1f1b" or m % max(1, m // p) == 0]


@pytest.mark.parametrize("name,m,p,v", CASES)
def test_every_plan_finishes_and_runs_every_action_once(name, m, p, v):
    plan = schedule_plan(name, m, p, v)
    assert (plan.microbatches, plan.processes, plan.stages) == (m, p, p * v)
    seen: dict[tuple[int, str, int], int] = {}
    for r, actions in enumerate(plan.actions):
        assert all(plan.process_of(a.stage) == r for a in actions)  # each process runs its own stages only
        for a in actions:
            seen[a] = seen.get(a, 0) + 1
    assert set(seen.values()) == {1}
    for s in range(plan.stages):
        forwards = [a.microbatch for a in plan.actions[plan.process_of(s)] if a.stage == s and a.kind == "F"]
        assert forwards == list(range(m))  # in micro-batch order: a stage keeps its inputs' order
        full = {a.microbatch for a in seen if a.stage == s and a.kind == "B"}
        split = {a.microbatch for a in seen if a.stage == s and a.kind == "I"}
        assert full | split == set(range(m)) and not full & split  # one backward per micro-batch
        assert split == {a.microbatch for a in seen if a.stage == s and a.kind == "W"}  # and the rest of a split one
    simulation = simulate(plan)  # raises if some process would wait forever
    assert simulation.makespan > 0 and 0 <= simulation.bubble < 1


@pytest.mark.parametrize("m,p", [(4, 2), (8, 4), (16, 4), (8, 8)])
def test_1f1b_has_gpipes_bubble_and_holds_p_minus_j(m, p):
    simulation = simulate(one_f_one_b(m, p), {"F": 1, "B": 2})
    bubble, held = theory("1f1b", m, p)
    assert simulation.bubble == pytest.approx(bubble)
    assert list(simulation.held) == held
    assert list(simulate(gpipe(m, p, inputs_first=False), {"F": 1, "B": 2}).held) == [m] * p


@pytest.mark.parametrize("m,p,v", [(8, 4, 2), (16, 4, 2), (12, 3, 4), (4, 2, 2)])
def test_interleaving_shrinks_the_bubble_v_times(m, p, v):
    simulation = simulate(interleaved_1f1b(m, p, v), {"F": 1, "B": 2})
    assert simulation.bubble == pytest.approx(theory("interleaved-1f1b", m, p, v)[0])
    assert simulation.bubble < simulate(one_f_one_b(m, p), {"F": 1, "B": 2}).bubble


@pytest.mark.parametrize("m,p", [(4, 2), (8, 4), (16, 4)])
def test_zero_bubble_fills_the_drain_with_parameter_gradients(m, p):
    simulation = simulate(zero_bubble(m, p), {"F": 1, "I": 1, "W": 1})
    assert simulation.bubble == pytest.approx(theory("zero-bubble", m, p)[0])
    assert simulation.bubble < simulate(one_f_one_b(m, p), {"F": 1, "B": 2}).bubble / 2
    assert simulation.held[0] == min(m, p)  # stage 0 holds what 1F1B's does


def test_a_plan_that_cannot_finish_is_reported():
    from lightning_pipe.engine.schedule import Plan

    backwards_first = Plan("broken", 1, 2, 2, ((Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0),
                                                                                       Action(1, "B", 0))))
    with pytest.raises(ValueError, match=r"plan 'broken' cannot finish: every process waits \(0B0, 1F0\)"):
        simulate(backwards_first)


def test_eager_plans_are_those_that_interleave():
    assert not gpipe(4, 2).eager and not forward_only(4, 2).eager
    assert one_f_one_b(4, 2).eager and zero_bubble(4, 2).eager and interleaved_1f1b(4, 2, 2).eager
    assert not one_f_one_b(1, 1).eager  # one micro-batch: nothing to interleave


@pytest.mark.parametrize("call,message", [
    (lambda: schedule_plan("pipedream", 4, 2), r"schedule must be one of 'gpipe', '1f1b', 'interleaved-1f1b', "
                                                r"'zero-bubble' \(got: 'pipedream'\)"),
    (lambda: schedule_plan("gpipe", 0, 2), r"the number of micro-batches must be a positive integer \(got: 0\)"),
    (lambda: schedule_plan("1f1b", 4, 2, 2), r"1f1b runs one stage per process \(stages per process: 2\)"),
    (lambda: schedule_plan("interleaved-1f1b", 4, 2, 1), r"needs at least 2 stages per process"),
    (lambda: schedule_plan("interleaved-1f1b", 9, 4, 2),
     r"number of micro-batches \(9\) to be a multiple of the number of rounds \(2 = max\(1, micro-batches // "
     r"processes\)\)"),
])
def test_bad_plans_are_refused_with_the_numbers(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_schedule_has_a_plan():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}
