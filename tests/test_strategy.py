"""PipeStrategy end to end: training through the pipeline ends with the weights of plain training.

The trainings run in shared jobs (tests/jobs.py: one launch per group of cases needing the same processes);
the plain references train here, on one device.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from jobs import config as case_config
from scripts import train as script
from strategy_utils import assert_same_weights

TRANSPARENCY = ["2stages-sgd", "3stages-chunks8-always", "chunks1-never-adamw-groups", "clip-norm-steplr",
                "clip-value-single-backward", "manual-two-optimizers-toggled",
                "2replicas-x-2stages-onecycle-accumulate", "2replicas-manual-optimization-clip",
                "plateau-scheduler", "lr-finder", "lr-finder-callback",
                "modes-frozen-bn-zero-grad-float64", "optimizer-snapshot-restored"]


def plain_weights(config: dict, out: Path) -> dict[str, torch.Tensor]:
    config = copy.deepcopy(config)
    replicas = config.get("devices", 2) * config.get("virtual_stages", 1) // (
        len(config.get("balance", [2, 2])) * config.get("tensor_parallel_size", 1))
    config["batch_size"] = config.get("batch_size", 8) * replicas  # one device sees the global batch
    out.mkdir(parents=True, exist_ok=True)
    model = script.main(config, str(out), plain=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load(path: Path) -> dict[str, torch.Tensor]:
    """The plain module's weights loaded from a checkpoint the pipeline wrote, with no strategy at all (a
    sharded one consolidated first, as its users do)."""
    if path.is_dir():
        import lightning_pipe

        lightning_pipe.consolidate_checkpoint(str(path), str(path) + ".consolidated")
        path = Path(str(path) + ".consolidated")
    return script.Model.load_from_checkpoint(path, map_location="cpu").state_dict()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TRANSPARENCY)
def test_same_weights_as_one_device(name, jobs, tmp_path):
    config = case_config(name)
    result, out = jobs.result(name), jobs.directory(name)
    expected = plain_weights(config, tmp_path / "plain")
    # The consolidated checkpoint loads into the plain module, with no strategy at all.
    loaded = load(out / "final.ckpt")
    assert_same_weights(loaded, {k: v.to(loaded[k].dtype) for k, v in expected.items()})  # a float32 model
    if config.get("precision") == "64-true":  # the checkpoint holds float64 weights: compare them as they are
        saved = torch.load(out / "final.ckpt", weights_only=False)["state_dict"]
        assert saved["sequential_module.3.0.weight"].dtype == torch.float64
        assert_same_weights(saved, expected)
    replicas = config.get("devices", 2) * config.get("virtual_stages", 1) // (
        len(config.get("balance", [2, 2])) * config.get("tensor_parallel_size", 1))
    assert result["world_size"] == replicas  # Lightning sees the replicas, not the processes
    if config.get("log_grad_norm"):
        plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
        norms = {k: v for k, v in plain.items() if "grad_" in k}
        for hook in ("", "after_backward/"):  # a remote stage's parameter, in both hooks
            assert f"{hook}grad_2.0_norm/sequential_module.3.0.weight" in norms
        assert {k: v for k, v in result["metrics"].items() if "grad_" in k} == pytest.approx(norms, rel=1e-5)
        assert result["metrics"]["refused"] == result["metrics"]["after_backward/refused"] == 1.0
    if config.get("lr_find"):  # the same suggestion, and one the finder chose, not the starting value
        plain = json.loads((tmp_path / "plain" / "result.json").read_text())
        assert result["lr"] == pytest.approx(plain["lr"], rel=1e-6) and result["lr"] != script.DEFAULTS["lr"]
    if config.get("scheduler") == "plateau":  # the case proves something only if the LR did move
        lr = torch.load(out / "final.ckpt", weights_only=False)["optimizer_states"][0]
        assert lr["param_groups"][0]["lr"] < 0.05


DEFERRED = ["adagrad-sanity-configure-model", "deferred-init-module-metric", "deferred-init-trunc-normal",
            "deferred-2replicas"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", DEFERRED)
def test_a_deferred_build_materialises_each_stage_in_its_own_process_with_the_plain_builds_values(
        name, jobs, tmp_path):
    """A model built on the meta device (configure_model, trainer.init_module(), lightning_pipe.deferred_init()):
    stage 1's process materialised exactly its layers, and no other process did (its guarded layers raise
    anywhere else); the weights as training starts are the plain build's, bit for bit, and so are the trained
    ones (within float32 tolerance)."""
    config = case_config(name)
    result, out = jobs.result(name), jobs.directory(name)
    expected = plain_weights(config, tmp_path / "plain")
    stage1 = sorted(f"sequential_module.{i}.0.{p}" for i in (2, 3) for p in ("weight", "bias"))
    assert [stats["materialized"] for stats in result["stages"]["fit"]] == [stage1]
    initial, plain_initial = torch.load(out / "initial.pt"), torch.load(tmp_path / "plain" / "initial.pt")
    assert initial.keys() == plain_initial.keys()
    for key in plain_initial:
        assert torch.equal(initial[key], plain_initial[key]), key
    assert_same_weights(load(out / "final.ckpt"), expected)


SCHEDULED = [f"{name}-{case}" for name in ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b")
             for case in ("sgd-accumulate-clip-log", "adamw-onecycle-always", "manual-two-optimizers", "3stages-never",
                          "2replicas")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SCHEDULED)
def test_every_schedule_with_the_loss_on_the_last_stage_trains_the_plain_models_weights(name, jobs, tmp_path):
    """The loss computed on the last stage, the micro-batches in each schedule's order: the plain model's
    weights (and logged losses, predictions, replicas' gradient norms) on the scenarios above."""
    config = case_config(name)
    result, out = jobs.result(name), jobs.directory(name)
    expected = plain_weights(config, tmp_path / "plain")
    assert_same_weights(load(out / "final.ckpt"), expected)
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
    for key in ("train_loss", "val_loss") if config.get("log_metric") else ():
        assert result["metrics"][key] == pytest.approx(plain[key], rel=1e-5), key  # logged with sync_dist
    if config.get("predict"):  # outputs through the schedule's processes, as the plain model gives them
        model = script.Model.load_from_checkpoint(out / "final.ckpt", map_location="cpu").eval()
        x, _ = script.data(model.config).tensors
        with torch.no_grad():
            torch.testing.assert_close(torch.load(out / "predicted.pt"), model(x), rtol=1e-5, atol=1e-6)
    if config.get("log_grad_norm"):  # every stage's gradients, averaged over the replicas, as on one device
        norms = {k: v for k, v in plain.items() if "grad_" in k}
        assert {k: v for k, v in result["metrics"].items() if "grad_" in k} == pytest.approx(norms, rel=1e-5)


MULTISTAGED = [*(f"{name}-adamw-accumulate-clip" for name in ("zbv", "dualpipev", "interleaved-zero-bubble",
                                                               "looped-bfs")),
               "zbv-2replicas", "dualpipev-2replicas", "zbv-2replicas-full-shard", "zbv-bf16-mixed"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MULTISTAGED)
def test_the_v_shaped_and_the_other_multistage_schedules_train_the_plain_models_weights(name, jobs, tmp_path):
    """ZBV and DualPipeV (2 stages per process in a V: the first and the last in the driver's process, the loss
    computed there), interleaved zero-bubble and looped BFS, with accumulation and clipping by the global norm, and
    the V shapes with 2 replicas averaged or sharded by FULL_SHARD: one device's weights (and logged loss)."""
    config = case_config(name)
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain_weights(config, tmp_path / "plain"))
    if config.get("log_metric"):
        plain = json.loads((tmp_path / "plain" / "result.json").read_text())["metrics"]
        assert jobs.result(name)["metrics"]["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)


@pytest.mark.timeout(900)
def test_dualpipev_scales_fp16_losses_as_gpipe_on_the_same_micro_batches(jobs):
    """16-mixed with a gradient scaler under DualPipeV: the scale reaches the loss on the last stage (in the
    driver's process), the same steps are skipped, and the weights and the scale end as GPipe's do on the same
    micro-batches."""
    piped = torch.load(jobs.directory("dualpipev-fp16-scaler") / "final.ckpt", weights_only=False)
    other = torch.load(jobs.directory("gpipe-fp16-scaler") / "final.ckpt", weights_only=False)
    assert_same_weights(piped["state_dict"], other["state_dict"])
    assert piped["MixedPrecision"]["scale"] == other["MixedPrecision"]["scale"] != 2.0**20


@pytest.mark.timeout(900)
def test_a_run_resumes_under_zbv_from_a_1f1b_checkpoint_at_another_balance(jobs):
    """The checkpoint 1F1B wrote after its first epoch (2 processes, balance [2, 3]), resumed under ZBV (the same 2
    processes holding 4 stages in a V): the second epoch ends where the uninterrupted 1F1B run ended."""
    full = load(jobs.directory("1f1b-resume-full") / "final.ckpt")
    resumed = load(jobs.directory("zbv-resume-from-1f1b-epoch-0") / "final.ckpt")
    assert_same_weights(resumed, full, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"])
def test_every_schedule_resumes_exactly_and_scales_fp16_losses(schedule, jobs, tmp_path):
    """Resuming from an epoch's checkpoint continues exactly, and the uninterrupted run is one device's. Under
    16-mixed, the gradient scaler's scale reaches the loss on the last stage: schedules that run their backwards
    ahead of Lightning's scale them with it (float16 gradients neither underflow nor overflow otherwise than
    GPipe's, whose backward waits for the scaled loss), so they skip the same steps and end with GPipe's scale
    and weights; GPipe with one micro-batch ends with one device's. With several micro-batches, one device
    training on the whole batch ends elsewhere (its whole-batch gradients overflow at other scales, so it skips
    other steps): one device accumulating over batches of a micro-batch's size is their reference."""
    full = load(jobs.directory(f"{schedule}-resume-full") / "final.ckpt")
    assert_same_weights(full, plain_weights(case_config(f"{schedule}-resume-full"), tmp_path / "plain-resume"))
    assert_same_weights(load(jobs.directory(f"{schedule}-resume-from-epoch-0") / "final.ckpt"), full,
                        rtol=1e-6, atol=1e-7)
    if schedule == "gpipe":
        name = "gpipe-fp16-scaler-one-microbatch"
        reference = plain_weights(case_config(name), tmp_path / "plain")
        other = torch.load(tmp_path / "plain" / "final.ckpt", weights_only=False)
    else:
        name = f"{schedule}-fp16-scaler"
        other = torch.load(jobs.directory("gpipe-fp16-scaler") / "final.ckpt", weights_only=False)
        reference = other["state_dict"]
    piped = torch.load(jobs.directory(name) / "final.ckpt", weights_only=False)
    assert_same_weights(piped["state_dict"], reference)
    assert piped["MixedPrecision"]["scale"] == other["MixedPrecision"]["scale"] != 2.0**20
    if schedule != "gpipe":
        # Several micro-batches under fp16 are one device's weights when that device computes what they compute:
        # each micro-batch's backward in float16 at the scaler's scale over the micro-batches' count, the scaler's
        # check on their sum (Lightning's accumulation over batches of a micro-batch's size).
        config = case_config(name)
        m = config.get("microbatches", 4)
        accumulated = {**config, "batch_size": config.get("batch_size", 8) // m,
                       "accumulate": config.get("accumulate", 1) * m}
        assert_same_weights(piped["state_dict"], plain_weights(accumulated, tmp_path / "plain-fp16"))


@pytest.mark.timeout(900)
def test_one_replica_uses_the_loader_as_given(jobs, tmp_path):
    """One pipeline and a loader built with shuffle=False: the batches of one device, in its order (under a
    distributed strategy Lightning would put a shuffling sampler in: other batches, other weights)."""
    from torch.utils.data import DistributedSampler

    config = case_config("one-replica-keeps-the-loader-order")
    assert_same_weights(load(jobs.directory("one-replica-keeps-the-loader-order") / "final.ckpt"),
                        plain_weights(config, tmp_path / "plain"))
    dataset = script.data({**script.DEFAULTS, **config})
    shuffled = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=config.get("seed", 7))
    assert list(shuffled) != list(range(len(dataset)))  # the order a distributed sampler would have given


@pytest.mark.timeout(900)
def test_one_replica_shuffles_as_one_device(jobs, tmp_path):
    """One pipeline and a loader built with shuffle=True: each epoch's permutation comes from the default
    generator in the state the program left it, as on one device (had the strategy reseeded the driver as DDP
    reseeds its processes, the batches, and so the weights, would be others)."""
    config = case_config("one-replica-shuffles-as-one-device")
    assert_same_weights(load(jobs.directory("one-replica-shuffles-as-one-device") / "final.ckpt"),
                        plain_weights(config, tmp_path / "plain"))


@pytest.mark.timeout(900)
def test_remote_stages_step_after_the_drivers_steps_and_meet_at_barriers(jobs):
    """post_optimizer_step steps the remote stages once per driver step (none when a gradient scaler skips
    one), and barrier has them meet too: without either hook, these counts stay put."""
    result = jobs.result("2stages-sgd")
    fit, after = result["stages"]["fit"][0], result["stages"]["barrier"][0]
    assert fit["steps"] == result["global_step"] == 16
    assert fit["barriers"] > 0 and after["barriers"] == fit["barriers"] + 1
    scaled = jobs.result("fp16-scaler")  # the scale starts at 2**20: early steps overflow and are skipped
    assert 0 < scaled["stages"]["fit"][0]["steps"] < scaled["global_step"]


@pytest.mark.timeout(900)
def test_zeroing_rides_along_and_the_optimizer_step_goes_on_the_data_plane(jobs):
    """Over the data plane, the driver's ``zero_grad`` sends the stage nothing of its own (it goes with the next
    message to that process: here the optimizer's step) and the stage's optimizer step goes to its step listener,
    answered on the plane: neither is a round trip by RPC, and each happens once per driver step (the same job
    trains one device's weights: ``TRANSPARENCY``)."""
    result = jobs.result("2stages-sgd")
    calls = result["stages"]["fit"][0]["calls"]
    steps = result["global_step"]
    assert calls.get("step on the plane") == steps == 16 and calls.get("zero_grad riding") == steps, calls
    assert not any(name.startswith(("step ", "zero_grad ")) and name.endswith("by RPC") for name in calls), calls
    # Clipping by the global norm: each stage's norm comes back on the plane, the scaling rides with the step.
    clipped = jobs.result("clip-norm-steplr")
    calls = clipped["stages"]["fit"][0]["calls"]
    assert calls.get("grad_norm on the plane") == clipped["global_step"] > 0, calls
    assert 0 < calls.get("scale_grads riding", 0) <= clipped["global_step"] and "scale_grads by RPC" not in calls, calls
    # A gradient scaler's overflow check, on the plane too.
    scaled = jobs.result("fp16-scaler")["stages"]["fit"][0]["calls"]
    assert scaled.get("unscale_grads on the plane", 0) > 0 and "unscale_grads by RPC" not in scaled, scaled


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_checkpoint_holds_the_plain_optimizer_state(optimizer, jobs, tmp_path):
    """The consolidated optimizer state is the one the unpipelined model's optimizer would have."""
    name = f"optimizer-state-{optimizer}"
    plain_weights(case_config(name), tmp_path / "plain")
    piped = torch.load(jobs.directory(name) / "final.ckpt", weights_only=False)
    plain = torch.load(tmp_path / "plain" / "final.ckpt", weights_only=False)
    (got,), (want,) = piped["optimizer_states"], plain["optimizer_states"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) == 10  # every parameter, stage 1's too
    for index, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=f"{index} {key}")
    assert piped["lr_schedulers"] == plain["lr_schedulers"]


