"""A body's state by the Hugging Face model's names, both ways, and the buffers no state_dict holds.

The body's entries are named by layer (``"3.block.attn.c_attn.weight"``); each layer's ``hf_names`` gives the
model's name of each of its children (``"transformer.h.2"``), so an entry maps to the model's
(``"transformer.h.2.attn.c_attn.weight"``). A checkpoint of the body, from one process or from every stage
of a pipeline, is thereby the model's ``state_dict`` (``save_pretrained``, ``from_pretrained``), and the
model's weights load into the body. An embedding tied to the head is one entry under each of its names, as in
the model's own ``state_dict``; where a file holds only one of them (``save_pretrained`` drops the tied one),
loading fills the other from it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

__all__ = ["hf_key_map", "hf_state_dict", "init_buffers", "load_hf_state_dict"]


def hf_key_map(body: nn.Sequential) -> dict[str, str]:
    """Every entry of ``body.state_dict()`` → the Hugging Face model's name for it. A layer with entries and
    no ``hf_names`` (one not made by :func:`~lightning_pipe.models.to_sequential`) is refused by name."""
    mapping: dict[str, str] = {}
    for index, layer in body._modules.items():  # every position: named_children() lists a repeated layer once
        if layer is None:
            continue
        names = getattr(layer, "hf_names", None)
        for key in layer.state_dict(keep_vars=True):
            child, _, rest = key.partition(".")
            if names is None or child not in names:
                raise ValueError(f"layer {index} ({type(layer).__name__}) of the body has entries with no Hugging "
                                 f"Face name (entry: {key!r}): it was not made by to_sequential; map its "
                                 "entries yourself or leave it out of the state you convert")
            mapping[f"{index}.{key}"] = f"{names[child]}.{rest}" if names[child] else rest
    return mapping


def hf_state_dict(body: nn.Sequential, state_dict: Mapping[str, Tensor] | None = None, prefix: str = ""
                  ) -> dict[str, Tensor]:
    """The body's state under the Hugging Face model's names: ``body.state_dict()`` by default, or
    ``state_dict`` whose keys are the body's behind ``prefix`` (a LightningModule's checkpoint:
    ``hf_state_dict(model.sequential_module, ckpt["state_dict"], prefix="sequential_module.")``), whose other
    keys are left out. ``model.load_state_dict(hf_state_dict(body))`` then loads it into the model (every
    entry but those of modules the body does not use, like BERT's pooler)."""
    mapping = hf_key_map(body)
    if state_dict is None:
        state_dict = body.state_dict()
        prefix = ""
    missing = [k for k in mapping if prefix + k not in state_dict]
    if missing:
        raise KeyError(f"the state lacks entries of the body (behind prefix {prefix!r}: {missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''}); pass the state_dict of this body")
    return {hf: state_dict[prefix + key] for key, hf in mapping.items()}


def tied_names(body: nn.Sequential) -> dict[str, list[str]]:
    """Each entry → the other entries holding the same tensor (a tied embedding and head)."""
    holders: dict[int, list[str]] = {}
    for key, t in body.state_dict(keep_vars=True).items():
        holders.setdefault(id(t), []).append(key)
    return {k: [o for o in keys if o != k] for keys in holders.values() for k in keys}


def load_hf_state_dict(body: nn.Sequential, state_dict: Mapping[str, Tensor], strict: bool = True) -> list[str]:
    """Load a Hugging Face model's ``state_dict`` (or ``safetensors`` file's tensors) into the body, and return
    the keys the body does not use (BERT's pooler, say).

    A tied entry missing from ``state_dict`` (``save_pretrained`` writes one of the two) is filled from its
    twin. With ``strict``, an entry of the body found under none of its names is an error naming it.
    """
    mapping = hf_key_map(body)
    twins = tied_names(body)
    own: dict[str, Tensor] = {}
    missing = []
    for key, hf in mapping.items():
        source = next((mapping[k] for k in [key, *twins.get(key, [])] if mapping[k] in state_dict), None)
        if source is None:
            missing.append(hf)
        else:
            own[key] = state_dict[source]
    if strict and missing:
        raise KeyError(f"the state_dict lacks entries of the body (Hugging Face names: {missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''}); is it the same architecture and size?")
    body.load_state_dict(own, strict=strict)
    used = set(mapping.values())
    return sorted(k for k in state_dict if k not in used)


def _rope(module: nn.Module) -> Tensor:
    """The inverse frequencies of a rotary embedding module, computed from its config as Hugging Face does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = getattr(module, "rope_type", "default")
    compute = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = compute(module.config)
    return inv_freq


@torch.no_grad()
def init_buffers(body: nn.Module) -> None:
    """Compute the buffers of the body's Hugging Face modules that no ``state_dict`` holds (non-persistent: a
    rotary embedding's ``inv_freq``, BERT's ``position_ids`` and ``token_type_ids``), as the model's own
    initialization does. A body built on the ``meta`` device needs it after ``to_empty`` (whose buffers hold
    garbage), with its weights from :func:`load_hf_state_dict`. Any other non-persistent buffer is refused by
    name, never left as garbage."""
    done: set[int] = set()
    for name, module in body.named_modules():
        for buffer in module._non_persistent_buffers_set:
            value = getattr(module, buffer)
            if value is None or id(value) in done:
                continue
            if buffer in ("inv_freq", "original_inv_freq") and hasattr(module, "config"):
                value.copy_(_rope(module))
            elif buffer == "position_ids":
                value.copy_(torch.arange(value.shape[-1]).expand_as(value))
            elif buffer == "token_type_ids":
                value.zero_()
            else:
                raise ValueError(f"init_buffers does not know the buffer {buffer!r} of {name or 'the body'} "
                                 f"({type(module).__name__}): compute it as the model's _init_weights does")
            done.add(id(value))
