"""Tensor parallel inside a stage: the plan resolved and checked (no processes), and applied in 2 processes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_processes
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_pipe.engine.partition import split_module
from lightning_pipe.transport.parallel.tensor import (
    STYLES,
    SummedGradients,
    Whole,
    check_stage_boundaries,
    parallelize_stage,
    resolve_plan,
    stage_plan,
)

PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}


def body() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.norm = nn.LayerNorm(8)


def blocks() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(32, 8), Block(), Block(), nn.Linear(8, 32))


# ------------------------------------------------------------------------------------------------ the names
def test_the_styles_by_name_have_hugging_faces_layouts():
    plan = resolve_plan(body(), {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}, 2)
    assert list(plan) == ["0", "2", "4"]
    assert isinstance(plan["0"], ColwiseParallel) and plan["0"].output_layouts == (Shard(-1),)
    assert isinstance(plan["2"], RowwiseParallel) and plan["2"].input_layouts == (Shard(-1),)
    assert plan["2"].output_layouts == (Replicate(),)
    assert plan["4"].input_layouts == (Replicate(),) and plan["4"].output_layouts == (Replicate(),)
    rep = STYLES["rowwise_rep"]()
    assert isinstance(rep, RowwiseParallel) and rep.input_layouts == (Replicate(),) == rep.output_layouts
    assert STYLES["colwise_gather_output"]().output_layouts == (Replicate(),)
    assert STYLES["embedding_rowwise"]().input_layouts == (Replicate(),)
    sp = STYLES["sequence_parallel"]()
    assert isinstance(sp, SequenceParallel) and sp.sequence_sharding == (Shard(1),) and sp.use_local_output
    assert isinstance(STYLES["replicate"](), Whole)
    assert isinstance(STYLES["replicated_with_grad_allreduce"](), SummedGradients)
    assert STYLES["colwise"]() is not STYLES["colwise"]()  # each entry its own


def test_patterns_as_hugging_face_writes_them_and_styles_as_objects():
    plan = resolve_plan(blocks(), {"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": RowwiseParallel(),
                                   "0": "embedding_rowwise", "3": "colwise_rep"}, 2)
    assert list(plan) == ["0", "1.self_attn.q_proj", "1.self_attn.o_proj", "2.self_attn.q_proj",
                          "2.self_attn.o_proj", "3"]  # the body's order, not the plan's
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    assert list(resolve_plan(model, {"layers.*.self_attn.q_proj": "colwise"}, 4)) == [
        "layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"]


def test_a_name_of_no_module_lists_close_ones():
    with pytest.raises(ValueError, match=r"names no module of the body: '1.self_atn.q_proj'; close names: "
                                         r"'1.self_attn.q_proj'"):
        resolve_plan(blocks(), {"1.self_atn.q_proj": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"'layers.\*.self_attn.q_proj'; close names: '\*.self_attn.q_proj'"):
        resolve_plan(blocks(), {"layers.*.self_attn.q_proj": "colwise"}, 2)
    with pytest.raises(ValueError, match="names no module of the body: '7'"):
        resolve_plan(body(), {"7": "colwise"}, 2)


def test_an_unknown_style_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown style name 'colwize' \(did you mean 'colwise'.*the known names: "
                                         r"colwise, colwise_rep, .*rowwise_rep"):
        resolve_plan(body(), {"0": "colwize"}, 2)
    with pytest.raises(ValueError, match="'packed_colwise', a Hugging Face style .* not supported here.*function"):
        resolve_plan(body(), {"0": "packed_colwise"}, 2)
    with pytest.raises(TypeError, match="ParallelStyle or a style name"):
        resolve_plan(body(), {"0": 3}, 2)


def test_a_dimension_that_does_not_divide_names_the_module_the_dimension_and_the_size():
    with pytest.raises(ValueError, match=r"'0' \(Linear\(in_features=8, out_features=6.*'colwise' over "
                                         r"tensor_parallel_size=4: its out_features \(the weight's dim 0\) is 6, "
                                         r"which does not divide by 4"):
        resolve_plan(nn.Sequential(nn.Linear(8, 6)), {"0": "colwise"}, 4)
    with pytest.raises(ValueError, match=r"in_features \(the weight's dim 1\) is 6"):
        resolve_plan(nn.Sequential(nn.Linear(6, 8)), {"0": "rowwise"}, 4)
    with pytest.raises(ValueError, match=r"num_embeddings \(the weight's dim 0\) is 30"):
        resolve_plan(nn.Sequential(nn.Embedding(30, 8)), {"0": "embedding_rowwise"}, 4)
    assert resolve_plan(nn.Sequential(nn.Linear(8, 6)), {"0": "colwise"}, 3)


def test_a_style_on_a_module_it_cannot_split_and_a_module_named_twice_are_refused():
    with pytest.raises(ValueError, match=r"gives '1' \(Tanh\) the style 'colwise', which splits an nn.Linear only"):
        resolve_plan(body(), {"1": "colwise"}, 2)
    with pytest.raises(ValueError, match="splits an nn.Embedding only"):
        resolve_plan(body(), {"0": "embedding_colwise"}, 2)
    with pytest.raises(ValueError, match="splits an nn.Linear or Embedding only"):
        resolve_plan(body(), {"1": ColwiseParallel()}, 2)
    with pytest.raises(ValueError, match=r"gives the module '1.self_attn.q_proj' twice: by '\*.self_attn.q_proj' "
                                         r"and by '1.self_attn.q_proj'"):
        resolve_plan(blocks(), {"*.self_attn.q_proj": "colwise", "1.self_attn.q_proj": "colwise_rep"}, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        resolve_plan(body(), PLAN, 0)


# ------------------------------------------------------------------------------------------------ the stages
def test_the_plan_at_3_2_leaves_stage_0_whole_and_passes():
    partitions = split_module(body(), [3, 2])
    assert list(check_stage_boundaries(partitions, PLAN, 2)) == ["0", "2", "4"]
    assert list(stage_plan(partitions[0], PLAN, 2)) == ["0", "2"]
    assert list(stage_plan(partitions[1], PLAN, 2)) == ["4"]  # by the body's names, kept by split_module
    renumbered = nn.Sequential(nn.Tanh(), nn.Linear(16, 4))
    assert list(stage_plan(renumbered, PLAN, 2, names={"0": "3", "1": "4"})) == ["1"]


def test_a_stage_leaving_its_output_sharded_to_a_stage_that_takes_it_whole_is_refused():
    with pytest.raises(ValueError, match=r"leaves stage 0's output sharded on dim -1 \('0' is 'colwise'\), and "
                                         r"stage 1's first layer '1' \(Tanh\) is not planned to take slices. Gather it "
                                         r"in stage 0: make '0' 'colwise_rep', or end stage 0 with a 'rowwise' layer"):
        check_stage_boundaries(split_module(body(), [1, 4]), {"0": "colwise"})
    with pytest.raises(ValueError, match="stage 1's first layer '1' \\(Tanh\\)"):
        check_stage_boundaries(split_module(body(), [1, 4]), {"0": "colwise", "2": "rowwise"})
    assert check_stage_boundaries(split_module(body(), [1, 4]), {"0": "colwise_rep"})
    # Slices handed straight to a layer that takes them: each tensor rank to its match in the next stage.
    two = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    assert check_stage_boundaries(split_module(two, [1, 1]), {"0": "colwise", "1": "rowwise"}, 2)


def test_layouts_that_do_not_meet_inside_a_stage_or_at_the_end_are_refused():
    with pytest.raises(ValueError, match=r"leaves the body's output sharded on dim -1 \('0' is 'colwise'\).*"
                                         r"'colwise_rep' for '0'"):
        check_stage_boundaries(split_module(body(), [5]), {"0": "colwise"})
    with pytest.raises(ValueError, match=r"gives '2' \(Linear, stage 0\) 'colwise', which takes its input whole, but "
                                         r"what reaches it is sharded on dim -1 \('0' is 'colwise'\)"):
        check_stage_boundaries(split_module(body(), [5]), {"0": "colwise", "2": "colwise", "4": "colwise_rep"})
    with pytest.raises(ValueError, match=r"'2' \(Linear, stage 1\) 'rowwise', which takes its input sharded on dim "
                                         r"-1, but what reaches it is whole \(the body's input\).*'rowwise_rep'"):
        check_stage_boundaries(split_module(body(), [2, 3]), {"2": "rowwise"})
    assert check_stage_boundaries(split_module(body(), [2, 3]), {"2": "rowwise_rep"})
    # A block's own layouts: its first planned module's input, its last one's output.
    plan = {"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": "rowwise", "0": "embedding_rowwise"}
    assert len(check_stage_boundaries(split_module(blocks(), [2, 2]), plan, 2)) == 5
    with pytest.raises(ValueError, match=r"gives '1.self_attn.q_proj' \(in layer '1', stage 0\) 'colwise'"):
        check_stage_boundaries(split_module(blocks(), [2, 2]), {**plan, "0": ColwiseParallel()})


def test_a_function_plan_is_called_as_it_is():
    calls = []
    stage = body()
    assert parallelize_stage(stage, lambda module, mesh: calls.append((module, mesh)), "mesh") is stage
    assert calls == [(stage, "mesh")]
    assert check_stage_boundaries(split_module(body(), [5]), lambda module, mesh: None) == {}
    with pytest.raises(TypeError, match="applied as it is"):
        resolve_plan(body(), lambda module, mesh: None, 2)
    with pytest.raises(ValueError, match="1-D tensor mesh"):
        parallelize_stage(body(), PLAN, None)


# ------------------------------------------------------------------------------------------------ in processes
class HeadNorm(nn.Module):
    """A norm over each head of 4 (as Qwen3's q_norm): after a colwise layer, each rank sees its own heads."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, 4))
        return F.layer_norm(heads, (4,), self.weight).flatten(-2)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, stages: list[nn.Module] | None = None) -> torch.Tensor:
    out = x
    for stage in stages or [model]:
        out = stage(out)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    F.mse_loss(out, y).backward()
    optimizer.step()
    return out.detach()