@pytest.mark.timeout(900)
def test_resume_continues_exactly(jobs, tmp_path):
    """Stop after epoch 1, resume from its checkpoint: the same weights as the uninterrupted run, which are one
    device's."""
    assert jobs.result("resume-from-epoch-0")["global_step"] == 24
    full = load(jobs.directory("resume-full") / "final.ckpt")
    assert_same_weights(full, plain_weights(case_config("resume-full"), tmp_path / "plain"))
    again = load(jobs.directory("resume-from-epoch-0") / "final.ckpt")
    assert_same_weights(again, full, rtol=1e-6, atol=1e-7)
    first = load(jobs.directory("resume-full") / "ckpts" / "epoch=0.ckpt")
    assert not torch.allclose(first["head.weight"], full["head.weight"])  # the resumed run did train further


@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_is_written_per_process_resumes_at_any_balance_and_consolidates_to_the_full_file(
        jobs, tmp_path):
    """state_dict_type="sharded": every process wrote its own file of each checkpoint, one torch.distributed.
    checkpoint directory; resuming from epoch 0's at the same balance and at [1, 3] (each stage reading its own
    entries) ends with the uninterrupted run's weights; consolidated, a checkpoint is the one-file checkpoint of
    the same run saved in full: the same state dict, optimizer states and schedulers, bit for bit."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    from lightning_pipe.lightning.sharded import consolidate_checkpoint

    directory = jobs.directory("sharded-resume-full") / "ckpts"
    assert sorted(p.name for p in directory.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert sorted(os.listdir(directory / "epoch=0.ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    metadata = FileSystemReader(str(directory / "epoch=0.ckpt")).read_metadata()
    stage1 = {index.fqn for index, info in metadata.storage_data.items() if info.relative_path == "__1_0.distcp"}
    names = sorted(f"sequential_module.{i}.0.{p}" for i in (2, 3) for p in ("weight", "bias"))
    assert sorted(k for k in stage1 if k.startswith("state_dict.")) == [f"state_dict.{n}" for n in names]
    assert sorted(k for k in stage1 if k.startswith("optimizer.")) == [  # stage 1's entries only
        f"optimizer.0.{n}.{key}" for n in names for key in ("exp_avg", "exp_avg_sq", "step")]
    assert "lightning" not in stage1  # the rest of Lightning's checkpoint: the main process's
    full = load(jobs.directory("sharded-resume-full") / "final.ckpt")
    assert_same_weights(full, plain_weights(case_config("sharded-resume-full"), tmp_path / "plain"))
    for resumed in ("sharded-resume-from-epoch-0", "sharded-resharded-from-epoch-0"):
        assert jobs.result(resumed)["global_step"] == 16
        assert_same_weights(load(jobs.directory(resumed) / "final.ckpt"), full, rtol=1e-6, atol=1e-7)
    twin = jobs.directory("full-twin-of-sharded") / "ckpts"
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
        consolidate_checkpoint(str(directory / name), str(tmp_path / name))
        mine, theirs = (torch.load(p, weights_only=True) for p in (tmp_path / name, twin / name))
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_turns_into_a_torch_file_with_dcp_and_resumes_at_another_replica_count(jobs, tmp_path):
    """A sharded checkpoint is torch.distributed.checkpoint's: its own dcp_to_torch_save makes one file whose
    state dict is the plain model's (loads into it, equal to the full save of the same run, bit for bit); and
    a job of 2 replicas resumes from one saved with 1 (each process of each replica reads its own entries),
    to the weights of one device resumed from it on the same data (the replicas' sampler shuffles: its
    permutation, the global batch)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import lightning_pipe

    directory = jobs.directory("sharded-resume-full") / "ckpts" / "epoch=1.ckpt"
    dcp_to_torch_save(str(directory), str(tmp_path / "dcp.pt"))
    converted = torch.load(tmp_path / "dcp.pt", weights_only=True)
    twin = torch.load(jobs.directory("full-twin-of-sharded") / "ckpts" / "epoch=1.ckpt", weights_only=True)
    torch.testing.assert_close(converted["state_dict"], twin["state_dict"], rtol=0, atol=0)
    plain = script.Model(**twin["hyper_parameters"])
    plain.load_state_dict(converted["state_dict"])  # strict: every entry of the plain model, no other
    assert jobs.result("sharded-2replicas-from-epoch-0")["global_step"] == 16
    epoch0 = tmp_path / "epoch=0.ckpt"
    lightning_pipe.consolidate_checkpoint(str(directory.parent / "epoch=0.ckpt"), str(epoch0))
    resumed = {**case_config("sharded-2replicas-from-epoch-0"), "state_dict_type": "full", "resume": str(epoch0)}
    assert_same_weights(load(jobs.directory("sharded-2replicas-from-epoch-0") / "final.ckpt"),
                        plain_weights(resumed, tmp_path / "plain"))


