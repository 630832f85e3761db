"""Tensor parallel inside a stage: the plan resolved and checked (no processes), and applied in 2 processes."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_processes
from jobs import GROUPS
from jobs import config as case_config
from strategy_utils import assert_same_weights
from test_strategy import load, plain_weights, script
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


def test_slices_on_another_dimension_than_a_layer_takes_are_refused():
    """Layouts were compared as "sharded or not" alone: a layer taking slices on one dimension accepted slices on
    another (rows where it cuts columns), and trained on the wrong numbers. Dimensions of one sign are compared
    now, inside a stage and from stage to stage."""
    rows, cols = ColwiseParallel(output_layouts=Shard(0)), RowwiseParallel(input_layouts=Shard(1))
    two = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"which takes its input sharded on dim 1, but what reaches it is sharded on "
                                         r"dim 0 .*takes what reaches it"):
        check_stage_boundaries(split_module(two, [2]), {"0": rows, "1": cols})
    with pytest.raises(ValueError, match=r"leaves stage 0's output sharded on dim 0 .* stage 1's first layer '1' "
                                         r"\(Linear\) is not planned to take slices"):
        check_stage_boundaries(split_module(two, [1, 1]), {"0": rows, "1": cols})
    assert check_stage_boundaries(split_module(two, [1, 1]), {"0": rows, "1": RowwiseParallel(input_layouts=Shard(0))})


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
    results = run_processes(_tensor_parallel, 2, str(tmp_path / "store"), timeout=120)
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


def _dropout_masks(rank: int, world: int, path: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 4))
        plan = {"0": "colwise", "2": "rowwise"}
        check_stage_boundaries([model], plan, 2)
        parallelize_stage(model, plan, mesh)
        seen: dict[str, object] = {}
        for name in ("1", "3"):
            model.get_submodule(name).register_forward_hook(
                lambda m, a, out, name=name: seen.__setitem__(name, _plain(out == 0)))
        torch.manual_seed(1)  # the same stream in both ranks, as the engine seeds each micro-batch
        out = model(torch.randn(16, 8))
        return {**seen, "out": _plain(out), "after": _plain(torch.rand(3))}
    finally:
        dist.destroy_process_group()


def test_a_dropout_on_slices_draws_each_tensor_ranks_own_mask_and_one_on_whole_activations_the_same(tmp_path):
    """A ``Dropout`` between a colwise and a rowwise layer acts on each rank's slice of the features: both ranks drew
    their masks from the stream they share, so slice 0 and slice 1 got the same mask (correlated, which one device
    never draws; Megatron keeps a generator per tensor rank there). Each rank now draws its own there, the stream
    they share left where it would be; a dropout on whole activations (after the rowwise layer) masks alike in
    every rank, as it must, and the output is the same in both."""
    results = run_processes(_dropout_masks, 2, str(tmp_path / "store"), timeout=120)
    first, second = results[0], results[1]
    assert first["1"].shape == (16, 32) and 0.3 < first["1"].mean() < 0.7  # each rank's slice, half dropped
    assert (first["1"] != second["1"]).mean() > 0.3, "the slices' masks are the same in both tensor ranks"
    assert (first["3"] == second["3"]).all()  # whole activations: one mask
    assert (first["out"] == second["out"]).all() and (first["after"] == second["after"]).all()


def _sequence_parallel_clipping(rank: int, world: int, path: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from lightning_pipe.transport.parallel import fsdp

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        model = copy.deepcopy(plain)
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(1)), "3": "sequence_parallel",
                "4": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        check_stage_boundaries([model], plan, 2)
        parallelize_stage(model, plan, mesh)
        x = torch.randn(2, 6, 8)
        for m in (plain, model):
            m(x).pow(2).sum().backward()
        results: dict[str, object] = {"placements": str(model[3].weight.grad.placements)}
        norm = fsdp.total_norm(fsdp.settle(model.parameters()), 2.0)
        results["norm"] = (norm, float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])))
        for g in fsdp.settle(model.parameters()):  # clipped by value, as clip_by_value does
            fsdp.local(g).detach().clamp_(-0.5, 0.5)
        torch.nn.utils.clip_grad_value_(plain.parameters(), 0.5)
        for m in (plain, model):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        results["weights"] = {n: (_plain(p.full_tensor() if isinstance(p, DTensor) else p), _plain(q))
                              for (n, p), q in zip(model.named_parameters(), plain.parameters())}
        return results
    finally:
        dist.destroy_process_group()


def test_partial_gradients_of_sequence_parallel_norms_are_summed_before_a_norm_or_a_clamp(tmp_path):
    """A norm under ``"sequence_parallel"`` sees its rank's slice of the sequence: its gradient is ``Partial``, each
    rank holding a part of the sum. The global norm counted each rank's part (the two ranks found 50.81 and 50.82,
    one device 51.39, and clipped by different coefficients), and clipping by value clamped the parts. The parts
    are now summed first: both ranks find one device's norm, and clamp as one device does."""
    results = run_processes(_sequence_parallel_clipping, 2, str(tmp_path / "store"), timeout=120)
    for rank, result in results.items():
        assert "Partial" in result["placements"]  # (what the fix is for)
        norm, plain = result["norm"]
        assert norm == pytest.approx(plain, rel=1e-5), f"rank {rank}: the global norm"
        for name, (got, expected) in result["weights"].items():
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected), rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: {name} after a step clipped by value")


