"""GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) as layers: embeddings → one layer per block → final norm and head.

::

    input_ids[, attention_mask] ─► GPT2Embeddings ─► (hidden, mask) ─► GPT2Block × n ─► GPT2Head ─► logits
                                   wte + wpe, drop                      h[i]               ln_f, lm_head

The head's ``lm_head`` is the model's own: its weight is the embedding's ``wte.weight`` (one ``Parameter``)
unless the config unties them (``tie_word_embeddings=False``). ``GPT2Model`` ends in ``ln_f`` alone and returns
``last_hidden_state``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_pipe.engine.backward_split import pure_backward_layer
from lightning_pipe.models.layers import Carried, HFLayer, attention_mask, positions, token_inputs

__all__: list[str] = []


@pure_backward_layer  # Hugging Face's modules: torch operations only
class GPT2Embeddings(HFLayer):
    """``input_ids[, attention_mask]`` → (token + position embeddings, after dropout; the padding mask)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, inputs: Any) -> Carried:
        ids, mask, _ = token_inputs(inputs)
        hidden = self.wte(ids)
        return self.drop(hidden + self.wpe(positions(hidden))), mask


@pure_backward_layer  # Hugging Face's modules: torch operations only
class GPT2Block(HFLayer):
    """One ``GPT2Block``, with the causal mask of its micro-batch built for it."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block, self.config = block, config

    def forward(self, inputs: Carried) -> Carried:
        hidden, mask = inputs
        causal = attention_mask(self.config, hidden, mask, "full_attention", positions(hidden))
        return self.block(hidden, attention_mask=causal), mask


@pure_backward_layer  # Hugging Face's modules: torch operations only
class GPT2Head(HFLayer):
    """The final ``ln_f``, then ``lm_head`` where the model has one: (hidden, mask) → logits or hidden states."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module | None) -> None:
        super().__init__()
        self.ln_f = ln_f
        self.lm_head = lm_head

    def forward(self, inputs: Carried) -> Tensor:
        hidden = self.ln_f(inputs[0])
        return hidden if self.lm_head is None else self.lm_head(hidden)


def gpt2_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``GPT2LMHeadModel`` (logits) or ``GPT2Model`` (last hidden state)."""
    transformer = getattr(model, "transformer", model)
    config = transformer.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("to_sequential takes GPT-2 without cross-attention (config.add_cross_attention: True): "
                         "the body's blocks receive no encoder states")
    return [GPT2Embeddings(transformer.wte, transformer.wpe, transformer.drop),
            *[GPT2Block(block, config) for block in transformer.h],
            GPT2Head(transformer.ln_f, getattr(model, "lm_head", None))]
