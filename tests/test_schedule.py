"""Schedules as data: golden plans, and every plan simulated (it finishes, runs each action once, and has the
bubble and the memory its theory says)."""

import pytest

from lightning_pipe.engine.multistage import zbv
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
                                          ("interleaved-1f1b", 3), ("interleaved-zero-bubble", 2),
                                          ("interleaved-zero-bubble", 3), ("looped-bfs", 2), ("looped-bfs", 3),
                                          ("zbv", 2), ("dualpipev", 2))
         for m, p in ((1, 1), (1, 3), (4, 1), (4, 2), (8, 4), (3, 5), (16, 4), (12, 3))
         if not name.startswith("interleaved") or m % max(1, m // p) == 0
         if name != "dualpipev" or m >= 2 * p]


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


KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def pipelinings(name: str, m: int, p: int, v: int) -> str:
    """torch.distributed.pipelining's order of schedule ``name``, rendered as ours (its no-ops left out, its
    overlapped forward and backward as the two in turn), computed by its own code without a process group."""
    from torch.distributed.pipelining import schedules

    cls = {"zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV,
           "looped-bfs": schedules.ScheduleLoopedBFS,
           "interleaved-zero-bubble": schedules.ScheduleInterleavedZeroBubble}[name]
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = p, m, v
    schedule.num_stages = schedule._num_stages = p * v
    schedule._stages = [None] * v
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    lines = []
    for rank in range(p):
        schedule.rank = rank
        actions = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
        flat = [b for a in actions for b in (getattr(a, "sub_actions", None) or (a,))]
        lines.append(" ".join(f"{b.stage_index}{KINDS[b.computation_type.name]}{b.microbatch_index}" for b in flat))
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "looped-bfs", "interleaved-zero-bubble"])
@pytest.mark.parametrize("m,p", [(4, 2), (8, 2), (8, 4), (6, 3), (12, 3)])
def test_the_schedules_pipelining_also_has_run_in_its_order(name, m, p):
    """The order each process runs its actions in is pipelining's own (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``), so that a torchtitan user's
    schedule by name is the same schedule here; the V shapes put stages r and 2p - 1 - r in process r."""
    plan = schedule_plan(name, m, p, 2)
    assert plan.render() == pipelinings(name, m, p, 2)
    if name in ("zbv", "dualpipev"):
        assert [plan.process_of(s) for s in range(2 * p)] == [*range(p), *reversed(range(p))]
        assert plan.process_of(0) == plan.process_of(2 * p - 1) == 0  # the batch and the loss in one process


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-zero-bubble", "looped-bfs"])
@pytest.mark.parametrize("m,p", [(8, 2), (8, 4), (16, 4)])
def test_the_new_schedules_have_their_theorys_bubble(name, m, p):
    """With forward, input-gradient and weight-gradient times equal (a whole backward twice one), the V shapes
    and interleaved zero-bubble leave a bubble of (p - 1) / (6m + p - 1), a third of interleaved 1F1B's; looped
    BFS has interleaved 1F1B's, and holds every micro-batch in every stage."""
    simulation = simulate(schedule_plan(name, m, p, 2), {"F": 1, "I": 1, "W": 1, "B": 2})
    bubble, held = theory(name, m, p, 2)
    assert simulation.bubble == pytest.approx(bubble)
    if held:
        assert list(simulation.held) == held
    if name != "looped-bfs":
        assert simulation.bubble < simulate(interleaved_1f1b(m, p, 2), {"F": 1, "B": 2}).bubble / 2


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
                                                r"'zero-bubble', .*'dualpipev', or a list of each process's actions "
                                                r"\(got: 'pipedream'\)"),
    (lambda: schedule_plan("zbv", 4, 2, 3),
     r"zbv runs a V of exactly 2 stages per process \(virtual_stages=2; got 3\)"),
    (lambda: schedule_plan("dualpipev", 3, 2, 2), r"dualpipev needs at least as many micro-batches as stages "
                                                  r"\(micro-batches: 3, stages: 4\): use microbatches=4"),
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
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "interleaved-zero-bubble",
                              "looped-bfs", "zbv", "dualpipev"}