def test_a_sharded_checkpoint_of_the_first_format_is_refused_saying_what_to_do(tmp_path):
    """A directory of the first sharded format (meta.pt, stage-NNNNN.pt) is neither consolidated nor resumed
    from: the message says what it is and how to convert it."""
    from lightning_pipe.lightning.sharded import consolidate_checkpoint, is_sharded, read_meta

    old = tmp_path / "epoch=0-step=8.ckpt"
    old.mkdir()
    torch.save({"lightning_pipe": {"format": "lightning_pipe.sharded", "version": 1}}, old / "meta.pt")
    torch.save({"state_dict": {}, "optimizer_states": {}}, old / "stage-00000.pt")
    assert is_sharded(str(old))  # ModelCheckpoint removes it as a directory
    says = (r"earlier format \(meta.pt and a stage-NNNNN.pt file per process\), which this version no longer "
            r"reads.*python -m lightning_pipe consolidate DIR FILE")
    with pytest.raises(OSError, match=says):
        read_meta(str(old))  # what fit(ckpt_path=DIR) reads first
    with pytest.raises(OSError, match=says):
        consolidate_checkpoint(str(old), str(tmp_path / "out.ckpt"))
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.timeout(900)
def test_bf16_mixed_reaches_every_stage(jobs, tmp_path):
    """Autocast runs in the remote stages too: the same weights as plain bf16-mixed training, and not those
    of float32 training."""
    config = case_config("bf16-mixed")
    bf16 = plain_weights(config, tmp_path / "plain")
    fp32 = plain_weights({**config, "precision": "32-true"}, tmp_path / "fp32")
    assert_same_weights(load(jobs.directory("bf16-mixed") / "final.ckpt"), bf16, rtol=1e-4, atol=1e-5)
    remote = "sequential_module.3.0.weight"  # a layer of stage 1, in the other process
    assert (bf16[remote] - fp32[remote]).abs().max() > 1e-4  # the test can tell bf16 from float32


