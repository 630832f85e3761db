"""A BERT encoder as an ``nn.Sequential`` body: embeddings → N transformer layers → mean pooling.

Each layer passes ``(hidden, attention_mask)`` on, so the mask reaches every layer through the pipeline
without a side channel. :func:`load_pretrained` reads Hugging Face-format weights (``model.safetensors``,
``config.json``) from a local directory into the body, with no network access.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_pipe import pure_backward_layer


@pure_backward_layer  # torch operations only: backward may run in two parts
class Embeddings(nn.Module):
    """Token ids and mask → (word + position + token-type embeddings, normalised; mask)."""

    def __init__(self, vocab: int, width: int, positions: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, width, padding_idx=0)
        self.position_embeddings = nn.Embedding(positions, width)
        self.token_type_embeddings = nn.Embedding(2, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)  # noqa: N815 - the checkpoint's name
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        ids, mask = inputs
        positions = torch.arange(ids.size(1), device=ids.device)
        hidden = self.word_embeddings(ids) + self.position_embeddings(positions) + \
            self.token_type_embeddings(torch.zeros_like(ids))
        return self.dropout(self.LayerNorm(hidden)), mask


@pure_backward_layer  # torch operations only: backward may run in two parts
class EncoderLayer(nn.Module):
    """One post-norm transformer layer: self-attention and a GELU feed-forward, each with a residual."""

    def __init__(self, width: int, heads: int, inner: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.attention_output = nn.Linear(width, width)
        self.attention_norm = nn.LayerNorm(width, eps=eps)
        self.intermediate = nn.Linear(width, inner)
        self.output = nn.Linear(inner, width)
        self.output_norm = nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, mask = inputs
        b, t, w = x.shape
        split = lambda y: y.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(w // self.heads)
        scores = scores.masked_fill(~mask[:, None, None, :].bool(), torch.finfo(scores.dtype).min)
        context = (self.dropout(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, w)
        x = self.attention_norm(x + self.dropout(self.attention_output(context)))
        y = self.output(nn.functional.gelu(self.intermediate(x)))
        return self.output_norm(x + self.dropout(y)), mask


@pure_backward_layer  # torch operations only: backward may run in two parts
class MeanPool(nn.Module):
    """(hidden, mask) → the mean of the unmasked tokens' hidden states (sentence-transformers pooling)."""

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        hidden, mask = inputs
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def encoder(config: dict, dropout: float | None = None) -> nn.Sequential:
    """The body for a BERT ``config.json``: embeddings, ``num_hidden_layers`` layers, mean pooling."""
    p = config["hidden_dropout_prob"] if dropout is None else dropout
    eps = config["layer_norm_eps"]
    width = config["hidden_size"]
    layers: list[nn.Module] = [Embeddings(config["vocab_size"], width, config["max_position_embeddings"], eps, p)]
    layers += [EncoderLayer(width, config["num_attention_heads"], config["intermediate_size"], eps, p)
               for _ in range(config["num_hidden_layers"])]
    return nn.Sequential(*layers, MeanPool())


def load_pretrained(body: nn.Sequential, directory: str | Path) -> None:
    """Load a Hugging Face BERT checkpoint (``model.safetensors``) into ``body`` made by :func:`encoder`."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(directory) / "model.safetensors"))
    names = {
        "attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
        "attention.output.dense": "attention_output", "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm",
    }
    state: dict[str, Tensor] = {}
    for key, value in weights.items():
        if key.startswith("embeddings.") and "position_ids" not in key:
            state["0." + key[len("embeddings."):]] = value
        elif key.startswith("encoder.layer."):
            index, rest = key[len("encoder.layer."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            state[f"{int(index) + 1}.{names[module]}.{kind}"] = value
    missing, unexpected = body.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory} does not fit this encoder (missing: {missing}, unexpected: {unexpected})")


def read_config(directory: str | Path) -> dict:
    """The ``config.json`` of a checkpoint directory."""
    return json.loads((Path(directory) / "config.json").read_text())