# ---------------------------------------------------------------------------------- through PipeStrategy
#: Compared with one device on the global batch (the others: with a run they resume, or in their own tests).
TRAINED = [name for group in ("4 processes tensor parallel", "8 processes tensor parallel") for name in GROUPS[group]
           if not name.startswith(("tp-llama", "tp-resume-from", "tp-bf16", "tp-fp16")) and "from-dcp" not in name]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TRAINED)
def test_stages_split_over_tensor_ranks_train_the_plain_models_weights(name, jobs, tmp_path):
    """2 stages x 2 tensor ranks under every schedule (AdamW clipped by the global norm; 1F1B, zero-bubble and
    interleaved 1F1B with the loss on the last stage), saving DCP checkpoints, and 2 replicas of them averaged, or
    sharded by FULL_SHARD after tensor parallel (8 processes): one device's weights on the global batch, within
    rtol 1e-4 / atol 2e-5. Every process holds its half of each split layer (at most 0.6 of its stage: the rowwise
    bias stays whole), and, under FULL_SHARD, half of that again; AdamW's state is two tensors the size of what it
    holds. No collective is left unwaited in any driver."""
    config = case_config(name)
    out = jobs.directory(name)
    assert_same_weights(load(out / "final.ckpt"), plain_weights(config, tmp_path / "plain"), rtol=1e-4, atol=2e-5)
    processes = len(config["balance"]) // config.get("virtual_stages", 1)
    pipelines = config["devices"] // processes
    held = [json.loads((out / f"held_replica{k}.json").read_text()) for k in range(pipelines)]
    # No collective left unwaited in any driver (a recomputed micro-batch's split output was, one per micro-batch).
    assert [json.loads((out / f"unwaited_replica{k}.json").read_text()) for k in range(pipelines)] == [0] * pipelines
    limit = 0.6 / (2 if config.get("sharding") == "FULL_SHARD" else 1)
    for process in range(processes):
        parts = [pipeline[process] for pipeline in held]
        assert all(0 < part["parameters"] <= limit * part["whole"] for part in parts), parts
        if config.get("optimizer") == "adamw":
            assert all(part["optimizer"] == 2 * part["parameters"] for part in parts), parts
    result = jobs.result(name)
    assert result["world_size"] == pipelines  # Lightning's world: every pipeline's driver
    if config.get("log_metric"):
        # Sums over the replicas count each sample once, as one device does: self.log(sync_dist=True, reduce_fx="sum")
        # and a torchmetrics SumMetric (over every driver, as under Lightning's ModelParallelStrategy, each sample
        # counted once per tensor rank: 2x), and self.all_gather gives one entry per replica, not per tensor rank.
        plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
        for key in ("train_loss", "train_samples", "train_samples_metric"):
            assert result["metrics"][key] == pytest.approx(plain[key], rel=1e-5), key
        assert plain["train_samples"] == config.get("samples", 64)
        assert result["gathered"] == pipelines // config["tensor_parallel_size"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp-init-module", "tp-2replicas-clip", "tp-llama-pretrained"])
