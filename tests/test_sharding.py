"""Each stage sharded over its replicas by FSDP2 (``sharding_strategy``): the plain model's weights, every process
holding its shard, checkpoints across layouts, and what is refused.

2 replicas x 2 stages train in the shared job "4 processes sharded" (tests/jobs.py); the job "2 processes after
sharded" resumes its checkpoints at one replica.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, run_processes
from hybrid_mesh import two_by_two_mesh
from jobs import GROUPS
from jobs import config as case_config
from scripts import train as script
from shard_reads import resume_a_shard, saved_weight
from strategy_utils import assert_same_weights
from test_strategy import load, plain_weights

from lightning_pipe import PipeStrategy

TRAINED = [name for name in GROUPS["4 processes sharded"]
           if name.startswith("sharded-") and not name.startswith(("sharded-save", "sharded-resume"))
           and "bf16" not in name]


def held(out: Path, replicas: int) -> list[list[dict[str, int]]]:
    """How much of its stage each process held after training, per replica (driver first)."""
    return [json.loads((out / f"held_replica{r}.json").read_text()) for r in range(replicas)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TRAINED)
def test_sharded_stages_train_the_plain_models_weights_each_process_holding_its_shard(name, jobs, tmp_path):
    """Both settings, every schedule, accumulation with clipping by the global norm, manual optimization,
    HYBRID_SHARD, a deferred build, fp16 with a gradient scaler: the weights of one device with the global
    batch, within rtol 1e-4 / atol 2e-5. In every process of both replicas the stage's parameters are
    shards (the replicas' shards add up to the stage, none holds it whole) and so is AdamW's state (two
    tensors per shard); replicated across the two shard groups (HYBRID_SHARD of one replica per group),
    each holds the whole stage."""
    config = case_config(name)
    out = jobs.directory(name)
    assert_same_weights(load(out / "final.ckpt"), plain_weights(config, tmp_path / "plain"), rtol=1e-4, atol=2e-5)
    assert jobs.result(name)["global_step"] == config["epochs"] * config["samples"] // (8 * config.get("accumulate", 1))
    replicas = held(out, 2)
    for process in range(len(replicas[0])):
        parts = [replica[process] for replica in replicas]
        whole = parts[0]["whole"]
        assert all(part["whole"] == whole for part in parts)
        if config.get("hybrid_shard_size") == 1:
            assert all(part["parameters"] == whole for part in parts), parts
        else:
            assert sum(part["parameters"] for part in parts) == whole, parts
            assert all(0 < part["parameters"] < whole for part in parts), parts
        # (fp16's scaler skipped every step of this short run on overflows, as one device does: no state yet)
        state = 0 if config.get("precision") == "16-mixed-scaler" else 2
        assert all(part["optimizer"] == state * part["parameters"] for part in parts), parts
    if config.get("log_grad_norm"):  # every stage's gradients, whole (from every shard), as on one device
        plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
        norms = {k: v for k, v in plain.items() if "grad_" in k}
        assert "grad_2.0_norm/sequential_module.3.0.weight" in norms
        assert {k: v for k, v in jobs.result(name)["metrics"].items() if "grad_" in k} == pytest.approx(norms,
                                                                                                        rel=1e-5)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("setting", ["shard-grad-op", "full-shard"])
def test_each_setting_gathers_and_reduces_as_often_as_it_promises(setting, jobs):
    """FSDP2's all-gathers and reduce-scatters, counted in every process (2 layers each, 4 steps of 4 micro-batches,
    GPipe, every micro-batch but the last recomputed in its backward). SHARD_GRAD_OP: one all-gather per layer and
    step (the parameters stay whole through the step) and one reduce-scatter (the step's gradients, once its last
    backward is over). FULL_SHARD: one all-gather per layer and micro-batch for its forward, one for its
    backward, and one for each recomputation (a stage recomputes its whole forward before the backward: keeping
    those layers whole would hold the stage whole), one reduce-scatter per layer and micro-batch; the model
    summary's forward adds one gather per layer and micro-batch."""
    name = f"sharded-{setting}-gpipe"
    config = {**script.DEFAULTS, **case_config(name)}
    steps, m, layers = jobs.result(name)["global_step"], config["microbatches"], 2
    logs = sorted((jobs.directory(name) / "collectives").glob("*.log"))
    assert len(logs) == 4  # every process of both replicas
    for log in logs:
        calls = log.read_text().split()
        gathers, reductions = calls.count("all_gather_single"), calls.count("reduce_scatter_single")
        if setting == "shard-grad-op":
            assert (gathers, reductions) == (steps * layers, steps * layers), log.name
        else:
            recomputed = m - 1  # checkpoint="except_last"
            assert (gathers, reductions) == (((2 * m + recomputed) * steps + m) * layers, m * steps * layers), \
                log.name


