"""Two processes of a pipeline over RPC whose driver never closes it before ``rpc.shutdown``: each process's exit
code, printed as JSON (``python unclosed.py DATA_PLANE``)."""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn

# Imported before RPC starts: a request from the other process would otherwise import them on RPC's thread while
# this one is halfway through (a partially initialized module).
from lightning_pipe.engine import run_pipeline
from lightning_pipe.transport import pipeline_over_rpc


def main(rank: int, port: int, data_plane: str) -> None:
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30, _transports=["uv"]))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipeline = pipeline_over_rpc("unclosed", module, [2, 1], ["w0", "w1"], data_plane=data_plane, timeout=30)
    if pipeline is not None:
        run_pipeline(pipeline, torch.randn(8, 4), chunks=2, checkpoint="never", training=True,
                     parameters=module.parameters()).sum().backward()
    rpc.shutdown()  # (no pipeline.close() first)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=main, args=(rank, port, sys.argv[1])) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, 9)  # (ours, by its pid)
    print(json.dumps(codes))
