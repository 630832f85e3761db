"""Pretrained weights read per stage (lightning_pipe.models.weights): each stage's materialisation reads its own
tensors alone, from model.safetensors, its shards, or a torch file, and the body then equals the model saved.

Checkpoints are tiny models saved here with ``save_pretrained`` (offline). Reads are counted by wrapping
``PretrainedFiles.read_parts``, through which every tensor is read.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from scripts.hf_train import batches, output, tiny  # noqa: E402

from lightning_pipe.engine.deferred import materialize, named_tensors, recording_of  # noqa: E402
from lightning_pipe.engine.partition import split_module  # noqa: E402
from lightning_pipe.models import (  # noqa: E402
    PretrainedFiles,
    hf_key_map,
    materialize_body,
    pretrained_body,
)

EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
FORMATS = {"safetensors": {}, "shards": {"max_shard_size": "20KB"}, "torch": {"safe_serialization": False}}


def saved(arch: str, tied: bool, tmp_path, fmt: str = "safetensors") -> torch.nn.Module:
    model = tiny(arch, tied, seed=11).eval()
    model.save_pretrained(tmp_path, **FORMATS[fmt])
    return model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_part_of_an_entry_is_read_as_the_whole_entry_sliced(fmt, tmp_path):
    """What a process holding a shard of a layer reads (rows or columns of a tensor split over tensor ranks):
    the same values as the whole entry, sliced; a part asked for under two keys is read once."""
    model = saved("llama", False, tmp_path, fmt)
    files = PretrainedFiles(tmp_path)
    state = model.state_dict()
    name, bias = "model.layers.1.mlp.up_proj.weight", "model.norm.weight"
    rows, columns = (slice(16, 48), slice(0, None)), (slice(0, None), slice(8, 16))
    got = files.read_parts({"rows": (name, rows), "columns": (name, columns), "again": (name, rows),
                            "whole": (bias, None)})
    assert torch.equal(got["rows"], state[name][rows]) and got["rows"].shape == (32, state[name].shape[1])
    assert torch.equal(got["columns"], state[name][columns]) and torch.equal(got["whole"], state[bias])
    assert got["again"] is got["rows"]
    assert files.read([bias])[bias].shape == state[bias].shape


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch,tied,balance", [("gpt2", True, [3, 3]), ("llama", False, [2, 2, 2]),
                                               ("bert", False, [2, 4])])
def test_each_stage_reads_its_own_tensors_alone(arch, tied, balance, fmt, tmp_path, reads):
    model = saved(arch, tied, tmp_path, fmt)
    if fmt == "shards":
        assert (tmp_path / "model.safetensors.index.json").exists()
    body = pretrained_body(tmp_path)
    assert reads == [] and all(t.is_meta for t in body.state_dict(keep_vars=True).values())
    mapping = hf_key_map(body)
    file_keys = set(PretrainedFiles(tmp_path).names())
    parts = split_module(body, balance)
    start = 0
    for part in parts:  # in the order a pipeline's processes would, each materialising its own part
        reads.clear()
        tensors = named_tensors(part)
        program = recording_of(next(iter(tensors.values()))).program({k: t for k, t in tensors.items() if t.is_meta})
        materialize(part, program.run())
        layers = {str(i) for i in range(start, start + len(part))}
        own = {hf for key, hf in mapping.items() if key.split(".", 1)[0] in layers}
        # A tied head the file holds once (under the embedding's name) is read under that name.
        expected = {k if k in file_keys else EMBEDDING[arch] for k in own}
        assert set(reads) == expected, (sorted(reads), sorted(expected))
        assert len(reads) == len(set(reads))
        later = [t for i, layer in enumerate(body) if i >= start + len(part) for t in layer.parameters()]
        assert all(t.is_meta for t in later)  # the stages after it: nothing read, nothing allocated
        start += len(part)
    ids, mask, _ = batches(arch, 6)[:]
    with torch.no_grad():
        torch.testing.assert_close(body.eval()((ids, mask)), output(model, ids, mask), rtol=0, atol=0)


def test_a_missing_entry_or_checkpoint_is_named(tmp_path):
    model = saved("llama", False, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights in .*model.safetensors"):
        pretrained_body(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp" not in k}
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(KeyError, match=r"lacks entries of the body .*model.layers.1.mlp"):
        pretrained_body(tmp_path)


def test_materialize_body_in_one_process_equals_the_model(tmp_path, reads):
    model = saved("qwen2", True, tmp_path)
    body = materialize_body(pretrained_body(tmp_path))
    names = PretrainedFiles(tmp_path).names()
    assert set(reads) == names and len(reads) == len(names) + 1  # the tied embedding read by the head too
    ids, mask, _ = batches("qwen2", 6)[:]
    with torch.no_grad():
        torch.testing.assert_close(body.eval()((ids, mask)), output(model, ids, mask), rtol=0, atol=0)
