"""Running a benchmark job in several local processes, bounded in time, leaving none behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(job: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple[Any, ...],
           release: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put((rank, "ok", job(rank, world, port, *args)))
        # Rank 0 hosts the store that the others' RPC shutdown may still read as it ends: no process leaves before
        # the parent has every result.
        release.wait(60.0)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def run_processes(job: Callable[..., Any], world: int, *args: Any, timeout: float, label: str = "job"
                  ) -> dict[int, Any]:
    """Run ``job(rank, world, port, *args)`` in ``world`` spawned processes (``port``: free, for their
    rendezvous on 127.0.0.1); return results by rank. Every process is ended, by its pid, before this
    returns, whatever happened."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    release = ctx.Event()  # set once every result is in (or the run has failed): the processes may end
    procs = [ctx.Process(target=_entry, args=(job, r, world, port, results, args, release), daemon=True)
             for r in range(world)]
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(out) + len(errors) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{label}: processes did not finish within {timeout:.0f} s (finished: "
                                   f"{sorted(out)})" + ("\n" + "\n".join(errors) if errors else ""))
            try:
                rank, status, value = results.get(timeout=min(1.0, remaining))
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if gone or errors:  # the others may be stuck on the failed one: wait a little, not forever
                    deadline = min(deadline, time.monotonic() + 5)
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{label}: a benchmark process failed:\n" + "\n".join(errors))
        return out
    finally:
        release.set()
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join(timeout=5)
        results.close()
        results.cancel_join_thread()