def test_a_stage_built_on_meta_is_split_layer_by_layer_never_held_whole(name, jobs):
    """Built on the meta device (the Llama reading a Hugging Face checkpoint), every process of every pipeline
    materialises its stage one layer at a time and splits each layer before the next is made: while it builds, it
    holds at most its shards plus one layer whole, below its stage whole wherever the stage has two layers with
    parameters (materialising the stage, then splitting it, holds it whole)."""
    import itertools

    from scripts.hf_train import tiny, to_sequential_of
    from scripts.train import make_body

    config = case_config(name)
    body = to_sequential_of(tiny("llama")) if config.get("script") == "hf" else \
        make_body(config)
    balance = config["balance"]
    starts = list(itertools.accumulate([0, *balance]))
    sizes = [[sum(p.numel() for p in layer.parameters()) for layer in body[a:b]] for a, b in zip(starts, starts[1:])]
    out = jobs.directory(name)
    for k in range(config["devices"] // len(balance)):  # every pipeline (one per tensor rank of each replica)
        built = json.loads((out / f"built_replica{k}.json").read_text())
        assert [b["whole"] for b in built] == [sum(s) for s in sizes], (built, sizes)
        for b, stage in zip(built, sizes):
            assert b["parameters"] < b["built"] <= b["parameters"] + max(stage), (b, stage)
            if sum(1 for size in stage if size) > 1:
                assert b["built"] < b["whole"], (b, stage)


@pytest.mark.timeout(900)
def test_a_run_resumed_from_the_one_file_with_split_stages_continues_exactly(jobs):
    """The one file saved after the first epoch (each split layer gathered whole, stage by stage) loads into the
    split stages of a new run, each process taking its shards, with AdamW's state and the scheduler's: its second
    epoch ends where the uninterrupted run ended (itself one device's, in the grid above)."""
    full = load(jobs.directory("tp-resume-full") / "final.ckpt")
    assert_same_weights(load(jobs.directory("tp-resume-from-epoch-0") / "final.ckpt"), full, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(900)
def test_a_dcp_checkpoint_of_split_stages_resumes_at_other_replicas_sharding_tensor_size_and_balance(jobs, tmp_path):
    """The DCP directory saved by 2 stages x 2 tensor ranks after its first epoch, resumed by one replica at t = 1 and
    another balance (2 processes), and by 2 replicas sharded by FULL_SHARD over the data dimension (8 processes):
    each process reads its own slices of the saved shards, with AdamW's state and the scheduler's. One replica's
    second epoch ends where the uninterrupted run ended; the 2 replicas' (whose loaders shuffle, as under DDP) where
    one device resumed from the same checkpoint, consolidated, ends."""
    import lightning_pipe

    saved = jobs.directory("tp-save-dcp") / "ckpts" / "epoch=0.ckpt"
    assert saved.is_dir() and (saved / ".metadata").exists()
    for name in ("tp-2replicas-full-shard-from-dcp", "one-replica-from-tp-dcp"):
        assert jobs.result(name)["global_step"] == jobs.result("tp-save-dcp")["global_step"] == 16, name
    full = load(jobs.directory("tp-save-dcp") / "final.ckpt")
    assert_same_weights(load(jobs.directory("one-replica-from-tp-dcp") / "final.ckpt"), full, rtol=1e-5, atol=1e-6)
    epoch0 = tmp_path / "epoch=0.ckpt"
    lightning_pipe.consolidate_checkpoint(str(saved), str(epoch0))
    name = "tp-2replicas-full-shard-from-dcp"
    plain = plain_weights({**case_config(name), "state_dict_type": "full", "resume": str(epoch0)}, tmp_path / "plain")
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain, rtol=1e-4, atol=2e-5)


@pytest.mark.timeout(900)
def test_bf16_mixed_split_stages_train_the_plain_models_bf16_weights_to_bf16_rounding(jobs, tmp_path):
    """bf16-mixed with split stages (SGD, one micro-batch): plain bf16-mixed training's weights on one device, to
    within bf16's rounding. Not to the bit, as the non-split bf16 cases are: a rowwise layer adds its ranks' partial
    products after each was rounded to bf16, where one device rounds their sum once. (After 8 steps the two differ
    by about 2e-4, as much as bf16 and float32 training do: that autocast runs in every process is shown by what
    each process's layers computed in.)"""
    config = case_config("tp-bf16-mixed")
    got = load(jobs.directory("tp-bf16-mixed") / "final.ckpt")
    assert_same_weights(got, plain_weights(config, tmp_path / "bf16"), rtol=0, atol=1e-3)
    # The weights cannot tell (float32 training ends as far from these), so each process says what its split
    # layers computed in: bfloat16, in the 2 tensor ranks of each of the 2 stages.
    seen = [json.loads(path.read_text()) for path in jobs.directory("tp-bf16-mixed").glob("dtypes-*.json")]
    assert sorted(sorted(layers) for layers in seen) == [["0", "2"], ["0", "2"], ["4"], ["4"]], seen
    assert {dtype for layers in seen for dtype in layers.values()} == {"torch.bfloat16"}, seen


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp-fp16-steps", "tp-fp16-overflows"])
def test_a_gradient_scaler_over_split_stages_unscales_and_skips_as_one_device(name, jobs, tmp_path):
    """16-mixed with a gradient scaler (SGD, one micro-batch): from a scale no step overflows at, every step
    unscales each process's slices of the gradients (left scaled by 16, the weights would move 16 times as far);
    from 2**20, the steps whose gradients overflow in some tensor rank's slice are skipped by every process, and the
    scale backs off as on one device. The scaler's state is one device's, and the weights are within float16's
    rounding of a rowwise layer's partial sums (5e-5 here, of updates of about 0.05)."""
    config = case_config(name)
    piped = torch.load(jobs.directory(name) / "final.ckpt", weights_only=False)
    out = tmp_path / "plain"
    out.mkdir()
    script.main(config, str(out), plain=True)
    plain = torch.load(out / "final.ckpt", weights_only=False)
    assert_same_weights(piped["state_dict"], plain["state_dict"], rtol=0, atol=1e-4)
    assert piped["MixedPrecision"] == plain["MixedPrecision"]
    initial = script.Model(config).state_dict()
    assert all(not torch.equal(piped["state_dict"][k], initial[k]) for k in initial)  # every weight moved
    if "init_scale" not in config:  # 2**20: steps overflowed, were skipped, and the scale backed off
        assert plain["MixedPrecision"]["scale"] < 2.0**20
    assert piped["global_step"] == 8


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp-llama-own-plan", "tp-llama-pretrained", "tp-llama-tied",
                                  "tp-llama-tied-embedding-whole"])
