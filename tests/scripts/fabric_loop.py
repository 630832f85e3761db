"""A Fabric training loop written as Fabric's docs write it, for the tests of PipeStrategy under Fabric.

    python fabric_loop.py '{"cases": {"NAME": {"balance": [3, 2], ...}, ...}, "devices": 2}' OUT_DIR

trains each case through ``lightning_pipe.PipeStrategy``, one after another in the same processes (each its own
Fabric and pipeline: only the first launches processes, the stage workers serve every case), and writes
``OUT_DIR/NAME/final.pt`` (``fabric.save``) and, from the main process, ``OUT_DIR/NAME/result.json``. :func:`run`
is the same loop for any Fabric: the tests run it on one device in their own process, as the reference.
``"package": "lightning_fabric"`` runs the job against the standalone package.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if (__name__ == "__main__" and json.loads(sys.argv[1]).get("package") == "lightning_fabric"
        and not globals().get("_REWRITTEN")):  # the same source against the standalone package
    from pathlib import Path

    _REWRITTEN = True
    source = Path(__file__).read_text().replace("import lightning as L", "import lightning_fabric as L")
    exec(compile(source, __file__, "exec"), globals())  # noqa: S102
    raise SystemExit(0)

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_pipe

DEFAULTS: dict[str, Any] = {
    "devices": 2, "balance": [3, 2], "microbatches": 4, "schedule": "gpipe", "last_stage_loss": False,
    "optimizer": "sgd", "clip": None, "clip_value": None, "accumulate": 1, "scheduler": None, "model": "sequential",
    "precision": "32-true", "build": "eager", "samples": 64, "batch_size": 8, "epochs": 1, "seed": 7,
    "load": None, "launch_fn": False, "collectives": False, "package": "lightning", "init_scale": 2.0 ** 4,
    "sharding": "NO_SHARD", "virtual_stages": 1, "state_dict_type": "full", "nodes": 1, "tensor_parallel_size": 1,
    "start_method": "popen", "own_state": False, "load_own": None, "load_with": "load_state_dict",
    "shard_by_rank": False, "checkpoint_io": None, "save_filter": False, "trainer_module": None,
    "checkpoint": "except_last", "memory_per_device": None,
}


class CustomIO(L.plugins.TorchCheckpointIO if L.__name__ == "lightning_fabric" else L.fabric.plugins.TorchCheckpointIO):
    """A ``CheckpointIO`` of the user's: it takes the whole checkpoint in hand (nothing streamed)."""


def keep_weights(key: str, value: Any) -> bool:
    """``fabric.save``'s filter of ``"save_filter"``: the module's weights alone."""
    return key.endswith("weight")


