"""A Hugging Face causal language model named by its config, as the planner measures it (``python -m lightning_pipe
plan --hf CONFIG``): its body, a batch of tokens for it, and the model's tensor-parallel plan."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from lightning_pipe.models.adapters import body_tp_plan, to_sequential

__all__ = ["CausalLMBody"]


class CausalLMBody(nn.Module):
    """The body of ``AutoModelForCausalLM.from_config(config)`` (``config``: a name or folder for
    ``AutoConfig.from_pretrained``, or a dict with its ``model_type`` for ``AutoConfig.for_model``), with
    ``example_input_array`` a batch of ``rows`` x ``sequence`` token ids and their attention mask, and
    ``tensor_parallel_plan`` the model's own. Built with random weights: the planner needs sizes and times alone."""

    def __init__(self, config: str | dict[str, Any], rows: int = 8, sequence: int = 128) -> None:
        super().__init__()
        if isinstance(config, dict):
            settings = dict(config)
            made = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
        else:
            made = transformers.AutoConfig.from_pretrained(config)
        model = transformers.AutoModelForCausalLM.from_config(made)
        self.sequential_module = to_sequential(model)
        self.tensor_parallel_plan = body_tp_plan(model, self.sequential_module)
        ids = torch.randint(0, made.vocab_size, (rows, sequence), generator=torch.Generator().manual_seed(0))
        self.example_input_array = (ids, torch.ones_like(ids))