@pytest.mark.timeout(900)
def test_fp16_with_gradient_scaler_matches_one_device(jobs, tmp_path):
    """16-mixed with a GradScaler (CPU here, as on GPUs): remote stages unscale and report overflow, so the
    scale moves and steps are skipped exactly as on one device."""
    expected = plain_weights(case_config("fp16-scaler"), tmp_path / "plain")
    assert_same_weights(load(jobs.directory("fp16-scaler") / "final.ckpt"), expected)
    piped = torch.load(jobs.directory("fp16-scaler") / "final.ckpt", weights_only=False)
    plain = torch.load(tmp_path / "plain" / "final.ckpt", weights_only=False)
    # The scale started at 2**20 and moved (overflows halved it, quiet steps doubled it), identically.
    assert piped["MixedPrecision"]["scale"] == plain["MixedPrecision"]["scale"] != 2.0**20


def test_overflow_on_a_remote_stage_skips_the_step():
    """Only a remote stage overflows: the driver's scaler must still skip the step and lower the scale."""
    from pytorch_lightning.plugins import MixedPrecision

    from lightning_pipe.lightning.optimizers import mix_in
    from lightning_pipe.lightning.precision import PipePrecision

    class Hosts:
        def __init__(self):
            self.calls = []

        def start(self, method, *args, timeout=None, plane=False):
            self.calls.append((method, *args))
            return [SimpleNamespace(result=lambda: True)]  # the remote stage found an inf

    class NoTrainer(MixedPrecision):
        def _after_closure(self, model, optimizer):  # Lightning's hooks and clipping need a Trainer
            self.base_ran = True

    plugin = NoTrainer("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    mix_in(plugin, PipePrecision)
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    optimizer._lp_hosts, optimizer._lp_index = Hosts(), 0
    before = layer.weight.detach().clone()
    plugin.scaler.scale(layer(torch.ones(1, 2)).sum()).backward()
    plugin.scaler.unscale_(optimizer)
    found = plugin.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert sum(v.item() for v in found.values()) == 0  # the driver's own gradients are finite

    plugin._after_closure(None, optimizer)

    assert plugin.base_ran
    assert optimizer._lp_hosts.calls == [("unscale_grads", 0, 1.0 / 1024.0)]
    assert sum(v.item() for v in found.values()) == 1
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    assert torch.equal(layer.weight, before)  # the step was skipped
    assert plugin.scaler.get_scale() == 512.0  # and the scale lowered


def test_mirrored_optimizers_keep_their_class_names():
    """The strategy gives the optimizer (and the precision plugin) a class that mixes in its own steps; the
    names stay the original's, since Lightning keys things by them: LearningRateMonitor logs "lr-SGD",
    checkpoints key the scaler's state by the plugin's qualified name."""
    from lightning_pipe.lightning.optimizers import _MirroredOptimizer, mix_in

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    mix_in(optimizer, _MirroredOptimizer)
    assert isinstance(optimizer, _MirroredOptimizer) and isinstance(optimizer, torch.optim.SGD)
    assert (type(optimizer).__name__, type(optimizer).__qualname__) == ("SGD", "SGD")
    assert "lr-" + optimizer.__class__.__name__ == "lr-SGD"  # how LearningRateMonitor names the metric


@pytest.mark.parametrize("norm_type", [2, 1.0, "inf"])
def test_grad_norm_of_a_plain_module_is_lightnings(norm_type):
    """Outside a pipeline, lightning_pipe.grad_norm answers exactly as Lightning's (the pipelined case is in
    test_same_weights_as_one_device); parameters without a gradient are left out, as there."""
    from pytorch_lightning.utilities import grad_norm as lightning_grad_norm

    import lightning_pipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    model(torch.randn(5, 3))[:, :1].sum().backward()
    model[3].weight.grad = None
    ours = lightning_pipe.grad_norm(model, norm_type, group_separator=":")
    theirs = lightning_grad_norm(model, norm_type, group_separator=":")
    assert list(ours) == list(theirs) and f"grad_{float(norm_type)}_norm:3.weight" not in ours
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("norm_type", [0, -2, "nan"])
def test_grad_norm_refuses_a_norm_that_is_not_positive(norm_type):
    import lightning_pipe

    with pytest.raises(ValueError, match=r"`norm_type` must be a positive number or 'inf'.*Got"):
        lightning_pipe.grad_norm(torch.nn.Linear(2, 2), norm_type)


def test_a_layer_of_another_stage_called_on_the_driver_is_refused_saying_to_call_the_body_whole():
    """A forward that loops over the body's layers (or calls a slice of it) would run a remote stage's layer on its
    placeholders: torch said only "Tensor on device meta is not on the expected device cpu!". Refused, naming the
    layer, its stage and what to call instead; stage 0's own layers still run here."""
    from torch import nn

    from lightning_pipe.lightning.body import PipelinedSequential

    body = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    module = PipelinedSequential(body, {"0": 0, "1": 0, "2": 1}, None, chunks=1, checkpoint="never")
    x = module[:2](torch.randn(4, 3))  # stage 0's layers
    for call in (lambda: module[2](x), lambda: module[1:](x), lambda: [layer(x) for layer in list(module)[2:]]):
        with pytest.raises(RuntimeError, match=r"sequential_module\.2 \(Linear\) is a layer of pipeline stage 1, which "
                                               r"lives in another process.*Call the body as a whole, "
                                               r"sequential_module\(x\)"):
            call()


def test_placeholders_refuse_the_functions_that_would_see_stage_0_alone():
    """On the driver, remote layers are placeholders without gradients: clip_grad_norm_, clip_grad_value_ and
    Lightning's grad_norm over the whole model would silently cover stage 0 alone, so they are refused with
    what to use instead; zeroing sees None, as before, and an optimizer the strategy did not set up is refused at
    its step."""
    from pytorch_lightning.utilities import grad_norm as lightning_grad_norm
    from torch import nn

    import lightning_pipe
    from lightning_pipe.lightning.body import PipelinedSequential
    from lightning_pipe.lightning.placeholders import Placeholder

    body = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 2)), nn.Linear(2, 1))
    module = PipelinedSequential(body, {"0": 0, "1": 1, "2": 1}, None, chunks=1, checkpoint="never")
    placeholder = module[1][1].weight
    assert isinstance(placeholder, Placeholder) and placeholder.is_meta and placeholder.shape == (2, 3)
    assert (placeholder.param_name, placeholder.stage) == ("sequential_module.1.1.weight", 1)
    assert not any(isinstance(p, Placeholder) for p in module[0].parameters())
    module[0](torch.randn(4, 3)).sum().backward()  # stage 0's own gradients are here

    refused = {
        "clip_grad_norm_": (lambda: torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0),
                            "gradient_clip_algorithm='norm'"),
        "clip_grad_value_": (lambda: torch.nn.utils.clip_grad_value_(module.parameters(), 1.0),
                             "gradient_clip_algorithm='value'"),
        "grad_norm": (lambda: lightning_grad_norm(module, 2), "lightning_pipe.grad_norm"),
    }
    before = module[0].weight.grad.clone()
    for name, (call, advice) in refused.items():
        with pytest.raises(RuntimeError, match=rf"{name} read the gradient of 'sequential_module.1.1.weight', "
                                               r"which lives in the process of pipeline stage 1.*stage 0 alone"):
            call()
        with pytest.raises(RuntimeError, match=re.escape(advice)):
            call()
    assert torch.equal(module[0].weight.grad, before)  # nothing was clipped halfway

    # Without the remote stages at hand (no hosts here), lightning_pipe.grad_norm says so rather than guess.
    with pytest.raises(ValueError, match=r"grad_norm cannot reach the stage that holds '1.1.weight'"):
        lightning_pipe.grad_norm(module, 2)
    # An optimizer the strategy did not set up (built over the placeholders afterwards) would step stage 0 alone:
    # refused at its step (it was taken, and the remote layers never trained); zeroing sees None.
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match=r"SGD holds parameters of layers in other pipeline stages "
                                           r"\(sequential_module.1.1.weight, .*: stages 1\).* update this process's "
                                           r"layers alone. Set the optimizer up with the model"):
        optimizer.step()
    optimizer.zero_grad()
    module.zero_grad()
    assert module[0].weight.grad is None and placeholder.grad is None

    # Remote layers frozen: no gradient anywhere but stage 0, whose answer is then the whole model's.
    module[1].requires_grad_(False)
    module[2].requires_grad_(False)
    module[0](torch.randn(4, 3)).sum().backward()
    ours, theirs = lightning_pipe.grad_norm(module, 2), lightning_grad_norm(module, 2)
    assert list(ours) == list(theirs) == ["grad_2.0_norm/0.weight", "grad_2.0_norm/0.bias", "grad_2.0_norm_total"]
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()  # (the remote layers frozen, nothing of theirs would step anywhere: taken)


@pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")  # no stages here to take them
def test_changing_a_placeholder_in_place_is_an_error_at_the_next_forward_or_state_dict():
    """An initialiser or a hook editing a remote layer's weights on the driver changes nothing where the layer
    lives: the next forward (and any state_dict, which checkpoints take) says so instead of training on
    without it. Loading a state, which reaches every stage, is the way to change them."""
    from torch import nn

    from lightning_pipe import Pipe
    from lightning_pipe.lightning.body import PipelinedSequential
    from lightning_pipe.lightning.placeholders import Placeholder

    def body():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.BatchNorm1d(2))

    class Stages:  # stands in for the remote stages' handle: takes what is loaded, holds nothing to fetch
        def __init__(self):
            self.loaded = {}

        def call(self, method, *args):
            return []

        def call_stage(self, j, method, part, strict):
            self.loaded.update(part)

    local = Pipe(body(), [1, 2], chunks=2).pipeline  # stands in for the remote stages' forward
    module = PipelinedSequential(body(), {"0": 0, "1": 1, "2": 1}, local, chunks=2, checkpoint="never",
                                 hosts=Stages())
    x = torch.ones(4, 2)
    module(x)
    module[1].weight.requires_grad_(False)  # freezing is no change of the values
    module.state_dict()
    module(x)

    torch.nn.init.zeros_(module[1].weight)
    message = (r"sequential_module.1.weight changed in place in this process, where the layers of remote stages "
               r"\(1\) are placeholders without data: the change did not reach")
    with pytest.raises(RuntimeError, match=message):
        module(x)
    with pytest.raises(RuntimeError, match=message):
        module.state_dict()
    module[2].reset_running_stats()  # buffers too
    with pytest.raises(RuntimeError, match=r"sequential_module.1.weight, sequential_module.2.running_mean, "
                                           r"sequential_module.2.running_var, sequential_module.2.num_batches_tracked"):
        module(x)

    module.load_state_dict(body().state_dict())
    assert set(module.hosts.loaded) == {f"sequential_module.{k}" for k in body().state_dict() if k[0] in "12"}
    module(x)
    module.state_dict()

    # A load that leaves a changed placeholder out does not make the change disappear.
    torch.nn.init.zeros_(module[1].bias)
    module.load_state_dict({"1.weight": torch.zeros(2, 2)}, strict=False)
    with pytest.raises(RuntimeError, match=r"^sequential_module.1.bias changed in place"):
        module(x)
    module.load_state_dict(body().state_dict())
    module(x)

    # assign=True puts plain meta parameters in: they become placeholders again, names and all.
    module.load_state_dict(body().state_dict(), assign=True)
    assert isinstance(module[1].weight, Placeholder) and module[1].weight.param_name == "sequential_module.1.weight"
    module(x)
    # Entries without data for remote layers (copies of placeholders) are refused, not sent to the stages.
    module.hosts.loaded.clear()
    with pytest.raises(RuntimeError, match=r"1.weight, 1.bias, 2.weight, 2.bias, 2.running_mean, 2.running_var "
                                           r"and 1 more hold no data \(meta tensors\): copies of this process's "
                                           r"placeholders"):
        module.load_state_dict({k: v.to("meta") for k, v in body().state_dict().items()})
    assert module.hosts.loaded == {}
    # A copy (of a body without a pipeline: a running one's threads cannot be copied) has new version
    # counters, which is no change, and keeps the placeholders' names and stages.
    original = PipelinedSequential(body(), {"0": 0, "1": 1, "2": 1}, None, chunks=2, checkpoint="never")
    original.load_state_dict(body().state_dict())
    copied = copy.deepcopy(original)
    copied.check_placeholders()
    assert (copied[2].weight.param_name, copied[2].weight.stage) == ("sequential_module.2.weight", 1)
    torch.nn.init.ones_(copied[2].weight)
    with pytest.raises(RuntimeError, match=r"^sequential_module.2.weight changed in place"):
        copied.check_placeholders()
    original.check_placeholders()