def fabric_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """Fabric's precision and plugin arguments: ``"16-mixed-scaler"`` is fp16 with a gradient scaler, as on GPUs,
    here on CPU (``init_scale`` small enough that steps are taken, ``growth_interval`` short enough that the scale
    moves); ``"checkpoint_io": "custom"`` a :class:`CustomIO`."""
    plugins: list[Any] = [CustomIO()] if config["checkpoint_io"] == "custom" else []
    if config["precision"] != "16-mixed-scaler":
        return {"precision": config["precision"], "plugins": plugins}
    from lightning.fabric.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=config["init_scale"], growth_interval=2)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler), *plugins]}


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss (module-level: it runs on the last stage under ``loss_on_last_stage``)."""
    return nn.functional.mse_loss(output.float(), target)


def body() -> nn.Sequential:
    """The scenarios' body."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class WithHead(nn.Module):
    """A body under ``sequential_module`` and a head outside it (stage 0's process keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = body()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sequential_module(x))


#: ``"model": "litgpt"``: a tiny Llama-like LitGPT ``GPT`` (no download) as a body (``to_sequential``), and
#: ``"litgpt-plain"`` the ``GPT`` itself, the one-device reference (LitGPT's own forward and names).
LITGPT = {"block_size": 16, "vocab_size": 50, "padding_multiple": 8, "n_layer": 4, "n_head": 4, "n_embd": 32,
          "n_query_groups": 2, "rotary_percentage": 1.0, "parallel_residual": False, "bias": False,
          "norm_class_name": "RMSNorm", "norm_eps": 1e-5, "mlp_class_name": "LLaMAMLP", "intermediate_size": 48}
TOKENS = 12  # per sample


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (module-level: it runs on the last stage under ``loss_on_last_stage``)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def model(config: dict[str, Any]) -> nn.Module:
    """The model of ``config``, seeded (``"trainer_module"``: tests/scripts/train.py's LightningModule of that
    config, built as its Trainer runs build it)."""
    if config["trainer_module"] is not None:
        import train

        return train.Model(config["trainer_module"])
    torch.manual_seed(config["seed"])
    if config["model"] in ("litgpt", "litgpt-plain"):
        import litgpt

        from lightning_pipe.models import to_sequential

        gpt = litgpt.GPT(litgpt.Config(name="tiny-llama", **LITGPT))
        return gpt if config["model"] == "litgpt-plain" else to_sequential(gpt)
    made = body() if config["model"] == "sequential" else WithHead()
    made.example_input_array = torch.zeros(config["batch_size"], 8)  # what the planner measures ("auto")
    return made


def data(config: dict[str, Any]) -> TensorDataset:
    """Regression samples (token ids and their next tokens for LitGPT), the same everywhere."""
    g = torch.Generator().manual_seed(123)
    if config["model"].startswith("litgpt"):
        tokens = torch.randint(0, LITGPT["vocab_size"], (config["samples"], TOKENS + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    x = torch.randn(config["samples"], 8, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(config["samples"], 4, generator=g))


def optimizer_of(config: dict[str, Any], module: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW with weight decay on the weights only (groups built from names); a LightningModule's
    own (``configure_optimizers``) for ``"trainer_module"``."""
    if config["trainer_module"] is not None:
        configured = module.configure_optimizers()
        return configured["optimizer"] if isinstance(configured, dict) else configured
    if config["optimizer"] == "adamw":
        decay = [p for n, p in module.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in module.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01)
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)


def train(fabric: Any, config: dict[str, Any], net: Any, optimizer: Any, scheduler: Any, loader: Any,
          state: dict[str, Any], body_of: Any, loss_fn: Any) -> None:
    """The epochs of :func:`run`'s loop."""
    for _ in range(config["epochs"]):
        for k, (x, y) in enumerate(loader):
            accumulating = (k + 1) % config["accumulate"] != 0
            with fabric.no_backward_sync(net, enabled=accumulating):
                if config["last_stage_loss"]:
                    loss = lightning_pipe.loss_on_last_stage(body_of, x, y, loss_fn)
                else:
                    loss = loss_fn(net(x), y)
                fabric.backward(loss / config["accumulate"])
            if accumulating:
                continue
            if config["clip"] is not None:
                fabric.clip_gradients(net, optimizer, max_norm=config["clip"])
            if config["clip_value"] is not None:
                fabric.clip_gradients(net, optimizer, clip_val=config["clip_value"])
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            state["step"] += 1


