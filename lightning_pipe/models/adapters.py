"""``to_sequential``: a Hugging Face model as a pipeline body, through the adapter of its architecture.

An adapter is a function from the model to its layers, in order (:class:`~lightning_pipe.models.layers.HFLayer`
s holding the model's own modules); :func:`register_adapter` ties it to the model classes it takes. The
adapters shipped: GPT-2 (:mod:`~lightning_pipe.models.gpt2`), the Llama family
(:mod:`~lightning_pipe.models.llama`), BERT (:mod:`~lightning_pipe.models.bert`) and LitGPT's ``GPT``
(:mod:`~lightning_pipe.models.litgpt`, registered by its qualified name ``litgpt.model.GPT``: a class named ``GPT``
elsewhere is not LitGPT's).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_pipe.engine.partition import check_repeats
from lightning_pipe.models.bert import bert_layers
from lightning_pipe.models.gpt2 import gpt2_layers
from lightning_pipe.models.layers import HFLayer
from lightning_pipe.models.litgpt import LITGPT_GPT, litgpt_layers
from lightning_pipe.models.llama import decoder_layers

__all__ = ["register_adapter", "supported_models", "to_sequential"]

#: An adapter: the model → its layers, in order.
Adapter = Callable[[nn.Module], list[nn.Module]]

_ADAPTERS: dict[str, tuple[str, Adapter]] = {}


def register_adapter(class_name: str, adapter: Adapter, family: str | None = None) -> None:
    """Have :func:`to_sequential` turn models of class ``class_name`` (or of a subclass) into a body with
    ``adapter``: a function from the model to its layers, each an
    :class:`~lightning_pipe.models.layers.HFLayer` holding the model's own modules as children; the first takes
    ``input_ids`` or ``(input_ids, attention_mask)``, the last returns the model's main output. ``class_name`` is
    the class's name (``"GPT2LMHeadModel"``: any class so named) or its module and name (``"litgpt.model.GPT"``:
    that class alone, where the name alone could be another's). ``family`` names the architecture in messages
    (default: ``class_name``). See docs/models.md, "Adding an architecture".
    """
    if not callable(adapter):
        raise TypeError(f"adapter must be a function from the model to its layers (got: {type(adapter).__name__})")
    _ADAPTERS[class_name] = (family or class_name, adapter)


for _family, _adapter, _names in (
        ("GPT-2", gpt2_layers, ("GPT2LMHeadModel", "GPT2Model")),
        ("Llama", decoder_layers, ("LlamaForCausalLM", "LlamaModel")),
        ("Mistral", decoder_layers, ("MistralForCausalLM", "MistralModel")),
        ("Qwen2", decoder_layers, ("Qwen2ForCausalLM", "Qwen2Model")),
        ("BERT", bert_layers, ("BertModel",)),
        ("LitGPT", litgpt_layers, (LITGPT_GPT,))):
    for _name in _names:
        register_adapter(_name, _adapter, _family)


def supported_models() -> dict[str, str]:
    """The model classes :func:`to_sequential` takes, each with its architecture's name."""
    return {name: family for name, (family, _) in _ADAPTERS.items()}


def _adapter_for(model: nn.Module) -> Adapter:
    for cls in type(model).__mro__:
        for name in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):  # the qualified name first
            if name in _ADAPTERS:
                return _ADAPTERS[name][1]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = ", ".join(f"{name} ({family})" for name, family in supported_models().items())
    raise TypeError(
        f"to_sequential has no adapter for {type(model).__name__} (model_type: {model_type!r}); it takes: "
        f"{supported}. Another architecture needs a small adapter, a function from the model to its layers, "
        "registered with lightning_pipe.models.register_adapter (docs/models.md, 'Adding an architecture')")