@pytest.mark.timeout(900)
def test_bf16_mixed_sharded_trains_as_unsharded(jobs, tmp_path):
    """bf16-mixed: every stage under autocast, parameters and reductions in float32 (Lightning's FSDP
    ``*-mixed`` policy): the weights of the same training unsharded, whose gap to float32 is bf16's own."""
    sharded = load(jobs.directory("sharded-full-shard-bf16") / "final.ckpt")
    twin = load(jobs.directory("unsharded-twin-bf16") / "final.ckpt")
    plain = plain_weights(case_config("unsharded-twin-bf16"), tmp_path / "plain")
    assert_same_weights(sharded, twin, rtol=1e-5, atol=1e-6)
    assert max(float((twin[k] - plain[k]).abs().max()) for k in plain) > 1e-5  # bf16 did change something


@pytest.mark.timeout(900)
def test_a_sharded_stages_checkpoints_resume_in_another_layout_as_if_uninterrupted(jobs, tmp_path):
    """Saved at 2 stages x 2 replicas under FULL_SHARD, every process writing its shards into one DCP checkpoint:
    resumed at another balance under SHARD_GRAD_OP, the uninterrupted run's weights. Its one-file twin
    (streamed, each stage gathered by its replica 0) resumes at another balance under FULL_SHARD the same way.
    DCP's own ``dcp_to_torch_save`` turns the directory into one file whose state dict loads strictly into the
    plain model, equal to the full file of the unsharded twin at the same epoch."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    expected = plain_weights(case_config("sharded-save-dcp"), tmp_path / "plain")
    for name in ("sharded-save-dcp", "sharded-resume-dcp-other-balance", "sharded-save-full",
                 "sharded-resume-full-other-balance"):
        assert_same_weights(load(jobs.directory(name) / "final.ckpt"), expected, rtol=1e-4, atol=2e-5)
    directory = jobs.directory("sharded-save-dcp") / "ckpts" / "epoch=0.ckpt"
    files = sorted(p.name for p in directory.iterdir())
    assert files == [".metadata", "__0-0_0.distcp", "__0-1_0.distcp", "__1-0_0.distcp", "__1-1_0.distcp"], files
    dcp_to_torch_save(str(directory), str(tmp_path / "dcp.pt"))
    converted = torch.load(tmp_path / "dcp.pt", weights_only=True)
    twin = torch.load(jobs.directory("unsharded-twin-save-full") / "ckpts" / "epoch=0.ckpt", weights_only=True)
    torch.testing.assert_close(converted["state_dict"], twin["state_dict"], rtol=1e-5, atol=1e-7)
    plain = script.Model(**twin["hyper_parameters"])
    plain.load_state_dict(converted["state_dict"])  # strict: every entry of the plain model, no other
    full = torch.load(jobs.directory("sharded-save-full") / "ckpts" / "epoch=0.ckpt", weights_only=True)
    torch.testing.assert_close(full["state_dict"], twin["state_dict"], rtol=1e-5, atol=1e-7)
    states = full["optimizer_states"][0]["state"]  # AdamW's state of the plain model, every tensor whole
    assert {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in states.items()} == \
        {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in twin["optimizer_states"][0]["state"].items()}


@pytest.mark.timeout(900)
def test_a_sharded_stages_checkpoint_resumes_at_one_replica_unsharded(jobs, tmp_path):
    """The FULL_SHARD DCP checkpoint resumed by one pipeline, unsharded (each process reads whole entries made of
    the two replicas' shards): the weights of one device resumed from it, and of the same resume from the
    unsharded twin's file."""
    import lightning_pipe

    mine = load(jobs.directory("one-replica-from-sharded-dcp") / "final.ckpt")
    twin = load(jobs.directory("one-replica-from-unsharded-full") / "final.ckpt")
    assert_same_weights(mine, twin, rtol=1e-5, atol=1e-6)
    epoch0 = tmp_path / "epoch=0.ckpt"
    lightning_pipe.consolidate_checkpoint(
        str(jobs.directory("sharded-save-dcp") / "ckpts" / "epoch=0.ckpt"), str(epoch0))
    config = {**case_config("one-replica-from-sharded-dcp"), "resume": str(epoch0)}
    assert_same_weights(mine, plain_weights(config, tmp_path / "plain"), rtol=1e-4, atol=2e-5)


@pytest.mark.timeout(180)
def test_a_process_holding_a_shard_reads_only_the_shards_bytes_of_a_checkpoint_saved_whole(tmp_path):
    """Resuming a stage sharded over 2 replicas from a checkpoint that holds its tensors whole (saved by an
    unsharded run, or at another replica count), each process reads its own rows alone: the kernel counts about half
    the tensor's bytes read per process, for a stage host's weights, and for the main process's weights and AdamW
    states (two tensors of the weight's shape, read as shards too, never whole). DCP's own reader
    loads every stored tensor whole before narrowing it: 16 MiB read per process and tensor, moved whole to the
    device before its shard was cut."""
    from lightning_pipe.lightning import sharded
    from lightning_pipe.transport.parallel import shards

    whole = saved_weight()
    states = {0: {"weight": {"exp_avg": 2 * whole, "exp_avg_sq": 3 * whole, "step": torch.tensor(5.0)}}}
    rest = {"lightning_pipe": {**sharded.FORMAT, "names": ["weight", "bias"]}, "state_dict": {}}
    shards.write_shard(str(tmp_path), 0, shards.entries({"weight": whole, "bias": torch.ones(3)}, states, rest),
                       others=lambda: [])
    found = run_processes(resume_a_shard, 2, str(tmp_path), free_port(), timeout=150)
    size = whole.numel() * whole.element_size()
    for rank, reads in found.items():
        for what, (read, right) in reads.items():
            assert right, f"rank {rank}: {what} are not its rows of the saved tensors"
            tensors = 2 if "AdamW" in what else 1  # exp_avg and exp_avg_sq (and a scalar step)
            assert read < 0.6 * tensors * size, (f"rank {rank} read {read / 2**20:.1f} MiB for its {what}: "
                                                 f"more than its half of {tensors} x {size / 2**20:.0f} MiB")
            assert read > 0.45 * tensors * size  # (what the kernel counts is the reading)


@pytest.mark.timeout(900)
def test_gpt2_with_a_tied_head_sharded_over_replicas_trains_the_hugging_face_models_weights(jobs):
    """GPT-2's head tied to its embedding across stages, each copy sharded over the 2 replicas (the owners sum
    their gradients shard by shard): the Hugging Face model trained on its own, clipped by a global norm."""
    from scripts.hf_train import DEFAULTS, tiny, train_plain

    from lightning_pipe.models import hf_state_dict, to_sequential

    config = {**DEFAULTS, **case_config("hf-gpt2-tied-2replicas-full-shard")}
    reference = train_plain(config).state_dict()
    checkpoint = torch.load(jobs.directory("hf-gpt2-tied-2replicas-full-shard") / "final.ckpt",
                            weights_only=True)["state_dict"]
    state = hf_state_dict(to_sequential(tiny(config["arch"], config["tied"])), checkpoint,
                          prefix="sequential_module.")
    for key, value in state.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-5, msg=key)