def run(fabric: Any, config: dict[str, Any], out: str) -> dict[str, Any]:
    """The loop: setup, the optimizer and scheduler, batches from ``setup_dataloaders``, the loss on the last stage
    or on the output, ``fabric.backward`` under ``no_backward_sync`` while accumulating, clipping, ``step``,
    ``zero_grad``; ``fabric.load`` of an earlier run first, ``fabric.save`` at the end."""
    config = {**DEFAULTS, **config}
    fabric.seed_everything(config["seed"])
    if config["build"] == "init_module":
        with fabric.init_module():
            net = model(config)
    else:
        net = model(config)
    optimizer = optimizer_of(config, net)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if config["scheduler"] else None
    net, optimizer = fabric.setup(net, optimizer)
    if config["shard_by_rank"]:  # sharded by hand by process, as scripts for Fabric's own strategies often do
        dataset = data(config)
        mine = Subset(dataset, range(fabric.global_rank, len(dataset), fabric.world_size))
        loader = fabric.setup_dataloaders(DataLoader(mine, batch_size=config["batch_size"]),
                                          use_distributed_sampler=False)
    else:
        loader = fabric.setup_dataloaders(DataLoader(data(config), batch_size=config["batch_size"]))
    state: dict[str, Any] = {"model": net, "optimizer": optimizer, "step": 0}
    if scheduler is not None:
        state["scheduler"] = scheduler
    if config["load"]:  # (a Trainer's directory holds no "step": not strict)
        fabric.load(config["load"], state, strict=config["trainer_module"] is None)
    if config["load_own"]:  # the loop's own files of an earlier run (own_state), by the module's and optimizer's own
        model_file, optimizer_file = (os.path.join(config["load_own"], f"own-{what}-0.pt")
                                      for what in ("model", "optimizer"))
        if config["load_with"] == "load_raw":
            fabric.load_raw(model_file, net)
            fabric.load_raw(optimizer_file, optimizer)
        else:
            net.load_state_dict(torch.load(model_file, weights_only=True))
            optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
    body_of = net.sequential_module if config["model"] == "module" else net
    loss_fn = lm_loss if config["model"].startswith("litgpt") else mse
    try:
        train(fabric, config, net, optimizer, scheduler, loader, state, body_of, loss_fn)
    except RuntimeError as exc:
        if not config["shard_by_rank"]:
            raise
        return {"error": str(exc)}  # refused (tensor ranks that received different inputs)
    fabric.save(os.path.join(out, "final.pt"), state, filter={"model": keep_weights} if config["save_filter"] else None)
    own_error = None
    if config["own_state"]:  # the script's own calls, as many end (an EMA, an evaluation, torch.save of them)
        try:
            own = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
        except RuntimeError as exc:  # where no process holds the whole (split or sharded stages): refused
            own_error = str(exc)
        else:
            for what, value in own.items():
                torch.save(value, os.path.join(out, f"own-{what}-{fabric.global_rank}.pt"))
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    if scaler is not None:
        state["scale"] = float(scaler.get_scale())
    result: dict[str, Any] = {"step": state["step"], "world_size": fabric.world_size,
                              "global_rank": fabric.global_rank, "lr": optimizer.param_groups[0]["lr"],
                              "own_state_error": own_error}
    if config["collectives"]:  # among the drivers, as under any strategy: one per replica
        result["all_reduce"] = float(fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum"))
        result["all_reduce_ones"] = float(fabric.all_reduce(torch.tensor(1.0), reduce_op="sum"))
        result["all_gathered"] = len(fabric.all_gather(torch.tensor(1.0)).reshape(-1))
        result["broadcast"] = fabric.broadcast(f"from {fabric.global_rank}", src=0)
        fabric.barrier()
    return result


def main(config: dict[str, Any], out: str) -> None:
    """Run the loop of ``config`` through PipeStrategy (the first case launches the processes)."""
    config = {**DEFAULTS, **config}
    strategy = lightning_pipe.PipeStrategy(balance=config["balance"], microbatches=config["microbatches"],
                                           schedule=config["schedule"], rpc_timeout_sec=60,
                                           checkpoint=config["checkpoint"],
                                           memory_per_device=config["memory_per_device"],
                                           sharding_strategy=config["sharding"],
                                           virtual_stages=config["virtual_stages"],
                                           state_dict_type=config["state_dict_type"],
                                           tensor_parallel_size=config["tensor_parallel_size"],
                                           start_method=config["start_method"],
                                           tensor_parallel_plan={"0": "colwise", "2": "rowwise", "4": "colwise_rep"}
                                           if config["tensor_parallel_size"] > 1 else None)
    fabric = L.Fabric(accelerator="cpu", devices=config["devices"], num_nodes=config["nodes"], strategy=strategy,
                      **fabric_arguments(config))
    os.makedirs(out, exist_ok=True)

    def loop(fabric: Any) -> dict[str, Any]:
        return run(fabric, config, out)

    if config["launch_fn"]:
        result = fabric.launch(loop)
    else:
        fabric.launch()
        result = loop(fabric)
    result["strategy"] = f"{type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}"
    chosen = fabric.strategy
    result["layout"] = {"balance": chosen.balance, "microbatches": chosen.microbatches, "schedule": chosen.schedule,
                        "checkpoint": chosen.checkpoint, "sharding": chosen.sharding_strategy,
                        "predicted": getattr(chosen, "_predicted", None)}
    if getattr(chosen, "_predicted", None):
        result["held"] = [q["peak"] - q["base"] for q in chosen.memory_per_process()]
    if fabric.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    for name, case in job["cases"].items():
        print(f"[case {name}]", flush=True)
        main({**case, "devices": job.get("devices", 2)}, os.path.join(sys.argv[2], name))
