"""lightning_pipe.models: Hugging Face models as pipeline bodies, against the models themselves.

Tiny models built from configs (no download; tests/scripts/hf_train.py): the body's output equals the model's
(padding on either side, with and without a mask, eager and sdpa attention), alone and through ``Pipe`` at 2
and 3 stages; a few training steps through ``Pipe`` equal training the model itself; the body's state maps to
the model's keys and back; a body builds on the meta device. A head tied to its embedding stays one
``Parameter`` in one process, and crosses stages through PipeStrategy (a copy per stage, gradients summed).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from scripts.hf_train import ARCHS, BLOCKS, batches, loss_fn, output, tiny  # noqa: E402

from lightning_pipe import Pipe, loss_on_last_stage  # noqa: E402
from lightning_pipe.models import (  # noqa: E402
    hf_state_dict,
    init_buffers,
    load_hf_state_dict,
    register_adapter,
    supported_models,
    to_sequential,
)

BALANCES = {2: [3, 3], 3: [2, 2, 2]}  # embeddings + 4 blocks + head


def inputs(arch: str, samples: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batches(arch, samples)[:]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch,tied", [(a, False) for a in ARCHS] + [("gpt2", True), ("llama", True)])
def test_the_body_gives_the_models_output(arch, tied, attn):
    model = tiny(arch, tied, attn).eval()
    body = to_sequential(model)
    assert len(body) == BLOCKS + 2
    ids, mask, _ = inputs(arch)
    assert (mask == 0).any(dim=1).sum() >= 4  # padded rows, on the left and on the right
    with torch.no_grad():
        assert_close(body((ids, mask)), output(model, ids, mask))
        assert_close(body(ids), output(model, ids))
        # The mask matters: the padded rows' outputs differ without it.
        assert not torch.allclose(body(ids), body((ids, mask)), atol=1e-3)


def test_sliding_windows_are_the_layers_own():
    """Mistral attends within its window in every layer, Qwen2 in the layers its config lists: a body that
    attended fully there would give other outputs (the sequences are longer than the window)."""
    ids, mask, _ = inputs("mistral")
    for arch in ("mistral", "qwen2"):
        model = tiny(arch).eval()
        body = to_sequential(model)
        kinds = [layer.kind for layer in body[1:-1]]
        assert kinds == (["sliding_attention"] * 4 if arch == "mistral" else ["full_attention"] * 2 +
                         ["sliding_attention"] * 2)
        with torch.no_grad():
            windowed = body((ids, mask))
            for layer in body[1:-1]:
                layer.kind = "full_attention"
            assert not torch.allclose(windowed, body((ids, mask)), atol=1e-3)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_pipe_gives_the_models_output(arch, stages):
    model = tiny(arch).eval()
    pipe = Pipe(to_sequential(copy.deepcopy(model)), BALANCES[stages], chunks=3).eval()
    ids, mask, _ = inputs(arch)
    with torch.no_grad():
        assert_close(pipe((ids, mask)), output(model, ids, mask))


def train_steps(arch: str, model: nn.Module, forward, steps: int = 3, optimizer: str = "sgd") -> None:
    """``steps`` steps on padded batches: ``forward(ids, mask, target)`` returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    data = batches(arch, 8 * steps)
    for step in range(steps):
        ids, mask, target = data[8 * step: 8 * (step + 1)]
        opt.zero_grad()
        forward(ids, mask, target).backward()
        opt.step()


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_training_through_pipe_trains_the_models_weights(arch, stages):
    """GPipe with the loss computed on the gathered output (3 stages: checkpointing every micro-batch), and
    1F1B with the loss on the last stage: the weights of the Hugging Face model trained on its own."""
    reference = tiny(arch)
    train_steps(arch, reference, lambda i, m, t: loss_fn(output(reference, i, m), t))
    for schedule in ("gpipe", "1f1b"):
        twin = tiny(arch)
        checkpoint = "always" if stages == 3 else "except_last"
        pipe = Pipe(to_sequential(twin), BALANCES[stages], chunks=4, checkpoint=checkpoint, schedule=schedule)
        if schedule == "gpipe":
            train_steps(arch, pipe, lambda i, m, t, pipe=pipe: loss_fn(pipe((i, m)), t))
        else:
            train_steps(arch, pipe, lambda i, m, t, pipe=pipe: loss_on_last_stage(pipe, (i, m), t, loss_fn))
        expected = reference.state_dict()
        trained = hf_state_dict(nn.Sequential(*[layer for part in pipe.partitions for layer in part]))
        for key, value in trained.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-5, msg=f"{schedule}: {key}")
        assert not torch.equal(trained[next(iter(trained))], tiny(arch).state_dict()[next(iter(trained))])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_tied_head_stays_the_embeddings_parameter_and_trains_as_the_model(arch):
    reference, twin = tiny(arch, tied=True), tiny(arch, tied=True)
    body = to_sequential(twin)
    head, embedding = body[-1].lm_head.weight, body[0].parameters().__next__()
    assert head is embedding
    assert len(list(body.parameters())) == len(list(reference.parameters()))  # counted once, as in the model
    train_steps(arch, reference, lambda i, m, t: loss_fn(output(reference, i, m), t), optimizer="adamw")
    train_steps(arch, body, lambda i, m, t: loss_fn(body((i, m)), t), optimizer="adamw")
    assert body[-1].lm_head.weight is body[0].parameters().__next__()
    for key, value in hf_state_dict(body).items():
        torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pipe_in_one_process_trains_a_head_tied_across_partitions_as_the_model(arch):
    """The head tied to the embedding, in the last partition, the embedding in the first: ``Pipe`` keeps a copy in
    the later partition, in step with the first's, their gradients summed (engine/tied.py). GPipe, 1F1B and
    zero-bubble train the Hugging Face model's weights (SGD: AdamW's normalised update would magnify the
    rounding of micro-batches' sums); the tied parameter is listed once, as in the model."""
    reference = tiny(arch, tied=True)
    train_steps(arch, reference, lambda i, m, t: loss_fn(output(reference, i, m), t))
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        pipe = Pipe(to_sequential(tiny(arch, tied=True)), BALANCES[2], devices=["cpu", "cpu"], chunks=4,
                    schedule=schedule)
        assert len(list(pipe.parameters())) == len(list(reference.parameters()))
        if schedule == "gpipe":
            train_steps(arch, pipe, lambda i, m, t, pipe=pipe: loss_fn(pipe((i, m)), t))
        else:
            train_steps(arch, pipe, lambda i, m, t, pipe=pipe: loss_on_last_stage(pipe, (i, m), t, loss_fn))
        state = pipe.state_dict()  # the copy's entry as its owner is now
        first, last = pipe.partitions[0][0], pipe.partitions[-1][-1]
        torch.testing.assert_close(state["partitions.1.5.lm_head.weight"], next(first.parameters()), rtol=0, atol=0)
        assert last.lm_head.weight is not next(first.parameters())  # each partition its own
        trained = hf_state_dict(nn.Sequential(*[layer for part in pipe.partitions for layer in part]))
        for key, value in trained.items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-5, atol=1e-5,
                                       msg=f"{schedule}: {key}")


