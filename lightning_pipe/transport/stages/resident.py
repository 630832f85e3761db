"""What a stage's process holds: its resident memory (now, at its peak since it joined its session, and as it joined)
and the pipeline's bookkeeping between steps."""

from __future__ import annotations

import os

import torch

from lightning_pipe.transport.stages.runner import StageRunner
from lightning_pipe.transport.wire.messages import MAILBOX

__all__ = ["BASE", "DEVICE_BASE", "process_memory", "remember_base"]

#: This process's resident memory as it joined its session, before any stage (see :func:`remember_base`).
BASE = [0]
#: What this process had allocated on its GPUs as it joined its session (0 where it had used none).
DEVICE_BASE = [0]


def _device_memory() -> tuple[int, int]:
    """What this process has allocated on every GPU it has used, in bytes: now, and at its peak since the counts
    were last reset (torch's caching allocator; ``(0, 0)`` where it has used none)."""
    if not torch.cuda.is_initialized():
        return 0, 0
    gpus = range(torch.cuda.device_count())
    return (sum(torch.cuda.memory_allocated(i) for i in gpus), sum(torch.cuda.max_memory_allocated(i) for i in gpus))


def _resident() -> int:
    """This process's resident memory now, in bytes (Linux's ``statm``; raises ``OSError`` elsewhere)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """The most resident memory this process has held, in bytes (Linux's ``VmHWM``; raises ``OSError`` elsewhere)."""
    with open("/proc/self/status") as f:
        found = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
    if found is None:
        raise OSError("no VmHWM in /proc/self/status")
    return found


def remember_base() -> None:
    """Note this process's resident memory now (as it joins its session): ``process_memory``'s ``base``; its peak is
    counted from here on (Linux's high-water mark reset), so that what the process did before (a planner's
    measurements, a model built whole and dropped) is not taken for what its stages hold. Where the mark cannot be
    reset, the base is the peak so far: what the stages add above it. The same for its GPUs (the allocator's peak
    reset), where it has used them already."""
    if torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
        DEVICE_BASE[0] = _device_memory()[0]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        BASE[0] = _resident()
    except OSError:  # not Linux, or not allowed
        try:
            BASE[0] = _peak()
        except OSError:
            pass


def process_memory(runner: StageRunner, hosted: int) -> dict[str, int]:
    """Resident memory of this process (bytes: ``rss`` now, ``peak`` the most it has held since it joined its session,
    Linux's ``VmHWM``, ``base`` what it held as it joined; ``device``, ``device_peak`` and ``device_base`` the same
    of what it allocated on its GPUs) and the pipeline's bookkeeping for ``runner``'s stages:
    saved micro-batches, undelivered messages, outputs held for the driver, per-step seeds and gradients set
    aside for a step's commit (all 0 between steps), and ``hosted``: how many remote stages this process hosts (of
    every pipeline still in use)."""
    rss = peak = 0
    try:
        rss, peak = _resident(), _peak()
    except OSError:  # not Linux: the bookkeeping alone
        pass
    stages = runner.stages.values()
    device, device_peak = _device_memory()
    kept = runner.bookkeeping()
    return {"rss": rss, "peak": peak, "base": BASE[0], "device": device, "device_peak": device_peak,
            "device_base": DEVICE_BASE[0], "saved": kept["saved"],
            "mailbox": MAILBOX.pending() + kept["held"], "seeds": kept["seeds"],
            "aside": sum(st.aside.pending() for st in stages), "stages": hosted}