def test_a_schedule_given_as_data_runs_as_written():
    """A user's action list per process (pipelining's text form; its communication actions passed over), or a CSV
    file of them, is a plan: its placement read from the stages each process names (here a V)."""
    from lightning_pipe.engine.plan import plan_from_actions

    rows = [zbv(4, 2).actions[0], [str(a) for a in zbv(4, 2).actions[1]]]
    plan = plan_from_actions([list(rows[0]), ["1RECV_F0", *rows[1], "1SEND_B0"]], microbatches=4)
    assert plan.actions == zbv(4, 2).actions and plan.placement == (0, 1, 1, 0)
    assert schedule_plan(plan, 4, 2, 2) is plan
    with pytest.raises(ValueError, match=r"runs 4 micro-batches on 2 processes of 2 stages each, and the pipeline has "
                                         r"3 micro-batches"):
        schedule_plan(plan, 3, 2, 2)


def test_a_schedule_given_as_data_from_a_csv_file(tmp_path):
    from lightning_pipe.engine.plan import plan_from_actions

    path = tmp_path / "schedule.csv"
    path.write_text("\n".join(",".join(map(str, row)) for row in one_f_one_b(4, 2).actions) + "\n")
    assert plan_from_actions(str(path)).actions == one_f_one_b(4, 2).actions


@pytest.mark.parametrize("rows,message", [
    ([["0F0", "0F1", "0B1", "0B0"], ["1F0", "1B1", "1F1", "1B0"]],
     r"process 1's action 1B1 comes before that micro-batch's forward on stage 1"),
    ([["0F1", "0F0", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]],
     r"process 0's action 0F1 comes before stage 0's forward of micro-batch 0"),
    ([["0F0", "0W0", "0I0"], ["1F0", "1B0"]], r"process 0's action 0W0 comes before its input gradients \(0I0\)"),
    ([["0F0", "0I0"], ["1F0", "1B0"]], r"stage 0's micro-batch 0 lacks its W \(it has: 0F0, 0I0\)"),
    ([["0F0", "0B0", "0B0"], ["1F0", "1B0"]], r"process 0's action 0B0 runs a second time"),
    ([["0F0", "0B0", "1F0"], ["1F0", "1B0"]], r"process 1's action 1F0 is of stage 1, which process 0 runs too"),
    ([["1F0", "1B0"], ["0F0", "0B0"]], r"stage 0 by process 0 \(where the batch is\): stage 0 is on process 1"),
    ([["0F0", "0X0"], ["1F0"]], r"process 0, action 1: '0X0' is not an action"),
    ([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B1", "1B0"]],
     r"plan 'custom' cannot finish: every process waits \(0B0, 1F1\)"),
])
def test_a_malformed_action_list_is_refused_naming_the_first_action_that_breaks_a_rule(rows, message):
    from lightning_pipe.engine.plan import plan_from_actions

    with pytest.raises(ValueError, match=message):
        plan_from_actions(rows)


@pytest.mark.parametrize("name,v", [(name, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1),
                                                               ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2),
                                                               ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2))])
@pytest.mark.parametrize("m,p", [(4, 2), (8, 4)])
def test_each_stage_has_one_last_backward_for_its_replicas_to_average_on(name, v, m, p):
    """With replicas, a stage's gradients are averaged as its last backward of the step computes them. DualPipeV
    runs whole backwards after the W of its first, split ones: that W counted as last too, its reduction ran while
    later backwards accumulated (DDP: "marked ready twice", now and then). Every stage of every schedule has one."""
    from lightning_pipe.transport.parallel.averages import is_last_backward

    plan = schedule_plan(name, m, p, v)
    for actions in plan.actions:
        later: dict[tuple[int, int], object] = {}  # the W left to run by each I (every backward split here)
        used: dict[int, list[str]] = {}
        for k, a in enumerate(actions):
            if a.kind == "F":
                continue
            last = is_last_backward(actions, k, later)
            if a.kind == "I":
                later[(a.stage, a.microbatch)] = object()  # split: its W computes the parameters' gradients
            else:
                later.pop((a.stage, a.microbatch), None)
                if last:  # (a split I's candidate goes unused: its W runs the reduction)
                    used.setdefault(a.stage, []).append(str(a))
        for s in {a.stage for a in actions}:
            final = [str(a) for a in actions if a.stage == s and a.kind != "F"][-1]
            assert used.get(s) == [final], (s, used.get(s))
