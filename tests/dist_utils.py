"""Running a function in several local processes, bounded in time, leaving none behind."""

from __future__ import annotations

import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import warm

_GIVEN: set[int] = set()  # the ports free_port gave this process


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``bind(0)`` and outgoing connections draw from it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for processes about to listen on it. Not from the ephemeral range, where
    the kernel hands a port ``bind(0)`` gave back to the next ``bind(0)`` or outgoing connection before the caller
    listens on it (two calls in a row returned the same port: a test's gloo group then met its RPC store there,
    EADDRINUSE); below it, in this test worker's share (``pytest -n``), never one given before in this process."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % workers
    share = (high - low) // workers
    start = low + worker * share
    pick = random.SystemRandom()
    for _ in range(500):
        port = pick.randrange(start, start + share)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {start}..{start + share - 1} after 500 tries")


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple[Any, ...],
           rpc_timeout: float, env: dict[str, str], release: Any) -> None:
    import torch.distributed.rpc as rpc

    os.environ.clear()  # the caller's environment, not the fork server's
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=rpc_timeout, num_worker_threads=16,
                         _transports=["uv"]))
        value = fn(rank, world, *args)
        rpc.shutdown()
        results.put((rank, "ok", value))
        # Rank 0 hosts the store that every process's shutdown still reads from as it ends: no process leaves before
        # the parent has every result (rank 0 leaving first reset the others' connections: a failed test).
        release.wait(rpc_timeout)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def run_processes(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
                  rpc_timeout: float = 30.0) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by RPC; return results by rank. They
    start from the fork server of :mod:`warm` (torch imported once), with this process's environment.

    Raises the first child's traceback as an AssertionError; every process is ended (by its pid) when
    this returns, whatever happened.
    """
    ctx = warm.context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    release = ctx.Event()  # set once every result is in (or the run has failed): the processes may end
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args, rpc_timeout, env, release),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if errors and (time.monotonic() > deadline or not any(p.is_alive() for p in procs)):
                    break  # the others are stuck on the failed one: report the failure
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if dead and not errors and results.empty():
                    raise AssertionError(f"processes {dead} exited without a result (exit codes: "
                                         f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"processes did not finish within {timeout:.0f} s "
                                         f"(finished: {sorted(out)})") from None
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + 5)  # the others should follow soon
        if errors:
            raise AssertionError("\n".join(errors))
        return out
    finally:
        release.set()
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()) if not errors else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
