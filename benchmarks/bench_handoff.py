"""One hand-off between two processes: through torch's RPC (what stages use today) against torch.distributed's
point-to-point send and receive over gloo, the receive posted ahead, with and without a header carrying the
shape (a data plane for stages whose shapes change from step to step needs one).

Two processes pass a ``rows x width`` float32 tensor back and forth (ping-pong); every hand-off is one message
from one process to the other, as an activation goes from a stage to the next. RPC: ``rpc_async`` of a function
that puts the tensor in a queue, which the receiving process's thread takes from (as ``runner._send`` and the
mailbox do). Point-to-point: ``ProcessGroupGloo.send``/``recv`` with the receive already waiting. The three ways
alternate, round after round, in the same processes; printed: each one's median time per hand-off and its
ratio to RPC's.

    python benchmarks/bench_handoff.py [--rows 64] [--widths 64 1024 16384] [--rounds 5] [--handoffs 400]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from processes import free_port, run_processes

_INBOX: queue.Queue[torch.Tensor] = queue.Queue()


def _deliver(t: torch.Tensor) -> None:
    _INBOX.put(t)


def _rpc_pingpong(rank: int, t: torch.Tensor, count: int) -> float:
    peer = f"w{1 - rank}"
    start = time.perf_counter()
    for k in range(count):
        if (k % 2) == rank:
            rpc.rpc_async(peer, _deliver, args=(t,))
        else:
            t = _INBOX.get(timeout=60)
    return time.perf_counter() - start


def _p2p_pingpong(rank: int, group: Any, t: torch.Tensor, count: int, header: bool) -> float:
    """Every receive is posted before its message can arrive (a thread keeps one waiting), as a data plane with
    receives posted ahead would."""
    peer = 1 - rank
    received: queue.Queue[torch.Tensor] = queue.Queue()

    def receive() -> None:
        for _ in range(sum(1 for k in range(count) if (k % 2) != rank)):
            if header:
                shape = torch.empty(4, dtype=torch.int64)
                group.recv([shape], peer, 0).wait()
                buffer = torch.empty(tuple(int(v) for v in shape[: int(shape[3])]))
            else:
                buffer = torch.empty_like(t)
            group.recv([buffer], peer, 1).wait()
            received.put(buffer)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    start = time.perf_counter()
    for k in range(count):
        if (k % 2) == rank:
            if header:
                group.send([torch.tensor([*t.shape, *[0] * (3 - t.dim()), t.dim()])], peer, 0).wait()
            group.send([t], peer, 1).wait()
        else:
            t = received.get(timeout=60)
    elapsed = time.perf_counter() - start
    thread.join(timeout=60)
    return elapsed


def job(rank: int, world: int, port: int, rows: int, widths: list[int], rounds: int, handoffs: int,
        store_port: int) -> dict[str, dict[int, list[float]]]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60, num_worker_threads=4))
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=__import__("datetime").timedelta(60))
    group = dist.ProcessGroupGloo(store, rank, world)
    times: dict[str, dict[int, list[float]]] = {"rpc": {}, "p2p": {}, "p2p+header": {}}
    for width in widths:
        t = torch.randn(rows, width)
        for _ in range(rounds):
            for name in times:
                rpc.api._barrier([f"w{r}" for r in range(world)])
                if name == "rpc":
                    elapsed = _rpc_pingpong(rank, t, handoffs)
                else:
                    elapsed = _p2p_pingpong(rank, group, t, handoffs, header=name == "p2p+header")
                times[name].setdefault(width, []).append(elapsed / handoffs)
    rpc.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    results = run_processes(job, 2, args.rows, args.widths, args.rounds, args.handoffs, free_port(),
                            timeout=args.timeout, label="hand-offs")
    times = results[0]
    for width in args.widths:
        size = args.rows * width * 4
        rpc_median = statistics.median(times["rpc"][width])
        line = f"{args.rows} x {width} float32 ({size / 1024:.0f} KiB): rpc {rpc_median * 1e6:.0f} us"
        for name in ("p2p", "p2p+header"):
            median = statistics.median(times[name][width])
            line += f", {name} {median * 1e6:.0f} us ({median / rpc_median:.2f}x rpc)"
        print(f"RESULT {line}", flush=True)


if __name__ == "__main__":
    main()
