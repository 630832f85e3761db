"""LitGPT's GPT as a pipeline body (lightning_pipe.models.litgpt), against ``litgpt.GPT`` itself.

Tiny LitGPT configs built on the spot (no download): a Pythia-like one (parallel residual, LayerNorm, GeLU MLP,
rotary on a quarter of each head), a Llama-like one (RMSNorm, LLaMAMLP, grouped-query attention) and a
Gemma-like one (scaled embeddings, soft-capped attention and logits, a sliding window in every other layer,
extra norms). The body's output equals the GPT's, alone and through ``Pipe``; training through ``Pipe`` equals
training the GPT; the state is LitGPT's (``GPT.state_dict()``'s keys, loaded by ``litgpt.GPT`` and converted
to Hugging Face's format by LitGPT's own ``convert_lit_checkpoint``); a ``lit_model.pth`` is read per stage.

LitGPT 0.5.13 pins ``huggingface-hub<1.4`` where transformers 5 needs more: it is installed beside our stack with
``pip install --no-deps litgpt==0.5.13`` (docs/models.md, "LitGPT"), and these tests are skipped without it.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

litgpt = pytest.importorskip("litgpt")

from lightning_pipe import Pipe, deferred_init, loss_on_last_stage  # noqa: E402
from lightning_pipe.engine.deferred import materialize, named_tensors, recording_of  # noqa: E402
from lightning_pipe.engine.partition import split_module  # noqa: E402
from lightning_pipe.models import (  # noqa: E402
    hf_key_map,
    hf_state_dict,
    load_hf_state_dict,
    materialize_body,
    pretrained_body,
    supported_models,
    to_sequential,
)

VOCAB, TIME, BLOCKS = 50, 12, 4
BALANCE = [3, 3]  # embeddings + 4 blocks + head, over 2 partitions
COMMON = dict(block_size=16, vocab_size=VOCAB, padding_multiple=8, n_layer=BLOCKS, n_head=4, n_embd=32)
CONFIGS = {
    "pythia": dict(rotary_percentage=0.25, parallel_residual=True, bias=True, norm_class_name="LayerNorm",
                   mlp_class_name="GptNeoxMLP"),
    "llama": dict(n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                  norm_class_name="RMSNorm", norm_eps=1e-5, mlp_class_name="LLaMAMLP", intermediate_size=48),
    "gemma": dict(n_query_groups=1, rotary_percentage=1.0, parallel_residual=False, bias=False,
                  norm_class_name="RMSNorm", mlp_class_name="GemmaMLP", intermediate_size=48,
                  scale_embeddings=True, attention_logit_softcapping=50.0, final_logit_softcapping=3.0,
                  sliding_window_size=4, sliding_window_indices=[1, 0, 1, 0], post_attention_norm=True,
                  post_mlp_norm=True),
}


def config(arch: str) -> litgpt.Config:
    return litgpt.Config(name=f"tiny-{arch}", **COMMON, **CONFIGS[arch])


def tiny(arch: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return litgpt.GPT(config(arch))


def batches(samples: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (samples, TIME) and their next tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, TIME + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def assert_same_state(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert trained.keys() == expected.keys()
    for key, value in trained.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-5, msg=f"{what}: {key}")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_the_body_gives_the_gpts_output(arch):
    model = tiny(arch).eval()
    body = to_sequential(model)
    assert len(body) == BLOCKS + 2
    assert body[0].wte is model.transformer.wte and body[2].block is model.transformer.h[1]  # its own modules
    assert body[-1].lm_head is model.lm_head and body[-1].ln_f is model.transformer.ln_f
    assert [layer.hf_names for layer in body[:2]] == [{"wte": "transformer.wte"}, {"block": "transformer.h.0"}]
    assert not any(True for _ in body.buffers())  # the rotary tables are built per call, held by no stage
    ids, _ = batches(6)
    with torch.no_grad():
        for time in (TIME, 1, COMMON["block_size"]):  # shorter and longer than the sliding window
            x = torch.randint(0, VOCAB, (3, time)) if time != TIME else ids
            assert_close(body(x), model(x))
        pipe = Pipe(to_sequential(copy.deepcopy(model)), BALANCE, chunks=3).eval()
        assert_close(pipe(ids), model(ids))
        copied = pickle.loads(pickle.dumps(body))  # as PipeStrategy sends each stage to its process
        assert_close(copied(ids), model(ids))


def test_what_the_config_adds_is_in_the_body():
    """The Gemma-like config's embedding scale, logit cap and sliding windows change the output: a body that
    skipped one of them would differ from the GPT, as these twins, each without one, do."""
    ids, _ = batches(4)
    model = tiny("gemma").eval()
    with torch.no_grad():
        expected = model(ids)
        for change in ({"scale_embeddings": False}, {"final_logit_softcapping": None},
                       {"sliding_window_indices": [0, 0, 0, 0]}):
            other = litgpt.GPT(litgpt.Config(name="tiny-gemma", **COMMON, **(CONFIGS["gemma"] | change)))
            other.load_state_dict(model.state_dict())
            assert not torch.allclose(to_sequential(other.eval())(ids), expected, atol=1e-3), change


def test_litgpts_lora_model_takes_the_same_adapter():
    """``litgpt.lora.GPT`` subclasses ``litgpt.model.GPT`` with the same forward: its body gives its output, and
    its LoRA matrices, which train, are the body's. The body travels to stages' processes: at LitGPT's default
    ``lora_dropout=0.0`` each LoRA layer held a lambda, which no pickle takes (a stage could not be sent); an
    ``nn.Identity`` now, the same output."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    torch.manual_seed(0)
    model = GPT(Config(name="tiny-llama", **COMMON, **CONFIGS["llama"], lora_r=4, lora_alpha=8, lora_query=True,
                       lora_value=True))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # zeros at first: the adapters would change nothing
    mark_only_lora_as_trainable(model)
    body = to_sequential(model.eval())
    ids, _ = batches(4)
    with torch.no_grad():
        assert_close(body(ids), model(ids))
        assert_close(pickle.loads(pickle.dumps(body))(ids), model(ids))  # as a stage's process receives it
    trainable = [k for k, p in body.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * BLOCKS and all(".attn.qkv.lora_" in k for k in trainable)  # A and B, fused qkv
    assert set(hf_state_dict(body)) == set(model.state_dict())


def train_steps(model: nn.Module, forward, steps: int = 3) -> None:
    """``steps`` SGD steps with momentum, ``forward(ids, target)`` returning the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids, target = batches(8 * steps)
    for step in range(steps):
        opt.zero_grad()
        forward(ids[8 * step: 8 * (step + 1)], target[8 * step: 8 * (step + 1)]).backward()
        opt.step()


@pytest.mark.parametrize("arch", ["pythia", "llama"])
def test_training_through_pipe_trains_the_gpts_weights(arch):
    """Two partitions, 4 micro-batches: GPipe with the loss on the gathered logits (recomputing all but the last
    micro-batch), 1F1B and zero-bubble with the loss on the last stage: LitGPT's GPT trained on its own."""
    reference = tiny(arch)
    train_steps(reference, lambda i, t: loss_fn(reference(i), t))
    expected = reference.state_dict()
    assert not torch.equal(expected["transformer.h.0.attn.qkv.weight"],
                           tiny(arch).state_dict()["transformer.h.0.attn.qkv.weight"])  # it trained
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        pipe = Pipe(to_sequential(tiny(arch)), BALANCE, chunks=4, schedule=schedule)
        if schedule == "gpipe":
            train_steps(pipe, lambda i, t, pipe=pipe: loss_fn(pipe(i), t))
        else:
            train_steps(pipe, lambda i, t, pipe=pipe: loss_on_last_stage(pipe, i, t, loss_fn))
        trained = hf_state_dict(nn.Sequential(*[layer for part in pipe.partitions for layer in part]))
        assert_same_state(trained, expected, schedule)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_the_state_is_litgpts_and_loads_both_ways(arch, tmp_path):
    model = tiny(arch, seed=1).eval()
    body = to_sequential(model)
    state = hf_state_dict(body)
    assert len(state) == len(model.state_dict()) and set(state) == set(model.state_dict())  # LitGPT's names
    assert hf_key_map(body)["1.block.attn.qkv.weight"] == "transformer.h.0.attn.qkv.weight"
    # Saved as LitGPT saves it, loaded as litgpt.utils.load_checkpoint loads it (lazy_load, "model" or not).
    from litgpt.utils import lazy_load

    ids, _ = batches(4)
    for saved in (state, {"model": state}):
        torch.save(saved, tmp_path / "lit_model.pth")
        loaded = lazy_load(tmp_path / "lit_model.pth")
        fresh = tiny(arch, seed=2).eval()
        fresh.load_state_dict(loaded.get("model", loaded), strict=True)
        with torch.no_grad():
            assert_close(fresh(ids), model(ids))
    # The other way: a GPT's weights into another body.
    other = to_sequential(tiny(arch, seed=3).eval())
    assert load_hf_state_dict(other, model.state_dict()) == []
    with torch.no_grad():
        assert_close(other(ids), model(ids))


@pytest.mark.parametrize("arch,hf_class", [("llama", "LlamaForCausalLM"), ("pythia", "GPTNeoXForCausalLM")])
def test_litgpts_conversion_reads_what_the_body_saves(arch, hf_class, tmp_path):
    """``litgpt convert_from_litgpt`` (``convert_lit_checkpoint``) turns the body's state, saved as
    ``lit_model.pth`` beside its ``model_config.yaml``, into Hugging Face's format: the Hugging Face model
    loading it (``from_pretrained``, which renames GPT-NeoX's ``embed_out`` as transformers 5 names it) gives the
    GPT's logits."""
    transformers = pytest.importorskip("transformers")
    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint
    from litgpt.utils import save_config

    model = tiny(arch, seed=4).eval()
    body = to_sequential(model)
    torch.save(hf_state_dict(body), tmp_path / "lit_model.pth")
    save_config(model.config, tmp_path)
    convert_lit_checkpoint(tmp_path, tmp_path / "hf")
    c = model.config
    if arch == "llama":
        hf_config = transformers.LlamaConfig(
            vocab_size=c.padded_vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_query_groups,
            rms_norm_eps=c.norm_eps, max_position_embeddings=c.block_size, tie_word_embeddings=False)
    else:
        hf_config = transformers.GPTNeoXConfig(
            vocab_size=c.padded_vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, rotary_pct=c.rotary_percentage,
            max_position_embeddings=c.block_size, layer_norm_eps=c.norm_eps, use_parallel_residual=True,
            hidden_act="gelu", tie_word_embeddings=False)
    from safetensors.torch import save_file

    converted = torch.load(tmp_path / "hf" / "model.pth", weights_only=True)
    save_file({k: v.contiguous() for k, v in converted.items()}, str(tmp_path / "hf" / "model.safetensors"))
    hf_config.save_pretrained(tmp_path / "hf")
    hf_model, info = getattr(transformers, hf_class).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # every weight LitGPT's conversion wrote, and nothing else
    ids, _ = batches(4)
    with torch.no_grad():
        assert_close(hf_model(ids).logits, body(ids))


def test_only_litgpts_gpt_takes_its_adapter():
    """The adapter is registered by ``litgpt.model.GPT``, not by the name ``GPT``: another class of that name
    is refused as any unsupported model."""
    assert supported_models()["litgpt.model.GPT"] == "LitGPT"
    assert "GPT" not in supported_models()

    class GPT(nn.Module):  # a user's own model, named as LitGPT's
        def __init__(self):
            super().__init__()
            self.transformer = tiny("llama").transformer

    with pytest.raises(TypeError, match="has no adapter for GPT"):
        to_sequential(GPT())


def test_what_litgpts_forward_does_not_take_is_refused():
    model = tiny("llama")
    body = to_sequential(model)
    ids, _ = batches(2)
    with pytest.raises(TypeError, match="takes input_ids alone .*no attention mask"):
        body((ids, torch.ones_like(ids)))
    with pytest.raises(ValueError, match=r"longer than the model's max_seq_length \(time: 17, max_seq_length: 16\)"):
        body(torch.zeros(1, 17, dtype=torch.long))
    model.set_kv_cache(batch_size=1)
    with pytest.raises(ValueError, match=r"key/value cache set .*clear_kv_cache\(\)"):
        to_sequential(model)
    model.clear_kv_cache()
    model.max_seq_length = 8  # the model's own limit, shorter than block_size, is the body's
    with pytest.raises(ValueError, match="max_seq_length: 8"):
        to_sequential(model)(ids)


def test_a_body_built_deferred_initialises_as_the_plain_gpt():
    """Built under ``deferred_init`` (``trainer.init_module()``), nothing is allocated, and materialised it holds
    the weights the plain build gets under the same seed."""
    torch.manual_seed(3)
    plain = litgpt.GPT(config("llama"))
    torch.manual_seed(3)
    with deferred_init():
        body = to_sequential(litgpt.GPT(config("llama")))
    assert all(t.is_meta for t in body.state_dict().values())
    materialize_body(body)
    assert_same_state(hf_state_dict(body), plain.state_dict(), "deferred")
    ids, _ = batches(2)
    with torch.no_grad():
        torch.testing.assert_close(body(ids), plain(ids), rtol=0, atol=0)


@pytest.mark.parametrize("nested", [False, True])
def test_each_stage_reads_its_own_tensors_from_lit_model_pth(nested, tmp_path, reads):
    """A LitGPT checkpoint directory (``lit_model.pth``: a state dict, or ``{"model": ...}`` as its fine-tuning
    scripts save it; ``model_config.yaml``): ``pretrained_body`` builds it on meta, and each stage materialised
    reads its own entries alone."""
    from litgpt.utils import save_config

    model = tiny("pythia", seed=11).eval()
    torch.save({"model": model.state_dict()} if nested else model.state_dict(), tmp_path / "lit_model.pth")
    save_config(model.config, tmp_path)
    body = pretrained_body(tmp_path)
    assert reads == [] and all(t.is_meta for t in body.state_dict().values())
    mapping, start = hf_key_map(body), 0
    for part in split_module(body, BALANCE):  # in the order the pipeline's processes would, each its own part
        reads.clear()
        tensors = named_tensors(part)
        program = recording_of(next(iter(tensors.values()))).program({k: t for k, t in tensors.items() if t.is_meta})
        materialize(part, program.run())
        layers = {str(i) for i in range(start, start + len(part))}
        assert sorted(reads) == sorted(hf for key, hf in mapping.items() if key.split(".", 1)[0] in layers)
        assert all(t.is_meta for layer in body[start + len(part):] for t in layer.parameters())
        start += len(part)
    ids, _ = batches(4)
    with torch.no_grad():
        torch.testing.assert_close(body.eval()(ids), model(ids), rtol=0, atol=0)


def test_a_directory_with_both_formats_is_read_as_asked(tmp_path):
    """``litgpt download`` leaves the Hugging Face files beside ``lit_model.pth``: ``pretrained_body`` builds the
    Hugging Face model from them unless told ``model_class=litgpt.GPT``; without a config it says what to do."""
    from litgpt.utils import save_config

    model = tiny("llama", seed=12).eval()
    torch.save(model.state_dict(), tmp_path / "lit_model.pth")
    with pytest.raises(FileNotFoundError, match="no model_config.yaml in .*attach_pretrained"):
        pretrained_body(tmp_path / "lit_model.pth")
    save_config(model.config, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")  # a Hugging Face file beside: no longer LitGPT's alone
    with pytest.raises((OSError, ValueError), match="config.json"):
        pretrained_body(tmp_path)  # read as Hugging Face's: it has no config.json
    body = materialize_body(pretrained_body(tmp_path, model_class=litgpt.GPT))
    ids, _ = batches(2)
    with torch.no_grad():
        torch.testing.assert_close(body.eval()(ids), model(ids), rtol=0, atol=0)
