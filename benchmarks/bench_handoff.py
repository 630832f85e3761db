"""One hand-off between two processes of one machine: by torch's RPC into the mailbox (``data_plane="rpc"``), by
the data plane over gloo (``"p2p"``: one message into a receive posted ahead, taken by the thread that needs it) and
by the data plane through shared memory (``"auto"``: a ring each way, a FIFO to wake the reader), per tensor size:
what each way costs, and where ``"auto"`` switches to RPC.

Two processes pass a ``rows x width`` float32 tensor back and forth (ping-pong), each hand-off one message from
one process to the other, as an activation goes from a stage to the next, with its slot, flags and shape (the
receiver knows nothing of it beforehand). RPC: ``rpc_async`` of the function that puts it in the mailbox, over
TensorPipe's TCP transport (``uv``, what ``PipeStrategy`` uses), taken from the mailbox by the receiving thread
(what ``StageRunner`` does over RPC). The data plane: ``DataPlane.send`` and ``DataPlane.take``, over gloo groups
or over shared memory. The three ways alternate, round after round, in the same processes; printed: each one's
median time per hand-off and the ratios.

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

from lightning_pipe.transport.wire.dataplane import DataPlane
from lightning_pipe.transport.wire.messages import MAILBOX, Slot, deliver_to_mailbox
from lightning_pipe.transport.wire.session import plane_groups


def _payload(t: torch.Tensor) -> Any:
    return [t], [False], True  # what a stage hands on: its tensors, which need a gradient back, atomic


def _pingpong(rank: int, way: str, plane: DataPlane | None, t: torch.Tensor, count: int, run: int) -> float:
    peer = f"w{1 - rank}"
    start = time.perf_counter()
    for k in range(count):
        slot = Slot("bench", run, "F", k, 1 - rank if (k % 2) == rank else rank, 0)
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
    if plane is not None:
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
    planes = {way: DataPlane(f"bench-{way}", plane_groups(store, f"bench-{way}", rank, world, 60.0, way == "shm"),
                             rank, ["w0", "w1"], 60.0, None) for way in ("gloo", "shm")}
    assert planes["shm"].links == "shared memory" and planes["gloo"].links == "gloo", "no shared memory here"
    times: dict[str, dict[int, list[float]]] = {"rpc": {}, "gloo": {}, "shm": {}}
    run = 0
    for width in widths:
        t = torch.randn(rows, width)
        for _ in range(rounds):
            for way in times:
                if way in planes and rows * width * 4 + 256 > (planes[way].max_bytes or 1 << 62):
                    continue  # over what a ring takes: the plane sends it by RPC
                rpc.api._barrier([f"w{r}" for r in range(world)])
                run += 1
                elapsed = _pingpong(rank, way, planes.get(way), t, handoffs, run)
                times[way].setdefault(width, []).append(elapsed / handoffs)
    for plane in planes.values():
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
        rpc_, gloo = (statistics.median(times[way][width]) for way in ("rpc", "gloo"))
        line = f"RESULT {args.rows} x {width} float32 ({size / 1024:.0f} KiB): rpc {rpc_ * 1e6:.0f} us, " \
               f"gloo {gloo * 1e6:.0f} us ({gloo / rpc_:.2f}x rpc), shared memory "
        if width in times["shm"]:
            shm = statistics.median(times["shm"][width])
            line += f"{shm * 1e6:.0f} us ({shm / rpc_:.2f}x rpc, {shm / gloo:.2f}x gloo)"
        else:
            line += "over its ring (the plane sends it by RPC)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
