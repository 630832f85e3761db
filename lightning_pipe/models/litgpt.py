"""LitGPT's ``GPT`` (``litgpt.GPT(config)``: Pythia, Llama, Gemma, ... as LitGPT builds them) as layers.

::

    input_ids ─► LitGPTEmbeddings ─► hidden ─► LitGPTBlock × n ─► LitGPTHead ─► logits
                 transformer.wte               transformer.h[i]    transformer.ln_f, lm_head

LitGPT's ``GPT.forward`` slices its rotary tables (the ``cos`` and ``sin`` buffers it builds for
``max_seq_length`` positions) once per batch and hands them to every block, each block's attention masking
causally by itself (or within ``config.sliding_window_size`` in the layers ``sliding_window_indices`` marks).
Here each ``LitGPTBlock`` builds the tables of its own micro-batch's length with LitGPT's own ``rope_cache``, so
no stage holds the model's buffers nor another stage's, and a body built on ``meta`` has no buffer to compute
when it is materialised. They are cast to the block's parameters' dtype, as ``GPT.to(dtype)`` casts the
model's. LitGPT's forward takes no padding mask, so neither does the body: only ``hidden`` crosses stages.

LitGPT's subclasses of ``GPT`` (``litgpt.lora.GPT``, ``litgpt.adapter.GPT``) share its forward and its names,
and take the same adapter. The state keeps LitGPT's names (``transformer.h.0.attn.qkv.weight``): what the body
saves is a ``lit_model.pth`` state dict, and LitGPT's checkpoints load into it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.backward_split import pure_backward_layer
from lightning_pipe.models.layers import HFLayer, token_inputs

__all__: list[str] = []

#: The qualified name of LitGPT's model class, by which the adapter is registered (``GPT`` alone is too common).
LITGPT_GPT = "litgpt.model.GPT"


def is_litgpt_gpt(cls: Any) -> bool:
    """Whether ``cls`` is LitGPT's ``GPT`` or a subclass of it (told by module and name: no import of LitGPT)."""
    return any(f"{c.__module__}.{c.__qualname__}" == LITGPT_GPT for c in getattr(cls, "__mro__", ()))


def litgpt_ids(inputs: Any, max_seq_length: int) -> Tensor:
    """``input_ids`` (batch, time), checked: LitGPT's GPT takes no attention mask, and at most
    ``max_seq_length`` positions."""
    if isinstance(inputs, (tuple, list)):
        raise TypeError(f"the body of LitGPT's GPT takes input_ids alone (got: a {type(inputs).__name__} of "
                        f"{len(inputs)}): GPT.forward has no attention mask, every token attends to all earlier ones; "
                        "pad on the right and leave the padding out of the loss (ignore_index)")
    ids, _, _ = token_inputs(inputs)
    if ids.shape[1] > max_seq_length:
        raise ValueError(f"the sequences are longer than the model's max_seq_length (time: {ids.shape[1]}, "
                         f"max_seq_length: {max_seq_length}): shorten them, or set model.max_seq_length (at most "
                         "config.block_size) before to_sequential")
    return ids


@pure_backward_layer  # LitGPT's modules: torch operations only
class LitGPTEmbeddings(HFLayer):
    """``input_ids`` → the token embeddings (scaled by ``sqrt(n_embd)`` where ``config.scale_embeddings``)."""

    def __init__(self, wte: nn.Embedding, config: Any, max_seq_length: int) -> None:
        super().__init__()
        self.wte, self.config, self.max_seq_length = wte, config, max_seq_length

    def forward(self, inputs: Any) -> Tensor:
        hidden = self.wte(litgpt_ids(inputs, self.max_seq_length))
        if self.config.scale_embeddings:
            hidden = hidden * torch.tensor(self.config.n_embd ** 0.5, dtype=hidden.dtype)
        return hidden


def rope_tables(config: Any, time: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """LitGPT's rotary tables (``cos``, ``sin``) for positions ``0 .. time - 1``: the first ``time`` rows of the
    model's ``cos`` and ``sin`` buffers, computed by ``GPT.rope_cache`` (its rope scalings read from ``config``),
    which reads nothing of the model but ``config`` and ``max_seq_length``."""
    from litgpt.model import GPT

    cos, sin = GPT.rope_cache(SimpleNamespace(config=config, max_seq_length=time), device=device)  # type: ignore
    return cos.to(dtype), sin.to(dtype)


@pure_backward_layer  # LitGPT's modules: torch operations only
class LitGPTBlock(HFLayer):
    """One LitGPT ``Block``, with the rotary tables of its micro-batch built for it (``index``: its place in
    ``transformer.h``, which picks its tables where ``config.rope_indices`` gives layers local ones)."""

    def __init__(self, block: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self.block, self.config, self.index = block, config, index

    def forward(self, hidden: Tensor) -> Tensor:
        weight = next((p for p in self.block.parameters() if p.is_floating_point()), hidden)
        cos, sin = rope_tables(self.config, hidden.shape[1], hidden.device, weight.dtype)
        if self.config.rope_indices is not None:
            cos, sin = cos[..., self.config.rope_indices[self.index]], sin[..., self.config.rope_indices[self.index]]
        return self.block(hidden, cos.unsqueeze(0), sin.unsqueeze(0))  # no mask: causal, as GPT.forward's


@pure_backward_layer  # LitGPT's modules: torch operations only
class LitGPTHead(HFLayer):
    """The final ``ln_f``, then ``lm_head`` (soft-capped where ``config.final_logit_softcapping``): hidden →
    logits."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module, config: Any) -> None:
        super().__init__()
        self.ln_f, self.lm_head, self.config = ln_f, lm_head, config

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(self.ln_f(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def litgpt_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``litgpt.GPT`` (or a subclass: LitGPT's LoRA and adapter models), returning its logits."""
    cached = [i for i, block in enumerate(model.transformer.h) if getattr(block.attn, "kv_cache", None) is not None]
    if cached:
        raise ValueError(f"{type(model).__name__} has a key/value cache set (set_kv_cache; blocks: {cached[:5]}), "
                         "which the body never uses but every stage would hold: call model.clear_kv_cache() before "
                         "to_sequential")
    for module in model.modules():  # LoRA's dropout at 0 (LitGPT's default) is a lambda: no stage's process takes it
        dropout = getattr(module, "lora_dropout", None)
        if callable(dropout) and not isinstance(dropout, nn.Module):
            module.lora_dropout = nn.Identity()
    config = model.config
    return [LitGPTEmbeddings(model.transformer.wte, config, model.max_seq_length),
            *[LitGPTBlock(block, config, i) for i, block in enumerate(model.transformer.h)],
            LitGPTHead(model.transformer.ln_f, model.lm_head, config)]