def test_a_tiny_llama_split_by_its_own_plan_trains_the_plain_models_weights(name, jobs):
    """A Llama made a body by to_sequential carries the model's Hugging Face plan (q, k, v, gate, up colwise; o and
    down rowwise; the embedding by rows of the vocabulary, the head gathered), by the body's names; at [3, 3] over 2
    tensor ranks with AdamW clipped, it trains the model's weights on one device. Built on meta from a Hugging Face
    checkpoint (each stage reading its own tensors, then split), it fine-tunes the checkpoint's weights. Its head
    tied to its embedding across the stages, both split by rows of the vocabulary or the embedding kept whole, it
    trains the tied model's weights (the copies' gradients summed, slice by slice or whole)."""
    from scripts.hf_train import DEFAULTS, to_sequential_of, train_plain

    config = {**DEFAULTS, **case_config(name)}
    got = torch.load(jobs.directory(name) / "final.ckpt", weights_only=True)["state_dict"]
    plain = to_sequential_of(train_plain(config))
    expected = {f"sequential_module.{k}": v for k, v in plain.state_dict().items()}
    assert_same_weights(got, expected, rtol=1e-4, atol=2e-5)  # (pretrained: from the checkpoint's seed + 100)
    assert plain.tensor_parallel_plan["1.layer.self_attn.o_proj"] == "rowwise"
    assert plain.tensor_parallel_plan["0.embed_tokens"] == "embedding_rowwise"
    if config["tied"]:  # found tied in every pipeline (each tensor rank's): the copies in stage 0 and stage 1
        assert jobs.result(name)["tied"] == [["sequential_module.0.embed_tokens.weight",
                                              "sequential_module.5.lm_head.weight"]]