# ---------------------------------------------------------------------------------------------- refused up front
def test_sharding_strategy_names_are_lightnings_and_others_are_refused():
    """Lightning's FSDPStrategy names (also as torch's enum, in any case); anything else refused with the list."""
    from torch.distributed.fsdp import ShardingStrategy

    assert PipeStrategy(sharding_strategy="full_shard").sharding_strategy == "FULL_SHARD"
    assert PipeStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).sharding_strategy == "SHARD_GRAD_OP"
    assert PipeStrategy().sharding_strategy == "NO_SHARD"
    with pytest.raises(ValueError, match=r"sharding_strategy must be one of 'NO_SHARD', 'SHARD_GRAD_OP', "
                                         r"'FULL_SHARD', 'HYBRID_SHARD' \(got: 'ZERO3'\)"):
        PipeStrategy(sharding_strategy="ZERO3")
    with pytest.raises(ValueError, match=r"hybrid_shard_size .* \(got: 2 with sharding_strategy='FULL_SHARD'\)"):
        PipeStrategy(sharding_strategy="FULL_SHARD", hybrid_shard_size=2)
    with pytest.raises(ValueError, match=r"\(got: 0 with sharding_strategy='HYBRID_SHARD'\)"):
        PipeStrategy(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=0)


@pytest.mark.parametrize("kwargs", [{"bucket_cap_mb": 1}, {"static_graph": True},
                                    {"find_unused_parameters": True}, {"gradient_as_bucket_view": True}])