def _plain(t: torch.Tensor) -> Any:
    """``t``'s values, to return to the test's process: a numpy array (a tensor would travel as shared memory,
    gone with the process that made it)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t.detach())  # (a collective's result may be a subclass still waiting for it)
    return out.numpy()


def _tensor_parallel(rank: int, world: int, path: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        torch.manual_seed(0)
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        results: dict[str, object] = {}
        cases = {
            "[3, 2]": (body(), PLAN, [3, 2]),
            "[5]": (body(), PLAN, [5]),
            "heads": (nn.Sequential(nn.Linear(8, 16), HeadNorm(), nn.Linear(16, 4)),
                      {"0": "colwise", "1": "replicated_with_grad_allreduce", "2": "rowwise"}, [2, 1]),
            "rep": (nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                    {"0": "rowwise_rep", "2": "colwise_gather_output"}, [3]),
        }
        for case, (plain, plan, balance) in cases.items():
            model = copy.deepcopy(plain)
            stages = split_module(model, balance)
            check_stage_boundaries(stages, plan, 2)
            for stage in stages:
                parallelize_stage(stage, plan, mesh)
            expected, out = _plain(_step(plain, x, y)), _step(model, x, y, stages)
            weights = {n: _plain(p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
            local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
            results[case] = (_plain(out), expected, weights, {n: _plain(p) for n, p in plain.named_parameters()}, local)
        return results
    finally:
        dist.destroy_process_group()


def test_a_body_split_over_2_tensor_ranks_gives_the_plain_models_outputs_and_weights(tmp_path):
    results = run_processes(_tensor_parallel, 2, str(tmp_path / "store"), timeout=90)
    for rank, cases in results.items():
        for case, (out, expected, weights, plain, _) in cases.items():
            out, expected = torch.from_numpy(out), torch.from_numpy(expected)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {case}: outputs")
            assert weights.keys() == plain.keys()
            for name in plain:
                torch.testing.assert_close(torch.from_numpy(weights[name]), torch.from_numpy(plain[name]), rtol=1e-5,
                                           atol=1e-6, msg=f"rank {rank} {case}: {name} after a step")
        assert cases["[3, 2]"][4] == {"0.weight": (8, 8), "0.bias": (8,), "2.weight": (16, 8), "2.bias": (16,),
                                      "4.weight": (2, 16), "4.bias": (2,)}  # each rank holds half of each
        assert cases["heads"][4]["0.weight"] == (8, 8) and "1.weight" not in cases["heads"][4]
