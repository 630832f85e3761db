"""Building on the meta device and materialising piece by piece gives, bit for bit, what the plain build gives."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from lightning_pipe import deferred_init
from lightning_pipe.engine.deferred import materialize, named_tensors, recording_of


class Initialised(nn.Module):
    """Everything a build does to its tensors: torch.nn.init's initialisers (those that skip meta tensors too),
    direct random ops, a generator of its own, constants, buffers computed from others, in-place edits."""

    def __init__(self) -> None:
        super().__init__()
        self.truncated = nn.Parameter(torch.empty(16, 8))
        nn.init.trunc_normal_(self.truncated, std=0.5, a=-0.6, b=0.6)  # rejection sampling: data-dependent draws
        self.orthogonal = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.orthogonal)
        self.dirac = nn.Parameter(torch.empty(3, 3, 3))
        nn.init.dirac_(self.dirac)
        self.sparse = nn.Parameter(torch.empty(8, 5))
        nn.init.sparse_(self.sparse, 0.5)
        self.embedding = nn.Embedding(20, 8)
        self.embedding.weight.data.normal_(0, 0.02).mul_(2)
        self.own_generator = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(5)))
        self.register_buffer("positions", torch.arange(10).float() / 3)
        self.register_buffer("constant", torch.tensor([1.5, 2.5]))
        self.register_buffer("rotary", torch.outer(self.positions, self.constant).cos(), persistent=False)
        self.scale = torch.tensor(0.5)  # a plain attribute
        self.table = {"bias": torch.zeros(2)}


def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Conv1d(4, 4, 3), Initialised(),
                         nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), nn.Linear(16, 4).half())


def everything(module: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(module.state_dict())
    state.update({f"{name}.rotary": m.rotary for name, m in module.named_modules() if isinstance(m, Initialised)})
    state.update({f"{name}.scale": m.scale for name, m in module.named_modules() if isinstance(m, Initialised)})
    return state


def test_every_layer_materialised_alone_equals_the_plain_build_and_the_generator_goes_on_the_same():
    torch.manual_seed(0)
    plain = build()
    after_plain = torch.rand(4)
    torch.manual_seed(0)
    with deferred_init() as recording:
        deferred = build()
    assert torch.equal(torch.rand(4), after_plain)  # the build drew what the plain build draws
    assert all(t.is_meta for t in named_tensors(deferred).values())
    for i, layer in enumerate(deferred):  # each layer materialised on its own, from the steps it needs only
        program = recording.program(named_tensors(layer))
        assert len(program.steps) < len(recording.steps)
        materialize(layer, program.run())
        expected, actual = everything(plain[i]), everything(layer)
        assert expected.keys() == actual.keys()
        for name in expected:
            assert actual[name].dtype == expected[name].dtype and torch.equal(actual[name], expected[name]), (i, name)
    assert isinstance(deferred[3].truncated, nn.Parameter) and deferred[5].weight.dtype == torch.float16
    assert deferred[3].table["bias"].device.type == "cpu"


def test_a_program_travels_pickled_and_runs_in_a_process_where_nothing_was_recorded(tmp_path):
    torch.manual_seed(1)
    plain = build()
    torch.manual_seed(1)
    with deferred_init() as recording:
        deferred = build()
    layer = deferred[4]
    blob = pickle.dumps((layer, recording.program(named_tensors(layer))))
    recording.release()  # the recording is gone here: the program alone makes the layer
    assert recording_of(next(layer.parameters())) is None
    copy, program = pickle.loads(blob)
    materialize(copy, program.run())
    for name, value in plain[4].state_dict().items():
        assert torch.equal(copy.state_dict()[name], value), name


def test_shared_parameters_stay_shared_and_views_stay_views():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embedding.weight
            self.register_buffer("row", self.embedding.weight.detach()[1], persistent=False)  # a view

    torch.manual_seed(2)
    plain = Tied()
    torch.manual_seed(2)
    with deferred_init() as recording:
        tied = Tied()
    materialize(tied, recording.program(named_tensors(tied)).run())
    assert tied.head.weight is tied.embedding.weight and torch.equal(tied.embedding.weight, plain.embedding.weight)
    assert tied.row.untyped_storage().data_ptr() == tied.embedding.weight.untyped_storage().data_ptr()
    assert torch.equal(tied.row, plain.embedding.weight[1])


def test_a_stage_materialised_layer_by_layer_holds_nothing_of_the_layers_after_and_gets_the_plain_values():
    """``materialize_layers``: each layer's tensors are real when its turn comes and the layers after it are still
    meta; layers sharing a tensor (a head tied to an embedding two layers before) come together, at the first's
    place; a layer without tensors has its turn too; the values are the plain build's, ties kept."""
    from lightning_pipe.engine.materialize import layer_groups, materialize_layers

    def stage() -> nn.Sequential:
        layers = build()
        layers.append(nn.Linear(16, 8, bias=False))
        layers[-1].weight = layers[0].weight  # layer 6 shares layer 0's weight
        layers.append(nn.Tanh())  # nothing to make: its turn comes all the same
        return layers

    torch.manual_seed(3)
    plain = stage()
    torch.manual_seed(3)
    with deferred_init() as recording:
        deferred = stage()
    program = recording.program(named_tensors(deferred))
    assert [children for children, _ in layer_groups(deferred, program)] == \
        [["0", "6"], ["1"], ["2"], ["3"], ["4"], ["5"], ["7"]]
    seen = []

    def each(children: list[str]) -> None:
        real = [name for name, layer in deferred.named_children()
                if any(not t.is_meta for t in named_tensors(layer).values())]
        seen.append((children, real))

    materialize_layers(deferred, program, each)
    assert seen == [(["0", "6"], ["0", "6"]), (["1"], ["0", "1", "6"]), (["2"], ["0", "1", "2", "6"]),
                    (["3"], ["0", "1", "2", "3", "6"]), (["4"], ["0", "1", "2", "3", "4", "6"]),
                    (["5"], ["0", "1", "2", "3", "4", "5", "6"]), (["7"], ["0", "1", "2", "3", "4", "5", "6"])]
    assert deferred[6].weight is deferred[0].weight
    expected, actual = everything(plain), everything(deferred)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_empty_init_skips_the_initialisers_and_draws_nothing_as_lightning_promises():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with deferred_init(skip_initialisers=True) as recording:
        layer = nn.Linear(4, 4)
        nn.init.trunc_normal_(layer.weight)
        nn.init.orthogonal_(layer.weight)
    assert torch.equal(torch.get_rng_state(), before)
    materialize(layer, recording.program(named_tensors(layer)).run())
    assert layer.weight.shape == (4, 4) and not layer.weight.is_meta


