"""BERT (``BertModel``) as layers: embeddings → one layer per encoder layer → the last hidden state.

::

    input_ids[, attention_mask[, token_type_ids]] ─► BertEmbeddingsLayer ─► (hidden, mask) ─► BertBlock × n
                                                      embeddings                              encoder.layer[i]
                                                 ─► LastHiddenState ─► last_hidden_state (batch, time, width)

Each block builds its micro-batch's bidirectional mask (causal where ``config.is_decoder``) as ``BertModel``
does. The pooler is not part of the body (``last_hidden_state`` is the model's main output): a body that pools
replaces the last layer, which receives ``(hidden, mask)``, with its own pooling (``body[-1] = MeanPool()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.backward_split import pure_backward_layer
from lightning_pipe.models.layers import Carried, HFLayer, attention_mask, positions, token_inputs

__all__: list[str] = []


@pure_backward_layer  # Hugging Face's modules: torch operations only
class BertEmbeddingsLayer(HFLayer):
    """``input_ids[, attention_mask[, token_type_ids]]`` → (word + position + token-type embeddings, normalised,
    after dropout; the padding mask)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, inputs: Any) -> Carried:
        ids, mask, token_type_ids = token_inputs(inputs, extra="token_type_ids")
        # The ids BertEmbeddings would take from its buffers, made afresh: a graph that saved a buffer (an
        # embedding's backward keeps its indices) would fail if the buffer were written meanwhile (the pipeline
        # restores buffers after recomputing a micro-batch).
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        hidden = self.embeddings(input_ids=ids, token_type_ids=token_type_ids, position_ids=positions(ids))
        return hidden, mask


@pure_backward_layer  # Hugging Face's modules: torch operations only
class BertBlock(HFLayer):
    """One ``BertLayer``, with the attention mask of its micro-batch built for it."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer, self.config = layer, config

    def forward(self, inputs: Carried) -> Carried:
        hidden, mask = inputs
        kind = "full_attention" if self.config.is_decoder else "bidirectional"
        return self.layer(hidden, attention_mask=attention_mask(self.config, hidden, mask, kind)), mask


class LastHiddenState(HFLayer):
    """(hidden, mask) → hidden: the encoder's ``last_hidden_state``."""

    def forward(self, inputs: Carried) -> Tensor:
        return inputs[0]


pure_backward_layer(LastHiddenState)


def bert_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``BertModel`` (last hidden state)."""
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("to_sequential takes BERT without cross-attention (config.add_cross_attention: True): "
                         "the body's layers receive no encoder states")
    return [BertEmbeddingsLayer(model.embeddings), *[BertBlock(layer, config) for layer in model.encoder.layer],
            LastHiddenState()]
