"""Failures surface in the caller without hanging, and partitions really run at the same time."""

import threading
import time
import traceback

import pytest
import torch
from torch import nn

from lightning_pipe import Pipe


class Boom(nn.Module):
    def __init__(self, when="forward"):
        super().__init__()
        self.when = when

    def forward(self, x):
        if self.when == "forward":
            raise ValueError("shape error in the middle")
        return _FailBackward.apply(x)


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward went wrong")


def three_stage(middle: nn.Module) -> Pipe:
    return Pipe(nn.Sequential(nn.Linear(2, 2), middle, nn.Linear(2, 2)), [1, 1, 1], chunks=4)


@pytest.mark.timeout(30)
def test_exception_in_middle_partition_forward():
    pipe = three_stage(Boom("forward"))
    with pytest.raises(ValueError, match="shape error in the middle") as info:
        pipe(torch.randn(8, 2))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "partition 1, layer 1 ('1': Boom)" in notes
    # The original traceback is kept: it reaches the line that raised, in the worker thread.
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert last.name == "forward" and 'raise ValueError("shape error in the middle")' in last.line
    # The pipe still works afterwards.
    pipe[1].when = "never"
    pipe[1].forward = lambda x: x
    assert pipe(torch.randn(8, 2)).shape == (8, 2)


@pytest.mark.timeout(30)
def test_exception_in_middle_partition_backward():
    pipe = three_stage(Boom("backward"))
    y = pipe(torch.randn(8, 2))
    with pytest.raises(ArithmeticError, match="backward went wrong"):
        y.sum().backward()


@pytest.mark.timeout(60)
def test_partitions_overlap_on_cpu():
    """Two partitions that each hold the GIL-free sleep for 50 ms per micro-batch: 8 micro-batches take
    about (8 + 1) slots when overlapped, 16 when serial."""
    active = []
    lock = threading.Lock()
    peak = [0]

    class Sleep(nn.Module):
        def forward(self, x):
            with lock:
                active.append(1)
                peak[0] = max(peak[0], len(active))
            time.sleep(0.02)
            with lock:
                active.pop()
            return x

    pipe = Pipe(nn.Sequential(Sleep(), Sleep()), [1, 1], chunks=8)
    with torch.no_grad():
        pipe(torch.zeros(8, 1))
    assert peak[0] == 2  # both partitions were inside their forward at the same moment
