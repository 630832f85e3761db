"""Hugging Face ``transformers`` models as pipeline bodies: :func:`to_sequential` and their state by the
model's names.

An optional layer above the engine (it imports ``transformers``; nothing else in the package imports it):
``pip install 'lightning_pipe[hf]'``. ::

    from transformers import AutoModelForCausalLM
    from lightning_pipe.models import to_sequential

    body = to_sequential(AutoModelForCausalLM.from_pretrained(path))   # embeddings, n blocks, norm + head
    logits = body((input_ids, attention_mask))                          # the model's logits

See docs/models.md: the architectures, what crosses stages, adding one, the limits.
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is installed where this is tested
    raise ImportError("lightning_pipe.models needs transformers, which is not installed: "
                      "pip install 'lightning_pipe[hf]'") from exc

from lightning_pipe.models.adapters import register_adapter, supported_models, to_sequential
from lightning_pipe.models.layers import HFLayer
from lightning_pipe.models.peft import drop_frozen, save_adapters
from lightning_pipe.models.state import hf_key_map, hf_state_dict, init_buffers, load_hf_state_dict
from lightning_pipe.models.weights import PretrainedFiles, attach_pretrained, materialize_body, pretrained_body

__all__ = ["HFLayer", "PretrainedFiles", "attach_pretrained", "drop_frozen", "hf_key_map", "hf_state_dict",
           "init_buffers", "load_hf_state_dict", "materialize_body", "pretrained_body", "register_adapter",
           "save_adapters", "supported_models", "to_sequential"]