def test_ddp_arguments_that_mean_nothing_when_sharded_are_refused(kwargs):
    """No DDP wraps a sharded stage: its arguments would be accepted and ignored, so they are refused, naming
    them; init_sync and broadcast_buffers keep their meaning and are taken."""
    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"sharding_strategy='FULL_SHARD' shards each stage with FSDP2 instead "
                                         rf"of wrapping it in DistributedDataParallel, so {name} would do nothing"):
        PipeStrategy(sharding_strategy="FULL_SHARD", **kwargs)
    PipeStrategy(sharding_strategy="FULL_SHARD", init_sync=True, broadcast_buffers=False)
    PipeStrategy(**kwargs)  # unsharded, DDP takes it


def test_a_configure_ddp_of_a_subclass_is_refused_with_sharding():
    """An overridden configure_ddp would never be called on sharded stages: refused, saying so."""

    class Hooked(PipeStrategy):
        def configure_ddp(self, module, device_ids, process_group, stage):  # noqa: ANN001, ANN201
            return super().configure_ddp(module, device_ids, process_group, stage)

    Hooked()
    with pytest.raises(ValueError, match=r"Hooked overrides configure_ddp, which sharded stages never call"):
        Hooked(sharding_strategy="SHARD_GRAD_OP")


def test_two_layers_of_one_stage_sharing_a_parameter_are_refused_before_sharding():
    """Each layer of a sharded stage is an FSDP unit, which cannot share a parameter with another: refused,
    saying what to do, before anything is sharded."""
    from torch import nn

    from lightning_pipe.transport.parallel.fsdp import Sharding, shard

    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    with pytest.raises(ValueError, match=r"two layers of one stage share a parameter \(shape \(4, 4\)\): FSDP cannot "
                                         r"shard it in both"):
        shard(nn.Sequential(first, nn.ReLU(), second), None, Sharding("FULL_SHARD"))


