"""A configurable LightningModule trained plain or through PipeStrategy, for the strategy's tests.

    python train.py '{"devices": 2, "balance": [2, 2], ...}' OUT_DIR

writes OUT_DIR/final.ckpt (the consolidated checkpoint) and OUT_DIR/result.json from the main process.

Written against ``pytorch_lightning``; with ``LP_TEST_PACKAGE=lightning.pytorch`` in the environment (inherited by
the processes Lightning starts) the same script runs against ``lightning.pytorch``, its imports rewritten as
``lightning_pipe.packages`` rewrites the binding's.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
from typing import Any

if (__name__ == "__main__" and os.environ.get("LP_TEST_PACKAGE") == "lightning.pytorch"
        and not globals().get("_REWRITTEN")):
    from pathlib import Path

    from lightning_pipe.packages import rewrite

    _REWRITTEN = True
    exec(compile(rewrite(Path(__file__).read_text()), __file__, "exec"), globals())  # noqa: S102
    raise SystemExit(0)

import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.tuner import Tuner
from pytorch_lightning.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_pipe

DEFAULTS: dict[str, Any] = {
    "devices": 2, "balance": [2, 2], "microbatches": 4, "checkpoint": "except_last", "pipelined_backward": True,
    "optimizer": "sgd", "scheduler": None, "accumulate": 1, "clip": None, "clip_algorithm": "norm",
    "manual": False, "batch_size": 8, "samples": 64, "epochs": 2, "layers": 4, "width": 16, "seed": 7,
    "shuffle": False, "precision": "32-true", "dropout": 0.0, "validate": False, "resume": None, "max_steps": -1,
    "save_every": None, "strategy": "pipe", "log_metric": False, "lr": 0.05, "measure_memory": None, "timeline": None,
    "sanity_steps": 0, "configure_model": False, "nodes": 1, "log_grad_norm": False, "lr_find": False,
    "manual_accumulate": 1, "eval_layers": [], "batchnorm": False, "freeze_bn_layers": [],
    "default_dtype_layer": False, "accelerator": "cpu", "schedule": "gpipe", "virtual_stages": 1,
    "last_stage_loss": False, "predict": False, "build": "eager", "guard": False, "save_initial": False,
    "init": None, "state_dict_type": "full", "ddp": {}, "hook": None, "rare_gate": False,
    "dump_replica_state": False, "sharding": "NO_SHARD", "hybrid_shard_size": None, "count_collectives": False,
    "data_plane": "auto", "lane": None, "start_method": "popen", "mark_processes": False,
    "init_scale": 2.0**20, "replica_batches": False, "body": "blocks",
    "tensor_parallel_size": 1, "tensor_parallel_plan": None, "record_dtypes": False, "optimizer_snapshot": False,
}

#: ``"body": "scenario"``: the body of the tensor-parallel scenarios (input width 8), and a plan splitting it.
SCENARIO_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}


_COUNTED: dict[str, Any] = {"control": None}  # the file naming where the current case records (see below)


def count_collectives(out: str, record: bool) -> None:
    """Record every all-gather and reduce-scatter of FSDP2 (torch.distributed's ``all_gather_single`` and
    ``reduce_scatter_single``, which it calls) made in this process, a line per call in
    ``<case>/collectives/<pid>.log`` while the current case records (``record``). Stage processes serve every
    case of a job but run this only at its first: the file ``collectives-case`` beside the cases' directories
    names the case that records now (empty: none), written by the main process as each case starts."""
    import torch.distributed as dist

    control = os.path.join(os.path.dirname(os.path.abspath(out)), "collectives-case")
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        with open(control, "w") as f:
            f.write(os.path.join(out, "collectives") if record else "")
        if record:
            os.makedirs(os.path.join(out, "collectives"), exist_ok=True)
    if _COUNTED["control"] is not None:
        return
    _COUNTED["control"] = control
    for name in ("all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            with open(_COUNTED["control"]) as f:
                directory = f.read()
            if directory:
                with open(os.path.join(directory, f"{os.getpid()}.log"), "a") as f:
                    f.write(f"{_name}\n")
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


class Rotate(nn.Module):
    """Multiplies by a matrix it makes in forward with the default dtype (float64 under precision="64-true")."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (torch.eye(self.width) * 0.9 + 0.01)