def test_backward_outside_lightnings_is_refused_with_replicas():
    """With replicas, a bare loss.backward() (instead of self.manual_backward) would leave each replica its own
    gradients, never averaged: the pipeline refuses it as its backward starts. Inside Lightning's backward,
    or with one replica, it runs."""
    from torch import nn

    from lightning_pipe import Pipe, PipeStrategy
    from lightning_pipe.lightning.body import PipelinedSequential

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module = PipelinedSequential(copy.deepcopy(body), {"0": 0, "1": 1}, Pipe(body, [1, 1], chunks=2).pipeline,
                                 chunks=2, checkpoint="never")
    strategy = PipeStrategy(balance=[1, 1])
    strategy._replicas.count = 2
    module.on_backward = strategy._replicas.check_backward_path
    x = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match=r"outside Lightning's backward \(loss.backward\(\) instead of "
                                           r"self.manual_backward\(loss\)\?\): with 2 replicas its gradients"):
        module(x).sum().backward()
    assert body[1].weight.grad is None  # refused before the pipeline's backward started
    loss = module(x).sum()
    strategy.pre_backward(loss)  # Lightning's backward starts: the hook lets the pipeline's backward run
    loss.backward()
    strategy.post_backward(loss)
    assert body[1].weight.grad is not None  # the pipeline's backward ran (the stand-in pipeline holds body)
    with pytest.raises(RuntimeError, match=r"outside Lightning's backward"):  # over once post_backward ran
        module(x).sum().backward()
    strategy._replicas.count = 1  # one replica: nothing to average
    module(x).sum().backward()


def test_tracing_the_pipelined_body_is_refused_saying_why():
    """torch.jit.trace (TensorBoardLogger(log_graph=True) runs it as fit starts) cannot see layers that run
    in other processes: it is refused with what to do, not left to fail deep in the pipeline."""
    from lightning_pipe import Pipe
    from lightning_pipe.lightning.body import PipelinedSequential

    body = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    module = PipelinedSequential(copy.deepcopy(body), {"0": 0, "1": 1}, Pipe(body, [1, 1], chunks=2).pipeline,
                                 chunks=2, checkpoint="never")
    with pytest.raises(RuntimeError, match=r"the pipelined body cannot be traced \(torch.jit.trace, or "
                                           r"TensorBoardLogger\(log_graph=True\)"):
        torch.jit.trace(module, torch.ones(4, 2))
    assert module(torch.ones(4, 2)).shape == (4, 2)  # not tracing: it runs
