"""What every layer of a body made from a Hugging Face model shares: its input, its masks, its names.

Between layers flows the tuple ``(hidden_states, attention_mask)``: every element a tensor with the batch on
dim 0, so that micro-batching splits it like any other pipeline value. ``attention_mask`` is the 2D padding mask
(1 = keep, 0 = padding, as in Hugging Face); each block builds the attention mask its attention implementation
wants (``eager``: an additive float mask, ``sdpa``: a boolean mask or none at all, ...) from it, per
micro-batch, with ``transformers``' own mask functions, as the Hugging Face model builds it once per batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import masking_utils

__all__ = ["HFLayer"]

#: What a block receives and passes on: the hidden states (batch, time, width) and the padding mask (batch, time).
Carried = tuple[Tensor, Tensor]


class HFLayer(nn.Module):
    """A layer of a body made by :func:`~lightning_pipe.models.to_sequential`: Hugging Face modules as children.

    ``hf_names`` maps each child's name to that module's qualified name in the Hugging Face model it came from
    (``{"wte": "transformer.wte"}``): :func:`~lightning_pipe.models.hf_state_dict` names the body's entries
    with it. :func:`~lightning_pipe.models.to_sequential` fills it in.
    """

    hf_names: dict[str, str]
    #: Where its weights come from when it is materialised: (the checkpoint's files, entry -> name there), set
    #: by :func:`~lightning_pipe.models.attach_pretrained`.
    pretrained: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.hf_names = {}

    @torch.no_grad()
    def after_materialize(self) -> None:
        """Called by ``materialize`` once this layer's tensors are real (in the process that holds it): where a
        checkpoint was attached, reads its own entries alone and copies them in, then computes the buffers no
        checkpoint holds. A tensor split over tensor ranks already (a ``DTensor``) reads its own shard alone."""
        if self.pretrained is None:
            return
        from lightning_pipe.models.state import init_buffers

        files, sources = self.pretrained
        own = self.state_dict(keep_vars=True)
        tensors = files.read_parts({key: (source, _local_index(own[key])) for key, source in sources.items()})
        for key, value in tensors.items():
            (own[key].to_local() if isinstance(own[key], DTensor) else own[key]).copy_(value)
        init_buffers(self)


def _local_index(t: Tensor) -> tuple[slice, ...] | None:
    """Where this process's shard of ``t`` lies in the whole tensor (one slice per dim), for a ``DTensor``; None
    for a plain tensor (it is whole)."""
    if not isinstance(t, DTensor):
        return None
    (chunk,) = t.__create_chunk_list__()
    return tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))


def token_inputs(inputs: Any, extra: str | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``input_ids``, ``(input_ids, attention_mask)`` or, where ``extra`` names a third input (BERT's
    ``token_type_ids``), ``(input_ids, attention_mask, extra)`` → the three, checked; a missing mask is all ones
    (no padding)."""
    accepted = "input_ids or (input_ids, attention_mask)" + (f" or (input_ids, attention_mask, {extra})" if extra
                                                              else "")
    if isinstance(inputs, Tensor):
        parts: tuple[Any, ...] = (inputs,)
    elif isinstance(inputs, (tuple, list)) and 1 <= len(inputs) <= (3 if extra else 2):
        parts = tuple(inputs)
    else:
        what = f"a {type(inputs).__name__} of {len(inputs)}" if isinstance(inputs, (tuple, list)) else \
            type(inputs).__name__
        raise TypeError(f"the body takes {accepted} (got: {what})")
    ids = parts[0]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"input_ids must be integer token ids of shape (batch, time) (got: {got})")
    mask = parts[1] if len(parts) > 1 else torch.ones_like(ids)
    third = parts[2] if len(parts) > 2 else None
    for name, t in (("attention_mask", mask), (extra, third)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != ids.shape):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must have the shape of input_ids (input_ids: {tuple(ids.shape)}, "
                             f"{name}: {got})")
    return ids, mask, third


def positions(hidden: Tensor) -> Tensor:
    """The position ids the Hugging Face models use when none are given: ``0 .. time - 1``, shape (1, time)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def attention_mask(config: Any, hidden: Tensor, padding: Tensor, kind: str, position_ids: Tensor | None = None
                   ) -> Any:
    """The attention mask of one micro-batch, as the Hugging Face model builds it for its attention
    implementation (``config._attn_implementation``): ``kind`` is ``"full_attention"`` (causal),
    ``"sliding_attention"`` (causal within ``config.sliding_window``) or ``"bidirectional"`` (an encoder's)."""
    if kind == "bidirectional":
        return masking_utils.create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=padding)
    make = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" else \
        masking_utils.create_causal_mask
    return make(config=config, inputs_embeds=hidden, attention_mask=padding, position_ids=position_ids,
                **{_CACHE: None})


# The mask functions' cache argument: ``cache`` since transformers 5.2x, ``past_key_values`` before.
_CACHE = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