# ------------------------------------------------------------------------------- what the suite did not yet prove
def one_device_by_replica_batches(config: dict, out: Path) -> dict:
    """The checkpoint of one device trained on the replicas' batches in turn, accumulating over them
    (``replica_batches``), its gradient scaler starting at the replicas' scale times their number: each batch's
    forward and backward is then the one a replica computes alone, down to its half-precision products, and the
    step is theirs (their gradients' mean is the accumulated sum divided by the replicas' number, exactly, scales
    being powers of 2). One device on the global batch rounds its products otherwise."""
    replicas = config["devices"] // len(config.get("balance", [2, 2]))
    plain = {**config, "replica_batches": True, "accumulate": config.get("accumulate", 1) * replicas,
             "init_scale": config.get("init_scale", 2.0**20) * replicas}
    out.mkdir(parents=True, exist_ok=True)
    script.main(plain, str(out), plain=True)
    return torch.load(out / "final.ckpt", weights_only=False)


def initial_weights(config: dict) -> dict[str, torch.Tensor]:
    """The model's weights as built, before any step."""
    return script.Model(config).state_dict()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["fp16-steps-full-shard", "hybrid-2x2-fp16-steps"])
def test_fp16_sharded_steps_unscale_every_shard_and_step_as_one_device(name, jobs, tmp_path):
    """16-mixed with a gradient scaler from a scale no step overflows at (16): every step unscales each shard of
    stage 0's gradients on the driver and of stage 1's in its process (FULL_SHARD over 2 replicas, HYBRID_SHARD
    over 2 x 2), and steps the shards; the weights and the scaler's state are one device's on the replicas'
    batches in turn (float16 rounds a batch's products by its size: one device on the global batch ends 6e-5
    away, see one_device_by_replica_batches). Every step was taken, in every process: the remote stage stepped
    at each, the scale doubled after 3 in a row, SGD holds momentum for every shard. (The group's
    "sharded-full-shard-fp16-scaler" overflows at every step: it never reaches the unscaling and the step; and
    its AdamW would hardly notice gradients left scaled.)"""
    config = case_config(name)
    piped = torch.load(jobs.directory(name) / "final.ckpt", weights_only=False)
    plain = one_device_by_replica_batches(config, tmp_path / "plain")
    assert_same_weights(piped["state_dict"], plain["state_dict"], rtol=1e-5, atol=1e-6)
    result = jobs.result(name)
    assert result["global_step"] == 4 and result["stages"]["fit"][0]["steps"] == 4
    replicas = config["devices"] // len(config["balance"])
    assert piped["MixedPrecision"]["scale"] == 2 * config["init_scale"]
    assert plain["MixedPrecision"]["scale"] == 2 * config["init_scale"] * replicas  # (its scale is replicas x)
    initial = initial_weights(config)
    assert all(not torch.equal(piped["state_dict"][k], initial[k]) for k in initial)  # every weight moved
    for replica in held(jobs.directory(name), replicas):
        for process in replica:
            assert 0 < process["parameters"] < process["whole"] and process["optimizer"] == process["parameters"]


