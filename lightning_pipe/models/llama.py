"""The Llama family (Llama, Mistral, Qwen2: RMSNorm, rotary positions, grouped-query attention) as layers.

::

    input_ids[, attention_mask] ─► DecoderEmbeddings ─► (hidden, mask) ─► DecoderLayer × n ─► DecoderHead ─► logits
                                   embed_tokens                           layers[i], rotary_emb   norm, lm_head

Each ``DecoderLayer`` computes the rotary tables of its micro-batch with a copy of the model's ``rotary_emb`` (its
own: a buffer of inverse frequencies that no state_dict holds) and builds its mask as the model does for that
layer: causal, or causal within ``config.sliding_window`` for Mistral's layers and Qwen2's
``"sliding_attention"`` layers (``config.layer_types``). Grouped-query attention is the attention module's own.
The head's ``lm_head`` is the model's: tied to ``embed_tokens`` (one ``Parameter``) where
``config.tie_word_embeddings`` ties them. A base model (``LlamaModel``, ...) ends in ``norm`` and returns
``last_hidden_state``.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from lightning_pipe.engine.backward_split import pure_backward_layer
from lightning_pipe.models.layers import Carried, HFLayer, attention_mask, positions, token_inputs

__all__: list[str] = []


@pure_backward_layer  # Hugging Face's modules: torch operations only
class DecoderEmbeddings(HFLayer):
    """``input_ids[, attention_mask]`` → (token embeddings; the padding mask)."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: Any) -> Carried:
        ids, mask, _ = token_inputs(inputs)
        return self.embed_tokens(ids), mask


def mask_kind(config: Any, index: int) -> str:
    """Which mask decoder layer ``index`` attends with: ``config.layer_types[index]`` where the config lists
    them (Qwen2), else sliding where ``config.sliding_window`` is set (Mistral), else full (Llama)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


@pure_backward_layer  # Hugging Face's modules: torch operations only
class DecoderLayer(HFLayer):
    """One decoder layer, with its micro-batch's rotary tables and attention mask built for it."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, kind: str) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.config, self.kind = layer, rotary_emb, config, kind

    def forward(self, inputs: Carried) -> Carried:
        hidden, mask = inputs
        position_ids = positions(hidden)
        causal = attention_mask(self.config, hidden, mask, self.kind, position_ids)
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        return self.layer(hidden, attention_mask=causal, position_embeddings=rotary, position_ids=position_ids), mask


@pure_backward_layer  # Hugging Face's modules: torch operations only
class DecoderHead(HFLayer):
    """The final ``norm``, then ``lm_head`` where the model has one: (hidden, mask) → logits or hidden states."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module | None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, inputs: Carried) -> Tensor:
        hidden = self.norm(inputs[0])
        return hidden if self.lm_head is None else self.lm_head(hidden)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``*ForCausalLM`` of the Llama family (logits) or of its base model (last hidden state).

    Each layer gets its own copy of ``rotary_emb`` (a buffer, no weights): a module shared by layers of
    different stages would be one stage's, or a placeholder, in the others."""
    base = getattr(model, "model", model)
    config = base.config
    n = config.num_hidden_layers
    rotary = [copy.deepcopy(base.rotary_emb, {id(config): config}) for _ in range(n)]
    return [DecoderEmbeddings(base.embed_tokens),
            *[DecoderLayer(layer, rotary[i], config, mask_kind(config, i)) for i, layer in enumerate(base.layers[:n])],
            DecoderHead(base.norm, getattr(model, "lm_head", None))]