@torch.library.custom_op("lp_test::claim_", mutates_args=("weight",))
def claim_(weight: torch.Tensor, process: int) -> None:
    """Scale ``weight`` by 1 (a no-op on values): materialising it runs this CPU kernel, which raises in any
    process of a guarded job (``LP_GUARD_PROCESSES``, the processes of a pipeline) but ``process``."""
    processes = int(os.environ.get("LP_GUARD_PROCESSES", "0"))
    here = int(os.environ.get("LOCAL_RANK", "0")) % processes if processes else process
    if here != process:
        raise RuntimeError(f"a layer of pipeline process {process} was materialised in process {here}")
    weight.mul_(1.0)


@claim_.register_fake
def _(weight: torch.Tensor, process: int) -> None:
    return None


class Guarded(nn.Linear):
    """A linear layer that only the pipeline process ``process`` may materialise (see :func:`claim_`)."""

    def __init__(self, width: int, process: int) -> None:
        super().__init__(width, width)
        with torch.no_grad():
            claim_(self.weight, process)


def owners(config: dict[str, Any]) -> list[int]:
    """The pipeline process of each block of the body (stage s in process s % processes)."""
    processes = len(config["balance"]) // config["virtual_stages"]
    return [s % processes for s, size in enumerate(config["balance"]) for _ in range(size)]