def test_a_tensor_nothing_initialised_is_refused_by_name():
    from torch.nn.init import orthogonal_  # bound before the build: skips meta tensors unseen

    with deferred_init() as recording:
        p = nn.Parameter(torch.empty(4, 4))
        orthogonal_(p)
    with pytest.raises(RuntimeError, match=r"^weight were created and never initialised .*orthogonal_"):
        recording.program({"weight": p})


def test_modules_converted_after_the_build_are_recorded_too():
    from lightning_pipe.engine.batchnorm import DeferredBatchNorm

    torch.manual_seed(4)
    plain = DeferredBatchNorm.convert(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))).double()
    torch.manual_seed(4)
    with deferred_init() as recording:
        body = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with recording.resume():
        body = DeferredBatchNorm.convert(body).double()
    materialize(body, recording.program(named_tensors(body)).run())
    assert body[0].weight.dtype == torch.float64
    for name, value in plain.state_dict().items():
        assert body.state_dict()[name].dtype == value.dtype and torch.equal(body.state_dict()[name], value), name


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "bert"])
def test_hugging_face_models_built_on_meta_initialise_as_the_plain_build(architecture):
    """Hugging Face models skip their initialisation on the meta device; recorded, they run it, as built plainly."""
    transformers = pytest.importorskip("transformers")
    configs = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, tie_word_embeddings=True)),
        "bert": lambda: transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100)),
    }
    torch.manual_seed(5)
    plain = configs[architecture]()
    torch.manual_seed(5)
    with deferred_init() as recording:
        model = configs[architecture]()
    materialize(model, recording.program(named_tensors(model)).run())
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    if architecture != "bert":  # tied embedding and head: still one parameter
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_guarded_layer_of_the_strategy_tests_raises_when_materialised_in_another_process(monkeypatch):
    """The multi-process tests prove per-stage materialisation with a layer that raises in any process but its
    own (tests/scripts/train.py): built for real in process 0, a layer of process 1 does raise."""
    from scripts import train as script

    monkeypatch.setitem(os.environ, "LP_GUARD_PROCESSES", "2")
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "0")
    script.Guarded(4, 0)
    with pytest.raises(RuntimeError, match="a layer of pipeline process 1 was materialised in process 0"):
        script.Guarded(4, 1)
