"""Micro-batches: checking, scattering and gathering."""

import pytest
import torch

from lightning_pipe.engine.microbatch import Batch, gather, scatter


def test_scatter_gather_roundtrip_tensor():
    x = torch.arange(20.0).view(10, 2)
    mbs = scatter(Batch.of(x, "input"), 4)
    assert [mb.value.size(0) for mb in mbs] == [3, 3, 2, 2]
    assert torch.equal(gather(mbs).value, x)
    assert gather(mbs).atomic


def test_scatter_fewer_when_batch_small():
    mbs = scatter(Batch.of(torch.zeros(3, 1), "input"), 8)
    assert len(mbs) == 3


def test_tuple_roundtrip():
    a, b = torch.randn(6, 3), torch.randn(6)
    mbs = scatter(Batch.of((a, b), "input"), 3)
    assert all(isinstance(mb.value, tuple) and len(mb.value) == 2 for mb in mbs)
    out = gather(mbs).value
    assert torch.equal(out[0], a) and torch.equal(out[1], b)


def test_tuple_batch_sizes_disagree():
    with pytest.raises(ValueError, match=r"dim 0 sizes: \[4, 5\]"):
        scatter(Batch.of((torch.zeros(4), torch.zeros(5)), "input"), 2)


def test_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        scatter(Batch.of(torch.zeros(0, 3), "input"), 2)


def test_scalar_has_no_batch_dim():
    with pytest.raises(ValueError, match="0-dim"):
        scatter(Batch.of(torch.tensor(1.0), "input"), 2)


def test_non_tensor():
    with pytest.raises(TypeError, match=r"non-tensor elements: 1: int"):
        Batch.of((torch.zeros(1), 3), "input")
    with pytest.raises(TypeError, match=r"got: str"):
        Batch.of("x", "input")