@pytest.mark.timeout(900)
def test_bf16_mixed_sharded_trains_one_devices_weights(jobs, tmp_path):
    """bf16-mixed under FULL_SHARD (every stage under autocast, reductions in float32) ends with the weights of one
    device on the replicas' batches in turn, within float32's rounding (bf16 rounds a batch's products by its
    size: one device on the global batch ends 3e-4 away; see one_device_by_replica_batches)."""
    name = "sharded-full-shard-bf16"
    plain = one_device_by_replica_batches(case_config(name), tmp_path / "plain")
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain["state_dict"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(900)
def test_a_full_files_optimizer_state_of_sharded_stages_is_one_devices_by_value(jobs, tmp_path):
    """The optimizer state in the full file of a FULL_SHARD run (each stage's shards gathered whole), at epoch 0
    and at the end: AdamW's state of the plain model on one device, value by value (``step``, ``exp_avg``,
    ``exp_avg_sq`` of every parameter), with its parameter groups and the scheduler."""
    name = "sharded-save-full"
    plain_weights(case_config(name), tmp_path / "plain")
    for file in ("ckpts/epoch=0.ckpt", "final.ckpt"):
        piped = torch.load(jobs.directory(name) / file, weights_only=False)
        plain = torch.load(tmp_path / "plain" / file, weights_only=False)
        (got,), (want,) = piped["optimizer_states"], plain["optimizer_states"]
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys() and len(want["state"]) == 10, file
        for index, state in want["state"].items():
            assert state.keys() == got["state"][index].keys()
            for key, value in state.items():
                torch.testing.assert_close(got["state"][index][key], value, rtol=1e-4, atol=1e-9,
                                           msg=f"{file}: {index} {key}")
        assert piped["lr_schedulers"] == plain["lr_schedulers"]


@pytest.mark.timeout(900)
def test_shard_grad_op_accumulating_trains_one_devices_weights(jobs, tmp_path):
    """SHARD_GRAD_OP with accumulate_grad_batches=2: each batch's gradients reduce-scattered as its backward ends
    and added to the shards' (a sum of averages), stepped every second batch: one device's weights on the global
    batch, each process holding its shard."""
    name = "shard-grad-op-accumulate"
    config = case_config(name)
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain_weights(config, tmp_path / "plain"),
                        rtol=1e-4, atol=2e-5)
    assert jobs.result(name)["global_step"] == 64 // (8 * 2)
    for replica in held(jobs.directory(name), 2):
        for process in replica:
            assert 0 < process["parameters"] < process["whole"] and process["optimizer"] == 2 * process["parameters"]


@pytest.mark.timeout(900)
def test_hybrid_shard_over_2_x_2_replicas_shards_in_rows_replicates_across_and_clips_by_the_global_norm(
        jobs, tmp_path):
    """HYBRID_SHARD with 4 replicas of 2 stages, hybrid_shard_size=2 (8 processes): each stage is sharded over the
    rows of replicas {0, 1} and {2, 3} and replicated across them. Every process holds half its stage: the two
    halves of a row add up to the stage, and each replica's half is the one of the replica in its column (equal
    sums). Clipped by the global norm (taken over the shard groups alone: over the replicas as well, it would be
    sqrt(2) too large), the weights and every logged gradient norm are one device's on the global batch."""
    name = "hybrid-2x2-clip"
    config = case_config(name)
    out = jobs.directory(name)
    final = load(out / "final.ckpt")
    assert_same_weights(final, plain_weights(config, tmp_path / "plain"), rtol=1e-4, atol=2e-5)
    assert jobs.result(name)["global_step"] == 4
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
    norms = {k: v for k, v in plain.items() if "grad_" in k}
    assert norms["grad_2.0_norm_total"] > 2 * config["clip"]  # the clipping acted (the last step's norm before it)
    assert {k: v for k, v in jobs.result(name)["metrics"].items() if "grad_" in k} == pytest.approx(norms, rel=1e-5)
    replicas = held(out, 4)
    stages = [[k for k in final if k.startswith(("sequential_module.0.", "sequential_module.1."))],
              [k for k in final if k.startswith(("sequential_module.2.", "sequential_module.3."))]]
    for process, keys in enumerate(stages):
        parts = [replica[process] for replica in replicas]
        assert all(2 * part["parameters"] == part["whole"] for part in parts), parts
        assert all(part["optimizer"] == 2 * part["parameters"] for part in parts), parts
        whole = sum(float(final[k].double().sum()) for k in keys)
        for row in ((0, 1), (2, 3)):  # a row's shards make the stage
            assert parts[row[0]]["sum"] + parts[row[1]]["sum"] == pytest.approx(whole, rel=1e-6, abs=1e-6), parts
        for column in ((0, 2), (1, 3)):  # a column holds one shard, replicated
            assert parts[column[0]]["sum"] == pytest.approx(parts[column[1]]["sum"], rel=1e-7, abs=1e-7), parts
        assert parts[0]["sum"] != pytest.approx(parts[1]["sum"], rel=1e-3), parts  # and the two shards differ


