"""Pretrained weights read per stage: each process reads the tensors of its own layers from the checkpoint's files.

:func:`pretrained_body` builds a Hugging Face checkpoint's body under ``lightning_pipe.deferred_init()`` (nothing
allocated) and gives each of its layers the checkpoint's location and its entries' names there. Whichever
process materialises a layer (``PipeStrategy``: each stage in its own process; ``materialize`` in one) then
reads those tensors alone (:meth:`HFLayer.after_materialize`): from ``model.safetensors``, from the shards an
index (``model.safetensors.index.json``) names, or from a torch file opened with ``mmap=True`` (LitGPT's
``lit_model.pth`` too). No process reads or holds the whole model::

    body = pretrained_body("path/to/checkpoint")      # on meta: the recorded build, no weights
    stage 0's process: materialises layers 0..2 ─► reads transformer.wte.weight, transformer.h.0.*, ...
    stage 1's process: materialises layers 3..5 ─► reads transformer.h.2.*, transformer.ln_f.*, lm_head.weight

A head tied to its embedding that the file holds once (``save_pretrained`` drops the copy) is read under the
embedding's name by the stage of the head.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PretrainedFiles", "attach_pretrained", "materialize_body", "pretrained_body"]

_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_TORCH, _TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_LITGPT, _LITGPT_CONFIG = "lit_model.pth", "model_config.yaml"  # a LitGPT checkpoint directory's


def _torch_state(file: str) -> Any:
    """A torch file's state dict, its tensors left on disk until used (``mmap``); a LitGPT checkpoint's
    ``{"model": state_dict, ...}`` (``fabric.save`` of its fine-tuning scripts) gives its ``"model"``, as
    LitGPT's own ``load_checkpoint`` reads it."""
    state = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    return state.get("model", state) if isinstance(state, dict) else state


class PretrainedFiles:
    """A checkpoint's tensor files, read by name: ``path`` is a directory (``save_pretrained``'s, or LitGPT's
    holding ``lit_model.pth``), a ``.safetensors`` file, or a torch file (``torch.save`` of a ``state_dict``, or
    of LitGPT's ``{"model": state_dict}``, opened with ``mmap=True``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        self.path = path
        self.index: dict[str, str] | None = None  # entry -> file, for sharded checkpoints
        if os.path.isdir(path):
            for name in (_SAFETENSORS_INDEX, _TORCH_INDEX):
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name)) as f:
                        self.index = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
                    break
            else:
                found = [name for name in (_SAFETENSORS, _TORCH, _LITGPT) if os.path.exists(os.path.join(path, name))]
                if not found:
                    raise FileNotFoundError(
                        f"no weights in {path!r} (looked for {_SAFETENSORS}, {_SAFETENSORS_INDEX}, {_TORCH}, "
                        f"{_TORCH_INDEX}, {_LITGPT}): pass a checkpoint directory written by save_pretrained or "
                        "LitGPT, or its file")
                self.path = os.path.join(path, found[0])
        elif not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}: pass a directory written by save_pretrained, or "
                                    "a .safetensors or torch file")

    def _file_of(self, name: str) -> str | None:
        return self.path if self.index is None else self.index.get(name)

    def names(self) -> set[str]:
        """Every entry the checkpoint holds (reading no tensor)."""
        if self.index is not None:
            return set(self.index)
        if self.path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                return set(f.keys())
        return set(_torch_state(self.path))

    def read(self, names: Sequence[str]) -> dict[str, Tensor]:
        """The tensors ``names`` (each from the file that holds it), read alone, on CPU."""
        return self.read_parts({name: (name, None) for name in names})

    def read_parts(self, parts: Mapping[str, tuple[str, tuple[slice, ...] | None]]) -> dict[str, Tensor]:
        """``{key: (name, index)}`` → ``{key: the part index of entry name}`` (``index``: one slice per dim;
        None: the whole entry), on CPU: a safetensors file reads that part alone (``get_slice``), a torch file the
        pages it spans (``mmap``)."""
        by_file: dict[str, list[str]] = {}
        for key, (name, _) in parts.items():
            file = self._file_of(name)
            if file is None:
                raise KeyError(f"the checkpoint {self.path!r} has no entry {name!r}")
            by_file.setdefault(file, []).append(key)
        out: dict[str, Tensor] = {}
        for file, keys in by_file.items():
            with contextlib.ExitStack() as opened:
                read = _reader(file, opened)
                done: dict[Any, Tensor] = {}  # one read per part asked for under several keys (a tied pair)
                for key in keys:
                    name, index = parts[key]
                    part = _part(name, index)
                    if part not in done:
                        done[part] = read(name, index)
                    out[key] = done[part]
        return out


def _reader(file: str, opened: contextlib.ExitStack) -> Callable[[str, tuple[slice, ...] | None], Tensor]:
    """How to read an entry of ``file``, or a part of it (one slice per dim): a safetensors file opened in
    ``opened`` reads the part alone (``get_slice``), a torch file (``mmap``) the pages it spans."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        f = opened.enter_context(safe_open(file, framework="pt"))
        return lambda name, index: f.get_tensor(name) if index is None else f.get_slice(name)[index]
    state = _torch_state(file)  # pages read on use
    return lambda name, index: (state[name] if index is None else state[name][index]).clone()


