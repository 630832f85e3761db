"""PEFT adapters (LoRA and the rest of ``peft``'s) on a pipeline body: checkpoints without the frozen base, and the
adapters written in PEFT's own format.

A PEFT model adapts its base in place, so ``to_sequential(peft_model.base_model.model)`` is a body whose layers hold
the adapters beside the frozen base; it trains through ``PipeStrategy`` as any body, the replicas averaging (or
sharding) what trains. What this module adds is what fine-tuning does with the result::

    class LoRA(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.peft_model = None                     # (not registered: the body holds its modules)
            peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(...))
            self.sequential_module = to_sequential(peft_model.base_model.model)
            self.__dict__["peft_model"] = peft_model   # kept for save_adapters, out of the module tree
            self.strict_loading = False                # checkpoints leave the frozen base out
        def on_save_checkpoint(self, checkpoint):
            drop_frozen(checkpoint, self)              # the base stays in its pretrained files

    trainer.fit(model, data)
    save_adapters(trainer, model.peft_model, "adapter/")   # adapter_model.safetensors + adapter_config.json
    # anywhere, no strategy: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), "adapter/")
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.models.state import hf_key_map

__all__ = ["drop_frozen", "save_adapters"]


def drop_frozen(checkpoint: dict[str, Any], module: nn.Module) -> list[str]:
    """Leave ``module``'s frozen parameters (``requires_grad=False``: a base under adapters) out of
    ``checkpoint["state_dict"]``, in ``on_save_checkpoint``; buffers and trainable parameters stay. Returns the names
    left out. Loading such a checkpoint (resuming included) needs ``module.strict_loading = False``, the base
    built from its own files as before the first fit."""
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    state = checkpoint["state_dict"]
    for name in frozen:
        state.pop(name, None)
    return frozen


def _peft_state(state: Mapping[str, Tensor], peft_model: Any, module_name: str, adapter_name: str
                ) -> dict[str, Tensor]:
    """The adapters' entries of a pipelined LightningModule's ``state`` (its body behind ``module_name``) under
    PEFT's names, as ``get_peft_model_state_dict`` gives them."""
    from peft import get_peft_model_state_dict

    from lightning_pipe.models.adapters import to_sequential

    base = peft_model.base_model.model
    mapping = hf_key_map(to_sequential(base))  # body entry -> the adapted model's name (the body holds its modules)
    prefix = f"{module_name}."
    named = {f"base_model.model.{hf}": state[prefix + key] for key, hf in mapping.items() if prefix + key in state}
    if not named:
        raise ValueError(f"the checkpoint holds no entry of a body named {module_name!r} (its entries: "
                         f"{list(state)[:5]} ...): pass module_name, the LightningModule's attribute of the body")
    adapters = get_peft_model_state_dict(peft_model, state_dict=named, adapter_name=adapter_name)
    if not adapters:
        raise ValueError(f"the checkpoint holds none of adapter {adapter_name!r}'s entries: was the body made from "
                         "this PEFT model (to_sequential(peft_model.base_model.model))?")
    return {k: v.detach().to("cpu").contiguous() for k, v in adapters.items()}


def save_adapters(source: Any, peft_model: Any, directory: str, module_name: str = "sequential_module",
                  adapter_name: str = "default") -> None:
    """Write the adapters of ``peft_model`` as trained through the pipeline in PEFT's own format
    (``adapter_model.safetensors`` and ``adapter_config.json``, what ``peft_model.save_pretrained`` writes), which
    ``PeftModel.from_pretrained(base, directory)`` loads into the plain model.

    ``source`` is a checkpoint file the pipeline wrote (a sharded directory is consolidated first: ``python -m
    lightning_pipe consolidate DIR FILE``), or a ``Trainer`` fitted with ``PipeStrategy``: then call it on every
    process, as ``trainer.save_checkpoint`` (it gathers every stage's adapters through a full checkpoint, from
    wherever they are sharded), and the main process writes. ``peft_model`` is the ``PeftModel`` whose base the body
    was made from (for its config and names)."""
    from safetensors.torch import save_file

    if hasattr(source, "save_checkpoint") and hasattr(source, "strategy"):  # a Trainer: through a checkpoint
        trainer, strategy = source, source.strategy
        staging = strategy.broadcast(tempfile.mkdtemp(prefix="lightning_pipe-adapters-")
                                     if trainer.is_global_zero else None)
        kind = getattr(strategy, "state_dict_type", "full")
        try:
            path = os.path.join(staging, "adapters.ckpt")
            if kind != "full":
                strategy.state_dict_type = "full"  # one file, every stage's entries gathered into it
            trainer.save_checkpoint(path)
            if trainer.is_global_zero:
                save_adapters(path, peft_model, directory, module_name, adapter_name)
            strategy.barrier("save_adapters")
        finally:
            if kind != "full":
                strategy.state_dict_type = kind
            if trainer.is_global_zero:
                shutil.rmtree(staging, ignore_errors=True)
        return
    path = str(source)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a sharded checkpoint (a directory): consolidate it into one file first "
                         f"(python -m lightning_pipe consolidate {path} FILE), then pass FILE")
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    adapters = _peft_state(state, peft_model, module_name, adapter_name)
    os.makedirs(directory, exist_ok=True)
    save_file(adapters, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config[adapter_name].save_pretrained(directory)