@pytest.mark.parametrize("arch,tied", [(a, False) for a in ARCHS] + [("gpt2", True), ("llama", True)])
def test_the_state_maps_to_the_models_keys_and_back(arch, tied, tmp_path):
    model = tiny(arch, tied, seed=1).eval()
    body = to_sequential(model)
    state = hf_state_dict(body)
    expected = model.state_dict()
    unused = {"pooler.dense.weight", "pooler.dense.bias"} if arch == "bert" else set()
    assert set(state) == set(expected) - unused
    fresh = tiny(arch, tied, seed=2).eval()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert set(missing) == unused and unexpected == []
    ids, mask, _ = inputs(arch)
    with torch.no_grad():
        assert_close(output(fresh, ids, mask), output(model, ids, mask))
    # The other way: the model's weights as save_pretrained writes them (one name of a tied pair) into a body.
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert arch == "bert" or tied == ("lm_head.weight" not in saved)
    other = to_sequential(tiny(arch, tied, seed=3).eval())
    assert sorted(load_hf_state_dict(other, saved)) == sorted(unused)
    with torch.no_grad():
        assert_close(other((ids, mask)), output(model, ids, mask))
    if tied:
        assert other[-1].lm_head.weight is next(other[0].parameters())
    with pytest.raises(KeyError, match="lacks entries of the body"):
        load_hf_state_dict(other, {k: v for k, v in saved.items() if ".1." not in k})