@pytest.mark.timeout(120)
def test_hybrid_shards_gradient_norm_and_overflow_are_taken_over_the_shard_group(tmp_path):
    """On a 2 x 2 mesh of HYBRID_SHARD (4 processes; rows {0, 1} and {2, 3} shard, columns replicate): the norm
    clipping uses is the whole gradient's, its shards' norms summed over the row (over the column too would count
    each shard twice), and an overflow in the second shard (seen by both its replicas) skips the step in every
    process (or'ed over the row: over the column, the first shard's processes would step)."""
    results = run_processes(two_by_two_mesh, 4, str(tmp_path / "store"), timeout=100)
    whole = float(torch.arange(12.0).norm())
    for rank, (norm, overflow, row, column) in results.items():
        assert row == [2 * (rank // 2), 2 * (rank // 2) + 1] and column == [rank % 2, rank % 2 + 2], (rank, row, column)
        assert overflow, rank
        assert norm == pytest.approx(whole, rel=1e-6), rank


class NotWeights:
    """An object ``torch.load(weights_only=True)`` refuses to unpickle."""


def test_the_sharded_reader_honours_weights_only(tmp_path):
    """A sharded checkpoint's Lightning entry was unpickled with ``weights_only=False`` whatever the caller asked:
    ``fabric.load(..., weights_only=True)`` of an untrusted directory ran its pickles. It is now read as
    ``torch.load(weights_only=...)`` reads a file: refused with True, read with False."""
    import pickle

    from lightning_pipe.transport.parallel import shards

    directory = str(tmp_path / "ckpt")
    shards.write_shard(directory, 0, shards.entries({"w": torch.ones(2)}, {}, rest={"hyper": NotWeights()}),
                       others=lambda: [])
    assert isinstance(shards.read_rest(directory, weights_only=False)["hyper"], NotWeights)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        shards.read_rest(directory, weights_only=True)


def test_the_global_norm_of_float64_gradients_is_taken_in_float64():
    """Clipping by the global norm under ``precision="64-true"``: the norm that scales float64 gradients is
    float64's, as ``clip_grad_norm_`` takes it on one device (a float32 sum of the norms left the weights 1e-10 off
    one device's); each gradient's own norm keeps its precision, float32 at the least."""
    from lightning_pipe.transport.parallel.fsdp import total_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, dtype=torch.float64, generator=g) * scale
             for n, scale in ((1000, 1e-3), (37, 3.0), (5, 1e3))]
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        want = torch.nn.utils.get_total_norm(grads, norm_type)
        assert want.dtype == torch.float64
        got = total_norm(grads, norm_type)
        assert got == pytest.approx(float(want), rel=1e-15, abs=0), norm_type
    halves = [t.to(torch.bfloat16) for t in grads]
    assert total_norm(halves, 2.0) == pytest.approx(float(torch.nn.utils.get_total_norm(
        [t.float() for t in halves], 2.0)), rel=1e-2)


def test_clipping_by_the_global_norm_returns_one_devices_norm_in_the_parameters_dtype():
    """What ``clip_gradients`` returns is the norm as ``clip_grad_norm_`` returns it: float64 for float64 parameters
    (under "64-true" the default dtype outside the forward is float32, in which it came back), the gradients scaled
    alike."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_pipe.lightning.precision import clip_by_global_norm

    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, dtype=torch.float64, generator=g)) for n in (7, 3)]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=torch.float64, generator=g)
    plain = [nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(plain, params):
        p.grad = q.grad.clone()
    optimizer = torch.optim.SGD(params, lr=0.1)
    optimizer._lp_hosts = SimpleNamespace(start=lambda *args, **kwargs: [], call_later=lambda *args: None)
    optimizer._lp_index = 0
    want = torch.nn.utils.clip_grad_norm_(plain, 0.5)
    got = clip_by_global_norm(optimizer, 0.5)
    assert got.dtype == want.dtype == torch.float64
    assert float(got) == pytest.approx(float(want), rel=1e-15, abs=0)
    for p, q in zip(params, plain):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-15, atol=0)