class RareGate(nn.Module):
    """Adds ``rare`` to the samples whose first feature exceeds 1.9 (2 of the 64 samples), touching ``rare`` only in
    micro-batches holding one: a parameter unused on some replicas in some steps. ``never`` is never used (not zero:
    weight decay would move it if it got a zero gradient instead of none)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.rare = nn.Parameter(torch.full((width,), 0.1))
        self.never = nn.Parameter(torch.full((width,), 0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[:, :1] > 1.9
        return x + self.rare * mask if bool(mask.any()) else x


class HookLog:
    """The state of :func:`record_hook`: the directory where each process writes a line per call, and the
    group to average over (None: the DDP's own, which PipeStrategy puts there)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.process_group: Any = None


def record_hook(state: HookLog, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001
    """A comm hook that records each call (process, bucket, whether it is the step's last) and all-reduces.
    (DDP refuses a hook whose ``bucket`` annotation is not ``dist.GradBucket`` itself, as a string is here.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with open(os.path.join(state.directory, f"{os.getpid()}.log"), "a") as f:
        f.write(f"{bucket.index()} {int(bucket.is_last())} {bucket.buffer().numel()}\n")
    return default_hooks.allreduce_hook(state.process_group, bucket)


class CallLog:
    """A ``ddp_comm_wrapper`` that records each call of the hook it wraps as :func:`record_hook` does (a line per
    call in a file per process), leaving the hook and its state as given: torch's ``fp16_compress_hook`` with no
    state, whose group PipeStrategy puts there."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, hook: Any) -> Any:
        directory = self.directory

        def recorded(state, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001, ANN202 - see record_hook
            with open(os.path.join(directory, f"{os.getpid()}.log"), "a") as f:
                f.write(f"{bucket.index()} {int(bucket.is_last())} {bucket.buffer().numel()}\n")
            return hook(state, bucket)

        return recorded


def bf16_hook(process_group: Any, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001
    """torch's bf16 compression hook, the very function ``bf16_compress_hook`` calls: torch registers that one
    by name only on CUDA builds with NCCL."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def record_dtype(directory: str, index: str, module: nn.Module, args: Any, output: torch.Tensor) -> None:
    """A forward hook: the dtype of layer ``index``'s output, recorded per process in ``directory`` (in a split
    run, the precision's autocast reached each process that ran the layer)."""
    path = os.path.join(directory, f"dtypes-{os.getpid()}.json")
    seen = json.loads(open(path).read()) if os.path.exists(path) else {}
    if seen.get(index) != str(output.dtype):
        seen[index] = str(output.dtype)
        with open(path, "w") as f:
            json.dump(seen, f)


class HeadNorm(nn.Module):
    """A norm over each head of 4 features with one weight for every head, as Qwen3's per-head ``q_norm``: under
    tensor parallel it stays whole (``"replicated_with_grad_allreduce"``), and each tensor rank sees its heads alone,
    so its gradient must be summed over the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.unflatten(-1, (-1, 4)), (4,), self.weight).flatten(-2)


#: ``"body": "heads"``: the scenarios' body with its first Tanh a :class:`HeadNorm`, and the plan keeping it whole.
HEADS_PLAN = {"0": "colwise", "1": "replicated_with_grad_allreduce", "2": "rowwise", "4": "colwise_rep"}


def make_body(config: dict[str, Any]) -> nn.Sequential:
    if config["body"] in ("scenario", "heads"):
        first = HeadNorm() if config["body"] == "heads" else nn.Tanh()
        return nn.Sequential(nn.Linear(config["width"], 16), first, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    layers: list[nn.Module] = []
    width = config["width"]
    for i in range(config["layers"]):
        linear = Guarded(width, owners(config)[i]) if config["guard"] else nn.Linear(width, width)
        if config["init"] == "trunc_normal":  # rejection sampling: draws as many numbers as its values ask
            nn.init.trunc_normal_(linear.weight, std=0.5, a=-0.6, b=0.6)
        block: list[nn.Module] = [linear, nn.Tanh()]
        if config["batchnorm"]:
            block.insert(1, nn.BatchNorm1d(width))
        if config["default_dtype_layer"]:
            block.append(Rotate(width))
        if config["dropout"] and i % 2:
            block.append(nn.Dropout(config["dropout"]))
        if config["rare_gate"] is True and i == 0:  # on the input itself, whose first feature is rarely above 1.9
            block.insert(0, RareGate(width))
        layers.append(nn.Sequential(*block))
    if config["rare_gate"] == "layer":  # a layer of its own (with balance [1, ...], a stage of its own)
        layers.insert(0, RareGate(width))
    return nn.Sequential(*layers)


class Model(pl.LightningModule):
    lazy = False  # the body is built in configure_model

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = {**DEFAULTS, **(config or {})}
        self.save_hyperparameters({"config": self.config})
        torch.manual_seed(self.config["seed"])
        if not self.lazy:
            self.sequential_module = make_body(self.config)
        out = 4 if self.config["body"] in ("scenario", "heads") else self.config["width"]
        if self.config["last_stage_loss"]:  # the head ends the body: the loss is computed on the last stage
            self.sequential_module.append(nn.Linear(out, 1))
            self.head = nn.Identity()
        else:
            self.head = nn.Linear(out, 1)  # outside the body: stays on the driver
        self.automatic_optimization = not self.config["manual"]
        self.metric = torchmetrics.MeanSquaredError()
        self.samples = torchmetrics.SumMetric()  # each sample once (a replica's tensor ranks see the same batch)
        self.gathered: int | None = None  # what self.all_gather gives of one number: one per replica
        # ModelSummary runs it as it is (Lightning converts batches, not this) under the precision's dtype.
        dtype = torch.float64 if self.config["precision"] == "64-true" else torch.float32
        self.example_input_array = torch.zeros(4, self.config["width"], dtype=dtype)
        self.lr = self.config["lr"]  # where Lightning's learning-rate finder puts its suggestion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sequential_module(x))

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean squared error of the model on (x, y): on the last stage where the head ends the body."""
        if self.config["last_stage_loss"]:
            return lightning_pipe.loss_on_last_stage(self.sequential_module, x, y, nn.functional.mse_loss)
        return nn.functional.mse_loss(self(x), y)

    def _head_parameters(self) -> Any:
        return (self.sequential_module[-1] if self.config["last_stage_loss"] else self.head).parameters()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.config["last_stage_loss"]:
            loss = self._loss(x, y)
        else:
            out = self(x)
            loss = nn.functional.mse_loss(out, y)
            if self.config["log_metric"]:
                self.metric(out, y)
                # Per epoch: torchmetrics computes it over every replica's updates (a step's value is the
                # process's own batch alone, sync_dist or not).
                self.log("train_mse", self.metric, on_step=False, on_epoch=True)
        if self.config["log_metric"]:
            self.log("train_loss", loss, sync_dist=True)
            self.log("train_samples", float(len(x)), sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
            self.samples.update(float(len(x)))
            self.log("train_samples_metric", self.samples, on_step=False, on_epoch=True)
            if self.gathered is None:
                self.gathered = len(self.all_gather(torch.tensor(1.0)).reshape(-1))
        if not self.automatic_optimization and self.config["optimizer"] == "two":
            self._alternate(loss, x, y)
        elif not self.automatic_optimization and self.config["manual_accumulate"] > 1:
            # Gradients accumulate over several batches, zeroed after each step: what is left at the end of the
            # epoch is dropped by the zero_grad Lightning calls before validation (on every stage).
            opt = self.optimizers()
            self.manual_backward(loss)
            if (batch_idx + 1) % self.config["manual_accumulate"] == 0:
                opt.step()
                opt.zero_grad()
        elif not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            if self.config["clip"]:
                self.clip_gradients(opt, gradient_clip_val=self.config["clip"], gradient_clip_algorithm="norm")
            opt.step()
            sched = self.lr_schedulers()
            if sched is not None:
                sched.step()
        return loss

    def _alternate(self, loss: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """Two optimizers stepped in turn, each with the other's parameters frozen (as GANs train): the body's,
        then the head's on a second forward. Stage 1 holds parameters of the first optimizer only."""
        body, head = self.optimizers()
        for opt, closure_loss in ((body, lambda: loss), (head, lambda: 2 * self._loss(x, y))):
            self.toggle_optimizer(opt)
            self.manual_backward(closure_loss())
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def _log_grad_norms(self, prefix: str) -> None:
        if self.config["log_grad_norm"]:
            # Through the pipeline, lightning_pipe's; on one device, Lightning's own: the reference.
            pipelined = isinstance(self.trainer.strategy, lightning_pipe.PipeStrategy)
            norms = (lightning_pipe.grad_norm if pipelined else grad_norm)(self, norm_type=2)
            self.log_dict({prefix + k: v for k, v in norms.items()})
            if pipelined:  # Lightning's would see stage 0 alone: it is refused, saying what to use
                try:
                    grad_norm(self, norm_type=2)
                except RuntimeError as exc:
                    self.log(prefix + "refused", float("lightning_pipe.grad_norm" in str(exc)))

    def on_train_start(self) -> None:
        from pytorch_lightning.callbacks import BaseFinetuning

        for i in self.config["eval_layers"]:  # Lightning keeps these modes through validation
            self.sequential_module[i].eval()
        for i in self.config["freeze_bn_layers"]:  # frozen weights, and BatchNorm statistics no longer tracked
            BaseFinetuning.freeze(self.sequential_module[i], train_bn=False)

    def on_train_epoch_start(self) -> None:
        if self.config["optimizer_snapshot"]:  # the optimizer's state taken as the second epoch starts, put back
            optimizer = self.optimizers().optimizer  # as the third does (a rollback of its moments)
            if self.current_epoch == 1:
                self._snapshot = copy.deepcopy(optimizer.state_dict())
            elif self.current_epoch == 2:
                optimizer.load_state_dict(self._snapshot)

    def on_after_backward(self) -> None:
        self._log_grad_norms("after_backward/")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._log_grad_norms("")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self._loss(x, y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", self._loss(x, y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        c = self.config
        if c["optimizer"] == "two":
            head = {id(p) for p in self._head_parameters()}
            body = [p for p in self.sequential_module.parameters() if id(p) not in head]
            return [torch.optim.SGD(body, lr=self.lr, momentum=0.9), torch.optim.Adam(self._head_parameters(), lr=0.01)]
        if c["optimizer"] == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        elif c["optimizer"] == "adam-fused":
            opt = torch.optim.Adam(self.parameters(), lr=0.01, fused=True)
        elif c["optimizer"] == "adagrad":  # builds per-parameter state in its constructor
            opt = torch.optim.Adagrad(self.parameters(), lr=c["lr"], initial_accumulator_value=0.1)
        else:  # adamw with parameter groups by name: no weight decay on biases
            decay = [p for n, p in self.named_parameters() if not n.endswith("bias")]
            no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": no_decay, "weight_decay": 0.0}], lr=0.01)
        if c["scheduler"] == "onecycle":
            total = self.trainer.estimated_stepping_batches
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=int(total))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if c["scheduler"] == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "train_loss"}}
        if c["scheduler"] == "step":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}
        return opt


class LazyModel(Model):
    """The same model with its body built in ``configure_model`` (once the processes run), the way large
    models are built; its checkpoints load into :class:`Model`."""

    lazy = True

    def configure_model(self) -> None:
        if not hasattr(self, "sequential_module"):
            torch.manual_seed(self.config["seed"] + 1)
            self.sequential_module = make_body(self.config)


def data(config: dict[str, Any]) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(config["samples"], config["width"], generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


class ReplicaBatches(torch.utils.data.Sampler):
    """One device's order for the batches of ``replicas`` replicas under Lightning's shuffling DistributedSampler
    (seeded by ``seed``): each step's batch of replica 0, then replica 1's, and so on."""

    def __init__(self, dataset: TensorDataset, replicas: int, batch_size: int, seed: int) -> None:
        self.parts = [DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=seed)
                      for r in range(replicas)]
        self.batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it as each epoch starts, as on the replicas'
        for part in self.parts:
            part.set_epoch(epoch)

    def __iter__(self) -> Any:
        parts = [list(part) for part in self.parts]
        for start in range(0, len(parts[0]), self.batch_size):
            for part in parts:
                yield from part[start:start + self.batch_size]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


class MemoryProbe(pl.Callback):
    """Records every pipeline process's memory after the given training steps (main process writes)."""

    def __init__(self, steps: list[int], path: str) -> None:
        self.steps, self.path, self.seen = set(steps), path, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps and trainer.global_step not in self.seen:
            self.seen[trainer.global_step] = trainer.strategy.memory_per_process()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(self.seen, f)


class SaveInitial(pl.Callback):
    """Saves the whole model's weights as training starts (the main process; every stage's, consolidated)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = module.state_dict()
        if trainer.is_global_zero:
            torch.save(state, self.path)


def placement(accelerator: str, devices: int) -> tuple[int, dict[str, Any]]:
    """``Trainer(devices=...)`` and the PipeStrategy arguments that run ``devices`` processes on
    ``accelerator``: with fewer GPUs than processes, they share the GPUs (the stages' weights and work are
    small here). NCCL refuses two processes of one group on one GPU; gloo averages CUDA tensors too."""
    if accelerator != "gpu" or torch.cuda.device_count() >= devices:
        return devices, {}
    gpus = torch.cuda.device_count()
    # Lightning checks Trainer(devices=...) against the GPUs there are; the processes are the strategy's devices.
    return 1, {"parallel_devices": [torch.device("cuda", i % gpus) for i in range(devices)],
               "process_group_backend": "gloo"}


class StageOneHook(lightning_pipe.PipeStrategy):
    """Records the comm hook's calls on stage 1's DDP only: ``configure_ddp`` overridden for one stage."""

    def __init__(self, *args: Any, log_directory: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log_directory = log_directory

    def configure_ddp(self, module: nn.Module, device_ids: Any, process_group: Any, stage: Any) -> Any:
        ddp = super().configure_ddp(module, device_ids, process_group, stage)
        if stage == 1:
            state = HookLog(self.log_directory)
            state.process_group = process_group
            ddp.register_comm_hook(state, record_hook)
        return ddp


def ddp_arguments(config: dict[str, Any], out: str) -> dict[str, Any]:
    """The DDP arguments of ``config`` for PipeStrategy: ``ddp`` as given, and the comm hook ``hook`` names."""
    kwargs = dict(config["ddp"])
    hooks = os.path.join(out, "hooks")
    if config["hook"] == "record":
        os.makedirs(hooks, exist_ok=True)
        kwargs.update(ddp_comm_hook=record_hook, ddp_comm_state=HookLog(hooks))
    elif config["hook"] == "stage-1":
        os.makedirs(hooks, exist_ok=True)
        kwargs["log_directory"] = hooks
    elif config["hook"] == "powersgd":  # as Lightning's docs teach: a state whose group PipeStrategy fills in
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        kwargs.update(ddp_comm_hook=powersgd.powerSGD_hook, ddp_comm_state=powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3))
    elif config["hook"] == "fp16":  # torch's fp16 compression as users pass it, each call recorded per process
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        os.makedirs(hooks, exist_ok=True)
        kwargs.update(ddp_comm_hook=default_hooks.fp16_compress_hook, ddp_comm_wrapper=CallLog(hooks))
    elif config["hook"] == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        nccl = torch.cuda.is_available() and torch.distributed.is_nccl_available()
        kwargs["ddp_comm_hook"] = default_hooks.bf16_compress_hook if nccl else bf16_hook
    return kwargs


def trainer_for(config: dict[str, Any], out: str, plain: bool = False) -> pl.Trainer:
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_pipe import PipeStrategy

    precision: dict[str, Any] = {"precision": config["precision"]}
    if config["precision"] == "16-mixed-scaler":  # fp16 with a gradient scaler, as on GPUs, here on CPU
        from pytorch_lightning.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=config["init_scale"], growth_interval=3)
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    kwargs: dict[str, Any] = dict(
        accelerator=config["accelerator"], max_epochs=config["epochs"], max_steps=config["max_steps"], logger=False,
        enable_progress_bar=False, enable_model_summary=not plain, **precision,
        accumulate_grad_batches=config["accumulate"], default_root_dir=out, num_sanity_val_steps=config["sanity_steps"],
        limit_val_batches=2 if config["validate"] else 0, deterministic=True,
    )
    if not config["manual"] and config["clip"]:
        kwargs.update(gradient_clip_val=config["clip"], gradient_clip_algorithm=config["clip_algorithm"])
    callbacks = []
    if config["lr_find"] == "callback":  # the finder as a callback, run as fit starts
        from pytorch_lightning.callbacks import LearningRateFinder

        callbacks.append(LearningRateFinder(min_lr=1e-3, max_lr=0.5, num_training_steps=24,
                                            early_stop_threshold=None))
    if config["measure_memory"] and not plain:
        callbacks.append(MemoryProbe(config["measure_memory"], os.path.join(out, "memory.json")))
    if config["save_every"] == "epoch":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_epochs=1, save_top_k=-1,
                                         save_last=True, filename="{epoch}"))
    elif config["save_every"]:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=config["save_every"],
                                         save_top_k=-1, save_last=True, filename="{step}"))
    kwargs["enable_checkpointing"] = bool(callbacks)
    if plain:
        return pl.Trainer(devices=1, callbacks=callbacks, **kwargs)
    strategy: Any = config["strategy"]
    devices, shared = placement(config["accelerator"], config["devices"])
    if strategy == "pipe":
        # "lane": "gloo", the GPU stages' NCCL lane as its code runs between CPU stages (no strategy argument asks).
        import lightning_pipe.lightning.build as build
        from lightning_pipe.transport.stages.rendezvous import connect

        build.connect = functools.partial(connect, lane=config["lane"])
        cls = StageOneHook if config["hook"] == "stage-1" else PipeStrategy
        strategy = cls(balance=config["balance"], microbatches=config["microbatches"],
                       checkpoint=config["checkpoint"], pipelined_backward=config["pipelined_backward"],
                       rpc_timeout_sec=60, timeline=config["timeline"], schedule=config["schedule"],
                       virtual_stages=config["virtual_stages"], state_dict_type=config["state_dict_type"],
                       sharding_strategy=config["sharding"], hybrid_shard_size=config["hybrid_shard_size"],
                       data_plane=config["data_plane"], start_method=config["start_method"], **shared,
                       **ddp_arguments(config, out),
                       **({"tensor_parallel_size": config["tensor_parallel_size"],
                           "tensor_parallel_plan": config["tensor_parallel_plan"]}
                          if config["tensor_parallel_size"] > 1 else {}))
    elif strategy == "ddp":  # Lightning's DDPStrategy over the plain model: the reference for replicas
        from pytorch_lightning.strategies import DDPStrategy

        strategy = DDPStrategy(**shared, **config["ddp"])
    return pl.Trainer(devices=devices, num_nodes=config["nodes"], strategy=strategy, callbacks=callbacks,
                      **kwargs)


def crash_at_save(spec: str) -> None:
    """Kill this process (SIGKILL: nothing runs after) as the n-th written checkpoint is put into place (``spec``
    ``"n"``: before, a file by os.replace, a sharded checkpoint's directory by placing.put_in_place), or right
    after the first step of putting it there (``"n:after"``: its swap with the checkpoint it replaces, or the
    rename of that one to its .old- name; a new name's rename): the moments a crash would leave a half-written
    checkpoint, or none at all, behind. With LP_NO_EXCHANGE set, the file system is taken for one without a swap
    (NFS, Lustre): a replaced directory goes by two renames."""
    import signal

    from lightning_pipe.transport import placing

    n, _, when = spec.partition(":")
    count, armed = [0], [False]

    def put(real: Any, src: Any, dst: Any) -> Any:
        count[0] += 1
        if count[0] == int(n):
            if when != "after":
                os.kill(os.getpid(), signal.SIGKILL)
            armed[0] = True
        try:
            return real(src, dst)
        finally:
            armed[0] = False

    def step(real: Any) -> Any:
        def stepped(*args: Any) -> Any:
            done = real(*args)
            if armed[0] and done is not False:  # (a swap the file system refuses: no step taken)
                os.kill(os.getpid(), signal.SIGKILL)
            return done
        return stepped

    real_replace, real_put = os.replace, placing.put_in_place

    def replace(src: Any, dst: Any) -> None:
        if ".tmp" in str(src) and ".partial-" not in str(dst):  # a one-file checkpoint (not DCP's .metadata)
            return put(step(real_replace), src, dst)
        return real_replace(src, dst)

    os.replace = replace  # type: ignore[assignment]
    placing.put_in_place = lambda staged, path: put(real_put, staged, path)
    os.rename = step(os.rename)  # type: ignore[assignment]
    placing.exchange = (lambda a, b: False) if os.environ.get("LP_NO_EXCHANGE") else step(placing.exchange)


def main(config: dict[str, Any], out: str, plain: bool = False) -> pl.LightningModule:
    config = {**DEFAULTS, **config}
    if config["mark_processes"] and not plain:  # each process that runs the script up to fit leaves its mark
        os.makedirs(os.path.join(out, "started"), exist_ok=True)
        open(os.path.join(out, "started", str(os.getpid())), "w").close()
    if not plain:
        count_collectives(out, config["count_collectives"])
    if os.environ.get("LP_CRASH_AT_SAVE"):
        crash_at_save(os.environ["LP_CRASH_AT_SAVE"])
    pl.seed_everything(config["seed"], workers=True)
    if config["guard"] and not plain:
        os.environ["LP_GUARD_PROCESSES"] = str(len(config["balance"]) // config["virtual_stages"])
    trainer = trainer_for(config, out, plain)
    model_class = LazyModel if config["configure_model"] else Model
    if config["build"] == "init_module":  # Lightning's way for large models; real on one device
        with trainer.init_module():
            model = model_class(config)
    elif config["build"] == "deferred_init" and not plain:  # the same model, built plainly as the reference
        with lightning_pipe.deferred_init():
            model = model_class(config)
    else:
        model = model_class(config)
    if config["save_initial"]:
        trainer.callbacks.append(SaveInitial(os.path.join(out, "initial.pt")))
    if config["record_dtypes"] and not plain:  # (the hooks travel with the layers to their stages' processes)
        for index, layer in enumerate(model.sequential_module):
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(functools.partial(record_dtype, out, str(index)))
    dataset = data(config)
    processes = len(config["balance"]) // config["virtual_stages"] if config["balance"] else config["devices"]
    replicas = config["devices"] * config["nodes"] // (processes * config["tensor_parallel_size"])
    if plain and replicas > 1 and config["replica_batches"]:
        # Each replica's batch in turn (batch_size: a replica's), for one device accumulating over them: the
        # replicas' step computed batch by batch as they compute it, which mixed precision rounds alike.
        sampler = ReplicaBatches(dataset, replicas, config["batch_size"], config["seed"])
        loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)
    elif plain and replicas > 1:
        # With replicas, Lightning gives training loaders a shuffling DistributedSampler seeded by
        # seed_everything, as under DDP; one device drawing the same permutation sees the union of every
        # replica's batch. One pipeline uses the loader as it is, as one device does.
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=config["seed"])
        loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=config["batch_size"], shuffle=config["shuffle"])
    if config["lr_find"] and config["lr_find"] != "callback":
        # A short run whose weights are restored from a checkpoint afterwards; the suggestion goes to model.lr.
        Tuner(trainer).lr_find(model, train_dataloaders=loader, min_lr=1e-3, max_lr=0.5, num_training=24,
                               early_stop_threshold=None)
    trainer.fit(model, loader, loader if config["validate"] else None, ckpt_path=config["resume"],
                weights_only=True if config["resume"] else None)
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    route = None  # how tensors go from the driver's stage to stage 1: None (host memory), or GPU to GPU
    stats: dict[str, Any] = {}
    if isinstance(trainer.strategy, lightning_pipe.PipeStrategy):
        route = str(trainer.strategy._pipeline.runner.direct(1))
        # What the remote stages did (optimizer steps, barriers), then once more after one barrier more.
        hosts = trainer.strategy._body.hosts
        stats["fit"] = hosts.call("stats")
        trainer.strategy.barrier("test")
        stats["barrier"] = hosts.call("stats")
    if trainer.is_global_zero:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"world_size": trainer.world_size, "global_step": trainer.global_step, "lr": model.lr,
                       "route": route, "stages": stats, "trainer": type(trainer).__module__,
                       "strategy": type(trainer.strategy).__module__,
                       "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                       "gathered": model.gathered}, f)
    if (config["sharding"] != "NO_SHARD" or config["tensor_parallel_size"] > 1) and not plain:
        # How much of its stage every process holds, per pipeline (a replica's, with tensor parallel).
        from lightning_pipe.transport.parallel.fsdp import held

        real = [p for p in model.sequential_module.parameters() if not p.is_meta]
        with open(os.path.join(out, f"held_replica{trainer.global_rank}.json"), "w") as f:
            json.dump([held(real, [o.optimizer for o in trainer.optimizers]
                            if hasattr(trainer.optimizers[0], "optimizer") else trainer.optimizers),
                       *[s["held"] for s in trainer.strategy._body.hosts.call("stats")]], f)
        # Built on meta and split: the most each process held while it built its stage, layer by layer.
        with open(os.path.join(out, f"built_replica{trainer.global_rank}.json"), "w") as f:
            json.dump([trainer.strategy._body.built, *[s["built"] for s in trainer.strategy._body.hosts.call("stats")]],
                      f)
        # Collectives left unwaited in this process so far (torch keeps each registered, its tensor alive).
        with open(os.path.join(out, f"unwaited_replica{trainer.global_rank}.json"), "w") as f:
            json.dump(torch._C._distributed_c10d._get_work_registry_size(), f)
    if isinstance(trainer.strategy, lightning_pipe.PipeStrategy):  # what each process's data plane carried
        plane = trainer.strategy._pipeline.runner.plane
        with open(os.path.join(out, f"plane_replica{trainer.global_rank}.json"), "w") as f:
            json.dump([None if plane is None else {"sent": plane.sent, "received": plane.received,
                                                    "links": plane.links},
                       *[s["plane"] for s in trainer.strategy._body.hosts.call("stats")]], f)
    if config["dump_replica_state"] and not plain:  # every stage's weights and buffers, as each replica has them
        torch.save(model.state_dict(), os.path.join(out, f"state_replica{trainer.global_rank}.pt"))
    if config["predict"] and not plain:  # the outputs, through the pipeline's forward in the schedule's processes
        predicted = torch.cat(trainer.predict(model, DataLoader(dataset, batch_size=config["batch_size"])))
        if trainer.is_global_zero:
            torch.save(predicted, os.path.join(out, "predicted.pt"))
    return model


def run_cases(cases: dict[str, dict[str, Any]], out: str) -> None:
    """Train several configs one after another in the same processes, ``OUT/<name>/`` each: one launch (each
    process imports Lightning once) for cases that need the same processes. ``resume`` may name a checkpoint
    relative to ``out`` (written by an earlier case). A case ``{"script": "phases"}`` runs phases.py's job,
    ``{"script": "hf", ...}`` trains a Hugging Face model's body (hf_train.py)."""
    for name, config in cases.items():
        print(f"[case {name}]", flush=True)
        os.makedirs(os.path.join(out, name), exist_ok=True)
        if config.get("script") == "phases":
            import phases

            phases.main(os.path.join(out, name))
            continue
        if config.get("script") == "hf":  # a Hugging Face model's body (hf_train.py)
            import hf_train

            hf_train.main(config, os.path.join(out, name))
            continue
        if config.get("resume") and not os.path.isabs(config["resume"]):
            config = {**config, "resume": os.path.join(out, config["resume"])}
        main(config, os.path.join(out, name))


if __name__ == "__main__":
    argument = json.loads(sys.argv[1])
    if "cases" in argument:
        run_cases(argument["cases"], sys.argv[2])
    else:
        main(argument, sys.argv[2])