def test_a_lightning_checkpoints_state_maps_by_its_prefix():
    body = to_sequential(tiny("llama"))
    ckpt = {f"sequential_module.{k}": v for k, v in body.state_dict().items()} | {"head.weight": torch.ones(1)}
    state = hf_state_dict(body, ckpt, prefix="sequential_module.")
    assert state.keys() == tiny("llama").state_dict().keys()
    with pytest.raises(KeyError, match="behind prefix 'model.'"):
        hf_state_dict(body, ckpt, prefix="model.")


@pytest.mark.parametrize("arch,tied", [("gpt2", True), ("llama", False), ("qwen2", True), ("bert", False)])
def test_a_body_builds_on_the_meta_device_and_loads_its_weights_there(arch, tied):
    """What per-stage loading does: build on meta, allocate (garbage), load the weights by the model's names,
    compute the buffers no state_dict holds; the body then gives the model's output."""
    model = tiny(arch, tied).eval()
    with torch.device("meta"):
        body = to_sequential(tiny(arch, tied))
    assert {p.device.type for p in body.parameters()} == {"meta"}
    assert {b.device.type for b in body.buffers()} <= {"meta"}
    body.to_empty(device="cpu")
    load_hf_state_dict(body, model.state_dict())
    init_buffers(body)
    ids, mask, _ = inputs(arch)
    with torch.no_grad():
        assert_close(body.eval()((ids, mask)), output(model, ids, mask))


def test_init_buffers_refuses_a_buffer_it_does_not_know():
    body = to_sequential(tiny("llama"))
    body[1].layer.register_buffer("table", torch.zeros(2), persistent=False)
    with pytest.raises(ValueError, match=r"does not know the buffer 'table' of 1\.layer"):
        init_buffers(body)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_a_body_pickles_as_stages_travel_to_their_processes(arch):
    body = to_sequential(tiny(arch).eval())
    ids, mask, _ = inputs(arch)
    copied = pickle.loads(pickle.dumps(body))
    with torch.no_grad():
        assert_close(copied((ids, mask)), body((ids, mask)))
    assert copied[1].hf_names == body[1].hf_names == {"block" if arch == "gpt2" else "layer":
                                                      "transformer.h.0" if arch == "gpt2" else "encoder.layer.0"}


def test_an_unsupported_model_is_refused_naming_the_supported_and_how_to_add_one():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                             intermediate_size=64, vocab_size=48))
    with pytest.raises(TypeError) as error:
        to_sequential(model)
    message = str(error.value)
    assert "GPTNeoXForCausalLM (model_type: 'gpt_neox')" in message
    assert all(name in message for name in supported_models())
    assert "register_adapter" in message and "docs/models.md" in message
    with pytest.raises(TypeError, match="not callable|must be a function"):
        register_adapter("GPTNeoXForCausalLM", "layers")  # type: ignore[arg-type]


