"""What a hand-off costs between two of this machine's processes over the data plane, measured before a job starts
(for the planner): a small message's time one way, and the bandwidth of a larger one beyond it."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lightning_pipe.transport.wire.dataplane import DataPlane
from lightning_pipe.transport.wire.messages import Slot
from lightning_pipe.transport.wire.session import plane_groups
from lightning_pipe.transport.wire.shm import RING_MEMORY

__all__ = ["handoff_costs"]

#: The two messages' payloads: a handful of numbers, and 256 KiB (a micro-batch's activations, say).
SMALL, LARGE = 64, 64 << 10
#: Seconds each process computes before each round, as a stage does between hand-offs: a message sent and taken
#: right after work costs about twice one between idle processes here (0.18 against 0.09 ms; caches and wake-ups).
BUSY = 2e-3


def handoff_costs(rank: int, world: int, store: Any, repeats: int = 30, timeout: float = 60.0) -> dict[str, float]:
    """In processes ``rank`` of ``world`` that share ``store`` (each calls it): ping-pong between processes 0 and 1
    over a data plane of their own (shared memory, as ``"auto"`` hands off between the processes of one machine, else
    gloo), a message each way per round after :data:`BUSY` of work, ``repeats`` rounds at each size after a few to
    warm up. Process 0 returns ``handoff`` (seconds one way of a small message: encoding, the copy, the wake-up and
    decoding, as between two stages), ``peer_memory`` (bytes each process holds per other process of its pipeline
    for the plane: shared memory's rings) and ``bandwidth`` (bytes per second of what a larger
    message adds); the others, nothing."""
    if rank > 1:
        return {}
    groups = plane_groups(store, "handoff-costs", rank, 2, timeout, shared=True)  # as "auto" makes them
    names = ["measure0", "measure1"]
    plane = DataPlane("handoff-costs", groups, rank, names, timeout, None)
    # What each process holds per other process of its pipeline for the plane: shared memory's ring each way.
    rings = 2.0 * RING_MEMORY if plane.links == "shared memory" else 0.0
    peer = names[1 - rank]
    found = {}
    work = torch.randn(256, 256)
    try:
        for floats in (SMALL, LARGE):
            payload = (torch.ones(floats),)
            times = []
            for k in range(repeats + 5):
                end = time.perf_counter() + BUSY
                while time.perf_counter() < end:
                    work @ work
                tick = time.perf_counter()
                if rank == 0:
                    plane.send(peer, Slot("handoff-costs", floats, "F", k, 1, 0), payload)
                    plane.take(peer, Slot("handoff-costs", floats, "B", k, 0, 1), timeout, lambda: "a measurement")
                else:
                    plane.take(peer, Slot("handoff-costs", floats, "F", k, 1, 0), timeout, lambda: "a measurement")
                    plane.send(peer, Slot("handoff-costs", floats, "B", k, 0, 1), payload)
                plane.flush()
                times.append((time.perf_counter() - tick) / 2)
            found[floats] = statistics.median(times[5:])
    finally:
        plane.close()
    if rank != 0:
        return {}
    extra = (LARGE - SMALL) * 4
    return {"handoff": found[SMALL], "bandwidth": extra / max(1e-9, found[LARGE] - found[SMALL]),
            "peer_memory": rings}