def test_the_plan_of_a_to_sequential_body_names_the_bodys_modules():
    """Hugging Face's plan (``model.layers.*.mlp.down_proj``) by the body's names, every entry a module of the body,
    checked at [3, 3] over 2 tensor ranks; a model without a plan gives a body without one."""
    from scripts.hf_train import tiny

    from lightning_pipe.models import to_sequential

    body = to_sequential(tiny("llama"))
    plan = body.tensor_parallel_plan
    named = dict(body.named_modules())
    assert all(name in named for name in plan)
    assert {k for k, v in plan.items() if v == "rowwise"} == {f"{j}.layer.{m}" for j in range(1, 5)
                                                               for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert plan["5.lm_head"] == "colwise_gather_output"
    check_stage_boundaries(split_module(body, [3, 3]), plan, 2)
    bert = to_sequential(tiny("bert"))
    assert all(name in dict(bert.named_modules()) for name in bert.tensor_parallel_plan or {})


def test_tensor_parallel_arguments_that_cannot_work_are_refused():
    """A size that is not a positive integer, a plan that is neither a dict nor a function, HYBRID_SHARD with it, DDP
    arguments that would do nothing, a configure_ddp of a subclass: each refused as the strategy is made, saying
    what to do; t = 2 with a plan is accepted by both loops' strategies."""
    from lightning_pipe import PipeStrategy
    from lightning_pipe.lightning.fabric.strategy import PipeStrategy as FabricPipeStrategy

    for size in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size is how many processes split each stage, a "
                                             rf"positive integer \(got: {re.escape(repr(size))}\)"):
            PipeStrategy(tensor_parallel_size=size)
    with pytest.raises(TypeError, match=r"tensor_parallel_plan must be a dict .* \(got: list\)"):
        PipeStrategy(tensor_parallel_size=2, tensor_parallel_plan=["0"])
    # A plan given with tensor_parallel_size=1 was dropped without a word (the job trained unsplit).
    with pytest.raises(ValueError, match=r"tensor_parallel_plan is given with tensor_parallel_size=1, which splits "
                                         r"nothing"):
        PipeStrategy(tensor_parallel_plan=PLAN)
    # A function plan that cannot be pickled failed in the stage processes, after they started.
    with pytest.raises(TypeError, match=r"tensor_parallel_plan=.*<lambda>.* cannot be pickled .* define it as a "
                                        r"function at the top level of a module"):
        PipeStrategy(tensor_parallel_size=2, tensor_parallel_plan=lambda stage, mesh: None)
    with pytest.raises(ValueError, match=r"'HYBRID_SHARD' with tensor_parallel_size=2 is not supported: use "
                                         r"'FULL_SHARD'"):
        PipeStrategy(tensor_parallel_size=2, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match=r"without DistributedDataParallel .* so static_graph, "
                                         r"bucket_cap_mb would do nothing"):
        PipeStrategy(tensor_parallel_size=2, static_graph=True, bucket_cap_mb=5)

    class Custom(PipeStrategy):
        def configure_ddp(self, *args, **kwargs):  # pragma: no cover - refused before it could run
            return super().configure_ddp(*args, **kwargs)

    with pytest.raises(ValueError, match=r"Custom overrides configure_ddp, which stages split by tensor parallel "
                                         r"never call"):
        Custom(tensor_parallel_size=2, tensor_parallel_plan=PLAN)
    for cls in (PipeStrategy, FabricPipeStrategy):
        strategy = cls(balance=[3, 2], tensor_parallel_size=2, tensor_parallel_plan=PLAN)
        assert (strategy.tensor_parallel_size, strategy.tensor_parallel_plan) == (2, PLAN)