def test_an_architecture_added_with_register_adapter(monkeypatch):
    """Qwen3 (a Llama-like decoder with norms on queries and keys) through the Llama family's adapter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_pipe.models import adapters
    from lightning_pipe.models.llama import decoder_layers

    monkeypatch.setattr(adapters, "_ADAPTERS", dict(adapters._ADAPTERS))
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         vocab_size=48)).eval()
    with pytest.raises(TypeError, match="no adapter for Qwen3ForCausalLM"):
        to_sequential(model)
    register_adapter("Qwen3ForCausalLM", decoder_layers, "Qwen3")
    ids, mask, _ = inputs("qwen2")
    with torch.no_grad():
        assert_close(to_sequential(model)((ids, mask)), output(model, ids, mask))


def test_bad_inputs_and_models_are_refused_saying_what_to_pass():
    body = to_sequential(tiny("gpt2"))
    ids, mask, _ = inputs("gpt2")
    with pytest.raises(TypeError, match=r"input_ids must be integer token ids .*float32 of shape \(6, 12, 4\)"):
        body(torch.zeros(6, 12, 4))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(input_ids: \(6, 12\), "
                                         r"attention_mask: \(6, 11\)\)"):
        body((ids, mask[:, 1:]))
    with pytest.raises(TypeError, match=r"takes input_ids or \(input_ids, attention_mask\) \(got: a tuple of 3\)"):
        body((ids, mask, mask))
    bert = to_sequential(tiny("bert")).eval()
    with torch.no_grad():  # BERT takes token types third
        types = torch.ones_like(ids)
        assert not torch.allclose(bert((ids, mask, types)), bert((ids, mask)))
    model = tiny("llama")
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match=r"activation checkpointing on, .*activation_checkpointing_disable\(\)"):
        to_sequential(model)


STRATEGY_CASES = ["hf-gpt2-gpipe-sgd", "hf-llama-1f1b-adamw", "hf-bert-sgd", "hf-qwen2-3stages-always"]
TIED_CASES = ["hf-gpt2-tied", "hf-gpt2-tied-3stages", "hf-llama-tied-3stages", "hf-gpt2-tied-pretrained",
              "hf-gpt2-tied-2replicas"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGY_CASES + TIED_CASES)
def test_pipestrategy_trains_the_models_weights_and_its_checkpoint_loads_into_the_model(name, jobs):
    """Through PipeStrategy's processes (tests/jobs.py), the body ends with the weights of the Hugging Face
    model trained on its own, and the consolidated checkpoint, named by the model's keys, loads into it.

    A head tied to its embedding across stages (a copy in the first and the last stage): the copies are equal
    after training, the file holds the parameter once under both names, and loading a changed value reaches
    every copy; training is clipped by a global norm that counts it once."""
    from jobs import config as case_config
    from scripts.hf_train import DEFAULTS, train_plain

    config = {**DEFAULTS, **case_config(name)}
    out = jobs.directory(name)
    reference = train_plain(config)
    replicas = config["devices"] // len(config["balance"])
    steps = config["epochs"] * config["samples"] // (config["batch_size"] * replicas)
    result = jobs.result(name)
    assert result["global_step"] == steps
    if config["tied"]:
        assert result["tied_gap_trained"] == [0.0] and result["tied_storages"] == 1
        assert result["tied_loaded_error"] == [0.0] and result["tied_gap_loaded"] == [0.0]
    checkpoint = torch.load(out / "final.ckpt", weights_only=True)["state_dict"]
    template = to_sequential(tiny(config["arch"], config["tied"]))
    state = hf_state_dict(template, checkpoint, prefix="sequential_module.")
    expected = reference.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-5, msg=key)
    initial = tiny(config["arch"], config["tied"], seed=config["seed"] + 100 * config["pretrained"]).state_dict()
    unchanged = [k for k in state if torch.allclose(state[k], initial[k])]
    assert all(k.endswith("key.bias") for k in unchanged), unchanged  # it trained (softmax ignores a key's bias)
    model = tiny(config["arch"], config["tied"], seed=5).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and all(k.startswith("pooler.") for k in missing)
    ids, mask, _ = inputs(config["arch"])
    with torch.no_grad():
        assert_close(output(model, ids, mask), output(reference.eval(), ids, mask))