def _part(name: str, index: tuple[slice, ...] | None) -> Any:
    """A hashable key for a part of an entry (slices are not hashable)."""
    return name, None if index is None else tuple((s.start, s.stop, s.step) for s in index)


def attach_pretrained(body: nn.Sequential, path: str | os.PathLike[str]) -> nn.Sequential:
    """Have each layer of ``body`` (made by :func:`~lightning_pipe.models.to_sequential`) fill itself from the
    checkpoint at ``path`` when it is materialised, reading its own entries alone; returns ``body``. A layer
    already materialised is filled now. Each entry is looked up under the model's name, or, for a tied one the
    file holds once, under its twin's; one found under neither is an error naming it."""
    from lightning_pipe.models.state import hf_key_map, tied_names

    files = PretrainedFiles(path)
    available = files.names()
    mapping, twins = hf_key_map(body), tied_names(body)
    missing = []
    for index, layer in body.named_children():
        sources: dict[str, str] = {}
        for key in layer.state_dict(keep_vars=True):
            full = f"{index}.{key}"
            if full not in mapping:
                continue
            source = next((mapping[k] for k in [full, *twins.get(full, [])] if mapping[k] in available), None)
            if source is None:
                missing.append(mapping[full])
            else:
                sources[key] = source
        layer.pretrained = (files, sources)
    if missing:
        raise KeyError(f"the checkpoint at {os.fspath(path)!r} lacks entries of the body (Hugging Face names: "
                       f"{missing[:5]}{' ...' if len(missing) > 5 else ''}); is it the same architecture and size?")
    for layer in body.children():
        real = not any(t.is_meta for t in layer.state_dict(keep_vars=True).values())
        if real and hasattr(layer, "after_materialize"):
            layer.after_materialize()  # already real: filled now
    return body


def pretrained_body(path: str | os.PathLike[str], model_class: Any = None, **config: Any) -> nn.Sequential:
    """The body of the Hugging Face checkpoint at ``path`` (a ``save_pretrained`` directory), or of LitGPT's (a
    directory holding ``lit_model.pth`` and ``model_config.yaml``, or that ``lit_model.pth``), built under
    ``lightning_pipe.deferred_init()``: no weights are allocated or read here. Each process that materialises a
    part of it (a stage under ``PipeStrategy``) reads that part's tensors alone; to have it whole in one process,
    ``materialize_body(body)``. ``model_class``: the ``transformers`` class (default: the config's first
    architecture), or ``litgpt.GPT`` (the default for a LitGPT directory with no Hugging Face weights beside;
    name it where ``litgpt download`` left both); ``config``: attributes to change in the config
    (``attn_implementation="eager"``, ...; LitGPT's: ``litgpt.Config`` fields)."""
    import lightning_pipe
    from lightning_pipe.models.adapters import to_sequential

    path = os.fspath(path)
    if _is_litgpt(path, model_class):
        import litgpt

        directory, file = (path, os.path.join(path, _LITGPT)) if os.path.isdir(path) else (os.path.dirname(path), path)
        if not os.path.exists(os.path.join(directory, _LITGPT_CONFIG)):
            raise FileNotFoundError(f"no {_LITGPT_CONFIG} in {directory!r}, which LitGPT's checkpoint directories "
                                    "hold: build the body yourself, to_sequential(litgpt.GPT(config)), then "
                                    "attach_pretrained(body, path_to_lit_model_pth)")
        with lightning_pipe.deferred_init():
            body = to_sequential((model_class or litgpt.GPT)(litgpt.Config.from_file(
                os.path.join(directory, _LITGPT_CONFIG), **config)))
        return attach_pretrained(body, file)
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(path, **config)
    if model_class is None:
        architectures = getattr(hf_config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            raise ValueError(f"the config at {path!r} names no architecture transformers has "
                             f"(architectures: {architectures}): pass model_class=...")
    with lightning_pipe.deferred_init():
        body = to_sequential(model_class(hf_config))
    return attach_pretrained(body, path)


def _is_litgpt(path: str, model_class: Any) -> bool:
    """Whether ``pretrained_body`` builds LitGPT's GPT: ``model_class`` is it (or a subclass), or, none given,
    ``path`` is a ``lit_model.pth`` or a directory holding one and its config but no Hugging Face weights."""
    if model_class is not None:
        from lightning_pipe.models.litgpt import is_litgpt_gpt

        return is_litgpt_gpt(model_class)
    if not os.path.isdir(path):
        return os.path.basename(path) == _LITGPT
    hf = (_SAFETENSORS, _SAFETENSORS_INDEX, _TORCH, _TORCH_INDEX)
    return all(os.path.exists(os.path.join(path, name)) for name in (_LITGPT, _LITGPT_CONFIG)) and \
        not any(os.path.exists(os.path.join(path, name)) for name in hf)


def materialize_body(body: nn.Sequential) -> nn.Sequential:
    """Materialise, in this process, every layer of a body built on the meta device (its pretrained weights
    read as it goes); returns ``body``."""
    from lightning_pipe.engine.deferred import materialize, named_tensors, recording_of

    meta = {name: t for name, t in named_tensors(body).items() if t.is_meta}
    recording = next((r for r in (recording_of(t) for t in meta.values()) if r is not None), None)
    if recording is None:
        raise ValueError("the body holds no tensor a deferred build recorded: build it with pretrained_body or "
                         "under lightning_pipe.deferred_init()")
    materialize(body, recording.program(meta).run())
    return body