class _Strategy:
    """What building a pipeline reads of the strategy for tensor parallel."""

    module_name = "sequential_module"

    def __init__(self, size: int, plan: Any = None) -> None:
        self.tensor_parallel_size, self.tensor_parallel_plan = size, plan


def test_a_split_without_a_plan_and_a_plan_that_does_not_meet_are_refused_at_setup():
    """Checked on every driver before any stage is split, against the body cut by the balance."""
    from lightning_pipe.lightning.build import tensor_split

    module, plain = nn.Module(), body()
    parts = split_module(plain, [3, 2])
    assert tensor_split(_Strategy(1), module, plain, parts) is None
    assert tensor_split(_Strategy(2, PLAN), module, plain, parts) == (2, PLAN)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs a plan saying how to split each layer of "
                                         r"Module.sequential_module: pass tensor_parallel_plan="):
        tensor_split(_Strategy(2), module, plain, parts)
    with pytest.raises(ValueError, match=r"leaves stage 0's output sharded on dim -1"):
        tensor_split(_Strategy(2, {"0": "colwise"}), module, plain, split_module(plain, [1, 4]))
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['7'\]|no module|matches no"):
        tensor_split(_Strategy(2, {"7": "colwise"}), module, plain, parts)
    # Zero-bubble over split stages ran each backward whole (tensor parallel's layers have hooks) and said nothing.
    zero_bubble = _Strategy(2, PLAN)
    zero_bubble.schedule = "zero-bubble"
    with pytest.warns(UserWarning, match=r"schedule='zero-bubble' with tensor_parallel_size=2: each stage's backward "
                                         r"runs whole.*1F1B's bubble"):
        assert tensor_split(zero_bubble, module, plain, parts) == (2, PLAN)


def test_the_topology_puts_the_tensor_ranks_of_a_stage_next_to_each_other():
    """8 processes, 2 stages, t = 2: stage 0 of replica 0 in ranks 0, 1; pipelines link matching tensor ranks;
    Lightning's world is the 4 drivers, the data split by the 2 replicas; a world that does not divide is refused."""
    from lightning_pipe.transport.topology import Topology

    topology = Topology(8, 2, tensor=2)
    assert (topology.replicas, topology.pipelines) == (2, 4)
    assert [topology.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [topology.tensor_of(r) for r in range(8)] == [0, 1] * 4
    assert [topology.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [topology.pipeline(k) for k in range(4)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.drivers() == [0, 1, 4, 5] and topology.stage_group(1) == [2, 3, 6, 7]
    assert all(topology.pipeline_of(r) == k for k in range(4) for r in topology.pipeline(k))
    assert Topology(4, 2) == Topology(4, 2, tensor=1) and Topology(4, 2).pipeline(1) == [2, 3]
    with pytest.raises(ValueError, match=r"multiple of stages x tensor_parallel_size \(devices x nodes: 6, stages: 2, "
                                         r"tensor_parallel_size: 2\)"):
        Topology(6, 2, tensor=2)