def to_sequential(model: nn.Module) -> nn.Sequential:
    """The Hugging Face ``model`` as a pipeline body: embeddings → one layer per transformer block → final
    norm / head, an ``nn.Sequential`` that ``Pipe`` and ``PipeStrategy`` split by ``balance``.

    The body takes ``input_ids`` (batch, time) or ``(input_ids, attention_mask)`` (1 = keep, 0 = padding) and
    returns the model's main output: the logits of a ``*ForCausalLM`` / ``GPT2LMHeadModel``, the
    ``last_hidden_state`` of a ``BertModel`` or of a decoder's base model; LitGPT's ``GPT``
    (``litgpt.GPT(config)``) takes ``input_ids`` alone, as its forward does, and returns its logits. Between layers
    flows ``(hidden_states, attention_mask)`` (LitGPT's: ``hidden_states``); each block builds its attention mask
    and rotary tables per micro-batch, as the model does per batch, so ``body(x)`` equals the model's output.

    The body holds the model's own modules (no copy): training one trains the other, and an embedding tied to
    the head stays one ``Parameter``. Nothing is allocated, so a model built on the ``meta`` device gives a body
    on ``meta`` (materialize it with ``to_empty``, :func:`~lightning_pipe.models.load_hf_state_dict` and
    :func:`~lightning_pipe.models.init_buffers`). Keep the body, not the model, in the LightningModule: a
    module registered twice would be trained twice. :func:`~lightning_pipe.models.hf_state_dict` names the
    body's state as the model's.
    """
    adapter = _adapter_for(model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has Hugging Face's activation checkpointing on, which the pipeline "
                         "replaces: call model.activation_checkpointing_disable() (gradient_checkpointing_disable() "
                         "in older transformers) and pass checkpoint='always' (or "
                         "'except_last') to PipeStrategy or Pipe")
    layers = adapter(model)
    check_repeats([(str(k), layer) for k, layer in enumerate(layers)], f"the body of {type(model).__name__} (the "
                  "layers its adapter returned)", "an adapter makes a new HFLayer for each position, even one that "
                  "holds the same modules as another")
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)  # a module reachable by several names: its first
    for k, layer in enumerate(layers):
        if not isinstance(layer, HFLayer):
            raise TypeError(f"the adapter of {type(model).__name__} returned a {type(layer).__name__} at layer {k}: "
                            "every layer must be an HFLayer holding the model's modules")
        # A module of the adapter's own (a copy of a buffer-only module) must hold no entries: they would have no
        # name in the model's state_dict.
        children = [(c, m) for c, m in layer._modules.items() if m is not None]  # a module held twice: both names
        foreign = [c for c, m in children if id(m) not in names and m.state_dict()]
        if foreign:
            raise ValueError(f"layer {k} ({type(layer).__name__}) of {type(model).__name__}'s adapter holds modules "
                             f"with weights that are not the model's (children: {foreign}): an adapter reuses the "
                             "model's own modules")
        layer.hf_names = {child: names[id(m)] for child, m in children if id(m) in names}
    body = nn.Sequential(*layers)
    body.tensor_parallel_plan = body_tp_plan(model, body)  # what PipeStrategy(tensor_parallel_size=t) splits by
    return body


def _model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan by its module names (``model.layers.*.self_attn.q_proj``): Hugging
    Face's ``tp_plan`` of the whole model, else its config's ``base_model_tp_plan`` under the base model's name."""
    plan = getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {under + key: style for key, style in base.items()}


def _matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches a plan's ``pattern``, ``*`` standing for one dotted part (as Hugging Face's)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names))


def body_tp_plan(model: nn.Module, body: nn.Sequential) -> dict[str, str] | None:
    """The model's tensor-parallel plan (Hugging Face's, see :func:`_model_tp_plan`) by the names of ``body`` (made by
    :func:`to_sequential` from ``model``): one entry per module it splits (``"1.layer.self_attn.q_proj":
    "colwise"``), or None where the model has no plan."""
    plan = _model_tp_plan(model)
    if not plan:
        return None
    named: dict[str, str] = {}
    for k, layer in enumerate(body):
        hf = getattr(layer, "hf_names", {})
        for name, _ in layer.named_modules():
            child, _, rest = name.partition(".")
            if not name or child not in hf:
                continue
            model_name = hf[child] + (f".{rest}" if rest else "")
            style = next((style for pattern, style in plan.items() if _matches(pattern, model_name)), None)
            if style is not None:
                named[f"{k}.{name}"] = style
    return named
