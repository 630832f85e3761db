"""Multi-process jobs shared by several tests: configs that need the same processes train in one launch.

Launching a job costs more than most of its training (every process imports Lightning), so the configs
below are grouped by the processes they need (devices and stages) and each group runs once per test session,
case after case in the same processes (``scripts/train.py`` with ``{"cases": ...}``). A test asks for its
case's result; the first one to ask runs the group. Each case is the same training as alone: its own model,
seed, Trainer and pipeline, written to ``<job>/<case>/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from filelock import FileLock
from strategy_utils import run_script

#: Each case changes a few things from train.py's defaults (2 processes, balance [2, 2], 4 micro-batches, SGD
#: with momentum, 2 epochs of 8 steps); together they cover the grid of the strategy's promises.
GROUPS: dict[str, dict[str, dict[str, Any]]] = {
    "2 processes": {
        "2stages-sgd": {"mark_processes": True},
        "chunks1-never-adamw-groups": {"microbatches": 1, "checkpoint": "never", "optimizer": "adamw"},
        "clip-norm-steplr": {"clip": 0.05, "scheduler": "step", "balance": [1, 3]},
        "clip-value-single-backward": {"clip": 0.01, "clip_algorithm": "value", "pipelined_backward": False},
        # Two optimizers stepped in turn with toggle_optimizer (GAN style); stage 1 is in the first one only.
        "manual-two-optimizers-toggled": {"manual": True, "optimizer": "two", "balance": [1, 3]},
        # Adagrad builds state in its constructor (placeholders too); the sanity check runs validation before
        # training; the body is built in configure_model, after the processes start.
        "adagrad-sanity-configure-model": {"optimizer": "adagrad", "validate": True, "sanity_steps": 2,
                                           "configure_model": True, "epochs": 1, "guard": True,
                                           "save_initial": True},
        # Built on the meta device (trainer.init_module(), lightning_pipe.deferred_init()), each process
        # materialising its own stage alone (a guarded layer raises anywhere else), with the plain build's values:
        # a metric's states and example_input_array included; trunc_normal_ draws as many numbers as it needs.
        "deferred-init-module-metric": {"build": "init_module", "guard": True, "save_initial": True,
                                        "optimizer": "adamw", "epochs": 1, "log_metric": True},
        "deferred-init-trunc-normal": {"build": "deferred_init", "guard": True, "save_initial": True,
                                       "init": "trunc_normal", "epochs": 1},
        "plateau-scheduler": {"scheduler": "plateau", "log_metric": True, "epochs": 3},
        # Lightning's learning-rate finder: a run of its own, checkpointed before and restored after, then fit
        # with its suggestion.
        "lr-finder": {"lr_find": True, "epochs": 1, "samples": 128},
        # The callback form restores a checkpoint saved before any step: every stage drops the finder's momentum.
        "lr-finder-callback": {"lr_find": "callback", "epochs": 1, "samples": 128},
        # What is set on the driver's copies of the layers reaches their stages: layer.eval() on a layer of
        # stage 0 and one of stage 1 (dropout off there, also after validation), BatchNorm frozen by
        # BaseFinetuning (its statistics no longer tracked), zero_grad before validation (manual accumulation
        # leaves gradients over), and precision="64-true"'s default dtype for tensors a layer makes.
        "modes-frozen-bn-zero-grad-float64": {"manual": True, "manual_accumulate": 3, "validate": True,
                                              "samples": 56, "dropout": 0.5, "eval_layers": [1, 3],
                                              "batchnorm": True, "freeze_bn_layers": [2], "microbatches": 1,
                                              "precision": "64-true", "default_dtype_layer": True},
        # One pipeline, a plain loader built with shuffle=False: the batches of one device, in its order.
        "one-replica-keeps-the-loader-order": {"layers": 5, "balance": [2, 3]},
        # ... and a shuffling loader: each epoch's permutation is drawn from the default generator as the program
        # left it (after building the model), not from a generator the strategy reseeded.
        "one-replica-shuffles-as-one-device": {"layers": 5, "balance": [2, 3], "shuffle": True},
        # optimizer.state_dict() in the loop is the whole model's (it was stage 0's alone: put back, the other
        # stages' moments went): taken as epoch 1 starts, loaded back as epoch 2 starts.
        "optimizer-snapshot-restored": {"optimizer": "adamw", "epochs": 3, "optimizer_snapshot": True},
        "optimizer-state-sgd": {"optimizer": "sgd", "balance": [1, 3], "scheduler": "step"},
        "optimizer-state-adamw": {"optimizer": "adamw", "balance": [1, 3], "scheduler": "step"},
        "resume-full": {"optimizer": "adamw", "scheduler": "step", "epochs": 3, "save_every": "epoch",
                        "balance": [3, 1]},
        "resume-from-epoch-0": {"optimizer": "adamw", "scheduler": "step", "epochs": 3, "save_every": "epoch",
                                "balance": [3, 1], "resume": "resume-full/ckpts/epoch=0.ckpt"},
        # One micro-batch: bf16 and fp16 round smaller matrix products differently, which would blur the checks.
        "bf16-mixed": {"precision": "bf16-mixed", "microbatches": 1, "balance": [1, 3], "epochs": 1},
        "fp16-scaler": {"precision": "16-mixed-scaler", "balance": [1, 3], "optimizer": "adamw", "microbatches": 1},
        # Sharded checkpoints: each process writes its own file; resumed at the same balance and at another one
        # (each stage reads its entries from whichever files hold them). Its twin saves one file, for the
        # consolidated checkpoint to be compared with.
        "sharded-resume-full": {"state_dict_type": "sharded", "optimizer": "adamw", "scheduler": "step",
                                "epochs": 2, "save_every": "epoch"},
        "sharded-resume-from-epoch-0": {"state_dict_type": "sharded", "optimizer": "adamw", "scheduler": "step",
                                        "epochs": 2, "resume": "sharded-resume-full/ckpts/epoch=0.ckpt"},
        "sharded-resharded-from-epoch-0": {"state_dict_type": "sharded", "optimizer": "adamw", "scheduler": "step",
                                           "epochs": 2, "balance": [1, 3],
                                           "resume": "sharded-resume-full/ckpts/epoch=0.ckpt"},
        "full-twin-of-sharded": {"optimizer": "adamw", "scheduler": "step", "epochs": 2, "save_every": "epoch"},
    },
    "3 processes": {
        "3stages-chunks8-always": {"devices": 3, "balance": [1, 2, 1], "microbatches": 8, "checkpoint": "always"},
        "timeline": {"devices": 3, "balance": [1, 2, 1], "microbatches": 4, "epochs": 1, "timeline": "trace.json"},
        # SGD with momentum: over hundreds of steps AdamW's normalised update turns float rounding of different
        # summation orders (micro-batches) into visible differences (1e-4 after 50 steps, 1e-2 after 100),
        # between any two implementations; SGD keeps them at rounding level (3e-7 after 300 steps).
        "soak-300-steps": {"devices": 3, "balance": [1, 1, 2], "samples": 400, "batch_size": 8, "epochs": 6,
                           "width": 128, "optimizer": "sgd", "lr": 0.005, "microbatches": 4, "save_every": 50,
                           "measure_memory": [50, 150, 300]},
    },
    "4 processes": {
        # lightning_pipe.grad_norm logged in on_after_backward and on_before_optimizer_step reports every stage's
        # gradients, averaged over the replicas by then as under DDP, as Lightning's grad_norm does on one
        # device. Accumulating, Lightning blocks the sync as for DDP; the last backward of a step averages.
        "2replicas-x-2stages-onecycle-accumulate": {"devices": 4, "batch_size": 4, "accumulate": 2,
                                                    "log_grad_norm": True, "scheduler": "onecycle",
                                                    "optimizer": "adamw"},
        # Manual clipping right after manual_backward must see the replicas' averaged gradients, as under DDP.
        "2replicas-manual-optimization-clip": {"devices": 4, "batch_size": 4, "manual": True, "clip": 0.05,
                                               "scheduler": "step", "epochs": 1, "log_grad_norm": True},
        # A deferred build with replicas: each replica's stage materialises its own, all equal to replica 0's.
        "deferred-2replicas": {"devices": 4, "batch_size": 4, "build": "deferred_init", "guard": True,
                               "save_initial": True, "epochs": 1},
        # fit, validate, test and predict in one script, and later Trainers taking over the pipeline.
        "phases": {"script": "phases"},
        # A sharded checkpoint of one replica resumed by two: each process of each replica reads its own entries.
        "sharded-2replicas-from-epoch-0": {"devices": 4, "batch_size": 4, "state_dict_type": "sharded",
                                           "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                                           "resume": "../2-processes/sharded-resume-full/ckpts/epoch=0.ckpt"},
    },
}


# Every schedule on the scenarios above, the loss computed on the last stage (the head ends the body): GPipe
# (its backward waits for Lightning's), 1F1B and zero-bubble (their backwards run inside the forward, their
# gradients committed by Lightning's backward), interleaved 1F1B (2 stages per process).
SCHEDULES = {"gpipe": {}, "1f1b": {}, "zero-bubble": {}, "interleaved-1f1b": {"virtual_stages": 2}}
for _name, _extra in SCHEDULES.items():
    _v = _extra.get("virtual_stages", 1)
    _loss = {"schedule": _name, "last_stage_loss": True, **_extra}
    # 4 layers and the head: 5 layers over 2 processes (x 2 stages each, interleaved)
    _two = {**_loss, "balance": [2, 3] if _v == 1 else [1, 1, 1, 2]}
    GROUPS["2 processes"].update({
        f"{_name}-sgd-accumulate-clip-log": {**_two, "accumulate": 2, "clip": 0.05, "log_metric": True,
                                             "validate": True, "predict": True, "epochs": 1},
        f"{_name}-adamw-onecycle-always": {**_two, "optimizer": "adamw", "scheduler": "onecycle",
                                           "checkpoint": "always", "microbatches": 8, "epochs": 1},
        f"{_name}-manual-two-optimizers": {**_two, "manual": True, "optimizer": "two", "epochs": 1},
        # Under a gradient scaler, micro-batches overflow at other scales than the whole batch (each micro-batch's
        # gradients are a fraction of the batch's): the schedules are compared with each other (same micro-
        # batches), and GPipe with one micro-batch with one device.
        f"{_name}-fp16-scaler": {**_two, "precision": "16-mixed-scaler", "epochs": 1},
        f"{_name}-resume-full": {**_two, "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                                 "save_every": "epoch"},
        f"{_name}-resume-from-epoch-0": {**_two, "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                                         "save_every": "epoch", "resume": f"{_name}-resume-full/ckpts/epoch=0.ckpt"},
    })
    if _name == "gpipe":
        GROUPS["2 processes"]["gpipe-fp16-scaler-one-microbatch"] = {**_two, "precision": "16-mixed-scaler",
                                                                     "microbatches": 1, "epochs": 1}
    # 6 layers and the head over 3 processes (x 2 stages each, interleaved)
    GROUPS["3 processes"][f"{_name}-3stages-never"] = {
        **_loss, "devices": 3, "layers": 6, "checkpoint": "never", "microbatches": 6, "epochs": 1,
        "balance": [2, 2, 3] if _v == 1 else [1, 1, 1, 1, 1, 2]}
    GROUPS["4 processes"][f"{_name}-2replicas"] = {
        **_two, "devices": 4, "batch_size": 4, "accumulate": 2, "log_grad_norm": True, "optimizer": "adamw",
        "epochs": 1}


# The schedules of several stages per process beyond interleaved 1F1B, the loss on the last stage: the V shapes (zbv,
# dualpipev: process r holds stages r and 3 - r, the first and the last in the driver's), interleaved zero-bubble
# and looped BFS; accumulation and clipping, 2 replicas averaged or sharded, and a run resumed under ZBV from 1F1B's
# checkpoint at another balance.
for _name in ("zbv", "dualpipev", "interleaved-zero-bubble", "looped-bfs"):
    _two = {"schedule": _name, "last_stage_loss": True, "virtual_stages": 2, "balance": [1, 1, 1, 2], "epochs": 1}
    GROUPS["2 processes"][f"{_name}-adamw-accumulate-clip"] = {**_two, "optimizer": "adamw", "accumulate": 2,
                                                              "clip": 0.05, "log_metric": True}
    if _name in ("zbv", "dualpipev"):
        GROUPS["4 processes"][f"{_name}-2replicas"] = {**_two, "devices": 4, "batch_size": 4, "accumulate": 2,
                                                       "optimizer": "adamw", "clip": 0.05}
GROUPS["4 processes"]["zbv-2replicas-full-shard"] = {**GROUPS["4 processes"]["zbv-2replicas"], "sharding": "FULL_SHARD"}
# Mixed precision: bf16 with one micro-batch (to the bit, as the other bf16 cases), fp16 with a gradient scaler against
# GPipe's on the same micro-batches (as for the other schedules).
GROUPS["2 processes"]["zbv-bf16-mixed"] = {"schedule": "zbv", "virtual_stages": 2, "last_stage_loss": True,
                                           "balance": [1, 1, 1, 2], "precision": "bf16-mixed", "microbatches": 1,
                                           "epochs": 1}
GROUPS["2 processes"]["dualpipev-fp16-scaler"] = {"schedule": "dualpipev", "virtual_stages": 2, "last_stage_loss": True,
                                                  "balance": [1, 1, 1, 2], "precision": "16-mixed-scaler",
                                                  "epochs": 1}
GROUPS["2 processes"]["zbv-resume-from-1f1b-epoch-0"] = {
    **GROUPS["2 processes"]["1f1b-resume-full"], "schedule": "zbv", "virtual_stages": 2, "balance": [1, 1, 1, 2],
    "save_every": None, "resume": "1f1b-resume-full/ckpts/epoch=0.ckpt"}


# The data planes (data_plane): every hand-off by RPC, and every one point-to-point whatever its size (the
# default, "auto", runs every other case).
GROUPS["4 processes"]["rpc-plane-1f1b-2replicas"] = {**GROUPS["4 processes"]["1f1b-2replicas"], "data_plane": "rpc"}
GROUPS["4 processes"]["p2p-plane-zero-bubble-2replicas"] = {**GROUPS["4 processes"]["zero-bubble-2replicas"],
                                                            "data_plane": "p2p"}
# The GPU stages' lane (their tensors after each message, over NCCL) as its code runs between CPU stages: over gloo.
GROUPS["4 processes"]["lane-1f1b-2replicas-clip"] = {**GROUPS["4 processes"]["1f1b-2replicas"], "lane": "gloo",
                                                     "clip": 0.05}


# Hugging Face models as bodies (lightning_pipe.models; tests/scripts/hf_train.py): GPT-2 under GPipe, Llama
# (grouped-query attention) under 1F1B with the loss on the last stage, BERT, Qwen2 (sliding-window layers) over 3
# stages; heads tied to their embedding across stages (a copy in the first and last stage, gradients summed),
# clipped by the global norm (the tied parameter counted once): GPT-2 at 2 stages, Llama at 3 under 1F1B.
HF_CASES = {
    "2 processes": {
        "hf-gpt2-gpipe-sgd": {"script": "hf", "arch": "gpt2"},
        "hf-llama-1f1b-adamw": {"script": "hf", "arch": "llama", "schedule": "1f1b", "last_stage_loss": True,
                                "optimizer": "adamw", "epochs": 1},
        "hf-bert-sgd": {"script": "hf", "arch": "bert", "balance": [2, 4], "epochs": 1},
    },
    "3 processes": {
        "hf-qwen2-3stages-always": {"script": "hf", "arch": "qwen2", "devices": 3, "balance": [2, 2, 2],
                                    "checkpoint": "always", "epochs": 1},
    },
}
HF_CASES["2 processes"]["hf-gpt2-tied"] = {"script": "hf", "arch": "gpt2", "tied": True, "epochs": 1,
                                           "optimizer": "adamw", "clip": 0.5}
HF_CASES["2 processes"]["hf-gpt2-tied-pretrained"] = {"script": "hf", "arch": "gpt2", "tied": True, "epochs": 1,
                                                      "pretrained": True, "balance": [2, 4]}
HF_CASES["4 processes"] = {"hf-gpt2-tied-2replicas": {"script": "hf", "arch": "gpt2", "tied": True, "devices": 4,
                                                      "clip": 0.5, "optimizer": "adamw"}}
HF_CASES["3 processes"]["hf-gpt2-tied-3stages"] = {"script": "hf", "arch": "gpt2", "tied": True, "devices": 3,
                                                   "balance": [2, 2, 2], "epochs": 1, "clip": 0.5}
HF_CASES["3 processes"]["hf-llama-tied-3stages"] = {"script": "hf", "arch": "llama", "tied": True, "devices": 3,
                                                    "balance": [2, 2, 2], "epochs": 1, "clip": 0.5,
                                                    "schedule": "1f1b", "last_stage_loss": True}
for _group, _cases in HF_CASES.items():
    GROUPS[_group].update(_cases)
# DistributedDataParallel's arguments and comm hooks, 2 replicas x 2 stages: each case trains 4 steps (global batch
# 8 over 32 samples). Every checkpoint mode under GPipe (the loss on the driver, whose head has a DDP of its own)
# and 1F1B (the loss on the last stage), with no hook and with a hook that records its calls and all-reduces;
# bf16 compression; static_graph; a hook on stage 1 alone (configure_ddp overridden); parameters
# unused on some replicas or on all; BatchNorm buffers with and without broadcast_buffers (one micro-batch, as
# DDP normalises whole batches).
_DDP = {"devices": 4, "batch_size": 4, "samples": 32, "epochs": 1}
_ONE_F_ONE_B = {"schedule": "1f1b", "last_stage_loss": True, "balance": [2, 3]}
GROUPS["4 processes DDP"] = {
    f"ddp-{schedule}-{mode}-{hook or 'no-hook'}": {
        **_DDP, **(_ONE_F_ONE_B if schedule == "1f1b" else {}), "checkpoint": mode, "hook": hook,
        **({"accumulate": 2, "samples": 64} if mode == "never" else {})}
    for schedule in ("gpipe", "1f1b") for mode in ("always", "except_last", "never") for hook in (None, "record")}
GROUPS["4 processes DDP"].update({
    "ddp-gpipe-bf16": {**_DDP, "hook": "bf16"},
    "ddp-1f1b-bf16": {**_DDP, **_ONE_F_ONE_B, "hook": "bf16"},
    "ddp-stage-1-hook-small-buckets": {**_DDP, "hook": "stage-1", "ddp": {"bucket_cap_mb": 0.001,
                                                                           "gradient_as_bucket_view": True}},
    # torch's fp16_compress_hook as users pass it (no state: each DDP's own group), its calls recorded in every
    # process by a ddp_comm_wrapper; twins of the grid's except_last cases without a hook.
    "ddp-gpipe-fp16": {**_DDP, "hook": "fp16"},
    "ddp-1f1b-fp16": {**_DDP, **_ONE_F_ONE_B, "hook": "fp16"},
    "ddp-static-graph": {**_DDP, "ddp": {"static_graph": True}},
    "ddp-unused-parameters": {**_DDP, "rare_gate": True, "optimizer": "adamw", "samples": 64},
    # Stage 0 is the gate alone: in most steps no replica uses it, in a few one replica does and the other's
    # stage 0 runs no backward at all (its output needs no gradient) but must join the reduction.
    "ddp-idle-stage-gpipe": {**_DDP, "rare_gate": "layer", "optimizer": "adamw", "samples": 64, "balance": [1, 4]},
    "ddp-idle-stage-1f1b": {**_DDP, **_ONE_F_ONE_B, "rare_gate": "layer", "optimizer": "adamw", "samples": 64,
                            "balance": [1, 5]},
    "ddp-batchnorm-broadcast": {**_DDP, "batchnorm": True, "microbatches": 1, "dump_replica_state": True},
    "ddp-batchnorm-no-broadcast": {**_DDP, "batchnorm": True, "microbatches": 1, "dump_replica_state": True,
                                   "ddp": {"broadcast_buffers": False}},
})

# Each stage sharded over its 2 replicas by FSDP2 (sharding_strategy), 2 replicas x 2 stages, AdamW, 4 steps: both
# settings under GPipe and 1F1B, zero-bubble and interleaved 1F1B, accumulation with clipping by the global norm
# and logged gradient norms, manual optimization, bf16 and fp16 (a gradient scaler), HYBRID_SHARD (one replica per
# shard group: replicated; every replica on this node: sharded), a deferred build that materialises each stage in
# its own processes alone, and checkpoints: DCP directories and full files, resumed at another balance and setting
# (and, in the next group, at one replica), with unsharded twins to compare with.
_SHARDED = {**_DDP, "optimizer": "adamw"}
_SAVED = {**_SHARDED, "scheduler": "step", "epochs": 2, "save_every": "epoch"}
GROUPS["4 processes sharded"] = {
    f"sharded-{setting.lower().replace('_', '-')}-{schedule}": {
        **_SHARDED, **(_ONE_F_ONE_B if schedule == "1f1b" else {}), "sharding": setting,
        "count_collectives": schedule == "gpipe"}
    for setting in ("SHARD_GRAD_OP", "FULL_SHARD") for schedule in ("gpipe", "1f1b")}
GROUPS["4 processes sharded"].update({
    "sharded-full-shard-zero-bubble": {**_SHARDED, **_ONE_F_ONE_B, "schedule": "zero-bubble", "sharding": "FULL_SHARD"},
    "sharded-shard-grad-op-interleaved": {**_SHARDED, "schedule": "interleaved-1f1b", "virtual_stages": 2,
                                          "last_stage_loss": True, "balance": [1, 1, 1, 2],
                                          "sharding": "SHARD_GRAD_OP"},
    "sharded-full-shard-accumulate-clip": {**_SHARDED, "sharding": "FULL_SHARD", "accumulate": 2, "samples": 64,
                                           "checkpoint": "never", "clip": 0.05, "log_grad_norm": True},
    "sharded-shard-grad-op-manual-validate": {**_SHARDED, "sharding": "SHARD_GRAD_OP", "manual": True,
                                                "validate": True, "sanity_steps": 2},
    "sharded-full-shard-bf16": {**_SHARDED, "sharding": "FULL_SHARD", "precision": "bf16-mixed", "microbatches": 1,
                                "balance": [1, 3]},
    "unsharded-twin-bf16": {**_SHARDED, "precision": "bf16-mixed", "microbatches": 1, "balance": [1, 3]},
    "sharded-full-shard-fp16-scaler": {**_SHARDED, "sharding": "FULL_SHARD", "precision": "16-mixed-scaler",
                                       "microbatches": 1, "balance": [1, 3]},
    "sharded-hybrid-replicated": {**_SHARDED, "sharding": "HYBRID_SHARD", "hybrid_shard_size": 1},
    "sharded-hybrid-one-node": {**_SHARDED, "sharding": "HYBRID_SHARD", **_ONE_F_ONE_B},
    "sharded-deferred-guarded": {**_SHARDED, "sharding": "FULL_SHARD", "build": "init_module", "guard": True},
    "sharded-save-dcp": {**_SAVED, "sharding": "FULL_SHARD", "state_dict_type": "sharded"},
    "sharded-resume-dcp-other-balance": {**_SAVED, "sharding": "SHARD_GRAD_OP", "state_dict_type": "sharded",
                                         "balance": [3, 1], "save_every": None,
                                         "resume": "sharded-save-dcp/ckpts/epoch=0.ckpt"},
    "sharded-save-full": {**_SAVED, "sharding": "FULL_SHARD"},
    "sharded-resume-full-other-balance": {**_SAVED, "sharding": "FULL_SHARD", "balance": [1, 3], "save_every": None,
                                          "resume": "sharded-save-full/ckpts/epoch=0.ckpt"},
    "unsharded-twin-save-full": {**_SAVED},
    "hf-gpt2-tied-2replicas-full-shard": {**HF_CASES["4 processes"]["hf-gpt2-tied-2replicas"],
                                          "sharding": "FULL_SHARD"},
})
# ... resumed at one replica (2 processes, the global batch of 2 replicas), unsharded, from the FULL_SHARD DCP
# checkpoint and from its unsharded twin's one file.
_ONE_REPLICA = {**_SAVED, "devices": 2, "batch_size": 8, "save_every": None}
GROUPS["2 processes after sharded"] = {
    "one-replica-from-sharded-dcp": {**_ONE_REPLICA,
                                     "resume": "../4-processes-sharded/sharded-save-dcp/ckpts/epoch=0.ckpt"},
    "one-replica-from-unsharded-full": {**_ONE_REPLICA,
                                        "resume": "../4-processes-sharded/unsharded-twin-save-full/ckpts/epoch=0.ckpt"},
}


# Fine-tuning as people do it, 2 replicas x 2 stages of a tiny Llama (tests/test_finetuning.py): PEFT's LoRA adapters on
# every block (GPipe, 1F1B, DDP, FULL_SHARD) or on the last block only (stage 0 trains nothing: DDP, every sharding
# setting, both checkpoint formats, a resume); the embedding frozen as the model is built and unfrozen at step 2,
# or trainable and frozen at step 2; stage 1 frozen whole and unfrozen at step 2 (a stage with nothing to train
# when fitting starts gets its averaging then).
_FT = {"script": "hf", "arch": "llama", "devices": 4, "balance": [3, 3], "samples": 32, "batch_size": 4, "epochs": 1,
       "optimizer": "adamw"}
_ADAPTERS_LAST = {**_FT, "lora": "last"}
_EMBEDDING = {**_FT, "frozen": ["0."]}
_STAGE_1 = {**_FT, "frozen": ["3.", "4.", "5."], "unfreeze_at": 2}
GROUPS["4 processes fine-tuning"] = {
    "ft-lora-gpipe-ddp": {**_FT, "lora": "all"},
    "ft-lora-1f1b-ddp": {**_FT, "lora": "all", "schedule": "1f1b", "last_stage_loss": True},
    "ft-lora-full-shard": {**_FT, "lora": "all", "sharding": "FULL_SHARD"},
    "ft-lora-last-ddp": _ADAPTERS_LAST,
    "ft-lora-last-full-shard": {**_ADAPTERS_LAST, "sharding": "FULL_SHARD"},
    "ft-lora-last-full-shard-dcp": {**_ADAPTERS_LAST, "sharding": "FULL_SHARD", "state_dict_type": "sharded"},
    "ft-lora-last-shard-grad-op-1f1b": {**_ADAPTERS_LAST, "sharding": "SHARD_GRAD_OP", "schedule": "1f1b",
                                        "last_stage_loss": True},
    "ft-lora-last-hybrid": {**_ADAPTERS_LAST, "sharding": "HYBRID_SHARD"},
    "ft-lora-last-resume-dcp": {**_ADAPTERS_LAST, "sharding": "FULL_SHARD", "state_dict_type": "sharded",
                                "epochs": 2, "resume": "ft-lora-last-full-shard-dcp/final.ckpt"},
    "ft-lora-last-resume-full-ddp": {**_ADAPTERS_LAST, "epochs": 2, "resume": "ft-lora-last-full-shard/final.ckpt"},
    "ft-unfreeze-embedding-ddp": {**_EMBEDDING, "unfreeze_at": 2},
    "ft-unfreeze-embedding-full-shard": {**_EMBEDDING, "unfreeze_at": 2, "sharding": "FULL_SHARD"},
    "ft-freeze-embedding-ddp-accumulate": {**_EMBEDDING, "freeze_at": 2, "accumulate": 2, "samples": 64},
    "ft-unfreeze-stage-1-ddp": _STAGE_1,
    "ft-unfreeze-stage-1-shard-grad-op": {**_STAGE_1, "sharding": "SHARD_GRAD_OP"},
    # Stage 1 trained, then frozen whole at step 2: its DDP goes, stage 0's stays.
    "ft-freeze-stage-1-ddp": {**_FT, "frozen": ["3.", "4.", "5."], "freeze_at": 2},
}


# Lightning's other package: the same script against lightning.pytorch (its imports rewritten, as the binding's
# are): the plain model's weights, 1F1B, replicas, sharded checkpoints, and checkpoints crossing packages both
# ways (resumed from the other package's, exactly as from its own).
GROUPS["2 processes, lightning.pytorch"] = {
    "L-2stages-sgd": {},
    "L-1f1b-adamw-onecycle": {"schedule": "1f1b", "last_stage_loss": True, "balance": [2, 3], "optimizer": "adamw",
                              "scheduler": "onecycle", "epochs": 1},
    "L-resume-from-pytorch-lightning": {**GROUPS["2 processes"]["resume-from-epoch-0"],
                                        "resume": "../2-processes/resume-full/ckpts/epoch=0.ckpt"},
    "L-sharded-resume-full": {**GROUPS["2 processes"]["sharded-resume-full"]},
}
GROUPS["4 processes, lightning.pytorch"] = {
    "L-2replicas-accumulate": {**GROUPS["4 processes"]["2replicas-x-2stages-onecycle-accumulate"]},
}
GROUPS["2 processes, after lightning.pytorch"] = {
    "resume-from-lightning-pytorch": {
        **GROUPS["2 processes"]["resume-from-epoch-0"],
        "resume": "../2-processes-lightning.pytorch/L-resume-from-pytorch-lightning/ckpts/epoch=1.ckpt"},
}
#: Groups that read what others wrote: those run first.
NEEDS = {"4 processes": ["2 processes"], "2 processes after sharded": ["4 processes sharded"],
         "2 processes, lightning.pytorch": ["2 processes"],
         "2 processes, after lightning.pytorch": ["2 processes, lightning.pytorch"]}


#: The groups whose processes are started as scripts (``start_method='popen'``, the default): every other group's
#: are forked from its main process where it reaches fit (``start_method='fork'``), which spares each the imports
#: and the model's build (about 9 s of CPU a process on the CI machine). Training is the same either way (the
#: tests of ``start_method`` in test_lightning.py); these groups keep the default launch under the grid.
SCRIPT_STARTED = {"2 processes", "2 processes, lightning.pytorch"}


def config(case: str) -> dict[str, Any]:
    """The config of ``case``, as it trained (paths relative to its job's directory)."""
    return next(cases[case] for cases in GROUPS.values() if case in cases)


class Jobs:
    """Runs each group once, when a test first asks for one of its cases (see :data:`GROUPS`). Test workers
    (``pytest -n``) share ``root``: the first to ask runs the group under a file lock, the others wait for it
    and read its files, or its failure."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _group(self, case: str) -> str:
        return next(group for group, cases in GROUPS.items() if case in cases)

    def directory(self, case: str) -> Path:
        """Where ``case`` wrote its files (its job run first)."""
        group = self._group(case)
        for needed in NEEDS.get(group, []):
            self.directory(next(iter(GROUPS[needed])))
        out = self.root / group.replace(",", "").replace(" ", "-")
        done, failed = out.with_suffix(".done"), out.with_suffix(".failed")
        with FileLock(str(out.with_suffix(".lock")), timeout=1200):
            if not done.exists() and not failed.exists():
                out.mkdir(parents=True, exist_ok=True)
                cases = {name: {**c, "timeline": str(out / name / c["timeline"])} if c.get("timeline") else c
                         for name, c in GROUPS[group].items()}
                if group not in SCRIPT_STARTED:
                    cases = {name: {"start_method": "fork", **c} for name, c in cases.items()}
                try:
                    env = {"LP_TEST_PACKAGE": "lightning.pytorch"} if group.endswith(", lightning.pytorch") else None
                    run_script("train.py", json.dumps({"cases": cases}), str(out), timeout=900, env=env)
                except AssertionError as exc:
                    failed.write_text(str(exc))
                else:
                    done.touch()
        if failed.exists():
            raise AssertionError(f"the job of the {group} failed:\n{failed.read_text()}")
        return out / case

    def result(self, case: str) -> dict[str, Any]:
        """What ``case``'s main process wrote in its result.json."""
        return json.loads((self.directory(case) / "result.json").read_text())


# ------------------------------------------------------------------------------- what the suite did not yet prove
# (tests/test_sharding.py, "What the suite did not yet prove".) Mixed precision sharded against one device: one device
# accumulating over the replicas' batches in turn (``replica_batches``) rounds as the replicas do, each batch's
# products in half precision alone; fp16 from a scale no step overflows at (the unscaling and step over shards run;
# SGD, as AdamW's update hardly changes with its gradients' scale), bf16 in the group's "sharded-full-shard-bf16".
# SHARD_GRAD_OP accumulating. Their names do not start with "sharded-": test_sharding's grid compares those with one
# device on the global batch.
GROUPS["4 processes sharded"].update({
    "fp16-steps-full-shard": {**_SHARDED, "sharding": "FULL_SHARD", "precision": "16-mixed-scaler", "init_scale": 16.0,
                              "microbatches": 1, "balance": [1, 3], "optimizer": "sgd"},
    "shard-grad-op-accumulate": {**_SHARDED, "sharding": "SHARD_GRAD_OP", "accumulate": 2, "samples": 64},
})
# HYBRID_SHARD on a real 2-D mesh: 4 replicas x 2 stages (8 processes), each stage sharded over rows of 2 replicas
# (hybrid_shard_size=2) and replicated across the 2 rows; clipped by the global norm (over the shard groups alone),
# and fp16 from a scale no step overflows at (overflows or'ed over the shard groups).
_HYBRID = {"devices": 8, "batch_size": 2, "samples": 32, "epochs": 1, "optimizer": "adamw", "sharding": "HYBRID_SHARD",
           "hybrid_shard_size": 2}
GROUPS["8 processes hybrid"] = {
    "hybrid-2x2-clip": {**_HYBRID, "microbatches": 2, "clip": 0.05, "log_grad_norm": True},
    "hybrid-2x2-fp16-steps": {**_HYBRID, "microbatches": 1, "balance": [1, 3], "precision": "16-mixed-scaler",
                              "init_scale": 16.0, "optimizer": "sgd"},
}
# Tensor parallel inside stages (tests/test_tensor_parallel.py): the scenarios' body split over 2 tensor ranks per stage
# at [3, 2] with its plan (2 stages x 2 tensor ranks), with AdamW and clipping by the global norm, and under 1F1B with
# the loss on the last stage; a tiny Llama from to_sequential with the model's own plan; and, 8 processes, 2 replicas
# of it averaged by all-reduce, then sharded by FSDP2 over the replicas (FULL_SHARD, after tensor parallel).
_TP = {"body": "scenario", "width": 8, "balance": [3, 2], "tensor_parallel_size": 2, "epochs": 1,
       "tensor_parallel_plan": {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}}
# A per-head norm kept whole, its gradient summed over the tensor ranks ("replicated_with_grad_allreduce", as Hugging
# Face's plans keep Qwen3's q_norm): under tensor parallel alone, with 2 replicas averaged, and sharded by FULL_SHARD
# (whose fully_shard replaces the parameters a hook on them would have summed: silently 8e-4 off one device).
_HEADS = {**_TP, "body": "heads",
          "tensor_parallel_plan": {"0": "colwise", "1": "replicated_with_grad_allreduce", "2": "rowwise",
                                   "4": "colwise_rep"}}
GROUPS["4 processes tensor parallel"] = {
    "tp-adamw-clip": {**_HEADS, "devices": 4, "optimizer": "adamw", "clip": 0.05, "log_metric": True},
    "tp-1f1b-last-stage-loss": {**_TP, "devices": 4, "schedule": "1f1b", "last_stage_loss": True, "balance": [3, 3]},
    # Built on the meta device (each process materialising its own stage, then splitting it); a run saving the one
    # file each epoch, and another resuming from its first epoch's (loaded into the split stages).
    "tp-init-module": {**_TP, "devices": 4, "build": "init_module", "optimizer": "adamw"},
    "tp-resume-full": {**_TP, "devices": 4, "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                       "save_every": "epoch"},
    "tp-resume-from-epoch-0": {**_TP, "devices": 4, "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                               "resume": "tp-resume-full/ckpts/epoch=0.ckpt"},
    "tp-llama-own-plan": {"script": "hf", "arch": "llama", "devices": 4, "balance": [3, 3], "tensor_parallel_size": 2,
                          "epochs": 1, "optimizer": "adamw", "clip": 0.5},
    # Its embedding tied to its head across the stages, each copy split by the plan (both by rows of the vocabulary:
    # the owners sum their slices), and with the embedding kept whole (each owner sums its gradient whole). SGD with
    # momentum (both within 2e-8 of one device's weights, which moved 0.02 to 0.05); under AdamW, whose normalised step
    # enlarges rounding, one weight of block 3 ended 3e-5 away, the tied weights themselves within 1e-6.
    "tp-llama-tied": {"script": "hf", "arch": "llama", "tied": True, "devices": 4, "balance": [3, 3],
                      "tensor_parallel_size": 2, "epochs": 1, "clip": 0.5},
    "tp-llama-tied-embedding-whole": {"script": "hf", "arch": "llama", "tied": True, "devices": 4, "balance": [3, 3],
                                      "tensor_parallel_size": 2, "epochs": 1, "plan_without": ["0.embed_tokens"]},
    # Every schedule: zero-bubble (weight gradients apart from input gradients, over DTensors) and interleaved 1F1B
    # (2 stages per process, each gathering its output whole).
    "tp-zero-bubble": {**_TP, "devices": 4, "schedule": "zero-bubble", "last_stage_loss": True, "balance": [3, 3],
                       "optimizer": "adamw"},
    "tp-interleaved": {**_TP, "devices": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2,
                       "last_stage_loss": True, "balance": [1, 2, 2, 1],
                       "tensor_parallel_plan": {"0": "colwise_rep", "2": "rowwise_rep", "4": "colwise_rep"}},
    # ZBV over split stages: 2 processes x 2 tensor ranks, each process's 2 stages in a V.
    "tp-zbv": {**_TP, "devices": 4, "schedule": "zbv", "virtual_stages": 2, "last_stage_loss": True,
               "balance": [1, 2, 2, 1],
               "optimizer": "adamw", "clip": 0.05,
               "tensor_parallel_plan": {"0": "colwise_rep", "2": "rowwise_rep", "4": "colwise_rep"}},
    # Autocast in split stages (one micro-batch, as the other bf16 cases).
    "tp-bf16-mixed": {**_TP, "devices": 4, "precision": "bf16-mixed", "microbatches": 1, "record_dtypes": True},
    # A gradient scaler over split gradients, from a scale no step overflows at (SGD: unscaled or not shows), and
    # from 2**20, where the first steps overflow in some tensor ranks' slices and must be skipped by all.
    "tp-fp16-steps": {**_TP, "devices": 4, "precision": "16-mixed-scaler", "init_scale": 16.0, "microbatches": 1},
    "tp-fp16-overflows": {**_TP, "devices": 4, "precision": "16-mixed-scaler", "microbatches": 1},
    # A Hugging Face checkpoint read stage by stage (the body built on meta), each stage then split.
    "tp-llama-pretrained": {"script": "hf", "arch": "llama", "devices": 4, "balance": [3, 3],
                            "tensor_parallel_size": 2, "epochs": 1, "pretrained": True},
    # A DCP checkpoint of split stages, resumed at 2 replicas sharded by FULL_SHARD (next group) and at t = 1, one
    # replica, another balance ("2 processes after sharded").
    "tp-save-dcp": {**_TP, "devices": 4, "optimizer": "adamw", "scheduler": "step", "epochs": 2,
                    "save_every": "epoch", "state_dict_type": "sharded"},
}
GROUPS["8 processes tensor parallel"] = {
    # Built on meta: each layer takes replica 0's weights, then is split, before the next is made.
    "tp-2replicas-clip": {**_HEADS, "devices": 8, "batch_size": 4, "samples": 32, "optimizer": "adamw", "clip": 0.05,
                          "build": "init_module", "log_metric": True},
    "tp-2replicas-full-shard-clip": {**_HEADS, "devices": 8, "batch_size": 4, "samples": 32, "optimizer": "adamw",
                                     "clip": 0.05, "sharding": "FULL_SHARD"},
    "tp-2replicas-full-shard-from-dcp": {**_TP, "devices": 8, "batch_size": 4, "optimizer": "adamw",
                                         "scheduler": "step", "epochs": 2, "sharding": "FULL_SHARD",
                                         "state_dict_type": "sharded",
                                         "resume": "../4-processes-tensor-parallel/tp-save-dcp/ckpts/epoch=0.ckpt"},
}
GROUPS["2 processes after sharded"]["one-replica-from-tp-dcp"] = {
    **_TP, "devices": 2, "tensor_parallel_size": 1, "tensor_parallel_plan": None, "balance": [2, 3],
    "optimizer": "adamw", "scheduler": "step", "epochs": 2,
    "resume": "../4-processes-tensor-parallel/tp-save-dcp/ckpts/epoch=0.ckpt"}
NEEDS["2 processes after sharded"].append("4 processes tensor parallel")
NEEDS["8 processes tensor parallel"] = ["4 processes tensor parallel"]
