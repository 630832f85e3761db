"""One hand-off between two processes: by torch's RPC into the mailbox (``data_plane="rpc"``) against the
point-to-point data plane (``lightning_pipe.transport.wire.dataplane``: one gloo message into a receive posted ahead,
taken by the thread that needs it), per tensor size: where ``data_plane="auto"`` switches from one to the other.

Two processes pass a ``rows x width`` float32 tensor back and forth (ping-pong), each hand-off one message from
one process to the other, as an activation goes from a stage to the next, with its slot, flags and shape (the
receiver knows nothing of it beforehand). RPC: ``rpc_async`` of the function that puts it in the mailbox, over
TensorPipe's TCP transport (``uv``, what ``PipeStrategy`` uses), taken from the mailbox by the receiving thread
(what ``StageRunner`` does over RPC). Point-to-point: ``DataPlane.send`` and ``DataPlane.take``. The two ways
alternate, round after round, in the same processes; printed: each one's median time per hand-off and the
ratio.

    python benchmarks/bench_handoff.py [--rows 64] [--widths 64 1024 4096 16384] [--rounds 5] [--handoffs 300]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from processes import free_port, run_processes

from lightning_pipe.transport.stages.rendezvous import _groups
from lightning_pipe.transport.wire.dataplane import DataPlane
from lightning_pipe.transport.wire.messages import MAILBOX, deliver_to_mailbox


def _payload(t: torch.Tensor) -> Any:
    return [t], [False], True  # what a stage hands on: its tensors, which need a gradient back, atomic


def _pingpong(rank: int, way: str, plane: DataPlane, t: torch.Tensor, count: int, run: int) -> float:
    peer = f"w{1 - rank}"
    start = time.perf_counter()
    for k in range(count):
        slot = ("bench", run, "F", k, 1 - rank if (k % 2) == rank else rank, 0)
        if (k % 2) == rank:
            if way == "rpc":
                rpc.rpc_async(peer, deliver_to_mailbox, args=(slot, _payload(t)), timeout=60)
            else:
                plane.send(peer, slot, _payload(t))
        else:
            if way == "rpc":
                tensors, _, _ = MAILBOX.take(slot, 60, lambda: "the other process")
            else:
                tensors, _, _ = plane.take(peer, slot, 60, lambda: "the other process")
            t = tensors[0]
    elapsed = time.perf_counter() - start
    plane.flush()
    return elapsed


def job(rank: int, world: int, port: int, rows: int, widths: list[int], rounds: int, handoffs: int,
        store_port: int) -> dict[str, dict[int, list[float]]]:
    warnings.filterwarnings("ignore", message="You are using a Backend")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60, num_worker_threads=16,
                                                                     _transports=["uv"]))
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    plane = DataPlane("bench", _groups(store, "bench", rank, world, 60.0), rank, ["w0", "w1"], 60.0, None)
    times: dict[str, dict[int, list[float]]] = {"rpc": {}, "p2p": {}}
    run = 0
    for width in widths:
        t = torch.randn(rows, width)
        for _ in range(rounds):
            for way in times:
                rpc.api._barrier([f"w{r}" for r in range(world)])
                run += 1
                times[way].setdefault(width, []).append(_pingpong(rank, way, plane, t, handoffs, run) / handoffs)
    plane.close()
    rpc.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    results = run_processes(job, 2, args.rows, args.widths, args.rounds, args.handoffs, free_port(),
                            timeout=args.timeout, label="hand-offs")
    times = results[0]
    for width in args.widths:
        size = args.rows * width * 4
        rpc_median = statistics.median(times["rpc"][width])
        p2p_median = statistics.median(times["p2p"][width])
        print(f"RESULT {args.rows} x {width} float32 ({size / 1024:.0f} KiB): rpc {rpc_median * 1e6:.0f} us, "
              f"point-to-point {p2p_median * 1e6:.0f} us ({p2p_median / rpc_median:.2f}x rpc)", flush=True)


if __name__ == "__main__":
    main()
