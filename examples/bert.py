"""A pretrained BERT encoder as an ``nn.Sequential`` body: ``lightning_pipe.models.to_sequential`` and mean pooling.

:func:`encoder` builds the ``BertModel`` of a Hugging Face checkpoint directory (``config.json``,
``model.safetensors``) on the ``meta`` device, turns it into a body (embeddings → one layer per encoder layer),
allocates it and loads the weights by the model's names (no network access), and ends it in the mean of the
unmasked tokens' hidden states (sentence-transformers pooling) instead of ``last_hidden_state``: the layers pass
``(hidden, attention_mask)`` on, so the pooling layer receives the mask too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_pipe import pure_backward_layer


@pure_backward_layer  # torch operations only: backward may run in two parts
class MeanPool(nn.Module):
    """(hidden, mask) → the mean of the unmasked tokens' hidden states (sentence-transformers pooling)."""

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        hidden, mask = inputs
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def encoder(directory: str | Path, dropout: float | None = None) -> nn.Sequential:
    """The pretrained BERT of ``directory`` as a body: embeddings, one layer per encoder layer, mean pooling.
    ``dropout`` replaces the checkpoint's dropout probabilities (hidden states and attention) where given."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    from lightning_pipe.models import init_buffers, load_hf_state_dict, to_sequential

    overrides = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    config = BertConfig.from_pretrained(str(directory), **overrides)
    with torch.device("meta"):  # no weights allocated until the checkpoint's are loaded
        body = to_sequential(BertModel(config, add_pooling_layer=False))
    body.to_empty(device="cpu")
    unused = load_hf_state_dict(body, load_file(str(Path(directory) / "model.safetensors")))
    init_buffers(body)
    if any(not k.startswith("pooler.") and not k.endswith("position_ids") for k in unused):
        raise ValueError(f"{directory} holds weights this encoder does not use ({unused}): is it a BertModel?")
    body[-1] = MeanPool()  # instead of the last hidden state: it receives (hidden, attention_mask)
    return body.train()
