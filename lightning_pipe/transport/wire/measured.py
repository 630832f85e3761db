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

#: The two messages' payloads (floats): a handful of numbers, and 1 MiB (a micro-batch's activations, say; at 256 KiB
#: the difference between the two was within the noise of their medians, at times below 0).
SMALL, LARGE = 64, 256 << 10
#: Seconds the sender computes before each message, as a stage does before it hands its output on (in chunks of a
#: small matrix product, so that the message goes close to that time); the receiver waits meanwhile, as the next stage.
BUSY = 2e-3


def handoff_costs(rank: int, world: int, store: Any, repeats: int = 30, timeout: float = 60.0) -> dict[str, float]:
    """In processes ``rank`` of ``world`` that share ``store`` (each calls it): process 0 sends process 1 a message
    after each :data:`BUSY` of work over a data plane of their own (shared memory, as ``"auto"`` hands off between the
    processes of one machine, else gloo), ``repeats`` at each size after a few to warm up; each carries the time it
    was sent, and process 1 takes the time from then to its arrival (one machine's monotonic clock, which every
    process reads alike), from the sender's call to the payload in the receiver's hands, as between two stages: the
    encoding, the copies, the wake-up or not, the decoding. Process 0 returns ``handoff`` (seconds of a small
    message, the median), ``peer_memory`` (bytes each process holds per other process of its pipeline for the plane:
    shared memory's rings) and ``bandwidth`` (bytes per second of what a larger message adds); the others, nothing.

    (A ping-pong after work on both sides measured the senders' work instead: each side's last product ran up to a
    millisecond past its 2 ms, and the other waited for it, 1.2-1.5 ms "one way" where a hand-off took 0.05-0.2.)"""
    if rank > 1:
        return {}
    groups = plane_groups(store, "handoff-costs", rank, 2, timeout, shared=True)  # as "auto" makes them
    names = ["measure0", "measure1"]
    plane = DataPlane("handoff-costs", groups, rank, names, timeout, None)
    # What each process holds per other process of its pipeline for the plane: shared memory's ring each way.
    rings = 2.0 * RING_MEMORY if plane.links == "shared memory" else 0.0
    peer = names[1 - rank]
    found = {}
    work = torch.randn(64, 64)
    try:
        for floats in (SMALL, LARGE):
            payload = torch.ones(floats)
            times = []
            for k in range(repeats + 5):
                slot = Slot("handoff-costs", floats, "F", k, 1, 0)
                if rank == 0:
                    end = time.monotonic() + BUSY
                    while time.monotonic() < end:
                        work @ work
                    plane.send(peer, slot, (torch.tensor([time.monotonic()], dtype=torch.float64), payload))
                else:
                    sent, _ = plane.take(peer, slot, timeout, lambda: "a measurement")
                    times.append(time.monotonic() - sent.item())
            plane.flush()
            if rank == 1:
                found[floats] = statistics.median(times[5:])
        if rank == 1:  # what the receiver found, to the process that reports it
            plane.send(peer, Slot("handoff-costs", 0, "B", 0, 0, 1), (torch.tensor([found[SMALL], found[LARGE]]),))
        else:
            (both,) = plane.take(peer, Slot("handoff-costs", 0, "B", 0, 0, 1), timeout, lambda: "a measurement")
            found = {SMALL: both[0].item(), LARGE: both[1].item()}
        plane.flush()
    finally:
        plane.close()
    if rank != 0:
        return {}
    extra = (LARGE - SMALL) * 4
    # Where the larger message came no later than the small one (noise), its bytes over its whole time: a bound.
    beyond = found[LARGE] - found[SMALL] if found[LARGE] > found[SMALL] else found[LARGE]
    return {"handoff": found[SMALL], "bandwidth": extra / max(1e-9, beyond), "peer_memory": rings}
